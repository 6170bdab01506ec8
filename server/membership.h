#pragma once

// Membership: who is in the job, which slot each trainer owns, and who is fenced.
//
// Every registration gets a fresh incarnation number, never reused: the high 32 bits are the
// server's start time in seconds (its epoch), the low 32 bits a counter. A worker silent for
// failure_timeout is declared FAILED; its incarnation is fenced for good: every later call that
// names it gets FAILED_PRECONDITION. An incarnation this server life does not know (a restart
// without durable state, or one with it that restores only the slots' owners, not spares and
// evaluators) gets ABORTED: the worker should register again.
// Records of fenced workers are kept up to kMaxFencedRecords; older ones are pruned, and an
// incarnation of this epoch below the counter is still recognised as fenced.
//
// Replay tasks. The claim of a task (ClaimReplay), its published range, its finish and its
// release are still kept here, with the slots' task fields, under the membership's lock; their
// only caller is the RecoveryCoordinator (server/recovery_coordinator.h), which assembles the
// tasks and decides what a finish means under the job's policy.
//
// Thread-safety: thread-safe; one mutex (mu_), which is taken after the stage and step-log locks
// and before SlotBooks' and the persist function's (server/recovery_coordinator.h has the
// server's lock order). ClaimReplay blocks the caller up to its timeout. The persist function is
// called under mu_ and must take no lock that is held while calling Membership.
// Ownership: `clock` is borrowed and must outlive the membership; the persist function is copied.
// Status codes: each function says which it returns; in general INVALID_ARGUMENT for a malformed
// request, ABORTED for an unknown incarnation (register again), FAILED_PRECONDITION for a fenced
// one or one that does not hold what it names, UNAUTHENTICATED / PERMISSION_DENIED from
// Authenticate and CheckRole, RESOURCE_EXHAUSTED when every trainer slot is owned.
// Time comes from the injected Clock.

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "proto/storage.pb.h"

namespace rebound::server {

// A worker declared failed by DetectFailures.
struct FailedWorker {
  uint64_t incarnation = 0;
  std::string name;
  bool had_slot = false;
  SlotId slot;
  absl::Duration silent_for;
};

class Membership {
 public:
  // Writes the membership's durable state; called under the membership's lock after every
  // change of a slot's owner or state and every new incarnation. A failing persist makes the
  // change fail (Register) or is logged (failure detection, which must go on).
  using PersistFn =
      std::function<absl::Status(const ServerRecord& server, const std::vector<SlotRecord>& slots)>;

  // REQUIRES: `job` is validated; `clock` outlives this object.
  Membership(const JobConfig& job, const Clock* clock, PersistFn persist = nullptr);

  // Restores the state of a previous server life: the incarnation epoch and counter, and each
  // slot's state and owner. Owners come back ALIVE with `grace` added to their silence budget,
  // so a trainer that reconnects within reconnect_grace + failure_timeout just goes on.
  // INVALID_ARGUMENT if the records belong to another job or topology.
  absl::Status Restore(const ServerRecord& server, const std::vector<SlotRecord>& slots,
                       absl::Duration grace) ABSL_LOCKS_EXCLUDED(mu_);

  static constexpr size_t kMaxFencedRecords = 4096;

  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  // Admits a worker. FAILED_PRECONDITION if the job id differs; RESOURCE_EXHAUSTED if it asks
  // to be a trainer and every slot is owned; INVALID_ARGUMENT for a malformed request.
  absl::StatusOr<RegisterResponse> Register(const RegisterRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Records liveness and progress. FAILED_PRECONDITION if fenced, ABORTED if unknown.
  absl::StatusOr<HeartbeatResponse> Heartbeat(const HeartbeatRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);

  // A clean exit: the incarnation is fenced as DEPARTED (DRAINED if `drained`); a slot it owned
  // becomes LOST (recovered by the job's policy: under REPLAY from its snapshot, which a drained
  // trainer's last sync made current, so nothing is replayed).
  absl::Status Deregister(uint64_t incarnation, bool drained = false) ABSL_LOCKS_EXCLUDED(mu_);

  // Asks the trainer of `slot` to drain: its heartbeats carry DRAIN until it leaves (after its
  // next sync). Returns its incarnation. INVALID_ARGUMENT for a slot outside the topology,
  // FAILED_PRECONDITION unless the slot is ACTIVE with an owner.
  absl::StatusOr<uint64_t> Drain(const SlotId& slot) ABSL_LOCKS_EXCLUDED(mu_);

  // Proves that a call naming `incarnation` comes from that worker: OK iff the incarnation is
  // alive and `credential` is its RegisterResponse.credential (compared in constant time).
  // UNAUTHENTICATED for an alive incarnation and another credential or none; the errors of
  // CheckAlive (ABORTED, FAILED_PRECONDITION) for an unknown or fenced one, which can do nothing
  // whoever names it; ABORTED for an owner restored from a data directory written before
  // credentials existed (it must register again). Every worker RPC calls this first.
  absl::Status Authenticate(uint64_t incarnation, absl::string_view credential) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // OK iff `incarnation` is alive; the errors of Heartbeat otherwise. For every worker RPC.
  absl::Status CheckAlive(uint64_t incarnation) const ABSL_LOCKS_EXCLUDED(mu_);

  // OK iff `incarnation` is alive in role `role`; PERMISSION_DENIED naming its role otherwise
  // (the errors of CheckAlive first).
  absl::Status CheckRole(uint64_t incarnation, WorkerRole role) const ABSL_LOCKS_EXCLUDED(mu_);

  // The range a replay task's leader published (PublishReplay): its snapshot step t0 and failed
  // step t_f. FAILED_PRECONDITION unless `incarnation` leads task `task_id` and has published it.
  absl::StatusOr<std::pair<int64_t, int64_t>> PublishedRange(uint64_t task_id,
                                                             uint64_t incarnation) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // OK iff `incarnation` is alive and owns `slot`; FAILED_PRECONDITION otherwise.
  absl::Status CheckOwner(uint64_t incarnation, const SlotId& slot) const ABSL_LOCKS_EXCLUDED(mu_);

  // True while `slot` has no trainer to train it: LOST or RECOVERING (a recovery group's logs must
  // not be GC'd past what its replay reads meanwhile).
  bool SlotDown(const SlotId& slot) const ABSL_LOCKS_EXCLUDED(mu_);

  // Records a slot's progress; at `max_steps` the slot becomes FINISHED (for good: its owner
  // may then leave without the slot becoming LOST). Returns true if it just finished.
  bool RecordProgress(const SlotId& slot, int64_t step, int64_t max_steps) ABSL_LOCKS_EXCLUDED(mu_);

  // True once every slot is FINISHED: heartbeats then carry STOP.
  bool AllFinished() const ABSL_LOCKS_EXCLUDED(mu_);

  // The recoveries so far (newest last, at most kMaxRecoveries), for status.
  std::vector<RecoveryStatus> Recoveries() const ABSL_LOCKS_EXCLUDED(mu_);
  static constexpr size_t kMaxRecoveries = 256;

  // Policy REPLAY (DESIGN §5.3). A replay task as one of its spares receives it.
  struct TaskSpare {
    uint64_t incarnation = 0;
    std::string peer_address;
  };
  struct ReplayClaim {
    uint64_t task_id = 0;
    SlotId slot;
    int64_t reached_step = 0;  // the last step the lost trainer reported
    int rank = 0;              // 0: the leader, which created the task and publishes its range
    std::vector<TaskSpare> spares;  // the task's spares in rank order, leader first
    // rank > 0 only: the range the leader published (PublishReplay).
    int64_t snapshot_step = 0;
    int64_t failed_step = 0;
  };
  // Waits up to `timeout` for work for the alive SPARE `incarnation` and claims it:
  //  * a task whose leader picked this spare as a helper and published the range: rank > 0;
  //  * else a LOST slot to replay: the slot becomes RECOVERING under a new task led by this
  //    spare (rank 0), with up to recovery_parallelism - 1 helpers, chosen among the other
  //    spares waiting in ClaimReplay at that moment (fewer when fewer wait). The leader reads
  //    the snapshot and the log's extent and calls PublishReplay, which hands the helpers the
  //    task.
  // Nothing when there is none by then. A helper that asks again leaves its task (it finished
  // or gave up; the leader decides the task's outcome). FAILED_PRECONDITION if `incarnation` is
  // not an alive spare or leads a task.
  absl::StatusOr<std::optional<ReplayClaim>> ClaimReplay(uint64_t incarnation,
                                                         absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The leader's range of task `task_id`: the snapshot's step t0 and t_f. Wakes the helpers.
  void PublishReplay(uint64_t task_id, int64_t snapshot_step, int64_t failed_step)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The slot of a task `incarnation` takes part in; FAILED_PRECONDITION otherwise.
  absl::StatusOr<SlotId> TaskSlot(uint64_t task_id, uint64_t incarnation) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Gives up a claimed task (e.g. its snapshot cannot be read): the slot is LOST again.
  void AbandonReplay(uint64_t task_id, const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  // How a task that did not rebuild its slot ends, as the recovery policy decided it
  // (RecoveryPolicy::EndOf): the recovery record's outcome and detail, and whether the slot falls
  // back to RESTART_FROM_CENTER (the next spare heartbeat takes it over) instead of waiting for
  // another replay.
  struct ReplayEnd {
    RecoveryOutcome outcome = ABANDONED;
    std::string why;
    bool fallback_restart = false;
  };
  // The end of a replay, reported by its leader. RECOVERED: the leader becomes the slot's
  // trainer under a new incarnation, returned (its spare incarnation is fenced as REPLACED); the
  // helpers are spares again. Any other outcome: the slot is LOST again and `end` applies
  // (ignored for RECOVERED). The recovery's record in status gets `report`'s figures.
  // FAILED_PRECONDITION unless `incarnation` leads task report.task_id().
  absl::StatusOr<std::optional<RegisterResponse>> FinishReplay(uint64_t incarnation,
                                                               const ReportRecoveryRequest& report,
                                                               const ReplayEnd& end)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Policy GLOBAL_CHECKPOINT. True (with the reason) once per loss of a slot's trainer since the
  // last call: the caller rolls everything back (ParameterServerService::MaybeRollBack).
  bool TakeRollbackRequest(std::string* why) ABSL_LOCKS_EXCLUDED(mu_);
  // Fences every alive trainer as ROLLED_BACK (its calls get ABORTED: it registers again) and
  // makes every slot LOST at `step`, the checkpoint's. No spare is given a slot to restore until
  // FinishRollback: the caller first puts the center and the slots' bookkeeping back.
  void RollBackAll(int64_t step, const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  // The server's state is back at the checkpoint: spares may restore the slots (ClaimReplay),
  // and the next loss of a trainer requests the next rollback.
  void FinishRollback() ABSL_LOCKS_EXCLUDED(mu_);
  // GLOBAL_CHECKPOINT: true, once, for a slot just restored whose trainer had been lost (declared
  // failed or gone), not merely rolled back with the others: its restore is a recovery that
  // counts against it, as a replay or a restart does under the other policies (DESIGN §4.5).
  bool TakeRecoveryCharge(const SlotId& slot) ABSL_LOCKS_EXCLUDED(mu_);

  // Declares failed every alive worker silent for longer than failure_timeout, fences it and
  // marks its slot LOST. Returns the newly failed workers.
  std::vector<FailedWorker> DetectFailures() ABSL_LOCKS_EXCLUDED(mu_);

  // The server itself did not run for `paused` (SIGSTOP, a VM frozen for migration, a machine
  // swapping): no heartbeat could arrive, so that time is not a worker's silence. Moves every
  // alive worker's last heartbeat and every replay task's start forward by it, never past now
  // (a restored worker's heartbeat already ahead of now stays). Called by the failure detector
  // when it wakes far later than it asked to.
  void ExcuseServerPause(absl::Duration paused) ABSL_LOCKS_EXCLUDED(mu_);

  // Fills the membership part of a status reply (slots and workers).
  void FillStatus(GetStatusResponse* response) const ABSL_LOCKS_EXCLUDED(mu_);

  // Number of workers in each state (for tests and metrics).
  int CountInState(WorkerState state) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Worker {
    uint64_t incarnation = 0;
    std::string name;
    WorkerRole role = ROLE_UNSPECIFIED;
    WorkerState state = ALIVE;
    std::string state_reason;
    int slot_index = -1;  // index into slots_, -1 for none
    std::string peer_address;
    std::string metrics_address;
    int64_t step = 0;
    double loss = 0.0;
    absl::Time registered;
    absl::Time last_heartbeat;
    int64_t silent_ms_at_failure = 0;
    bool polling = false;  // a spare waiting in ClaimReplay: it can help a replay at once
    bool draining = false;  // asked to drain (Drain)
    // A trainer that took its slot over after replay task `takeover_task` at `handed_over`: its
    // first heartbeat ends the recovery's takeover phase.
    uint64_t takeover_task = 0;
    absl::Time handed_over;
    // Pipelines: FLUSH_LOG requests made of this trainer (a neighbour of a lost slot) and the
    // last one it reported done; what it waits for when blocked on a neighbour (heartbeat).
    int64_t flushes_requested = 0;
    int64_t flushes_done = 0;
    std::string blocked_reason;
    // The secret of RegisterResponse.credential, kept through takeovers (the same process).
    std::string credential;
  };

  struct Slot {
    SlotId id;
    SlotState state = UNASSIGNED;
    uint64_t owner = 0;  // incarnation, 0 = none
    int64_t step = 0;         // last step reported (heartbeat or update)
    int64_t synced_step = 0;  // last step applied by a sync or push (persisted)
    std::string detail;
    absl::Time lost_at;       // when the slot became LOST
    int64_t detection_ms = 0;  // how long its owner had been silent when declared failed
    int64_t rolled_back_from = 0;  // GLOBAL_CHECKPOINT: the step it had reached at the rollback
    // GLOBAL_CHECKPOINT: its trainer was lost (not merely rolled back) since its last restore;
    // its next restore is a recovery that counts against it (DESIGN §4.5).
    bool failed_since_restore = false;
    // RECOVERING: the replay task and its spares in rank order (the leader first). A helper
    // stays in task_spares for the record and leaves task_active when it has asked for work again.
    uint64_t task_id = 0;
    std::vector<uint64_t> task_spares;
    std::vector<bool> task_active;
    std::vector<bool> task_picked;  // the spare has received the task
    bool task_published = false;    // the leader has published the range
    int64_t task_snapshot_step = 0;
    int64_t task_failed_step = 0;
    absl::Time task_started;
    bool fallback_restart = false;  // a replay of this slot failed its checksum
    // LOST in a pipeline: no replay task starts before its live neighbours have flushed their
    // step logs (their buffers hold the boundary tensors it received), or before this time.
    absl::Time flush_deadline = absl::InfinitePast();
  };

  absl::Status CheckAliveLocked(uint64_t incarnation) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PersistLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int SlotIndex(const SlotId& slot) const;
  std::vector<Neighbour> NeighboursLocked(int slot_index) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The alive owners of the stages whose step logs a replay of slot `slot_index` reads: its
  // recovery group's other members and the stages right outside the group (same replica).
  std::vector<Worker*> NeighbourOwnersLocked(int slot_index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A LOST slot may be replayed: its neighbours have flushed their logs or the wait is over.
  bool FlushedLocked(int slot_index, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FenceLocked(Worker& worker, WorkerState state, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PruneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const JobConfig job_;
  const Clock* const clock_;
  const PersistFn persist_;
  const absl::Duration failure_timeout_;

  mutable absl::Mutex mu_;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_);  // high 32 bits of this server life's incarnations
  uint64_t next_counter_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t first_counter_of_life_ ABSL_GUARDED_BY(mu_) = 1;  // the first issued since Restore
  std::map<uint64_t, Worker> workers_ ABSL_GUARDED_BY(mu_);
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);  // index = replica * S + stage
  std::vector<RecoveryStatus> recoveries_ ABSL_GUARDED_BY(mu_);
  uint64_t next_task_id_ ABSL_GUARDED_BY(mu_) = 1;
  // The last FLUSH_LOG sequence number given out. It starts at this server life's start time in
  // microseconds, so that it exceeds every sequence a worker may still report from an earlier
  // life of the server (flushes_done survives in the worker across a restart).
  int64_t last_flush_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  // A trainer was lost: set until RollBackAll; no restore task starts meanwhile.
  bool rollback_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool rollback_taken_ ABSL_GUARDED_BY(mu_) = false;  // TakeRollbackRequest said so
  std::string rollback_why_ ABSL_GUARDED_BY(mu_);

  // Policy RESTART_FROM_CENTER: gives the first LOST slot to the spare `worker`, which continues
  // under a new incarnation. Returns the takeover to send it, or nothing.
  std::optional<RegisterResponse> MaybeTakeOverLocked(Worker& worker, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes `spare` the trainer of slot `index` under a new incarnation.
  RegisterResponse HandOverLocked(int index, Worker& spare, absl::Time now,
                                  const std::string& detail) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The slot of a RECOVERING task goes back to LOST (the spare died, timed out or failed).
  void ReleaseTaskLocked(Slot& slot, RecoveryOutcome outcome, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  RecoveryStatus* FindRecoveryLocked(uint64_t task_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The rank of `incarnation` in slot's task if it is an active participant, else -1.
  static int ActiveRank(const Slot& slot, uint64_t incarnation);
  // Forgets slot's task (it ended).
  static void ClearTask(Slot& slot);
};

}  // namespace rebound::server
