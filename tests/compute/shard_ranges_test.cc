// The ranges of a sharded center (compute/shard_ranges.h): contiguous, covering, byte-balanced,
// a pure function of n and K.

#include "compute/shard_ranges.h"

#include <catch2/catch.hpp>

#include <cstdint>

namespace rebound::compute {
namespace {

TEST_CASE("K ranges cover [0, n) contiguously, each floor(n/K) or ceil(n/K) elements") {
  for (int64_t n : {int64_t{7}, int64_t{100}, int64_t{7850}, int64_t{16777216} + 3}) {
    for (int groups : {1, 2, 3, 4, 7, 64}) {
      if (n < groups) continue;
      const std::vector<int64_t> begins = RangeBegins(n, groups);
      REQUIRE(begins.size() == static_cast<size_t>(groups) + 1);
      CHECK(begins.front() == 0);
      CHECK(begins.back() == n);
      for (int k = 0; k < groups; ++k) {
        const int64_t size = begins[k + 1] - begins[k];
        CHECK(size >= n / groups);
        CHECK(size <= (n + groups - 1) / groups);
      }
    }
  }
  // Worked by hand: 10 parameters in 3 ranges are [0, 3), [3, 6), [6, 10).
  CHECK(RangeBegins(10, 3) == std::vector<int64_t>{0, 3, 6, 10});
}

TEST_CASE("a range's layout is one tensor named after its stage and range") {
  absl::StatusOr<StageLayout> layout = RangeLayout(1, 10, 3, 2);
  REQUIRE(layout.ok());
  REQUIRE(layout->tensors().size() == 1);
  CHECK(layout->tensors()[0].name == "stage1.range2");
  CHECK(layout->packed_size() == 4);
  CHECK(RangeLayout(0, 2, 3, 0).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(RangeLayout(0, 10, 3, 3).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(RangeLayout(0, 10, 0, 0).status().code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rebound::compute
