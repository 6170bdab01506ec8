#include "compute/cpu/cpu_backend.h"

#include <cblas.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_format.h"
#include "compute/adahessian.h"
#include "compute/elementwise_math.h"
#include "compute/rng_fill.h"

namespace rebound {
namespace compute {
namespace {

constexpr int64_t kAlignment = 64;

template <Activation kAct>
void BiasActivationRows(int rows, int cols, bool with_rop, const float* __restrict b,
                        const float* __restrict rb, float* __restrict a, float* __restrict ra,
                        float* __restrict h, float* __restrict rh) {
  for (int r = 0; r < rows; ++r) {
    const int64_t base = static_cast<int64_t>(r) * cols;
    for (int c = 0; c < cols; ++c) {
      const float x = a[base + c] + b[c];
      a[base + c] = x;
      if (h != nullptr) {
        const ActivationDerivatives ev = EvalActivation(kAct, x);
        h[base + c] = ev.f;
        if (with_rop) {
          const float rx = ra[base + c] + rb[c];
          ra[base + c] = rx;
          rh[base + c] = ev.d1 * rx;
        }
      } else if (with_rop) {
        ra[base + c] = ra[base + c] + rb[c];
      }
    }
  }
}

template <Activation kAct>
void ActivationBackwardLoop(int64_t n, bool with_rop, const float* a, const float* ra,
                            const float* re, const float* e, float* rdelta, float* delta) {
  // out may alias e: each element is read before it is written.
  if (with_rop) {
    for (int64_t i = 0; i < n; ++i) {
      const ActivationDerivatives ev = EvalActivation(kAct, a[i]);
      const float ei = e[i];
      const float rei = re[i];
      delta[i] = ei * ev.d1;
      rdelta[i] = rei * ev.d1 + (ei * ev.d2) * ra[i];
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const ActivationDerivatives ev = EvalActivation(kAct, a[i]);
      delta[i] = e[i] * ev.d1;
    }
  }
}

// The full quads of a Rademacher fill: one Philox call per four draws.
void RademacherQuads(const RngStream& stream, uint64_t key, int64_t quads,
                     float* __restrict out) {
  for (int64_t q = 0; q < quads; ++q) {
    const Philox4x32 w = RngQuad(stream, key, static_cast<uint64_t>(q));
    out[4 * q + 0] = RademacherFromWord(w.v[0]);
    out[4 * q + 1] = RademacherFromWord(w.v[1]);
    out[4 * q + 2] = RademacherFromWord(w.v[2]);
    out[4 * q + 3] = RademacherFromWord(w.v[3]);
  }
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads) : threads_(threads) {}

  std::string name() const override {
    return absl::StrFormat("cpu (%s, %d thread%s)", openblas_get_config(), threads_,
                           threads_ == 1 ? "" : "s");
  }
  bool host_addressable() const override { return true; }
  absl::Status Synchronize() override { return absl::OkStatus(); }

 protected:
  absl::StatusOr<void*> AllocateRaw(int64_t bytes) override {
    const int64_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    void* ptr = std::aligned_alloc(kAlignment, static_cast<size_t>(rounded));
    if (ptr == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("cpu backend: cannot allocate %d bytes", bytes));
    }
    return ptr;
  }
  void FreeRaw(void* ptr) override { std::free(ptr); }
  absl::Status ZeroRaw(void* ptr, int64_t bytes) override {
    std::memset(ptr, 0, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  absl::Status CopyToDeviceRaw(const void* src, void* dst, int64_t bytes) override {
    std::memmove(dst, src, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  absl::Status CopyToHostRaw(const void* src, void* dst, int64_t bytes) override {
    std::memmove(dst, src, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  absl::Status CopyRaw(const void* src, void* dst, int64_t bytes) override {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  absl::Status FillImpl(DSpan dst, float value) override {
    for (int64_t i = 0; i < dst.size; ++i) dst.data[i] = value;
    return absl::OkStatus();
  }

  absl::Status GemmImpl(Transpose ta, Transpose tb, int m, int n, int k, float alpha,
                        const float* a, int lda, const float* b, int ldb, float beta, float* c,
                        int ldc) override {
    cblas_sgemm(CblasRowMajor, ta == Transpose::kYes ? CblasTrans : CblasNoTrans,
                tb == Transpose::kYes ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b,
                ldb, beta, c, ldc);
    return absl::OkStatus();
  }

  absl::Status AddImpl(ConstDSpan a, ConstDSpan b, DSpan out) override {
    const float* pa = a.data;
    const float* pb = b.data;
    float* po = out.data;
    for (int64_t i = 0; i < out.size; ++i) po[i] = pa[i] + pb[i];
    return absl::OkStatus();
  }
  absl::Status MultiplyImpl(ConstDSpan a, ConstDSpan b, DSpan out) override {
    const float* pa = a.data;
    const float* pb = b.data;
    float* po = out.data;
    for (int64_t i = 0; i < out.size; ++i) po[i] = pa[i] * pb[i];
    return absl::OkStatus();
  }
  absl::Status AxpyImpl(float alpha, ConstDSpan x, DSpan y) override {
    const float* px = x.data;
    float* py = y.data;
    for (int64_t i = 0; i < y.size; ++i) py[i] = py[i] + alpha * px[i];
    return absl::OkStatus();
  }
  absl::Status AddRowVectorImpl(int rows, int cols, ConstDSpan v, DSpan y) override {
    const float* __restrict pv = v.data;
    float* __restrict py = y.data;
    for (int r = 0; r < rows; ++r) {
      float* row = py + static_cast<int64_t>(r) * cols;
      for (int c = 0; c < cols; ++c) row[c] = row[c] + pv[c];
    }
    return absl::OkStatus();
  }

  absl::Status BiasActivationForwardImpl(Activation act, int rows, int cols, bool with_rop,
                                         ConstDSpan b, ConstDSpan rb, DSpan a_pair,
                                         DSpan h_pair) override {
    const int64_t half = static_cast<int64_t>(rows) * cols;
    float* a = a_pair.data;
    float* ra = with_rop ? a_pair.data + half : nullptr;
    float* h = h_pair.size > 0 ? h_pair.data : nullptr;
    float* rh = (h != nullptr && with_rop) ? h_pair.data + half : nullptr;
    const float* prb = with_rop ? rb.data : nullptr;
    switch (act) {
      case Activation::kRelu:
        BiasActivationRows<Activation::kRelu>(rows, cols, with_rop, b.data, prb, a, ra, h, rh);
        break;
      case Activation::kTanh:
        BiasActivationRows<Activation::kTanh>(rows, cols, with_rop, b.data, prb, a, ra, h, rh);
        break;
      case Activation::kGelu:
        BiasActivationRows<Activation::kGelu>(rows, cols, with_rop, b.data, prb, a, ra, h, rh);
        break;
      case Activation::kIdentity:
        BiasActivationRows<Activation::kIdentity>(rows, cols, with_rop, b.data, prb, a, ra, h,
                                                  rh);
        break;
    }
    return absl::OkStatus();
  }

  absl::Status ActivationBackwardImpl(Activation act, int rows, int cols, bool with_rop,
                                      ConstDSpan a_pair, ConstDSpan e_pair,
                                      DSpan out_pair) override {
    const int64_t n = static_cast<int64_t>(rows) * cols;
    const float* a = a_pair.data;
    const float* ra = with_rop ? a_pair.data + n : nullptr;
    // Pairs in the backward direction are [R{x}; x].
    const float* re = with_rop ? e_pair.data : nullptr;
    const float* e = with_rop ? e_pair.data + n : e_pair.data;
    float* rdelta = with_rop ? out_pair.data : nullptr;
    float* delta = with_rop ? out_pair.data + n : out_pair.data;
    switch (act) {
      case Activation::kRelu:
        ActivationBackwardLoop<Activation::kRelu>(n, with_rop, a, ra, re, e, rdelta, delta);
        break;
      case Activation::kTanh:
        ActivationBackwardLoop<Activation::kTanh>(n, with_rop, a, ra, re, e, rdelta, delta);
        break;
      case Activation::kGelu:
        ActivationBackwardLoop<Activation::kGelu>(n, with_rop, a, ra, re, e, rdelta, delta);
        break;
      case Activation::kIdentity:
        ActivationBackwardLoop<Activation::kIdentity>(n, with_rop, a, ra, re, e, rdelta, delta);
        break;
    }
    return absl::OkStatus();
  }

  absl::Status ColumnSumsImpl(int rows, int cols, ConstDSpan x, DSpan out) override {
    const float* __restrict px = x.data;
    float* __restrict po = out.data;
    for (int c = 0; c < cols; ++c) po[c] = 0.0f;
    for (int r = 0; r < rows; ++r) {
      const float* row = px + static_cast<int64_t>(r) * cols;
      for (int c = 0; c < cols; ++c) po[c] = po[c] + row[c];
    }
    return absl::OkStatus();
  }

  absl::Status SoftmaxCrossEntropyImpl(int rows, int classes, bool with_rop,
                                       ConstDSpan logits_pair, ConstDIntSpan labels, float scale,
                                       DSpan delta_pair, DSpan stats) override {
    const int64_t half = static_cast<int64_t>(rows) * classes;
    const bool want_delta = delta_pair.size > 0;
    float loss_sum = 0.0f;
    float correct_sum = 0.0f;
    for (int r = 0; r < rows; ++r) {
      const int64_t base = static_cast<int64_t>(r) * classes;
      const float* a = logits_pair.data + base;
      const float* ra = with_rop ? logits_pair.data + half + base : nullptr;
      float* rdelta = (want_delta && with_rop) ? delta_pair.data + base : nullptr;
      float* delta = want_delta ? delta_pair.data + (with_rop ? half : 0) + base : nullptr;
      float loss = 0.0f;
      int correct = 0;
      SoftmaxCrossEntropyRow(a, ra, classes, labels.data[r], scale, delta, rdelta, &loss,
                             &correct);
      loss_sum += loss;
      correct_sum += static_cast<float>(correct);
    }
    stats.data[0] = scale * loss_sum;
    stats.data[1] = correct_sum;
    return absl::OkStatus();
  }

  absl::Status RademacherFillImpl(const RngStream& stream, DSpan out) override {
    const uint64_t key = RngStreamKey(stream);
    const int64_t n = out.size;
    const int64_t full_quads = n / 4;
    float* po = out.data;
    RademacherQuads(stream, key, full_quads, po);
    if (full_quads * 4 < n) {
      const Philox4x32 w = RngQuad(stream, key, static_cast<uint64_t>(full_quads));
      for (int64_t i = full_quads * 4; i < n; ++i) po[i] = RademacherFromWord(w.v[i & 3]);
    }
    return absl::OkStatus();
  }

  absl::Status BlockAverageRowsImpl(int rows, int cols, int block, DSpan x) override {
    return ::rebound::compute::BlockAverageRows(rows, cols, block,
                                                absl::Span<float>(x.data, x.size));
  }

  absl::Status AdaHessianUpdateImpl(const AdaHessianScalars& s, ConstDSpan g, ConstDSpan d,
                                    DSpan m, DSpan v, DSpan theta) override {
    return ::rebound::compute::AdaHessianUpdate(
        s, absl::Span<const float>(g.data, g.size), absl::Span<const float>(d.data, d.size),
        absl::Span<float>(m.data, m.size), absl::Span<float>(v.data, v.size),
        absl::Span<float>(theta.data, theta.size));
  }

  absl::Status ElasticMoveImpl(float rate, ConstDSpan toward, DSpan y) override {
    return ::rebound::compute::ElasticMove(rate, absl::Span<const float>(toward.data, toward.size),
                                           absl::Span<float>(y.data, y.size));
  }

 private:
  const int threads_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(int threads) {
  if (threads < 1 || threads > 256) {
    return absl::InvalidArgumentError(
        absl::StrFormat("compute.threads must be in [1, 256], got %d", threads));
  }
  openblas_set_num_threads(threads);
  return std::unique_ptr<Backend>(new CpuBackend(threads));
}

}  // namespace compute
}  // namespace rebound
