// Auditor (server/audit/auditor.h): which sync windows are audited, who replays them and when,
// and the verdicts of a mismatch (confirmed, the first auditor's fault, inconclusive) with their
// charges and the quarantine; against a real Membership, ReliabilityTracker and StepLogService on
// an in-memory DurableStore and a fake clock. The spares are this test, calling as the service's
// handlers do.

#include <catch2/catch.hpp>

#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "server/audit/auditor.h"
#include "server/membership.h"
#include "server/reliability.h"
#include "server/step_log.h"
#include "storage/durable_store.h"
#include "tests/server/server_testing.h"

namespace rebound::server {
namespace {

using testing::Slot;

JobConfig Job(const std::string& audit) {
  return testing::TinyModelJob(
      2, 1,
      absl::StrCat("fault_tolerance { policy: REPLAY heartbeat_interval_ms: 100 "
                   "failure_timeout_ms: 1000 recovery_timeout_ms: 60000 }\n",
                   audit));
}

struct Fixture {
  explicit Fixture(const std::string& audit =
                       "audit { fraction: 1 max_concurrent: 1 on_mismatch: AUDIT_QUARANTINE }\n")
      : job(Job(audit)) {
    store = testing::OpenInMemoryStore(job);
    membership = std::make_unique<Membership>(job, &clock);
    tracker = std::make_unique<ReliabilityTracker>(job.weighting(), 2);
    step_log = std::make_unique<StepLogService>(job, membership.get(), store.get());
    auditor = std::make_unique<Auditor>(job, membership.get(), tracker.get(), step_log.get(),
                                        &clock);
    for (int r = 0; r < 2; ++r) {
      auto trainer = membership->Register(testing::Request(absl::StrCat("trainer-", r), TRAINER));
      REQUIRE(trainer.ok());
      REQUIRE(trainer->slot().replica() == r);
      trainers.push_back(trainer->incarnation());
    }
  }

  uint64_t Spare(const std::string& name, bool audits = true) {
    auto registered = membership->Register(testing::Request(name, SPARE, name + ":1"));
    REQUIRE(registered.ok());
    if (audits) auditor->AddAuditor(registered->incarnation());
    return registered->incarnation();
  }

  // The complete log of `replica`'s steps (from, to]: each step's records, as a trainer ships.
  void Log(int replica, int64_t from, int64_t to) {
    storage::WriteBatch batch;
    for (int64_t t = from + 1; t <= to; ++t) {
      for (int k = 0; k < job.data().micro_batches(); ++k) {
        LogRecord record;
        *record.mutable_slot() = Slot(replica);
        record.set_step(t);
        record.set_micro_batch(k);
        record.add_sample_ids(2 * t);
        record.add_sample_ids(2 * t + 1);
        batch.PutLogRecord(record);
      }
      LogRecord step;
      *step.mutable_slot() = Slot(replica);
      step.set_step(t);
      step.set_micro_batch(-1);
      step.set_params_checksum(1000 + t);
      batch.PutLogRecord(step);
    }
    REQUIRE(store->Commit(batch).ok());
  }

  // The window (from, to] of `replica`'s trainer, chosen at its sync and held.
  void Window(int replica, int64_t from, int64_t to) {
    REQUIRE(auditor->Choose(Slot(replica), trainers[replica], from, to));
    Snapshot snapshot;
    *snapshot.mutable_slot() = Slot(replica);
    snapshot.set_step(from);
    auditor->Hold(Slot(replica), trainers[replica], snapshot, to);
  }

  RecoveryTask Claim(uint64_t spare) {
    auto task = auditor->Claim(spare);
    REQUIRE(task.ok());
    REQUIRE(task->has_value());
    return **task;
  }

  bool NothingFor(uint64_t spare) {
    auto task = auditor->Claim(spare);
    REQUIRE(task.ok());
    return !task->has_value();
  }

  absl::Status Report(uint64_t spare, const RecoveryTask& task, AuditResult result,
                      int64_t step = 0, uint64_t replayed = 0) {
    ReportAuditRequest report;
    report.set_incarnation(spare);
    report.set_audit_id(task.task_id());
    report.set_result(result);
    report.set_steps_replayed(task.failed_step() - task.snapshot().step());
    if (result == AUDIT_MISMATCHED) {
      report.mutable_mismatch()->set_step(step);
      report.mutable_mismatch()->set_logged_checksum(1000 + step);
      report.mutable_mismatch()->set_replayed_checksum(replayed);
      report.mutable_mismatch()->set_tensor_index(1);
      report.mutable_mismatch()->set_tensor_name("layer0.bias");
    }
    return auditor->Finish(report);
  }

  GetStatusResponse Status() const {
    GetStatusResponse status;
    auditor->FillStatus(&status);
    return status;
  }

  JobConfig job;
  FakeClock clock;
  std::unique_ptr<storage::DurableStore> store;
  std::unique_ptr<Membership> membership;
  std::unique_ptr<ReliabilityTracker> tracker;
  std::unique_ptr<StepLogService> step_log;
  std::unique_ptr<Auditor> auditor;
  std::vector<uint64_t> trainers;
};

TEST_CASE("a window is audited only when its trainer made both of its syncs (sharded: and the one "
          "before)") {
  Fixture f;
  // The first sync a slot makes under this server: its start is not known to be this trainer's.
  CHECK_FALSE(f.auditor->Choose(Slot(0), f.trainers[0], 0, 10));
  CHECK(f.auditor->Choose(Slot(0), f.trainers[0], 10, 20));
  // Another incarnation's sync after it (a takeover): not this window, the next one.
  CHECK_FALSE(f.auditor->Choose(Slot(0), 999, 20, 30));
  CHECK(f.auditor->Choose(Slot(0), 999, 30, 40));
  // A sharded job: nor the window that starts at the new owner's first sync (a range may have
  // answered it from the snapshot the trainer before it left there), but the one after.
  Fixture sharded("sharding { groups: 2 }\naudit { fraction: 1 max_concurrent: 4 }\n");
  CHECK_FALSE(sharded.auditor->Choose(Slot(0), sharded.trainers[0], 0, 10));
  CHECK_FALSE(sharded.auditor->Choose(Slot(0), sharded.trainers[0], 10, 20));
  CHECK(sharded.auditor->Choose(Slot(0), sharded.trainers[0], 20, 30));
  CHECK_FALSE(sharded.auditor->Choose(Slot(0), 999, 30, 40));
  CHECK_FALSE(sharded.auditor->Choose(Slot(0), 999, 40, 50));
  CHECK(sharded.auditor->Choose(Slot(0), 999, 50, 60));
  // Fraction 0: audits are off, nothing is chosen or held.
  Fixture off("");
  CHECK_FALSE(off.auditor->enabled());
  CHECK_FALSE(off.auditor->Choose(Slot(0), off.trainers[0], 0, 10));
  CHECK_FALSE(off.auditor->Choose(Slot(0), off.trainers[0], 10, 20));
  CHECK_FALSE(off.Status().has_audit_counts());
}

TEST_CASE("a held window keeps its log, goes to an auditing spare once its log is complete, "
          "and a match clears it") {
  Fixture f;
  f.auditor->Choose(Slot(0), f.trainers[0], 0, 10);
  f.Window(0, 10, 20);
  CHECK(f.auditor->KeepLogFrom(Slot(0)) == 10);
  CHECK_FALSE(f.auditor->KeepLogFrom(Slot(1)).has_value());
  const uint64_t plain = f.Spare("plain", /*audits=*/false);
  const uint64_t spare = f.Spare("spare");
  // The log is not complete through step 20 yet: nothing to hand out.
  f.Log(0, 10, 19);
  CHECK(f.NothingFor(spare));
  f.Log(0, 19, 20);
  // A spare that did not register for audits never gets one.
  CHECK(f.NothingFor(plain));
  const RecoveryTask task = f.Claim(spare);
  CHECK(task.audit());
  CHECK((task.task_id() & Auditor::kAuditIdBit) != 0);
  CHECK(task.slot().replica() == 0);
  CHECK(task.snapshot().step() == 10);
  CHECK(task.failed_step() == 20);
  CHECK(task.rank() == 0);
  CHECK(task.spares_size() == 1);
  CHECK(task.micro_batch_count() == f.job.data().micro_batches());
  CHECK(task.audited_worker() == "trainer-0");
  // ReadLog: only the spare that runs it reads its window.
  auto slot = f.auditor->AuditSlot(task.task_id(), spare);
  REQUIRE(slot.ok());
  CHECK(slot->replica() == 0);
  CHECK(f.auditor->AuditSlot(task.task_id(), plain).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  // max_concurrent 1: a second window waits while this one runs.
  f.auditor->Choose(Slot(1), f.trainers[1], 0, 10);
  f.Window(1, 10, 20);
  f.Log(1, 10, 20);
  const uint64_t other = f.Spare("other");
  CHECK(f.NothingFor(other));

  REQUIRE(f.Report(spare, task, AUDIT_MATCHED).ok());
  CHECK_FALSE(f.auditor->KeepLogFrom(Slot(0)).has_value());
  const GetStatusResponse status = f.Status();
  CHECK(status.audit_counts().matched() == 1);
  CHECK(status.audit_counts().steps_audited() == 10);
  CHECK(status.audit_counts().windows_chosen() == 2);
  bool clean = false;
  for (const AuditStatus& a : status.audits()) {
    if (a.audit_id() == (task.task_id() & ~Auditor::kAuditIdBit)) {
      clean = a.verdict() == AUDIT_CLEAN && a.result() == AUDIT_MATCHED && a.worker() == "trainer-0";
    }
  }
  CHECK(clean);
  // The same report again: the audit is over.
  CHECK(f.Report(spare, task, AUDIT_MATCHED).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(f.tracker->FaultScore("trainer-0", f.clock.Now()) == 0);
  // Now the second window starts.
  CHECK(f.Claim(other).slot().replica() == 1);
}

TEST_CASE("no audit starts while a slot is LOST, and a running one is preempted and waits again") {
  Fixture f;
  f.auditor->Choose(Slot(0), f.trainers[0], 0, 10);
  f.Window(0, 10, 20);
  f.Log(0, 10, 20);
  const uint64_t spare = f.Spare("spare");
  const RecoveryTask task = f.Claim(spare);
  CHECK(f.auditor->CommandsFor(spare).empty());
  // Trainer 1 dies: its slot is LOST.
  f.clock.Advance(absl::Milliseconds(600));
  testing::BeatOk(*f.membership, testing::Beat(f.trainers[0]));
  testing::BeatOk(*f.membership, testing::Beat(spare));
  f.clock.Advance(absl::Milliseconds(600));
  REQUIRE(f.membership->DetectFailures().size() == 1);
  REQUIRE(f.membership->AnySlotLost());
  const std::vector<Command> commands = f.auditor->CommandsFor(spare);
  REQUIRE(commands.size() == 1);
  CHECK(commands[0] == PREEMPT_AUDIT);
  REQUIRE(f.Report(spare, task, AUDIT_PREEMPTED).ok());
  // The window waits again, and is not handed out while the slot is LOST.
  CHECK(f.auditor->KeepLogFrom(Slot(0)) == 10);
  CHECK(f.NothingFor(spare));
  const GetStatusResponse status = f.Status();
  CHECK(status.audit_counts().preempted() == 1);
}

TEST_CASE("a mismatch charges nobody until a second spare's replay agrees: then the trainer's "
          "machine is charged and the trainer quarantined") {
  Fixture f;
  f.auditor->Choose(Slot(1), f.trainers[1], 0, 10);
  f.Window(1, 10, 20);
  f.Log(1, 10, 20);
  const uint64_t first = f.Spare("first");
  const uint64_t second = f.Spare("second");
  const RecoveryTask task = f.Claim(first);
  REQUIRE(f.Report(first, task, AUDIT_MISMATCHED, 15, 0xbad).ok());
  CHECK(f.tracker->FaultScore("trainer-1", f.clock.Now()) == 0);
  CHECK(f.Status().audit_counts().confirmed() == 0);
  // The second replay goes to another spare first: the first auditor waits out the grace.
  CHECK(f.NothingFor(first));
  const RecoveryTask again = f.Claim(second);
  CHECK(again.snapshot().step() == 10);
  CHECK(again.failed_step() == 20);
  CHECK(again.task_id() != task.task_id());
  // A mismatch outside the window is refused and decides nothing.
  CHECK(f.Report(second, again, AUDIT_MISMATCHED, 25, 0xbad).code() ==
        absl::StatusCode::kInvalidArgument);

  Fixture g;
  g.auditor->Choose(Slot(1), g.trainers[1], 0, 10);
  g.Window(1, 10, 20);
  g.Log(1, 10, 20);
  const uint64_t a = g.Spare("a");
  const uint64_t b = g.Spare("b");
  REQUIRE(g.Report(a, g.Claim(a), AUDIT_MISMATCHED, 15, 0xbad).ok());
  REQUIRE(g.Report(b, g.Claim(b), AUDIT_MISMATCHED, 15, 0xbad).ok());
  const GetStatusResponse status = g.Status();
  CHECK(status.audit_counts().confirmed() == 1);
  CHECK(status.audit_counts().confirmed_by_worker().at("trainer-1") == 1);
  CHECK(status.audit_counts().quarantined() == 1);
  CHECK(g.tracker->FaultScore("trainer-1", g.clock.Now()) > 0);
  CHECK(g.tracker->FaultScore("a", g.clock.Now()) == 0);
  CHECK(g.tracker->FaultScore("trainer-0", g.clock.Now()) == 0);
  int confirmed = 0;
  for (const AuditStatus& record : status.audits()) {
    confirmed += record.verdict() == AUDIT_CONFIRMED;
    if (record.confirms() != 0) {
      CHECK(record.mismatch().step() == 15);
      CHECK(record.mismatch().tensor_name() == "layer0.bias");
      CHECK(absl::StrContains(record.detail(), "confirmed"));
    }
  }
  CHECK(confirmed == 2);  // the first replay's record and the second's
  // Quarantined: fenced, its slot LOST and restarted from the center by the next spare.
  CHECK(g.membership->CheckAlive(g.trainers[1]).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(g.membership->AnySlotLost());
  GetStatusResponse membership_status;
  g.membership->FillStatus(&membership_status);
  CHECK(membership_status.slots(1).state() == LOST);
  CHECK(absl::StrContains(membership_status.slots(1).detail(), "quarantined"));
  const HeartbeatResponse beat = testing::BeatOk(*g.membership, testing::Beat(a));
  REQUIRE(beat.has_takeover());
  CHECK(beat.takeover().slot().replica() == 1);
}

TEST_CASE("a second replay that matches the log convicts the first auditor, not the trainer; one "
          "that differs otherwise convicts nobody") {
  Fixture f;
  f.auditor->Choose(Slot(0), f.trainers[0], 0, 10);
  f.Window(0, 10, 20);
  f.Log(0, 10, 20);
  const uint64_t corrupt = f.Spare("corrupt");
  const uint64_t healthy = f.Spare("healthy");
  REQUIRE(f.Report(corrupt, f.Claim(corrupt), AUDIT_MISMATCHED, 12, 0xbad).ok());
  REQUIRE(f.Report(healthy, f.Claim(healthy), AUDIT_MATCHED).ok());
  GetStatusResponse status = f.Status();
  CHECK(status.audit_counts().auditor_faults() == 1);
  CHECK(status.audit_counts().auditor_faults_by_worker().at("corrupt") == 1);
  CHECK(status.audit_counts().confirmed() == 0);
  CHECK(f.tracker->FaultScore("corrupt", f.clock.Now()) > 0);
  CHECK(f.tracker->FaultScore("trainer-0", f.clock.Now()) == 0);
  CHECK(f.membership->CheckAlive(f.trainers[0]).ok());  // not quarantined

  // The same spare again after the grace (no other spare asks), once it matched another window
  // since its mismatch: its replays disagree with each other: inconclusive.
  f.auditor->Choose(Slot(1), f.trainers[1], 0, 10);
  f.Window(1, 10, 20);
  f.Log(1, 10, 20);
  REQUIRE(f.Report(corrupt, f.Claim(corrupt), AUDIT_MISMATCHED, 12, 0xbad).ok());
  CHECK(f.NothingFor(corrupt));
  f.clock.Advance(Auditor::kConfirmGrace + absl::Milliseconds(1));
  testing::BeatOk(*f.membership, testing::Beat(corrupt));
  testing::BeatOk(*f.membership, testing::Beat(healthy));
  CHECK(f.NothingFor(corrupt));  // no match since its mismatch
  f.Window(0, 20, 30);
  f.Log(0, 20, 30);
  const RecoveryTask other = f.Claim(corrupt);
  CHECK(other.slot().replica() == 0);
  CHECK(other.snapshot().step() == 20);
  REQUIRE(f.Report(corrupt, other, AUDIT_MATCHED).ok());
  const RecoveryTask again = f.Claim(corrupt);
  CHECK(again.slot().replica() == 1);
  CHECK(again.snapshot().step() == 10);
  REQUIRE(f.Report(corrupt, again, AUDIT_MISMATCHED, 13, 0xbee).ok());
  status = f.Status();
  CHECK(status.audit_counts().inconclusive() == 1);
  CHECK(f.tracker->FaultScore("trainer-1", f.clock.Now()) == 0);
}

TEST_CASE("a lone auditor replays its mismatched window again only after it matched another "
          "window; one that mismatches everything convicts nobody") {
  Fixture f;
  f.auditor->Choose(Slot(0), f.trainers[0], 0, 10);
  f.auditor->Choose(Slot(1), f.trainers[1], 0, 10);
  f.Window(0, 10, 20);
  f.Log(0, 10, 20);
  const uint64_t only = f.Spare("only");
  const uint64_t gone = f.Spare("gone");
  // The other auditor leaves: it could not run the second replay.
  REQUIRE(f.membership->Deregister(gone).ok());
  REQUIRE(f.Report(only, f.Claim(only), AUDIT_MISMATCHED, 11, 0xbad).ok());
  // Nothing else to replay: the second replay waits for a match of this spare.
  CHECK(f.NothingFor(only));
  f.Window(1, 10, 20);
  f.Log(1, 10, 20);
  const RecoveryTask other = f.Claim(only);
  CHECK(other.slot().replica() == 1);
  REQUIRE(f.Report(only, other, AUDIT_MATCHED).ok());
  const RecoveryTask again = f.Claim(only);
  CHECK(again.slot().replica() == 0);
  CHECK(again.snapshot().step() == 10);
  REQUIRE(f.Report(only, again, AUDIT_MISMATCHED, 11, 0xbad).ok());
  CHECK(f.Status().audit_counts().confirmed() == 1);
  CHECK(f.tracker->FaultScore("trainer-0", f.clock.Now()) > 0);

  // A lone spare whose every replay differs (its own fault, persistent) never confirms: its
  // accusations wait for another spare, expire inconclusive and charge nobody.
  Fixture g;
  g.auditor->Choose(Slot(0), g.trainers[0], 0, 10);
  g.auditor->Choose(Slot(1), g.trainers[1], 0, 10);
  g.Window(0, 10, 20);
  g.Log(0, 10, 20);
  g.Window(1, 10, 20);
  g.Log(1, 10, 20);
  const uint64_t broken = g.Spare("broken");
  REQUIRE(g.Report(broken, g.Claim(broken), AUDIT_MISMATCHED, 11, 0xbad).ok());
  REQUIRE(g.Report(broken, g.Claim(broken), AUDIT_MISMATCHED, 14, 0xbee).ok());
  CHECK(g.NothingFor(broken));
  g.clock.Advance(absl::Milliseconds(g.job.audit().max_wait_ms()) + absl::Milliseconds(1));
  testing::BeatOk(*g.membership, testing::Beat(broken));
  CHECK(g.NothingFor(broken));
  const GetStatusResponse status = g.Status();
  CHECK(status.audit_counts().confirmed() == 0);
  CHECK(status.audit_counts().inconclusive() == 2);
  CHECK(g.tracker->FaultScore("trainer-0", g.clock.Now()) == 0);
  CHECK(g.tracker->FaultScore("trainer-1", g.clock.Now()) == 0);
  CHECK(g.membership->CheckAlive(g.trainers[0]).ok());
  CHECK(g.membership->CheckAlive(g.trainers[1]).ok());
}

TEST_CASE("bad reports are refused and a window nobody replays expires") {
  Fixture f;
  f.auditor->Choose(Slot(0), f.trainers[0], 0, 10);
  f.Window(0, 10, 20);
  f.Log(0, 10, 20);
  const uint64_t spare = f.Spare("spare");
  const uint64_t other = f.Spare("other");
  const RecoveryTask task = f.Claim(spare);
  ReportAuditRequest unset;
  unset.set_incarnation(spare);
  unset.set_audit_id(task.task_id());
  CHECK(f.auditor->Finish(unset).code() == absl::StatusCode::kInvalidArgument);
  ReportAuditRequest nowhere = unset;
  nowhere.set_result(AUDIT_MISMATCHED);
  CHECK(f.auditor->Finish(nowhere).code() == absl::StatusCode::kInvalidArgument);
  // Another spare's report of this audit (it does not run it).
  CHECK(f.Report(other, task, AUDIT_MATCHED).code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(f.Report(spare, task, AUDIT_INCOMPLETE).ok());
  CHECK(f.Status().audit_counts().incomplete() == 1);

  f.auditor->Choose(Slot(1), f.trainers[1], 0, 10);
  f.Window(1, 10, 20);
  f.clock.Advance(absl::Milliseconds(30001));  // audit.max_wait_ms
  CHECK(f.NothingFor(spare));  // expires on the next call
  const GetStatusResponse status = f.Status();
  CHECK(status.audit_counts().expired() == 1);
  CHECK_FALSE(f.auditor->KeepLogFrom(Slot(1)).has_value());
  bool skipped = false;
  for (const AuditStatus& a : status.audits()) skipped |= a.verdict() == AUDIT_SKIPPED;
  CHECK(skipped);
}

TEST_CASE("windows beyond steps_per_hour are skipped; beyond the waiting room, the oldest gives "
          "its place") {
  Fixture f("audit { fraction: 1 max_concurrent: 1 steps_per_hour: 25 }\n");
  f.auditor->Choose(Slot(0), f.trainers[0], 0, 10);
  CHECK(f.auditor->Choose(Slot(0), f.trainers[0], 10, 20));   // 10 steps
  CHECK(f.auditor->Choose(Slot(0), f.trainers[0], 20, 30));   // 20
  CHECK_FALSE(f.auditor->Choose(Slot(0), f.trainers[0], 30, 40));  // 30 > 25
  f.clock.Advance(absl::Hours(1) + absl::Seconds(1));
  CHECK(f.auditor->Choose(Slot(0), f.trainers[0], 40, 50));
  CHECK(f.Status().audit_counts().windows_skipped() == 1);

  // The waiting room full (2 x max_concurrent): the newest window replaces the oldest waiting.
  Fixture g("audit { fraction: 1 max_concurrent: 1 }\n");
  g.auditor->Choose(Slot(0), g.trainers[0], 0, 10);
  g.Window(0, 10, 20);
  g.clock.Advance(absl::Milliseconds(1));
  g.Window(0, 20, 30);
  g.clock.Advance(absl::Milliseconds(1));
  g.Window(0, 30, 40);
  const GetStatusResponse status = g.Status();
  CHECK(status.audit_counts().windows_skipped() == 1);
  CHECK(status.audit_counts().windows_chosen() == 3);
  CHECK(g.auditor->KeepLogFrom(Slot(0)) == 20);  // (10, 20] gave its place
  bool replaced = false;
  for (const AuditStatus& a : status.audits()) {
    if (a.from_step() == 10 && a.verdict() == AUDIT_SKIPPED) {
      replaced = absl::StrContains(a.detail(), "replaced by a newer window");
    }
  }
  CHECK(replaced);
  // A second replay keeps its place: the newer windows replace first replays only.
  g.Log(0, 20, 40);
  const uint64_t a = g.Spare("a");
  const RecoveryTask first = g.Claim(a);  // (20, 30]
  CHECK(first.snapshot().step() == 20);
  REQUIRE(g.Report(a, first, AUDIT_MISMATCHED, 25, 0xbad).ok());
  // Waiting: the second replay of (20, 30], and (30, 40]: the room is full.
  g.clock.Advance(absl::Milliseconds(1));
  g.Window(0, 40, 50);  // replaces (30, 40]
  g.clock.Advance(absl::Milliseconds(1));
  g.Window(0, 50, 60);  // replaces (40, 50]
  CHECK(g.auditor->KeepLogFrom(Slot(0)) == 20);  // the second replay's window is still held
  CHECK(g.Status().audit_counts().windows_skipped() == 3);
  // No other auditor: the second replay is a's once it matched another window.
  CHECK(g.NothingFor(a));
  g.Log(0, 40, 60);
  const RecoveryTask newest = g.Claim(a);
  CHECK(newest.snapshot().step() == 50);
  REQUIRE(g.Report(a, newest, AUDIT_MATCHED).ok());
  const RecoveryTask again = g.Claim(a);
  CHECK(again.snapshot().step() == 20);
}

TEST_CASE("status keeps a mismatch on record while windows skipped by the dozen come and go") {
  Fixture f("audit { fraction: 1 max_concurrent: 1 }\n");
  f.auditor->Choose(Slot(0), f.trainers[0], 0, 10);
  f.Window(0, 10, 20);
  f.Log(0, 10, 20);
  const uint64_t a = f.Spare("a");
  f.Spare("b");
  const RecoveryTask task = f.Claim(a);
  REQUIRE(f.Report(a, task, AUDIT_MISMATCHED, 13, 0xbad).ok());
  f.auditor->Choose(Slot(1), f.trainers[1], 0, 10);
  for (int i = 1; i <= 2 * Auditor::kMaxRecords; ++i) {
    f.clock.Advance(absl::Milliseconds(1));
    f.Window(1, 10 * i, 10 * i + 10);  // the room is full: each replaces the oldest waiting
  }
  const GetStatusResponse status = f.Status();
  const uint64_t first_id = task.task_id() & ~Auditor::kAuditIdBit;
  int records = 0;
  bool kept = false;
  for (const AuditStatus& record : status.audits()) {
    records += record.has_verdict() || record.has_result();
    kept |= record.audit_id() == first_id && record.mismatch().step() == 13;
  }
  CHECK(status.audit_counts().windows_skipped() >= Auditor::kMaxRecords);
  CHECK(records <= Auditor::kMaxRecords);
  CHECK(kept);
}

TEST_CASE("a full waiting room takes the place from the trainer with the most windows waiting: "
          "one that stopped syncing keeps its newest window") {
  Fixture f("audit { fraction: 1 max_concurrent: 1 }\n");  // room: 2 windows
  f.auditor->Choose(Slot(0), f.trainers[0], 0, 10);
  f.auditor->Choose(Slot(1), f.trainers[1], 0, 10);
  f.Window(1, 10, 20);  // trainer-1's last window: it stops syncing (dies) after it
  for (int i = 1; i <= 5; ++i) {
    f.clock.Advance(absl::Milliseconds(1));
    f.Window(0, 10 * i, 10 * i + 10);  // trainer-0 goes on
  }
  // trainer-1's window is still there, older than every one of trainer-0's that gave its place.
  CHECK(f.auditor->KeepLogFrom(Slot(1)) == 10);
  CHECK(f.auditor->KeepLogFrom(Slot(0)) == 50);
  const GetStatusResponse status = f.Status();
  CHECK(status.audit_counts().windows_skipped() == 4);
  for (const AuditStatus& a : status.audits()) {
    if (a.verdict() == AUDIT_SKIPPED) CHECK(a.slot().replica() == 0);
  }
  // A spare gets the oldest: the silent trainer's.
  f.Log(1, 10, 20);
  f.Log(0, 50, 60);
  const uint64_t spare = f.Spare("spare");
  CHECK(f.Claim(spare).slot().replica() == 1);
}

TEST_CASE("spares take the trainers in turn: a trainer's backlog does not hold them") {
  Fixture f("audit { fraction: 1 max_concurrent: 2 }\n");  // room: 4 windows
  f.auditor->Choose(Slot(0), f.trainers[0], 0, 10);
  f.auditor->Choose(Slot(1), f.trainers[1], 0, 10);
  f.Window(0, 10, 20);
  f.clock.Advance(absl::Milliseconds(1));
  f.Window(0, 20, 30);
  f.clock.Advance(absl::Milliseconds(1));
  f.Window(0, 30, 40);
  f.clock.Advance(absl::Milliseconds(1));
  f.Window(1, 10, 20);  // the newest
  f.Log(0, 10, 40);
  f.Log(1, 10, 20);
  const uint64_t spare = f.Spare("spare");
  const RecoveryTask first = f.Claim(spare);
  CHECK(first.slot().replica() == 0);
  CHECK(first.snapshot().step() == 10);  // the oldest, neither trainer audited yet
  REQUIRE(f.Report(spare, first, AUDIT_MATCHED).ok());
  const RecoveryTask second = f.Claim(spare);
  CHECK(second.slot().replica() == 1);  // trainer-1's turn, though trainer-0's are older
  REQUIRE(f.Report(spare, second, AUDIT_MATCHED).ok());
  const RecoveryTask third = f.Claim(spare);
  CHECK(third.slot().replica() == 0);
  CHECK(third.snapshot().step() == 20);
}

TEST_CASE("at the job's end an auditing spare stays while a mismatch awaits its second replay, "
          "at most audit.max_wait_ms; otherwise it may leave") {
  Fixture f("audit { fraction: 1 max_concurrent: 2 on_mismatch: AUDIT_REPORT }\n");
  f.auditor->Choose(Slot(1), f.trainers[1], 0, 10);
  f.Window(1, 10, 20);
  f.Log(1, 10, 20);
  const uint64_t first = f.Spare("first");
  const uint64_t second = f.Spare("second");
  const uint64_t plain = f.Spare("plain", /*audits=*/false);
  // A window waiting for its first replay holds nobody: never-replayed windows are not waited for.
  CHECK_FALSE(f.auditor->HoldsAtJobEnd(first));
  const RecoveryTask task = f.Claim(first);
  CHECK(f.auditor->HoldsAtJobEnd(first));        // it runs an audit
  CHECK_FALSE(f.auditor->HoldsAtJobEnd(second));  // nothing to decide yet
  REQUIRE(f.Report(first, task, AUDIT_MISMATCHED, 15, 0xbad).ok());
  // The mismatch awaits its second replay: every auditing spare stays, others may go.
  CHECK(f.auditor->HoldsAtJobEnd(first));
  CHECK(f.auditor->HoldsAtJobEnd(second));
  CHECK_FALSE(f.auditor->HoldsAtJobEnd(plain));
  const RecoveryTask again = f.Claim(second);
  CHECK(f.auditor->HoldsAtJobEnd(first));  // the second replay runs
  REQUIRE(f.Report(second, again, AUDIT_MISMATCHED, 15, 0xbad).ok());
  CHECK(f.Status().audit_counts().confirmed() == 1);
  CHECK_FALSE(f.auditor->HoldsAtJobEnd(first));
  CHECK_FALSE(f.auditor->HoldsAtJobEnd(second));

  // A second replay nobody runs holds the spares no longer than audit.max_wait_ms.
  Fixture g("audit { fraction: 1 max_concurrent: 2 on_mismatch: AUDIT_REPORT }\n");
  g.auditor->Choose(Slot(0), g.trainers[0], 0, 10);
  g.Window(0, 10, 20);
  g.Log(0, 10, 20);
  const uint64_t lone = g.Spare("lone");
  REQUIRE(g.Report(lone, g.Claim(lone), AUDIT_MISMATCHED, 12, 0xbad).ok());
  CHECK(g.auditor->HoldsAtJobEnd(lone));
  g.clock.Advance(absl::Milliseconds(30001));
  CHECK_FALSE(g.auditor->HoldsAtJobEnd(lone));
  CHECK(g.Status().audit_counts().inconclusive() == 1);
}

}  // namespace
}  // namespace rebound::server
