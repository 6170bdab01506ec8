// Pipelined replicas (topology.stages > 1; docs/design.md §2, §5.2, §5.3; docs/protocol.md
// "Pipeline stages") against the real rebound_server and rebound_worker binaries on loopback:
// stages exchange boundary pairs over WorkerPeer, sync with their stage's center, and a stage
// that is SIGKILLed is rebuilt by a spare from its snapshot and the boundary tensors its
// neighbours logged, while the neighbours wait (BLOCKED in status once past neighbour_timeout_ms)
// and then go on with the new incarnation. Every comparison is of raw center bytes: a
// DETERMINISTIC, UNIFORM run split into S stages, with or without a lost stage, must end with the
// center of the same run with one stage.

#include <catch2/catch.hpp>
#include <signal.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <cstdlib>
#include <random>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/slot.h"
#include "common/tensor_codec.h"
#include "grpcpp/grpcpp.h"
#include "proto/rebound.grpc.pb.h"
#include "tests/common/prometheus_text.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/scrape.h"
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
  int recovery_parallelism = 1;
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
      " neighbour_timeout_ms: ", spec.neighbour_timeout_ms,
      " recovery_parallelism: ", spec.recovery_parallelism, " }\n",
      "  data { batch_size: 32 micro_batches: 4 train_limit: 2000 test_limit: 100 }\n",
      "  adahessian { lr: 0.01 hessian_every: 2 }\n",
      "  easgd { sync_period: ", spec.sync_period, " }\n",
      "  step_log { linger_ms: 5 ", spec.logged_boundaries, " }\n",
      "  training { max_steps: ", spec.max_steps, " eval_every_ms: 300 }\n");
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
    INFO("slot " << SlotName(slot.slot()));
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

// A WorkerPeer client of `address` (a worker's peer service, plaintext as in these tests).
std::unique_ptr<WorkerPeer::Stub> PeerStub(const std::string& address) {
  return WorkerPeer::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
}

grpc::Status SendBoundary(WorkerPeer::Stub& stub, const BoundaryMessage& message) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  BoundaryAck ack;
  return stub.SendBoundary(&context, message, &ack);
}

TEST_CASE("malformed, foreign and misaddressed boundary pairs are refused and change nothing") {
  PipelineSpec spec;
  spec.stages = 2;
  spec.max_steps = 100;
  const std::map<uint32_t, std::string> clean = RunClean(spec);

  Cluster cluster(spec);
  cluster.StartTrainers(spec);
  const GetStatusResponse running =
      cluster.WaitFor("slot (0, 1) past step 5", [](const GetStatusResponse& s) {
        return SlotAt(s, 0, 1).step() >= 5;
      });
  const WorkerStatus* t01 = FindWorker(running, Cluster::Name(0, 1), TRAINER);
  const WorkerStatus* t00 = FindWorker(running, Cluster::Name(0, 0), TRAINER);
  REQUIRE(t01 != nullptr);
  REQUIRE(t00 != nullptr);
  auto stub = PeerStub(t01->peer_address());
  // A well-formed forward pair of a step ahead, as stage 0 would send it: 8 rows of 12 features.
  BoundaryMessage message;
  message.set_sender_incarnation(t00->incarnation() + 1000);  // nobody's
  message.mutable_from_slot()->set_replica(0);
  message.mutable_from_slot()->set_stage(0);
  message.mutable_to_slot()->set_replica(0);
  message.mutable_to_slot()->set_stage(1);
  message.set_step(SlotAt(running, 0, 1).step() + 1);
  message.set_micro_batch(0);
  for (int i = 0; i < 8; ++i) message.add_sample_ids(i);
  BoundaryPayload* payload = message.mutable_payload();
  payload->set_direction(FORWARD);
  const std::vector<float> garbage(8 * 12, 1e30f);
  *payload->mutable_value() = MakeFloatTensor(0, "value", {8, 12}, garbage);
  *payload->mutable_r_value() = MakeFloatTensor(1, "r_value", {8, 12}, garbage);

  // An incarnation that does not own stage 0: refused, to be resent by a real owner.
  grpc::Status status = SendBoundary(*stub, message);
  CHECK(status.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(absl::StrContains(status.error_message(), "does not own slot (0, 0)"));
  // For another slot: the sender's view is stale.
  BoundaryMessage misaddressed = message;
  misaddressed.mutable_to_slot()->set_stage(0);
  status = SendBoundary(*stub, misaddressed);
  CHECK(status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(absl::StrContains(status.error_message(), "trains slot (0, 1), not (0, 0)"));
  // Malformed: the wrong shape, then the wrong direction for stage 1 of 2.
  BoundaryMessage misshapen = message;
  *misshapen.mutable_payload()->mutable_value() =
      MakeFloatTensor(0, "value", {8, 11}, std::vector<float>(8 * 11));
  status = SendBoundary(*stub, misshapen);
  CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(absl::StrContains(status.error_message(), "the value must be 8 x 12"));
  BoundaryMessage backwards = message;
  backwards.mutable_payload()->set_direction(BACKWARD);
  status = SendBoundary(*stub, backwards);
  CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(absl::StrContains(status.error_message(), "receives no backward pairs"));

  const GetStatusResponse done = cluster.WaitFor("job finished", AllFinished);
  CHECK(done.recoveries_size() == 0);
  CHECK(cluster.ExitCode(Cluster::Name(0, 0)) == 0);
  CHECK(cluster.ExitCode(Cluster::Name(0, 1)) == 0);
  // None of it was used: the run ends with the clean run's center.
  CHECK(cluster.Centers(spec.stages) == clean);
}

// Where a kill lands: stage `stage` of replica 0, once the store holds its log through step
// snapshot + `offset` (offset in [1, tau - 1]: anywhere in a round, up to its sync), with
// `spares` spares waiting (recovery_parallelism = spares).
struct KillPoint {
  int replicas = 1;
  int stage = 1;
  int offset = 3;
  int spares = 1;
  std::string logged_boundaries;  // of the killed run; empty: all
  std::string group;              // the recovery group the detail must name; empty: none
};

// A 3-stage DETERMINISTIC run with one stage killed at `kill` and rebuilt by replay; checks the
// recovery and returns the final centers.
std::map<uint32_t, std::string> RunKilled(PipelineSpec spec, const KillPoint& kill) {
  spec.logged_boundaries = kill.logged_boundaries;
  spec.recovery_parallelism = kill.spares;
  spec.replicas = kill.replicas;
  Cluster cluster(spec);
  cluster.StartTrainers(spec);
  for (int i = 0; i < kill.spares; ++i) cluster.StartWorker(absl::StrCat("spare", i), SPARE);
  const GetStatusResponse before = cluster.WaitFor(
      absl::StrCat("slot (0, ", kill.stage, ") logged ", kill.offset, " steps past a snapshot"),
      [&](const GetStatusResponse& s) {
        const SlotStatus& slot = SlotAt(s, 0, kill.stage);
        return slot.snapshot_step() >= spec.sync_period &&
               slot.logged_step() >= slot.snapshot_step() + kill.offset &&
               slot.logged_step() < spec.max_steps - spec.sync_period;
      },
      absl::Seconds(60), absl::Milliseconds(1));
  const std::string victim = Cluster::Name(0, kill.stage);
  cluster.Kill(victim);
  const GetStatusResponse done = cluster.WaitFor("job finished", AllFinished);
  INFO(done.DebugString());
  REQUIRE(done.recoveries_size() == 1);
  const RecoveryStatus& r = done.recoveries(0);
  CHECK(r.outcome() == RECOVERED);
  CHECK(r.verified());
  CHECK(r.slot().stage() == kill.stage);
  CHECK(r.spares_size() == kill.spares);
  CHECK(r.failed_step() >= SlotAt(before, 0, kill.stage).snapshot_step());
  if (kill.group.empty()) {
    CHECK_FALSE(absl::StrContains(r.detail(), "recovery group"));
  } else {
    CHECK(absl::StrContains(r.detail(), "replayed with its recovery group, stages " + kill.group));
  }
  CheckEverySyncAppliedOnce(done, spec);
  // The stages whose logs the replay reads: the killed stage's recovery group and the stages
  // right around it.
  int first = kill.stage;
  int end = kill.stage + 1;
  if (!kill.group.empty()) {
    first = kill.group[1] - '0';
    end = kill.group[4] - '0';
  }
  for (int r = 1; r < spec.replicas; ++r) {
    // The other replicas' stages never noticed but for a wait at their DETERMINISTIC turn.
    for (int s = 0; s < spec.stages; ++s) {
      CHECK(cluster.ExitCode(Cluster::Name(r, s)) == 0);
      CHECK_FALSE(
          absl::StrContains(cluster.WorkerLog(Cluster::Name(r, s)), "flushed the step log"));
    }
  }
  for (int s = 0; s < spec.stages; ++s) {
    if (s == kill.stage) continue;
    INFO("stage " << s);
    // The others stayed alive through the rebuild, under their first incarnation; those the
    // replay reads from flushed their logs first, when asked.
    const WorkerStatus* live = FindWorker(done, Cluster::Name(0, s), TRAINER);
    REQUIRE(live != nullptr);
    CHECK(live->incarnation() == SlotAt(before, 0, s).owner_incarnation());
    CHECK(cluster.ExitCode(Cluster::Name(0, s)) == 0);
    CHECK(absl::StrContains(cluster.WorkerLog(Cluster::Name(0, s)), "flushed the step log") ==
          (s >= first - 1 && s <= end));
  }
  for (int i = 0; i < kill.spares; ++i) CHECK(cluster.ExitCode(absl::StrCat("spare", i)) == 0);
  std::cout << "pipeline_test: stage " << kill.stage << " killed at logged step "
            << SlotAt(before, 0, kill.stage).logged_step() << " (" << kill.spares
            << " spare(s)): " << r.detail() << std::endl;
  return cluster.Centers(spec.stages);
}

// The four kill points of the replay cases below, each a fixed number of steps past a snapshot
// drawn from a fixed seed (printed; REBOUND_TEST_SEED replaces it to explore other kill points).
// Both cases draw all four, so a seed names the same points in both.
struct StageKills {
  uint32_t seed = 20261203;
  std::vector<KillPoint> kills;
};

StageKills DrawStageKills(const PipelineSpec& spec) {
  StageKills drawn;
  if (const char* text = std::getenv("REBOUND_TEST_SEED"); text != nullptr) {
    REQUIRE(absl::SimpleAtoi(text, &drawn.seed));
  }
  std::mt19937 random(drawn.seed);
  std::uniform_int_distribution<int> offset(1, spec.sync_period - 1);
  std::vector<KillPoint>& kills = drawn.kills;
  kills.resize(4);
  kills[0].stage = 1;  // the middle stage of replica 0 of 2, every boundary logged
  kills[0].replicas = 2;
  kills[1].stage = 0;  // the first stage, by two spares in parallel
  kills[1].spares = 2;
  kills[2].stage = 1;  // boundary 1 unlogged: group [0, 2), stage 0 stays alive
  kills[2].logged_boundaries = "logged_boundaries: [2]";
  kills[2].group = "[0, 2)";
  kills[3].stage = 2;  // boundary 2 unlogged: group [1, 3), by two spares
  kills[3].logged_boundaries = "logged_boundaries: [1]";
  kills[3].group = "[1, 3)";
  kills[3].spares = 2;
  for (KillPoint& kill : kills) kill.offset = offset(random);
  std::cout << "pipeline_test: seed " << drawn.seed << std::endl;
  return drawn;
}

// Runs each of `picked` (indices into the drawn kill points) and compares its final parameters
// with a clean run's of the same replica count.
void CheckStageKills(const std::vector<int>& picked) {
  PipelineSpec spec;
  spec.stages = 3;
  spec.sync_period = 20;
  spec.max_steps = 100;
  const StageKills drawn = DrawStageKills(spec);
  std::map<int, std::map<uint32_t, std::string>> clean;  // by replica count
  for (int i : picked) {
    const KillPoint& kill = drawn.kills[i];
    INFO("seed " << drawn.seed << ": stage " << kill.stage << " killed " << kill.offset
                 << " steps past a snapshot, " << kill.spares << " spare(s), "
                 << (kill.logged_boundaries.empty() ? "all logged" : kill.logged_boundaries));
    if (clean.count(kill.replicas) == 0) {
      PipelineSpec clean_spec = spec;
      clean_spec.replicas = kill.replicas;
      clean[kill.replicas] = RunClean(clean_spec);
    }
    CHECK(RunKilled(spec, kill) == clean[kill.replicas]);
  }
}

TEST_CASE("a killed stage is rebuilt by replay with its recovery group, or alone by two spares, "
          "and the run ends bit-identical") {
  CheckStageKills({1, 2});
}

// The other two kill points in tools/test.sh --full (pipeline_test_full): the default tier has a
// stage rebuilt by two spares and one rebuilt with its recovery group (above).
TEST_CASE("a killed middle stage of 2 replicas, and a recovery group rebuilt by two spares, end "
          "bit-identical", "[.full]") {
  CheckStageKills({0, 3});
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
  // The evaluator chains the stages' centers into the whole model.
  cluster.StartWorker("eval", EVALUATOR);
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
  REQUIRE(t00->has_metrics_address());
  const Exposition blocked_metrics = ScrapeMetrics(t00->metrics_address());
  CHECK(blocked_metrics.samples.at("rebound_worker_blocked") == 1);
  // Stage 0 sent every forward pair of its steps so far, and backward pairs came back for all
  // but the last step.
  CHECK(blocked_metrics.samples.at("rebound_worker_boundary_pairs_sent_total") >=
        4 * spec.sync_period);
  CHECK(blocked_metrics.samples.at("rebound_worker_boundary_wait_seconds_count") >=
        4 * (spec.sync_period - 1));

  cluster.StartWorker("spare", SPARE);
  cluster.WaitFor("slot (0, 0) no longer BLOCKED", [](const auto& s) {
    return SlotAt(s, 0, 0).state() == ACTIVE || SlotAt(s, 0, 0).state() == FINISHED;
  });
  {
    const GetStatusResponse resumed = cluster.Status();
    const WorkerStatus* trainer = FindWorker(resumed, Cluster::Name(0, 0), TRAINER);
    REQUIRE(trainer != nullptr);
    CHECK(ScrapeMetrics(trainer->metrics_address()).samples.at("rebound_worker_blocked") == 0);
  }
  const GetStatusResponse done = cluster.WaitFor("job finished", AllFinished);
  REQUIRE(done.recoveries_size() == 1);
  CHECK(done.recoveries(0).outcome() == RECOVERED);
  CHECK(done.recoveries(0).verified());
  CheckEverySyncAppliedOnce(done, spec);
  CHECK(cluster.ExitCode(Cluster::Name(0, 0)) == 0);
  CHECK(cluster.ExitCode("spare") == 0);
  // It evaluated the chained centers: better than chance (0.1) on the 100 test samples.
  REQUIRE(done.has_last_eval());
  CHECK(done.last_eval().test_accuracy() > 0.3);
  CHECK(done.last_eval().test_accuracy() <= 1.0);
  CHECK(cluster.ExitCode("eval") == 0);
}

}  // namespace
}  // namespace rebound::testing
