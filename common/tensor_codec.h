#pragma once

// Conversion between float spans and the wire `Tensor` (raw little-endian bytes), with the
// validation every receiver needs: dtype, shape and byte length must agree.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/tensor.pb.h"

namespace rebound {

// A FLOAT32 tensor holding `values` with the given id, name and shape.
// REQUIRES: product(shape) == values.size().
Tensor MakeFloatTensor(uint32_t id, const std::string& name, const std::vector<int64_t>& shape,
                       absl::Span<const float> values);

// Number of elements of `shape`, or an error if a dimension is negative or the product overflows
// `max_elements`.
absl::StatusOr<int64_t> ElementCount(const Tensor& tensor, int64_t max_elements = int64_t{1} << 40);

// OK iff `tensor` is FLOAT32 and its byte length equals 4 * product(shape). `what` names the
// tensor in the error (e.g. "params.tensors[3]"). INVALID_ARGUMENT otherwise.
absl::Status ValidateFloatTensor(const Tensor& tensor, const std::string& what);

// Copies the tensor's values into `out`. REQUIRES: ValidateFloatTensor(tensor) is OK and
// out.size() equals its element count (else INVALID_ARGUMENT).
absl::Status CopyFloats(const Tensor& tensor, absl::Span<float> out);

// The tensor's values. INVALID_ARGUMENT if it is not a valid FLOAT32 tensor.
absl::StatusOr<std::vector<float>> ReadFloats(const Tensor& tensor);

// OK iff every value is finite; INVALID_ARGUMENT naming the first offending index otherwise.
absl::Status CheckFinite(absl::Span<const float> values, const std::string& what);

}  // namespace rebound
