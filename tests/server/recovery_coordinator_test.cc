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

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
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
#include "tests/server/in_memory_units.h"
#include "tests/server/server_testing.h"

namespace rebound::server {
namespace {

using testing::Beat;
using testing::BeatOk;
using testing::FailOne;
using testing::FlushWhenAsked;
using testing::HasCommand;
using testing::JobWithPolicy;
using testing::PipelineJob;
using testing::RegisterTrainers;
using testing::Request;

// `stages` = 1: 2 replicas x 1 stage; 2: 1 replica x 2 stages (each its own recovery group),
// under `policy`.
JobConfig Job(const std::string& policy, int stages) {
  return testing::TinyModelJob(
      3 - stages, stages,
      absl::StrCat("easgd { sync_period: 2 }\n"
                   "training { max_steps: 16 }\n"
                   "fault_tolerance { policy: ",
                   policy, " heartbeat_interval_ms: 100 failure_timeout_ms: 1000 }\n"));
}

// The units the server makes, in memory (tests/server/in_memory_units.h).
struct Units : testing::InMemoryUnits {
  explicit Units(const std::string& policy, int stages = 1) : Units(Job(policy, stages)) {}
  explicit Units(const JobConfig& job_config) : InMemoryUnits(job_config) {}
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

  // The proven report makes the spare the slot's trainer under a new incarnation. A verified
  // replay charges nobody (docs/design.md §4.5, issue R11): the slot now weighs its new owner's score,
  // and the lost trainer's own score (charged when it failed) is not raised again.
  u.tracker.SetOwner(t.slot(), "a");
  u.tracker.OnFault("a", u.clock.Now());
  REQUIRE(u.tracker.Current(t.slot(), u.clock.Now()).fault_score() == Approx(0.5));
  report.set_steps_replayed(0);
  auto finished = u.coordinator->Finish(report);
  REQUIRE(finished.ok());
  REQUIRE(finished->has_value());
  CHECK((*finished)->slot().replica() == 0);
  CHECK((*finished)->incarnation() != spare.incarnation());
  CHECK(StateOf(*u.membership, 0) == ACTIVE);
  CHECK(u.tracker.Current(t.slot(), u.clock.Now()).fault_score() == 0.0);  // s's: none
  CHECK(u.tracker.Current(t.slot(), u.clock.Now()).weight() == 1.0);
  CHECK(u.tracker.FaultScore("a", u.clock.Now()) == Approx(0.5));
  CHECK(u.tracker.FaultScore("s", u.clock.Now()) == 0.0);
}

// Trainers a and b and spare s; a leaves, and s claims the replay of its slot (0, 0).
struct LostSlot {
  RegisterResponse spare;
  RecoveryTask task;
};
LostSlot ClaimLostSlot(Units& u) {
  const RegisterResponse a = u.Register("a", TRAINER);
  u.Register("b", TRAINER);
  LostSlot lost;
  lost.spare = u.Register("s", SPARE);
  REQUIRE(u.membership->Deregister(a.incarnation()).ok());
  auto task = u.coordinator->NextTask(lost.spare.incarnation(), absl::ZeroDuration());
  REQUIRE(task.ok());
  REQUIRE(task->has_value());
  lost.task = **task;
  return lost;
}

TEST_CASE("REPLAY: a task that ends otherwise leaves the slot LOST; a mismatch falls back") {
  Units u("REPLAY");
  const LostSlot lost = ClaimLostSlot(u);
  const RegisterResponse& spare = lost.spare;
  ReportRecoveryRequest report;
  report.set_incarnation(spare.incarnation());
  report.set_task_id(lost.task.task_id());
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
  // A restart from the center charges nobody; the slot weighs the spare's own score (one fault
  // of "s" earlier), not the lost trainer's.
  const SlotId slot = reply->takeover().slot();
  u.tracker.SetOwner(slot, "a");
  u.tracker.OnFault("a", u.clock.Now());
  u.tracker.OnFault("s", u.clock.Now());
  u.tracker.OnFault("a", u.clock.Now());
  u.coordinator->OnRestartedFromCenter(spare.incarnation(), reply->takeover());
  CHECK(u.tracker.Current(slot, u.clock.Now()).fault_score() == Approx(0.5));
  CHECK(u.tracker.FaultScore("s", u.clock.Now()) == Approx(0.5));
  CHECK(u.tracker.FaultScore("a", u.clock.Now()) == Approx(1.0));
}

TEST_CASE("REPLAY: after max_replay_attempts failed replays a slot falls back to the center") {
  // A spare that gives up the same way every time (e.g. it cannot rebuild the optimizer) must
  // not leave the slot LOST while it could restart the slot from the center.
  Units u("REPLAY");
  REQUIRE(u.job.fault_tolerance().max_replay_attempts() == 2);  // the default
  const LostSlot lost = ClaimLostSlot(u);
  const RegisterResponse& spare = lost.spare;
  auto give_up = [&](uint64_t task_id) {
    ReportRecoveryRequest report;
    report.set_incarnation(spare.incarnation());
    report.set_task_id(task_id);
    report.set_outcome(ABANDONED);
    report.set_detail("the optimizer Foo has no snapshot state");
    auto finished = u.coordinator->Finish(report);
    REQUIRE(finished.ok());
    CHECK_FALSE(finished->has_value());
  };
  give_up(lost.task.task_id());
  // One failure: another replay.
  CHECK(StateOf(*u.membership, 0) == LOST);
  HeartbeatRequest beat;
  beat.set_incarnation(spare.incarnation());
  auto reply = u.membership->Heartbeat(beat);
  REQUIRE(reply.ok());
  CHECK_FALSE(reply->has_takeover());
  auto second = u.coordinator->NextTask(spare.incarnation(), absl::ZeroDuration());
  REQUIRE(second.ok());
  REQUIRE(second->has_value());
  give_up((*second)->task_id());
  // Two: the fallback. No replay task; the spare's heartbeat restarts it from the center.
  GetStatusResponse status;
  u.membership->FillStatus(&status);
  CHECK(status.slots(0).state() == LOST);
  CHECK_THAT(status.slots(0).detail(),
             Catch::Matchers::Contains("restart it from the center (FALLBACK after 2 failed "
                                       "replays); the last attempt: the optimizer Foo"));
  auto none = u.coordinator->NextTask(spare.incarnation(), absl::ZeroDuration());
  REQUIRE(none.ok());
  CHECK_FALSE(none->has_value());
  reply = u.membership->Heartbeat(beat);
  REQUIRE(reply.ok());
  REQUIRE(reply->has_takeover());
  CHECK(reply->takeover().slot().replica() == 0);
  CHECK(StateOf(*u.membership, 0) == ACTIVE);
  const std::vector<RecoveryStatus> recoveries = u.membership->Recoveries();
  REQUIRE(recoveries.size() == 3);
  CHECK(recoveries[2].policy() == RESTART_FROM_CENTER);
  CHECK(absl::StrContains(recoveries[2].detail(), "FALLBACK"));

  // The count is per loss: the new trainer leaves, and one failed replay of this loss does not
  // fall back yet.
  REQUIRE(u.membership->Deregister(reply->takeover().incarnation()).ok());
  const RegisterResponse s2 = u.Register("s2", SPARE);
  auto third = u.coordinator->NextTask(s2.incarnation(), absl::ZeroDuration());
  REQUIRE(third.ok());
  REQUIRE(third->has_value());
  ReportRecoveryRequest report;
  report.set_incarnation(s2.incarnation());
  report.set_task_id((*third)->task_id());
  report.set_outcome(ABANDONED);
  report.set_detail("gave up");
  REQUIRE(u.coordinator->Finish(report).ok());
  auto fourth = u.coordinator->NextTask(s2.incarnation(), absl::ZeroDuration());
  REQUIRE(fourth.ok());
  CHECK(fourth->has_value());
}

TEST_CASE("REPLAY: an UNREPLAYABLE report falls back at once, without DATA_LOSS; a pipeline "
          "stage waits for another replay") {
  Units u("REPLAY");
  const LostSlot lost = ClaimLostSlot(u);
  ReportRecoveryRequest report;
  report.set_incarnation(lost.spare.incarnation());
  report.set_task_id(lost.task.task_id());
  report.set_outcome(UNREPLAYABLE);
  report.set_detail("step 4: cannot replay exactly: the optimizer Unfit");
  REQUIRE(u.coordinator->Finish(report).ok());
  const std::vector<RecoveryStatus> recoveries = u.membership->Recoveries();
  REQUIRE(recoveries.size() == 1);
  CHECK(recoveries[0].outcome() == UNREPLAYABLE);
  CHECK_FALSE(absl::StrContains(recoveries[0].detail(), "DATA_LOSS"));
  CHECK(absl::StrContains(recoveries[0].detail(), "falling back to RESTART_FROM_CENTER"));
  HeartbeatRequest beat;
  beat.set_incarnation(lost.spare.incarnation());
  auto reply = u.membership->Heartbeat(beat);
  REQUIRE(reply.ok());
  CHECK(reply->has_takeover());  // one report was enough: max_replay_attempts is 2

  Units pipeline("REPLAY", /*stages=*/2);
  pipeline.Register("a", TRAINER);
  const RegisterResponse b = pipeline.Register("b", TRAINER);
  const RegisterResponse spare = pipeline.Register("s", SPARE);
  REQUIRE(pipeline.membership->Deregister(b.incarnation()).ok());
  pipeline.clock.Advance(absl::Milliseconds(1001));
  auto task = pipeline.coordinator->NextTask(spare.incarnation(), absl::ZeroDuration());
  REQUIRE(task.ok());
  REQUIRE(task->has_value());
  report.set_incarnation(spare.incarnation());
  report.set_task_id((*task)->task_id());
  REQUIRE(pipeline.coordinator->Finish(report).ok());
  auto again = pipeline.coordinator->NextTask(spare.incarnation(), absl::ZeroDuration());
  REQUIRE(again.ok());
  CHECK(again->has_value());
}

TEST_CASE("REPLAY: max_replay_attempts 1 falls back after the first failed replay") {
  JobConfig job = Job("REPLAY", 1);
  job.mutable_fault_tolerance()->set_max_replay_attempts(1);
  Units u(job);
  const LostSlot lost = ClaimLostSlot(u);
  ReportRecoveryRequest report;
  report.set_incarnation(lost.spare.incarnation());
  report.set_task_id(lost.task.task_id());
  report.set_outcome(ABANDONED);
  report.set_detail("gave up");
  REQUIRE(u.coordinator->Finish(report).ok());
  HeartbeatRequest beat;
  beat.set_incarnation(lost.spare.incarnation());
  auto reply = u.membership->Heartbeat(beat);
  REQUIRE(reply.ok());
  CHECK(reply->has_takeover());
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

TEST_CASE("REPLAY: a task past recovery_timeout is abandoned after the detector's pass") {
  // The task's start and timeout are the coordinator's (AfterDetection); a pause of the whole
  // server (Membership::ExcuseServerPause, told to the coordinator) is not the task's time.
  Units u("REPLAY");
  const LostSlot lost = ClaimLostSlot(u);
  const RegisterResponse& spare = lost.spare;
  const uint64_t id = lost.task.task_id();

  u.clock.Advance(absl::Milliseconds(120000));  // recovery_timeout_ms' default, exactly
  u.coordinator->AfterDetection();
  CHECK(StateOf(*u.membership, 0) == RECOVERING);
  u.clock.Advance(absl::Milliseconds(30000));
  u.membership->ExcuseServerPause(absl::Milliseconds(30000));
  u.coordinator->AfterDetection();
  CHECK(StateOf(*u.membership, 0) == RECOVERING);
  CHECK(u.coordinator->TaskSlot(id, spare.incarnation()).ok());

  u.clock.Advance(absl::Milliseconds(1));
  u.coordinator->AfterDetection();
  CHECK(StateOf(*u.membership, 0) == LOST);
  const std::vector<RecoveryStatus> recoveries = u.membership->Recoveries();
  REQUIRE(recoveries.size() == 1);
  CHECK(recoveries[0].outcome() == ABANDONED);
  CHECK_THAT(recoveries[0].detail(), Catch::Matchers::Contains("recovery_timeout_ms = 120000"));
  // The task is over: its leader's report is refused, and it may claim the slot again.
  ReportRecoveryRequest report;
  report.set_incarnation(spare.incarnation());
  report.set_task_id(id);
  report.set_outcome(RECOVERED);
  CHECK(u.coordinator->Finish(report).status().code() == absl::StatusCode::kFailedPrecondition);
  auto again = u.coordinator->NextTask(spare.incarnation(), absl::ZeroDuration());
  REQUIRE(again.ok());
  REQUIRE(again->has_value());
  CHECK((*again)->task_id() != id);
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


// The replay tasks' claim, publication and end (moved here from membership_test with the code:
// Membership keeps the slots, the coordinator the tasks), on the same jobs as there.
namespace claims {

// The status of the worker `incarnation`.
// (Membership fills the workers, the coordinator a spare's waiting_for_task and replay_task.)
WorkerStatus StatusOf(const Units& u, uint64_t incarnation) {
  GetStatusResponse status;
  u.membership->FillStatus(&status);
  u.coordinator->FillStatus(&status);
  for (const WorkerStatus& w : status.workers()) {
    if (w.incarnation() == incarnation) return w;
  }
  FAIL("no worker " << incarnation);
  return {};
}

// ClaimReplay of one spare on its own thread, as a WaitForTask long poll does.
class Poll {
 public:
  Poll(RecoveryCoordinator* tasks, uint64_t incarnation)
      : incarnation_(incarnation), thread_([this, tasks] {
          auto claim = tasks->ClaimReplay(incarnation_, absl::Seconds(20));
          absl::MutexLock lock(&mu_);
          status_ = claim.status();
          if (claim.ok()) claim_ = *claim;
          done_ = true;
        }) {}
  ~Poll() { thread_.join(); }

  bool done() const {
    absl::MutexLock lock(&mu_);
    return done_;
  }
  // Waits (20 s at most) for the poll to end; its claim, or nothing.
  std::optional<ReplayClaim> Wait() {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&done_), absl::Seconds(20));
    REQUIRE(done_);
    REQUIRE(status_.ok());
    return claim_;
  }

 private:
  const uint64_t incarnation_;
  mutable absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::optional<ReplayClaim> claim_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// Waits until every one of `incarnations` waits in ClaimReplay, as status says.
void WaitUntilPolling(const Units& u, std::initializer_list<uint64_t> incarnations) {
  const absl::Time limit = absl::Now() + absl::Seconds(20);
  for (uint64_t incarnation : incarnations) {
    while (!StatusOf(u, incarnation).waiting_for_task() && absl::Now() < limit) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    REQUIRE(StatusOf(u, incarnation).waiting_for_task());
  }
}

TEST_CASE("under GLOBAL_CHECKPOINT no spare restores a slot until the rollback is finished") {
  // The server restores the center and the slots' bookkeeping between RollBackAll and
  // FinishRollback; a spare handed a slot before then synced against the state of before the
  // rollback (its first sync was refused as stale, and the spare exited).
  Units u(JobWithPolicy("GLOBAL_CHECKPOINT checkpoint_every_steps: 16"));
  FakeClock& clock = u.clock;
  Membership& membership = *u.membership;
  RecoveryCoordinator& tasks = *u.coordinator;
  auto a = membership.Register(Request("a"));
  auto b = membership.Register(Request("b"));
  auto spare = membership.Register(Request("s", SPARE));
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(spare.ok());
  membership.RecordProgress(a->slot(), 32, 1000);
  clock.Advance(absl::Milliseconds(900));
  REQUIRE(membership.Heartbeat(Beat(b->incarnation(), 32)).ok());
  REQUIRE(membership.Heartbeat(Beat(spare->incarnation())).ok());
  clock.Advance(absl::Milliseconds(200));
  REQUIRE(membership.DetectFailures().size() == 1);  // a
  std::string why;
  REQUIRE(membership.TakeRollbackRequest(&why));
  CHECK(absl::StrContains(why, "lost its trainer 'a'"));
  CHECK_FALSE(membership.TakeRollbackRequest(&why));  // once per loss

  membership.RollBackAll(16, why);
  GetStatusResponse status;
  membership.FillStatus(&status);
  CHECK(status.slots(0).state() == LOST);
  CHECK(status.slots(1).state() == LOST);
  CHECK(membership.CheckOwner(b->incarnation(), b->slot()).code() == absl::StatusCode::kAborted);
  // Rolled back but not yet restored: nothing to claim, even after a wait.
  auto early = tasks.ClaimReplay(spare->incarnation(), absl::Milliseconds(20));
  REQUIRE(early.ok());
  CHECK_FALSE(early->has_value());
  // A spare already waiting is woken by FinishRollback. `waited` is written by the waiter and
  // read here only after join(); `returned` and `finish_called` tell, without a data race,
  // whether the claim returned and whether FinishRollback had been called by then.
  std::optional<absl::StatusOr<std::optional<ReplayClaim>>> waited;
  absl::Notification returned;
  std::atomic<bool> finish_called{false};
  std::atomic<bool> returned_after_finish{false};
  std::thread waiter([&] {
    waited = tasks.ClaimReplay(spare->incarnation(), absl::Seconds(20));
    returned_after_finish.store(finish_called.load());
    returned.Notify();
  });
  // The spare is parked in ClaimReplay once status shows it waiting for a task.
  auto spare_waiting = [&] {
    GetStatusResponse now;
    membership.FillStatus(&now);
    tasks.FillStatus(&now);
    for (const WorkerStatus& worker : now.workers()) {
      if (worker.incarnation() == spare->incarnation()) return worker.waiting_for_task();
    }
    return false;
  };
  for (int i = 0; i < 2000 && !spare_waiting() && !returned.HasBeenNotified(); ++i) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  CHECK(spare_waiting());
  // Parked, and it stays parked: the claim blocks until the rollback is finished.
  CHECK_FALSE(returned.WaitForNotificationWithTimeout(absl::Milliseconds(20)));
  finish_called.store(true);
  membership.FinishRollback();
  waiter.join();
  CHECK(returned_after_finish.load());
  REQUIRE(waited.has_value());
  REQUIRE(waited->ok());
  REQUIRE((*waited)->has_value());
  CHECK((**waited)->slot.replica() == 0);
  CHECK((**waited)->reached_step == 16);

  // Slot 0 is restored, then slot 1 (a restore charges nobody since issue R11, docs/design.md §4.5).
  ReportRecoveryRequest report;
  report.set_incarnation(spare->incarnation());
  report.set_task_id((**waited)->task_id);
  report.set_outcome(RECOVERED);
  auto restored = tasks.FinishReplay(spare->incarnation(), report, {});
  REQUIRE(restored.ok());
  REQUIRE(restored->has_value());
  CHECK((*restored)->slot().replica() == 0);
  auto b2 = membership.Register(Request("b2", SPARE));
  REQUIRE(b2.ok());
  auto claim = tasks.ClaimReplay(b2->incarnation(), absl::ZeroDuration());
  REQUIRE(claim.ok());
  REQUIRE(claim->has_value());
  CHECK((*claim)->slot.replica() == 1);
  report.set_incarnation(b2->incarnation());
  report.set_task_id((*claim)->task_id);
  restored = tasks.FinishReplay(b2->incarnation(), report, {});
  REQUIRE(restored.ok());
  REQUIRE(restored->has_value());
  CHECK((*restored)->slot().replica() == 1);
}

TEST_CASE("under REPLAY a lost slot waits for a spare to claim its replay") {
  Units u(JobWithPolicy("REPLAY"));
  FakeClock& clock = u.clock;
  Membership& membership = *u.membership;
  RecoveryCoordinator& tasks = *u.coordinator;
  auto a = membership.Register(Request("a"));
  auto spare = membership.Register(Request("s", SPARE));
  // Nothing to replay yet: the long poll ends empty.
  auto none = tasks.ClaimReplay(spare->incarnation(), absl::ZeroDuration());
  REQUIRE(none.ok());
  CHECK_FALSE(none->has_value());

  membership.RecordProgress(a->slot(), 8, 1000);
  REQUIRE(membership.Heartbeat(Beat(a->incarnation(), 11)).ok());
  clock.Advance(absl::Milliseconds(1001));
  REQUIRE(membership.Heartbeat(Beat(spare->incarnation())).ok());
  REQUIRE(membership.DetectFailures().size() == 1);
  auto beat = membership.Heartbeat(Beat(spare->incarnation()));
  CHECK_FALSE(beat->has_takeover());  // REPLAY never silently restarts from the center
  GetStatusResponse status;
  membership.FillStatus(&status);
  CHECK(status.slots(0).state() == LOST);
  CHECK(absl::StrContains(status.slots(0).detail(), "waiting for a spare to replay it"));

  auto claim = tasks.ClaimReplay(spare->incarnation(), absl::ZeroDuration());
  REQUIRE(claim.ok());
  REQUIRE(claim->has_value());
  CHECK((*claim)->slot.replica() == 0);
  CHECK((*claim)->reached_step == 11);
  CHECK(tasks.TaskSlot((*claim)->task_id, spare->incarnation()).ok());
  CHECK(tasks.TaskSlot((*claim)->task_id, a->incarnation()).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  // One task per spare.
  CHECK(tasks.ClaimReplay(spare->incarnation(), absl::ZeroDuration()).status().code() ==
        absl::StatusCode::kFailedPrecondition);

  ReportRecoveryRequest report;
  report.set_task_id((*claim)->task_id);
  report.set_outcome(RECOVERED);
  report.set_steps_replayed(3);
  report.set_verified(true);
  auto finished = tasks.FinishReplay(spare->incarnation(), report, {});
  REQUIRE(finished.ok());
  REQUIRE(finished->has_value());
  const RegisterResponse& trainer = **finished;
  CHECK(trainer.role() == TRAINER);
  CHECK(trainer.start_step() == 11);  // snapshot at 8 + 3 replayed steps
  CHECK(membership.CheckOwner(trainer.incarnation(), trainer.slot()).ok());
  CHECK(membership.CheckAlive(spare->incarnation()).code() ==
        absl::StatusCode::kFailedPrecondition);  // REPLACED
  const auto recoveries = membership.Recoveries();
  REQUIRE(recoveries.size() == 1);
  CHECK(recoveries[0].policy() == REPLAY);
  CHECK(recoveries[0].outcome() == RECOVERED);
  CHECK(recoveries[0].verified());
  CHECK(recoveries[0].steps_replayed() == 3);
}

TEST_CASE("with recovery_parallelism 2 one waiting spare leads a replay and another helps") {
  Units u(JobWithPolicy("REPLAY", 2));
  FakeClock& clock = u.clock;
  Membership& membership = *u.membership;
  RecoveryCoordinator& tasks = *u.coordinator;
  auto a = membership.Register(Request("a"));
  auto s1 = membership.Register(Request("s1", SPARE));
  auto s2 = membership.Register(Request("s2", SPARE));
  auto s3 = membership.Register(Request("s3", SPARE));
  membership.RecordProgress(a->slot(), 16, 1000);
  REQUIRE(membership.Heartbeat(Beat(a->incarnation(), 20)).ok());
  clock.Advance(absl::Milliseconds(600));
  for (const auto& s : {s1, s2, s3}) REQUIRE(membership.Heartbeat(Beat(s->incarnation())).ok());
  clock.Advance(absl::Milliseconds(500));

  // s1 and s2 wait for work; s3 does not (it is busy elsewhere, e.g. loading its data).
  Poll p1(&tasks, s1->incarnation());
  Poll p2(&tasks, s2->incarnation());
  WaitUntilPolling(u, {s1->incarnation(), s2->incarnation()});
  REQUIRE(membership.DetectFailures().size() == 1);  // a; its slot is LOST
  // Whichever wakes first leads; the other is its helper and waits for the published range.
  const absl::Time limit = absl::Now() + absl::Seconds(20);
  while (!p1.done() && !p2.done() && absl::Now() < limit) absl::SleepFor(absl::Milliseconds(1));
  REQUIRE((p1.done() || p2.done()));
  Poll& leader_poll = p1.done() ? p1 : p2;
  Poll& helper_poll = p1.done() ? p2 : p1;
  const uint64_t leader = p1.done() ? s1->incarnation() : s2->incarnation();
  const uint64_t helper = p1.done() ? s2->incarnation() : s1->incarnation();
  std::optional<ReplayClaim> led = leader_poll.Wait();
  REQUIRE(led.has_value());
  CHECK(led->rank == 0);
  CHECK(led->slot.replica() == 0);
  REQUIRE(led->spares.size() == 2);
  CHECK(led->spares[0].incarnation == leader);
  CHECK(led->spares[1].incarnation == helper);
  CHECK(led->spares[1].peer_address == "127.0.0.1:1");
  CHECK(StatusOf(u, helper).replay_task() == led->task_id);
  CHECK(StatusOf(u, s3->incarnation()).replay_task() == 0);
  // The helper gets the task only once the leader has published the range.
  absl::SleepFor(absl::Milliseconds(50));
  CHECK_FALSE(helper_poll.done());
  tasks.PublishReplay(led->task_id, 16, 19);
  std::optional<ReplayClaim> helped = helper_poll.Wait();
  REQUIRE(helped.has_value());
  CHECK(helped->task_id == led->task_id);
  CHECK(helped->rank == 1);
  CHECK(helped->snapshot_step == 16);
  CHECK(helped->failed_step == 19);
  CHECK(tasks.TaskSlot(led->task_id, helper).ok());
  CHECK(tasks.TaskSlot(led->task_id, s3->incarnation()).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  // Only the leader reports.
  ReportRecoveryRequest report;
  report.set_task_id(led->task_id);
  report.set_outcome(RECOVERED);
  report.set_steps_replayed(3);
  report.set_verified(true);
  CHECK(tasks.FinishReplay(helper, report, {}).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  auto finished = tasks.FinishReplay(leader, report, {});
  REQUIRE(finished.ok());
  REQUIRE(finished->has_value());
  CHECK((*finished)->start_step() == 19);
  const auto recoveries = membership.Recoveries();
  REQUIRE(recoveries.size() == 1);
  REQUIRE(recoveries[0].spares_size() == 2);
  CHECK(recoveries[0].spares(1) == helper);
  // The helper is a free spare again.
  CHECK(membership.CheckAlive(helper).ok());
  CHECK(StatusOf(u, helper).replay_task() == 0);
}

TEST_CASE("a spare between two long polls still helps a replay that starts then") {
  // The security test's job once lost its second spare this way: s2's poll had just ended empty
  // when the slot became claimable, and s1 replayed alone although recovery_parallelism was 2.
  Units u(JobWithPolicy("REPLAY", 2));
  FakeClock& clock = u.clock;
  Membership& membership = *u.membership;
  RecoveryCoordinator& tasks = *u.coordinator;
  auto a = membership.Register(Request("a"));
  auto s1 = membership.Register(Request("s1", SPARE));
  auto s2 = membership.Register(Request("s2", SPARE));
  auto s3 = membership.Register(Request("s3", SPARE));
  membership.RecordProgress(a->slot(), 16, 1000);
  REQUIRE(membership.Heartbeat(Beat(a->incarnation(), 20)).ok());
  clock.Advance(absl::Milliseconds(600));
  for (const auto& s : {s1, s2, s3}) REQUIRE(membership.Heartbeat(Beat(s->incarnation())).ok());

  // s3's poll ended 700 ms before the failure (it did not come back: busy, or gone); s2's 100 ms
  // before it.
  auto s3_poll = tasks.ClaimReplay(s3->incarnation(), absl::ZeroDuration());
  REQUIRE(s3_poll.ok());
  CHECK_FALSE(s3_poll->has_value());
  clock.Advance(absl::Milliseconds(600));
  auto s2_poll = tasks.ClaimReplay(s2->incarnation(), absl::ZeroDuration());
  REQUIRE(s2_poll.ok());
  CHECK_FALSE(s2_poll->has_value());
  CHECK_FALSE(StatusOf(u, s2->incarnation()).waiting_for_task());
  clock.Advance(absl::Milliseconds(100));
  Poll p1(&tasks, s1->incarnation());
  WaitUntilPolling(u, {s1->incarnation()});
  REQUIRE(membership.DetectFailures().size() == 1);  // a; its slot is LOST
  std::optional<ReplayClaim> led = p1.Wait();
  REQUIRE(led.has_value());
  CHECK(led->rank == 0);
  REQUIRE(led->spares.size() == 2);
  CHECK(led->spares[0].incarnation == s1->incarnation());
  CHECK(led->spares[1].incarnation == s2->incarnation());
  CHECK(StatusOf(u, s3->incarnation()).replay_task() == 0);
  // s2 polls again and gets its part once the leader published the range.
  tasks.PublishReplay(led->task_id, 16, 19);
  auto helped = tasks.ClaimReplay(s2->incarnation(), absl::Seconds(5));
  REQUIRE(helped.ok());
  REQUIRE(helped->has_value());
  CHECK((*helped)->task_id == led->task_id);
  CHECK((*helped)->rank == 1);
  CHECK((*helped)->failed_step == 19);
}

TEST_CASE("a helper that dies mid-replay ends the task; the slot goes to a new task") {
  Units u(JobWithPolicy("REPLAY", 2));
  FakeClock& clock = u.clock;
  Membership& membership = *u.membership;
  RecoveryCoordinator& tasks = *u.coordinator;
  auto a = membership.Register(Request("a"));
  auto s1 = membership.Register(Request("s1", SPARE));
  auto s2 = membership.Register(Request("s2", SPARE));
  clock.Advance(absl::Milliseconds(600));
  REQUIRE(membership.Heartbeat(Beat(s1->incarnation())).ok());
  REQUIRE(membership.Heartbeat(Beat(s2->incarnation())).ok());
  clock.Advance(absl::Milliseconds(500));
  uint64_t task = 0;
  uint64_t leader = 0;
  uint64_t helper = 0;
  {
    Poll p1(&tasks, s1->incarnation());
    Poll p2(&tasks, s2->incarnation());
    WaitUntilPolling(u, {s1->incarnation(), s2->incarnation()});
    REQUIRE(membership.DetectFailures().size() == 1);  // a
    const absl::Time limit = absl::Now() + absl::Seconds(20);
    while (!p1.done() && !p2.done() && absl::Now() < limit) absl::SleepFor(absl::Milliseconds(1));
    REQUIRE((p1.done() || p2.done()));
    // Decided once, before the publication lets the helper's poll end too.
    const bool s1_leads = p1.done();
    leader = s1_leads ? s1->incarnation() : s2->incarnation();
    helper = s1_leads ? s2->incarnation() : s1->incarnation();
    std::optional<ReplayClaim> led = (s1_leads ? p1 : p2).Wait();
    REQUIRE(led.has_value());
    REQUIRE(led->spares.size() == 2);
    task = led->task_id;
    tasks.PublishReplay(task, 0, 5);
    std::optional<ReplayClaim> helped = (s1_leads ? p2 : p1).Wait();
    REQUIRE(helped.has_value());
    CHECK(helped->rank == 1);
  }
  // The helper goes silent; the leader keeps beating.
  clock.Advance(absl::Milliseconds(600));
  REQUIRE(membership.Heartbeat(Beat(leader)).ok());
  clock.Advance(absl::Milliseconds(500));
  REQUIRE(membership.DetectFailures().size() == 1);  // the helper
  CHECK(membership.CheckAlive(helper).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(membership.Recoveries()[0].outcome() == SPARE_FAILED);
  // The leader's report is refused: the task is over.
  ReportRecoveryRequest report;
  report.set_task_id(task);
  report.set_outcome(RECOVERED);
  CHECK(tasks.FinishReplay(leader, report, {}).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  // The leader claims the slot again, alone now.
  auto again = tasks.ClaimReplay(leader, absl::ZeroDuration());
  REQUIRE(again->has_value());
  CHECK((*again)->task_id != task);
  CHECK((*again)->spares.size() == 1);
}

TEST_CASE("a spare that dies mid-replay releases the task to another spare") {
  Units u(JobWithPolicy("REPLAY"));
  FakeClock& clock = u.clock;
  Membership& membership = *u.membership;
  RecoveryCoordinator& tasks = *u.coordinator;
  auto a = membership.Register(Request("a"));
  auto s1 = membership.Register(Request("s1", SPARE));
  auto s2 = membership.Register(Request("s2", SPARE));
  clock.Advance(absl::Milliseconds(600));
  REQUIRE(membership.Heartbeat(Beat(s1->incarnation())).ok());
  REQUIRE(membership.Heartbeat(Beat(s2->incarnation())).ok());
  clock.Advance(absl::Milliseconds(500));
  REQUIRE(membership.DetectFailures().size() == 1);  // a
  auto claim = tasks.ClaimReplay(s1->incarnation(), absl::ZeroDuration());
  REQUIRE(claim->has_value());
  // s1 goes silent; s2 keeps beating.
  clock.Advance(absl::Milliseconds(600));
  REQUIRE(membership.Heartbeat(Beat(s2->incarnation())).ok());
  clock.Advance(absl::Milliseconds(500));
  REQUIRE(membership.DetectFailures().size() == 1);  // s1
  GetStatusResponse status;
  membership.FillStatus(&status);
  CHECK(status.slots(0).state() == LOST);
  CHECK(membership.Recoveries()[0].outcome() == SPARE_FAILED);
  auto again = tasks.ClaimReplay(s2->incarnation(), absl::ZeroDuration());
  REQUIRE(again->has_value());
  CHECK((*again)->task_id != (*claim)->task_id);
}

// The decision to fall back is the recovery policy's (RecoveryPolicy::EndOf, tested above);
// Membership carries it out.
TEST_CASE("a replay that fails its checksum falls back to RESTART_FROM_CENTER, loudly") {
  Units u(JobWithPolicy("REPLAY"));
  FakeClock& clock = u.clock;
  Membership& membership = *u.membership;
  RecoveryCoordinator& tasks = *u.coordinator;
  auto a = membership.Register(Request("a"));
  auto s1 = membership.Register(Request("s1", SPARE));
  clock.Advance(absl::Milliseconds(1001));
  REQUIRE(membership.Heartbeat(Beat(s1->incarnation())).ok());
  REQUIRE(membership.DetectFailures().size() == 1);
  auto claim = tasks.ClaimReplay(s1->incarnation(), absl::ZeroDuration());
  REQUIRE(claim->has_value());
  ReportRecoveryRequest report;
  report.set_task_id((*claim)->task_id);
  report.set_outcome(CHECKSUM_MISMATCH);
  report.set_detail("step 5: checksum 0x1 != logged 0x2");
  Membership::ReplayEnd end;
  end.outcome = CHECKSUM_MISMATCH;
  end.why = "DATA_LOSS: step 5: checksum 0x1 != logged 0x2; falling back to RESTART_FROM_CENTER";
  end.fallback_restart = true;
  auto finished = tasks.FinishReplay(s1->incarnation(), report, end);
  REQUIRE(finished.ok());
  CHECK_FALSE(finished->has_value());
  CHECK(membership.Recoveries()[0].outcome() == CHECKSUM_MISMATCH);
  // No second replay of that slot; the spare's next heartbeat restarts it from the center.
  CHECK_FALSE(tasks.ClaimReplay(s1->incarnation(), absl::ZeroDuration())->has_value());
  auto beat = membership.Heartbeat(Beat(s1->incarnation()));
  REQUIRE(beat->has_takeover());
  const auto recoveries = membership.Recoveries();
  REQUIRE(recoveries.size() == 2);
  CHECK(recoveries[1].policy() == RESTART_FROM_CENTER);
  CHECK(absl::StrContains(recoveries[1].detail(), "FALLBACK"));
}

TEST_CASE("a single-stage job never asks for FLUSH_LOG and replays a lost slot at once") {
  Units u(JobWithPolicy("REPLAY"));
  FakeClock& clock = u.clock;
  Membership& membership = *u.membership;
  RecoveryCoordinator& tasks = *u.coordinator;
  auto a = membership.Register(Request("a"));
  auto b = membership.Register(Request("b"));
  auto spare = membership.Register(Request("s", SPARE));
  REQUIRE(spare->role() == SPARE);
  FailOne(clock, membership, {a->incarnation(), b->incarnation()}, a->incarnation(),
          {spare->incarnation()});
  HeartbeatResponse beat = BeatOk(membership, Beat(b->incarnation()));
  CHECK_FALSE(HasCommand(beat, FLUSH_LOG));
  CHECK_FALSE(beat.has_flush_sequence());
  auto claim = tasks.ClaimReplay(spare->incarnation(), absl::ZeroDuration());
  REQUIRE(claim.ok());
  REQUIRE(claim->has_value());
  CHECK((*claim)->slot.replica() == 0);
}

TEST_CASE("a lost pipeline stage is not handed out for replay before both neighbours flushed") {
  Units u(PipelineJob(1));
  FakeClock& clock = u.clock;
  Membership& membership = *u.membership;
  RecoveryCoordinator& tasks = *u.coordinator;
  const std::vector<uint64_t> t = RegisterTrainers(membership, 3);
  auto spare = membership.Register(Request("s", SPARE));
  REQUIRE(spare->role() == SPARE);
  FailOne(clock, membership, t, t[1], {spare->incarnation()});

  auto claim = tasks.ClaimReplay(spare->incarnation(), absl::Milliseconds(20));
  REQUIRE(claim.ok());
  CHECK_FALSE(claim->has_value());
  GetStatusResponse status;
  membership.FillStatus(&status);
  CHECK(status.slots(1).state() == LOST);

  FlushWhenAsked(membership, t[0]);
  claim = tasks.ClaimReplay(spare->incarnation(), absl::Milliseconds(20));
  REQUIRE(claim.ok());
  CHECK_FALSE(claim->has_value());  // stage 2 has not flushed

  FlushWhenAsked(membership, t[2]);
  claim = tasks.ClaimReplay(spare->incarnation(), absl::ZeroDuration());
  REQUIRE(claim.ok());
  REQUIRE(claim->has_value());
  CHECK((*claim)->slot.replica() == 0);
  CHECK((*claim)->slot.stage() == 1);
  CHECK((*claim)->rank == 0);
  status.Clear();
  membership.FillStatus(&status);
  CHECK(status.slots(1).state() == RECOVERING);
}

TEST_CASE("a spare waiting in ClaimReplay gets the lost stage as soon as its neighbours flushed") {
  Units u(PipelineJob(1));
  FakeClock& clock = u.clock;
  Membership& membership = *u.membership;
  RecoveryCoordinator& tasks = *u.coordinator;
  const std::vector<uint64_t> t = RegisterTrainers(membership, 3);
  auto spare = membership.Register(Request("s", SPARE));
  FailOne(clock, membership, t, t[1], {spare->incarnation()});

  Poll poll(&tasks, spare->incarnation());
  WaitUntilPolling(u, {spare->incarnation()});
  FlushWhenAsked(membership, t[2]);
  absl::SleepFor(absl::Milliseconds(20));
  CHECK_FALSE(poll.done());  // stage 0 has not flushed
  FlushWhenAsked(membership, t[0]);
  std::optional<ReplayClaim> claim = poll.Wait();
  REQUIRE(claim.has_value());
  CHECK(claim->slot.stage() == 1);
}

TEST_CASE(
    "a lost pipeline stage is handed out after failure_timeout even if a neighbour never "
    "flushes") {
  Units u(PipelineJob(1));
  FakeClock& clock = u.clock;
  Membership& membership = *u.membership;
  RecoveryCoordinator& tasks = *u.coordinator;
  const std::vector<uint64_t> t = RegisterTrainers(membership, 3);
  auto spare = membership.Register(Request("s", SPARE));
  FailOne(clock, membership, t, t[1], {spare->incarnation()});  // lost now, at T
  FlushWhenAsked(membership, t[0]);

  SECTION("the silent neighbour keeps heartbeating") {
    clock.Advance(absl::Milliseconds(999));
    CHECK(HasCommand(BeatOk(membership, Beat(t[2])), FLUSH_LOG));
    BeatOk(membership, Beat(t[0]));
    BeatOk(membership, Beat(spare->incarnation()));
    auto claim = tasks.ClaimReplay(spare->incarnation(), absl::ZeroDuration());
    REQUIRE(claim.ok());
    CHECK_FALSE(claim->has_value());  // T + 999 ms
    clock.Advance(absl::Milliseconds(1));
    claim = tasks.ClaimReplay(spare->incarnation(), absl::ZeroDuration());  // T + 1000 ms
    REQUIRE(claim.ok());
    REQUIRE(claim->has_value());
    CHECK(claim->value().slot.stage() == 1);
  }
  SECTION("a neighbour that leaves is not waited for") {
    REQUIRE(membership.Deregister(t[2]).ok());
    auto claim = tasks.ClaimReplay(spare->incarnation(), absl::ZeroDuration());
    REQUIRE(claim.ok());
    REQUIRE(claim->has_value());
    CHECK(claim->value().slot.stage() == 1);
  }
}

// The coordinator's tasks and Membership's RECOVERING slots change under two locks (Membership's,
// then the coordinator's, when Membership tells it of a start, an end or a fence): under
// concurrent claims, publications, reports and fences no task may outlive its slot's recovery
// and no slot may stay RECOVERING without a task.
TEST_CASE("concurrent claims, reports and fences leave no task and no RECOVERING slot behind") {
  Units u(JobWithPolicy("REPLAY", 2));
  auto a = u.membership->Register(Request("a", TRAINER));
  auto b = u.membership->Register(Request("b", TRAINER));
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(u.membership->Deregister(a->incarnation()).ok());
  REQUIRE(u.membership->Deregister(b->incarnation()).ok());
  std::atomic<bool> stop{false};
  std::atomic<int> led{0};
  std::atomic<int> helped{0};
  std::atomic<int> errors{0};
  // Each spare leads tasks and ends them ABANDONED (the slot is LOST again); one that helps
  // leaves at once (its task ends SPARE_FAILED) and registers again.
  auto spare = [&](int id) {
    auto registered = u.membership->Register(Request(absl::StrCat("s", id), SPARE));
    if (!registered.ok()) {
      errors.fetch_add(1);
      return;
    }
    uint64_t incarnation = registered->incarnation();
    while (!stop.load()) {
      auto claim = u.coordinator->ClaimReplay(incarnation, absl::Milliseconds(5));
      if (!claim.ok()) {
        errors.fetch_add(1);
        return;
      }
      if (!claim->has_value()) continue;
      if ((*claim)->rank > 0) {
        helped.fetch_add(1);
        if (!u.membership->Deregister(incarnation).ok()) errors.fetch_add(1);
        registered = u.membership->Register(Request(absl::StrCat("s", id), SPARE));
        if (!registered.ok()) {
          errors.fetch_add(1);
          return;
        }
        incarnation = registered->incarnation();
        continue;
      }
      led.fetch_add(1);
      u.coordinator->PublishReplay((*claim)->task_id, 0, 0);
      ReportRecoveryRequest report;
      report.set_task_id((*claim)->task_id);
      report.set_outcome(ABANDONED);
      auto finished = u.coordinator->FinishReplay(incarnation, report, {});
      // Refused only when a helper's fence ended the task first.
      if (!finished.ok() && finished.status().code() != absl::StatusCode::kFailedPrecondition) {
        errors.fetch_add(1);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) threads.emplace_back(spare, i);
  absl::SleepFor(absl::Milliseconds(300));
  stop.store(true);
  for (std::thread& t : threads) t.join();
  CHECK(errors.load() == 0);
  CHECK(led.load() > 0);
  GetStatusResponse status;
  u.membership->FillStatus(&status);
  u.coordinator->FillStatus(&status);
  CHECK(status.slots(0).state() == LOST);
  CHECK(status.slots(1).state() == LOST);
  uint64_t last_spare = 0;
  for (const WorkerStatus& worker : status.workers()) {
    if (worker.role() != SPARE || worker.state() != ALIVE) continue;
    CHECK(worker.replay_task() == 0);
    CHECK_FALSE(worker.waiting_for_task());
    last_spare = worker.incarnation();
  }
  // No spare is left leading a task: each may claim again, unless every slot fell back to the
  // center after max_replay_attempts failed replays (then a heartbeat restarts it).
  bool replayable = false;
  for (const SlotStatus& slot : status.slots()) {
    replayable = replayable || !absl::StrContains(slot.detail(), "FALLBACK");
  }
  REQUIRE(last_spare != 0);
  auto again = u.coordinator->ClaimReplay(last_spare, absl::ZeroDuration());
  REQUIRE(again.ok());
  CHECK(again->has_value() == replayable);
}

}  // namespace claims

}  // namespace
}  // namespace rebound::server
