#pragma once

// SlotBooks: the bookkeeping the server keeps per slot for the updates it applied (the last
// applied step, the update count, the last applied push sequence, the step through which the
// slot's log was GC'd), the DETERMINISTIC scheduling turns derived from it, the recovery group's
// oldest last-sync step (its log floor), and the center-integrity figures (syncs and pushes
// refused per slot, the largest accepted divergence ratio per stage).
//
// The books are memory plus the weight records: the service writes a slot's book into the slot's
// WeightRecord with every update (in the update's write batch) and calls Set after that batch
// committed (or SetDecided before it, then MarkDurable after it); Restore loads them back after
// a server restart. Durable gives the books a crash cannot take back.
//
// Thread-safety: thread-safe (one internal mutex, a leaf: no other lock is taken under it, and no
// callback runs under it). WaitForTurn blocks the calling thread (at most its timeout).
// Ownership: holds a copy of the job's topology; borrows nothing.
// Status codes: WaitForTurn gives UNAVAILABLE when the turn does not come within the timeout;
// nothing else fails.

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "proto/storage.pb.h"

namespace rebound::server {

// A slot's book; all zero for a slot with no applied update.
struct SlotBook {
  int64_t last_update_step = 0;
  // The step through which the slot's last sync GC'd its log (memory only): its snapshot's step,
  // or for a member of a multi-stage recovery group the group's floor then.
  int64_t log_floor = 0;
  int64_t update_count = 0;
  uint64_t applied_sequence = 0;
  // A sharded job (docs/design.md §10.2): the weight of the slot's next sync, decided when group 0
  // committed its previous one (1 before the first).
  double next_weight = 1.0;
};

// The weight record stored with every update of `slot`: `weights` (its
// ReliabilityTracker::ExportSlot) with the slot id and `book`.
WeightRecord WithBook(WeightRecord weights, const SlotId& slot, const SlotBook& book);

class SlotBooks {
 public:
  explicit SlotBooks(const JobConfig& job);

  SlotBooks(const SlotBooks&) = delete;
  SlotBooks& operator=(const SlotBooks&) = delete;

  // The slot's book (all zero if it has none).
  SlotBook Get(const SlotId& slot) const ABSL_LOCKS_EXCLUDED(mu_);

  // Records the book of an update that committed (its batch is durable), and raises the
  // stage's largest accepted divergence ratio to `divergence_ratio`.
  void Set(const SlotId& slot, const SlotBook& book, double divergence_ratio)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Likewise for an update decided but not yet durable (an unsharded sync is decided under the
  // stage lock and written after it: CenterTable::ElasticSyncStaged): every rule sees it at
  // once (a retry of its step is a duplicate from now on), readers (Durable) only once
  // MarkDurable says its batch is durable.
  void SetDecided(const SlotId& slot, const SlotBook& book, double divergence_ratio)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The update of `slot` that made its book `book` (SetDecided) is durable.
  void MarkDurable(const SlotId& slot, const SlotBook& book) ABSL_LOCKS_EXCLUDED(mu_);
  // The slot's book as of its last durable update: what status and exports report, so that a
  // reader never sees an update a crash could still take back.
  SlotBook Durable(const SlotId& slot) const ABSL_LOCKS_EXCLUDED(mu_);

  // Books of a previous server life (or of a checkpoint), from their weight records: applied
  // sequence, last update step and update count. Other slots keep theirs.
  void Restore(const std::vector<WeightRecord>& records) ABSL_LOCKS_EXCLUDED(mu_);
  // Every book back to zero (a GLOBAL_CHECKPOINT rollback, before Restore of the checkpoint's).
  void Clear() ABSL_LOCKS_EXCLUDED(mu_);

  // The step through which the slot's step log may be GC'd: for a member of a multi-stage
  // recovery group, or of a job with audits, its log_floor (a group rebuild starts from the
  // group's oldest snapshot; an audited window's log is kept), otherwise its last applied step.
  // 0 for a slot with no book.
  int64_t StepLogFloor(const SlotId& slot) const ABSL_LOCKS_EXCLUDED(mu_);

  // The newest durable last applied step over every slot (0 when none has a book).
  int64_t NewestUpdateStep() const ABSL_LOCKS_EXCLUDED(mu_);

  // Pipelines (docs/design.md §5.2): the oldest last-sync step over the recovery group of `slot`, with
  // the slot's own taken as `own_step` (< 0: its book's). A group rebuild replays from there, so
  // the group's logs are kept back to it. The slot's own step when it is alone in its group.
  int64_t GroupFloor(const SlotId& slot, int64_t own_step) const ABSL_LOCKS_EXCLUDED(mu_);

  // DETERMINISTIC scheduling: waits until `slot` holds the smallest (update count, replica) of
  // its stage, i.e. it is its turn in the round. UNAVAILABLE after `timeout`.
  absl::Status WaitForTurn(const SlotId& slot, absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

  // Center integrity: a sync or push of `slot` refused as its worker's fault.
  void CountRefused(const SlotId& slot) ABSL_LOCKS_EXCLUDED(mu_);
  int64_t Refused(const SlotId& slot) const ABSL_LOCKS_EXCLUDED(mu_);
  // The largest divergence ratio an accepted update of `stage` had (0 before the first).
  double MaxDivergenceRatio(int stage) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Key = std::pair<int, int>;
  static Key KeyOf(const SlotId& slot) { return {slot.replica(), slot.stage()}; }
  const SlotBook& GetLocked(const Key& key) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const JobConfig job_;

  mutable absl::Mutex mu_;
  std::map<Key, SlotBook> books_ ABSL_GUARDED_BY(mu_);
  // The books as of each slot's last durable update (step and count only).
  std::map<Key, SlotBook> durable_ ABSL_GUARDED_BY(mu_);
  // Center integrity (memory only, since the server started).
  std::map<Key, int64_t> refused_ ABSL_GUARDED_BY(mu_);
  std::map<int, double> max_divergence_ratio_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rebound::server
