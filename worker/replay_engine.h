#pragma once

// ReplayEngine: rebuilds a lost slot for one replay task (docs/design.md §5.3, policy REPLAY; also a
// GLOBAL_CHECKPOINT restore, which replays nothing): it loads the task's snapshot (or its
// recovery group's), reads the logged steps (t0, tf] from the server (ReadLog), and replays them,
// comparing every step's parameter checksum with the log.
//
// With k = 1 spare it replays whole steps. With k >= 2 it computes this spare's tree-aligned
// block of micro-batches per step and all-gathers the k blocks' sums with the other spares
// (worker/partial_sum_exchange.h), then combines them along the top of the same reduction tree
// in the same order as every other spare and applies the identical AdaHessian step. The sends of
// a step run on the engine's one long-lived sender thread (worker/job_thread.h) while the
// replay's thread assembles the next step's batch and waits for the others' sums: the engine
// uses two threads whatever the number of steps or tasks.
//
// Thread-safety: one thread calls Replay at a time. Ownership: `config`, `stub`, `mailbox`,
// `stop` and `clock` are borrowed and must outlive the engine. The caller opens the mailbox for
// the task before Replay and closes it after.
//
// An audit task (RecoveryTask.audit, docs/recovery.md#audits) replays the same way: a live
// trainer's window, by one spare, rank 0 of 1; its caller reports it and takes nothing over.
//
// Status codes (Replay): INVALID_ARGUMENT for a task that is not consistent (rank and block,
// recovery group, snapshot steps) or a peer's sums of the wrong shape; DATA_LOSS when the log is
// incomplete or inconsistent, or a replayed step's checksum differs from the log's (then
// report->outcome() is CHECKSUM_MISMATCH and report->mismatch() says where); CANCELLED
// "stopped" when `stop` is notified, CANCELLED "preempted ..." when the call's
// ReplayControl::preempted says so; the exchange's codes (DEADLINE_EXCEEDED, UNAVAILABLE,
// FAILED_PRECONDITION) naming the peer; the ReadLog call's code; the compute layer's errors.

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "compute/backend.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "worker/data/fashion_mnist.h"
#include "worker/job_thread.h"
#include "worker/replay_mailbox.h"
#include "worker/slot_compute.h"

namespace rebound::worker {

// What one ReplayEngine::Replay call may add; the defaults are a recovery's.
struct ReplayControl {
  // Asked on Replay's thread before each step: true ends the replay there with CANCELLED
  // "preempted ..." (an audit whose spare a recovery needs). Null: only the engine's `stop`
  // ends a replay early.
  std::function<bool()> preempted;
  // If not null, set to true when a failed replay moved the data set back into *preloaded.
  bool* data_returned = nullptr;
};

class ReplayEngine {
 public:
  ReplayEngine(const WorkerConfig& config, ParameterServer::Stub* stub, ReplayMailbox* mailbox,
               const absl::Notification& stop, const Clock* clock);

  ReplayEngine(const ReplayEngine&) = delete;
  ReplayEngine& operator=(const ReplayEngine&) = delete;

  // Rebuilds the task's slot as spare task.rank() of task.spares_size(), on the data set
  // `*preloaded` (moved from once the slot's compute is built; moved back into it if a step then
  // fails or the replay is preempted or stopped, which `control.data_returned` tells). On success
  // `report` holds the outcome (RECOVERED), steps replayed, final checksum and phase times, and
  // the result is the slot's state at task.failed_step(), its data cursor after that step. A
  // replayed step whose checksum differs from the log's fills report->mismatch(): the step, both
  // checksums and, when the log holds each tensor's checksum (LogRecord.tensor_checksums), the
  // index (id order) and name of the first tensor that differs (else index -1, no name).
  absl::StatusOr<std::unique_ptr<SlotCompute>> Replay(const JobConfig& job,
                                                      const RecoveryTask& task,
                                                      uint64_t incarnation,
                                                      FashionMnist* preloaded,
                                                      ReportRecoveryRequest* report,
                                                      const ReplayControl& control = {});

 private:
  struct TaskReplay;  // one task's state (replay_engine.cc)

  // The logged steps in order, `*replayed` counting those done; stops early on `stop_` or
  // `control.preempted`.
  absl::Status ReplaySteps(TaskReplay& r, const ReplayControl& control,
                           ReportRecoveryRequest* report, int64_t* replayed);

  // Checks the task, builds the compute of the replayed stages, loads their snapshots, reads
  // the logged steps and, for k >= 2, sets up the exchange and the accumulators.
  absl::StatusOr<std::unique_ptr<TaskReplay>> Prepare(const JobConfig& job,
                                                      const RecoveryTask& task,
                                                      uint64_t incarnation,
                                                      FashionMnist* preloaded);
  // Logged step i (the `replayed`-th): loads its batch, computes this spare's sums, combines
  // them with the others' (k >= 2), applies the step and compares the checksum with the log.
  absl::Status ReplayStep(TaskReplay& r, size_t i, int64_t replayed,
                          ReportRecoveryRequest* report);
  // Loads step i's batch (k >= 2: this spare's block, unless prefetched) and its logged
  // boundary inputs.
  absl::Status LoadStep(TaskReplay& r, size_t i);
  // k >= 2: publishes and sends this spare's sums of step t (on the sender thread), prefetches
  // the next step's block, gathers the others' sums and replaces `sums` by the combined ones.
  absl::Status ExchangeSums(TaskReplay& r, size_t i, int64_t t, bool first,
                            std::vector<compute::ConstDSpan>* sums);
  // A recovery group's replay: the lost stage's state alone, as the slot's compute.
  absl::Status KeepLostStage(TaskReplay& r, ReportRecoveryRequest* report);

  const WorkerConfig& config_;
  ParameterServer::Stub* const stub_;
  ReplayMailbox* const mailbox_;
  const absl::Notification& stop_;
  const Clock* const clock_;
  JobThread sender_;  // sends each step's partial sums while the replay goes on
};

}  // namespace rebound::worker
