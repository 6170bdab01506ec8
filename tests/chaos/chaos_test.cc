// A short seeded chaos run (tests/chaos/chaos.h, docs/chaos.md) against the real rebound_server
// and rebound_worker: a fault-free run of a small job, then the same job under a seeded schedule
// of faults that always holds a trainer SIGKILL and a server SIGKILL with restart; the run must
// finish with every sync applied exactly once (status and the RocksDB store read back), every
// rebuilt slot a verified REPLAY, and, the job being DETERMINISTIC with UNIFORM weights, the
// fault-free run's center bit for bit (hence its accuracy).
//
// The seed is printed; REBOUND_CHAOS_SEED=<n> replays another schedule, e.g.
//   bazel test //tests/chaos:chaos_test --test_env=REBOUND_CHAOS_SEED=7 --test_output=all
//
// The cases tagged [group] (//tests/chaos:chaos_group_test runs them, //tests/chaos:chaos_test
// the others) run the same job on a replicated server group (a leader, a standby, etcd of 3
// members; docs/design.md §10.1): a fault-free group run, then two fixed seeds (one per case, the
// second tagged [full]: chaos_group_test_full, tools/test.sh --full) whose schedules hold,
// between them, every group fault kind (the leader SIGKILLed, its disk lost, the leader
// SIGSTOPped past its lease, one etcd member lost, every etcd member lost, a standby's disk
// lost) besides a trainer kill; each must finish exactly once in the final leader's store and
// in every member's, lose no sync a trainer was answered, and end on the fault-free run's
// center bit for bit.
//
// The case tagged [sharded] (//tests/chaos:chaos_sharded_test runs it) runs the job with its
// center sharded across 2 server groups of one server each (docs/design.md §10.2, docs/sharding.md)
// under a fixed seed whose schedule holds a trainer that dies between its ranges (after range
// 0, before range 1 and the commit), a range group's server SIGKILLed and restarted, and a
// trainer kill; it must apply every sync once in every range (status, PullRange and each group's
// store), lose no sync a trainer was answered, and end bit for bit on the center of a fault-free
// run of the same job UNSHARDED (sharding changes no bit of the result).

#include "tests/chaos/chaos.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/config.h"

namespace rebound::chaos {
namespace {

constexpr uint64_t kDefaultSeed = 20241203;
constexpr int kFaults = 5;

// Group mode: two seeds whose schedules hold, between them, every group fault kind.
constexpr int64_t kGroupSteps = 9600;
constexpr int kGroupFaults = 4;  // three group kinds and a trainer kill or another drawn kind
struct GroupSeed {
  uint64_t seed;
  std::vector<FaultKind> must;
};
const GroupSeed kGroupSeeds[] = {
    {11, {FaultKind::kKillLeader, FaultKind::kLeaderDiskLoss, FaultKind::kKillEtcdMember}},
    {12, {FaultKind::kStopLeader, FaultKind::kKillAllEtcd, FaultKind::kRestartStandbyEmpty}},
};

// Sharded mode: 2 groups; a seed whose schedule (process kinds only, the same on every machine)
// kills a range group's server (pick % 2 == 1) and has trainers die after range 0 of 2: seed 2
// kills trainer-1 at progress 0.10, trainer-0 dies in its sync of step 400 and trainer-2 in its
// sync of step 600, group 1's server is killed at progress 0.18 for 0.5 s, and the third
// die_between_ranges (trainer-1's) finds its trainer gone.
constexpr int kShardGroups = 2;
constexpr uint64_t kShardSeed = 2;
constexpr int kShardFaults = 5;
const std::vector<FaultKind> kShardKinds = {
    FaultKind::kKillTrainer, FaultKind::kStopTrainer, FaultKind::kKillSpare,
    FaultKind::kKillServer,  FaultKind::kStopServer,  FaultKind::kDieBetweenRanges};
const std::vector<FaultKind> kShardMust = {FaultKind::kKillTrainer, FaultKind::kKillServer,
                                           FaultKind::kDieBetweenRanges};

std::string Runfile(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr) return path;
  return absl::StrCat(srcdir, "/", workspace != nullptr ? workspace : "rebound", "/", path);
}

ChaosOptions Options(uint64_t seed, int faults) {
  ChaosOptions options;
  options.seed = seed;
  options.faults = faults;
  options.must_include = {FaultKind::kKillTrainer, FaultKind::kKillServer};
  options.server_binary = Runfile("server/rebound_server");
  options.worker_binary = Runfile("worker/rebound_worker");
  const char* tmp = std::getenv("TEST_TMPDIR");
  options.work_dir = tmp != nullptr ? tmp : "/tmp";
  options.time_limit = absl::Minutes(2);  // each run; Bazel's moderate timeout is 5 minutes
  options.log = [](const std::string& line) { std::cout << "chaos: " << line << std::endl; };
  return options;
}

TEST_CASE("a seed plans the same bounded schedule every time, with the kinds it must hold",
          "[plan]") {
  const ChaosJob job;
  const std::vector<FaultKind> must = {FaultKind::kKillTrainer, FaultKind::kKillServer};
  const std::vector<PlannedFault> a = PlanFaults(42, 8, AllFaultKinds(), must, job);
  const std::vector<PlannedFault> b = PlanFaults(42, 8, AllFaultKinds(), must, job);
  REQUIRE(a.size() == 8);
  REQUIRE(b.size() == 8);
  std::set<FaultKind> kinds;
  for (size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].ToString());
    CHECK(a[i].ToString() == b[i].ToString());
    CHECK(a[i].pick == b[i].pick);
    CHECK(a[i].at_progress >= 0.08);
    CHECK(a[i].at_progress <= 0.8);
    if (i > 0) CHECK(a[i].at_progress >= a[i - 1].at_progress);
    CHECK(a[i].duration <= MaxFaultDuration(job));
    if (!IsGroupFault(a[i].kind)) {
      CHECK(a[i].duration <= absl::Milliseconds(2.5 * job.failure_timeout_ms));
    }
    kinds.insert(a[i].kind);
  }
  CHECK(kinds.count(FaultKind::kKillTrainer) == 1);
  CHECK(kinds.count(FaultKind::kKillServer) == 1);
  // Another seed, another schedule; no kind outside those allowed.
  const std::vector<PlannedFault> c = PlanFaults(43, 8, AllFaultKinds(), must, job);
  bool differs = false;
  for (size_t i = 0; i < c.size(); ++i) differs = differs || c[i].ToString() != a[i].ToString();
  CHECK(differs);
  const std::vector<FaultKind> process_only = {FaultKind::kKillSpare, FaultKind::kStopServer};
  for (const PlannedFault& f : PlanFaults(7, 6, process_only, must, job)) {
    CHECK((f.kind == FaultKind::kKillSpare || f.kind == FaultKind::kStopServer));
  }
  CHECK(PlanFaults(7, 0, AllFaultKinds(), must, job).empty());
}

TEST_CASE("a group schedule holds its kinds, stops the leader past its lease, and bounds outages",
          "[plan]") {
  const ChaosJob job;
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    const std::vector<PlannedFault> plan =
        PlanFaults(seed, 6, GroupFaultKinds(), GroupFaultKinds(), job);
    REQUIRE(plan.size() == 6);
    std::set<FaultKind> kinds;
    for (const PlannedFault& f : plan) {
      INFO("seed " << seed << ": " << f.ToString());
      CHECK(IsGroupFault(f.kind));
      CHECK_FALSE(IsSingleServerFault(f.kind));
      CHECK(f.duration >= absl::ZeroDuration());
      CHECK(f.duration <= MaxFaultDuration(job));
      if (f.kind == FaultKind::kStopLeader) {
        CHECK(f.duration > absl::Milliseconds(1.5 * job.leader_lease_ms));
      }
      kinds.insert(f.kind);
    }
    CHECK(kinds.size() == GroupFaultKinds().size());  // each must-include kind once
  }
  CHECK(GroupFaultKinds().size() == 6);
  for (FaultKind kind : GroupFaultKinds()) CHECK_FALSE(IsNetworkFault(kind));
  CHECK(IsSingleServerFault(FaultKind::kKillServer));
  CHECK(IsSingleServerFault(FaultKind::kStopServer));
}

TEST_CASE(
    "a seeded chaos run finishes with every sync applied once, every rebuilt slot a "
    "verified replay, and the fault-free run's center",
    "[single]") {
  uint64_t seed = kDefaultSeed;
  if (const char* text = std::getenv("REBOUND_CHAOS_SEED"); text != nullptr) {
    REQUIRE(absl::SimpleAtoi(text, &seed));
  }
  std::cout << "chaos_test: seed " << seed << " (REBOUND_CHAOS_SEED overrides it)" << std::endl;
  const ChaosJob job;  // 3 trainers, DETERMINISTIC, UNIFORM

  const RunReport reference = RunChaos(job, Options(seed, 0));
  std::cout << "chaos_test: fault-free run: " << reference.Summary() << std::endl;
  INFO("fault-free run: " << reference.Summary());
  REQUIRE(reference.ok());
  REQUIRE(reference.finished);
  CHECK(reference.recoveries == 0);

  const RunReport run = RunChaos(job, Options(seed, kFaults), &reference);
  std::cout << "chaos_test: run with faults: " << run.Summary() << std::endl;
  INFO("seed " << seed << "\n" << run.Summary());
  CHECK(run.errors.empty());
  CHECK(run.violations.empty());
  REQUIRE(run.finished);
  CHECK(run.total_faults() + run.skipped_faults + run.unfired_faults == kFaults);
  CHECK(run.faults.count("kill_trainer") == 1);
  CHECK(run.faults.count("kill_server") == 1);
  CHECK(run.server_restarts >= 1);
  CHECK(run.recoveries >= 1);
  CHECK(run.accuracy > 0.5);  // it learned
  CHECK(run.accuracy == reference.accuracy);
  CHECK(run.center_identical);
}

TEST_CASE("each mode has its kinds: group kinds need standbys, die_between_ranges shard groups, "
          "and a sharded job has no byzantine trainer",
          "[plan]") {
  ChaosOptions single;
  ChaosOptions group;
  group.standbys = 1;
  ChaosOptions sharded;
  sharded.shard_groups = 2;
  ChaosOptions sharded_group = group;
  sharded_group.shard_groups = 2;
  for (FaultKind kind : AllFaultKinds()) {
    INFO(FaultKindName(kind));
    CHECK(KindFitsMode(kind, single) == !(IsGroupFault(kind) || IsShardedFault(kind)));
    CHECK(KindFitsMode(kind, group) == !(IsSingleServerFault(kind) || IsShardedFault(kind)));
    CHECK(KindFitsMode(kind, sharded) == !(IsGroupFault(kind) || kind == FaultKind::kByzantine));
    CHECK(KindFitsMode(kind, sharded_group) ==
          !(IsSingleServerFault(kind) || kind == FaultKind::kByzantine));
  }
  CHECK(IsShardedFault(FaultKind::kDieBetweenRanges));
  CHECK_FALSE(IsGroupFault(FaultKind::kDieBetweenRanges));
  CHECK_FALSE(IsNetworkFault(FaultKind::kDieBetweenRanges));
  CHECK(std::string(FaultKindName(FaultKind::kDieBetweenRanges)) == "die_between_ranges");
  // The test's sharded seed: a range group's server killed, a trainer dying after range 0 of 2.
  const ChaosJob job;
  const std::vector<PlannedFault> plan =
      PlanFaults(kShardSeed, kShardFaults, kShardKinds, kShardMust, job);
  REQUIRE(plan.size() == kShardFaults);
  bool range_server_killed = false;
  bool dies_after_range_0 = false;
  for (const PlannedFault& f : plan) {
    INFO(f.ToString());
    if (f.kind == FaultKind::kKillServer && f.pick % kShardGroups == 1) range_server_killed = true;
    if (f.kind == FaultKind::kDieBetweenRanges &&
        (f.pick / static_cast<uint32_t>(job.replicas)) % kShardGroups == 0) {
      dies_after_range_0 = true;
    }
  }
  CHECK(range_server_killed);
  CHECK(dies_after_range_0);
}

// The group's job: long enough that three group faults, each waiting for the group to be whole
// again (a failover, a restart, a catch-up from a checkpoint), all fire before its end.
ChaosJob GroupJob() {
  ChaosJob job;
  job.max_steps = kGroupSteps;
  return job;
}

ChaosOptions GroupOptions(uint64_t seed, int faults, const std::vector<FaultKind>& must) {
  ChaosOptions options = Options(seed, faults);
  options.standbys = 1;
  options.etcd_members = 3;
  options.network = false;  // the same schedule on every machine
  options.kinds = must;
  options.kinds.push_back(FaultKind::kKillTrainer);
  options.must_include = must;
  options.time_limit = absl::Minutes(3);
  return options;
}

// A fault-free group run, then the group run of each of `seeds`, checked against it.
void CheckGroupRuns(const std::vector<GroupSeed>& seeds) {
  const ChaosJob job = GroupJob();
  const RunReport reference = RunChaos(job, GroupOptions(seeds.front().seed, 0, {}));
  std::cout << "chaos_test: fault-free group run: " << reference.Summary() << std::endl;
  INFO("fault-free group run: " << reference.Summary());
  REQUIRE(reference.ok());
  REQUIRE(reference.finished);
  CHECK(reference.leader_changes == 0);
  CHECK(reference.members_compared == 2);  // the leader's store and the standby's

  for (const GroupSeed& g : seeds) {
    const RunReport run = RunChaos(job, GroupOptions(g.seed, kGroupFaults, g.must), &reference);
    std::cout << "chaos_test: group run: " << run.Summary() << std::endl;
    INFO("seed " << g.seed << "\n" << run.Summary());
    CHECK(run.errors.empty());
    CHECK(run.violations.empty());
    REQUIRE(run.finished);
    CHECK(run.total_faults() + run.skipped_faults + run.unfired_faults == kGroupFaults);
    for (FaultKind kind : g.must) {
      INFO(FaultKindName(kind));
      CHECK(run.faults.count(FaultKindName(kind)) == 1);
    }
    CHECK(run.leader_changes >= 1);
    CHECK(run.acknowledged_syncs > 0);
    CHECK(run.members_compared == 2);
    CHECK(run.accuracy > 0.5);
    CHECK(run.accuracy == reference.accuracy);
    CHECK(run.center_identical);
  }
}

TEST_CASE("silent_corruption is drawn only when named, for a job that audits, sharded or not",
          "[plan]") {
  for (FaultKind kind : AllFaultKinds()) CHECK(kind != FaultKind::kSilentCorruption);
  REQUIRE(NamedOnlyFaultKinds().size() == 1);
  CHECK(NamedOnlyFaultKinds()[0] == FaultKind::kSilentCorruption);
  CHECK(std::string(FaultKindName(FaultKind::kSilentCorruption)) == "silent_corruption");
  ChaosOptions single;
  CHECK(KindFitsMode(FaultKind::kSilentCorruption, single));
  ChaosOptions sharded;
  sharded.shard_groups = 2;
  CHECK(KindFitsMode(FaultKind::kSilentCorruption, sharded));
  // The job audits every window when asked, and the server accepts it.
  ChaosJob job;
  CHECK_FALSE(MakeChaosJob(job).has_audit());
  job.audit = true;
  const JobConfig audited = MakeChaosJob(job);
  CHECK(audited.audit().fraction() == 1);
  CHECK(audited.audit().on_mismatch() == AUDIT_REPORT);
  CHECK(ValidateJobConfig(audited).ok());
  // Naming it changes no default schedule: the kinds drawn by default are as before.
  const std::vector<FaultKind> must = {FaultKind::kKillTrainer, FaultKind::kKillServer};
  const std::vector<PlannedFault> plan = PlanFaults(42, 8, AllFaultKinds(), must, job);
  for (const PlannedFault& f : plan) CHECK(f.kind != FaultKind::kSilentCorruption);
}

TEST_CASE("between them, the group seeds must inject every group fault kind") {
  std::set<FaultKind> must;
  for (const GroupSeed& g : kGroupSeeds) must.insert(g.must.begin(), g.must.end());
  for (FaultKind kind : GroupFaultKinds()) {
    INFO(FaultKindName(kind));
    CHECK(must.count(kind) == 1);
  }
}

// The first seed in every tier (a leader killed, its disk lost, an etcd member killed); the
// second, which holds the other group kinds, in tools/test.sh --full (chaos_group_test_full):
// the default tier checks those kinds in //tests/integration:group_test's cases (a leader
// SIGSTOPped past its lease, every etcd member lost, a standby's catch-up from nothing).
TEST_CASE(
    "a replicated group under chaos loses no answered sync, applies every sync once in every "
    "member's store, and ends on the fault-free run's center",
    "[group]") {
  CheckGroupRuns({kGroupSeeds[0]});
}

TEST_CASE(
    "a replicated group under chaos (a leader stopped, all of etcd lost, a standby restarted "
    "empty) loses no answered sync and ends on the fault-free run's center",
    "[group][.full]") {
  CheckGroupRuns({kGroupSeeds[1]});
}

ChaosOptions ShardOptions(uint64_t seed, int faults) {
  ChaosOptions options = Options(seed, faults);
  options.shard_groups = kShardGroups;
  options.network = false;  // the same schedule on every machine
  options.kinds = kShardKinds;
  options.must_include = kShardMust;
  return options;
}

TEST_CASE(
    "a center sharded across 2 groups under chaos applies every sync once in every range, loses "
    "no answered sync, and ends on the unsharded fault-free run's center bit for bit",
    "[sharded]") {
  uint64_t seed = kShardSeed;
  if (const char* text = std::getenv("REBOUND_CHAOS_SEED"); text != nullptr) {
    REQUIRE(absl::SimpleAtoi(text, &seed));
  }
  std::cout << "chaos_test: sharded seed " << seed << " (REBOUND_CHAOS_SEED overrides it)"
            << std::endl;
  const ChaosJob job;  // 3 trainers, DETERMINISTIC, UNIFORM
  // The reference: the same job on one server, fault-free.
  ChaosOptions unsharded = Options(seed, 0);
  unsharded.network = false;
  const RunReport reference = RunChaos(job, unsharded);
  std::cout << "chaos_test: fault-free unsharded run: " << reference.Summary() << std::endl;
  INFO("fault-free unsharded run: " << reference.Summary());
  REQUIRE(reference.ok());
  REQUIRE(reference.finished);

  const RunReport run = RunChaos(job, ShardOptions(seed, kShardFaults), &reference);
  std::cout << "chaos_test: sharded run with faults: " << run.Summary() << std::endl;
  INFO("seed " << seed << "\n" << run.Summary());
  CHECK(run.errors.empty());
  CHECK(run.violations.empty());
  REQUIRE(run.finished);
  CHECK(run.shard_groups == kShardGroups);
  CHECK(run.total_faults() + run.skipped_faults + run.unfired_faults == kShardFaults);
  CHECK(run.faults.count("kill_trainer") == 1);
  CHECK(run.faults.count("kill_server") == 1);
  CHECK(run.faults.count("die_between_ranges") == 1);
  CHECK(run.died_between_ranges >= 1);
  CHECK(run.server_restarts >= 1);
  CHECK(run.recoveries >= 2);  // the killed trainer's slot and those that died mid-sync
  const int64_t syncs = job.replicas * (job.max_steps / job.sync_period);
  REQUIRE(run.range_versions.size() == static_cast<size_t>(kShardGroups));
  for (int64_t version : run.range_versions) CHECK(version == syncs);
  CHECK(run.acknowledged_syncs > 0);
  CHECK(run.members_compared == kShardGroups);
  CHECK(run.accuracy > 0.5);
  CHECK(run.accuracy == reference.accuracy);
  CHECK(run.center_identical);
}

}  // namespace
}  // namespace rebound::chaos
