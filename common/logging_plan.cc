#include "common/logging_plan.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/config.h"

namespace rebound {
namespace {

// Expected recovery with `logged` boundaries: sum over groups of P(failure in g) x (tau / 2) x
// cost(g), where cost(g) sums `stage_cost` over the group's stages (shares of the model's step,
// or ms).
double ExpectedRecovery(const std::vector<int>& logged, const std::vector<double>& stage_cost,
                        int64_t tau) {
  const int stages = static_cast<int>(stage_cost.size());
  std::vector<int> cuts = {0};
  cuts.insert(cuts.end(), logged.begin(), logged.end());
  cuts.push_back(stages);
  double expected = 0.0;
  for (size_t g = 0; g + 1 < cuts.size(); ++g) {
    double compute = 0.0;
    for (int s = cuts[g]; s < cuts[g + 1]; ++s) compute += stage_cost[s];
    const double p = static_cast<double>(cuts[g + 1] - cuts[g]) / stages;
    expected += p * (static_cast<double>(tau) / 2.0) * compute;
  }
  return expected;
}

absl::Status CheckMeasured(const MeasuredCosts& measured, int stages, int64_t tau) {
  if (!measured.stage_ms.empty()) {
    if (static_cast<int>(measured.stage_ms.size()) != stages) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "stage_ms has %d values, the job has %d stages", measured.stage_ms.size(), stages));
    }
    for (size_t s = 0; s < measured.stage_ms.size(); ++s) {
      const double ms = measured.stage_ms[s];
      if (!std::isfinite(ms) || ms <= 0.0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("stage_ms[%d] must be a finite number > 0, got %g", s, ms));
      }
    }
  }
  if (!measured.boundary_bytes_per_step.empty()) {
    if (static_cast<int>(measured.boundary_bytes_per_step.size()) != stages - 1) {
      return absl::InvalidArgumentError(
          absl::StrFormat("boundary_bytes_per_step has %d values, the job has %d boundaries",
                          measured.boundary_bytes_per_step.size(), stages - 1));
    }
    // Every boundary's stored bytes, and their sum, must fit in int64.
    const int64_t max_per_step = std::numeric_limits<int64_t>::max() / tau / stages;
    for (size_t b = 0; b < measured.boundary_bytes_per_step.size(); ++b) {
      const int64_t bytes = measured.boundary_bytes_per_step[b];
      if (bytes <= 0 || bytes > max_per_step) {
        return absl::InvalidArgumentError(
            absl::StrFormat("boundary_bytes_per_step[%d] (boundary %d) must be in [1, %d], got %d",
                            b, b + 1, max_per_step, bytes));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LoggingPlan> PlanLogging(const JobConfig& job, int64_t budget_bytes) {
  return PlanLogging(job, budget_bytes, MeasuredCosts());
}

absl::StatusOr<LoggingPlan> PlanLogging(const JobConfig& job, int64_t budget_bytes,
                                        const MeasuredCosts& measured) {
  if (absl::Status valid = ValidateJobConfig(job); !valid.ok()) return valid;
  if (budget_bytes < 0) return absl::InvalidArgumentError("the budget must be >= 0 bytes");
  const std::vector<int> starts = StageLayerStarts(job);
  const int stages = static_cast<int>(starts.size()) - 1;
  const int64_t tau = job.easgd().sync_period();
  const int64_t batch = job.data().batch_size();
  if (absl::Status valid = CheckMeasured(measured, stages, tau); !valid.ok()) return valid;
  // The cost of one step of each stage that the greedy rule ranks by: measured ms, or the
  // stage's share of the model's multiply-adds. `stage_share` is the same in units of one step
  // of the whole model.
  std::vector<double> stage_cost(stages, 0.0);
  std::vector<double> stage_share(stages, 0.0);
  LoggingPlan plan;
  if (!measured.stage_ms.empty()) {
    plan.stage_ms = measured.stage_ms;
    for (double ms : measured.stage_ms) plan.model_step_ms += ms;
    for (int s = 0; s < stages; ++s) {
      stage_cost[s] = measured.stage_ms[s];
      stage_share[s] = measured.stage_ms[s] / plan.model_step_ms;
    }
  } else {
    std::vector<double> layer_macs;
    int64_t in = job.model().input_dim();
    double total = 0.0;
    for (const LayerSpec& layer : job.model().layers()) {
      layer_macs.push_back(static_cast<double>(in) * layer.width());
      total += layer_macs.back();
      in = layer.width();
    }
    for (int s = 0; s < stages; ++s) {
      for (int l = starts[s]; l < starts[s + 1]; ++l) stage_share[s] += layer_macs[l] / total;
    }
    stage_cost = stage_share;
  }
  plan.bytes_measured = !measured.boundary_bytes_per_step.empty();
  for (int b = 1; b < stages; ++b) {
    BoundaryCost cost;
    cost.boundary = b;
    cost.width = job.model().layers(starts[b] - 1).width();
    cost.bytes_per_step = plan.bytes_measured
                              ? measured.boundary_bytes_per_step[b - 1]
                              : 4 * batch * cost.width * static_cast<int64_t>(sizeof(float));
    cost.stored_bytes = cost.bytes_per_step * tau;
    plan.boundaries.push_back(cost);
    plan.logged.push_back(b);
    plan.stored_bytes += cost.stored_bytes;
  }
  plan.expected_recovery_all = ExpectedRecovery(plan.logged, stage_share, tau);
  while (plan.stored_bytes > budget_bytes && !plan.logged.empty()) {
    const double current = ExpectedRecovery(plan.logged, stage_cost, tau);
    double best_ratio = std::numeric_limits<double>::infinity();
    size_t best = 0;
    for (size_t i = 0; i < plan.logged.size(); ++i) {
      std::vector<int> without = plan.logged;
      without.erase(without.begin() + static_cast<std::ptrdiff_t>(i));
      const double added = ExpectedRecovery(without, stage_cost, tau) - current;
      const double saved = static_cast<double>(plan.boundaries[plan.logged[i] - 1].stored_bytes);
      const double ratio = added / saved;
      if (ratio < best_ratio) {  // ties: the first (lowest) boundary
        best_ratio = ratio;
        best = i;
      }
    }
    const int dropped = plan.logged[best];
    plan.stored_bytes -= plan.boundaries[dropped - 1].stored_bytes;
    plan.logged.erase(plan.logged.begin() + static_cast<std::ptrdiff_t>(best));
    plan.dropped.emplace_back(dropped, ExpectedRecovery(plan.logged, stage_share, tau));
  }
  plan.expected_recovery_plan = ExpectedRecovery(plan.logged, stage_share, tau);
  if (!plan.stage_ms.empty()) {
    std::vector<int> all;
    for (const BoundaryCost& b : plan.boundaries) all.push_back(b.boundary);
    plan.expected_recovery_ms_all = ExpectedRecovery(all, plan.stage_ms, tau);
    plan.expected_recovery_ms_plan = ExpectedRecovery(plan.logged, plan.stage_ms, tau);
  }
  plan.fits = plan.stored_bytes <= budget_bytes;
  const int boundaries = static_cast<int>(plan.boundaries.size());
  if (boundaries <= kMaxExhaustiveBoundaries) {
    plan.exhaustive = true;
    double best = std::numeric_limits<double>::infinity();
    for (uint32_t mask = 0; mask < (uint32_t{1} << boundaries); ++mask) {
      std::vector<int> logged;
      int64_t stored = 0;
      for (int b = 1; b <= boundaries; ++b) {
        if ((mask >> (b - 1)) & 1) {
          logged.push_back(b);
          stored += plan.boundaries[b - 1].stored_bytes;
        }
      }
      if (stored > budget_bytes) continue;
      const double expected = ExpectedRecovery(logged, stage_cost, tau);
      if (expected < best || (expected == best && stored < plan.best_stored_bytes)) {
        best = expected;
        plan.best_logged = logged;
        plan.best_stored_bytes = stored;
      }
    }
    plan.expected_recovery_best = ExpectedRecovery(plan.best_logged, stage_share, tau);
  }
  return plan;
}

std::string FormatLoggingPlan(const JobConfig& job, int64_t budget_bytes, const LoggingPlan& plan) {
  std::string out =
      absl::StrFormat("job %s: %d stages, batch %d, tau %d; log budget %d bytes\n", job.job_id(),
                      static_cast<int>(plan.boundaries.size()) + 1, job.data().batch_size(),
                      job.easgd().sync_period(), budget_bytes);
  if (plan.boundaries.empty()) {
    return out + "one stage: no stage boundary to log (replay needs only the sample ids)\n";
  }
  const bool timed = !plan.stage_ms.empty();
  if (timed) {
    std::vector<std::string> ms;
    for (double v : plan.stage_ms) ms.push_back(absl::StrFormat("%.3f", v));
    absl::StrAppend(&out, "measured step time per stage (ms): ", absl::StrJoin(ms, " "),
                    "; whole model ", absl::StrFormat("%.3f", plan.model_step_ms), " ms\n");
  } else {
    absl::StrAppend(&out, "step time per stage: estimated from multiply-adds (no --stage_ms)\n");
  }
  absl::StrAppend(
      &out, absl::StrFormat("%-9s %6s %14s %14s  %s\n", "BOUNDARY", "WIDTH",
                            plan.bytes_measured ? "BYTES/STEP*" : "BYTES/STEP", "STORED", "PLAN"));
  for (const BoundaryCost& b : plan.boundaries) {
    const bool kept =
        std::find(plan.logged.begin(), plan.logged.end(), b.boundary) != plan.logged.end();
    absl::StrAppend(&out, absl::StrFormat("%-9d %6d %14d %14d  %s\n", b.boundary, b.width,
                                          b.bytes_per_step, b.stored_bytes, kept ? "log" : "drop"));
  }
  if (plan.bytes_measured) {
    absl::StrAppend(&out, "* as measured, instead of 4 x batch x width floats\n");
  }
  absl::StrAppend(
      &out,
      absl::StrFormat("stored with the plan: %d bytes; expected recovery per failure: %.2f "
                      "model-steps (every boundary logged: %.2f)\n",
                      plan.stored_bytes, plan.expected_recovery_plan, plan.expected_recovery_all));
  if (timed) {
    absl::StrAppend(&out,
                    absl::StrFormat("expected recovery per failure: %.1f ms (every boundary "
                                    "logged: %.1f ms)\n",
                                    plan.expected_recovery_ms_plan, plan.expected_recovery_ms_all));
  }
  for (const auto& [boundary, expected] : plan.dropped) {
    absl::StrAppend(&out, absl::StrFormat("  dropped boundary %d -> expected recovery %.2f",
                                          boundary, expected));
    if (timed) {
      absl::StrAppend(&out, absl::StrFormat(" (%.1f ms)", expected * plan.model_step_ms));
    }
    absl::StrAppend(&out, "\n");
  }
  if (plan.exhaustive && plan.best_logged != plan.logged) {
    absl::StrAppend(
        &out, absl::StrFormat("note: logging [%s] also fits (%d bytes) with expected recovery "
                              "%.2f model-steps",
                              absl::StrJoin(plan.best_logged, ", "), plan.best_stored_bytes,
                              plan.expected_recovery_best));
    if (timed) {
      absl::StrAppend(&out, absl::StrFormat(" (%.1f ms)",
                                            plan.expected_recovery_best * plan.model_step_ms));
    }
    absl::StrAppend(&out, ": every choice priced, the greedy rule's drops overshot\n");
  }
  // An empty logged_boundaries list means every boundary: no boundary at all is spelled apart.
  if (plan.logged.empty()) {
    absl::StrAppend(&out, "step_log { log_no_boundaries: true }\n");
  } else {
    absl::StrAppend(&out, "step_log { logged_boundaries: [", absl::StrJoin(plan.logged, ", "),
                    "] }\n");
  }
  return out;
}

}  // namespace rebound
