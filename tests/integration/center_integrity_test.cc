// Center integrity (issue R9, docs/bad_input.md "Center integrity"), against the real
// rebound_server and rebound_worker binaries on loopback: syncs of +-3.4e38 (finite, so they pass
// the input checks), alternating huge syncs, syncs just under and just over
// weighting.max_abs_value, a sync far beyond weighting.max_divergence_ratio, and pushes whose g
// or D would overflow the center's m, v or the center. Each is INVALID_ARGUMENT naming what it
// would have broken, leaves the center, its version and every slot's applied updates and
// snapshot step as they were (GetStatus and a Pull), is counted in the slot's refused_updates and
// charged to the sender as a fault; and a byzantine trainer process that poisons its syncs is
// refused, exits, and the honest trainers finish with a finite center.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "proto/rebound.grpc.pb.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/trainer_calls.h"
#include "tests/integration/status_util.h"

namespace rebound::testing {
namespace {

using ::Catch::Contains;
using Code = grpc::StatusCode;

// Fashion-MNIST's 784 inputs -> 8 hidden -> 10 classes: tensors 0 (layer0.weight, 8 x 784),
// 1 (layer0.bias, 8), 2 (layer1.weight, 10 x 8) and 3 (layer1.bias, 10); 6370 parameters.
std::string JobText(const std::string& mode, const std::string& weighting_extra,
                    int replicas = 2, int64_t max_steps = 80, int failure_timeout_ms = 120000) {
  return absl::StrCat(
      "  job_id: \"integrity\"\n"
      "  model { layers { width: 8 } layers { width: 10 activation: IDENTITY } }\n"
      "  topology { replicas: ", replicas, " }\n",
      "  weighting { policy: DYNAMIC ", weighting_extra, " }\n",
      // Test clients never heartbeat: nobody is declared failed while a test case runs.
      "  fault_tolerance { failure_timeout_ms: ", failure_timeout_ms, " }\n",
      "  data { batch_size: 16 micro_batches: 4 train_limit: 1000 test_limit: 100 }\n"
      "  easgd { mode: ", mode, " sync_period: 8 }\n"
      "  training { max_steps: ", max_steps, " }\n");
}

LocalClusterOptions Options() {
  LocalClusterOptions options;
  options.name = "integrity";
  options.wait_limit = absl::Seconds(90);
  return options;
}

// +v, -v, +v, ... in every tensor.
TensorBundle Alternating(const TensorBundle& like, float v) {
  return Mapped(like, [v](size_t i, float) { return i % 2 == 0 ? v : -v; });
}

bool AllFinite(const TensorBundle& bundle) {
  bool finite = true;
  Mapped(bundle, [&finite](size_t, float v) {
    finite = finite && std::isfinite(v);
    return v;
  });
  return finite;
}

// What a refused update must not change.
struct Observed {
  int64_t version = 0;
  std::string center;  // the serialized center bundle
  std::vector<int64_t> update_counts;
  std::vector<int64_t> snapshot_steps;
  std::vector<int64_t> refused;
};

class IntegrityCluster : public TrainerCallsCluster {
 public:
  explicit IntegrityCluster(const std::string& job_text)
      : TrainerCallsCluster(job_text, Options()) {}

  Observed Observe() {
    Observed observed;
    const PullResponse center = Center();
    observed.version = center.center_version();
    observed.center = center.center().SerializeAsString();
    const GetStatusResponse status = Status();
    for (const SlotStatus& slot : status.slots()) {
      observed.update_counts.push_back(slot.update_count());
      observed.snapshot_steps.push_back(slot.snapshot_step());
      observed.refused.push_back(slot.refused_updates());
    }
    return observed;
  }

  // Nothing `before` saw has changed but slot `refused_slot`'s refused count, up by one.
  void CheckRefusedOnce(const Observed& before, int refused_slot) {
    const Observed now = Observe();
    CHECK(now.version == before.version);
    CHECK(now.center == before.center);
    CHECK(now.update_counts == before.update_counts);
    CHECK(now.snapshot_steps == before.snapshot_steps);
    std::vector<int64_t> expected = before.refused;
    ++expected[refused_slot];
    CHECK(now.refused == expected);
  }

  double FaultScore(int replica) { return Status().slots(replica).weight().fault_score(); }

};

TEST_CASE("a sync of +-3.4e38 is INVALID_ARGUMENT naming tensor and element, changes nothing, "
          "and counts against its sender") {
  IntegrityCluster cluster(JobText("EASGD", ""));
  const RegisterResponse a = cluster.RegisterTrainer("a");
  const RegisterResponse b = cluster.RegisterTrainer("b");
  const TensorBundle center = cluster.Center().center();
  const TensorBundle poison = Alternating(center, 3.4e38f);

  // The first sync of the job: no other trainer to compare with, so the result check refuses
  // it (every value of the moved center would be about +-1.5e38).
  Observed before = cluster.Observe();
  CheckStatus(cluster.Sync(cluster.MakeSync(a, 8, poison)), Code::INVALID_ARGUMENT,
              "would make the center of stage 0 hold 1.53e+38 at tensor id 0 (layer0.weight) "
              "element 0 (x = 3.4e+38");
  cluster.CheckRefusedOnce(before, 0);
  CHECK(cluster.FaultScore(0) > 0.4);
  CHECK(cluster.FaultScore(1) == 0.0);

  // Both trainers sync honestly; then a's poison is refused by its distance from the center,
  // against b's (weighting.max_divergence_ratio).
  const TensorBundle honest = Mapped(center, [](size_t, float v) { return v + 0.01f; });
  REQUIRE(cluster.Sync(cluster.MakeSync(a, 8, honest)).ok());
  REQUIRE(cluster.Sync(cluster.MakeSync(b, 8, honest)).ok());
  before = cluster.Observe();
  CheckStatus(cluster.Sync(cluster.MakeSync(a, 16, poison)), Code::INVALID_ARGUMENT,
              "the bound is weighting.max_divergence_ratio = 10000");
  cluster.CheckRefusedOnce(before, 0);
  CHECK(AllFinite(cluster.Center().center()));

  // The honest trainer goes on; so does a, once it sends honest parameters again.
  SyncResponse reply;
  REQUIRE(cluster.Sync(cluster.MakeSync(b, 16, honest), &reply).ok());
  CHECK(reply.center_version() == before.version + 1);
  REQUIRE(cluster.Sync(cluster.MakeSync(a, 16, honest), &reply).ok());
  CHECK(reply.center_version() == before.version + 2);
  const GetStatusResponse status = cluster.Status();
  CHECK(status.slots(0).refused_updates() == 2);
  CHECK(status.slots(1).refused_updates() == 0);
  CHECK(status.centers(0).max_divergence_ratio() > 0.0);
  CHECK(status.centers(0).max_divergence_ratio() < 2.0);
}

TEST_CASE("alternating +3e38 / -3e38 syncs are refused before the center overflows, also with "
          "both bounds off") {
  // Bounds off: only finiteness protects the center. The first +-3e38 sync is finite and
  // applied; the next, signs swapped, would overflow x - c to infinity and is refused.
  IntegrityCluster cluster(JobText("EASGD", "max_abs_value: 0 max_divergence_ratio: 0"));
  const RegisterResponse a = cluster.RegisterTrainer("a");
  const RegisterResponse b = cluster.RegisterTrainer("b");
  const TensorBundle center = cluster.Center().center();
  REQUIRE(cluster.Sync(cluster.MakeSync(a, 8, Alternating(center, 3e38f))).ok());
  const Observed before = cluster.Observe();
  CheckStatus(cluster.Sync(cluster.MakeSync(b, 8, Alternating(center, -3e38f))),
              Code::INVALID_ARGUMENT,
              "would make the center of stage 0 hold -inf at tensor id 0 (layer0.weight) "
              "element 0");
  cluster.CheckRefusedOnce(before, 1);
  CHECK(AllFinite(cluster.Center().center()));
}

TEST_CASE("a sync just under max_abs_value is applied and one just over is refused") {
  // R = 2: alpha = 0.45, w = 1 at a first sync. With x = c except one element V, the snapshot
  // holds V - 0.45 (V - c), about 0.55 V there: the bound 1e6 admits V up to about 1.818e6.
  IntegrityCluster cluster(JobText("EASGD", ""));
  const RegisterResponse a = cluster.RegisterTrainer("a");
  const RegisterResponse b = cluster.RegisterTrainer("b");
  const TensorBundle center = cluster.Center().center();
  auto with_last_bias = [&](float v) {
    TensorBundle params = center;
    Tensor* bias = params.mutable_tensors(3);
    std::memcpy(&(*bias->mutable_data())[9 * sizeof(float)], &v, sizeof(float));
    return params;
  };
  SyncResponse reply;
  REQUIRE(cluster.Sync(cluster.MakeSync(a, 8, with_last_bias(1.8e6f)), &reply).ok());
  CHECK(reply.center_version() == 1);
  const double seen = cluster.Status().centers(0).max_abs_value();
  CHECK(seen > 0.98e6);
  CHECK(seen <= 1e6);

  Observed before = cluster.Observe();
  CheckStatus(cluster.Sync(cluster.MakeSync(b, 8, with_last_bias(1.85e6f))),
              Code::INVALID_ARGUMENT, "at tensor id 3 (layer1.bias) element 9 (x = 1.85e+06");
  CHECK_THAT(cluster.Sync(cluster.MakeSync(b, 8, with_last_bias(1.85e6f))).error_message(),
             Contains("|value| <= 1e+06 (weighting.max_abs_value)"));
  ++before.refused[1];  // the second refusal, above
  cluster.CheckRefusedOnce(before, 1);
}

TEST_CASE("a push whose g or D would overflow m, v or the center is INVALID_ARGUMENT and the "
          "sequence is not consumed") {
  IntegrityCluster cluster(JobText("ASYNC_ADAHESSIAN", ""));
  const RegisterResponse a = cluster.RegisterTrainer("a");
  cluster.RegisterTrainer("b");
  Observed before = cluster.Observe();
  CheckStatus(cluster.Push(cluster.MakePush(a, 1, 0.01f, 3e38f)), Code::INVALID_ARGUMENT,
              "would make the center's AdaHessian v of stage 0 hold inf at tensor id 0 "
              "(layer0.weight) element 0");
  cluster.CheckRefusedOnce(before, 0);
  before = cluster.Observe();
  CheckStatus(cluster.Push(cluster.MakePush(a, 1, 3e38f, 1.0f)), Code::INVALID_ARGUMENT,
              "would make the center of stage 0 hold");
  cluster.CheckRefusedOnce(before, 0);
  CHECK(cluster.FaultScore(0) > 0.8);

  // Sequence 1 was never applied: a valid push with it is.
  PushResponse reply;
  REQUIRE(cluster.Push(cluster.MakePush(a, 1, 0.01f, 1.0f), &reply).ok());
  CHECK(reply.applied());
  CHECK(reply.applied_sequence() == 1);
  CHECK(reply.center_version() == before.version + 1);
  CHECK(AllFinite(cluster.Center().center()));
}

TEST_CASE("a byzantine trainer process is refused and exits; the honest trainers finish with a "
          "finite center") {
  // 3 trainers; the third poisons its syncs from step 16 (its second). A spare takes its slot
  // over (REPLAY from its last accepted snapshot) so that the job can finish.
  IntegrityCluster cluster(JobText("EASGD", "", /*replicas=*/3, /*max_steps=*/64,
                                   /*failure_timeout_ms=*/3000));
  cluster.StartWorker("honest0", TRAINER);
  cluster.StartWorker("honest1", TRAINER);
  cluster.StartWorker("byzantine", TRAINER, "", {"--fault_poison_from_step=16"});
  cluster.StartWorker("spare", SPARE);
  CHECK(cluster.ExitCode("byzantine", absl::Seconds(60)) == 1);
  const std::string log = cluster.WorkerLog("byzantine");
  CHECK_THAT(log, Contains("FAULT INJECTION: poisoned update at step 16"));
  CHECK_THAT(log, Contains("the server refused this trainer's sync of step 16 as invalid"));
  const GetStatusResponse done =
      cluster.WaitFor("every slot finished", [](const GetStatusResponse& s) {
        return AllFinished(s);
      });
  CHECK(cluster.ExitCode("honest0") == 0);
  CHECK(cluster.ExitCode("honest1") == 0);
  CHECK(done.slots(2).refused_updates() >= 1);
  CHECK(done.slots(0).refused_updates() == 0);
  CHECK(done.slots(1).refused_updates() == 0);
  // Every slot applied all its syncs exactly once; the poisoned one never.
  for (const SlotStatus& slot : done.slots()) CHECK(slot.update_count() == 64 / 8);
  // Read by a reader registered now: the cluster's observer never heartbeats, and this job (a
  // refused trainer, a replay) may run past its failure_timeout, after which it is fenced.
  const PullResponse center = cluster.Pull(cluster.RegisterObserver("reader"));
  CHECK(center.center_version() == 3 * 64 / 8);
  CHECK(AllFinite(center.center()));
  CHECK(done.centers(0).max_abs_value() < 100.0);
}

}  // namespace
}  // namespace rebound::testing
