// Audit replay (docs/recovery.md#audits, docs/design.md §14) against the real rebound_server and
// rebound_worker binaries on loopback: idle spares replay live trainers' sync windows and compare
// every step's checksum with the log. One trainer flips one bit of one parameter once per sync
// window (--fault_flip_bit_at_step, --fault_flip_bit_repeat_every: no crash, no NaN, its logged
// checksum is of the corrupted parameters); every window is chosen for an audit (fraction 1) as
// long as there is room for it to wait. What is checked, from the server's status
// and /metrics: the mismatch is found at that step, confirmed by a second replay on the other
// spare, charged to that trainer's machine and nobody else, and under AUDIT_QUARANTINE the
// trainer is fenced and its slot restarts from the center; the fault-free trainer's audits all
// match. A pipeline stage's corruption is caught the same way, from its neighbour's logged pairs.
// A sharded center's windows start from the ranges' snapshots, read and joined by group 0. A
// last case kills a trainer while audits run: the recovery is not held up.

#include <signal.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "catch2/catch.hpp"
#include "proto/rebound.pb.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/scrape.h"
#include "tests/integration/status_util.h"
#include "testing/cluster/time_scale.h"

namespace rebound::testing {
namespace {

constexpr int kSyncPeriod = 20;
// The corrupted trainer flips a bit after step 50 and every sync period after it: every window
// of it from (40, 60] on holds one flip, so whichever of its windows is audited first (windows
// beyond the waiting room are skipped) differs at its flip.
constexpr int kCorruptStep = 50;

// `extra`: more job fields (a sharding block).
std::string JobText(const char* on_mismatch, int64_t max_steps, int replicas,
                    const std::string& extra = "") {
  return absl::StrCat(
      "  job_id: \"audit\"\n", extra,
      "  model { layers { width: 16 } layers { width: 10 activation: IDENTITY } }\n",
      "  topology { replicas: ", replicas, " }\n",
      "  weighting { policy: UNIFORM }\n",
      "  fault_tolerance { policy: REPLAY heartbeat_interval_ms: 200 failure_timeout_ms: 3000 }\n",
      "  data { batch_size: 32 micro_batches: 2 train_limit: 2000 test_limit: 100 }\n",
      "  adahessian { lr: 0.01 }\n",
      "  easgd { sync_period: ", kSyncPeriod, " }\n",
      "  step_log { linger_ms: 20 }\n",
      "  training { max_steps: ", max_steps, " }\n",
      // Room for 16 windows to wait: the first ones are kept, whatever the spares' pace.
      "  audit { fraction: 1 max_concurrent: 8 on_mismatch: ", on_mismatch, " }\n");
}

// The two trainers, `clean` then `corrupt` (slots 0 and 1, or stages 0 and 1), `corrupt` flipping
// a bit after kCorruptStep and every sync period after it, and two auditing spares.
void StartTrainersAndSpares(LocalCluster& cluster, const std::string& clean,
                            const std::string& corrupt) {
  cluster.StartWorker(clean, TRAINER);
  cluster.StartWorker(corrupt, TRAINER, "",
                      {absl::StrCat("--fault_flip_bit_at_step=", kCorruptStep),
                       absl::StrCat("--fault_flip_bit_repeat_every=", kSyncPeriod)});
  cluster.StartWorker("spare-1", SPARE);
  cluster.StartWorker("spare-2", SPARE);
}

// The second replay of a window (the one that carries the verdict) with `verdict`, if any.
const AuditStatus* FindVerdict(const GetStatusResponse& s, AuditVerdict verdict) {
  for (const AuditStatus& a : s.audits()) {
    if (a.confirms() != 0 && a.has_verdict() && a.verdict() == verdict) return &a;
  }
  return nullptr;
}

TEST_CASE("a trainer that flips a bit is caught by an audit, confirmed by a second spare, charged "
          "and quarantined; the fault-free trainer's audits all match") {
  // Long enough that the audits run while it trains (a spare stops when the job is finished);
  // the test ends once the quarantined slot is back.
  LocalCluster cluster(JobText("AUDIT_QUARANTINE", 1000000, 2),
                       LocalClusterOptions{"audit", 500, false, absl::Seconds(90)});
  StartTrainersAndSpares(cluster, "good", "bad");

  const GetStatusResponse caught = cluster.WaitFor(
      "a confirmed mismatch", [](const GetStatusResponse& s) {
        return FindVerdict(s, AUDIT_CONFIRMED) != nullptr;
      });
  INFO(caught.DebugString());
  const AuditStatus* confirmed = FindVerdict(caught, AUDIT_CONFIRMED);
  REQUIRE(confirmed != nullptr);
  CHECK(confirmed->worker() == "bad");
  CHECK(confirmed->slot().replica() == 1);
  CHECK(confirmed->result() == AUDIT_MISMATCHED);
  // A sync window and its flipped step: the replay from the window's snapshot first differs
  // there.
  const int64_t flipped = confirmed->mismatch().step();
  CHECK(flipped >= kCorruptStep);
  CHECK((flipped - kCorruptStep) % kSyncPeriod == 0);
  CHECK(confirmed->from_step() == (flipped / kSyncPeriod) * kSyncPeriod);
  CHECK(confirmed->to_step() == confirmed->from_step() + kSyncPeriod);
  CHECK(confirmed->mismatch().logged_checksum() != confirmed->mismatch().replayed_checksum());
  // The C++ trainer logs per-tensor checksums when audits are on: the tensor is named.
  CHECK(confirmed->mismatch().tensor_index() >= 0);
  CHECK(absl::StartsWith(confirmed->mismatch().tensor_name(), "layer"));
  // Confirmed by the other spare: the first replay's record names the first auditor.
  const AuditStatus* first = nullptr;
  for (const AuditStatus& a : caught.audits()) {
    if (a.audit_id() == confirmed->confirms()) first = &a;
  }
  REQUIRE(first != nullptr);
  CHECK(first->verdict() == AUDIT_CONFIRMED);
  CHECK(first->mismatch().step() == flipped);
  CHECK(first->mismatch().replayed_checksum() == confirmed->mismatch().replayed_checksum());
  CHECK(first->auditor() != confirmed->auditor());

  // Quarantined: fenced, its slot restarted from the center by a spare.
  // And the healthy trainer audited too (the spares may have served the corrupt trainer's
  // windows, second replays first, until then).
  const GetStatusResponse done = cluster.WaitFor(
      "the quarantined slot restarted and a window of the healthy trainer matched",
      [](const GetStatusResponse& s) {
        bool restarted = false;
        bool good_matched = false;
        for (const RecoveryStatus& r : s.recoveries()) {
          restarted |= r.slot().replica() == 1 && r.outcome() == RECOVERED;
        }
        for (const AuditStatus& a : s.audits()) {
          good_matched |= a.worker() == "good" && a.result() == AUDIT_MATCHED;
        }
        return restarted && good_matched;
      });
  INFO(done.DebugString());
  const AuditCounts& counts = done.audit_counts();
  // Other windows of it that waited may be confirmed too; it is quarantined once.
  CHECK(counts.confirmed() >= 1);
  CHECK(counts.quarantined() == 1);
  CHECK(counts.auditor_faults() == 0);
  CHECK(counts.inconclusive() == 0);
  CHECK(counts.confirmed_by_worker().at("bad") == counts.confirmed());
  CHECK(counts.confirmed_by_worker().count("good") == 0);
  bool fenced = false;
  for (const WorkerStatus& w : done.workers()) {
    if (w.name() == "bad" && w.role() == TRAINER && w.state() == QUARANTINED) {
      fenced = true;
      CHECK(absl::StrContains(w.state_reason(), absl::StrCat("step ", flipped)));
    }
  }
  CHECK(fenced);
  bool restarted = false;
  for (const RecoveryStatus& r : done.recoveries()) {
    if (r.slot().replica() == 1 && r.policy() == RESTART_FROM_CENTER &&
        absl::StrContains(r.detail(), "QUARANTINE")) {
      restarted = r.outcome() == RECOVERED;
    }
  }
  CHECK(restarted);
  // The fault-free trainer: every one of its audited windows that was replayed matched.
  int good_matched = 0;
  for (const AuditStatus& a : done.audits()) {
    if (a.worker() != "good") continue;
    CHECK(a.result() != AUDIT_MISMATCHED);
    // Clean, or skipped (a window that gave its place to a newer one): never accused.
    CHECK((!a.has_verdict() || a.verdict() == AUDIT_CLEAN || a.verdict() == AUDIT_SKIPPED));
    good_matched += a.result() == AUDIT_MATCHED;
  }
  CHECK(good_matched > 0);
  // At least the matched window's steps (a mismatched replay counts the steps before its
  // mismatch).
  CHECK(counts.steps_audited() >= kSyncPeriod);

  // The machine is charged (its fault score), and the metrics say who.
  const WorkerStatus* bad = FindWorker(done, "bad", TRAINER);
  REQUIRE(bad != nullptr);
  const Exposition metrics = ScrapeMetrics(done.metrics_address());
  // Scraped after that status: the counters may only have grown (windows still waiting).
  CHECK(metrics.samples.at("rebound_audit_mismatches_total{worker=\"bad\"}") >=
        counts.confirmed());
  CHECK(metrics.samples.count("rebound_audit_mismatches_total{worker=\"good\"}") == 0);
  CHECK(metrics.samples.at("rebound_audit_verdicts_total{verdict=\"confirmed\"}") >=
        counts.confirmed());
  CHECK(metrics.samples.at("rebound_audits_total{result=\"matched\"}") >= counts.matched());
  CHECK(metrics.samples.at("rebound_audits_total{result=\"matched\"}") > 0);
  CHECK(metrics.samples.at("rebound_audit_quarantines_total") == 1);
  // Fault scores follow the registered name (docs/weighting.md): charged once, decaying.
  CHECK(bad->fault_score() > 0);
  const WorkerStatus* good = FindWorker(done, "good", TRAINER);
  REQUIRE(good != nullptr);
  CHECK(good->fault_score() == 0);
}

// A center sharded across 2 server groups: a window's start is the ranges' (each keeps a slot's
// last two syncs only), read by group 0 at the commit that chooses the window and joined. A
// start read wrong would differ at the window's first step, for either trainer: the flip is
// found at its own step, and the fault-free trainer's windows from a synced start (step > 0)
// match bit for bit.
TEST_CASE("with a sharded center the window's start is read from every range: the flip is caught "
          "at its step, quarantined, and the fault-free trainer's windows match") {
  LocalCluster cluster(JobText("AUDIT_QUARANTINE", 1000000, 2, "  sharding { groups: 2 }\n"),
                       LocalClusterOptions{"audit-shard", 500, false, absl::Seconds(120)});
  StartTrainersAndSpares(cluster, "good", "bad");
  const GetStatusResponse done = cluster.WaitFor(
      "a confirmed mismatch, the quarantined slot restarted and a synced window of the "
      "fault-free trainer matched",
      [](const GetStatusResponse& s) {
        bool restarted = false;
        bool good_matched = false;
        for (const RecoveryStatus& r : s.recoveries()) {
          restarted |= r.slot().replica() == 1 && r.outcome() == RECOVERED;
        }
        for (const AuditStatus& a : s.audits()) {
          good_matched |=
              a.worker() == "good" && a.result() == AUDIT_MATCHED && a.from_step() > 0;
        }
        return restarted && good_matched && FindVerdict(s, AUDIT_CONFIRMED) != nullptr;
      });
  INFO(done.DebugString());
  const AuditStatus* confirmed = FindVerdict(done, AUDIT_CONFIRMED);
  REQUIRE(confirmed != nullptr);
  CHECK(confirmed->worker() == "bad");
  const int64_t flipped = confirmed->mismatch().step();
  CHECK(flipped >= kCorruptStep);
  CHECK((flipped - kCorruptStep) % kSyncPeriod == 0);
  CHECK(confirmed->from_step() == (flipped / kSyncPeriod) * kSyncPeriod);
  CHECK(absl::StartsWith(confirmed->mismatch().tensor_name(), "layer"));
  const AuditCounts& counts = done.audit_counts();
  CHECK(counts.quarantined() == 1);
  CHECK(counts.auditor_faults() == 0);
  CHECK(counts.inconclusive() == 0);
  CHECK(counts.confirmed_by_worker().count("good") == 0);
  for (const AuditStatus& a : done.audits()) {
    if (a.worker() == "good") CHECK(a.result() != AUDIT_MISMATCHED);
  }
  bool fenced = false;
  for (const WorkerStatus& w : done.workers()) {
    fenced |= w.name() == "bad" && w.role() == TRAINER && w.state() == QUARANTINED;
  }
  CHECK(fenced);
}

// A pipeline of 2 stages: a stage's audit replays its window from the boundary pairs its
// neighbour logged (every boundary logged), exactly as its recovery would.
std::string PipelineJobText() {
  return absl::StrCat(
      "  job_id: \"audit-pipe\"\n",
      "  model { layers { width: 12 } layers { width: 10 activation: TANH }"
      " layers { width: 10 activation: IDENTITY } }\n",
      "  topology { replicas: 1 stages: 2 }\n",
      "  weighting { policy: UNIFORM }\n",
      "  fault_tolerance { policy: REPLAY heartbeat_interval_ms: 200 failure_timeout_ms: 3000 }\n",
      "  data { batch_size: 32 micro_batches: 4 train_limit: 2000 test_limit: 100 }\n",
      "  adahessian { lr: 0.01 hessian_every: 2 }\n",
      "  easgd { sync_period: ", kSyncPeriod, " }\n",
      "  step_log { linger_ms: 5 }\n",
      "  training { max_steps: 1000000 }\n",
      "  audit { fraction: 1 max_concurrent: 8 on_mismatch: AUDIT_REPORT }\n");
}

TEST_CASE("a pipeline stage that flips a bit is caught from its neighbour's logged pairs; the "
          "other stage's audits match") {
  LocalCluster cluster(PipelineJobText(),
                       LocalClusterOptions{"audit-pipe", 500, false, absl::Seconds(90)});
  StartTrainersAndSpares(cluster, "stage0", "stage1");
  const GetStatusResponse caught = cluster.WaitFor(
      "a confirmed mismatch of stage 1 and a matched audit of stage 0",
      [](const GetStatusResponse& s) {
        bool stage0_matched = false;
        for (const AuditStatus& a : s.audits()) {
          stage0_matched |= a.slot().stage() == 0 && a.result() == AUDIT_MATCHED;
        }
        return stage0_matched && FindVerdict(s, AUDIT_CONFIRMED) != nullptr;
      });
  INFO(caught.DebugString());
  const AuditStatus* confirmed = FindVerdict(caught, AUDIT_CONFIRMED);
  REQUIRE(confirmed != nullptr);
  CHECK(confirmed->worker() == "stage1");
  CHECK(confirmed->slot().stage() == 1);
  const int64_t flipped = confirmed->mismatch().step();
  CHECK(flipped >= kCorruptStep);
  CHECK((flipped - kCorruptStep) % kSyncPeriod == 0);
  CHECK(absl::StartsWith(confirmed->mismatch().tensor_name(), "layer"));
  for (const AuditStatus& a : caught.audits()) {
    if (a.slot().stage() == 0) CHECK(a.result() != AUDIT_MISMATCHED);
  }
  CHECK(caught.audit_counts().auditor_faults() == 0);
  // AUDIT_REPORT: the stage is charged and trains on.
  const WorkerStatus* stage1 = FindWorker(caught, "stage1", TRAINER);
  REQUIRE(stage1 != nullptr);
  CHECK(stage1->state() == ALIVE);
  CHECK(stage1->fault_score() > 0);
}

TEST_CASE("audits give their spare back when a trainer dies: the replay is not held up") {
  LocalCluster cluster(JobText("AUDIT_REPORT", 1000000, 2),
                       LocalClusterOptions{"audit-preempt", 500, false, absl::Seconds(90)});
  cluster.StartWorker("a", TRAINER);
  cluster.StartWorker("b", TRAINER);
  cluster.StartWorker("spare", SPARE);
  cluster.WaitFor("an audit matched", [](const GetStatusResponse& s) {
    return s.audit_counts().matched() >= 2;
  });
  cluster.Kill("b");
  const GetStatusResponse done = cluster.WaitFor(
      "b's slot rebuilt", [](const GetStatusResponse& s) {
        for (const RecoveryStatus& r : s.recoveries()) {
          if (r.slot().replica() == 1 && r.has_outcome()) return true;
        }
        return false;
      });
  INFO(done.DebugString());
  bool recovered = false;
  for (const RecoveryStatus& r : done.recoveries()) {
    if (r.slot().replica() == 1 && r.outcome() == RECOVERED && r.policy() == REPLAY) {
      recovered = r.verified();
    }
  }
  CHECK(recovered);
  CHECK(done.audit_counts().mismatched() == 0);
  CHECK(done.audit_counts().confirmed() == 0);
  // None of the audits that ran found anything.
  for (const AuditStatus& a : done.audits()) CHECK(a.result() != AUDIT_MISMATCHED);
}

}  // namespace
}  // namespace rebound::testing
