#include "worker/data/fashion_mnist.h"

#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "tests/worker/test_files.h"
#include "worker/data/dataset.h"
#include "worker/data/idx_reader.h"

namespace rebound::worker {
namespace {

using ::Catch::Matchers::Contains;
using testing::Gzip;
using testing::IdxBytes;
using testing::kDebianFashionMnistDir;
using testing::PatternBytes;
using testing::TempPath;
using testing::WriteFile;

// The full data set, loaded once for all test cases of this binary.
const FashionMnist& DebianFashionMnist() {
  static const FashionMnist* const data = [] {
    DataConfig config;  // dataset_dir defaults to the Debian directory
    absl::StatusOr<FashionMnist> loaded = LoadFashionMnist(config);
    INFO(loaded.status());
    REQUIRE(loaded.ok());
    return new FashionMnist(std::move(*loaded));
  }();
  return *data;
}

// The raw training pixels and labels, decoded independently of the code under test.
const std::string& RawTrainImages() {
  static const std::string* const raw = new std::string(testing::GunzipFile(
      std::string(kDebianFashionMnistDir) + "/" + kFashionMnistTrainImages));
  return *raw;
}

uint8_t RawTrainPixel(int64_t sample, int64_t feature) {
  return static_cast<uint8_t>(RawTrainImages()[16 + sample * 784 + feature]);
}

// Writes a synthetic data set directory: `train` and `test` samples of 2 x 3 pixels, label
// files with `train_labels` and `test_labels` entries.
std::string WriteSyntheticDir(const std::string& name, uint32_t train, uint32_t train_labels,
                              uint32_t test, uint32_t test_labels, uint32_t test_cols = 3) {
  const std::string dir = TempPath(name);
  REQUIRE((::mkdir(dir.c_str(), 0755) == 0 || errno == EEXIST));
  WriteFile(dir + "/" + kFashionMnistTrainImages,
            Gzip(IdxBytes(kIdxImagesMagic, {train, 2, 3}, PatternBytes(train * 6, 256))));
  WriteFile(dir + "/" + kFashionMnistTrainLabels,
            Gzip(IdxBytes(kIdxLabelsMagic, {train_labels}, PatternBytes(train_labels, 10))));
  WriteFile(dir + "/" + kFashionMnistTestImages,
            Gzip(IdxBytes(kIdxImagesMagic, {test, 2, test_cols},
                          PatternBytes(test * 2 * test_cols, 256, 1))));
  WriteFile(dir + "/" + kFashionMnistTestLabels,
            Gzip(IdxBytes(kIdxLabelsMagic, {test_labels}, PatternBytes(test_labels, 10, 3))));
  return dir;
}

TEST_CASE("pixels are normalised by the Fashion-MNIST mean and standard deviation") {
  CHECK(NormalizeFashionMnistPixel(0) == (0.0f - 0.2860f) / 0.3530f);
  CHECK(NormalizeFashionMnistPixel(255) == (1.0f - 0.2860f) / 0.3530f);
  CHECK(NormalizeFashionMnistPixel(200) == Approx((200.0 / 255.0 - 0.2860) / 0.3530).epsilon(1e-6));
  CHECK(NormalizeFashionMnistPixel(73) == Approx((73.0 / 255.0 - 0.2860) / 0.3530).margin(1e-6));
}

TEST_CASE("the Debian data set loads as 60000 training and 10000 test samples of 784 features") {
  const FashionMnist& data = DebianFashionMnist();
  for (const Dataset* split : {&data.train, &data.test}) {
    CHECK(split->rows == 28);
    CHECK(split->cols == 28);
    CHECK(split->features == 784);
    CHECK(split->images.size() == static_cast<size_t>(split->count) * 784);
    CHECK(split->labels.size() == static_cast<size_t>(split->count));
  }
  CHECK(data.train.count == 60000);
  CHECK(data.test.count == 10000);
  CHECK(std::vector<uint8_t>(data.train.labels.begin(), data.train.labels.begin() + 4) ==
        std::vector<uint8_t>{9, 0, 0, 3});
  CHECK(std::vector<uint8_t>(data.test.labels.begin(), data.test.labels.begin() + 4) ==
        std::vector<uint8_t>{9, 2, 1, 1});
  std::array<int, 10> histogram{};
  for (uint8_t label : data.train.labels) ++histogram[label];
  CHECK(histogram == std::array<int, 10>{6000, 6000, 6000, 6000, 6000, 6000, 6000, 6000, 6000,
                                         6000});
}

TEST_CASE("every loaded training feature is its raw pixel normalised") {
  const Dataset& train = DebianFashionMnist().train;
  REQUIRE(RawTrainImages().size() == 16 + train.images.size());
  int64_t mismatches = 0;
  for (size_t i = 0; i < train.images.size(); ++i) {
    const float expected =
        NormalizeFashionMnistPixel(static_cast<uint8_t>(RawTrainImages()[16 + i]));
    if (train.images[i] != expected) ++mismatches;
  }
  CHECK(mismatches == 0);
}

TEST_CASE("the normalised training features have mean about 0 and deviation about 1") {
  const Dataset& train = DebianFashionMnist().train;
  double sum = 0.0;
  double sum_squares = 0.0;
  for (float x : train.images) {
    sum += x;
    sum_squares += static_cast<double>(x) * x;
  }
  const double n = static_cast<double>(train.images.size());
  const double mean = sum / n;
  const double deviation = std::sqrt(sum_squares / n - mean * mean);
  CHECK(std::abs(mean) < 1e-3);
  CHECK(std::abs(deviation - 1.0) < 1e-3);
}

TEST_CASE("a batch assembled from sample ids holds those samples of the Debian training set") {
  const Dataset& train = DebianFashionMnist().train;
  const std::vector<int64_t> ids = {59999, 0, 12345, 0};
  std::vector<float> features(ids.size() * 784);
  std::vector<int32_t> labels(ids.size());
  REQUIRE(AssembleBatch(train, ids, absl::MakeSpan(features), absl::MakeSpan(labels)).ok());
  for (size_t b = 0; b < ids.size(); ++b) {
    INFO("batch row " << b << ", sample " << ids[b]);
    CHECK(labels[b] == train.labels[ids[b]]);
    for (int f = 0; f < 784; f += 37) {
      CHECK(features[b * 784 + f] == NormalizeFashionMnistPixel(RawTrainPixel(ids[b], f)));
    }
  }
  CHECK(labels[1] == 9);
  CHECK(labels[3] == 9);
}

TEST_CASE("train_limit and test_limit keep the first samples") {
  DataConfig config;
  config.set_train_limit(1000);
  config.set_test_limit(500);
  const absl::StatusOr<FashionMnist> limited = LoadFashionMnist(config);
  REQUIRE(limited.ok());
  const FashionMnist& full = DebianFashionMnist();
  CHECK(limited->train.count == 1000);
  CHECK(limited->test.count == 500);
  CHECK(limited->train.images.size() == 1000u * 784);
  CHECK(limited->test.labels.size() == 500);
  CHECK(std::equal(limited->train.images.begin(), limited->train.images.end(),
                   full.train.images.begin()));
  CHECK(std::equal(limited->test.labels.begin(), limited->test.labels.end(),
                   full.test.labels.begin()));
}

TEST_CASE("a limit above the sample count or below zero is INVALID_ARGUMENT") {
  const std::string dir = WriteSyntheticDir("limits", 5, 5, 4, 4);
  DataConfig config;
  config.set_dataset_dir(dir);
  config.set_train_limit(6);
  absl::StatusOr<FashionMnist> data = LoadFashionMnist(config);
  CHECK(data.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(data.status().message()),
             Contains(kFashionMnistTrainImages) && Contains("limit 6"));

  config.set_train_limit(0);
  config.set_test_limit(-1);
  data = LoadFashionMnist(config);
  CHECK(data.status().code() == absl::StatusCode::kInvalidArgument);

  config.set_train_limit(5);
  config.set_test_limit(4);
  data = LoadFashionMnist(config);
  REQUIRE(data.ok());
  CHECK(data->train.count == 5);
  CHECK(data->test.count == 4);
  CHECK(data->train.features == 6);
  CHECK(data->train.images[7] == NormalizeFashionMnistPixel(49));  // pattern byte 7 * 7 mod 256
  CHECK(data->test.labels[2] == (2 * 7 + 3) % 10);
}

TEST_CASE("image and label files with different counts are INVALID_ARGUMENT naming both") {
  const std::string dir = WriteSyntheticDir("mismatch", 5, 4, 4, 4);
  DataConfig config;
  config.set_dataset_dir(dir);
  const absl::StatusOr<FashionMnist> data = LoadFashionMnist(config);
  INFO(data.status());
  CHECK(data.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(data.status().message()),
             Contains(dir + "/" + kFashionMnistTrainImages) && Contains("5 images") &&
                 Contains(dir + "/" + kFashionMnistTrainLabels) && Contains("4 labels"));
}

TEST_CASE("train and test images of different shapes are INVALID_ARGUMENT") {
  const std::string dir = WriteSyntheticDir("shapes", 5, 5, 4, 4, /*test_cols=*/2);
  DataConfig config;
  config.set_dataset_dir(dir + "/");
  const absl::StatusOr<FashionMnist> data = LoadFashionMnist(config);
  CHECK(data.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(data.status().message()), Contains("2 x 3") && Contains("2 x 2"));
}

TEST_CASE("a data set directory without the files is NOT_FOUND naming the missing file") {
  DataConfig config;
  config.set_dataset_dir(TempPath("no-such-dir"));
  const absl::StatusOr<FashionMnist> data = LoadFashionMnist(config);
  CHECK(data.status().code() == absl::StatusCode::kNotFound);
  CHECK_THAT(std::string(data.status().message()),
             Contains(TempPath("no-such-dir") + "/" + kFashionMnistTrainImages));
}

TEST_CASE("a corrupt test labels file fails the whole load with DATA_LOSS naming it") {
  const std::string dir = WriteSyntheticDir("corrupt-test-labels", 5, 5, 4, 4);
  const std::string path = dir + "/" + kFashionMnistTestLabels;
  const std::string gz = testing::ReadFile(path);
  WriteFile(path, gz.substr(0, gz.size() - 1));
  DataConfig config;
  config.set_dataset_dir(dir);
  const absl::StatusOr<FashionMnist> data = LoadFashionMnist(config);
  CHECK(data.status().code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(std::string(data.status().message()), Contains(path));
}

}  // namespace
}  // namespace rebound::worker
