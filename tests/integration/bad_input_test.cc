// The bad-input matrix of docs/bad_input.md, against the real rebound_server and rebound_worker
// binaries on loopback: malformed configs, malformed tensors, NaN and Inf, messages over the size
// limit, unknown, fenced and foreign incarnations, out-of-range steps, replayed sequence numbers,
// a corrupt data directory and a truncated data set. Every case asserts the exact status code and
// a distinctive part of the message, and that the server is unharmed: it still answers, the
// center, its version and every slot's applied updates are unchanged, and a valid request that
// follows still succeeds.
//
// The test registers itself as trainers and spares (test clients that never heartbeat), so the
// jobs here have a failure timeout longer than any test case.

#include <catch2/catch.hpp>
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/client_unary_call.h"
#include "grpcpp/impl/codegen/rpc_method.h"
#include "proto/health.grpc.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "common/version.h"
#include "storage/durable_store.h"
#include "storage/format_version.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/trainer_calls.h"
#include "tests/integration/scrape.h"
#include "tests/integration/status_util.h"
#include "testing/cluster/processes.h"
#include "testing/cluster/time_scale.h"
#include "tests/storage/raw_db.h"

namespace rebound::testing {
namespace {

namespace fs = std::filesystem;
using ::Catch::Contains;
using Code = grpc::StatusCode;

// Fashion-MNIST's 784 inputs -> 8 hidden -> 10 classes: tensors 0 (layer0.weight, 8 x 784),
// 1 (layer0.bias, 8), 2 (layer1.weight, 10 x 8) and 3 (layer1.bias, 10); 6370 parameters.
constexpr int kMaxSteps = 80;

struct JobSpec {
  const char* mode = "EASGD";
  const char* weighting = "DYNAMIC";
  std::string data_extra;  // appended inside data { }
  int input_dim = 784;     // the model's; the data set has 784 features
};

std::string JobText(const JobSpec& spec) {
  return absl::StrCat(
      "  job_id: \"bad-input\"\n"
      "  model { input_dim: ", spec.input_dim,
      " layers { width: 8 } layers { width: 10 activation: IDENTITY } }\n"
      "  topology { replicas: 2 }\n"
      "  weighting { policy: ",
      spec.weighting,
      " }\n"
      // Test clients never heartbeat: nobody is declared failed while a test case runs.
      "  fault_tolerance { failure_timeout_ms: 120000 }\n"
      "  data { batch_size: 16 micro_batches: 4 train_limit: 1000 test_limit: 100 ",
      spec.data_extra,
      " }\n"
      "  easgd { mode: ",
      spec.mode,
      " sync_period: 8 }\n"
      "  training { max_steps: ",
      kMaxSteps, " }\n");
}

LocalClusterOptions Options(bool durable = false, const std::string& server_extra = "") {
  LocalClusterOptions options;
  options.name = "bad-input";
  options.durable = durable;
  options.wait_limit = absl::Seconds(60);
  options.server_config_extra = server_extra;
  return options;
}

void SetFloat(Tensor* tensor, size_t index, float value) {
  REQUIRE((index + 1) * sizeof(float) <= tensor->data().size());
  std::memcpy(&(*tensor->mutable_data())[index * sizeof(float)], &value, sizeof(float));
}

// What a bad request must not change: the center, its version and every slot's applied updates.
struct Observed {
  int64_t version = 0;
  size_t center_hash = 0;  // of the serialized center bundle
  std::vector<int64_t> update_counts;
  std::vector<int64_t> snapshot_steps;
};

class BadInputCluster : public TrainerCallsCluster {
 public:
  explicit BadInputCluster(const JobSpec& spec, const LocalClusterOptions& options = Options())
      : TrainerCallsCluster(JobText(spec), options) {}
  using TrainerCallsCluster::MakePush;

  // The center moved by `delta`: valid parameters for a sync.
  TensorBundle ValidParams(float delta = 0.01f) { return Shifted(Center().center(), delta); }

  // A push of (g, D) = (0.01, 1) everywhere: valid for the slot's stage.
  PushRequest MakePush(const RegisterResponse& trainer, uint64_t sequence) {
    return MakePush(trainer, sequence, 0.01f, 1.0f);
  }

  Observed Observe() {
    Observed observed;
    const PullResponse center = Center();
    observed.version = center.center_version();
    observed.center_hash = std::hash<std::string>()(center.center().SerializeAsString());
    const GetStatusResponse status = Status();
    for (const SlotStatus& slot : status.slots()) {
      observed.update_counts.push_back(slot.update_count());
      observed.snapshot_steps.push_back(slot.snapshot_step());
    }
    return observed;
  }

  // The server still answers (it did not crash) and nothing that `before` saw has changed.
  void CheckUnchanged(const Observed& before) {
    const Observed now = Observe();
    CHECK(now.version == before.version);
    CHECK(now.center_hash == before.center_hash);
    CHECK(now.update_counts == before.update_counts);
    CHECK(now.snapshot_steps == before.snapshot_steps);
  }

  double FaultScore(int replica) { return Status().slots(replica).weight().fault_score(); }

};

// ---- tensors --------------------------------------------------------------------------------

Tensor* Param(SyncRequest* request, int index) {
  return request->mutable_params()->mutable_tensors(index);
}

struct TensorCase {
  const char* what;
  std::function<void(SyncRequest*)> damage;
  const char* message;
};

TEST_CASE("a Sync with a wrong tensor count, id, dtype, shape or byte length is INVALID_ARGUMENT "
          "naming the tensor, changes nothing and counts against the sender") {
  BadInputCluster cluster{JobSpec()};
  const RegisterResponse a = cluster.RegisterTrainer("a");
  const RegisterResponse b = cluster.RegisterTrainer("b");
  const std::vector<TensorCase> cases = {
      {"a tensor missing",
       [](SyncRequest* r) { r->mutable_params()->mutable_tensors()->RemoveLast(); },
       "params: expected 4 tensors, got 3"},
      {"no tensors", [](SyncRequest* r) { r->clear_params(); },
       "params: expected 4 tensors, got 0"},
      {"a tensor too many",
       [](SyncRequest* r) { *r->mutable_params()->add_tensors() = r->params().tensors(3); },
       "params: expected 4 tensors, got 5"},
      {"a wrong id", [](SyncRequest* r) { Param(r, 1)->set_id(7); },
       "params.tensors[1]: expected tensor id 1 (layer0.bias), got 7"},
      {"dtype INT32", [](SyncRequest* r) { Param(r, 0)->set_dtype(INT32); },
       "params.tensors[0]: dtype must be FLOAT32, got INT32"},
      {"no dtype", [](SyncRequest* r) { Param(r, 2)->set_dtype(DTYPE_UNSPECIFIED); },
       "params.tensors[2]: dtype must be FLOAT32, got DTYPE_UNSPECIFIED"},
      {"4 bytes short", [](SyncRequest* r) { Param(r, 2)->mutable_data()->resize(316); },
       "params.tensors[2]: 316 data bytes, shape needs 320"},
      {"1 byte long", [](SyncRequest* r) { Param(r, 3)->mutable_data()->push_back('x'); },
       "params.tensors[3]: 41 data bytes, shape needs 40"},
      {"the shape transposed, bytes consistent",
       [](SyncRequest* r) {
         Tensor* t = Param(r, 0);
         t->set_shape(0, 784);
         t->set_shape(1, 8);
       },
       "params.tensors[0]: layer0.weight must have shape [8, 784], got [784, 8]"},
      {"a bias given two dimensions",
       [](SyncRequest* r) {
         Tensor* t = Param(r, 1);
         t->clear_shape();
         t->add_shape(1);
         t->add_shape(8);
       },
       "params.tensors[1]: layer0.bias must have shape [8], got [1, 8]"},
      {"a negative dimension",
       [](SyncRequest* r) { Param(r, 3)->set_shape(0, -10); },
       "params.tensors[3]: tensor 'layer1.bias': shape[0] is negative (-10)"},
      {"a shape whose element count overflows",
       [](SyncRequest* r) {
         Tensor* t = Param(r, 0);
         t->set_shape(0, int64_t{1} << 40);
         t->set_shape(1, int64_t{1} << 40);
       },
       "params.tensors[0]: tensor 'layer0.weight': more than 1099511627776 elements"},
      {"optimizer state of the wrong shape",
       [](SyncRequest* r) {
         *r->mutable_optimizer()->mutable_m() = r->params();
         r->mutable_optimizer()->mutable_m()->mutable_tensors()->RemoveLast();
       },
       "optimizer.m: expected 4 tensors, got 3"},
  };
  const TensorBundle params = cluster.ValidParams();
  const Observed before = cluster.Observe();
  for (const TensorCase& c : cases) {
    SECTION(c.what) {
      SyncRequest request = cluster.MakeSync(a, 8, params);
      c.damage(&request);
      CheckStatus(cluster.Sync(request), Code::INVALID_ARGUMENT, c.message);
      cluster.CheckUnchanged(before);
      // The sender's fault score rose (docs/design.md §4.5); the other slot's did not.
      CHECK(cluster.FaultScore(0) > 0.4);
      CHECK(cluster.FaultScore(1) == 0.0);
      // A valid sync of either slot still goes through.
      SyncResponse reply;
      REQUIRE(cluster.Sync(cluster.MakeSync(a, 8, params), &reply).ok());
      CHECK(reply.center_version() == before.version + 1);
      REQUIRE(cluster.Sync(cluster.MakeSync(b, 8, params)).ok());
      CHECK(cluster.Center().center_version() == before.version + 2);
    }
  }
}

TEST_CASE("NaN or Inf in a Sync is INVALID_ARGUMENT, changes nothing and raises the sender's "
          "fault score, which lowers its next weight") {
  BadInputCluster cluster{JobSpec()};
  const RegisterResponse a = cluster.RegisterTrainer("a");
  const RegisterResponse b = cluster.RegisterTrainer("b");
  const TensorBundle params = cluster.ValidParams();
  const Observed before = cluster.Observe();
  REQUIRE(cluster.FaultScore(0) == 0.0);
  REQUIRE(cluster.FaultScore(1) == 0.0);

  SyncRequest nan = cluster.MakeSync(a, 8, params);
  SetFloat(nan.mutable_params()->mutable_tensors(0), 3, std::numeric_limits<float>::quiet_NaN());
  CheckStatus(cluster.Sync(nan), Code::INVALID_ARGUMENT,
              "params.tensors[0]: non-finite value nan at index 3");
  cluster.CheckUnchanged(before);
  const double fault_a = cluster.FaultScore(0);
  CHECK(fault_a > 0.4);  // +0.5 (fault_increment), decaying with a 60 s half-life
  CHECK(fault_a <= 0.5);
  CHECK(cluster.FaultScore(1) == 0.0);

  // Inf in the optimizer state counts against its sender as well.
  SyncRequest inf = cluster.MakeSync(b, 8, params);
  *inf.mutable_optimizer()->mutable_v() = params;
  SetFloat(inf.mutable_optimizer()->mutable_v()->mutable_tensors(2), 5,
           std::numeric_limits<float>::infinity());
  CheckStatus(cluster.Sync(inf), Code::INVALID_ARGUMENT,
              "optimizer.v.tensors[2]: non-finite value inf at index 5");
  cluster.CheckUnchanged(before);
  CHECK(cluster.FaultScore(1) > 0.4);

  SyncRequest minus_inf = cluster.MakeSync(b, 8, params);
  SetFloat(minus_inf.mutable_params()->mutable_tensors(3), 9,
           -std::numeric_limits<float>::infinity());
  CheckStatus(cluster.Sync(minus_inf), Code::INVALID_ARGUMENT,
              "params.tensors[3]: non-finite value -inf at index 9");
  cluster.CheckUnchanged(before);
  CHECK(cluster.FaultScore(1) > 0.8);  // two faults: 0.5 + 0.5, capped at 1

  // The senders' next valid syncs are applied with their weights cut by the fault score
  // (DYNAMIC weights, first sync: every other input is neutral, w = 1 - f).
  SyncResponse reply;
  REQUIRE(cluster.Sync(cluster.MakeSync(a, 8, params), &reply).ok());
  CHECK(reply.center_version() == before.version + 1);
  CHECK(reply.weight() >= 1.0 - fault_a);  // f only decays after it was read
  CHECK(reply.weight() < 0.6);
  REQUIRE(cluster.Sync(cluster.MakeSync(b, 8, params), &reply).ok());
  CHECK(reply.weight() == Approx(0.05).margin(0.02));  // w_min
  const GetStatusResponse status = cluster.Status();
  CHECK(status.slots(0).update_count() == 1);
  CHECK(status.slots(1).update_count() == 1);
}

// ---- mode ASYNC_ADAHESSIAN: Push ------------------------------------------------------------

TEST_CASE("a malformed, NaN or Inf Push is INVALID_ARGUMENT, applies nothing and raises the "
          "sender's fault score") {
  JobSpec spec;
  spec.mode = "ASYNC_ADAHESSIAN";
  BadInputCluster cluster{spec};
  const RegisterResponse a = cluster.RegisterTrainer("a");
  const RegisterResponse b = cluster.RegisterTrainer("b");
  const Observed before = cluster.Observe();

  PushRequest nan = cluster.MakePush(a, 1);
  SetFloat(nan.mutable_gradient()->mutable_tensors(0), 0, std::numeric_limits<float>::quiet_NaN());
  CheckStatus(cluster.Push(nan), Code::INVALID_ARGUMENT,
              "gradient.tensors[0]: non-finite value nan at index 0");
  cluster.CheckUnchanged(before);
  CHECK(cluster.FaultScore(0) > 0.4);
  CHECK(cluster.FaultScore(1) == 0.0);

  PushRequest inf = cluster.MakePush(b, 1);
  SetFloat(inf.mutable_hessian_diag()->mutable_tensors(1), 7,
           std::numeric_limits<float>::infinity());
  CheckStatus(cluster.Push(inf), Code::INVALID_ARGUMENT,
              "hessian_diag.tensors[1]: non-finite value inf at index 7");
  cluster.CheckUnchanged(before);
  CHECK(cluster.FaultScore(1) > 0.4);

  PushRequest dtype = cluster.MakePush(a, 1);
  dtype.mutable_gradient()->mutable_tensors(2)->set_dtype(INT64);
  CheckStatus(cluster.Push(dtype), Code::INVALID_ARGUMENT,
              "gradient.tensors[2]: dtype must be FLOAT32, got INT64");
  PushRequest shape = cluster.MakePush(a, 1);
  shape.mutable_hessian_diag()->mutable_tensors(2)->set_shape(0, 8);
  shape.mutable_hessian_diag()->mutable_tensors(2)->set_shape(1, 10);
  CheckStatus(cluster.Push(shape), Code::INVALID_ARGUMENT,
              "hessian_diag.tensors[2]: layer1.weight must have shape [10, 8], got [8, 10]");
  PushRequest length = cluster.MakePush(a, 1);
  length.mutable_gradient()->mutable_tensors(1)->mutable_data()->resize(4);
  CheckStatus(cluster.Push(length), Code::INVALID_ARGUMENT,
              "gradient.tensors[1]: 4 data bytes, shape needs 32");
  PushRequest missing = cluster.MakePush(a, 1);
  missing.clear_hessian_diag();
  CheckStatus(cluster.Push(missing), Code::INVALID_ARGUMENT,
              "hessian_diag: expected 4 tensors, got 0");
  cluster.CheckUnchanged(before);
  CHECK(cluster.FaultScore(0) > 0.8);

  // Nothing was applied: the valid first pushes are sequence 1 of each slot.
  PushResponse reply;
  REQUIRE(cluster.Push(cluster.MakePush(a, 1), &reply).ok());
  CHECK(reply.applied());
  CHECK(reply.applied_sequence() == 1);
  REQUIRE(cluster.Push(cluster.MakePush(b, 1), &reply).ok());
  CHECK(reply.applied());
  CHECK(reply.center_version() == before.version + 2);
}

TEST_CASE("a replayed push sequence is answered applied: false and never applied twice; a gap, "
          "a zero sequence or an out-of-range step is refused") {
  JobSpec spec;
  spec.mode = "ASYNC_ADAHESSIAN";
  BadInputCluster cluster{spec};
  const RegisterResponse a = cluster.RegisterTrainer("a");

  PushResponse reply;
  REQUIRE(cluster.Push(cluster.MakePush(a, 1), &reply).ok());
  REQUIRE(reply.applied());
  const Observed after_first = cluster.Observe();
  CHECK(after_first.version == 1);

  // The same sequence again (a retry after a lost reply): acknowledged, not applied.
  for (int i = 0; i < 3; ++i) {
    REQUIRE(cluster.Push(cluster.MakePush(a, 1), &reply).ok());
    CHECK_FALSE(reply.applied());
    CHECK(reply.applied_sequence() == 1);
    CHECK(reply.center_version() == 1);
  }
  cluster.CheckUnchanged(after_first);

  CheckStatus(cluster.Push(cluster.MakePush(a, 3)), Code::FAILED_PRECONDITION,
              "push sequence 3 of slot (0, 0) skips ahead: the next one is 2");
  PushRequest zero = cluster.MakePush(a, 0);
  CheckStatus(cluster.Push(zero), Code::INVALID_ARGUMENT, "sequence and step must be >= 1");
  PushRequest negative_step = cluster.MakePush(a, 2);
  negative_step.set_step(-2);
  CheckStatus(cluster.Push(negative_step), Code::INVALID_ARGUMENT,
              "sequence and step must be >= 1");
  PushRequest beyond = cluster.MakePush(a, 2);
  beyond.set_step(kMaxSteps + 1);
  CheckStatus(cluster.Push(beyond), Code::INVALID_ARGUMENT,
              absl::StrCat("step must be <= training.max_steps = ", kMaxSteps, ", got ",
                           kMaxSteps + 1));
  cluster.CheckUnchanged(after_first);
  CHECK(cluster.Status().slots(0).state() == ACTIVE);

  // A Sync in this mode is refused, and the next push in sequence is applied.
  CheckStatus(cluster.Sync(cluster.MakeSync(a, 8, cluster.ValidParams())),
              Code::FAILED_PRECONDITION, "this job runs mode ASYNC_ADAHESSIAN");
  REQUIRE(cluster.Push(cluster.MakePush(a, 2), &reply).ok());
  CHECK(reply.applied());
  CHECK(reply.applied_sequence() == 2);
  CHECK(cluster.Status().slots(0).update_count() == 2);
}

// ---- steps and retries (mode EASGD) ---------------------------------------------------------

TEST_CASE("a replayed sync is applied once, an older one is stale, and steps out of range are "
          "INVALID_ARGUMENT") {
  BadInputCluster cluster{JobSpec()};
  const RegisterResponse a = cluster.RegisterTrainer("a");
  const TensorBundle params = cluster.ValidParams();
  const Observed before = cluster.Observe();

  for (int64_t step : {int64_t{0}, int64_t{-8}, std::numeric_limits<int64_t>::min()}) {
    CheckStatus(cluster.Sync(cluster.MakeSync(a, step, params)), Code::INVALID_ARGUMENT,
                absl::StrCat("step must be >= 1, got ", step));
  }
  for (int64_t step : {int64_t{kMaxSteps + 1}, std::numeric_limits<int64_t>::max()}) {
    CheckStatus(cluster.Sync(cluster.MakeSync(a, step, params)), Code::INVALID_ARGUMENT,
                absl::StrCat("step must be <= training.max_steps = ", kMaxSteps, ", got ", step));
  }
  cluster.CheckUnchanged(before);
  // The slot did not finish on a step it never reached.
  CHECK(cluster.Status().slots(0).state() == ACTIVE);

  REQUIRE(cluster.Sync(cluster.MakeSync(a, 8, params)).ok());
  SyncResponse first;
  REQUIRE(cluster.Sync(cluster.MakeSync(a, 16, params), &first).ok());
  CHECK(first.has_center_before());
  CHECK(first.center_version() == 2);
  const Observed after_first = cluster.Observe();

  // The same step again, even with other parameters: acknowledged with the stored post-sync
  // state, the center untouched.
  SyncResponse again;
  REQUIRE(cluster.Sync(cluster.MakeSync(a, 16, Shifted(params, 1.0f)), &again).ok());
  CHECK_FALSE(again.has_center_before());
  REQUIRE(again.has_worker_params_after());
  CHECK(again.worker_params_after().tensors_size() == 4);
  CHECK(again.center_version() == 2);
  cluster.CheckUnchanged(after_first);

  CheckStatus(cluster.Sync(cluster.MakeSync(a, 8, params)), Code::FAILED_PRECONDITION,
              "stale sync: slot (0, 0) already synced step 16, got step 8");
  cluster.CheckUnchanged(after_first);

  // Heartbeats with a step out of range are refused too; the slot's step is unchanged.
  for (int64_t step : {int64_t{-1}, int64_t{kMaxSteps + 1}}) {
    HeartbeatRequest beat;
    beat.set_incarnation(a.incarnation());
    beat.set_step(step);
    HeartbeatResponse reply;
    CheckStatus(cluster.Call(&ParameterServer::Stub::Heartbeat, beat, &reply),
                Code::INVALID_ARGUMENT,
                step < 0 ? "step must be >= 0, got -1"
                         : absl::StrCat("step must be <= training.max_steps = ", kMaxSteps,
                                        ", got ", step));
  }
  CHECK(cluster.Status().slots(0).step() == 16);

  REQUIRE(cluster.Sync(cluster.MakeSync(a, 24, params)).ok());
  CHECK(cluster.Status().slots(0).update_count() == 3);
}

TEST_CASE("a sync must be the slot's next sync point: a jump or an off-period step is "
          "INVALID_ARGUMENT, and a retried sync is still answered") {
  BadInputCluster cluster{JobSpec()};
  const RegisterResponse a = cluster.RegisterTrainer("a");
  const TensorBundle params = cluster.ValidParams();
  REQUIRE(cluster.Sync(cluster.MakeSync(a, 8, params)).ok());
  const Observed before = cluster.Observe();
  // tau = 8: after step 8 the only next sync point is 16 (max_steps = 80).
  for (int64_t step : {int64_t{24}, int64_t{kMaxSteps}, int64_t{12}, int64_t{9}}) {
    CheckStatus(cluster.Sync(cluster.MakeSync(a, step, params)), Code::INVALID_ARGUMENT,
                absl::StrCat("step must be the slot's next sync point: a multiple of "
                             "easgd.sync_period = 8 (or training.max_steps = ", kMaxSteps,
                             ") at most 16 (slot (0, 0) last synced step 8), got ", step));
  }
  cluster.CheckUnchanged(before);
  CHECK(cluster.Status().slots(0).state() == ACTIVE);
  // The retry of the applied sync is recognised (its reply carries the stored state).
  SyncResponse again;
  REQUIRE(cluster.Sync(cluster.MakeSync(a, 8, params), &again).ok());
  CHECK(again.has_worker_params_after());
  cluster.CheckUnchanged(before);
  REQUIRE(cluster.Sync(cluster.MakeSync(a, 16, params)).ok());
  CHECK(cluster.Status().slots(0).snapshot_step() == 16);
}

TEST_CASE("a request body that is not a protobuf message is INVALID_ARGUMENT with a message, "
          "and changes nothing") {
  BadInputCluster cluster{JobSpec()};
  const Observed before = cluster.Observe();
  const int workers_before = cluster.Status().workers_size();
  auto channel = grpc::CreateChannel(cluster.address(), grpc::InsecureChannelCredentials());
  for (const char* method : {"/rebound.ParameterServer/Register", "/rebound.ParameterServer/Sync",
                             "/rebound.ParameterServer/GetStatus"}) {
    // An unterminated varint tag; a length-delimited field 2 that claims 100 bytes and has 2.
    for (const std::string& garbage : {std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 11),
                                       std::string("\x12\x64xy", 4)}) {
      grpc::Slice slice(garbage);
      grpc::ByteBuffer request(&slice, 1);
      grpc::ByteBuffer response;
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
      const grpc::internal::RpcMethod rpc(method, grpc::internal::RpcMethod::NORMAL_RPC);
      const grpc::Status status =
          grpc::internal::BlockingUnaryCall(channel.get(), rpc, &context, request, &response);
      INFO(method);
      CheckStatus(status, Code::INVALID_ARGUMENT,
                  absl::StrCat(method, ": the request is not a valid protobuf message of this "
                                       "method (it does not parse)"));
    }
  }
  cluster.CheckUnchanged(before);
  CHECK(cluster.Status().workers_size() == workers_before);
}

// One AppendLog batch of `records` on a fresh stream; the stream's final status.
grpc::Status AppendLogOnce(BadInputCluster& cluster, uint64_t incarnation,
                           const std::vector<LogRecord>& records) {
  auto stub = ParameterServer::NewStub(
      grpc::CreateChannel(cluster.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
  WorkerCredentials::AddTo(&context, cluster.credentials().Of(incarnation));
  auto stream = stub->AppendLog(&context);
  AppendLogRequest request;
  request.set_incarnation(incarnation);
  for (const LogRecord& record : records) *request.add_records() = record;
  stream->Write(request);
  stream->WritesDone();
  AppendLogAck ack;
  while (stream->Read(&ack)) {
  }
  return stream->Finish();
}

// One WorkerSession.Attach as `incarnation` (with its credential, if it has one) that the server
// refuses: the call's final status, and whether an `attached` event came first (it must not).
grpc::Status AttachRefused(BadInputCluster& cluster, uint64_t incarnation, bool* attached) {
  auto stub = WorkerSession::NewStub(
      grpc::CreateChannel(cluster.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
  WorkerCredentials::AddTo(&context, cluster.credentials().Of(incarnation));
  AttachRequest request;
  request.set_incarnation(incarnation);
  auto reader = stub->Attach(&context, request);
  SessionEvent event;
  *attached = false;
  while (reader->Read(&event)) *attached = *attached || event.attached();
  return reader->Finish();
}

TEST_CASE("AppendLog steps beyond max_steps or far past the snapshot and sample ids beyond the "
          "data set are INVALID_ARGUMENT, and nothing is logged") {
  BadInputCluster cluster{JobSpec()};
  const RegisterResponse a = cluster.RegisterTrainer("a");
  const Observed before = cluster.Observe();
  auto record = [&](int64_t step, int64_t sample) {
    LogRecord r;
    *r.mutable_slot() = a.slot();
    r.set_step(step);
    r.set_micro_batch(0);
    r.set_record_id(1);
    r.set_sender_incarnation(a.incarnation());
    for (int i = 0; i < 4; ++i) r.add_sample_ids(sample + i);  // batch 16 / M 4
    return r;
  };
  const int64_t huge = int64_t{1} << 62;
  CheckStatus(AppendLogOnce(cluster, a.incarnation(), {record(huge, 0)}), Code::INVALID_ARGUMENT,
              absl::StrCat("step must be <= training.max_steps = ", kMaxSteps, ", got ", huge));
  // The snapshot is at 0, tau = 8: records up to step 16 can be replayed, not 17.
  CheckStatus(AppendLogOnce(cluster, a.incarnation(), {record(17, 0)}), Code::INVALID_ARGUMENT,
              "step must be <= the slot's snapshot step + 2 x easgd.sync_period = 16, got 17");
  CheckStatus(AppendLogOnce(cluster, a.incarnation(), {record(1, huge)}), Code::INVALID_ARGUMENT,
              absl::StrCat("sample_ids[0] must be < data.train_limit = 1000, got ", huge));
  CheckStatus(AppendLogOnce(cluster, a.incarnation(), {record(1, 998)}), Code::INVALID_ARGUMENT,
              "sample_ids[2] must be < data.train_limit = 1000, got 1000");
  CHECK(cluster.Status().slots(0).logged_step() == 0);
  CHECK(cluster.Status().step_log().records_written() == 0);
  cluster.CheckUnchanged(before);
  // A valid record goes through.
  REQUIRE(AppendLogOnce(cluster, a.incarnation(), {record(1, 996)}).ok());
  CHECK(cluster.Status().step_log().records_written() == 1);
}

TEST_CASE("ReportEval with a stage or center_version out of range, or a non-finite loss, is "
          "INVALID_ARGUMENT and not recorded") {
  BadInputCluster cluster{JobSpec()};
  const uint64_t evaluator = cluster.Register("eval", EVALUATOR).incarnation();
  auto eval = [&](int32_t stage, int64_t version, double loss, double accuracy) {
    ReportEvalRequest request;
    request.set_incarnation(evaluator);
    request.set_stage(stage);
    request.set_center_version(version);
    request.set_test_loss(loss);
    request.set_test_accuracy(accuracy);
    ReportEvalResponse response;
    return cluster.Call(&ParameterServer::Stub::ReportEval, request, &response);
  };
  CheckStatus(eval(99, 0, 0.5, 0.5), Code::INVALID_ARGUMENT, "stage must be in [0, 1), got 99");
  CheckStatus(eval(-1, 0, 0.5, 0.5), Code::INVALID_ARGUMENT, "stage must be in [0, 1), got -1");
  CheckStatus(eval(0, -1, 0.5, 0.5), Code::INVALID_ARGUMENT,
              "center_version must be in [0, 0] (the stage's current version), got -1");
  CheckStatus(eval(0, 5, 0.5, 0.5), Code::INVALID_ARGUMENT,
              "center_version must be in [0, 0] (the stage's current version), got 5");
  CheckStatus(eval(0, 0, std::numeric_limits<double>::infinity(), 0.5), Code::INVALID_ARGUMENT,
              "test_loss must be finite, got inf");
  CheckStatus(eval(0, 0, 0.5, std::numeric_limits<double>::quiet_NaN()), Code::INVALID_ARGUMENT,
              "test_accuracy must be in [0, 1], got nan");
  CHECK_FALSE(cluster.Status().has_last_eval());
  REQUIRE(eval(0, 0, 0.5, 0.25).ok());
  CHECK(cluster.Status().last_eval().test_accuracy() == 0.25);
}

TEST_CASE("a worker name outside [A-Za-z0-9._:@+-] and an unknown enum value are "
          "INVALID_ARGUMENT naming the field, and register nobody") {
  BadInputCluster cluster{JobSpec()};
  const int workers_before = cluster.Status().workers_size();
  RegisterResponse response;
  for (const std::string& name : {std::string("a\x1b[31mred"), std::string("two\nlines"),
                                  std::string("bad\xff\xfeutf8"), std::string("sp ace")}) {
    RegisterRequest request;
    request.set_worker_name(name);
    const grpc::Status status = cluster.Call(&ParameterServer::Stub::Register, request, &response);
    CheckStatus(status, Code::INVALID_ARGUMENT,
                "worker_name may hold only the characters [A-Za-z0-9._:@+-], got byte 0x");
    // The message shows the byte as hex, never raw.
    CHECK(status.error_message().find_first_of("\x1b\n\xff") == std::string::npos);
  }
  // requested_role 77 and backend 77: proto2 parsers keep them as unknown fields, and the
  // getters would read ROLE_UNSPECIFIED (auto) and BACKEND_UNSPECIFIED.
  RegisterRequest valid;
  valid.set_worker_name("w-1");
  for (const auto& [bytes, message] :
       {std::pair<std::string, std::string>{"\x18\x4d",
                                            "requested_role: unknown enum value 77 "
                                            "(rebound.WorkerRole)"},
        {"\x28\x4d", "backend: unknown enum value 77 (rebound.BackendKind)"}}) {
    RegisterRequest request;
    REQUIRE(request.ParseFromString(valid.SerializeAsString() + bytes));
    CHECK(request.requested_role() == ROLE_UNSPECIFIED);
    CheckStatus(cluster.Call(&ParameterServer::Stub::Register, request, &response),
                Code::INVALID_ARGUMENT, message);
  }
  CHECK(cluster.Status().workers_size() == workers_before);
  REQUIRE(cluster.Call(&ParameterServer::Stub::Register, valid, &response).ok());
  CHECK(cluster.Status().workers_size() == workers_before + 1);
}

TEST_CASE("a Register from an incompatible version is FAILED_PRECONDITION naming both versions, "
          "and registers nobody; one without a version (before 0.13) or of this one registers") {
  BadInputCluster cluster{JobSpec()};
  const int workers_before = cluster.Status().workers_size();
  RegisterResponse response;
  RegisterRequest request;
  request.set_worker_name("w-far");
  request.set_version("999.0.0");
  const grpc::Status status = cluster.Call(&ParameterServer::Stub::Register, request, &response);
  CheckStatus(status, Code::FAILED_PRECONDITION,
              absl::StrCat("incompatible versions: this server is rebound ", ProjectVersion(),
                           ", the worker 'w-far' is rebound 999.0.0"));
  CHECK_THAT(status.error_message(), Contains("docs/upgrading.md"));
  request.set_version("0.13");
  CheckStatus(cluster.Call(&ParameterServer::Stub::Register, request, &response),
              Code::INVALID_ARGUMENT, "the worker 'w-far' sent a malformed version");
  CHECK(cluster.Status().workers_size() == workers_before);

  // This build's version registers, and the reply says the server's version.
  request.set_worker_name("w-same");
  request.set_version(ProjectVersion());
  REQUIRE(cluster.Call(&ParameterServer::Stub::Register, request, &response).ok());
  CHECK(response.server_version() == ProjectVersion());
  // No version: a worker of rebound 0.12, which 0.13 still serves.
  RegisterRequest legacy;
  legacy.set_worker_name("w-legacy");
  const grpc::Status legacy_status =
      cluster.Call(&ParameterServer::Stub::Register, legacy, &response);
  if (CheckPeerVersion("this server", kVersionBeforeExchange, "a worker").ok()) {
    CHECK(legacy_status.ok());
    CHECK(cluster.Status().workers_size() == workers_before + 2);
  } else {
    CHECK(legacy_status.error_code() == Code::FAILED_PRECONDITION);
  }
}

// ---- identities ----------------------------------------------------------------------------

TEST_CASE("unknown, fenced, foreign and non-owning incarnations are refused with the code that "
          "tells the worker what to do") {
  BadInputCluster cluster{JobSpec()};
  const RegisterResponse a = cluster.RegisterTrainer("a");
  const RegisterResponse b = cluster.RegisterTrainer("b");
  const TensorBundle params = cluster.ValidParams();
  const Observed before = cluster.Observe();

  SECTION("an incarnation this server never issued: ABORTED, register again") {
    const uint64_t epoch = a.incarnation() & ~uint64_t{0xFFFFFFFF};
    for (uint64_t stranger : {uint64_t{0}, (epoch - (uint64_t{1} << 32)) | 1,
                              epoch | 0xFFFFFF00u}) {
      SyncRequest request = cluster.MakeSync(a, 8, params);
      request.set_incarnation(stranger);
      CheckStatus(cluster.Sync(request), Code::ABORTED,
                  absl::StrCat("incarnation ", stranger, " is unknown to this server"));
      HeartbeatRequest beat;
      beat.set_incarnation(stranger);
      HeartbeatResponse reply;
      CheckStatus(cluster.Call(&ParameterServer::Stub::Heartbeat, beat, &reply), Code::ABORTED,
                  "is unknown to this server");
      bool attached = true;
      CheckStatus(AttachRefused(cluster, stranger, &attached), Code::ABORTED,
                  "is unknown to this server");
      CHECK_FALSE(attached);
    }
  }
  SECTION("a fenced incarnation: FAILED_PRECONDITION saying why") {
    DeregisterRequest leave;
    leave.set_incarnation(b.incarnation());
    DeregisterResponse left;
    REQUIRE(cluster.Call(&ParameterServer::Stub::Deregister, leave, &left).ok());
    const std::string fenced = absl::StrCat("incarnation ", b.incarnation(),
                                            " (worker b) is fenced: DEPARTED");
    CheckStatus(cluster.Sync(cluster.MakeSync(b, 8, params)), Code::FAILED_PRECONDITION, fenced);
    HeartbeatRequest beat;
    beat.set_incarnation(b.incarnation());
    HeartbeatResponse reply;
    CheckStatus(cluster.Call(&ParameterServer::Stub::Heartbeat, beat, &reply),
                Code::FAILED_PRECONDITION, fenced);
    PullRequest pull;
    pull.set_incarnation(b.incarnation());
    PullResponse center;
    CheckStatus(cluster.Call(&ParameterServer::Stub::Pull, pull, &center),
                Code::FAILED_PRECONDITION, fenced);
    CheckStatus(cluster.Call(&ParameterServer::Stub::Deregister, leave, &left),
                Code::FAILED_PRECONDITION, fenced);
    // A fenced worker cannot open a session either (nor, by its end, be declared crashed).
    bool attached = true;
    CheckStatus(AttachRefused(cluster, b.incarnation(), &attached), Code::FAILED_PRECONDITION,
                fenced);
    CHECK_FALSE(attached);
    CHECK(cluster.Status().slots(1).state() == LOST);
  }
  SECTION("an alive incarnation that does not own the slot: FAILED_PRECONDITION") {
    SyncRequest other = cluster.MakeSync(a, 8, params);
    *other.mutable_slot() = b.slot();
    CheckStatus(cluster.Sync(other), Code::FAILED_PRECONDITION,
                absl::StrCat("incarnation ", a.incarnation(), " does not own slot (1, 0)"));
    const uint64_t spare = cluster.RegisterObserver("spare");
    SyncRequest from_spare = cluster.MakeSync(a, 8, params);
    from_spare.set_incarnation(spare);
    CheckStatus(cluster.Sync(from_spare), Code::FAILED_PRECONDITION,
                absl::StrCat("incarnation ", spare, " does not own slot (0, 0)"));
  }
  SECTION("a slot outside the topology: INVALID_ARGUMENT") {
    SyncRequest outside = cluster.MakeSync(a, 8, params);
    outside.mutable_slot()->set_replica(2);
    CheckStatus(cluster.Sync(outside), Code::INVALID_ARGUMENT,
                "slot (2, 0) is outside the 2 x 1 topology");
    outside.mutable_slot()->set_replica(0);
    outside.mutable_slot()->set_stage(-1);
    CheckStatus(cluster.Sync(outside), Code::INVALID_ARGUMENT,
                "slot (0, -1) is outside the 2 x 1 topology");
    PullRequest pull;
    pull.set_incarnation(a.incarnation());
    pull.set_stage(1);
    PullResponse center;
    CheckStatus(cluster.Call(&ParameterServer::Stub::Pull, pull, &center), Code::INVALID_ARGUMENT,
                "stage 1 is outside [0, 1)");
    DrainRequest drain;
    drain.mutable_slot()->set_replica(7);
    DrainResponse drained;
    CheckStatus(cluster.Call(&ParameterServer::Stub::Drain, drain, &drained),
                Code::INVALID_ARGUMENT, "outside");
  }
  SECTION("a registration for another job, with a bad name, or for a slot when none is free") {
    RegisterRequest request;
    request.set_worker_name("intruder");
    request.set_job_id("other-job");
    RegisterResponse response;
    CheckStatus(cluster.Call(&ParameterServer::Stub::Register, request, &response),
                Code::FAILED_PRECONDITION, "this server runs job \"bad-input\", not \"other-job\"");
    request.set_job_id("bad-input");
    request.set_worker_name("");
    CheckStatus(cluster.Call(&ParameterServer::Stub::Register, request, &response),
                Code::INVALID_ARGUMENT, "worker_name must have 1 to 256 characters");
    request.set_worker_name(std::string(257, 'n'));
    CheckStatus(cluster.Call(&ParameterServer::Stub::Register, request, &response),
                Code::INVALID_ARGUMENT, "worker_name must have 1 to 256 characters");
    request.set_worker_name("late");
    request.set_requested_role(TRAINER);
    CheckStatus(cluster.Call(&ParameterServer::Stub::Register, request, &response),
                Code::RESOURCE_EXHAUSTED, "all 2 trainer slots are owned");
  }
  SECTION("a Push in an EASGD job and an out-of-range evaluation") {
    PushRequest push;
    push.set_incarnation(a.incarnation());
    push.set_sequence(1);
    push.set_step(1);
    PushResponse pushed;
    CheckStatus(cluster.Push(push, &pushed), Code::FAILED_PRECONDITION,
                "this job runs mode EASGD");
    ReportEvalRequest eval;
    eval.set_incarnation(a.incarnation());
    eval.set_test_accuracy(0.5);
    ReportEvalResponse evaluated;
    CheckStatus(cluster.Call(&ParameterServer::Stub::ReportEval, eval, &evaluated),
                Code::PERMISSION_DENIED,
                absl::StrCat("incarnation ", a.incarnation(), " is a TRAINER, not a EVALUATOR"));
    eval.set_incarnation(cluster.Register("judge", EVALUATOR).incarnation());
    eval.set_test_accuracy(1.5);
    CheckStatus(cluster.Call(&ParameterServer::Stub::ReportEval, eval, &evaluated),
                Code::INVALID_ARGUMENT, "test_accuracy must be in [0, 1], got 1.5");
    eval.set_test_accuracy(0.5);
    eval.set_test_loss(std::numeric_limits<double>::quiet_NaN());
    CheckStatus(cluster.Call(&ParameterServer::Stub::ReportEval, eval, &evaluated),
                Code::INVALID_ARGUMENT, "test_loss must be finite, got nan");
    CHECK_FALSE(cluster.Status().has_last_eval());
  }
  cluster.CheckUnchanged(before);
  // None of it was the owner's fault, and the owner's next sync goes through.
  CHECK(cluster.FaultScore(0) == 0.0);
  SyncResponse reply;
  REQUIRE(cluster.Sync(cluster.MakeSync(a, 8, params), &reply).ok());
  CHECK(reply.center_version() == before.version + 1);
}

// ---- message size ---------------------------------------------------------------------------

TEST_CASE("a message over max_message_bytes is RESOURCE_EXHAUSTED from gRPC and the server goes "
          "on") {
  BadInputCluster cluster(JobSpec(), Options(/*durable=*/false, "max_message_bytes: 1048576\n"));
  const RegisterResponse a = cluster.RegisterTrainer("a");
  const TensorBundle params = cluster.ValidParams();
  const Observed before = cluster.Observe();

  SyncRequest big = cluster.MakeSync(a, 8, params);
  big.mutable_params()->mutable_tensors(0)->set_name(std::string(2 << 20, 'x'));
  REQUIRE(big.ByteSizeLong() > (1u << 20));
  const grpc::Status refused = cluster.Sync(big);
  CheckStatus(refused, Code::RESOURCE_EXHAUSTED, "Received message larger than max");
  CHECK_THAT(refused.error_message(), Contains("vs. 1048576)"));
  RegisterRequest huge_name;
  huge_name.set_worker_name(std::string(3 << 20, 'n'));
  RegisterResponse registered;
  CheckStatus(cluster.Call(&ParameterServer::Stub::Register, huge_name, &registered),
              Code::RESOURCE_EXHAUSTED, "Received message larger than max");
  cluster.CheckUnchanged(before);
  CHECK(cluster.Status().workers_size() == 2);  // the observer and "a": nobody else registered
  CHECK(cluster.FaultScore(0) == 0.0);          // gRPC refused it before the service saw it

  SyncResponse reply;
  REQUIRE(cluster.Sync(cluster.MakeSync(a, 8, params), &reply).ok());
  CHECK(reply.center_version() == before.version + 1);
}

// ---- a configuration that does not fit: exit 2, never 3 (fenced) ----------------------------

// Starts a trainer with `worker_extra` in its config against `cluster`; returns its exit code
// (nullopt if it did not exit) and its log.
std::optional<int> RunMisfitTrainer(BadInputCluster& cluster, const std::string& worker_extra,
                                    std::string* log) {
  const std::string dir = MakeTempDir("misfit-worker");
  WriteFileOrDie(dir + "/worker.pbtxt",
                 absl::StrCat("backoff_initial_ms: 20\nbackoff_max_ms: 200\n", worker_extra));
  auto worker = Subprocess::Start({Runfile("worker/rebound_worker"), "--config",
                                   dir + "/worker.pbtxt", "--server", cluster.address(), "--name",
                                   "m", "--role", "trainer"},
                                  dir + "/m.log");
  REQUIRE(worker.ok());
  const std::optional<int> exit_code = (*worker)->WaitFor(Scaled(absl::Seconds(60)));
  *log = ReadFileOrEmpty(dir + "/m.log");
  return exit_code;
}

TEST_CASE("a trainer whose data set does not fit the job's model exits 2, not 3 (fenced)") {
  // Supervisors restart a worker that exits 3; this one would fail the same way forever.
  JobSpec spec;
  spec.input_dim = 100;
  BadInputCluster cluster(spec);
  std::string log;
  const std::optional<int> exit_code = RunMisfitTrainer(cluster, "", &log);
  INFO(log);
  CHECK(exit_code == 2);
  CHECK_THAT(log, Contains("work failed: FAILED_PRECONDITION: model.input_dim 100 does not match "
                           "the data set's 784 features per sample"));
  CHECK_THAT(log, !Contains("fenced by the server"));
}

#if !defined(REBOUND_HAVE_CUDA)
TEST_CASE("a trainer asking for compute.backend CUDA in a build without CUDA exits 2") {
  BadInputCluster cluster(JobSpec{});
  std::string log;
  const std::optional<int> exit_code =
      RunMisfitTrainer(cluster, "compute { backend: CUDA }\n", &log);
  INFO(log);
  CHECK(exit_code == 2);
  CHECK_THAT(log, Contains("compute.backend is CUDA but this binary was built without CUDA"));
  CHECK_THAT(log, !Contains("fenced by the server"));
}
#endif

// ---- configs, through the real binaries ----------------------------------------------------

struct BinaryRun {
  int exit_code = -1;
  std::string output;
};

BinaryRun RunBinary(const std::string& binary, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {Runfile(binary)};
  argv.insert(argv.end(), args.begin(), args.end());
  BinaryRun run;
  run.exit_code = RunCommand(argv, &run.output, Scaled(absl::Seconds(30)));
  return run;
}

TEST_CASE("the binaries refuse a bad config with exit code 2, naming file, line and field") {
  const std::string dir = MakeTempDir("bad-configs");
  const std::string job = JobText(JobSpec());
  struct ConfigCase {
    const char* what;
    const char* binary;
    std::string file;  // written to dir/<name> unless empty; "" = does not exist
    std::string text;
    std::string message;
  };
  const std::vector<ConfigCase> cases = {
      {"server: syntax error", "server/rebound_server", "server.pbtxt",
       absl::StrCat("job {\n", job, "}\nlisten_address \"127.0.0.1:0\"\n"),
       "server.pbtxt:11:16: Expected \":\", found \"\"127.0.0.1:0\"\"."},
      {"server: unknown field", "server/rebound_server", "server.pbtxt",
       absl::StrCat("job {\n", job, "}\nmax_wait_msec: 100\n"),
       "server.pbtxt:11:14: Message type \"rebound.ServerConfig\" has no field named "
       "\"max_wait_msec\"."},
      {"server: out of range in the inline job", "server/rebound_server", "server.pbtxt",
       absl::StrCat("job {\n", job, "  adahessian { lr: -1 }\n}\n"),
       "server.pbtxt:10: job.adahessian.lr must be > 0, got -1"},
      {"server: empty file", "server/rebound_server", "server.pbtxt", "",
       "server.pbtxt: job must be set inline, or job_file must name the job config"},
      {"server: no such file", "server/rebound_server", "", "",
       "missing.pbtxt: cannot open config file"},
      {"server: wrong type in its job file", "server/rebound_server", "server.pbtxt",
       "job_file: \"job.pbtxt\"\n", "job.pbtxt:3:22: Expected integer, got: \"two\""},
      {"worker: unknown field", "worker/rebound_worker", "worker.pbtxt",
       "rpc_deadline_ms: 2000\nretry_forever: true\n",
       "worker.pbtxt:2:14: Message type \"rebound.WorkerConfig\" has no field named "
       "\"retry_forever\"."},
      {"worker: out of range", "worker/rebound_worker", "worker.pbtxt",
       "backoff_initial_ms: 500\nbackoff_max_ms: 100\n",
       "worker.pbtxt:2: backoff_max_ms must be >= backoff_initial_ms = 500, got 100"},
      {"worker: wrong type", "worker/rebound_worker", "worker.pbtxt", "compute: 4\n",
       "worker.pbtxt:1:10: Expected \"{\", found \"4\"."},
      {"worker: no such file", "worker/rebound_worker", "", "",
       "missing.pbtxt: cannot open config file"},
      {"server: job_file is /dev/zero", "server/rebound_server", "server.pbtxt",
       "job_file: \"/dev/zero\"\n",
       "/dev/zero: the config file must be a regular file, this is a character device"},
      {"server: job_file is a directory", "server/rebound_server", "server.pbtxt",
       absl::StrCat("job_file: \"", dir, "\"\n"),
       absl::StrCat(dir, ": the config file must be a regular file, this is a directory")},
      {"server: job_file over 16 MiB", "server/rebound_server", "server.pbtxt",
       "job_file: \"big.pbtxt\"\n", "big.pbtxt: the config file is over the limit of 16 MiB"},
      {"server: a TLS certificate that is not PEM", "server/rebound_server", "server.pbtxt",
       absl::StrCat("job {\n", job, "}\nsecurity { tls { cert_file: \"", dir,
                    "/bad.pem\" key_file: \"", dir, "/bad.pem\" } }\n"),
       absl::StrCat("security.tls.cert_file ", dir, "/bad.pem is not a PEM CERTIFICATE: no "
                    "\"-----BEGIN CERTIFICATE-----\" line")},
      {"worker: a CA file that is not PEM", "worker/rebound_worker", "worker.pbtxt",
       absl::StrCat("security { tls { ca_file: \"", dir, "/bad.pem\" } }\n"),
       absl::StrCat("security.tls.ca_file ", dir, "/bad.pem is not a PEM CERTIFICATE")},
      {"worker: a token file that is a directory", "worker/rebound_worker", "worker.pbtxt",
       absl::StrCat("security { token_file: \"", dir, "\" }\n"),
       absl::StrCat(dir, ": the token file must be a regular file, this is a directory")},
  };
  for (const ConfigCase& c : cases) {
    SECTION(c.what) {
      // The job file of the "wrong type" case: line 3 is the topology.
      WriteFileOrDie(dir + "/job.pbtxt",
                     absl::StrCat("job_id: \"j\"\n",
                                  "model { layers { width: 10 activation: IDENTITY } }\n",
                                  "topology { replicas: \"two\" }\n"));
      WriteFileOrDie(dir + "/bad.pem", "not a certificate\n");
      if (absl::StrContains(c.what, "16 MiB")) {
        WriteFileOrDie(dir + "/big.pbtxt", std::string((size_t{16} << 20) + 1, ' '));
      }
      std::string path = dir + "/missing.pbtxt";
      if (!c.file.empty()) {
        path = dir + "/" + c.file;
        WriteFileOrDie(path, c.text);
      }
      std::vector<std::string> args = {"--config", path};
      if (absl::StrContains(c.binary, "worker")) {
        args.insert(args.end(), {"--server", "127.0.0.1:1", "--name", "w"});
      } else {
        args.insert(args.end(), {"--listen", "127.0.0.1:0"});
      }
      const BinaryRun run = RunBinary(c.binary, args);
      INFO(run.output);
      CHECK(run.exit_code == 2);
      CHECK_THAT(run.output, Contains(c.message));
      CHECK_THAT(run.output, Contains("invalid config"));
    }
  }
}

// ---- a corrupt data directory ---------------------------------------------------------------

// Starts rebound_server on `data_dir` with the job of `spec` (config and log in `dir`); returns
// its exit code if it exits before serving, or -1 once it serves (then `*address` holds its
// address).
int StartServerOn(const std::string& data_dir, const JobSpec& spec, const std::string& dir,
                  std::unique_ptr<Subprocess>* server, std::string* address,
                  const std::vector<std::string>& extra_args = {},
                  const std::string& config_extra = "") {
  WriteFileOrDie(dir + "/server.pbtxt",
                 ScaledServerConfig(absl::StrCat("job {\n", JobText(spec),
                                                 "}\ndurability { data_dir: \"", data_dir,
                                                 "\" }\n", config_extra)));
  ServerStart start;
  start.binary = Runfile("server/rebound_server");
  start.config = dir + "/server.pbtxt";
  start.listen = "127.0.0.1:0";
  start.port_file = dir + "/port";
  start.log = dir + "/server.log";
  start.extra_args = extra_args;
  start.wait = Scaled(absl::Seconds(30));
  const absl::StatusOr<int> port = StartServerProcess(start, server);
  REQUIRE(*server != nullptr);
  if (port.ok()) {
    *address = absl::StrCat("127.0.0.1:", *port);
    return -1;
  }
  return (*server)->WaitFor(Scaled(absl::Seconds(10))).value_or(-2);
}

TEST_CASE("a server whose data directory holds a corrupt value refuses to start, naming the "
          "column family and key, and starts again once the value is repaired") {
  const JobSpec spec;
  std::string data_dir;
  std::string center_before_stop;
  {
    BadInputCluster cluster(spec, Options(/*durable=*/true));
    const RegisterResponse a = cluster.RegisterTrainer("a");
    REQUIRE(cluster.Sync(cluster.MakeSync(a, 8, cluster.ValidParams())).ok());
    center_before_stop = cluster.Center().center().SerializeAsString();
    data_dir = cluster.data_dir();
    cluster.StopServer();
  }
  const std::string dir = MakeTempDir("bad-input-restart");
  const std::string slot_key(8, '\0');  // (replica 0, stage 0): two big-endian u32
  std::unique_ptr<Subprocess> server;
  std::string address;

  SECTION("a flipped byte in a weight record") {
    std::string original;
    {
      RawDb raw(data_dir);
      original = raw.Get("weights", slot_key);
      std::string damaged = original;
      damaged.back() ^= 0x20;
      raw.Put("weights", slot_key, damaged);
    }
    CHECK(StartServerOn(data_dir, spec, dir, &server, &address) == 1);
    const std::string log = ReadFileOrEmpty(dir + "/server.log");
    INFO(log);
    CHECK_THAT(log, Contains("cannot load the durable state"));
    CHECK_THAT(log, Contains("DATA_LOSS: weights key (r=0, s=0): checksum mismatch"));

    // The refusal wrote nothing: with the value repaired the state comes back whole.
    { RawDb(data_dir).Put("weights", slot_key, original); }
    REQUIRE(StartServerOn(data_dir, spec, dir, &server, &address) == -1);
    auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
    auto stub = ParameterServer::NewStub(channel);
    GetStatusResponse status;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
    REQUIRE(stub->GetStatus(&context, GetStatusRequest(), &status).ok());
    CHECK(status.centers(0).version() == 1);
    CHECK(status.slots(0).update_count() == 1);
    CHECK(status.slots(0).snapshot_step() == 8);
    RegisterRequest observer;
    observer.set_worker_name("observer");
    observer.set_requested_role(SPARE);
    RegisterResponse registered;
    grpc::ClientContext register_context;
    register_context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
    REQUIRE(stub->Register(&register_context, observer, &registered).ok());
    PullRequest pull;
    pull.set_incarnation(registered.incarnation());
    PullResponse center;
    grpc::ClientContext pull_context;
    pull_context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
    WorkerCredentials::AddTo(&pull_context, registered.credential());
    REQUIRE(stub->Pull(&pull_context, pull, &center).ok());
    const bool same_center = center.center().SerializeAsString() == center_before_stop;
    CHECK(same_center);
    server->Signal(SIGTERM);
    CHECK(server->WaitFor(Scaled(absl::Seconds(20))) == 0);
  }
  SECTION("a truncated slot record in meta") {
    {
      RawDb raw(data_dir);
      const std::string key = "slot/" + slot_key;
      raw.Put("meta", key, raw.Get("meta", key).substr(0, 7));
    }
    CHECK(StartServerOn(data_dir, spec, dir, &server, &address) == 1);
    const std::string log = ReadFileOrEmpty(dir + "/server.log");
    INFO(log);
    CHECK_THAT(log, Contains("meta key slot/(r=0, s=0): truncated: 7 bytes"));
  }
  SECTION("a truncated tensor file of the center") {
    int truncated = 0;
    for (const auto& entry : fs::directory_iterator(data_dir + "/tensors")) {
      if (entry.path().filename().string().rfind("center-s0-", 0) != 0) continue;
      fs::resize_file(entry.path(), 100);
      ++truncated;
    }
    REQUIRE(truncated >= 1);
    CHECK(StartServerOn(data_dir, spec, dir, &server, &address) == 1);
    const std::string log = ReadFileOrEmpty(dir + "/server.log");
    INFO(log);
    CHECK_THAT(log, Contains("center key (s=0): tensor file " + data_dir + "/tensors/center-s0-"));
    CHECK_THAT(log, Contains("holds 100 bytes, the record says 25480"));
  }
}

// The newest write-ahead log file of a RocksDB directory.
std::string NewestWal(const std::string& dir) {
  std::string newest;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() == ".log" && entry.path().string() > newest) {
      newest = entry.path().string();
    }
  }
  REQUIRE_FALSE(newest.empty());
  return newest;
}

void FlipByte(const std::string& path, uint64_t offset) {
  std::string bytes = ReadFileOrEmpty(path);
  REQUIRE(offset < bytes.size());
  bytes[offset] ^= 0x5a;
  WriteFileOrDie(path, bytes);
}

GetStatusResponse StatusOf(const std::string& address) {
  auto stub = ParameterServer::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  GetStatusResponse status;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
  const grpc::Status called = stub->GetStatus(&context, GetStatusRequest(), &status);
  INFO(called.error_message());
  REQUIRE(called.ok());
  return status;
}

TEST_CASE("a server refuses a data directory of a newer format, naming it and both formats, and "
          "serves it again once its FORMAT is this build's") {
  const JobSpec spec;
  std::string data_dir;
  {
    BadInputCluster cluster(spec, Options(/*durable=*/true));
    const RegisterResponse a = cluster.RegisterTrainer("a");
    REQUIRE(cluster.Sync(cluster.MakeSync(a, 8, cluster.ValidParams())).ok());
    data_dir = cluster.data_dir();
    cluster.StopServer();
  }
  // The server recorded the format of the directory it made.
  const std::string current = absl::StrCat("rebound data directory format ",
                                           storage::kDataFormatVersion, "\n");
  CHECK(ReadFileOrEmpty(data_dir + "/FORMAT") == current);

  WriteFileOrDie(data_dir + "/FORMAT", absl::StrCat("rebound data directory format ",
                                                    storage::kDataFormatVersion + 1, "\n"));
  const std::string dir = MakeTempDir("bad-input-format");
  std::unique_ptr<Subprocess> server;
  std::string address;
  CHECK(StartServerOn(data_dir, spec, dir, &server, &address) == 1);
  const std::string log = ReadFileOrEmpty(dir + "/server.log");
  INFO(log);
  CHECK_THAT(log, Contains(absl::StrCat(
                      "FAILED_PRECONDITION: data directory ", data_dir, " has format ",
                      storage::kDataFormatVersion + 1, ", newer than format ",
                      storage::kDataFormatVersion, " that rebound ", ProjectVersion(), " reads")));
  CHECK_THAT(log, Contains("docs/upgrading.md#the-data-directory-format"));

  WriteFileOrDie(data_dir + "/FORMAT", current);
  REQUIRE(StartServerOn(data_dir, spec, dir, &server, &address) == -1);
  const GetStatusResponse status = StatusOf(address);
  CHECK(status.centers(0).version() == 1);
  CHECK(status.server_version() == VersionLine());
  server->Signal(SIGTERM);
  CHECK(server->WaitFor(Scaled(absl::Seconds(20))) == 0);
}

TEST_CASE("a server killed with SIGKILL whose WAL tail is damaged exits 1 naming the WAL, and "
          "starts with --accept_wal_loss, logging what it dropped") {
  const JobSpec spec;
  std::string data_dir;
  {
    BadInputCluster cluster(spec, Options(/*durable=*/true));
    const RegisterResponse a = cluster.RegisterTrainer("a");
    REQUIRE(cluster.Sync(cluster.MakeSync(a, 8, cluster.ValidParams())).ok());
    REQUIRE(cluster.Sync(cluster.MakeSync(a, 16, cluster.ValidParams())).ok());
    CHECK(cluster.Status().slots(0).snapshot_step() == 16);
    data_dir = cluster.data_dir();
    cluster.KillServer();
  }
  // The last record of the WAL is the acknowledged sync of step 16.
  const std::string wal = NewestWal(data_dir);
  const uint64_t size = fs::file_size(wal);
  REQUIRE(size > 64);
  FlipByte(wal, size - 16);
  const std::string dir = MakeTempDir("bad-input-wal");
  std::unique_ptr<Subprocess> server;
  std::string address;

  CHECK(StartServerOn(data_dir, spec, dir, &server, &address) == 1);
  std::string log = ReadFileOrEmpty(dir + "/server.log");
  {
    INFO(log);
    CHECK_THAT(log, Contains("cannot open the data directory: DATA_LOSS: data_dir " + data_dir +
                             ": the write-ahead log is damaged"));
    CHECK_THAT(log, Contains(wal + ": dropping "));
    CHECK_THAT(log, Contains("--accept_wal_loss"));
  }
  // Refusing changed nothing: the WAL is still damaged and refused again.
  CHECK(StartServerOn(data_dir, spec, dir, &server, &address) == 1);

  REQUIRE(StartServerOn(data_dir, spec, dir, &server, &address, {"--accept_wal_loss"}) == -1);
  log = ReadFileOrEmpty(dir + "/server.log");
  INFO(log);
  CHECK_THAT(log, Contains("DROPPING everything after it"));
  CHECK_THAT(log, Contains("wal-damaged-"));
  // The operator sees what was lost: the sync of step 16.
  const GetStatusResponse status = StatusOf(address);
  CHECK(status.slots(0).snapshot_step() == 8);
  CHECK(status.centers(0).version() == 1);
  server->Signal(SIGTERM);
  CHECK(server->WaitFor(Scaled(absl::Seconds(20))) == 0);
}

TEST_CASE("a corrupt SST met by a background compaction turns health NOT_SERVING with the reason "
          "in GetStatus and the metrics") {
  const std::string data_dir = MakeTempDir("bad-input-sst") + "/data";
  {
    // Three flushed step-log SSTs and a fourth batch in the WAL only: the server's open flushes
    // it into a fourth level-0 file, which starts a compaction of all four.
    storage::DurableStoreOptions options;
    options.data_dir = data_dir;
    auto store = storage::DurableStore::Open(options);
    REQUIRE(store.ok());
    for (int round = 0; round < 4; ++round) {
      storage::WriteBatch batch;
      for (int step = 1; step <= 200; ++step) {
        LogRecord record;
        record.mutable_slot()->set_replica(1);
        record.mutable_slot()->set_stage(0);
        record.set_step(round * 200 + step);
        record.set_micro_batch(0);
        record.add_sample_ids(step);
        batch.PutLogRecord(record);
      }
      REQUIRE((*store)->Commit(batch).ok());
      if (round < 3) REQUIRE((*store)->Flush().ok());
    }
  }
  std::string sst;
  for (const auto& entry : fs::directory_iterator(data_dir)) {
    if (entry.path().extension() == ".sst") sst = entry.path().string();
  }
  REQUIRE_FALSE(sst.empty());
  FlipByte(sst, 100);  // inside the first data block (footer, index and properties come last)

  const std::string dir = MakeTempDir("bad-input-sst-server");
  std::unique_ptr<Subprocess> server;
  std::string address;
  REQUIRE(StartServerOn(data_dir, JobSpec(), dir, &server, &address, {},
                        "metrics { enabled: true port: 0 }\n") == -1);
  auto health = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::health::v1::HealthCheckResponse::ServingStatus serving =
      grpc::health::v1::HealthCheckResponse::SERVING;
  const absl::Time deadline = absl::Now() + Scaled(absl::Seconds(30));
  while (absl::Now() < deadline) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(5))));
    grpc::health::v1::HealthCheckResponse response;
    REQUIRE(health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response).ok());
    serving = response.status();
    if (serving == grpc::health::v1::HealthCheckResponse::NOT_SERVING) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  const std::string log = ReadFileOrEmpty(dir + "/server.log");
  INFO(log);
  CHECK(serving == grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  CHECK_THAT(log, Contains("health: NOT_SERVING: DATA_LOSS: data_dir " + data_dir +
                           ": RocksDB compaction failed"));
  const GetStatusResponse status = StatusOf(address);
  CHECK_THAT(status.storage_error(), Contains("DATA_LOSS"));
  CHECK_THAT(status.storage_error(), Contains("compaction"));
  CHECK_THAT(status.storage_error(), Contains("checksum mismatch"));
  REQUIRE(status.has_metrics_address());
  const Exposition metrics = ScrapeMetrics(status.metrics_address());
  CHECK(metrics.samples.at("rebound_store_writable") == 0);
  CHECK(metrics.samples.at("rebound_store_background_errors_total") >= 1);
  server->Signal(SIGTERM);
  CHECK(server->WaitFor(Scaled(absl::Seconds(20))) == 0);
}

// ---- a truncated data set -------------------------------------------------------------------

TEST_CASE("a trainer given a truncated data set file exits 1 naming the file") {
  const std::string data = MakeTempDir("truncated-fashion-mnist");
  const std::string debian = "/usr/share/datasets/fashion-mnist";
  for (const char* name : {"train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                           "t10k-labels-idx1-ubyte.gz"}) {
    fs::create_symlink(debian + "/" + name, data + "/" + name);
  }
  const std::string images = ReadFileOrEmpty(debian + "/train-images-idx3-ubyte.gz");
  REQUIRE(images.size() > 100000);
  WriteFileOrDie(data + "/train-images-idx3-ubyte.gz", images.substr(0, images.size() / 3));

  JobSpec spec;
  spec.data_extra = absl::StrCat("dataset_dir: \"", data, "\"");
  BadInputCluster cluster(spec);
  const Observed before = cluster.Observe();
  const std::string dir = MakeTempDir("truncated-worker");
  WriteFileOrDie(dir + "/worker.pbtxt", "backoff_initial_ms: 20\nbackoff_max_ms: 200\n");
  auto worker = Subprocess::Start({Runfile("worker/rebound_worker"), "--config",
                                   dir + "/worker.pbtxt", "--server", cluster.address(), "--name",
                                   "t", "--role", "trainer"},
                                  dir + "/t.log");
  REQUIRE(worker.ok());
  const std::optional<int> exit_code = (*worker)->WaitFor(Scaled(absl::Seconds(60)));
  const std::string log = ReadFileOrEmpty(dir + "/t.log");
  INFO(log);
  CHECK(exit_code == 1);
  CHECK_THAT(log, Contains("work failed: DATA_LOSS: " + data + "/train-images-idx3-ubyte.gz"));
  CHECK_THAT(log, Contains("truncated gzip stream"));
  // The trainer left cleanly: its slot waits for recovery, the center is untouched.
  const GetStatusResponse status = cluster.Status();
  const WorkerStatus* t = FindWorker(status, "t", TRAINER);
  REQUIRE(t != nullptr);
  CHECK(t->state() == DEPARTED);
  CHECK(status.slots(0).state() == LOST);
  cluster.CheckUnchanged(before);
}

}  // namespace
}  // namespace rebound::testing
