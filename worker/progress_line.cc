#include "worker/progress_line.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_format.h"
#include "glog/logging.h"

namespace rebound::worker {

ProgressLine::ProgressLine(std::string slot_name, int64_t max_steps, int64_t batch_size,
                           absl::Duration interval, const Clock* clock)
    : slot_name_(std::move(slot_name)),
      max_steps_(max_steps),
      batch_size_(batch_size),
      interval_(interval),
      clock_(clock) {}

std::optional<std::string> ProgressLine::Step(int64_t t, float loss,
                                              std::optional<double> weight) {
  if (interval_ <= absl::ZeroDuration()) return std::nullopt;
  const absl::Time now = clock_->Now();
  if (!started_) {
    started_ = true;
    last_time_ = now;
    last_step_ = t;
    return std::nullopt;
  }
  const absl::Duration elapsed = now - last_time_;
  if (elapsed < interval_) return std::nullopt;
  const double samples_per_s =
      static_cast<double>((t - last_step_) * batch_size_) / absl::ToDoubleSeconds(elapsed);
  std::string line = absl::StrFormat(
      "progress: slot %s step %d/%d, loss %s, weight %s, %.0f samples/s", slot_name_, t,
      max_steps_, std::isfinite(loss) ? absl::StrFormat("%.4f", loss) : std::string("-"),
      weight.has_value() ? absl::StrFormat("%.2f", *weight) : std::string("-"), samples_per_s);
  last_time_ = now;
  last_step_ = t;
  LOG(INFO) << line;
  return line;
}

}  // namespace rebound::worker
