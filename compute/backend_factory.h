#pragma once

// Chooses and creates the compute backend of a job (docs/design.md §5.6).

#include <memory>

#include "absl/status/statusor.h"
#include "compute/backend.h"
#include "proto/config.pb.h"

namespace rebound {
namespace compute {

// The backend that `config` asks for:
//   CPU  -> OpenBLAS with config.threads() threads (INVALID_ARGUMENT outside [1, 256]);
//   CUDA -> cuBLAS on device config.cuda_device(). FAILED_PRECONDITION, with a message that says
//           so, if this binary was built without --config=cuda, if no CUDA device is present or
//           the ordinal does not exist.
// INVALID_ARGUMENT for BACKEND_UNSPECIFIED or an unknown kind.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const ComputeConfig& config);

// True iff this binary contains the CUDA backend (built with --config=cuda).
bool CudaBackendCompiledIn();

}  // namespace compute
}  // namespace rebound
