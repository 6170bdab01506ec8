// rebound_train: a single-process trainer (no server) on Fashion-MNIST with AdaHessian.
//
//   rebound_train --config configs/train.pbtxt [--epochs N]
//
// The config is a JobConfig; it uses model, data, compute, adahessian and the job seed (an lr
// decay with adahessian.decay_steps 0 ends at the last step of the last epoch). Prints
// one line per epoch: mean training loss, test loss and accuracy, samples per second.
// Exit codes: 0 done, 2 bad config or one that does not fit (the model and the data set,
// compute.backend CUDA in a build without CUDA), 1 any other error (e.g. missing data set).

#include <gflags/gflags.h>
#include <glog/logging.h>

#include <cstdio>

#include "common/clock.h"
#include "common/config.h"
#include "common/process.h"
#include "common/usage.h"
#include "common/version.h"
#include "compute/backend_factory.h"
#include "compute/step.h"
#include "worker/data/dataset.h"
#include "worker/data/fashion_mnist.h"
#include "worker/data/shard_sampler.h"
#include "worker/slot_compute.h"

DEFINE_string(config, "", "job config (.pbtxt); required");
DEFINE_int32(epochs, 10, "epochs to train, >= 1");

namespace rebound::worker {
namespace {

int Run() {
  if (FLAGS_config.empty() || FLAGS_epochs < 1) {
    LOG(ERROR) << "--config is required and --epochs must be >= 1";
    return 2;
  }
  auto job = LoadJobConfig(FLAGS_config);
  if (!job.ok()) {
    LOG(ERROR) << "invalid config:\n" << job.status().message();
    return 2;
  }
  auto data = LoadFashionMnist(job->data());
  if (!data.ok()) {
    LOG(ERROR) << data.status();
    return 1;
  }
  if (absl::Status fits = CheckModelFitsData(job->model(), data->train); !fits.ok()) {
    LOG(ERROR) << fits;
    return 2;
  }
  auto backend = compute::CreateBackend(job->compute());
  if (!backend.ok()) {
    LOG(ERROR) << backend.status();
    // compute.backend CUDA in a CPU build, or a bad device: the config's, not a failure.
    return backend.status().code() == absl::StatusCode::kFailedPrecondition ||
                   backend.status().code() == absl::StatusCode::kInvalidArgument
               ? 2
               : 1;
  }
  auto sampler = ShardSampler::Create(job->data(), data->train.count, 1, 0);
  if (!sampler.ok()) {
    LOG(ERROR) << sampler.status();
    return 1;
  }
  // The job's length, which a decay with decay_steps 0 spans (EffectiveAdaHessianConfig): all
  // the epochs of this run.
  job->mutable_training()->set_max_steps(static_cast<int64_t>(FLAGS_epochs) *
                                         sampler->batches_per_epoch());
  compute::TrainerOptions options;
  options.model = job->model();
  options.optimizer = EffectiveAdaHessianConfig(*job);
  options.batch_size = job->data().batch_size();
  options.micro_batches = job->data().micro_batches();
  options.seed = job->data().seed();
  options.replica = 0;
  auto trainer = compute::LocalTrainer::Create(backend->get(), options);
  if (!trainer.ok()) {
    LOG(ERROR) << trainer.status();
    return 1;
  }
  if (absl::Status init = (*trainer)->InitParams(); !init.ok()) {
    LOG(ERROR) << init;
    return 1;
  }

  const int batch = job->data().batch_size();
  const int64_t features = data->train.features;
  std::vector<float> images(static_cast<size_t>(batch) * features);
  std::vector<int32_t> labels(batch);
  std::vector<int32_t> test_labels(data->test.labels.begin(), data->test.labels.end());
  std::printf("rebound_train: %lld train / %lld test samples, batch %d in %d micro-batches, "
              "%lld steps per epoch\n",
              static_cast<long long>(data->train.count), static_cast<long long>(data->test.count),
              batch, job->data().micro_batches(),
              static_cast<long long>(sampler->batches_per_epoch()));
  int64_t t = 0;
  for (int epoch = 1; epoch <= FLAGS_epochs; ++epoch) {
    const Clock* const clock = DefaultClock();
    const absl::Time start = clock->Now();
    double loss_sum = 0.0;
    const int64_t steps = sampler->batches_per_epoch();
    for (int64_t i = 0; i < steps; ++i) {
      const std::vector<int64_t> ids = sampler->NextBatch();
      absl::Status assembled = AssembleBatch(data->train, ids, absl::MakeSpan(images),
                                             absl::MakeSpan(labels));
      if (!assembled.ok()) {
        LOG(ERROR) << assembled;
        return 1;
      }
      auto loss = (*trainer)->Step(++t, images, labels);
      if (!loss.ok()) {
        LOG(ERROR) << loss.status();
        return 1;
      }
      loss_sum += *loss;
    }
    const double seconds = absl::ToDoubleSeconds(clock->Now() - start);
    auto eval = (*trainer)->Evaluate(data->test.images, test_labels);
    if (!eval.ok()) {
      LOG(ERROR) << eval.status();
      return 1;
    }
    std::printf("epoch %2d  train_loss %.4f  test_loss %.4f  test_accuracy %.2f%%  "
                "%.0f samples/s  %.1f s\n",
                epoch, loss_sum / steps, eval->loss, 100.0 * eval->accuracy,
                steps * batch / seconds, seconds);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace rebound::worker

constexpr char kUsageHeader[] =
    "usage: rebound_train --config FILE [--epochs N]\n"
    "\n"
    "A single-process trainer (no server) on Fashion-MNIST with AdaHessian. The config is a\n"
    "JobConfig: it uses model, data, compute, adahessian and the job seed. Prints one line per\n"
    "epoch: mean training loss, test loss and accuracy, samples per second.\n";

constexpr char kUsageFooter[] =
    "Exit codes: 0 done; 1 any other error (e.g. the data set is missing); 2 bad config or flags,\n"
    "or a config that does not fit (the model and the data set, compute.backend).\n";

int main(int argc, char** argv) {
  rebound::ExitIfVersionFlag(argc, argv);
  rebound::ExitIfHelpFlag(argc, argv,
                          rebound::UsageText(kUsageHeader, __FILE__, kUsageFooter));
  if (const absl::Status flags = rebound::CheckCommandLineFlags(argc, argv); !flags.ok()) {
    std::fprintf(stderr, "%s: %s (--help: the flags)\n", "rebound_train",
                 std::string(flags.message()).c_str());
    return 2;  // bad flags, as documented (gflags would exit 1)
  }
  gflags::SetUsageMessage("rebound_train --config FILE [--epochs N] (--help: the flags)");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  rebound::InitLogging(argv[0]);
  return rebound::worker::Run();
}
