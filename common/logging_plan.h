#pragma once

// Selective logging (docs/design.md §5.2): which stage boundaries of a pipelined job to log, by
// SWIFT's greedy rule. Logging boundary b (between stages b-1 and b) stores, per step and
// micro-batch, the forward pair (h, R{h}) and the backward pair (delta, R{delta}) of that
// boundary: 4 x batch x width(b) floats per step, kept for up to tau steps. Stages between two
// logged boundaries form a recovery group rebuilt together from their snapshots, so a failure in
// a group costs a replay of every stage of the group.
//
// The model of expected recovery time used to rank boundaries: a failure hits each stage with
// equal probability 1/S; rebuilding group g replays on average tau/2 steps of its stages, each
// step costing the sum of its stages' step times. A stage's step time is measured when the caller
// gives one (MeasuredCosts::stage_ms, e.g. from //bench:selective_logging), else estimated as the
// stage's share of the model's multiply-adds. Starting from every boundary logged, the plan
// repeatedly drops the boundary whose removal adds the least expected recovery time per byte of
// log storage saved, until the log fits the budget.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/config.pb.h"

namespace rebound {

struct BoundaryCost {
  int boundary = 0;            // b in [1, S-1]: between stage b-1 and stage b
  int width = 0;               // features crossing it
  int64_t bytes_per_step = 0;  // what logging it stores per step (all micro-batches)
  int64_t stored_bytes = 0;    // bytes_per_step x tau: what the log holds at most
};

// Measured costs that replace the estimates above; each is optional (empty: estimate).
struct MeasuredCosts {
  // Milliseconds per training step of each stage s = 0..S-1 (forward and backward with the R-op
  // of its M micro-batches and its AdaHessian apply): S finite values > 0.
  std::vector<double> stage_ms;
  // Bytes that logging boundary b = 1..S-1 ships per step (e.g. the serialized LogRecords of its
  // forward and backward pairs): S-1 values > 0, replacing 4 x batch x width floats.
  std::vector<int64_t> boundary_bytes_per_step;
};

struct LoggingPlan {
  std::vector<BoundaryCost> boundaries;  // all, ascending
  std::vector<int> logged;               // the boundaries kept, ascending
  int64_t stored_bytes = 0;              // of the kept boundaries
  // Expected recovery work of one failure, in units of "one step of the whole model": with
  // every boundary logged, and with the plan.
  double expected_recovery_all = 0.0;
  double expected_recovery_plan = 0.0;
  // The order in which boundaries were dropped, with the expected recovery after each.
  std::vector<std::pair<int, double>> dropped;
  bool fits = false;  // stored_bytes <= budget (false only if even no logging... never: 0 fits)
  bool bytes_measured = false;  // boundary bytes came from MeasuredCosts
  // With measured stage times (else empty and zeros): the times, one step of the whole model
  // (their sum), and the expected recovery of one failure in ms (expected_recovery_* x
  // model_step_ms).
  std::vector<double> stage_ms;
  double model_step_ms = 0.0;
  double expected_recovery_ms_all = 0.0;
  double expected_recovery_ms_plan = 0.0;
  // For up to kMaxExhaustiveBoundaries boundaries, every choice is also priced: the one within
  // the budget with the least expected recovery (fewest stored bytes on a tie). The greedy rule
  // can miss it (its first drops may be near ties that a later drop overshoots); the plan stays
  // the greedy one (docs/design.md §5.2) and FormatLoggingPlan names the better choice when it differs.
  bool exhaustive = false;
  std::vector<int> best_logged;
  double expected_recovery_best = 0.0;  // model-steps
  int64_t best_stored_bytes = 0;
};

inline constexpr int kMaxExhaustiveBoundaries = 20;

// INVALID_ARGUMENT for a job that does not validate, a negative budget, or measured costs of the
// wrong count or out of range (the message names stage_ms or boundary_bytes_per_step).
absl::StatusOr<LoggingPlan> PlanLogging(const JobConfig& job, int64_t budget_bytes,
                                        const MeasuredCosts& measured);
// PlanLogging with nothing measured: stage times from multiply-adds, bytes from widths.
absl::StatusOr<LoggingPlan> PlanLogging(const JobConfig& job, int64_t budget_bytes);

// The plan as the text reboundctl prints.
std::string FormatLoggingPlan(const JobConfig& job, int64_t budget_bytes, const LoggingPlan& plan);

}  // namespace rebound
