#include <catch2/catch.hpp>

#include <algorithm>

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
#include "tests/server/server_testing.h"

namespace rebound::server {
namespace {

using testing::Beat;
using testing::BeatOk;
using testing::Blocked;
using testing::FailOne;
using testing::Flushed;
using testing::FlushWhenAsked;
using testing::HasCommand;
using testing::JobWithPolicy;
using testing::PipelineJob;
using testing::RegisterTrainers;
using testing::Request;
using testing::TwoByOneJob;

// What a Membership wrote last (its PersistFn), for a second one to restore: a restart.
struct Written {
  ServerRecord server;
  std::vector<SlotRecord> slots;
  Membership::PersistFn Writer() {
    return [this](const ServerRecord& record, const std::vector<SlotRecord>& records) {
      server = record;
      slots = records;
      return absl::OkStatus();
    };
  }
};

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

TEST_CASE("the start barrier holds trainers until min_trainers slots have one, then never "
          "again") {
  FakeClock clock;
  JobConfig job = TwoByOneJob();
  job.mutable_topology()->set_min_trainers(2);
  Membership membership(job, &clock);
  auto a = membership.Register(Request("a"));
  REQUIRE(a.ok());
  CHECK(a->hold_start());
  CHECK(BeatOk(membership, Beat(a->incarnation())).hold_start());
  auto b = membership.Register(Request("b"));
  REQUIRE(b.ok());
  CHECK_FALSE(b->hold_start());  // the second of two: released
  CHECK_FALSE(BeatOk(membership, Beat(a->incarnation())).hold_start());
  // A trainer lost and replaced later finds the job started: nothing holds it.
  REQUIRE(membership.Deregister(b->incarnation()).ok());
  CHECK_FALSE(BeatOk(membership, Beat(a->incarnation(), 3)).hold_start());
}

TEST_CASE("the start barrier lets the trainers there start after start_barrier_ms; none without "
          "min_trainers") {
  FakeClock clock;
  JobConfig job = TwoByOneJob();
  job.mutable_topology()->set_min_trainers(2);
  job.mutable_topology()->set_start_barrier_ms(5000);
  Membership membership(job, &clock);
  auto a = membership.Register(Request("a"));
  REQUIRE(a.ok());
  CHECK(a->hold_start());
  for (int i = 0; i < 9; ++i) {  // 4.5 s of heartbeats: still held
    clock.Advance(absl::Milliseconds(500));
    CHECK(BeatOk(membership, Beat(a->incarnation())).hold_start());
  }
  clock.Advance(absl::Milliseconds(500));
  CHECK_FALSE(BeatOk(membership, Beat(a->incarnation())).hold_start());

  FakeClock other_clock;
  Membership no_barrier(TwoByOneJob(), &other_clock);
  auto alone = no_barrier.Register(Request("a"));
  REQUIRE(alone.ok());
  CHECK_FALSE(alone->hold_start());
  CHECK_FALSE(BeatOk(no_barrier, Beat(alone->incarnation())).hold_start());
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
  Written written;
  uint64_t trainer = 0;
  uint64_t spare = 0;
  {
    Membership first(TwoByOneJob(), &clock, written.Writer());
    trainer = first.Register(Request("a"))->incarnation();
    REQUIRE(first.Register(Request("b")).ok());
    spare = first.Register(Request("s", SPARE))->incarnation();
  }
  Membership second(TwoByOneJob(), &clock);
  REQUIRE(second.Restore(written.server, written.slots, absl::Seconds(10)).ok());
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

TEST_CASE("a restored owner that crashes within the restart grace is declared with its silence "
          "since its last contact, never a negative one") {
  FakeClock clock;
  Written written;
  uint64_t a = 0;
  uint64_t b = 0;
  {
    Membership first(TwoByOneJob(), &clock, written.Writer());
    a = first.Register(Request("a"))->incarnation();
    b = first.Register(Request("b"))->incarnation();
  }
  // A new leader: the owners' heartbeat deadline lies 10 s ahead (the reconnect grace).
  Membership second(TwoByOneJob(), &clock);
  REQUIRE(second.Restore(written.server, written.slots, absl::Seconds(10)).ok());
  clock.Advance(absl::Seconds(1));
  REQUIRE(second.AttachSession(a).ok());  // a's last contact
  clock.Advance(absl::Milliseconds(500));
  second.DetachSession(a, /*lost=*/true);
  clock.Advance(absl::Milliseconds(200));  // crash_confirm_ms
  const std::vector<FailedWorker> failed = second.DetectFailures();
  REQUIRE(failed.size() == 1);
  CHECK(failed[0].incarnation == a);
  CHECK(failed[0].crashed);
  CHECK(failed[0].silent_for == absl::Milliseconds(700));
  CHECK(failed[0].detected_after == absl::Milliseconds(200));
  GetStatusResponse status;
  second.FillStatus(&status);
  for (const WorkerStatus& w : status.workers()) {
    INFO(w.DebugString());
    if (w.incarnation() == a) {
      CHECK(w.state() == FAILED);
      CHECK(w.silent_ms_at_failure() == 700);
    } else if (w.incarnation() == b) {
      // b has not called this server: silent since the restore, within its grace.
      CHECK(w.state() == ALIVE);
      CHECK(w.last_heartbeat_ms_ago() == 1700);
    }
  }
}

TEST_CASE("restored from a backup, no owner comes back: active slots are LOST, the old "
          "incarnations are unknown and new ones never repeat them") {
  FakeClock clock;
  Written written;
  std::vector<uint64_t> old;
  {
    Membership first(TwoByOneJob(), &clock, written.Writer());
    old.push_back(first.Register(Request("a"))->incarnation());
    old.push_back(first.Register(Request("b"))->incarnation());
    // Issued after the backup was taken (the records above): the restored server must not
    // hand these numbers out again.
    old.push_back(first.Register(Request("s", SPARE))->incarnation());
  }
  Membership restored(TwoByOneJob(), &clock);
  REQUIRE(restored
              .Restore(written.server, written.slots, absl::Seconds(10), /*forget_owners=*/true)
              .ok());
  for (uint64_t incarnation : old) {
    CHECK(restored.CheckAlive(incarnation).code() == absl::StatusCode::kAborted);
  }
  GetStatusResponse status;
  restored.FillStatus(&status);
  REQUIRE(status.slots_size() == 2);
  for (const SlotStatus& slot : status.slots()) {
    INFO(slot.ShortDebugString());
    CHECK(slot.state() == LOST);
    CHECK(slot.owner_incarnation() == 0);
  }
  // An old trainer registering again finds no free slot: a spare (role auto), which rebuilds one.
  auto again = restored.Register(Request("a"));
  REQUIRE(again.ok());
  CHECK(again->role() == SPARE);
  CHECK(std::find(old.begin(), old.end(), again->incarnation()) == old.end());
}

}  // namespace
}  // namespace rebound::server

namespace rebound::server {
namespace {

// Pipelines (S > 1) under REPLAY: a lost stage's neighbours flush their step logs first, and a
// trainer waiting on a neighbour shows as BLOCKED.

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
  Written written;
  std::vector<uint64_t> t;
  int64_t old_sequence = 0;
  {
    Membership first(PipelineJob(1), &clock, written.Writer());
    t = RegisterTrainers(first, 3);
    FailOne(clock, first, t, t[2]);  // (0, 2) lost: (0, 1) flushes
    old_sequence = FlushWhenAsked(first, t[1]);
  }
  // The next life restores (0, 0) and (0, 1); t[1]'s agent still reports its last flush.
  clock.Advance(absl::Seconds(5));
  Membership second(PipelineJob(1), &clock);
  REQUIRE(second.Restore(written.server, written.slots, absl::ZeroDuration()).ok());
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

// ---- persistence outside the state lock (R20) ------------------------------------------------

TEST_CASE("a write in progress (a replicated group's wait for its standbys) holds up no "
          "heartbeat, owner check or status") {
  FakeClock clock;
  std::atomic<bool> block{false};
  absl::Notification writing;
  absl::Notification release;
  Membership membership(TwoByOneJob(), &clock,
                        [&](const ServerRecord&, const std::vector<SlotRecord>&) {
                          if (block.load()) {
                            writing.Notify();
                            release.WaitForNotification();
                          }
                          return absl::OkStatus();
                        });
  auto a = membership.Register(Request("a"));
  REQUIRE(a.ok());
  block.store(true);
  absl::StatusOr<RegisterResponse> b;
  std::thread registering([&] { b = membership.Register(Request("b")); });
  writing.WaitForNotification();  // b's registration is being written, and waits
  // The calls every Sync and heartbeat make, from another thread, bounded: before R20 the write
  // held the membership's lock and these waited for it.
  absl::Notification answered;
  bool alive = false;
  bool beat = false;
  int listed = 0;
  std::thread calling([&] {
    alive = membership.CheckAlive(a->incarnation()).ok();
    beat = membership.Heartbeat(Beat(a->incarnation())).ok();
    GetStatusResponse status;
    membership.FillStatus(&status);
    listed = status.workers_size();
    answered.Notify();
  });
  const bool in_time = answered.WaitForNotificationWithTimeout(absl::Seconds(10));
  release.Notify();
  calling.join();
  registering.join();
  CHECK(in_time);
  CHECK(alive);
  CHECK(beat);
  CHECK(listed == 2);  // b is in memory while its write runs; it learns its incarnation after
  REQUIRE(b.ok());
  CHECK(b->slot().replica() == 1);
}

TEST_CASE("concurrent changes are written in their order, never an older state after a newer "
          "one, and one write may cover several") {
  FakeClock clock;
  absl::Mutex mu;
  std::vector<uint64_t> written;  // next_incarnation_counter of each write, in write order
  Membership membership(TwoByOneJob(), &clock,
                        [&](const ServerRecord& server, const std::vector<SlotRecord>&) {
                          absl::SleepFor(absl::Milliseconds(1));  // a write takes time
                          absl::MutexLock lock(&mu);
                          written.push_back(server.next_incarnation_counter());
                          return absl::OkStatus();
                        });
  constexpr int kThreads = 4;
  constexpr int kEach = 25;
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        if (membership.Register(Request(absl::StrCat("w", t, "-", i))).ok()) ++ok;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  CHECK(ok.load() == kThreads * kEach);
  absl::MutexLock lock(&mu);
  REQUIRE_FALSE(written.empty());
  CHECK(std::is_sorted(written.begin(), written.end()));
  // The last write holds every registration (the counter after the 100th).
  CHECK(written.back() == 1 + kThreads * kEach);
  CHECK(written.size() <= static_cast<size_t>(kThreads * kEach));
}

TEST_CASE("a registration that cannot be written is refused UNAVAILABLE and undone, and the "
          "undoing is written") {
  FakeClock clock;
  int calls = 0;
  std::vector<SlotRecord> last;
  Membership membership(TwoByOneJob(), &clock,
                        [&](const ServerRecord&, const std::vector<SlotRecord>& slots) {
                          ++calls;
                          if (calls == 2) return absl::UnavailableError("disk full");
                          last = slots;
                          return absl::OkStatus();
                        });
  REQUIRE(membership.Register(Request("a")).ok());
  auto b = membership.Register(Request("b"));
  CHECK(b.status().code() == absl::StatusCode::kUnavailable);
  CHECK(b.status().message() == "cannot persist the registration: disk full");
  CHECK(calls == 3);  // a, b (failed), b undone
  REQUIRE(last.size() == 2);
  CHECK(last[1].state() == UNASSIGNED);
  CHECK(last[1].owner_incarnation() == 0);
  // The slot is free again: the next trainer gets it.
  auto c = membership.Register(Request("c"));
  REQUIRE(c.ok());
  CHECK(c->slot().replica() == 1);
}

}  // namespace
}  // namespace rebound::server
