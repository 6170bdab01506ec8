#pragma once

// The trainer's and the evaluator's calls about the center (docs/design.md §4.4, §4.6): PullCenter
// reads a stage's center from the server under the worker's retry policy (worker/retry.h) and
// checks its shape; RefusedUpdate turns the server's refusal of an update into the trainer's
// end.
//
// Thread-safety: stateless; the stub is used from the calling thread only for the call.
// Ownership: `clock`, `stop` and `stub` are borrowed for the call.
//
// Status codes: PullCenter returns the retried call's status (see worker/retry.h: UNAVAILABLE on
// giving up, CANCELLED when stopped, FAILED_PRECONDITION when fenced, ABORTED when the server no
// longer knows the incarnation) or INVALID_ARGUMENT when the center does not hold exactly the
// tensors of `layout`. RefusedUpdate returns `status` unchanged unless it is INVALID_ARGUMENT,
// which it returns as INVALID_ARGUMENT "<what> of step <t> refused: ...".

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "compute/model_layout.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "worker/range_client.h"

namespace rebound::worker {

// The center of stage `stage_index`, as incarnation `incarnation` sees it. A sharded job's
// (`ranges` not null): gathered from its K server groups (RangeClient::Pull).
absl::StatusOr<PullResponse> PullCenter(const WorkerConfig& config, const Clock* clock,
                                        const absl::Notification& stop,
                                        ParameterServer::Stub* stub, uint64_t incarnation,
                                        int stage_index, const compute::StageLayout& layout,
                                        const RangeClient* ranges = nullptr);

// The trainer's end when the server refuses its update (`what`: "sync" or "push") of step t as
// invalid (malformed, non-finite, or breaking the center's integrity): retrying would send the
// same state again, so it stops (logged at ERROR).
absl::Status RefusedUpdate(const char* what, int64_t t, const absl::Status& status);

}  // namespace rebound::worker
