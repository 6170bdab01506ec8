// GlobalCheckpoint (server/global_checkpoint.h): the barrier at each cut, who takes the
// checkpoint, what a rollback does to waiters, and the checkpoint file a restarted server loads.

#include "server/global_checkpoint.h"

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/config.h"
#include "tests/server/server_testing.h"

namespace rebound::server {
namespace {

JobConfig Job() {
  return testing::ParseJob(
      "job_id: \"g\"\n"
      "model { layers { width: 8 } layers { width: 4 activation: IDENTITY } }\n"
      "topology { replicas: 2 stages: 1 }\n"
      "easgd { sync_period: 10 }\n"
      "training { max_steps: 95 }\n"
      "fault_tolerance { policy: GLOBAL_CHECKPOINT checkpoint_every_steps: 20 }\n");
}

CheckpointRecord Initial() {
  CheckpointRecord record;
  CenterRecord* center = record.add_centers();
  center->set_stage(0);
  center->set_version(0);
  return record;
}

// Gathers a checkpoint whose center version is the cut's step, counting the calls; `current`
// (optional) gets the step of the checkpoint kept until this one is persisted.
GlobalCheckpoint::TakeFn Taker(int* calls, int64_t* current = nullptr) {
  return [calls, current](int64_t step, int64_t current_step) -> absl::StatusOr<CheckpointRecord> {
    ++*calls;
    if (current != nullptr) *current = current_step;
    CheckpointRecord record;
    CenterRecord* center = record.add_centers();
    center->set_stage(0);
    center->set_version(step);
    return record;
  };
}

std::string TempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  const std::string dir =
      absl::StrCat(base != nullptr ? base : "/tmp", "/gc-", absl::ToUnixNanos(absl::Now()));
  std::filesystem::create_directories(dir);
  return dir;
}

TEST_CASE("the cuts are the multiples of K and max_steps") {
  GlobalCheckpoint checkpoint(Job(), "", Initial(), DefaultClock());
  CHECK_FALSE(checkpoint.IsCut(0));
  CHECK_FALSE(checkpoint.IsCut(10));
  CHECK(checkpoint.IsCut(20));
  CHECK(checkpoint.IsCut(40));
  CHECK_FALSE(checkpoint.IsCut(50));
  CHECK(checkpoint.IsCut(95));
}

TEST_CASE("the last slot to arrive takes the checkpoint and releases the others") {
  const std::string dir = TempDir();
  GlobalCheckpoint checkpoint(Job(), dir, Initial(), DefaultClock());
  int calls = 0;
  // Slot 0 alone: its wait times out, retryably.
  absl::Status alone = checkpoint.Arrive(0, 20, 0, absl::Milliseconds(10), Taker(&calls));
  CHECK(alone.code() == absl::StatusCode::kUnavailable);
  CHECK(alone.message() ==
        "GLOBAL_CHECKPOINT: waiting at the barrier of step 20 for slot(s) 1; retry");
  CheckpointStatus status;
  checkpoint.FillStatus(&status);
  CHECK(status.pending_step() == 20);
  CHECK(status.pending_arrived() == 1);
  CHECK(calls == 0);
  // Its retry waits again; slot 1 arrives and takes the checkpoint; both are released.
  std::optional<absl::Status> first;
  std::thread retry([&] { first = checkpoint.Arrive(0, 20, 0, absl::Seconds(20), Taker(&calls)); });
  absl::SleepFor(absl::Milliseconds(20));
  CHECK(checkpoint.Arrive(1, 20, 0, absl::Seconds(20), Taker(&calls)).ok());
  retry.join();
  REQUIRE(first.has_value());
  CHECK(first->ok());
  CHECK(calls == 1);
  CHECK(checkpoint.Current().step() == 20);
  CHECK(checkpoint.Current().centers(0).version() == 20);
  CHECK(checkpoint.Current().job_id() == "g");
  checkpoint.FillStatus(&status);
  CHECK(status.count() == 1);
  CHECK(status.step() == 20);
  CHECK(status.pending_step() == 0);
  CHECK(status.barrier_wait_ms() >= 20);  // slot 0 waited at least that long
  // A retried sync of a complete cut passes at once.
  CHECK(checkpoint.Arrive(1, 20, 0, absl::ZeroDuration(), Taker(&calls)).ok());
  CHECK(calls == 1);
  // The file is there; a restarted server loads it.
  CHECK(std::filesystem::exists(dir + "/checkpoint-20.pb"));
  GlobalCheckpoint restarted(Job(), dir, Initial(), DefaultClock());
  REQUIRE(restarted.Load().ok());
  CHECK(restarted.Current().step() == 20);
  CHECK(restarted.Current().centers(0).version() == 20);
  CHECK(restarted.Arrive(0, 20, 0, absl::ZeroDuration(), Taker(&calls)).ok());
  // The next cut replaces the file.
  CHECK(checkpoint.Arrive(0, 40, 0, absl::Milliseconds(1), Taker(&calls)).code() ==
        absl::StatusCode::kUnavailable);
  int64_t kept_until_taken = -1;
  CHECK(checkpoint.Arrive(1, 40, 0, absl::Milliseconds(1), Taker(&calls, &kept_until_taken)).ok());
  CHECK(kept_until_taken == 20);  // the taker learns which checkpoint a failure would keep
  CHECK(std::filesystem::exists(dir + "/checkpoint-40.pb"));
  CHECK_FALSE(std::filesystem::exists(dir + "/checkpoint-20.pb"));
}

TEST_CASE("a rollback releases the waiters with ABORTED and fences syncs of the old epoch") {
  GlobalCheckpoint checkpoint(Job(), "", Initial(), DefaultClock());
  int calls = 0;
  std::optional<absl::Status> waiting;
  std::thread waiter(
      [&] { waiting = checkpoint.Arrive(0, 20, 0, absl::Seconds(20), Taker(&calls)); });
  absl::SleepFor(absl::Milliseconds(20));
  const CheckpointRecord restored = checkpoint.BeginRollback();
  waiter.join();
  REQUIRE(waiting.has_value());
  CHECK(waiting->code() == absl::StatusCode::kAborted);
  CHECK(restored.step() == 0);  // nothing taken yet: the job's start
  CHECK(checkpoint.epoch() == 1);
  // A sync applied before the rollback (epoch 0) never arrives after it.
  CHECK(checkpoint.Arrive(1, 20, 0, absl::Seconds(1), Taker(&calls)).code() ==
        absl::StatusCode::kAborted);
  CheckpointStatus status;
  checkpoint.FillStatus(&status);
  CHECK(status.rollbacks() == 1);
  CHECK(status.pending_step() == 0);
  CHECK(calls == 0);
}

TEST_CASE(
    "no cut completes between Freeze and BeginRollback: the rollback restores the frozen one") {
  // The race this closes: the last slot arrived at cut 40 while the server, rolling back, had
  // already fenced the trainers at the checkpoint of step 20; the cut completed, and the slots'
  // bookkeeping was restored from step 40 while their spares restarted from step 20.
  GlobalCheckpoint checkpoint(Job(), "", Initial(), DefaultClock());
  int calls = 0;
  CHECK(checkpoint.Arrive(0, 20, 0, absl::Milliseconds(1), Taker(&calls)).code() ==
        absl::StatusCode::kUnavailable);
  REQUIRE(checkpoint.Arrive(1, 20, 0, absl::Seconds(1), Taker(&calls)).ok());
  REQUIRE(calls == 1);
  std::optional<absl::Status> waiting;
  std::thread waiter(
      [&] { waiting = checkpoint.Arrive(0, 40, 0, absl::Seconds(20), Taker(&calls)); });
  absl::SleepFor(absl::Milliseconds(20));
  const CheckpointRecord frozen = checkpoint.Freeze();
  CHECK(frozen.step() == 20);
  waiter.join();  // released at once, not after 20 s
  REQUIRE(waiting.has_value());
  CHECK(waiting->code() == absl::StatusCode::kAborted);
  // The last slot arrives at cut 40 now: no checkpoint is taken.
  absl::Status last = checkpoint.Arrive(1, 40, 0, absl::Seconds(1), Taker(&calls));
  CHECK(last.code() == absl::StatusCode::kAborted);
  CHECK(last.message() ==
        "GLOBAL_CHECKPOINT: every slot is being rolled back to the checkpoint of step 20; "
        "this sync of step 40 is undone");
  CHECK(calls == 1);
  CHECK(checkpoint.Current().step() == 20);
  // Even the retry of a cut completed before the freeze is ABORTED: its trainer is being fenced.
  CHECK(checkpoint.Arrive(0, 20, 0, absl::ZeroDuration(), Taker(&calls)).code() ==
        absl::StatusCode::kAborted);
  const CheckpointRecord restored = checkpoint.BeginRollback();
  CHECK(restored.step() == 20);
  CHECK(checkpoint.epoch() == 1);
  // After the rollback the barrier works again in the new epoch.
  CHECK(checkpoint.Arrive(0, 40, 1, absl::Milliseconds(1), Taker(&calls)).code() ==
        absl::StatusCode::kUnavailable);
  CHECK(checkpoint.Arrive(1, 40, 1, absl::Seconds(1), Taker(&calls)).ok());
  CHECK(calls == 2);
  CHECK(checkpoint.Current().step() == 40);
}

TEST_CASE("a checkpoint file of another job is DATA_LOSS") {
  const std::string dir = TempDir();
  {
    auto other = ParseJobConfig(
        "job_id: \"other\"\n"
        "model { layers { width: 8 } layers { width: 4 activation: IDENTITY } }\n"
        "topology { replicas: 1 stages: 1 }\n"
        "easgd { sync_period: 10 }\n"
        "fault_tolerance { policy: GLOBAL_CHECKPOINT checkpoint_every_steps: 20 }\n",
        "job.pbtxt");
    REQUIRE(other.ok());
    GlobalCheckpoint checkpoint(*other, dir, Initial(), DefaultClock());
    int calls = 0;
    REQUIRE(checkpoint.Arrive(0, 20, 0, absl::ZeroDuration(), Taker(&calls)).ok());
  }
  GlobalCheckpoint checkpoint(Job(), dir, Initial(), DefaultClock());
  absl::Status loaded = checkpoint.Load();
  CHECK(loaded.code() == absl::StatusCode::kDataLoss);
  CHECK(loaded.message() == absl::StrCat(dir,
                                         "/checkpoint-20.pb holds step 20 of job \"other\", "
                                         "not this job's (\"g\") step 20"));
}

}  // namespace
}  // namespace rebound::server
