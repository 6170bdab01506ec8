#pragma once

// What a spare does (DESIGN.md §5.3, policy REPLAY): it long-polls the server for a replay task,
// rebuilds the lost slot from its snapshot and logged steps, checks every step's checksum against
// the log, and (as the task's leader) reports and takes the slot over.
//
// A task has k >= 1 spares (fault_tolerance.recovery_parallelism, fewer when fewer spares are
// waiting). With k = 1 the spare replays whole steps. With k >= 2 the server gives spare r the
// tree-aligned block r of micro-batches (compute::TreeAlignedBlocks); per step each spare
// computes its block's sums and sends them to every other spare over WorkerPeer.SendPartialSum
// (an all-gather: one exchange per step), then combines the k blocks with the top of the same
// reduction tree, in the same order as every other spare, and applies the identical AdaHessian
// step: the result is bit-identical to the lost trainer's state, which every spare checks
// against the logged checksum. While the others' sums travel, each spare assembles the next
// step's batch. A peer that does not answer within the exchange bound (rpc_deadline_ms per
// step; twice that for the first step, which waits for the slowest spare's snapshot and log
// transfer), or whose port stops accepting connections, ends the task: the leader (rank 0)
// reports it ABANDONED and the server hands the slot to a new task. The leader reports success
// and takes the slot over; the other spares return to the pool.

#include <memory>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/channel.h"
#include "proto/config.pb.h"
#include "worker/agent.h"
#include "worker/replay_mailbox.h"
#include "worker/training.h"

namespace rebound::worker {

// Serves replay tasks until one makes this spare the trainer of a slot: the agent then holds the
// new trainer registration and the rebuilt state is returned for RunTrainer. NOT_FOUND when the
// agent's registration changed by other means (a RESTART_FROM_CENTER takeover), CANCELLED when
// stopped. `mailbox` is the one this worker's WorkerPeer service fills.
absl::StatusOr<std::unique_ptr<SlotCompute>> RunSpare(const WorkerConfig& config,
                                                      const Registration& registration,
                                                      const std::shared_ptr<grpc::Channel>& channel,
                                                      WorkerAgent* agent, ReplayMailbox* mailbox,
                                                      const absl::Notification& stop);

}  // namespace rebound::worker
