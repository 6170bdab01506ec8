#include "worker/easgd_trainer.h"

#include <glog/logging.h>

#include <csignal>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/retry.h"
#include "common/slot.h"
#include "common/status_macros.h"
#include "compute/adahessian.h"
#include "compute/tensor_bundle.h"
#include "worker/center_client.h"
#include "worker/retry.h"
#include "worker/worker_metrics.h"

namespace rebound::worker {

EasgdTrainer::EasgdTrainer(const WorkerConfig& config, const Registration& registration,
                           std::shared_ptr<grpc::Channel> channel, WorkerAgent* agent,
                           const absl::Notification& stop, const Clock* clock,
                           const InjectedFaults& faults, SlotCompute* compute, bool replayed,
                           PipelinePort* port)
    : config_(config),
      registration_(registration),
      job_(registration.job),
      slot_(registration.slot),
      channel_(std::move(channel)),
      agent_(agent),
      stop_(stop),
      clock_(clock),
      faults_(faults),
      compute_(compute),
      replayed_(replayed),
      port_(port),
      max_steps_(registration.job.training().max_steps()),
      tau_(registration.job.easgd().sync_period()),
      stub_(ParameterServer::NewStub(channel_)),
      progress_(SlotName(slot_), max_steps_, registration.job.data().batch_size(),
                absl::Seconds(config.progress_interval_s()), clock) {
  const size_t n = compute_->trainer->stage(0).layout().packed_size();
  x_.resize(n);
  m_.resize(n);
  v_.resize(n);
  d_.resize(n);
}

EasgdTrainer::~EasgdTrainer() {
  if (!hooks_set_) return;
  agent_->SetFlushHook(nullptr);
  if (port_ != nullptr) port_->SetFlush(nullptr);
}

absl::Status EasgdTrainer::Open() {
  // The step log (docs/design.md §5.2): per step, the sample ids of each micro-batch and the checksum of
  // the parameters after the step, shipped asynchronously from a bounded buffer. Only REPLAY reads
  // it: under the other policies nothing is logged.
  if (job_.step_log().enabled() && EffectiveRecoveryPolicy(job_) == REPLAY) {
    step_logger_ =
        std::make_shared<StepLogger>(channel_, registration_.incarnation, job_.step_log(),
                                                config_, clock_);
  }
  if (job_.topology().stages() <= 1) return absl::OkStatus();
  // Pipelines: the boundary exchange with the neighbouring stages, and a flush of the log on the
  // server's FLUSH_LOG or a neighbour's FlushLog (a lost neighbour's inputs may sit in it).
  hooks_set_ = true;
  PipelineExchange::LogFn log_fn;
  if (step_logger_ != nullptr) {
    log_fn = [this](const std::vector<LogRecord>& records) { return AppendToLog(records); };
  }
  ASSIGN_OR_RETURN(pipeline_, PipelineExchange::Create(config_, registration_, agent_, port_,
                                                       stop_, clock_, std::move(log_fn)));
  if (step_logger_ != nullptr) {
    std::weak_ptr<StepLogger> weak = step_logger_;
    auto flush = [weak](absl::Duration timeout) -> absl::Status {
      std::shared_ptr<StepLogger> logger = weak.lock();
      return logger == nullptr ? absl::OkStatus() : logger->Flush(timeout);
    };
    agent_->SetFlushHook(flush);
    port_->SetFlush(flush);
  }
  return absl::OkStatus();
}

absl::Status EasgdTrainer::Start() {
  const int64_t start = registration_.start_step;
  if (start > 0 && !replayed_) {
    compute::MlpStage& stage = compute_->trainer->stage(0);
    const compute::StageLayout& layout = stage.layout();
    ASSIGN_OR_RETURN(const PullResponse center,
                     registration_.center->Pull(stop_, stub_.get(), registration_.incarnation,
                                                slot_.stage(), layout));
    RETURN_IF_ERROR(stage.SetParams(compute::PackedFromBundle(layout, center.center())));
    RETURN_IF_ERROR(compute_->SeekAfter(start));
    LOG(INFO) << "restarting slot " << SlotName(slot_) << " from the center (version "
              << center.center_version() << ") at step " << start;
  }
  LOG(INFO) << "training slot " << SlotName(slot_) << " on "
            << compute_->sampler->shard().size() << " samples for steps " << start + 1 << ".."
            << max_steps_ << ", sync every " << tau_;
  label_map_ = InjectedLabelMap(faults_);
  if (replayed_ && start > 0 && (start % tau_ == 0 || start == max_steps_)) {
    // The lost trainer had done step `start` but its sync was not applied: do it now.
    RETURN_IF_ERROR(Sync(start, std::nanf("")));
  }
  return absl::OkStatus();
}

absl::StatusOr<float> EasgdTrainer::TrainStep(int64_t t, absl::Span<const int64_t> ids) {
  const absl::Time step_start = clock_->Now();
  float loss = 0;
  if (pipeline_ != nullptr) {
    ASSIGN_OR_RETURN(loss, pipeline_->Step(t, ids, label_map_, compute_));
  } else {
    ASSIGN_OR_RETURN(loss, compute_->Step(t, ids, label_map_));
  }
  Metrics().step_seconds->ObserveDuration(clock_->Now() - step_start);
  Metrics().steps->Increment();
  Metrics().step->Set(static_cast<double>(t));
  // Only the last stage of a pipeline computes the loss; the others report none (NaN).
  const bool has_loss = pipeline_ == nullptr || compute_->trainer->ends_at_loss();
  if (has_loss) Metrics().loss->Set(loss);
  if (has_loss && !std::isfinite(loss)) {
    return absl::InternalError(absl::StrCat("the loss of step ", t, " is not finite"));
  }
  return loss;
}

absl::Status EasgdTrainer::LogStep(int64_t t, absl::Span<const int64_t> ids) {
  if (step_logger_ == nullptr) return absl::OkStatus();
  const int micro_batches = job_.data().micro_batches();
  const size_t per = ids.size() / micro_batches;  // micro-batch k = rows [k B/M, (k+1) B/M)
  std::vector<LogRecord> records;
  records.reserve(micro_batches + 1);
  // The sample ids are stage 0's own input; later stages find them in the boundary records
  // their neighbours log (docs/design.md §5.2).
  for (int k = 0; k < micro_batches && slot_.stage() == 0; ++k) {
    records.push_back(MakeMicroBatchRecord(slot_, t, k, ids.subspan(k * per, per)));
  }
  const compute::MlpStage& stage = compute_->trainer->stage(0);
  ASSIGN_OR_RETURN(const uint64_t checksum, stage.ParamsChecksum());
  // A job with audits also logs each tensor's checksum, so that an audit's mismatch names the
  // tensor (docs/recovery.md#audits); without audits nobody reads them, and they cost nothing.
  std::vector<uint64_t> tensor_checksums;
  if (job_.audit().fraction() > 0) {
    ASSIGN_OR_RETURN(tensor_checksums, stage.TensorChecksums());
  }
  records.push_back(MakeStepRecord(slot_, t, checksum, tensor_checksums));
  Metrics().log_records->Increment(static_cast<double>(records.size()));
  RETURN_IF_ERROR(AppendToLog(std::move(records)));
  Metrics().log_buffered_bytes->Set(static_cast<double>(step_logger_->stats().pending_bytes));
  return absl::OkStatus();
}

void EasgdTrainer::DieAfterLogged(int64_t t) {
  const absl::Status flushed = step_logger_ == nullptr
                                   ? absl::OkStatus()
                                   : step_logger_->Flush(absl::Milliseconds(config_.rpc_deadline_ms()));
  LOG(ERROR) << "fault injection: step " << t << " logged (" << flushed << "); dying";
  raise(SIGKILL);
}

absl::Status EasgdTrainer::AppendToLog(std::vector<LogRecord> records) {
  // The common case: room in the buffer, one call, no copy. AppendAll itself waits up to a
  // second for room.
  absl::Status status = step_logger_->AppendAll(&records, absl::Seconds(1));
  if (status.code() != absl::StatusCode::kUnavailable) return status;
  // The buffer stayed full (the server is slow or away): keep trying, with no backoff to speak
  // of between attempts, until give_up_after_ms. Only UNAVAILABLE is retried; the logger's
  // other errors are final. A refused AppendAll leaves the records in `records`.
  RetryPolicy policy;
  policy.initial_backoff = absl::Milliseconds(1);
  policy.max_backoff = absl::Milliseconds(1);
  policy.give_up_after = absl::Milliseconds(config_.give_up_after_ms());
  RetryLoop retry(policy, clock_, &stop_, "append to the step log (buffer full)");
  while (retry.ShouldRetry(&status)) status = step_logger_->AppendAll(&records, absl::Seconds(1));
  return status;
}

absl::Status EasgdTrainer::Sync(int64_t t, float loss) {
  compute::MlpStage& stage = compute_->trainer->stage(0);
  const compute::StageLayout& layout = stage.layout();
  RETURN_IF_ERROR(stage.GetParams(absl::MakeSpan(x_)));
  RETURN_IF_ERROR(compute_->trainer->optimizer(0).GetState(
      absl::MakeSpan(m_), absl::MakeSpan(v_), absl::MakeSpan(d_)));
  CenterClient::SyncState state;
  state.x = absl::MakeSpan(x_);
  state.m = m_;
  state.v = v_;
  state.d = d_;
  state.loss = loss;
  state.data_epoch = compute_->sampler->cursor().epoch;
  state.data_offset = compute_->sampler->cursor().offset;
  std::vector<float> poisoned;
  if (faults_.poison_from_step > 0 && t >= faults_.poison_from_step) {
    poisoned = x_;
    MaybePoison(faults_, t, &poisoned);
    state.sent = poisoned;
  }
  const bool die = faults_.die_in_sync_at_step > 0 && t == faults_.die_in_sync_at_step;
  // This role's incarnation, not the agent's current one: once the agent has registered again
  // (a rollback, a server restart), this trainer's syncs must be refused as its own, not be
  // sent under the new spare's name.
  absl::StatusOr<CenterClient::Synced> synced;
  {
    ScopedLatency timed(Metrics().sync_seconds);
    synced = registration_.center->Sync(
        stop_, stub_.get(), registration_.incarnation, slot_, t, layout, state,
        die ? faults_.die_in_sync_ranges : CenterClient::kAllRanges);
  }
  if (die) {
    LOG(ERROR) << "fault injection: synced step " << t << " to ranges [0, "
               << faults_.die_in_sync_ranges << ") only; dying before the commit";
    raise(SIGKILL);
  }
  RETURN_IF_ERROR(RefusedUpdate("sync", t, synced.status()));
  Metrics().syncs->Increment();
  Metrics().weight->Set(synced->weight);
  last_weight_ = synced->weight;
  RETURN_IF_ERROR(stage.SetParams(x_));
  if (agent_->drain_requested()) agent_->MarkDrained();
  VLOG(1) << "synced step " << t << " loss " << loss << " weight " << synced->weight
          << " center version " << synced->center_version;
  return absl::OkStatus();
}

void EasgdTrainer::Finish() {
  if (step_logger_ != nullptr) {
    absl::Status flushed = step_logger_->Flush(absl::Milliseconds(config_.rpc_deadline_ms()));
    if (!flushed.ok()) LOG(WARNING) << "step log not flushed at the end: " << flushed;
  }
  if (pipeline_ != nullptr) {
    // The other stages may still need this one's last pairs (a neighbour rebuilt near the end):
    // stay until the job ends (every slot FINISHED) or give_up_after_ms.
    LOG(INFO) << "finished " << max_steps_ << " steps; serving the last pairs until the job ends";
    pipeline_->Linger(stop_);
  }
  LOG(INFO) << "finished " << max_steps_ << " steps";
}

absl::Status EasgdTrainer::Run() {
  RETURN_IF_ERROR(Open());
  RETURN_IF_ERROR(Start());
  for (int64_t t = registration_.start_step + 1; t <= max_steps_; ++t) {
    if (stop_.HasBeenNotified()) return absl::CancelledError("stopped");
    RETURN_IF_ERROR(MaybeResetFromScratch(faults_, t, job_, slot_, &resets_,
                                          compute_->trainer.get()));
    const std::vector<int64_t> ids = compute_->sampler->NextBatch();
    ASSIGN_OR_RETURN(const float loss, TrainStep(t, ids));
    // --fault_flip_bit_at_step: after the step's update, before its checksum is logged.
    RETURN_IF_ERROR(MaybeFlipBit(faults_, t, &compute_->trainer->stage(0)).status());
    agent_->set_progress(t, loss);
    // The loss a pipeline's inner stage does not compute is NaN: "-" in the line.
    progress_.Step(t, loss, last_weight_);
    RETURN_IF_ERROR(LogStep(t, ids));
    if (faults_.die_after_logged_step > 0 && t == faults_.die_after_logged_step) {
      DieAfterLogged(t);
    }
    if (pipeline_ != nullptr) pipeline_->Complete(t);
    if (t % tau_ != 0 && t != max_steps_) continue;
    RETURN_IF_ERROR(Sync(t, loss));
    if (agent_->drained()) {
      // DRAIN: the slot's state is the snapshot of this sync; a spare takes it from there.
      LOG(WARNING) << "drained: synced step " << t << "; leaving slot " << SlotName(slot_);
      return absl::OkStatus();
    }
  }
  Finish();
  return absl::OkStatus();
}

}  // namespace rebound::worker
