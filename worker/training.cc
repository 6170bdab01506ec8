#include "worker/training.h"

#include <glog/logging.h>

#include <chrono>
#include <cmath>
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/backoff.h"
#include "common/checksum.h"
#include "common/config.h"
#include "common/rng.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "compute/adahessian.h"
#include "compute/backend_factory.h"
#include "compute/step.h"
#include "compute/tensor_bundle.h"
#include "worker/data/dataset.h"
#include "worker/data/fashion_mnist.h"
#include "worker/data/shard_sampler.h"
#include "worker/pipeline.h"
#include "worker/pipeline_port.h"
#include "worker/retry.h"
#include "worker/step_logger.h"
#include "worker/worker_metrics.h"

namespace rebound::worker {
namespace {

// Fault injection, a byzantine trainer: from step faults.poison_from_step on, `values` become
// +value, -value, +value, ... (returns whether it did).
bool MaybePoison(const InjectedFaults& faults, int64_t t, std::vector<float>* values) {
  if (faults.poison_from_step <= 0 || t < faults.poison_from_step) return false;
  for (size_t i = 0; i < values->size(); ++i) {
    (*values)[i] = i % 2 == 0 ? faults.poison_value : -faults.poison_value;
  }
  LOG(WARNING) << "FAULT INJECTION: poisoned update at step " << t << " (every value +-"
               << faults.poison_value << ")";
  return true;
}

// The trainer's end when the server refuses its update as invalid (malformed, non-finite, or
// breaking the center's integrity): retrying would send the same state again, so it stops.
absl::Status RefusedUpdate(const char* what, int64_t t, const absl::Status& status) {
  if (status.code() != absl::StatusCode::kInvalidArgument) return status;
  LOG(ERROR) << "the server refused this trainer's " << what << " of step " << t
             << " as invalid; this trainer cannot go on and exits: " << status.message();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " of step ", t, " refused: ", status.message()));
}

// The model of slot `slot`: its stage's layers (the whole model when S = 1), or those of stages
// [first_stage, end_stage) of its replica, split as the job splits them.
compute::TrainerOptions OptionsFor(const JobConfig& job, const SlotId& slot, int first_stage = -1,
                                   int end_stage = -1) {
  compute::TrainerOptions options;
  options.model = job.model();
  options.optimizer = job.adahessian();
  options.batch_size = job.data().batch_size();
  options.micro_batches = job.data().micro_batches();
  options.seed = job.data().seed();
  options.replica = static_cast<uint32_t>(slot.replica());
  if (job.topology().stages() > 1) {
    const std::vector<int> starts = StageLayerStarts(job);
    if (first_stage < 0) {
      first_stage = slot.stage();
      end_stage = slot.stage() + 1;
    }
    options.first_layer = starts[first_stage];
    options.end_layer = starts[end_stage];
    options.stage_boundaries.assign(starts.begin() + first_stage + 1, starts.begin() + end_stage);
  }
  return options;
}

// Pulls the center of stage `stage_index` (retried like every call) and checks that it holds
// exactly the tensors of `layout`.
absl::StatusOr<PullResponse> PullCenter(const WorkerConfig& config, const absl::Notification& stop,
                                        ParameterServer::Stub* stub, uint64_t incarnation,
                                        int stage_index, const compute::StageLayout& layout) {
  PullRequest pull;
  pull.set_incarnation(incarnation);
  pull.set_stage(stage_index);
  PullResponse center;
  RETURN_IF_ERROR(CallWithRetry(config, stop, "pull", [&](grpc::ClientContext* context) {
    center.Clear();
    return stub->Pull(context, pull, &center);
  }));
  RETURN_IF_ERROR(compute::ValidateBundle(layout, center.center(), "center"));
  return center;
}

// The labels a trainer sees under fault injection: perm[y] for a fixed random permutation of the
// classes; empty (labels unchanged) without it.
std::vector<int32_t> InjectedLabelMap(const InjectedFaults& faults) {
  std::vector<int32_t> label_map;
  if (faults.label_permutation_seed == 0) return label_map;
  label_map.resize(kFashionMnistClasses);
  for (int i = 0; i < kFashionMnistClasses; ++i) label_map[i] = i;
  const RngStream stream{faults.label_permutation_seed, 0, 0, 0, kRngShuffle};
  for (int i = kFashionMnistClasses - 1; i > 0; --i) {
    std::swap(label_map[i], label_map[RngWord(stream, i) % (i + 1)]);
  }
  LOG(WARNING) << "FAULT INJECTION: this trainer's labels are permuted";
  return label_map;
}

// Fault injection, a naive supervisor's restart before step t (when one is due): fresh random
// parameters (the `resets`-th draw of this replica), zero optimizer state.
absl::Status MaybeResetFromScratch(const InjectedFaults& faults, int64_t t, const JobConfig& job,
                                   const SlotId& slot, int64_t* resets,
                                   compute::LocalTrainer* trainer) {
  if (faults.reset_every_steps <= 0 || t <= 1 || (t - 1) % faults.reset_every_steps != 0) {
    return absl::OkStatus();
  }
  const compute::StageLayout& layout = trainer->stage(0).layout();
  ModelSpec fresh = job.model();
  fresh.set_init_seed(job.model().init_seed() + 7919 * (++*resets) + 104729 * slot.replica());
  std::vector<float> padded(layout.padded_size());
  std::vector<float> packed(layout.packed_size());
  RETURN_IF_ERROR(compute::InitParams(fresh, layout, absl::MakeSpan(padded)));
  RETURN_IF_ERROR(layout.Pack(padded, absl::MakeSpan(packed)));
  RETURN_IF_ERROR(trainer->stage(0).SetParams(packed));
  std::fill(packed.begin(), packed.end(), 0.0f);
  RETURN_IF_ERROR(trainer->optimizer(0).SetState(packed, packed, packed));
  LOG(WARNING) << "FAULT INJECTION: restarted from scratch at step " << t;
  return absl::OkStatus();
}

// The trainer of mode ASYNC_ADAHESSIAN (DESIGN §4.6; the contract is RunTrainer's, in
// training.h). The center is the replica: the trainer keeps no optimizer state the server lacks,
// so it writes no step log (a lost trainer is replaced by any spare that pulls the center) and
// sends no snapshot.
absl::Status RunAsyncAdaHessianTrainer(const WorkerConfig& config,
                                       const Registration& registration,
                                       ParameterServer::Stub* stub, WorkerAgent* agent,
                                       const absl::Notification& stop,
                                       const InjectedFaults& faults, SlotCompute* compute) {
  const JobConfig& job = registration.job;
  const SlotId& slot = registration.slot;
  // Every call names the registration this loop runs under: if the server forgets it (ABORTED),
  // the worker starts its work over under the agent's new one (worker/main.cc).
  const uint64_t incarnation = registration.incarnation;
  compute::MlpStage& stage = compute->trainer->stage(0);
  const compute::StageLayout& layout = stage.layout();
  const int64_t max_steps = job.training().max_steps();
  const int tau = job.easgd().sync_period();

  // Loads the current center into the local parameters.
  auto pull = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(const PullResponse center,
                     PullCenter(config, stop, stub, incarnation, slot.stage(), layout));
    RETURN_IF_ERROR(stage.SetParams(compute::PackedFromBundle(layout, center.center())));
    VLOG(1) << "pulled center version " << center.center_version();
    return absl::OkStatus();
  };

  // Sequence numbers. The slot pushes exactly once per step, from step 1, with sequence = step,
  // so its applied sequence is its last applied step, which the server also records as the
  // slot's progress: a takeover's start_step is that step, and the new trainer goes on from
  // start_step + 1 = applied + 1. Should start_step lag behind (a REPLAY takeover in this mode
  // starts at 0, having no snapshot or log to replay), the first push is answered
  // applied: false with the applied sequence and the trainer skips ahead to it.
  const int64_t start = registration.start_step;
  RETURN_IF_ERROR(pull());
  RETURN_IF_ERROR(compute->SeekAfter(start));
  LOG(INFO) << "training slot (" << slot.replica() << ", " << slot.stage() << ") on "
            << compute->sampler->shard().size() << " samples for steps " << start + 1 << ".."
            << max_steps << ": pushing g and D every step, pulling the center every " << tau;

  const std::vector<int32_t> label_map = InjectedLabelMap(faults);
  int64_t resets = 0;
  std::vector<float> g(layout.packed_size()), d(layout.packed_size());
  for (int64_t t = start + 1; t <= max_steps; ++t) {
    if (stop.HasBeenNotified()) return absl::CancelledError("stopped");
    RETURN_IF_ERROR(
        MaybeResetFromScratch(faults, t, job, slot, &resets, compute->trainer.get()));
    const std::vector<int64_t> ids = compute->sampler->NextBatch();
    ASSIGN_OR_RETURN(const float loss, compute->ComputeGradients(t, ids, label_map,
                                                                 absl::MakeSpan(g),
                                                                 absl::MakeSpan(d)));
    if (!std::isfinite(loss)) {
      return absl::InternalError(absl::StrCat("the loss of step ", t, " is not finite"));
    }
    PushRequest request;
    request.set_incarnation(incarnation);
    *request.mutable_slot() = slot;
    request.set_sequence(static_cast<uint64_t>(t));
    request.set_step(t);
    if (MaybePoison(faults, t, &g)) MaybePoison(faults, t, &d);
    *request.mutable_gradient() = compute::BundleFromPacked(layout, g);
    *request.mutable_hessian_diag() = compute::BundleFromPacked(layout, d);
    request.set_loss(loss);
    PushResponse response;
    // A retry after a lost reply is harmless: the server recognises the sequence and answers
    // applied: false.
    {
      ScopedLatency timed(Metrics().sync_seconds);
      RETURN_IF_ERROR(RefusedUpdate(
          "push", t, CallWithRetry(config, stop, "push", [&](grpc::ClientContext* context) {
            response.Clear();
            return stub->Push(context, request, &response);
          })));
    }
    Metrics().syncs->Increment();
    Metrics().weight->Set(response.weight());
    Metrics().steps->Increment();
    Metrics().step->Set(static_cast<double>(t));
    Metrics().loss->Set(loss);
    bool pull_now = t % tau == 0 || t == max_steps;
    if (!response.applied() && response.applied_sequence() > static_cast<uint64_t>(t)) {
      const int64_t applied = static_cast<int64_t>(
          std::min<uint64_t>(response.applied_sequence(), static_cast<uint64_t>(max_steps)));
      LOG(WARNING) << "the server has applied this slot's pushes through sequence "
                   << response.applied_sequence() << ": skipping from step " << t << " to step "
                   << applied + 1;
      t = applied;
      RETURN_IF_ERROR(compute->SeekAfter(t));
      pull_now = true;
    }
    agent->set_progress(t, loss);
    VLOG(1) << "pushed step " << t << " loss " << loss << (response.applied() ? "" : " (again)")
            << " weight " << response.weight() << " center version "
            << response.center_version();
    if (pull_now) RETURN_IF_ERROR(pull());
    if (pull_now && agent->drain_requested()) {
      // DRAIN: every step is pushed; the slot goes on from the center under its successor.
      agent->MarkDrained();
      LOG(WARNING) << "drained: pushed step " << t << "; leaving the slot";
      return absl::OkStatus();
    }
  }
  LOG(INFO) << "finished " << max_steps << " steps";
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckModelFitsData(const ModelSpec& model, const Dataset& data) {
  if (model.input_dim() != data.features) {
    return absl::FailedPreconditionError(
        absl::StrCat("model.input_dim ", model.input_dim(), " does not match the data set's ",
                     data.features, " features per sample"));
  }
  const int classes = model.layers(model.layers_size() - 1).width();
  if (classes < kFashionMnistClasses) {
    return absl::FailedPreconditionError(
        absl::StrCat("the output layer has ", classes, " units; the data set has ",
                     kFashionMnistClasses, " classes"));
  }
  return absl::OkStatus();
}

ComputeConfig EffectiveCompute(const JobConfig& job, const WorkerConfig& config) {
  ComputeConfig compute = job.compute();
  if (config.has_compute()) {
    if (config.compute().has_backend()) compute.set_backend(config.compute().backend());
    if (config.compute().has_threads()) compute.set_threads(config.compute().threads());
    if (config.compute().has_cuda_device()) {
      compute.set_cuda_device(config.compute().cuda_device());
    }
  }
  return compute;
}

namespace {

absl::Mutex stash_mu;
std::optional<std::pair<std::string, FashionMnist>>* Stash() ABSL_EXCLUSIVE_LOCKS_REQUIRED(stash_mu) {
  static auto* stash = new std::optional<std::pair<std::string, FashionMnist>>();
  return stash;
}

}  // namespace

void StashDataSet(const DataConfig& config, FashionMnist data) {
  absl::MutexLock lock(&stash_mu);
  Stash()->emplace(config.SerializeAsString(), std::move(data));
}

std::optional<FashionMnist> TakeStashedDataSet(const DataConfig& config) {
  absl::MutexLock lock(&stash_mu);
  auto* stash = Stash();
  if (!stash->has_value() || (*stash)->first != config.SerializeAsString()) return std::nullopt;
  std::optional<FashionMnist> data(std::move((*stash)->second));
  stash->reset();
  return data;
}

absl::StatusOr<FashionMnist> LoadDataSet(const DataConfig& config) {
  if (std::optional<FashionMnist> stashed = TakeStashedDataSet(config); stashed.has_value()) {
    return *std::move(stashed);
  }
  return LoadFashionMnist(config);
}

absl::StatusOr<std::unique_ptr<SlotCompute>> SlotCompute::Create(const WorkerConfig& config,
                                                                 const JobConfig& job,
                                                                 const SlotId& slot_id,
                                                                 FashionMnist* preloaded,
                                                                 int first_stage, int end_stage) {
  const int replica = slot_id.replica();
  auto slot = std::make_unique<SlotCompute>();
  if (preloaded != nullptr) {
    slot->data = std::move(*preloaded);
  } else {
    ASSIGN_OR_RETURN(slot->data, LoadDataSet(job.data()));
  }
  RETURN_IF_ERROR(CheckModelFitsData(job.model(), slot->data.train));
  ASSIGN_OR_RETURN(slot->backend, compute::CreateBackend(EffectiveCompute(job, config)));
  ASSIGN_OR_RETURN(slot->trainer, compute::LocalTrainer::Create(slot->backend.get(),
                                                                OptionsFor(job, slot_id, first_stage,
                                                                           end_stage)));
  RETURN_IF_ERROR(slot->trainer->InitParams());
  ASSIGN_OR_RETURN(ShardSampler sampler,
                   ShardSampler::Create(job.data(), slot->data.train.count,
                                        job.topology().replicas(), replica));
  slot->sampler = std::make_unique<ShardSampler>(std::move(sampler));
  const int batch = job.data().batch_size();
  slot->images.resize(static_cast<size_t>(batch) * slot->data.train.features);
  slot->labels.resize(batch);
  return slot;
}

absl::Status SlotCompute::LoadBatch(absl::Span<const int64_t> ids,
                                    const std::vector<int32_t>& label_map) {
  RETURN_IF_ERROR(AssembleBatch(data.train, ids, absl::MakeSpan(images), absl::MakeSpan(labels)));
  if (!label_map.empty()) {
    for (int32_t& label : labels) label = label_map[label];
  }
  return absl::OkStatus();
}

absl::Status SlotCompute::LoadRows(absl::Span<const int64_t> ids) {
  if (ids.size() > labels.size()) {
    return absl::InvalidArgumentError(absl::StrCat(ids.size(), " samples for a batch of ",
                                                   labels.size()));
  }
  const size_t features = images.size() / labels.size();
  return AssembleBatch(data.train, ids, absl::MakeSpan(images).subspan(0, ids.size() * features),
                       absl::MakeSpan(labels).subspan(0, ids.size()));
}

absl::StatusOr<float> SlotCompute::Step(int64_t t, absl::Span<const int64_t> ids,
                                        const std::vector<int32_t>& label_map) {
  RETURN_IF_ERROR(LoadBatch(ids, label_map));
  return trainer->Step(t, images, labels);
}

absl::StatusOr<float> SlotCompute::ComputeGradients(int64_t t, absl::Span<const int64_t> ids,
                                                    const std::vector<int32_t>& label_map,
                                                    absl::Span<float> g, absl::Span<float> d) {
  RETURN_IF_ERROR(LoadBatch(ids, label_map));
  return trainer->ComputeGradients(t, images, labels, g, d);
}

absl::StatusOr<uint64_t> SlotCompute::ParamsChecksum() {
  return trainer->stage(0).ParamsChecksum();
}

absl::Status SlotCompute::SeekAfter(int64_t steps) {
  const int64_t per_epoch = sampler->batches_per_epoch();
  return sampler->Seek(DataCursor{steps / per_epoch, (steps % per_epoch) * sampler->batch_size()});
}

absl::Status RunTrainer(const WorkerConfig& config, const Registration& registration,
                        const std::shared_ptr<grpc::Channel>& channel, WorkerAgent* agent,
                        const absl::Notification& stop, const InjectedFaults& faults,
                        std::unique_ptr<SlotCompute> resumed, PipelinePort* port) {
  const JobConfig& job = registration.job;
  RETURN_IF_ERROR(ValidateJobConfig(job));
  const SlotId slot = registration.slot;
  const bool pipelined = job.topology().stages() > 1;
  const bool replayed = resumed != nullptr;
  std::unique_ptr<SlotCompute> compute = std::move(resumed);
  if (compute == nullptr) {
    ASSIGN_OR_RETURN(compute, SlotCompute::Create(config, job, slot));
  }
  // Whatever ends this role, the next one of this process reuses the data set.
  struct StashOnExit {
    const DataConfig& config;
    std::unique_ptr<SlotCompute>& compute;
    ~StashOnExit() {
      if (compute != nullptr) StashDataSet(config, std::move(compute->data));
    }
  } stash_on_exit{job.data(), compute};
  auto stub = ParameterServer::NewStub(channel);
  if (job.easgd().mode() == ASYNC_ADAHESSIAN) {
    // A replayed state is not needed: the trainer starts from the center either way.
    return RunAsyncAdaHessianTrainer(config, registration, stub.get(), agent, stop, faults,
                                     compute.get());
  }
  compute::LocalTrainer* trainer = compute->trainer.get();
  ShardSampler& sampler = *compute->sampler;
  compute::MlpStage& stage = trainer->stage(0);
  compute::StageOptimizer& optimizer = trainer->optimizer(0);
  const compute::StageLayout& layout = stage.layout();
  // The step log (DESIGN §5.2): per step, the sample ids of each micro-batch and the checksum of
  // the parameters after the step, shipped asynchronously from a bounded buffer. Only REPLAY reads
  // it: under the other policies nothing is logged.
  std::shared_ptr<StepLogger> step_logger;
  if (job.step_log().enabled() && EffectiveRecoveryPolicy(job) == REPLAY) {
    step_logger =
        std::make_shared<StepLogger>(channel, registration.incarnation, job.step_log(), config);
  }
  // Appends a record, waiting out back-pressure (bounded by give_up_after_ms): a record that is
  // skipped would leave a hole that caps what replay can rebuild.
  auto log = [&](const std::vector<LogRecord>& records) -> absl::Status {
    const absl::Time give_up = absl::Now() + absl::Milliseconds(config.give_up_after_ms());
    while (true) {
      absl::Status appended = step_logger->AppendAll(records, absl::Seconds(1));
      if (appended.code() != absl::StatusCode::kUnavailable) return appended;
      if (stop.HasBeenNotified()) return absl::CancelledError("stopped");
      if (absl::Now() >= give_up) return appended;
      LOG(WARNING) << "step log buffer full: " << appended.message();
    }
  };

  // Pipelines: the boundary exchange with the neighbouring stages, and a flush of the log on the
  // server's FLUSH_LOG or a neighbour's FlushLog (a lost neighbour's inputs may sit in it).
  std::unique_ptr<PipelineExchange> pipeline;
  struct FlushHooks {
    WorkerAgent* agent;
    PipelinePort* port;
    ~FlushHooks() {
      agent->SetFlushHook(nullptr);
      if (port != nullptr) port->SetFlush(nullptr);
    }
  } flush_hooks{agent, pipelined ? port : nullptr};
  if (pipelined) {
    PipelineExchange::LogFn log_fn;
    if (step_logger != nullptr) log_fn = log;
    ASSIGN_OR_RETURN(pipeline, PipelineExchange::Create(config, registration, agent, port, stop,
                                                        std::move(log_fn)));
    if (step_logger != nullptr) {
      std::weak_ptr<StepLogger> weak = step_logger;
      auto flush = [weak](absl::Duration timeout) -> absl::Status {
        std::shared_ptr<StepLogger> logger = weak.lock();
        return logger == nullptr ? absl::OkStatus() : logger->Flush(timeout);
      };
      agent->SetFlushHook(flush);
      port->SetFlush(flush);
    }
  }

  std::vector<float> x(layout.packed_size()), m(layout.packed_size()), v(layout.packed_size()),
      d(layout.packed_size());
  const int64_t max_steps = job.training().max_steps();
  const int tau = job.easgd().sync_period();
  const int64_t start = registration.start_step;
  if (start > 0 && !replayed) {
    // RESTART_FROM_CENTER: the lost slot restarts from the current center with fresh optimizer
    // state, at the data position the slot had reached at its last sync.
    ASSIGN_OR_RETURN(const PullResponse center,
                     PullCenter(config, stop, stub.get(), registration.incarnation, slot.stage(),
                                layout));
    RETURN_IF_ERROR(stage.SetParams(compute::PackedFromBundle(layout, center.center())));
    RETURN_IF_ERROR(compute->SeekAfter(start));
    LOG(INFO) << "restarting slot (" << slot.replica() << ", " << slot.stage()
              << ") from the center (version " << center.center_version() << ") at step "
              << start;
  }
  LOG(INFO) << "training slot (" << slot.replica() << ", " << slot.stage() << ") on "
            << sampler.shard().size() << " samples for steps " << start + 1 << ".." << max_steps
            << ", sync every " << tau;

  const std::vector<int32_t> label_map = InjectedLabelMap(faults);
  int64_t resets = 0;

  // The EASGD exchange after step t (§4.4): send x and the optimizer state, move x toward the
  // center with the reply's c_before (or take the stored post-sync state of a retried sync).
  auto sync_at = [&](int64_t t, float loss) -> absl::Status {
    RETURN_IF_ERROR(stage.GetParams(absl::MakeSpan(x)));
    RETURN_IF_ERROR(optimizer.GetState(absl::MakeSpan(m), absl::MakeSpan(v), absl::MakeSpan(d)));
    SyncRequest request;
    // This role's incarnation, not the agent's current one: once the agent has registered again
    // (a rollback, a server restart), this trainer's syncs must be refused as its own, not be
    // sent under the new spare's name.
    request.set_incarnation(registration.incarnation);
    *request.mutable_slot() = slot;
    request.set_step(t);
    std::vector<float> poisoned;
    if (faults.poison_from_step > 0 && t >= faults.poison_from_step) {
      poisoned = x;
      MaybePoison(faults, t, &poisoned);
    }
    *request.mutable_params() = compute::BundleFromPacked(layout, poisoned.empty() ? x : poisoned);
    request.mutable_optimizer()->set_step(t);
    *request.mutable_optimizer()->mutable_m() = compute::BundleFromPacked(layout, m);
    *request.mutable_optimizer()->mutable_v() = compute::BundleFromPacked(layout, v);
    *request.mutable_optimizer()->mutable_last_hdiag() = compute::BundleFromPacked(layout, d);
    if (std::isfinite(loss)) request.set_loss(loss);
    request.set_data_epoch(sampler.cursor().epoch);
    request.set_data_offset(sampler.cursor().offset);
    SyncResponse response;
    {
      ScopedLatency timed(Metrics().sync_seconds);
      RETURN_IF_ERROR(RefusedUpdate(
          "sync", t, CallWithRetry(config, stop, "sync", [&](grpc::ClientContext* context) {
            response.Clear();
            return stub->Sync(context, request, &response);
          })));
    }
    Metrics().syncs->Increment();
    Metrics().weight->Set(response.weight());
    if (response.has_worker_params_after()) {
      RETURN_IF_ERROR(compute::ValidateBundle(layout, response.worker_params_after(),
                                              "worker_params_after"));
      x = compute::PackedFromBundle(layout, response.worker_params_after());
    } else {
      RETURN_IF_ERROR(compute::ValidateBundle(layout, response.center_before(), "center_before"));
      const std::vector<float> c_before = compute::PackedFromBundle(layout, response.center_before());
      RETURN_IF_ERROR(compute::ElasticPullWorker(response.moving_rate(), c_before,
                                                 absl::MakeSpan(x)));
    }
    RETURN_IF_ERROR(stage.SetParams(x));
    if (agent->drain_requested()) agent->MarkDrained();
    VLOG(1) << "synced step " << t << " loss " << loss << " weight " << response.weight()
            << " center version " << response.center_version();
    return absl::OkStatus();
  };
  if (replayed && start > 0 && (start % tau == 0 || start == max_steps)) {
    // The lost trainer had done step `start` but its sync was not applied: do it now.
    RETURN_IF_ERROR(sync_at(start, std::nanf("")));
  }

  for (int64_t t = start + 1; t <= max_steps; ++t) {
    if (stop.HasBeenNotified()) return absl::CancelledError("stopped");
    RETURN_IF_ERROR(MaybeResetFromScratch(faults, t, job, slot, &resets, trainer));
    const std::vector<int64_t> ids = sampler.NextBatch();
    const absl::Time step_start = absl::Now();
    float loss = 0;
    if (pipeline != nullptr) {
      ASSIGN_OR_RETURN(loss, pipeline->Step(t, ids, label_map, compute.get()));
    } else {
      ASSIGN_OR_RETURN(loss, compute->Step(t, ids, label_map));
    }
    Metrics().step_seconds->ObserveDuration(absl::Now() - step_start);
    Metrics().steps->Increment();
    Metrics().step->Set(static_cast<double>(t));
    // Only the last stage of a pipeline computes the loss; the others report none (NaN).
    const bool has_loss = pipeline == nullptr || trainer->ends_at_loss();
    if (has_loss) Metrics().loss->Set(loss);
    if (has_loss && !std::isfinite(loss)) {
      return absl::InternalError(absl::StrCat("the loss of step ", t, " is not finite"));
    }
    agent->set_progress(t, loss);
    if (step_logger != nullptr) {
      const int micro_batches = job.data().micro_batches();
      const size_t per = ids.size() / micro_batches;  // micro-batch k = rows [k B/M, (k+1) B/M)
      std::vector<LogRecord> records;
      records.reserve(micro_batches + 1);
      // The sample ids are stage 0's own input; later stages find them in the boundary records
      // their neighbours log (DESIGN §5.2).
      for (int k = 0; k < micro_batches && slot.stage() == 0; ++k) {
        records.push_back(
            MakeMicroBatchRecord(slot, t, k, absl::MakeConstSpan(ids).subspan(k * per, per)));
      }
      ASSIGN_OR_RETURN(const uint64_t checksum, stage.ParamsChecksum());
      records.push_back(MakeStepRecord(slot, t, checksum));
      Metrics().log_records->Increment(static_cast<double>(records.size()));
      RETURN_IF_ERROR(log(records));
      Metrics().log_buffered_bytes->Set(static_cast<double>(step_logger->stats().pending_bytes));
    }
    if (pipeline != nullptr) pipeline->Complete(t);
    if (t % tau != 0 && t != max_steps) continue;
    RETURN_IF_ERROR(sync_at(t, loss));
    if (agent->drained()) {
      // DRAIN: the slot's state is the snapshot of this sync; a spare takes it from there.
      LOG(WARNING) << "drained: synced step " << t << "; leaving slot (" << slot.replica() << ", "
                   << slot.stage() << ")";
      return absl::OkStatus();
    }
  }
  if (step_logger != nullptr) {
    absl::Status flushed = step_logger->Flush(absl::Milliseconds(config.rpc_deadline_ms()));
    if (!flushed.ok()) LOG(WARNING) << "step log not flushed at the end: " << flushed;
  }
  if (pipeline != nullptr) {
    // The other stages may still need this one's last pairs (a neighbour rebuilt near the end):
    // stay until the job ends (every slot FINISHED) or give_up_after_ms.
    LOG(INFO) << "finished " << max_steps << " steps; serving the last pairs until the job ends";
    pipeline->Linger(stop);
  }
  LOG(INFO) << "finished " << max_steps << " steps";
  return absl::OkStatus();
}

absl::Status RunEvaluator(const WorkerConfig& config, const Registration& registration,
                          const std::shared_ptr<grpc::Channel>& channel,
                          const absl::Notification& stop) {
  const JobConfig& job = registration.job;
  RETURN_IF_ERROR(ValidateJobConfig(job));
  ASSIGN_OR_RETURN(FashionMnist data, LoadFashionMnist(job.data()));
  RETURN_IF_ERROR(CheckModelFitsData(job.model(), data.train));
  ASSIGN_OR_RETURN(std::unique_ptr<compute::Backend> backend,
                   compute::CreateBackend(EffectiveCompute(job, config)));
  // The whole model, split as the job splits it: stage s takes the center of stage s.
  ASSIGN_OR_RETURN(std::unique_ptr<compute::LocalTrainer> model,
                   compute::LocalTrainer::Create(
                       backend.get(), OptionsFor(job, SlotId(), 0, job.topology().stages())));
  const std::vector<int32_t> labels(data.test.labels.begin(), data.test.labels.end());
  auto stub = ParameterServer::NewStub(channel);
  std::vector<int64_t> evaluated_versions(model->num_stages(), -1);
  const absl::Duration period = absl::Milliseconds(job.training().eval_every_ms());
  do {
    std::vector<int64_t> versions;
    for (int s = 0; s < model->num_stages(); ++s) {
      const compute::StageLayout& layout = model->stage(s).layout();
      ASSIGN_OR_RETURN(const PullResponse center,
                       PullCenter(config, stop, stub.get(), registration.incarnation, s, layout));
      RETURN_IF_ERROR(
          model->stage(s).SetParams(compute::PackedFromBundle(layout, center.center())));
      versions.push_back(center.center_version());
    }
    if (versions == evaluated_versions) continue;
    ASSIGN_OR_RETURN(compute::EvalResult result, model->Evaluate(data.test.images, labels));
    evaluated_versions = versions;
    // Reported as stage 0's version (each stage's center moves at every round alike).
    const int64_t version = versions[0];
    ReportEvalRequest report;
    report.set_incarnation(registration.incarnation);
    report.set_stage(0);
    report.set_center_version(version);
    report.set_test_loss(result.loss);
    report.set_test_accuracy(result.accuracy);
    ReportEvalResponse ack;
    RETURN_IF_ERROR(CallWithRetry(config, stop, "report eval", [&](grpc::ClientContext* context) {
      return stub->ReportEval(context, report, &ack);
    }));
    Metrics().test_accuracy->Set(result.accuracy);
    Metrics().test_loss->Set(result.loss);
    LOG(INFO) << "center version " << version << ": test accuracy "
              << result.accuracy << ", test loss " << result.loss;
  } while (!stop.WaitForNotificationWithTimeout(period));
  return absl::CancelledError("stopped");
}

}  // namespace rebound::worker
