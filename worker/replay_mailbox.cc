#include "worker/replay_mailbox.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "glog/logging.h"

namespace rebound::worker {
namespace {

int64_t SumsBytes(const TensorBundle& sums) {
  int64_t bytes = 0;
  for (const Tensor& tensor : sums.tensors()) bytes += static_cast<int64_t>(tensor.data().size());
  return bytes;
}

}  // namespace

void ReplayMailbox::Open(uint64_t task_id) {
  absl::MutexLock lock(&mu_);
  open_task_ = task_id;
  last_task_ = std::max(last_task_, task_id);
  floor_step_ = 0;
  partials_.clear();
  held_bytes_ = 0;
  regions_.clear();
}

void ReplayMailbox::Close() {
  absl::MutexLock lock(&mu_);
  open_task_ = 0;
  partials_.clear();
  held_bytes_ = 0;
  regions_.clear();
}

std::shared_ptr<const SharedSumsReader> ReplayMailbox::Region(int rank) const {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(rank);
  return it == regions_.end() ? nullptr : it->second;
}

std::shared_ptr<const SharedSumsReader> ReplayMailbox::MapOffered(const PartialSum& message) {
  absl::StatusOr<std::unique_ptr<SharedSumsReader>> region =
      SharedSumsReader::Open(message.shm_name());
  if (!region.ok()) {
    LOG(INFO) << "spare rank " << message.rank() << "'s shared memory is not usable here ("
              << region.status() << "); its sums come inline";
    return nullptr;
  }
  int64_t floats = 0;
  for (const Tensor& tensor : message.sums().tensors()) {
    // Whole floats only: the comparison below covers every byte, and Read checked whole floats.
    if (tensor.data().size() % sizeof(float) != 0) {
      LOG(WARNING) << "spare rank " << message.rank() << " sent sums that are not whole floats; "
                   << "its region is not used";
      return nullptr;
    }
    floats += static_cast<int64_t>(tensor.data().size() / sizeof(float));
  }
  absl::StatusOr<absl::Span<const float>> held = (*region)->Read(
      message.shm_offset(), message.task_id(), message.step(), message.rank(), floats);
  bool same = held.ok();
  const float* at = same ? held->data() : nullptr;
  for (const Tensor& tensor : message.sums().tensors()) {
    if (!same) break;
    same = std::memcmp(at, tensor.data().data(), tensor.data().size()) == 0;
    at += tensor.data().size() / sizeof(float);
  }
  if (!same) {
    // Same name, other bytes: another host's /dev/shm (or a bug); inline it stays.
    LOG(WARNING) << "spare rank " << message.rank() << "'s region " << message.shm_name()
                 << " does not hold the sums it sent ("
                 << (held.ok() ? "different bytes" : held.status().ToString())
                 << "); its sums come inline";
    return nullptr;
  }
  return std::shared_ptr<const SharedSumsReader>(*std::move(region));
}

int64_t ReplayMailbox::held_bytes() const {
  absl::MutexLock lock(&mu_);
  return held_bytes_;
}

absl::Status ReplayMailbox::Admit(uint64_t task_id, int64_t step, int64_t bytes) {
  if (task_id == 0) return absl::InvalidArgumentError("task_id must be set");
  if (open_task_ == 0 ? task_id > last_task_ : task_id > open_task_) {
    return absl::UnavailableError(
        absl::StrCat("not replaying task ", task_id, " yet; send again shortly"));
  }
  if (task_id != open_task_) {
    return absl::FailedPreconditionError(absl::StrCat("replay task ", task_id, " is over here"));
  }
  if (step < floor_step_) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " of replay task ", task_id, " is over here"));
  }
  if (held_bytes_ + bytes > max_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "replay mailbox full: ", held_bytes_, " bytes held, ", bytes, " more, bound ", max_bytes_));
  }
  return absl::OkStatus();
}

void ReplayMailbox::DropBefore(int64_t step) {
  floor_step_ = std::max(floor_step_, step);
  for (auto it = partials_.begin(); it != partials_.end() && it->first.first < step;) {
    held_bytes_ -= SumsBytes(it->second.sums());
    it = partials_.erase(it);
  }
}

absl::StatusOr<bool> ReplayMailbox::PutPartial(PartialSum message) {
  const int64_t bytes = SumsBytes(message.sums());
  const bool offered = message.has_shm_name() && message.has_sums();
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(Admit(message.task_id(), message.step(), bytes));
  }
  // Mapped and compared outside the lock; admitted again below (the task may have moved on).
  std::shared_ptr<const SharedSumsReader> region = offered ? MapOffered(message) : nullptr;
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(Admit(message.task_id(), message.step(), bytes));
  if (message.has_shm_name() && !message.has_sums()) {
    auto it = regions_.find(message.rank());
    if (it == regions_.end() || it->second->name() != message.shm_name()) {
      return absl::FailedPreconditionError(
          absl::StrCat("spare rank ", message.rank(), " sent a reference to ",
                       message.shm_name(), ", which this spare has not mapped; send inline"));
    }
  }
  if (region != nullptr) regions_[message.rank()] = std::move(region);
  const bool mapped = offered && regions_.count(message.rank()) > 0;
  const auto key = std::make_pair(message.step(), message.rank());
  if (partials_.count(key) > 0) return mapped;  // a resend
  held_bytes_ += bytes;
  partials_.emplace(key, std::move(message));
  return mapped;
}

absl::StatusOr<PartialSum> ReplayMailbox::TakePartial(int64_t step, int rank,
                                                      absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  if (open_task_ == 0) return absl::FailedPreconditionError("no replay task is open");
  DropBefore(step);
  const auto key = std::make_pair(step, rank);
  auto arrived = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return partials_.count(key) > 0;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&arrived), timeout)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "no partial sum of step ", step, " from spare rank ", rank, " within ",
        absl::FormatDuration(timeout)));
  }
  auto it = partials_.find(key);
  PartialSum message = std::move(it->second);
  held_bytes_ -= SumsBytes(message.sums());
  partials_.erase(it);
  return message;
}

}  // namespace rebound::worker
