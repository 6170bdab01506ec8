#pragma once

// The work a registered worker does for its role (DESIGN.md §4.4, §5.1):
//
// * RunTrainer, mode EASGD (§4.4): local AdaHessian steps on the slot's data shard; every
//   sync_period steps (and at max_steps) an EASGD Sync with the server, retried with capped
//   exponential backoff across server unavailability (a retried Sync is recognised by the server
//   and answered with the stored post-sync state, so it is applied once); the reply's c_before
//   moves the local parameters with the same kernel the server used, so the worker's state after
//   the sync is bit-identical to the snapshot the server stored. Each step is logged (§5.2).
// * RunTrainer, mode ASYNC_ADAHESSIAN (§4.6): pulls the center at the start and loads it into
//   the local parameters; each step t computes the gradient g and Hessian diagonal D of the
//   slot's next batch at the local parameters without updating them
//   (compute::LocalTrainer::ComputeGradients) and Pushes them with sequence number t, retried
//   like a Sync (a retried push is answered applied: false and changes nothing); every
//   sync_period steps (and at max_steps) it pulls the center again. The center is the replica:
//   no step log, no snapshot.
// * EvaluatorLoop: pulls the center every eval_every_ms, measures test loss and accuracy, and
//   reports them (visible in status).
//
// Both stop when `stop` is notified (returning CANCELLED), when the incarnation is fenced
// (FAILED_PRECONDITION) or when the server stays unreachable past give_up_after_ms (UNAVAILABLE).

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/channel.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "worker/agent.h"
#include "compute/backend.h"
#include "compute/step.h"
#include "worker/data/dataset.h"
#include "worker/data/fashion_mnist.h"
#include "worker/data/shard_sampler.h"

namespace rebound::worker {

class PipelinePort;

// Faults a trainer can inject into itself, for the weighting benchmark and chaos tests only
// (docs/operations.md): they model a machine that computes on corrupted data, and a naive
// supervisor that restarts a trainer from scratch.
struct InjectedFaults {
  // Non-zero: every label y of the trainer's batches becomes perm[y], perm a fixed random
  // permutation of the classes drawn from this seed (silent data corruption).
  uint64_t label_permutation_seed = 0;
  // Non-zero: every this many steps the trainer drops its parameters and optimizer state and
  // starts again from fresh random parameters.
  int64_t reset_every_steps = 0;
  // Non-zero: a byzantine trainer (issue R9). Every sync (push) from this step on carries
  // `poison_value` with alternating signs (+, -, +, ...) in place of every parameter (of every
  // g and D element); the server must refuse it, and the trainer then exits.
  int64_t poison_from_step = 0;
  float poison_value = 3.4e38f;
};

// The compute state of one slot's trainer: its data, backend, model, optimizer and data cursor.
// Built fresh (the model's deterministic initialisation), or rebuilt by Replay.
struct SlotCompute {
  FashionMnist data;
  std::unique_ptr<compute::Backend> backend;
  std::unique_ptr<compute::LocalTrainer> trainer;
  std::unique_ptr<ShardSampler> sampler;
  std::vector<float> images;   // one batch, reused
  std::vector<int32_t> labels;

  // Loads the data set (unless `preloaded` is given, which is then moved from) and builds the
  // model of `slot` (its stage's layers when S > 1) from its initialisation.
  // With first_stage >= 0 the model holds stages [first_stage, end_stage) of the slot's replica
  // instead (a replay of a recovery group).
  static absl::StatusOr<std::unique_ptr<SlotCompute>> Create(const WorkerConfig& config,
                                                             const JobConfig& job,
                                                             const SlotId& slot,
                                                             FashionMnist* preloaded = nullptr,
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

// The data set a role of this process loaded, kept for the next role when this one ends (a
// trainer rolled back under GLOBAL_CHECKPOINT, or registering again after a server restart,
// comes back as a spare: reading and decoding the data set again would cost it seconds). One set
// at most, moved in and out, never copied.
void StashDataSet(const DataConfig& config, FashionMnist data);
// The stashed set if it was loaded with an equal `config`.
std::optional<FashionMnist> TakeStashedDataSet(const DataConfig& config);
// TakeStashedDataSet, or LoadFashionMnist.
absl::StatusOr<FashionMnist> LoadDataSet(const DataConfig& config);

// Trains the registered slot to max_steps, in the job's mode (see above). OK when done.
// Mode EASGD: `resumed` (optional) is the slot's state rebuilt by Replay at
// registration.start_step; without it the trainer starts from the model's initialisation
// (start_step 0) or from the center (start_step > 0, RESTART_FROM_CENTER).
// Mode ASYNC_ADAHESSIAN: the trainer always starts from the center, at step start_step + 1 of its
// data (`resumed` only saves loading the data set again). Push sequence = step: the slot pushes
// once per step from step 1, so its applied sequence is its last applied step, which a takeover's
// start_step carries; if start_step lags behind it, the first push is answered applied: false
// with the applied sequence and the trainer skips ahead to it (with a fresh pull of the center).
// Stages > 1 (worker/pipeline.h): `port` is this worker's WorkerPeer port (required then); the
// stage exchanges pairs with its neighbours every step and syncs with its stage's center.
absl::Status RunTrainer(const WorkerConfig& config, const Registration& registration,
                        const std::shared_ptr<grpc::Channel>& channel, WorkerAgent* agent,
                        const absl::Notification& stop, const InjectedFaults& faults = {},
                        std::unique_ptr<SlotCompute> resumed = nullptr,
                        PipelinePort* port = nullptr);

// Evaluates the center until `stop`. Returns CANCELLED then.
absl::Status RunEvaluator(const WorkerConfig& config, const Registration& registration,
                          const std::shared_ptr<grpc::Channel>& channel,
                          const absl::Notification& stop);

// FAILED_PRECONDITION unless the model's input and output fit the data set.
absl::Status CheckModelFitsData(const ModelSpec& model, const Dataset& data);

// The compute settings of this worker: the job's, with the worker config's backend, threads and
// device when it sets them.
ComputeConfig EffectiveCompute(const JobConfig& job, const WorkerConfig& config);

}  // namespace rebound::worker
