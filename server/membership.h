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
// Replay tasks are not kept here: the RecoveryCoordinator (server/recovery_coordinator.h) owns
// them (their spares, claim, published range, timeouts and end). Membership keeps what a slot is
// while one runs: RECOVERING under the task's id (StartRecovery), until FinishRecovery or
// AbandonRecovery hands it over or makes it LOST again, and the recovery records of status. It
// tells the coordinator, through the RecoveryObserver it is given, what the tasks depend on:
// a spare fenced (its task ends), a slot claimable (a waiting claim wakes), a server pause.
//
// Thread-safety: thread-safe; the state is under one mutex (mu_), which is taken after the stage
// and step-log locks and before the RecoveryObserver's and SlotBooks' (server/recovery_coordinator.h
// has the server's lock order). The observer is called under mu_: it keeps its tasks in memory
// (no I/O, no network), must take no lock that is held while calling Membership and must not call
// Membership. The persist function is NOT called under mu_ (R20): a change is made in memory
// under mu_, and the method that made it writes the whole state afterwards, under persist_mu_
// alone (taken before mu_), so that a write, which in a replicated group waits for the in-sync
// standbys, holds up no other Membership call: every Sync's owner check and every heartbeat go on
// meanwhile. Writes are ordered by a sequence number, each writes the state as of its start, and
// one write covers every change made before it began (the others' callers then return at once):
// the store never goes back to an older state. A method returns after its change is written (or
// its failure logged; Register fails and undoes its registration): nothing the change grants
// reaches a worker before the store holds it. Only the persist function blocks.
// Ownership: `clock` is borrowed and must outlive the membership; the persist function is copied;
// the observer is borrowed from SetRecoveryObserver until it is replaced or reset.
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
  absl::Duration silent_for;  // since its last heartbeat
  // Declared on its session's end (crash detection: its process is gone) rather than on
  // silence; `detected_after` is then the time since the session ended, else `silent_for`.
  bool crashed = false;
  absl::Duration detected_after;
};

// A replay task's spare as Membership knows it.
struct TaskSpare {
  uint64_t incarnation = 0;
  std::string peer_address;
};

// A slot made RECOVERING by Membership::StartRecovery under a new task.
struct RecoveryStart {
  uint64_t task_id = 0;
  SlotId slot;
  int64_t reached_step = 0;       // the last step the lost trainer reported
  std::vector<TaskSpare> spares;  // the task's spares in rank order, the leader first
};

// What Membership tells the owner of the replay tasks (the RecoveryCoordinator). Every function
// is called with Membership's lock held (lock order: Membership::mu_ -> the observer's lock) and
// must not call Membership.
class RecoveryObserver {
 public:
  virtual ~RecoveryObserver() = default;
  // The spares waiting for work now that take part in no task, in incarnation order (oldest
  // first): the helpers a new task may pick.
  virtual std::vector<uint64_t> IdleSpares() const = 0;
  // StartRecovery made `start.slot` RECOVERING under task `start.task_id`.
  virtual void OnRecoveryStarted(const RecoveryStart& start) = 0;
  // The task that `incarnation` takes part in as an active spare, 0 for none (it is being fenced:
  // Membership ends that task).
  virtual uint64_t TaskOf(uint64_t incarnation) const = 0;
  // Task `task_id`'s slot is no longer RECOVERING (handed over or LOST again): the task is over.
  virtual void OnRecoveryEnded(uint64_t task_id) = 0;
  // Whether a LOST slot may now be claimed (StartRecovery would start a task); told after every
  // change that may alter it, and on every heartbeat and failure detection pass.
  virtual void OnClaimableChanged(bool claimable) = 0;
  // The server did not run for `paused` (ExcuseServerPause): not a task's time either.
  virtual void OnServerPaused(absl::Duration paused) = 0;
};

class Membership {
 public:
  // Writes the membership's durable state (the whole of it); called after every change of a
  // slot's owner or state and every new incarnation, one call at a time and without the
  // membership's state lock (see Thread-safety above). A failing persist makes the change fail
  // (Register) or is logged (failure detection, which must go on).
  using PersistFn =
      std::function<absl::Status(const ServerRecord& server, const std::vector<SlotRecord>& slots)>;

  // REQUIRES: `job` is validated; `clock` outlives this object.
  Membership(const JobConfig& job, const Clock* clock, PersistFn persist = nullptr);

  // Restores the state of a previous server life: the incarnation epoch and counter, and each
  // slot's state and owner. Owners come back ALIVE with `grace` added to their silence budget,
  // so a trainer that reconnects within reconnect_grace + failure_timeout just goes on.
  // `forget_owners` (a state restored from a backup, whose trainers have gone on past it): no
  // owner comes back; every ACTIVE slot is LOST (rebuilt from its snapshot and log as the
  // policy says), the old incarnations are unknown (their calls answer ABORTED, so their
  // workers register again) and a new incarnation epoch starts, so that no new incarnation
  // repeats one issued after the backup.
  // INVALID_ARGUMENT if the records belong to another job or topology.
  absl::Status Restore(const ServerRecord& server, const std::vector<SlotRecord>& slots,
                       absl::Duration grace, bool forget_owners = false) ABSL_LOCKS_EXCLUDED(mu_);

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

  // Audits (docs/recovery.md#audits, AUDIT_QUARANTINE): fences the trainer `incarnation` as
  // QUARANTINED (its calls get FAILED_PRECONDITION) and makes its slot LOST with the fallback to
  // RESTART_FROM_CENTER, whatever the job's policy: its snapshots descend from the corrupted step,
  // so a replay would rebuild the corruption. FAILED_PRECONDITION unless it is alive and owns
  // `slot`.
  absl::Status Quarantine(uint64_t incarnation, const SlotId& slot, const std::string& why)
      ABSL_LOCKS_EXCLUDED(mu_);

  // True while some slot is LOST (waiting for a spare): an audit then gives its spare back.
  bool AnySlotLost() const ABSL_LOCKS_EXCLUDED(mu_);

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

  // OK iff `incarnation` is alive and owns `slot`; FAILED_PRECONDITION otherwise.
  absl::Status CheckOwner(uint64_t incarnation, const SlotId& slot) const ABSL_LOCKS_EXCLUDED(mu_);

  // The name `incarnation` registered with (fenced ones too while their record is kept); "" if
  // unknown. Fault scores follow this name (server/reliability.h).
  std::string NameOf(uint64_t incarnation) const ABSL_LOCKS_EXCLUDED(mu_);

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

  // Replay tasks' slots (docs/design.md §5.3), for the RecoveryCoordinator only.
  //
  // The observer told of what the tasks depend on (see RecoveryObserver); nullptr for none.
  void SetRecoveryObserver(RecoveryObserver* observer) ABSL_LOCKS_EXCLUDED(mu_);
  // OK iff `incarnation` is an alive spare: the errors of CheckAlive, else FAILED_PRECONDITION
  // naming its role.
  absl::Status CheckSpare(uint64_t incarnation) const ABSL_LOCKS_EXCLUDED(mu_);
  // Makes the first LOST slot that may be replayed RECOVERING under a new task led by the spare
  // `leader`, with up to `max_spares` - 1 helpers among the observer's IdleSpares that are alive
  // spares, and tells the observer (OnRecoveryStarted) before returning it. A slot may be
  // replayed unless it falls back to RESTART_FROM_CENTER, a rollback is requested and not
  // finished (GLOBAL_CHECKPOINT), or its pipeline neighbours have not flushed their step logs
  // within failure_timeout. Nothing when no slot may be replayed.
  // REQUIRES: `leader` is an alive spare in no task (the caller checked).
  std::optional<RecoveryStart> StartRecovery(uint64_t leader, int max_spares)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Gives up task `task_id` (its snapshot cannot be read, it ran past recovery_timeout): its
  // slot is LOST again and its record gets `outcome` and `why`. Nothing if the slot is no longer
  // RECOVERING under that task.
  void AbandonRecovery(uint64_t task_id, RecoveryOutcome outcome, const std::string& why)
      ABSL_LOCKS_EXCLUDED(mu_);
  // How a task that did not rebuild its slot ends, as the recovery policy decided it
  // (RecoveryPolicy::EndOf): the recovery record's outcome and detail, and whether the slot falls
  // back to RESTART_FROM_CENTER (the next spare heartbeat takes it over) instead of waiting for
  // another replay.
  struct ReplayEnd {
    RecoveryOutcome outcome = ABANDONED;
    std::string why;
    bool fallback_restart = false;
  };
  // The end of task `report.task_id()`, reported by its leader `leader` (the caller checked it
  // leads). RECOVERED: the leader becomes the slot's trainer under a new incarnation, returned
  // (its spare incarnation is fenced as REPLACED), at step `replayed_from` (the task's snapshot
  // step; the slot's synced step if unset) plus the steps replayed. Any other outcome: the slot
  // is LOST again and `end` applies (ignored for RECOVERED). The recovery's record in status
  // gets `report`'s figures. The errors of CheckAlive for `leader`; FAILED_PRECONDITION if the
  // slot is no longer RECOVERING under that task.
  absl::StatusOr<std::optional<RegisterResponse>> FinishRecovery(
      uint64_t leader, const ReportRecoveryRequest& report, const ReplayEnd& end,
      std::optional<int64_t> replayed_from) ABSL_LOCKS_EXCLUDED(mu_);

  // Policy GLOBAL_CHECKPOINT. True (with the reason) once per loss of a slot's trainer since the
  // last call: the caller rolls everything back (ParameterServerService::MaybeRollBack).
  bool TakeRollbackRequest(std::string* why) ABSL_LOCKS_EXCLUDED(mu_);
  // Fences every alive trainer as ROLLED_BACK (its calls get ABORTED: it registers again) and
  // makes every slot LOST at `step`, the checkpoint's. No spare is given a slot to restore until
  // FinishRollback: the caller first puts the center and the slots' bookkeeping back.
  void RollBackAll(int64_t step, const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  // The server's state is back at the checkpoint: spares may restore the slots (StartRecovery),
  // and the next loss of a trainer requests the next rollback.
  void FinishRollback() ABSL_LOCKS_EXCLUDED(mu_);

  // Crash detection (docs/design.md §13). A worker's session stream (server/worker_sessions.h)
  // opened: OK iff `incarnation` is alive (the errors of CheckAlive), and it holds fewer than
  // kMaxSessionsPerWorker sessions (RESOURCE_EXHAUSTED). An earlier session's loss is forgiven: the
  // worker is back (`*back_after`, when not null, is then set to the time since the loss; else
  // to zero). Counts as contact, like a heartbeat.
  absl::Status AttachSession(uint64_t incarnation, absl::Duration* back_after = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  static constexpr int kMaxSessionsPerWorker = 4;
  // A session of `incarnation` ended. `lost`: it ended without the server ending it (the peer
  // went away or cancelled); when it was the worker's last one and the worker is still alive, its
  // loss is recorded, and DetectFailures declares the worker failed unless it attaches again
  // within crash_confirm_ms. Not lost: the server ended it (stopping, or the session's lifetime).
  void DetachSession(uint64_t incarnation, bool lost) ABSL_LOCKS_EXCLUDED(mu_);

  // Declares failed every alive worker silent for longer than failure_timeout, or whose session
  // was lost more than crash_confirm_ms ago without another attached (crash_confirm_ms > 0),
  // fences it and marks its slot LOST (a spare's replay task ends: SPARE_FAILED). Returns the
  // newly failed workers. (Replay tasks past recovery_timeout are the coordinator's:
  // AfterDetection.)
  std::vector<FailedWorker> DetectFailures() ABSL_LOCKS_EXCLUDED(mu_);

  // The server itself did not run for `paused` (SIGSTOP, a VM frozen for migration, a machine
  // swapping): no heartbeat could arrive, so that time is not a worker's silence. Moves every
  // alive worker's last heartbeat forward by it, never past now (a restored worker's heartbeat
  // already ahead of now stays), and tells the observer (replay tasks' starts move too). Called
  // by the failure detector when it wakes far later than it asked to.
  void ExcuseServerPause(absl::Duration paused) ABSL_LOCKS_EXCLUDED(mu_);

  // Fills the membership part of a status reply (slots and workers; a spare's waiting_for_task
  // and replay_task are the coordinator's).
  void FillStatus(GetStatusResponse* response) const ABSL_LOCKS_EXCLUDED(mu_);

  // Number of workers in each state (for tests and metrics).
  int CountInState(WorkerState state) const ABSL_LOCKS_EXCLUDED(mu_);

  // Goodput (docs/metrics.md#goodput): adds the time since the last call to each slot's current
  // state, and the steps its trainer made meanwhile; an ACTIVE slot whose step has not moved for
  // two heartbeat intervals (a new trainer loading its data, a stall) counts as idle. A slot's
  // accounts start at its first step. Called by every failure-detector pass.
  void AccountTime() ABSL_LOCKS_EXCLUDED(mu_);

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
    // The heartbeat deadline's base: the last heartbeat, or after a restart or a leader change
    // (a restored owner that has not called yet) the restore plus the reconnect grace, ahead of
    // now. `heard` is the last contact itself (a registration, heartbeat, attach or the
    // restore): the silence reported (silent_ms_at_failure, last_heartbeat_ms_ago).
    absl::Time last_heartbeat;
    absl::Time heard;
    int64_t silent_ms_at_failure = 0;
    // How long its failure took to detect: the silence, or for a crash the time since its
    // session was lost (the recovery's detection phase).
    int64_t detection_ms_at_failure = 0;
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
    // Crash detection: the session streams open now, and when the last one was lost (infinite
    // future: none lost since the last attach).
    int sessions = 0;
    absl::Time session_lost_at = absl::InfiniteFuture();
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
    // RECOVERING: the replay task (and recovery record) it recovers under; the task itself is
    // the RecoveryCoordinator's.
    uint64_t task_id = 0;
    // The next spare restarts it from the center (RESTART_FROM_CENTER): a replay of it failed
    // its checksum, or max_replay_attempts replays of this loss failed.
    bool fallback_restart = false;
    bool quarantined = false;  // its fallback is a quarantine's (Quarantine), not a failed replay's
    int failed_replays = 0;  // of this loss: since the slot last became LOST from ACTIVE
    // LOST in a pipeline: no replay task starts before its live neighbours have flushed their
    // step logs (their buffers hold the boundary tensors it received), or before this time.
    absl::Time flush_deadline = absl::InfinitePast();
    // Goodput (AccountTime): time in each state since the slot first had a trainer, the steps
    // trained while ACTIVE, the failures' detection, the replays' time, the steps discarded.
    absl::Duration active_time, lost_time, recovering_time, blocked_time;
    int64_t active_steps = 0;
    int64_t step_at_account = 0;
    // The accounts start at the slot's first step (not at its first registration: a job's
    // start-up is nobody's loss); `progress_at` is when its step last moved.
    bool accounting = false;
    absl::Time progress_at;
    int64_t detection_ms_total = 0;
    int64_t replay_ms_total = 0;
    int64_t steps_discarded = 0;
  };

  // The start barrier (TopologyConfig.min_trainers): true while a fresh job waits for its
  // trainers. Released for good, and logged, when min_trainers slots have an owner, when any slot
  // has made progress (a restored or running job), or start_barrier_ms after the first trainer
  // registered.
  bool StartHeldLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckAliveLocked(uint64_t incarnation) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Holds mu_ like absl::MutexLock for a public method that may change persisted state; when it
  // goes out of scope (after the method's return value is built) it releases mu_ and then writes
  // the change the method made, if any (Persist), logging a failure as "cannot persist <what>".
  class ABSL_SCOPED_LOCKABLE WriteLock {
   public:
    WriteLock(Membership* membership, const char* what)
        ABSL_EXCLUSIVE_LOCK_FUNCTION(membership->mu_);
    ~WriteLock() ABSL_UNLOCK_FUNCTION();
    WriteLock(const WriteLock&) = delete;
    WriteLock& operator=(const WriteLock&) = delete;

   private:
    // dirty_seq_, read with mu_ held (the constructor took it; the destructor has not released
    // it yet), which the analysis cannot follow into a scoped lock's own members.
    static uint64_t DirtySeq(const Membership& membership) ABSL_NO_THREAD_SAFETY_ANALYSIS;
    Membership* const membership_;
    const char* const what_;
    uint64_t start_seq_ = 0;
  };
  // A change to be persisted was made: returns its sequence number (see Persist).
  uint64_t MarkDirtyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ++dirty_seq_; }
  // Writes the state unless a write that began after change `seq` succeeded already: a snapshot
  // taken under mu_, written under persist_mu_ alone. OK for seq 0 (nothing changed).
  absl::Status Persist(uint64_t seq) ABSL_LOCKS_EXCLUDED(mu_, persist_mu_);
  // Persist, logging a failure as "cannot persist <what>: ...".
  void PersistOrLog(uint64_t seq, const char* what) ABSL_LOCKS_EXCLUDED(mu_, persist_mu_);
  int SlotIndex(const SlotId& slot) const;
  std::vector<Neighbour> NeighboursLocked(int slot_index) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The alive owners of the stages whose step logs a replay of slot `slot_index` reads: its
  // recovery group's other members and the stages right outside the group (same replica).
  std::vector<Worker*> NeighbourOwnersLocked(int slot_index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A LOST slot may be replayed: its neighbours have flushed their logs or the wait is over.
  bool FlushedLocked(int slot_index, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FenceLocked(Worker& worker, WorkerState state, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A LOST slot StartRecovery would take at `now`, -1 for none.
  int ClaimableSlotLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the observer whether a slot may be claimed now.
  void NotifyClaimableLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The slot RECOVERING under task `task_id`, nullptr for none.
  Slot* RecoveringSlotLocked(uint64_t task_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PruneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const JobConfig job_;
  const Clock* const clock_;
  const PersistFn persist_;
  const absl::Duration failure_timeout_;
  const absl::Duration crash_confirm_;  // zero: crash detection off
  // Goodput: an ACTIVE slot whose step has not moved for this long is stalled (counted idle).
  const absl::Duration stall_after_;

  // Serializes the persist function's calls; taken before mu_, held across a write.
  absl::Mutex persist_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  uint64_t persisted_seq_ ABSL_GUARDED_BY(persist_mu_) = 0;  // the newest change written
  mutable absl::Mutex mu_;
  uint64_t dirty_seq_ ABSL_GUARDED_BY(mu_) = 0;  // the newest change made (MarkDirtyLocked)
  uint64_t epoch_ ABSL_GUARDED_BY(mu_);  // high 32 bits of this server life's incarnations
  uint64_t next_counter_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t first_counter_of_life_ ABSL_GUARDED_BY(mu_) = 1;  // the first issued since Restore
  std::map<uint64_t, Worker> workers_ ABSL_GUARDED_BY(mu_);
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);  // index = replica * S + stage
  bool start_released_ ABSL_GUARDED_BY(mu_) = false;  // the start barrier (StartHeldLocked)
  std::optional<absl::Time> first_trainer_at_ ABSL_GUARDED_BY(mu_);
  std::vector<RecoveryStatus> recoveries_ ABSL_GUARDED_BY(mu_);
  // Per policy, this server life's recoveries that ended in a takeover: their durations from
  // the failure to the takeover, bucketed by kRecoveryDurationBounds (GetStatus, /metrics).
  std::map<RecoveryPolicy, RecoveryDurations> recovery_durations_ ABSL_GUARDED_BY(mu_);
  uint64_t next_task_id_ ABSL_GUARDED_BY(mu_) = 1;
  // The last FLUSH_LOG sequence number given out. It starts at this server life's start time in
  // microseconds, so that it exceeds every sequence a worker may still report from an earlier
  // life of the server (flushes_done survives in the worker across a restart).
  int64_t last_flush_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  // A trainer was lost: set until RollBackAll; no restore task starts meanwhile.
  bool rollback_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool rollback_taken_ ABSL_GUARDED_BY(mu_) = false;  // TakeRollbackRequest said so
  std::string rollback_why_ ABSL_GUARDED_BY(mu_);
  RecoveryObserver* observer_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Time accounted_at_ ABSL_GUARDED_BY(mu_);  // the last AccountTime

  // Policy RESTART_FROM_CENTER: gives the first LOST slot to the spare `worker`, which continues
  // under a new incarnation. Returns the takeover to send it, or nothing.
  std::optional<RegisterResponse> MaybeTakeOverLocked(Worker& worker, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes `spare` the trainer of slot `index` under a new incarnation, from step `start_step`
  // (the steps the slot had reached past it are discarded: goodput's rollback).
  // `policy` is the recovery's (a restart under REPLAY's fallback is RESTART_FROM_CENTER's); its
  // duration, from the owner's failure to now, goes into recovery_durations_.
  RegisterResponse HandOverLocked(int index, Worker& spare, absl::Time now,
                                  const std::string& detail, int64_t start_step,
                                  RecoveryPolicy policy) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The slot goes on from `step`; what it had reached past it is counted as discarded.
  void RestartSlotAtLocked(Slot& slot, int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The slot of a RECOVERING task goes back to LOST (the spare died, timed out or failed); the
  // observer is told the task is over.
  void ReleaseTaskLocked(Slot& slot, RecoveryOutcome outcome, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  RecoveryStatus* FindRecoveryLocked(uint64_t task_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace rebound::server
