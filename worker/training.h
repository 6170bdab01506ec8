#pragma once

// The work a registered worker does for its role (DESIGN.md §4.4, §5.1):
//
// * TrainerLoop: local AdaHessian steps on the slot's data shard; every sync_period steps (and at
//   max_steps) an EASGD Sync with the server, retried with capped exponential backoff across
//   server unavailability (a retried Sync is recognised by the server and answered with the
//   stored post-sync state, so it is applied once); the reply's c_before moves the local
//   parameters with the same kernel the server used, so the worker's state after the sync is
//   bit-identical to the snapshot the server stored.
// * EvaluatorLoop: pulls the center every eval_every_ms, measures test loss and accuracy, and
//   reports them (visible in status).
//
// Both stop when `stop` is notified (returning CANCELLED), when the incarnation is fenced
// (FAILED_PRECONDITION) or when the server stays unreachable past give_up_after_ms (UNAVAILABLE).

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/channel.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "worker/agent.h"
#include "worker/data/dataset.h"

namespace rebound::worker {

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
};

// Trains the registered slot to max_steps. OK when done.
absl::Status RunTrainer(const WorkerConfig& config, const Registration& registration,
                        const std::shared_ptr<grpc::Channel>& channel, WorkerAgent* agent,
                        const absl::Notification& stop, const InjectedFaults& faults = {});

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
