#include "compute/range_snapshot.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "compute/shard_ranges.h"
#include "compute/tensor_bundle.h"

namespace rebound::compute {

namespace {

// The bundle of `part` that a snapshot's `index`-th tensor set lives in: 0 params, 1 m, 2 v,
// 3 last_hdiag.
constexpr int kBundles = 4;
constexpr const char* kBundleNames[kBundles] = {"params", "optimizer.m", "optimizer.v",
                                                "optimizer.last_hdiag"};

const TensorBundle& BundleOf(const Snapshot& part, int index) {
  switch (index) {
    case 0:
      return part.params();
    case 1:
      return part.optimizer().m();
    case 2:
      return part.optimizer().v();
    default:
      return part.optimizer().last_hdiag();
  }
}

TensorBundle* MutableBundleOf(Snapshot* snapshot, int index) {
  switch (index) {
    case 0:
      return snapshot->mutable_params();
    case 1:
      return snapshot->mutable_optimizer()->mutable_m();
    case 2:
      return snapshot->mutable_optimizer()->mutable_v();
    default:
      return snapshot->mutable_optimizer()->mutable_last_hdiag();
  }
}

}  // namespace

absl::Status JoinRangeSnapshots(const StageLayout& layout, absl::Span<const Snapshot> parts,
                                Snapshot* snapshot) {
  const int groups = static_cast<int>(parts.size());
  const int64_t n = layout.packed_size();
  const int stage = snapshot->slot().stage();
  if (groups < 1) return absl::InvalidArgumentError("no range snapshot to join");
  for (int k = 0; k < groups; ++k) {
    if (parts[k].step() != snapshot->step()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "range ", k, "'s snapshot is of step ", parts[k].step(), ", not ", snapshot->step()));
    }
  }
  for (int index = 0; index < kBundles; ++index) {
    const int held = static_cast<int>(
        std::count_if(parts.begin(), parts.end(), [index](const Snapshot& part) {
          return BundleOf(part, index).tensors_size() > 0;
        }));
    if (held == 0 && index > 0) continue;  // no optimizer state of this part anywhere
    if (held != groups) {
      return absl::InvalidArgumentError(absl::StrCat(
          kBundleNames[index], " is held by ", held, " of the ", groups, " ranges' snapshots of ",
          "step ", snapshot->step(), ": a snapshot's state is all of its ranges' or none"));
    }
    std::vector<float> packed(n);
    for (int k = 0; k < groups; ++k) {
      ASSIGN_OR_RETURN(const StageLayout range, RangeLayout(stage, n, groups, k));
      const TensorBundle& bundle = BundleOf(parts[k], index);
      RETURN_IF_ERROR(ValidateBundle(range, bundle,
                                     absl::StrCat("range ", k, "'s ", kBundleNames[index])));
      const std::vector<float> values = PackedFromBundle(range, bundle);
      std::copy(values.begin(), values.end(), packed.begin() + RangeBegin(n, groups, k));
    }
    *MutableBundleOf(snapshot, index) = BundleFromPacked(layout, packed);
  }
  return absl::OkStatus();
}

}  // namespace rebound::compute
