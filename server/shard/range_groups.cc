#include "server/shard/range_groups.h"

#include <thread>

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

std::vector<absl::Status> OnEachGroup(size_t n, const std::function<absl::Status(size_t)>& fn) {
  std::vector<absl::Status> statuses(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    threads.emplace_back([&statuses, &fn, i] { statuses[i] = fn(i); });
  }
  for (std::thread& thread : threads) thread.join();
  return statuses;
}

}  // namespace rebound::server
