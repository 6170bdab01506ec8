#include "worker/data/dataset.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace rebound::worker {

absl::Status AssembleBatch(const Dataset& data, absl::Span<const int64_t> sample_ids,
                           absl::Span<float> features, absl::Span<int32_t> labels) {
  const int64_t n = static_cast<int64_t>(sample_ids.size());
  if (static_cast<int64_t>(features.size()) != n * data.features) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "feature buffer holds %d floats, %d sample ids x %d features need %d", features.size(), n,
        data.features, n * data.features));
  }
  if (static_cast<int64_t>(labels.size()) != n) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "label buffer holds %d labels, %d sample ids need as many", labels.size(), n));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (sample_ids[i] < 0 || sample_ids[i] >= data.count) {
      return absl::InvalidArgumentError(
          absl::StrFormat("sample id %d (position %d of the batch) is outside [0, %d)",
                          sample_ids[i], i, data.count));
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = sample_ids[i];
    const float* source = data.images.data() + id * data.features;
    std::copy(source, source + data.features, features.data() + i * data.features);
    labels[i] = data.labels[id];
  }
  return absl::OkStatus();
}

}  // namespace rebound::worker
