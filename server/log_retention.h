#pragma once

// LogRetention: how far back the server keeps each slot's step log and snapshots, so that a
// replay finds what it reads (docs/design.md §5.2, §5.3). A sync of a slot GCs its log through the
// step of its new snapshot; a member of a multi-stage recovery group (an unlogged boundary next
// to it) keeps its log back to the group's oldest last-sync step (a group rebuild replays from
// there), keeps in memory the snapshot its last sync replaced, and while another member of its
// group is LOST or RECOVERING GCs nothing past its previous floor (a replay may be reading the
// group's logs from it). With audits (server/audit/auditor.h) a sync whose window the auditor
// chooses keeps the window's log and hands the auditor its starting snapshot (HoldAudit), and no
// sync GCs a log that a waiting or running audit still reads. A sharded job's group 0 stores a
// slot's snapshot as a header (step, data cursor) while its tensors are the range groups', which
// keep only the slot's last two syncs: the start's header is read when the window is chosen and
// its tensors from every range before the commit is answered (the trainer syncs again only after
// that, so no range has replaced the start yet; docs/recovery.md#audits).
//
// Thread-safety: thread-safe. Lock order: ForSync calls Membership::SlotDown and SlotBooks
// (each takes its own lock, none nested) and reads the store; it holds no lock of its own
// meanwhile, so callers may hold a stage lock around it. Its own mutex is a leaf.
// Ownership: `membership`, `store` and `books` are borrowed and must outlive this object.
// Status codes: SnapshotAt gives NOT_FOUND when neither the stored snapshot nor the replaced one
// is at the step asked for, and the store's errors (DATA_LOSS, UNAVAILABLE) as they are.

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "proto/storage.pb.h"
#include "server/audit/auditor.h"
#include "server/membership.h"
#include "server/slot_books.h"
#include "storage/durable_store.h"

namespace rebound::server {

class LogRetention {
 public:
  // REQUIRES: the pointers outlive this object.
  LogRetention(const JobConfig& job, const Membership* membership,
               const storage::DurableStore* store, const SlotBooks* books);

  LogRetention(const LogRetention&) = delete;
  LogRetention& operator=(const LogRetention&) = delete;

  // Audits: the auditor whose windows' logs are kept (nullptr: none). Call before the service
  // is ready; `auditor` must outlive this object.
  void SetAuditor(Auditor* auditor) { auditor_ = auditor; }

  // A sharded job's group 0: fills an audited window's start (a stored header) with its tensors
  // from every range (server/shard/range_reader.h). Unset, such a window is dropped (logged).
  // Call before the service is ready.
  using RangeSnapshotFill = std::function<absl::Status(Snapshot* header)>;
  void SetRangeSnapshotFill(RangeSnapshotFill fill) { fill_from_ranges_ = std::move(fill); }

  // What a sync of `slot` at `step` keeps.
  struct SyncFloor {
    int64_t gc_step = 0;               // the log is GC'd through this step
    std::optional<Snapshot> replaced;  // group members: the snapshot the sync replaces
    // An audited window (audit_from, step] of `owner`'s: HoldAudit reads its starting snapshot.
    std::optional<int64_t> audit_from;
    uint64_t owner = 0;
    // A sharded job: the window's start as stored (a header), read when the window is chosen
    // (the sync's commit replaces it).
    std::optional<Snapshot> audit_start;
  };
  // Called before the sync's batch is written (under the stage lock). `owner`: the sync's
  // incarnation (0: unknown, no audit).
  SyncFloor ForSync(const SlotId& slot, int64_t step, uint64_t owner = 0) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Once the sync is decided: keeps `floor.replaced` (if any) as the slot's previous snapshot.
  void Committed(const SlotId& slot, int64_t step, SyncFloor floor) ABSL_LOCKS_EXCLUDED(mu_);

  // A sync that chose its window (floor.audit_from set), outside the stage lock and before the
  // sync's batch is written, while the stored snapshot is still the window's start: reads it and
  // hands the window (audit_from, step] to the auditor. A start that is gone (a takeover wrote
  // another) drops the window, logged. Reading the snapshot (parameters and optimizer state)
  // here rather than in ForSync keeps the read off the stage lock: other trainers' syncs of the
  // stage do not wait for it. A sharded job's window (`start`: SyncFloor::audit_start) is handed
  // over once its tensors are read from the ranges, after the commit and before it is answered.
  void HoldAudit(const SlotId& slot, int64_t step, std::optional<int64_t> audit_from,
                 uint64_t owner, std::optional<Snapshot> start = std::nullopt) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // The snapshot of `slot` at `step`: its stored one, or the one its last sync replaced, or (step
  // 0) the model's initialisation.
  absl::StatusOr<Snapshot> SnapshotAt(const SlotId& slot, int64_t step) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const JobConfig job_;
  const Membership* const membership_;
  const storage::DurableStore* const store_;
  const SlotBooks* const books_;
  Auditor* auditor_ = nullptr;
  RangeSnapshotFill fill_from_ranges_;

  mutable absl::Mutex mu_;
  // Members of multi-stage recovery groups: the snapshot each one's last sync replaced (memory
  // only: after a server restart a group whose members' snapshots differ waits for its next
  // common round; docs/recovery.md).
  std::map<std::pair<int, int>, Snapshot> previous_snapshots_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rebound::server
