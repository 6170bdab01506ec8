#pragma once

// FanOut: one call per part at once, for everything that talks to a sharded center's K groups:
// group 0's calls to the range groups (server/shard: checkpoints, the range check, exports) and
// a worker's calls to every range (worker/range_client.h). The K calls of one operation go out
// together so that its latency is the slowest group's, not their sum.
//
// Thread-safety: FanOut runs `fn` on n threads at once (one each), and returns after every one
// returned; `fn` must be safe to call concurrently for different i. Each call bounds itself
// (its RPC deadline, its retry cap): FanOut adds no bound of its own.
// Status codes: FirstFailure returns the first failed status by index, its code unchanged.

#include <cstddef>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace rebound {

// Runs fn(i) for every i in [0, n), each on a thread of its own, and returns their statuses by i.
std::vector<absl::Status> FanOut(size_t n, const std::function<absl::Status(size_t)>& fn);

// OK when every status is; otherwise the first failure by index i, as "<what> i: <message>".
absl::Status FirstFailure(const std::vector<absl::Status>& statuses, absl::string_view what);

}  // namespace rebound
