// ParameterServerService's calls of a sharded job's group 0 (docs/design.md §10.2, docs/sharding.md):
// the range groups' authorizations and the trainers' sync commits.

#include <glog/logging.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/grpc_status.h"
#include "common/request_fields.h"
#include "common/slot.h"
#include "common/status_macros.h"
#include "server/service.h"

namespace rebound::server {

absl::Status ParameterServerService::CheckUnsharded(const char* what) const {
  if (job_.sharding().groups() <= 1) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "this job's center is sharded across ", job_.sharding().groups(),
      " server groups: trainers sync (push) each range with CenterRange.SyncRange (PushRange) and "
      "commit with CommitSync (CommitPush), and read it with CenterRange.PullRange "
      "(docs/sharding.md); ",
      what, " is for unsharded jobs"));
}

absl::Status ParameterServerService::CheckCoordinator() const {
  if (job_.sharding().groups() <= 1 || config_.shard().group() == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "this server group holds range ", config_.shard().group(), " of a sharded center; workers "
      "register with group 0 at ", config_.shard().group_addresses(0), " (docs/sharding.md)"));
}

absl::StatusOr<AuthorizeRangeResponse> ParameterServerService::Authorize(
    const grpc::ServerContext* context, const AuthorizeRangeRequest& request) {
  RETURN_IF_ERROR(CheckWorker(context, request.incarnation()));
  RETURN_IF_ERROR(CheckEnumValues(request));
  if (job_.sharding().groups() <= 1 || config_.shard().group() != 0) {
    return absl::FailedPreconditionError(
        "AuthorizeRange is answered by a sharded job's group 0 only");
  }
  if (request.range() < 0 || request.range() >= job_.sharding().groups()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "range must be in [0, ", job_.sharding().groups(), "), got ", request.range()));
  }
  AuthorizeRangeResponse response;
  response.set_moving_rate(EffectiveMovingRate(job_));
  switch (request.access()) {
    case RANGE_READ:
      RETURN_IF_ERROR(membership_->CheckAlive(request.incarnation()));
      return response;
    case RANGE_FAULT: {
      // Only the owner's own update can be its fault; its credential is checked above.
      const SlotId slot = Normalized(request.slot());
      RETURN_IF_ERROR(ValidateSlot(slot));
      RETURN_IF_ERROR(membership_->CheckOwner(request.incarnation(), slot));
      OnRefused(slot, request.incarnation(),
                absl::StrCat("an update in range ", request.range()).c_str(),
                absl::InvalidArgumentError(request.reason().substr(0, 1024)));
      return response;
    }
    case RANGE_DECLARATION: {
      // A range group learns the declared model from here (RangeService::EnsureDeclared).
      RETURN_IF_ERROR(membership_->CheckAlive(request.incarnation()));
      ASSIGN_OR_RETURN(*response.mutable_model(), centers_->Declaration());
      return response;
    }
    case RANGE_PUSH: {
      const SlotId slot = Normalized(request.slot());
      RETURN_IF_ERROR(ValidateSlot(slot));
      RETURN_IF_ERROR(membership_->CheckOwner(request.incarnation(), slot));
      RETURN_IF_ERROR(rules_.CheckPushStep(request.sequence(), request.step()));
      // At most one push past the committed one, as for syncs (a retry is answered by the
      // range, which may not have applied it yet).
      const SlotBook book = books_.Get(slot);
      RETURN_IF_ERROR(
          apply::UpdateRules::DecidePush(slot, book.applied_sequence, request.sequence())
              .status());
      response.set_weight(book.next_weight);
      return response;
    }
    case RANGE_SYNC: {
      const SlotId slot = Normalized(request.slot());
      RETURN_IF_ERROR(ValidateSlot(slot));
      RETURN_IF_ERROR(membership_->CheckOwner(request.incarnation(), slot));
      RETURN_IF_ERROR(rules_.CheckSyncStep(request.step()));
      // At most one sync past the committed one: a group is never two syncs ahead of group 0,
      // which is what lets each group keep only its last two range snapshots.
      RETURN_IF_ERROR(CheckNextSyncStep(slot, request.step()));
      response.set_weight(books_.Get(slot).next_weight);
      return response;
    }
    default:
      return absl::InvalidArgumentError(
          "access must be RANGE_SYNC, RANGE_PUSH, RANGE_READ, RANGE_DECLARATION or RANGE_FAULT");
  }
}

grpc::Status ParameterServerService::AuthorizeRange(grpc::ServerContext* context,
                                                    const AuthorizeRangeRequest* request,
                                                    AuthorizeRangeResponse* response) {
  absl::StatusOr<AuthorizeRangeResponse> allowed = Authorize(context, *request);
  if (!allowed.ok()) return ToGrpcStatus(allowed.status());
  *response = *std::move(allowed);
  return grpc::Status::OK;
}

absl::StatusOr<double> ParameterServerService::SumOfRangeSquares(
    const google::protobuf::RepeatedPtrField<RangeSyncResult>& ranges) const {
  const int groups = job_.sharding().groups();
  if (ranges.size() != groups) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ranges must hold one result per range (", groups, "), got ", ranges.size()));
  }
  double sum_of_squares = 0.0;
  for (int k = 0; k < groups; ++k) {
    const RangeSyncResult& range = ranges.Get(k);
    if (range.range() != k || range.center_version() < 0 ||
        !(range.partial_sq_norm() >= 0.0 && std::isfinite(range.partial_sq_norm()))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ranges[", k, "] must be range ", k, " with a center_version >= 0 and a finite "
          "partial_sq_norm >= 0, got range ", range.range(), ", version ", range.center_version(),
          ", partial_sq_norm ", range.partial_sq_norm()));
    }
    sum_of_squares += range.partial_sq_norm();
  }
  return sum_of_squares;
}

grpc::Status ParameterServerService::CommitSync(grpc::ServerContext* context,
                                                const CommitSyncRequest* request,
                                                CommitSyncResponse* response) {
  if (absl::Status ok = CheckWorker(context, request->incarnation()); !ok.ok()) {
    return ToGrpcStatus(ok);
  }
  if (absl::Status enums = CheckEnumValues(*request); !enums.ok()) return ToGrpcStatus(enums);
  const int groups = job_.sharding().groups();
  if (groups <= 1 || config_.shard().group() != 0 || job_.easgd().mode() != EASGD) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        "CommitSync is for a sharded EASGD job's group 0; an unsharded job's trainers Sync"));
  }
  const SlotId slot = Normalized(request->slot());
  if (absl::Status ok = ValidateSlot(slot); !ok.ok()) return ToGrpcStatus(ok);
  if (absl::Status ok = membership_->CheckOwner(request->incarnation(), slot); !ok.ok()) {
    return ToGrpcStatus(ok);
  }
  const int64_t step = request->step();
  if (absl::Status ok = rules_.CheckSyncStep(step); !ok.ok()) return ToGrpcStatus(ok);
  if (absl::Status ok = CheckNextSyncStep(slot, step); !ok.ok()) return ToGrpcStatus(ok);
  absl::StatusOr<double> summed = SumOfRangeSquares(request->ranges());
  if (!summed.ok()) return ToGrpcStatus(summed.status());
  const double sum_of_squares = *summed;
  // Every range must hold the sync before group 0 records it: the committed step is what a
  // recovery reads every range's snapshot at.
  if (!range_check_) {
    return ToGrpcStatus(absl::FailedPreconditionError("this server cannot check its ranges"));
  }
  if (absl::Status held = range_check_(slot, step); !held.ok()) return ToGrpcStatus(held);
  const uint64_t checkpoint_epoch = recovery_->SyncEpoch();
  {
    absl::MutexLock lock(&commit_mu_);
    // Again under the lock: the sender may have been fenced meanwhile, or a retry committed.
    if (absl::Status ok = membership_->CheckOwner(request->incarnation(), slot); !ok.ok()) {
      return ToGrpcStatus(ok);
    }
    const SlotBook book = books_.Get(slot);
    absl::StatusOr<apply::Verdict> verdict = rules_.DecideSync(slot, book.last_update_step, step);
    if (!verdict.ok()) return ToGrpcStatus(verdict.status());
    if (*verdict == apply::Verdict::kStale) {
      return ToGrpcStatus(apply::UpdateRules::StaleSync(slot, book.last_update_step, step));
    }
    if (*verdict == apply::Verdict::kDuplicate) {
      // A retried commit (its answer was lost, or the barrier's wait timed out): back to the
      // barrier of its cut below (GLOBAL_CHECKPOINT), which a complete cut passes at once.
      response->set_duplicate(true);
      response->set_next_weight(book.next_weight);
    } else {
      // The weighting inputs of this sync decide the next one's weight (the divergence lags one
      // sync: docs/weighting.md#sharded-jobs). Range 0's version stands for the center's: every
      // range applies every sync.
      const absl::Time now = clock_->Now();
      const int64_t version_before =
          std::max<int64_t>(0, request->ranges(0).center_version() - 1);
      const double norm = std::sqrt(sum_of_squares);
      const WeightInputs inputs = tracker_->Measure(slot, now, version_before, norm);
      SlotBook updated = apply::UpdateRules::AfterSync(book, step);
      updated.next_weight = inputs.weight();
      LogRetention::SyncFloor floor = retention_.ForSync(slot, step);
      const int64_t gc_step = floor.gc_step;
      const int64_t previous_floor = book.log_floor;
      updated.log_floor = gc_step;
      tracker_->Record(slot, now, version_before, norm, inputs);
      // The slot's snapshot here is its header (step, data cursor): the tensors are the range
      // groups' (CenterRange.ReadRangeSnapshot at this step).
      Snapshot snapshot;
      *snapshot.mutable_slot() = slot;
      snapshot.set_step(step);
      snapshot.set_data_epoch(request->data_epoch());
      snapshot.set_data_offset(request->data_offset());
      snapshot.mutable_optimizer()->set_step(step);
      storage::WriteBatch batch;
      batch.PutSnapshot(snapshot, {});
      batch.PutWeight(WeightRecordFor(slot, updated));
      batch.DeleteLogRange(slot, previous_floor, gc_step + 1);
      absl::Status committed = step_log_->CommitSnapshot(slot, gc_step, [&]() -> absl::Status {
        RETURN_IF_ERROR(store_->Commit(batch));
        books_.Set(slot, updated, 0.0);
        return absl::OkStatus();
      });
      if (!committed.ok()) {
        LOG(ERROR) << "commit of slot " << SlotName(slot) << " step " << step
                   << " failed: " << committed;
        return ToGrpcStatus(committed);
      }
      retention_.Committed(slot, std::move(floor));
      response->set_weight(book.next_weight);
      response->set_next_weight(updated.next_weight);
    }
  }
  if (!response->duplicate() &&
      membership_->RecordProgress(slot, step, job_.training().max_steps())) {
    LOG(INFO) << "slot " << SlotName(slot) << " finished at step " << step;
  }
  if (absl::Status barrier = recovery_->AfterSync(slot, step, checkpoint_epoch); !barrier.ok()) {
    return ToGrpcStatus(barrier);
  }
  return grpc::Status::OK;
}

grpc::Status ParameterServerService::CommitPush(grpc::ServerContext* context,
                                                const CommitPushRequest* request,
                                                CommitPushResponse* response) {
  if (absl::Status ok = CheckWorker(context, request->incarnation()); !ok.ok()) {
    return ToGrpcStatus(ok);
  }
  if (absl::Status enums = CheckEnumValues(*request); !enums.ok()) return ToGrpcStatus(enums);
  if (job_.sharding().groups() <= 1 || config_.shard().group() != 0 ||
      job_.easgd().mode() != ASYNC_ADAHESSIAN) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        "CommitPush is for a sharded ASYNC_ADAHESSIAN job's group 0; an unsharded job's "
        "trainers Push"));
  }
  const SlotId slot = Normalized(request->slot());
  if (absl::Status ok = ValidateSlot(slot); !ok.ok()) return ToGrpcStatus(ok);
  if (absl::Status ok = membership_->CheckOwner(request->incarnation(), slot); !ok.ok()) {
    return ToGrpcStatus(ok);
  }
  const uint64_t sequence = request->sequence();
  if (absl::Status ok = rules_.CheckPushStep(sequence, request->step()); !ok.ok()) {
    return ToGrpcStatus(ok);
  }
  absl::StatusOr<double> summed = SumOfRangeSquares(request->ranges());
  if (!summed.ok()) return ToGrpcStatus(summed.status());
  if (!push_check_) {
    return ToGrpcStatus(absl::FailedPreconditionError("this server cannot check its ranges"));
  }
  if (absl::Status held = push_check_(slot, sequence); !held.ok()) return ToGrpcStatus(held);
  {
    absl::MutexLock lock(&commit_mu_);
    if (absl::Status ok = membership_->CheckOwner(request->incarnation(), slot); !ok.ok()) {
      return ToGrpcStatus(ok);
    }
    const SlotBook book = books_.Get(slot);
    absl::StatusOr<apply::Verdict> verdict =
        apply::UpdateRules::DecidePush(slot, book.applied_sequence, sequence);
    if (!verdict.ok()) return ToGrpcStatus(verdict.status());
    if (*verdict == apply::Verdict::kDuplicate) {
      response->set_applied(false);
      response->set_applied_sequence(book.applied_sequence);
      return grpc::Status::OK;
    }
    // As CommitSync: this push's inputs decide the next one's weight (||g|| from the K partial
    // sums; range 0's version stands for the center's).
    const absl::Time now = clock_->Now();
    const int64_t version_before = std::max<int64_t>(0, request->ranges(0).center_version() - 1);
    const double norm = std::sqrt(*summed);
    const WeightInputs inputs = tracker_->Measure(slot, now, version_before, norm);
    SlotBook updated = apply::UpdateRules::AfterPush(book, sequence, request->step());
    updated.next_weight = inputs.weight();
    tracker_->Record(slot, now, version_before, norm, inputs);
    storage::WriteBatch batch;
    batch.PutWeight(WeightRecordFor(slot, updated));
    if (absl::Status committed = store_->Commit(batch); !committed.ok()) {
      LOG(ERROR) << "commit of slot " << SlotName(slot) << " push " << sequence
                 << " failed: " << committed;
      return ToGrpcStatus(committed);
    }
    books_.Set(slot, updated, 0.0);
    response->set_applied(true);
    response->set_applied_sequence(sequence);
    response->set_weight(book.next_weight);
  }
  if (membership_->RecordProgress(slot, request->step(), job_.training().max_steps())) {
    LOG(INFO) << "slot " << SlotName(slot) << " finished at step " << request->step();
  }
  return grpc::Status::OK;
}

}  // namespace rebound::server
