#include "worker/pipeline_port.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/slot.h"
#include "common/tensor_codec.h"

namespace rebound::worker {
namespace {

int64_t PayloadBytes(const BoundaryMessage& message) {
  return static_cast<int64_t>(message.payload().value().data().size() +
                              message.payload().r_value().data().size());
}

const char* DirectionText(BoundaryDirection direction) {
  return direction == FORWARD ? "forward" : "backward";
}

}  // namespace

void PipelinePort::Open(const Shape& shape, int64_t completed_step, OwnerFn owner,
                        std::function<void()> on_unknown_sender) {
  absl::MutexLock lock(&mu_);
  open_ = true;
  shape_ = shape;
  owner_ = std::move(owner);
  on_unknown_sender_ = std::move(on_unknown_sender);
  completed_ = completed_step;
  held_.clear();
  taken_.clear();
  held_bytes_ = 0;
}

void PipelinePort::Close() {
  absl::MutexLock lock(&mu_);
  open_ = false;
  owner_ = nullptr;
  on_unknown_sender_ = nullptr;
  held_.clear();
  taken_.clear();
  held_bytes_ = 0;
  flush_ = nullptr;
}

absl::Status PipelinePort::Validate(const BoundaryMessage& message) const {
  const BoundaryDirection direction = message.payload().direction();
  const std::string what =
      absl::StrCat("boundary message (step ", message.step(), ", micro-batch ",
                   message.micro_batch(), ")");
  if (!message.has_payload()) return absl::InvalidArgumentError(what + ": no payload");
  if (direction != FORWARD && direction != BACKWARD) {
    return absl::InvalidArgumentError(what + ": direction must be FORWARD or BACKWARD");
  }
  const int s = shape_.slot.stage();
  if ((direction == FORWARD && s == 0) || (direction == BACKWARD && s == shape_.stages - 1)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": slot ", SlotName(shape_.slot),
                                                   " receives no ", DirectionText(direction),
                                                   " pairs"));
  }
  const int from_stage = direction == FORWARD ? s - 1 : s + 1;
  if (message.from_slot().replica() != shape_.slot.replica() ||
      message.from_slot().stage() != from_stage) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": a ", DirectionText(direction), " pair for slot ", SlotName(shape_.slot),
        " comes from stage ", from_stage, " of its replica, not from slot ",
        SlotName(message.from_slot())));
  }
  if (message.step() < 1) return absl::InvalidArgumentError(what + ": step must be >= 1");
  if (message.micro_batch() < 0 || message.micro_batch() >= shape_.micro_batches) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": micro_batch must be in [0, ", shape_.micro_batches, ")"));
  }
  if (message.sample_ids_size() != shape_.rows) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": needs ", shape_.rows,
                                                   " sample ids, got ",
                                                   message.sample_ids_size()));
  }
  const int64_t width = direction == FORWARD ? shape_.forward_width : shape_.backward_width;
  const Tensor& value = message.payload().value();
  const Tensor& r_value = message.payload().r_value();
  if (absl::Status valid = ValidateFloatTensor(value, what + " value"); !valid.ok()) return valid;
  if (value.shape_size() != 2 || value.shape(0) != shape_.rows || value.shape(1) != width) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the value must be ", shape_.rows, " x ", width));
  }
  if (absl::Status valid = ValidateFloatTensor(r_value, what + " r_value"); !valid.ok()) {
    return valid;
  }
  const bool r_empty = r_value.data().empty();
  if (!r_empty && (r_value.shape_size() != 2 || r_value.shape(0) != shape_.rows ||
                   r_value.shape(1) != width)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the r_value must be empty or ", shape_.rows, " x ", width));
  }
  return absl::OkStatus();
}

absl::StatusOr<BoundaryAck> PipelinePort::Put(const BoundaryMessage& message) {
  std::function<void()> on_unknown;
  absl::Status refused;
  {
    absl::MutexLock lock(&mu_);
    if (!open_) return absl::UnavailableError("no pipeline trainer runs on this worker now");
    if (message.to_slot().replica() != shape_.slot.replica() ||
        message.to_slot().stage() != shape_.slot.stage()) {
      return absl::FailedPreconditionError(absl::StrCat("this worker trains slot ",
                                                        SlotName(shape_.slot), ", not ",
                                                        SlotName(message.to_slot())));
    }
    if (absl::Status valid = Validate(message); !valid.ok()) return valid;
    const uint64_t expected = owner_ ? owner_(message.from_slot()) : 0;
    if (message.sender_incarnation() == 0 || message.sender_incarnation() != expected) {
      refused = absl::UnavailableError(absl::StrCat(
          "incarnation ", message.sender_incarnation(), " does not own slot ",
          SlotName(message.from_slot()), " as far as this trainer knows (", expected,
          "); it asks the server again"));
      on_unknown = on_unknown_sender_;
    } else {
      BoundaryAck ack;
      ack.set_receiver_incarnation(shape_.incarnation);
      const Key key{message.step(), message.payload().direction(), message.micro_batch()};
      if (message.step() <= completed_ || held_.count(key) > 0 || taken_.count(key) > 0) {
        ack.set_duplicate(true);
        return ack;
      }
      if (message.step() > completed_ + kAheadSteps) {
        return absl::UnavailableError(absl::StrCat("step ", message.step(), " is more than ",
                                                   kAheadSteps, " steps past step ", completed_,
                                                   " that this trainer has completed"));
      }
      const int64_t bytes = PayloadBytes(message);
      if (held_bytes_ + bytes > shape_.max_bytes) {
        return absl::UnavailableError(
            absl::StrCat("the boundary buffer holds ", held_bytes_, " of ", shape_.max_bytes,
                         " bytes; resend later"));
      }
      held_.emplace(key, message);
      held_bytes_ += bytes;
      return ack;
    }
  }
  if (on_unknown) on_unknown();
  return refused;
}

absl::StatusOr<BoundaryMessage> PipelinePort::Take(BoundaryDirection direction, int64_t step,
                                                   int mb, absl::Duration timeout) {
  const Key key{step, direction, mb};
  absl::MutexLock lock(&mu_);
  auto arrived = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !open_ || held_.count(key) > 0;
  };
  mu_.AwaitWithTimeout(absl::Condition(&arrived), timeout);
  if (!open_) return absl::FailedPreconditionError("the pipeline port is closed");
  auto it = held_.find(key);
  if (it == held_.end()) {
    return absl::DeadlineExceededError(absl::StrCat("no ", DirectionText(direction),
                                                    " pair of step ", step, ", micro-batch ", mb,
                                                    " yet"));
  }
  BoundaryMessage message = std::move(it->second);
  held_bytes_ -= PayloadBytes(message);
  held_.erase(it);
  taken_.insert(key);
  return message;
}

void PipelinePort::DropThroughLocked(int64_t step) {
  while (!held_.empty() && std::get<0>(held_.begin()->first) <= step) {
    held_bytes_ -= PayloadBytes(held_.begin()->second);
    held_.erase(held_.begin());
  }
  while (!taken_.empty() && std::get<0>(*taken_.begin()) <= step) taken_.erase(taken_.begin());
}

void PipelinePort::Complete(int64_t step) {
  absl::MutexLock lock(&mu_);
  if (step <= completed_) return;
  completed_ = step;
  DropThroughLocked(step);
}

void PipelinePort::SetFlush(std::function<absl::Status(absl::Duration)> flush) {
  absl::MutexLock lock(&mu_);
  flush_ = std::move(flush);
}

absl::Status PipelinePort::Flush(absl::Duration timeout) {
  std::function<absl::Status(absl::Duration)> flush;
  {
    absl::MutexLock lock(&mu_);
    flush = flush_;
  }
  if (!flush) return absl::OkStatus();
  return flush(timeout);
}

int64_t PipelinePort::held_bytes() const {
  absl::MutexLock lock(&mu_);
  return held_bytes_;
}

}  // namespace rebound::worker
