#pragma once

// A labelled image data set held in memory, and the assembly of a batch from sample ids.
//
// Sample ids are the indices 0..count-1 of the data set's samples. They are what the step log
// stores (docs/design.md §5.2), so a batch is always rebuilt from its ids: replaying a step calls
// AssembleBatch with the logged ids and gets bit-identical inputs.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace rebound::worker {

// `count` samples of rows x cols features each. Invariants: features == rows * cols,
// images.size() == count * features, labels.size() == count; the functions here REQUIRE them
// (every loader establishes them). Immutable once loaded; safe to share read-only between
// threads.
struct Dataset {
  int64_t count = 0;
  int32_t rows = 0;
  int32_t cols = 0;
  int64_t features = 0;        // rows * cols
  std::vector<float> images;   // count x features, row-major: sample i starts at i * features
  std::vector<uint8_t> labels;  // count class indices
};

// Writes the samples `sample_ids` of `data`, in that order, to `features` (ids.size() x
// data.features, row-major) and their labels to `labels` (ids.size()). Ids may repeat.
// Errors (INVALID_ARGUMENT, nothing is written): an id outside [0, data.count); a buffer whose
// size is not ids.size() x data.features resp. ids.size().
absl::Status AssembleBatch(const Dataset& data, absl::Span<const int64_t> sample_ids,
                           absl::Span<float> features, absl::Span<int32_t> labels);

}  // namespace rebound::worker
