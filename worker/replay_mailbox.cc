#include "worker/replay_mailbox.h"

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

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
}

void ReplayMailbox::Close() {
  absl::MutexLock lock(&mu_);
  open_task_ = 0;
  partials_.clear();
  held_bytes_ = 0;
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

absl::Status ReplayMailbox::PutPartial(PartialSum message) {
  const int64_t bytes = SumsBytes(message.sums());
  absl::MutexLock lock(&mu_);
  if (absl::Status admitted = Admit(message.task_id(), message.step(), bytes); !admitted.ok()) {
    return admitted;
  }
  const auto key = std::make_pair(message.step(), message.rank());
  if (partials_.count(key) > 0) return absl::OkStatus();  // a resend
  held_bytes_ += bytes;
  partials_.emplace(key, std::move(message));
  return absl::OkStatus();
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

grpc::Status WorkerPeerService::SendPartialSum(grpc::ServerContext* context,
                                               const PartialSum* request, PartialSumAck*) {
  if (absl::Status allowed = token_.Check(context); !allowed.ok()) return ToGrpcStatus(allowed);
  // Take the request's contents instead of copying ~2 MB of sums: the synchronous API's request
  // object belongs to this call, which only destroys it after the handler returns, and it is
  // not on a protobuf arena, so Swap exchanges pointers.
  PartialSum message;
  auto* owned = const_cast<PartialSum*>(request);
  if (owned->GetArena() == nullptr) {
    message.Swap(owned);
  } else {
    message = *request;
  }
  return ToGrpcStatus(mailbox_->PutPartial(std::move(message)));
}

}  // namespace rebound::worker
