#pragma once

// The one retry policy of Rebound (docs/design.md §5.1): UNAVAILABLE and DEADLINE_EXCEEDED mean "try
// the same call again" after a capped, jittered exponential backoff, until a give-up time passes
// or the caller is told to stop; every other status ends the loop at once.
//
//   RetryLoop retry(policy, clock, stop, "Sync");
//   while (true) {
//     absl::Status status = ...one attempt...;
//     if (!retry.ShouldRetry(&status)) return status;   // OK, final error, gave up or stopped
//   }
//
// or, for one call: `absl::Status s = Retry(policy, clock, stop, "Sync", [&] { return ...; });`
//
// Thread-safety: a RetryPolicy is a value; a RetryLoop belongs to one thread. Ownership: the
// clock and `stop` are borrowed and must outlive the loop.

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/backoff.h"
#include "common/clock.h"

namespace rebound {

// The codes that mean "the same call may succeed if tried again".
bool IsRetryable(absl::StatusCode code);

struct RetryPolicy {
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(2);
  // Time without success after which the loop gives up with UNAVAILABLE naming the last error.
  // absl::InfiniteDuration() retries until stopped.
  absl::Duration give_up_after = absl::Seconds(60);
  // Log each retry at WARNING (loops that probe often turn it off).
  bool log_retries = true;
};

class RetryLoop {
 public:
  // `stop` may be null (the loop then ends only by success, a final error or giving up).
  RetryLoop(const RetryPolicy& policy, const Clock* clock, const absl::Notification* stop,
            std::string what);

  // Called after each attempt with its status. Returns true when the caller should try again
  // (after this call has waited the backoff). Returns false when the loop ends, with *status
  // left as the attempt's status (OK, or an error that is not retryable), or replaced by
  // UNAVAILABLE "<what> failed for <ms> ms: <last error>" when the give-up time has passed, or
  // by CANCELLED "stopped" when `stop` was notified.
  bool ShouldRetry(absl::Status* status);

  // A success that does not end the loop (a stream that keeps going): the backoff and the
  // give-up time start over.
  void Reset();

  // Attempts made so far that failed with a retryable status.
  int retries() const { return retries_; }

 private:
  const RetryPolicy policy_;
  const Clock* const clock_;
  const absl::Notification* const stop_;
  const std::string what_;
  Backoff backoff_;
  absl::Time give_up_;
  int retries_ = 0;
};

// Calls `attempt` (returns absl::Status) until RetryLoop::ShouldRetry says stop; returns the
// final status.
template <typename Attempt>
absl::Status Retry(const RetryPolicy& policy, const Clock* clock, const absl::Notification* stop,
                   std::string what, Attempt&& attempt) {
  RetryLoop loop(policy, clock, stop, std::move(what));
  while (true) {
    absl::Status status = attempt();
    if (!loop.ShouldRetry(&status)) return status;
  }
}

}  // namespace rebound
