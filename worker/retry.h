#pragma once

// A worker's unary RPCs to the server under the one retry policy (common/retry.h, docs/design.md
// §5.1): UNAVAILABLE and DEADLINE_EXCEEDED mean "try the same call again" after a capped,
// jittered exponential backoff of backoff_initial_ms .. backoff_max_ms, until
// give_up_after_ms pass without success or `stop` is notified. Each attempt gets a fresh
// grpc::ClientContext with a deadline of rpc_deadline_ms.
//
// Thread-safety: stateless; CallWithRetry runs on the calling thread. Ownership: `clock` and
// `stop` are borrowed for the call.
//
// A call the server cancels (CANCELLED while `stop` is not notified: a group's leader shutting
// down or fencing itself) counts as UNAVAILABLE: retried on whoever leads next.
//
// Status codes: CallWithRetry returns the call's status when it is OK or not retryable,
// UNAVAILABLE "<what> failed for <give_up_after_ms> ms: <last error>" on giving up, and
// CANCELLED "stopped" when `stop` is notified.

#include <chrono>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/grpc_status.h"
#include "common/retry.h"
#include "grpcpp/grpcpp.h"
#include "proto/config.pb.h"

namespace rebound::worker {

// The retry policy of `config` (backoff_initial_ms, backoff_max_ms, give_up_after_ms).
inline RetryPolicy WorkerRetryPolicy(const WorkerConfig& config) {
  RetryPolicy policy;
  policy.initial_backoff = absl::Milliseconds(config.backoff_initial_ms());
  policy.max_backoff = absl::Milliseconds(config.backoff_max_ms());
  policy.give_up_after = absl::Milliseconds(config.give_up_after_ms());
  return policy;
}

// A policy that only paces a loop whose caller decides when it ends (a deadline of its own, a
// neighbour's give-up): backoff `initial` .. `max`, no give-up time, no log lines.
inline RetryPolicy PacingPolicy(absl::Duration initial, absl::Duration max) {
  RetryPolicy policy;
  policy.initial_backoff = initial;
  policy.max_backoff = max;
  policy.give_up_after = absl::InfiniteDuration();
  policy.log_retries = false;
  return policy;
}

// Calls `rpc(grpc::ClientContext*)` (one attempt; returns grpc::Status) until the policy ends.
template <typename Rpc>
absl::Status CallWithRetry(const WorkerConfig& config, const Clock* clock,
                           const absl::Notification& stop, const char* what, Rpc&& rpc) {
  return Retry(WorkerRetryPolicy(config), clock, &stop, what, [&]() {
    grpc::ClientContext context;
    // gRPC deadlines are wall-clock time points.
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(config.rpc_deadline_ms()));
    absl::Status status = FromGrpcStatus(rpc(&context));
    // The server cancelled the call (a leader shutting down, a deposed one fencing itself): the
    // same call may succeed on whoever leads next. Only this worker's own stop ends the loop.
    if (status.code() == absl::StatusCode::kCancelled && !stop.HasBeenNotified()) {
      status = absl::UnavailableError(absl::StrCat("cancelled by the server: ", status.message()));
    }
    return status;
  });
}

}  // namespace rebound::worker
