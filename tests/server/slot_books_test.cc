// SlotBooks (server/slot_books.h): books, the DETERMINISTIC turn, the log floors of recovery
// groups and the integrity figures.

#include <catch2/catch.hpp>

#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/config.h"
#include "server/slot_books.h"
#include "tests/server/server_testing.h"

namespace rebound::server {
namespace {

using testing::Slot;

// 2 replicas x 2 stages; `log_no_boundaries` makes both stages one recovery group.
JobConfig Job(bool log_no_boundaries) {
  return testing::TinyModelJob(2, 2,
                               log_no_boundaries ? "step_log { log_no_boundaries: true }\n" : "");
}

SlotBook Book(int64_t step, int64_t count, int64_t log_floor = 0) {
  SlotBook book;
  book.last_update_step = step;
  book.update_count = count;
  book.log_floor = log_floor;
  return book;
}

TEST_CASE("a decided update is seen by the rules at once and by readers once it is durable") {
  SlotBooks books(Job(false));
  books.Set(Slot(0, 0), Book(2, 1), 0.0);
  CHECK(books.Durable(Slot(0, 0)).update_count == 1);
  // Decided (a staged sync's books, under the stage lock): its write is not durable yet.
  books.SetDecided(Slot(0, 0), Book(4, 2), 2.5);
  CHECK(books.Get(Slot(0, 0)).update_count == 2);
  CHECK(books.Get(Slot(0, 0)).last_update_step == 4);
  CHECK(books.Durable(Slot(0, 0)).update_count == 1);
  CHECK(books.Durable(Slot(0, 0)).last_update_step == 2);
  CHECK(books.NewestUpdateStep() == 2);
  CHECK(books.MaxDivergenceRatio(0) == 2.5);
  books.SetDecided(Slot(0, 0), Book(6, 3), 0.0);
  books.MarkDurable(Slot(0, 0), Book(6, 3));
  CHECK(books.Durable(Slot(0, 0)).update_count == 3);
  CHECK(books.NewestUpdateStep() == 6);
  // A late report of an earlier write never takes the durable book back.
  books.MarkDurable(Slot(0, 0), Book(4, 2));
  CHECK(books.Durable(Slot(0, 0)).update_count == 3);
  CHECK(books.Durable(Slot(0, 0)).last_update_step == 6);
  books.Clear();
  CHECK(books.Durable(Slot(0, 0)).update_count == 0);
}

TEST_CASE("a slot without a book reads as zero; Set, Restore and Clear") {
  SlotBooks books(Job(false));
  CHECK(books.Get(Slot(1, 1)).last_update_step == 0);
  CHECK(books.Get(Slot(1, 1)).applied_sequence == 0);
  CHECK(books.NewestUpdateStep() == 0);
  books.Set(Slot(0, 1), Book(2, 1), 0.5);
  CHECK(books.NewestUpdateStep() == 2);
  books.Set(Slot(1, 1), Book(8, 4), 1.5);
  CHECK(books.NewestUpdateStep() == 8);
  CHECK(books.Get(Slot(1, 1)).last_update_step == 8);
  CHECK(books.Get(Slot(1, 1)).update_count == 4);
  CHECK(books.MaxDivergenceRatio(1) == 1.5);
  CHECK(books.MaxDivergenceRatio(0) == 0.0);

  WeightRecord record;
  *record.mutable_slot() = Slot(1, 1);
  record.set_last_update_step(16);
  record.set_update_count(9);
  record.set_applied_sequence(3);
  books.Clear();
  CHECK(books.Get(Slot(1, 1)).last_update_step == 0);
  CHECK(books.NewestUpdateStep() == 0);
  books.Restore({record});
  CHECK(books.NewestUpdateStep() == 16);
  CHECK(books.Get(Slot(1, 1)).last_update_step == 16);
  CHECK(books.Get(Slot(1, 1)).update_count == 9);
  CHECK(books.Get(Slot(1, 1)).applied_sequence == 3);
  CHECK(books.Get(Slot(0, 1)).last_update_step == 0);

  WeightRecord stored = WithBook(WeightRecord(), Slot(1, 1), books.Get(Slot(1, 1)));
  CHECK(stored.slot().replica() == 1);
  CHECK(stored.slot().stage() == 1);
  CHECK(stored.last_update_step() == 16);
  CHECK(stored.applied_sequence() == 3);
}

TEST_CASE("refused updates are counted per slot") {
  SlotBooks books(Job(false));
  books.CountRefused(Slot(0, 1));
  books.CountRefused(Slot(0, 1));
  CHECK(books.Refused(Slot(0, 1)) == 2);
  CHECK(books.Refused(Slot(0, 0)) == 0);
}

TEST_CASE("log floors: a slot alone keeps its log to its last step, a group member to its floor") {
  SECTION("every boundary logged: each stage is its own group") {
    SlotBooks books(Job(false));
    books.Set(Slot(0, 0), Book(8, 4, 6), 0);
    books.Set(Slot(0, 1), Book(4, 2, 2), 0);
    CHECK(books.StepLogFloor(Slot(0, 0)) == 8);
    CHECK(books.GroupFloor(Slot(0, 0), -1) == 8);
    CHECK(books.GroupFloor(Slot(0, 0), 10) == 10);
  }
  SECTION("no boundary logged: stages 0 and 1 are one group") {
    SlotBooks books(Job(true));
    books.Set(Slot(0, 0), Book(8, 4, 6), 0);
    books.Set(Slot(0, 1), Book(4, 2, 2), 0);
    books.Set(Slot(1, 1), Book(2, 1, 2), 0);  // another replica: not in the group
    CHECK(books.StepLogFloor(Slot(0, 0)) == 6);
    CHECK(books.GroupFloor(Slot(0, 0), -1) == 4);
    CHECK(books.GroupFloor(Slot(0, 0), 10) == 4);
    CHECK(books.GroupFloor(Slot(0, 1), 3) == 3);
  }
}

TEST_CASE("WaitForTurn: the smallest (update count, replica) of the stage goes first") {
  SlotBooks books(Job(false));
  // Equal counts: replica 0 first; replica 1 times out with UNAVAILABLE.
  CHECK(books.WaitForTurn(Slot(0, 0), absl::ZeroDuration()).ok());
  const absl::Status waited = books.WaitForTurn(Slot(1, 0), absl::Milliseconds(1));
  CHECK(waited.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(waited.message()), Catch::Matchers::Contains("slot (1, 0)"));
  // Another stage's books do not count.
  CHECK(books.WaitForTurn(Slot(1, 1), absl::Milliseconds(1)).code() ==
        absl::StatusCode::kUnavailable);
  // Replica 1 waits until replica 0's update is recorded.
  absl::Notification done;
  absl::Status turn;
  std::thread waiter([&] {
    turn = books.WaitForTurn(Slot(1, 0), absl::Seconds(20));
    done.Notify();
  });
  CHECK_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(20)));
  books.Set(Slot(0, 0), Book(2, 1), 0);
  waiter.join();
  CHECK(turn.ok());
}

}  // namespace
}  // namespace rebound::server
