// LogRetention (server/log_retention.h): the GC floor of a sync, the replaced snapshots of a
// recovery group's members, and SnapshotAt, against an in-memory DurableStore and a Membership
// on a fake clock.

#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/config.h"
#include "server/audit/auditor.h"
#include "server/log_retention.h"
#include "server/membership.h"
#include "server/reliability.h"
#include "server/step_log.h"
#include "server/slot_books.h"
#include "storage/durable_store.h"
#include "tests/server/server_testing.h"

namespace rebound::server {
namespace {

// 1 replica x 2 stages; `log_no_boundaries`: both stages are one recovery group.
JobConfig Job(bool log_no_boundaries) {
  return testing::TinyModelJob(
      1, 2,
      absl::StrCat("fault_tolerance { policy: REPLAY heartbeat_interval_ms: 100 "
                   "failure_timeout_ms: 1000 }\n",
                   log_no_boundaries ? "step_log { log_no_boundaries: true }\n" : ""));
}

SlotId Slot(int stage) {
  SlotId slot;
  slot.set_replica(0);
  slot.set_stage(stage);
  return slot;
}

SlotBook Book(int64_t step, int64_t log_floor) {
  SlotBook book;
  book.last_update_step = step;
  book.update_count = step / 2;
  book.log_floor = log_floor;
  return book;
}

struct Fixture {
  explicit Fixture(bool log_no_boundaries) : job(Job(log_no_boundaries)) {
    store = testing::OpenInMemoryStore(job);
    membership = std::make_unique<Membership>(job, &clock);
    retention = std::make_unique<LogRetention>(job, membership.get(), store.get(), &books);
  }

  void StoreSnapshot(int stage, int64_t step) {
    Snapshot snapshot;
    *snapshot.mutable_slot() = Slot(stage);
    snapshot.set_step(step);
    storage::WriteBatch batch;
    batch.PutSnapshot(snapshot);
    REQUIRE(store->Commit(batch).ok());
  }

  RegisterResponse Register(const std::string& name) {
    auto registered = membership->Register(
        testing::Request(name, ROLE_UNSPECIFIED, absl::StrCat(name, ":1")));
    REQUIRE(registered.ok());
    return *registered;
  }

  JobConfig job;
  FakeClock clock;
  std::unique_ptr<storage::DurableStore> store;
  std::unique_ptr<Membership> membership;
  SlotBooks books{job};
  std::unique_ptr<LogRetention> retention;
};

TEST_CASE("a stage alone in its group GCs through its sync's step and keeps no snapshot") {
  Fixture f(false);
  f.books.Set(Slot(1), Book(2, 2), 0);
  f.StoreSnapshot(0, 4);
  const LogRetention::SyncFloor floor = f.retention->ForSync(Slot(0), 6);
  CHECK(floor.gc_step == 6);
  CHECK_FALSE(floor.replaced.has_value());
}

TEST_CASE("a group member GCs only to the group's oldest step and keeps what it replaces") {
  Fixture f(true);
  f.Register("a");
  f.Register("b");
  f.books.Set(Slot(0), Book(4, 2), 0);
  f.books.Set(Slot(1), Book(2, 2), 0);
  f.StoreSnapshot(0, 4);
  LogRetention::SyncFloor floor = f.retention->ForSync(Slot(0), 6);
  CHECK(floor.gc_step == 2);  // stage 1 last synced at 2
  REQUIRE(floor.replaced.has_value());
  CHECK(floor.replaced->step() == 4);

  // After the sync committed, the replaced snapshot (step 4) is still found.
  f.StoreSnapshot(0, 6);
  f.retention->Committed(Slot(0), 6, std::move(floor));
  auto at4 = f.retention->SnapshotAt(Slot(0), 4);
  REQUIRE(at4.ok());
  CHECK(at4->step() == 4);
  auto at6 = f.retention->SnapshotAt(Slot(0), 6);
  REQUIRE(at6.ok());
  CHECK(at6->step() == 6);
  // Step 0 is the model's initialisation; any other step is gone.
  auto at0 = f.retention->SnapshotAt(Slot(1), 0);
  REQUIRE(at0.ok());
  CHECK(at0->step() == 0);
  CHECK(at0->slot().stage() == 1);
  CHECK(f.retention->SnapshotAt(Slot(0), 2).status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("while another member is down, a group member GCs nothing past its previous floor") {
  Fixture f(true);
  f.Register("a");
  const RegisterResponse b = f.Register("b");
  f.books.Set(Slot(0), Book(4, 1), 0);
  f.books.Set(Slot(1), Book(4, 3), 0);
  CHECK(f.retention->ForSync(Slot(0), 6).gc_step == 4);
  REQUIRE(f.membership->Deregister(b.incarnation()).ok());  // stage 1 is LOST
  CHECK(f.retention->ForSync(Slot(0), 6).gc_step == 1);
}

TEST_CASE("a sync whose window is audited keeps the window's log, and HoldAudit hands the "
          "auditor the stored starting snapshot, read before the sync's batch replaces it") {
  const JobConfig job = testing::TinyModelJob(
      1, 1,
      "fault_tolerance { policy: REPLAY heartbeat_interval_ms: 100 failure_timeout_ms: 1000 }\n"
      "audit { fraction: 1 max_concurrent: 1 }\n");
  FakeClock clock;
  std::unique_ptr<storage::DurableStore> store = testing::OpenInMemoryStore(job);
  Membership membership(job, &clock);
  ReliabilityTracker tracker(job.weighting(), 1);
  StepLogService step_log(job, &membership, store.get());
  SlotBooks books{job};
  Auditor auditor(job, &membership, &tracker, &step_log, &clock);
  LogRetention retention(job, &membership, store.get(), &books);
  retention.SetAuditor(&auditor);
  auto trainer = membership.Register(testing::Request("trainer", TRAINER));
  REQUIRE(trainer.ok());
  const uint64_t owner = trainer->incarnation();
  auto store_snapshot = [&](int64_t step) {
    Snapshot snapshot;
    *snapshot.mutable_slot() = Slot(0);
    snapshot.set_step(step);
    snapshot.set_data_offset(step * 10);
    storage::WriteBatch batch;
    batch.PutSnapshot(snapshot);
    REQUIRE(store->Commit(batch).ok());
  };

  // The first sync (8) only records the trainer: its window's start is unknown.
  books.Set(Slot(0), Book(0, 0), 0);
  LogRetention::SyncFloor first = retention.ForSync(Slot(0), 8, owner);
  CHECK(first.gc_step == 8);
  CHECK_FALSE(first.audit_from.has_value());
  store_snapshot(8);
  books.Set(Slot(0), Book(8, 8), 0);
  // The second (16): the window (8, 16] is chosen; the log from 8 on is kept.
  LogRetention::SyncFloor second = retention.ForSync(Slot(0), 16, owner);
  REQUIRE(second.audit_from.has_value());
  CHECK(*second.audit_from == 8);
  CHECK(second.owner == owner);
  CHECK(second.gc_step == 8);
  CHECK_FALSE(auditor.KeepLogFrom(Slot(0)).has_value());  // not held before HoldAudit
  retention.HoldAudit(Slot(0), 16, second.audit_from, second.owner);
  CHECK(auditor.KeepLogFrom(Slot(0)) == 8);
  GetStatusResponse status;
  auditor.FillStatus(&status);
  REQUIRE(status.audits_size() == 1);
  CHECK(status.audits(0).from_step() == 8);
  CHECK(status.audits(0).to_step() == 16);
  CHECK(status.audits(0).worker() == "trainer");
  // Later syncs keep the held window's log.
  store_snapshot(16);
  books.Set(Slot(0), Book(16, 8), 0);
  LogRetention::SyncFloor third = retention.ForSync(Slot(0), 24, owner);
  CHECK(third.gc_step == 8);

  // A window whose starting snapshot is gone (the store holds another step) is dropped.
  retention.HoldAudit(Slot(0), 24, third.audit_from.value_or(16) + 100, owner);
  GetStatusResponse after;
  auditor.FillStatus(&after);
  CHECK(after.audits_size() == 1);
  CHECK(after.audit_counts().windows_chosen() == 1);
  CHECK(after.audit_counts().windows_unread() == 1);
}

TEST_CASE("a sharded job's window starts from the header read when it is chosen, its tensors "
          "filled from the ranges after the commit; a failed read drops the window") {
  const JobConfig job = testing::TinyModelJob(
      1, 1,
      "fault_tolerance { policy: REPLAY heartbeat_interval_ms: 100 failure_timeout_ms: 1000 }\n"
      "sharding { groups: 2 }\n"
      "audit { fraction: 1 max_concurrent: 1 }\n");
  FakeClock clock;
  std::unique_ptr<storage::DurableStore> store = testing::OpenInMemoryStore(job);
  Membership membership(job, &clock);
  ReliabilityTracker tracker(job.weighting(), 1);
  StepLogService step_log(job, &membership, store.get());
  SlotBooks books{job};
  Auditor auditor(job, &membership, &tracker, &step_log, &clock);
  LogRetention retention(job, &membership, store.get(), &books);
  retention.SetAuditor(&auditor);
  // The ranges' part: what the fill was asked for, and params it puts in.
  std::vector<std::pair<int64_t, int64_t>> asked;  // (step, data_offset) of each header
  bool ranges_answer = true;
  retention.SetRangeSnapshotFill([&](Snapshot* header) -> absl::Status {
    asked.emplace_back(header->step(), header->data_offset());
    if (!ranges_answer) return absl::NotFoundError("range 1 holds no snapshot of step 24");
    header->mutable_params()->add_tensors()->set_name("from the ranges");
    return absl::OkStatus();
  });
  auto trainer = membership.Register(testing::Request("trainer", TRAINER));
  REQUIRE(trainer.ok());
  const uint64_t owner = trainer->incarnation();
  auto store_header = [&](int64_t step) {  // what CommitSync stores: no tensors
    Snapshot header;
    *header.mutable_slot() = Slot(0);
    header.set_step(step);
    header.set_data_offset(step * 10);
    storage::WriteBatch batch;
    batch.PutSnapshot(header);
    REQUIRE(store->Commit(batch).ok());
  };

  books.Set(Slot(0), Book(0, 0), 0);
  CHECK_FALSE(retention.ForSync(Slot(0), 8, owner).audit_from.has_value());
  store_header(8);
  books.Set(Slot(0), Book(8, 8), 0);
  // (8, 16] starts at the trainer's first sync here: not audited in a sharded job.
  CHECK_FALSE(retention.ForSync(Slot(0), 16, owner).audit_from.has_value());
  store_header(16);
  books.Set(Slot(0), Book(16, 16), 0);
  // The window (16, 24] is chosen: the header of 16 is read now, before the commit replaces it.
  LogRetention::SyncFloor third = retention.ForSync(Slot(0), 24, owner);
  REQUIRE(third.audit_start.has_value());
  CHECK(third.audit_start->step() == 16);
  CHECK(third.audit_start->data_offset() == 160);
  store_header(24);  // the commit
  books.Set(Slot(0), Book(24, 16), 0);
  retention.HoldAudit(Slot(0), 24, third.audit_from, third.owner, third.audit_start);
  CHECK(asked == std::vector<std::pair<int64_t, int64_t>>{{16, 160}});
  CHECK(auditor.KeepLogFrom(Slot(0)) == 16);
  GetStatusResponse status;
  auditor.FillStatus(&status);
  REQUIRE(status.audits_size() == 1);
  CHECK(status.audits(0).from_step() == 16);

  // Without the header read at choosing time, the store's is the commit's (24): dropped, and the
  // ranges are not asked. A read that fails drops the window too.
  retention.HoldAudit(Slot(0), 32, int64_t{16}, owner);
  CHECK(asked.size() == 1);
  ranges_answer = false;
  Snapshot header24;
  *header24.mutable_slot() = Slot(0);
  header24.set_step(24);
  retention.HoldAudit(Slot(0), 32, int64_t{24}, owner, header24);
  CHECK(asked.size() == 2);
  GetStatusResponse after;
  auditor.FillStatus(&after);
  CHECK(after.audits_size() == 1);
  CHECK(after.audit_counts().windows_unread() == 2);
}

}  // namespace
}  // namespace rebound::server
