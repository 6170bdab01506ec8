// ReplayMailbox (worker/replay_mailbox.h): which replay messages a spare accepts, holds and hands
// out, and within which bounds; the same-host transport's regions (worker/shared_sums.h).

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "worker/replay_mailbox.h"
#include "worker/shared_sums.h"

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
  CHECK(mailbox.PutPartial(Partial(7, 1, 1, 4)).status().code() == absl::StatusCode::kUnavailable);
  mailbox.Open(7);
  CHECK(mailbox.PutPartial(Partial(8, 1, 1, 4)).status().code() == absl::StatusCode::kUnavailable);
  CHECK(mailbox.PutPartial(Partial(6, 1, 1, 4)).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  CHECK(mailbox.PutPartial(Partial(0, 1, 1, 4)).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(mailbox.PutPartial(Partial(7, 1, 1, 4)).ok());
  mailbox.Close();
  CHECK(mailbox.held_bytes() == 0);
  // Task 7 is over here; task 9 has not begun.
  CHECK(mailbox.PutPartial(Partial(7, 2, 1, 4)).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  CHECK(mailbox.PutPartial(Partial(9, 2, 1, 4)).status().code() == absl::StatusCode::kUnavailable);
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
  CHECK(mailbox.PutPartial(Partial(3, 5, 2, 8)).status().code() ==
        absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("a mailbox holds at most its bound") {
  ReplayMailbox mailbox(100);
  mailbox.Open(1);
  REQUIRE(mailbox.PutPartial(Partial(1, 1, 1, 20)).ok());  // 80 bytes
  CHECK(mailbox.PutPartial(Partial(1, 1, 2, 20)).status().code() ==
        absl::StatusCode::kResourceExhausted);
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

// A first message offering `region`: `floats` floats of value `value`, inline and in the slot of
// `step`.
PartialSum Offer(SharedSumsWriter* region, uint64_t task, int64_t step, int rank, int floats,
                 float value) {
  PartialSum message = Partial(task, step, rank, 0);
  std::vector<float> values(floats, value);
  message.mutable_sums()->mutable_tensors(0)->set_data(
      std::string(reinterpret_cast<const char*>(values.data()), floats * sizeof(float)));
  absl::Span<float> slot = region->Begin(step, floats);
  std::copy(values.begin(), values.end(), slot.begin());
  message.set_shm_name(region->name());
  message.set_shm_offset(region->SlotOffset(step));
  return message;
}

PartialSum Reference(const SharedSumsWriter& region, uint64_t task, int64_t step, int rank) {
  PartialSum message;
  message.set_task_id(task);
  message.set_step(step);
  message.set_rank(rank);
  message.set_shm_name(region.name());
  message.set_shm_offset(region.SlotOffset(step));
  return message;
}

TEST_CASE("a mailbox maps an offered shared-memory region that holds the inline sums, and then "
          "takes references to it") {
  auto region = SharedSumsWriter::Create(/*task_id=*/4, /*rank=*/1, /*max_floats=*/64);
  REQUIRE(region.ok());
  ReplayMailbox mailbox(1 << 20);
  mailbox.Open(4);
  // A reference before any offer: the receiver cannot read it.
  CHECK(mailbox.PutPartial(Reference(**region, 4, 1, 1)).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<bool> mapped = mailbox.PutPartial(Offer(region->get(), 4, 1, 1, 16, 2.5f));
  REQUIRE(mapped.ok());
  CHECK(*mapped);
  auto reader = mailbox.Region(1);
  REQUIRE(reader != nullptr);
  CHECK(mailbox.Region(2) == nullptr);

  // The offer's name goes away; the mapping stays and sees later steps, in the other slot.
  (*region)->Unlink();
  CHECK(SharedSumsReader::Open((*region)->name()).status().code() == absl::StatusCode::kNotFound);
  absl::Span<float> slot = (*region)->Begin(2, 16);
  std::fill(slot.begin(), slot.end(), -1.0f);
  mapped = mailbox.PutPartial(Reference(**region, 4, 2, 1));
  REQUIRE(mapped.ok());
  CHECK_FALSE(*mapped);
  auto step2 = mailbox.TakePartial(2, 1, absl::ZeroDuration());
  REQUIRE(step2.ok());
  CHECK_FALSE(step2->has_sums());
  auto floats = reader->Read(step2->shm_offset(), 4, 2, 1, 16);
  REQUIRE(floats.ok());
  CHECK(std::all_of(floats->begin(), floats->end(), [](float f) { return f == -1.0f; }));
  // Step 1's slot still holds step 1.
  auto step1 = reader->Read((*region)->SlotOffset(1), 4, 1, 1, 16);
  REQUIRE(step1.ok());
  CHECK((*step1)[15] == 2.5f);

  // The header guards against a stale slot, a wrong length or rank and reads past the end.
  CHECK(reader->Read((*region)->SlotOffset(3), 4, 3, 1, 16).status().code() ==
        absl::StatusCode::kDataLoss);  // holds step 1
  CHECK(reader->Read((*region)->SlotOffset(2), 4, 2, 1, 15).status().code() ==
        absl::StatusCode::kDataLoss);
  CHECK(reader->Read((*region)->SlotOffset(2), 4, 2, 0, 16).status().code() ==
        absl::StatusCode::kDataLoss);
  CHECK(reader->Read(1 << 20, 4, 2, 1, 16).status().code() == absl::StatusCode::kDataLoss);
  CHECK(reader->Read((*region)->SlotOffset(2), 4, 2, 1, 1 << 20).status().code() ==
        absl::StatusCode::kDataLoss);

  // A new task forgets the mapping.
  mailbox.Open(5);
  CHECK(mailbox.Region(1) == nullptr);
}

TEST_CASE("a region whose bytes differ from the inline sums is declined, and the sums are still "
          "delivered inline") {
  auto region = SharedSumsWriter::Create(6, 0, 64);
  REQUIRE(region.ok());
  ReplayMailbox mailbox(1 << 20);
  mailbox.Open(6);
  PartialSum offer = Offer(region->get(), 6, 1, 0, 8, 1.0f);
  (*region)->Begin(1, 8)[3] = 7.0f;  // not what was sent inline
  absl::StatusOr<bool> mapped = mailbox.PutPartial(offer);
  REQUIRE(mapped.ok());
  CHECK_FALSE(*mapped);
  CHECK(mailbox.Region(0) == nullptr);
  auto taken = mailbox.TakePartial(1, 0, absl::ZeroDuration());
  REQUIRE(taken.ok());
  CHECK(taken->sums().tensors(0).data().size() == 8 * sizeof(float));

  // A name that is not a replay region's is not even opened.
  offer.set_shm_name("/etc/passwd");
  offer.set_step(2);
  mapped = mailbox.PutPartial(offer);
  REQUIRE(mapped.ok());
  CHECK_FALSE(*mapped);
  CHECK(SharedSumsReader::Open("/../etc/passwd").status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("the regions of dead processes are swept, those of live ones kept") {
  auto mine = SharedSumsWriter::Create(8, 0, 4);
  REQUIRE(mine.ok());
  // A region named after a process that has exited.
  const pid_t child = fork();
  if (child == 0) _exit(0);
  REQUIRE(child > 0);
  REQUIRE(waitpid(child, nullptr, 0) == child);
  const std::string stale = absl::StrCat("/rebound-replay-", child, "-8-1-abc");
  const int fd = shm_open(stale.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  REQUIRE(fd >= 0);
  close(fd);
  CHECK(SweepStaleRegions() >= 1);
  CHECK(shm_open(stale.c_str(), O_RDONLY, 0) < 0);
  CHECK(SharedSumsReader::Open((*mine)->name()).ok());
}

}  // namespace
}  // namespace rebound::worker
