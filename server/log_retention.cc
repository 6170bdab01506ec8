#include "server/log_retention.h"

#include <glog/logging.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/slot.h"

namespace rebound::server {

LogRetention::LogRetention(const JobConfig& job, const Membership* membership,
                           const storage::DurableStore* store, const SlotBooks* books)
    : job_(job), membership_(membership), store_(store), books_(books) {}

LogRetention::SyncFloor LogRetention::ForSync(const SlotId& slot, int64_t step,
                                              uint64_t owner) const {
  SyncFloor floor;
  floor.gc_step = step;
  const auto [first, end] = RecoveryGroup(job_, slot.stage());
  if (end - first <= 1) {
    if (auditor_ == nullptr || !auditor_->enabled()) return floor;
    // Audits (validated: only slots that replay alone). A held window's log stays.
    if (std::optional<int64_t> keep = auditor_->KeepLogFrom(slot)) {
      floor.gc_step = std::min(floor.gc_step, *keep);
    }
    const int64_t previous = books_->Get(slot).last_update_step;
    if (owner != 0 && auditor_->Choose(slot, owner, previous, step)) {
      floor.audit_from = previous;
      floor.owner = owner;
      floor.gc_step = std::min(floor.gc_step, previous);
      if (job_.sharding().groups() > 1) {
        // A header of a few bytes: read under the commit's lock, before the commit replaces it.
        absl::StatusOr<Snapshot> header = SnapshotAt(slot, previous);
        if (header.ok()) floor.audit_start = *std::move(header);
      }
    }
    return floor;
  }
  // While another member is LOST or RECOVERING a replay may be reading the group's logs from the
  // group's floor of that time: nothing more is GC'd until it is back.
  bool member_down = false;
  for (int m = first; m < end; ++m) {
    SlotId member = slot;
    member.set_stage(m);
    if (m != slot.stage() && membership_->SlotDown(member)) member_down = true;
  }
  floor.gc_step = member_down ? books_->Get(slot).log_floor : books_->GroupFloor(slot, step);
  absl::StatusOr<Snapshot> current = store_->ReadSnapshot(slot);
  if (current.ok()) floor.replaced = *std::move(current);
  return floor;
}

void LogRetention::Committed(const SlotId& slot, int64_t step, SyncFloor floor) {
  if (!floor.replaced.has_value()) return;
  absl::MutexLock lock(&mu_);
  previous_snapshots_[{slot.replica(), slot.stage()}] = *std::move(floor.replaced);
}

void LogRetention::HoldAudit(const SlotId& slot, int64_t step, std::optional<int64_t> audit_from,
                             uint64_t owner, std::optional<Snapshot> stored_start) const {
  if (!audit_from.has_value() || auditor_ == nullptr) return;
  absl::StatusOr<Snapshot> start = stored_start.has_value()
                                       ? absl::StatusOr<Snapshot>(*std::move(stored_start))
                                       : SnapshotAt(slot, *audit_from);
  if (start.ok() && start->step() != *audit_from) {
    start = absl::NotFoundError(absl::StrCat("the stored snapshot is of step ", start->step()));
  }
  if (start.ok() && job_.sharding().groups() > 1 && start->step() > 0) {
    // A sharded job's header: the tensors are the ranges'.
    absl::Status filled = fill_from_ranges_
                              ? fill_from_ranges_(&*start)
                              : absl::FailedPreconditionError("no reader of the range groups");
    if (!filled.ok()) start = filled;
  }
  if (!start.ok()) {
    LOG(WARNING) << "audit of slot " << SlotName(slot) << " window (" << *audit_from << ", "
                 << step << "] dropped: " << start.status();
    auditor_->Unread();
    return;
  }
  auditor_->Hold(slot, owner, *std::move(start), step);
}

absl::StatusOr<Snapshot> LogRetention::SnapshotAt(const SlotId& slot, int64_t step) const {
  absl::StatusOr<Snapshot> stored = store_->ReadSnapshot(slot);
  if (stored.ok() && stored->step() == step) return stored;
  if (!stored.ok() && stored.status().code() != absl::StatusCode::kNotFound) return stored;
  {
    absl::MutexLock lock(&mu_);
    auto it = previous_snapshots_.find({slot.replica(), slot.stage()});
    if (it != previous_snapshots_.end() && it->second.step() == step) return it->second;
  }
  if (step == 0) {
    Snapshot initial;  // never synced: the model's initialisation
    *initial.mutable_slot() = slot;
    initial.set_step(0);
    return initial;
  }
  return absl::NotFoundError(absl::StrCat(
      "slot ", SlotName(slot), " has no snapshot of step ", step, " (stored: step ",
      stored.ok() ? stored->step() : 0, "; the one before it is kept in memory only and this "
      "server no longer has it)"));
}

}  // namespace rebound::server
