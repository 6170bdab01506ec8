#include "compute/backend_factory.h"

#include "absl/strings/str_format.h"
#include "compute/cpu/cpu_backend.h"

#if defined(REBOUND_HAVE_CUDA)
#include "compute/cuda/cuda_backend.h"
#endif

namespace rebound {
namespace compute {

bool CudaBackendCompiledIn() {
#if defined(REBOUND_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const ComputeConfig& config) {
  switch (config.backend()) {
    case CPU:
      return CreateCpuBackend(config.threads());
    case CUDA:
#if defined(REBOUND_HAVE_CUDA)
      if (config.cuda_device() < 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "compute.cuda_device must be >= 0, got %d", config.cuda_device()));
      }
      return CreateCudaBackend(config.cuda_device());
#else
      return absl::FailedPreconditionError(
          "compute.backend is CUDA but this binary was built without CUDA support; rebuild with "
          "`bazel build --config=cuda` or set compute.backend: CPU");
#endif
    default:
      return absl::InvalidArgumentError(absl::StrFormat(
          "compute.backend must be CPU or CUDA, got %s", BackendKind_Name(config.backend())));
  }
}

}  // namespace compute
}  // namespace rebound
