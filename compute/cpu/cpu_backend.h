#pragma once

// The CPU backend: OpenBLAS cblas_sgemm for GEMMs, plain loops for everything else (the same
// loops as compute/adahessian.h for the optimizer kernels). Spans are host pointers, so callers
// may wrap any host memory in a DSpan and pass it in.
//
// Threads. OpenBLAS's thread count is a process-wide setting: CreateCpuBackend fixes it to
// `threads` with openblas_set_num_threads, and bit-exact replay (docs/design.md §5.6) requires every
// backend of the job to use the same value. Creating CPU backends with different thread counts in
// one process changes it for all of them. The backend's own loops run on the calling thread.

#include <memory>

#include "absl/status/statusor.h"
#include "compute/backend.h"

namespace rebound {
namespace compute {

// INVALID_ARGUMENT unless 1 <= threads <= 256.
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(int threads);

}  // namespace compute
}  // namespace rebound
