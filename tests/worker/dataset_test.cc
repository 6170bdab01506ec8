#include "worker/data/dataset.h"

#include <vector>

#include <catch2/catch.hpp>

#include "tests/worker/test_files.h"

namespace rebound::worker {
namespace {

using ::Catch::Matchers::Contains;

// 4 samples of 2 x 3 features; feature f of sample i is 10 i + f, label of sample i is 9 - i.
Dataset SmallDataset() {
  Dataset data;
  data.count = 4;
  data.rows = 2;
  data.cols = 3;
  data.features = 6;
  for (int i = 0; i < 4; ++i) {
    for (int f = 0; f < 6; ++f) data.images.push_back(static_cast<float>(10 * i + f));
    data.labels.push_back(static_cast<uint8_t>(9 - i));
  }
  return data;
}

TEST_CASE("a batch holds the samples of its ids in the ids' order, repeats included") {
  const Dataset data = SmallDataset();
  const std::vector<int64_t> ids = {3, 0, 3, 1};
  std::vector<float> features(ids.size() * 6, -1.0f);
  std::vector<int32_t> labels(ids.size(), -1);
  REQUIRE(AssembleBatch(data, ids, absl::MakeSpan(features), absl::MakeSpan(labels)).ok());
  CHECK(features == std::vector<float>{30, 31, 32, 33, 34, 35, 0,  1,  2,  3,  4,  5,
                                       30, 31, 32, 33, 34, 35, 10, 11, 12, 13, 14, 15});
  CHECK(labels == std::vector<int32_t>{6, 9, 6, 8});
}

TEST_CASE("an empty id list assembles an empty batch") {
  const Dataset data = SmallDataset();
  CHECK(AssembleBatch(data, {}, absl::Span<float>(), absl::Span<int32_t>()).ok());
}

TEST_CASE("an out-of-range sample id is INVALID_ARGUMENT and writes nothing") {
  const Dataset data = SmallDataset();
  for (const int64_t bad : {int64_t{4}, int64_t{-1}, int64_t{1} << 40}) {
    const std::vector<int64_t> ids = {0, bad};
    std::vector<float> features(ids.size() * 6, -1.0f);
    std::vector<int32_t> labels(ids.size(), -1);
    const absl::Status status =
        AssembleBatch(data, ids, absl::MakeSpan(features), absl::MakeSpan(labels));
    INFO(status);
    CHECK(status.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(status.message()),
               Contains("sample id " + std::to_string(bad)) && Contains("[0, 4)"));
    CHECK(features == std::vector<float>(12, -1.0f));
    CHECK(labels == std::vector<int32_t>(2, -1));
  }
}

TEST_CASE("buffers of the wrong size are INVALID_ARGUMENT") {
  const Dataset data = SmallDataset();
  const std::vector<int64_t> ids = {0, 1};
  std::vector<float> short_features(11);
  std::vector<float> features(12);
  std::vector<int32_t> long_labels(3);
  std::vector<int32_t> labels(2);
  CHECK(AssembleBatch(data, ids, absl::MakeSpan(short_features), absl::MakeSpan(labels)).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(AssembleBatch(data, ids, absl::MakeSpan(features), absl::MakeSpan(long_labels)).code() ==
        absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rebound::worker
