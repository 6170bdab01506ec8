#pragma once

// Transport security and authentication (docs/operations.md#security), from a SecurityConfig:
//  * TLS: the server presents cert_file/key_file; with require_client_cert it asks every client
//    for a certificate signed by ca_file (mutual TLS). Clients verify the server against ca_file
//    (the system roots when empty) and present their own cert_file/key_file when given.
//  * A bearer token: the first line of token_file. Clients send "authorization: Bearer <token>"
//    on every call; the server answers UNAUTHENTICATED to a call without it or with another
//    token, on the call's headers (before its body is read). gRPC's health service is not
//    checked, so probes work without the token (over TLS when TLS is on); reflection is;
//    /metrics is separate plain HTTP, bound to 127.0.0.1 by default.
// Every worker of a job uses the same block: with a certificate in it, a worker's WorkerPeer
// service serves TLS too, and spares connect to each other with the same credentials and token.

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "proto/config.pb.h"

namespace rebound {

// Worker credentials (docs/operations.md#security): the server gives every registration a secret
// (RegisterResponse.credential); the worker sends it as metadata kWorkerCredentialKey on every call
// that acts as that worker. Operator calls that change the job (Drain) carry the operator token
// as metadata kOperatorTokenKey.
inline constexpr char kWorkerCredentialKey[] = "rebound-worker-credential";
inline constexpr char kOperatorTokenKey[] = "rebound-operator-token";

// A fresh worker credential: 256 bits from the kernel's CSPRNG (getrandom), as 64 hex digits.
// INTERNAL if the kernel gives no random bytes.
absl::StatusOr<std::string> NewWorkerCredential();

// a == b, in time that depends only on the lengths (for secrets).
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// The value of metadata `key` of the call (the first one), empty if absent or if `context` is null.
std::string MetadataValue(const grpc::ServerContextBase* context, absl::string_view key);

// True iff the call's peer is on this host (loopback or a Unix socket).
bool FromLoopback(const grpc::ServerContextBase* context);

// The credential a worker process currently holds, shared by the channel that sends it and the
// code that learns it (Register). Thread-safe.
class WorkerCredential {
 public:
  void Set(std::string credential) {
    absl::MutexLock lock(&mu_);
    credential_ = std::move(credential);
  }
  std::string Get() const {
    absl::MutexLock lock(&mu_);
    return credential_;
  }

 private:
  mutable absl::Mutex mu_;
  std::string credential_ ABSL_GUARDED_BY(mu_);
};

// The token: the first line of `path`, without surrounding white space. INVALID_ARGUMENT if
// empty, UNAVAILABLE if unreadable.
absl::StatusOr<std::string> ReadBearerToken(const std::string& path);

// TLS (or insecure) server credentials for `security`. With a token file they also check the
// token on each call's initial metadata, before its message is received (gRPC core's auth
// metadata processor): a call without it is refused UNAUTHENTICATED unless it is to
// grpc.health.v1.Health, and costs no memory of its size. INVALID_ARGUMENT naming an
// unreadable file; UNAVAILABLE/INVALID_ARGUMENT as ReadBearerToken for the token file.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const SecurityConfig& security);

// True iff `security` makes this endpoint serve TLS (a certificate and key are configured).
bool ServesTls(const SecurityConfig& security);

// A channel to `address` with `security`'s credentials; with a token file, every call carries
// the token; with `worker`, every call carries the worker credential it holds at the call's start
// (none while it is empty). `args` as for grpc::CreateCustomChannel. `address` may list the
// members of a replicated group separated by commas (common/server_addresses.h): the channel
// then goes to ChannelTarget(address) with `args` plus AddFailoverChannelArgs, and follows the
// leader; the first member's host:port is the calls' authority, so with TLS every member's
// certificate must be valid for the first member's host (e.g. one certificate naming every
// member). INVALID_ARGUMENT for an unreadable TLS file or a malformed list; UNAVAILABLE for a
// member that does not resolve; the token file's errors as ReadBearerToken.
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address,
                                                           const SecurityConfig& security,
                                                           const grpc::ChannelArguments& args,
                                                           std::shared_ptr<const WorkerCredential> worker = nullptr);

// The server side of the token: OK for every call when no token is configured; otherwise OK
// iff the call's metadata carries "authorization: Bearer <token>" (compared in constant time).
// A null context (an in-process call) is trusted.
class TokenChecker {
 public:
  // Empty token: no check.
  explicit TokenChecker(std::string token) : token_(std::move(token)) {}
  static absl::StatusOr<TokenChecker> FromConfig(const SecurityConfig& security);

  absl::Status Check(const grpc::ServerContextBase* context) const;

 private:
  std::string token_;
};

}  // namespace rebound
