#pragma once

// Group 0's calls to the range groups 1..K-1 of a sharded job (docs/design.md §10.2): one channel
// each (a replicated group's entry lists its members: the channel follows its leader), and one
// way to call them all at once.
//
// Thread-safety: the stubs are thread-safe; OnEachGroup runs `fn` on n threads at once.
// Status codes: MakeChannel's (common/security.h).

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/config.pb.h"
#include "proto/sharding.grpc.pb.h"

namespace rebound::server {

// Stubs on groups 1..K-1 (config.shard().group_addresses), in order, with the server's security.
absl::StatusOr<std::vector<std::unique_ptr<CenterRange::Stub>>> RangeGroupStubs(
    const ServerConfig& config);

// Runs fn(i) for every i in [0, n), each on a thread of its own, and returns their statuses by i.
std::vector<absl::Status> OnEachGroup(size_t n, const std::function<absl::Status(size_t)>& fn);

}  // namespace rebound::server
