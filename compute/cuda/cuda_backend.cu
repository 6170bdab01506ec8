#include "compute/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/str_format.h"
#include "compute/elementwise_math.h"
#include "compute/rng_fill.h"

namespace rebound {
namespace compute {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;

int BlocksFor(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < kMaxBlocks ? (blocks > 0 ? blocks : 1) : kMaxBlocks);
}

#define REBOUND_GRID_STRIDE(i, n)                                                \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; \
       i < (n); i += static_cast<int64_t>(blockDim.x) * gridDim.x)

// ---- kernels -----------------------------------------------------------------------------------

__global__ void FillKernel(float* out, int64_t n, float value) {
  REBOUND_GRID_STRIDE(i, n) { out[i] = value; }
}

__global__ void AddKernel(const float* a, const float* b, float* out, int64_t n) {
  REBOUND_GRID_STRIDE(i, n) { out[i] = a[i] + b[i]; }
}

__global__ void MultiplyKernel(const float* a, const float* b, float* out, int64_t n) {
  REBOUND_GRID_STRIDE(i, n) { out[i] = a[i] * b[i]; }
}

__global__ void AxpyKernel(float alpha, const float* x, float* y, int64_t n) {
  REBOUND_GRID_STRIDE(i, n) { y[i] = y[i] + alpha * x[i]; }
}

__global__ void AddRowVectorKernel(int cols, const float* v, float* y, int64_t n) {
  REBOUND_GRID_STRIDE(i, n) { y[i] = y[i] + v[i % cols]; }
}

template <Activation kAct>
__global__ void BiasActivationKernel(int cols, bool with_rop, const float* b, const float* rb,
                                     float* a, float* ra, float* h, float* rh, int64_t n) {
  REBOUND_GRID_STRIDE(i, n) {
    const int c = static_cast<int>(i % cols);
    const float x = a[i] + b[c];
    a[i] = x;
    if (h != nullptr) {
      const ActivationDerivatives ev = EvalActivation(kAct, x);
      h[i] = ev.f;
      if (with_rop) {
        const float rx = ra[i] + rb[c];
        ra[i] = rx;
        rh[i] = ev.d1 * rx;
      }
    } else if (with_rop) {
      ra[i] = ra[i] + rb[c];
    }
  }
}

template <Activation kAct>
__global__ void ActivationBackwardKernel(bool with_rop, const float* a, const float* ra,
                                         const float* re, const float* e, float* rdelta,
                                         float* delta, int64_t n) {
  REBOUND_GRID_STRIDE(i, n) {
    const ActivationDerivatives ev = EvalActivation(kAct, a[i]);
    const float ei = e[i];
    if (with_rop) {
      const float rei = re[i];
      delta[i] = ei * ev.d1;
      rdelta[i] = rei * ev.d1 + (ei * ev.d2) * ra[i];
    } else {
      delta[i] = ei * ev.d1;
    }
  }
}

// One thread per column, rows in ascending order: the CPU backend's order, no atomics.
__global__ void ColumnSumsKernel(int rows, int cols, const float* x, float* out) {
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += blockDim.x * gridDim.x) {
    float sum = 0.0f;
    for (int r = 0; r < rows; ++r) sum = sum + x[static_cast<int64_t>(r) * cols + c];
    out[c] = sum;
  }
}

// One thread per row; per-row loss and correctness go to `row_stats` (2 floats per row).
__global__ void SoftmaxRowsKernel(int rows, int classes, bool with_rop, const float* logits,
                                  const int32_t* labels, float scale, float* delta_pair,
                                  float* row_stats) {
  const int64_t half = static_cast<int64_t>(rows) * classes;
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += blockDim.x * gridDim.x) {
    const int64_t base = static_cast<int64_t>(r) * classes;
    const float* a = logits + base;
    const float* ra = with_rop ? logits + half + base : nullptr;
    float* rdelta = (delta_pair != nullptr && with_rop) ? delta_pair + base : nullptr;
    float* delta =
        delta_pair != nullptr ? delta_pair + (with_rop ? half : 0) + base : nullptr;
    float loss = 0.0f;
    int correct = 0;
    SoftmaxCrossEntropyRow(a, ra, classes, labels[r], scale, delta, rdelta, &loss, &correct);
    row_stats[2 * r] = loss;
    row_stats[2 * r + 1] = static_cast<float>(correct);
  }
}

// One block of kThreads threads: thread t sums rows t, t + kThreads, ... in order, then a fixed
// shared-memory tree. Deterministic for a given row count.
__global__ void SoftmaxStatsKernel(int rows, float scale, const float* row_stats, float* stats) {
  __shared__ float loss[kThreads];
  __shared__ float correct[kThreads];
  const int t = threadIdx.x;
  float l = 0.0f;
  float c = 0.0f;
  for (int r = t; r < rows; r += kThreads) {
    l = l + row_stats[2 * r];
    c = c + row_stats[2 * r + 1];
  }
  loss[t] = l;
  correct[t] = c;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (t < stride) {
      loss[t] = loss[t] + loss[t + stride];
      correct[t] = correct[t] + correct[t + stride];
    }
    __syncthreads();
  }
  if (t == 0) {
    stats[0] = scale * loss[0];
    stats[1] = correct[0];
  }
}

__global__ void RademacherKernel(RngStream stream, uint64_t key, float* out, int64_t n) {
  const int64_t quads = (n + 3) / 4;
  REBOUND_GRID_STRIDE(q, quads) {
    const Philox4x32 w = RngQuad(stream, key, static_cast<uint64_t>(q));
    for (int j = 0; j < 4; ++j) {
      const int64_t i = 4 * q + j;
      if (i < n) out[i] = RademacherFromWord(w.v[j]);
    }
  }
}

// One thread per (row, block).
__global__ void BlockAverageKernel(int rows, int cols, int block, float* x) {
  const int blocks_per_row = (cols + block - 1) / block;
  const int64_t total = static_cast<int64_t>(rows) * blocks_per_row;
  REBOUND_GRID_STRIDE(k, total) {
    const int r = static_cast<int>(k / blocks_per_row);
    const int begin = static_cast<int>(k % blocks_per_row) * block;
    const int end = begin + block < cols ? begin + block : cols;
    float* row = x + static_cast<int64_t>(r) * cols;
    float sum = 0.0f;
    for (int i = begin; i < end; ++i) sum = sum + row[i];
    const float mean = sum / static_cast<float>(end - begin);
    for (int i = begin; i < end; ++i) row[i] = mean;
  }
}

__global__ void AdaHessianKernel(AdaHessianScalars s, const float* g, const float* d, float* m,
                                 float* v, float* theta, int64_t n) {
  REBOUND_GRID_STRIDE(i, n) {
    float mi = m[i];
    float vi = v[i];
    float ti = theta[i];
    AdaHessianElement(s, g[i], d[i], &mi, &vi, &ti);
    m[i] = mi;
    v[i] = vi;
    theta[i] = ti;
  }
}

__global__ void ElasticMoveKernel(float rate, const float* toward, float* y, int64_t n) {
  REBOUND_GRID_STRIDE(i, n) { y[i] = ElasticMoveElement(y[i], toward[i], rate); }
}

// ---- host side ---------------------------------------------------------------------------------

absl::Status CudaError(const char* what, cudaError_t err) {
  return absl::InternalError(
      absl::StrFormat("CUDA %s failed: %s (%s)", what, cudaGetErrorName(err),
                      cudaGetErrorString(err)));
}

absl::Status CublasError(const char* what, cublasStatus_t status) {
  return absl::InternalError(absl::StrFormat("cuBLAS %s failed: %s (%d)", what,
                                             cublasGetStatusString(status),
                                             static_cast<int>(status)));
}

#define REBOUND_CUDA_RETURN(what, expr)            \
  do {                                             \
    const cudaError_t rebound_err_ = (expr);       \
    if (rebound_err_ != cudaSuccess) {             \
      return CudaError(what, rebound_err_);        \
    }                                              \
  } while (false)

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, std::string device_name)
      : device_(device), device_name_(std::move(device_name)) {}

  ~CudaBackend() override {
    cudaSetDevice(device_);
    if (row_stats_ != nullptr) cudaFree(row_stats_);
    if (handle_ != nullptr) cublasDestroy(handle_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init() {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    REBOUND_CUDA_RETURN("cudaStreamCreate", cudaStreamCreateWithFlags(&stream_,
                                                                      cudaStreamNonBlocking));
    cublasStatus_t st = cublasCreate(&handle_);
    if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasCreate", st);
    st = cublasSetStream(handle_, stream_);
    if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasSetStream", st);
    st = cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH);
    if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasSetMathMode", st);
    st = cublasSetAtomicsMode(handle_, CUBLAS_ATOMICS_NOT_ALLOWED);
    if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasSetAtomicsMode", st);
    st = cublasSetPointerMode(handle_, CUBLAS_POINTER_MODE_HOST);
    if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasSetPointerMode", st);
    return absl::OkStatus();
  }

  std::string name() const override {
    return absl::StrFormat("cuda (device %d: %s)", device_, device_name_);
  }
  bool host_addressable() const override { return false; }

  absl::Status Synchronize() override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    REBOUND_CUDA_RETURN("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

 protected:
  absl::StatusOr<void*> AllocateRaw(int64_t bytes) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    void* ptr = nullptr;
    const cudaError_t err = cudaMalloc(&ptr, static_cast<size_t>(bytes));
    if (err != cudaSuccess) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "cudaMalloc of %d bytes failed: %s", bytes, cudaGetErrorString(err)));
    }
    return ptr;
  }
  void FreeRaw(void* ptr) override {
    cudaSetDevice(device_);
    // Queued work may still use the memory: finish it first (cudaFree would too).
    cudaStreamSynchronize(stream_);
    cudaFree(ptr);
  }
  absl::Status ZeroRaw(void* ptr, int64_t bytes) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    REBOUND_CUDA_RETURN("cudaMemsetAsync",
                        cudaMemsetAsync(ptr, 0, static_cast<size_t>(bytes), stream_));
    return absl::OkStatus();
  }
  absl::Status CopyToDeviceRaw(const void* src, void* dst, int64_t bytes) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    REBOUND_CUDA_RETURN("cudaMemcpyAsync(H2D)",
                        cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes),
                                        cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  }
  absl::Status CopyToHostRaw(const void* src, void* dst, int64_t bytes) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    REBOUND_CUDA_RETURN("cudaMemcpyAsync(D2H)",
                        cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes),
                                        cudaMemcpyDeviceToHost, stream_));
    REBOUND_CUDA_RETURN("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  absl::Status CopyRaw(const void* src, void* dst, int64_t bytes) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    REBOUND_CUDA_RETURN("cudaMemcpyAsync(D2D)",
                        cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes),
                                        cudaMemcpyDeviceToDevice, stream_));
    return absl::OkStatus();
  }
  absl::Status FillImpl(DSpan dst, float value) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    FillKernel<<<BlocksFor(dst.size), kThreads, 0, stream_>>>(dst.data, dst.size, value);
    return Launched("Fill");
  }

  absl::Status GemmImpl(Transpose ta, Transpose tb, int m, int n, int k, float alpha,
                        const float* a, int lda, const float* b, int ldb, float beta, float* c,
                        int ldc) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands and
    // keep the transpose flags (a row-major matrix is its transpose in column-major).
    const cublasOperation_t op_a = ta == Transpose::kYes ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = tb == Transpose::kYes ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasStatus_t st =
        cublasSgemm(handle_, op_b, op_a, n, m, k, &alpha, b, ldb, a, lda, &beta, c, ldc);
    if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasSgemm", st);
    return absl::OkStatus();
  }

  absl::Status AddImpl(ConstDSpan a, ConstDSpan b, DSpan out) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    AddKernel<<<BlocksFor(out.size), kThreads, 0, stream_>>>(a.data, b.data, out.data,
                                                             out.size);
    return Launched("Add");
  }
  absl::Status MultiplyImpl(ConstDSpan a, ConstDSpan b, DSpan out) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    MultiplyKernel<<<BlocksFor(out.size), kThreads, 0, stream_>>>(a.data, b.data, out.data,
                                                                  out.size);
    return Launched("Multiply");
  }
  absl::Status AxpyImpl(float alpha, ConstDSpan x, DSpan y) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    AxpyKernel<<<BlocksFor(y.size), kThreads, 0, stream_>>>(alpha, x.data, y.data, y.size);
    return Launched("Axpy");
  }
  absl::Status AddRowVectorImpl(int rows, int cols, ConstDSpan v, DSpan y) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    AddRowVectorKernel<<<BlocksFor(y.size), kThreads, 0, stream_>>>(cols, v.data, y.data,
                                                                    y.size);
    return Launched("AddRowVector");
  }

  absl::Status BiasActivationForwardImpl(Activation act, int rows, int cols, bool with_rop,
                                         ConstDSpan b, ConstDSpan rb, DSpan a_pair,
                                         DSpan h_pair) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    const int64_t half = static_cast<int64_t>(rows) * cols;
    float* a = a_pair.data;
    float* ra = with_rop ? a_pair.data + half : nullptr;
    float* h = h_pair.size > 0 ? h_pair.data : nullptr;
    float* rh = (h != nullptr && with_rop) ? h_pair.data + half : nullptr;
    const float* prb = with_rop ? rb.data : nullptr;
    const int blocks = BlocksFor(half);
    switch (act) {
      case Activation::kRelu:
        BiasActivationKernel<Activation::kRelu><<<blocks, kThreads, 0, stream_>>>(
            cols, with_rop, b.data, prb, a, ra, h, rh, half);
        break;
      case Activation::kTanh:
        BiasActivationKernel<Activation::kTanh><<<blocks, kThreads, 0, stream_>>>(
            cols, with_rop, b.data, prb, a, ra, h, rh, half);
        break;
      case Activation::kGelu:
        BiasActivationKernel<Activation::kGelu><<<blocks, kThreads, 0, stream_>>>(
            cols, with_rop, b.data, prb, a, ra, h, rh, half);
        break;
      case Activation::kIdentity:
        BiasActivationKernel<Activation::kIdentity><<<blocks, kThreads, 0, stream_>>>(
            cols, with_rop, b.data, prb, a, ra, h, rh, half);
        break;
    }
    return Launched("BiasActivationForward");
  }

  absl::Status ActivationBackwardImpl(Activation act, int rows, int cols, bool with_rop,
                                      ConstDSpan a_pair, ConstDSpan e_pair,
                                      DSpan out_pair) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    const int64_t n = static_cast<int64_t>(rows) * cols;
    const float* a = a_pair.data;
    const float* ra = with_rop ? a_pair.data + n : nullptr;
    const float* re = with_rop ? e_pair.data : nullptr;
    const float* e = with_rop ? e_pair.data + n : e_pair.data;
    float* rdelta = with_rop ? out_pair.data : nullptr;
    float* delta = with_rop ? out_pair.data + n : out_pair.data;
    const int blocks = BlocksFor(n);
    switch (act) {
      case Activation::kRelu:
        ActivationBackwardKernel<Activation::kRelu><<<blocks, kThreads, 0, stream_>>>(
            with_rop, a, ra, re, e, rdelta, delta, n);
        break;
      case Activation::kTanh:
        ActivationBackwardKernel<Activation::kTanh><<<blocks, kThreads, 0, stream_>>>(
            with_rop, a, ra, re, e, rdelta, delta, n);
        break;
      case Activation::kGelu:
        ActivationBackwardKernel<Activation::kGelu><<<blocks, kThreads, 0, stream_>>>(
            with_rop, a, ra, re, e, rdelta, delta, n);
        break;
      case Activation::kIdentity:
        ActivationBackwardKernel<Activation::kIdentity><<<blocks, kThreads, 0, stream_>>>(
            with_rop, a, ra, re, e, rdelta, delta, n);
        break;
    }
    return Launched("ActivationBackward");
  }

  absl::Status ColumnSumsImpl(int rows, int cols, ConstDSpan x, DSpan out) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    ColumnSumsKernel<<<BlocksFor(cols), kThreads, 0, stream_>>>(rows, cols, x.data, out.data);
    return Launched("ColumnSums");
  }

  absl::Status SoftmaxCrossEntropyImpl(int rows, int classes, bool with_rop,
                                       ConstDSpan logits_pair, ConstDIntSpan labels, float scale,
                                       DSpan delta_pair, DSpan stats) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    if (rows > row_stats_rows_) {
      // Growing the scratch: cudaFree/cudaMalloc synchronise, which is fine on this rare path.
      if (row_stats_ != nullptr) {
        REBOUND_CUDA_RETURN("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
        cudaFree(row_stats_);
        row_stats_ = nullptr;
        row_stats_rows_ = 0;
      }
      REBOUND_CUDA_RETURN("cudaMalloc", cudaMalloc(reinterpret_cast<void**>(&row_stats_),
                                                   sizeof(float) * 2 * static_cast<size_t>(rows)));
      row_stats_rows_ = rows;
    }
    if (rows > 0) {
      SoftmaxRowsKernel<<<BlocksFor(rows), kThreads, 0, stream_>>>(
          rows, classes, with_rop, logits_pair.data, labels.data, scale,
          delta_pair.size > 0 ? delta_pair.data : nullptr, row_stats_);
      const absl::Status launched = Launched("SoftmaxRows");
      if (!launched.ok()) return launched;
    }
    SoftmaxStatsKernel<<<1, kThreads, 0, stream_>>>(rows, scale, row_stats_, stats.data);
    return Launched("SoftmaxStats");
  }

  absl::Status RademacherFillImpl(const RngStream& stream, DSpan out) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    RademacherKernel<<<BlocksFor((out.size + 3) / 4), kThreads, 0, stream_>>>(
        stream, RngStreamKey(stream), out.data, out.size);
    return Launched("RademacherFill");
  }

  absl::Status BlockAverageRowsImpl(int rows, int cols, int block, DSpan x) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    const int64_t total = static_cast<int64_t>(rows) * ((cols + block - 1) / block);
    BlockAverageKernel<<<BlocksFor(total), kThreads, 0, stream_>>>(rows, cols, block, x.data);
    return Launched("BlockAverageRows");
  }

  absl::Status AdaHessianUpdateImpl(const AdaHessianScalars& s, ConstDSpan g, ConstDSpan d,
                                    DSpan m, DSpan v, DSpan theta) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    AdaHessianKernel<<<BlocksFor(theta.size), kThreads, 0, stream_>>>(
        s, g.data, d.data, m.data, v.data, theta.data, theta.size);
    return Launched("AdaHessianUpdate");
  }

  absl::Status ElasticMoveImpl(float rate, ConstDSpan toward, DSpan y) override {
    REBOUND_CUDA_RETURN("cudaSetDevice", cudaSetDevice(device_));
    ElasticMoveKernel<<<BlocksFor(y.size), kThreads, 0, stream_>>>(rate, toward.data, y.data,
                                                                   y.size);
    return Launched("ElasticMove");
  }

 private:
  // Reports a failed kernel launch (configuration errors; not asynchronous faults, which the
  // next synchronising call reports).
  absl::Status Launched(const char* kernel) {
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return CudaError(kernel, err);
    return absl::OkStatus();
  }

  const int device_;
  const std::string device_name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t handle_ = nullptr;
  float* row_stats_ = nullptr;
  int row_stats_rows_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "compute.backend is CUDA but no CUDA device is available (%s)",
        err != cudaSuccess ? cudaGetErrorString(err) : "device count is 0"));
  }
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "compute.cuda_device is %d but this machine has %d CUDA device(s)", device, count));
  }
  // Deterministic cuBLAS workspaces (docs/design.md §5.6); must be set before cuBLAS initialises.
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  cudaDeviceProp prop;
  const cudaError_t perr = cudaGetDeviceProperties(&prop, device);
  if (perr != cudaSuccess) return CudaError("cudaGetDeviceProperties", perr);
  std::unique_ptr<CudaBackend> backend(new CudaBackend(device, prop.name));
  absl::Status status = backend->Init();
  if (!status.ok()) return status;
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace compute
}  // namespace rebound
