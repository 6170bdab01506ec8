#include "compute/tensor_bundle.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"

namespace rebound {
namespace compute {

TensorBundle BundleFromPacked(const StageLayout& layout, absl::Span<const float> packed) {
  TensorBundle bundle;
  for (const TensorInfo& info : layout.tensors()) {
    const std::vector<int64_t> shape =
        info.is_bias ? std::vector<int64_t>{info.cols} : std::vector<int64_t>{info.rows, info.cols};
    *bundle.add_tensors() =
        MakeFloatTensor(info.id, info.name, shape, packed.subspan(info.packed_offset, info.size()));
  }
  return bundle;
}

TensorBundle BundleHeader(const StageLayout& layout) {
  TensorBundle bundle;
  for (const TensorInfo& info : layout.tensors()) {
    const std::vector<int64_t> shape =
        info.is_bias ? std::vector<int64_t>{info.cols} : std::vector<int64_t>{info.rows, info.cols};
    Tensor* tensor = bundle.add_tensors();
    tensor->set_id(info.id);
    tensor->set_name(info.name);
    tensor->set_dtype(FLOAT32);
    for (int64_t dim : shape) tensor->add_shape(dim);
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
    const bool shape_ok = info.is_bias ? (t.shape_size() == 1 && t.shape(0) == info.cols)
                                       : (t.shape_size() == 2 && t.shape(0) == info.rows &&
                                          t.shape(1) == info.cols);
    if (!shape_ok) {
      std::string got;
      for (int d = 0; d < t.shape_size(); ++d) absl::StrAppend(&got, d ? ", " : "", t.shape(d));
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": ", info.name, " must have shape [",
          info.is_bias ? absl::StrCat(info.cols) : absl::StrCat(info.rows, ", ", info.cols),
          "], got [", got, "]"));
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
