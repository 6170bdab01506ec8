#pragma once

// The ranges of a sharded center (docs/design.md §10.2, docs/sharding.md): a stage's flattened
// (packed) parameter vector of n float32 elements split into K contiguous ranges,
//   range k = elements [RangeBegin(n, K, k), RangeBegin(n, K, k + 1)),  RangeBegin = floor(k n / K),
// so every range has floor(n / K) or ceil(n / K) elements (byte-balanced: all are float32). A pure
// function of the layout and K: every server group, trainer, spare and tool computes the same.
//
// A range travels and is stored as a one-tensor stage layout (RangeLayout): tensor id 0 named
// "stage<s>.range<k>" of shape [n_k], so the center table, the store and the tensor codec handle
// it like any stage.
//
// Thread-safety: pure functions. Status codes: INVALID_ARGUMENT for a range that would be empty
// (K > n) or arguments out of range.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "compute/model_layout.h"

namespace rebound::compute {

// REQUIRES: 0 <= k <= groups, groups >= 1, n >= 0.
inline int64_t RangeBegin(int64_t n, int groups, int k) { return n * k / groups; }

// The K + 1 boundaries RangeBegin(n, K, 0..K).
std::vector<int64_t> RangeBegins(int64_t n, int groups);

// The layout of range k of a stage of n parameters. INVALID_ARGUMENT unless 1 <= groups,
// 0 <= k < groups and the range is not empty (n >= groups).
absl::StatusOr<StageLayout> RangeLayout(int stage, int64_t n, int groups, int k);

}  // namespace rebound::compute
