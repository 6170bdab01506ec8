#include "server/shard/range_service.h"

#include <glog/logging.h>

#include <chrono>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/config.h"
#include "common/grpc_status.h"
#include "common/slot.h"
#include "common/status_macros.h"
#include "compute/shard_ranges.h"
#include "compute/tensor_bundle.h"
#include "server/sync_batch.h"

namespace rebound::server {

RangeService::RangeService(const ServerConfig& config, CenterTable* centers,
                           storage::DurableStore* store, Authorizer authorize,
                           CallCheck check_call, int64_t inflight_bytes)
    : config_(config),
      job_(config_.job()),
      group_(config_.shard().group()),
      in_range_(absl::StrCat(" in range ", group_)),
      rules_(job_),
      centers_(centers),
      store_(store),
      authorize_(std::move(authorize)),
      check_call_(std::move(check_call)),
      books_(job_),
      inflight_("request bytes in flight (max_inflight_bytes)", "bytes", inflight_bytes) {}

void RangeService::Restore(const storage::LoadedState& state) {
  std::vector<WeightRecord> books;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, snapshot] : state.range_snapshots) {
      const auto& [slot, copy] = key;
      kept_[Key(slot.first, slot.second)].step[copy] = snapshot.step();
    }
    for (const auto& [slot, book] : state.range_books) {
      Kept& kept = kept_[Key(slot.first, slot.second)];
      kept.sequence = book.applied_sequence();
      kept.pushes = book.update_count();
    }
    for (const auto& [key, kept] : kept_) {
      WeightRecord book;
      book.mutable_slot()->set_replica(key.first);
      book.mutable_slot()->set_stage(key.second);
      book.set_last_update_step(kept.last());
      const int64_t tau = job_.easgd().sync_period();
      book.set_update_count((kept.last() + tau - 1) / tau);
      books.push_back(std::move(book));
    }
  }
  books_.Restore(books);
}

void RangeService::FillStatus(ShardingStatus* status) const {
  status->set_groups(job_.sharding().groups());
  status->set_group(group_);
  *status->mutable_group_addresses() = config_.shard().group_addresses();
  // Every stage's whole size (a declared model's once it is declared here).
  for (int s = 0; s < centers_->num_stages(); ++s) {
    const int64_t parameters = centers_->StageParameters(s);
    ShardingStatus::StageRanges* stage = status->add_stages();
    stage->set_stage(s);
    stage->set_parameters(parameters);
    const std::vector<int64_t> begins =
        compute::RangeBegins(parameters, job_.sharding().groups());
    for (size_t k = 0; k + 1 < begins.size(); ++k) stage->add_range_begin(begins[k]);
  }
}

int RangeService::CopyOf(int64_t step) const {
  const int64_t tau = job_.easgd().sync_period();
  return static_cast<int>(((step + tau - 1) / tau) % 2);
}

absl::Status RangeService::CheckRange(int range) const {
  if (range != group_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "this server group holds range ", group_, " of the center, the call names range ", range,
        " (its address is shard.group_addresses[", range, "])"));
  }
  return absl::OkStatus();
}

grpc::Status RangeService::ChargeFault(const grpc::ServerContext* context, uint64_t incarnation,
                                       const SlotId& slot, const absl::Status& refusal) const {
  AuthorizeRangeRequest ask;
  ask.set_incarnation(incarnation);
  ask.set_access(RANGE_FAULT);
  *ask.mutable_slot() = slot;
  ask.set_range(group_);
  ask.set_reason(std::string(refusal.message()));
  // Group 0 charges the slot's owner only, after checking the caller's credential; the caller's
  // answer is the refusal whatever group 0 said.
  if (absl::StatusOr<AuthorizeRangeResponse> charged = authorize_(context, ask); !charged.ok()) {
    LOG(INFO) << "range " << group_ << " refused an update of slot " << SlotName(slot)
              << " not charged by group 0: " << charged.status();
  }
  return ToGrpcStatus(refusal);
}

absl::Status RangeService::EnsureDeclared(const grpc::ServerContext* context,
                                          uint64_t incarnation) {
  if (!job_.model().declared_by_worker() || centers_->num_stages() > 0) {
    return absl::OkStatus();
  }
  absl::MutexLock lock(&declare_mu_);
  if (centers_->num_stages() > 0) return absl::OkStatus();  // declared meanwhile
  AuthorizeRangeRequest ask;
  ask.set_incarnation(incarnation);
  ask.set_access(RANGE_DECLARATION);
  ask.set_range(group_);
  ASSIGN_OR_RETURN(const AuthorizeRangeResponse answer, authorize_(context, ask));
  // Durable first, as group 0's first declaration: a restart declares the model from it.
  CenterRecord declaration;
  declaration.set_stage(CenterTable::kDeclarationStage);
  declaration.set_version(0);
  *declaration.mutable_params() = answer.model();
  storage::WriteBatch batch;
  batch.PutCenter(declaration);
  RETURN_IF_ERROR(store_->Commit(batch));
  if (absl::Status declared = centers_->Declare(answer.model()); !declared.ok()) {
    // Group 0 checked it when it was declared: a model that does not declare here is group
    // 0's or the link's fault, not the worker's.
    return absl::InternalError(
        absl::StrCat("the model group 0 declared does not declare here: ", declared.message()));
  }
  LOG(INFO) << "range " << group_ << " learned the declared model from group 0 ("
            << centers_->StageParameters(0) << " parameters)";
  return absl::OkStatus();
}

absl::Status RangeService::CheckSlot(const SlotId& slot) const {
  return CheckSlotInTopology(slot, job_.topology());
}

uint64_t RangeService::Generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

RangeService::Kept RangeService::GetKept(const SlotId& slot) const {
  absl::MutexLock lock(&mu_);
  auto it = kept_.find(Key(slot.replica(), slot.stage()));
  return it == kept_.end() ? Kept() : it->second;
}

grpc::Status RangeService::AnswerApplied(const SlotId& slot, int64_t step,
                                         SyncRangeResponse* response) const {
  const Kept kept = GetKept(slot);
  for (int copy = 0; copy < 2; ++copy) {
    if (kept.step[copy] != step) continue;
    auto snapshot = store_->ReadRangeSnapshot(slot, copy);
    if (!snapshot.ok()) return ToGrpcStatus(snapshot.status());
    if (snapshot->step() != step) break;  // replaced meanwhile: stale by now
    LOG(INFO) << "sync of slot " << SlotName(slot) << " step " << step << " in range " << group_
              << " was applied before: answered from its kept snapshot";
    *response->mutable_worker_params_after() = std::move(*snapshot->mutable_params());
    response->set_center_version(centers_->version(slot.stage()));
    response->set_moving_rate(EffectiveMovingRate(job_));
    return grpc::Status::OK;
  }
  return ToGrpcStatus(apply::UpdateRules::StaleSync(slot, GetKept(slot).last(), step, in_range_));
}

grpc::Status RangeService::SyncRange(grpc::ServerContext* context,
                                     const SyncRangeRequest* request,
                                     SyncRangeResponse* response) {
  if (absl::Status ok = check_call_(context); !ok.ok()) return ToGrpcStatus(ok);
  auto admitted = inflight_.Enter(static_cast<int64_t>(request->ByteSizeLong()));
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  const SlotId slot = Normalized(request->slot());
  if (absl::Status ok = CheckUpdateCall(context, request->range(), slot, request->incarnation());
      !ok.ok()) {
    return ToGrpcStatus(ok);
  }
  const int64_t step = request->step();
  if (absl::Status ok = rules_.CheckSyncStep(step); !ok.ok()) return ToGrpcStatus(ok);
  // The tensors first: a malformed request is refused before group 0 authorizes anything, and
  // charged to its sender (as an unsharded Sync's).
  if (absl::Status ok = ValidateSync(slot, *request); !ok.ok()) {
    return ChargeFault(context, request->incarnation(), slot, ok);
  }
  // Read before the authorization: a rollback after it refuses this sync (ApplySync).
  const uint64_t generation = Generation();
  absl::StatusOr<AuthorizeRangeResponse> allowed =
      Authorize(context, RANGE_SYNC, request->incarnation(), slot, step, 0);
  if (!allowed.ok()) return ToGrpcStatus(allowed.status());
  bool step_refused = false;  // ApplySync's own refusal, not the integrity checks'
  absl::StatusOr<CenterTable::Update> applied =
      ApplySync(slot, *request, allowed->weight(), generation, &step_refused, response);
  // A step this group applied already (the last one, or the one before it that group 0 may not
  // have committed yet) is answered from its kept snapshot.
  if (applied.ok() && applied->declined) return AnswerApplied(slot, step, response);
  if (!applied.ok() && applied.status().code() == absl::StatusCode::kInvalidArgument &&
      !step_refused) {
    // Refused by the integrity checks (a result beyond weighting.max_abs_value): nothing
    // changed, and the sender is charged as for an unsharded Sync.
    return ChargeFault(context, request->incarnation(), slot, applied.status());
  }
  if (!applied.ok()) return ToGrpcStatus(applied.status());
  response->set_center_version(applied->version);
  response->set_weight(allowed->weight());
  return grpc::Status::OK;
}

absl::Status RangeService::CheckUpdateCall(const grpc::ServerContext* context, int range,
                                           const SlotId& slot, uint64_t incarnation) {
  RETURN_IF_ERROR(CheckRange(range));
  RETURN_IF_ERROR(CheckSlot(slot));
  return EnsureDeclared(context, incarnation);
}

absl::Status RangeService::ValidateSync(const SlotId& slot,
                                        const SyncRangeRequest& request) const {
  // The range snapshot is what a spare resumes from: the whole AdaHessian state (m, v, last D),
  // or none at all (an optimizer whose state the client cannot export: a replay then restarts
  // the slot from the center, docs/python.md).
  const apply::BundleCheck check = [&](const TensorBundle& bundle, const char* name) {
    return centers_->ValidateBundle(slot.stage(), bundle, name);
  };
  RETURN_IF_ERROR(check(request.params(), "params"));
  return apply::UpdateRules::CheckOptimizerState(request.optimizer(),
                                                 apply::StateParts::kAllOrNone, check);
}

absl::Status RangeService::ValidatePush(const SlotId& slot,
                                        const PushRangeRequest& request) const {
  RETURN_IF_ERROR(centers_->ValidateBundle(slot.stage(), request.gradient(), "gradient"));
  return centers_->ValidateBundle(slot.stage(), request.hessian_diag(), "hessian_diag");
}

absl::Status RangeService::AuthorizeRead(const grpc::ServerContext* context,
                                         uint64_t incarnation) const {
  AuthorizeRangeRequest ask;
  ask.set_incarnation(incarnation);
  ask.set_access(RANGE_READ);
  ask.set_range(group_);
  return authorize_(context, ask).status();
}

absl::Status RangeService::AuthorizeWorkerRead(const grpc::ServerContext* context,
                                               uint64_t incarnation) {
  RETURN_IF_ERROR(EnsureDeclared(context, incarnation));
  return AuthorizeRead(context, incarnation);
}

absl::Status RangeService::CheckOperatorRead(const grpc::ServerContext* context,
                                             absl::string_view call) const {
  if (!check_operator_) {
    return absl::FailedPreconditionError(
        absl::StrCat("this server takes no operator calls on its range (", call, ")"));
  }
  return check_operator_(context);
}

absl::StatusOr<AuthorizeRangeResponse> RangeService::Authorize(
    const grpc::ServerContext* context, RangeAccess access, uint64_t incarnation,
    const SlotId& slot, int64_t step, uint64_t sequence) const {
  AuthorizeRangeRequest ask;
  ask.set_incarnation(incarnation);
  ask.set_access(access);
  *ask.mutable_slot() = slot;
  ask.set_step(step);
  ask.set_sequence(sequence);
  ask.set_range(group_);
  return authorize_(context, ask);
}

absl::StatusOr<CenterTable::Update> RangeService::ApplySync(const SlotId& slot,
                                                            const SyncRangeRequest& request,
                                                            double weight_of_sync,
                                                            uint64_t generation,
                                                            bool* step_refused,
                                                            SyncRangeResponse* response) {
  const int stage = slot.stage();
  const int64_t step = request.step();
  auto decide = [&]() -> absl::StatusOr<apply::Verdict> {
    absl::StatusOr<apply::Verdict> verdict =
        rules_.DecideSync(slot, GetKept(slot).last(), step, in_range_);
    if (!verdict.ok()) *step_refused = true;
    return verdict;
  };
  // Decided first without the stage lock (a retry waits for no turn), and again under it.
  ASSIGN_OR_RETURN(const apply::Verdict verdict, decide());
  if (verdict != apply::Verdict::kApply) {
    return CenterTable::Update{/*declined=*/true, centers_->version(stage)};
  }
  if (job_.scheduling() == DETERMINISTIC) {
    RETURN_IF_ERROR(books_.WaitForTurn(slot, absl::Milliseconds(config_.max_wait_ms())));
  }
  const OptimizerState& optimizer = request.optimizer();
  const bool no_state = apply::UpdateRules::CarriesNoState(optimizer);
  const std::vector<float> x = centers_->Unbundle(stage, request.params());
  const double alpha = EffectiveMovingRate(job_);
  const compute::StageLayout& layout = centers_->layout(stage);
  auto weight = [&](int64_t /*version*/,
                    double norm) -> absl::StatusOr<CenterTable::WeightDecision> {
    // GLOBAL_CHECKPOINT: authorized before a rollback, this sync must not move the restored
    // center (its sender is fenced by now).
    if (Generation() != generation) {
      return absl::AbortedError(absl::StrCat(
          "GLOBAL_CHECKPOINT: range ", group_, " was rolled back while this sync of slot ",
          SlotName(slot), " step ", step, " waited; it is undone"));
    }
    // Again under the stage lock: another call of the same step may have applied it.
    ASSIGN_OR_RETURN(const apply::Verdict now, decide());
    if (now != apply::Verdict::kApply) return CenterTable::WeightDecision::Decline();
    response->set_partial_sq_norm(norm * norm);
    return weight_of_sync;
  };
  auto commit = [&](int64_t version, absl::Span<const float> center,
                    absl::Span<const float> worker_after,
                    absl::Span<const float> center_before) -> absl::Status {
    storage::WriteBatch batch;
    CenterRecord center_header;
    center_header.set_stage(stage);
    center_header.set_version(version);
    *center_header.mutable_params() = compute::BundleHeader(layout);
    std::vector<absl::string_view> center_data;
    compute::AppendTensorViews(layout, center, &center_data);
    batch.PutCenter(center_header, std::move(center_data));
    Snapshot snapshot;
    *snapshot.mutable_slot() = slot;
    snapshot.set_step(step);
    *snapshot.mutable_params() = compute::BundleHeader(layout);
    std::vector<absl::string_view> data;
    compute::AppendTensorViews(layout, worker_after, &data);
    OptimizerState* state = snapshot.mutable_optimizer();
    state->set_step(optimizer.step());
    if (!no_state) {
      AddHeaderAndViews(optimizer.m(), state->mutable_m(), &data);
      AddHeaderAndViews(optimizer.v(), state->mutable_v(), &data);
      AddHeaderAndViews(optimizer.last_hdiag(), state->mutable_last_hdiag(), &data);
    }
    const int copy = CopyOf(step);
    batch.PutRangeSnapshot(snapshot, std::move(data), copy);
    RETURN_IF_ERROR(store_->Commit(batch));
    {
      absl::MutexLock lock(&mu_);
      kept_[Key(slot.replica(), slot.stage())].step[copy] = step;
    }
    books_.Set(slot, apply::UpdateRules::AfterSync(books_.Get(slot), step), 0.0);
    *response->mutable_center_before() = centers_->Bundle(stage, center_before);
    return absl::OkStatus();
  };
  const size_t n = x.size();
  std::unique_ptr<float[]> worker_after(new float[n]);  // written in full by ElasticSync
  absl::StatusOr<CenterTable::Update> applied = centers_->ElasticSync(
      stage, x, alpha, weight, commit, absl::MakeSpan(worker_after.get(), n));
  if (!applied.ok() && applied.status().code() != absl::StatusCode::kInvalidArgument &&
      applied.status().code() != absl::StatusCode::kAborted) {
    LOG(ERROR) << "sync of slot " << SlotName(slot) << " range " << group_
               << " failed: " << applied.status();
  }
  response->set_moving_rate(alpha);
  return applied;
}

grpc::Status RangeService::PushRange(grpc::ServerContext* context,
                                     const PushRangeRequest* request,
                                     PushRangeResponse* response) {
  if (absl::Status ok = check_call_(context); !ok.ok()) return ToGrpcStatus(ok);
  auto admitted = inflight_.Enter(static_cast<int64_t>(request->ByteSizeLong()));
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  if (job_.easgd().mode() != ASYNC_ADAHESSIAN) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        "this job runs mode EASGD: trainers sync ranges (SyncRange), they do not push"));
  }
  const SlotId slot = Normalized(request->slot());
  if (absl::Status ok = CheckUpdateCall(context, request->range(), slot, request->incarnation());
      !ok.ok()) {
    return ToGrpcStatus(ok);
  }
  const uint64_t sequence = request->sequence();
  if (absl::Status ok = rules_.CheckPushStep(sequence, request->step()); !ok.ok()) {
    return ToGrpcStatus(ok);
  }
  if (absl::Status ok = ValidatePush(slot, *request); !ok.ok()) {
    return ChargeFault(context, request->incarnation(), slot, ok);
  }
  absl::StatusOr<AuthorizeRangeResponse> allowed =
      Authorize(context, RANGE_PUSH, request->incarnation(), slot, request->step(), sequence);
  if (!allowed.ok()) return ToGrpcStatus(allowed.status());
  // FAILED_PRECONDITION when it skips ahead: never an integrity refusal.
  absl::StatusOr<CenterTable::Update> applied =
      ApplyPush(slot, *request, allowed->weight(), response);
  if (!applied.ok() && applied.status().code() == absl::StatusCode::kInvalidArgument) {
    return ChargeFault(context, request->incarnation(), slot, applied.status());
  }
  if (!applied.ok()) return ToGrpcStatus(applied.status());
  response->set_applied(!applied->declined);
  response->set_applied_sequence(applied->declined ? GetKept(slot).sequence : sequence);
  response->set_center_version(applied->version);
  if (!applied->declined) response->set_weight(allowed->weight());
  return grpc::Status::OK;
}

absl::StatusOr<CenterTable::Update> RangeService::ApplyPush(const SlotId& slot,
                                                            const PushRangeRequest& request,
                                                            double weight_of_push,
                                                            PushRangeResponse* response) {
  const int stage = slot.stage();
  const uint64_t sequence = request.sequence();
  auto decide = [&]() {
    return apply::UpdateRules::DecidePush(slot, GetKept(slot).sequence, sequence, in_range_);
  };
  ASSIGN_OR_RETURN(const apply::Verdict verdict, decide());
  if (verdict == apply::Verdict::kDuplicate) {
    return CenterTable::Update{/*declined=*/true, centers_->version(stage)};
  }
  const std::vector<float> g = centers_->Unbundle(stage, request.gradient());
  const std::vector<float> d = centers_->Unbundle(stage, request.hessian_diag());
  const compute::StageLayout& layout = centers_->layout(stage);
  auto weight = [&](int64_t /*version*/,
                    double norm) -> absl::StatusOr<CenterTable::WeightDecision> {
    ASSIGN_OR_RETURN(apply::Verdict now, decide());
    if (now == apply::Verdict::kDuplicate) return CenterTable::WeightDecision::Decline();
    response->set_partial_sq_norm(norm * norm);
    return weight_of_push;
  };
  auto commit = [&](int64_t version, absl::Span<const float> center, int64_t opt_step,
                    absl::Span<const float> m, absl::Span<const float> v) -> absl::Status {
    storage::WriteBatch batch;
    AddCenterAndOptToBatch(layout, stage, version, center, opt_step, m, v, &batch);
    const Kept kept = GetKept(slot);
    WeightRecord book;
    *book.mutable_slot() = slot;
    book.set_applied_sequence(sequence);
    book.set_last_update_step(request.step());
    book.set_update_count(kept.pushes + 1);
    batch.PutRangeBook(book);
    RETURN_IF_ERROR(store_->Commit(batch));
    absl::MutexLock lock(&mu_);
    Kept& now = kept_[Key(slot.replica(), slot.stage())];
    now.sequence = sequence;
    now.pushes = kept.pushes + 1;
    return absl::OkStatus();
  };
  absl::StatusOr<CenterTable::Update> applied = centers_->ApplyAdaHessian(
      stage, g, d, EffectiveAdaHessianConfig(job_), weight, commit);
  if (!applied.ok() && applied.status().code() != absl::StatusCode::kInvalidArgument &&
      applied.status().code() != absl::StatusCode::kFailedPrecondition) {
    LOG(ERROR) << "push of slot " << SlotName(slot) << " range " << group_
               << " failed: " << applied.status();
  }
  return applied;
}

grpc::Status RangeService::PullRange(grpc::ServerContext* context,
                                     const PullRangeRequest* request,
                                     PullRangeResponse* response) {
  if (absl::Status ok = check_call_(context); !ok.ok()) return ToGrpcStatus(ok);
  if (absl::Status ok = CheckRange(request->range()); !ok.ok()) return ToGrpcStatus(ok);
  if (absl::Status ok = EnsureDeclared(context, request->incarnation()); !ok.ok()) {
    return ToGrpcStatus(ok);
  }
  if (request->stage() < 0 || request->stage() >= centers_->num_stages()) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("stage must be in [0, ", centers_->num_stages(), "), got ",
                     request->stage())));
  }
  if (absl::Status ok = AuthorizeRead(context, request->incarnation()); !ok.ok()) {
    return ToGrpcStatus(ok);
  }
  auto center = centers_->Read(request->stage());
  if (!center.ok()) return ToGrpcStatus(center.status());
  *response->mutable_center() = centers_->Bundle(request->stage(), center->first);
  response->set_center_version(center->second);
  return grpc::Status::OK;
}

grpc::Status RangeService::ReadRangeSnapshot(grpc::ServerContext* context,
                                             const ReadRangeSnapshotRequest* request,
                                             Snapshot* response) {
  if (absl::Status ok = check_call_(context); !ok.ok()) return ToGrpcStatus(ok);
  if (absl::Status ok = CheckRange(request->range()); !ok.ok()) return ToGrpcStatus(ok);
  const SlotId slot = Normalized(request->slot());
  if (absl::Status ok = CheckSlot(slot); !ok.ok()) return ToGrpcStatus(ok);
  // Without an incarnation: group 0's read of an audited window's start, an operator call.
  const absl::Status admitted =
      request->incarnation() == 0
          ? CheckOperatorRead(context, "ReadRangeSnapshot without an incarnation")
          : AuthorizeWorkerRead(context, request->incarnation());
  if (!admitted.ok()) return ToGrpcStatus(admitted);
  absl::StatusOr<Snapshot> part = ReadSnapshotPart(slot, request->step());
  if (!part.ok()) return ToGrpcStatus(part.status());
  *response = *std::move(part);
  return grpc::Status::OK;
}

absl::StatusOr<Snapshot> RangeService::ReadSnapshotPart(const SlotId& request_slot,
                                                        int64_t step) const {
  const SlotId slot = Normalized(request_slot);
  RETURN_IF_ERROR(CheckSlot(slot));
  const Kept kept = GetKept(slot);
  for (int copy = 0; copy < 2; ++copy) {
    if (kept.step[copy] != step || step == 0) continue;
    ASSIGN_OR_RETURN(Snapshot snapshot, store_->ReadRangeSnapshot(slot, copy));
    if (snapshot.step() != step) break;  // overwritten by the next sync meanwhile
    snapshot.clear_stored_tensors();
    return snapshot;
  }
  return absl::NotFoundError(absl::StrCat(
      "range ", group_, " holds no snapshot of slot ", SlotName(slot), " at step ", step,
      " (it holds steps ", kept.step[0], " and ", kept.step[1], ")"));
}

grpc::Status RangeService::RangeSteps(grpc::ServerContext* context,
                                      const RangeStepsRequest* request,
                                      RangeStepsResponse* response) {
  if (absl::Status ok = check_call_(context); !ok.ok()) return ToGrpcStatus(ok);
  const SlotId slot = Normalized(request->slot());
  if (absl::Status ok = CheckSlot(slot); !ok.ok()) return ToGrpcStatus(ok);
  const Kept kept = GetKept(slot);
  response->add_steps(kept.step[0]);
  response->add_steps(kept.step[1]);
  response->set_applied_sequence(kept.sequence);
  return grpc::Status::OK;
}

RangeService::Applied RangeService::GetApplied(int stage) const {
  const int replicas = job_.topology().replicas();
  Applied applied;
  applied.steps.resize(replicas);
  applied.sequences.resize(replicas);
  absl::MutexLock lock(&mu_);
  for (int r = 0; r < replicas; ++r) {
    auto it = kept_.find(Key(r, stage));
    if (it == kept_.end()) continue;
    applied.steps[r] = it->second.last();
    applied.sequences[r] = it->second.sequence;
  }
  applied.generation = generation_;
  return applied;
}

absl::StatusOr<ExportRangeResponse> RangeService::ReadForExport(int stage) const {
  ExportRangeResponse response;
  if (job_.model().declared_by_worker() && centers_->num_stages() == 0) {
    response.set_model_unknown(true);
    return response;
  }
  if (stage < 0 || stage >= centers_->num_stages()) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage must be in [0, ", centers_->num_stages(), "), got ", stage));
  }
  // A sync or push changes the slot's kept step or sequence together with the center, under
  // the stage lock: equal looks around the read mean that the center read holds exactly the
  // updates the looks name. A rollback restores the centers before the kept steps: not during
  // one.
  absl::MutexLock no_rollback(&checkpoint_mu_);
  for (int read = 0; read < kExportReads; ++read) {
    const Applied before = GetApplied(stage);
    ASSIGN_OR_RETURN(auto center, centers_->Read(stage));
    const Applied after = GetApplied(stage);
    if (!(before == after)) continue;
    *response.mutable_center() = centers_->Bundle(stage, center.first);
    response.set_center_version(center.second);
    for (int64_t step : after.steps) response.add_applied_steps(step);
    for (uint64_t sequence : after.sequences) response.add_applied_sequences(sequence);
    return response;
  }
  return absl::UnavailableError(absl::StrCat("range ", group_, " applied updates of stage ", stage,
                                             " during each of its ", kExportReads,
                                             " reads; retry"));
}

grpc::Status RangeService::ExportRange(grpc::ServerContext* context,
                                       const ExportRangeRequest* request,
                                       ExportRangeResponse* response) {
  if (absl::Status ok = check_call_(context); !ok.ok()) return ToGrpcStatus(ok);
  if (absl::Status ok = CheckOperatorRead(context, "ExportRange"); !ok.ok()) {
    return ToGrpcStatus(ok);
  }
  if (absl::Status ok = CheckRange(request->range()); !ok.ok()) return ToGrpcStatus(ok);
  absl::StatusOr<ExportRangeResponse> read = ReadForExport(request->stage());
  if (!read.ok()) return ToGrpcStatus(read.status());
  *response = *std::move(read);
  return grpc::Status::OK;
}

uint64_t RangeService::AppliedSequence(const SlotId& slot) const {
  return GetKept(Normalized(slot)).sequence;
}

bool RangeService::Holds(const SlotId& slot, int64_t step) const {
  const Kept kept = GetKept(Normalized(slot));
  return step > 0 && (kept.step[0] == step || kept.step[1] == step);
}

// --- GLOBAL_CHECKPOINT (docs/sharding.md#global-checkpoint) ---

absl::Status RangeService::EnableGlobalCheckpoint(const std::string& dir,
                                                  CallCheck check_operator) {
  checkpoints_ = std::make_unique<RangeCheckpointFiles>(job_.job_id(), group_, dir);
  check_operator_ = std::move(check_operator);
  ASSIGN_OR_RETURN(const std::vector<int64_t> held, checkpoints_->Steps());
  if (!held.empty()) {
    LOG(INFO) << "range " << group_ << " holds the checkpoints of steps " << held.front()
              << " to " << held.back();
    return absl::OkStatus();
  }
  // The job's start: what a rollback before the first cut restores.
  return TakeCheckpoint(0, 0).status();
}

absl::Status RangeService::CheckOperatorCall(const grpc::ServerContext* context) const {
  RETURN_IF_ERROR(check_call_(context));
  if (checkpoints_ == nullptr) {
    return absl::FailedPreconditionError(
        "CheckpointRange and RollbackRange are group 0's calls in a job under "
        "fault_tolerance.policy GLOBAL_CHECKPOINT; this job's policy is another");
  }
  return check_operator_(context);
}

absl::StatusOr<int64_t> RangeService::TakeCheckpoint(int64_t step, int64_t keep_from) {
  if (checkpoints_ == nullptr) {
    return absl::FailedPreconditionError("this job is not under GLOBAL_CHECKPOINT");
  }
  if (step < 0 || step > job_.training().max_steps() || keep_from < 0 || keep_from > step) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step must be in [0, training.max_steps = ", job_.training().max_steps(),
        "] and keep_from in [0, step], got step ", step, ", keep_from ", keep_from));
  }
  absl::MutexLock lock(&checkpoint_mu_);
  CheckpointRecord record;
  record.set_step(step);
  record.set_taken_unix_ms(absl::ToUnixMillis(absl::Now()));
  for (int stage = 0; stage < centers_->num_stages(); ++stage) {
    ASSIGN_OR_RETURN(auto center, centers_->Read(stage));
    CenterRecord* out = record.add_centers();
    out->set_stage(stage);
    out->set_version(center.second);
    *out->mutable_params() = centers_->Bundle(stage, center.first);
  }
  if (step > 0) {
    // Every slot's range snapshot at the cut: the trainers wait at group 0's barrier, so none
    // has synced past it (the other copy holds the sync before).
    for (int r = 0; r < job_.topology().replicas(); ++r) {
      for (int s = 0; s < job_.topology().stages(); ++s) {
        SlotId slot;
        slot.set_replica(r);
        slot.set_stage(s);
        const Kept kept = GetKept(slot);
        const int copy = kept.step[0] == step ? 0 : (kept.step[1] == step ? 1 : -1);
        if (copy < 0) {
          return absl::FailedPreconditionError(absl::StrCat(
              "range ", group_, " holds slot ", SlotName(slot), "'s syncs of steps ",
              kept.step[0], " and ", kept.step[1], ", not the cut ", step));
        }
        ASSIGN_OR_RETURN(Snapshot snapshot, store_->ReadRangeSnapshot(slot, copy));
        if (snapshot.step() != step) {
          return absl::FailedPreconditionError(absl::StrCat(
              "slot ", SlotName(slot), "'s range snapshot moved on to step ", snapshot.step(),
              " during the checkpoint of step ", step));
        }
        snapshot.clear_stored_tensors();
        *record.add_snapshots() = std::move(snapshot);
      }
    }
  }
  ASSIGN_OR_RETURN(const int64_t bytes, checkpoints_->Put(std::move(record), keep_from));
  LOG(INFO) << "range " << group_ << " kept its checkpoint of step " << step << " (" << bytes
            << " bytes)";
  return bytes;
}

absl::StatusOr<std::vector<int64_t>> RangeService::RollBack(int64_t step, uint64_t rollback_id) {
  if (checkpoints_ == nullptr) {
    return absl::FailedPreconditionError("this job is not under GLOBAL_CHECKPOINT");
  }
  if (rollback_id == 0) return absl::InvalidArgumentError("rollback_id must not be 0");
  absl::MutexLock lock(&checkpoint_mu_);
  auto versions = [this] {
    std::vector<int64_t> out;
    for (int stage = 0; stage < centers_->num_stages(); ++stage) {
      out.push_back(centers_->version(stage));
    }
    return out;
  };
  bool done = false;
  {
    absl::MutexLock kept_lock(&mu_);
    done = rollback_id == last_rollback_id_;
  }
  if (done) return versions();  // a repeat (group 0's retry of a lost answer)
  ASSIGN_OR_RETURN(CheckpointRecord record, checkpoints_->Get(step));
  // The record must be this range's whole state at `step`.
  const int stages = centers_->num_stages();
  const int slots = job_.topology().replicas() * job_.topology().stages();
  if (record.centers_size() != stages || (step > 0 && record.snapshots_size() != slots)) {
    return absl::DataLossError(absl::StrCat(
        "range ", group_, "'s checkpoint of step ", step, " holds ", record.centers_size(),
        " centers and ", record.snapshots_size(), " snapshots; the job has ", stages,
        " stages and ", slots, " slots"));
  }
  for (int stage = 0; stage < stages; ++stage) {
    const CenterRecord& center = record.centers(stage);
    if (center.stage() != stage) {
      return absl::DataLossError(absl::StrCat("range ", group_, "'s checkpoint of step ", step,
                                              " holds stage ", center.stage(), " at ", stage));
    }
    RETURN_IF_ERROR(centers_->ValidateBundle(stage, center.params(), "checkpoint center"));
  }
  std::map<Key, const Snapshot*> snapshots;
  for (const Snapshot& snapshot : record.snapshots()) {
    RETURN_IF_ERROR(CheckSlot(snapshot.slot()));
    if (snapshot.step() != step) {
      return absl::DataLossError(absl::StrCat("range ", group_, "'s checkpoint of step ", step,
                                              " holds a snapshot of step ", snapshot.step()));
    }
    snapshots[Key(snapshot.slot().replica(), snapshot.slot().stage())] = &snapshot;
  }
  if (step > 0 && static_cast<int>(snapshots.size()) != slots) {
    return absl::DataLossError(absl::StrCat("range ", group_, "'s checkpoint of step ", step,
                                            " does not hold one snapshot per slot"));
  }
  {
    // From here a sync authorized before the rollback no longer moves a center.
    absl::MutexLock kept_lock(&mu_);
    ++generation_;
  }
  storage::WriteBatch batch;
  for (int stage = 0; stage < stages; ++stage) {
    CenterRecord center = record.centers(stage);
    center.set_version(centers_->version(stage) + 1);
    // Under the stage lock: a sync of the old generation that holds it finishes first.
    RETURN_IF_ERROR(centers_->Restore(center, nullptr));
    batch.PutCenter(center);
  }
  const int copy = step > 0 ? CopyOf(step) : 0;
  std::vector<WeightRecord> books;
  for (int r = 0; r < job_.topology().replicas(); ++r) {
    for (int s = 0; s < job_.topology().stages(); ++s) {
      Snapshot empty;  // step 0: "none" (RangeService::Restore reads the headers' steps)
      empty.mutable_slot()->set_replica(r);
      empty.mutable_slot()->set_stage(s);
      if (step > 0) {
        batch.PutRangeSnapshot(*snapshots[Key(r, s)], copy);
        batch.PutRangeSnapshot(empty, 1 - copy);
      } else {
        batch.PutRangeSnapshot(empty, 0);
        batch.PutRangeSnapshot(empty, 1);
      }
      WeightRecord book;
      *book.mutable_slot() = empty.slot();
      book.set_last_update_step(step);
      const int64_t tau = job_.easgd().sync_period();
      book.set_update_count((step + tau - 1) / tau);
      books.push_back(std::move(book));
    }
  }
  RETURN_IF_ERROR(store_->Commit(batch));
  {
    absl::MutexLock kept_lock(&mu_);
    for (const WeightRecord& book : books) {
      Kept kept;
      if (step > 0) kept.step[copy] = step;
      kept_[Key(book.slot().replica(), book.slot().stage())] = kept;
    }
  }
  // DETERMINISTIC turns as group 0 keeps them after the rollback: every slot at the cut.
  books_.Clear();
  if (step > 0) books_.Restore(books);
  {
    absl::MutexLock kept_lock(&mu_);
    last_rollback_id_ = rollback_id;
  }
  LOG(WARNING) << "range " << group_ << " rolled back to its checkpoint of step " << step
               << " (rollback " << rollback_id << ")";
  return versions();
}

grpc::Status RangeService::CheckpointRange(grpc::ServerContext* context,
                                           const CheckpointRangeRequest* request,
                                           CheckpointRangeResponse* response) {
  if (absl::Status ok = CheckOperatorCall(context); !ok.ok()) return ToGrpcStatus(ok);
  if (absl::Status ok = CheckRange(request->range()); !ok.ok()) return ToGrpcStatus(ok);
  absl::StatusOr<int64_t> bytes = TakeCheckpoint(request->step(), request->keep_from());
  if (!bytes.ok()) return ToGrpcStatus(bytes.status());
  response->set_bytes(*bytes);
  return grpc::Status::OK;
}

grpc::Status RangeService::RollbackRange(grpc::ServerContext* context,
                                         const RollbackRangeRequest* request,
                                         RollbackRangeResponse* response) {
  if (absl::Status ok = CheckOperatorCall(context); !ok.ok()) return ToGrpcStatus(ok);
  if (absl::Status ok = CheckRange(request->range()); !ok.ok()) return ToGrpcStatus(ok);
  // A copy that arrives after its caller gave up must not land later than group 0 expects.
  if (context != nullptr && context->deadline() < std::chrono::system_clock::now()) {
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                        "the rollback call's deadline passed before it was handled");
  }
  if (request->step() < 0 || request->step() > job_.training().max_steps()) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "step must be in [0, training.max_steps = ", job_.training().max_steps(), "], got ",
        request->step())));
  }
  absl::StatusOr<std::vector<int64_t>> versions =
      RollBack(request->step(), request->rollback_id());
  if (!versions.ok()) return ToGrpcStatus(versions.status());
  for (int64_t version : *versions) response->add_center_versions(version);
  return grpc::Status::OK;
}

}  // namespace rebound::server
