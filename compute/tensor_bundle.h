#pragma once

// A stage's parameters (or gradients, moments, D) as they leave the process: one FLOAT32 Tensor
// per model tensor in ascending global id order, with the tensor's own shape ([out, in] for a
// weight, [out] for a bias). The in-process form is the stage's packed layout
// (compute/model_layout.h); these functions convert between the two and validate what arrives.

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "compute/model_layout.h"
#include "proto/tensor.pb.h"

namespace rebound {
namespace compute {

// One tensor per model tensor of `layout`, values from `packed` (packed_size() floats).
TensorBundle BundleFromPacked(const StageLayout& layout, absl::Span<const float> packed);

// The same tensors' metadata (ids, names, shapes, FLOAT32) without data, and views of each
// tensor's bytes inside `packed`, in the same order: together what BundleFromPacked makes,
// without the copy (for storage::WriteBatch's zero-copy puts). The views are valid as long as
// `packed` is. REQUIRES: packed.size() == layout.packed_size().
TensorBundle BundleHeader(const StageLayout& layout);
void AppendTensorViews(const StageLayout& layout, absl::Span<const float> packed,
                       std::vector<absl::string_view>* views);

// OK iff `bundle` holds exactly the layout's tensors (ids, shapes, FLOAT32, byte lengths) and,
// if `require_finite`, only finite values. INVALID_ARGUMENT naming `what`.tensors[i] otherwise.
absl::Status ValidateBundle(const StageLayout& layout, const TensorBundle& bundle,
                            const std::string& what, bool require_finite = true);

// The packed values of a bundle. REQUIRES: ValidateBundle(layout, bundle) is OK.
std::vector<float> PackedFromBundle(const StageLayout& layout, const TensorBundle& bundle);

// "[d0, d1, ...]", for messages.
std::string ShapeString(absl::Span<const int64_t> dims);

}  // namespace compute
}  // namespace rebound
