#pragma once

// Group 0's calls to the range groups 1..K-1 of a sharded job (docs/design.md §10.2): one channel
// each (a replicated group's entry lists its members: the channel follows its leader).
//
// Thread-safety: the stubs are thread-safe. The calls to every group go out at once through
// common/fan_out.h.
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


}  // namespace rebound::server
