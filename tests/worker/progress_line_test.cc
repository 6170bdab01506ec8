// ProgressLine (worker/progress_line.h): a trainer's line every progress_interval_s, on a
// FakeClock: nothing before the interval, then the step, loss, weight and samples/s of the steps
// since the line before.

#include "worker/progress_line.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "common/clock.h"

namespace rebound::worker {
namespace {

TEST_CASE("a progress line comes once per interval with the samples per second since the last") {
  FakeClock clock;
  ProgressLine progress("(0, 1)", 4000, 64, absl::Seconds(10), &clock);
  CHECK_FALSE(progress.Step(1, 2.3f, std::nullopt).has_value());  // starts the clock
  clock.Advance(absl::Seconds(5));
  CHECK_FALSE(progress.Step(50, 1.9f, std::nullopt).has_value());
  clock.Advance(absl::Seconds(5));
  // Steps 1 to 101 in 10 s: 100 steps of 64 samples.
  std::optional<std::string> line = progress.Step(101, 0.41234f, std::nullopt);
  REQUIRE(line.has_value());
  CHECK(*line == "progress: slot (0, 1) step 101/4000, loss 0.4123, weight -, 640 samples/s");
  clock.Advance(absl::Seconds(9));
  CHECK_FALSE(progress.Step(200, 0.4f, 0.98).has_value());
  clock.Advance(absl::Seconds(11));
  // Steps 101 to 301 in 20 s.
  line = progress.Step(301, 0.3f, 0.976);
  REQUIRE(line.has_value());
  CHECK(*line == "progress: slot (0, 1) step 301/4000, loss 0.3000, weight 0.98, 640 samples/s");
}

TEST_CASE("a stage without a loss writes '-', and an interval of 0 never reports") {
  FakeClock clock;
  ProgressLine inner("(0, 0)", 100, 10, absl::Seconds(1), &clock);
  inner.Step(1, std::nanf(""), 1.0);
  clock.Advance(absl::Seconds(2));
  const std::optional<std::string> line = inner.Step(21, std::nanf(""), 1.0);
  REQUIRE(line.has_value());
  CHECK(*line == "progress: slot (0, 0) step 21/100, loss -, weight 1.00, 100 samples/s");

  ProgressLine off("(0, 0)", 100, 10, absl::ZeroDuration(), &clock);
  for (int t = 1; t <= 100; ++t) {
    clock.Advance(absl::Seconds(100));
    CHECK_FALSE(off.Step(t, 1.0f, 1.0).has_value());
  }
}

}  // namespace
}  // namespace rebound::worker
