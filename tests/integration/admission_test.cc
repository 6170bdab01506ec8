// What the server admits before it spends memory or threads on a call (docs/operations.md#bounds),
// against the real rebound_server and rebound_worker on loopback: one server, and one worker's
// WorkerPeer service, per port (no SO_REUSEPORT); the bearer token checked before a request's
// body is read; reflection behind the token and health open; bounds on request bytes in flight
// and on parked long polls.

#include <catch2/catch.hpp>
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file.h"
#include "common/security.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/client_unary_call.h"
#include "grpcpp/impl/codegen/sync_stream.h"
#include "proto/rebound.grpc.pb.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/status_util.h"
#include "testing/cluster/processes.h"
#include "tests/integration/worker_credentials.h"

namespace rebound::testing {
namespace {

constexpr char kJob[] =
    "  job_id: \"adm\"\n"
    "  model { layers { width: 16 } layers { width: 10 activation: IDENTITY } }\n"
    "  topology { replicas: 2 }\n"
    "  data { batch_size: 16 micro_batches: 1 train_limit: 200 test_limit: 50 }\n"
    "  training { max_steps: 100 }\n";

// The server's peak resident memory (VmHWM), bytes.
int64_t PeakRss(pid_t pid) {
  const std::string status = ReadFileOrEmpty(absl::StrCat("/proc/", pid, "/status"));
  for (absl::string_view line : absl::StrSplit(status, '\n')) {
    if (absl::StartsWith(line, "VmHWM:")) {
      int64_t kb = 0;
      std::string number(absl::StripAsciiWhitespace(line.substr(6)));
      number = number.substr(0, number.find(' '));
      REQUIRE(absl::SimpleAtoi(number, &kb));
      return kb << 10;
    }
  }
  FAIL("no VmHWM in /proc/" << pid << "/status");
  return -1;
}

std::shared_ptr<grpc::Channel> Channel(const std::string& address, const std::string& token_file) {
  SecurityConfig security;
  if (!token_file.empty()) security.set_token_file(token_file);
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  args.SetMaxReceiveMessageSize(-1);
  auto channel = MakeChannel(address, security, args);
  REQUIRE(channel.ok());
  return *channel;
}

std::chrono::system_clock::time_point In(absl::Duration d) {
  return std::chrono::system_clock::now() +
         std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// grpc.reflection.v1alpha ServerReflectionInfo with list_services: the status, and the answer's
// bytes (which name the services) when it is OK.
grpc::Status ListServices(const std::shared_ptr<grpc::Channel>& channel, std::string* answer) {
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(10)));
  const grpc::internal::RpcMethod method(
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      grpc::internal::RpcMethod::BIDI_STREAMING);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channel.get(), method, &context));
  // ServerReflectionRequest { list_services: "" } (field 7, length-delimited).
  const std::string request("\x3a\x00", 2);
  grpc::Slice slice(request);
  grpc::ByteBuffer out(&slice, 1);
  stream->Write(out);
  stream->WritesDone();
  grpc::ByteBuffer in;
  answer->clear();
  while (stream->Read(&in)) {
    std::vector<grpc::Slice> slices;
    REQUIRE(in.Dump(&slices).ok());
    for (const grpc::Slice& s : slices) {
      answer->append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  return stream->Finish();
}

// grpc.health.v1 Check of the whole server: the status and the answer's serving status.
grpc::Status HealthCheck(const std::shared_ptr<grpc::Channel>& channel, int* serving) {
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(10)));
  const grpc::internal::RpcMethod method("/grpc.health.v1.Health/Check",
                                         grpc::internal::RpcMethod::NORMAL_RPC);
  grpc::ByteBuffer request;  // HealthCheckRequest {}: empty
  grpc::Slice empty("");
  request = grpc::ByteBuffer(&empty, 1);
  grpc::ByteBuffer response;
  grpc::Status status = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel.get(), method, &context, request, &response);
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (status.ok() && response.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  // HealthCheckResponse { status = 1 (SERVING) }: 0x08 0x01.
  *serving = bytes.size() == 2 && bytes[0] == '\x08' ? bytes[1] : -1;
  return status;
}

TEST_CASE("a second server on a bound port exits 1 saying the address is in use, and the first "
          "keeps serving") {
  LocalCluster cluster(kJob, LocalClusterOptions{"second-server"});
  const RegisterResponse first = cluster.Register("t0", TRAINER);
  const std::string dir = MakeTempDir("second-server-config");
  WriteFileOrDie(dir + "/server.pbtxt", absl::StrCat("job {\n", kJob, "}\n"));
  auto second = Subprocess::Start({Runfile("server/rebound_server"), "--config",
                                   dir + "/server.pbtxt", "--listen", cluster.address(),
                                   "--port_file", dir + "/port"},
                                  dir + "/server.log");
  REQUIRE(second.ok());
  const int code = (*second)->WaitFor(absl::Seconds(30)).value_or(-1);
  const std::string log = ReadFileOrEmpty(dir + "/server.log");
  INFO(log);
  CHECK(code == 1);
  CHECK(absl::StrContains(log, absl::StrCat("cannot listen on ", cluster.address(),
                                            ": address in use")));
  CHECK(ReadFileOrEmpty(dir + "/port").empty());
  // The first server still owns every registration: the next trainer gets the next slot.
  const RegisterResponse next = cluster.Register("t1", TRAINER);
  CHECK(first.slot().replica() == 0);
  CHECK(next.slot().replica() == 1);
  const GetStatusResponse status = cluster.Status();
  CHECK(status.workers_size() == 2);
}

TEST_CASE("a second worker on a bound WorkerPeer port exits 1 saying the address is in use") {
  LocalCluster cluster(kJob, LocalClusterOptions{"second-peer"});
  cluster.StartWorker("s1", SPARE);
  const GetStatusResponse before = cluster.Status();
  const WorkerStatus* first = FindWorker(before, "s1", SPARE);
  REQUIRE(first != nullptr);
  const std::string peer = first->peer_address();
  REQUIRE(absl::StartsWith(peer, "127.0.0.1:"));
  const std::string dir = MakeTempDir("second-peer-config");
  WriteFileOrDie(dir + "/worker.pbtxt", absl::StrCat("peer_listen_address: \"", peer, "\"\n"));
  auto second = Subprocess::Start({Runfile("worker/rebound_worker"), "--config",
                                   dir + "/worker.pbtxt", "--server", cluster.address(), "--name",
                                   "s2", "--role", "spare"},
                                  dir + "/worker.log");
  REQUIRE(second.ok());
  const int code = (*second)->WaitFor(absl::Seconds(30)).value_or(-1);
  const std::string log = ReadFileOrEmpty(dir + "/worker.log");
  INFO(log);
  CHECK(code == 1);
  CHECK(absl::StrContains(log, absl::StrCat("cannot listen on ", peer, ": address in use")));
  // The first still serves as the only worker; the second never registered.
  const GetStatusResponse status = cluster.Status();
  CHECK(status.workers_size() == 1);
  CHECK(FindWorker(status, "s2", SPARE) == nullptr);
}

TEST_CASE("with a token, a 200 MiB call without it is refused before its body is read") {
  const std::string dir = MakeTempDir("token-before-body");
  WriteFileOrDie(dir + "/token", "s3cr3t\n");
  LocalClusterOptions options{"token-before-body"};
  options.server_config_extra = absl::StrCat("security { token_file: \"", dir, "/token\" }\n");
  options.client_security.set_token_file(dir + "/token");
  LocalCluster cluster(kJob, options);
  const int64_t peak_before = PeakRss(cluster.server_pid());

  SyncRequest huge;
  huge.set_incarnation(1);
  huge.mutable_params()->add_tensors()->set_data(std::string(size_t{200} << 20, 'x'));
  auto stub = ParameterServer::NewStub(Channel(cluster.address(), ""));
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(60)));
  SyncResponse response;
  const grpc::Status refused = stub->Sync(&context, huge, &response);
  CHECK(refused.error_code() == grpc::StatusCode::UNAUTHENTICATED);
  CHECK(absl::StrContains(refused.error_message(), "requires a bearer token"));
  // Before: the whole message was buffered and parsed (peak +600 MB). Now the call is refused on
  // its headers; the peak grows by less than one tenth of the message.
  const int64_t peak_after = PeakRss(cluster.server_pid());
  INFO("server peak RSS " << (peak_before >> 20) << " -> " << (peak_after >> 20) << " MiB");
  CHECK(peak_after - peak_before < (int64_t{20} << 20));
  // Nothing changed: no worker, the center at version 0.
  const GetStatusResponse status = cluster.Status();
  CHECK(status.workers_size() == 0);
  CHECK(status.centers(0).version() == 0);
}

TEST_CASE("with a token, reflection needs it and the health service does not") {
  const std::string dir = MakeTempDir("reflection-token");
  WriteFileOrDie(dir + "/token", "s3cr3t\n");
  WriteFileOrDie(dir + "/wrong", "guess\n");
  LocalClusterOptions options{"reflection-token"};
  options.server_config_extra = absl::StrCat("security { token_file: \"", dir, "/token\" }\n");
  options.client_security.set_token_file(dir + "/token");
  LocalCluster cluster(kJob, options);

  std::string answer;
  const grpc::Status with_token = ListServices(Channel(cluster.address(), dir + "/token"), &answer);
  CHECK(with_token.ok());
  CHECK(absl::StrContains(answer, "rebound.ParameterServer"));
  for (const std::string& token_file : {std::string(), dir + "/wrong"}) {
    INFO("token file '" << token_file << "'");
    const grpc::Status refused = ListServices(Channel(cluster.address(), token_file), &answer);
    CHECK(refused.error_code() == grpc::StatusCode::UNAUTHENTICATED);
    CHECK(absl::StrContains(refused.error_message(), "requires a bearer token"));
    CHECK(answer.empty());
  }
  int serving = -1;
  const grpc::Status health = HealthCheck(Channel(cluster.address(), ""), &serving);
  CHECK(health.ok());
  CHECK(serving == 1);
}

TEST_CASE("a sync beyond max_inflight_bytes gets RESOURCE_EXHAUSTED and changes nothing") {
  LocalClusterOptions options{"inflight"};
  options.server_config_extra = "max_inflight_bytes: 33554432\n";  // 32 MiB
  LocalCluster cluster(kJob, options);
  const RegisterResponse trainer = cluster.Register("t0", TRAINER);
  SyncRequest big;
  big.set_incarnation(trainer.incarnation());
  *big.mutable_slot() = trainer.slot();
  big.set_step(10);
  big.mutable_params()->add_tensors()->set_data(std::string(size_t{40} << 20, 'x'));
  auto stub = ParameterServer::NewStub(Channel(cluster.address(), ""));
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(60)));
  WorkerCredentials::AddTo(&context, cluster.credentials().Of(trainer.incarnation()));
  SyncResponse response;
  const grpc::Status refused = stub->Sync(&context, big, &response);
  CHECK(refused.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  INFO(refused.error_message());
  // Refused while it is received (gRPC's resource quota resets the stream with HTTP/2
  // ENHANCE_YOUR_CALM, code 11), or once parsed by the service's own count, naming the bound.
  CHECK((absl::StrContains(refused.error_message(), "max_inflight_bytes") ||
         absl::StrContains(refused.error_message(), "RST_STREAM with error code 11")));
  const GetStatusResponse status = cluster.Status();
  CHECK(status.centers(0).version() == 0);
  CHECK(status.slots(0).update_count() == 0);
}

TEST_CASE("200 parked Pulls: those beyond max_parked_calls get RESOURCE_EXHAUSTED and other calls "
          "are still answered") {
  LocalClusterOptions options{"parked"};
  options.max_wait_ms = 4000;
  options.server_config_extra = "max_parked_calls: 20\n";
  LocalCluster cluster(kJob, options);
  const uint64_t observer = cluster.RegisterObserver();
  auto channel = Channel(cluster.address(), "");
  auto stub = ParameterServer::NewStub(channel);

  // A version no job can reach is refused at once.
  {
    PullRequest absurd;
    absurd.set_incarnation(observer);
    absurd.set_min_version(int64_t{1} << 60);
    PullResponse response;
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(2)));
    WorkerCredentials::AddTo(&context, cluster.credentials().Of(observer));
    const grpc::Status refused = stub->Pull(&context, absurd, &response);
    CHECK(refused.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(absl::StrContains(refused.error_message(), "min_version"));
  }

  constexpr int kPulls = 200;
  grpc::CompletionQueue queue;
  struct Call {
    grpc::ClientContext context;
    PullResponse response;
    grpc::Status status;
    std::unique_ptr<grpc::ClientAsyncResponseReader<PullResponse>> reader;
  };
  std::vector<Call> calls(kPulls);
  PullRequest wait;
  wait.set_incarnation(observer);
  wait.set_min_version(1);  // the next version: nobody syncs, so each waits max_wait_ms
  for (int i = 0; i < kPulls; ++i) {
    calls[i].context.set_deadline(In(absl::Seconds(30)));
    WorkerCredentials::AddTo(&calls[i].context, cluster.credentials().Of(observer));
    calls[i].reader = stub->AsyncPull(&calls[i].context, wait, &queue);
    calls[i].reader->Finish(&calls[i].response, &calls[i].status, &calls[i]);
  }
  // The refusals come back first; wait for them before probing, so the parked ones are parked.
  int done = 0;
  int exhausted = 0;
  std::vector<std::string> messages;
  void* tag = nullptr;
  bool ok = false;
  while (exhausted < kPulls - 20 && queue.Next(&tag, &ok)) {
    ++done;
    const grpc::Status& status = static_cast<Call*>(tag)->status;
    if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++exhausted;
      messages.push_back(status.error_message());
    } else {
      FAIL("a Pull returned " << status.error_code() << " " << status.error_message()
                              << " before max_wait_ms");
    }
  }
  REQUIRE(exhausted == kPulls - 20);
  CHECK(absl::StrContains(messages.front(), "max_parked_calls"));
  // While 20 Pulls are parked, GetStatus and an immediate Pull are answered (deadline 2 s, far
  // below the parked calls' 4 s).
  for (int i = 0; i < 5; ++i) {
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(2)));
    GetStatusResponse status;
    REQUIRE(stub->GetStatus(&context, GetStatusRequest(), &status).ok());
    CHECK(status.workers_size() == 1);
    PullRequest now;
    now.set_incarnation(observer);
    PullResponse pulled;
    grpc::ClientContext pull_context;
    pull_context.set_deadline(In(absl::Seconds(2)));
    WorkerCredentials::AddTo(&pull_context, cluster.credentials().Of(observer));
    REQUIRE(stub->Pull(&pull_context, now, &pulled).ok());
    CHECK(pulled.center_version() == 0);
  }
  // The parked ones come back after max_wait_ms with the center as it is.
  int answered = 0;
  while (done < kPulls && queue.Next(&tag, &ok)) {
    ++done;
    const Call* call = static_cast<Call*>(tag);
    CHECK(call->status.ok());
    answered += call->status.ok() && call->response.center_version() == 0;
  }
  CHECK(answered == 20);
  queue.Shutdown();
  while (queue.Next(&tag, &ok)) {
  }
}

}  // namespace
}  // namespace rebound::testing
