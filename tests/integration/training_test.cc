// The parameter server's training calls against the real rebound_server binary on loopback: a
// test client plays a trainer over gRPC where the protocol itself is checked, and real
// rebound_worker trainers run where whole runs are checked.

#include <catch2/catch.hpp>
#include <signal.h>

#include <algorithm>
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
#include "storage/durable_store.h"
#include "tests/integration/status_util.h"
#include "testing/cluster/processes.h"
#include "testing/cluster/time_scale.h"
#include "tests/integration/worker_credentials.h"

namespace rebound::testing {
namespace {

// 4 inputs -> 3 hidden -> 2 classes: small enough to reason about every value.
const char kTinyModel[] =
    "  model { input_dim: 4 layers { width: 3 } layers { width: 2 activation: IDENTITY } }\n";
// Fashion-MNIST's 784 inputs -> 8 hidden -> 10 classes, for real trainers.
const char kSmallModel[] =
    "  model { layers { width: 8 } layers { width: 10 activation: IDENTITY } }\n";

std::string JobText(const std::string& extra, const std::string& model, int replicas,
                    const std::string& weighting) {
  return absl::StrCat(
      "  job_id: \"tt\"\n", model, "  topology { replicas: ", replicas, " }\n",
      "  weighting { policy: ", weighting, " }\n"
      "  fault_tolerance { heartbeat_interval_ms: 200 failure_timeout_ms: 5000 "
      "reconnect_grace_ms: 10000 }\n",
      extra);
}

class Server {
 public:
  explicit Server(const std::string& job_extra = "", bool durable = false,
                  const std::string& model = kTinyModel, int replicas = 2,
                  const std::string& weighting = "UNIFORM")
      : dir_(MakeTempDir("training")) {
    std::string config = absl::StrCat("listen_address: \"127.0.0.1:0\"\njob {\n",
                                      JobText(job_extra, model, replicas, weighting),
                                      "}\nmax_wait_ms: 2000\n");
    if (durable) absl::StrAppend(&config, "durability { data_dir: \"", dir_, "/data\" }\n");
    WriteFileOrDie(dir_ + "/server.pbtxt", ScaledServerConfig(config));
    Start();
  }

  void Start() {
    ServerStart start;
    start.binary = Runfile("server/rebound_server");
    start.config = dir_ + "/server.pbtxt";
    start.listen = absl::StrCat("127.0.0.1:", port_);  // a restart keeps the port
    start.port_file = dir_ + "/port";
    start.log = dir_ + "/server.log";
    start.wait = Scaled(absl::Seconds(30));
    const absl::StatusOr<int> port = StartServerProcess(start, &process_);
    INFO(port.status());
    REQUIRE(port.ok());
    port_ = *port;
    stub_ = ParameterServer::NewStub(
        grpc::CreateChannel(address(), grpc::InsecureChannelCredentials()));
  }

  void Kill() {
    process_->Signal(SIGKILL);
    REQUIRE(process_->WaitFor(Scaled(absl::Seconds(10))).has_value());
  }

  template <typename Request, typename Response>
  grpc::Status Call(grpc::Status (ParameterServer::Stub::*method)(grpc::ClientContext*,
                                                                   const Request&, Response*),
                    const Request& request, Response* response) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
    WorkerCredentials::AddTo(&context, credentials_.For(request));
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
    credentials_.Remember(response);
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
    const absl::Time deadline = absl::Now() + Scaled(limit);
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
  WorkerCredentials credentials_;
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

// Fault scores follow workers (docs/design.md §4.5, issue R11) and are persisted with the weights.
// A long half-life keeps the scores where they were across the restart, whatever the machine.
const char kSlowDecay[] = "DYNAMIC fault_half_life_s: 36000";

// Registers t0 and t1; t0 syncs once, then its next sync is refused (NaN: a fault of "t0"); t1's
// sync is applied after that (its weight record carries the table of worker scores). Returns
// t0's score then.
double ChargeT0(Server& server) {
  const RegisterResponse t0 = server.Register("t0", TRAINER);
  const RegisterResponse t1 = server.Register("t1", TRAINER);
  const TensorBundle center = server.Pull(t0.incarnation()).center();
  SyncResponse reply;
  REQUIRE(server.Call(&ParameterServer::Stub::Sync, MakeSync(t0, 8, Shifted(center, 0.25f)),
                      &reply)
              .ok());
  const grpc::Status refused = server.Call(
      &ParameterServer::Stub::Sync,
      MakeSync(t0, 16, Mapped(center, [](size_t, float) { return NAN; })), &reply);
  REQUIRE(refused.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  REQUIRE(server.Call(&ParameterServer::Stub::Sync, MakeSync(t1, 8, Shifted(center, -0.25f)),
                      &reply)
              .ok());
  const GetStatusResponse status = server.Status();
  const WorkerStatus* w0 = FindWorker(status, "t0", TRAINER);
  REQUIRE(w0 != nullptr);
  CHECK(w0->fault_score() == Approx(0.5).epsilon(0.01));
  CHECK(status.slots(0).weight().fault_score() == Approx(w0->fault_score()));
  CHECK(FindWorker(status, "t1", TRAINER)->fault_score() == 0.0);
  return w0->fault_score();
}

// After a restart: t0's name (restored as slot 0's owner) has about `score`, t1's none.
void CheckRestoredScores(Server& server, double score) {
  const GetStatusResponse after = server.Status();
  INFO(after.DebugString());
  const WorkerStatus* w0 = FindWorker(after, "t0", TRAINER);
  const WorkerStatus* w1 = FindWorker(after, "t1", TRAINER);
  REQUIRE(w0 != nullptr);
  REQUIRE(w1 != nullptr);
  CHECK(w0->fault_score() == Approx(score).epsilon(0.01));
  CHECK(after.slots(0).weight().fault_score() == Approx(score).epsilon(0.01));
  CHECK(after.slots(0).weight().weight() == Approx(1.0 - score).epsilon(0.01));
  CHECK(w1->fault_score() == 0.0);
  CHECK(after.slots(1).weight().fault_score() == 0.0);
}

TEST_CASE("a worker's fault score survives a SIGKILL of the server") {
  Server server("", /*durable=*/true, kTinyModel, 2, kSlowDecay);
  const double score = ChargeT0(server);
  server.Kill();
  server.Start();
  CheckRestoredScores(server, score);
}

TEST_CASE("a data directory of the old form (a fault score per slot) loads: each slot's score "
          "goes to its stored owner's name") {
  Server server("", /*durable=*/true, kTinyModel, 2, kSlowDecay);
  const double score = ChargeT0(server);
  server.Kill();
  {
    // Rewrite the weight records as a server before R11 wrote them: the score is the slot's,
    // there is no owner and no table of worker scores.
    storage::DurableStoreOptions options;
    options.data_dir = server.dir() + "/data";
    auto store = storage::DurableStore::Open(options);
    INFO(store.status());
    REQUIRE(store.ok());
    auto state = (*store)->LoadAll();
    REQUIRE(state.ok());
    REQUIRE(state->weights.size() == 2);
    storage::WriteBatch batch;
    for (auto [key, record] : state->weights) {
      record.clear_faults_by_worker();
      record.clear_owner_name();
      record.clear_worker_faults();
      record.set_fault_score(record.slot().replica() == 0 ? score : 0.0);
      record.set_fault_updated_unix_ms(absl::ToUnixMillis(absl::Now()));
      batch.PutWeight(record);
    }
    REQUIRE((*store)->Commit(batch).ok());
  }
  server.Start();
  CheckRestoredScores(server, score);
  CHECK(absl::StrContains(ReadFileOrEmpty(server.dir() + "/server.log"),
                          "its fault score 0.5 now belongs to its owner 't0'"));
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

TEST_CASE("a fenced incarnation can neither sync nor push") {
  Server server;
  const RegisterResponse trainer = server.Register("t0", TRAINER);
  const TensorBundle center = server.Pull(trainer.incarnation()).center();
  DeregisterRequest leave;
  leave.set_incarnation(trainer.incarnation());
  DeregisterResponse left;
  REQUIRE(server.Call(&ParameterServer::Stub::Deregister, leave, &left).ok());
  SyncResponse reply;
  const grpc::Status sync =
      server.Call(&ParameterServer::Stub::Sync, MakeSync(trainer, 8, center), &reply);
  CHECK(sync.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(absl::StrContains(sync.error_message(), "is fenced: DEPARTED"));

  Server async("  easgd { mode: ASYNC_ADAHESSIAN }\n");
  const RegisterResponse pusher = async.Register("p0", TRAINER);
  const TensorBundle async_center = async.Pull(pusher.incarnation()).center();
  leave.set_incarnation(pusher.incarnation());
  REQUIRE(async.Call(&ParameterServer::Stub::Deregister, leave, &left).ok());
  PushRequest push;
  push.set_incarnation(pusher.incarnation());
  *push.mutable_slot() = pusher.slot();
  push.set_sequence(1);
  push.set_step(1);
  *push.mutable_gradient() = async_center;
  *push.mutable_hessian_diag() = async_center;
  PushResponse pushed;
  const grpc::Status refused = async.Call(&ParameterServer::Stub::Push, push, &pushed);
  CHECK(refused.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(async.Status().centers(0).version() == 0);
}

TEST_CASE("under DYNAMIC a trainer far from the center loses weight and regains it") {
  Server server("", /*durable=*/false, kTinyModel, /*replicas=*/3, "DYNAMIC");
  REQUIRE(server.Status().weighting() == DYNAMIC);
  std::vector<RegisterResponse> trainers;
  for (const char* name : {"t0", "t1", "t2"}) trainers.push_back(server.Register(name, TRAINER));
  int64_t step = 0;
  std::vector<double> weights(3);
  auto round = [&](float far_shift) {
    step += 8;
    for (int r = 0; r < 3; ++r) {
      const TensorBundle c = server.Pull(trainers[r].incarnation()).center();
      SyncResponse reply;
      REQUIRE(server
                  .Call(&ParameterServer::Stub::Sync,
                        MakeSync(trainers[r], step, Shifted(c, r == 2 ? far_shift : 0.01f)),
                        &reply)
                  .ok());
      weights[r] = reply.weight();
    }
    absl::SleepFor(absl::Milliseconds(100));
  };
  round(0.01f);
  round(0.01f);
  round(5.0f);  // t2 is 500x farther from the center than the others
  CHECK(weights[2] < 0.5);
  CHECK(weights[0] > 0.5);
  round(0.01f);
  round(0.01f);
  CHECK(weights[2] > 0.7);
}

// Runs a whole job with two real trainers and returns the final center. With `kill_at` > 0
// trainer "b" is SIGKILLed once its slot passes that step, and a spare rebuilds it by replay.
TensorBundle RunDeterministicJob(int64_t kill_at = 0, int64_t max_steps = 40, int tau = 4,
                                 const std::string& model = kSmallModel,
                                 const std::string& adahessian = "lr: 0.01") {
  Server server(
      absl::StrCat("  scheduling: DETERMINISTIC\n"
                   "  data { batch_size: 16 micro_batches: 4 train_limit: 600 test_limit: 100 }\n"
                   "  adahessian { ",
                   adahessian,
                   " }\n"
                   // Ship each step's records at once: with syncs every few milliseconds a
                   // linger would let the snapshots cover (and drop) every record.
                   "  step_log { linger_ms: 0 }\n"
                   "  easgd { sync_period: ",
                   tau, " }\n  training { max_steps: ", max_steps, " }\n"),
      /*durable=*/false, model);
  WriteFileOrDie(server.dir() + "/worker.pbtxt",
                 ScaledWorkerConfig("backoff_initial_ms: 20\nbackoff_max_ms: 200\n"));
  std::vector<std::unique_ptr<Subprocess>> workers;
  for (const char* name : {"a", "b"}) {
    auto worker = Subprocess::Start({Runfile("worker/rebound_worker"), "--config",
                                     server.dir() + "/worker.pbtxt", "--server", server.address(),
                                     "--name", name, "--role", "trainer"},
                                    server.dir() + "/" + name + ".log");
    REQUIRE(worker.ok());
    workers.push_back(*std::move(worker));
    // One after the other, so that "a" owns slot 0 and "b" slot 1 in every run.
    server.WaitForStatus([&](const GetStatusResponse& s) {
      for (const WorkerStatus& w : s.workers()) {
        if (w.name() == name && w.state() == ALIVE) return true;
      }
      return false;
    });
  }
  if (kill_at > 0) {
    auto spare = Subprocess::Start({Runfile("worker/rebound_worker"), "--config",
                                    server.dir() + "/worker.pbtxt", "--server", server.address(),
                                    "--name", "spare", "--role", "spare"},
                                   server.dir() + "/spare.log");
    REQUIRE(spare.ok());
    workers.push_back(*std::move(spare));
    // Kill mid-interval, well after the last sync, so that logged, unsynced steps remain
    // (in DETERMINISTIC mode a trainer often waits inside its sync for the other's turn).
    const GetStatusResponse at_kill = server.WaitForStatus([&](const GetStatusResponse& s) {
      return (s.slots(1).step() >= kill_at && s.slots(1).step() % tau >= tau / 2) ||
             s.slots(1).state() == FINISHED;
    });
    REQUIRE(at_kill.slots(1).state() != FINISHED);
    workers[1]->Signal(SIGKILL);
    // 128 + SIGKILL; anything else means it finished before the kill and the test proves nothing.
    REQUIRE(workers[1]->WaitFor(Scaled(absl::Seconds(10))).value_or(-1) == 128 + SIGKILL);
  }
  const GetStatusResponse done = server.WaitForStatus([](const GetStatusResponse& s) {
    for (const SlotStatus& slot : s.slots()) {
      if (slot.state() != FINISHED) return false;
    }
    return true;
  });
  for (size_t i = 0; i < workers.size(); ++i) {
    if (kill_at > 0 && i == 1) continue;
    CHECK(workers[i]->WaitFor(Scaled(absl::Seconds(30))) == 0);
  }
  if (kill_at > 0) {
    REQUIRE(done.recoveries_size() == 1);
    const RecoveryStatus& recovery = done.recoveries(0);
    INFO(recovery.DebugString());
    CHECK(recovery.policy() == REPLAY);
    CHECK(recovery.outcome() == RECOVERED);
    CHECK(recovery.verified());
    CHECK(recovery.steps_replayed() > 0);
    CHECK(recovery.slot().replica() == 1);
    // The operator's view of the same recovery.
    std::string table;
    REQUIRE(RunCommand({Runfile("tools/reboundctl"), "--server", server.address(), "recoveries"},
                       &table, Scaled(absl::Seconds(30))) == 0);
    INFO(table);
    CHECK(absl::StrContains(table, "(1,0)   REPLAY               RECOVERED"));
    CHECK(absl::StrContains(table, " yes "));
  }
  const RegisterResponse observer = server.Register("observer", SPARE);
  const PullResponse center = server.Pull(observer.incarnation());
  CHECK(center.center_version() == 2 * max_steps / tau);
  // Every step was logged: M = 4 micro-batch records and one checksum record per step, except
  // those a sync's snapshot had already covered when they arrived (the log ships asynchronously).
  if (kill_at == 0) {
    const StepLogStatus log = server.Status().step_log();
    CHECK(log.records_written() + log.below_snapshot_dropped() == 2 * max_steps * 5);
    CHECK(log.records_written() > 0);
    CHECK(log.duplicates_dropped() == 0);
  }
  return center.center();
}

TEST_CASE("DETERMINISTIC scheduling with UNIFORM weights reproduces a run bit for bit") {
  const TensorBundle first = RunDeterministicJob();
  const TensorBundle second = RunDeterministicJob();
  CHECK(SameBytes(first, second));
}

TEST_CASE("a trainer killed and rebuilt by replay ends bit-identical to the run without failure") {
  // A long sync period: the kill lands between syncs, leaving logged, unsynced steps to replay.
  // A wider hidden layer makes steps slow enough (about 2 ms) for the kill to land mid-interval.
  const char* model = "  model { layers { width: 512 } layers { width: 10 activation: IDENTITY } }\n";
  // A warm-up and cosine schedule: every replayed step must use the lr of its own step t. The
  // kill lands in the decay, after the warm-up, in the second half of a sync interval (R16: 400
  // steps cross the same phases as the 1,600 they replaced, in a quarter of the time).
  const char* adahessian =
      "lr: 0.01 warmup_steps: 50 lr_decay: LR_COSINE decay_steps: 400 final_lr_fraction: 0.1";
  const TensorBundle clean = RunDeterministicJob(0, 400, 100, model, adahessian);
  const TensorBundle rebuilt = RunDeterministicJob(250, 400, 100, model, adahessian);
  CHECK(SameBytes(clean, rebuilt));
}

std::unique_ptr<Subprocess> StartTrainer(const Server& server, const std::string& name) {
  auto worker = Subprocess::Start({Runfile("worker/rebound_worker"), "--config",
                                   server.dir() + "/worker.pbtxt", "--server", server.address(),
                                   "--name", name, "--role", "trainer"},
                                  server.dir() + "/" + name + ".log");
  REQUIRE(worker.ok());
  return *std::move(worker);
}

TEST_CASE("training goes on across a SIGKILL of the server and every sync is applied once") {
  Server server(
      "  data { batch_size: 16 micro_batches: 4 train_limit: 2000 test_limit: 100 }\n"
      "  adahessian { lr: 0.01 }\n"
      "  easgd { sync_period: 8 }\n"
      "  training { max_steps: 800 }\n",
      /*durable=*/true, kSmallModel);
  WriteFileOrDie(server.dir() + "/worker.pbtxt",
                 ScaledWorkerConfig(
                     "backoff_initial_ms: 20\nbackoff_max_ms: 300\nrpc_deadline_ms: 3000\n"));
  auto a = StartTrainer(server, "a");
  auto b = StartTrainer(server, "b");
  server.WaitForStatus([](const GetStatusResponse& s) {
    return s.slots(0).snapshot_step() >= 80 && s.slots(1).snapshot_step() >= 80;
  });
  const GetStatusResponse before = server.Status();
  REQUIRE_FALSE(AllFinished(before));
  server.Kill();
  absl::SleepFor(absl::Milliseconds(500));  // the trainers' syncs fail and back off meanwhile
  server.Start();
  const GetStatusResponse after = server.WaitForStatus(AllFinished);
  CHECK(a->WaitFor(Scaled(absl::Seconds(30))) == 0);
  CHECK(b->WaitFor(Scaled(absl::Seconds(30))) == 0);
  // The trainers kept their incarnations: they never had to register again.
  CHECK(after.slots(0).owner_incarnation() == before.slots(0).owner_incarnation());
  CHECK(after.slots(1).owner_incarnation() == before.slots(1).owner_incarnation());
  // From the server's durable record: 800 / 8 = 100 syncs per slot, each applied exactly once,
  // so the center moved exactly 200 times.
  CHECK(after.slots(0).update_count() == 100);
  CHECK(after.slots(1).update_count() == 100);
  CHECK(after.centers(0).version() == 200);
}

TEST_CASE("under DYNAMIC a trainer frozen by SIGSTOP loses weight and regains it") {
  Server server(
      "  data { batch_size: 64 micro_batches: 4 train_limit: 3000 test_limit: 100 }\n"
      "  adahessian { lr: 0.01 }\n"
      "  easgd { sync_period: 64 }\n"
      "  training { max_steps: 100000000 }\n",
      /*durable=*/false, kSmallModel, /*replicas=*/3, "DYNAMIC");
  WriteFileOrDie(server.dir() + "/worker.pbtxt",
                 ScaledWorkerConfig("backoff_initial_ms: 20\nbackoff_max_ms: 300\n"));
  std::vector<std::unique_ptr<Subprocess>> trainers;
  for (const char* name : {"a", "b", "c"}) trainers.push_back(StartTrainer(server, name));
  server.WaitForStatus([](const GetStatusResponse& s) {
    for (const SlotStatus& slot : s.slots()) {
      if (slot.update_count() < 3) return false;
    }
    return true;
  });
  // The trainers registered concurrently: find the slot that "c" owns.
  int c = -1;
  const GetStatusResponse registered = server.Status();
  for (const WorkerStatus& w : registered.workers()) {
    if (w.name() == "c") c = w.slot().replica();
  }
  REQUIRE(c >= 0);
  // Freeze c for 2.5 s: well below failure_timeout (5 s), far above a sync interval (scaled, as
  // the failure timeout is: a slower build's sync interval is longer).
  trainers[2]->Signal(SIGSTOP);
  absl::SleepFor(Scaled(absl::Milliseconds(2500)));
  const int64_t count_at_resume = server.Status().slots(c).update_count();
  trainers[2]->Signal(SIGCONT);
  // Its syncs after the freeze are late, stale and far from the center that moved meanwhile
  // (which of these dominates when the status is read depends on how many syncs it made by
  // then): its weight falls below 0.5.
  const GetStatusResponse low = server.WaitForStatus([&](const GetStatusResponse& s) {
    return s.slots(c).update_count() > count_at_resume;
  });
  const WeightInputs& inputs = low.slots(c).weight();
  INFO(inputs.DebugString());
  CHECK(inputs.weight() < 0.5);
  CHECK(std::max({inputs.staleness(), inputs.lateness(), inputs.divergence()}) > 2.0);
  CHECK(inputs.fault_score() == 0.0);  // not failed: only slow
  // Back to its normal pace, it regains its weight.
  const GetStatusResponse recovered = server.WaitForStatus([&](const GetStatusResponse& s) {
    return s.slots(c).update_count() >= count_at_resume + 4 && s.slots(c).weight().weight() > 0.5;
  });
  CHECK(recovered.slots(c).weight().weight() > 0.5);
  CHECK(recovered.slots(c).state() == ACTIVE);
}

}  // namespace
}  // namespace rebound::testing
