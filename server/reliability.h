#pragma once

// ReliabilityTracker: the per-trainer weights of DESIGN.md §4.5 (Rebound's own rule, inspired by
// Xu & Carr, 2024, whose exact formula is not public).
//
// At each sync of a trainer the tracker measures
//   staleness  s = (center updates by others since its previous sync) / (R - 1)
//   lateness   l = (time since its previous sync) / median over live trainers of that interval
//   divergence d = ||x - c|| / median over live trainers of their latest ||x_j - c||
//   fault score f in [0, 1]: + fault_increment (capped at 1) per failure, recovery or missed
//              sync deadline, decaying with half-life fault_half_life_s
// and gives the sync the weight
//   w = clamp((1 - f) / (1 + lambda * max(0, max(s, l, d) - 1)), min_weight, 1)
// Policy UNIFORM always answers w = 1 but still measures the inputs, so status shows them.
// Inputs that cannot be measured yet (a first sync, a single trainer, a zero median) are 1:
// neutral.
//
// Thread-safety: thread-safe (one internal mutex, a leaf of the server's lock order). Time is
// passed in, never read from a clock. Ownership: borrows nothing. Status codes: none (nothing
// fails; unknown slots read as neutral).

#include <cstdint>
#include <map>
#include <optional>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "proto/storage.pb.h"

namespace rebound::server {

class ReliabilityTracker {
 public:
  // `replicas` = R. REQUIRES: a validated WeightingConfig.
  ReliabilityTracker(const WeightingConfig& config, int replicas);

  ReliabilityTracker(const ReliabilityTracker&) = delete;
  ReliabilityTracker& operator=(const ReliabilityTracker&) = delete;

  // A sync of `slot` at `now`: `center_version` is the center's version just before this sync
  // is applied, `divergence_norm` is ||x - c|| for it. Records the measurement and returns the
  // weight to apply with its inputs.
  WeightInputs OnSync(const SlotId& slot, absl::Time now, int64_t center_version,
                      double divergence_norm);

  // OnSync in two halves, for a caller that may still refuse the sync after its weight is known
  // (the server's integrity checks, issue R9): Measure returns what OnSync would return and
  // changes nothing; Record then stores that measurement. Measure + Record with the same
  // arguments (and no other sync of the stage in between) is OnSync.
  WeightInputs Measure(const SlotId& slot, absl::Time now, int64_t center_version,
                       double divergence_norm) const;
  void Record(const SlotId& slot, absl::Time now, int64_t center_version,
              double divergence_norm, const WeightInputs& inputs);

  // The median of the latest divergence norms of the stage's other live trainers (`slot` itself
  // left out, so that a sender cannot raise its own reference); nullopt when no other live
  // trainer of the stage has one, or their median is 0. The center-integrity bound
  // weighting.max_divergence_ratio applies to a norm over it. Changes nothing.
  std::optional<double> PeerDivergenceMedian(const SlotId& slot) const;

  // A failure, recovery or missed deadline of `slot`: raises its fault score.
  void OnFault(const SlotId& slot, absl::Time now);

  // A slot's trainer is gone (LOST) or back: only live slots enter the medians.
  void SetLive(const SlotId& slot, bool live);

  // The weight `slot` would get now (fault score decayed to `now`) with the last measured inputs.
  WeightInputs Current(const SlotId& slot, absl::Time now) const;

  // Durable state of every slot, and its restoration after a server restart.
  std::vector<WeightRecord> Export(absl::Time now) const;
  WeightRecord ExportSlot(const SlotId& slot, absl::Time now) const;
  void Import(const WeightRecord& record);

 private:
  struct SlotState {
    bool live = true;
    bool synced = false;
    absl::Time last_sync;
    int64_t version_after_last_sync = 0;
    absl::Duration last_interval = absl::ZeroDuration();
    bool has_interval = false;
    double last_divergence = 0.0;
    bool has_divergence = false;
    double fault = 0.0;
    absl::Time fault_time;
    WeightInputs inputs;
  };
  using Key = std::pair<int, int>;

  static Key KeyOf(const SlotId& slot) { return {slot.replica(), slot.stage()}; }
  double DecayedFault(const SlotState& state, absl::Time now) const;
  // The slot's state after a sync measured at `now` (OnSync's changes, without the inputs).
  static SlotState AfterSync(SlotState state, absl::Time now, int64_t center_version,
                             double divergence_norm);
  WeightInputs MeasureLocked(const SlotId& slot, absl::Time now, int64_t center_version,
                             double divergence_norm) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  double Weight(double fault, double staleness, double lateness, double divergence) const;
  WeightRecord RecordLocked(const Key& key, const SlotState& state, absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WeightingConfig config_;
  const int replicas_;

  mutable absl::Mutex mu_;
  std::map<Key, SlotState> slots_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rebound::server
