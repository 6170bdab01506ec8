// common/server_addresses.h: parsing of server address lists, the gRPC target they become, the
// failover channel settings, and MakeChannel over a list against real gRPC servers on loopback
// (a member that refuses, one that accepts TCP but never answers, TLS, and a leader that moves).

#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/security.h"
#include "common/server_addresses.h"
#include "grpcpp/grpcpp.h"
#include "proto/health.grpc.pb.h"

namespace rebound {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

std::string ParseError(const std::string& list) {
  auto parsed = ParseServerAddresses(list, "--server");
  REQUIRE_FALSE(parsed.ok());
  CHECK(parsed.status().code() == absl::StatusCode::kInvalidArgument);
  return std::string(parsed.status().message());
}

TEST_CASE("a single address parses as today's host:port, port 0 included") {
  CHECK(*ParseServerAddresses("127.0.0.1:7070", "--server") ==
        std::vector<std::string>{"127.0.0.1:7070"});
  CHECK(*ParseServerAddresses(" server.example:7070 ", "--server") ==
        std::vector<std::string>{"server.example:7070"});
  CHECK(*ParseServerAddresses("0.0.0.0:0", "--server") == std::vector<std::string>{"0.0.0.0:0"});
  CHECK(*ParseServerAddresses("dns:///rebound.ns.svc:7070", "--server") ==
        std::vector<std::string>{"dns:///rebound.ns.svc:7070"});
  CHECK(ParseError("7070") ==
        "--server must be host:port with a port in [0, 65535], got \"7070\"");
  CHECK(ParseError("") == "--server must be host:port with a port in [0, 65535], got \"\"");
}

TEST_CASE("a list's entries are split at commas, in order, without the white space around them") {
  CHECK(*ParseServerAddresses(" 10.0.0.1:7070 , server-b:7071,[::1]:7072 ", "--server") ==
        std::vector<std::string>{"10.0.0.1:7070", "server-b:7071", "[::1]:7072"});
}

TEST_CASE("a bad list is refused naming the field and the entry") {
  CHECK(ParseError("a:1,,b:2") ==
        "--server entry 2 of \"a:1,,b:2\" is empty; expected host:port addresses separated by "
        "commas");
  CHECK(ParseError("a:1, ") ==
        "--server entry 2 of \"a:1, \" is empty; expected host:port addresses separated by commas");
  CHECK(ParseError(",a:1") ==
        "--server entry 1 of \",a:1\" is empty; expected host:port addresses separated by commas");
  CHECK(ParseError("a:1,b") ==
        "--server entry 2 of \"a:1,b\" must be host:port with a port in [1, 65535] (a member of "
        "the group), got \"b\"");
  CHECK(ParseError("a:1,b:70000") ==
        "--server entry 2 of \"a:1,b:70000\" must be host:port with a port in [1, 65535] (a "
        "member of the group), got \"b:70000\"");
  CHECK(ParseError("a:0,b:1") ==
        "--server entry 1 of \"a:0,b:1\" must be host:port with a port in [1, 65535] (a member of "
        "the group), got \"a:0\"");
  CHECK(ParseError("a:1,dns:///b:2") ==
        "--server entry 2 of \"a:1,dns:///b:2\" must be host:port with one host (an IPv6 address "
        "in brackets, [::1]:7070; a gRPC target URI such as dns:///name:7070 only as the single "
        "address), got \"dns:///b:2\"");
  CHECK(absl::StartsWith(ParseError("a:1,::1:2"),
                         "--server entry 2 of \"a:1,::1:2\" must be host:port with one host"));
  CHECK(absl::StartsWith(ParseError("[::1:2,a:1"),
                         "--server entry 1 of \"[::1:2,a:1\" must be host:port with one host"));
  CHECK(ParseError("a:1,b:2, a:1") ==
        "--server entry 3 of \"a:1,b:2, a:1\" repeats entry 1, \"a:1\"");
  auto unnamed = ParseServerAddresses("a:1,,b:2", "");
  CHECK(unnamed.status().message() ==
        "entry 2 of \"a:1,,b:2\" is empty; expected host:port addresses separated by commas");
}

TEST_CASE("one address is its own channel target, byte for byte, and is not resolved") {
  for (const std::string address :
       {"127.0.0.1:7070", "no-such-host.invalid:7070", " padded:1 ", "dns:///rebound.ns.svc:7070",
        "[::1]:7070", "anything at all"}) {
    auto target = ChannelTarget(address);
    REQUIRE(target.ok());
    CHECK(*target == address);
  }
}

TEST_CASE("numeric lists become ipv4: or ipv6: targets in the list's order") {
  CHECK(*ChannelTarget("10.0.0.2:7071, 10.0.0.1:7070") == "ipv4:10.0.0.2:7071,10.0.0.1:7070");
  CHECK(*ChannelTarget("[::1]:1,[2001:db8::7]:2") == "ipv6:[::1]:1,[2001:db8::7]:2");
  // Mixed families: an IPv4-only member goes into an ipv6: target as its IPv4-mapped address.
  CHECK(*ChannelTarget("127.0.0.1:1,[::1]:2") == "ipv6:[::ffff:127.0.0.1]:1,[::1]:2");
}

TEST_CASE("host names in a list are resolved once, IPv4 first, without repeated addresses") {
  // The test machines' /etc/hosts maps localhost to 127.0.0.1 (perhaps also to ::1).
  CHECK(*ChannelTarget("localhost:7070,127.0.0.2:7071") == "ipv4:127.0.0.1:7070,127.0.0.2:7071");
  CHECK(*ChannelTarget("localhost:7070,[::1]:7071") == "ipv6:[::ffff:127.0.0.1]:7070,[::1]:7071");
  // A name and its number are the same member: gRPC would try it twice.
  CHECK(*ChannelTarget("localhost:7070,127.0.0.1:7070") == "ipv4:127.0.0.1:7070");
}

TEST_CASE("a list member that does not resolve is UNAVAILABLE naming it; a bad list is "
          "INVALID_ARGUMENT") {
  auto unknown = ChannelTarget("127.0.0.1:7070,no-such-host.invalid:7071");
  REQUIRE_FALSE(unknown.ok());
  CHECK(unknown.status().code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StartsWith(unknown.status().message(),
                         "cannot resolve the host \"no-such-host.invalid\" of the server address "
                         "\"no-such-host.invalid:7071\": "));
  auto bad = ChannelTarget("127.0.0.1:7070,127.0.0.1:0");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StartsWith(bad.status().message(),
                         "server address entry 2 of \"127.0.0.1:7070,127.0.0.1:0\""));
  auto channel = MakeChannel("127.0.0.1:7070,no-such-host.invalid:7071", SecurityConfig(),
                             grpc::ChannelArguments());
  CHECK(channel.status().code() == absl::StatusCode::kUnavailable);
}

TEST_CASE("the failover settings replace the caller's values of their keys and keep the rest") {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 120000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 60000);
  args.SetMaxReceiveMessageSize(-1);
  args.SetUserAgentPrefix("rebound-test");
  AddFailoverChannelArgs(&args);
  grpc_channel_args c_args;
  args.SetChannelArgs(&c_args);
  // gRPC uses the first value of a key: each must be there once.
  auto only = [&](const char* key) -> grpc_arg {
    std::vector<grpc_arg> found;
    for (size_t i = 0; i < c_args.num_args; ++i) {
      if (std::string(c_args.args[i].key) == key) found.push_back(c_args.args[i]);
    }
    INFO(key);
    REQUIRE(found.size() == 1);
    return found.front();
  };
  CHECK(std::string(only(GRPC_ARG_LB_POLICY_NAME).value.string) == "pick_first");
  CHECK(only(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS).value.integer == 100);
  CHECK(only(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS).value.integer == 1000);
  CHECK(only(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS).value.integer == 1000);
  CHECK(only(GRPC_ARG_KEEPALIVE_TIME_MS).value.integer == 1000);
  CHECK(only(GRPC_ARG_KEEPALIVE_TIMEOUT_MS).value.integer == 1000);
  CHECK(only(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS).value.integer == 1);
  CHECK(only(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA).value.integer == 0);
  CHECK(only(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH).value.integer == -1);
  CHECK(absl::StartsWith(only(GRPC_ARG_PRIMARY_USER_AGENT_STRING).value.string,
                         "rebound-test grpc-c++/"));
}

// ---- a channel over a list, against real servers -----------------------------------------------

constexpr absl::Duration kBound = absl::Seconds(15);  // generous: a busy 2-core machine

// A loopback port nobody listens on (bound and released).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  socklen_t len = sizeof(addr);
  REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  close(fd);
  return ntohs(addr.sin_port);
}

// grpc.health.v1.Health of one member: `member` is SERVING, any other service NOT_FOUND, so a
// check of `member` answers only from this member's server.
class MemberHealth final : public Health::Service {
 public:
  explicit MemberHealth(std::string member) : member_(std::move(member)) {}
  grpc::Status Check(grpc::ServerContext*, const HealthCheckRequest* request,
                     HealthCheckResponse* response) override {
    if (request->service() != member_) return grpc::Status(grpc::StatusCode::NOT_FOUND, "");
    response->set_status(HealthCheckResponse::SERVING);
    return grpc::Status::OK;
  }

 private:
  const std::string member_;
};

// A member: a gRPC server on 127.0.0.1:port with MemberHealth. It permits the failover
// channel's keepalive pings as the group's servers do.
struct Member {
  std::unique_ptr<MemberHealth> health;
  std::unique_ptr<grpc::Server> server;

  void Stop() {
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    server.reset();
  }
};

Member StartMember(int port, const std::string& member,
                   std::shared_ptr<grpc::ServerCredentials> credentials =
                       grpc::InsecureServerCredentials()) {
  Member started;
  started.health = std::make_unique<MemberHealth>(member);
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort(absl::StrCat("127.0.0.1:", port), credentials, &bound);
  builder.RegisterService(started.health.get());
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
  started.server = builder.BuildAndStart();
  REQUIRE(started.server != nullptr);
  REQUIRE(bound == port);
  return started;
}

// One health check of `member` with a 1 s deadline, failing fast while no member is connected.
bool Serving(Health::Stub& stub, const std::string& member) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  HealthCheckRequest request;
  request.set_service(member);
  HealthCheckResponse response;
  const grpc::Status status = stub.Check(&context, request, &response);
  return status.ok() && response.status() == HealthCheckResponse::SERVING;
}

// How long until `member` answers SERVING through `stub`; kBound if it never does within it.
absl::Duration TimeUntilServing(Health::Stub& stub, const std::string& member) {
  const absl::Time start = absl::Now();
  while (absl::Now() - start < kBound) {
    if (Serving(stub, member)) return absl::Now() - start;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return kBound;
}

TEST_CASE("a channel over a list reaches the member that listens, and follows it when it moves") {
  const int port_a = FreePort();
  const int port_b = FreePort();
  REQUIRE(port_a != port_b);
  Member b = StartMember(port_b, "member-b");

  // The caller's own reconnect schedule is slow (a worker sets its configured backoff): the
  // failover settings must replace it, or the move below takes 20 s or more.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 20000);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 20000);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 60000);
  auto channel = MakeChannel(absl::StrCat("127.0.0.1:", port_a, ",127.0.0.1:", port_b),
                             SecurityConfig(), args);
  REQUIRE(channel.ok());
  auto stub = Health::NewStub(*channel);

  const absl::Duration first = TimeUntilServing(*stub, "member-b");
  INFO("reached member B (A closed) after " << absl::FormatDuration(first));
  CHECK(first < kBound);

  // The leader moves: B goes away, the channel finds no member (both refuse), then A listens.
  b.Stop();
  const absl::Time gone = absl::Now();
  while (Serving(*stub, "member-b") && absl::Now() - gone < kBound) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  REQUIRE_FALSE(Serving(*stub, "member-b"));
  Member a = StartMember(port_a, "member-a");
  const absl::Duration moved = TimeUntilServing(*stub, "member-a");
  INFO("reached member A after B went away in " << absl::FormatDuration(moved));
  CHECK(moved < kBound);
  a.Stop();
}

TEST_CASE("a member that accepts TCP but never answers costs about a second, not gRPC's 20 s") {
  // A listening socket that is never accepted from: the kernel completes the TCP handshake, the
  // HTTP/2 one never comes (as with a SIGSTOPped server).
  const int hung = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(hung >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(hung, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  REQUIRE(listen(hung, 16) == 0);
  socklen_t len = sizeof(addr);
  REQUIRE(getsockname(hung, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  const int port_hung = ntohs(addr.sin_port);
  const int port_b = FreePort();
  Member b = StartMember(port_b, "member-b");

  auto channel = MakeChannel(absl::StrCat("127.0.0.1:", port_hung, ",127.0.0.1:", port_b),
                             SecurityConfig(), grpc::ChannelArguments());
  REQUIRE(channel.ok());
  auto stub = Health::NewStub(*channel);
  const absl::Duration reached = TimeUntilServing(*stub, "member-b");
  INFO("reached member B past the hung one after " << absl::FormatDuration(reached));
  CHECK(reached < absl::Seconds(10));
  b.Stop();
  close(hung);
}

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

TEST_CASE("over TLS, a list's members are checked against the first member's host") {
  const std::string dir = TempDir();
  const std::string script = absl::StrCat(
      "set -e; cd '", dir, "'; ",
      "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 "
      "  -subj /CN=rebound-test-ca 2>/dev/null; ",
      "printf 'subjectAltName=IP:127.0.0.1\\n' > san.ext; ",
      "openssl req -newkey rsa:2048 -nodes -keyout member.key -out member.csr -subj /CN=member "
      "  2>/dev/null; ",
      "openssl x509 -req -in member.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out member.pem "
      "  -days 1 -extfile san.ext 2>/dev/null");
  REQUIRE(std::system(script.c_str()) == 0);
  SecurityConfig server_security;
  server_security.mutable_tls()->set_cert_file(dir + "/member.pem");
  server_security.mutable_tls()->set_key_file(dir + "/member.key");
  auto credentials = MakeServerCredentials(server_security);
  REQUIRE(credentials.ok());
  const int port_a = FreePort();
  const int port_b = FreePort();
  Member b = StartMember(port_b, "member-b", *credentials);

  SecurityConfig client_security;
  client_security.mutable_tls()->set_ca_file(dir + "/ca.pem");
  auto channel = MakeChannel(absl::StrCat("127.0.0.1:", port_a, ",127.0.0.1:", port_b),
                             client_security, grpc::ChannelArguments());
  REQUIRE(channel.ok());
  auto stub = Health::NewStub(*channel);
  CHECK(TimeUntilServing(*stub, "member-b") < kBound);
  b.Stop();
}

}  // namespace
}  // namespace rebound
