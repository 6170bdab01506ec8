// ReplayMailbox (worker/replay_mailbox.h): which replay messages a spare accepts, holds and hands
// out, and within which bounds.

#include <catch2/catch.hpp>

#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "worker/replay_mailbox.h"

namespace rebound::worker {
namespace {

PartialSum Partial(uint64_t task, int64_t step, int rank, int floats) {
  PartialSum message;
  message.set_task_id(task);
  message.set_step(step);
  message.set_rank(rank);
  Tensor* tensor = message.mutable_sums()->add_tensors();
  tensor->set_dtype(FLOAT32);
  tensor->set_data(std::string(floats * sizeof(float), static_cast<char>(rank)));
  return message;
}

TEST_CASE("a mailbox refuses messages of a task it has not opened, retryably, and of older ones "
          "for good") {
  ReplayMailbox mailbox(1 << 20);
  CHECK(mailbox.PutPartial(Partial(7, 1, 1, 4)).code() == absl::StatusCode::kUnavailable);
  mailbox.Open(7);
  CHECK(mailbox.PutPartial(Partial(8, 1, 1, 4)).code() == absl::StatusCode::kUnavailable);
  CHECK(mailbox.PutPartial(Partial(6, 1, 1, 4)).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(mailbox.PutPartial(Partial(0, 1, 1, 4)).code() == absl::StatusCode::kInvalidArgument);
  CHECK(mailbox.PutPartial(Partial(7, 1, 1, 4)).ok());
  mailbox.Close();
  CHECK(mailbox.held_bytes() == 0);
  // Task 7 is over here; task 9 has not begun.
  CHECK(mailbox.PutPartial(Partial(7, 2, 1, 4)).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(mailbox.PutPartial(Partial(9, 2, 1, 4)).code() == absl::StatusCode::kUnavailable);
  CHECK(mailbox.TakePartial(2, 1, absl::ZeroDuration()).status().code() ==
        absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("a mailbox hands out each step's messages once, drops resends and stale steps") {
  ReplayMailbox mailbox(1 << 20);
  mailbox.Open(3);
  REQUIRE(mailbox.PutPartial(Partial(3, 5, 1, 8)).ok());
  REQUIRE(mailbox.PutPartial(Partial(3, 5, 2, 8)).ok());
  REQUIRE(mailbox.PutPartial(Partial(3, 5, 1, 8)).ok());  // a resend: dropped
  CHECK(mailbox.held_bytes() == 2 * 8 * 4);
  auto second = mailbox.TakePartial(5, 2, absl::ZeroDuration());
  REQUIRE(second.ok());
  CHECK(second->rank() == 2);
  CHECK(second->sums().tensors(0).data() == std::string(32, '\2'));
  auto first = mailbox.TakePartial(5, 1, absl::ZeroDuration());
  REQUIRE(first.ok());
  CHECK(first->sums().tensors(0).data() == std::string(32, '\1'));
  CHECK(mailbox.TakePartial(5, 1, absl::Milliseconds(5)).status().code() ==
        absl::StatusCode::kDeadlineExceeded);
  CHECK(mailbox.held_bytes() == 0);
  // Moving on to step 6 drops what is left of step 5, and step 5 is refused from then on; a
  // partial of a later step waits for its turn.
  REQUIRE(mailbox.PutPartial(Partial(3, 5, 1, 8)).ok());
  REQUIRE(mailbox.PutPartial(Partial(3, 6, 1, 8)).ok());
  REQUIRE(mailbox.PutPartial(Partial(3, 7, 1, 8)).ok());
  auto next = mailbox.TakePartial(6, 1, absl::ZeroDuration());
  REQUIRE(next.ok());
  CHECK(next->step() == 6);
  CHECK(mailbox.held_bytes() == 8 * 4);  // step 7's
  CHECK(mailbox.PutPartial(Partial(3, 5, 2, 8)).code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("a mailbox holds at most its bound") {
  ReplayMailbox mailbox(100);
  mailbox.Open(1);
  REQUIRE(mailbox.PutPartial(Partial(1, 1, 1, 20)).ok());  // 80 bytes
  CHECK(mailbox.PutPartial(Partial(1, 1, 2, 20)).code() == absl::StatusCode::kResourceExhausted);
  CHECK(mailbox.held_bytes() == 80);
  REQUIRE(mailbox.TakePartial(1, 1, absl::ZeroDuration()).ok());
  CHECK(mailbox.PutPartial(Partial(1, 1, 2, 20)).ok());
}

TEST_CASE("a waiting Take wakes when its message arrives") {
  ReplayMailbox mailbox(1 << 20);
  mailbox.Open(2);
  std::thread sender([&] {
    absl::SleepFor(absl::Milliseconds(30));
    CHECK(mailbox.PutPartial(Partial(2, 1, 0, 4)).ok());
  });
  auto partial = mailbox.TakePartial(1, 0, absl::Seconds(20));
  sender.join();
  REQUIRE(partial.ok());
  CHECK(partial->task_id() == 2);
}

}  // namespace
}  // namespace rebound::worker
