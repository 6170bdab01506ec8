#pragma once

// The ParameterServer gRPC service: a thin layer over the server's units. Each RPC checks the
// caller, validates its request, calls one unit and converts the result to the reply:
//
//   Register, Heartbeat, Deregister, Drain   -> Membership (Heartbeat's restart-from-center
//                                               takeover -> RecoveryCoordinator)
//   Sync, Push, CommitSync, CommitPush       -> apply::UpdateApplier (server/apply): the update
//                                               rules, the center's move, the commit with the
//                                               books, the log's GC floors and the coordinator's
//                                               sync barrier (GLOBAL_CHECKPOINT)
//   Pull                                     -> CenterTable
//   ExportCenter                             -> CenterTable: every stage, named and shaped, for
//                                               an operator (server/export_center.cc)
//   Backup                                   -> the DurableStore's checkpoint, streamed
//                                               (server/backup.cc, checkpoint_transfer.h)
//   AuthorizeRange                           -> RangeAuthority (server/shard): a sharded job's
//                                               group 0 authorizing the range groups' calls
//                                               (docs/design.md §10.2, docs/sharding.md)
//   AppendLog, ReadLog                       -> StepLogService
//   WaitForTask, ReportRecovery              -> RecoveryCoordinator (server/recovery_coordinator.h)
//                                               (ReadLog asks it for the task's slot)
//   WaitForTask, ReportAudit                 -> Auditor (server/audit/auditor.h): audit replay;
//                                               an audit's ReadLog and a spare's PREEMPT_AUDIT
//   ReportEval, GetStatus                    -> the service's own last evaluation; every unit's
//                                               status
//
// Caller checks. Every call that acts as a worker first proves it is that worker (the worker
// credential of its incarnation in the call's metadata: UNAUTHENTICATED otherwise); Drain and
// ExportCenter and Backup need the operator token (or a caller on this host when none is configured: UNAUTHENTICATED /
// PERMISSION_DENIED); ReportEval comes only from an evaluator (PERMISSION_DENIED). Every handler
// then validates its input (INVALID_ARGUMENT, never a crash), checks that the caller's
// incarnation is alive (ABORTED when unknown, FAILED_PRECONDITION when fenced) and owns the slot
// it names (FAILED_PRECONDITION), and acknowledges an update only after its RocksDB write batch
// has committed. Until MarkReady() every call but GetStatus answers UNAVAILABLE (the server is
// loading its durable state; health says NOT_SERVING meanwhile). Long polls and request bytes
// beyond the admission bounds get RESOURCE_EXHAUSTED (server/call_gate.h).
//
// Sync: OK with the new center version; the same sync again (its reply was lost) is answered OK
// from the stored post-sync state; a stale one (below the slot's last) FAILED_PRECONDITION; a
// refused one (malformed, non-finite, diverging) INVALID_ARGUMENT, counted as its worker's
// fault; the barrier's UNAVAILABLE / ABORTED under GLOBAL_CHECKPOINT. Push: OK with applied=false
// for a duplicate sequence, FAILED_PRECONDITION for one that skips ahead.
//
// Thread-safety: thread-safe (gRPC calls every handler from its own threads). The service owns
// SlotBooks, LogRetention, the StepLogService, the RecoveryCoordinator, the UpdateApplier and the
// RangeAuthority; every pointer given to
// the constructor is borrowed and must outlive it. Lock order: see server/recovery_coordinator.h.

#include <atomic>
#include <map>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/security.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "server/apply/update_applier.h"
#include "server/call_gate.h"
#include "server/center_table.h"
#include "server/membership.h"
#include "server/audit/auditor.h"
#include "server/log_retention.h"
#include "server/recovery_coordinator.h"
#include "server/reliability.h"
#include "server/shard/range_authority.h"
#include "server/slot_books.h"
#include "server/step_log.h"
#include "storage/durable_store.h"

namespace rebound::server {

class ParameterServerService final : public ParameterServer::Service {
 public:
  // REQUIRES: every pointer outlives the service; `store` may be shared with `membership`'s
  // persist function.
  ParameterServerService(const ServerConfig& config, Membership* membership, CenterTable* centers,
                         ReliabilityTracker* tracker, storage::DurableStore* store,
                         const Clock* clock, TokenChecker token = TokenChecker(""),
                         std::string operator_token = "");

  // Restores the service's own per-slot bookkeeping (applied sequences, last update steps) from
  // the weight records of a previous server life.
  void RestoreBookkeeping(const std::vector<WeightRecord>& records);

  // Policy GLOBAL_CHECKPOINT: RecoveryCoordinator::EnableGlobalCheckpoint. Call after the
  // durable state is loaded, before MarkReady.
  absl::Status EnableGlobalCheckpoint(const std::string& dir, RangeCheckpointCalls ranges = {});

  // RecoveryCoordinator::AfterDetection (the GLOBAL_CHECKPOINT rollback). Called by the server's
  // failure detector after each pass.
  void MaybeRollBack();

  // The admission bounds this service enforces (server/call_gate.h); the server's main gives
  // the same bytes and threads to gRPC's resource quota.
  const AdmissionBounds& admission() const { return admission_; }

  // The newest step whose sync or push the center applied, over every slot (0 before any): the
  // job's step of the periodic exports (server/periodic_export.h).
  int64_t NewestAppliedStep() const { return books_.NewestUpdateStep(); }

  // Where this server serves /metrics (shown in GetStatus); empty when it does not.
  void SetMetricsAddress(const std::string& address) {
    absl::MutexLock lock(&metrics_mu_);
    metrics_address_ = address;
  }

  // A replicated group's member (server/group): fills GetStatusResponse.group. Set before
  // MarkReady; unset for a single server.
  void SetGroupStatus(std::function<void(GroupStatus*)> fill) { group_status_ = std::move(fill); }

  // A sharded job's server (docs/design.md §10.2): fills GetStatusResponse.sharding. Set before
  // MarkReady.
  void SetShardingStatus(std::function<void(ShardingStatus*)> fill) {
    sharding_status_ = std::move(fill);
  }

  // A sharded job's group 0: whether every range holds a slot's sync of a step, asked before
  // CommitSync commits it (server/shard/range_check.h; its error is the commit's). Set before
  // MarkReady; unset, CommitSync is FAILED_PRECONDITION.
  void SetRangeCheck(std::function<absl::Status(const SlotId& slot, int64_t step)> check) {
    range_check_ = std::move(check);
  }
  // Likewise for a push (mode ASYNC_ADAHESSIAN): every range applied the slot's `sequence`.
  void SetPushCheck(std::function<absl::Status(const SlotId& slot, uint64_t sequence)> check) {
    push_check_ = std::move(check);
  }

  // A sharded job's group 0: ExportCenter's read of the whole center from every range, by the
  // deadline (server/center_export.h, ReadShardedCenterExport). Set before MarkReady; unset,
  // ExportCenter of a sharded job is FAILED_PRECONDITION.
  void SetShardedExport(std::function<absl::StatusOr<ExportCenterResponse>(absl::Time deadline)>
                            read) {
    sharded_export_ = std::move(read);
  }

  // A sharded job's group 0 with audits: fills an audited window's start (a stored header) with
  // its tensors from every range (LogRetention::SetRangeSnapshotFill). Set before MarkReady.
  void SetRangeSnapshotFill(LogRetention::RangeSnapshotFill fill) {
    retention_.SetRangeSnapshotFill(std::move(fill));
  }

  // Opens the service for business (after the durable state is loaded).
  void MarkReady() { ready_.store(true, std::memory_order_release); }

  // The bearer token (if one is configured), then readiness: what every call is checked for
  // first. Shared with the CenterRange service of a sharded job's server.
  absl::Status CheckServing(const grpc::ServerContextBase* context) const {
    return CheckCall(context);
  }
  // CheckServing, then the call's worker credential for `incarnation`: what every worker call is
  // checked for first. Shared with the WorkerSession service (server/worker_sessions.h).
  absl::Status CheckWorkerCall(const grpc::ServerContextBase* context, uint64_t incarnation) const {
    return CheckWorker(context, incarnation);
  }
  // CheckCall, then the operator token (or, without one configured, a peer on this host):
  // UNAUTHENTICATED / PERMISSION_DENIED. Also a sharded GLOBAL_CHECKPOINT job's CheckpointRange
  // and RollbackRange (group 0's calls to the range groups).
  absl::Status CheckOperator(const grpc::ServerContext* context) const;

  // A sharded job's group 0 (docs/design.md §10.2, docs/sharding.md): whether a worker's call to a
  // range group may proceed (the call in `context` carries the worker's credential), and for
  // RANGE_SYNC the sync's weight, decided when the slot's previous sync was committed. The
  // credential (UNAUTHENTICATED), a live incarnation (ABORTED / FAILED_PRECONDITION), for a sync
  // the slot's ownership (FAILED_PRECONDITION) and its step: at most the slot's next sync point
  // after its committed one (INVALID_ARGUMENT). FAILED_PRECONDITION on a server that is not a
  // sharded job's group 0.
  absl::StatusOr<AuthorizeRangeResponse> Authorize(const grpc::ServerContext* context,
                                                   const AuthorizeRangeRequest& request);

  grpc::Status Register(grpc::ServerContext* context, const RegisterRequest* request,
                        RegisterResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context, const HeartbeatRequest* request,
                         HeartbeatResponse* response) override;
  grpc::Status Deregister(grpc::ServerContext* context, const DeregisterRequest* request,
                          DeregisterResponse* response) override;
  grpc::Status GetStatus(grpc::ServerContext* context, const GetStatusRequest* request,
                         GetStatusResponse* response) override;
  grpc::Status Sync(grpc::ServerContext* context, const SyncRequest* request,
                    SyncResponse* response) override;
  grpc::Status Push(grpc::ServerContext* context, const PushRequest* request,
                    PushResponse* response) override;
  grpc::Status Pull(grpc::ServerContext* context, const PullRequest* request,
                    PullResponse* response) override;
  grpc::Status ReportEval(grpc::ServerContext* context, const ReportEvalRequest* request,
                          ReportEvalResponse* response) override;

  grpc::Status AppendLog(grpc::ServerContext* context,
                         grpc::ServerReaderWriter<AppendLogAck, AppendLogRequest>* stream) override;
  grpc::Status WaitForTask(grpc::ServerContext* context, const WaitForTaskRequest* request,
                           WaitForTaskResponse* response) override;
  grpc::Status ReadLog(grpc::ServerContext* context, const ReadLogRequest* request,
                       grpc::ServerWriter<LogRecord>* writer) override;
  grpc::Status ReportRecovery(grpc::ServerContext* context, const ReportRecoveryRequest* request,
                              ReportRecoveryResponse* response) override;
  grpc::Status ReportAudit(grpc::ServerContext* context, const ReportAuditRequest* request,
                           ReportAuditResponse* response) override;
  grpc::Status Drain(grpc::ServerContext* context, const DrainRequest* request,
                     DrainResponse* response) override;
  // server/export_center.cc.
  grpc::Status ExportCenter(grpc::ServerContext* context, const ExportCenterRequest* request,
                            ExportCenterResponse* response) override;
  // server/backup.cc.
  grpc::Status Backup(grpc::ServerContext* context, const BackupRequest* request,
                      grpc::ServerWriter<CheckpointChunk>* writer) override;
  grpc::Status AuthorizeRange(grpc::ServerContext* context, const AuthorizeRangeRequest* request,
                              AuthorizeRangeResponse* response) override;
  grpc::Status CommitSync(grpc::ServerContext* context, const CommitSyncRequest* request,
                          CommitSyncResponse* response) override;
  grpc::Status CommitPush(grpc::ServerContext* context, const CommitPushRequest* request,
                          CommitPushResponse* response) override;

  // What AppendLog and ReadLog do, on the stream interfaces: for in-process callers that have no
  // gRPC call (fuzz/service_fuzzer.cc). `context` may be null: an in-process call, trusted.
  grpc::Status ServeAppendLog(
      grpc::ServerContext* context,
      grpc::ServerReaderWriterInterface<AppendLogAck, AppendLogRequest>* stream);
  grpc::Status ServeReadLog(grpc::ServerContext* context, const ReadLogRequest* request,
                            grpc::ServerWriterInterface<LogRecord>* writer);

 private:
  absl::Status CheckReady() const;
  // The bearer token (if one is configured), then CheckReady.
  absl::Status CheckCall(const grpc::ServerContextBase* context) const;
  // CheckCall, then the call's worker credential for `incarnation` (Membership::Authenticate).
  absl::Status CheckWorker(const grpc::ServerContextBase* context, uint64_t incarnation) const;
  absl::Status ValidateSlot(const SlotId& slot) const;
  // ReportEval's fields: stage in range, center_version in [0, current], loss finite,
  // accuracy in [0, 1].
  absl::Status ValidateEval(const ReportEvalRequest& request) const;
  // Registration's model check (docs/design.md §11): a declared-model job's first declaration is
  // made durable (the center at version 0) and fixes the layout; every other declaration must
  // match the job's layout (CenterTable::CheckModel). FAILED_PRECONDITION for a registration
  // without a model in a declared-model job and for a differing one; INVALID_ARGUMENT for a
  // malformed first declaration; the store's error if it cannot be made durable.
  absl::Status CheckDeclaredModel(const RegisterRequest& request);

  const ServerConfig config_;
  const JobConfig& job_;
  Membership* const membership_;
  CenterTable* const centers_;
  ReliabilityTracker* const tracker_;
  storage::DurableStore* const store_;
  const Clock* const clock_;
  const TokenChecker token_;
  const std::string operator_token_;  // empty: operator calls from this host only
  const AdmissionBounds admission_;
  // Long polls parked at once (Pull with min_version, WaitForTask), and Sync/Push request bytes
  // held at once: RESOURCE_EXHAUSTED beyond either.
  CallGate parked_;
  CallGate inflight_;
  const absl::Time started_;
  std::atomic<bool> ready_{false};

  SlotBooks books_;
  std::unique_ptr<StepLogService> step_log_;
  LogRetention retention_;
  // Audit replay (docs/recovery.md#audits): WaitForTask hands its audits out, ReadLog reads their
  // windows, ReportAudit ends them, Heartbeat carries their preemption; the sync's log floor
  // keeps their windows (LogRetention).
  Auditor auditor_;
  std::unique_ptr<RecoveryCoordinator> recovery_;
  // Every Sync, Push, CommitSync and CommitPush, and the range groups' authorizations.
  std::unique_ptr<apply::UpdateApplier> applier_;
  // A sharded job's group 0: the range groups' authorizations.
  std::unique_ptr<RangeAuthority> range_authority_;

  // Serializes the first declaration of a declared model (leftmost in the server's lock order:
  // held while committing the declaration and calling CenterTable::Declare).
  absl::Mutex model_mu_;
  std::string model_declared_by_ ABSL_GUARDED_BY(model_mu_);

  mutable absl::Mutex eval_mu_;
  bool has_eval_ ABSL_GUARDED_BY(eval_mu_) = false;
  ReportEvalRequest last_eval_ ABSL_GUARDED_BY(eval_mu_);
  absl::Time last_eval_time_ ABSL_GUARDED_BY(eval_mu_);
  mutable absl::Mutex metrics_mu_;
  std::string metrics_address_ ABSL_GUARDED_BY(metrics_mu_);
  // Set before MarkReady, then read-only; GetStatus reads them only once ready_ is true.
  std::function<void(GroupStatus*)> group_status_;
  std::function<void(ShardingStatus*)> sharding_status_;  // likewise
  std::function<absl::Status(const SlotId&, int64_t)> range_check_;  // likewise
  std::function<absl::Status(const SlotId&, uint64_t)> push_check_;  // likewise
  std::function<absl::StatusOr<ExportCenterResponse>(absl::Time)> sharded_export_;  // likewise
  // One backup at a time (server/backup.cc): each makes a checkpoint of the store.
  absl::Mutex backup_mu_;
  int64_t backups_ ABSL_GUARDED_BY(backup_mu_) = 0;
};

}  // namespace rebound::server
