// The fixed micro-batch reduction tree (compute/reduction_tree.h).

#include "compute/reduction_tree.h"

#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <vector>

#include "tests/compute/test_util.h"

namespace rebound {
namespace compute {
namespace {

using testing::BitEqual;
using testing::ToHost;
using testing::UniformFloats;

std::vector<std::vector<float>> Leaves(int m, int length, uint32_t seed) {
  std::vector<std::vector<float>> leaves;
  for (int i = 0; i < m; ++i) {
    // Values of very different magnitudes, so that the order of additions shows in the bits.
    std::vector<float> v = UniformFloats(length, -1.0f, 1.0f, seed + i);
    for (int k = 0; k < length; ++k) v[k] *= (i % 3 == 0) ? 1e4f : (i % 3 == 1 ? 1.0f : 1e-4f);
    leaves.push_back(v);
  }
  return leaves;
}

// The tree's definition, written out independently: sum(b, e) = sum(b, s) + sum(s, e) with
// s = b + ceil((e - b) / 2).
std::vector<float> ReferenceSum(const std::vector<std::vector<float>>& leaves, int b, int e) {
  if (e - b == 1) return leaves[b];
  const int s = b + (e - b + 1) / 2;
  std::vector<float> left = ReferenceSum(leaves, b, s);
  const std::vector<float> right = ReferenceSum(leaves, s, e);
  for (size_t k = 0; k < left.size(); ++k) left[k] = left[k] + right[k];
  return left;
}

// Reduces the leaves of `target`, committing them in ascending order or, with `reverse`,
// descending.
std::vector<float> Accumulate(Backend& backend, TreeAccumulator& acc, int m,
                              const std::vector<std::vector<float>>& leaves, TreeNode target,
                              bool reverse = false) {
  const int64_t length = static_cast<int64_t>(leaves[0].size());
  REQUIRE(acc.Start(m, target, length).ok());
  for (int j = target.begin; j < target.end; ++j) {
    const int i = reverse ? target.end - 1 - (j - target.begin) : j;
    auto buf = acc.LeafBuffer(i);
    REQUIRE(buf.ok());
    REQUIRE(backend.CopyToDevice(leaves[i], buf->sub(0, length)).ok());
    REQUIRE(acc.Commit(TreeNode{i, i + 1}).ok());
  }
  REQUIRE(acc.done());
  auto result = acc.Result();
  REQUIRE(result.ok());
  return ToHost(backend, result->sub(0, length));
}

TEST_CASE("the tree splits every node at its midpoint, left side larger", "[tree]") {
  CHECK(TreeSplit({0, 2}) == 1);
  CHECK(TreeSplit({0, 3}) == 2);
  CHECK(TreeSplit({0, 4}) == 2);
  CHECK(TreeSplit({0, 6}) == 3);
  CHECK(TreeSplit({3, 6}) == 5);
  CHECK(TreeSplit({0, 7}) == 4);
  CHECK(IsTreeNode(6, {0, 6}));
  CHECK(IsTreeNode(6, {0, 3}));
  CHECK(IsTreeNode(6, {3, 5}));
  CHECK(IsTreeNode(6, {5, 6}));
  CHECK_FALSE(IsTreeNode(6, {0, 4}));
  CHECK_FALSE(IsTreeNode(6, {2, 4}));
  CHECK_FALSE(IsTreeNode(6, {0, 7}));
  CHECK_FALSE(IsTreeNode(6, {3, 3}));
  CHECK(IsTreeNode(1, {0, 1}));
}

TEST_CASE("tree-aligned blocks for k = 1, 2, 4 spares partition the micro-batches", "[tree]") {
  using Blocks = std::vector<TreeNode>;
  auto blocks = [](int m, int k) { return TreeAlignedBlocks(m, k).value(); };
  CHECK(blocks(4, 1) == Blocks{{0, 4}});
  CHECK(blocks(4, 2) == Blocks{{0, 2}, {2, 4}});
  CHECK(blocks(4, 4) == Blocks{{0, 1}, {1, 2}, {2, 3}, {3, 4}});
  CHECK(blocks(8, 4) == Blocks{{0, 2}, {2, 4}, {4, 6}, {6, 8}});
  CHECK(blocks(6, 2) == Blocks{{0, 3}, {3, 6}});
  CHECK(blocks(6, 4) == Blocks{{0, 2}, {2, 3}, {3, 5}, {5, 6}});
  CHECK(blocks(3, 4) == Blocks{{0, 1}, {1, 2}, {2, 3}});
  CHECK(blocks(1, 2) == Blocks{{0, 1}});
  CHECK(blocks(5, 3) == Blocks{{0, 2}, {2, 3}, {3, 5}});
  for (int m = 1; m <= 17; ++m) {
    for (int k : {1, 2, 3, 4, 8}) {
      const Blocks b = blocks(m, k);
      INFO("M = " << m << ", k = " << k);
      CHECK(static_cast<int>(b.size()) == std::min(m, k));
      int next = 0;
      for (const TreeNode& node : b) {
        CHECK(node.begin == next);
        CHECK(IsTreeNode(m, node));
        next = node.end;
      }
      CHECK(next == m);
    }
  }
  CHECK(TreeAlignedBlocks(0, 1).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(TreeAlignedBlocks(4, 0).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("the accumulator sums micro-batches along the tree's definition", "[tree]") {
  auto backend = testing::CpuBackend();
  const int length = 37;
  auto acc = TreeAccumulator::Create(backend.get(), length).value();
  for (int m = 1; m <= 9; ++m) {
    INFO("M = " << m);
    const auto leaves = Leaves(m, length, 100 + m);
    const std::vector<float> got = Accumulate(*backend, *acc, m, leaves, {0, m});
    CHECK(BitEqual(got, ReferenceSum(leaves, 0, m)));
  }
}

TEST_CASE("micro-batches committed out of order are still summed in the tree's order",
          "[tree]") {
  auto backend = testing::CpuBackend();
  const int length = 29;
  auto acc = TreeAccumulator::Create(backend.get(), length).value();
  for (int m : {2, 5, 8}) {
    INFO("M = " << m);
    const auto leaves = Leaves(m, length, 300 + m);
    CHECK(BitEqual(Accumulate(*backend, *acc, m, leaves, {0, m}, /*reverse=*/true),
                   ReferenceSum(leaves, 0, m)));
  }
  // An arbitrary interleaving with a block's partial sum among the leaves.
  const auto leaves = Leaves(6, length, 400);
  const std::vector<float> block = ReferenceSum(leaves, 3, 5);
  REQUIRE(acc->Start(6, {0, 6}, length).ok());
  for (int i : {5, 1, 0, 2}) {
    REQUIRE(backend->CopyToDevice(leaves[i], acc->LeafBuffer(i)->sub(0, length)).ok());
  }
  for (int i : {2, 5, 0}) REQUIRE(acc->Commit({i, i + 1}).ok());
  REQUIRE(acc->CommitCopy({3, 5}, ConstDSpan(block.data(), length)).ok());
  CHECK_FALSE(acc->done());
  REQUIRE(acc->Commit({1, 2}).ok());
  REQUIRE(acc->done());
  CHECK(BitEqual(ToHost(*backend, acc->Result()->sub(0, length)), ReferenceSum(leaves, 0, 6)));
}

TEST_CASE("blocks reduced separately and combined give the bits of the whole reduction",
          "[tree]") {
  auto backend = testing::CpuBackend();
  const int length = 53;
  for (int m : {2, 3, 4, 6, 7, 8}) {
    const auto leaves = Leaves(m, length, 7 * m);
    auto whole_acc = TreeAccumulator::Create(backend.get(), length).value();
    const std::vector<float> whole = Accumulate(*backend, *whole_acc, m, leaves, {0, m});
    for (int k : {1, 2, 4}) {
      INFO("M = " << m << ", k = " << k);
      const std::vector<TreeNode> blocks = TreeAlignedBlocks(m, k).value();
      // Each "spare" reduces its block with its own accumulator.
      std::vector<std::vector<float>> partials;
      for (const TreeNode& block : blocks) {
        auto spare = TreeAccumulator::Create(backend.get(), length).value();
        partials.push_back(Accumulate(*backend, *spare, m, leaves, block));
      }
      // The leader combines the partial sums with the top of the tree.
      auto leader = TreeAccumulator::Create(backend.get(), length).value();
      REQUIRE(leader->Start(m, {0, m}, length).ok());
      for (size_t i = 0; i < blocks.size(); ++i) {
        REQUIRE(leader->CommitCopy(blocks[i], ConstDSpan(partials[i].data(), length)).ok());
      }
      REQUIRE(leader->done());
      CHECK(BitEqual(ToHost(*backend, leader->Result()->sub(0, length)), whole));
    }
  }
}

TEST_CASE("a different tree shape would change the bits", "[tree]") {
  // Guards the test above against being vacuous: summing in plain left-to-right order differs.
  const auto leaves = Leaves(6, 53, 42);
  std::vector<float> sequential = leaves[0];
  for (int i = 1; i < 6; ++i) {
    for (size_t k = 0; k < sequential.size(); ++k) sequential[k] += leaves[i][k];
  }
  CHECK_FALSE(BitEqual(sequential, ReferenceSum(leaves, 0, 6)));
}

TEST_CASE("the accumulator rejects nodes that are not in the tree, overlap or were not handed "
          "out",
          "[tree]") {
  auto backend = testing::CpuBackend();
  auto acc = TreeAccumulator::Create(backend.get(), 4).value();
  CHECK(acc->LeafBuffer(0).status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(acc->Start(6, {0, 4}, 4).code() == absl::StatusCode::kInvalidArgument);
  CHECK(acc->Start(6, {0, 3}, 5).code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(acc->Start(6, {0, 6}, 4).ok());
  CHECK(acc->Commit({0, 1}).code() == absl::StatusCode::kFailedPrecondition);  // no buffer
  CHECK(acc->BufferFor({0, 4}).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(acc->BufferFor({0, 7}).status().code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(acc->BufferFor({0, 3}).ok());
  CHECK(acc->LeafBuffer(1).status().code() == absl::StatusCode::kInvalidArgument);  // overlaps
  CHECK(acc->BufferFor({0, 3})->data == acc->BufferFor({0, 3})->data);  // same reservation
  CHECK(acc->Commit({0, 2}).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(acc->Commit({0, 3}).ok());
  CHECK(acc->LeafBuffer(2).status().code() == absl::StatusCode::kInvalidArgument);  // merged
  CHECK_FALSE(acc->done());
  CHECK(acc->Result().status().code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(acc->BufferFor({3, 6}).ok());
  CHECK(acc->Commit({3, 6}).ok());
  CHECK(acc->done());
}

}  // namespace
}  // namespace compute
}  // namespace rebound
