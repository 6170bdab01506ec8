#include "worker/evaluator.h"

#include <glog/logging.h>

#include <memory>
#include <vector>

#include "common/config.h"
#include "common/status_macros.h"
#include "compute/backend_factory.h"
#include "compute/step.h"
#include "compute/tensor_bundle.h"
#include "worker/center_client.h"
#include "worker/data/fashion_mnist.h"
#include "worker/retry.h"
#include "worker/slot_compute.h"
#include "worker/worker_metrics.h"

namespace rebound::worker {

absl::Status RunEvaluator(const WorkerConfig& config, const Registration& registration,
                          const std::shared_ptr<grpc::Channel>& channel,
                          const absl::Notification& stop, const Clock* clock,
                          const std::atomic<bool>* job_done) {
  const JobConfig& job = registration.job;
  RETURN_IF_ERROR(ValidateJobConfig(job));
  ASSIGN_OR_RETURN(FashionMnist data, LoadFashionMnist(job.data()));
  RETURN_IF_ERROR(CheckModelFitsData(job.model(), data.train));
  ASSIGN_OR_RETURN(std::unique_ptr<compute::Backend> backend,
                   compute::CreateBackend(EffectiveCompute(job, config)));
  // The whole model, split as the job splits it: stage s takes the center of stage s.
  ASSIGN_OR_RETURN(std::unique_ptr<compute::LocalTrainer> model,
                   compute::LocalTrainer::Create(
                       backend.get(), TrainerOptionsFor(job, SlotId(), 0, job.topology().stages())));
  const std::vector<int32_t> labels(data.test.labels.begin(), data.test.labels.end());
  auto stub = ParameterServer::NewStub(channel);
  std::vector<int64_t> evaluated_versions(model->num_stages(), -1);
  // One round: pull every stage; if any moved, evaluate and report. `calls_stop` ends its calls.
  auto round = [&](const absl::Notification& calls_stop) -> absl::Status {
    std::vector<int64_t> versions;
    for (int s = 0; s < model->num_stages(); ++s) {
      const compute::StageLayout& layout = model->stage(s).layout();
      ASSIGN_OR_RETURN(const PullResponse center,
                       registration.center->Pull(calls_stop, stub.get(),
                                                 registration.incarnation, s, layout));
      RETURN_IF_ERROR(
          model->stage(s).SetParams(compute::PackedFromBundle(layout, center.center())));
      versions.push_back(center.center_version());
    }
    if (versions == evaluated_versions) return absl::OkStatus();
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
    RETURN_IF_ERROR(CallWithRetry(config, clock, calls_stop, "report eval",
                                  [&](grpc::ClientContext* context) {
                                    return stub->ReportEval(context, report, &ack);
                                  }));
    Metrics().test_accuracy->Set(result.accuracy);
    Metrics().test_loss->Set(result.loss);
    LOG(INFO) << "center version " << version << ": test accuracy "
              << result.accuracy << ", test loss " << result.loss;
    return absl::OkStatus();
  };
  const absl::Duration period = absl::Milliseconds(job.training().eval_every_ms());
  do {
    RETURN_IF_ERROR(round(stop));
  } while (!clock->WaitFor(period, &stop));
  if (job_done != nullptr && job_done->load()) {
    // The job's end: the final center, which the last period may have missed, gets its report
    // (the agent stays registered for it: worker/agent.h). Bounded by the calls' retry policy.
    const absl::Notification not_stopped;
    if (absl::Status last = round(not_stopped); !last.ok()) {
      LOG(WARNING) << "the final center's evaluation: " << last;
    }
  }
  return absl::CancelledError("stopped");
}

}  // namespace rebound::worker
