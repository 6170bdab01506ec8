#include "compute/tensor_bundle.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"

namespace rebound {
namespace compute {

std::string ShapeString(absl::Span<const int64_t> dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

TensorBundle BundleFromPacked(const StageLayout& layout, absl::Span<const float> packed) {
  TensorBundle bundle;
  for (const TensorInfo& info : layout.tensors()) {
    *bundle.add_tensors() = MakeFloatTensor(info.id, info.name, info.shape,
                                            packed.subspan(info.packed_offset, info.size()));
  }
  return bundle;
}

TensorBundle BundleHeader(const StageLayout& layout) {
  TensorBundle bundle;
  for (const TensorInfo& info : layout.tensors()) {
    Tensor* tensor = bundle.add_tensors();
    tensor->set_id(info.id);
    tensor->set_name(info.name);
    tensor->set_dtype(FLOAT32);
    for (int64_t dim : info.shape) tensor->add_shape(dim);
  }
  return bundle;
}

void AppendTensorViews(const StageLayout& layout, absl::Span<const float> packed,
                       std::vector<absl::string_view>* views) {
  for (const TensorInfo& info : layout.tensors()) {
    const absl::Span<const float> values = packed.subspan(info.packed_offset, info.size());
    views->emplace_back(reinterpret_cast<const char*>(values.data()),
                        values.size() * sizeof(float));
  }
}

absl::Status ValidateBundle(const StageLayout& layout, const TensorBundle& bundle,
                            const std::string& what, bool require_finite) {
  const auto& tensors = layout.tensors();
  if (bundle.tensors_size() != static_cast<int>(tensors.size())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected ", tensors.size(),
                                                   " tensors, got ", bundle.tensors_size()));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = bundle.tensors(static_cast<int>(i));
    const TensorInfo& info = tensors[i];
    const std::string name = absl::StrCat(what, ".tensors[", i, "]");
    if (t.id() != info.id) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected tensor id ", info.id, " (", info.name, "), got ", t.id()));
    }
    RETURN_IF_ERROR(ValidateFloatTensor(t, name));
    const bool shape_ok = static_cast<size_t>(t.shape_size()) == info.shape.size() &&
                          std::equal(info.shape.begin(), info.shape.end(), t.shape().begin());
    if (!shape_ok) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": ", info.name, " must have shape ",
                                                     ShapeString(info.shape), ", got ",
                                                     ShapeString(absl::MakeConstSpan(t.shape().data(), t.shape_size()))));
    }
    if (require_finite) {
      const float* values = reinterpret_cast<const float*>(t.data().data());
      RETURN_IF_ERROR(
          CheckFinite(absl::MakeConstSpan(values, t.data().size() / sizeof(float)), name));
    }
  }
  return absl::OkStatus();
}

std::vector<float> PackedFromBundle(const StageLayout& layout, const TensorBundle& bundle) {
  std::vector<float> packed(layout.packed_size());
  for (size_t i = 0; i < layout.tensors().size(); ++i) {
    const TensorInfo& info = layout.tensors()[i];
    const std::string& data = bundle.tensors(static_cast<int>(i)).data();
    std::memcpy(packed.data() + info.packed_offset, data.data(), data.size());
  }
  return packed;
}

}  // namespace compute
}  // namespace rebound
