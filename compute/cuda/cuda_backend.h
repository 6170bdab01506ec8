#pragma once

// The CUDA backend: cuBLAS for GEMMs and the kernels of cuda_backend.cu for everything else, all
// queued on one stream of one device. Built only with --config=cuda (//compute/cuda:cuda_backend
// is incompatible otherwise); use CreateBackend() from compute/backend_factory.h rather than
// this header.
//
// Determinism (docs/design.md §5.6): CUBLAS_WORKSPACE_CONFIG is set to ":4096:8" unless the
// environment already sets it, cuBLAS runs in CUBLAS_DEFAULT_MATH (full FP32, no TF32) with
// atomics disallowed, and no kernel uses atomics: every reduction (column sums, the loss) runs in
// a fixed order. The element kernels are compiled without FMA contraction, so the optimizer and
// elastic kernels give the same bits as the CPU backend.
//
// No host round trips: every call only queues work, except CopyToHost and Synchronize. Growing
// the internal loss scratch (first use, or more rows than before) calls cudaMalloc.
//
// The backend makes its device current (cudaSetDevice) on every call, so it may be used from any
// one thread at a time.

#include <memory>

#include "absl/status/statusor.h"
#include "compute/backend.h"

namespace rebound {
namespace compute {

// FAILED_PRECONDITION if no CUDA device is present (or the driver is missing) or `device` is not
// a valid ordinal; INTERNAL if stream or cuBLAS initialisation fails.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device);

}  // namespace compute
}  // namespace rebound
