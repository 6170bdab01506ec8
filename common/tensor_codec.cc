#include "common/tensor_codec.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace rebound {

Tensor MakeFloatTensor(uint32_t id, const std::string& name, const std::vector<int64_t>& shape,
                       absl::Span<const float> values) {
  Tensor tensor;
  tensor.set_id(id);
  tensor.set_name(name);
  tensor.set_dtype(FLOAT32);
  for (int64_t dim : shape) tensor.add_shape(dim);
  tensor.set_data(values.data(), values.size() * sizeof(float));
  return tensor;
}

absl::StatusOr<int64_t> ElementCount(const Tensor& tensor, int64_t max_elements) {
  int64_t count = 1;
  for (int i = 0; i < tensor.shape_size(); ++i) {
    const int64_t dim = tensor.shape(i);
    if (dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", tensor.name(), "': shape[", i, "] is negative (", dim, ")"));
    }
    if (dim != 0 && count > max_elements / dim) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", tensor.name(), "': more than ", max_elements, " elements"));
    }
    count *= dim;
  }
  return count;
}

absl::Status ValidateFloatTensor(const Tensor& tensor, const std::string& what) {
  if (tensor.dtype() != FLOAT32) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": dtype must be FLOAT32, got ",
                                                   DType_Name(tensor.dtype())));
  }
  auto count = ElementCount(tensor);
  if (!count.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", count.status().message()));
  }
  const uint64_t expected = static_cast<uint64_t>(*count) * sizeof(float);
  if (tensor.data().size() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", tensor.data().size(),
                                                   " data bytes, shape needs ", expected));
  }
  return absl::OkStatus();
}

absl::Status CopyFloats(const Tensor& tensor, absl::Span<float> out) {
  if (tensor.data().size() != out.size() * sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor.name(), "': holds ",
                                                   tensor.data().size() / sizeof(float),
                                                   " floats, expected ", out.size()));
  }
  std::memcpy(out.data(), tensor.data().data(), tensor.data().size());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> ReadFloats(const Tensor& tensor) {
  absl::Status valid = ValidateFloatTensor(tensor, absl::StrCat("tensor '", tensor.name(), "'"));
  if (!valid.ok()) return valid;
  std::vector<float> values(tensor.data().size() / sizeof(float));
  std::memcpy(values.data(), tensor.data().data(), tensor.data().size());
  return values;
}

absl::Status CheckFinite(absl::Span<const float> values, const std::string& what) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": non-finite value ", values[i], " at index ", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace rebound
