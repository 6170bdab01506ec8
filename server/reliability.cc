#include "server/reliability.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace rebound::server {
namespace {

// Median of a non-empty list (mean of the two middle values for an even count).
double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

}  // namespace

ReliabilityTracker::ReliabilityTracker(const WeightingConfig& config, int replicas)
    : config_(config), replicas_(replicas) {}

double ReliabilityTracker::DecayedFault(const SlotState& state, absl::Time now) const {
  if (state.fault <= 0.0) return 0.0;
  const double elapsed_s = std::max(0.0, absl::ToDoubleSeconds(now - state.fault_time));
  return state.fault * std::exp2(-elapsed_s / config_.fault_half_life_s());
}

double ReliabilityTracker::Weight(double fault, double staleness, double lateness,
                                  double divergence) const {
  if (config_.policy() == UNIFORM) return 1.0;
  const double worst = std::max({staleness, lateness, divergence});
  const double w = (1.0 - fault) / (1.0 + config_.lambda() * std::max(0.0, worst - 1.0));
  return std::clamp(w, config_.min_weight(), 1.0);
}

ReliabilityTracker::SlotState ReliabilityTracker::AfterSync(SlotState state, absl::Time now,
                                                           int64_t center_version,
                                                           double divergence_norm) {
  state.live = true;
  if (state.synced) {
    state.last_interval = now - state.last_sync;
    state.has_interval = true;
  }
  state.last_divergence = divergence_norm;
  state.has_divergence = true;
  state.synced = true;
  state.last_sync = now;
  state.version_after_last_sync = center_version + 1;
  return state;
}

WeightInputs ReliabilityTracker::MeasureLocked(const SlotId& slot, absl::Time now,
                                               int64_t center_version,
                                               double divergence_norm) const {
  const Key key = KeyOf(slot);
  auto found = slots_.find(key);
  const SlotState before = found == slots_.end() ? SlotState() : found->second;
  const SlotState after = AfterSync(before, now, center_version, divergence_norm);

  double staleness = 1.0;
  double lateness = 1.0;
  if (before.synced && replicas_ > 1) {
    const int64_t by_others = std::max<int64_t>(0, center_version - before.version_after_last_sync);
    staleness = static_cast<double>(by_others) / (replicas_ - 1);
  }

  // Compared with the live slots of the same stage (the other replicas), this one as it is after
  // the sync: in a pipeline each stage has its own center, parameter count and pace.
  std::vector<double> intervals;
  std::vector<double> divergences;
  auto add = [&](const SlotState& other) {
    if (!other.live) return;
    if (other.has_interval) intervals.push_back(absl::ToDoubleSeconds(other.last_interval));
    if (other.has_divergence) divergences.push_back(other.last_divergence);
  };
  for (const auto& [other_key, other] : slots_) {
    if (other_key.second != slot.stage() || other_key == key) continue;
    add(other);
  }
  add(after);
  if (after.has_interval && !intervals.empty()) {
    const double median = Median(intervals);
    if (median > 0.0) lateness = absl::ToDoubleSeconds(after.last_interval) / median;
  }
  double divergence = 1.0;
  const double median_divergence = Median(divergences);
  if (median_divergence > 0.0 && std::isfinite(divergence_norm)) {
    divergence = divergence_norm / median_divergence;
  }

  const double fault = DecayedFault(before, now);
  WeightInputs inputs;
  inputs.set_staleness(staleness);
  inputs.set_lateness(lateness);
  inputs.set_divergence(divergence);
  inputs.set_fault_score(fault);
  inputs.set_weight(Weight(fault, staleness, lateness, divergence));
  return inputs;
}

WeightInputs ReliabilityTracker::Measure(const SlotId& slot, absl::Time now,
                                         int64_t center_version, double divergence_norm) const {
  absl::MutexLock lock(&mu_);
  return MeasureLocked(slot, now, center_version, divergence_norm);
}

void ReliabilityTracker::Record(const SlotId& slot, absl::Time now, int64_t center_version,
                                double divergence_norm, const WeightInputs& inputs) {
  absl::MutexLock lock(&mu_);
  SlotState& state = slots_[KeyOf(slot)];
  state = AfterSync(state, now, center_version, divergence_norm);
  state.inputs = inputs;
}

WeightInputs ReliabilityTracker::OnSync(const SlotId& slot, absl::Time now, int64_t center_version,
                                        double divergence_norm) {
  absl::MutexLock lock(&mu_);
  const WeightInputs inputs = MeasureLocked(slot, now, center_version, divergence_norm);
  SlotState& state = slots_[KeyOf(slot)];
  state = AfterSync(state, now, center_version, divergence_norm);
  state.inputs = inputs;
  return inputs;
}

std::optional<double> ReliabilityTracker::PeerDivergenceMedian(const SlotId& slot) const {
  absl::MutexLock lock(&mu_);
  const Key key = KeyOf(slot);
  std::vector<double> divergences;
  for (const auto& [other_key, other] : slots_) {
    if (other_key.second != slot.stage() || other_key == key) continue;
    if (other.live && other.has_divergence) divergences.push_back(other.last_divergence);
  }
  if (divergences.empty()) return std::nullopt;
  const double median = Median(divergences);
  if (!(median > 0.0)) return std::nullopt;
  return median;
}

void ReliabilityTracker::OnFault(const SlotId& slot, absl::Time now) {
  absl::MutexLock lock(&mu_);
  SlotState& state = slots_[KeyOf(slot)];
  state.fault = std::min(1.0, DecayedFault(state, now) + config_.fault_increment());
  state.fault_time = now;
}

void ReliabilityTracker::SetLive(const SlotId& slot, bool live) {
  absl::MutexLock lock(&mu_);
  slots_[KeyOf(slot)].live = live;
}

WeightInputs ReliabilityTracker::Current(const SlotId& slot, absl::Time now) const {
  absl::MutexLock lock(&mu_);
  auto it = slots_.find(KeyOf(slot));
  WeightInputs inputs;
  if (it == slots_.end()) {
    inputs.set_staleness(1.0);
    inputs.set_lateness(1.0);
    inputs.set_divergence(1.0);
    inputs.set_fault_score(0.0);
    inputs.set_weight(1.0);
    return inputs;
  }
  const SlotState& state = it->second;
  inputs = state.inputs;
  if (!state.synced) {
    inputs.set_staleness(1.0);
    inputs.set_lateness(1.0);
    inputs.set_divergence(1.0);
  }
  const double fault = DecayedFault(state, now);
  inputs.set_fault_score(fault);
  inputs.set_weight(Weight(fault, inputs.staleness(), inputs.lateness(), inputs.divergence()));
  return inputs;
}

std::vector<WeightRecord> ReliabilityTracker::Export(absl::Time now) const {
  absl::MutexLock lock(&mu_);
  std::vector<WeightRecord> records;
  for (const auto& [key, state] : slots_) records.push_back(RecordLocked(key, state, now));
  return records;
}

WeightRecord ReliabilityTracker::ExportSlot(const SlotId& slot, absl::Time now) const {
  absl::MutexLock lock(&mu_);
  auto it = slots_.find(KeyOf(slot));
  if (it == slots_.end()) return RecordLocked(KeyOf(slot), SlotState(), now);
  return RecordLocked(it->first, it->second, now);
}

WeightRecord ReliabilityTracker::RecordLocked(const Key& key, const SlotState& state,
                                              absl::Time now) const {
  {
    WeightRecord record;
    record.mutable_slot()->set_replica(key.first);
    record.mutable_slot()->set_stage(key.second);
    record.set_fault_score(DecayedFault(state, now));
    record.set_fault_updated_unix_ms(absl::ToUnixMillis(now));
    if (state.synced) {
      record.set_last_sync_unix_ms(absl::ToUnixMillis(state.last_sync));
      record.set_center_version_at_last_sync(state.version_after_last_sync);
    }
    if (state.has_divergence) record.set_last_divergence(state.last_divergence);
    *record.mutable_inputs() = state.inputs;
    record.set_weight(state.inputs.weight());
    return record;
  }
}

void ReliabilityTracker::Import(const WeightRecord& record) {
  absl::MutexLock lock(&mu_);
  SlotState& state = slots_[KeyOf(record.slot())];
  state.fault = record.fault_score();
  state.fault_time = absl::FromUnixMillis(record.fault_updated_unix_ms());
  if (record.has_last_sync_unix_ms()) {
    state.synced = true;
    state.last_sync = absl::FromUnixMillis(record.last_sync_unix_ms());
    state.version_after_last_sync = record.center_version_at_last_sync();
  }
  if (record.has_last_divergence()) {
    state.has_divergence = true;
    state.last_divergence = record.last_divergence();
  }
  state.inputs = record.inputs();
}

}  // namespace rebound::server
