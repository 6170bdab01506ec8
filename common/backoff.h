#pragma once

// Capped exponential backoff with jitter: initial, 2x initial, ... up to max, each delay drawn
// uniformly from [delay/2, delay] so that many workers retrying after a server restart spread
// out. Not thread-safe.

#include <cstdint>
#include <random>

#include "absl/time/time.h"

namespace rebound {

class Backoff {
 public:
  // REQUIRES: 0 < initial <= max.
  Backoff(absl::Duration initial, absl::Duration max, uint64_t seed)
      : initial_(initial), max_(max), current_(initial), rng_(seed) {}

  // The delay before the next retry; doubles the base delay up to the cap.
  absl::Duration Next() {
    const absl::Duration base = current_;
    current_ = std::min(max_, current_ * 2);
    std::uniform_real_distribution<double> fraction(0.5, 1.0);
    return base * fraction(rng_);
  }

  // Back to the initial delay after a success.
  void Reset() { current_ = initial_; }

 private:
  const absl::Duration initial_;
  const absl::Duration max_;
  absl::Duration current_;
  std::mt19937_64 rng_;
};

}  // namespace rebound
