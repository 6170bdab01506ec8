#include "server/failure_detector.h"

#include <glog/logging.h>

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/slot.h"

namespace rebound::server {

absl::Duration FailureDetector::CheckPeriod(const JobConfig& job) {
  const FaultToleranceConfig& ft = job.fault_tolerance();
  int period_ms = ft.heartbeat_interval_ms() / 4;
  if (ft.crash_confirm_ms() > 0) period_ms = std::min(period_ms, ft.crash_confirm_ms() / 4);
  return absl::Milliseconds(std::max(10, std::min(100, period_ms)));
}

FailureDetector::FailureDetector(const JobConfig& job, Membership* membership,
                                 ReliabilityTracker* tracker, const Clock* clock, Hooks hooks)
    : membership_(membership),
      tracker_(tracker),
      clock_(clock),
      hooks_(std::move(hooks)),
      period_(CheckPeriod(job)),
      last_pass_(clock->Now()) {}

void FailureDetector::Run(const absl::Notification* stop) {
  while (!clock_->WaitFor(period_, stop)) CheckOnce();
}

std::vector<FailedWorker> FailureDetector::CheckOnce() {
  // Woken far later than asked: the whole server was stopped or starved, and no heartbeat
  // could arrive meanwhile. Without this, every worker would be fenced on resume.
  const absl::Time now = clock_->Now();
  const absl::Duration late = now - last_pass_ - period_;
  last_pass_ = now;
  if (late > std::max(4 * period_, absl::Milliseconds(200))) {
    LOG(WARNING) << "the server did not run for " << absl::ToInt64Milliseconds(late)
                 << " ms (stopped or starved); that time is not counted as workers' silence";
    membership_->ExcuseServerPause(late);
  }
  if (hooks_.health) {
    const absl::Status health = hooks_.health();
    if (healthy_ && !health.ok()) {
      healthy_ = false;
      LOG(ERROR) << "health: NOT_SERVING: " << health;
      if (hooks_.on_unhealthy) hooks_.on_unhealthy(health);
    }
  }
  membership_->AccountTime();
  std::vector<FailedWorker> failed = membership_->DetectFailures();
  for (const FailedWorker& worker : failed) {
    // A failure is the worker's (by name, whatever its role): it carries the score when it
    // registers again.
    tracker_->OnFault(worker.name, clock_->Now());
    if (worker.had_slot) tracker_->SetLive(worker.slot, false);
    LOG(WARNING) << "declared '" << worker.name << "' (incarnation " << worker.incarnation
                 << ") failed "
                 << (worker.crashed
                         ? absl::StrCat(absl::ToInt64Milliseconds(worker.detected_after),
                                        " ms after its session ended (crashed)")
                         : absl::StrCat("after ", absl::ToInt64Milliseconds(worker.silent_for),
                                        " ms of silence"))
                 << (worker.had_slot ? absl::StrCat("; slot ", SlotName(worker.slot), " is LOST")
                                     : std::string());
  }
  if (hooks_.after_pass) hooks_.after_pass();
  return failed;
}

}  // namespace rebound::server
