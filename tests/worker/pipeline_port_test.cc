// PipelinePort (worker/pipeline_port.h): which boundary messages the receiving trainer accepts,
// with which status code, what it holds and hands out, and when it forgets.

#include "worker/pipeline_port.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/tensor_codec.h"

namespace rebound::worker {
namespace {

using Catch::Matchers::Contains;

// The trainer of slot (0, 1) in a 1 x 3 pipeline: FORWARD pairs of 3 x 4 from stage 0 (owned by
// incarnation 10), BACKWARD pairs of 3 x 2 from stage 2 (owned by incarnation 30).
constexpr uint64_t kIncarnation = 42;
constexpr uint64_t kStage0Owner = 10;
constexpr uint64_t kStage2Owner = 30;
constexpr int kRows = 3;
constexpr int kForwardWidth = 4;
constexpr int kBackwardWidth = 2;
constexpr int kMicroBatches = 2;
// Payload bytes: a forward message carries value and r_value (2 x 3 x 4 floats), a backward one
// its value only (3 x 2 floats; the r_value is {0, 2} without data).
constexpr int64_t kForwardBytes = 2 * kRows * kForwardWidth * 4;  // 96
constexpr int64_t kBackwardBytes = kRows * kBackwardWidth * 4;    // 24

SlotId Slot(int replica, int stage) {
  SlotId slot;
  slot.set_replica(replica);
  slot.set_stage(stage);
  return slot;
}

PipelinePort::Shape MiddleShape() {
  PipelinePort::Shape shape;
  shape.slot = Slot(0, 1);
  shape.incarnation = kIncarnation;
  shape.stages = 3;
  shape.micro_batches = kMicroBatches;
  shape.rows = kRows;
  shape.forward_width = kForwardWidth;
  shape.backward_width = kBackwardWidth;
  return shape;
}

uint64_t Owner(const SlotId& slot) {
  if (slot.replica() != 0) return 0;
  if (slot.stage() == 0) return kStage0Owner;
  if (slot.stage() == 2) return kStage2Owner;
  return 0;
}

// `count` floats whose values tell step, micro-batch and position apart.
std::vector<float> Values(int64_t step, int mb, int count, float offset) {
  std::vector<float> values;
  for (int i = 0; i < count; ++i) {
    values.push_back(offset + static_cast<float>(step * 1000 + mb * 100 + i));
  }
  return values;
}

BoundaryMessage Forward(int64_t step, int mb) {
  BoundaryMessage message;
  message.set_sender_incarnation(kStage0Owner);
  *message.mutable_from_slot() = Slot(0, 0);
  *message.mutable_to_slot() = Slot(0, 1);
  message.set_step(step);
  message.set_micro_batch(mb);
  for (int k = 0; k < kRows; ++k) message.add_sample_ids(step * 100 + mb * kRows + k);
  BoundaryPayload* payload = message.mutable_payload();
  payload->set_direction(FORWARD);
  *payload->mutable_value() = MakeFloatTensor(0, "value", {kRows, kForwardWidth},
                                              Values(step, mb, kRows * kForwardWidth, 0.5f));
  *payload->mutable_r_value() = MakeFloatTensor(1, "r_value", {kRows, kForwardWidth},
                                                Values(step, mb, kRows * kForwardWidth, 0.25f));
  return message;
}

BoundaryMessage Backward(int64_t step, int mb) {
  BoundaryMessage message;
  message.set_sender_incarnation(kStage2Owner);
  *message.mutable_from_slot() = Slot(0, 2);
  *message.mutable_to_slot() = Slot(0, 1);
  message.set_step(step);
  message.set_micro_batch(mb);
  for (int k = 0; k < kRows; ++k) message.add_sample_ids(step * 100 + mb * kRows + k);
  BoundaryPayload* payload = message.mutable_payload();
  payload->set_direction(BACKWARD);
  *payload->mutable_value() = MakeFloatTensor(0, "value", {kRows, kBackwardWidth},
                                              Values(step, mb, kRows * kBackwardWidth, -0.5f));
  *payload->mutable_r_value() = MakeFloatTensor(1, "r_value", {0, kBackwardWidth}, {});
  return message;
}

absl::StatusCode CodeOf(const absl::StatusOr<BoundaryAck>& ack) { return ack.status().code(); }

// Put must acknowledge `message` as new (held), naming this trainer's incarnation.
void PutNew(PipelinePort& port, const BoundaryMessage& message) {
  absl::StatusOr<BoundaryAck> ack = port.Put(message);
  INFO(ack.status().ToString());
  REQUIRE(ack.ok());
  CHECK_FALSE(ack->duplicate());
  CHECK(ack->receiver_incarnation() == kIncarnation);
}

// Put must acknowledge `message` as a duplicate, naming this trainer's incarnation.
void PutDuplicate(PipelinePort& port, const BoundaryMessage& message) {
  absl::StatusOr<BoundaryAck> ack = port.Put(message);
  INFO(ack.status().ToString());
  REQUIRE(ack.ok());
  CHECK(ack->duplicate());
  CHECK(ack->receiver_incarnation() == kIncarnation);
}

// A Take of (direction, step, mb) with a 30 s timeout, blocked on a thread of its own from
// construction; Join() waits for it to return.
class BlockedTake {
 public:
  BlockedTake(PipelinePort& port, BoundaryDirection direction, int64_t step, int mb)
      : thread_([this, &port, direction, step, mb] {
          started_.Notify();
          const absl::Time start = absl::Now();
          taken_ = port.Take(direction, step, mb, absl::Seconds(30));
          waited_ = absl::Now() - start;
        }) {
    started_.WaitForNotification();
  }
  ~BlockedTake() {
    if (thread_.joinable()) thread_.join();
  }

  // What the Take returned, and how long it waited.
  const absl::StatusOr<BoundaryMessage>& Join() {
    if (thread_.joinable()) thread_.join();
    return taken_;
  }
  absl::Duration waited() const { return waited_; }

 private:
  absl::Notification started_;
  absl::StatusOr<BoundaryMessage> taken_ = absl::UnknownError("not run");
  absl::Duration waited_;
  std::thread thread_;  // last: it starts once the members it writes exist
};

TEST_CASE("a closed port answers UNAVAILABLE to senders and FAILED_PRECONDITION to Take") {
  PipelinePort port;
  CHECK(CodeOf(port.Put(Forward(1, 0))) == absl::StatusCode::kUnavailable);
  CHECK(port.Take(FORWARD, 1, 0, absl::ZeroDuration()).status().code() ==
        absl::StatusCode::kFailedPrecondition);

  port.Open(MiddleShape(), 0, Owner, nullptr);
  PutNew(port, Forward(1, 0));
  CHECK(port.held_bytes() == kForwardBytes);
  port.Close();
  // Closing forgets what was held.
  CHECK(port.held_bytes() == 0);
  CHECK(CodeOf(port.Put(Forward(1, 1))) == absl::StatusCode::kUnavailable);
  CHECK(port.Take(FORWARD, 1, 0, absl::ZeroDuration()).status().code() ==
        absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("a malformed boundary message is INVALID_ARGUMENT and nothing is held") {
  PipelinePort port;
  port.Open(MiddleShape(), 0, Owner, nullptr);
  BoundaryMessage message = Forward(1, 0);
  std::string why;
  SECTION("no payload") {
    message.clear_payload();
    why = "no payload";
  }
  SECTION("no direction") {
    message.mutable_payload()->clear_direction();
    why = "direction must be FORWARD or BACKWARD";
  }
  SECTION("a forward pair that comes from stage 2") {
    message.set_sender_incarnation(kStage2Owner);
    *message.mutable_from_slot() = Slot(0, 2);
    why = "comes from stage 0 of its replica, not from slot (0, 2)";
  }
  SECTION("a backward pair that comes from stage 0") {
    message = Backward(1, 0);
    message.set_sender_incarnation(kStage0Owner);
    *message.mutable_from_slot() = Slot(0, 0);
    why = "comes from stage 2 of its replica, not from slot (0, 0)";
  }
  SECTION("a forward pair from another replica's stage 0") {
    *message.mutable_from_slot() = Slot(1, 0);
    why = "not from slot (1, 0)";
  }
  SECTION("step 0") {
    message.set_step(0);
    why = "step must be >= 1";
  }
  SECTION("micro-batch M") {
    message.set_micro_batch(kMicroBatches);
    why = "micro_batch must be in [0, 2)";
  }
  SECTION("micro-batch -1") {
    message.set_micro_batch(-1);
    why = "micro_batch must be in [0, 2)";
  }
  SECTION("one sample id too few") {
    message.mutable_sample_ids()->RemoveLast();
    why = "needs 3 sample ids, got 2";
  }
  SECTION("a value of the backward width") {
    *message.mutable_payload()->mutable_value() =
        MakeFloatTensor(0, "value", {kRows, kBackwardWidth}, Values(1, 0, kRows * 2, 0));
    why = "the value must be 3 x 4";
  }
  SECTION("a value of one row too many") {
    *message.mutable_payload()->mutable_value() =
        MakeFloatTensor(0, "value", {kRows + 1, kForwardWidth}, Values(1, 0, 16, 0));
    why = "the value must be 3 x 4";
  }
  SECTION("a value whose bytes do not match its shape") {
    message.mutable_payload()->mutable_value()->mutable_data()->resize(11 * 4);
    why = "44 data bytes, shape needs 48";
  }
  SECTION("a value that is not FLOAT32") {
    message.mutable_payload()->mutable_value()->clear_dtype();
    why = "dtype must be FLOAT32";
  }
  SECTION("an r_value of another shape") {
    *message.mutable_payload()->mutable_r_value() =
        MakeFloatTensor(1, "r_value", {kRows, kForwardWidth - 1}, Values(1, 0, 9, 0));
    why = "the r_value must be empty or 3 x 4";
  }
  SECTION("an r_value whose shape promises data it lacks") {
    message.mutable_payload()->mutable_r_value()->clear_data();
    why = "0 data bytes, shape needs 48";
  }
  absl::StatusOr<BoundaryAck> ack = port.Put(message);
  CHECK(CodeOf(ack) == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(ack.status().message()), Contains(why));
  CHECK(port.held_bytes() == 0);
  CHECK(port.Take(FORWARD, 1, 0, absl::ZeroDuration()).status().code() ==
        absl::StatusCode::kDeadlineExceeded);
}

TEST_CASE("the first and the last stage refuse the pairs they never receive") {
  PipelinePort port;
  PipelinePort::Shape shape = MiddleShape();
  SECTION("stage 0 gets no FORWARD pair") {
    shape.slot = Slot(0, 0);
    shape.forward_width = 0;
    port.Open(shape, 0, Owner, nullptr);
    BoundaryMessage message = Forward(1, 0);
    *message.mutable_to_slot() = Slot(0, 0);
    absl::StatusOr<BoundaryAck> ack = port.Put(message);
    CHECK(CodeOf(ack) == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(ack.status().message()), Contains("slot (0, 0) receives no forward"));
  }
  SECTION("stage S-1 gets no BACKWARD pair") {
    shape.slot = Slot(0, 2);
    shape.backward_width = 0;
    port.Open(shape, 0, Owner, nullptr);
    BoundaryMessage message = Backward(1, 0);
    *message.mutable_to_slot() = Slot(0, 2);
    absl::StatusOr<BoundaryAck> ack = port.Put(message);
    CHECK(CodeOf(ack) == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(ack.status().message()), Contains("slot (0, 2) receives no backward"));
  }
  CHECK(port.held_bytes() == 0);
}

TEST_CASE("a message for another slot is FAILED_PRECONDITION: the sender's view is stale") {
  PipelinePort port;
  port.Open(MiddleShape(), 0, Owner, nullptr);
  BoundaryMessage message = Forward(1, 0);
  SECTION("another stage of this replica") { *message.mutable_to_slot() = Slot(0, 2); }
  SECTION("the same stage of another replica") { *message.mutable_to_slot() = Slot(1, 1); }
  absl::StatusOr<BoundaryAck> ack = port.Put(message);
  CHECK(CodeOf(ack) == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(ack.status().message()), Contains("this worker trains slot (0, 1)"));
  CHECK(port.held_bytes() == 0);
}

TEST_CASE("a sender that is not the known neighbour incarnation is UNAVAILABLE and reported") {
  PipelinePort port;
  int unknown_calls = 0;
  int64_t held_seen_by_callback = -1;
  // The callback runs outside the port's lock: it may call into the port (a heartbeat would).
  port.Open(MiddleShape(), 0, Owner, [&] {
    ++unknown_calls;
    held_seen_by_callback = port.held_bytes();
  });
  PutNew(port, Backward(1, 0));

  BoundaryMessage message = Forward(1, 0);
  SECTION("a stale incarnation of the neighbour") { message.set_sender_incarnation(11); }
  SECTION("no incarnation at all") { message.set_sender_incarnation(0); }
  SECTION("the other neighbour's incarnation") { message.set_sender_incarnation(kStage2Owner); }
  absl::StatusOr<BoundaryAck> ack = port.Put(message);
  CHECK(CodeOf(ack) == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(ack.status().message()), Contains("does not own slot (0, 0)"));
  CHECK(unknown_calls == 1);
  CHECK(held_seen_by_callback == kBackwardBytes);
  CHECK(port.held_bytes() == kBackwardBytes);
  CHECK(port.Take(FORWARD, 1, 0, absl::ZeroDuration()).status().code() ==
        absl::StatusCode::kDeadlineExceeded);

  // Refusals of other kinds do not call it.
  message = Forward(1, 0);
  message.set_micro_batch(kMicroBatches);
  CHECK(CodeOf(port.Put(message)) == absl::StatusCode::kInvalidArgument);
  CHECK(CodeOf(port.Put(Forward(PipelinePort::kAheadSteps + 1, 0))) ==
        absl::StatusCode::kUnavailable);
  CHECK(unknown_calls == 1);
  // The known incarnation goes through.
  PutNew(port, Forward(1, 0));
}

TEST_CASE("an unknown sender is refused without a callback, and when no owner is known") {
  PipelinePort port;
  SECTION("no on_unknown_sender") {
    port.Open(MiddleShape(), 0, Owner, nullptr);
    BoundaryMessage stranger = Forward(1, 1);
    stranger.set_sender_incarnation(99);
    absl::StatusOr<BoundaryAck> ack = port.Put(stranger);
    CHECK(CodeOf(ack) == absl::StatusCode::kUnavailable);
    CHECK_THAT(
        std::string(ack.status().message()),
        Contains("incarnation 99 does not own slot (0, 0) as far as this trainer knows (10)"));
  }
  SECTION("an owner function that knows nobody") {
    port.Open(
        MiddleShape(), 0, [](const SlotId&) { return uint64_t{0}; }, nullptr);
    absl::StatusOr<BoundaryAck> ack = port.Put(Forward(1, 0));
    CHECK(CodeOf(ack) == absl::StatusCode::kUnavailable);
    CHECK_THAT(std::string(ack.status().message()), Contains("as far as this trainer knows (0)"));
    // Incarnation 0 never matches an unknown owner.
    BoundaryMessage nobody = Forward(1, 1);
    nobody.set_sender_incarnation(0);
    CHECK(CodeOf(port.Put(nobody)) == absl::StatusCode::kUnavailable);
  }
  SECTION("no owner function") {
    port.Open(MiddleShape(), 0, nullptr, nullptr);
    CHECK(CodeOf(port.Put(Forward(1, 0))) == absl::StatusCode::kUnavailable);
  }
  CHECK(port.held_bytes() == 0);
}

TEST_CASE("a message more than kAheadSteps past the completed step is UNAVAILABLE") {
  REQUIRE(PipelinePort::kAheadSteps == 2);
  PipelinePort port;
  port.Open(MiddleShape(), /*completed_step=*/5, Owner, nullptr);
  absl::StatusOr<BoundaryAck> ack = port.Put(Forward(8, 0));
  CHECK(CodeOf(ack) == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(ack.status().message()),
             Contains("step 8 is more than 2 steps past step 5"));
  CHECK(port.held_bytes() == 0);
  PutNew(port, Forward(7, 0));
  PutNew(port, Backward(6, 1));
  CHECK(port.held_bytes() == kForwardBytes + kBackwardBytes);

  port.Complete(6);
  // Step 6's message is dropped with it; step 8 is now within reach, step 9 is not.
  CHECK(port.held_bytes() == kForwardBytes);
  PutNew(port, Forward(8, 0));
  CHECK(CodeOf(port.Put(Forward(9, 0))) == absl::StatusCode::kUnavailable);
  CHECK(port.held_bytes() == 2 * kForwardBytes);
}

TEST_CASE("a port that holds max_bytes refuses more with UNAVAILABLE until a Take frees room") {
  PipelinePort port;
  PipelinePort::Shape shape = MiddleShape();
  shape.max_bytes = kForwardBytes + kBackwardBytes;  // 120
  port.Open(shape, 0, Owner, nullptr);
  PutNew(port, Forward(1, 0));
  PutNew(port, Backward(1, 0));
  CHECK(port.held_bytes() == 120);  // exactly full is allowed

  absl::StatusOr<BoundaryAck> full = port.Put(Backward(1, 1));
  CHECK(CodeOf(full) == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(full.status().message()),
             Contains("the boundary buffer holds 120 of 120 bytes"));
  CHECK(port.held_bytes() == 120);
  // A duplicate of a held message is still acknowledged when the buffer is full.
  PutDuplicate(port, Forward(1, 0));

  REQUIRE(port.Take(BACKWARD, 1, 0, absl::ZeroDuration()).ok());
  CHECK(port.held_bytes() == kForwardBytes);
  PutNew(port, Backward(1, 1));
  CHECK(port.held_bytes() == 120);
  // A forward message (96 bytes) does not fit in what is left.
  CHECK(CodeOf(port.Put(Forward(1, 1))) == absl::StatusCode::kUnavailable);
  REQUIRE(port.Take(FORWARD, 1, 0, absl::ZeroDuration()).ok());
  PutNew(port, Forward(1, 1));
  CHECK(port.held_bytes() == 120);
}

TEST_CASE("resends of held, taken and completed messages are OK duplicates and dropped") {
  PipelinePort port;
  port.Open(MiddleShape(), /*completed_step=*/3, Owner, nullptr);
  SECTION("a step already completed when the port opened") {
    PutDuplicate(port, Forward(3, 0));
    PutDuplicate(port, Backward(1, 1));
    CHECK(port.held_bytes() == 0);
    CHECK(port.Take(FORWARD, 3, 0, absl::ZeroDuration()).status().code() ==
          absl::StatusCode::kDeadlineExceeded);
  }
  SECTION("a message already held") {
    PutNew(port, Forward(4, 1));
    BoundaryMessage resend = Forward(4, 1);
    resend.mutable_payload()->mutable_value()->set_name("changed");
    PutDuplicate(port, resend);
    CHECK(port.held_bytes() == kForwardBytes);
    absl::StatusOr<BoundaryMessage> taken = port.Take(FORWARD, 4, 1, absl::ZeroDuration());
    REQUIRE(taken.ok());
    CHECK(taken->payload().value().name() == "value");  // the first one stands
  }
  SECTION("a message already taken") {
    PutNew(port, Backward(5, 0));
    REQUIRE(port.Take(BACKWARD, 5, 0, absl::ZeroDuration()).ok());
    PutDuplicate(port, Backward(5, 0));
    CHECK(port.held_bytes() == 0);
    CHECK(port.Take(BACKWARD, 5, 0, absl::ZeroDuration()).status().code() ==
          absl::StatusCode::kDeadlineExceeded);
  }
  SECTION("the same key in the other direction is not a duplicate") {
    PutNew(port, Forward(4, 0));
    PutNew(port, Backward(4, 0));
    CHECK(port.held_bytes() == kForwardBytes + kBackwardBytes);
  }
}

TEST_CASE("Take hands out exactly the message asked for, once") {
  PipelinePort port;
  port.Open(MiddleShape(), 0, Owner, nullptr);
  const BoundaryMessage forward = Forward(2, 1);
  const BoundaryMessage backward = Backward(2, 1);
  PutNew(port, Forward(2, 0));
  PutNew(port, forward);
  PutNew(port, backward);
  CHECK(port.held_bytes() == 2 * kForwardBytes + kBackwardBytes);

  absl::StatusOr<BoundaryMessage> taken = port.Take(BACKWARD, 2, 1, absl::ZeroDuration());
  REQUIRE(taken.ok());
  CHECK(taken->SerializeAsString() == backward.SerializeAsString());
  CHECK(taken->payload().r_value().shape(0) == 0);
  CHECK(taken->payload().r_value().data().empty());
  CHECK(port.held_bytes() == 2 * kForwardBytes);

  taken = port.Take(FORWARD, 2, 1, absl::ZeroDuration());
  REQUIRE(taken.ok());
  CHECK(taken->SerializeAsString() == forward.SerializeAsString());
  CHECK(taken->sample_ids(0) == 203);
  CHECK(port.held_bytes() == kForwardBytes);

  // Taken once: a second Take waits for its timeout.
  const absl::Time start = absl::Now();
  absl::StatusOr<BoundaryMessage> again = port.Take(FORWARD, 2, 1, absl::Milliseconds(50));
  CHECK(again.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK_THAT(std::string(again.status().message()),
             Contains("no forward pair of step 2, micro-batch 1 yet"));
  CHECK(absl::Now() - start >= absl::Milliseconds(40));  // it waited, give or take the timer
  // Nor does another key's message answer it.
  CHECK(port.Take(BACKWARD, 2, 0, absl::ZeroDuration()).status().code() ==
        absl::StatusCode::kDeadlineExceeded);
  CHECK(port.held_bytes() == kForwardBytes);
}

TEST_CASE("a Take blocked in another thread is woken by the Put it waits for") {
  PipelinePort port;
  port.Open(MiddleShape(), 0, Owner, nullptr);
  BlockedTake taker(port, FORWARD, 1, 1);
  absl::SleepFor(absl::Milliseconds(50));
  PutNew(port, Forward(1, 0));  // another key: the taker keeps waiting
  absl::SleepFor(absl::Milliseconds(20));
  PutNew(port, Forward(1, 1));
  const absl::StatusOr<BoundaryMessage>& taken = taker.Join();
  REQUIRE(taken.ok());
  CHECK(taken->SerializeAsString() == Forward(1, 1).SerializeAsString());
  CHECK(taker.waited() < absl::Seconds(10));
  CHECK(port.held_bytes() == kForwardBytes);  // (1, 0) is still held
}

TEST_CASE("a Take blocked in another thread is woken by Close with FAILED_PRECONDITION") {
  PipelinePort port;
  port.Open(MiddleShape(), 0, Owner, nullptr);
  BlockedTake taker(port, BACKWARD, 1, 0);
  absl::SleepFor(absl::Milliseconds(50));
  port.Close();
  const absl::StatusOr<BoundaryMessage>& taken = taker.Join();
  CHECK(taken.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(taken.status().message()), Contains("closed"));
  CHECK(taker.waited() < absl::Seconds(10));
}

TEST_CASE("Complete drops the held messages of completed steps and makes them duplicates") {
  PipelinePort port;
  port.Open(MiddleShape(), 0, Owner, nullptr);
  PutNew(port, Forward(1, 0));
  PutNew(port, Backward(1, 1));
  PutNew(port, Forward(2, 0));
  PutNew(port, Backward(2, 0));
  REQUIRE(port.Take(BACKWARD, 2, 0, absl::ZeroDuration()).ok());
  CHECK(port.held_bytes() == 2 * kForwardBytes + kBackwardBytes);

  port.Complete(1);
  CHECK(port.held_bytes() == kForwardBytes);  // only step 2's forward message is left
  CHECK(port.Take(FORWARD, 1, 0, absl::ZeroDuration()).status().code() ==
        absl::StatusCode::kDeadlineExceeded);
  PutDuplicate(port, Forward(1, 0));
  PutDuplicate(port, Forward(1, 1));  // never received, but its step is done
  CHECK(port.held_bytes() == kForwardBytes);
  // Step 2's taken key is still remembered.
  PutDuplicate(port, Backward(2, 0));

  // Completing an older step again changes nothing.
  port.Complete(0);
  CHECK(port.held_bytes() == kForwardBytes);
  PutDuplicate(port, Forward(1, 1));
  PutNew(port, Forward(3, 0));  // still within kAheadSteps of step 1
  CHECK(CodeOf(port.Put(Forward(4, 0))) == absl::StatusCode::kUnavailable);

  port.Complete(3);
  CHECK(port.held_bytes() == 0);
  PutDuplicate(port, Forward(2, 0));
  PutDuplicate(port, Backward(3, 1));
  PutNew(port, Forward(4, 0));
  CHECK(port.held_bytes() == kForwardBytes);
}

TEST_CASE("a new Open forgets what an earlier one held and starts at its completed step") {
  PipelinePort port;
  port.Open(MiddleShape(), 0, Owner, nullptr);
  PutNew(port, Forward(1, 0));
  PutNew(port, Backward(2, 0));
  REQUIRE(port.Take(BACKWARD, 2, 0, absl::ZeroDuration()).ok());

  PipelinePort::Shape shape = MiddleShape();
  shape.incarnation = 43;
  port.Open(shape, /*completed_step=*/0, Owner, nullptr);
  CHECK(port.held_bytes() == 0);
  CHECK(port.Take(FORWARD, 1, 0, absl::ZeroDuration()).status().code() ==
        absl::StatusCode::kDeadlineExceeded);
  // The taken key is forgotten too, and acks name the new incarnation.
  absl::StatusOr<BoundaryAck> ack = port.Put(Backward(2, 0));
  REQUIRE(ack.ok());
  CHECK_FALSE(ack->duplicate());
  CHECK(ack->receiver_incarnation() == 43);
}

TEST_CASE("Flush runs the step log's flush with the timeout, or does nothing without one") {
  PipelinePort port;
  CHECK(port.Flush(absl::Seconds(1)).ok());  // nothing to flush

  absl::Duration asked = absl::ZeroDuration();
  int calls = 0;
  port.SetFlush([&](absl::Duration timeout) {
    ++calls;
    asked = timeout;
    return absl::UnavailableError("the server does not answer");
  });
  absl::Status flushed = port.Flush(absl::Milliseconds(1500));
  CHECK(flushed.code() == absl::StatusCode::kUnavailable);
  CHECK(flushed.message() == "the server does not answer");
  CHECK(calls == 1);
  CHECK(asked == absl::Milliseconds(1500));

  port.SetFlush([&](absl::Duration) {
    ++calls;
    return absl::OkStatus();
  });
  CHECK(port.Flush(absl::Seconds(2)).ok());
  CHECK(calls == 2);

  port.SetFlush(nullptr);
  CHECK(port.Flush(absl::Seconds(1)).ok());
  CHECK(calls == 2);
}

}  // namespace
}  // namespace rebound::worker
