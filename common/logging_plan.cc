#include "common/logging_plan.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/config.h"

namespace rebound {
namespace {

// Expected recovery work with `logged` boundaries: sum over groups of P(failure in g) x
// (tau / 2) x compute(g), compute in units of the whole model's step.
double ExpectedRecovery(const std::vector<int>& logged, const std::vector<double>& stage_share,
                        int64_t tau) {
  const int stages = static_cast<int>(stage_share.size());
  std::vector<int> cuts = {0};
  cuts.insert(cuts.end(), logged.begin(), logged.end());
  cuts.push_back(stages);
  double expected = 0.0;
  for (size_t g = 0; g + 1 < cuts.size(); ++g) {
    double compute = 0.0;
    for (int s = cuts[g]; s < cuts[g + 1]; ++s) compute += stage_share[s];
    const double p = static_cast<double>(cuts[g + 1] - cuts[g]) / stages;
    expected += p * (static_cast<double>(tau) / 2.0) * compute;
  }
  return expected;
}

}  // namespace

absl::StatusOr<LoggingPlan> PlanLogging(const JobConfig& job, int64_t budget_bytes) {
  if (absl::Status valid = ValidateJobConfig(job); !valid.ok()) return valid;
  if (budget_bytes < 0) return absl::InvalidArgumentError("the budget must be >= 0 bytes");
  const std::vector<int> starts = StageLayerStarts(job);
  const int stages = static_cast<int>(starts.size()) - 1;
  const int64_t tau = job.easgd().sync_period();
  const int64_t batch = job.data().batch_size();
  // Multiply-adds per layer, then per stage as a share of the model.
  std::vector<double> layer_macs;
  int64_t in = job.model().input_dim();
  double total = 0.0;
  for (const LayerSpec& layer : job.model().layers()) {
    layer_macs.push_back(static_cast<double>(in) * layer.width());
    total += layer_macs.back();
    in = layer.width();
  }
  std::vector<double> stage_share(stages, 0.0);
  for (int s = 0; s < stages; ++s) {
    for (int l = starts[s]; l < starts[s + 1]; ++l) stage_share[s] += layer_macs[l] / total;
  }
  LoggingPlan plan;
  for (int b = 1; b < stages; ++b) {
    BoundaryCost cost;
    cost.boundary = b;
    cost.width = job.model().layers(starts[b] - 1).width();
    cost.bytes_per_step = 4 * batch * cost.width * static_cast<int64_t>(sizeof(float));
    cost.stored_bytes = cost.bytes_per_step * tau;
    plan.boundaries.push_back(cost);
    plan.logged.push_back(b);
    plan.stored_bytes += cost.stored_bytes;
  }
  plan.expected_recovery_all = ExpectedRecovery(plan.logged, stage_share, tau);
  while (plan.stored_bytes > budget_bytes && !plan.logged.empty()) {
    double best_ratio = std::numeric_limits<double>::infinity();
    size_t best = 0;
    double best_expected = 0.0;
    for (size_t i = 0; i < plan.logged.size(); ++i) {
      std::vector<int> without = plan.logged;
      without.erase(without.begin() + static_cast<std::ptrdiff_t>(i));
      const double expected = ExpectedRecovery(without, stage_share, tau);
      const double added = expected - ExpectedRecovery(plan.logged, stage_share, tau);
      const double saved =
          static_cast<double>(plan.boundaries[plan.logged[i] - 1].stored_bytes);
      const double ratio = added / saved;
      if (ratio < best_ratio) {  // ties: the first (lowest) boundary
        best_ratio = ratio;
        best = i;
        best_expected = expected;
      }
    }
    const int dropped = plan.logged[best];
    plan.stored_bytes -= plan.boundaries[dropped - 1].stored_bytes;
    plan.logged.erase(plan.logged.begin() + static_cast<std::ptrdiff_t>(best));
    plan.dropped.emplace_back(dropped, best_expected);
  }
  plan.expected_recovery_plan = ExpectedRecovery(plan.logged, stage_share, tau);
  plan.fits = plan.stored_bytes <= budget_bytes;
  return plan;
}

std::string FormatLoggingPlan(const JobConfig& job, int64_t budget_bytes, const LoggingPlan& plan) {
  std::string out = absl::StrFormat(
      "job %s: %d stages, batch %d, tau %d; log budget %d bytes\n", job.job_id(),
      static_cast<int>(plan.boundaries.size()) + 1, job.data().batch_size(),
      job.easgd().sync_period(), budget_bytes);
  if (plan.boundaries.empty()) {
    return out + "one stage: no stage boundary to log (replay needs only the sample ids)\n";
  }
  absl::StrAppend(&out, absl::StrFormat("%-9s %6s %14s %14s  %s\n", "BOUNDARY", "WIDTH",
                                        "BYTES/STEP", "STORED", "PLAN"));
  for (const BoundaryCost& b : plan.boundaries) {
    const bool kept = std::find(plan.logged.begin(), plan.logged.end(), b.boundary) !=
                      plan.logged.end();
    absl::StrAppend(&out, absl::StrFormat("%-9d %6d %14d %14d  %s\n", b.boundary, b.width,
                                          b.bytes_per_step, b.stored_bytes,
                                          kept ? "log" : "drop"));
  }
  absl::StrAppend(&out, absl::StrFormat(
                            "stored with the plan: %d bytes; expected recovery per failure: %.2f "
                            "model-steps (every boundary logged: %.2f)\n",
                            plan.stored_bytes, plan.expected_recovery_plan,
                            plan.expected_recovery_all));
  for (const auto& [boundary, expected] : plan.dropped) {
    absl::StrAppend(&out, absl::StrFormat("  dropped boundary %d -> expected recovery %.2f\n",
                                          boundary, expected));
  }
  absl::StrAppend(&out, "step_log { logged_boundaries: [",
                  absl::StrJoin(plan.logged, ", "), "] }\n");
  return out;
}

}  // namespace rebound
