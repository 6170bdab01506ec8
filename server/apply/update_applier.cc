#include "server/apply/update_applier.h"

#include <glog/logging.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/config.h"
#include "common/slot.h"
#include "common/status_macros.h"
#include "compute/tensor_bundle.h"
#include "server/sync_batch.h"

namespace rebound::server::apply {

UpdateApplier::UpdateApplier(const ApplierUnits& units)
    : config_(*units.config),
      job_(config_.job()),
      rules_(job_),
      membership_(units.membership),
      centers_(units.centers),
      tracker_(units.tracker),
      store_(units.store),
      step_log_(units.step_log),
      books_(units.books),
      retention_(units.retention),
      recovery_(units.recovery),
      clock_(units.clock) {}

absl::Status UpdateApplier::CheckNextSyncStep(const SlotId& slot, int64_t step) const {
  return rules_.DecideSync(slot, books_->Get(slot).last_update_step, step).status();
}

absl::StatusOr<double> UpdateApplier::DivergenceRatio(const SlotId& slot, double norm,
                                                      const char* what) const {
  return rules_.DivergenceRatio(slot, norm, tracker_->PeerDivergenceMedian(slot), what);
}

WeightRecord UpdateApplier::WeightRecordFor(const SlotId& slot, const SlotBook& book) const {
  return WithBook(tracker_->ExportSlot(slot, clock_->Now()), slot, book);
}

void UpdateApplier::OnRefused(const SlotId& slot, uint64_t incarnation, const std::string& what,
                              const absl::Status& status) {
  tracker_->OnFault(membership_->NameOf(incarnation), clock_->Now());
  books_->CountRefused(slot);
  LOG(WARNING) << "refused " << what << " of slot " << SlotName(slot)
               << " (a fault of its worker): " << status;
}

absl::Status UpdateApplier::Refused(const SlotId& slot, uint64_t incarnation, const char* what,
                                    absl::Status status) {
  if (status.code() == absl::StatusCode::kInvalidArgument) {
    OnRefused(slot, incarnation, what, status);
  }
  return status;
}

std::string UpdateApplier::IntegritySummary(int stage) const {
  const double max_ratio = books_->MaxDivergenceRatio(stage);
  const double ratio_bound = job_.weighting().max_divergence_ratio();
  const double abs_bound = job_.weighting().max_abs_value();
  return absl::StrCat(
      "center integrity of stage ", stage, " so far: max |value| ", centers_->max_abs_seen(stage),
      abs_bound > 0 ? absl::StrCat(" (", centers_->max_abs_seen(stage) / abs_bound,
                                   " of weighting.max_abs_value ", abs_bound, ")")
                    : std::string(" (weighting.max_abs_value off)"),
      ", max divergence ratio ", max_ratio,
      ratio_bound > 0 ? absl::StrCat(" (", max_ratio / ratio_bound,
                                     " of weighting.max_divergence_ratio ", ratio_bound, ")")
                      : std::string(" (weighting.max_divergence_ratio off)"));
}

void UpdateApplier::Progressed(const SlotId& slot, int64_t step) {
  if (membership_->RecordProgress(slot, step, job_.training().max_steps())) {
    LOG(INFO) << "slot " << SlotName(slot) << " finished at step " << step << "; "
              << IntegritySummary(slot.stage());
  }
}

absl::Status UpdateApplier::Sync(const SlotId& slot, const SyncRequest& request,
                                 SyncResponse* response) {
  const int64_t step = request.step();
  RETURN_IF_ERROR(rules_.CheckSyncStep(step));
  RETURN_IF_ERROR(CheckNextSyncStep(slot, step));
  const int stage = slot.stage();
  const BundleCheck check = [&](const TensorBundle& bundle, const char* name) {
    return centers_->ValidateBundle(stage, bundle, name);
  };
  // Non-finite or malformed parameters are the sender's fault: they count against it; so is a
  // malformed or non-finite optimizer state (it becomes the slot's snapshot).
  absl::Status valid = check(request.params(), "params");
  if (valid.ok()) {
    valid = UpdateRules::CheckOptimizerState(request.optimizer(), StateParts::kAnySubset, check);
  }
  if (!valid.ok()) return Refused(slot, request.incarnation(), "sync", valid);
  if (job_.scheduling() == DETERMINISTIC) {
    RETURN_IF_ERROR(books_->WaitForTurn(slot, absl::Milliseconds(config_.max_wait_ms())));
  }
  const uint64_t checkpoint_epoch = recovery_->SyncEpoch();

  const std::vector<float> x = centers_->Unbundle(stage, request.params());
  const double alpha = EffectiveMovingRate(job_);
  WeightInputs inputs;
  SlotBook updated;
  // The measurement is recorded in the tracker only when the sync commits (a refused sync
  // leaves no trace but its fault).
  absl::Time measured_at;
  int64_t measured_version = 0;
  double measured_norm = 0;
  double ratio = 0;
  // Decided under the stage lock: a duplicate (a retry whose reply was lost) is declined, a
  // fenced sender or a divergent update refused.
  auto weight = [&](int64_t version, double norm) -> absl::StatusOr<CenterTable::WeightDecision> {
    // Checked again under the stage lock: the sync may have waited (its DETERMINISTIC turn, the
    // lock) while its sender was declared failed; a fenced worker never writes again.
    RETURN_IF_ERROR(membership_->CheckOwner(request.incarnation(), slot));
    const SlotBook book = books_->Get(slot);
    ASSIGN_OR_RETURN(Verdict verdict, rules_.DecideSync(slot, book.last_update_step, step));
    if (verdict != Verdict::kApply) return CenterTable::WeightDecision::Decline();
    ASSIGN_OR_RETURN(ratio, DivergenceRatio(slot, norm, "||x - c||"));
    measured_at = clock_->Now();
    measured_version = version;
    measured_norm = norm;
    inputs = tracker_->Measure(slot, measured_at, version, norm);
    updated = UpdateRules::AfterSync(book, step);
    return inputs.weight();
  };
  // The tensors go to the store without copies: the center and the worker's post-sync
  // parameters from the table's buffers, the optimizer state from the request's own bytes.
  // Decided under the stage lock (the books, so that a retry of this step is a duplicate from
  // now on; the log's floor; the weight's measurement); written after it (CenterTable's
  // ElasticSyncStaged).
  const compute::StageLayout& layout = centers_->layout(stage);
  storage::WriteBatch batch;
  std::optional<storage::DurableStore::Prepared> prepared;
  storage::DurableStore::Position position;
  auto decide = [&](int64_t version, absl::Span<const float> center,
                    absl::Span<const float> worker_after, absl::Span<const float> center_before)
      -> absl::StatusOr<CenterTable::StagedWrite> {
    // The log is GC'd through the new snapshot's step, or less for a recovery group's member.
    LogRetention::SyncFloor floor = retention_->ForSync(slot, step, request.incarnation());
    const int64_t gc_step = floor.gc_step;
    const std::optional<int64_t> audit_from = floor.audit_from;
    const uint64_t audit_owner = floor.owner;
    const int64_t previous_floor = updated.log_floor;  // the log below it is deleted already
    updated.log_floor = gc_step;
    AddSyncToBatch(layout, slot, request, version, center, worker_after,
                   WeightRecordFor(slot, updated), &batch, gc_step,
                   /*log_gc_from=*/previous_floor);
    RETURN_IF_ERROR(batch.status());
    tracker_->Record(slot, measured_at, measured_version, measured_norm, inputs);
    RETURN_IF_ERROR(step_log_->CommitSnapshot(slot, gc_step, [&]() -> absl::Status {
      books_->SetDecided(slot, updated, ratio);
      return absl::OkStatus();
    }));
    retention_->Committed(slot, step, std::move(floor));
    CenterTable::StagedWrite staged;
    staged.prepare = [&, center_before, audit_from, audit_owner]() -> absl::Status {
      // Before this sync's batch replaces the window's starting snapshot, off the stage lock.
      retention_->HoldAudit(slot, step, audit_from, audit_owner);
      *response->mutable_center_before() = centers_->Bundle(stage, center_before);
      ASSIGN_OR_RETURN(storage::DurableStore::Prepared files, store_->Prepare(batch));
      prepared.emplace(std::move(files));
      return absl::OkStatus();
    };
    staged.write = [&]() -> absl::Status {
      ASSIGN_OR_RETURN(position, store_->Write(*prepared));
      return absl::OkStatus();
    };
    staged.await = [&]() { return store_->AwaitReplicated(position); };
    return staged;
  };
  const size_t n = x.size();
  std::unique_ptr<float[]> worker_after(new float[n]);  // uninitialised: written in full
  absl::StatusOr<CenterTable::Update> result = centers_->ElasticSyncStaged(
      stage, x, alpha, weight, decide, absl::MakeSpan(worker_after.get(), n));
  if (result.ok() && result->declined) {
    return AnswerSyncAgain(slot, request, checkpoint_epoch, response);
  }
  if (!result.ok()) {
    // Refused by the integrity checks (its result, or its distance from the center): nothing
    // was changed, and the sender is charged with a fault.
    if (result.status().code() != absl::StatusCode::kInvalidArgument) {
      LOG(ERROR) << "sync of slot " << SlotName(slot) << " failed: " << result.status();
    }
    return Refused(slot, request.incarnation(), "sync", result.status());
  }
  books_->MarkDurable(slot, updated);
  Progressed(slot, step);
  RETURN_IF_ERROR(recovery_->AfterSync(slot, step, checkpoint_epoch));
  response->set_center_version(result->version);
  response->set_weight(inputs.weight());
  response->set_moving_rate(alpha);
  return absl::OkStatus();
}

absl::Status UpdateApplier::AnswerSyncAgain(const SlotId& slot, const SyncRequest& request,
                                            uint64_t checkpoint_epoch, SyncResponse* response) {
  // The same sync again (its reply was lost): answer with the stored post-sync state, once the
  // first is written (it may still be: its books are set when it is decided).
  centers_->AwaitWrites(slot.stage());
  const int64_t last = books_->Get(slot).last_update_step;
  if (request.step() < last) return UpdateRules::StaleSync(slot, last, request.step());
  RETURN_IF_ERROR(recovery_->AfterSync(slot, request.step(), checkpoint_epoch));
  ASSIGN_OR_RETURN(Snapshot snapshot, store_->ReadSnapshot(slot));
  *response->mutable_worker_params_after() = std::move(*snapshot.mutable_params());
  response->set_center_version(centers_->version(slot.stage()));
  response->set_moving_rate(EffectiveMovingRate(job_));
  response->set_weight(tracker_->Current(slot, clock_->Now()).weight());
  return absl::OkStatus();
}

absl::Status UpdateApplier::Push(const SlotId& slot, const PushRequest& request,
                                 PushResponse* response) {
  RETURN_IF_ERROR(rules_.CheckPushStep(request.sequence(), request.step()));
  const int stage = slot.stage();
  for (const auto& [bundle, name] :
       {std::pair<const TensorBundle*, const char*>{&request.gradient(), "gradient"},
        {&request.hessian_diag(), "hessian_diag"}}) {
    if (absl::Status ok = centers_->ValidateBundle(stage, *bundle, name); !ok.ok()) {
      return Refused(slot, request.incarnation(), "push", ok);
    }
  }
  const std::vector<float> g = centers_->Unbundle(stage, request.gradient());
  const std::vector<float> d = centers_->Unbundle(stage, request.hessian_diag());
  WeightInputs inputs;
  SlotBook updated;
  uint64_t applied = 0;
  absl::Time measured_at;
  int64_t measured_version = 0;
  double measured_norm = 0;
  double ratio = 0;
  auto weight = [&](int64_t version, double norm) -> absl::StatusOr<CenterTable::WeightDecision> {
    RETURN_IF_ERROR(membership_->CheckOwner(request.incarnation(), slot));
    const SlotBook book = books_->Get(slot);
    applied = book.applied_sequence;
    ASSIGN_OR_RETURN(Verdict verdict, UpdateRules::DecidePush(slot, applied, request.sequence()));
    if (verdict != Verdict::kApply) return CenterTable::WeightDecision::Decline();
    ASSIGN_OR_RETURN(ratio, DivergenceRatio(slot, norm, "||g||"));
    measured_at = clock_->Now();
    measured_version = version;
    measured_norm = norm;
    inputs = tracker_->Measure(slot, measured_at, version, norm);
    updated = UpdateRules::AfterPush(book, request.sequence(), request.step());
    return inputs.weight();
  };
  const compute::StageLayout& layout = centers_->layout(stage);
  auto commit = [&](int64_t version, absl::Span<const float> center, int64_t opt_step,
                    absl::Span<const float> m, absl::Span<const float> v) {
    storage::WriteBatch batch;
    AddCenterAndOptToBatch(layout, stage, version, center, opt_step, m, v, &batch);
    tracker_->Record(slot, measured_at, measured_version, measured_norm, inputs);
    batch.PutWeight(WeightRecordFor(slot, updated));
    RETURN_IF_ERROR(store_->Commit(batch));
    books_->Set(slot, updated, ratio);
    return absl::OkStatus();
  };
  absl::StatusOr<CenterTable::Update> result =
      centers_->ApplyAdaHessian(stage, g, d, EffectiveAdaHessianConfig(job_), weight, commit);
  if (result.ok() && result->declined) {
    response->set_applied(false);
    response->set_applied_sequence(applied);
    response->set_center_version(centers_->version(stage));
    response->set_weight(tracker_->Current(slot, clock_->Now()).weight());
    return absl::OkStatus();
  }
  if (!result.ok()) return Refused(slot, request.incarnation(), "push", result.status());
  Progressed(slot, request.step());
  response->set_applied(true);
  response->set_applied_sequence(request.sequence());
  response->set_center_version(result->version);
  response->set_weight(inputs.weight());
  return absl::OkStatus();
}

absl::StatusOr<double> UpdateApplier::AuthorizeRangeSync(const SlotId& slot,
                                                         uint64_t incarnation,
                                                         int64_t step) const {
  RETURN_IF_ERROR(membership_->CheckOwner(incarnation, slot));
  RETURN_IF_ERROR(rules_.CheckSyncStep(step));
  RETURN_IF_ERROR(CheckNextSyncStep(slot, step));
  return books_->Get(slot).next_weight;
}

absl::StatusOr<double> UpdateApplier::AuthorizeRangePush(const SlotId& slot,
                                                         uint64_t incarnation,
                                                         uint64_t sequence,
                                                         int64_t step) const {
  RETURN_IF_ERROR(membership_->CheckOwner(incarnation, slot));
  RETURN_IF_ERROR(rules_.CheckPushStep(sequence, step));
  // At most one push past the committed one, as for syncs (a retry is answered by the range,
  // which may not have applied it yet).
  const SlotBook book = books_->Get(slot);
  RETURN_IF_ERROR(UpdateRules::DecidePush(slot, book.applied_sequence, sequence).status());
  return book.next_weight;
}

absl::Status UpdateApplier::CommitSync(const SlotId& slot, const CommitSyncRequest& request,
                                       const RangeSyncCheck& check,
                                       CommitSyncResponse* response) {
  const int64_t step = request.step();
  RETURN_IF_ERROR(rules_.CheckSyncStep(step));
  RETURN_IF_ERROR(CheckNextSyncStep(slot, step));
  ASSIGN_OR_RETURN(const double sum_of_squares, rules_.SumOfRangeSquares(request.ranges()));
  // Every range must hold the sync before group 0 records it: the committed step is what a
  // recovery reads every range's snapshot at.
  RETURN_IF_ERROR(check(slot, step));
  const uint64_t checkpoint_epoch = recovery_->SyncEpoch();
  // An audited window (LogRetention::HoldAudit): its start is read from the ranges after the
  // commit, off the lock, before the trainer (which syncs again only after the answer) moves on.
  std::optional<int64_t> audit_from;
  uint64_t audit_owner = 0;
  std::optional<Snapshot> audit_start;
  {
    absl::MutexLock lock(&commit_mu_);
    // Again under the lock: the sender may have been fenced meanwhile, or a retry committed.
    RETURN_IF_ERROR(membership_->CheckOwner(request.incarnation(), slot));
    const SlotBook book = books_->Get(slot);
    ASSIGN_OR_RETURN(const Verdict verdict, rules_.DecideSync(slot, book.last_update_step, step));
    if (verdict == Verdict::kStale) {
      return UpdateRules::StaleSync(slot, book.last_update_step, step);
    }
    if (verdict == Verdict::kDuplicate) {
      // A retried commit (its answer was lost, or the barrier's wait timed out): back to the
      // barrier of its cut below (GLOBAL_CHECKPOINT), which a complete cut passes at once.
      response->set_duplicate(true);
      response->set_next_weight(book.next_weight);
    } else {
      // The weighting inputs of this sync decide the next one's weight (the divergence lags one
      // sync: docs/weighting.md#sharded-jobs). Range 0's version stands for the center's: every
      // range applies every sync.
      const absl::Time now = clock_->Now();
      const int64_t version_before = std::max<int64_t>(0, request.ranges(0).center_version() - 1);
      const double norm = std::sqrt(sum_of_squares);
      const WeightInputs inputs = tracker_->Measure(slot, now, version_before, norm);
      SlotBook updated = UpdateRules::AfterSync(book, step);
      updated.next_weight = inputs.weight();
      LogRetention::SyncFloor floor = retention_->ForSync(slot, step, request.incarnation());
      const int64_t gc_step = floor.gc_step;
      const int64_t previous_floor = book.log_floor;
      updated.log_floor = gc_step;
      tracker_->Record(slot, now, version_before, norm, inputs);
      // The slot's snapshot here is its header (step, data cursor): the tensors are the range
      // groups' (CenterRange.ReadRangeSnapshot at this step).
      Snapshot snapshot;
      *snapshot.mutable_slot() = slot;
      snapshot.set_step(step);
      snapshot.set_data_epoch(request.data_epoch());
      snapshot.set_data_offset(request.data_offset());
      snapshot.mutable_optimizer()->set_step(step);
      storage::WriteBatch batch;
      batch.PutSnapshot(snapshot, {});
      batch.PutWeight(WeightRecordFor(slot, updated));
      batch.DeleteLogRange(slot, previous_floor, gc_step + 1);
      absl::Status committed = step_log_->CommitSnapshot(slot, gc_step, [&]() -> absl::Status {
        RETURN_IF_ERROR(store_->Commit(batch));
        books_->Set(slot, updated, 0.0);
        return absl::OkStatus();
      });
      if (!committed.ok()) {
        LOG(ERROR) << "commit of slot " << SlotName(slot) << " step " << step
                   << " failed: " << committed;
        return committed;
      }
      audit_from = floor.audit_from;
      audit_owner = floor.owner;
      audit_start = std::move(floor.audit_start);
      retention_->Committed(slot, step, std::move(floor));
      response->set_weight(book.next_weight);
      response->set_next_weight(updated.next_weight);
    }
  }
  retention_->HoldAudit(slot, step, audit_from, audit_owner, std::move(audit_start));
  if (!response->duplicate()) Progressed(slot, step);
  return recovery_->AfterSync(slot, step, checkpoint_epoch);
}

absl::Status UpdateApplier::CommitPush(const SlotId& slot, const CommitPushRequest& request,
                                       const RangePushCheck& check,
                                       CommitPushResponse* response) {
  const uint64_t sequence = request.sequence();
  RETURN_IF_ERROR(rules_.CheckPushStep(sequence, request.step()));
  ASSIGN_OR_RETURN(const double sum_of_squares, rules_.SumOfRangeSquares(request.ranges()));
  RETURN_IF_ERROR(check(slot, sequence));
  {
    absl::MutexLock lock(&commit_mu_);
    RETURN_IF_ERROR(membership_->CheckOwner(request.incarnation(), slot));
    const SlotBook book = books_->Get(slot);
    ASSIGN_OR_RETURN(const Verdict verdict,
                     UpdateRules::DecidePush(slot, book.applied_sequence, sequence));
    if (verdict == Verdict::kDuplicate) {
      response->set_applied(false);
      response->set_applied_sequence(book.applied_sequence);
      return absl::OkStatus();
    }
    // As CommitSync: this push's inputs decide the next one's weight (||g|| from the K partial
    // sums; range 0's version stands for the center's).
    const absl::Time now = clock_->Now();
    const int64_t version_before = std::max<int64_t>(0, request.ranges(0).center_version() - 1);
    const double norm = std::sqrt(sum_of_squares);
    const WeightInputs inputs = tracker_->Measure(slot, now, version_before, norm);
    SlotBook updated = UpdateRules::AfterPush(book, sequence, request.step());
    updated.next_weight = inputs.weight();
    tracker_->Record(slot, now, version_before, norm, inputs);
    storage::WriteBatch batch;
    batch.PutWeight(WeightRecordFor(slot, updated));
    if (absl::Status committed = store_->Commit(batch); !committed.ok()) {
      LOG(ERROR) << "commit of slot " << SlotName(slot) << " push " << sequence
                 << " failed: " << committed;
      return committed;
    }
    books_->Set(slot, updated, 0.0);
    response->set_applied(true);
    response->set_applied_sequence(sequence);
    response->set_weight(book.next_weight);
  }
  Progressed(slot, request.step());
  return absl::OkStatus();
}

}  // namespace rebound::server::apply
