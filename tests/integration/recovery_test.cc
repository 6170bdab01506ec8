// Recovery under policy REPLAY (docs/recovery.md, docs/design.md §5.2-§5.3) against the real
// rebound_server and rebound_worker binaries on loopback: trainers are SIGKILLed, spares come
// late, die during their replay or rebuild two slots at once, and every outcome is read from the
// server's GetStatus; replays run with one spare and with two in parallel (one of them killed
// mid-replay), and a trainer is drained through reboundctl. A durable server's RocksDB directory
// is read back to check that the step log's GC keeps the stored log within one sync period per
// slot. The last test (tagged [fencing]) shows a fenced trainer's sync refused even after it
// waited for its DETERMINISTIC turn.
//
// Where a kill lands. A trainer ships its log asynchronously (StepLogger lets records gather for
// 20 ms), so a kill timed by a heartbeat's step (every 200 ms) may land just after a sync and
// find nothing to replay, and how often depends on the machine's load. Instead the other
// trainers are frozen with SIGSTOP for a moment, so that the server's records_written counts the
// victim's records only, and the victim is killed once the store holds a given number of its
// steps past its snapshot (WaitForLoggedSteps).

#include <catch2/catch.hpp>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "proto/rebound.grpc.pb.h"
#include "storage/durable_store.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/scrape.h"
#include "tests/integration/status_util.h"
#include "testing/cluster/processes.h"
#include "testing/cluster/time_scale.h"

namespace rebound::testing {
namespace {

// Fashion-MNIST's 784 inputs -> 8 hidden -> 10 classes: 6370 parameters, small snapshots.
const char kSmallModel[] =
    "  model { layers { width: 8 } layers { width: 10 activation: IDENTITY } }\n";
// The trainers' step-log linger (step_log.linger_ms; the default is 100).
constexpr int kLingerMs = 20;
// 784 -> 64 -> 10: compute-bound steps (about a millisecond at batch 64), so that a sync period
// of a few hundred steps lasts far longer than the StepLogger's 20 ms linger.
const char kWideModel[] =
    "  model { layers { width: 64 } layers { width: 10 activation: IDENTITY } }\n";

constexpr int kMicroBatches = 4;
constexpr int kRecordsPerStep = kMicroBatches + 1;  // M micro-batch records and one checksum
constexpr int kFailureTimeoutMs = 3000;
// The server's bound on any wait inside a handler (a DETERMINISTIC sync waiting for its turn,
// a spare's long poll).
constexpr int kMaxWaitMs = 500;
constexpr int kKilledBySigkill = 128 + SIGKILL;

struct JobSpec {
  const char* model = kWideModel;
  int replicas = 2;
  int batch_size = 64;
  int train_limit = 2000;
  int sync_period = 300;
  int64_t max_steps = 900;
  bool deterministic = false;
  bool durable = false;
  int failure_timeout_ms = kFailureTimeoutMs;
  int max_wait_ms = kMaxWaitMs;
  int recovery_parallelism = 1;  // k spares per replay
};

// The detail the server gives a RECOVERED replay that started from the snapshot at `t0`.
std::string RebuiltDetail(int64_t t0, int64_t steps_replayed) {
  return absl::StrCat("rebuilt to step ", t0 + steps_replayed, " from the snapshot at step ", t0);
}

std::string JobText(const JobSpec& spec) {
  return absl::StrCat(
      "  job_id: \"rt\"\n", spec.model, "  topology { replicas: ", spec.replicas, " }\n",
      "  weighting { policy: UNIFORM }\n",
      spec.deterministic ? "  scheduling: DETERMINISTIC\n" : "",
      "  fault_tolerance { policy: REPLAY heartbeat_interval_ms: 200 failure_timeout_ms: ",
      spec.failure_timeout_ms, " recovery_parallelism: ", spec.recovery_parallelism, " }\n",
      "  data { batch_size: ", spec.batch_size, " micro_batches: ", kMicroBatches,
      " train_limit: ", spec.train_limit, " test_limit: 100 }\n",
      "  adahessian { lr: 0.01 }\n",
      "  easgd { sync_period: ", spec.sync_period, " }\n",
      // A short linger: these tests time their kills against what has been logged.
      "  step_log { linger_ms: ", kLingerMs, " }\n",
      "  training { max_steps: ", spec.max_steps, " }\n");
}

// The server and workers of one test (tests/integration/local_cluster.h).
class Cluster : public LocalCluster {
 public:
  explicit Cluster(const JobSpec& spec)
      : LocalCluster(JobText(spec), LocalClusterOptions{"recovery", spec.max_wait_ms,
                                                        spec.durable, absl::Seconds(60)}) {}
};

// Waits until the trainer of `replica` syncs again: it is at the start of a round.
void WaitForNextSync(Cluster& cluster, int replica) {
  const int64_t before = cluster.Status().slots(replica).snapshot_step();
  cluster.WaitFor(
      absl::StrCat("slot ", replica, " syncs after step ", before),
      [&](const GetStatusResponse& s) { return s.slots(replica).snapshot_step() > before; },
      absl::Seconds(30), absl::Milliseconds(1));
}

// Lets the trainer of `replica` run until the store holds at least `steps` complete steps of its
// log past its snapshot, and returns that snapshot's step.
// REQUIRES: every other trainer is frozen (SIGSTOP), so that records_written counts this
// trainer's records only; and the trainer has just synced, with `steps` well below a sync period
// (it is killed right after: a sync already sent when it dies would still be applied).
// Why it holds: a sync's commit raises the slot's log floor, so a record written after the
// snapshot was read is past the snapshot, and a trainer ships its records in step order; a
// newer sync meanwhile restarts the count.
int64_t WaitForLoggedSteps(Cluster& cluster, int replica, int steps) {
  // Records the frozen trainers had on the wire land.
  absl::SleepFor(Scaled(absl::Milliseconds(20)));
  GetStatusResponse s = cluster.Status();
  int64_t snapshot = s.slots(replica).snapshot_step();
  int64_t written_at_snapshot = s.step_log().records_written();
  const absl::Time deadline = absl::Now() + Scaled(absl::Seconds(30));
  while (true) {
    s = cluster.Status();
    if (s.slots(replica).snapshot_step() != snapshot) {
      snapshot = s.slots(replica).snapshot_step();
      written_at_snapshot = s.step_log().records_written();
    } else if (s.step_log().records_written() >= written_at_snapshot + kRecordsPerStep * steps) {
      return snapshot;
    }
    if (absl::Now() > deadline) {
      FAIL("slot " << replica << " did not log " << steps << " steps past its snapshot\n"
                   << s.DebugString() << cluster.Logs());
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
}

// Checks a replay that rebuilt `replica` from the snapshot at `t0`, as status reports it.
void CheckRebuilt(const RecoveryStatus& r, int replica, int64_t t0, int min_steps,
                  int sync_period, int spares = 1) {
  INFO(r.DebugString());
  CHECK(r.policy() == REPLAY);
  CHECK(r.outcome() == RECOVERED);
  CHECK(r.verified());
  CHECK(r.slot().replica() == replica);
  CHECK(r.spares_size() == spares);
  // At least the steps the store held at the kill, never more than the log can hold: one sync
  // period.
  CHECK(r.steps_replayed() >= min_steps);
  CHECK(r.steps_replayed() <= sync_period);
  CHECK(r.detail() == RebuiltDetail(t0, r.steps_replayed()));
}

// The worker `spare_incarnation` (a spare) took over `replica`: that incarnation is REPLACED and
// a trainer of the same name owns the slot under the incarnation named in the reason.
void CheckTookOver(const GetStatusResponse& s, uint64_t spare_incarnation, int replica) {
  INFO(s.DebugString());
  const WorkerStatus* spare = FindIncarnation(s, spare_incarnation);
  REQUIRE(spare != nullptr);
  CHECK(spare->role() == SPARE);
  CHECK(spare->state() == REPLACED);
  const WorkerStatus* trainer = FindWorker(s, spare->name(), TRAINER);
  REQUIRE(trainer != nullptr);
  CHECK(trainer->slot().replica() == replica);
  CHECK(trainer->incarnation() == s.slots(replica).owner_incarnation());
  CHECK(spare->state_reason() == absl::StrCat("took over slot (", replica, ", 0) as incarnation ",
                                              trainer->incarnation()));
}

// Every slot synced exactly max_steps / tau times (a rebuilt trainer's sync is applied once),
// so the center moved that many times per slot.
void CheckEverySyncAppliedOnce(const GetStatusResponse& s, const JobSpec& spec) {
  const int64_t rounds = spec.max_steps / spec.sync_period;
  for (const SlotStatus& slot : s.slots()) {
    INFO("slot " << slot.slot().replica());
    CHECK(slot.update_count() == rounds);
    CHECK(slot.snapshot_step() == spec.max_steps);
  }
  CHECK(s.centers(0).version() == rounds * spec.replicas);
}

TEST_CASE("a lost slot waits for a spare, and a spare that registers later rebuilds it by replay") {
  JobSpec spec;  // 2 trainers, tau 300, 900 steps
  Cluster cluster(spec);
  cluster.StartWorker("a", TRAINER);
  cluster.StartWorker("b", TRAINER);
  cluster.WaitFor(
      "b synced once", [](const GetStatusResponse& s) { return s.slots(1).snapshot_step() > 0; },
      absl::Seconds(60), absl::Milliseconds(1));
  cluster.Signal("a", SIGSTOP);
  const int64_t t0 = WaitForLoggedSteps(cluster, 1, 30);
  const absl::Time killed_at = absl::Now();
  cluster.Kill("b");
  cluster.Signal("a", SIGCONT);

  const GetStatusResponse lost = cluster.WaitFor(
      "b declared failed", [](const GetStatusResponse& s) { return s.slots(1).state() == LOST; });
  const WorkerStatus* b = FindWorker(lost, "b", TRAINER);
  REQUIRE(b != nullptr);
  CHECK(b->state() == FAILED);
  // A killed process: declared on its session's end (crash detection, docs/design.md §13), before
  // the job's failure timeout as the cluster wrote it (testing/cluster/time_scale.h).
  CHECK(absl::StartsWith(b->state_reason(), "its session ended "));
  CHECK(b->silent_ms_at_failure() <= ScaledMs(kFailureTimeoutMs));
  CHECK(lost.slots(1).snapshot_step() == t0);
  CHECK(t0 % spec.sync_period == 0);

  // No spare: the slot stays LOST, says why, and nobody replays it. The other trainer is not
  // held up meanwhile.
  const absl::Time until = absl::Now() + absl::Seconds(2);
  GetStatusResponse held;
  do {
    held = cluster.Status();
    INFO(held.slots(1).DebugString());
    REQUIRE(held.slots(1).state() == LOST);
    CHECK(held.slots(1).owner_incarnation() == 0);
    CHECK(absl::StrContains(held.slots(1).detail(), "waiting for a spare to replay it"));
    CHECK(absl::StrContains(held.slots(1).detail(),
                            absl::StrCat("owner incarnation ", b->incarnation(), " FAILED")));
    CHECK(held.slots(1).snapshot_step() == t0);
    CHECK(held.recoveries_size() == 0);
    absl::SleepFor(absl::Milliseconds(100));
  } while (absl::Now() < until);
  CHECK((held.slots(0).state() == FINISHED || held.slots(0).step() > lost.slots(0).step()));

  cluster.StartWorker("spare", SPARE);
  const GetStatusResponse done = cluster.WaitFor("job finished", AllFinished);
  REQUIRE(done.recoveries_size() == 1);
  CheckRebuilt(done.recoveries(0), 1, t0, 30, spec.sync_period);
  CheckTookOver(done, done.recoveries(0).spares(0), 1);
  CheckEverySyncAppliedOnce(done, spec);
  // The recovery's duration, from b's death to the takeover, the 2 s without a spare included:
  // in the status and as a histogram on /metrics (docs/metrics.md#recovery).
  const double since_kill = absl::ToDoubleSeconds(absl::Now() - killed_at);
  REQUIRE(done.recovery_durations_size() == 1);
  const RecoveryDurations& took = done.recovery_durations(0);
  CHECK(took.policy() == REPLAY);
  CHECK(took.count() == 1);
  CHECK(took.sum_seconds() >= 2.0);
  CHECK(took.sum_seconds() <= since_kill);
  const Exposition metrics = ScrapeMetrics(done.metrics_address());
  CHECK(metrics.types.at("rebound_recovery_duration_seconds") == "histogram");
  const std::string series = "rebound_recovery_duration_seconds";
  CHECK(metrics.samples.at(series + "_count{policy=\"REPLAY\"}") == 1);
  CHECK(metrics.samples.at(series + "_sum{policy=\"REPLAY\"}") == Approx(took.sum_seconds()));
  CHECK(metrics.samples.at(series + "_bucket{policy=\"REPLAY\",le=\"1\"}") == 0);
  CHECK(metrics.samples.at(series + "_bucket{policy=\"REPLAY\",le=\"+Inf\"}") == 1);
  INFO(cluster.Logs());
  CHECK(cluster.ExitCode("a") == 0);
  CHECK(cluster.ExitCode("spare") == 0);
}

TEST_CASE("a spare killed during its replay gives the task back and a second spare rebuilds the "
          "slot") {
  // A bigger batch makes each step slower, and 100 logged steps are replayed after the spare
  // has loaded the data set: the task is held for most of a second.
  JobSpec spec;
  spec.batch_size = 256;
  Cluster cluster(spec);
  cluster.StartWorker("a", TRAINER);
  cluster.StartWorker("b", TRAINER);
  cluster.StartWorker("s1", SPARE);
  cluster.StartWorker("s2", SPARE);
  cluster.WaitFor(
      "b synced once", [](const GetStatusResponse& s) { return s.slots(1).snapshot_step() > 0; },
      absl::Seconds(60), absl::Milliseconds(1));
  cluster.Signal("a", SIGSTOP);
  const int64_t t0 = WaitForLoggedSteps(cluster, 1, 100);
  cluster.Kill("b");
  cluster.Signal("a", SIGCONT);

  const GetStatusResponse claimed = cluster.WaitFor(
      "a spare claims slot 1",
      [](const GetStatusResponse& s) { return s.slots(1).state() == RECOVERING; },
      absl::Seconds(30), absl::Milliseconds(2));
  REQUIRE(claimed.recoveries_size() == 1);
  REQUIRE(claimed.recoveries(0).spares_size() == 1);
  const uint64_t first_task = claimed.recoveries(0).task_id();
  const uint64_t first_spare = claimed.recoveries(0).spares(0);
  const WorkerStatus* replaying = FindIncarnation(claimed, first_spare);
  REQUIRE(replaying != nullptr);
  const std::string first_name = replaying->name();
  const std::string second_name = first_name == "s1" ? "s2" : "s1";
  CHECK(claimed.slots(1).snapshot_step() == t0);

  // Freeze the replaying spare, give any call it had in flight time to land, and check that it
  // still holds the task: from here on it cannot report, so the kill is mid-replay.
  cluster.Signal(first_name, SIGSTOP);
  absl::SleepFor(Scaled(absl::Milliseconds(300)));
  const GetStatusResponse frozen = cluster.Status();
  INFO(frozen.DebugString());
  REQUIRE(frozen.slots(1).state() == RECOVERING);
  REQUIRE(frozen.recoveries_size() == 1);
  REQUIRE_FALSE(frozen.recoveries(0).has_outcome());
  cluster.Kill(first_name);

  const GetStatusResponse done = cluster.WaitFor("job finished", AllFinished);
  INFO(done.DebugString());
  REQUIRE(done.recoveries_size() == 2);
  const RecoveryStatus& failed = done.recoveries(0);
  CHECK(failed.task_id() == first_task);
  CHECK(failed.policy() == REPLAY);
  CHECK(failed.outcome() == SPARE_FAILED);
  CHECK_FALSE(failed.verified());
  CHECK(failed.slot().replica() == 1);
  REQUIRE(failed.spares_size() == 1);
  CHECK(failed.spares(0) == first_spare);
  CHECK(absl::StartsWith(failed.detail(),
                         absl::StrCat("spare ", first_spare, " FAILED during the replay: "
                                      "its session ended ")));
  const WorkerStatus* dead = FindIncarnation(done, first_spare);
  REQUIRE(dead != nullptr);
  CHECK(dead->state() == FAILED);
  CHECK(FindWorker(done, first_name, TRAINER) == nullptr);  // it never took the slot

  const RecoveryStatus& rebuilt = done.recoveries(1);
  CHECK(rebuilt.task_id() != first_task);
  CheckRebuilt(rebuilt, 1, t0, 100, spec.sync_period);
  const WorkerStatus* second = FindWorker(done, second_name, SPARE);
  REQUIRE(second != nullptr);
  CHECK(rebuilt.spares(0) == second->incarnation());
  CheckTookOver(done, second->incarnation(), 1);
  CheckEverySyncAppliedOnce(done, spec);
  INFO(cluster.Logs());
  CHECK(cluster.ExitCode("a") == 0);
  CHECK(cluster.ExitCode(second_name) == 0);
}

TEST_CASE("a helper killed during a parallel replay ends the task and other spares rebuild the "
          "slot") {
  JobSpec spec;
  spec.batch_size = 256;
  spec.recovery_parallelism = 2;
  Cluster cluster(spec);
  cluster.StartWorker("a", TRAINER);
  cluster.StartWorker("b", TRAINER);
  for (const char* name : {"s1", "s2", "s3"}) cluster.StartWorker(name, SPARE);
  cluster.WaitFor(
      "b synced once and every spare waits for work",
      [](const GetStatusResponse& s) {
        int waiting = 0;
        for (const WorkerStatus& w : s.workers()) waiting += w.waiting_for_task();
        return s.slots(1).snapshot_step() > 0 && waiting == 3;
      },
      absl::Seconds(60), absl::Milliseconds(1));
  cluster.Signal("a", SIGSTOP);
  const int64_t t0 = WaitForLoggedSteps(cluster, 1, 100);
  cluster.Kill("b");
  cluster.Signal("a", SIGCONT);

  const GetStatusResponse claimed = cluster.WaitFor(
      "two spares take slot 1",
      [](const GetStatusResponse& s) { return s.slots(1).state() == RECOVERING; },
      absl::Seconds(30), absl::Milliseconds(2));
  REQUIRE(claimed.recoveries_size() == 1);
  REQUIRE(claimed.recoveries(0).spares_size() == 2);
  const uint64_t first_task = claimed.recoveries(0).task_id();
  const uint64_t leader = claimed.recoveries(0).spares(0);
  const uint64_t helper = claimed.recoveries(0).spares(1);
  const std::string helper_name = FindIncarnation(claimed, helper)->name();
  const std::string leader_name = FindIncarnation(claimed, leader)->name();
  CHECK(FindIncarnation(claimed, helper)->replay_task() == first_task);

  // Freeze the helper mid-replay (the leader cannot finish a step without it), then kill it.
  cluster.Signal(helper_name, SIGSTOP);
  absl::SleepFor(Scaled(absl::Milliseconds(300)));
  const GetStatusResponse frozen = cluster.Status();
  INFO(frozen.DebugString());
  REQUIRE(frozen.slots(1).state() == RECOVERING);
  REQUIRE_FALSE(frozen.recoveries(0).has_outcome());
  cluster.Kill(helper_name);

  const GetStatusResponse done = cluster.WaitFor("job finished", AllFinished);
  INFO(done.DebugString());
  REQUIRE(done.recoveries_size() == 2);
  const RecoveryStatus& failed = done.recoveries(0);
  CHECK(failed.task_id() == first_task);
  // The leader saw its helper's port close and gave the task up (ABANDONED), unless the failure
  // detector declared the helper dead first (SPARE_FAILED).
  CHECK((failed.outcome() == ABANDONED || failed.outcome() == SPARE_FAILED));
  CHECK_FALSE(failed.verified());
  if (failed.outcome() == ABANDONED) {
    CHECK(absl::StrContains(failed.detail(), absl::StrCat("spare 1 (incarnation ", helper)));
  }
  std::cout << "recovery_test: helper killed mid-replay: task " << first_task << " "
            << RecoveryOutcome_Name(failed.outcome()) << " (" << failed.detail() << "); "
            << done.recoveries(1).detail() << " by " << done.recoveries(1).spares_size()
            << " spare(s)" << std::endl;
  const RecoveryStatus& rebuilt = done.recoveries(1);
  CHECK(rebuilt.task_id() != first_task);
  // Whoever waited for work then: the old leader and s3, or one of them.
  CheckRebuilt(rebuilt, 1, t0, 100, spec.sync_period, rebuilt.spares_size());
  for (uint64_t spare : rebuilt.spares()) CHECK(spare != helper);
  CheckTookOver(done, rebuilt.spares(0), 1);
  cluster.WaitFor("the helper declared failed", [helper](const GetStatusResponse& s) {
    return FindIncarnation(s, helper)->state() == FAILED;
  });
  CheckEverySyncAppliedOnce(done, spec);
  INFO(cluster.Logs());
  CHECK(cluster.ExitCode("a") == 0);
  CHECK(cluster.ExitCode(leader_name) == 0);
}

TEST_CASE("reboundctl drain: the trainer leaves after its next sync and a spare takes the slot "
          "over from that snapshot, with nothing to replay") {
  JobSpec spec;
  spec.sync_period = 50;
  spec.max_steps = 600;
  Cluster cluster(spec);
  cluster.StartWorker("a", TRAINER);
  cluster.StartWorker("b", TRAINER);
  cluster.StartWorker("spare", SPARE);
  cluster.WaitFor("b synced once",
                  [](const GetStatusResponse& s) { return s.slots(1).snapshot_step() > 0; });
  const uint64_t b = FindWorker(cluster.Status(), "b", TRAINER)->incarnation();
  std::string said;
  REQUIRE(RunCommand({Runfile("tools/reboundctl"), "--server", cluster.address(), "drain", "1,0"},
                     &said, Scaled(absl::Seconds(30))) == 0);
  CHECK(said == absl::StrCat("draining slot (1,0): its trainer (incarnation ", b,
                             ") leaves after its next sync\n"));
  // Draining a slot nobody owns, or outside the job, is refused with the reason.
  std::string refused;
  CHECK(RunCommand({Runfile("tools/reboundctl"), "--server", cluster.address(), "drain", "7,0"},
                   &refused, Scaled(absl::Seconds(30))) == 1);
  CHECK(absl::StrContains(refused, "slot (7, 0) is outside the job's topology"));
  CHECK(RunCommand({Runfile("tools/reboundctl"), "--server", cluster.address(), "drain", "x"},
                   &refused, Scaled(absl::Seconds(30))) == 64);

  const GetStatusResponse done = cluster.WaitFor("job finished", AllFinished);
  INFO(done.DebugString());
  const WorkerStatus* drained = FindIncarnation(done, b);
  REQUIRE(drained != nullptr);
  CHECK(drained->state() == DRAINED);
  CHECK(absl::StartsWith(drained->state_reason(), "drained on request after its sync at step "));
  REQUIRE(done.recoveries_size() == 1);
  const RecoveryStatus& r = done.recoveries(0);
  CHECK(r.policy() == REPLAY);
  CHECK(r.outcome() == RECOVERED);
  CHECK(r.steps_replayed() == 0);
  CHECK(r.phases().detection_ms() == 0);  // it said goodbye; nobody waited for its silence
  CheckTookOver(done, r.spares(0), 1);
  CheckEverySyncAppliedOnce(done, spec);
  INFO(cluster.Logs());
  CHECK(cluster.ExitCode("b") == 0);
  CHECK(cluster.ExitCode("a") == 0);
  CHECK(cluster.ExitCode("spare") == 0);
}

TEST_CASE("two trainers killed at once are rebuilt by two spares, one slot each") {
  JobSpec spec;
  spec.replicas = 3;
  spec.max_steps = 1500;  // b or c may be a round ahead of the other when the kills begin
  Cluster cluster(spec);
  cluster.StartWorker("a", TRAINER);
  cluster.StartWorker("b", TRAINER);
  cluster.StartWorker("c", TRAINER);
  cluster.StartWorker("s1", SPARE);
  cluster.StartWorker("s2", SPARE);
  // Each of b and c is frozen at its first sync until the other has synced too: neither can be
  // rounds ahead when the kills begin (a trainer that started seconds before the other, on a busy
  // machine, had finished its slot before its kill: exit 0, not 137).
  for (const auto& [name, replica] : {std::pair<const char*, int>{"b", 1}, {"c", 2}}) {
    cluster.WaitFor(
        absl::StrCat(name, " synced once"),
        [replica = replica](const GetStatusResponse& s) {
          return s.slots(replica).snapshot_step() > 0;
        },
        absl::Seconds(60), absl::Milliseconds(1));
    cluster.Signal(name, SIGSTOP);
  }
  // b syncs and logs 30 steps while a and c are frozen, then c while a and b are; then both die
  // by one kill each, back to back.
  cluster.Signal("a", SIGSTOP);
  cluster.Signal("b", SIGCONT);
  // Each one's snapshot at its kill: frozen or dead mid-round, neither can sync again.
  int64_t t0[3] = {0, 0, 0};
  WaitForNextSync(cluster, 1);
  t0[1] = WaitForLoggedSteps(cluster, 1, 30);
  cluster.Signal("b", SIGSTOP);
  cluster.Signal("c", SIGCONT);
  WaitForNextSync(cluster, 2);
  t0[2] = WaitForLoggedSteps(cluster, 2, 30);
  cluster.Signal("b", SIGKILL);
  cluster.Signal("c", SIGKILL);
  REQUIRE(cluster.ExitCode("b", absl::Seconds(10)) == kKilledBySigkill);
  REQUIRE(cluster.ExitCode("c", absl::Seconds(10)) == kKilledBySigkill);
  cluster.Signal("a", SIGCONT);

  const GetStatusResponse done = cluster.WaitFor("job finished", AllFinished);
  INFO(done.DebugString());
  REQUIRE(done.recoveries_size() == 2);
  std::map<int, const RecoveryStatus*> by_replica;
  for (const RecoveryStatus& r : done.recoveries()) by_replica[r.slot().replica()] = &r;
  REQUIRE(by_replica.size() == 2);
  REQUIRE(by_replica.count(1) == 1);
  REQUIRE(by_replica.count(2) == 1);
  for (int replica : {1, 2}) {
    CheckRebuilt(*by_replica[replica], replica, t0[replica], 30, spec.sync_period);
    CheckTookOver(done, by_replica[replica]->spares(0), replica);
  }
  // One spare per slot: s1 and s2 each rebuilt one.
  const WorkerStatus* s1 = FindWorker(done, "s1", SPARE);
  const WorkerStatus* s2 = FindWorker(done, "s2", SPARE);
  REQUIRE(s1 != nullptr);
  REQUIRE(s2 != nullptr);
  const std::vector<uint64_t> used = {by_replica[1]->spares(0), by_replica[2]->spares(0)};
  CHECK((used == std::vector<uint64_t>{s1->incarnation(), s2->incarnation()} ||
         used == std::vector<uint64_t>{s2->incarnation(), s1->incarnation()}));
  for (const char* name : {"b", "c"}) {
    const WorkerStatus* dead = FindWorker(done, name, TRAINER);
    REQUIRE(dead != nullptr);
    CHECK(dead->state() == FAILED);
    CHECK(absl::StartsWith(dead->state_reason(), "its session ended "));
  }
  CHECK(done.slots(0).owner_incarnation() == FindWorker(done, "a", TRAINER)->incarnation());
  CheckEverySyncAppliedOnce(done, spec);
  INFO(cluster.Logs());
  CHECK(cluster.ExitCode("a") == 0);
  CHECK(cluster.ExitCode("s1") == 0);
  CHECK(cluster.ExitCode("s2") == 0);
}

// Where test 4 kills trainer "b": after its sync of round `round`, once `steps` more of its
// steps are in the store; `spares` spares wait, and the job's recovery_parallelism is that.
struct KillPoint {
  int64_t round = 0;
  int steps = 0;
  int spares = 1;
};

// Runs a DETERMINISTIC, UNIFORM job with trainers "a" (slot 0) and "b" (slot 1) and returns the
// final center. With a kill point, "b" is SIGKILLed there and kill->spares spares rebuild it by
// replay, together.
TensorBundle RunDeterministicJob(JobSpec spec, const KillPoint* kill) {
  if (kill != nullptr) spec.recovery_parallelism = kill->spares;
  Cluster cluster(spec);
  cluster.StartWorker("a", TRAINER);
  cluster.StartWorker("b", TRAINER);
  int64_t t0 = -1;
  std::vector<std::string> spares;
  if (kill != nullptr) {
    for (int i = 0; i < kill->spares; ++i) {
      spares.push_back(i == 0 ? "spare" : absl::StrCat("spare", i + 1));
      // With two spares, the second sends its sums inline while the first offers shared memory
      // (worker/shared_sums.h): both transports in one replay.
      cluster.StartWorker(spares.back(), SPARE, i == 1 ? "replay_shared_memory: false\n" : "");
    }
    cluster.WaitFor(
        absl::StrCat("b synced round ", kill->round),
        [&](const GetStatusResponse& s) {
          return s.slots(1).snapshot_step() >= kill->round * spec.sync_period;
        },
        absl::Seconds(60), absl::Milliseconds(1));
    // With "a" frozen, "b" cannot sync again (DETERMINISTIC: its next sync waits for a's). Had
    // b reached the end of its round, its sync would wait in the server; "a" stays frozen until
    // that wait has given up, so that a dead trainer's sync is never applied after its death.
    cluster.Signal("a", SIGSTOP);
    t0 = WaitForLoggedSteps(cluster, 1, kill->steps);
    cluster.Kill("b");
    absl::SleepFor(absl::Milliseconds(kMaxWaitMs) + Scaled(absl::Milliseconds(200)));
    cluster.Signal("a", SIGCONT);
    // Declared within crash_confirm_ms of the kill, while "a" is still frozen; the spares may
    // have rebuilt the slot and synced it again by the time this status is read, so the slot's
    // snapshot then is no figure to check: the recovery's record says it replayed from t0
    // (CheckRebuilt below), i.e. no sync of the dead "b" was applied after its death.
    cluster.WaitFor("b declared failed", [](const auto& s) {
      const WorkerStatus* b = FindWorker(s, "b", TRAINER);
      return b != nullptr && b->state() == FAILED;
    });
  }
  const GetStatusResponse done = cluster.WaitFor("job finished", AllFinished);
  if (kill != nullptr) {
    REQUIRE(done.recoveries_size() == 1);
    CheckRebuilt(done.recoveries(0), 1, t0, kill->steps, spec.sync_period, kill->spares);
    CheckTookOver(done, done.recoveries(0).spares(0), 1);
    // The helpers went back to the pool: spares still, alive until the job's end.
    for (int r = 1; r < done.recoveries(0).spares_size(); ++r) {
      const WorkerStatus* helper = FindIncarnation(done, done.recoveries(0).spares(r));
      REQUIRE(helper != nullptr);
      CHECK(helper->role() == SPARE);
      CHECK(helper->state() == ALIVE);
    }
    if (kill->spares == 2) {
      // The first spare's sums went through shared memory, the second's inline.
      CHECK(absl::StrContains(cluster.WorkerLog("spare"), "go through shared memory"));
      CHECK_FALSE(absl::StrContains(cluster.WorkerLog("spare2"), "go through shared memory"));
    }
    std::cout << "recovery_test: b killed after round " << kill->round << " and "
              << kill->steps << " logged steps; " << kill->spares << " spare(s): "
              << done.recoveries(0).detail() << std::endl;
  } else {
    CHECK(done.recoveries_size() == 0);
  }
  CheckEverySyncAppliedOnce(done, spec);
  INFO(cluster.Logs());
  CHECK(cluster.ExitCode("a") == 0);
  for (const std::string& spare : spares) CHECK(cluster.ExitCode(spare) == 0);
  const PullResponse center = cluster.Pull(cluster.RegisterObserver());
  CHECK(center.center_version() == spec.replicas * spec.max_steps / spec.sync_period);
  return center.center();
}

TEST_CASE("trainers killed at random steps and rebuilt by replay, by one spare and by two in "
          "parallel, end with the clean run's center, bit for bit") {
  // Another model, sync period and job length than training_test's (784-512-10, 100 and 400).
  JobSpec spec;
  spec.deterministic = true;
  spec.sync_period = 300;
  spec.max_steps = 1500;
  // A fixed seed, printed; REBOUND_TEST_SEED replaces it to explore other kill steps.
  uint32_t seed = 20241202;
  if (const char* text = std::getenv("REBOUND_TEST_SEED"); text != nullptr) {
    REQUIRE(absl::SimpleAtoi(text, &seed));
  }
  std::mt19937 random(seed);
  // After round 2 or 3 of 5 (b reaches round 2 well after this test starts watching it; the
  // last two rounds finish the job), once 10 to 100 of the next round's steps are logged: with
  // the StepLogger's 20 ms linger, the kill lands a few dozen steps later, well before the
  // round's end.
  std::uniform_int_distribution<int64_t> round(2, spec.max_steps / spec.sync_period - 2);
  std::uniform_int_distribution<int> steps(10, 100);
  KillPoint kills[2];
  for (KillPoint& kill : kills) {
    kill.round = round(random);
    kill.steps = steps(random);
  }
  kills[1].spares = 2;  // k = 2: two spares replay a block of micro-batches each
  std::cout << "recovery_test: seed " << seed << ", kill after step "
            << kills[0].round * spec.sync_period << " + " << kills[0].steps << " and after step "
            << kills[1].round * spec.sync_period << " + " << kills[1].steps << std::endl;
  INFO("seed " << seed);

  const TensorBundle clean = RunDeterministicJob(spec, nullptr);
  for (const KillPoint& kill : kills) {
    INFO("kill after round " << kill.round << " + " << kill.steps << " steps, " << kill.spares
                              << " spare(s)");
    CHECK(SameBytes(RunDeterministicJob(spec, &kill), clean));
  }
}

int64_t DirectoryBytes(const std::string& dir) {
  int64_t total = 0;
  std::error_code error;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, error);
       !error && it != std::filesystem::recursive_directory_iterator(); it.increment(error)) {
    std::error_code size_error;
    if (it->is_regular_file(size_error)) {
      const auto size = it->file_size(size_error);
      if (!size_error) total += static_cast<int64_t>(size);
    }
  }
  return total;
}

// The stored step log of one slot, read back through the product's own DurableStore.
struct StoredLog {
  int64_t snapshot_step = 0;
  int64_t records = 0;
  int64_t bytes = 0;
  int64_t lowest_step = 0;  // 0 when empty
  int64_t highest_step = 0;
};

std::vector<StoredLog> ReadStoredLogs(const std::string& data_dir, int replicas) {
  storage::DurableStoreOptions options;
  options.data_dir = data_dir;
  auto store = storage::DurableStore::Open(options);
  INFO(store.status());
  REQUIRE(store.ok());
  auto state = (*store)->LoadAll();
  INFO(state.status());
  REQUIRE(state.ok());
  std::vector<StoredLog> logs(replicas);
  for (int r = 0; r < replicas; ++r) {
    SlotId slot;
    slot.set_replica(r);
    slot.set_stage(0);
    auto snapshot = state->snapshots.find({r, 0});
    if (snapshot != state->snapshots.end()) logs[r].snapshot_step = snapshot->second.step();
    auto records = (*store)->ReadLog(slot, 0, std::numeric_limits<int64_t>::max());
    INFO(records.status());
    REQUIRE(records.ok());
    for (const LogRecord& record : *records) {
      ++logs[r].records;
      logs[r].bytes += static_cast<int64_t>(record.ByteSizeLong());
      if (logs[r].lowest_step == 0) logs[r].lowest_step = record.step();
      logs[r].highest_step = record.step();
    }
  }
  return logs;
}

TEST_CASE("over 100 sync rounds the step log's GC keeps the stored log within one sync period "
          "per slot") {
  JobSpec spec;
  // The small model keeps the snapshots small (about 100 KB a sync); big batches make a round
  // of 8 steps last longer than the StepLogger's 20 ms linger, so that most records reach the
  // store before their step's sync and the GC, not the floor, removes them.
  spec.model = kSmallModel;
  spec.batch_size = 2048;
  spec.train_limit = 10000;
  spec.sync_period = 8;
  spec.max_steps = 8 * 100;
  spec.durable = true;
  // The bound: a trainer ships steps t0+1..t0+tau before its sync at t0+tau, and that sync's
  // commit deletes every record up to it (atomically with the snapshot, serialized with the
  // slot's AppendLog batches), so a slot's stored log never holds more than tau steps, all in
  // (snapshot, snapshot + tau].
  const int64_t bound_per_slot = int64_t{spec.sync_period} * kRecordsPerStep;
  Cluster cluster(spec);
  cluster.StartWorker("a", TRAINER);
  cluster.StartWorker("b", TRAINER);

  struct Sample {
    int64_t round = 0;         // the slower slot's synced rounds
    int64_t synced_steps = 0;  // summed over the slots
    int64_t data_dir_bytes = 0;
    StepLogStatus counters;
    std::vector<StoredLog> logs;
  };
  std::vector<Sample> samples;
  // Sample just after these rounds, with both trainers frozen by SIGSTOP while the data
  // directory is copied and the copy is read (well under a second, far below failure_timeout),
  // so that the copy is quiescent and the job waits for the sample.
  for (int64_t round : {10, 20, 35, 50, 65, 80}) {
    const GetStatusResponse reached = cluster.WaitFor(
        absl::StrCat("round ", round),
        [&](const GetStatusResponse& s) {
          return std::min(s.slots(0).snapshot_step(), s.slots(1).snapshot_step()) >=
                     round * spec.sync_period ||
                 AllFinished(s);
        },
        absl::Seconds(60), absl::Milliseconds(1));
    if (AllFinished(reached)) break;
    absl::SleepFor(absl::Milliseconds(25));  // into the next round: its log is being shipped
    cluster.Signal("a", SIGSTOP);
    cluster.Signal("b", SIGSTOP);
    absl::SleepFor(Scaled(absl::Milliseconds(100)));  // calls in flight land
    Sample sample;
    const GetStatusResponse frozen = cluster.Status();
    sample.round = std::min(frozen.slots(0).snapshot_step(), frozen.slots(1).snapshot_step()) /
                   spec.sync_period;
    sample.synced_steps = frozen.slots(0).snapshot_step() + frozen.slots(1).snapshot_step();
    sample.counters = frozen.step_log();
    sample.data_dir_bytes = DirectoryBytes(cluster.data_dir());
    const std::string copy = MakeTempDir("store-copy");
    std::error_code error;
    std::filesystem::copy(cluster.data_dir(), copy, std::filesystem::copy_options::recursive,
                          error);
    INFO(error.message());
    REQUIRE_FALSE(error);
    sample.logs = ReadStoredLogs(copy, spec.replicas);
    cluster.Signal("a", SIGCONT);
    cluster.Signal("b", SIGCONT);
    std::filesystem::remove_all(copy, error);
    samples.push_back(sample);
  }
  cluster.WaitFor("job finished", AllFinished);
  INFO(cluster.Logs());
  CHECK(cluster.ExitCode("a") == 0);
  CHECK(cluster.ExitCode("b") == 0);
  // Read after the trainers exited: they flush their last records before that.
  const StepLogStatus total = cluster.Status().step_log();
  const int64_t final_data_dir_bytes = DirectoryBytes(cluster.data_dir());
  cluster.StopServer();
  const std::vector<StoredLog> final_logs = ReadStoredLogs(cluster.data_dir(), spec.replicas);

  std::cout << "recovery_test: round, data dir bytes, records_written, bytes_written, "
               "below_snapshot_dropped, stored records (slot 0, slot 1), stored bytes\n";
  for (const Sample& s : samples) {
    std::cout << "  " << s.round << ", " << s.data_dir_bytes << ", "
              << s.counters.records_written() << ", " << s.counters.bytes_written() << ", "
              << s.counters.below_snapshot_dropped() << ", (" << s.logs[0].records << ", "
              << s.logs[1].records << "), " << s.logs[0].bytes + s.logs[1].bytes << "\n";
  }
  std::cout << "  " << spec.max_steps / spec.sync_period << ", " << final_data_dir_bytes << ", "
            << total.records_written() << ", " << total.bytes_written() << ", "
            << total.below_snapshot_dropped() << ", (" << final_logs[0].records << ", "
            << final_logs[1].records << "), " << final_logs[0].bytes + final_logs[1].bytes
            << std::endl;

  // Samples spread over the run.
  REQUIRE(samples.size() >= 4);
  CHECK(samples.back().round >= 80);
  int64_t previous_written = 0;
  int64_t stored_max = 0;
  for (const Sample& s : samples) {
    INFO("round " << s.round);
    for (int r = 0; r < spec.replicas; ++r) {
      const StoredLog& log = s.logs[r];
      INFO("slot " << r << ": " << log.records << " records, steps " << log.lowest_step << ".."
                   << log.highest_step << ", snapshot at step " << log.snapshot_step);
      CHECK(log.records <= bound_per_slot);
      if (log.records > 0) {
        CHECK(log.lowest_step > log.snapshot_step);
        CHECK(log.highest_step <= log.snapshot_step + spec.sync_period);
      }
      stored_max = std::max(stored_max, log.records);
    }
    // records_written only grows, and never counts a step not trained yet (a trainer is at
    // most one sync period past its snapshot).
    CHECK(s.counters.records_written() >= previous_written);
    previous_written = s.counters.records_written();
    CHECK(s.counters.records_written() + s.counters.below_snapshot_dropped() <=
          kRecordsPerStep * (s.synced_steps + spec.replicas * spec.sync_period));
  }
  // The samples caught the log in the store: what they read is not empty by construction.
  CHECK(stored_max > 0);
  // Every record of every step was either written or dropped below a snapshot (it arrived after
  // its step's sync), exactly once: 8000 records. At least ten times what the bound lets the
  // store keep must have been written, so that the GC, not the dropping, kept the log small.
  CHECK(total.records_written() + total.below_snapshot_dropped() ==
        kRecordsPerStep * spec.replicas * spec.max_steps);
  CHECK(total.records_written() >= 10 * spec.replicas * bound_per_slot);
  CHECK(total.duplicates_dropped() == 0);
  // After the last sync (step 800) nothing is left, and the snapshots are the last syncs'.
  for (int r = 0; r < spec.replicas; ++r) {
    INFO("slot " << r);
    CHECK(final_logs[r].records == 0);
    CHECK(final_logs[r].snapshot_step == spec.max_steps);
  }
}

SyncRequest MakeSync(const RegisterResponse& trainer, int64_t step, const TensorBundle& params) {
  SyncRequest request;
  request.set_incarnation(trainer.incarnation());
  *request.mutable_slot() = trainer.slot();
  request.set_step(step);
  *request.mutable_params() = params;
  return request;
}

// Fails with rebound 0.2.0: ParameterServerService::Sync checks the owner before WaitForTurn and
// not after, so a sync that waited there is applied even though its sender was fenced meanwhile
// (and its slot handed to recovery). Deselect with --test_arg='~[fencing]' until fixed.
TEST_CASE("a sync that waits for its DETERMINISTIC turn is refused once its sender is fenced",
          "[fencing]") {
  // The product's defaults let a sync wait far longer (max_wait_ms 30 s) than a silent trainer
  // takes to be declared failed (failure_timeout_ms 3 s); here 10 s and 1 s. Two test clients
  // play the trainers.
  JobSpec spec;
  spec.model = kSmallModel;
  spec.deterministic = true;
  spec.sync_period = 8;
  spec.max_steps = 80;
  spec.failure_timeout_ms = 1000;
  spec.max_wait_ms = 10000;
  Cluster cluster(spec);
  const RegisterResponse t0 = cluster.Register("t0", TRAINER);
  const RegisterResponse t1 = cluster.Register("t1", TRAINER);
  REQUIRE(t1.slot().replica() == 1);
  const TensorBundle center = cluster.Pull(t0.incarnation()).center();

  // t1's first sync must wait for t0's (replica order).
  grpc::Status late_status;
  SyncResponse late_reply;
  std::thread late([&] {
    late_status = cluster.Call(&ParameterServer::Stub::Sync, MakeSync(t1, 8, center),
                               &late_reply, absl::Seconds(20));
  });
  struct JoinOnExit {
    std::thread& thread;
    ~JoinOnExit() {
      if (thread.joinable()) thread.join();  // the call is bounded by its deadline
    }
  } join_late{late};
  // Meanwhile t1 falls silent and is declared failed; t0 heartbeats.
  const absl::Time deadline = absl::Now() + Scaled(absl::Seconds(10));
  GetStatusResponse status;
  while (true) {
    HeartbeatRequest beat;
    beat.set_incarnation(t0.incarnation());
    HeartbeatResponse ack;
    CHECK(cluster.Call(&ParameterServer::Stub::Heartbeat, beat, &ack).ok());
    status = cluster.Status();
    const WorkerStatus* w = FindWorker(status, "t1", TRAINER);
    if (w != nullptr && w->state() == FAILED) break;
    if (absl::Now() > deadline) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  const WorkerStatus* fenced = FindWorker(status, "t1", TRAINER);
  const bool declared_failed = fenced != nullptr && fenced->state() == FAILED;
  // t0's sync gives t1's waiting sync its turn.
  SyncResponse reply;
  const grpc::Status synced =
      cluster.Call(&ParameterServer::Stub::Sync, MakeSync(t0, 8, center), &reply);
  late.join();
  REQUIRE(declared_failed);
  REQUIRE(synced.ok());
  INFO(late_status.error_code() << " " << late_status.error_message());
  // A fenced worker never writes again: its sync is refused and changes nothing.
  CHECK(late_status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  const GetStatusResponse after = cluster.Status();
  INFO(after.DebugString());
  CHECK(after.slots(1).update_count() == 0);
  CHECK(after.slots(1).snapshot_step() == 0);
  CHECK(after.centers(0).version() == 1);
}

}  // namespace
}  // namespace rebound::testing
