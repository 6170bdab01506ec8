#pragma once

// The fixed micro-batch reduction tree of docs/design.md §5.3 and §5.6. A step's batch is split into
// M micro-batches; their gradients, Hz and losses are summed along one fixed binary tree, so that
// any machine that sums any tree-aligned part of them and then combines the parts along the top
// of the same tree produces the same bits as the trainer.
//
// The tree over micro-batch indices [0, M), M >= 1:
//   * the root is [0, M);
//   * a node [b, e) with n = e - b >= 2 has the children [b, s) and [s, e), s = b + ceil(n / 2)
//     (midpoint rule; the left child takes the extra element when n is odd);
//   * the leaves are the single micro-batches [m, m + 1);
//   * the value of a node is left + right, element by element in float (IEEE addition, which is
//     commutative, so only the tree's shape matters).
// For M a power of two this is the perfect binary tree. Any set of tree nodes that partitions a
// node can be summed to that node's exact value by TreeAccumulator.

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "compute/backend.h"

namespace rebound {
namespace compute {

// Micro-batches [begin, end).
struct TreeNode {
  int begin = 0;
  int end = 0;

  int size() const { return end - begin; }
  bool operator==(const TreeNode& other) const {
    return begin == other.begin && end == other.end;
  }
  bool operator!=(const TreeNode& other) const { return !(*this == other); }
};

// The split point s of a node of size >= 2 (see above).
int TreeSplit(TreeNode node);

// True iff `node` is a node of the tree over [0, num_micro_batches).
bool IsTreeNode(int num_micro_batches, TreeNode node);

// The blocks that k spares reduce in a parallel replay (§5.3): min(k, M) contiguous tree nodes
// that partition [0, M), in ascending order. Built from the root by splitting, k - 1 times, the
// largest block that is not a leaf (the leftmost on ties). For k a power of two and M >= k these
// are the tree's nodes at depth log2(k): k = 1 -> {[0, M)}, k = 2 -> the root's two children,
// k = 4 -> its four grandchildren. INVALID_ARGUMENT unless M >= 1 and k >= 1.
absl::StatusOr<std::vector<TreeNode>> TreeAlignedBlocks(int num_micro_batches, int k);

// Sums values along the tree, streaming. The caller asks for a buffer per tree node (single
// micro-batches, or blocks' partial sums from other machines), writes the node's value into it
// and commits it; nodes may be committed in any order (e.g. a pipeline whose backward passes
// finish out of order), but the sums are always formed in the tree's fixed order: siblings are
// added as soon as both are present, left + right. Only buffers of nodes not yet merged are held.
//
//   acc->Start(M, target, active);                 // per reduction
//   for (m in target) {                            // any order
//     DSpan buf = acc->LeafBuffer(m).value();      // write micro-batch m's value here
//     ...; acc->Commit({m, m + 1});
//   }
//   ConstDSpan sum = acc->Result().value();
//
// Only the first `active` floats of each value take part (the rest of a buffer is left as is).
// Not thread-safe.
class TreeAccumulator {
 public:
  // Buffers of `length` >= 1 floats on `backend` (not owned; must outlive the accumulator).
  static absl::StatusOr<std::unique_ptr<TreeAccumulator>> Create(Backend* backend,
                                                                 int64_t length);

  TreeAccumulator(const TreeAccumulator&) = delete;
  TreeAccumulator& operator=(const TreeAccumulator&) = delete;

  int64_t length() const { return length_; }

  // Begins summing node `target` of the tree over [0, num_micro_batches), over the first
  // `active` (1 <= active <= length()) floats. Forgets any unfinished reduction.
  // INVALID_ARGUMENT if target is not a tree node or active is out of range.
  absl::Status Start(int num_micro_batches, TreeNode target, int64_t active);

  // A buffer of length() floats (contents unspecified) reserved for the value of `node`, a tree
  // node inside the target that overlaps no other node reserved or committed since Start.
  // Asking again for the same node returns the same buffer. INVALID_ARGUMENT otherwise.
  absl::StatusOr<DSpan> BufferFor(TreeNode node);
  // BufferFor({m, m + 1}).
  absl::StatusOr<DSpan> LeafBuffer(int m);

  // Declares that the buffer reserved for `node` holds its value, and adds every pair of
  // siblings that became complete. FAILED_PRECONDITION if no buffer is reserved for exactly
  // this node (nothing changes).
  absl::Status Commit(TreeNode node);

  // BufferFor(node), a copy of the first `active` floats of `value` into it, and Commit(node).
  absl::Status CommitCopy(TreeNode node, ConstDSpan value);

  // True once the whole target has been committed.
  bool done() const;

  // The sum over the target (the first `active` floats are meaningful). Valid until the next
  // Start. FAILED_PRECONDITION if not done().
  absl::StatusOr<ConstDSpan> Result() const;

 private:
  TreeAccumulator(Backend* backend, int64_t length) : backend_(backend), length_(length) {}

  struct Entry {
    TreeNode node;
    int buffer;
  };

  absl::StatusOr<int> AcquireBuffer();
  // Pushes the committed nodes that start at next_ onto the stack, merging siblings.
  absl::Status Drain();

  Backend* backend_;
  int64_t length_;
  std::vector<DeviceBuffer> buffers_;
  std::vector<int> free_;  // indices into buffers_
  // Nodes handed out (reserved) or committed but not yet on the stack, keyed by begin.
  std::map<int, Entry> reserved_;
  std::map<int, Entry> committed_;
  std::vector<Entry> stack_;  // merged prefix of the target, in post-order
  int num_micro_batches_ = 0;
  TreeNode target_;
  int64_t active_ = 0;
  int next_ = 0;  // first micro-batch not yet on the stack
  bool started_ = false;
};

}  // namespace compute
}  // namespace rebound
