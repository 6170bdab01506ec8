#include "worker/slot_compute.h"

#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/status_macros.h"
#include "compute/backend_factory.h"

namespace rebound::worker {

void DataSetCache::Put(const DataConfig& config, FashionMnist data) {
  absl::MutexLock lock(&mu_);
  kept_.emplace(config.SerializeAsString(), std::move(data));
}

std::optional<FashionMnist> DataSetCache::Take(const DataConfig& config) {
  absl::MutexLock lock(&mu_);
  if (!kept_.has_value() || kept_->first != config.SerializeAsString()) return std::nullopt;
  std::optional<FashionMnist> data(std::move(kept_->second));
  kept_.reset();
  return data;
}

absl::StatusOr<FashionMnist> DataSetCache::Load(const DataConfig& config) {
  if (std::optional<FashionMnist> kept = Take(config); kept.has_value()) {
    return *std::move(kept);
  }
  return LoadFashionMnist(config);
}

compute::TrainerOptions TrainerOptionsFor(const JobConfig& job, const SlotId& slot,
                                          int first_stage, int end_stage) {
  compute::TrainerOptions options;
  options.model = job.model();
  options.optimizer = EffectiveAdaHessianConfig(job);
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

namespace {
constexpr char kConfigMismatchPayload[] = "type.rebound.dev/worker.ConfigMismatch";
}  // namespace

absl::Status MarkConfigMismatch(absl::Status status) {
  if (status.code() == absl::StatusCode::kFailedPrecondition) {
    status.SetPayload(kConfigMismatchPayload, absl::Cord("this process's configuration"));
  }
  return status;
}

bool IsConfigMismatch(const absl::Status& status) {
  return status.code() == absl::StatusCode::kFailedPrecondition &&
         status.GetPayload(kConfigMismatchPayload).has_value();
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

absl::StatusOr<std::unique_ptr<SlotCompute>> SlotCompute::Create(const WorkerConfig& config,
                                                                 const JobConfig& job,
                                                                 const SlotId& slot_id,
                                                                 FashionMnist data,
                                                                 int first_stage, int end_stage) {
  const int replica = slot_id.replica();
  auto slot = std::make_unique<SlotCompute>();
  slot->data = std::move(data);
  RETURN_IF_ERROR(MarkConfigMismatch(CheckModelFitsData(job.model(), slot->data.train)));
  auto backend = compute::CreateBackend(EffectiveCompute(job, config));
  if (!backend.ok()) return MarkConfigMismatch(backend.status());
  slot->backend = *std::move(backend);
  ASSIGN_OR_RETURN(slot->trainer, compute::LocalTrainer::Create(slot->backend.get(),
                                                                TrainerOptionsFor(job, slot_id, first_stage,
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

}  // namespace rebound::worker
