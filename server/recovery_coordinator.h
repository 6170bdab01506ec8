#pragma once

// RecoveryCoordinator: what the server does to bring a slot whose trainer was lost back
// (DESIGN.md §2, §5.3, §5.4), behind one RecoveryPolicy per job:
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
// Membership keeps who is who (incarnations, roles, leases, slot owners and slot states, and
// today still the claim's bookkeeping: ClaimReplay, PublishReplay, FinishReplay, the task fields
// of its slots); the coordinator is the only caller of those replay-task functions, and its
// policy decides what a task's end means (RecoveryPolicy::EndOf: the fallback).
//
// Thread-safety: thread-safe; every method may be called from any gRPC handler thread.
// NextTask blocks up to its wait, and AfterSync up to the server's max_wait_ms (the barrier).
// EnableGlobalCheckpoint must be called before the service is marked ready (it swaps the policy;
// the swap itself is atomic, so a GetStatus during start-up reads one policy or the other).
// AfterDetection is called by the failure detector's thread only.
//
// Lock order of the server (a lock may be held while taking one to its right, never the
// reverse): GlobalCheckpoint::mu_ -> CenterTable stage lock -> StepLogService locks ->
// Membership::mu_ -> {SlotBooks::mu_, LogRetention::mu_, ReliabilityTracker::mu_} (leaves). The
// coordinator has no lock of its own and calls every unit without holding one.
//
// Ownership: every pointer given to the constructor is borrowed and must outlive the coordinator;
// it owns its policies and the GlobalCheckpoint.
//
// Status codes: NextTask: the errors of Membership::ClaimReplay (FAILED_PRECONDITION: not an alive
// spare, or it leads a task); ABORTED when the task cannot be assembled because a snapshot moved or
// a recovery group's snapshots are gone (the task is abandoned and the slot LOST again), INTERNAL
// when the micro-batches cannot be split among the spares, the store's or step log's error
// otherwise (the task is abandoned). Finish: FAILED_PRECONDITION for a RECOVERED report that does
// not prove its replay, or from an incarnation that leads no such task. AfterSync: the barrier's
// UNAVAILABLE / ABORTED (GlobalCheckpoint::Arrive). EnableGlobalCheckpoint: the errors of
// GlobalCheckpoint::Load (DATA_LOSS) or of reading the centers.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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

// How a job's lost slots come back. (Not to be confused with the config enum
// rebound::RecoveryPolicy, which kind() returns.)
class RecoveryPolicy {
 public:
  virtual ~RecoveryPolicy() = default;

  virtual rebound::RecoveryPolicy kind() const = 0;

  // Fills `out` with the task that spare `incarnation` claimed (`claim`). On an error the caller
  // abandons the task.
  virtual absl::Status Assemble(const Membership::ReplayClaim& claim, uint64_t incarnation,
                                RecoveryTask* out) = 0;

  // A RECOVERED report is acceptable (before the takeover); FAILED_PRECONDITION otherwise.
  virtual absl::Status CheckRecovered(const ReportRecoveryRequest& report) const = 0;

  // How a task whose report is not RECOVERED ends: the slot is LOST again, and after a
  // CHECKSUM_MISMATCH falls back to RESTART_FROM_CENTER (a single stage) or waits for another
  // replay (a pipeline stage: restarted from the center it would not match its neighbours).
  virtual Membership::ReplayEnd EndOf(const ReportRecoveryRequest& report) const = 0;

  // The slot of `takeover` was taken over after `report`: charges it (DESIGN §4.5) and logs it.
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

class RecoveryCoordinator {
 public:
  // Starts with ReplayPolicy, or RestartFromCenterPolicy for a RESTART_FROM_CENTER job;
  // EnableGlobalCheckpoint switches to GlobalCheckpointPolicy. REQUIRES: every unit is set.
  explicit RecoveryCoordinator(const RecoveryUnits& units);
  ~RecoveryCoordinator();

  RecoveryCoordinator(const RecoveryCoordinator&) = delete;
  RecoveryCoordinator& operator=(const RecoveryCoordinator&) = delete;

  // Policy GLOBAL_CHECKPOINT: sets up the barrier checkpoints (server/global_checkpoint.h), kept
  // in `dir` (empty: in memory) and loaded from there; the job's start (the centers as they are
  // now) is the checkpoint until the first cut. Call once, after the durable state is loaded and
  // before the service is marked ready.
  absl::Status EnableGlobalCheckpoint(const std::string& dir);

  // WaitForTask: waits up to `wait` for work for spare `incarnation`; the task it claimed, or
  // nothing.
  absl::StatusOr<std::optional<RecoveryTask>> NextTask(uint64_t incarnation, absl::Duration wait);

  // ReportRecovery from the leader `report.incarnation()`: the takeover of a RECOVERED slot, or
  // nothing (the task ended otherwise; the slot is LOST again or falls back).
  absl::StatusOr<std::optional<RegisterResponse>> Finish(const ReportRecoveryRequest& report);

  // ReadLog: the slot of task `task_id`, in which `incarnation` takes part; FAILED_PRECONDITION
  // otherwise (the errors of CheckAlive first).
  absl::StatusOr<SlotId> TaskSlot(uint64_t task_id, uint64_t incarnation) const;

  // A spare's heartbeat took a LOST slot over from the center (RESTART_FROM_CENTER, or the
  // fallback of a failed replay): the slot is live again and charged with the recovery.
  void OnRestartedFromCenter(uint64_t spare_incarnation, const RegisterResponse& takeover);

  // The sync barrier (see RecoveryPolicy).
  uint64_t SyncEpoch() const;
  absl::Status AfterSync(const SlotId& slot, int64_t step, uint64_t epoch);

  // Called by the failure detector after each pass: under GLOBAL_CHECKPOINT, if a trainer was
  // lost since the last call, rolls every slot and the center back to the last checkpoint.
  void AfterDetection();

  // The recovery part of a status reply (the checkpoint's figures).
  void FillStatus(GetStatusResponse* response) const;

 private:
  RecoveryPolicy* policy() const { return policy_.load(std::memory_order_acquire); }

  const RecoveryUnits units_;
  std::unique_ptr<RecoveryPolicy> initial_;
  std::unique_ptr<RecoveryPolicy> checkpoint_;  // GLOBAL_CHECKPOINT, once enabled
  std::atomic<RecoveryPolicy*> policy_;
};

}  // namespace rebound::server
