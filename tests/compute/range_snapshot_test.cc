// A sharded slot snapshot joined from its ranges (compute/range_snapshot.h): each range's part at
// its place, the optimizer state all or none, parts of another step or size refused.

#include "compute/range_snapshot.h"

#include <catch2/catch.hpp>

#include <limits>
#include <vector>

#include "compute/shard_ranges.h"
#include "compute/tensor_bundle.h"

namespace rebound::compute {
namespace {

// A stage of 8 parameters: weight [2, 3] then bias [2], packed in that order.
StageLayout EightParameters() {
  TensorBundle declared;
  Tensor* weight = declared.add_tensors();
  weight->set_id(0);
  weight->set_name("layer0.weight");
  weight->set_dtype(FLOAT32);
  weight->add_shape(2);
  weight->add_shape(3);
  Tensor* bias = declared.add_tensors();
  bias->set_id(1);
  bias->set_name("layer0.bias");
  bias->set_dtype(FLOAT32);
  bias->add_shape(2);
  absl::StatusOr<StageLayout> layout = StageLayout::FromDeclared(declared);
  REQUIRE(layout.ok());
  return *layout;
}

// One range's bundle of `values` (range k of 8 in 3 ranges).
TensorBundle RangeBundle(int k, std::vector<float> values) {
  absl::StatusOr<StageLayout> range = RangeLayout(0, 8, 3, k);
  REQUIRE(range.ok());
  return BundleFromPacked(*range, values);
}

// The three ranges of 8 parameters are [0, 2), [2, 5), [5, 8) (compute/shard_ranges.h). Range
// k's part at `step` holds, at element i of the stage, params i, m 10 + i, v 20 + i, D 30 + i.
std::vector<Snapshot> Parts(int64_t step, bool optimizer) {
  const std::vector<std::vector<int>> elements = {{0, 1}, {2, 3, 4}, {5, 6, 7}};
  std::vector<Snapshot> parts(3);
  for (int k = 0; k < 3; ++k) {
    parts[k].set_step(step);
    std::vector<float> p, m, v, d;
    for (int i : elements[k]) {
      p.push_back(static_cast<float>(i));
      m.push_back(10.0f + i);
      v.push_back(20.0f + i);
      d.push_back(30.0f + i);
    }
    *parts[k].mutable_params() = RangeBundle(k, p);
    if (!optimizer) continue;
    parts[k].mutable_optimizer()->set_step(step);
    *parts[k].mutable_optimizer()->mutable_m() = RangeBundle(k, m);
    *parts[k].mutable_optimizer()->mutable_v() = RangeBundle(k, v);
    *parts[k].mutable_optimizer()->mutable_last_hdiag() = RangeBundle(k, d);
  }
  return parts;
}

Snapshot Header(int64_t step) {
  Snapshot header;
  header.mutable_slot()->set_replica(1);
  header.set_step(step);
  header.set_data_epoch(2);
  header.set_data_offset(96);
  return header;
}

TEST_CASE("the ranges' parts are joined at their places, the header kept") {
  const StageLayout layout = EightParameters();
  Snapshot snapshot = Header(40);
  REQUIRE(JoinRangeSnapshots(layout, Parts(40, true), &snapshot).ok());
  CHECK(snapshot.step() == 40);
  CHECK(snapshot.slot().replica() == 1);
  CHECK(snapshot.data_offset() == 96);
  REQUIRE(ValidateBundle(layout, snapshot.params(), "params").ok());
  // The weight holds elements 0..5 and the bias 6, 7, each tensor in its own shape.
  REQUIRE(snapshot.params().tensors_size() == 2);
  CHECK(snapshot.params().tensors(1).name() == "layer0.bias");
  CHECK(PackedFromBundle(layout, snapshot.params()) ==
        std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(PackedFromBundle(layout, snapshot.optimizer().m()) ==
        std::vector<float>{10, 11, 12, 13, 14, 15, 16, 17});
  CHECK(PackedFromBundle(layout, snapshot.optimizer().v()) ==
        std::vector<float>{20, 21, 22, 23, 24, 25, 26, 27});
  CHECK(PackedFromBundle(layout, snapshot.optimizer().last_hdiag()) ==
        std::vector<float>{30, 31, 32, 33, 34, 35, 36, 37});
}

TEST_CASE("an optimizer state no range holds stays empty; one some ranges hold is refused") {
  const StageLayout layout = EightParameters();
  Snapshot snapshot = Header(40);
  REQUIRE(JoinRangeSnapshots(layout, Parts(40, false), &snapshot).ok());
  CHECK(PackedFromBundle(layout, snapshot.params()) ==
        std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(snapshot.optimizer().m().tensors_size() == 0);
  CHECK(snapshot.optimizer().last_hdiag().tensors_size() == 0);

  std::vector<Snapshot> mixed = Parts(40, true);
  mixed[1].mutable_optimizer()->clear_v();
  Snapshot refused = Header(40);
  const absl::Status status = JoinRangeSnapshots(layout, mixed, &refused);
  CHECK(status.code() == absl::StatusCode::kInvalidArgument);
  CHECK(status.message().find("optimizer.v is held by 2 of the 3") != absl::string_view::npos);
}

TEST_CASE("a part of another step, of the wrong size or not finite is refused") {
  const StageLayout layout = EightParameters();
  std::vector<Snapshot> parts = Parts(40, true);
  parts[2].set_step(60);  // the range had applied the next sync already
  Snapshot snapshot = Header(40);
  absl::Status status = JoinRangeSnapshots(layout, parts, &snapshot);
  CHECK(status.code() == absl::StatusCode::kInvalidArgument);
  CHECK(status.message().find("range 2's snapshot is of step 60, not 40") !=
        absl::string_view::npos);

  parts = Parts(40, true);
  *parts[0].mutable_params() = RangeBundle(1, {0, 1, 2});  // range 1's size in range 0
  status = JoinRangeSnapshots(layout, parts, &snapshot);
  CHECK(status.code() == absl::StatusCode::kInvalidArgument);
  CHECK(status.message().find("range 0's params") != absl::string_view::npos);

  parts = Parts(40, true);
  *parts[1].mutable_optimizer()->mutable_m() =
      RangeBundle(1, {1.0f, std::numeric_limits<float>::infinity(), 3.0f});
  status = JoinRangeSnapshots(layout, parts, &snapshot);
  CHECK(status.code() == absl::StatusCode::kInvalidArgument);
  CHECK(status.message().find("range 1's optimizer.m") != absl::string_view::npos);

  CHECK(JoinRangeSnapshots(layout, {}, &snapshot).code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rebound::compute
