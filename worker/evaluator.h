#pragma once

// The evaluator's loop (docs/design.md §4.4): every eval_every_ms it pulls the center of every stage,
// and when any stage's center version changed, measures the whole model's test loss and accuracy
// on the data set's test split and reports them (ReportEval; status shows them).
//
// Thread-safety: RunEvaluator runs on the calling thread. Ownership: `stop` and `clock` are
// borrowed and must outlive the call.
//
// Status codes: CANCELLED when `stop` is notified (its normal end); INVALID_ARGUMENT for an
// invalid job; FAILED_PRECONDITION when the model does not fit the data set or the incarnation
// is fenced; the data set's load errors; UNAVAILABLE when the server stays unreachable past
// give_up_after_ms; ABORTED when the server no longer knows the incarnation.

#include <atomic>
#include <memory>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "grpcpp/channel.h"
#include "proto/config.pb.h"
#include "worker/agent.h"

namespace rebound::worker {

// Evaluates the center until `stop`. Returns CANCELLED then. When `job_done` (may be null) is
// set by then (the server said the job is finished), it first evaluates and reports the final
// center once more, so that the last report is of the trained model.
absl::Status RunEvaluator(const WorkerConfig& config, const Registration& registration,
                          const std::shared_ptr<grpc::Channel>& channel,
                          const absl::Notification& stop, const Clock* clock,
                          const std::atomic<bool>* job_done = nullptr);

}  // namespace rebound::worker
