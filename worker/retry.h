#pragma once

// Retrying a worker's unary RPCs to the server (DESIGN.md §5.1: UNAVAILABLE and
// DEADLINE_EXCEEDED mean "try the same call again").

#include <chrono>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/backoff.h"
#include "common/grpc_status.h"
#include "grpcpp/grpcpp.h"
#include "proto/config.pb.h"
#include <glog/logging.h>

namespace rebound::worker {

inline bool Retryable(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded;
}

// Calls `rpc` (one attempt with a fresh context and deadline) until it succeeds, fails for good,
// `stop` is notified or give_up_after_ms pass without success.
template <typename Rpc>
absl::Status CallWithRetry(const WorkerConfig& config, const absl::Notification& stop,
                           const char* what, Rpc rpc) {
  Backoff backoff(absl::Milliseconds(config.backoff_initial_ms()),
                  absl::Milliseconds(config.backoff_max_ms()), absl::ToUnixNanos(absl::Now()));
  const absl::Time give_up = absl::Now() + absl::Milliseconds(config.give_up_after_ms());
  while (true) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(config.rpc_deadline_ms()));
    const absl::Status status = FromGrpcStatus(rpc(&context));
    if (status.ok() || !Retryable(status.code())) return status;
    if (absl::Now() >= give_up) {
      return absl::UnavailableError(absl::StrCat(what, " failed for ", config.give_up_after_ms(),
                                                 " ms: ", status.message()));
    }
    const absl::Duration delay = backoff.Next();
    LOG(WARNING) << what << " failed (" << status << "); retrying in "
                 << absl::ToInt64Milliseconds(delay) << " ms";
    if (stop.WaitForNotificationWithTimeout(delay)) {
      return absl::CancelledError("stopped");
    }
  }
}

}  // namespace rebound::worker
