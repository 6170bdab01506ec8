// RecoveryCoordinator (server/recovery_coordinator.h) against the real units in memory (a
// Membership on a fake clock, an in-memory DurableStore, a CenterTable, the step log, SlotBooks
// and LogRetention), one policy per test case.

#include <catch2/catch.hpp>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/config.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "server/center_table.h"
#include "server/log_retention.h"
#include "server/membership.h"
#include "server/recovery_coordinator.h"
#include "server/reliability.h"
#include "server/slot_books.h"
#include "server/step_log.h"
#include "storage/durable_store.h"

namespace rebound::server {
namespace {

// `stages` = 1: 2 replicas x 1 stage; 2: 1 replica x 2 stages (each its own recovery group),
// under `policy`.
JobConfig Job(const std::string& policy, int stages) {
  auto job = ParseJobConfig(
      absl::StrCat("job_id: \"j\"\n"
                   "model { input_dim: 4 layers { width: 3 } layers { width: 2 activation: "
                   "IDENTITY } }\n"
                   "topology { replicas: ", 3 - stages, " stages: ", stages, " }\n"
                   "data { batch_size: 4 micro_batches: 2 }\n"
                   "easgd { sync_period: 2 }\n"
                   "training { max_steps: 16 }\n"
                   "fault_tolerance { policy: ",
                   policy, " heartbeat_interval_ms: 100 failure_timeout_ms: 1000 }\n"),
      "job.pbtxt");
  REQUIRE(job.ok());
  return *job;
}

RegisterRequest Request(const std::string& name, WorkerRole role) {
  RegisterRequest request;
  request.set_job_id("j");
  request.set_worker_name(name);
  request.set_requested_role(role);
  request.set_peer_address(absl::StrCat(name, ":1"));
  return request;
}

// The units server/main.cc and the service make, in memory.
struct Units {
  explicit Units(const std::string& policy, int stages = 1) : job(Job(policy, stages)) {
    config.set_max_wait_ms(0);
    *config.mutable_job() = job;
    auto opened = storage::DurableStore::Open(
        storage::DurableStoreOptions::FromConfig(DurabilityConfig(), job.step_log()));
    REQUIRE(opened.ok());
    store = *std::move(opened);
    auto created = CenterTable::Create(job);
    REQUIRE(created.ok());
    centers = *std::move(created);
    storage::DurableStore* db = store.get();
    membership = std::make_unique<Membership>(
        job, &clock, [db](const ServerRecord& server, const std::vector<SlotRecord>& slots) {
          storage::WriteBatch batch;
          batch.PutServer(server);
          for (const SlotRecord& slot : slots) batch.PutSlot(slot);
          return db->Commit(batch);
        });
    step_log = std::make_unique<StepLogService>(
        job, membership.get(), store.get(),
        [this](const SlotId& slot) { return books.StepLogFloor(slot); });
    retention = std::make_unique<LogRetention>(job, membership.get(), store.get(), &books);
    RecoveryUnits units;
    units.config = &config;
    units.membership = membership.get();
    units.centers = centers.get();
    units.tracker = &tracker;
    units.store = store.get();
    units.step_log = step_log.get();
    units.books = &books;
    units.retention = retention.get();
    units.clock = &clock;
    coordinator = std::make_unique<RecoveryCoordinator>(units);
  }

  RegisterResponse Register(const std::string& name, WorkerRole role) {
    auto registered = membership->Register(Request(name, role));
    REQUIRE(registered.ok());
    return *registered;
  }

  JobConfig job;
  ServerConfig config;
  FakeClock clock;
  std::unique_ptr<storage::DurableStore> store;
  std::unique_ptr<CenterTable> centers;
  ReliabilityTracker tracker{job.weighting(), job.topology().replicas()};
  std::unique_ptr<Membership> membership;
  SlotBooks books{job};
  std::unique_ptr<StepLogService> step_log;
  std::unique_ptr<LogRetention> retention;
  std::unique_ptr<RecoveryCoordinator> coordinator;
};

SlotState StateOf(const Membership& membership, int replica) {
  GetStatusResponse status;
  membership.FillStatus(&status);
  return status.slots(replica).state();
}

TEST_CASE("REPLAY: a spare gets a replay task for a lost slot and must prove its replay") {
  Units u("REPLAY");
  const RegisterResponse a = u.Register("a", TRAINER);
  u.Register("b", TRAINER);
  const RegisterResponse spare = u.Register("s", SPARE);
  // Nothing lost: no task.
  auto none = u.coordinator->NextTask(spare.incarnation(), absl::ZeroDuration());
  REQUIRE(none.ok());
  CHECK_FALSE(none->has_value());

  REQUIRE(u.membership->Deregister(a.incarnation()).ok());
  CHECK(StateOf(*u.membership, 0) == LOST);
  auto task = u.coordinator->NextTask(spare.incarnation(), absl::ZeroDuration());
  REQUIRE(task.ok());
  REQUIRE(task->has_value());
  const RecoveryTask& t = **task;
  CHECK(t.policy() == REPLAY);
  CHECK(t.slot().replica() == 0);
  CHECK(t.rank() == 0);
  CHECK(t.snapshot().step() == 0);  // never synced: the model's initialisation
  CHECK(t.failed_step() == 0);      // nothing logged
  REQUIRE(t.spares_size() == 1);
  CHECK(t.spares(0).incarnation() == spare.incarnation());
  CHECK(StateOf(*u.membership, 0) == RECOVERING);
  auto read = u.coordinator->TaskSlot(t.task_id(), spare.incarnation());
  REQUIRE(read.ok());
  CHECK(read->replica() == 0);
  CHECK(u.coordinator->TaskSlot(t.task_id() + 1, spare.incarnation()).status().code() ==
        absl::StatusCode::kFailedPrecondition);

  // A RECOVERED report that does not cover the published range is refused; the task goes on.
  ReportRecoveryRequest report;
  report.set_incarnation(spare.incarnation());
  report.set_task_id(t.task_id());
  report.set_outcome(RECOVERED);
  report.set_steps_replayed(3);
  report.set_verified(true);
  auto refused = u.coordinator->Finish(report);
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(StateOf(*u.membership, 0) == RECOVERING);

  // The proven report makes the spare the slot's trainer under a new incarnation, charged.
  const double fault_before = u.tracker.Current(t.slot(), u.clock.Now()).fault_score();
  report.set_steps_replayed(0);
  auto finished = u.coordinator->Finish(report);
  REQUIRE(finished.ok());
  REQUIRE(finished->has_value());
  CHECK((*finished)->slot().replica() == 0);
  CHECK((*finished)->incarnation() != spare.incarnation());
  CHECK(StateOf(*u.membership, 0) == ACTIVE);
  CHECK(u.tracker.Current(t.slot(), u.clock.Now()).fault_score() > fault_before);
}

TEST_CASE("REPLAY: a task that ends otherwise leaves the slot LOST; a mismatch falls back") {
  Units u("REPLAY");
  const RegisterResponse a = u.Register("a", TRAINER);
  u.Register("b", TRAINER);
  const RegisterResponse spare = u.Register("s", SPARE);
  REQUIRE(u.membership->Deregister(a.incarnation()).ok());
  auto task = u.coordinator->NextTask(spare.incarnation(), absl::ZeroDuration());
  REQUIRE(task.ok());
  REQUIRE(task->has_value());
  ReportRecoveryRequest report;
  report.set_incarnation(spare.incarnation());
  report.set_task_id((*task)->task_id());
  report.set_outcome(CHECKSUM_MISMATCH);
  report.set_detail("step 2 hashes differently");
  auto finished = u.coordinator->Finish(report);
  REQUIRE(finished.ok());
  CHECK_FALSE(finished->has_value());
  CHECK(StateOf(*u.membership, 0) == LOST);
  // The fallback: no replay task for it, a spare's heartbeat restarts it from the center.
  auto again = u.coordinator->NextTask(spare.incarnation(), absl::ZeroDuration());
  REQUIRE(again.ok());
  CHECK_FALSE(again->has_value());
  HeartbeatRequest beat;
  beat.set_incarnation(spare.incarnation());
  auto reply = u.membership->Heartbeat(beat);
  REQUIRE(reply.ok());
  REQUIRE(reply->has_takeover());
  const double fault_before = u.tracker.Current(reply->takeover().slot(), u.clock.Now()).fault_score();
  u.coordinator->OnRestartedFromCenter(spare.incarnation(), reply->takeover());
  CHECK(u.tracker.Current(reply->takeover().slot(), u.clock.Now()).fault_score() > fault_before);
}

TEST_CASE("REPLAY: a pipeline stage whose replay mismatches waits for another replay") {
  Units u("REPLAY", /*stages=*/2);
  u.Register("a", TRAINER);
  const RegisterResponse b = u.Register("b", TRAINER);
  const RegisterResponse spare = u.Register("s", SPARE);
  REQUIRE(u.membership->Deregister(b.incarnation()).ok());
  // Its live neighbour does not flush: the replay starts once failure_timeout has passed.
  u.clock.Advance(absl::Milliseconds(1001));
  auto task = u.coordinator->NextTask(spare.incarnation(), absl::ZeroDuration());
  REQUIRE(task.ok());
  REQUIRE(task->has_value());
  CHECK((*task)->slot().stage() == 1);
  ReportRecoveryRequest report;
  report.set_incarnation(spare.incarnation());
  report.set_task_id((*task)->task_id());
  report.set_outcome(CHECKSUM_MISMATCH);
  report.set_detail("step 2 hashes differently");
  auto finished = u.coordinator->Finish(report);
  REQUIRE(finished.ok());
  CHECK_FALSE(finished->has_value());
  const std::vector<RecoveryStatus> recoveries = u.membership->Recoveries();
  REQUIRE(recoveries.size() == 1);
  CHECK(recoveries[0].outcome() == CHECKSUM_MISMATCH);
  CHECK_THAT(recoveries[0].detail(), Catch::Matchers::Contains("no fallback"));
  // No restart from the center: the next claim is another replay of the stage.
  HeartbeatRequest beat;
  beat.set_incarnation(spare.incarnation());
  auto reply = u.membership->Heartbeat(beat);
  REQUIRE(reply.ok());
  CHECK_FALSE(reply->has_takeover());
  auto again = u.coordinator->NextTask(spare.incarnation(), absl::ZeroDuration());
  REQUIRE(again.ok());
  REQUIRE(again->has_value());
  CHECK((*again)->slot().stage() == 1);
  CHECK((*again)->task_id() != (*task)->task_id());
}

TEST_CASE("RESTART_FROM_CENTER: no tasks; the coordinator starts with that policy") {
  Units u("RESTART_FROM_CENTER");
  const RegisterResponse a = u.Register("a", TRAINER);
  const RegisterResponse spare = u.Register("s", SPARE);
  REQUIRE(u.membership->Deregister(a.incarnation()).ok());
  auto task = u.coordinator->NextTask(spare.incarnation(), absl::ZeroDuration());
  REQUIRE(task.ok());
  CHECK_FALSE(task->has_value());
  GetStatusResponse status;
  u.coordinator->FillStatus(&status);
  CHECK_FALSE(status.has_checkpoint());
}

TEST_CASE("GLOBAL_CHECKPOINT: a lost trainer rolls every slot back; spares restore them") {
  Units u("GLOBAL_CHECKPOINT checkpoint_every_steps: 4");
  REQUIRE(u.coordinator->EnableGlobalCheckpoint("").ok());
  const RegisterResponse a = u.Register("a", TRAINER);
  const RegisterResponse b = u.Register("b", TRAINER);
  const RegisterResponse spare = u.Register("s", SPARE);
  // Nothing lost: the detector's pass changes nothing.
  u.coordinator->AfterDetection();
  CHECK(StateOf(*u.membership, 1) == ACTIVE);

  REQUIRE(u.membership->Deregister(a.incarnation()).ok());
  u.coordinator->AfterDetection();
  CHECK(StateOf(*u.membership, 0) == LOST);
  CHECK(StateOf(*u.membership, 1) == LOST);
  CHECK(u.membership->CheckAlive(b.incarnation()).code() == absl::StatusCode::kAborted);
  GetStatusResponse status;
  u.coordinator->FillStatus(&status);
  CHECK(status.checkpoint().rollbacks() == 1);
  CHECK(status.checkpoint().step() == 0);
  // The sync barrier's epoch moved with the rollback.
  CHECK(u.coordinator->SyncEpoch() == 1);

  auto task = u.coordinator->NextTask(spare.incarnation(), absl::ZeroDuration());
  REQUIRE(task.ok());
  REQUIRE(task->has_value());
  CHECK((*task)->policy() == GLOBAL_CHECKPOINT);
  CHECK((*task)->slot().replica() == 0);
  CHECK((*task)->snapshot().step() == 0);
  ReportRecoveryRequest report;
  report.set_incarnation(spare.incarnation());
  report.set_task_id((*task)->task_id());
  report.set_outcome(RECOVERED);
  auto finished = u.coordinator->Finish(report);
  REQUIRE(finished.ok());
  REQUIRE(finished->has_value());
  CHECK(StateOf(*u.membership, 0) == ACTIVE);
}

TEST_CASE("a status read while the global checkpoint is enabled sees one policy or the other") {
  // server/main.cc serves GetStatus (and /metrics scrapes it) before it enables the checkpoint:
  // the policy's swap must not race with FillStatus (a data race under TSan when the service
  // held the checkpoint in a plain unique_ptr).
  Units u("GLOBAL_CHECKPOINT checkpoint_every_steps: 4");
  std::atomic<bool> done{false};
  std::atomic<int> with_checkpoint{0};
  std::thread reader([&] {
    while (!done.load()) {
      GetStatusResponse status;
      u.coordinator->FillStatus(&status);
      if (status.has_checkpoint()) with_checkpoint.fetch_add(1);
    }
  });
  REQUIRE(u.coordinator->EnableGlobalCheckpoint("").ok());
  while (with_checkpoint.load() == 0) std::this_thread::yield();
  done.store(true);
  reader.join();
  GetStatusResponse status;
  u.coordinator->FillStatus(&status);
  CHECK(status.checkpoint().every_steps() == 4);
}

}  // namespace
}  // namespace rebound::server
