#pragma once

// The worker-to-worker half of a parallel replay (docs/design.md §5.3). k spares replay a lost slot
// together: each computes a tree-aligned block of every step's micro-batches and sends its
// block's reduced sums to every other spare (PartialSum); each combines the k blocks along the
// top of the reduction tree, in the same order, and applies the same AdaHessian step.
//
// ReplayMailbox holds the messages that reach this worker's WorkerPeer service
// (worker/peer_service.h) until the replay loop takes them. It serves one task at a time:
//   * a message for a task newer than the open one (or when none is open) is refused with
//     UNAVAILABLE: the sender is ahead of us (we are still reading the snapshot) and retries;
//   * a message for an older task, or for a step the loop has already passed, is refused with
//     FAILED_PRECONDITION: that task or step is over;
//   * a duplicate (same step and rank) is dropped;
//   * at most `max_bytes` of sums are held; more is RESOURCE_EXHAUSTED.
// It also holds, per sending rank, the mapping of that spare's shared-memory region
// (worker/shared_sums.h): a message carrying sums both inline and in a region (the first of a
// task) has the region mapped and compared here; equal bytes make the mailbox keep the mapping
// and the service acknowledge shm_mapped. A reference-only message from a rank without a mapping
// of that name is FAILED_PRECONDITION.
// Thread-safety: thread-safe (the peer service's handlers put, the replay takes).
// Ownership: the mailbox owns the messages it holds and its region mappings; Region() shares a
// mapping with the caller, which may keep it past the next Open or Close.

#include <cstdint>
#include <map>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/rebound.grpc.pb.h"
#include "worker/shared_sums.h"

namespace rebound::worker {

class ReplayMailbox {
 public:
  explicit ReplayMailbox(int64_t max_bytes) : max_bytes_(max_bytes) {}

  ReplayMailbox(const ReplayMailbox&) = delete;
  ReplayMailbox& operator=(const ReplayMailbox&) = delete;

  // Accepts messages of task `task_id` from now on (dropping anything held).
  void Open(uint64_t task_id);
  // Refuses everything until the next Open; drops what is held.
  void Close();

  // Called by the WorkerPeer service; see the class comment for the errors. True if the message
  // offered a shared-memory region that is now mapped (the sender may send references).
  absl::StatusOr<bool> PutPartial(PartialSum message);

  // The partial sum of `step` from `rank`, waiting up to `timeout` (DEADLINE_EXCEEDED then;
  // FAILED_PRECONDITION if the mailbox is not open). Forgets every held partial of an earlier
  // step.
  absl::StatusOr<PartialSum> TakePartial(int64_t step, int rank, absl::Duration timeout);

  int64_t held_bytes() const;

  // The mapping of `rank`'s region in the open task, or null.
  std::shared_ptr<const SharedSumsReader> Region(int rank) const;

 private:
  absl::Status Admit(uint64_t task_id, int64_t step, int64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Maps the region `message` offers and compares it with its inline sums (no lock held: this
  // reads megabytes). Null (and a log line) if it cannot be used.
  static std::shared_ptr<const SharedSumsReader> MapOffered(const PartialSum& message);
  void DropBefore(int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t max_bytes_;
  mutable absl::Mutex mu_;
  uint64_t open_task_ ABSL_GUARDED_BY(mu_) = 0;  // 0: closed
  uint64_t last_task_ ABSL_GUARDED_BY(mu_) = 0;  // the newest task ever opened
  int64_t floor_step_ ABSL_GUARDED_BY(mu_) = 0;  // messages of steps below this are stale
  std::map<std::pair<int64_t, int>, PartialSum> partials_ ABSL_GUARDED_BY(mu_);
  int64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, std::shared_ptr<const SharedSumsReader>> regions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rebound::worker
