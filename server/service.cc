#include "server/service.h"

#include "common/request_fields.h"

#include <glog/logging.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checksum.h"
#include "common/config.h"
#include "common/grpc_status.h"
#include "common/security.h"
#include "common/slot.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "compute/tensor_bundle.h"
#include "server/shard/range_authority.h"

namespace rebound::server {

namespace {

int64_t ModelFloats(const CenterTable& centers) {
  int64_t floats = 0;
  for (int s = 0; s < centers.num_stages(); ++s) floats += centers.layout(s).packed_size();
  return floats;
}

// The highest center version any job can reach above `version`: every replica's every step.
int64_t ReachableVersion(const JobConfig& job, int64_t version) {
  return version + int64_t{job.topology().replicas()} * std::max<int64_t>(1, job.training().max_steps());
}

}  // namespace

ParameterServerService::ParameterServerService(const ServerConfig& config, Membership* membership,
                                               CenterTable* centers, ReliabilityTracker* tracker,
                                               storage::DurableStore* store, const Clock* clock,
                                               TokenChecker token, std::string operator_token)
    : config_(config),
      job_(config_.job()),
      membership_(membership),
      centers_(centers),
      tracker_(tracker),
      store_(store),
      clock_(clock),
      token_(std::move(token)),
      operator_token_(std::move(operator_token)),
      admission_(EffectiveAdmissionBounds(config_, ModelFloats(*centers))),
      parked_("parked long polls (max_parked_calls)", "calls", admission_.parked_calls),
      inflight_("request bytes in flight (max_inflight_bytes)", "bytes",
                admission_.inflight_bytes),
      started_(clock->Now()),
      books_(job_),
      step_log_(std::make_unique<StepLogService>(
          job_, membership_, store_,
          [this](const SlotId& slot) { return books_.StepLogFloor(slot); },
          [this](const SlotId& slot) { return books_.Get(slot).last_update_step; })),
      retention_(job_, membership_, store_, &books_),
      auditor_(job_, membership_, tracker_, step_log_.get(), clock_) {
  retention_.SetAuditor(&auditor_);
  RecoveryUnits units;
  units.config = &config_;
  units.membership = membership_;
  units.centers = centers_;
  units.tracker = tracker_;
  units.store = store_;
  units.step_log = step_log_.get();
  units.books = &books_;
  units.retention = &retention_;
  units.clock = clock_;
  recovery_ = std::make_unique<RecoveryCoordinator>(units);
  applier_ = std::make_unique<apply::UpdateApplier>(apply::ApplierUnits{units, recovery_.get()});
  range_authority_ =
      std::make_unique<RangeAuthority>(config_, membership_, centers_, applier_.get());
}

void ParameterServerService::RestoreBookkeeping(const std::vector<WeightRecord>& records) {
  books_.Restore(records);
}

absl::Status ParameterServerService::CheckCall(const grpc::ServerContextBase* context) const {
  RETURN_IF_ERROR(token_.Check(context));
  return CheckReady();
}

absl::Status ParameterServerService::CheckWorker(const grpc::ServerContextBase* context,
                                                 uint64_t incarnation) const {
  RETURN_IF_ERROR(CheckCall(context));
  if (context == nullptr) return absl::OkStatus();
  return membership_->Authenticate(incarnation, MetadataValue(context, kWorkerCredentialKey));
}

absl::Status ParameterServerService::CheckOperator(const grpc::ServerContext* context) const {
  RETURN_IF_ERROR(CheckCall(context));
  if (context == nullptr) return absl::OkStatus();
  if (operator_token_.empty()) {
    if (FromLoopback(context)) return absl::OkStatus();
    return absl::PermissionDeniedError(absl::StrCat(
        "operator calls come from the server's own host unless the server has "
        "security.operator_token_file; this one comes from ", context->peer()));
  }
  if (!ConstantTimeEquals(MetadataValue(context, kOperatorTokenKey), operator_token_)) {
    return absl::UnauthenticatedError(absl::StrCat(
        "operator calls need the operator token (metadata ", kOperatorTokenKey,
        "; reboundctl --operator_token_file); the call has none or another one"));
  }
  return absl::OkStatus();
}

absl::Status ParameterServerService::CheckReady() const {
  if (!ready_.load()) {
    return absl::UnavailableError("the server is loading its durable state; retry shortly");
  }
  // A fenced store (a failed replication barrier: this leader is handing over) answers every
  // call UNAVAILABLE, so the worker retries at the new leader, before any check that reads the
  // in-memory state, which may lag what the group acknowledged (R15: a trainer's step-log
  // records were refused as INVALID_ARGUMENT by a deposed leader's stale books, and it exited).
  return store_->Fenced();
}

absl::Status ParameterServerService::ValidateSlot(const SlotId& slot) const {
  return CheckSlotInTopology(slot, job_.topology());
}

absl::Status ParameterServerService::EnableGlobalCheckpoint(const std::string& dir,
                                                            RangeCheckpointCalls ranges) {
  return recovery_->EnableGlobalCheckpoint(dir, std::move(ranges));
}

void ParameterServerService::MaybeRollBack() { recovery_->AfterDetection(); }

grpc::Status ParameterServerService::Register(grpc::ServerContext* context,
                                              const RegisterRequest* request,
                                              RegisterResponse* response) {
  if (absl::Status ready = CheckCall(context); !ready.ok()) return ToGrpcStatus(ready);
  if (absl::Status enums = CheckEnumValues(*request); !enums.ok()) return ToGrpcStatus(enums);
  if (absl::Status compatible =
          CheckPeerVersion("this server", request->version(),
                           absl::StrCat("the worker '", request->worker_name(), "'"));
      !compatible.ok()) {
    LOG(WARNING) << "rejected registration of '" << request->worker_name() << "' from "
                 << context->peer() << ": " << compatible;
    return ToGrpcStatus(compatible);
  }
  if (absl::Status coordinator = CoordinatorOnly(config_); !coordinator.ok()) {
    return ToGrpcStatus(coordinator);
  }
  if (absl::Status model = CheckDeclaredModel(*request); !model.ok()) {
    LOG(WARNING) << "rejected registration of '" << request->worker_name() << "' from "
                 << context->peer() << ": " << model;
    return ToGrpcStatus(model);
  }
  auto registered = membership_->Register(*request);
  if (!registered.ok()) {
    LOG(WARNING) << "rejected registration of '" << request->worker_name() << "' from "
                 << context->peer() << ": " << registered.status();
    return ToGrpcStatus(registered.status());
  }
  *response = *std::move(registered);
  response->set_server_version(ProjectVersion());
  if (job_.sharding().groups() > 1) {
    *response->mutable_range_addresses() = config_.shard().group_addresses();
  }
  if (response->has_slot()) {
    tracker_->SetOwner(response->slot(), request->worker_name());
    tracker_->SetLive(response->slot(), true);
  }
  if (response->role() == SPARE && request->audits()) auditor_.AddAuditor(response->incarnation());
  LOG(INFO) << "registered '" << request->worker_name() << "' as "
            << WorkerRole_Name(response->role()) << " incarnation " << response->incarnation()
            << (response->has_slot() ? " slot " + SlotName(response->slot()) : std::string());
  return grpc::Status::OK;
}

absl::Status ParameterServerService::CheckDeclaredModel(const RegisterRequest& request) {
  const bool declared_job = job_.model().declared_by_worker();
  if (!request.has_model()) {
    if (!declared_job) return absl::OkStatus();  // rebound_worker builds the job's MLP spec
    return absl::FailedPreconditionError(
        "this job trains a model its workers declare (model.declared_by_worker): register with "
        "the model's tensors (RegisterRequest.model; the Python client does, docs/python.md); "
        "rebound_worker trains only a model spec with layers");
  }
  absl::MutexLock lock(&model_mu_);
  if (centers_->num_stages() > 0) {
    const std::string fixed_by =
        !declared_job ? "the job's model spec"
        : model_declared_by_.empty()
            ? "the first registration, stored in the data directory"
            : absl::StrCat("the first registration, of '", model_declared_by_, "'");
    return centers_->CheckModel(request.model(), fixed_by);
  }
  // The first declaration: check it, make it durable (the center at version 0: its tensors'
  // names, shapes and initial values, which a restarted server declares the model from; a
  // sharded job's under CenterTable::kDeclarationStage, its stage 0 being range 0), then fix it.
  ASSIGN_OR_RETURN(const compute::StageLayout layout,
                   compute::StageLayout::FromDeclared(request.model()));
  RETURN_IF_ERROR(compute::ValidateBundle(layout, request.model(), "model"));
  if (job_.sharding().groups() > 1 && layout.packed_size() < job_.sharding().groups()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the declared model has ", layout.packed_size(), " parameters, fewer than the job's ",
        job_.sharding().groups(), " server groups (sharding.groups): a range would be empty"));
  }
  CenterRecord center;
  center.set_stage(job_.sharding().groups() > 1 ? CenterTable::kDeclarationStage : 0);
  center.set_version(0);
  *center.mutable_params() = request.model();
  storage::WriteBatch batch;
  batch.PutCenter(center);
  RETURN_IF_ERROR(store_->Commit(batch));
  RETURN_IF_ERROR(centers_->Declare(request.model()));
  model_declared_by_ = request.worker_name();
  LOG(INFO) << "the job's model was declared by '" << request.worker_name() << "': "
            << layout.tensors().size() << " tensors, " << layout.packed_size() << " parameters";
  return absl::OkStatus();
}

grpc::Status ParameterServerService::Heartbeat(grpc::ServerContext* context,
                                               const HeartbeatRequest* request,
                                               HeartbeatResponse* response) {
  if (absl::Status ready = CheckWorker(context, request->incarnation()); !ready.ok()) {
    return ToGrpcStatus(ready);
  }
  if (absl::Status enums = CheckEnumValues(*request); !enums.ok()) return ToGrpcStatus(enums);
  auto reply = membership_->Heartbeat(*request);
  if (!reply.ok()) return ToGrpcStatus(reply.status());
  *response = *std::move(reply);
  if (response->has_takeover()) {
    recovery_->OnRestartedFromCenter(request->incarnation(), response->takeover());
  }
  for (Command command : auditor_.CommandsFor(request->incarnation())) {
    response->add_commands(command);
  }
  // The job is over, but a mismatch found is decided first: an auditing spare stays for it.
  auto& commands = *response->mutable_commands();
  auto stop = std::find(commands.begin(), commands.end(), STOP);
  if (stop != commands.end() && auditor_.HoldsAtJobEnd(request->incarnation())) {
    commands.erase(stop);
  }
  return grpc::Status::OK;
}

grpc::Status ParameterServerService::Deregister(grpc::ServerContext* context,
                                                const DeregisterRequest* request,
                                                DeregisterResponse* response) {
  if (absl::Status ready = CheckWorker(context, request->incarnation()); !ready.ok()) {
    return ToGrpcStatus(ready);
  }
  if (absl::Status enums = CheckEnumValues(*request); !enums.ok()) return ToGrpcStatus(enums);
  absl::Status status = membership_->Deregister(request->incarnation(), request->drained());
  if (status.ok()) {
    LOG(INFO) << "incarnation " << request->incarnation()
              << (request->drained() ? " drained" : " deregistered");
  }
  return ToGrpcStatus(status);
}

grpc::Status ParameterServerService::Sync(grpc::ServerContext* context, const SyncRequest* request,
                                          SyncResponse* response) {
  if (absl::Status ready = CheckWorker(context, request->incarnation()); !ready.ok()) {
    return ToGrpcStatus(ready);
  }
  if (absl::Status enums = CheckEnumValues(*request); !enums.ok()) return ToGrpcStatus(enums);
  auto admitted = inflight_.Enter(static_cast<int64_t>(request->ByteSizeLong()));
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  if (job_.easgd().mode() != EASGD) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        "this job runs mode ASYNC_ADAHESSIAN: trainers Push and Pull, they do not Sync"));
  }
  if (absl::Status unsharded = UnshardedOnly(job_, "Sync"); !unsharded.ok()) {
    return ToGrpcStatus(unsharded);
  }
  const SlotId slot = Normalized(request->slot());
  if (absl::Status valid = ValidateSlot(slot); !valid.ok()) return ToGrpcStatus(valid);
  if (absl::Status owner = membership_->CheckOwner(request->incarnation(), slot); !owner.ok()) {
    return ToGrpcStatus(owner);
  }
  return ToGrpcStatus(applier_->Sync(slot, *request, response));
}

grpc::Status ParameterServerService::Push(grpc::ServerContext* context, const PushRequest* request,
                                          PushResponse* response) {
  if (absl::Status ready = CheckWorker(context, request->incarnation()); !ready.ok()) {
    return ToGrpcStatus(ready);
  }
  if (absl::Status enums = CheckEnumValues(*request); !enums.ok()) return ToGrpcStatus(enums);
  auto admitted = inflight_.Enter(static_cast<int64_t>(request->ByteSizeLong()));
  if (!admitted.ok()) return ToGrpcStatus(admitted.status());
  if (job_.easgd().mode() != ASYNC_ADAHESSIAN) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        "this job runs mode EASGD: trainers Sync, they do not Push"));
  }
  if (absl::Status unsharded = UnshardedOnly(job_, "Push"); !unsharded.ok()) {
    return ToGrpcStatus(unsharded);
  }
  const SlotId slot = Normalized(request->slot());
  if (absl::Status valid = ValidateSlot(slot); !valid.ok()) return ToGrpcStatus(valid);
  if (absl::Status owner = membership_->CheckOwner(request->incarnation(), slot); !owner.ok()) {
    return ToGrpcStatus(owner);
  }
  return ToGrpcStatus(applier_->Push(slot, *request, response));
}

grpc::Status ParameterServerService::Pull(grpc::ServerContext* context, const PullRequest* request,
                                          PullResponse* response) {
  if (absl::Status ready = CheckWorker(context, request->incarnation()); !ready.ok()) {
    return ToGrpcStatus(ready);
  }
  if (absl::Status enums = CheckEnumValues(*request); !enums.ok()) return ToGrpcStatus(enums);
  if (absl::Status alive = membership_->CheckAlive(request->incarnation()); !alive.ok()) {
    return ToGrpcStatus(alive);
  }
  if (absl::Status unsharded = UnshardedOnly(job_, "Pull"); !unsharded.ok()) {
    return ToGrpcStatus(unsharded);
  }
  const int stage = request->stage();
  if (stage < 0 || stage >= centers_->num_stages()) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("stage ", stage, " is outside [0, ", centers_->num_stages(), ")")));
  }
  if (request->min_version() > 0) {
    // A version no job can reach would park a thread for max_wait_ms for nothing.
    const int64_t version = centers_->version(stage);
    if (request->min_version() > ReachableVersion(job_, version)) {
      return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
          "min_version ", request->min_version(), " is beyond any version this job can reach (",
          ReachableVersion(job_, version), " = the center's version ", version,
          " + replicas x max_steps)")));
    }
    if (request->min_version() > version) {
      auto parked = parked_.Enter();
      if (!parked.ok()) return ToGrpcStatus(parked.status());
      centers_->WaitForVersion(stage, request->min_version(),
                               absl::Milliseconds(config_.max_wait_ms()));
    }
  }
  auto read = centers_->Read(stage);
  if (!read.ok()) return ToGrpcStatus(read.status());
  const auto& [center, version] = *read;
  *response->mutable_center() = centers_->Bundle(stage, center);
  response->set_center_version(version);
  return grpc::Status::OK;
}

absl::Status ParameterServerService::ValidateEval(const ReportEvalRequest& request) const {
  if (request.stage() < 0 || request.stage() >= centers_->num_stages()) {
    return absl::InvalidArgumentError(absl::StrCat("stage must be in [0, ", centers_->num_stages(),
                                                   "), got ", request.stage()));
  }
  const int64_t current = centers_->version(request.stage());
  if (request.center_version() < 0 || request.center_version() > current) {
    return absl::InvalidArgumentError(absl::StrCat("center_version must be in [0, ", current,
                                                   "] (the stage's current version), got ",
                                                   request.center_version()));
  }
  if (!std::isfinite(request.test_loss())) {
    return absl::InvalidArgumentError(
        absl::StrCat("test_loss must be finite, got ", request.test_loss()));
  }
  // Absent for a job without class-index targets (a regression: docs/python.md); then the
  // status has no accuracy either.
  if (request.has_test_accuracy() &&
      !(request.test_accuracy() >= 0.0 && request.test_accuracy() <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("test_accuracy must be in [0, 1], got ", request.test_accuracy()));
  }
  return absl::OkStatus();
}

grpc::Status ParameterServerService::ReportEval(grpc::ServerContext* context,
                                                const ReportEvalRequest* request,
                                                ReportEvalResponse* response) {
  if (absl::Status ready = CheckWorker(context, request->incarnation()); !ready.ok()) {
    return ToGrpcStatus(ready);
  }
  if (absl::Status enums = CheckEnumValues(*request); !enums.ok()) return ToGrpcStatus(enums);
  if (absl::Status evaluator = membership_->CheckRole(request->incarnation(), EVALUATOR);
      !evaluator.ok()) {
    return ToGrpcStatus(evaluator);
  }
  if (absl::Status valid = ValidateEval(*request); !valid.ok()) return ToGrpcStatus(valid);
  absl::MutexLock lock(&eval_mu_);
  has_eval_ = true;
  last_eval_ = *request;
  last_eval_time_ = clock_->Now();
  return grpc::Status::OK;
}

grpc::Status ParameterServerService::GetStatus(grpc::ServerContext* context,
                                               const GetStatusRequest* request,
                                               GetStatusResponse* response) {
  if (absl::Status allowed = token_.Check(context); !allowed.ok()) return ToGrpcStatus(allowed);
  const absl::Time now = clock_->Now();
  response->set_job_id(job_.job_id());
  response->set_server_version(VersionLine());
  response->set_uptime_ms(absl::ToInt64Milliseconds(now - started_));
  response->set_replicas(job_.topology().replicas());
  response->set_stages(job_.topology().stages());
  response->set_weighting(job_.weighting().policy());
  response->set_recovery_policy(EffectiveRecoveryPolicy(job_));
  membership_->FillStatus(response);
  for (SlotStatus& slot : *response->mutable_slots()) {
    *slot.mutable_weight() = tracker_->Current(slot.slot(), now);
    // Durable books only, as the centers' durable versions: nothing a crash can take back.
    const SlotBook book = books_.Durable(slot.slot());
    slot.set_snapshot_step(book.last_update_step);
    slot.set_update_count(book.update_count);
    slot.set_refused_updates(books_.Refused(slot.slot()));
    slot.set_logged_step(step_log_->LoggedStep(slot.slot()));
  }
  for (WorkerStatus& worker : *response->mutable_workers()) {
    worker.set_fault_score(tracker_->FaultScore(worker.name(), now));
  }
  const StepLogStats log = step_log_->stats();
  response->mutable_step_log()->set_records_written(log.records_written);
  response->mutable_step_log()->set_bytes_written(log.bytes_written);
  response->mutable_step_log()->set_duplicates_dropped(log.duplicates_dropped);
  response->mutable_step_log()->set_below_snapshot_dropped(log.below_snapshot_dropped);
  for (RecoveryStatus& recovery : membership_->Recoveries()) {
    *response->add_recoveries() = std::move(recovery);
  }
  for (int s = 0; s < centers_->num_stages(); ++s) {
    CenterStatus* center = response->add_centers();
    center->set_stage(s);
    center->set_version(centers_->version(s));
    center->set_parameter_count(centers_->layout(s).packed_size());
    center->set_max_abs_value(centers_->max_abs_seen(s));
    center->set_max_divergence_ratio(books_.MaxDivergenceRatio(s));
  }
  absl::MutexLock lock(&eval_mu_);
  if (has_eval_) {
    EvalStatus* eval = response->mutable_last_eval();
    eval->set_center_version(last_eval_.center_version());
    eval->set_test_loss(last_eval_.test_loss());
    if (last_eval_.has_test_accuracy()) eval->set_test_accuracy(last_eval_.test_accuracy());
    eval->set_reported_ms_ago(absl::ToInt64Milliseconds(now - last_eval_time_));
  }
  recovery_->FillStatus(response);
  auditor_.FillStatus(response);
  if (store_ != nullptr) {
    if (absl::Status storage = store_->BackgroundError(); !storage.ok()) {
      response->set_storage_error(storage.ToString());
    }
  }
  {
    absl::MutexLock lock(&metrics_mu_);
    if (!metrics_address_.empty()) response->set_metrics_address(metrics_address_);
  }
  // GetStatus is answered while the server loads its state, before main sets these two and
  // MarkReady publishes them: read them only once ready (TSan saw the write race a status
  // poll that came early).
  if (ready_.load(std::memory_order_acquire)) {
    if (group_status_) group_status_(response->mutable_group());
    if (sharding_status_) sharding_status_(response->mutable_sharding());
  }
  return grpc::Status::OK;
}

grpc::Status ParameterServerService::AppendLog(
    grpc::ServerContext* context, grpc::ServerReaderWriter<AppendLogAck, AppendLogRequest>* stream) {
  return ServeAppendLog(context, stream);
}

grpc::Status ParameterServerService::ServeAppendLog(
    grpc::ServerContext* context,
    grpc::ServerReaderWriterInterface<AppendLogAck, AppendLogRequest>* stream) {
  if (absl::Status ready = CheckCall(context); !ready.ok()) return ToGrpcStatus(ready);
  return step_log_->HandleAppendLog(context, stream);
}

namespace {
// How often a spare's long poll looks for an audit that became ready (WaitForTask).
constexpr absl::Duration kAuditSlice = absl::Milliseconds(50);
}  // namespace

grpc::Status ParameterServerService::WaitForTask(grpc::ServerContext* context,
                                                 const WaitForTaskRequest* request,
                                                 WaitForTaskResponse* response) {
  if (absl::Status ready = CheckWorker(context, request->incarnation()); !ready.ok()) {
    return ToGrpcStatus(ready);
  }
  if (absl::Status enums = CheckEnumValues(*request); !enums.ok()) return ToGrpcStatus(enums);
  const absl::Duration wait =
      absl::Milliseconds(std::clamp(request->wait_ms(), 0, config_.max_wait_ms()));
  std::optional<CallGate::Pass> parked;
  if (wait > absl::ZeroDuration()) {
    auto entered = parked_.Enter();
    if (!entered.ok()) return ToGrpcStatus(entered.status());
    parked.emplace(*std::move(entered));
  }
  // With audits, the wait is cut in slices: between two, an audit that became ready (and no slot
  // LOST: Claim checks) is handed out, so that a window waits a slice, not a whole long poll.
  // A recovery is looked for in every slice, and first.
  const absl::Time until = absl::Now() + wait;
  while (true) {
    const absl::Duration left = std::max(absl::ZeroDuration(), until - absl::Now());
    auto task = recovery_->NextTask(request->incarnation(),
                                    auditor_.enabled() ? std::min(left, kAuditSlice) : left);
    if (!task.ok()) return ToGrpcStatus(task.status());
    if (task->has_value()) {
      *response->mutable_task() = **std::move(task);
      return grpc::Status::OK;
    }
    auto audit = auditor_.Claim(request->incarnation());
    if (!audit.ok()) return ToGrpcStatus(audit.status());
    if (audit->has_value()) {
      *response->mutable_task() = **std::move(audit);
      return grpc::Status::OK;
    }
    if (left <= absl::ZeroDuration() || !auditor_.enabled()) return grpc::Status::OK;
  }
}

grpc::Status ParameterServerService::ReportAudit(grpc::ServerContext* context,
                                                 const ReportAuditRequest* request,
                                                 ReportAuditResponse* response) {
  if (absl::Status ready = CheckWorker(context, request->incarnation()); !ready.ok()) {
    return ToGrpcStatus(ready);
  }
  if (absl::Status enums = CheckEnumValues(*request); !enums.ok()) return ToGrpcStatus(enums);
  if (absl::Status spare = membership_->CheckSpare(request->incarnation()); !spare.ok()) {
    return ToGrpcStatus(spare);
  }
  return ToGrpcStatus(auditor_.Finish(*request));
}

grpc::Status ParameterServerService::ReadLog(grpc::ServerContext* context,
                                             const ReadLogRequest* request,
                                             grpc::ServerWriter<LogRecord>* writer) {
  return ServeReadLog(context, request, writer);
}

grpc::Status ParameterServerService::ServeReadLog(grpc::ServerContext* context,
                                                  const ReadLogRequest* request,
                                                  grpc::ServerWriterInterface<LogRecord>* writer) {
  if (absl::Status ready = CheckWorker(context, request->incarnation()); !ready.ok()) {
    return ToGrpcStatus(ready);
  }
  if (absl::Status enums = CheckEnumValues(*request); !enums.ok()) return ToGrpcStatus(enums);
  auto slot = (request->task_id() & Auditor::kAuditIdBit) != 0
                  ? auditor_.AuditSlot(request->task_id(), request->incarnation())
                  : recovery_->TaskSlot(request->task_id(), request->incarnation());
  if (!slot.ok()) return ToGrpcStatus(slot.status());
  SlotId read = Normalized(*slot);
  if (request->has_slot()) {
    // Another member of the task's recovery group: the pairs logged at the group's edges.
    const auto [first, end] = RecoveryGroup(job_, read.stage());
    const SlotId asked = Normalized(request->slot());
    if (asked.replica() != read.replica() || asked.stage() < first || asked.stage() >= end) {
      return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
          "replay task ", request->task_id(), " of slot ", SlotName(read), " reads the log of ",
          "its recovery group, stages [", first, ", ", end, ") of replica ", read.replica(),
          ", not slot ", SlotName(asked))));
    }
    read = asked;
  }
  return step_log_->HandleReadLog(context, *request, read, writer);
}

grpc::Status ParameterServerService::ReportRecovery(grpc::ServerContext* context,
                                                    const ReportRecoveryRequest* request,
                                                    ReportRecoveryResponse* response) {
  if (absl::Status ready = CheckWorker(context, request->incarnation()); !ready.ok()) {
    return ToGrpcStatus(ready);
  }
  if (absl::Status enums = CheckEnumValues(*request); !enums.ok()) return ToGrpcStatus(enums);
  auto finished = recovery_->Finish(*request);
  if (!finished.ok()) return ToGrpcStatus(finished.status());
  if (!finished->has_value()) return grpc::Status::OK;
  const RegisterResponse& takeover = **finished;
  response->set_incarnation(takeover.incarnation());
  *response->mutable_slot() = takeover.slot();
  *response->mutable_neighbours() = takeover.neighbours();
  return grpc::Status::OK;
}

grpc::Status ParameterServerService::Drain(grpc::ServerContext* context, const DrainRequest* request,
                                           DrainResponse* response) {
  if (absl::Status allowed = CheckOperator(context); !allowed.ok()) return ToGrpcStatus(allowed);
  if (absl::Status enums = CheckEnumValues(*request); !enums.ok()) return ToGrpcStatus(enums);
  auto drained = membership_->Drain(Normalized(request->slot()));
  if (!drained.ok()) return ToGrpcStatus(drained.status());
  response->set_incarnation(*drained);
  LOG(WARNING) << "draining slot " << SlotName(request->slot()) << ": its trainer (incarnation "
               << *drained << ") leaves after its next sync";
  return grpc::Status::OK;
}

absl::StatusOr<AuthorizeRangeResponse> ParameterServerService::Authorize(
    const grpc::ServerContext* context, const AuthorizeRangeRequest& request) {
  RETURN_IF_ERROR(CheckWorker(context, request.incarnation()));
  return range_authority_->Authorize(request);
}

grpc::Status ParameterServerService::AuthorizeRange(grpc::ServerContext* context,
                                                    const AuthorizeRangeRequest* request,
                                                    AuthorizeRangeResponse* response) {
  absl::StatusOr<AuthorizeRangeResponse> allowed = Authorize(context, *request);
  if (!allowed.ok()) return ToGrpcStatus(allowed.status());
  *response = *std::move(allowed);
  return grpc::Status::OK;
}

grpc::Status ParameterServerService::CommitSync(grpc::ServerContext* context,
                                                const CommitSyncRequest* request,
                                                CommitSyncResponse* response) {
  if (absl::Status ok = CheckWorker(context, request->incarnation()); !ok.ok()) {
    return ToGrpcStatus(ok);
  }
  if (absl::Status enums = CheckEnumValues(*request); !enums.ok()) return ToGrpcStatus(enums);
  if (job_.sharding().groups() <= 1 || config_.shard().group() != 0 ||
      job_.easgd().mode() != EASGD) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        "CommitSync is for a sharded EASGD job's group 0; an unsharded job's trainers Sync"));
  }
  const SlotId slot = Normalized(request->slot());
  if (absl::Status ok = ValidateSlot(slot); !ok.ok()) return ToGrpcStatus(ok);
  if (absl::Status ok = membership_->CheckOwner(request->incarnation(), slot); !ok.ok()) {
    return ToGrpcStatus(ok);
  }
  if (!range_check_) {
    return ToGrpcStatus(absl::FailedPreconditionError("this server cannot check its ranges"));
  }
  return ToGrpcStatus(applier_->CommitSync(slot, *request, range_check_, response));
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
  if (!push_check_) {
    return ToGrpcStatus(absl::FailedPreconditionError("this server cannot check its ranges"));
  }
  return ToGrpcStatus(applier_->CommitPush(slot, *request, push_check_, response));
}

}  // namespace rebound::server
