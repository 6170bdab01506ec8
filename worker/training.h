#pragma once

// The work of a registered trainer (docs/design.md §4.4, §4.6, §5.1): RunTrainer builds (or takes
// over) the slot's compute state and trains it to max_steps in the job's mode:
//
// * EASGD (§4.4): worker/easgd_trainer.h.
// * ASYNC_ADAHESSIAN (§4.6): pulls the center at the start and loads it into the local
//   parameters; each step t computes the gradient g and Hessian diagonal D of the slot's next
//   batch at the local parameters without updating them (compute::LocalTrainer::
//   ComputeGradients) and Pushes them with sequence number t, retried like a Sync (a retried
//   push is answered applied: false and changes nothing); every sync_period steps (and at
//   max_steps) it pulls the center again. The center is the replica: no step log, no snapshot.
//
// The evaluator's loop is worker/evaluator.h; a spare's, worker/replay.h.
//
// Thread-safety: RunTrainer runs on the calling thread. Ownership: every pointer argument is
// borrowed and must outlive the call; `resumed` is taken. Whatever ends the role, the data set
// goes back to `data_sets` for the next role of the process.
//
// Status codes: OK when the slot reached max_steps (or drained); CANCELLED when `stop` is
// notified; FAILED_PRECONDITION when the incarnation is fenced (or the model does not fit the
// data set); ABORTED when the server no longer knows the incarnation; UNAVAILABLE when the
// server stays unreachable past give_up_after_ms; INVALID_ARGUMENT for an invalid job or an
// update the server refuses as invalid; INTERNAL when a loss is not finite; DEADLINE_EXCEEDED
// when a pipeline neighbour stays silent past give_up_after_ms.

#include <memory>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "grpcpp/channel.h"
#include "proto/config.pb.h"
#include "worker/agent.h"
#include "worker/injected_faults.h"
#include "worker/pipeline_port.h"
#include "worker/slot_compute.h"

namespace rebound::worker {

// Trains the registered slot to max_steps, in the job's mode (see above).
// Mode EASGD: `resumed` (optional) is the slot's state rebuilt by a replay at
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
                        const absl::Notification& stop, const Clock* clock,
                        DataSetCache* data_sets, const InjectedFaults& faults = {},
                        std::unique_ptr<SlotCompute> resumed = nullptr,
                        PipelinePort* port = nullptr);

}  // namespace rebound::worker
