// Pipelined replicas (topology.stages > 1; DESIGN.md §2, §5.2, §5.3; docs/protocol.md
// "Pipeline stages") against the real rebound_server and rebound_worker binaries on loopback:
// stages exchange boundary pairs over WorkerPeer, sync with their stage's center, and a stage
// that is SIGKILLed is rebuilt by a spare from its snapshot and the boundary tensors its
// neighbours logged, while the neighbours wait (BLOCKED in status once past neighbour_timeout_ms)
// and then go on with the new incarnation. Every comparison is of raw center bytes: a
// DETERMINISTIC, UNIFORM run split into S stages, with or without a lost stage, must end with the
// center of the same run with one stage.

#include <catch2/catch.hpp>
#include <signal.h>

#include <cstdint>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/rebound.grpc.pb.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/status_util.h"

namespace rebound::testing {
namespace {

constexpr int kKilledBySigkill = 128 + SIGKILL;

struct PipelineSpec {
  int replicas = 1;
  int stages = 1;
  int sync_period = 10;
  int64_t max_steps = 60;
  int neighbour_timeout_ms = 10000;
  std::string logged_boundaries;  // e.g. "logged_boundaries: [1]"; empty: all
};

// 784 -> 12 -> 10 -> 10 (three layers: S up to 3), Hessian every other step so that pairs travel
// with and without the R-op.
std::string JobText(const PipelineSpec& spec) {
  return absl::StrCat(
      "  job_id: \"pipe\"\n",
      "  model { layers { width: 12 } layers { width: 10 activation: TANH }"
      " layers { width: 10 activation: IDENTITY } }\n",
      "  topology { replicas: ", spec.replicas, " stages: ", spec.stages, " }\n",
      "  weighting { policy: UNIFORM }\n  scheduling: DETERMINISTIC\n",
      "  fault_tolerance { policy: REPLAY heartbeat_interval_ms: 200 failure_timeout_ms: 2000",
      " neighbour_timeout_ms: ", spec.neighbour_timeout_ms, " }\n",
      "  data { batch_size: 32 micro_batches: 4 train_limit: 2000 test_limit: 100 }\n",
      "  adahessian { lr: 0.01 hessian_every: 2 }\n",
      "  easgd { sync_period: ", spec.sync_period, " }\n",
      "  step_log { linger_ms: 5 ", spec.logged_boundaries, " }\n",
      "  training { max_steps: ", spec.max_steps, " }\n");
}

class Cluster : public LocalCluster {
 public:
  explicit Cluster(const PipelineSpec& spec)
      : LocalCluster(JobText(spec),
                     LocalClusterOptions{"pipeline", 500, false, absl::Seconds(120)}) {}

  // Trainers started in order own slots (0, 0), (0, 1), ..., (1, 0), ...
  void StartTrainers(const PipelineSpec& spec) {
    for (int r = 0; r < spec.replicas; ++r) {
      for (int s = 0; s < spec.stages; ++s) StartWorker(Name(r, s), TRAINER);
    }
  }
  static std::string Name(int r, int s) { return absl::StrCat("t", r, s); }

  // Every stage's center, tensors by id (the ids are the model's, whatever the split).
  std::map<uint32_t, std::string> Centers(int stages) {
    const uint64_t observer = RegisterObserver();
    std::map<uint32_t, std::string> tensors;
    for (int s = 0; s < stages; ++s) {
      PullRequest request;
      request.set_incarnation(observer);
      request.set_stage(s);
      PullResponse response;
      REQUIRE(Call(&ParameterServer::Stub::Pull, request, &response).ok());
      for (const Tensor& t : response.center().tensors()) {
        REQUIRE(tensors.count(t.id()) == 0);
        tensors[t.id()] = t.data();
      }
    }
    return tensors;
  }
};

const SlotStatus& SlotAt(const GetStatusResponse& s, int r, int stage) {
  for (const SlotStatus& slot : s.slots()) {
    if (slot.slot().replica() == r && slot.slot().stage() == stage) return slot;
  }
  FAIL("no slot (" << r << ", " << stage << ") in status");
  return s.slots(0);
}

void CheckEverySyncAppliedOnce(const GetStatusResponse& s, const PipelineSpec& spec) {
  for (const SlotStatus& slot : s.slots()) {
    INFO("slot (" << slot.slot().replica() << ", " << slot.slot().stage() << ")");
    CHECK(slot.update_count() == spec.max_steps / spec.sync_period);
    CHECK(slot.snapshot_step() == spec.max_steps);
  }
}

std::map<uint32_t, std::string> RunClean(const PipelineSpec& spec) {
  Cluster cluster(spec);
  cluster.StartTrainers(spec);
  const GetStatusResponse done = cluster.WaitFor("job finished", AllFinished);
  CHECK(done.recoveries_size() == 0);
  CheckEverySyncAppliedOnce(done, spec);
  for (int r = 0; r < spec.replicas; ++r) {
    for (int s = 0; s < spec.stages; ++s) CHECK(cluster.ExitCode(Cluster::Name(r, s)) == 0);
  }
  return cluster.Centers(spec.stages);
}

TEST_CASE("a model split into 2 and 3 pipeline stages trains bit-identical to one stage") {
  PipelineSpec spec;
  spec.replicas = 2;
  spec.stages = 1;
  const std::map<uint32_t, std::string> whole = RunClean(spec);
  REQUIRE(whole.size() == 6);  // 3 layers: W and b each
  for (int stages : {2, 3}) {
    INFO(stages << " stages");
    spec.stages = stages;
    const std::map<uint32_t, std::string> split = RunClean(spec);
    CHECK(split == whole);
  }
}

// Kills the middle stage of a 3-stage replica once its neighbours' log holds a few of its steps
// past its snapshot; a spare rebuilds it.
TEST_CASE("a middle stage killed mid-round is rebuilt by replay and the run ends bit-identical") {
  PipelineSpec spec;
  spec.stages = 3;
  spec.sync_period = 20;
  spec.max_steps = 100;
  const std::map<uint32_t, std::string> clean = RunClean(spec);

  Cluster cluster(spec);
  cluster.StartTrainers(spec);
  cluster.StartWorker("spare", SPARE);
  // Past the first sync, and at least 3 logged steps beyond the snapshot.
  const GetStatusResponse before = cluster.WaitFor(
      "slot (0, 1) logged steps past its first snapshot",
      [&](const GetStatusResponse& s) {
        const SlotStatus& slot = SlotAt(s, 0, 1);
        return slot.snapshot_step() >= spec.sync_period &&
               slot.logged_step() >= slot.snapshot_step() + 3 &&
               slot.logged_step() < spec.max_steps - spec.sync_period;
      },
      absl::Seconds(60), absl::Milliseconds(1));
  cluster.Kill(Cluster::Name(0, 1));
  const int64_t t0_at_kill = SlotAt(before, 0, 1).snapshot_step();
  const GetStatusResponse done = cluster.WaitFor("job finished", AllFinished);
  INFO(done.DebugString());
  REQUIRE(done.recoveries_size() == 1);
  const RecoveryStatus& r = done.recoveries(0);
  CHECK(r.outcome() == RECOVERED);
  CHECK(r.verified());
  CHECK(r.slot().stage() == 1);
  CHECK(r.steps_replayed() >= 1);
  CHECK(r.failed_step() >= t0_at_kill);
  CheckEverySyncAppliedOnce(done, spec);
  CHECK(cluster.ExitCode(Cluster::Name(0, 0)) == 0);
  CHECK(cluster.ExitCode(Cluster::Name(0, 2)) == 0);
  CHECK(cluster.ExitCode("spare") == 0);
  // The neighbours flushed their logs for the replay.
  CHECK(absl::StrContains(cluster.WorkerLog(Cluster::Name(0, 0)), "flushed the step log"));
  CHECK(absl::StrContains(cluster.WorkerLog(Cluster::Name(0, 2)), "flushed the step log"));
  std::cout << "pipeline_test: middle stage killed at logged step "
            << SlotAt(before, 0, 1).logged_step() << ": " << r.detail() << std::endl;
  CHECK(cluster.Centers(spec.stages) == clean);
}

// Boundary 1 unlogged: stages 0 and 1 form one recovery group, rebuilt together from their
// snapshots and the pairs logged at boundary 2, while stage 0 itself stays alive.
TEST_CASE("with a boundary unlogged, a killed stage is rebuilt with its recovery group, "
          "bit-identical") {
  PipelineSpec spec;
  spec.stages = 3;
  spec.sync_period = 20;
  spec.max_steps = 100;
  const std::map<uint32_t, std::string> clean = RunClean(spec);

  spec.logged_boundaries = "logged_boundaries: [2]";
  Cluster cluster(spec);
  cluster.StartTrainers(spec);
  cluster.StartWorker("spare", SPARE);
  const GetStatusResponse before = cluster.WaitFor(
      "slot (0, 1) logged steps past its first snapshot",
      [&](const GetStatusResponse& s) {
        const SlotStatus& slot = SlotAt(s, 0, 1);
        return slot.snapshot_step() >= spec.sync_period &&
               slot.logged_step() >= slot.snapshot_step() + 3 &&
               slot.logged_step() < spec.max_steps - spec.sync_period;
      },
      absl::Seconds(60), absl::Milliseconds(1));
  cluster.Kill(Cluster::Name(0, 1));
  const GetStatusResponse done = cluster.WaitFor("job finished", AllFinished);
  INFO(done.DebugString());
  REQUIRE(done.recoveries_size() == 1);
  const RecoveryStatus& r = done.recoveries(0);
  CHECK(r.outcome() == RECOVERED);
  CHECK(r.verified());
  CHECK(r.slot().stage() == 1);
  CHECK(r.steps_replayed() >= 1);
  CHECK(absl::StrContains(r.detail(), "replayed with its recovery group, stages [0, 2)"));
  CheckEverySyncAppliedOnce(done, spec);
  // Stage 0 stayed alive through the rebuild, under its first incarnation.
  const WorkerStatus* t00 = FindWorker(done, Cluster::Name(0, 0), TRAINER);
  REQUIRE(t00 != nullptr);
  CHECK(t00->incarnation() == SlotAt(before, 0, 0).owner_incarnation());
  CHECK(cluster.ExitCode(Cluster::Name(0, 0)) == 0);
  CHECK(cluster.ExitCode(Cluster::Name(0, 2)) == 0);
  CHECK(cluster.ExitCode("spare") == 0);
  std::cout << "pipeline_test: group member killed at logged step "
            << SlotAt(before, 0, 1).logged_step() << ": " << r.detail() << std::endl;
  CHECK(cluster.Centers(spec.stages) == clean);
}

TEST_CASE("a stage whose neighbour stays dead shows BLOCKED in status, then resumes when a spare "
          "rebuilds the neighbour") {
  PipelineSpec spec;
  spec.stages = 2;
  spec.sync_period = 10;
  spec.max_steps = 400;
  spec.neighbour_timeout_ms = 500;
  Cluster cluster(spec);
  cluster.StartTrainers(spec);
  cluster.WaitFor("slot (0, 1) past its first sync", [&](const GetStatusResponse& s) {
    return SlotAt(s, 0, 1).snapshot_step() >= spec.sync_period;
  });
  cluster.Kill(Cluster::Name(0, 1));
  const GetStatusResponse blocked = cluster.WaitFor("slot (0, 0) BLOCKED", [](const auto& s) {
    return SlotAt(s, 0, 0).state() == BLOCKED && SlotAt(s, 0, 1).state() == LOST;
  });
  const std::string detail = SlotAt(blocked, 0, 0).detail();
  INFO(detail);
  CHECK(absl::StartsWith(detail, "BLOCKED "));
  CHECK(absl::StrContains(detail, "slot (0, 1)"));
  // Killed while stage 0 sent it a forward pair or waited for its backward pair.
  CHECK((absl::StrContains(detail, "sending the forward pair of step ") ||
         absl::StrContains(detail, "waiting for the backward pair of step ")));
  // Not hung: the blocked trainer still heartbeats.
  absl::SleepFor(absl::Seconds(3));
  const GetStatusResponse later = cluster.Status();
  CHECK(SlotAt(later, 0, 0).state() == BLOCKED);
  const WorkerStatus* t00 = FindWorker(later, Cluster::Name(0, 0), TRAINER);
  REQUIRE(t00 != nullptr);
  CHECK(t00->state() == ALIVE);
  CHECK(t00->last_heartbeat_ms_ago() < 1500);

  cluster.StartWorker("spare", SPARE);
  const GetStatusResponse done = cluster.WaitFor("job finished", AllFinished);
  REQUIRE(done.recoveries_size() == 1);
  CHECK(done.recoveries(0).outcome() == RECOVERED);
  CHECK(done.recoveries(0).verified());
  CheckEverySyncAppliedOnce(done, spec);
  CHECK(cluster.ExitCode(Cluster::Name(0, 0)) == 0);
  CHECK(cluster.ExitCode("spare") == 0);
}

}  // namespace
}  // namespace rebound::testing
