// SWIFT's greedy selective logging (common/logging_plan.h) on a job small enough to work out by
// hand: 10 inputs -> 8 -> 8 -> 8 -> 4 in four stages of one layer each, batch 2, tau 10.
// Multiply-adds per layer 80, 64, 64, 32 (shares 1/3, 4/15, 4/15, 2/15); each boundary carries 8
// features: 4 x 2 x 8 floats = 256 bytes per step, 2560 stored.
//
// With measured stage times (MeasuredCosts::stage_ms) the same rule runs on ms. Dropping boundary
// b merges the groups A (a stages, cost C_A ms per step) and B (n stages, C_B) on either side of
// it; the expected recovery grows by (tau / 2) / S x ((a + n)(C_A + C_B) - a C_A - n C_B)
// = (5 / 4) x (a C_B + n C_A) ms, which for two single stages is (5 / 4) x (ms[b-1] + ms[b]).

#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

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

TEST_CASE("measured stage times make the greedy rule drop a different boundary") {
  // Stage times 1, 1, 4, 4 ms. Every boundary logged: (1/4) x 5 x (1 + 1 + 4 + 4) = 12.5 ms.
  // Dropping b1 adds (5/4)(1 + 1) = 2.5 ms, b2 (5/4)(1 + 4) = 6.25, b3 (5/4)(4 + 4) = 10; at
  // equal bytes b1 goes first (the multiply-add model drops b3 first: the test above).
  MeasuredCosts measured;
  measured.stage_ms = {1.0, 1.0, 4.0, 4.0};
  auto plan = PlanLogging(Job(4), 5120, measured);
  REQUIRE(plan.ok());
  CHECK(plan->logged == std::vector<int>{2, 3});
  CHECK(plan->stored_bytes == 5120);
  REQUIRE(plan->dropped.size() == 1);
  CHECK(plan->dropped[0].first == 1);
  CHECK(std::fabs(plan->model_step_ms - 10.0) < 1e-12);
  CHECK(std::fabs(plan->expected_recovery_ms_all - 12.5) < 1e-12);
  CHECK(std::fabs(plan->expected_recovery_ms_plan - 15.0) < 1e-12);
  // In whole-model steps of 10 ms: 1.25 and 1.5.
  CHECK(std::fabs(plan->expected_recovery_all - 1.25) < 1e-12);
  CHECK(std::fabs(plan->expected_recovery_plan - 1.5) < 1e-12);
  auto by_macs = PlanLogging(Job(4), 5120);
  REQUIRE(by_macs.ok());
  CHECK(by_macs->logged == std::vector<int>{1, 2});
  CHECK(by_macs->stage_ms.empty());
  CHECK(by_macs->expected_recovery_ms_plan == 0.0);
  const std::string text = FormatLoggingPlan(Job(4), 5120, *plan);
  CHECK(text.find("expected recovery per failure: 15.0 ms (every boundary logged: 12.5 ms)") !=
        std::string::npos);
  CHECK(text.find("step_log { logged_boundaries: [2, 3] }") != std::string::npos);
  CHECK(FormatLoggingPlan(Job(4), 5120, *by_macs).find(" ms (") == std::string::npos);
}

TEST_CASE("with measured times a zero budget drops all and an ample one keeps all") {
  MeasuredCosts measured;
  measured.stage_ms = {1.0, 1.0, 4.0, 4.0};
  auto none = PlanLogging(Job(4), 0, measured);
  REQUIRE(none.ok());
  CHECK(none->logged.empty());
  CHECK(none->stored_bytes == 0);
  CHECK(none->fits);
  // One group of all four stages: 5 steps x 10 ms.
  CHECK(std::fabs(none->expected_recovery_ms_plan - 50.0) < 1e-12);
  CHECK(std::fabs(none->expected_recovery_plan - 5.0) < 1e-12);
  REQUIRE(none->dropped.size() == 3);
  // From {2, 3}: dropping b2 leaves {0,1,2},{3}: (3/4)5x6 + (1/4)5x4 = 27.5 ms; dropping b3
  // leaves {0,1},{2,3}: (2/4)5x2 + (2/4)5x8 = 25 ms: b3 goes.
  CHECK(none->dropped[0].first == 1);
  CHECK(none->dropped[1].first == 3);
  CHECK(std::fabs(none->dropped[1].second - 2.5) < 1e-12);  // 25 ms / 10 ms
  CHECK(none->dropped[2].first == 2);
  auto all = PlanLogging(Job(4), 7680, measured);
  REQUIRE(all.ok());
  CHECK(all->logged == std::vector<int>{1, 2, 3});
  CHECK(all->dropped.empty());
  CHECK(std::fabs(all->expected_recovery_ms_plan - 12.5) < 1e-12);
}

TEST_CASE("measured boundary bytes replace the width estimate in the bytes saved") {
  // 100, 300, 100 bytes per step: 1000, 3000, 1000 stored. By multiply-adds dropping b1 adds
  // 0.75 model-steps, b2 0.667, b3 0.5: per kilobyte saved 0.75, 0.222, 0.5, so b2 goes first.
  // Then {0}, {1, 2}, {3}: (1/4)5(1/3) + (2/4)5(8/15) + (1/4)5(2/15) = 23/12.
  MeasuredCosts measured;
  measured.boundary_bytes_per_step = {100, 300, 100};
  auto plan = PlanLogging(Job(4), 4000, measured);
  REQUIRE(plan.ok());
  CHECK(plan->bytes_measured);
  REQUIRE(plan->boundaries.size() == 3);
  CHECK(plan->boundaries[1].bytes_per_step == 300);
  CHECK(plan->boundaries[1].stored_bytes == 3000);
  CHECK(plan->logged == std::vector<int>{1, 3});
  CHECK(plan->stored_bytes == 2000);
  CHECK(std::fabs(plan->expected_recovery_plan - 23.0 / 12.0) < 1e-12);
}

TEST_CASE("measured costs of the wrong count or out of range are refused") {
  auto refused = [](MeasuredCosts measured) {
    auto plan = PlanLogging(Job(4), 5120, measured);
    return !plan.ok() && plan.status().code() == absl::StatusCode::kInvalidArgument;
  };
  MeasuredCosts m;
  m.stage_ms = {1.0, 1.0, 4.0};
  CHECK(refused(m));
  CHECK(std::string(PlanLogging(Job(4), 0, m).status().message()).find("stage_ms") !=
        std::string::npos);
  m.stage_ms = {1.0, 1.0, 4.0, 4.0, 1.0};
  CHECK(refused(m));
  m.stage_ms = {1.0, 0.0, 4.0, 4.0};
  CHECK(refused(m));
  m.stage_ms = {1.0, -2.0, 4.0, 4.0};
  CHECK(refused(m));
  m.stage_ms = {1.0, std::nan(""), 4.0, 4.0};
  CHECK(refused(m));
  m.stage_ms = {1.0, HUGE_VAL, 4.0, 4.0};
  CHECK(refused(m));
  MeasuredCosts b;
  b.boundary_bytes_per_step = {100, 100};
  CHECK(refused(b));
  b.boundary_bytes_per_step = {100, 0, 100};
  CHECK(refused(b));
  b.boundary_bytes_per_step = {100, -5, 100};
  CHECK(refused(b));
  b.boundary_bytes_per_step = {100, int64_t{1} << 62, 100};  // x tau overflows int64
  CHECK(refused(b));
  MeasuredCosts one;
  one.stage_ms = {3.0};  // a one-stage job: one time, no boundary
  auto single = PlanLogging(Job(1), 0, one);
  REQUIRE(single.ok());
  CHECK(single->boundaries.empty());
  CHECK(std::fabs(single->expected_recovery_ms_plan - 15.0) < 1e-12);
}

TEST_CASE("when the greedy drops overshoot, the plan names the better choice that fits") {
  // Equal stage times (1 ms) and boundary bytes 100, 200, 200 per step (stored x 10: 1000, 2000,
  // 2000), budget 2000. Added recovery per byte saved (formula above, a = n = 1 first):
  // b1 2.5 / 1000, b2 and b3 2.5 / 2000: b2 goes first (the lowest of the tie). Then [1, 3]
  // (groups {0}, {1, 2}, {3}) still stores 3000: dropping b1 adds (5/4)(1 x 2 + 2 x 1) = 5 per
  // 1000 bytes, dropping b3 adds (5/4)(2 x 1 + 1 x 2) = 5 per 2000: b3 goes, leaving [1] (1000
  // bytes): groups {0} and {1, 2, 3}, (1/4)(5)(1) + (3/4)(5)(3) = 12.5 ms. Logging [2] alone
  // also fits (2000 bytes): groups {0, 1} and {2, 3}, 2 x (2/4)(5)(2) = 10 ms.
  MeasuredCosts measured;
  measured.stage_ms = {1, 1, 1, 1};
  measured.boundary_bytes_per_step = {100, 200, 200};
  auto plan = PlanLogging(Job(4), 2000, measured);
  REQUIRE(plan.ok());
  CHECK(plan->logged == std::vector<int>{1});
  CHECK(plan->stored_bytes == 1000);
  CHECK(std::fabs(plan->expected_recovery_ms_plan - 12.5) < 1e-9);
  REQUIRE(plan->exhaustive);
  CHECK(plan->best_logged == std::vector<int>{2});
  CHECK(plan->best_stored_bytes == 2000);
  CHECK(std::fabs(plan->expected_recovery_best * plan->model_step_ms - 10.0) < 1e-9);
  const std::string text = FormatLoggingPlan(Job(4), 2000, *plan);
  INFO(text);
  CHECK(text.find("step_log { logged_boundaries: [1] }") != std::string::npos);
  CHECK(text.find("note: logging [2] also fits (2000 bytes) with expected recovery 2.50 "
                  "model-steps (10.0 ms)") != std::string::npos);
  // The greedy plan is the best one here: no note.
  auto all = PlanLogging(Job(4), 1 << 20, measured);
  REQUIRE(all.ok());
  CHECK(all->best_logged == all->logged);
  CHECK(FormatLoggingPlan(Job(4), 1 << 20, *all).find("note:") == std::string::npos);
}

TEST_CASE("a plan that logs no boundary says so with log_no_boundaries, not an empty list") {
  // An empty logged_boundaries list means every boundary (config.md).
  auto plan = PlanLogging(Job(4), 0);
  REQUIRE(plan.ok());
  CHECK(plan->logged.empty());
  const std::string text = FormatLoggingPlan(Job(4), 0, *plan);
  CHECK(text.find("step_log { log_no_boundaries: true }") != std::string::npos);
  CHECK(text.find("logged_boundaries: []") == std::string::npos);
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
