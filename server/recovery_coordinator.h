#pragma once

// RecoveryCoordinator: what the server does to bring a slot whose trainer was lost back
// (docs/design.md §2, §5.3, §5.4), behind one RecoveryPolicy per job:
//
//   * ReplayPolicy (policy REPLAY, the default): a spare that asks for work (WaitForTask) claims
//     a LOST slot, or a share of a task whose leader picked it; the coordinator assembles its
//     RecoveryTask: the snapshot to start from (a multi-stage recovery group's snapshots at the
//     group's oldest step), the range (t0, t_f] the leader fixes once from the step log, the
//     task's spares and this spare's block of micro-batches. The leader's RECOVERED report must
//     prove its replay (every step replayed and verified, the final checksum the log's); the
//     leader then becomes the slot's trainer. A replay whose checksums do not match falls back to
//     RESTART_FROM_CENTER for that slot (a pipeline stage waits for another replay instead).
//   * RestartFromCenterPolicy (RESTART_FROM_CENTER): no tasks; a spare's heartbeat takes a LOST
//     slot over from the center (Membership), and the coordinator charges and logs it.
//   * GlobalCheckpointPolicy (GLOBAL_CHECKPOINT, after EnableGlobalCheckpoint): the barrier at
//     each cut a sync waits at, and the rollback: once a trainer is lost every slot and the
//     center go back to the last checkpoint, and spares restore the slots from it (a restore task
//     per slot; the slot whose trainer was lost is charged with the recovery).
//
// The coordinator owns the replay tasks: each task's spares in rank order (the leader first),
// which of them still take part and have received it, the range its leader published, its start
// (for recovery_timeout) and the spares waiting for work. Membership keeps who is who
// (incarnations, roles, leases, slot owners and slot states: a task's slot is RECOVERING under
// the task's id, and Membership hands it over or makes it LOST again), and tells the coordinator,
// as its RecoveryObserver, what the tasks depend on: a spare fenced (its task ends), a slot
// claimable (a waiting claim wakes), a pause of the server. The policy decides what a task's end
// means (RecoveryPolicy::EndOf: the fallback).
//
// Thread-safety: thread-safe; every method may be called from any gRPC handler thread.
// NextTask and ClaimReplay block up to their wait, and AfterSync up to the server's max_wait_ms
// (the barrier).
// EnableGlobalCheckpoint must be called before the service is marked ready (it swaps the policy;
// the swap itself is atomic, so a GetStatus during start-up reads one policy or the other).
// AfterDetection is called by the failure detector's thread only.
//
// Lock order of the server (a lock may be held while taking one to its right, never the
// reverse): ParameterServerService::model_mu_ -> CenterTable::declare_mu_ ->
// GlobalCheckpoint::mu_ -> CenterTable stage lock -> StepLogService locks ->
// Membership::persist_mu_ (held across the membership's DurableStore commits, never with
// Membership::mu_) -> Membership::mu_ -> RecoveryCoordinator::mu_ -> {SlotBooks::mu_, LogRetention::mu_,
// ReliabilityTracker::mu_, Auditor::mu_ (server/audit/auditor.h)}. WorkerSessions::mu_ (server/worker_sessions.h) is taken before
// Membership::mu_ and with none of the others held. The coordinator's mu_ guards its tasks; Membership takes it when it
// calls the coordinator as its RecoveryObserver; the coordinator holds it while calling no other
// unit, and calls every unit (Membership included) without holding it.
//
// Ownership: every pointer given to the constructor is borrowed and must outlive the coordinator;
// it owns its policies and the GlobalCheckpoint. It is the membership's RecoveryObserver from its
// construction to its destruction (one coordinator per Membership).
//
// Status codes: NextTask: the errors of ClaimReplay (FAILED_PRECONDITION: not an alive spare, or
// it leads a task; ABORTED for an unknown incarnation); ABORTED when the task cannot be
// assembled because a snapshot moved or a recovery group's snapshots are gone (the task is
// abandoned and the slot LOST again), INTERNAL
// when the micro-batches cannot be split among the spares, the store's or step log's error
// otherwise (the task is abandoned). Finish: FAILED_PRECONDITION for a RECOVERED report that does
// not prove its replay, or from an incarnation that leads no such task. AfterSync: the barrier's
// UNAVAILABLE / ABORTED (GlobalCheckpoint::Arrive). EnableGlobalCheckpoint: the errors of
// GlobalCheckpoint::Load (DATA_LOSS) or of reading the centers.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "proto/storage.pb.h"
#include "server/center_table.h"
#include "server/global_checkpoint.h"
#include "server/log_retention.h"
#include "server/membership.h"
#include "server/reliability.h"
#include "server/slot_books.h"
#include "server/step_log.h"
#include "storage/durable_store.h"

namespace rebound::server {

// The units a recovery policy works with; all borrowed, all outlive the policy.
struct RecoveryUnits {
  const ServerConfig* config = nullptr;
  Membership* membership = nullptr;
  CenterTable* centers = nullptr;
  ReliabilityTracker* tracker = nullptr;
  storage::DurableStore* store = nullptr;
  StepLogService* step_log = nullptr;
  SlotBooks* books = nullptr;
  LogRetention* retention = nullptr;
  const Clock* clock = nullptr;
};

// A sharded job's range groups under GLOBAL_CHECKPOINT (server/shard/range_checkpoints.h), as
// group 0 calls them: `take` asks every range to keep its part of a complete cut (older than
// `keep_from` may go), `roll_back` to go back to its part of `step`, once per `rollback_id`
// (non-zero, drawn per rollback, the same on a retry).
// Unset for an unsharded job: the center is group 0's alone.
struct RangeCheckpointCalls {
  std::function<absl::Status(int64_t step, int64_t keep_from)> take;
  std::function<absl::Status(int64_t step, uint64_t rollback_id)> roll_back;
};

// A replay task as one of its spares receives it (ClaimReplay).
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

// How a job's lost slots come back. (Not to be confused with the config enum
// rebound::RecoveryPolicy, which kind() returns.)
class RecoveryPolicy {
 public:
  virtual ~RecoveryPolicy() = default;

  virtual rebound::RecoveryPolicy kind() const = 0;

  // Fills `out` with the task that spare `incarnation` claimed (`claim`). On an error the caller
  // abandons the task.
  virtual absl::Status Assemble(const ReplayClaim& claim, uint64_t incarnation,
                                RecoveryTask* out) = 0;

  // A RECOVERED report is acceptable (before the takeover); FAILED_PRECONDITION otherwise.
  virtual absl::Status CheckRecovered(const ReportRecoveryRequest& report) const = 0;

  // How a task whose report is not RECOVERED ends: the slot is LOST again, and after a
  // CHECKSUM_MISMATCH falls back to RESTART_FROM_CENTER (a single stage) or waits for another
  // replay (a pipeline stage: restarted from the center it would not match its neighbours).
  virtual Membership::ReplayEnd EndOf(const ReportRecoveryRequest& report) const = 0;

  // The slot of `takeover` was taken over after `report`: charges it (docs/design.md §4.5) and logs it.
  virtual void OnRecovered(const ReportRecoveryRequest& report,
                           const RegisterResponse& takeover) = 0;

  // The barrier of a sync (GLOBAL_CHECKPOINT): the epoch read before the sync is applied, and
  // the wait after it is. Others: 0 and OK.
  virtual uint64_t SyncEpoch() const { return 0; }
  virtual absl::Status AfterSync(const SlotId& slot, int64_t step, uint64_t epoch) {
    return absl::OkStatus();
  }

  // After each pass of the failure detector (the rollback of GLOBAL_CHECKPOINT).
  virtual void AfterDetection() {}

  virtual void FillStatus(GetStatusResponse* response) const {}
};

class RecoveryCoordinator : private RecoveryObserver {
 public:
  // Starts with ReplayPolicy, or RestartFromCenterPolicy for a RESTART_FROM_CENTER job;
  // EnableGlobalCheckpoint switches to GlobalCheckpointPolicy. REQUIRES: every unit is set.
  // Becomes the membership's RecoveryObserver until destroyed.
  explicit RecoveryCoordinator(const RecoveryUnits& units);
  ~RecoveryCoordinator() override;

  RecoveryCoordinator(const RecoveryCoordinator&) = delete;
  RecoveryCoordinator& operator=(const RecoveryCoordinator&) = delete;

  // Policy GLOBAL_CHECKPOINT: sets up the barrier checkpoints (server/global_checkpoint.h), kept
  // in `dir` (empty: in memory) and loaded from there; the job's start (the centers as they are
  // now) is the checkpoint until the first cut. Call once, after the durable state is loaded and
  // before the service is marked ready. A sharded job's group 0 passes its range groups'
  // calls: a cut counts once every range kept its part, and a rollback hands out restores only
  // once every range went back (retried after each detection pass until then).
  absl::Status EnableGlobalCheckpoint(const std::string& dir, RangeCheckpointCalls ranges = {});

  // WaitForTask: waits up to `wait` for work for spare `incarnation`; the task it claimed, or
  // nothing.
  absl::StatusOr<std::optional<RecoveryTask>> NextTask(uint64_t incarnation, absl::Duration wait);

  // ReportRecovery from the leader `report.incarnation()`: the takeover of a RECOVERED slot, or
  // nothing (the task ended otherwise; the slot is LOST again or falls back).
  absl::StatusOr<std::optional<RegisterResponse>> Finish(const ReportRecoveryRequest& report);

  // ReadLog: the slot of task `task_id`, in which `incarnation` takes part; FAILED_PRECONDITION
  // otherwise (the errors of CheckAlive first).
  absl::StatusOr<SlotId> TaskSlot(uint64_t task_id, uint64_t incarnation) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // The replay tasks (policy REPLAY, docs/design.md §5.3, and GLOBAL_CHECKPOINT's restores), which
  // NextTask and Finish drive; public for tests.
  //
  // Waits up to `timeout` for work for the alive SPARE `incarnation` and claims it:
  //  * a task whose leader picked this spare as a helper and published the range: rank > 0;
  //  * else a LOST slot to replay (Membership::StartRecovery): the slot becomes RECOVERING under
  //    a new task led by this spare (rank 0), with up to recovery_parallelism - 1 helpers, chosen
  //    among the other spares waiting in ClaimReplay at that moment or between two of their
  //    polls (one that left with nothing less than kRepollGrace ago; fewer when fewer wait). The
  //    leader reads the snapshot and the log's extent and calls PublishReplay, which hands the
  //    helpers the task.
  // Nothing when there is none by then (under RESTART_FROM_CENTER never: the spare just waits).
  // A helper that asks again leaves its task (it finished or gave up; the leader decides the
  // task's outcome). The errors of Membership::CheckSpare; FAILED_PRECONDITION if `incarnation`
  // leads a task.
  absl::StatusOr<std::optional<ReplayClaim>> ClaimReplay(uint64_t incarnation,
                                                         absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The leader's range of task `task_id`: the snapshot's step t0 and t_f. Wakes the helpers.
  void PublishReplay(uint64_t task_id, int64_t snapshot_step, int64_t failed_step)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The range the leader `incarnation` of task `task_id` published; FAILED_PRECONDITION unless it
  // leads that task and has published it.
  absl::StatusOr<std::pair<int64_t, int64_t>> PublishedRange(uint64_t task_id,
                                                             uint64_t incarnation) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Gives up a claimed task (e.g. its snapshot cannot be read): the slot is LOST again.
  void AbandonReplay(uint64_t task_id, const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  // The end of a replay, reported by its leader (Membership::FinishRecovery does the takeover or
  // the release under `end`). The errors of CheckAlive; FAILED_PRECONDITION unless `incarnation`
  // leads task report.task_id().
  absl::StatusOr<std::optional<RegisterResponse>> FinishReplay(uint64_t incarnation,
                                                               const ReportRecoveryRequest& report,
                                                               const Membership::ReplayEnd& end)
      ABSL_LOCKS_EXCLUDED(mu_);

  // A spare's heartbeat took a LOST slot over from the center (RESTART_FROM_CENTER, or the
  // fallback of a failed replay): the slot is live again and charged with the recovery.
  void OnRestartedFromCenter(uint64_t spare_incarnation, const RegisterResponse& takeover);

  // The sync barrier (see RecoveryPolicy).
  uint64_t SyncEpoch() const;
  absl::Status AfterSync(const SlotId& slot, int64_t step, uint64_t epoch);

  // Called by the failure detector after each pass: a replay task running longer than
  // recovery_timeout is abandoned (its slot is LOST again); under GLOBAL_CHECKPOINT, if a trainer
  // was lost since the last call, rolls every slot and the center back to the last checkpoint.
  void AfterDetection() ABSL_LOCKS_EXCLUDED(mu_);

  // The recovery part of a status reply, after Membership::FillStatus: each alive spare's
  // waiting_for_task and replay_task, and the checkpoint's figures.
  void FillStatus(GetStatusResponse* response) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // A replay task, from Membership::StartRecovery until its slot is handed over or LOST again.
  struct Task {
    SlotId slot;
    int64_t reached_step = 0;
    // Its spares in rank order (the leader first). A helper stays in `spares` for the record and
    // leaves `active` when it has asked for work again.
    std::vector<TaskSpare> spares;
    std::vector<bool> active;
    std::vector<bool> picked;  // the spare has received the task
    bool published = false;    // the leader has published the range
    int64_t snapshot_step = 0;
    int64_t failed_step = 0;
    absl::Time started;
  };
  // The rank of `incarnation` in `task` if it is an active participant, else -1.
  static int ActiveRank(const Task& task, uint64_t incarnation);
  static ReplayClaim ClaimOf(uint64_t task_id, const Task& task, int rank);
  // A published task that picked `incarnation` as a helper and that it has not received yet.
  uint64_t PendingLocked(uint64_t incarnation) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A share of a published task, else a new task from a LOST slot; nothing if neither.
  std::optional<ReplayClaim> TryClaim(uint64_t incarnation) ABSL_LOCKS_EXCLUDED(mu_);

  // RecoveryObserver (called with Membership's lock held).
  std::vector<uint64_t> IdleSpares() const override ABSL_LOCKS_EXCLUDED(mu_);
  void OnRecoveryStarted(const RecoveryStart& start) override ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t TaskOf(uint64_t incarnation) const override ABSL_LOCKS_EXCLUDED(mu_);
  void OnRecoveryEnded(uint64_t task_id) override ABSL_LOCKS_EXCLUDED(mu_);
  void OnClaimableChanged(bool claimable) override ABSL_LOCKS_EXCLUDED(mu_);
  void OnServerPaused(absl::Duration paused) override ABSL_LOCKS_EXCLUDED(mu_);

  RecoveryPolicy* policy() const { return policy_.load(std::memory_order_acquire); }

  const RecoveryUnits units_;
  std::unique_ptr<RecoveryPolicy> initial_;
  std::unique_ptr<RecoveryPolicy> checkpoint_;  // GLOBAL_CHECKPOINT, once enabled
  std::atomic<RecoveryPolicy*> policy_;

  mutable absl::Mutex mu_;
  std::map<uint64_t, Task> tasks_ ABSL_GUARDED_BY(mu_);  // by task id
  std::set<uint64_t> waiting_ ABSL_GUARDED_BY(mu_);      // spares in ClaimReplay
  // Spares whose long poll just ended with nothing, by when: between two polls (a round trip)
  // a spare is still idle, and a task started then counts it as a helper (kRepollGrace).
  std::map<uint64_t, absl::Time> between_polls_ ABSL_GUARDED_BY(mu_);
  // Membership says a LOST slot may be claimed (OnClaimableChanged): a waiting claim wakes.
  bool claimable_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace rebound::server
