// The parameter server's training calls against the real rebound_server binary on loopback: a
// test client plays a trainer over gRPC where the protocol itself is checked, and real
// rebound_worker trainers run where whole runs are checked.

#include <catch2/catch.hpp>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "proto/rebound.grpc.pb.h"
#include "tests/integration/subprocess.h"

namespace rebound::testing {
namespace {

// 4 inputs -> 3 hidden -> 2 classes: small enough to reason about every value.
const char kTinyModel[] =
    "  model { input_dim: 4 layers { width: 3 } layers { width: 2 activation: IDENTITY } }\n";
// Fashion-MNIST's 784 inputs -> 8 hidden -> 10 classes, for real trainers.
const char kSmallModel[] =
    "  model { layers { width: 8 } layers { width: 10 activation: IDENTITY } }\n";

std::string JobText(const std::string& extra, const std::string& model) {
  return absl::StrCat(
      "  job_id: \"tt\"\n", model,
      "  topology { replicas: 2 }\n"
      "  weighting { policy: UNIFORM }\n"
      "  fault_tolerance { heartbeat_interval_ms: 200 failure_timeout_ms: 5000 "
      "reconnect_grace_ms: 10000 }\n",
      extra);
}

class Server {
 public:
  explicit Server(const std::string& job_extra = "", bool durable = false,
                  const std::string& model = kTinyModel)
      : dir_(MakeTempDir("training")) {
    std::string config = absl::StrCat("listen_address: \"127.0.0.1:0\"\njob {\n",
                                      JobText(job_extra, model),
                                      "}\nmax_wait_ms: 2000\n");
    if (durable) absl::StrAppend(&config, "durability { data_dir: \"", dir_, "/data\" }\n");
    WriteFileOrDie(dir_ + "/server.pbtxt", config);
    Start();
  }

  void Start() {
    const std::string port_file = dir_ + "/port";
    unlink(port_file.c_str());
    const std::string listen = port_ == 0 ? "127.0.0.1:0" : absl::StrCat("127.0.0.1:", port_);
    auto process = Subprocess::Start({Runfile("server/rebound_server"), "--config",
                                      dir_ + "/server.pbtxt", "--listen", listen, "--port_file",
                                      port_file},
                                     dir_ + "/server.log");
    REQUIRE(process.ok());
    process_ = *std::move(process);
    auto port = WaitForPortFile(port_file, *process_, absl::Seconds(30));
    REQUIRE(port.ok());
    port_ = *port;
    stub_ = ParameterServer::NewStub(
        grpc::CreateChannel(address(), grpc::InsecureChannelCredentials()));
  }

  void Kill() {
    process_->Signal(SIGKILL);
    REQUIRE(process_->WaitFor(absl::Seconds(10)).has_value());
  }

  template <typename Request, typename Response>
  grpc::Status Call(grpc::Status (ParameterServer::Stub::*method)(grpc::ClientContext*,
                                                                   const Request&, Response*),
                    const Request& request, Response* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return ((*stub_).*method)(&context, request, response);
  }

  // Registers a test client; returns its reply.
  RegisterResponse Register(const std::string& name, WorkerRole role) {
    RegisterRequest request;
    request.set_worker_name(name);
    request.set_requested_role(role);
    RegisterResponse response;
    const grpc::Status status = Call(&ParameterServer::Stub::Register, request, &response);
    REQUIRE(status.ok());
    return response;
  }

  PullResponse Pull(uint64_t incarnation) {
    PullRequest request;
    request.set_incarnation(incarnation);
    request.set_stage(0);
    PullResponse response;
    const grpc::Status status = Call(&ParameterServer::Stub::Pull, request, &response);
    REQUIRE(status.ok());
    return response;
  }

  GetStatusResponse Status() {
    GetStatusResponse response;
    REQUIRE(Call(&ParameterServer::Stub::GetStatus, GetStatusRequest(), &response).ok());
    return response;
  }

  GetStatusResponse WaitForStatus(const std::function<bool(const GetStatusResponse&)>& done,
                                  absl::Duration limit = absl::Seconds(120)) {
    const absl::Time deadline = absl::Now() + limit;
    GetStatusResponse status = Status();
    while (!done(status)) {
      if (absl::Now() > deadline) FAIL("state not reached:\n" << status.DebugString());
      absl::SleepFor(absl::Milliseconds(100));
      status = Status();
    }
    return status;
  }

  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  int port_ = 0;
  std::unique_ptr<Subprocess> process_;
  std::unique_ptr<ParameterServer::Stub> stub_;
};

std::vector<float> Floats(const Tensor& tensor) {
  std::vector<float> values(tensor.data().size() / sizeof(float));
  std::memcpy(values.data(), tensor.data().data(), tensor.data().size());
  return values;
}

Tensor WithFloats(Tensor tensor, const std::vector<float>& values) {
  tensor.set_data(values.data(), values.size() * sizeof(float));
  return tensor;
}

// The bundle with every value shifted by `delta`.
TensorBundle Shifted(const TensorBundle& bundle, float delta) {
  TensorBundle out;
  for (const Tensor& t : bundle.tensors()) {
    std::vector<float> values = Floats(t);
    for (float& v : values) v += delta;
    *out.add_tensors() = WithFloats(t, values);
  }
  return out;
}

bool SameBytes(const TensorBundle& a, const TensorBundle& b) {
  if (a.tensors_size() != b.tensors_size()) return false;
  for (int i = 0; i < a.tensors_size(); ++i) {
    if (a.tensors(i).data() != b.tensors(i).data()) return false;
  }
  return true;
}

SyncRequest MakeSync(const RegisterResponse& trainer, int64_t step, const TensorBundle& params) {
  SyncRequest request;
  request.set_incarnation(trainer.incarnation());
  *request.mutable_slot() = trainer.slot();
  request.set_step(step);
  *request.mutable_params() = params;
  return request;
}

TEST_CASE("a sync moves the center toward the worker and a retried sync is applied once") {
  Server server;
  const RegisterResponse trainer = server.Register("t0", TRAINER);
  REQUIRE(trainer.role() == TRAINER);
  const PullResponse start = server.Pull(trainer.incarnation());
  CHECK(start.center_version() == 0);
  REQUIRE(start.center().tensors_size() == 4);  // two weights, two biases

  const TensorBundle x = Shifted(start.center(), 0.5f);
  SyncResponse reply;
  REQUIRE(server.Call(&ParameterServer::Stub::Sync, MakeSync(trainer, 8, x), &reply).ok());
  CHECK(SameBytes(reply.center_before(), start.center()));
  CHECK(reply.center_version() == 1);
  CHECK(reply.weight() == 1.0);
  CHECK(reply.moving_rate() == 0.45);  // 0.9 / R

  // The center moved by alpha * w * (x - c), element by element in float.
  const PullResponse moved = server.Pull(trainer.incarnation());
  CHECK(moved.center_version() == 1);
  const float rate = static_cast<float>(0.45 * 1.0);
  for (int i = 0; i < 4; ++i) {
    const std::vector<float> c = Floats(start.center().tensors(i));
    const std::vector<float> xs = Floats(x.tensors(i));
    const std::vector<float> now = Floats(moved.center().tensors(i));
    for (size_t j = 0; j < c.size(); ++j) {
      const float diff = xs[j] - c[j];
      CHECK(now[j] == c[j] + rate * diff);
    }
  }

  // The reply was "lost": the same sync again changes nothing and returns the worker's
  // post-sync state x - alpha (x - c_before) as the server stored it.
  SyncResponse again;
  REQUIRE(server.Call(&ParameterServer::Stub::Sync, MakeSync(trainer, 8, x), &again).ok());
  CHECK(again.center_before().tensors_size() == 0);
  REQUIRE(again.worker_params_after().tensors_size() == 4);
  CHECK(again.center_version() == 1);
  for (int i = 0; i < 4; ++i) {
    const std::vector<float> c = Floats(start.center().tensors(i));
    const std::vector<float> xs = Floats(x.tensors(i));
    const std::vector<float> after = Floats(again.worker_params_after().tensors(i));
    for (size_t j = 0; j < c.size(); ++j) {
      const float diff = c[j] - xs[j];
      CHECK(after[j] == xs[j] + static_cast<float>(0.45) * diff);
    }
  }
  CHECK(server.Pull(trainer.incarnation()).center_version() == 1);

  // An older step is stale.
  SyncResponse stale;
  const grpc::Status status =
      server.Call(&ParameterServer::Stub::Sync, MakeSync(trainer, 4, x), &stale);
  CHECK(status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(absl::StrContains(status.error_message(), "already synced step 8"));
}

TEST_CASE("malformed or hostile syncs get the precise status and change nothing") {
  Server server;
  const RegisterResponse trainer = server.Register("t0", TRAINER);
  const RegisterResponse other = server.Register("t1", TRAINER);
  const TensorBundle center = server.Pull(trainer.incarnation()).center();
  SyncResponse reply;
  auto sync = [&](const SyncRequest& request) {
    return server.Call(&ParameterServer::Stub::Sync, request, &reply);
  };

  TensorBundle missing = center;
  missing.mutable_tensors()->RemoveLast();
  grpc::Status status = sync(MakeSync(trainer, 8, missing));
  CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(status.error_message() == "params: expected 4 tensors, got 3");

  TensorBundle reshaped = center;
  reshaped.mutable_tensors(0)->set_shape(0, 4);
  reshaped.mutable_tensors(0)->set_shape(1, 3);
  status = sync(MakeSync(trainer, 8, reshaped));
  CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(status.error_message() == "params.tensors[0]: layer0.weight must have shape [3, 4], got [4, 3]");

  TensorBundle short_data = center;
  short_data.mutable_tensors(1)->set_data(center.tensors(1).data().substr(1));
  status = sync(MakeSync(trainer, 8, short_data));
  CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(status.error_message() == "params.tensors[1]: 11 data bytes, shape needs 12");

  TensorBundle poisoned = center;
  std::vector<float> values = Floats(center.tensors(2));
  values[1] = NAN;
  *poisoned.mutable_tensors(2) = WithFloats(center.tensors(2), values);
  status = sync(MakeSync(trainer, 8, poisoned));
  CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(status.error_message() == "params.tensors[2]: non-finite value nan at index 1");

  SyncRequest foreign = MakeSync(trainer, 8, center);
  *foreign.mutable_slot() = other.slot();
  status = sync(foreign);
  CHECK(status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(absl::StrContains(status.error_message(), "does not own slot (1, 0)"));

  SyncRequest outside = MakeSync(trainer, 8, center);
  outside.mutable_slot()->set_replica(7);
  CHECK(sync(outside).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(sync(MakeSync(trainer, 0, center)).error_code() == grpc::StatusCode::INVALID_ARGUMENT);

  PushRequest push;
  push.set_incarnation(trainer.incarnation());
  *push.mutable_slot() = trainer.slot();
  PushResponse pushed;
  CHECK(server.Call(&ParameterServer::Stub::Push, push, &pushed).error_code() ==
        grpc::StatusCode::FAILED_PRECONDITION);

  // Nothing was applied, and the NaN counted against its sender.
  CHECK(server.Pull(trainer.incarnation()).center_version() == 0);
  const GetStatusResponse status_now = server.Status();
  CHECK(status_now.slots(0).weight().fault_score() > 0.9);  // raised for each of 4 bad syncs...
  CHECK(status_now.slots(1).weight().fault_score() == 0.0);
}

TEST_CASE("an acknowledged sync survives a SIGKILL of the server, and so does the trainer") {
  Server server("", /*durable=*/true);
  const RegisterResponse trainer = server.Register("t0", TRAINER);
  const TensorBundle x = Shifted(server.Pull(trainer.incarnation()).center(), -0.25f);
  SyncResponse reply;
  REQUIRE(server.Call(&ParameterServer::Stub::Sync, MakeSync(trainer, 8, x), &reply).ok());
  const PullResponse before = server.Pull(trainer.incarnation());
  REQUIRE(before.center_version() == 1);

  server.Kill();
  server.Start();
  // The trainer's incarnation is known again (within reconnect_grace): it heartbeats and pulls.
  HeartbeatRequest beat;
  beat.set_incarnation(trainer.incarnation());
  HeartbeatResponse ack;
  CHECK(server.Call(&ParameterServer::Stub::Heartbeat, beat, &ack).ok());
  const PullResponse after = server.Pull(trainer.incarnation());
  CHECK(after.center_version() == 1);
  CHECK(SameBytes(after.center(), before.center()));
  // The sync it may retry after the crash is recognised and not applied twice.
  SyncResponse retried;
  REQUIRE(server.Call(&ParameterServer::Stub::Sync, MakeSync(trainer, 8, x), &retried).ok());
  CHECK(retried.worker_params_after().tensors_size() == 4);
  CHECK(server.Pull(trainer.incarnation()).center_version() == 1);
  // New registrations get new incarnations: the counter survived too.
  CHECK(server.Register("t1", TRAINER).incarnation() > trainer.incarnation());
}

TEST_CASE("server-side AdaHessian applies each push sequence exactly once, in order") {
  Server server("  easgd { mode: ASYNC_ADAHESSIAN }\n");
  const RegisterResponse trainer = server.Register("t0", TRAINER);
  const TensorBundle center = server.Pull(trainer.incarnation()).center();
  auto push = [&](uint64_t sequence, PushResponse* reply) {
    PushRequest request;
    request.set_incarnation(trainer.incarnation());
    *request.mutable_slot() = trainer.slot();
    request.set_sequence(sequence);
    request.set_step(static_cast<int64_t>(sequence));
    *request.mutable_gradient() = Shifted(center, 1.0f);
    *request.mutable_hessian_diag() = Shifted(center, 2.0f);
    return server.Call(&ParameterServer::Stub::Push, request, reply);
  };
  PushResponse reply;
  REQUIRE(push(1, &reply).ok());
  CHECK(reply.applied());
  CHECK(reply.center_version() == 1);
  const TensorBundle once = server.Pull(trainer.incarnation()).center();
  CHECK_FALSE(SameBytes(once, center));

  REQUIRE(push(1, &reply).ok());
  CHECK_FALSE(reply.applied());
  CHECK(reply.applied_sequence() == 1);
  CHECK(SameBytes(server.Pull(trainer.incarnation()).center(), once));

  const grpc::Status gap = push(3, &reply);
  CHECK(gap.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(absl::StrContains(gap.error_message(), "the next one is 2"));

  REQUIRE(push(2, &reply).ok());
  CHECK(reply.applied());
  CHECK(reply.center_version() == 2);

  SyncResponse sync;
  CHECK(server.Call(&ParameterServer::Stub::Sync, MakeSync(trainer, 8, center), &sync)
            .error_code() == grpc::StatusCode::FAILED_PRECONDITION);
}

// Runs a whole job with two real trainers and returns the final center.
TensorBundle RunDeterministicJob() {
  Server server(
      "  scheduling: DETERMINISTIC\n"
      "  data { batch_size: 16 micro_batches: 4 train_limit: 600 test_limit: 100 }\n"
      "  adahessian { lr: 0.01 }\n"
      "  easgd { sync_period: 4 }\n"
      "  training { max_steps: 40 }\n",
      /*durable=*/false, kSmallModel);
  WriteFileOrDie(server.dir() + "/worker.pbtxt", "backoff_initial_ms: 20\nbackoff_max_ms: 200\n");
  std::vector<std::unique_ptr<Subprocess>> workers;
  for (const char* name : {"a", "b"}) {
    auto worker = Subprocess::Start({Runfile("worker/rebound_worker"), "--config",
                                     server.dir() + "/worker.pbtxt", "--server", server.address(),
                                     "--name", name, "--role", "trainer"},
                                    server.dir() + "/" + name + ".log");
    REQUIRE(worker.ok());
    workers.push_back(*std::move(worker));
  }
  server.WaitForStatus([](const GetStatusResponse& s) {
    for (const SlotStatus& slot : s.slots()) {
      if (slot.state() != FINISHED) return false;
    }
    return true;
  });
  for (auto& worker : workers) CHECK(worker->WaitFor(absl::Seconds(30)) == 0);
  const RegisterResponse observer = server.Register("observer", SPARE);
  const PullResponse center = server.Pull(observer.incarnation());
  CHECK(center.center_version() == 20);  // 2 trainers x 40 / 4 syncs
  return center.center();
}

TEST_CASE("DETERMINISTIC scheduling with UNIFORM weights reproduces a run bit for bit") {
  const TensorBundle first = RunDeterministicJob();
  const TensorBundle second = RunDeterministicJob();
  CHECK(SameBytes(first, second));
}

}  // namespace
}  // namespace rebound::testing
