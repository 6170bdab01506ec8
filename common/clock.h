#pragma once

// The one way Rebound's code reads time and waits: an injectable clock, so that time-dependent
// logic (failure detection, weights, retries, checkpoints, replays) is tested with a fake clock
// instead of sleeps.
//
// Thread-safety: every Clock is safe to use from any number of threads. Ownership: a Clock is
// passed by pointer and must outlive whatever holds it; DefaultClock() lives for the process.

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace rebound {

class Clock {
 public:
  virtual ~Clock() = default;

  virtual absl::Time Now() const = 0;

  // Waits for `duration` or until `stop` (may be null) is notified, whichever comes first.
  // Returns true iff `stop` was notified. A non-positive duration returns at once.
  virtual bool WaitFor(absl::Duration duration, const absl::Notification* stop) const = 0;
};

// Wall-clock time; waits really sleep.
class RealClock : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
  bool WaitFor(absl::Duration duration, const absl::Notification* stop) const override {
    if (stop == nullptr) {
      if (duration > absl::ZeroDuration()) absl::SleepFor(duration);
      return false;
    }
    return stop->WaitForNotificationWithTimeout(duration);
  }
};

// The process's real clock, for code that is not given one.
inline Clock* DefaultClock() {
  static RealClock* const clock = new RealClock;
  return clock;
}

// A clock that moves only when told to: by Advance(), or by a WaitFor() (which advances it by the
// whole duration unless `stop` is already notified, and never blocks). Thread-safe.
class FakeClock : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::UnixEpoch() + absl::Hours(24)) : now_(start) {}
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  bool WaitFor(absl::Duration duration, const absl::Notification* stop) const override {
    if (stop != nullptr && stop->HasBeenNotified()) return true;
    if (duration > absl::ZeroDuration()) {
      absl::MutexLock lock(&mu_);
      now_ += duration;
    }
    return stop != nullptr && stop->HasBeenNotified();
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  mutable absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rebound
