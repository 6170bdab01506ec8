// SWIFT's greedy selective logging (common/logging_plan.h) on a job small enough to work out by
// hand: 10 inputs -> 8 -> 8 -> 8 -> 4 in four stages of one layer each, batch 2, tau 10.
// Multiply-adds per layer 80, 64, 64, 32 (shares 1/3, 4/15, 4/15, 2/15); each boundary carries 8
// features: 4 x 2 x 8 floats = 256 bytes per step, 2560 stored.

#include <catch2/catch.hpp>

#include <cmath>

#include "absl/strings/str_cat.h"

#include "common/config.h"
#include "common/logging_plan.h"

namespace rebound {
namespace {

JobConfig Job(int stages) {
  auto job = ParseJobConfig(
      absl::StrCat("job_id: \"p\"\n"
                   "model { input_dim: 10 layers { width: 8 } layers { width: 8 } "
                   "layers { width: 8 } layers { width: 4 activation: IDENTITY } }\n"
                   "topology { replicas: 1 stages: ",
                   stages,
                   " }\n"
                   "data { batch_size: 2 micro_batches: 1 }\n"
                   "easgd { sync_period: 10 }\n"),
      "job.pbtxt");
  REQUIRE(job.ok());
  return *job;
}

TEST_CASE("every boundary is logged when the budget allows it") {
  auto plan = PlanLogging(Job(4), 1 << 20);
  REQUIRE(plan.ok());
  REQUIRE(plan->boundaries.size() == 3);
  for (const BoundaryCost& b : plan->boundaries) {
    CHECK(b.width == 8);
    CHECK(b.bytes_per_step == 256);
    CHECK(b.stored_bytes == 2560);
  }
  CHECK(plan->logged == std::vector<int>{1, 2, 3});
  CHECK(plan->stored_bytes == 7680);
  // Every stage its own group: (1/4) x (10/2) x (sum of shares = 1) = 1.25.
  CHECK(std::fabs(plan->expected_recovery_all - 1.25) < 1e-12);
  CHECK(std::fabs(plan->expected_recovery_plan - 1.25) < 1e-12);
  CHECK(plan->fits);
}

TEST_CASE("the boundary dropped first is the one whose loss adds the least recovery per byte") {
  // Dropping b1 adds 0.75, b2 0.667, b3 0.5 model-steps (same bytes each): b3 goes first; then
  // of {1, 2}, dropping b1 (total 2.5) beats b2 (2.917).
  auto one = PlanLogging(Job(4), 5120);
  REQUIRE(one.ok());
  CHECK(one->logged == std::vector<int>{1, 2});
  CHECK(one->stored_bytes == 5120);
  CHECK(std::fabs(one->expected_recovery_plan - 1.75) < 1e-12);
  auto two = PlanLogging(Job(4), 2560);
  REQUIRE(two.ok());
  CHECK(two->logged == std::vector<int>{2});
  CHECK(std::fabs(two->expected_recovery_plan - 2.5) < 1e-12);
  REQUIRE(two->dropped.size() == 2);
  CHECK(two->dropped[0].first == 3);
  CHECK(two->dropped[1].first == 1);
  auto none = PlanLogging(Job(4), 0);
  REQUIRE(none.ok());
  CHECK(none->logged.empty());
  CHECK(std::fabs(none->expected_recovery_plan - 5.0) < 1e-12);  // all four stages replay
  const std::string text = FormatLoggingPlan(Job(4), 2560, *two);
  CHECK(text.find("step_log { logged_boundaries: [2] }") != std::string::npos);
}

TEST_CASE("a one-stage job has nothing to plan; bad input is refused") {
  auto plan = PlanLogging(Job(1), 0);
  REQUIRE(plan.ok());
  CHECK(plan->boundaries.empty());
  CHECK(FormatLoggingPlan(Job(1), 0, *plan).find("no stage boundary") != std::string::npos);
  CHECK(PlanLogging(Job(4), -1).status().code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rebound
