#include "server/reliability.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/slot.h"

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

double ReliabilityTracker::Decayed(const Fault& fault, absl::Time now) const {
  if (fault.score <= 0.0) return 0.0;
  const double elapsed_s = std::max(0.0, absl::ToDoubleSeconds(now - fault.updated));
  return fault.score * std::exp2(-elapsed_s / config_.fault_half_life_s());
}

double ReliabilityTracker::OwnerFaultLocked(const SlotState& state, absl::Time now) const {
  if (state.owner.empty()) return 0.0;
  auto it = faults_.find(state.owner);
  return it == faults_.end() ? 0.0 : Decayed(it->second, now);
}

double ReliabilityTracker::Smooth(bool* has, double* value, double raw) const {
  const double half_life = config_.input_smoothing_half_life_syncs();
  if (!*has || !(half_life > 0.0)) {
    *has = true;
    *value = raw;
    return raw;
  }
  const double alpha = 1.0 - std::exp2(-1.0 / half_life);
  *value += alpha * (raw - *value);
  return *value;
}

double ReliabilityTracker::Weight(double fault, double staleness, double lateness,
                                  double divergence) const {
  if (config_.policy() == UNIFORM) return 1.0;
  const double worst = std::max({staleness, lateness, divergence});
  const double w = (1.0 - fault) / (1.0 + config_.lambda() * std::max(0.0, worst - 1.0));
  return std::clamp(w, config_.min_weight(), 1.0);
}

ReliabilityTracker::Measured ReliabilityTracker::MeasureLocked(const SlotId& slot,
                                                               absl::Time now,
                                                               int64_t center_version,
                                                               double divergence_norm) const {
  const Key key = KeyOf(slot);
  auto found = slots_.find(key);
  const SlotState before = found == slots_.end() ? SlotState() : found->second;
  Measured m;
  SlotState& after = m.after;
  after = before;
  after.live = true;
  if (before.synced) {
    after.last_interval = now - before.last_sync;
    after.has_interval = true;
  }
  after.last_divergence = divergence_norm;
  after.has_divergence = true;
  after.synced = true;
  after.last_sync = now;
  after.version_after_last_sync = center_version + 1;

  double staleness = 1.0;
  if (before.synced && replicas_ > 1) {
    const int64_t by_others = std::max<int64_t>(0, center_version - before.version_after_last_sync);
    staleness = Smooth(&after.has_staleness, &after.staleness,
                       static_cast<double>(by_others) / (replicas_ - 1));
  } else if (after.has_staleness) {
    staleness = after.staleness;
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
  double lateness = after.has_lateness ? after.lateness : 1.0;
  if (before.synced && after.has_interval && !intervals.empty()) {
    const double median = Median(intervals);
    if (median > 0.0) {
      lateness = Smooth(&after.has_lateness, &after.lateness,
                        absl::ToDoubleSeconds(after.last_interval) / median);
    }
  }
  double divergence = 1.0;
  const double median_divergence = Median(divergences);
  if (median_divergence > 0.0 && std::isfinite(divergence_norm)) {
    divergence = divergence_norm / median_divergence;
  }

  const double fault = OwnerFaultLocked(before, now);
  m.inputs.set_staleness(staleness);
  m.inputs.set_lateness(lateness);
  m.inputs.set_divergence(divergence);
  m.inputs.set_fault_score(fault);
  m.inputs.set_weight(Weight(fault, staleness, lateness, divergence));
  return m;
}

WeightInputs ReliabilityTracker::Measure(const SlotId& slot, absl::Time now,
                                         int64_t center_version, double divergence_norm) const {
  absl::MutexLock lock(&mu_);
  return MeasureLocked(slot, now, center_version, divergence_norm).inputs;
}

void ReliabilityTracker::Record(const SlotId& slot, absl::Time now, int64_t center_version,
                                double divergence_norm, const WeightInputs& inputs) {
  absl::MutexLock lock(&mu_);
  Measured m = MeasureLocked(slot, now, center_version, divergence_norm);
  m.after.inputs = inputs;
  slots_[KeyOf(slot)] = std::move(m.after);
}

WeightInputs ReliabilityTracker::OnSync(const SlotId& slot, absl::Time now, int64_t center_version,
                                        double divergence_norm) {
  absl::MutexLock lock(&mu_);
  Measured m = MeasureLocked(slot, now, center_version, divergence_norm);
  m.after.inputs = m.inputs;
  slots_[KeyOf(slot)] = std::move(m.after);
  return m.inputs;
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

void ReliabilityTracker::OnFault(const std::string& worker, absl::Time now) {
  if (worker.empty()) return;
  absl::MutexLock lock(&mu_);
  Fault& fault = faults_[worker];
  fault.score = std::min(1.0, Decayed(fault, now) + config_.fault_increment());
  fault.updated = now;
  PruneLocked(now);
}

void ReliabilityTracker::PruneLocked(absl::Time now) {
  std::vector<std::pair<double, std::string>> droppable;
  for (auto it = faults_.begin(); it != faults_.end();) {
    const bool owns = std::any_of(slots_.begin(), slots_.end(),
                                  [&](const auto& slot) { return slot.second.owner == it->first; });
    const double score = Decayed(it->second, now);
    if (!owns && score < kForgetBelow) {
      it = faults_.erase(it);
      continue;
    }
    if (!owns) droppable.emplace_back(score, it->first);
    ++it;
  }
  if (faults_.size() <= kMaxWorkers) return;
  std::sort(droppable.begin(), droppable.end());
  for (const auto& [score, name] : droppable) {
    if (faults_.size() <= kMaxWorkers) break;
    faults_.erase(name);
  }
}

void ReliabilityTracker::SetOwner(const SlotId& slot, const std::string& worker) {
  absl::MutexLock lock(&mu_);
  SlotState& state = slots_[KeyOf(slot)];
  SlotState fresh;
  fresh.live = state.live;
  fresh.owner = worker;
  state = std::move(fresh);
}

double ReliabilityTracker::FaultScore(const std::string& worker, absl::Time now) const {
  absl::MutexLock lock(&mu_);
  auto it = faults_.find(worker);
  return it == faults_.end() ? 0.0 : Decayed(it->second, now);
}

std::vector<std::pair<std::string, double>> ReliabilityTracker::FaultScores(absl::Time now) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<std::string, double>> scores;
  for (const auto& [name, fault] : faults_) scores.emplace_back(name, Decayed(fault, now));
  return scores;
}

void ReliabilityTracker::SetLive(const SlotId& slot, bool live) {
  absl::MutexLock lock(&mu_);
  slots_[KeyOf(slot)].live = live;
}

WeightInputs ReliabilityTracker::Current(const SlotId& slot, absl::Time now) const {
  absl::MutexLock lock(&mu_);
  auto it = slots_.find(KeyOf(slot));
  const SlotState state = it == slots_.end() ? SlotState() : it->second;
  WeightInputs inputs = state.inputs;
  if (!state.synced) {
    inputs.set_staleness(1.0);
    inputs.set_lateness(1.0);
    inputs.set_divergence(1.0);
  }
  const double fault = OwnerFaultLocked(state, now);
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
  WeightRecord record;
  record.mutable_slot()->set_replica(key.first);
  record.mutable_slot()->set_stage(key.second);
  record.set_faults_by_worker(true);
  record.set_owner_name(state.owner);
  record.set_fault_score(OwnerFaultLocked(state, now));
  record.set_fault_updated_unix_ms(absl::ToUnixMillis(now));
  for (const auto& [name, fault] : faults_) {
    WorkerFault* out = record.add_worker_faults();
    out->set_name(name);
    out->set_score(Decayed(fault, now));
    out->set_updated_unix_ms(absl::ToUnixMillis(now));
  }
  if (state.synced) {
    record.set_last_sync_unix_ms(absl::ToUnixMillis(state.last_sync));
    record.set_center_version_at_last_sync(state.version_after_last_sync);
  }
  if (state.has_divergence) record.set_last_divergence(state.last_divergence);
  *record.mutable_inputs() = state.inputs;
  record.set_weight(state.inputs.weight());
  return record;
}

std::string ReliabilityTracker::Import(const WeightRecord& record) {
  absl::MutexLock lock(&mu_);
  SlotState& state = slots_[KeyOf(record.slot())];
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
  std::string note;
  if (record.faults_by_worker()) {
    if (state.owner.empty()) state.owner = record.owner_name();
    for (const WorkerFault& entry : record.worker_faults()) {
      if (entry.name().empty()) continue;
      const absl::Time updated = absl::FromUnixMillis(entry.updated_unix_ms());
      auto it = faults_.find(entry.name());
      if (it != faults_.end() && it->second.updated >= updated) continue;
      faults_[entry.name()] = Fault{entry.score(), updated};
    }
  } else if (record.fault_score() > 0.0) {
    const std::string slot = SlotName(record.slot());
    if (state.owner.empty()) {
      note = absl::StrCat("old-form weight record of slot ", slot, ": its fault score ",
                          record.fault_score(),
                          " is dropped (the stored membership names no owner of the slot)");
    } else {
      const Fault migrated{record.fault_score(), absl::FromUnixMillis(record.fault_updated_unix_ms())};
      auto it = faults_.find(state.owner);
      const absl::Time at = migrated.updated;
      if (it == faults_.end() || Decayed(it->second, at) < migrated.score) {
        faults_[state.owner] = migrated;
      }
      note = absl::StrCat("old-form weight record of slot ", slot, ": its fault score ",
                          record.fault_score(), " now belongs to its owner '", state.owner, "'");
    }
  }
  return note;
}

}  // namespace rebound::server
