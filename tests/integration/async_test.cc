// Mode ASYNC_ADAHESSIAN (docs/design.md §4.6) end to end, against the real rebound_server and
// rebound_worker binaries on loopback: trainers push the gradient and Hessian diagonal of every
// step and pull the center every sync_period steps; the server applies each push exactly once,
// also when a trainer is SIGKILLed mid-run and a spare takes its slot over; and the center learns
// (its test loss, computed here in-process on Fashion-MNIST, falls below the initialisation's).

#include <catch2/catch.hpp>
#include <google/protobuf/text_format.h>
#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "compute/cpu/cpu_backend.h"
#include "compute/step.h"
#include "compute/tensor_bundle.h"
#include "grpcpp/grpcpp.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/status_util.h"
#include "testing/cluster/processes.h"
#include "worker/data/fashion_mnist.h"

namespace rebound::testing {
namespace {

// Fashion-MNIST's 784 inputs -> 8 hidden -> 10 classes: 6370 parameters, small pushes.
const char kSmallModel[] =
    "  model { layers { width: 8 } layers { width: 10 activation: IDENTITY } }\n";
constexpr int kKilledBySigkill = 128 + SIGKILL;

struct JobSpec {
  const char* policy = "RESTART_FROM_CENTER";
  int64_t max_steps = 150;
  int sync_period = 8;
  int failure_timeout_ms = 1500;
};

std::string JobText(const JobSpec& spec) {
  return absl::StrCat(
      "  job_id: \"at\"\n", kSmallModel, "  topology { replicas: 2 }\n",
      "  weighting { policy: UNIFORM }\n",
      "  fault_tolerance { policy: ", spec.policy,
      " heartbeat_interval_ms: 200 failure_timeout_ms: ", spec.failure_timeout_ms, " }\n",
      "  data { batch_size: 16 micro_batches: 4 train_limit: 2000 test_limit: 1000 }\n",
      "  adahessian { lr: 0.01 }\n",
      "  easgd { mode: ASYNC_ADAHESSIAN sync_period: ", spec.sync_period, " }\n",
      "  training { max_steps: ", spec.max_steps, " }\n");
}

// The server and workers of one test (tests/integration/local_cluster.h).
class Cluster : public LocalCluster {
 public:
  explicit Cluster(const JobSpec& spec)
      : LocalCluster(JobText(spec), LocalClusterOptions{"async", 500, false, absl::Seconds(120)}) {}

  // The current center, pulled by a fresh test client registered as a spare.
  PullResponse PullCenter(const std::string& client) { return Pull(RegisterObserver(client)); }
};

// Test loss and accuracy of a center on the job's test split, computed in this process.
compute::EvalResult Evaluate(const JobConfig& job, const TensorBundle& center) {
  auto data = worker::LoadFashionMnist(job.data());
  REQUIRE(data.ok());
  auto backend = compute::CreateCpuBackend(1);
  REQUIRE(backend.ok());
  compute::TrainerOptions options;
  options.model = job.model();
  options.optimizer = job.adahessian();
  options.batch_size = job.data().batch_size();
  options.micro_batches = job.data().micro_batches();
  auto model = compute::LocalTrainer::Create(backend->get(), options);
  REQUIRE(model.ok());
  const compute::StageLayout& layout = (*model)->stage(0).layout();
  REQUIRE(compute::ValidateBundle(layout, center, "center").ok());
  REQUIRE((*model)->stage(0).SetParams(compute::PackedFromBundle(layout, center)).ok());
  const std::vector<int32_t> labels(data->test.labels.begin(), data->test.labels.end());
  auto result = (*model)->Evaluate(data->test.images, labels);
  REQUIRE(result.ok());
  REQUIRE(result->samples == 1000);
  return *result;
}

// Every step of every slot was pushed and applied exactly once: the server counted max_steps
// pushes per slot, the last one for step max_steps, and the center moved once per push.
void CheckEveryPushAppliedOnce(const GetStatusResponse& s, const JobSpec& spec) {
  INFO(s.DebugString());
  REQUIRE(s.slots_size() == 2);
  for (const SlotStatus& slot : s.slots()) {
    INFO("slot " << slot.slot().replica());
    CHECK(slot.state() == FINISHED);
    CHECK(slot.update_count() == spec.max_steps);
    CHECK(slot.snapshot_step() == spec.max_steps);  // the step of the last applied push
  }
  CHECK(s.centers(0).version() == 2 * spec.max_steps);
  // The center is the replica: trainers write no step log in this mode.
  CHECK(s.step_log().records_written() == 0);
}

TEST_CASE("two ASYNC_ADAHESSIAN trainers push every step exactly once and the center learns") {
  const JobSpec spec;
  Cluster cluster(spec);
  const PullResponse initial = cluster.PullCenter("observer-before");
  REQUIRE(initial.center_version() == 0);
  cluster.StartWorker("a", TRAINER);
  cluster.StartWorker("b", TRAINER);
  const GetStatusResponse done = cluster.WaitFor("every slot finished", AllFinished);
  CHECK(cluster.ExitCode("a") == 0);
  CHECK(cluster.ExitCode("b") == 0);
  CheckEveryPushAppliedOnce(done, spec);
  CHECK(done.recoveries_size() == 0);
  // Both trainers pushed, in pace: UNIFORM weights, no faults.
  for (const SlotStatus& slot : done.slots()) {
    CHECK(slot.weight().weight() == 1.0);
    CHECK(slot.weight().fault_score() == 0.0);
  }

  const PullResponse final_center = cluster.PullCenter("observer-after");
  CHECK(final_center.center_version() == 2 * spec.max_steps);
  CHECK_FALSE(SameBytes(final_center.center(), initial.center()));
  const compute::EvalResult before = Evaluate(cluster.job(), initial.center());
  const compute::EvalResult after = Evaluate(cluster.job(), final_center.center());
  INFO("test loss " << before.loss << " -> " << after.loss << ", accuracy " << before.accuracy
                    << " -> " << after.accuracy);
  CHECK(after.loss < 0.8 * before.loss);
  CHECK(after.accuracy > before.accuracy + 0.2);
}

// Kills trainer "b" (slot 1) once its pushes pass step 200 and lets spare "s" take the slot
// over under `spec.policy`; returns the final status.
GetStatusResponse RunWithKilledTrainer(Cluster& cluster, const JobSpec& spec) {
  cluster.StartWorker("a", TRAINER);
  cluster.StartWorker("b", TRAINER);
  cluster.StartWorker("s", SPARE);
  const GetStatusResponse at_kill = cluster.WaitFor("slot 1 past step 200", [](const auto& s) {
    return s.slots(1).step() >= 200 || s.slots(1).state() == FINISHED;
  });
  REQUIRE(at_kill.slots(1).state() == ACTIVE);
  cluster.worker("b").Signal(SIGKILL);
  // 128 + SIGKILL; anything else means it finished before the kill and the test proves nothing.
  REQUIRE(cluster.ExitCode("b", absl::Seconds(10)) == kKilledBySigkill);
  const GetStatusResponse done = cluster.WaitFor("every slot finished", AllFinished);
  CHECK(cluster.ExitCode("a") == 0);
  CHECK(cluster.ExitCode("s") == 0);
  INFO(done.DebugString() << cluster.Logs());
  REQUIRE(done.recoveries_size() == 1);
  CHECK(done.recoveries(0).slot().replica() == 1);
  // The spare owns the slot as a trainer under a new incarnation.
  const WorkerStatus* taken_over = FindWorker(done, "s", TRAINER);
  REQUIRE(taken_over != nullptr);
  CHECK(taken_over->slot().replica() == 1);
  CHECK(done.slots(1).owner_incarnation() == taken_over->incarnation());
  return done;
}

TEST_CASE("a trainer SIGKILLed mid-run is restarted from the center by a spare and no push is "
          "lost or applied twice") {
  JobSpec spec;
  spec.max_steps = 2000;
  Cluster cluster(spec);
  const GetStatusResponse done = RunWithKilledTrainer(cluster, spec);
  CheckEveryPushAppliedOnce(done, spec);
  CHECK(done.recoveries(0).policy() == RESTART_FROM_CENTER);
  // The spare went on from the slot's last applied push, not from the beginning.
  CHECK(done.recoveries(0).failed_step() >= 200);
  CHECK_FALSE(absl::StrContains(cluster.WorkerLog("s"), "skipping from step"));
}

TEST_CASE("under REPLAY a killed trainer's slot is restarted from the center: nothing to replay") {
  // In this mode the center is the replica: no snapshot or step log exists to replay, so the
  // server applies RESTART_FROM_CENTER (common/config.h EffectiveRecoveryPolicy) and says so.
  JobSpec spec;
  spec.policy = "REPLAY";
  spec.max_steps = 2000;
  Cluster cluster(spec);
  const GetStatusResponse done = RunWithKilledTrainer(cluster, spec);
  CheckEveryPushAppliedOnce(done, spec);
  CHECK(done.recovery_policy() == RESTART_FROM_CENTER);
  CHECK(done.recoveries(0).policy() == RESTART_FROM_CENTER);
  CHECK(done.recoveries(0).outcome() == RECOVERED);
  // The spare starts where the slot's pushes stopped: it never has to skip ahead.
  CHECK_FALSE(absl::StrContains(cluster.WorkerLog("s"), "skipping from step"));
}

}  // namespace
}  // namespace rebound::testing
