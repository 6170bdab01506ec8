#include "common/server_addresses.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/strings/string_view.h"
#include "grpc/grpc.h"
#include "grpcpp/support/channel_arguments.h"

namespace rebound {
namespace {

constexpr int kInitialReconnectBackoffMs = 100;
constexpr int kMaxReconnectBackoffMs = 1000;
constexpr int kMinConnectTimeoutMs = 1000;
constexpr int kKeepaliveTimeMs = 1000;
constexpr int kKeepaliveTimeoutMs = 1000;

// The host of a valid "host:port" entry (brackets kept) and its port.
struct HostPort {
  std::string host;
  int port = 0;
};

HostPort Split(const std::string& entry) {
  const size_t colon = entry.rfind(':');
  HostPort parts;
  parts.host = entry.substr(0, colon);
  absl::SimpleAtoi(entry.substr(colon + 1), &parts.port);
  return parts;
}

// A list entry's host must be one host, not a gRPC target URI ("dns:///h") and not an IPv6
// address without its brackets (whose last colon would be taken for the port's).
bool IsSingleHost(const std::string& host) {
  if (host.front() == '[') {
    return host.size() > 2 && host.back() == ']' &&
           host.find_first_of("[]/", 1) == host.size() - 1;
  }
  return host.find_first_of(":/[]") == std::string::npos;
}

// The addresses of one host, by family, as text (IPv6 without brackets), in getaddrinfo's order
// and without repeats.
struct Resolved {
  std::vector<std::string> v4;
  std::vector<std::string> v6;
};

absl::StatusOr<Resolved> Resolve(const std::string& host, const std::string& entry) {
  const std::string name = host.front() == '[' ? host.substr(1, host.size() - 2) : host;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int error = getaddrinfo(name.c_str(), nullptr, &hints, &found);
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> owner(found, &freeaddrinfo);
  if (error != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve the host \"", name,
                                               "\" of the server address \"", entry,
                                               "\": ", gai_strerror(error)));
  }
  Resolved resolved;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {0};
    std::vector<std::string>* into = nullptr;
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr, text,
                sizeof(text));
      into = &resolved.v4;
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr, text,
                sizeof(text));
      into = &resolved.v6;
    } else {
      continue;
    }
    if (std::find(into->begin(), into->end(), text) == into->end()) into->push_back(text);
  }
  if (resolved.v4.empty() && resolved.v6.empty()) {
    return absl::UnavailableError(absl::StrCat("the host \"", name, "\" of the server address \"",
                                               entry, "\" resolves to no IPv4 or IPv6 address"));
  }
  return resolved;
}

}  // namespace

absl::Status ValidateHostPort(const std::string& address, const std::string& field) {
  const std::string prefix = field.empty() ? "" : field + " ";
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "must be host:port with a port in [0, 65535], got \"", address, "\""));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ParseServerAddresses(const std::string& list,
                                                              const std::string& field) {
  if (list.find(',') == std::string::npos) {
    absl::Status valid = ValidateHostPort(list, field);
    if (!valid.ok()) return valid;
    return std::vector<std::string>{std::string(absl::StripAsciiWhitespace(list))};
  }
  const std::string prefix = field.empty() ? "" : field + " ";
  std::vector<std::string> entries;
  for (absl::string_view raw : absl::StrSplit(list, ',')) {
    const std::string entry(absl::StripAsciiWhitespace(raw));
    const std::string which =
        absl::StrCat(prefix, "entry ", entries.size() + 1, " of \"", list, "\"");
    if (entry.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(which, " is empty; expected host:port addresses separated by commas"));
    }
    int port = 0;
    if (!ValidateHostPort(entry, "").ok() ||
        !absl::SimpleAtoi(entry.substr(entry.rfind(':') + 1), &port) || port == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          which, " must be host:port with a port in [1, 65535] (a member of the group), got \"",
          entry, "\""));
    }
    if (!IsSingleHost(Split(entry).host)) {
      return absl::InvalidArgumentError(absl::StrCat(
          which, " must be host:port with one host (an IPv6 address in brackets, [::1]:7070; a "
                 "gRPC target URI such as dns:///name:7070 only as the single address), got \"",
          entry, "\""));
    }
    const auto repeated = std::find(entries.begin(), entries.end(), entry);
    if (repeated != entries.end()) {
      return absl::InvalidArgumentError(absl::StrCat(which, " repeats entry ",
                                                     repeated - entries.begin() + 1, ", \"",
                                                     entry, "\""));
    }
    entries.push_back(entry);
  }
  return entries;
}

absl::StatusOr<std::string> ChannelTarget(const std::string& list) {
  if (list.find(',') == std::string::npos) return list;
  absl::StatusOr<std::vector<std::string>> entries = ParseServerAddresses(list, "server address");
  if (!entries.ok()) return entries.status();
  std::vector<HostPort> members;
  std::vector<Resolved> resolved;
  bool every_host_has_v4 = true;
  for (const std::string& entry : *entries) {
    members.push_back(Split(entry));
    absl::StatusOr<Resolved> addresses = Resolve(members.back().host, entry);
    if (!addresses.ok()) return addresses.status();
    every_host_has_v4 = every_host_has_v4 && !addresses->v4.empty();
    resolved.push_back(*std::move(addresses));
  }
  std::vector<std::string> targets;
  for (size_t i = 0; i < members.size(); ++i) {
    const std::string port = absl::StrCat(":", members[i].port);
    if (every_host_has_v4) {
      for (const std::string& a : resolved[i].v4) targets.push_back(a + port);
    } else if (!resolved[i].v4.empty()) {
      for (const std::string& a : resolved[i].v4) targets.push_back("[::ffff:" + a + "]" + port);
    } else {
      for (const std::string& a : resolved[i].v6) targets.push_back("[" + a + "]" + port);
    }
  }
  // Two entries may name the same address (a name and its number): gRPC would try it twice.
  std::vector<std::string> unique;
  for (std::string& t : targets) {
    if (std::find(unique.begin(), unique.end(), t) == unique.end()) unique.push_back(std::move(t));
  }
  return absl::StrCat(every_host_has_v4 ? "ipv4:" : "ipv6:", absl::StrJoin(unique, ","));
}

void AddFailoverChannelArgs(grpc::ChannelArguments* args) {
  // gRPC uses the first value given for a key, so the caller's values of these keys (a worker
  // sets its own reconnect backoff) are left out of a copy rather than overridden.
  static const char* const kKeys[] = {GRPC_ARG_LB_POLICY_NAME,
                                      GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
                                      GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
                                      GRPC_ARG_MIN_RECONNECT_BACKOFF_MS,
                                      GRPC_ARG_KEEPALIVE_TIME_MS,
                                      GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                                      GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS,
                                      GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA};
  grpc_channel_args given;
  args->SetChannelArgs(&given);
  grpc::ChannelArguments kept;  // starts with gRPC's user agent, "grpc-c++/<version>"
  grpc_channel_args fresh;
  kept.SetChannelArgs(&fresh);
  std::string default_agent;
  for (size_t i = 0; i < fresh.num_args; ++i) {
    if (std::strcmp(fresh.args[i].key, GRPC_ARG_PRIMARY_USER_AGENT_STRING) == 0) {
      default_agent = fresh.args[i].value.string;
    }
  }
  bool agent_seen = false;
  for (size_t i = 0; i < given.num_args; ++i) {
    const grpc_arg& arg = given.args[i];
    const bool replaced =
        std::any_of(std::begin(kKeys), std::end(kKeys),
                    [&](const char* key) { return std::strcmp(key, arg.key) == 0; });
    if (replaced) continue;
    if (!agent_seen && arg.type == GRPC_ARG_STRING &&
        std::strcmp(arg.key, GRPC_ARG_PRIMARY_USER_AGENT_STRING) == 0) {
      // The caller's first user agent is the default, perhaps behind a SetUserAgentPrefix.
      agent_seen = true;
      const absl::string_view agent = arg.value.string;
      if (agent != default_agent) {
        kept.SetUserAgentPrefix(std::string(absl::StripSuffix(agent, " " + default_agent)));
      }
      continue;
    }
    switch (arg.type) {
      case GRPC_ARG_STRING:
        kept.SetString(arg.key, arg.value.string);
        break;
      case GRPC_ARG_INTEGER:
        kept.SetInt(arg.key, arg.value.integer);
        break;
      case GRPC_ARG_POINTER:
        kept.SetPointerWithVtable(arg.key, arg.value.pointer.p, arg.value.pointer.vtable);
        break;
    }
  }
  *args = std::move(kept);
  args->SetLoadBalancingPolicyName("pick_first");
  args->SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, kInitialReconnectBackoffMs);
  args->SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, kMaxReconnectBackoffMs);
  args->SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, kMinConnectTimeoutMs);
  args->SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  args->SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  args->SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // gRPC's default (2) stops the pings of a connection without calls after two.
  args->SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
}

}  // namespace rebound
