#include "worker/training.h"

#include <glog/logging.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/slot.h"
#include "common/status_macros.h"
#include "compute/step.h"
#include "compute/tensor_bundle.h"
#include "worker/center_client.h"
#include "worker/easgd_trainer.h"
#include "worker/progress_line.h"
#include "worker/retry.h"
#include "worker/worker_metrics.h"

namespace rebound::worker {
namespace {

// The trainer of mode ASYNC_ADAHESSIAN (docs/design.md §4.6; the contract is RunTrainer's, in
// training.h). The center is the replica: the trainer keeps no optimizer state the server lacks,
// so it writes no step log (a lost trainer is replaced by any spare that pulls the center) and
// sends no snapshot.
absl::Status RunAsyncAdaHessianTrainer(const WorkerConfig& config,
                                       const Registration& registration,
                                       ParameterServer::Stub* stub, WorkerAgent* agent,
                                       const absl::Notification& stop, const Clock* clock,
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
                     registration.center->Pull(stop, stub, incarnation, slot.stage(), layout));
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
  ProgressLine progress(SlotName(slot), max_steps, job.data().batch_size(),
                        absl::Seconds(config.progress_interval_s()), clock);
  RETURN_IF_ERROR(pull());
  RETURN_IF_ERROR(compute->SeekAfter(start));
  LOG(INFO) << "training slot " << SlotName(slot) << " on "
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
    if (MaybePoison(faults, t, &g)) MaybePoison(faults, t, &d);
    absl::StatusOr<PushResponse> pushed;
    {
      ScopedLatency timed(Metrics().sync_seconds);
      pushed = registration.center->Push(stop, stub, incarnation, slot, t,
                                         static_cast<uint64_t>(t), layout, g, d, loss);
    }
    RETURN_IF_ERROR(RefusedUpdate("push", t, pushed.status()));
    const PushResponse& response = *pushed;
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
    progress.Step(t, loss, response.weight());
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

absl::Status RunTrainer(const WorkerConfig& config, const Registration& registration,
                        const std::shared_ptr<grpc::Channel>& channel, WorkerAgent* agent,
                        const absl::Notification& stop, const Clock* clock,
                        DataSetCache* data_sets, const InjectedFaults& faults,
                        std::unique_ptr<SlotCompute> resumed, PipelinePort* port) {
  const JobConfig& job = registration.job;
  RETURN_IF_ERROR(ValidateJobConfig(job));
  const bool replayed = resumed != nullptr;
  std::unique_ptr<SlotCompute> compute = std::move(resumed);
  if (compute == nullptr) {
    ASSIGN_OR_RETURN(FashionMnist data, data_sets->Load(job.data()));
    ASSIGN_OR_RETURN(compute,
                     SlotCompute::Create(config, job, registration.slot, std::move(data)));
  }
  // Whatever ends this role, the next one of this process reuses the data set.
  struct KeepDataSet {
    const DataConfig& config;
    DataSetCache* data_sets;
    std::unique_ptr<SlotCompute>& compute;
    ~KeepDataSet() {
      if (compute != nullptr) data_sets->Put(config, std::move(compute->data));
    }
  } keep_data_set{job.data(), data_sets, compute};
  if (job.easgd().mode() == ASYNC_ADAHESSIAN) {
    // A replayed state is not needed: the trainer starts from the center either way.
    auto stub = ParameterServer::NewStub(channel);
    return RunAsyncAdaHessianTrainer(config, registration, stub.get(), agent, stop, clock,
                                     faults, compute.get());
  }
  EasgdTrainer trainer(config, registration, channel, agent, stop, clock, faults, compute.get(),
                       replayed, port);
  return trainer.Run();
}

}  // namespace rebound::worker
