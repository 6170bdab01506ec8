#pragma once

// EasgdTrainer: the trainer of mode EASGD (docs/design.md §4.4, §5.2). Local AdaHessian steps on the
// slot's data shard; every sync_period steps (and at max_steps) an EASGD Sync with the server,
// retried under the worker's retry policy across server unavailability (a retried Sync is
// recognised by the server and answered with the stored post-sync state, so it is applied
// once); the reply's c_before moves the local parameters with the same kernel the server used,
// so the worker's state after the sync is bit-identical to the snapshot the server stored. Under
// recovery policy REPLAY each step is logged (worker/step_logger.h). With stages > 1 each step
// exchanges boundary pairs with the neighbouring stages (worker/pipeline.h).
//
// The steps of Run(), in order: Open (step logger, pipeline exchange, FLUSH_LOG hooks), Start
// (RESTART_FROM_CENTER pulls the center; a replayed slot does the sync its lost trainer owed),
// then per step TrainStep, LogStep and, at a sync step, Sync; Finish flushes the log and, in a
// pipeline, lingers for the neighbours until the job ends. An injected bit flip
// (InjectedFaults::flip_bit_at_step) falls between TrainStep and LogStep.
//
// Thread-safety: one thread calls Run(), once. Ownership: `agent`, `stop`, `clock`, `compute`
// and `port` are borrowed and must outlive the trainer; the trainer owns its step logger and
// pipeline exchange and clears the hooks it set on the agent and the port when destroyed.
//
// Status codes (Run): OK when the slot reached max_steps or drained; CANCELLED when `stop` was
// notified; FAILED_PRECONDITION when the incarnation is fenced; ABORTED when the server no
// longer knows it; UNAVAILABLE when the server stays unreachable past give_up_after_ms;
// INVALID_ARGUMENT when the server refuses an update as invalid; INTERNAL when a loss is not
// finite; DEADLINE_EXCEEDED when a pipeline neighbour stays silent past give_up_after_ms.

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/types/span.h"
#include "common/clock.h"
#include "grpcpp/channel.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "worker/agent.h"
#include "worker/injected_faults.h"
#include "worker/pipeline.h"
#include "worker/pipeline_port.h"
#include "worker/progress_line.h"
#include "worker/slot_compute.h"
#include "worker/step_logger.h"

namespace rebound::worker {

class EasgdTrainer {
 public:
  // `replayed`: `compute` holds the slot's state rebuilt by a replay at
  // registration.start_step; otherwise it holds the model's initialisation (start_step 0) or is
  // restarted from the center (start_step > 0, RESTART_FROM_CENTER). `port` is required when
  // the job has stages > 1.
  EasgdTrainer(const WorkerConfig& config, const Registration& registration,
               std::shared_ptr<grpc::Channel> channel, WorkerAgent* agent,
               const absl::Notification& stop, const Clock* clock, const InjectedFaults& faults,
               SlotCompute* compute, bool replayed, PipelinePort* port);
  ~EasgdTrainer();

  EasgdTrainer(const EasgdTrainer&) = delete;
  EasgdTrainer& operator=(const EasgdTrainer&) = delete;

  // Trains the slot from registration.start_step + 1 to max_steps (see the file comment).
  absl::Status Run();

 private:
  // The step logger (REPLAY with step_log.enabled), the pipeline exchange and the FLUSH_LOG
  // hooks of the agent and the port.
  absl::Status Open();
  // RESTART_FROM_CENTER: the slot restarts from the current center with fresh optimizer state
  // at the data position it had reached at its last sync. A replayed slot whose lost trainer
  // had done step start_step but whose sync was not applied does that sync.
  absl::Status Start();
  // Step t on the batch `ids` (alone, or through the pipeline); its loss (NaN on a stage
  // without the loss).
  absl::StatusOr<float> TrainStep(int64_t t, absl::Span<const int64_t> ids);
  // Step t's records (stage 0: its micro-batches' sample ids; every stage: the checksum and,
  // in a job with audits, each tensor's).
  absl::Status LogStep(int64_t t, absl::Span<const int64_t> ids);
  // Appends records, waiting out back-pressure up to give_up_after_ms: a record that is
  // skipped would leave a hole that caps what replay can rebuild. Per step: one AppendAll,
  // without a retry loop unless the buffer stays full for a second.
  // --fault_die_after_logged_step: flushes the step log, then SIGKILLs this process.
  void DieAfterLogged(int64_t t);
  absl::Status AppendToLog(std::vector<LogRecord> records);
  // The EASGD exchange after step t (§4.4): sends x and the optimizer state, moves x toward the
  // center with the reply's c_before (or takes the stored post-sync state of a retried sync).
  absl::Status Sync(int64_t t, float loss);
  // After the last step: flushes the log; a pipeline stage stays for its neighbours.
  void Finish();

  const WorkerConfig& config_;
  const Registration& registration_;
  const JobConfig& job_;
  const SlotId slot_;
  const std::shared_ptr<grpc::Channel> channel_;
  WorkerAgent* const agent_;
  const absl::Notification& stop_;
  const Clock* const clock_;
  const InjectedFaults faults_;
  SlotCompute* const compute_;
  const bool replayed_;
  PipelinePort* const port_;
  const int64_t max_steps_;
  const int tau_;
  std::unique_ptr<ParameterServer::Stub> stub_;
  ProgressLine progress_;
  std::optional<double> last_weight_;  // of the last sync; none before it
  std::vector<int32_t> label_map_;
  int64_t resets_ = 0;
  // Destroyed after the pipeline (declared first).
  std::shared_ptr<StepLogger> step_logger_;
  std::unique_ptr<PipelineExchange> pipeline_;
  bool hooks_set_ = false;
  std::vector<float> x_, m_, v_, d_;  // parameters and optimizer state, packed, reused
};

}  // namespace rebound::worker
