#pragma once

// SlotCompute: the compute state of one slot's trainer (its data set, backend, model, optimizer
// and data cursor), and DataSetCache, which hands a loaded data set from one role of the process
// to the next (docs/design.md §4.4, §5.3).
//
// Thread-safety: a SlotCompute belongs to one thread at a time (the trainer's, or the replay's
// that built it and hands it over). DataSetCache is thread-safe.
// Ownership: a SlotCompute owns everything it holds; the data set is moved in and can be moved
// out again (`data`) when the role ends. DataSetCache owns at most one data set; it is created
// by the composition root (worker/main.cc) and borrowed by the roles, and must outlive them.
//
// Status codes: Create returns FAILED_PRECONDITION when the model does not fit the data set or
// the backend this build lacks, marked as the configuration's (MarkConfigMismatch below),
// INVALID_ARGUMENT for a model or data configuration the compute layer refuses, and the errors
// of the backend's creation; LoadBatch/LoadRows INVALID_ARGUMENT for sample ids out of range or
// more rows than a batch; DataSetCache::Load the errors of LoadFashionMnist (NOT_FOUND,
// DATA_LOSS, ...).

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "compute/backend.h"
#include "compute/step.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "worker/data/dataset.h"
#include "worker/data/fashion_mnist.h"
#include "worker/data/shard_sampler.h"

namespace rebound::worker {

// The data set a role of this process loaded, kept for the next role when this one ends (a
// trainer rolled back under GLOBAL_CHECKPOINT, or registering again after a server restart,
// comes back as a spare: reading and decoding the data set again would cost it seconds). One set
// at most, moved in and out, never copied.
class DataSetCache {
 public:
  DataSetCache() = default;
  DataSetCache(const DataSetCache&) = delete;
  DataSetCache& operator=(const DataSetCache&) = delete;

  // Keeps `data`, loaded with `config`, replacing what was kept.
  void Put(const DataConfig& config, FashionMnist data);
  // The kept set (moved out) if it was loaded with an equal `config`; nullopt otherwise.
  std::optional<FashionMnist> Take(const DataConfig& config);
  // Take, or LoadFashionMnist.
  absl::StatusOr<FashionMnist> Load(const DataConfig& config);

 private:
  absl::Mutex mu_;
  // The serialized DataConfig the set was loaded with, and the set.
  std::optional<std::pair<std::string, FashionMnist>> kept_ ABSL_GUARDED_BY(mu_);
};

struct SlotCompute {
  FashionMnist data;
  std::unique_ptr<compute::Backend> backend;
  std::unique_ptr<compute::LocalTrainer> trainer;
  std::unique_ptr<ShardSampler> sampler;
  std::vector<float> images;   // one batch, reused
  std::vector<int32_t> labels;

  // Builds the model of `slot` (its stage's layers when S > 1) from its initialisation, on
  // `data` (moved in). With first_stage >= 0 the model holds stages [first_stage, end_stage) of
  // the slot's replica instead (a replay of a recovery group).
  static absl::StatusOr<std::unique_ptr<SlotCompute>> Create(const WorkerConfig& config,
                                                             const JobConfig& job,
                                                             const SlotId& slot,
                                                             FashionMnist data,
                                                             int first_stage = -1,
                                                             int end_stage = -1);
  // Fills `images` and `labels` with the batch of these sample ids (each label y becomes
  // label_map[y] unless label_map is empty).
  absl::Status LoadBatch(absl::Span<const int64_t> ids, const std::vector<int32_t>& label_map);
  // Fills the first ids.size() rows of `images` and `labels` with these samples (a part of a
  // batch: a parallel replay's block).
  absl::Status LoadRows(absl::Span<const int64_t> ids);
  // Runs step t on the batch of these sample ids; returns the step's loss.
  absl::StatusOr<float> Step(int64_t t, absl::Span<const int64_t> ids,
                             const std::vector<int32_t>& label_map);
  // Step t on that batch without its update (mode ASYNC_ADAHESSIAN): the step's gradient and
  // Hessian diagonal into g and d, packed layout (compute::LocalTrainer::ComputeGradients);
  // returns the step's loss.
  absl::StatusOr<float> ComputeGradients(int64_t t, absl::Span<const int64_t> ids,
                                         const std::vector<int32_t>& label_map,
                                         absl::Span<float> g, absl::Span<float> d);
  // xxHash64 of the parameters in the packed layout (what the step log records).
  absl::StatusOr<uint64_t> ParamsChecksum();
  // Positions the data cursor after `steps` batches.
  absl::Status SeekAfter(int64_t steps);
};

// The model options of slot `slot`: its stage's layers (the whole model when S = 1), or those of
// stages [first_stage, end_stage) of its replica, split as the job splits them.
compute::TrainerOptions TrainerOptionsFor(const JobConfig& job, const SlotId& slot,
                                          int first_stage = -1, int end_stage = -1);

// FAILED_PRECONDITION unless the model's input and output fit the data set.
absl::Status CheckModelFitsData(const ModelSpec& model, const Dataset& data);

// A FAILED_PRECONDITION of this process's own configuration (the model does not fit the data
// set, a CUDA backend in a CPU build) is told from the server's fence by a payload: restarting
// the worker would fail the same way, and nothing needs to wait for the server's word on it.
// MarkConfigMismatch adds the payload to a FAILED_PRECONDITION (any other status is returned as
// it is); IsConfigMismatch finds it.
absl::Status MarkConfigMismatch(absl::Status status);
bool IsConfigMismatch(const absl::Status& status);

// The compute settings of this worker: the job's, with the worker config's backend, threads and
// device when it sets them.
ComputeConfig EffectiveCompute(const JobConfig& job, const WorkerConfig& config);

}  // namespace rebound::worker
