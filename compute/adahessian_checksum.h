#pragma once

// AdaHessianUpdateChecksummed: a stage's AdaHessian update (compute/adahessian.h, §4.3) on host
// memory that also returns the per-step parameter checksum of DESIGN.md §5.2, the xxHash64 of
// the updated parameters in the packed layout (the tensors' elements back to back in the given
// order: exactly what MlpStage::ParamsChecksum() returns right after the update).
//
// Why fused: hashing the parameters in a second pass costs ~95 us per step on the shipped model
// (235,146 floats; xxHash64's four lanes are bound by their 64-bit multiplies, wherever the bytes
// are). Hashing each block of 16 updated floats right after the update computes them lets those
// multiplies run beside the update's float work: the fused pass takes ~55 us more than the update
// alone (324 against 269 + 98 us; docs/benchmarks.md, logging overhead). The update's results are
// those of
// AdaHessianUpdate, bit for bit (the same per-element expression, AdaHessianElement, under the
// same compiler flags); tests/compute/adahessian_checksum_test.cc checks both.
//
// Thread-safety: none needed (a function of its arguments); the spans must not be used by
// another thread during the call. Ownership: borrows the spans.

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "compute/elementwise_math.h"
#include "compute/model_layout.h"

namespace rebound {
namespace compute {

// AdaHessianUpdate(s, g, d, m, v, theta) over the whole padded span (padding included, as
// AdaHessianUpdate does), then the xxHash64 of theta[t.offset, t.offset + t.size()) for each
// tensor t of `tensors` in order. INVALID_ARGUMENT (nothing changes) when the spans' sizes
// differ, or when a tensor lies outside theta or starts before the previous one ends: the
// caller hashes separately then.
absl::StatusOr<uint64_t> AdaHessianUpdateChecksummed(const AdaHessianScalars& s,
                                                     absl::Span<const float> g,
                                                     absl::Span<const float> d,
                                                     absl::Span<float> m, absl::Span<float> v,
                                                     absl::Span<float> theta,
                                                     absl::Span<const TensorInfo> tensors);

}  // namespace compute
}  // namespace rebound
