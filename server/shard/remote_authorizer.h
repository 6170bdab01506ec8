#pragma once

// RemoteAuthorizer: how a sharded job's range group (group > 0) asks group 0 whether a worker's
// call may proceed (ParameterServer.AuthorizeRange, docs/design.md §10.2, docs/sharding.md). The
// worker's credential travels from the worker's call to group 0 unchanged; the range group never
// learns more than group 0's answer.
//
// Every ask has a deadline (the server's max_wait_ms, at most 5 s) and is not retried here: the
// worker's own retry policy retries its call. Group 0 may be a replicated group: its entry in
// shard.group_addresses lists its members and the channel follows its leader.
//
// Thread-safety: thread-safe (one gRPC channel). Status codes: group 0's answer (UNAUTHENTICATED,
// ABORTED, FAILED_PRECONDITION, INVALID_ARGUMENT); UNAVAILABLE when group 0 cannot be reached
// in time (retry the same call later).

#include <memory>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"

namespace rebound::server {

class RemoteAuthorizer {
 public:
  // A channel to group 0 (config.shard().group_addresses(0)) with the server's security.
  static absl::StatusOr<std::unique_ptr<RemoteAuthorizer>> Create(const ServerConfig& config);

  absl::StatusOr<AuthorizeRangeResponse> Authorize(const grpc::ServerContext* worker_call,
                                                   const AuthorizeRangeRequest& request) const;

 private:
  RemoteAuthorizer(std::unique_ptr<ParameterServer::Stub> stub, absl::Duration deadline)
      : stub_(std::move(stub)), deadline_(deadline) {}

  const std::unique_ptr<ParameterServer::Stub> stub_;
  const absl::Duration deadline_;
};

}  // namespace rebound::server
