#include <catch2/catch.hpp>

#include <atomic>

#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

#include "common/clock.h"
#include "common/config.h"
#include "server/membership.h"

namespace rebound::server {
namespace {

JobConfig TwoByOneJob() {
  auto job = ParseJobConfig(
      "job_id: \"j\"\n"
      "model { layers { width: 8 } layers { width: 4 activation: IDENTITY } }\n"
      "topology { replicas: 2 stages: 1 }\n"
      "fault_tolerance { heartbeat_interval_ms: 100 failure_timeout_ms: 1000 }\n",
      "job.pbtxt");
  REQUIRE(job.ok());
  return *job;
}

RegisterRequest Request(const std::string& name, WorkerRole role = ROLE_UNSPECIFIED) {
  RegisterRequest request;
  request.set_job_id("j");
  request.set_worker_name(name);
  request.set_requested_role(role);
  request.set_peer_address("127.0.0.1:1");
  return request;
}

HeartbeatRequest Beat(uint64_t incarnation, int64_t step = 0) {
  HeartbeatRequest request;
  request.set_incarnation(incarnation);
  request.set_step(step);
  return request;
}

TEST_CASE("trainers fill the slots in order, then workers become spares") {
  FakeClock clock;
  Membership membership(TwoByOneJob(), &clock);
  auto a = membership.Register(Request("a"));
  auto b = membership.Register(Request("b"));
  auto c = membership.Register(Request("c"));
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(c.ok());
  CHECK(a->role() == TRAINER);
  CHECK(a->slot().replica() == 0);
  CHECK(b->role() == TRAINER);
  CHECK(b->slot().replica() == 1);
  CHECK(c->role() == SPARE);
  CHECK_FALSE(c->has_slot());
  CHECK(a->job().job_id() == "j");
  // Incarnations are unique and increasing.
  CHECK(a->incarnation() < b->incarnation());
  CHECK(b->incarnation() < c->incarnation());
}

TEST_CASE("a worker that insists on training is refused when every slot is owned") {
  FakeClock clock;
  Membership membership(TwoByOneJob(), &clock);
  REQUIRE(membership.Register(Request("a")).ok());
  REQUIRE(membership.Register(Request("b")).ok());
  auto c = membership.Register(Request("c", TRAINER));
  CHECK(c.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(c.status().message() == "all 2 trainer slots are owned; register as a spare instead");
}

TEST_CASE("a worker of another job is refused") {
  FakeClock clock;
  Membership membership(TwoByOneJob(), &clock);
  RegisterRequest request = Request("a");
  request.set_job_id("other");
  auto a = membership.Register(request);
  CHECK(a.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(a.status().message() == "this server runs job \"j\", not \"other\"");
  request.set_worker_name("");
  request.set_job_id("j");
  CHECK(membership.Register(request).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("a worker is declared failed only after failure_timeout of silence") {
  FakeClock clock;
  Membership membership(TwoByOneJob(), &clock);
  auto a = membership.Register(Request("a"));
  auto b = membership.Register(Request("b"));
  REQUIRE(a.ok());
  REQUIRE(b.ok());

  clock.Advance(absl::Milliseconds(900));
  REQUIRE(membership.Heartbeat(Beat(b->incarnation(), 7)).ok());
  clock.Advance(absl::Milliseconds(100));  // a has been silent exactly 1000 ms: still alive
  CHECK(membership.DetectFailures().empty());

  clock.Advance(absl::Milliseconds(1));
  auto failed = membership.DetectFailures();
  REQUIRE(failed.size() == 1);
  CHECK(failed[0].incarnation == a->incarnation());
  CHECK(failed[0].had_slot);
  CHECK(failed[0].slot.replica() == 0);
  CHECK(absl::ToInt64Milliseconds(failed[0].silent_for) == 1001);
  CHECK(membership.CountInState(FAILED) == 1);
  CHECK(membership.CountInState(ALIVE) == 1);

  GetStatusResponse status;
  membership.FillStatus(&status);
  REQUIRE(status.slots_size() == 2);
  CHECK(status.slots(0).state() == LOST);
  CHECK(status.slots(0).owner_incarnation() == 0);
  CHECK(status.slots(1).state() == ACTIVE);
  CHECK(status.slots(1).step() == 7);
  REQUIRE(status.workers_size() == 2);
  CHECK(status.workers(0).state() == FAILED);
  CHECK(status.workers(0).silent_ms_at_failure() == 1001);
  CHECK(status.workers(0).state_reason() == "no heartbeat for 1001 ms (failure_timeout 1000 ms)");
}

TEST_CASE("time the server itself did not run is not a worker's silence") {
  FakeClock clock;
  Membership membership(TwoByOneJob(), &clock);
  auto a = membership.Register(Request("a"));
  auto b = membership.Register(Request("b"));
  REQUIRE(a.ok());
  REQUIRE(b.ok());

  clock.Advance(absl::Milliseconds(600));
  REQUIRE(membership.Heartbeat(Beat(b->incarnation())).ok());
  clock.Advance(absl::Milliseconds(5000));  // the server was stopped for 5 s
  membership.ExcuseServerPause(absl::Milliseconds(5000));
  CHECK(membership.DetectFailures().empty());

  // What is left counts: a's silence is 600 ms before the pause, then the time since.
  clock.Advance(absl::Milliseconds(400));
  CHECK(membership.DetectFailures().empty());  // a: exactly 1000 ms
  clock.Advance(absl::Milliseconds(1));
  auto failed = membership.DetectFailures();
  REQUIRE(failed.size() == 1);
  CHECK(failed[0].incarnation == a->incarnation());
  CHECK(absl::ToInt64Milliseconds(failed[0].silent_for) == 1001);

  // An excuse never moves a heartbeat into the future: b beat 5401 ms ago and the excuse is 6 s.
  membership.ExcuseServerPause(absl::Seconds(6));
  clock.Advance(absl::Milliseconds(1001));
  failed = membership.DetectFailures();
  REQUIRE(failed.size() == 1);
  CHECK(failed[0].incarnation == b->incarnation());
}

TEST_CASE("a fenced incarnation's heartbeat gets FAILED_PRECONDITION, for good") {
  FakeClock clock;
  Membership membership(TwoByOneJob(), &clock);
  auto a = membership.Register(Request("a"));
  REQUIRE(a.ok());
  clock.Advance(absl::Seconds(2));
  REQUIRE(membership.DetectFailures().size() == 1);

  auto beat = membership.Heartbeat(Beat(a->incarnation()));
  CHECK(beat.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(beat.status().message()) ==
        "incarnation " + std::to_string(a->incarnation()) +
            " (worker a) is fenced: FAILED: no heartbeat for 2000 ms (failure_timeout 1000 ms); "
            "register again");
  // Heartbeating again does not revive it.
  CHECK(membership.CheckAlive(a->incarnation()).code() == absl::StatusCode::kFailedPrecondition);

  // The same worker may come back, under a new incarnation. Its lost slot waits for recovery
  // (it is not handed to a fresh registration), so it gets the next unassigned slot.
  auto again = membership.Register(Request("a"));
  REQUIRE(again.ok());
  CHECK(again->role() == TRAINER);
  CHECK(again->slot().replica() == 1);
  CHECK(again->incarnation() != a->incarnation());
  GetStatusResponse status;
  membership.FillStatus(&status);
  CHECK(status.slots(0).state() == LOST);
}

TEST_CASE("an incarnation this server never issued gets ABORTED: register again") {
  FakeClock clock;
  Membership membership(TwoByOneJob(), &clock);
  auto beat = membership.Heartbeat(Beat(12345));
  CHECK(beat.status().code() == absl::StatusCode::kAborted);
}

TEST_CASE("deregistering fences the incarnation and frees its slot as LOST") {
  FakeClock clock;
  Membership membership(TwoByOneJob(), &clock);
  auto a = membership.Register(Request("a"));
  REQUIRE(a.ok());
  CHECK(membership.Deregister(a->incarnation()).ok());
  CHECK(membership.CheckAlive(a->incarnation()).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(membership.Deregister(a->incarnation()).code() == absl::StatusCode::kFailedPrecondition);
  GetStatusResponse status;
  membership.FillStatus(&status);
  CHECK(status.slots(0).state() == LOST);
  CHECK(status.workers(0).state() == DEPARTED);
}

TEST_CASE("records of fenced workers are bounded and pruned ones stay fenced") {
  FakeClock clock;
  Membership membership(TwoByOneJob(), &clock);
  uint64_t first = 0;
  for (size_t i = 0; i < Membership::kMaxFencedRecords + 10; ++i) {
    auto w = membership.Register(Request("w", SPARE));
    REQUIRE(w.ok());
    if (i == 0) first = w->incarnation();
    REQUIRE(membership.Deregister(w->incarnation()).ok());
  }
  GetStatusResponse status;
  membership.FillStatus(&status);
  CHECK(status.workers_size() == static_cast<int>(Membership::kMaxFencedRecords));
  CHECK(membership.CheckAlive(first).code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("a negative step in a heartbeat is INVALID_ARGUMENT") {
  FakeClock clock;
  Membership membership(TwoByOneJob(), &clock);
  auto a = membership.Register(Request("a"));
  REQUIRE(a.ok());
  CHECK(membership.Heartbeat(Beat(a->incarnation(), -1)).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("a heartbeat step beyond max_steps is INVALID_ARGUMENT and leaves the slot's step") {
  FakeClock clock;
  Membership membership(TwoByOneJob(), &clock);  // max_steps: the default 1000
  auto a = membership.Register(Request("a"));
  REQUIRE(a.ok());
  REQUIRE(membership.Heartbeat(Beat(a->incarnation(), 1000)).ok());
  const auto beyond = membership.Heartbeat(Beat(a->incarnation(), 1001));
  CHECK(beyond.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(beyond.status().message() == "step must be <= training.max_steps = 1000, got 1001");
  GetStatusResponse status;
  membership.FillStatus(&status);
  CHECK(status.slots(0).step() == 1000);
}

}  // namespace
}  // namespace rebound::server

namespace rebound::server {
namespace {

JobConfig JobWithPolicy(const char* policy, int recovery_parallelism = 1) {
  auto job = ParseJobConfig(
      absl::StrCat("job_id: \"j\"\n"
                   "model { layers { width: 8 } layers { width: 4 activation: IDENTITY } }\n"
                   "topology { replicas: 2 stages: 1 }\n"
                   "fault_tolerance { policy: ",
                   policy, " heartbeat_interval_ms: 100 failure_timeout_ms: 1000 ",
                   "recovery_parallelism: ", recovery_parallelism, " }\n"),
      "job.pbtxt");
  REQUIRE(job.ok());
  return *job;
}

TEST_CASE("RESTART_FROM_CENTER hands a lost slot to a spare under a new incarnation") {
  FakeClock clock;
  Membership membership(JobWithPolicy("RESTART_FROM_CENTER"), &clock);
  auto a = membership.Register(Request("a"));
  auto b = membership.Register(Request("b"));
  auto spare = membership.Register(Request("s"));
  REQUIRE(spare->role() == SPARE);
  membership.RecordProgress(a->slot(), 16, 1000);  // a's last sync

  clock.Advance(absl::Milliseconds(900));
  REQUIRE(membership.Heartbeat(Beat(b->incarnation(), 20)).ok());
  auto before = membership.Heartbeat(Beat(spare->incarnation()));
  REQUIRE(before.ok());
  CHECK_FALSE(before->has_takeover());  // nothing lost yet

  clock.Advance(absl::Milliseconds(200));
  REQUIRE(membership.DetectFailures().size() == 1);  // a
  auto beat = membership.Heartbeat(Beat(spare->incarnation()));
  REQUIRE(beat.ok());
  REQUIRE(beat->has_takeover());
  const RegisterResponse& takeover = beat->takeover();
  CHECK(takeover.role() == TRAINER);
  CHECK(takeover.slot().replica() == 0);
  CHECK(takeover.start_step() == 16);
  CHECK(takeover.incarnation() > spare->incarnation());

  // The spare's old incarnation is fenced; the new one owns the slot.
  CHECK(membership.CheckAlive(spare->incarnation()).code() ==
        absl::StatusCode::kFailedPrecondition);
  CHECK(membership.CheckOwner(takeover.incarnation(), takeover.slot()).ok());
  GetStatusResponse status;
  membership.FillStatus(&status);
  CHECK(status.slots(0).state() == ACTIVE);
  CHECK(status.slots(0).owner_incarnation() == takeover.incarnation());
  const auto recoveries = membership.Recoveries();
  REQUIRE(recoveries.size() == 1);
  CHECK(recoveries[0].policy() == RESTART_FROM_CENTER);
  CHECK(recoveries[0].outcome() == RECOVERED);
  CHECK(recoveries[0].slot().replica() == 0);
}

TEST_CASE("under GLOBAL_CHECKPOINT no spare restores a slot until the rollback is finished") {
  // The server restores the center and the slots' bookkeeping between RollBackAll and
  // FinishRollback; a spare handed a slot before then synced against the state of before the
  // rollback (its first sync was refused as stale, and the spare exited).
  FakeClock clock;
  Membership membership(JobWithPolicy("GLOBAL_CHECKPOINT checkpoint_every_steps: 16"), &clock);
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
  auto early = membership.ClaimReplay(spare->incarnation(), absl::Milliseconds(20));
  REQUIRE(early.ok());
  CHECK_FALSE(early->has_value());
  // A spare already waiting is woken by FinishRollback. `waited` is written by the waiter and
  // read here only after join(); `returned` and `finish_called` tell, without a data race,
  // whether the claim returned and whether FinishRollback had been called by then.
  std::optional<absl::StatusOr<std::optional<Membership::ReplayClaim>>> waited;
  absl::Notification returned;
  std::atomic<bool> finish_called{false};
  std::atomic<bool> returned_after_finish{false};
  std::thread waiter([&] {
    waited = membership.ClaimReplay(spare->incarnation(), absl::Seconds(20));
    returned_after_finish.store(finish_called.load());
    returned.Notify();
  });
  // The spare is parked in ClaimReplay once status shows it waiting for a task.
  auto spare_waiting = [&] {
    GetStatusResponse now;
    membership.FillStatus(&now);
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

  // Slot 0's restore is a recovery that counts against it (its trainer failed), once; slot 1's
  // does not (it was only rolled back with the others).
  CHECK_FALSE(membership.TakeRecoveryCharge(a->slot()));  // not restored yet
  ReportRecoveryRequest report;
  report.set_incarnation(spare->incarnation());
  report.set_task_id((**waited)->task_id);
  report.set_outcome(RECOVERED);
  auto restored = membership.FinishReplay(spare->incarnation(), report, {});
  REQUIRE(restored.ok());
  REQUIRE(restored->has_value());
  CHECK((*restored)->slot().replica() == 0);
  CHECK(membership.TakeRecoveryCharge(a->slot()));
  CHECK_FALSE(membership.TakeRecoveryCharge(a->slot()));
  auto b2 = membership.Register(Request("b2", SPARE));
  REQUIRE(b2.ok());
  auto claim = membership.ClaimReplay(b2->incarnation(), absl::ZeroDuration());
  REQUIRE(claim.ok());
  REQUIRE(claim->has_value());
  CHECK((*claim)->slot.replica() == 1);
  report.set_incarnation(b2->incarnation());
  report.set_task_id((*claim)->task_id);
  restored = membership.FinishReplay(b2->incarnation(), report, {});
  REQUIRE(restored.ok());
  REQUIRE(restored->has_value());
  CHECK_FALSE(membership.TakeRecoveryCharge(b->slot()));
}

TEST_CASE("under REPLAY a lost slot waits for a spare to claim its replay") {
  FakeClock clock;
  Membership membership(JobWithPolicy("REPLAY"), &clock);
  auto a = membership.Register(Request("a"));
  auto spare = membership.Register(Request("s", SPARE));
  // Nothing to replay yet: the long poll ends empty.
  auto none = membership.ClaimReplay(spare->incarnation(), absl::ZeroDuration());
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

  auto claim = membership.ClaimReplay(spare->incarnation(), absl::ZeroDuration());
  REQUIRE(claim.ok());
  REQUIRE(claim->has_value());
  CHECK((*claim)->slot.replica() == 0);
  CHECK((*claim)->reached_step == 11);
  CHECK(membership.TaskSlot((*claim)->task_id, spare->incarnation()).ok());
  CHECK(membership.TaskSlot((*claim)->task_id, a->incarnation()).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  // One task per spare.
  CHECK(membership.ClaimReplay(spare->incarnation(), absl::ZeroDuration()).status().code() ==
        absl::StatusCode::kFailedPrecondition);

  ReportRecoveryRequest report;
  report.set_task_id((*claim)->task_id);
  report.set_outcome(RECOVERED);
  report.set_steps_replayed(3);
  report.set_verified(true);
  auto finished = membership.FinishReplay(spare->incarnation(), report, {});
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

// The status of the worker `incarnation`.
WorkerStatus StatusOf(const Membership& membership, uint64_t incarnation) {
  GetStatusResponse status;
  membership.FillStatus(&status);
  for (const WorkerStatus& w : status.workers()) {
    if (w.incarnation() == incarnation) return w;
  }
  FAIL("no worker " << incarnation);
  return {};
}

// ClaimReplay of one spare on its own thread, as a WaitForTask long poll does.
class Poll {
 public:
  Poll(Membership* membership, uint64_t incarnation)
      : incarnation_(incarnation), thread_([this, membership] {
          auto claim = membership->ClaimReplay(incarnation_, absl::Seconds(20));
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
  std::optional<Membership::ReplayClaim> Wait() {
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
  std::optional<Membership::ReplayClaim> claim_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// Waits until every one of `incarnations` waits in ClaimReplay, as status says.
void WaitUntilPolling(const Membership& membership, std::initializer_list<uint64_t> incarnations) {
  const absl::Time limit = absl::Now() + absl::Seconds(20);
  for (uint64_t incarnation : incarnations) {
    while (!StatusOf(membership, incarnation).waiting_for_task() && absl::Now() < limit) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    REQUIRE(StatusOf(membership, incarnation).waiting_for_task());
  }
}

TEST_CASE("with recovery_parallelism 2 one waiting spare leads a replay and another helps") {
  FakeClock clock;
  Membership membership(JobWithPolicy("REPLAY", 2), &clock);
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
  Poll p1(&membership, s1->incarnation());
  Poll p2(&membership, s2->incarnation());
  WaitUntilPolling(membership, {s1->incarnation(), s2->incarnation()});
  REQUIRE(membership.DetectFailures().size() == 1);  // a; its slot is LOST
  // Whichever wakes first leads; the other is its helper and waits for the published range.
  const absl::Time limit = absl::Now() + absl::Seconds(20);
  while (!p1.done() && !p2.done() && absl::Now() < limit) absl::SleepFor(absl::Milliseconds(1));
  REQUIRE((p1.done() || p2.done()));
  Poll& leader_poll = p1.done() ? p1 : p2;
  Poll& helper_poll = p1.done() ? p2 : p1;
  const uint64_t leader = p1.done() ? s1->incarnation() : s2->incarnation();
  const uint64_t helper = p1.done() ? s2->incarnation() : s1->incarnation();
  std::optional<Membership::ReplayClaim> led = leader_poll.Wait();
  REQUIRE(led.has_value());
  CHECK(led->rank == 0);
  CHECK(led->slot.replica() == 0);
  REQUIRE(led->spares.size() == 2);
  CHECK(led->spares[0].incarnation == leader);
  CHECK(led->spares[1].incarnation == helper);
  CHECK(led->spares[1].peer_address == "127.0.0.1:1");
  CHECK(StatusOf(membership, helper).replay_task() == led->task_id);
  CHECK(StatusOf(membership, s3->incarnation()).replay_task() == 0);
  // The helper gets the task only once the leader has published the range.
  absl::SleepFor(absl::Milliseconds(50));
  CHECK_FALSE(helper_poll.done());
  membership.PublishReplay(led->task_id, 16, 19);
  std::optional<Membership::ReplayClaim> helped = helper_poll.Wait();
  REQUIRE(helped.has_value());
  CHECK(helped->task_id == led->task_id);
  CHECK(helped->rank == 1);
  CHECK(helped->snapshot_step == 16);
  CHECK(helped->failed_step == 19);
  CHECK(membership.TaskSlot(led->task_id, helper).ok());
  CHECK(membership.TaskSlot(led->task_id, s3->incarnation()).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  // Only the leader reports.
  ReportRecoveryRequest report;
  report.set_task_id(led->task_id);
  report.set_outcome(RECOVERED);
  report.set_steps_replayed(3);
  report.set_verified(true);
  CHECK(membership.FinishReplay(helper, report, {}).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  auto finished = membership.FinishReplay(leader, report, {});
  REQUIRE(finished.ok());
  REQUIRE(finished->has_value());
  CHECK((*finished)->start_step() == 19);
  const auto recoveries = membership.Recoveries();
  REQUIRE(recoveries.size() == 1);
  REQUIRE(recoveries[0].spares_size() == 2);
  CHECK(recoveries[0].spares(1) == helper);
  // The helper is a free spare again.
  CHECK(membership.CheckAlive(helper).ok());
  CHECK(StatusOf(membership, helper).replay_task() == 0);
}

TEST_CASE("a helper that dies mid-replay ends the task; the slot goes to a new task") {
  FakeClock clock;
  Membership membership(JobWithPolicy("REPLAY", 2), &clock);
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
    Poll p1(&membership, s1->incarnation());
    Poll p2(&membership, s2->incarnation());
    WaitUntilPolling(membership, {s1->incarnation(), s2->incarnation()});
    REQUIRE(membership.DetectFailures().size() == 1);  // a
    const absl::Time limit = absl::Now() + absl::Seconds(20);
    while (!p1.done() && !p2.done() && absl::Now() < limit) absl::SleepFor(absl::Milliseconds(1));
    REQUIRE((p1.done() || p2.done()));
    // Decided once, before the publication lets the helper's poll end too.
    const bool s1_leads = p1.done();
    leader = s1_leads ? s1->incarnation() : s2->incarnation();
    helper = s1_leads ? s2->incarnation() : s1->incarnation();
    std::optional<Membership::ReplayClaim> led = (s1_leads ? p1 : p2).Wait();
    REQUIRE(led.has_value());
    REQUIRE(led->spares.size() == 2);
    task = led->task_id;
    membership.PublishReplay(task, 0, 5);
    std::optional<Membership::ReplayClaim> helped = (s1_leads ? p2 : p1).Wait();
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
  CHECK(membership.FinishReplay(leader, report, {}).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  // The leader claims the slot again, alone now.
  auto again = membership.ClaimReplay(leader, absl::ZeroDuration());
  REQUIRE(again->has_value());
  CHECK((*again)->task_id != task);
  CHECK((*again)->spares.size() == 1);
}

TEST_CASE("a spare that dies mid-replay releases the task to another spare") {
  FakeClock clock;
  Membership membership(JobWithPolicy("REPLAY"), &clock);
  auto a = membership.Register(Request("a"));
  auto s1 = membership.Register(Request("s1", SPARE));
  auto s2 = membership.Register(Request("s2", SPARE));
  clock.Advance(absl::Milliseconds(600));
  REQUIRE(membership.Heartbeat(Beat(s1->incarnation())).ok());
  REQUIRE(membership.Heartbeat(Beat(s2->incarnation())).ok());
  clock.Advance(absl::Milliseconds(500));
  REQUIRE(membership.DetectFailures().size() == 1);  // a
  auto claim = membership.ClaimReplay(s1->incarnation(), absl::ZeroDuration());
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
  auto again = membership.ClaimReplay(s2->incarnation(), absl::ZeroDuration());
  REQUIRE(again->has_value());
  CHECK((*again)->task_id != (*claim)->task_id);
}

// The decision to fall back is the recovery policy's (RecoveryPolicy::EndOf, tested in
// recovery_coordinator_test); Membership carries it out.
TEST_CASE("a replay that fails its checksum falls back to RESTART_FROM_CENTER, loudly") {
  FakeClock clock;
  Membership membership(JobWithPolicy("REPLAY"), &clock);
  auto a = membership.Register(Request("a"));
  auto s1 = membership.Register(Request("s1", SPARE));
  clock.Advance(absl::Milliseconds(1001));
  REQUIRE(membership.Heartbeat(Beat(s1->incarnation())).ok());
  REQUIRE(membership.DetectFailures().size() == 1);
  auto claim = membership.ClaimReplay(s1->incarnation(), absl::ZeroDuration());
  REQUIRE(claim->has_value());
  ReportRecoveryRequest report;
  report.set_task_id((*claim)->task_id);
  report.set_outcome(CHECKSUM_MISMATCH);
  report.set_detail("step 5: checksum 0x1 != logged 0x2");
  Membership::ReplayEnd end;
  end.outcome = CHECKSUM_MISMATCH;
  end.why = "DATA_LOSS: step 5: checksum 0x1 != logged 0x2; falling back to RESTART_FROM_CENTER";
  end.fallback_restart = true;
  auto finished = membership.FinishReplay(s1->incarnation(), report, end);
  REQUIRE(finished.ok());
  CHECK_FALSE(finished->has_value());
  CHECK(membership.Recoveries()[0].outcome() == CHECKSUM_MISMATCH);
  // No second replay of that slot; the spare's next heartbeat restarts it from the center.
  CHECK_FALSE(membership.ClaimReplay(s1->incarnation(), absl::ZeroDuration())->has_value());
  auto beat = membership.Heartbeat(Beat(s1->incarnation()));
  REQUIRE(beat->has_takeover());
  const auto recoveries = membership.Recoveries();
  REQUIRE(recoveries.size() == 2);
  CHECK(recoveries[1].policy() == RESTART_FROM_CENTER);
  CHECK(absl::StrContains(recoveries[1].detail(), "FALLBACK"));
}

TEST_CASE("a finished slot stays finished when its trainer leaves, and STOP follows") {
  FakeClock clock;
  Membership membership(JobWithPolicy("RESTART_FROM_CENTER"), &clock);
  auto a = membership.Register(Request("a"));
  auto b = membership.Register(Request("b"));
  CHECK(membership.RecordProgress(a->slot(), 1000, 1000));
  REQUIRE(membership.Deregister(a->incarnation()).ok());
  GetStatusResponse status;
  membership.FillStatus(&status);
  CHECK(status.slots(0).state() == FINISHED);
  auto beat = membership.Heartbeat(Beat(b->incarnation()));
  CHECK(beat->commands_size() == 0);
  CHECK(membership.RecordProgress(b->slot(), 1000, 1000));
  CHECK(membership.AllFinished());
  beat = membership.Heartbeat(Beat(b->incarnation()));
  REQUIRE(beat->commands_size() == 1);
  CHECK(beat->commands(0) == STOP);
}

}  // namespace
}  // namespace rebound::server

namespace rebound::server {
namespace {

TEST_CASE("after a restart the slots' owners go on and every other old incarnation registers "
          "again (ABORTED)") {
  FakeClock clock;
  ServerRecord server;
  std::vector<SlotRecord> slots;
  uint64_t trainer = 0;
  uint64_t spare = 0;
  {
    Membership first(TwoByOneJob(), &clock,
                     [&](const ServerRecord& s, const std::vector<SlotRecord>& records) {
                       server = s;
                       slots = records;
                       return absl::OkStatus();
                     });
    trainer = first.Register(Request("a"))->incarnation();
    REQUIRE(first.Register(Request("b")).ok());
    spare = first.Register(Request("s", SPARE))->incarnation();
  }
  Membership second(TwoByOneJob(), &clock);
  REQUIRE(second.Restore(server, slots, absl::Seconds(10)).ok());
  CHECK(second.CheckAlive(trainer).ok());
  const absl::Status old_spare = second.CheckAlive(spare);
  CHECK(old_spare.code() == absl::StatusCode::kAborted);
  CHECK(absl::StrContains(old_spare.message(), "is unknown to this server"));
  // A spare of this life that is then forgotten (deregistered and pruned) stays fenced.
  auto fresh = second.Register(Request("s2", SPARE));
  REQUIRE(fresh.ok());
  CHECK(fresh->incarnation() > spare);
  REQUIRE(second.Deregister(fresh->incarnation()).ok());
  CHECK(second.CheckAlive(fresh->incarnation()).code() == absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace rebound::server

namespace rebound::server {
namespace {

// Pipelines (S > 1) under REPLAY: a lost stage's neighbours flush their step logs first, and a
// trainer waiting on a neighbour shows as BLOCKED.

JobConfig PipelineJob(int replicas) {
  auto job =
      ParseJobConfig(absl::StrCat("job_id: \"j\"\n"
                                  "model { layers { width: 8 } layers { width: 6 } "
                                  "layers { width: 4 activation: IDENTITY } }\n"
                                  "topology { replicas: ",
                                  replicas,
                                  " stages: 3 }\n"
                                  "fault_tolerance { policy: REPLAY heartbeat_interval_ms: 100 "
                                  "failure_timeout_ms: 1000 }\n"),
                     "job.pbtxt");
  INFO(job.status().ToString());
  REQUIRE(job.ok());
  return *job;
}

// Registers a trainer on every slot, in slot order (index replica * 3 + stage).
std::vector<uint64_t> RegisterTrainers(Membership& membership, int slots) {
  std::vector<uint64_t> trainers;
  for (int i = 0; i < slots; ++i) {
    auto trainer = membership.Register(Request(absl::StrCat("t", i), TRAINER));
    REQUIRE(trainer.ok());
    REQUIRE(trainer->slot().replica() * 3 + trainer->slot().stage() == i);
    trainers.push_back(trainer->incarnation());
  }
  return trainers;
}

bool HasCommand(const HeartbeatResponse& response, Command command) {
  for (int c : response.commands()) {
    if (c == command) return true;
  }
  return false;
}

HeartbeatResponse BeatOk(Membership& membership, const HeartbeatRequest& request) {
  auto response = membership.Heartbeat(request);
  INFO(response.status().ToString());
  REQUIRE(response.ok());
  return *response;
}

HeartbeatRequest Flushed(uint64_t incarnation, int64_t flushes_done) {
  HeartbeatRequest request = Beat(incarnation);
  request.set_flushes_done(flushes_done);
  return request;
}

// Heartbeats as a trainer that carries out the FLUSH_LOG its heartbeat asks for (the sequence
// numbers are the server's: above any of an earlier server life, so not 1, 2, ...).
// Returns the sequence it reported.
int64_t FlushWhenAsked(Membership& membership, uint64_t incarnation) {
  const HeartbeatResponse beat = BeatOk(membership, Beat(incarnation));
  REQUIRE(HasCommand(beat, FLUSH_LOG));
  REQUIRE(beat.flush_sequence() > 0);
  BeatOk(membership, Flushed(incarnation, beat.flush_sequence()));
  return beat.flush_sequence();
}

HeartbeatRequest Blocked(uint64_t incarnation, const std::string& reason) {
  HeartbeatRequest request = Beat(incarnation);
  request.set_blocked_reason(reason);
  return request;
}

// `trainers` except `silent` heartbeat 900 ms in; 200 ms later `silent` is declared failed.
void FailOne(FakeClock& clock, Membership& membership, const std::vector<uint64_t>& trainers,
             uint64_t silent, std::vector<uint64_t> others_alive = {}) {
  clock.Advance(absl::Milliseconds(900));
  for (uint64_t t : trainers) {
    if (t != silent) BeatOk(membership, Beat(t));
  }
  for (uint64_t t : others_alive) BeatOk(membership, Beat(t));
  clock.Advance(absl::Milliseconds(200));
  const std::vector<FailedWorker> failed = membership.DetectFailures();
  REQUIRE(failed.size() == 1);
  REQUIRE(failed[0].incarnation == silent);
}

TEST_CASE(
    "when a pipeline stage fails, only its alive neighbours are asked to flush, until they "
    "report it") {
  FakeClock clock;
  Membership membership(PipelineJob(2), &clock);
  const std::vector<uint64_t> t = RegisterTrainers(membership, 6);
  // Nothing to flush before a loss.
  for (uint64_t trainer : t) {
    HeartbeatResponse beat = BeatOk(membership, Beat(trainer));
    CHECK_FALSE(HasCommand(beat, FLUSH_LOG));
    CHECK_FALSE(beat.has_flush_sequence());
  }

  FailOne(clock, membership, t, t[1]);  // slot (0, 1)
  GetStatusResponse status;
  membership.FillStatus(&status);
  CHECK(status.slots(1).state() == LOST);
  CHECK(absl::StrContains(status.slots(1).detail(),
                          "once its neighbours have flushed their step logs"));

  int64_t sequence = 0;
  for (uint64_t neighbour : {t[0], t[2]}) {
    HeartbeatResponse beat = BeatOk(membership, Beat(neighbour));
    CHECK(HasCommand(beat, FLUSH_LOG));
    CHECK(beat.flush_sequence() > 0);
    if (sequence == 0) sequence = beat.flush_sequence();
    CHECK(beat.flush_sequence() == sequence);  // one request per loss
    // Asked again on every heartbeat that does not report it, or reports less.
    beat = BeatOk(membership, Flushed(neighbour, sequence - 1));
    CHECK(HasCommand(beat, FLUSH_LOG));
    CHECK(beat.flush_sequence() == sequence);
  }
  // The other replica's stages are no neighbours of (0, 1).
  for (uint64_t other : {t[3], t[4], t[5]}) {
    HeartbeatResponse beat = BeatOk(membership, Beat(other));
    CHECK_FALSE(HasCommand(beat, FLUSH_LOG));
    CHECK_FALSE(beat.has_flush_sequence());
  }

  // The heartbeat that reports the flush carries no FLUSH_LOG, nor do later ones.
  HeartbeatResponse done = BeatOk(membership, Flushed(t[0], sequence));
  CHECK_FALSE(HasCommand(done, FLUSH_LOG));
  CHECK_FALSE(done.has_flush_sequence());
  CHECK_FALSE(HasCommand(BeatOk(membership, Beat(t[0])), FLUSH_LOG));
  CHECK(HasCommand(BeatOk(membership, Beat(t[2])), FLUSH_LOG));

  // A clean exit is a loss too: (1, 0) leaves, its one neighbour (1, 1) is asked; then (1, 2)
  // leaves and (1, 1) is asked again, under the next sequence number.
  REQUIRE(membership.Deregister(t[3]).ok());
  HeartbeatResponse first = BeatOk(membership, Beat(t[4]));
  CHECK(HasCommand(first, FLUSH_LOG));
  CHECK(first.flush_sequence() > sequence);
  CHECK_FALSE(HasCommand(BeatOk(membership, Beat(t[5])), FLUSH_LOG));
  REQUIRE(membership.Deregister(t[5]).ok());
  HeartbeatResponse second = BeatOk(membership, Flushed(t[4], first.flush_sequence()));
  CHECK(HasCommand(second, FLUSH_LOG));
  CHECK(second.flush_sequence() > first.flush_sequence());
  CHECK_FALSE(
      HasCommand(BeatOk(membership, Flushed(t[4], second.flush_sequence())), FLUSH_LOG));
  // Replica 0's stages were not involved.
  CHECK_FALSE(HasCommand(BeatOk(membership, Beat(t[0])), FLUSH_LOG));
}

TEST_CASE("after a server restart, a flush a neighbour did for the previous life does not count") {
  FakeClock clock;
  ServerRecord server;
  std::vector<SlotRecord> slots;
  std::vector<uint64_t> t;
  int64_t old_sequence = 0;
  {
    Membership first(PipelineJob(1), &clock,
                     [&](const ServerRecord& record, const std::vector<SlotRecord>& records) {
                       server = record;
                       slots = records;
                       return absl::OkStatus();
                     });
    t = RegisterTrainers(first, 3);
    FailOne(clock, first, t, t[2]);  // (0, 2) lost: (0, 1) flushes
    old_sequence = FlushWhenAsked(first, t[1]);
  }
  // The next life restores (0, 0) and (0, 1); t[1]'s agent still reports its last flush.
  clock.Advance(absl::Seconds(5));
  Membership second(PipelineJob(1), &clock);
  REQUIRE(second.Restore(server, slots, absl::ZeroDuration()).ok());
  CHECK_FALSE(HasCommand(BeatOk(second, Flushed(t[1], old_sequence)), FLUSH_LOG));
  // (0, 0) fails in this life: t[1] must flush again, whatever it reported before.
  clock.Advance(absl::Milliseconds(900));
  BeatOk(second, Flushed(t[1], old_sequence));
  clock.Advance(absl::Milliseconds(200));
  const std::vector<FailedWorker> failed = second.DetectFailures();
  REQUIRE(failed.size() == 1);
  CHECK(failed[0].incarnation == t[0]);
  const HeartbeatResponse asked = BeatOk(second, Flushed(t[1], old_sequence));
  CHECK(HasCommand(asked, FLUSH_LOG));
  CHECK(asked.flush_sequence() > old_sequence);
}

TEST_CASE("the first stage's loss asks only stage 1 to flush") {
  FakeClock clock;
  Membership membership(PipelineJob(1), &clock);
  const std::vector<uint64_t> t = RegisterTrainers(membership, 3);
  FailOne(clock, membership, t, t[0]);
  HeartbeatResponse beat = BeatOk(membership, Beat(t[1]));
  CHECK(HasCommand(beat, FLUSH_LOG));
  CHECK(beat.flush_sequence() > 0);
  CHECK_FALSE(HasCommand(BeatOk(membership, Beat(t[2])), FLUSH_LOG));
}

TEST_CASE("a single-stage job never asks for FLUSH_LOG and replays a lost slot at once") {
  FakeClock clock;
  Membership membership(JobWithPolicy("REPLAY"), &clock);
  auto a = membership.Register(Request("a"));
  auto b = membership.Register(Request("b"));
  auto spare = membership.Register(Request("s", SPARE));
  REQUIRE(spare->role() == SPARE);
  FailOne(clock, membership, {a->incarnation(), b->incarnation()}, a->incarnation(),
          {spare->incarnation()});
  HeartbeatResponse beat = BeatOk(membership, Beat(b->incarnation()));
  CHECK_FALSE(HasCommand(beat, FLUSH_LOG));
  CHECK_FALSE(beat.has_flush_sequence());
  auto claim = membership.ClaimReplay(spare->incarnation(), absl::ZeroDuration());
  REQUIRE(claim.ok());
  REQUIRE(claim->has_value());
  CHECK((*claim)->slot.replica() == 0);
}

TEST_CASE("a lost pipeline stage is not handed out for replay before both neighbours flushed") {
  FakeClock clock;
  Membership membership(PipelineJob(1), &clock);
  const std::vector<uint64_t> t = RegisterTrainers(membership, 3);
  auto spare = membership.Register(Request("s", SPARE));
  REQUIRE(spare->role() == SPARE);
  FailOne(clock, membership, t, t[1], {spare->incarnation()});

  auto claim = membership.ClaimReplay(spare->incarnation(), absl::Milliseconds(20));
  REQUIRE(claim.ok());
  CHECK_FALSE(claim->has_value());
  GetStatusResponse status;
  membership.FillStatus(&status);
  CHECK(status.slots(1).state() == LOST);

  FlushWhenAsked(membership, t[0]);
  claim = membership.ClaimReplay(spare->incarnation(), absl::Milliseconds(20));
  REQUIRE(claim.ok());
  CHECK_FALSE(claim->has_value());  // stage 2 has not flushed

  FlushWhenAsked(membership, t[2]);
  claim = membership.ClaimReplay(spare->incarnation(), absl::ZeroDuration());
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
  FakeClock clock;
  Membership membership(PipelineJob(1), &clock);
  const std::vector<uint64_t> t = RegisterTrainers(membership, 3);
  auto spare = membership.Register(Request("s", SPARE));
  FailOne(clock, membership, t, t[1], {spare->incarnation()});

  Poll poll(&membership, spare->incarnation());
  WaitUntilPolling(membership, {spare->incarnation()});
  FlushWhenAsked(membership, t[2]);
  absl::SleepFor(absl::Milliseconds(20));
  CHECK_FALSE(poll.done());  // stage 0 has not flushed
  FlushWhenAsked(membership, t[0]);
  std::optional<Membership::ReplayClaim> claim = poll.Wait();
  REQUIRE(claim.has_value());
  CHECK(claim->slot.stage() == 1);
}

TEST_CASE(
    "a lost pipeline stage is handed out after failure_timeout even if a neighbour never "
    "flushes") {
  FakeClock clock;
  Membership membership(PipelineJob(1), &clock);
  const std::vector<uint64_t> t = RegisterTrainers(membership, 3);
  auto spare = membership.Register(Request("s", SPARE));
  FailOne(clock, membership, t, t[1], {spare->incarnation()});  // lost now, at T
  FlushWhenAsked(membership, t[0]);

  SECTION("the silent neighbour keeps heartbeating") {
    clock.Advance(absl::Milliseconds(999));
    CHECK(HasCommand(BeatOk(membership, Beat(t[2])), FLUSH_LOG));
    BeatOk(membership, Beat(t[0]));
    BeatOk(membership, Beat(spare->incarnation()));
    auto claim = membership.ClaimReplay(spare->incarnation(), absl::ZeroDuration());
    REQUIRE(claim.ok());
    CHECK_FALSE(claim->has_value());  // T + 999 ms
    clock.Advance(absl::Milliseconds(1));
    claim = membership.ClaimReplay(spare->incarnation(), absl::ZeroDuration());  // T + 1000 ms
    REQUIRE(claim.ok());
    REQUIRE(claim->has_value());
    CHECK(claim->value().slot.stage() == 1);
  }
  SECTION("a neighbour that leaves is not waited for") {
    REQUIRE(membership.Deregister(t[2]).ok());
    auto claim = membership.ClaimReplay(spare->incarnation(), absl::ZeroDuration());
    REQUIRE(claim.ok());
    REQUIRE(claim->has_value());
    CHECK(claim->value().slot.stage() == 1);
  }
}

TEST_CASE(
    "a trainer blocked on a neighbour shows its slot BLOCKED with the reason until it "
    "reports none") {
  FakeClock clock;
  Membership membership(PipelineJob(1), &clock);
  const std::vector<uint64_t> t = RegisterTrainers(membership, 3);
  const std::string reason =
      "waiting 10000 ms for the BACKWARD pair of step 7, micro-batch 2 from slot (0, 2)";
  BeatOk(membership, Blocked(t[1], reason));

  GetStatusResponse status;
  membership.FillStatus(&status);
  REQUIRE(status.slots_size() == 3);
  CHECK(status.slots(1).state() == BLOCKED);
  CHECK(status.slots(1).detail() == reason);
  CHECK(status.slots(1).owner_incarnation() == t[1]);
  CHECK(status.slots(0).state() == ACTIVE);
  CHECK(status.slots(2).state() == ACTIVE);

  SECTION("an empty reason clears it") {
    BeatOk(membership, Blocked(t[1], ""));
    status.Clear();
    membership.FillStatus(&status);
    CHECK(status.slots(1).state() == ACTIVE);
    CHECK(status.slots(1).detail().empty());
  }
  SECTION("a heartbeat without a reason clears it") {
    BeatOk(membership, Beat(t[1]));
    status.Clear();
    membership.FillStatus(&status);
    CHECK(status.slots(1).state() == ACTIVE);
    CHECK(status.slots(1).detail().empty());
  }
  SECTION("a blocked trainer that fails leaves its slot LOST, not BLOCKED") {
    FailOne(clock, membership, t, t[1]);
    status.Clear();
    membership.FillStatus(&status);
    CHECK(status.slots(1).state() == LOST);
    CHECK(absl::StrContains(status.slots(1).detail(),
                            absl::StrCat("owner incarnation ", t[1], " FAILED")));
  }
}

}  // namespace
}  // namespace rebound::server
