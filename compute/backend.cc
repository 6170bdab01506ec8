#include "compute/backend.h"

#include <utility>

#include "absl/strings/str_format.h"

namespace rebound {
namespace compute {
namespace {

absl::Status SizeMismatch(const char* op, int64_t want, int64_t got) {
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: span has %d elements, expected %d", op, got, want));
}

// OK iff a span of `size` elements holds a row-major matrix of `rows` x `cols` with leading
// dimension `ld`.
absl::Status CheckMatrix(const char* op, const char* which, int rows, int cols, int ld,
                         int64_t size) {
  if (rows < 0 || cols < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %s has negative shape %d x %d", op, which, rows, cols));
  }
  if (ld < (cols > 1 ? cols : 1)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: leading dimension of %s is %d, smaller than its %d columns", op, which, ld, cols));
  }
  if (rows > 0 && cols > 0) {
    const int64_t need = static_cast<int64_t>(rows - 1) * ld + cols;
    if (need > size) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: %s (%d x %d, ld %d) needs %d elements, span has %d", op, which,
                          rows, cols, ld, need, size));
    }
  }
  return absl::OkStatus();
}

bool Overlap(const float* a, int64_t na, const float* b, int64_t nb) {
  return na > 0 && nb > 0 && a < b + nb && b < a + na;
}

}  // namespace

// ---- DeviceBuffer ----------------------------------------------------------------------------

DeviceBuffer::~DeviceBuffer() { Release(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : owner_(other.owner_), data_(other.data_), size_(other.size_), dtype_(other.dtype_) {
  other.owner_ = nullptr;
  other.data_ = nullptr;
  other.size_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    owner_ = other.owner_;
    data_ = other.data_;
    size_ = other.size_;
    dtype_ = other.dtype_;
    other.owner_ = nullptr;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

void DeviceBuffer::Release() {
  if (owner_ != nullptr && data_ != nullptr) owner_->FreeRaw(data_);
  owner_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

DSpan DeviceBuffer::span() {
  if (dtype_ != DType::kFloat32) return DSpan();
  return DSpan{static_cast<float*>(data_), size_};
}

ConstDSpan DeviceBuffer::span() const {
  if (dtype_ != DType::kFloat32) return ConstDSpan();
  return ConstDSpan(static_cast<const float*>(data_), size_);
}

DIntSpan DeviceBuffer::int_span() {
  if (dtype_ != DType::kInt32) return DIntSpan();
  return DIntSpan{static_cast<int32_t*>(data_), size_};
}

ConstDIntSpan DeviceBuffer::int_span() const {
  if (dtype_ != DType::kInt32) return ConstDIntSpan();
  return ConstDIntSpan(static_cast<const int32_t*>(data_), size_);
}

// ---- Backend -----------------------------------------------------------------------------------

Backend::~Backend() = default;

absl::StatusOr<DeviceBuffer> Backend::Allocate(int64_t size, DType dtype) {
  if (size < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("Allocate: negative size %d", size));
  }
  DeviceBuffer buffer;
  buffer.dtype_ = dtype;
  if (size == 0) return buffer;
  const int64_t bytes = size * 4;  // both dtypes are 4 bytes wide
  absl::StatusOr<void*> ptr = AllocateRaw(bytes);
  if (!ptr.ok()) return ptr.status();
  buffer.owner_ = this;
  buffer.data_ = *ptr;
  buffer.size_ = size;
  absl::Status zeroed = ZeroRaw(*ptr, bytes);
  if (!zeroed.ok()) return zeroed;
  return buffer;
}

absl::Status Backend::CopyToDevice(absl::Span<const float> src, DSpan dst) {
  if (static_cast<int64_t>(src.size()) != dst.size) {
    return SizeMismatch("CopyToDevice", src.size(), dst.size);
  }
  if (dst.size == 0) return absl::OkStatus();
  return CopyToDeviceRaw(src.data(), dst.data, dst.size * 4);
}

absl::Status Backend::CopyToDevice(absl::Span<const int32_t> src, DIntSpan dst) {
  if (static_cast<int64_t>(src.size()) != dst.size) {
    return SizeMismatch("CopyToDevice", src.size(), dst.size);
  }
  if (dst.size == 0) return absl::OkStatus();
  return CopyToDeviceRaw(src.data(), dst.data, dst.size * 4);
}

absl::Status Backend::CopyToHost(ConstDSpan src, absl::Span<float> dst) {
  if (static_cast<int64_t>(dst.size()) != src.size) {
    return SizeMismatch("CopyToHost", src.size, dst.size());
  }
  if (src.size == 0) return absl::OkStatus();
  return CopyToHostRaw(src.data, dst.data(), src.size * 4);
}

absl::Status Backend::CopyToHost(ConstDIntSpan src, absl::Span<int32_t> dst) {
  if (static_cast<int64_t>(dst.size()) != src.size) {
    return SizeMismatch("CopyToHost", src.size, dst.size());
  }
  if (src.size == 0) return absl::OkStatus();
  return CopyToHostRaw(src.data, dst.data(), src.size * 4);
}

absl::Status Backend::Copy(ConstDSpan src, DSpan dst) {
  if (src.size != dst.size) return SizeMismatch("Copy", src.size, dst.size);
  if (Overlap(src.data, src.size, dst.data, dst.size)) {
    return absl::InvalidArgumentError("Copy: source and destination overlap");
  }
  if (src.size == 0) return absl::OkStatus();
  return CopyRaw(src.data, dst.data, src.size * 4);
}

absl::Status Backend::Fill(DSpan dst, float value) {
  if (dst.size == 0) return absl::OkStatus();
  return FillImpl(dst, value);
}

absl::Status Backend::Gemm(Transpose ta, Transpose tb, int m, int n, int k, float alpha,
                           ConstDSpan a, int lda, ConstDSpan b, int ldb, float beta, DSpan c,
                           int ldc) {
  if (m < 0 || n < 0 || k < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("Gemm: negative shape %d %d %d", m, n, k));
  }
  const bool ta_yes = ta == Transpose::kYes;
  const bool tb_yes = tb == Transpose::kYes;
  absl::Status s = CheckMatrix("Gemm", "A", ta_yes ? k : m, ta_yes ? m : k, lda, a.size);
  if (!s.ok()) return s;
  s = CheckMatrix("Gemm", "B", tb_yes ? n : k, tb_yes ? k : n, ldb, b.size);
  if (!s.ok()) return s;
  s = CheckMatrix("Gemm", "C", m, n, ldc, c.size);
  if (!s.ok()) return s;
  if (Overlap(a.data, a.size, c.data, c.size) || Overlap(b.data, b.size, c.data, c.size)) {
    return absl::InvalidArgumentError("Gemm: C overlaps A or B");
  }
  if (m == 0 || n == 0) return absl::OkStatus();
  counters_.gemm_calls += 1;
  counters_.gemm_flops += 2.0 * m * n * k;
  return GemmImpl(ta, tb, m, n, k, alpha, a.data, lda, b.data, ldb, beta, c.data, ldc);
}

absl::Status Backend::Add(ConstDSpan a, ConstDSpan b, DSpan out) {
  if (a.size != out.size) return SizeMismatch("Add", out.size, a.size);
  if (b.size != out.size) return SizeMismatch("Add", out.size, b.size);
  if (out.size == 0) return absl::OkStatus();
  return AddImpl(a, b, out);
}

absl::Status Backend::Multiply(ConstDSpan a, ConstDSpan b, DSpan out) {
  if (a.size != out.size) return SizeMismatch("Multiply", out.size, a.size);
  if (b.size != out.size) return SizeMismatch("Multiply", out.size, b.size);
  if (out.size == 0) return absl::OkStatus();
  return MultiplyImpl(a, b, out);
}

absl::Status Backend::Axpy(float alpha, ConstDSpan x, DSpan y) {
  if (x.size != y.size) return SizeMismatch("Axpy", y.size, x.size);
  if (y.size == 0) return absl::OkStatus();
  return AxpyImpl(alpha, x, y);
}

absl::Status Backend::AddRowVector(int rows, int cols, ConstDSpan v, DSpan y) {
  if (rows < 0 || cols < 0) return absl::InvalidArgumentError("AddRowVector: negative shape");
  if (v.size != cols) return SizeMismatch("AddRowVector", cols, v.size);
  if (y.size != static_cast<int64_t>(rows) * cols) {
    return SizeMismatch("AddRowVector", static_cast<int64_t>(rows) * cols, y.size);
  }
  if (y.size == 0) return absl::OkStatus();
  return AddRowVectorImpl(rows, cols, v, y);
}

absl::Status Backend::BiasActivationForward(Activation act, int rows, int cols, bool with_rop,
                                            ConstDSpan b, ConstDSpan rb, DSpan a_pair,
                                            DSpan h_pair) {
  if (rows < 0 || cols < 0) {
    return absl::InvalidArgumentError("BiasActivationForward: negative shape");
  }
  const int64_t half = static_cast<int64_t>(rows) * cols;
  const int64_t want = with_rop ? 2 * half : half;
  if (b.size != cols) return SizeMismatch("BiasActivationForward bias", cols, b.size);
  if (with_rop && rb.size != cols) {
    return SizeMismatch("BiasActivationForward R{bias}", cols, rb.size);
  }
  if (a_pair.size != want) return SizeMismatch("BiasActivationForward a", want, a_pair.size);
  if (h_pair.size != want && !(act == Activation::kIdentity && h_pair.size == 0)) {
    return SizeMismatch("BiasActivationForward h", want, h_pair.size);
  }
  if (half == 0) return absl::OkStatus();
  return BiasActivationForwardImpl(act, rows, cols, with_rop, b, rb, a_pair, h_pair);
}

absl::Status Backend::ActivationBackward(Activation act, int rows, int cols, bool with_rop,
                                         ConstDSpan a_pair, ConstDSpan e_pair, DSpan out_pair) {
  if (rows < 0 || cols < 0) {
    return absl::InvalidArgumentError("ActivationBackward: negative shape");
  }
  const int64_t half = static_cast<int64_t>(rows) * cols;
  const int64_t want = with_rop ? 2 * half : half;
  if (a_pair.size != want) return SizeMismatch("ActivationBackward a", want, a_pair.size);
  if (e_pair.size != want) return SizeMismatch("ActivationBackward e", want, e_pair.size);
  if (out_pair.size != want) return SizeMismatch("ActivationBackward out", want, out_pair.size);
  if (half == 0) return absl::OkStatus();
  return ActivationBackwardImpl(act, rows, cols, with_rop, a_pair, e_pair, out_pair);
}

absl::Status Backend::ColumnSums(int rows, int cols, ConstDSpan x, DSpan out) {
  if (rows < 0 || cols < 0) return absl::InvalidArgumentError("ColumnSums: negative shape");
  if (x.size != static_cast<int64_t>(rows) * cols) {
    return SizeMismatch("ColumnSums", static_cast<int64_t>(rows) * cols, x.size);
  }
  if (out.size != cols) return SizeMismatch("ColumnSums out", cols, out.size);
  if (cols == 0) return absl::OkStatus();
  if (Overlap(x.data, x.size, out.data, out.size)) {
    return absl::InvalidArgumentError("ColumnSums: output overlaps input");
  }
  return ColumnSumsImpl(rows, cols, x, out);
}

absl::Status Backend::SoftmaxCrossEntropy(int rows, int classes, bool with_rop,
                                          ConstDSpan logits_pair, ConstDIntSpan labels,
                                          float scale, DSpan delta_pair, DSpan stats) {
  if (rows < 0 || classes < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("SoftmaxCrossEntropy: bad shape %d x %d", rows, classes));
  }
  const int64_t half = static_cast<int64_t>(rows) * classes;
  const int64_t want = with_rop ? 2 * half : half;
  if (logits_pair.size != want) {
    return SizeMismatch("SoftmaxCrossEntropy logits", want, logits_pair.size);
  }
  if (labels.size != rows) return SizeMismatch("SoftmaxCrossEntropy labels", rows, labels.size);
  if (delta_pair.size != 0 && delta_pair.size != want) {
    return SizeMismatch("SoftmaxCrossEntropy delta", want, delta_pair.size);
  }
  if (stats.size < 2) return SizeMismatch("SoftmaxCrossEntropy stats", 2, stats.size);
  if (Overlap(logits_pair.data, logits_pair.size, delta_pair.data, delta_pair.size) ||
      Overlap(stats.data, 2, delta_pair.data, delta_pair.size) ||
      Overlap(stats.data, 2, logits_pair.data, logits_pair.size)) {
    return absl::InvalidArgumentError("SoftmaxCrossEntropy: outputs overlap inputs");
  }
  return SoftmaxCrossEntropyImpl(rows, classes, with_rop, logits_pair, labels, scale, delta_pair,
                                 stats);
}

absl::Status Backend::RademacherFill(const RngStream& stream, DSpan out) {
  if (out.size == 0) return absl::OkStatus();
  return RademacherFillImpl(stream, out);
}

absl::Status Backend::BlockAverageRows(int rows, int cols, int block, DSpan x) {
  if (rows < 0 || cols < 0) {
    return absl::InvalidArgumentError("BlockAverageRows: negative shape");
  }
  if (block < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("BlockAverageRows: block size must be >= 1, got %d", block));
  }
  if (x.size != static_cast<int64_t>(rows) * cols) {
    return SizeMismatch("BlockAverageRows", static_cast<int64_t>(rows) * cols, x.size);
  }
  if (block == 1 || x.size == 0) return absl::OkStatus();
  return BlockAverageRowsImpl(rows, cols, block, x);
}

absl::Status Backend::AdaHessianUpdate(const AdaHessianScalars& s, ConstDSpan g, ConstDSpan d,
                                       DSpan m, DSpan v, DSpan theta) {
  const int64_t n = theta.size;
  if (g.size != n) return SizeMismatch("AdaHessianUpdate g", n, g.size);
  if (d.size != n) return SizeMismatch("AdaHessianUpdate d", n, d.size);
  if (m.size != n) return SizeMismatch("AdaHessianUpdate m", n, m.size);
  if (v.size != n) return SizeMismatch("AdaHessianUpdate v", n, v.size);
  if (n == 0) return absl::OkStatus();
  return AdaHessianUpdateImpl(s, g, d, m, v, theta);
}

absl::Status Backend::ElasticMove(float rate, ConstDSpan toward, DSpan y) {
  if (toward.size != y.size) return SizeMismatch("ElasticMove", y.size, toward.size);
  if (y.size == 0) return absl::OkStatus();
  return ElasticMoveImpl(rate, toward, y);
}

}  // namespace compute
}  // namespace rebound
