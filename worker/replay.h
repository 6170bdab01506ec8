#pragma once

// What a spare does (docs/design.md §5.3, policy REPLAY): RunSpare long-polls the server for a replay
// task (WaitForTask), has the ReplayEngine (worker/replay_engine.h) rebuild the lost slot from its
// snapshot and logged steps, and, as the task's leader (rank 0), reports the outcome
// (ReportRecovery) and takes the slot over; the other spares of the task return to the pool. A
// task that fails is reported ABANDONED (or CHECKSUM_MISMATCH, with where the replay first
// differed) and the server hands the slot to a new task.
//
// An audit task (RecoveryTask.audit, docs/recovery.md#audits) is a live trainer's window: the
// spare replays it the same way, reports the result (ReportAudit: AUDIT_MATCHED,
// AUDIT_MISMATCHED with the mismatch, AUDIT_PREEMPTED when the agent's PREEMPT_AUDIT stopped it
// at a step, AUDIT_INCOMPLETE with the reason otherwise), keeps the data set and waits for the
// next task; it never takes a slot over, and a report that is refused or cannot be delivered is
// logged, never the end of the spare. Recoveries are never preempted.
//
// Thread-safety: RunSpare runs on the calling thread (the engine adds one sender thread for the
// role's duration). Ownership: every pointer argument is borrowed and must outlive the call.
// The data set is loaded (from `data_sets`) when the role starts, not when a trainer dies, and
// goes back to `data_sets` when the role ends without a takeover.
//
// Status codes: see RunSpare.

#include <memory>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "grpcpp/channel.h"
#include "proto/config.pb.h"
#include "worker/agent.h"
#include "worker/replay_mailbox.h"
#include "worker/slot_compute.h"

namespace rebound::worker {

// Serves replay tasks until one makes this spare the trainer of a slot: the agent then holds the
// new trainer registration and the rebuilt state is returned for RunTrainer. NOT_FOUND when the
// agent's registration changed by other means (a RESTART_FROM_CENTER takeover), CANCELLED when
// stopped, FAILED_PRECONDITION or ABORTED when the server fenced or forgot this spare and no
// new registration followed, the report's error (UNAVAILABLE on giving up) when the leader
// cannot report, the data set's load errors. `mailbox` is the one this worker's WorkerPeer
// service fills.
absl::StatusOr<std::unique_ptr<SlotCompute>> RunSpare(const WorkerConfig& config,
                                                      const Registration& registration,
                                                      const std::shared_ptr<grpc::Channel>& channel,
                                                      WorkerAgent* agent, ReplayMailbox* mailbox,
                                                      const absl::Notification& stop,
                                                      const Clock* clock, DataSetCache* data_sets);

}  // namespace rebound::worker
