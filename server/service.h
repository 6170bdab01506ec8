#pragma once

// The ParameterServer gRPC service.
//
// Membership calls (Register, Heartbeat, Deregister), the EASGD exchange (Sync), the server-side
// AdaHessian (Push, Pull), the step log, replay tasks, evaluation reports, Drain and GetStatus
// are served here. Every call that acts as a worker first proves it is that worker (the worker
// credential of its incarnation in the call's metadata: UNAUTHENTICATED otherwise); Drain needs
// the operator token (or a caller on this host when none is configured); ReportEval comes only
// from an evaluator (PERMISSION_DENIED). Every handler then validates its input
// (INVALID_ARGUMENT, never a crash), checks that the caller's incarnation is alive and owns the
// slot it names (FAILED_PRECONDITION when fenced), and acknowledges an update only after its
// RocksDB write batch has committed.
//
// Until MarkReady() every call but GetStatus answers UNAVAILABLE (the server is loading its
// durable state; health says NOT_SERVING meanwhile).

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/security.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "server/center_table.h"
#include "server/global_checkpoint.h"
#include "server/membership.h"
#include "server/call_gate.h"
#include "server/reliability.h"
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

  // Policy GLOBAL_CHECKPOINT: sets up the barrier checkpoints (server/global_checkpoint.h), kept
  // in `dir` (empty: in memory) and loaded from there; the job's start (the centers as they are
  // now) is the checkpoint until the first cut. Call after the durable state is loaded.
  absl::Status EnableGlobalCheckpoint(const std::string& dir);

  // Policy GLOBAL_CHECKPOINT: if a trainer was lost since the last call, rolls every slot and the
  // center back to the last checkpoint: every trainer is fenced as ROLLED_BACK (it registers
  // again, as a spare), every slot is restored by a spare from its checkpointed snapshot. Called
  // by the server's failure detector after each check.
  void MaybeRollBack();

  // The admission bounds this service enforces (server/call_gate.h); the server's main gives
  // the same bytes and threads to gRPC's resource quota.
  const AdmissionBounds& admission() const { return admission_; }

  // Where this server serves /metrics (shown in GetStatus); empty when it does not.
  void SetMetricsAddress(const std::string& address) {
    absl::MutexLock lock(&metrics_mu_);
    metrics_address_ = address;
  }

  // Opens the service for business (after the durable state is loaded).
  void MarkReady() { ready_.store(true); }

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
  grpc::Status Drain(grpc::ServerContext* context, const DrainRequest* request,
                     DrainResponse* response) override;

  // What AppendLog and ReadLog do, on the stream interfaces: for in-process callers that have no
  // gRPC call (fuzz/service_fuzzer.cc). `context` may be null: an in-process call, trusted.
  grpc::Status ServeAppendLog(
      grpc::ServerContext* context,
      grpc::ServerReaderWriterInterface<AppendLogAck, AppendLogRequest>* stream);
  grpc::Status ServeReadLog(grpc::ServerContext* context, const ReadLogRequest* request,
                            grpc::ServerWriterInterface<LogRecord>* writer);

 private:
  // Per-slot bookkeeping of applied updates, written with every update under its stage lock.
  struct SlotBook {
    int64_t last_update_step = 0;
    // The step through which the slot's last sync GC'd its log (memory only): its snapshot's step,
    // or for a member of a multi-stage recovery group the group's floor then.
    int64_t log_floor = 0;
    int64_t update_count = 0;
    uint64_t applied_sequence = 0;
  };
  using SlotKey = std::pair<int, int>;

  absl::Status CheckReady() const;
  // The bearer token (if one is configured), then CheckReady.
  absl::Status CheckCall(const grpc::ServerContext* context) const;
  // CheckCall, then the call's worker credential for `incarnation` (Membership::Authenticate).
  absl::Status CheckWorker(const grpc::ServerContext* context, uint64_t incarnation) const;
  // CheckCall, then the operator token (or, without one configured, a peer on this host):
  // UNAUTHENTICATED / PERMISSION_DENIED.
  absl::Status CheckOperator(const grpc::ServerContext* context) const;
  // REPLAY: a RECOVERED report proves its replay: it covers the whole published range, says
  // every step was verified, and its final checksum is the log's for failed_step.
  // FAILED_PRECONDITION otherwise.
  absl::Status CheckReplayProof(const ReportRecoveryRequest& report) const;
  absl::Status ValidateSlot(const SlotId& slot) const;
  // INVALID_ARGUMENT for a Sync or Push step beyond training.max_steps.
  absl::Status CheckStepInJob(int64_t step) const;
  // INVALID_ARGUMENT unless a Sync step above the slot's last applied step is its next sync
  // point: a multiple of easgd.sync_period (or max_steps), at most last + sync_period.
  absl::Status CheckNextSyncStep(const SlotId& slot, int64_t step);
  // ReportEval's fields: stage in range, center_version in [0, current], loss finite,
  // accuracy in [0, 1].
  absl::Status ValidateEval(const ReportEvalRequest& request) const;
  // DETERMINISTIC scheduling: waits until `slot` holds the smallest (update count, replica) of
  // its stage, i.e. it is its turn in the round (bounded by max_wait_ms: UNAVAILABLE).
  absl::Status WaitForTurn(const SlotId& slot);
  WeightRecord WeightRecordFor(const SlotId& slot, const SlotBook& book) const;
  // Center integrity (issue R9): `norm` (||x - c|| of a sync, ||g|| of a push: `what`) over the
  // median of the stage's other live trainers' latest ones (0 when there are none to compare
  // with); INVALID_ARGUMENT when it exceeds weighting.max_divergence_ratio. Changes nothing.
  absl::StatusOr<double> DivergenceRatio(const SlotId& slot, double norm, const char* what) const;
  // A sync or push refused as the sender's fault (malformed, non-finite, or one whose result
  // would break the center's integrity): a fault of its worker, counted per slot for status.
  void OnRefused(const SlotId& slot, const char* what, const absl::Status& status);
  // "center integrity of stage s so far: max |value| ... (r of the bound), max divergence ratio
  // ... (r of the bound)", for the log line of a finished slot.
  std::string IntegritySummary(int stage) const;
  // Pipelines (DESIGN §5.2): the oldest last-sync step over the recovery group of `slot`, with
  // the slot's own taken as `own_step` (< 0: its book's). A group rebuild replays from there, so
  // the group's logs are kept back to it. The slot's own step when it is alone in its group.
  int64_t GroupFloorLocked(const SlotId& slot, int64_t own_step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(book_mu_);
  // The snapshot of group member `slot` at step `step`: its stored one, or the one its last sync
  // replaced (kept in memory for members of multi-stage groups). NOT_FOUND if neither is at
  // `step`.
  absl::StatusOr<Snapshot> SnapshotAt(const SlotId& slot, int64_t step) const;
  // The snapshots and range of a replay task of a multi-stage recovery group [first, end): fills
  // out->group_snapshots; returns t0 (the group's oldest snapshot step).
  absl::StatusOr<int64_t> GroupSnapshots(const SlotId& slot, int first, int end,
                                         int64_t published_t0, RecoveryTask* out) const;
  // GLOBAL_CHECKPOINT: the checkpoint of a complete cut: every stage's center and every slot's
  // stored snapshot, which the barrier guarantees are all at `step`.
  absl::StatusOr<CheckpointRecord> GatherCheckpoint(int64_t step) const;
  // GLOBAL_CHECKPOINT: the wait of a sync at cut `step` (see GlobalCheckpoint::Arrive).
  absl::Status WaitAtBarrier(const SlotId& slot, int64_t step, uint64_t epoch);

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

  std::unique_ptr<StepLogService> step_log_;
  std::unique_ptr<GlobalCheckpoint> checkpoint_;  // policy GLOBAL_CHECKPOINT only

  mutable absl::Mutex book_mu_;
  std::map<SlotKey, SlotBook> books_ ABSL_GUARDED_BY(book_mu_);
  // Center integrity (memory only, since the server started): syncs and pushes refused per
  // slot, and per stage the largest divergence ratio (DivergenceRatio) an accepted one had.
  std::map<SlotKey, int64_t> refused_ ABSL_GUARDED_BY(book_mu_);
  std::map<int, double> max_divergence_ratio_ ABSL_GUARDED_BY(book_mu_);
  // Members of multi-stage recovery groups: the snapshot each one's last sync replaced (memory
  // only: after a server restart a group whose members' snapshots differ waits for its next
  // common round; docs/recovery.md).
  mutable absl::Mutex previous_mu_;
  std::map<SlotKey, Snapshot> previous_snapshots_ ABSL_GUARDED_BY(previous_mu_);

  mutable absl::Mutex eval_mu_;
  bool has_eval_ ABSL_GUARDED_BY(eval_mu_) = false;
  ReportEvalRequest last_eval_ ABSL_GUARDED_BY(eval_mu_);
  absl::Time last_eval_time_ ABSL_GUARDED_BY(eval_mu_);
  mutable absl::Mutex metrics_mu_;
  std::string metrics_address_ ABSL_GUARDED_BY(metrics_mu_);
};

// The version string reported in GetStatus.
extern const char kServerVersion[];

}  // namespace rebound::server
