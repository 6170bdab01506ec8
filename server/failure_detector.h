#pragma once

// The server's failure detector (docs/design.md §4.3, §13): a loop that, several times per
// heartbeat interval, declares failed every worker silent for longer than failure_timeout or whose
// session ended without a reattach within crash_confirm_ms (Membership::DetectFailures), charges each failure to the worker's registered name
// (ReliabilityTracker::OnFault; the score follows the worker, not the slot, docs/design.md §4.5),
// takes a lost slot out of the weights' medians (SetLive false), watches
// the server's health, and then runs the caller's per-pass work (the recovery coordinator's
// rollback under GLOBAL_CHECKPOINT, memory housekeeping).
//
// A silent worker is declared failed at most failure_timeout + one check period after its last
// heartbeat; a crashed one at most crash_confirm_ms + one check period after its session ended. A pass that runs far later than asked (the whole server was stopped or starved) does
// not count that time as the workers' silence (Membership::ExcuseServerPause).
//
// Time: every time read and every wait goes through the injected Clock (a FakeClock in tests
// drives it pass by pass with CheckOnce).
//
// Thread-safety: Run is called by one thread (the detector's); CheckOnce must not run
// concurrently with itself or Run. The units it calls are thread-safe.
// Ownership: `membership`, `tracker` and `clock` are borrowed and must outlive the detector;
// the hooks are copied and called on the detector's thread.
// Status codes: none; problems are logged (the detector must go on).

#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "proto/config.pb.h"
#include "server/membership.h"
#include "server/reliability.h"

namespace rebound::server {

class FailureDetector {
 public:
  struct Hooks {
    // The server's health, read every pass; null: always healthy.
    std::function<absl::Status()> health;
    // Called once, on the first pass whose health is not OK (the server stops serving so that its
    // supervisor restarts it from what was acknowledged).
    std::function<void(const absl::Status&)> on_unhealthy;
    // Called at the end of every pass.
    std::function<void()> after_pass;
  };

  // The period of the checks for `job`: a quarter of the heartbeat interval or of
  // crash_confirm_ms (when set), whichever is shorter, within [10, 100] ms.
  static absl::Duration CheckPeriod(const JobConfig& job);

  // REQUIRES: `membership`, `tracker` and `clock` outlive the detector.
  FailureDetector(const JobConfig& job, Membership* membership, ReliabilityTracker* tracker,
                  const Clock* clock, Hooks hooks);

  FailureDetector(const FailureDetector&) = delete;
  FailureDetector& operator=(const FailureDetector&) = delete;

  // Checks every period (Clock::WaitFor) until `stop` is notified.
  void Run(const absl::Notification* stop);

  // One pass at the clock's now; returns the workers it declared failed.
  std::vector<FailedWorker> CheckOnce();

  absl::Duration period() const { return period_; }

 private:
  Membership* const membership_;
  ReliabilityTracker* const tracker_;
  const Clock* const clock_;
  const Hooks hooks_;
  const absl::Duration period_;
  absl::Time last_pass_;
  bool healthy_ = true;
};

}  // namespace rebound::server
