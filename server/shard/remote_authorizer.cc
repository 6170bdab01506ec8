#include "server/shard/remote_authorizer.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/security.h"
#include "common/status_macros.h"

namespace rebound::server {

absl::StatusOr<std::unique_ptr<RemoteAuthorizer>> RemoteAuthorizer::Create(
    const ServerConfig& config) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                   MakeChannel(config.shard().group_addresses(0), config.security(), args));
  const absl::Duration deadline =
      std::min(absl::Milliseconds(config.max_wait_ms()), absl::Seconds(5));
  return std::unique_ptr<RemoteAuthorizer>(
      new RemoteAuthorizer(ParameterServer::NewStub(channel), deadline));
}

absl::StatusOr<AuthorizeRangeResponse> RemoteAuthorizer::Authorize(
    const grpc::ServerContext* worker_call, const AuthorizeRangeRequest& request) const {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(absl::ToInt64Milliseconds(deadline_)));
  const std::string credential = MetadataValue(worker_call, kWorkerCredentialKey);
  if (!credential.empty()) context.AddMetadata(kWorkerCredentialKey, credential);
  AuthorizeRangeResponse response;
  const grpc::Status status = stub_->AuthorizeRange(&context, request, &response);
  if (status.ok()) return response;
  absl::Status error = FromGrpcStatus(status);
  if (error.code() == absl::StatusCode::kDeadlineExceeded ||
      error.code() == absl::StatusCode::kCancelled) {
    // Group 0 did not answer in time (a failover, a slow link): the worker retries its call.
    return absl::UnavailableError(
        absl::StrCat("group 0 did not authorize the call in time: ", error.message()));
  }
  return error;
}

}  // namespace rebound::server
