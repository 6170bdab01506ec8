#include "server/shard/range_groups.h"

#include "common/security.h"
#include "common/status_macros.h"

namespace rebound::server {

absl::StatusOr<std::vector<std::unique_ptr<CenterRange::Stub>>> RangeGroupStubs(
    const ServerConfig& config) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  std::vector<std::unique_ptr<CenterRange::Stub>> stubs;
  for (int k = 1; k < config.shard().group_addresses_size(); ++k) {
    ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                     MakeChannel(config.shard().group_addresses(k), config.security(), args));
    stubs.push_back(CenterRange::NewStub(channel));
  }
  return stubs;
}

}  // namespace rebound::server
