#pragma once

// ReliabilityTracker: the per-trainer weights of docs/design.md §4.5 (Rebound's own rule, inspired by
// Xu & Carr, 2024, whose exact formula is not public).
//
// At each sync of a trainer the tracker measures
//   staleness  s = (center updates by others since its previous sync) / (R - 1)
//   lateness   l = (time since its previous sync) / median over live trainers of that interval
//   divergence d = ||x - c|| / median over live trainers of their latest ||x_j - c||
// and takes the fault score f in [0, 1] of the slot's current owner. Fault scores belong to
// workers, by registered name, not to slots: + fault_increment (capped at 1) per OnFault of the
// name (a declared failure, an update refused as its sender's fault), decaying with half-life
// fault_half_life_s. A slot rebuilt by a replay is not charged; its new owner brings its own
// score (SetOwner), and a worker that registers again under the same name carries its score.
// s and l enter the weight as exponential moving averages over the slot's syncs with half-life
// input_smoothing_half_life_syncs (alpha = 1 - 2^(-1/h); the first measurement initializes the
// average; h = 0 uses them raw); d is always used as measured. The sync gets the weight
//   w = clamp((1 - f) / (1 + lambda * max(0, max(s', l', d) - 1)), min_weight, 1)
// where s', l' are the averages; the WeightInputs returned and shown in status hold s', l', d, f.
// Policy UNIFORM always answers w = 1 but still measures the inputs, so status shows them.
// Inputs that cannot be measured yet (a first sync of an owner, a single trainer, a zero median)
// are 1: neutral.
//
// The table of worker scores is bounded: a name whose score decayed below kForgetBelow and that
// owns no slot is forgotten, and at most kMaxWorkers names are kept (the lowest scores that own no
// slot are dropped first), so the per-worker metric has a bounded label count.
//
// Thread-safety: thread-safe (one internal mutex, a leaf of the server's lock order). Time is
// passed in, never read from a clock. Ownership: borrows nothing. Status codes: none (nothing
// fails; unknown slots and names read as neutral).

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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

  // A fault of the worker registered as `worker` (a declared failure, an update refused as its
  // fault): raises that name's score. Nothing for an empty name.
  void OnFault(const std::string& worker, absl::Time now);

  // A new trainer (incarnation) registered as `worker` now owns `slot` (a registration, a takeover
  // after a replay or restore, a restart from the center): the slot's weight uses that name's
  // score from now on, and the slot's sync history (previous sync, averaged inputs, divergence)
  // starts afresh, so the new trainer's first sync is neutral. "" = no owner known (fault 0).
  void SetOwner(const SlotId& slot, const std::string& worker);

  // The fault score of `worker` decayed to `now` (0 for a name never charged or forgotten).
  double FaultScore(const std::string& worker, absl::Time now) const;
  // Every name the tracker holds with its score decayed to `now`, by name (at most kMaxWorkers).
  std::vector<std::pair<std::string, double>> FaultScores(absl::Time now) const;

  // A slot's trainer is gone (LOST) or back: only live slots enter the medians.
  void SetLive(const SlotId& slot, bool live);

  // The weight `slot` would get now (its owner's fault score decayed to `now`) with the last
  // measured inputs (the smoothed staleness and lateness, the raw divergence).
  WeightInputs Current(const SlotId& slot, absl::Time now) const;

  // Durable state of every slot, and its restoration after a server restart (the moving averages
  // of staleness and lateness start afresh: the first measurement after it initializes them;
  // status shows the stored inputs until then). Each record carries
  // its slot's owner and the whole table of worker scores (storage.proto WeightRecord); Import
  // keeps, per name, the most recently updated entry, and takes the record's owner unless
  // SetOwner gave the slot one before. A record of the old form (no faults_by_worker: its
  // fault_score was the slot's) gives that score to the slot's owner as SetOwner set it before
  // Import (server/main.cc sets the owners from the stored membership first), keeping the higher
  // if the name already has one; with no owner known the score is dropped. Returns a line for the
  // log when an old-form score was migrated or dropped, "" otherwise.
  std::vector<WeightRecord> Export(absl::Time now) const;
  WeightRecord ExportSlot(const SlotId& slot, absl::Time now) const;
  std::string Import(const WeightRecord& record);

  static constexpr double kForgetBelow = 1e-3;
  static constexpr size_t kMaxWorkers = 256;

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
    // The moving averages of staleness and lateness (valid once a first one was measured).
    bool has_staleness = false;
    double staleness = 1.0;
    bool has_lateness = false;
    double lateness = 1.0;
    std::string owner;  // registered name of the slot's trainer, "" = none known
    WeightInputs inputs;
  };
  struct Fault {
    double score = 0.0;
    absl::Time updated;
  };
  using Key = std::pair<int, int>;

  static Key KeyOf(const SlotId& slot) { return {slot.replica(), slot.stage()}; }
  double Decayed(const Fault& fault, absl::Time now) const;
  double OwnerFaultLocked(const SlotState& state, absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One more raw measurement `raw` folded into the average `*value` (`*has` says it holds one).
  double Smooth(bool* has, double* value, double raw) const;
  // Forgets decayed names that own no slot, then the lowest scores beyond kMaxWorkers.
  void PruneLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The slot's state after a sync measured at `now` (OnSync's changes, the averages included),
  // with the inputs that sync gets.
  struct Measured {
    SlotState after;
    WeightInputs inputs;
  };
  Measured MeasureLocked(const SlotId& slot, absl::Time now, int64_t center_version,
                         double divergence_norm) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  double Weight(double fault, double staleness, double lateness, double divergence) const;
  WeightRecord RecordLocked(const Key& key, const SlotState& state, absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WeightingConfig config_;
  const int replicas_;

  mutable absl::Mutex mu_;
  std::map<Key, SlotState> slots_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Fault> faults_ ABSL_GUARDED_BY(mu_);  // by registered name
};

}  // namespace rebound::server
