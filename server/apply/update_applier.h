#pragma once

// UpdateApplier: applies a slot's updates and commits them, for every call of group 0 (or of an
// unsharded server) that does: an unsharded job's Sync and Push, a sharded job's CommitSync and
// CommitPush, and the authorization of a range group's SyncRange and PushRange (R20). It owns
// what an update must pass (UpdateRules, the sender's ownership again under the stage lock, the
// divergence bound), the weight (ReliabilityTracker), the center's move (CenterTable) and the
// commit that follows: the store's batch, the slot's books, its log's retention, the step log's
// snapshot floor; and what follows an applied update: the slot's progress, the GLOBAL_CHECKPOINT
// barrier. A refusal that is the sender's fault (malformed or non-finite tensors, a result
// beyond the center's integrity bounds) is charged to its worker.
//
// gRPC-free: the service's handlers check the call itself (credential, admission, the job's
// mode and topology, the slot's validity and owner) and convert the status; this unit sees the
// request messages only.
//
// An unsharded Sync is decided under the stage lock and written after it (CenterTable's
// ElasticSyncStaged: the answer still waits for the store and the in-sync standbys). Push,
// CommitSync and CommitPush commit under their lock (the stage's, or commit_mu_).
//
// Thread-safety: thread-safe. Lock order: commit_mu_ is taken before the units' locks and never
// with a stage lock; the stage locks are the CenterTable's (recovery_coordinator.h has the
// server's lock order). Sync blocks up to max_wait_ms for a DETERMINISTIC turn and the
// GLOBAL_CHECKPOINT barrier; every call blocks on the store's commit.
// Ownership: every unit in ApplierUnits is borrowed and must outlive the applier.
// Status codes: UpdateRules' (INVALID_ARGUMENT, FAILED_PRECONDITION), Membership::CheckOwner's
// (a fenced sender), the store's (UNAVAILABLE, DATA_LOSS), UNAVAILABLE for a DETERMINISTIC turn
// that did not come, and the RecoveryCoordinator's barrier's. A duplicate is not an error: it
// is answered as the first was.

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "proto/storage.pb.h"
#include "server/apply/update_rules.h"
#include "server/center_table.h"
#include "server/log_retention.h"
#include "server/membership.h"
#include "server/recovery_coordinator.h"
#include "server/reliability.h"
#include "server/slot_books.h"
#include "server/step_log.h"
#include "storage/durable_store.h"

namespace rebound::server::apply {

// The units an applier works on: the coordinator's (the service owns the books, step log,
// retention and coordinator; the server's life the others) and the coordinator itself.
struct ApplierUnits : RecoveryUnits {
  RecoveryCoordinator* recovery = nullptr;
};

// A sharded job's group 0: whether every range holds a slot's sync of `step` (or applied its
// push of `sequence`), asked before the commit records it (server/shard/range_check.h).
using RangeSyncCheck = std::function<absl::Status(const SlotId& slot, int64_t step)>;
using RangePushCheck = std::function<absl::Status(const SlotId& slot, uint64_t sequence)>;

class UpdateApplier {
 public:
  // REQUIRES: every pointer in `units` is set and outlives the applier.
  explicit UpdateApplier(const ApplierUnits& units);

  UpdateApplier(const UpdateApplier&) = delete;
  UpdateApplier& operator=(const UpdateApplier&) = delete;

  // For every call below, REQUIRES: `slot` is the request's slot, normalized and in the
  // topology; its sender's credential was checked.

  // A trainer's sync (mode EASGD, unsharded): applied at the slot's next sync point; a retry of
  // the last applied step is answered with the stored post-sync state (no center_before), an
  // older step is FAILED_PRECONDITION.
  absl::Status Sync(const SlotId& slot, const SyncRequest& request, SyncResponse* response);
  // A trainer's push (mode ASYNC_ADAHESSIAN, unsharded): applied at the next sequence; a retry
  // is answered with applied = false.
  absl::Status Push(const SlotId& slot, const PushRequest& request, PushResponse* response);

  // A sharded job's group 0: records a sync every range applied (`check` says they did), and
  // decides the weight of the slot's next one; a retry is answered with duplicate = true. A sync
  // whose window is chosen for an audit reads the window's start from every range before it
  // answers (LogRetention::HoldAudit).
  absl::Status CommitSync(const SlotId& slot, const CommitSyncRequest& request,
                          const RangeSyncCheck& check, CommitSyncResponse* response);
  // Likewise for a push every range applied.
  absl::Status CommitPush(const SlotId& slot, const CommitPushRequest& request,
                          const RangePushCheck& check, CommitPushResponse* response);
  // A range group asks whether the owner `incarnation` of `slot` may sync `step` there (at most
  // one sync past the committed one: a group is never two syncs ahead of group 0, which is what
  // lets each group keep only its last two range snapshots) or push `sequence`; the weight the
  // range applies it with.
  absl::StatusOr<double> AuthorizeRangeSync(const SlotId& slot, uint64_t incarnation,
                                            int64_t step) const;
  absl::StatusOr<double> AuthorizeRangePush(const SlotId& slot, uint64_t incarnation,
                                            uint64_t sequence, int64_t step) const;

  // A sync or push refused as the sender's fault (malformed, non-finite, or one whose result
  // would break the center's integrity): a fault of its worker, counted per slot for status.
  void OnRefused(const SlotId& slot, uint64_t incarnation, const std::string& what,
                 const absl::Status& status);

 private:
  // DecideSync against the slot's book, for its error alone.
  absl::Status CheckNextSyncStep(const SlotId& slot, int64_t step) const;
  absl::StatusOr<double> DivergenceRatio(const SlotId& slot, double norm, const char* what) const;
  WeightRecord WeightRecordFor(const SlotId& slot, const SlotBook& book) const;
  // A failed update: an integrity refusal (INVALID_ARGUMENT) is charged to the sender; the
  // status as it is.
  absl::Status Refused(const SlotId& slot, uint64_t incarnation, const char* what,
                       absl::Status status);
  // The slot reached `step`; logs its end (with the stage's integrity summary) once it finishes.
  void Progressed(const SlotId& slot, int64_t step);
  // "center integrity of stage s so far: ..." for the log line of a finished slot.
  std::string IntegritySummary(int stage) const;
  // The answer to a retried sync of the last applied step: the stored post-sync state.
  absl::Status AnswerSyncAgain(const SlotId& slot, const SyncRequest& request,
                               uint64_t checkpoint_epoch, SyncResponse* response);

  const ServerConfig& config_;
  const JobConfig& job_;
  const UpdateRules rules_;
  Membership* const membership_;
  CenterTable* const centers_;
  ReliabilityTracker* const tracker_;
  storage::DurableStore* const store_;
  StepLogService* const step_log_;
  SlotBooks* const books_;
  LogRetention* const retention_;
  RecoveryCoordinator* const recovery_;
  const Clock* const clock_;

  // Serializes CommitSync's and CommitPush's check-and-record of a slot's step.
  absl::Mutex commit_mu_;
};

}  // namespace rebound::server::apply
