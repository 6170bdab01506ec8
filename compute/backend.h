#pragma once

// The compute backend (docs/design.md §2, §5.6): device memory and the handful of kernels the MLP of
// compute/mlp.h, the AdaHessian step and the elastic update need. Two implementations exist:
// compute/cpu (OpenBLAS, always built) and compute/cuda (cuBLAS plus own kernels, built only with
// --config=cuda). Create one with CreateBackend() from compute/backend_factory.h.
//
// Memory model. A DeviceBuffer owns memory in the backend's address space (host memory for the
// CPU backend, GPU memory for CUDA); it stays there between steps. DSpan / ConstDSpan are
// non-owning views of float elements in that space (DIntSpan for int32), passed to every kernel.
// Their `data` pointers must never be dereferenced by callers unless host_addressable() is true.
// For the CPU backend any host pointer may be wrapped in a span and handed to it.
//
// Ordering. Kernels run in issue order on one in-order queue (the CUDA stream); a call returns
// once the work is queued, except CopyToHost and Synchronize, which wait for it. Buffers must not
// be freed while queued work still uses them.
//
// Determinism (docs/design.md §5.6). On one backend, hardware and thread count, every kernel is a pure
// function of its inputs: reductions run in a fixed order and never use atomics, cuBLAS runs in
// its default (non-TF32) math mode with atomics disallowed and a fixed workspace configuration,
// and OpenBLAS uses the fixed thread count of ComputeConfig.threads.
//
// Errors. Invalid arguments (sizes, shapes) give INVALID_ARGUMENT and queue nothing. Device
// failures give INTERNAL (CUDA) or RESOURCE_EXHAUSTED (allocation). Threads: a Backend is not
// thread-safe; use one per thread.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/rng.h"
#include "compute/elementwise_math.h"

namespace rebound {
namespace compute {

// A view of `size` floats at `data` in a backend's memory space.
struct DSpan {
  float* data = nullptr;
  int64_t size = 0;

  // Elements [offset, offset + count). REQUIRES: 0 <= offset, offset + count <= size.
  DSpan sub(int64_t offset, int64_t count) const { return DSpan{data + offset, count}; }
  bool empty() const { return size == 0; }
};

struct ConstDSpan {
  const float* data = nullptr;
  int64_t size = 0;

  ConstDSpan() = default;
  ConstDSpan(const float* d, int64_t n) : data(d), size(n) {}
  ConstDSpan(DSpan s) : data(s.data), size(s.size) {}  // NOLINT: implicit by design

  ConstDSpan sub(int64_t offset, int64_t count) const {
    return ConstDSpan(data + offset, count);
  }
  bool empty() const { return size == 0; }
};

struct DIntSpan {
  int32_t* data = nullptr;
  int64_t size = 0;
  DIntSpan sub(int64_t offset, int64_t count) const { return DIntSpan{data + offset, count}; }
};

struct ConstDIntSpan {
  const int32_t* data = nullptr;
  int64_t size = 0;

  ConstDIntSpan() = default;
  ConstDIntSpan(const int32_t* d, int64_t n) : data(d), size(n) {}
  ConstDIntSpan(DIntSpan s) : data(s.data), size(s.size) {}  // NOLINT: implicit by design
  ConstDIntSpan sub(int64_t offset, int64_t count) const {
    return ConstDIntSpan(data + offset, count);
  }
};

enum class DType { kFloat32, kInt32 };

class Backend;

// Memory owned by a backend: `size` elements of `dtype`, zero-filled at allocation. Move-only.
// REQUIRES: it does not outlive the Backend that allocated it.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  int64_t size() const { return size_; }
  DType dtype() const { return dtype_; }
  bool empty() const { return size_ == 0; }

  // Views of the whole buffer. REQUIRES: dtype() matches (kFloat32 for span(), kInt32 for
  // int_span()); an empty span otherwise.
  DSpan span();
  ConstDSpan span() const;
  DIntSpan int_span();
  ConstDIntSpan int_span() const;

 private:
  friend class Backend;
  void Release();

  Backend* owner_ = nullptr;
  void* data_ = nullptr;
  int64_t size_ = 0;
  DType dtype_ = DType::kFloat32;
};

enum class Transpose { kNo, kYes };

// What the backend's kernels have done so far; for benchmarks and tests.
struct BackendCounters {
  int64_t gemm_calls = 0;
  double gemm_flops = 0.0;  // 2 * m * n * k per Gemm call
};

class Backend {
 public:
  virtual ~Backend();
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  // A human-readable description, e.g. "cpu (OpenBLAS 0.3.21, 1 thread)".
  virtual std::string name() const = 0;
  // True iff span data pointers are host addresses (the CPU backend).
  virtual bool host_addressable() const = 0;

  // ---- memory --------------------------------------------------------------------------------

  // A zero-filled buffer of `size` >= 0 elements.
  absl::StatusOr<DeviceBuffer> Allocate(int64_t size, DType dtype = DType::kFloat32);

  // Host -> device. REQUIRES: src.size() == dst.size.
  absl::Status CopyToDevice(absl::Span<const float> src, DSpan dst);
  absl::Status CopyToDevice(absl::Span<const int32_t> src, DIntSpan dst);
  // Device -> host; waits for queued work. REQUIRES: src.size == dst.size().
  absl::Status CopyToHost(ConstDSpan src, absl::Span<float> dst);
  absl::Status CopyToHost(ConstDIntSpan src, absl::Span<int32_t> dst);
  // Device -> device. REQUIRES: equal sizes; the ranges do not overlap.
  absl::Status Copy(ConstDSpan src, DSpan dst);
  // dst[i] = value.
  absl::Status Fill(DSpan dst, float value);
  // Waits until all queued work is done; reports any asynchronous device error.
  virtual absl::Status Synchronize() = 0;

  // ---- BLAS ----------------------------------------------------------------------------------

  // Row-major C = alpha * op(A) * op(B) + beta * C with op(A) m x k, op(B) k x n, C m x n.
  // A is stored m x k (lda >= k) if ta == kNo, else k x m (lda >= m); likewise B; ldc >= n.
  // beta == 0 overwrites C (its old contents may be garbage). C must not overlap A or B.
  absl::Status Gemm(Transpose ta, Transpose tb, int m, int n, int k, float alpha, ConstDSpan a,
                    int lda, ConstDSpan b, int ldb, float beta, DSpan c, int ldc);

  // ---- element-wise (out may alias an input of the same size) ---------------------------------

  absl::Status Add(ConstDSpan a, ConstDSpan b, DSpan out);        // out = a + b
  absl::Status Multiply(ConstDSpan a, ConstDSpan b, DSpan out);   // out = a * b
  absl::Status Axpy(float alpha, ConstDSpan x, DSpan y);          // y = y + alpha * x
  // y[r, c] = y[r, c] + v[c] for a row-major rows x cols matrix y.
  absl::Status AddRowVector(int rows, int cols, ConstDSpan v, DSpan y);

  // The MLP's fused layer kernels. "Pairs" are two row-major rows x cols matrices stacked in one
  // span of 2 * rows * cols elements (see compute/mlp.h for which half holds what).
  //
  // BiasActivationForward: `a_pair` = [a; R{a}] holds the GEMM outputs; adds the bias in place
  // (a += b, R{a} += rb) and writes h_pair = [f(a); f'(a) * R{a}]. Without the R-op (with_rop
  // false) only the first halves exist (spans of rows * cols) and rb is ignored. For
  // kIdentity, h_pair may be empty (the biased a_pair is then the output).
  absl::Status BiasActivationForward(Activation act, int rows, int cols, bool with_rop,
                                     ConstDSpan b, ConstDSpan rb, DSpan a_pair, DSpan h_pair);
  // ActivationBackward: with `a_pair` = [a; R{a}] from the forward pass and e_pair = [R{e}; e]
  // the gradient pair of the layer output h = f(a), writes
  //   out_pair = [R{delta}; delta] = [R{e} f'(a) + e f''(a) R{a};  e f'(a)].
  // Without the R-op: out = e f'(a) (spans of rows * cols). out_pair may alias e_pair.
  absl::Status ActivationBackward(Activation act, int rows, int cols, bool with_rop,
                                  ConstDSpan a_pair, ConstDSpan e_pair, DSpan out_pair);

  // ---- reductions ------------------------------------------------------------------------------

  // out[c] = sum over r = 0, 1, ..., rows-1 (in this order) of x[r, c].
  absl::Status ColumnSums(int rows, int cols, ConstDSpan x, DSpan out);

  // Softmax cross-entropy of `rows` samples with logits pair [a; R{a}] (rows x classes each;
  // without the R-op only a) and int32 labels in [0, classes). With p = softmax(a) per row:
  //   loss_r = -log p[r, label_r];  delta = scale (p - onehot);
  //   R{delta} = scale p (R{a} - <p, R{a}>)  (the R-op of softmax: (diag p - p p^T) R{a}).
  // Writes delta_pair = [R{delta}; delta] (with_rop) or delta (not), unless delta_pair is empty
  // (evaluation), and stats[0] = scale * sum_r loss_r (fixed order), stats[1] = number of rows
  // whose argmax (first maximum) equals the label. REQUIRES: stats.size >= 2.
  // Labels are not range-checked here (that would need a host round trip): callers validate
  // them before upload, as LocalTrainer does.
  absl::Status SoftmaxCrossEntropy(int rows, int classes, bool with_rop, ConstDSpan logits_pair,
                                   ConstDIntSpan labels, float scale, DSpan delta_pair,
                                   DSpan stats);

  // ---- randomness and optimizer kernels -----------------------------------------------------

  // out[i] = RngRademacher(stream, i) (common/rng.h), i in [0, out.size).
  absl::Status RademacherFill(const RngStream& stream, DSpan out);

  // Replaces every block of `block` consecutive elements along each row of the row-major
  // rows x cols matrix x by the block's mean (sum in ascending order, divided by the block's
  // length; the last block of a row may be shorter). REQUIRES: block >= 1.
  absl::Status BlockAverageRows(int rows, int cols, int block, DSpan x);

  // AdaHessianElement (compute/elementwise_math.h) for every i. REQUIRES: equal sizes; m, v,
  // theta overlap neither each other nor g and d.
  absl::Status AdaHessianUpdate(const AdaHessianScalars& s, ConstDSpan g, ConstDSpan d, DSpan m,
                                DSpan v, DSpan theta);

  // y[i] = ElasticMoveElement(y[i], toward[i], rate). REQUIRES: equal sizes, no overlap.
  absl::Status ElasticMove(float rate, ConstDSpan toward, DSpan y);

  const BackendCounters& counters() const { return counters_; }
  void ResetCounters() { counters_ = BackendCounters(); }

 protected:
  Backend() = default;

  // Implementations receive validated arguments.
  virtual absl::StatusOr<void*> AllocateRaw(int64_t bytes) = 0;
  virtual void FreeRaw(void* ptr) = 0;
  virtual absl::Status ZeroRaw(void* ptr, int64_t bytes) = 0;
  virtual absl::Status CopyToDeviceRaw(const void* src, void* dst, int64_t bytes) = 0;
  virtual absl::Status CopyToHostRaw(const void* src, void* dst, int64_t bytes) = 0;
  virtual absl::Status CopyRaw(const void* src, void* dst, int64_t bytes) = 0;
  virtual absl::Status FillImpl(DSpan dst, float value) = 0;
  virtual absl::Status GemmImpl(Transpose ta, Transpose tb, int m, int n, int k, float alpha,
                                const float* a, int lda, const float* b, int ldb, float beta,
                                float* c, int ldc) = 0;
  virtual absl::Status AddImpl(ConstDSpan a, ConstDSpan b, DSpan out) = 0;
  virtual absl::Status MultiplyImpl(ConstDSpan a, ConstDSpan b, DSpan out) = 0;
  virtual absl::Status AxpyImpl(float alpha, ConstDSpan x, DSpan y) = 0;
  virtual absl::Status AddRowVectorImpl(int rows, int cols, ConstDSpan v, DSpan y) = 0;
  virtual absl::Status BiasActivationForwardImpl(Activation act, int rows, int cols,
                                                 bool with_rop, ConstDSpan b, ConstDSpan rb,
                                                 DSpan a_pair, DSpan h_pair) = 0;
  virtual absl::Status ActivationBackwardImpl(Activation act, int rows, int cols, bool with_rop,
                                              ConstDSpan a_pair, ConstDSpan e_pair,
                                              DSpan out_pair) = 0;
  virtual absl::Status ColumnSumsImpl(int rows, int cols, ConstDSpan x, DSpan out) = 0;
  virtual absl::Status SoftmaxCrossEntropyImpl(int rows, int classes, bool with_rop,
                                               ConstDSpan logits_pair, ConstDIntSpan labels,
                                               float scale, DSpan delta_pair, DSpan stats) = 0;
  virtual absl::Status RademacherFillImpl(const RngStream& stream, DSpan out) = 0;
  virtual absl::Status BlockAverageRowsImpl(int rows, int cols, int block, DSpan x) = 0;
  virtual absl::Status AdaHessianUpdateImpl(const AdaHessianScalars& s, ConstDSpan g,
                                            ConstDSpan d, DSpan m, DSpan v, DSpan theta) = 0;
  virtual absl::Status ElasticMoveImpl(float rate, ConstDSpan toward, DSpan y) = 0;

 private:
  friend class DeviceBuffer;
  BackendCounters counters_;
};

}  // namespace compute
}  // namespace rebound
