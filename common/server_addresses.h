#pragma once

// The address of a ParameterServer as the clients give it (docs/design.md §10.1): one host:port, or
// the members of a replicated group separated by commas ("10.0.0.1:7070,10.0.0.2:7070"). Only
// the group's leader listens on the workers' port (the standbys refuse connections), so a
// client follows the leader with one gRPC channel over every member's address and the
// pick_first policy: gRPC connects to the first address that accepts and, when that connection
// breaks, tries the list again in order.
//
// Hostnames in a list are resolved once, when the channel's target is made (ChannelTarget): a
// member that later moves to another IP address is not followed. A DNS name that resolves to
// every member (e.g. a Kubernetes headless service, "dns:///rebound.ns.svc:7070") can be given
// instead as the single address; gRPC then re-resolves it itself.
//
// Thread-safety: every function here may be called from any thread.

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace grpc {
class ChannelArguments;
}  // namespace grpc

namespace rebound {

// OK iff `address` is "host:port" with a non-empty host and a port that is a number in
// [0, 65535]; INVALID_ARGUMENT otherwise, naming `field` (when not empty) and the address:
//   --listen must be host:port with a port in [0, 65535], got "7070"
absl::Status ValidateHostPort(const std::string& address, const std::string& field);

// The entries of `list`, comma-separated host:port addresses, with the white space around each
// removed. One entry (no comma) is checked exactly as ValidateHostPort, port 0 included. In a
// list of two or more each entry must also name a member: INVALID_ARGUMENT naming `field` (when
// not empty) and the entry for an empty entry, one that fails ValidateHostPort, port 0, a gRPC
// target URI ("dns:///..." is for a single address) or an entry given twice.
absl::StatusOr<std::vector<std::string>> ParseServerAddresses(const std::string& list,
                                                              const std::string& field);

// The gRPC target for a channel to `list`. One address (no comma): `list` itself, unchanged.
// Several: every host resolved now (getaddrinfo; numeric addresses stand for themselves) and
// joined in the list's order into "ipv4:A:P,B:P,..." when every host has an IPv4 address (a host
// with both families gives its IPv4 ones), else "ipv6:[A]:P,..." (an IPv4-only host then as its
// IPv4-mapped IPv6 address). A host's several addresses are all kept; repeats are dropped.
// INVALID_ARGUMENT as ParseServerAddresses; UNAVAILABLE naming the host (and the resolver's
// reason) for a host that resolves to nothing, which may be a passing DNS failure.
absl::StatusOr<std::string> ChannelTarget(const std::string& list);

// Sets on `args` what a channel to a replicated group needs, replacing the values `args` had for
// the same keys (gRPC would use the first value given), and keeps its other settings:
//  * the pick_first load-balancing policy (the first member that accepts, in the list's order);
//  * reconnect backoff from 100 ms up to 1 s, so a new leader is tried within a second;
//  * a minimum connect timeout of 1 s (GRPC_ARG_MIN_RECONNECT_BACKOFF_MS): a member that accepts
//    TCP but never answers (e.g. SIGSTOPped) costs at most about 1 s before the next address;
//  * keepalive pings every 1 s, also without calls and without limit, each to be answered within
//    1 s: the connection to a leader that hangs is found dead in about 2 s and the list is tried
//    again.
// The group's servers must permit pings this frequent without calls (the server side of
// docs/design.md §10.1, not set here: GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS 1 and
// GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS below 1000, e.g. 500); a server that
// does not answers them with GOAWAY "too_many_pings", which drops the connection.
// REQUIRES: `args` is not null.
void AddFailoverChannelArgs(grpc::ChannelArguments* args);

}  // namespace rebound
