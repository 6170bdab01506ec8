#include "worker/data/fashion_mnist.h"

#include <array>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "worker/data/idx_reader.h"

namespace rebound::worker {
namespace {

std::string JoinPath(const std::string& dir, const char* file) {
  if (dir.empty() || dir.back() == '/') return dir + file;
  return dir + "/" + file;
}

}  // namespace

float NormalizeFashionMnistPixel(uint8_t pixel) {
  return (static_cast<float>(pixel) / 255.0f - kFashionMnistMean) / kFashionMnistStd;
}

absl::StatusOr<Dataset> LoadIdxDataset(const std::string& images_path,
                                       const std::string& labels_path, int64_t limit) {
  ASSIGN_OR_RETURN(IdxImages images, ReadIdxImages(images_path));
  ASSIGN_OR_RETURN(std::vector<uint8_t> labels,
                   ReadIdxLabels(labels_path, kFashionMnistClasses));
  const int64_t label_count = static_cast<int64_t>(labels.size());
  if (images.count != label_count) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s holds %d images but %s holds %d labels", images_path, images.count,
                        labels_path, label_count));
  }
  if (limit < 0 || limit > images.count) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: sample limit %d is outside [0, %d] (0 = all samples)", images_path, limit,
        images.count));
  }
  const int64_t count = limit == 0 ? images.count : limit;

  std::array<float, 256> normalized;
  for (int p = 0; p < 256; ++p) normalized[p] = NormalizeFashionMnistPixel(static_cast<uint8_t>(p));

  Dataset data;
  data.count = count;
  data.rows = images.rows;
  data.cols = images.cols;
  data.features = int64_t{images.rows} * images.cols;
  data.images.resize(count * data.features);
  for (size_t i = 0; i < data.images.size(); ++i) data.images[i] = normalized[images.pixels[i]];
  labels.resize(count);
  data.labels = std::move(labels);
  return data;
}

absl::StatusOr<FashionMnist> LoadFashionMnist(const DataConfig& config) {
  const std::string& dir = config.dataset_dir();
  FashionMnist result;
  ASSIGN_OR_RETURN(result.train, LoadIdxDataset(JoinPath(dir, kFashionMnistTrainImages),
                                                JoinPath(dir, kFashionMnistTrainLabels),
                                                config.train_limit()));
  ASSIGN_OR_RETURN(result.test, LoadIdxDataset(JoinPath(dir, kFashionMnistTestImages),
                                               JoinPath(dir, kFashionMnistTestLabels),
                                               config.test_limit()));
  if (result.train.rows != result.test.rows || result.train.cols != result.test.cols) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s has %d x %d images but %s has %d x %d", JoinPath(dir, kFashionMnistTrainImages),
        result.train.rows, result.train.cols, JoinPath(dir, kFashionMnistTestImages),
        result.test.rows, result.test.cols));
  }
  return result;
}

}  // namespace rebound::worker
