#include "compute/reduction_tree.h"

#include <iterator>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace rebound {
namespace compute {

int TreeSplit(TreeNode node) { return node.begin + (node.size() + 1) / 2; }

bool IsTreeNode(int num_micro_batches, TreeNode node) {
  if (num_micro_batches < 1 || node.begin < 0 || node.end > num_micro_batches ||
      node.begin >= node.end) {
    return false;
  }
  TreeNode current{0, num_micro_batches};
  while (current != node) {
    if (current.size() < 2) return false;
    const int split = TreeSplit(current);
    if (node.end <= split) {
      current = TreeNode{current.begin, split};
    } else if (node.begin >= split) {
      current = TreeNode{split, current.end};
    } else {
      return false;  // straddles the split
    }
  }
  return true;
}

absl::StatusOr<std::vector<TreeNode>> TreeAlignedBlocks(int num_micro_batches, int k) {
  if (num_micro_batches < 1 || k < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "TreeAlignedBlocks: need M >= 1 and k >= 1, got M = %d, k = %d", num_micro_batches, k));
  }
  std::vector<TreeNode> blocks = {TreeNode{0, num_micro_batches}};
  while (static_cast<int>(blocks.size()) < k) {
    int widest = -1;
    for (int i = 0; i < static_cast<int>(blocks.size()); ++i) {
      if (blocks[i].size() >= 2 && (widest < 0 || blocks[i].size() > blocks[widest].size())) {
        widest = i;
      }
    }
    if (widest < 0) break;  // all leaves: M < k
    const TreeNode node = blocks[widest];
    const int split = TreeSplit(node);
    blocks[widest] = TreeNode{node.begin, split};
    blocks.insert(blocks.begin() + widest + 1, TreeNode{split, node.end});
  }
  return blocks;
}

absl::StatusOr<std::unique_ptr<TreeAccumulator>> TreeAccumulator::Create(Backend* backend,
                                                                          int64_t length) {
  if (backend == nullptr) return absl::InvalidArgumentError("TreeAccumulator: null backend");
  if (length < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("TreeAccumulator: length must be >= 1, got %d", length));
  }
  return std::unique_ptr<TreeAccumulator>(new TreeAccumulator(backend, length));
}

absl::Status TreeAccumulator::Start(int num_micro_batches, TreeNode target, int64_t active) {
  if (!IsTreeNode(num_micro_batches, target)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("TreeAccumulator: [%d, %d) is not a node of the reduction tree over "
                        "[0, %d)",
                        target.begin, target.end, num_micro_batches));
  }
  if (active < 1 || active > length_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "TreeAccumulator: active length %d outside [1, %d]", active, length_));
  }
  for (const Entry& e : stack_) free_.push_back(e.buffer);
  for (const auto& [begin, e] : reserved_) free_.push_back(e.buffer);
  for (const auto& [begin, e] : committed_) free_.push_back(e.buffer);
  stack_.clear();
  reserved_.clear();
  committed_.clear();
  num_micro_batches_ = num_micro_batches;
  target_ = target;
  active_ = active;
  next_ = target.begin;
  started_ = true;
  return absl::OkStatus();
}

absl::StatusOr<int> TreeAccumulator::AcquireBuffer() {
  if (!free_.empty()) {
    const int index = free_.back();
    free_.pop_back();
    return index;
  }
  ASSIGN_OR_RETURN(DeviceBuffer buffer, backend_->Allocate(length_));
  buffers_.push_back(std::move(buffer));
  return static_cast<int>(buffers_.size()) - 1;
}

absl::StatusOr<DSpan> TreeAccumulator::BufferFor(TreeNode node) {
  if (!started_) return absl::FailedPreconditionError("TreeAccumulator: Start was not called");
  auto it = reserved_.find(node.begin);
  if (it != reserved_.end() && it->second.node == node) {
    return buffers_[it->second.buffer].span();
  }
  if (node.begin < target_.begin || node.end > target_.end ||
      !IsTreeNode(num_micro_batches_, node)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "TreeAccumulator: [%d, %d) is not a node of the reduction tree inside [%d, %d)",
        node.begin, node.end, target_.begin, target_.end));
  }
  // Overlaps: with the merged prefix, or with a reserved or committed node.
  bool overlaps = node.begin < next_;
  for (const std::map<int, Entry>* held : {&reserved_, &committed_}) {
    auto after = held->lower_bound(node.begin);
    if (after != held->end() && after->second.node.begin < node.end) overlaps = true;
    if (after != held->begin() && std::prev(after)->second.node.end > node.begin) {
      overlaps = true;
    }
  }
  if (overlaps) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "TreeAccumulator: [%d, %d) overlaps micro-batches already handed out or committed",
        node.begin, node.end));
  }
  ASSIGN_OR_RETURN(const int buffer, AcquireBuffer());
  reserved_[node.begin] = Entry{node, buffer};
  return buffers_[buffer].span();
}

absl::StatusOr<DSpan> TreeAccumulator::LeafBuffer(int m) { return BufferFor(TreeNode{m, m + 1}); }

absl::Status TreeAccumulator::Commit(TreeNode node) {
  if (!started_) return absl::FailedPreconditionError("TreeAccumulator: Start was not called");
  auto it = reserved_.find(node.begin);
  if (it == reserved_.end() || it->second.node != node) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "TreeAccumulator: no buffer was handed out for [%d, %d)", node.begin, node.end));
  }
  committed_[node.begin] = it->second;
  reserved_.erase(it);
  return Drain();
}

absl::Status TreeAccumulator::Drain() {
  for (auto it = committed_.find(next_); it != committed_.end(); it = committed_.find(next_)) {
    stack_.push_back(it->second);
    next_ = it->second.node.end;
    committed_.erase(it);
    while (stack_.size() >= 2) {
      Entry& left = stack_[stack_.size() - 2];
      const Entry& right = stack_.back();
      const TreeNode parent{left.node.begin, right.node.end};
      if (!IsTreeNode(num_micro_batches_, parent) || TreeSplit(parent) != left.node.end) break;
      DSpan sum = buffers_[left.buffer].span().sub(0, active_);
      RETURN_IF_ERROR(backend_->Add(sum, buffers_[right.buffer].span().sub(0, active_), sum));
      free_.push_back(right.buffer);
      left.node = parent;
      stack_.pop_back();
    }
  }
  return absl::OkStatus();
}

absl::Status TreeAccumulator::CommitCopy(TreeNode node, ConstDSpan value) {
  if (value.size < active_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "TreeAccumulator: value has %d floats, fewer than the active %d", value.size, active_));
  }
  ASSIGN_OR_RETURN(DSpan buffer, BufferFor(node));
  RETURN_IF_ERROR(backend_->Copy(value.sub(0, active_), buffer.sub(0, active_)));
  return Commit(node);
}

bool TreeAccumulator::done() const {
  return started_ && stack_.size() == 1 && stack_.front().node == target_;
}

absl::StatusOr<ConstDSpan> TreeAccumulator::Result() const {
  if (!done()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "TreeAccumulator: [%d, %d) is not complete (next micro-batch %d)", target_.begin,
        target_.end, next_));
  }
  return ConstDSpan(buffers_[stack_.front().buffer].span());
}

}  // namespace compute
}  // namespace rebound
