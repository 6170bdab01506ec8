// FailureDetector (server/failure_detector.h) under a FakeClock: who is declared failed and when,
// what the slot of a failed trainer is charged, a server pause, the health watch and the hooks.

#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/config.h"
#include "server/failure_detector.h"
#include "server/membership.h"
#include "server/reliability.h"
#include "tests/server/server_testing.h"

namespace rebound::server {
namespace {

using testing::Beat;
using testing::Request;
using testing::TwoByOneJob;

SlotState StateOf(const Membership& membership, int replica) {
  GetStatusResponse status;
  membership.FillStatus(&status);
  for (const SlotStatus& slot : status.slots()) {
    if (slot.slot().replica() == replica) return slot.state();
  }
  return SLOT_STATE_UNSPECIFIED;
}

struct Fixture {
  JobConfig job = TwoByOneJob();
  FakeClock clock;
  Membership membership{job, &clock};
  ReliabilityTracker tracker{job.weighting(), job.topology().replicas()};
};

TEST_CASE("the check period is a quarter of the heartbeat interval or of crash_confirm_ms, within "
          "[10, 100] ms") {
  JobConfig job = TwoByOneJob();
  CHECK(FailureDetector::CheckPeriod(job) == absl::Milliseconds(25));
  job.mutable_fault_tolerance()->set_heartbeat_interval_ms(20);
  CHECK(FailureDetector::CheckPeriod(job) == absl::Milliseconds(10));
  job.mutable_fault_tolerance()->set_heartbeat_interval_ms(10000);
  CHECK(FailureDetector::CheckPeriod(job) == absl::Milliseconds(50));  // crash_confirm 200 / 4
  job.mutable_fault_tolerance()->set_crash_confirm_ms(0);  // off: the heartbeat's alone
  CHECK(FailureDetector::CheckPeriod(job) == absl::Milliseconds(100));
  job.mutable_fault_tolerance()->set_crash_confirm_ms(80);
  CHECK(FailureDetector::CheckPeriod(job) == absl::Milliseconds(20));
  job.mutable_fault_tolerance()->set_crash_confirm_ms(8);
  CHECK(FailureDetector::CheckPeriod(job) == absl::Milliseconds(10));
}

// Crash detection (docs/design.md §13): the session's end, confirmed by crash_confirm_ms (200 ms
// in TwoByOneJob: the default) without another attach.
TEST_CASE("a lost session declares its worker failed after crash_confirm_ms, not before") {
  Fixture f;
  auto a = f.membership.Register(Request("a"));
  auto b = f.membership.Register(Request("b"));
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  FailureDetector detector(f.job, &f.membership, &f.tracker, &f.clock, {});
  REQUIRE(f.membership.AttachSession(a->incarnation()).ok());
  REQUIRE(f.membership.AttachSession(b->incarnation()).ok());
  f.clock.Advance(absl::Milliseconds(50));
  f.membership.DetachSession(a->incarnation(), /*lost=*/true);
  for (int t = 25; t < 200; t += 25) {
    f.clock.Advance(absl::Milliseconds(25));
    CHECK(detector.CheckOnce().empty());
  }
  f.clock.Advance(absl::Milliseconds(25));  // 200 ms after the loss
  const std::vector<FailedWorker> failed = detector.CheckOnce();
  REQUIRE(failed.size() == 1);
  CHECK(failed[0].incarnation == a->incarnation());
  CHECK(failed[0].crashed);
  CHECK(failed[0].detected_after == absl::Milliseconds(200));
  CHECK(failed[0].silent_for == absl::Milliseconds(250));  // since its attach (contact)
  CHECK(StateOf(f.membership, 0) == LOST);
  CHECK(StateOf(f.membership, 1) == ACTIVE);
  GetStatusResponse status;
  f.membership.FillStatus(&status);
  CHECK(status.workers(0).state_reason() ==
        "its session ended 200 ms ago without a Deregister and it did not attach again "
        "(crash_confirm 200 ms): the process is gone");
  CHECK(status.workers(0).silent_ms_at_failure() == 250);
  // Its attach again now is refused: it is fenced.
  CHECK(f.membership.AttachSession(a->incarnation()).code() ==
        absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("a session lost and attached again within crash_confirm_ms, or ended by the server, or "
          "lost beside another open one, fences nobody") {
  Fixture f;
  auto a = f.membership.Register(Request("a"));
  auto b = f.membership.Register(Request("b"));
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  FailureDetector detector(f.job, &f.membership, &f.tracker, &f.clock, {});
  REQUIRE(f.membership.AttachSession(a->incarnation()).ok());
  REQUIRE(f.membership.AttachSession(b->incarnation()).ok());
  // a: lost, back 150 ms later (a reset connection), and so on five times.
  for (int i = 0; i < 5; ++i) {
    f.membership.DetachSession(a->incarnation(), /*lost=*/true);
    f.clock.Advance(absl::Milliseconds(150));
    CHECK(detector.CheckOnce().empty());
    absl::Duration back_after;
    REQUIRE(f.membership.AttachSession(a->incarnation(), &back_after).ok());
    CHECK(back_after == absl::Milliseconds(150));
    REQUIRE(f.membership.Heartbeat(Beat(a->incarnation())).ok());
    REQUIRE(f.membership.Heartbeat(Beat(b->incarnation())).ok());
  }
  // b: a second session opened before the first one's end was seen (a reconnect that raced it).
  REQUIRE(f.membership.AttachSession(b->incarnation()).ok());
  f.membership.DetachSession(b->incarnation(), /*lost=*/true);
  // a: the server ends its session (stopping, or the session's age): not a loss.
  f.membership.DetachSession(a->incarnation(), /*lost=*/false);
  for (int t = 0; t < 800; t += 25) {
    f.clock.Advance(absl::Milliseconds(25));
    CHECK(detector.CheckOnce().empty());
    if (t % 100 == 0) {
      REQUIRE(f.membership.Heartbeat(Beat(a->incarnation())).ok());
      REQUIRE(f.membership.Heartbeat(Beat(b->incarnation())).ok());
    }
  }
  CHECK(StateOf(f.membership, 0) == ACTIVE);
  CHECK(StateOf(f.membership, 1) == ACTIVE);
}

TEST_CASE("with crash_confirm_ms 0 a lost session waits for the heartbeat timeout; a server "
          "pause moves a loss's window") {
  Fixture f;
  f.job.mutable_fault_tolerance()->set_crash_confirm_ms(0);
  Membership membership(f.job, &f.clock);
  auto a = membership.Register(Request("a"));
  REQUIRE(a.ok());
  FailureDetector detector(f.job, &membership, &f.tracker, &f.clock, {});
  REQUIRE(membership.AttachSession(a->incarnation()).ok());
  membership.DetachSession(a->incarnation(), /*lost=*/true);
  for (int t = 25; t <= 1000; t += 25) {  // pass by pass: a longer gap is a server pause
    f.clock.Advance(absl::Milliseconds(25));
    CHECK(detector.CheckOnce().empty());
  }
  f.clock.Advance(absl::Milliseconds(25));
  const std::vector<FailedWorker> failed = detector.CheckOnce();
  REQUIRE(failed.size() == 1);
  CHECK_FALSE(failed[0].crashed);

  // Crash detection on: the server stopped for 5 s right after the loss. The pause is excused
  // and the window runs in time the server ran.
  Fixture g;
  auto b = g.membership.Register(Request("b"));
  REQUIRE(b.ok());
  FailureDetector other(g.job, &g.membership, &g.tracker, &g.clock, {});
  REQUIRE(g.membership.AttachSession(b->incarnation()).ok());
  g.membership.DetachSession(b->incarnation(), /*lost=*/true);
  g.clock.Advance(absl::Milliseconds(100));
  CHECK(other.CheckOnce().empty());
  g.clock.Advance(absl::Seconds(5));
  CHECK(other.CheckOnce().empty());  // the pause (about 4.95 s) moved the loss forward
  g.clock.Advance(absl::Milliseconds(150));
  const std::vector<FailedWorker> late = other.CheckOnce();
  REQUIRE(late.size() == 1);
  CHECK(late[0].crashed);
}

TEST_CASE("AttachSession: an unknown incarnation ABORTED, at most 4 sessions per worker") {
  Fixture f;
  auto a = f.membership.Register(Request("a"));
  REQUIRE(a.ok());
  CHECK(f.membership.AttachSession(a->incarnation() + 1000).code() == absl::StatusCode::kAborted);
  for (int i = 0; i < Membership::kMaxSessionsPerWorker; ++i) {
    REQUIRE(f.membership.AttachSession(a->incarnation()).ok());
  }
  const absl::Status fifth = f.membership.AttachSession(a->incarnation());
  CHECK(fifth.code() == absl::StatusCode::kResourceExhausted);
  CHECK(fifth.message() ==
        absl::StrCat("incarnation ", a->incarnation(),
                     " already holds 4 sessions (at most 4); a worker needs one"));
  f.membership.DetachSession(a->incarnation(), /*lost=*/true);
  CHECK(f.membership.AttachSession(a->incarnation()).ok());
  f.membership.DetachSession(a->incarnation() + 1000, /*lost=*/true);  // unknown: nothing
}

TEST_CASE("a silent trainer is declared failed after failure_timeout, not before") {
  Fixture f;
  auto a = f.membership.Register(Request("a"));
  auto b = f.membership.Register(Request("b"));
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  int passes = 0;
  FailureDetector::Hooks hooks;
  hooks.after_pass = [&] { ++passes; };
  FailureDetector detector(f.job, &f.membership, &f.tracker, &f.clock, hooks);
  const double fault_before = f.tracker.FaultScore("a", f.clock.Now());

  // b beats every 100 ms; a is silent. Until 1000 ms of silence nobody is declared failed.
  for (int t = 25; t <= 1000; t += 25) {
    f.clock.Advance(absl::Milliseconds(25));
    if (t % 100 == 0) REQUIRE(f.membership.Heartbeat(Beat(b->incarnation())).ok());
    CHECK(detector.CheckOnce().empty());
  }
  CHECK(StateOf(f.membership, 0) == ACTIVE);
  CHECK(passes == 40);

  // The next pass past the timeout declares a (and only a) failed: its slot is LOST and out of
  // the weights' medians, and the fault is charged to the worker's name "a" (docs/design.md §4.5).
  f.clock.Advance(absl::Milliseconds(25));
  const std::vector<FailedWorker> failed = detector.CheckOnce();
  REQUIRE(failed.size() == 1);
  CHECK(failed[0].incarnation == a->incarnation());
  CHECK(failed[0].name == "a");
  CHECK(failed[0].had_slot);
  CHECK(failed[0].slot.replica() == 0);
  CHECK(failed[0].silent_for > absl::Milliseconds(1000));
  CHECK(StateOf(f.membership, 0) == LOST);
  CHECK(StateOf(f.membership, 1) == ACTIVE);
  CHECK(f.tracker.FaultScore("a", f.clock.Now()) == Approx(fault_before + 0.5));
  CHECK(f.tracker.FaultScore("b", f.clock.Now()) == 0.0);
  CHECK(f.membership.CheckAlive(a->incarnation()).code() ==
        absl::StatusCode::kFailedPrecondition);
  // Once only.
  f.clock.Advance(absl::Milliseconds(25));
  CHECK(detector.CheckOnce().empty());
}

TEST_CASE("a pass far later than its period excuses the server's pause") {
  Fixture f;
  auto a = f.membership.Register(Request("a"));
  REQUIRE(a.ok());
  FailureDetector detector(f.job, &f.membership, &f.tracker, &f.clock, {});
  f.clock.Advance(absl::Milliseconds(25));
  CHECK(detector.CheckOnce().empty());
  // The whole server stops for 5 s: no heartbeat could arrive, so a is not failed on resume.
  f.clock.Advance(absl::Seconds(5));
  CHECK(detector.CheckOnce().empty());
  CHECK(StateOf(f.membership, 0) == ACTIVE);
  // Its silence counts again from the resume: failed after failure_timeout of real silence.
  for (int i = 0; i < 38; ++i) {
    f.clock.Advance(absl::Milliseconds(25));
    CHECK(detector.CheckOnce().empty());
  }
  for (int i = 0; i < 4; ++i) {
    f.clock.Advance(absl::Milliseconds(25));
    detector.CheckOnce();
  }
  CHECK(StateOf(f.membership, 0) == LOST);
}

TEST_CASE("the first unhealthy pass calls on_unhealthy, once") {
  Fixture f;
  absl::Status health = absl::OkStatus();
  std::vector<std::string> reported;
  FailureDetector::Hooks hooks;
  hooks.health = [&] { return health; };
  hooks.on_unhealthy = [&](const absl::Status& status) {
    reported.push_back(std::string(status.message()));
  };
  FailureDetector detector(f.job, &f.membership, &f.tracker, &f.clock, hooks);
  f.clock.Advance(absl::Milliseconds(25));
  detector.CheckOnce();
  CHECK(reported.empty());
  health = absl::DataLossError("store refuses writes");
  f.clock.Advance(absl::Milliseconds(25));
  detector.CheckOnce();
  f.clock.Advance(absl::Milliseconds(25));
  detector.CheckOnce();
  CHECK(reported == std::vector<std::string>{"store refuses writes"});
}

TEST_CASE("Run checks once per period until stopped") {
  Fixture f;
  auto a = f.membership.Register(Request("a"));
  REQUIRE(a.ok());
  absl::Notification stop;
  int passes = 0;
  FailureDetector::Hooks hooks;
  // The fake clock's WaitFor advances it by the period; stop after 60 passes (1.5 s).
  hooks.after_pass = [&] {
    if (++passes == 60) stop.Notify();
  };
  FailureDetector detector(f.job, &f.membership, &f.tracker, &f.clock, hooks);
  const absl::Time start = f.clock.Now();
  detector.Run(&stop);
  CHECK(passes == 60);
  CHECK(f.clock.Now() - start == absl::Milliseconds(60 * 25));
  CHECK(StateOf(f.membership, 0) == LOST);
}

// Goodput (docs/metrics.md#goodput), with every pass 25 ms after the one before and steps
// reported by heartbeats: a trainer trains 1 s (100 steps), dies after its sync at step 60 and is
// declared 200 ms later; its slot waits 300 ms for a spare, which restarts it from the center at
// step 60 and trains 0.5 s (50 steps). The other slot trains throughout.
TEST_CASE("goodput: a slot's time is split into productive time and lost time by cause") {
  JobConfig job = testing::JobWithPolicy("RESTART_FROM_CENTER");
  FakeClock clock;
  Membership membership(job, &clock);
  ReliabilityTracker tracker(job.weighting(), job.topology().replicas());
  FailureDetector detector(job, &membership, &tracker, &clock, {});
  auto a = membership.Register(Request("a", TRAINER));
  auto b = membership.Register(Request("b", TRAINER));
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(membership.AttachSession(a->incarnation()).ok());
  detector.CheckOnce();  // the accounts start
  int64_t b_step = 0;
  auto pass = [&](int t, uint64_t trainer, int64_t* step) {
    clock.Advance(absl::Milliseconds(25));
    if (t % 4 == 0) {
      b_step += 10;
      REQUIRE(membership.Heartbeat(Beat(b->incarnation(), b_step)).ok());
      if (trainer != 0) {
        *step += 10;
        REQUIRE(membership.Heartbeat(Beat(trainer, *step)).ok());
      }
    }
    return detector.CheckOnce();
  };
  int64_t a_step = 0;
  for (int t = 1; t <= 40; ++t) CHECK(pass(t, a->incarnation(), &a_step).empty());
  REQUIRE(a_step == 100);
  membership.RecordProgress(a->slot(), 60, 1000000);  // its last sync
  membership.DetachSession(a->incarnation(), /*lost=*/true);
  for (int t = 1; t < 8; ++t) CHECK(pass(t, 0, nullptr).empty());
  REQUIRE(pass(8, 0, nullptr).size() == 1);  // 200 ms after the loss
  for (int t = 1; t <= 12; ++t) pass(t, 0, nullptr);  // LOST: no spare yet
  auto s = membership.Register(Request("s", SPARE));
  REQUIRE(s.ok());
  auto took = membership.Heartbeat(Beat(s->incarnation()));
  REQUIRE(took.ok());
  REQUIRE(took->has_takeover());
  CHECK(took->takeover().start_step() == 60);
  int64_t s_step = 60;
  for (int t = 1; t <= 20; ++t) CHECK(pass(t, took->takeover().incarnation(), &s_step).empty());
  REQUIRE(s_step == 110);

  GetStatusResponse status;
  membership.FillStatus(&status);
  const SlotGoodput& lost = status.slots(0).goodput();
  INFO(status.DebugString());
  // The accounts start at each slot's first step (100 ms in): ACTIVE 0.9 + 0.2 (dead, not yet
  // declared) + 0.5 s, over 90 + 50 steps.
  const double step_s = 1.6 / 140;
  CHECK(lost.detect_seconds() == Approx(0.2));
  CHECK(lost.steps_discarded() == 40);  // reached 100, went on from 60
  CHECK(lost.rollback_seconds() == Approx(40 * step_s));
  CHECK(lost.goodput_seconds() == Approx(1.6 - 0.2 - 40 * step_s));
  CHECK(lost.idle_seconds() == Approx(0.3));
  CHECK(lost.replay_seconds() == 0);
  CHECK(lost.restore_seconds() == 0);
  const SlotGoodput& kept = status.slots(1).goodput();
  CHECK(kept.goodput_seconds() == Approx(1.9));
  CHECK(kept.detect_seconds() + kept.idle_seconds() + kept.rollback_seconds() == 0);
  CHECK(status.goodput().goodput_seconds() == Approx(1.9 + 1.6 - 0.2 - 40 * step_s));
  // Both slots' 1.9 s: the job's effective training time ratio.
  CHECK(status.ettr() == Approx((1.9 + 1.6 - 0.2 - 40 * step_s) / 3.8));
  // One recovery, a restart from the center: 0.2 s from the crash to its declaration, then 0.3 s
  // LOST until the spare took over, in the bucket whose upper bound is 0.5 s.
  REQUIRE(status.recovery_durations_size() == 1);
  const RecoveryDurations& durations = status.recovery_durations(0);
  CHECK(durations.policy() == RESTART_FROM_CENTER);
  CHECK(durations.count() == 1);
  CHECK(durations.sum_seconds() == Approx(0.5));
  REQUIRE(durations.bucket_le_seconds_size() == 11);
  REQUIRE(durations.bucket_counts_size() == 12);
  CHECK(durations.bucket_le_seconds(2) == 0.5);
  for (int i = 0; i < durations.bucket_counts_size(); ++i) {
    INFO("bucket " << i);
    CHECK(durations.bucket_counts(i) == (i == 2 ? 1u : 0u));
  }
}

TEST_CASE("goodput: an ACTIVE slot whose step stops moving for two heartbeat intervals is idle") {
  Fixture f;
  auto a = f.membership.Register(Request("a", TRAINER));
  REQUIRE(a.ok());
  FailureDetector detector(f.job, &f.membership, &f.tracker, &f.clock, {});
  detector.CheckOnce();
  int64_t step = 0;
  auto pass = [&](int t, bool progress) {
    f.clock.Advance(absl::Milliseconds(25));
    if (t % 4 == 0) {
      if (progress) step += 10;
      REQUIRE(f.membership.Heartbeat(Beat(a->incarnation(), step)).ok());
    }
    CHECK(detector.CheckOnce().empty());
  };
  for (int t = 1; t <= 20; ++t) pass(t, true);   // 0.5 s: the accounts start 100 ms in
  for (int t = 1; t <= 20; ++t) pass(t, false);  // 0.5 s alive, no step (heartbeat 100 ms)
  for (int t = 1; t <= 8; ++t) pass(t, true);    // 0.2 s: steps again from 100 ms in
  GetStatusResponse status;
  f.membership.FillStatus(&status);
  INFO(status.DebugString());
  const SlotGoodput& g = status.slots(0).goodput();
  // Productive: 0.4 s, the stall's first 0.2 s (two heartbeat intervals), the last 0.125 s.
  CHECK(g.goodput_seconds() == Approx(0.725));
  // Idle: the rest of the stall (0.3 s) and 75 ms until the next step arrived.
  CHECK(g.idle_seconds() == Approx(0.375));
  CHECK(status.ettr() == Approx(0.725 / 1.1));
}

}  // namespace
}  // namespace rebound::server
