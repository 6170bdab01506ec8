#include <catch2/catch.hpp>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

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

}  // namespace
}  // namespace rebound::server

namespace rebound::server {
namespace {

JobConfig JobWithPolicy(const char* policy) {
  auto job = ParseJobConfig(
      absl::StrCat("job_id: \"j\"\n"
                   "model { layers { width: 8 } layers { width: 4 activation: IDENTITY } }\n"
                   "topology { replicas: 2 stages: 1 }\n"
                   "fault_tolerance { policy: ",
                   policy, " heartbeat_interval_ms: 100 failure_timeout_ms: 1000 }\n"),
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
  auto finished = membership.FinishReplay(spare->incarnation(), report);
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
  auto finished = membership.FinishReplay(s1->incarnation(), report);
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
