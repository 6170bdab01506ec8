#include "server/apply/update_rules.h"

#include <cmath>
#include <initializer_list>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/slot.h"

namespace rebound::server::apply {

UpdateRules::UpdateRules(const JobConfig& job)
    : sync_period_(job.easgd().sync_period()),
      max_steps_(job.training().max_steps()),
      max_divergence_ratio_(job.weighting().max_divergence_ratio()),
      groups_(job.sharding().groups()) {}

absl::Status UpdateRules::CheckSyncStep(int64_t step) const {
  if (step < 1) return absl::InvalidArgumentError(absl::StrCat("step must be >= 1, got ", step));
  if (step > max_steps_) {
    return absl::InvalidArgumentError(
        absl::StrCat("step must be <= training.max_steps = ", max_steps_, ", got ", step));
  }
  return absl::OkStatus();
}

absl::Status UpdateRules::CheckPushStep(uint64_t sequence, int64_t step) const {
  if (sequence < 1 || step < 1) {
    return absl::InvalidArgumentError("sequence and step must be >= 1");
  }
  return CheckSyncStep(step);
}

absl::StatusOr<Verdict> UpdateRules::DecideSync(const SlotId& slot, int64_t last, int64_t step,
                                                absl::string_view where) const {
  if (step == last) return Verdict::kDuplicate;
  if (step < last) return Verdict::kStale;
  if ((step % sync_period_ != 0 && step != max_steps_) || step > last + sync_period_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step must be the slot's next sync point: a multiple of easgd.sync_period = ",
        sync_period_, " (or training.max_steps = ", max_steps_, ") at most ",
        last + sync_period_, " (slot ", SlotName(slot), " last synced step ", last, where,
        "), got ", step));
  }
  return Verdict::kApply;
}

absl::Status UpdateRules::StaleSync(const SlotId& slot, int64_t last, int64_t step,
                                    absl::string_view where) {
  return absl::FailedPreconditionError(absl::StrCat("stale sync: slot ", SlotName(slot),
                                                    " already synced step ", last, where,
                                                    ", got step ", step));
}

absl::StatusOr<Verdict> UpdateRules::DecidePush(const SlotId& slot, uint64_t applied,
                                                uint64_t sequence, absl::string_view where) {
  if (sequence <= applied) return Verdict::kDuplicate;
  if (sequence != applied + 1) {
    return absl::FailedPreconditionError(absl::StrCat("push sequence ", sequence, " of slot ",
                                                      SlotName(slot), " skips ahead", where,
                                                      ": the next one is ", applied + 1));
  }
  return Verdict::kApply;
}

bool UpdateRules::CarriesNoState(const OptimizerState& state) {
  return state.m().tensors_size() == 0 && state.v().tensors_size() == 0 &&
         state.last_hdiag().tensors_size() == 0;
}

absl::Status UpdateRules::CheckOptimizerState(const OptimizerState& state, StateParts parts,
                                              const BundleCheck& check) {
  if (CarriesNoState(state)) return absl::OkStatus();
  for (const auto& [bundle, name] :
       {std::pair<const TensorBundle*, const char*>{&state.m(), "optimizer.m"},
        {&state.v(), "optimizer.v"},
        {&state.last_hdiag(), "optimizer.last_hdiag"}}) {
    if (parts == StateParts::kAnySubset && bundle->tensors_size() == 0) continue;
    if (absl::Status ok = check(*bundle, name); !ok.ok()) return ok;
  }
  return absl::OkStatus();
}

absl::StatusOr<double> UpdateRules::DivergenceRatio(const SlotId& slot, double norm,
                                                    std::optional<double> median,
                                                    const char* what) const {
  if (!median.has_value()) return 0.0;
  const double ratio = norm / *median;
  if (max_divergence_ratio_ > 0.0 && !(ratio <= max_divergence_ratio_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "refused: slot ", SlotName(slot), " sent ", what, " = ", norm, ", ", ratio,
        " times the median of the stage's other live trainers (", *median,
        "); the bound is weighting.max_divergence_ratio = ", max_divergence_ratio_,
        "; nothing was changed"));
  }
  return ratio;
}

absl::StatusOr<double> UpdateRules::SumOfRangeSquares(
    const google::protobuf::RepeatedPtrField<RangeSyncResult>& ranges) const {
  if (ranges.size() != groups_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ranges must hold one result per range (", groups_, "), got ", ranges.size()));
  }
  double sum_of_squares = 0.0;
  for (int k = 0; k < groups_; ++k) {
    const RangeSyncResult& range = ranges.Get(k);
    if (range.range() != k || range.center_version() < 0 ||
        !(range.partial_sq_norm() >= 0.0 && std::isfinite(range.partial_sq_norm()))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ranges[", k, "] must be range ", k, " with a center_version >= 0 and a finite "
          "partial_sq_norm >= 0, got range ", range.range(), ", version ", range.center_version(),
          ", partial_sq_norm ", range.partial_sq_norm()));
    }
    sum_of_squares += range.partial_sq_norm();
  }
  return sum_of_squares;
}

SlotBook UpdateRules::AfterSync(SlotBook book, int64_t step) {
  book.last_update_step = step;
  book.update_count += 1;
  return book;
}

SlotBook UpdateRules::AfterPush(SlotBook book, uint64_t sequence, int64_t step) {
  book.applied_sequence = sequence;
  book.last_update_step = step;
  book.update_count += 1;
  return book;
}

}  // namespace rebound::server::apply
