#pragma once

// Policy GLOBAL_CHECKPOINT (docs/design.md §5.4), the baseline that REPLAY is measured against: every
// K = fault_tolerance.checkpoint_every_steps steps all slots and the center are checkpointed, and
// a failure rolls every slot back to the last checkpoint.
//
// Cuts. The steps K, 2K, ... and max_steps are cuts (K is a multiple of the sync period, so a
// trainer syncs at every cut). A trainer's sync at a cut is applied and made durable as usual,
// then its reply waits at the cut's barrier until every slot has synced there: the center then
// holds exactly the syncs up to the cut, each slot's snapshot is its state at the cut, and the
// last slot to arrive takes the checkpoint (the centers and snapshots, gathered by the caller)
// before all are released. This is what a consistent global checkpoint costs an asynchronous
// job: the fast trainers wait for the slowest at every cut, plus the write. A wait longer than
// the server's max_wait_ms answers UNAVAILABLE; the trainer retries the sync, which the server
// recognises as applied and sends back to the barrier.
//
// Persistence. With a data directory each checkpoint is written to
// <data_dir>/checkpoints/checkpoint-<step>.pb (written to a temporary file, fsynced, renamed; the
// older one removed), and Load finds the newest at start. Without one it is kept in memory.
//
// Rollback. Freeze fixes the checkpoint to go back to: from then on no cut completes (an arrival
// gets ABORTED), so the step the caller fences the trainers at is the step it restores. The
// caller then fences every trainer, and BeginRollback releases every waiter with ABORTED and
// returns that same checkpoint; the caller restores the center and the slots from it
// (server/service.cc).
//
// Thread-safety: thread-safe; Arrive blocks the calling thread at the barrier (at most its
// timeout). Ownership: the Clock is borrowed and must outlive the object; times of arrivals, writes
// and waits are read from it (the barrier's timeout itself is a wait on the object's mutex).
//
// Status codes: Load gives DATA_LOSS for a file that does not parse or belongs to another job;
// Arrive gives ABORTED (a rollback), UNAVAILABLE (the barrier's wait timed out), INTERNAL (an
// arrival at another cut than the pending one).

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "proto/storage.pb.h"

namespace rebound::server {

class GlobalCheckpoint {
 public:
  // `dir`: where checkpoint files live; empty keeps them in memory. `initial`: the checkpoint of
  // the job's start (step 0: the initial centers, no snapshots: every slot starts from the
  // model's initialisation), used until a newer one is taken or loaded. `clock` outlives this.
  GlobalCheckpoint(const JobConfig& job, std::string dir, CheckpointRecord initial,
                   const Clock* clock);

  GlobalCheckpoint(const GlobalCheckpoint&) = delete;
  GlobalCheckpoint& operator=(const GlobalCheckpoint&) = delete;

  // Loads the newest checkpoint file of `dir`, if any (a server restart). DATA_LOSS if it does
  // not parse or belongs to another job.
  absl::Status Load() ABSL_LOCKS_EXCLUDED(mu_);

  // True iff a sync at `step` must wait at a barrier.
  bool IsCut(int64_t step) const;

  // Gathers the checkpoint of a completed cut (the caller reads the centers and snapshots);
  // `current_step` is the checkpoint kept until this one is persisted (what a rollback restores
  // if this one fails).
  using TakeFn =
      std::function<absl::StatusOr<CheckpointRecord>(int64_t step, int64_t current_step)>;

  // The number of rollbacks so far. A sync reads it before it is applied and passes it to
  // Arrive, so that a sync applied just before a rollback never arrives at a barrier after it.
  uint64_t epoch() const ABSL_LOCKS_EXCLUDED(mu_);

  // Slot `slot_index` has synced at cut `step` (in `epoch`: ABORTED if a rollback has happened
  // since). Waits up to `timeout` for every slot to arrive;
  // the last to arrive calls `take` and persists its result first. OK once the cut is complete
  // (at once for a cut already complete: a retried sync); UNAVAILABLE when the wait times out;
  // ABORTED when a rollback ends the wait. A failing `take` or write is logged and the older
  // checkpoint kept: training goes on and the next cut tries again.
  absl::Status Arrive(int slot_index, int64_t step, uint64_t epoch, absl::Duration timeout,
                      const TakeFn& take) ABSL_LOCKS_EXCLUDED(mu_);

  // Fixes the checkpoint a rollback goes back to and returns it: until BeginRollback no cut
  // completes, and an arrival gets ABORTED.
  CheckpointRecord Freeze() ABSL_LOCKS_EXCLUDED(mu_);

  // Starts a rollback: waiters get ABORTED, the barrier is reset; returns the checkpoint to
  // restore (the one Freeze returned, if it was called).
  CheckpointRecord BeginRollback() ABSL_LOCKS_EXCLUDED(mu_);

  // The current checkpoint (the last taken or loaded).
  CheckpointRecord Current() const ABSL_LOCKS_EXCLUDED(mu_);

  void FillStatus(CheckpointStatus* out) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Status Persist(const CheckpointRecord& record) const;

  const std::string job_id_;
  const int num_slots_;
  const int64_t every_;
  const int64_t max_steps_;
  const std::string dir_;
  const Clock* const clock_;

  mutable absl::Mutex mu_;
  CheckpointRecord current_ ABSL_GUARDED_BY(mu_);
  int64_t completed_step_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t pending_step_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, absl::Time> arrived_ ABSL_GUARDED_BY(mu_);  // slot -> first arrival
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;                 // rollbacks
  bool frozen_ ABSL_GUARDED_BY(mu_) = false;                // a rollback is under way
  int64_t count_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration barrier_wait_ ABSL_GUARDED_BY(mu_);
  absl::Duration write_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rebound::server
