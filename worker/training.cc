#include "worker/training.h"

#include <glog/logging.h>

#include <chrono>
#include <cmath>
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
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
#include "worker/step_logger.h"

namespace rebound::worker {
namespace {

bool Retryable(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded;
}

// Calls `rpc` (one attempt with a fresh context and deadline) until it succeeds, fails for good,
// `stop` is notified or give_up_after_ms pass without success.
template <typename Rpc>
absl::Status CallWithRetry(const WorkerConfig& config, const absl::Notification& stop,
                           const char* what, Rpc rpc) {
  Backoff backoff(absl::Milliseconds(config.backoff_initial_ms()),
                  absl::Milliseconds(config.backoff_max_ms()), absl::ToUnixNanos(absl::Now()));
  const absl::Time give_up = absl::Now() + absl::Milliseconds(config.give_up_after_ms());
  while (true) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(config.rpc_deadline_ms()));
    const absl::Status status = FromGrpcStatus(rpc(&context));
    if (status.ok() || !Retryable(status.code())) return status;
    if (absl::Now() >= give_up) {
      return absl::UnavailableError(absl::StrCat(what, " failed for ", config.give_up_after_ms(),
                                                 " ms: ", status.message()));
    }
    const absl::Duration delay = backoff.Next();
    LOG(WARNING) << what << " failed (" << status << "); retrying in "
                 << absl::ToInt64Milliseconds(delay) << " ms";
    if (stop.WaitForNotificationWithTimeout(delay)) {
      return absl::CancelledError("stopped");
    }
  }
}

compute::TrainerOptions OptionsFor(const JobConfig& job, int replica) {
  compute::TrainerOptions options;
  options.model = job.model();
  options.optimizer = job.adahessian();
  options.batch_size = job.data().batch_size();
  options.micro_batches = job.data().micro_batches();
  options.seed = job.data().seed();
  options.replica = static_cast<uint32_t>(replica);
  return options;
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

absl::Status RunTrainer(const WorkerConfig& config, const Registration& registration,
                        const std::shared_ptr<grpc::Channel>& channel, WorkerAgent* agent,
                        const absl::Notification& stop, const InjectedFaults& faults) {
  const JobConfig& job = registration.job;
  RETURN_IF_ERROR(ValidateJobConfig(job));
  if (job.topology().stages() != 1) {
    return absl::UnimplementedError("pipeline stages (S > 1) arrive with issue R5");
  }
  if (job.easgd().mode() != EASGD) {
    return absl::UnimplementedError("the ASYNC_ADAHESSIAN trainer loop arrives with issue R3's "
                                    "follow-up; run mode EASGD");
  }
  const SlotId slot = registration.slot;
  ASSIGN_OR_RETURN(FashionMnist data, LoadFashionMnist(job.data()));
  RETURN_IF_ERROR(CheckModelFitsData(job.model(), data.train));
  ASSIGN_OR_RETURN(std::unique_ptr<compute::Backend> backend,
                   compute::CreateBackend(EffectiveCompute(job, config)));
  ASSIGN_OR_RETURN(std::unique_ptr<compute::LocalTrainer> trainer,
                   compute::LocalTrainer::Create(backend.get(), OptionsFor(job, slot.replica())));
  RETURN_IF_ERROR(trainer->InitParams());
  ASSIGN_OR_RETURN(ShardSampler sampler,
                   ShardSampler::Create(job.data(), data.train.count, job.topology().replicas(),
                                        slot.replica()));
  compute::MlpStage& stage = trainer->stage(0);
  compute::StageOptimizer& optimizer = trainer->optimizer(0);
  const compute::StageLayout& layout = stage.layout();
  auto stub = ParameterServer::NewStub(channel);
  // The step log (DESIGN §5.2): per step, the sample ids of each micro-batch and the checksum of
  // the parameters after the step, shipped asynchronously from a bounded buffer.
  std::unique_ptr<StepLogger> step_logger;
  if (job.step_log().enabled()) {
    step_logger = std::make_unique<StepLogger>(channel, registration.incarnation,
                                               job.step_log().buffer_bytes(), config);
  }
  // Appends a record, waiting out back-pressure (bounded by give_up_after_ms): a record that is
  // skipped would leave a hole that caps what replay can rebuild.
  auto log = [&](LogRecord record) -> absl::Status {
    const absl::Time give_up = absl::Now() + absl::Milliseconds(config.give_up_after_ms());
    while (true) {
      absl::Status appended = step_logger->Append(record, absl::Seconds(1));
      if (appended.code() != absl::StatusCode::kUnavailable) return appended;
      if (stop.HasBeenNotified()) return absl::CancelledError("stopped");
      if (absl::Now() >= give_up) return appended;
      LOG(WARNING) << "step log buffer full: " << appended.message();
    }
  };

  const int batch = job.data().batch_size();
  std::vector<float> images(static_cast<size_t>(batch) * data.train.features);
  std::vector<int32_t> labels(batch);
  std::vector<float> x(layout.packed_size()), m(layout.packed_size()), v(layout.packed_size()),
      d(layout.packed_size());
  const int64_t max_steps = job.training().max_steps();
  const int tau = job.easgd().sync_period();
  const int64_t start = registration.start_step;
  if (start > 0) {
    // RESTART_FROM_CENTER: the lost slot restarts from the current center with fresh optimizer
    // state, at the data position the slot had reached at its last sync.
    PullRequest pull;
    pull.set_incarnation(registration.incarnation);
    pull.set_stage(slot.stage());
    PullResponse center;
    RETURN_IF_ERROR(CallWithRetry(config, stop, "pull", [&](grpc::ClientContext* context) {
      center.Clear();
      return stub->Pull(context, pull, &center);
    }));
    RETURN_IF_ERROR(compute::ValidateBundle(layout, center.center(), "center"));
    RETURN_IF_ERROR(stage.SetParams(compute::PackedFromBundle(layout, center.center())));
    const int64_t per_epoch = sampler.batches_per_epoch();
    RETURN_IF_ERROR(sampler.Seek(DataCursor{start / per_epoch, (start % per_epoch) * batch}));
    LOG(INFO) << "restarting slot (" << slot.replica() << ", " << slot.stage()
              << ") from the center (version " << center.center_version() << ") at step "
              << start;
  }
  LOG(INFO) << "training slot (" << slot.replica() << ", " << slot.stage() << ") on "
            << sampler.shard().size() << " samples for steps " << start + 1 << ".." << max_steps
            << ", sync every " << tau;

  std::vector<int32_t> label_map;
  if (faults.label_permutation_seed != 0) {
    label_map.resize(kFashionMnistClasses);
    for (int i = 0; i < kFashionMnistClasses; ++i) label_map[i] = i;
    const RngStream stream{faults.label_permutation_seed, 0, 0, 0, kRngShuffle};
    for (int i = kFashionMnistClasses - 1; i > 0; --i) {
      std::swap(label_map[i], label_map[RngWord(stream, i) % (i + 1)]);
    }
    LOG(WARNING) << "FAULT INJECTION: this trainer's labels are permuted";
  }
  int64_t resets = 0;

  for (int64_t t = start + 1; t <= max_steps; ++t) {
    if (stop.HasBeenNotified()) return absl::CancelledError("stopped");
    if (faults.reset_every_steps > 0 && t > 1 && (t - 1) % faults.reset_every_steps == 0) {
      // A naive supervisor's restart: fresh random parameters, zero optimizer state.
      ModelSpec fresh = job.model();
      fresh.set_init_seed(job.model().init_seed() + 7919 * (++resets) + 104729 * slot.replica());
      std::vector<float> padded(layout.padded_size());
      RETURN_IF_ERROR(compute::InitParams(fresh, layout, absl::MakeSpan(padded)));
      RETURN_IF_ERROR(layout.Pack(padded, absl::MakeSpan(x)));
      RETURN_IF_ERROR(stage.SetParams(x));
      std::fill(m.begin(), m.end(), 0.0f);
      RETURN_IF_ERROR(optimizer.SetState(m, m, m));
      LOG(WARNING) << "FAULT INJECTION: restarted from scratch at step " << t;
    }
    const std::vector<int64_t> ids = sampler.NextBatch();
    RETURN_IF_ERROR(AssembleBatch(data.train, ids, absl::MakeSpan(images), absl::MakeSpan(labels)));
    if (!label_map.empty()) {
      for (int32_t& label : labels) label = label_map[label];
    }
    ASSIGN_OR_RETURN(const float loss, trainer->Step(t, images, labels));
    if (!std::isfinite(loss)) {
      return absl::InternalError(absl::StrCat("the loss of step ", t, " is not finite"));
    }
    agent->set_progress(t, loss);
    if (step_logger != nullptr) {
      const int micro_batches = job.data().micro_batches();
      const size_t per = ids.size() / micro_batches;  // micro-batch k = rows [k B/M, (k+1) B/M)
      for (int k = 0; k < micro_batches; ++k) {
        RETURN_IF_ERROR(log(
            MakeMicroBatchRecord(slot, t, k, absl::MakeConstSpan(ids).subspan(k * per, per))));
      }
      RETURN_IF_ERROR(stage.GetParams(absl::MakeSpan(x)));
      RETURN_IF_ERROR(log(MakeStepRecord(slot, t, ChecksumFloats(x))));
    }
    if (t % tau != 0 && t != max_steps) continue;

    RETURN_IF_ERROR(stage.GetParams(absl::MakeSpan(x)));
    RETURN_IF_ERROR(optimizer.GetState(absl::MakeSpan(m), absl::MakeSpan(v), absl::MakeSpan(d)));
    SyncRequest request;
    request.set_incarnation(agent->registration().incarnation);
    *request.mutable_slot() = slot;
    request.set_step(t);
    *request.mutable_params() = compute::BundleFromPacked(layout, x);
    request.mutable_optimizer()->set_step(t);
    *request.mutable_optimizer()->mutable_m() = compute::BundleFromPacked(layout, m);
    *request.mutable_optimizer()->mutable_v() = compute::BundleFromPacked(layout, v);
    *request.mutable_optimizer()->mutable_last_hdiag() = compute::BundleFromPacked(layout, d);
    request.set_loss(loss);
    request.set_data_epoch(sampler.cursor().epoch);
    request.set_data_offset(sampler.cursor().offset);
    SyncResponse response;
    RETURN_IF_ERROR(CallWithRetry(config, stop, "sync", [&](grpc::ClientContext* context) {
      response.Clear();
      return stub->Sync(context, request, &response);
    }));
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
    VLOG(1) << "synced step " << t << " loss " << loss << " weight " << response.weight()
            << " center version " << response.center_version();
  }
  if (step_logger != nullptr) {
    absl::Status flushed = step_logger->Flush(absl::Milliseconds(config.rpc_deadline_ms()));
    if (!flushed.ok()) LOG(WARNING) << "step log not flushed at the end: " << flushed;
  }
  LOG(INFO) << "finished " << max_steps << " steps";
  return absl::OkStatus();
}

absl::Status RunEvaluator(const WorkerConfig& config, const Registration& registration,
                          const std::shared_ptr<grpc::Channel>& channel,
                          const absl::Notification& stop) {
  const JobConfig& job = registration.job;
  RETURN_IF_ERROR(ValidateJobConfig(job));
  if (job.topology().stages() != 1) {
    return absl::UnimplementedError("evaluating a pipelined model arrives with issue R5");
  }
  ASSIGN_OR_RETURN(FashionMnist data, LoadFashionMnist(job.data()));
  RETURN_IF_ERROR(CheckModelFitsData(job.model(), data.train));
  ASSIGN_OR_RETURN(std::unique_ptr<compute::Backend> backend,
                   compute::CreateBackend(EffectiveCompute(job, config)));
  ASSIGN_OR_RETURN(std::unique_ptr<compute::LocalTrainer> model,
                   compute::LocalTrainer::Create(backend.get(), OptionsFor(job, 0)));
  const compute::StageLayout& layout = model->stage(0).layout();
  const std::vector<int32_t> labels(data.test.labels.begin(), data.test.labels.end());
  auto stub = ParameterServer::NewStub(channel);
  int64_t evaluated_version = -1;
  const absl::Duration period = absl::Milliseconds(job.training().eval_every_ms());
  do {
    PullRequest pull;
    pull.set_incarnation(registration.incarnation);
    pull.set_stage(0);
    PullResponse center;
    RETURN_IF_ERROR(CallWithRetry(config, stop, "pull", [&](grpc::ClientContext* context) {
      center.Clear();
      return stub->Pull(context, pull, &center);
    }));
    if (center.center_version() == evaluated_version) continue;
    RETURN_IF_ERROR(compute::ValidateBundle(layout, center.center(), "center"));
    RETURN_IF_ERROR(model->stage(0).SetParams(compute::PackedFromBundle(layout, center.center())));
    ASSIGN_OR_RETURN(compute::EvalResult result, model->Evaluate(data.test.images, labels));
    evaluated_version = center.center_version();
    ReportEvalRequest report;
    report.set_incarnation(registration.incarnation);
    report.set_stage(0);
    report.set_center_version(center.center_version());
    report.set_test_loss(result.loss);
    report.set_test_accuracy(result.accuracy);
    ReportEvalResponse ack;
    RETURN_IF_ERROR(CallWithRetry(config, stop, "report eval", [&](grpc::ClientContext* context) {
      return stub->ReportEval(context, report, &ack);
    }));
    LOG(INFO) << "center version " << center.center_version() << ": test accuracy "
              << result.accuracy << ", test loss " << result.loss;
  } while (!stop.WaitForNotificationWithTimeout(period));
  return absl::CancelledError("stopped");
}

}  // namespace rebound::worker
