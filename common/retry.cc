#include "common/retry.h"

#include <glog/logging.h>

#include "absl/strings/str_cat.h"

namespace rebound {

bool IsRetryable(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded;
}

RetryLoop::RetryLoop(const RetryPolicy& policy, const Clock* clock,
                     const absl::Notification* stop, std::string what)
    : policy_(policy),
      clock_(clock),
      stop_(stop),
      what_(std::move(what)),
      backoff_(policy.initial_backoff, policy.max_backoff,
               static_cast<uint64_t>(absl::ToUnixNanos(clock->Now()))),
      give_up_(clock->Now() + policy.give_up_after) {}

bool RetryLoop::ShouldRetry(absl::Status* status) {
  if (status->ok() || !IsRetryable(status->code())) return false;
  if (stop_ != nullptr && stop_->HasBeenNotified()) {
    *status = absl::CancelledError("stopped");
    return false;
  }
  if (clock_->Now() >= give_up_) {
    *status = absl::UnavailableError(
        absl::StrCat(what_, " failed for ", absl::ToInt64Milliseconds(policy_.give_up_after),
                     " ms: ", status->message()));
    return false;
  }
  const absl::Duration delay = backoff_.Next();
  ++retries_;
  if (policy_.log_retries) {
    LOG(WARNING) << what_ << " failed (" << *status << "); retrying in "
                 << absl::ToInt64Milliseconds(delay) << " ms";
  }
  if (clock_->WaitFor(delay, stop_)) {
    *status = absl::CancelledError("stopped");
    return false;
  }
  return true;
}

void RetryLoop::Reset() {
  backoff_.Reset();
  give_up_ = clock_->Now() + policy_.give_up_after;
}

}  // namespace rebound
