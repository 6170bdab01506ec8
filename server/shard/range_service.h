#pragma once

// RangeService: the CenterRange service of one server group of a sharded job (docs/design.md §10.2,
// docs/sharding.md): the group's range k of every stage's center, and each slot's snapshots of
// that range.
//
// Exactly once per (slot, step). A trainer sends its sync of step t to every group in parallel
// and commits it at group 0 (ParameterServer.CommitSync) once every group answered, before it
// syncs again; so a group's last applied step of a slot is the committed step C or C + tau.
// The group keeps the slot's range snapshots of its last two syncs (copies by sync number mod 2,
// durable with the center move in one write batch), so that
//   * a sync of a step the group applied already (a lost reply, or the trainer died before every
//     group had the step and its rebuilt successor syncs the step again) is answered with the
//     stored post-sync range and changes nothing;
//   * a spare finds every group's snapshot at the committed step C, whichever groups had
//     applied C + tau (ReadRangeSnapshot).
// A sync below both kept steps is stale (FAILED_PRECONDITION); one that is not the slot's next
// sync point is INVALID_ARGUMENT.
//
// Mode ASYNC_ADAHESSIAN (PushRange): the range applies the slot's pushes in sequence, once each
// (its applied sequence durable with the center and its m, v in one batch: a "range/" meta
// record); a push at or below it answers applied: false and changes nothing, one that skips
// ahead is FAILED_PRECONDITION. Group 0 commits a push only once every range applied it.
//
// Identity. Every call names a worker incarnation and carries its credential; the group asks
// `authorize` (group 0's ParameterServer.AuthorizeRange: in process for group 0, over gRPC for
// the others) before it reads or changes anything. Group 0 checks the credential, that the
// incarnation is alive and owns the slot, and that the step is at most one sync past the slot's
// committed one, and decides the sync's weight (from the slot's previous sync).
//
// A declared model (model.declared_by_worker, the Python client): the first worker call that
// reaches a range group k > 0 before it knows the model asks group 0 for the declaration
// (AuthorizeRange with RANGE_DECLARATION, the worker's credential), stores it (the center
// family's CenterTable::kDeclarationStage record, so a restart declares it again) and declares
// its range of it.
//
// DETERMINISTIC scheduling: a new sync waits for its turn in the round (the group's own
// SlotBooks: the same order as group 0 keeps), so every range's center moves in slot order and
// the K ranges together equal the one-group center bit for bit (UNIFORM weights).
//
// Policy GLOBAL_CHECKPOINT (docs/sharding.md#global-checkpoint): at a complete cut group 0 asks
// every range to keep its part (CheckpointRange: the range of every stage's center and every
// slot's range snapshot at the cut, server/shard/range_checkpoint_files.h); at a rollback, to go
// back to it (RollbackRange): the centers are restored with new versions, each slot's kept
// snapshot is the cut's again (its other copy emptied) and a sync authorized before the rollback
// that has not reached the center yet is refused (ABORTED) instead of moving the restored one.
//
// ExportRange (group 0's ExportCenter of a sharded job, docs/sharding.md#exporting-the-center):
// an operator call that answers the range of a stage with what it had applied (every slot's last
// sync step and push sequence), read between two equal looks at them. ReadRangeSnapshot without
// an incarnation is group 0's read of an audited window's starting snapshot (docs/recovery.md#
// audits), also an operator call.
//
// Thread-safety: thread-safe; the slots' kept steps under one mutex (a leaf, never held across
// a call to another unit), the center under CenterTable's stage locks. Lock order:
// declare_mu_ (held across the call to group 0 and CenterTable::Declare), checkpoint_mu_ (a
// whole checkpoint or rollback, or an export's read) -> CenterTable's stage locks -> mu_.
// Ownership: every pointer and function given to the constructor is borrowed/kept and must
// outlive the service. Status codes: as ParameterServer's (proto/rebound.proto) plus NOT_FOUND
// for a snapshot (or a range checkpoint) the group does not hold.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "proto/sharding.grpc.pb.h"
#include "server/apply/update_rules.h"
#include "server/call_gate.h"
#include "server/center_table.h"
#include "server/shard/range_checkpoint_files.h"
#include "server/slot_books.h"
#include "storage/durable_store.h"

namespace rebound::server {

class RangeService final : public CenterRange::Service {
 public:
  // Group 0's answer to an AuthorizeRangeRequest for the call in `context` (whose metadata holds
  // the worker's credential), or its refusal.
  using Authorizer = std::function<absl::StatusOr<AuthorizeRangeResponse>(
      const grpc::ServerContext* context, const AuthorizeRangeRequest& request)>;
  // The server's own check of every call: its bearer token and its readiness.
  using CallCheck = std::function<absl::Status(const grpc::ServerContext* context)>;

  // `centers` holds range config.shard().group() of every stage (CenterTable::Create).
  // `inflight_bytes` bounds the SyncRange request bytes handled at once (RESOURCE_EXHAUSTED
  // beyond: the server's max_inflight_bytes, as the ParameterServer's own Sync gate).
  RangeService(const ServerConfig& config, CenterTable* centers, storage::DurableStore* store,
               Authorizer authorize, CallCheck check_call, int64_t inflight_bytes);

  // The kept steps of every slot, from the headers of the stored range snapshots (after a
  // server restart). Call before the server is ready.
  void Restore(const storage::LoadedState& state);

  // Policy GLOBAL_CHECKPOINT: the group keeps its range checkpoints in `dir` (empty: in memory)
  // and keeps the job's start (step 0: the centers as they are now) if it holds none yet.
  // `check_operator` admits CheckpointRange and RollbackRange (the server's operator check:
  // group 0 sends the operator token). Until this is called both are FAILED_PRECONDITION. Call
  // once, after Restore, before the server is ready.
  absl::Status EnableGlobalCheckpoint(const std::string& dir, CallCheck check_operator);

  // What CheckpointRange and RollbackRange do, callable in process (group 0's own range).
  // TakeCheckpoint: FAILED_PRECONDITION unless every slot's kept range snapshot holds `step`;
  // returns the range checkpoint's bytes. RollBack: the last `rollback_id` done again changes
  // nothing; NOT_FOUND without a checkpoint of `step`; returns every stage's range version
  // after it.
  absl::StatusOr<int64_t> TakeCheckpoint(int64_t step, int64_t keep_from)
      ABSL_LOCKS_EXCLUDED(checkpoint_mu_, mu_);
  absl::StatusOr<std::vector<int64_t>> RollBack(int64_t step, uint64_t rollback_id)
      ABSL_LOCKS_EXCLUDED(checkpoint_mu_, mu_);

  // Admits the operator calls on the range (ExportRange, ReadRangeSnapshot without an
  // incarnation; also CheckpointRange and RollbackRange
  // unless EnableGlobalCheckpoint gives its own check): the server's operator check. Until this
  // is called those are FAILED_PRECONDITION. Call once, before the server is ready.
  void SetOperatorCheck(CallCheck check_operator) { check_operator_ = std::move(check_operator); }

  // What ExportRange answers, callable in process (group 0's own range): the range's center of
  // `stage` with the slots' applied syncs and pushes, read between two identical looks at them
  // (a sync changes them and the center under the stage lock, so the center holds exactly
  // those). A declared model this group does not know yet: model_unknown only.
  // INVALID_ARGUMENT for a stage out of range; UNAVAILABLE when updates landed between the looks
  // of every one of kExportReads tries.
  static constexpr int kExportReads = 16;
  absl::StatusOr<ExportRangeResponse> ReadForExport(int stage) const
      ABSL_LOCKS_EXCLUDED(checkpoint_mu_, mu_);

  // What ReadRangeSnapshot answers once the call is admitted, callable in process (group 0's
  // own range, for an audit's window): the slot's range snapshot at `step` (one of the two kept),
  // without its storage fields. NOT_FOUND when the group holds none at that step (step 0 is the
  // model's initialisation, never stored); INVALID_ARGUMENT for a slot outside the topology.
  absl::StatusOr<Snapshot> ReadSnapshotPart(const SlotId& slot, int64_t step) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // This group's place and the ranges, for GetStatus.
  void FillStatus(ShardingStatus* status) const;

  grpc::Status SyncRange(grpc::ServerContext* context, const SyncRangeRequest* request,
                         SyncRangeResponse* response) override;
  grpc::Status PushRange(grpc::ServerContext* context, const PushRangeRequest* request,
                         PushRangeResponse* response) override;
  grpc::Status PullRange(grpc::ServerContext* context, const PullRangeRequest* request,
                         PullRangeResponse* response) override;
  grpc::Status ReadRangeSnapshot(grpc::ServerContext* context,
                                 const ReadRangeSnapshotRequest* request,
                                 Snapshot* response) override;
  grpc::Status RangeSteps(grpc::ServerContext* context, const RangeStepsRequest* request,
                          RangeStepsResponse* response) override;
  grpc::Status CheckpointRange(grpc::ServerContext* context,
                               const CheckpointRangeRequest* request,
                               CheckpointRangeResponse* response) override;
  grpc::Status RollbackRange(grpc::ServerContext* context, const RollbackRangeRequest* request,
                             RollbackRangeResponse* response) override;
  grpc::Status ExportRange(grpc::ServerContext* context, const ExportRangeRequest* request,
                           ExportRangeResponse* response) override;

  // Whether this group's range holds the slot's sync of `step` (one of its two kept snapshots).
  bool Holds(const SlotId& slot, int64_t step) const ABSL_LOCKS_EXCLUDED(mu_);
  // Mode ASYNC_ADAHESSIAN: the slot's applied push sequence in this range.
  uint64_t AppliedSequence(const SlotId& slot) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The steps of a slot's two kept range snapshots (0: none), by copy.
  struct Kept {
    int64_t step[2] = {0, 0};
    int64_t last() const { return std::max(step[0], step[1]); }
    // Mode ASYNC_ADAHESSIAN: the slot's applied push sequence and how many it applied.
    uint64_t sequence = 0;
    int64_t pushes = 0;
  };
  using Key = std::pair<int, int>;

  // The copy a sync of step t goes to: its sync number (ceil(t / tau)) mod 2.
  int CopyOf(int64_t step) const;
  absl::Status CheckRange(int range) const;
  absl::Status CheckSlot(const SlotId& slot) const;
  Kept GetKept(const SlotId& slot) const ABSL_LOCKS_EXCLUDED(mu_);
  // The applied sync steps and push sequences of every slot (r, stage), by replica, and the
  // rollback generation: what ReadForExport compares before and after its read.
  struct Applied {
    std::vector<int64_t> steps;
    std::vector<uint64_t> sequences;
    uint64_t generation = 0;
    bool operator==(const Applied& other) const {
      return steps == other.steps && sequences == other.sequences &&
             generation == other.generation;
    }
  };
  Applied GetApplied(int stage) const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t Generation() const ABSL_LOCKS_EXCLUDED(mu_);
  // A worker's read (PullRange; ReadRangeSnapshot with an incarnation): group 0 authorizes it;
  // AuthorizeWorkerRead learns a declared model first (EnsureDeclared).
  absl::Status AuthorizeRead(const grpc::ServerContext* context, uint64_t incarnation) const;
  absl::Status AuthorizeWorkerRead(const grpc::ServerContext* context, uint64_t incarnation)
      ABSL_LOCKS_EXCLUDED(declare_mu_);
  // An operator read on the range (ExportRange; ReadRangeSnapshot without an incarnation):
  // FAILED_PRECONDITION naming `call` until SetOperatorCheck, else the operator check's answer.
  absl::Status CheckOperatorRead(const grpc::ServerContext* context, absl::string_view call) const;
  // CheckpointRange and RollbackRange: the server's checks, then its operator check.
  absl::Status CheckOperatorCall(const grpc::ServerContext* context) const;
  // Asks group 0 to charge the caller with a refused update of `slot` (RANGE_FAULT), and
  // returns `refusal` for the caller.
  grpc::Status ChargeFault(const grpc::ServerContext* context, uint64_t incarnation,
                           const SlotId& slot, const absl::Status& refusal) const;
  // A declared-model job: learns the model from group 0 if this group does not know it yet.
  absl::Status EnsureDeclared(const grpc::ServerContext* context, uint64_t incarnation)
      ABSL_LOCKS_EXCLUDED(declare_mu_);
  // What every SyncRange and PushRange passes after the server's checks (token, readiness) and
  // its admission: the range, the slot (normalized) in the topology, the declared model (EnsureDeclared).
  absl::Status CheckUpdateCall(const grpc::ServerContext* context, int range, const SlotId& slot,
                               uint64_t incarnation) ABSL_LOCKS_EXCLUDED(declare_mu_);
  // A sync's tensors: its parameters and its optimizer state (all three parts or none: the
  // range snapshot is what a spare resumes from). INVALID_ARGUMENT, the sender's fault.
  absl::Status ValidateSync(const SlotId& slot, const SyncRangeRequest& request) const;
  // A push's tensors (gradient, Hessian diagonal): INVALID_ARGUMENT, the sender's fault.
  absl::Status ValidatePush(const SlotId& slot, const PushRangeRequest& request) const;
  // Asks group 0 whether the call may proceed (`authorize_`), for this range.
  absl::StatusOr<AuthorizeRangeResponse> Authorize(const grpc::ServerContext* context,
                                                   RangeAccess access, uint64_t incarnation,
                                                   const SlotId& slot, int64_t step,
                                                   uint64_t sequence) const;
  // Applies an authorized sync to this range of the center with `weight` and commits the
  // center and the slot's range snapshot (one of its two kept copies); sets center_before,
  // partial_sq_norm and moving_rate in `response`. Declined when this range applied the step
  // already (checked first, and again under the stage lock); waits for the slot's DETERMINISTIC turn (UNAVAILABLE when it does not come);
  // ABORTED when a rollback began after `generation`; a step refused by UpdateRules
  // under the stage lock sets `*step_refused` (not the sender's fault); INVALID_ARGUMENT from
  // the integrity checks otherwise.
  absl::StatusOr<CenterTable::Update> ApplySync(const SlotId& slot,
                                                const SyncRangeRequest& request, double weight,
                                                uint64_t generation, bool* step_refused,
                                                SyncRangeResponse* response);
  // Likewise for a push (AdaHessian on this range, the range's book); declined for a retry;
  // FAILED_PRECONDITION when it skips ahead; sets partial_sq_norm.
  absl::StatusOr<CenterTable::Update> ApplyPush(const SlotId& slot,
                                                const PushRangeRequest& request, double weight,
                                                PushRangeResponse* response);
  // The answer to a sync of a step the group applied already, or FAILED_PRECONDITION (stale).
  grpc::Status AnswerApplied(const SlotId& slot, int64_t step, SyncRangeResponse* response) const;

  const ServerConfig config_;
  const JobConfig& job_;
  const int group_;
  const std::string in_range_;  // " in range k": follows the slot's name in messages
  const apply::UpdateRules rules_;
  CenterTable* const centers_;
  storage::DurableStore* const store_;
  const Authorizer authorize_;
  const CallCheck check_call_;
  SlotBooks books_;  // DETERMINISTIC turns of this group's syncs
  CallGate inflight_;

  // GLOBAL_CHECKPOINT: set once by EnableGlobalCheckpoint, before the server is ready.
  std::unique_ptr<RangeCheckpointFiles> checkpoints_;
  // Set once by SetOperatorCheck or EnableGlobalCheckpoint, before the server is ready.
  CallCheck check_operator_;
  // One checkpoint or rollback at a time; an export's read waits for a rollback to end (its
  // centers and kept steps change in two steps).
  mutable absl::Mutex checkpoint_mu_;
  absl::Mutex declare_mu_;     // one declaration fetch at a time

  mutable absl::Mutex mu_;
  std::map<Key, Kept> kept_ ABSL_GUARDED_BY(mu_);
  // The last rollback (RollbackRange's rollback_id) done in full; 0: none.
  uint64_t last_rollback_id_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // rollbacks begun (a sync compares it)
};

}  // namespace rebound::server
