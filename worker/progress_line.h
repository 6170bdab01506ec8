#pragma once

// ProgressLine: the one line a trainer logs every WorkerConfig.progress_interval_s seconds, so
// that a user watching a worker's log sees it train (docs/operations.md#progress-lines):
//
//   progress: slot (0, 1) step 1200/4000, loss 0.4123, weight 0.98, 2310 samples/s
//
// samples/s counts the steps since the line before (or since the first step seen) times the
// batch size, over the clock's time between them. A weight not known yet (before the first sync)
// and a loss this stage does not compute (a pipeline's inner stages) are written as "-".
//
// Time: the injected Clock's (a FakeClock in tests).
// Thread-safety: not thread-safe; one trainer thread calls Step. Ownership: `clock` is borrowed
// and must outlive it.

#include <cstdint>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "common/clock.h"

namespace rebound::worker {

class ProgressLine {
 public:
  // `interval` <= 0: Step never reports.
  ProgressLine(std::string slot_name, int64_t max_steps, int64_t batch_size,
               absl::Duration interval, const Clock* clock);

  // Step t finished with `loss` (NaN: none computed here); `weight` is the last sync's (nullopt:
  // none yet). Returns the line when one is due (and logs it), else nullopt. The first call only
  // starts the clock.
  std::optional<std::string> Step(int64_t t, float loss, std::optional<double> weight);

 private:
  const std::string slot_name_;
  const int64_t max_steps_;
  const int64_t batch_size_;
  const absl::Duration interval_;
  const Clock* const clock_;
  bool started_ = false;
  absl::Time last_time_;
  int64_t last_step_ = 0;
};

}  // namespace rebound::worker
