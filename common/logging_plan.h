#pragma once

// Selective logging (DESIGN.md §5.2): which stage boundaries of a pipelined job to log, by
// SWIFT's greedy rule. Logging boundary b (between stages b-1 and b) stores, per step and
// micro-batch, the forward pair (h, R{h}) and the backward pair (delta, R{delta}) of that
// boundary: 4 x batch x width(b) floats per step, kept for up to tau steps. Stages between two
// logged boundaries form a recovery group rebuilt together from their snapshots, so a failure in
// a group costs a replay of every stage of the group.
//
// The model of expected recovery time used to rank boundaries: a failure hits each stage with
// equal probability 1/S; rebuilding group g replays on average tau/2 steps of its stages, each
// step costing the group's share of the model's compute (proportional to the multiply-adds of
// its layers). Starting from every boundary logged, the plan repeatedly drops the boundary whose
// removal adds the least expected recovery time per byte of log storage saved, until the log fits
// the budget.

#include <cstdint>
#include <string>
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
};

// INVALID_ARGUMENT for a job that does not validate or a negative budget.
absl::StatusOr<LoggingPlan> PlanLogging(const JobConfig& job, int64_t budget_bytes);

// The plan as the text reboundctl prints.
std::string FormatLoggingPlan(const JobConfig& job, int64_t budget_bytes, const LoggingPlan& plan);

}  // namespace rebound
