// The Backend contract on the CPU backend (compute/backend.h, compute/cpu/cpu_backend.h) and the
// backend factory (compute/backend_factory.h).

#include "compute/backend.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/rng.h"
#include "compute/backend_factory.h"
#include "compute/cpu/cpu_backend.h"
#include "tests/compute/reference_mlp.h"
#include "tests/compute/test_util.h"

namespace rebound {
namespace compute {
namespace {

using testing::ToHost;
using testing::UniformFloats;

DeviceBuffer Upload(Backend& backend, const std::vector<float>& host) {
  DeviceBuffer buffer = backend.Allocate(host.size()).value();
  REQUIRE(backend.CopyToDevice(host, buffer.span()).ok());
  return buffer;
}

TEST_CASE("GEMM computes alpha op(A) op(B) + beta C for every transpose combination",
          "[backend]") {
  auto backend = testing::CpuBackend();
  const int m = 5, n = 7, k = 3;
  for (Transpose ta : {Transpose::kNo, Transpose::kYes}) {
    for (Transpose tb : {Transpose::kNo, Transpose::kYes}) {
      const bool at = ta == Transpose::kYes;
      const bool bt = tb == Transpose::kYes;
      // Leading dimensions larger than the widths, to exercise them.
      const int lda = (at ? m : k) + 2;
      const int ldb = (bt ? k : n) + 1;
      const int ldc = n + 3;
      const std::vector<float> a = UniformFloats((at ? k : m) * lda, -1, 1, 1);
      const std::vector<float> b = UniformFloats((bt ? n : k) * ldb, -1, 1, 2);
      const std::vector<float> c0 = UniformFloats(m * ldc, -1, 1, 3);
      DeviceBuffer da = Upload(*backend, a), db = Upload(*backend, b), dc = Upload(*backend, c0);
      REQUIRE(backend->Gemm(ta, tb, m, n, k, 0.5f, da.span(), lda, db.span(), ldb, -2.0f,
                            dc.span(), ldc)
                  .ok());
      const std::vector<float> c = ToHost(*backend, dc.span());
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          double s = 0;
          for (int p = 0; p < k; ++p) {
            const double av = at ? a[p * lda + i] : a[i * lda + p];
            const double bv = bt ? b[j * ldb + p] : b[p * ldb + j];
            s += av * bv;
          }
          INFO("ta " << at << " tb " << bt << " C[" << i << "][" << j << "]");
          CHECK(c[i * ldc + j] == Approx(0.5 * s - 2.0 * c0[i * ldc + j]).margin(1e-5));
        }
        for (int j = n; j < ldc; ++j) CHECK(c[i * ldc + j] == c0[i * ldc + j]);  // untouched
      }
    }
  }
  CHECK(backend->counters().gemm_calls == 4);
  CHECK(backend->counters().gemm_flops == 4 * 2.0 * m * n * k);
}

TEST_CASE("GEMM rejects spans too small for their shapes and overlapping outputs",
          "[backend]") {
  auto backend = testing::CpuBackend();
  DeviceBuffer a = backend->Allocate(6).value(), b = backend->Allocate(6).value(),
               c = backend->Allocate(3).value();
  CHECK(backend->Gemm(Transpose::kNo, Transpose::kNo, 2, 2, 3, 1, a.span(), 3, b.span(), 2, 0,
                      c.span(), 2)
            .code() == absl::StatusCode::kInvalidArgument);
  CHECK(backend->Gemm(Transpose::kNo, Transpose::kNo, 2, 2, 3, 1, a.span(), 2, b.span(), 2, 0,
                      a.span(), 2)
            .code() == absl::StatusCode::kInvalidArgument);
  CHECK(backend->counters().gemm_calls == 0);
}

TEST_CASE("element-wise kernels add, multiply, scale and broadcast rows", "[backend]") {
  auto backend = testing::CpuBackend();
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};
  const std::vector<float> b = {0.5f, -1, 2, 0, 1, -3};
  DeviceBuffer da = Upload(*backend, a), db = Upload(*backend, b);
  DeviceBuffer out = backend->Allocate(6).value();
  REQUIRE(backend->Add(da.span(), db.span(), out.span()).ok());
  CHECK(ToHost(*backend, out.span()) == std::vector<float>{1.5f, 1, 5, 4, 6, 3});
  REQUIRE(backend->Multiply(da.span(), db.span(), out.span()).ok());
  CHECK(ToHost(*backend, out.span()) == std::vector<float>{0.5f, -2, 6, 0, 5, -18});
  REQUIRE(backend->Axpy(2.0f, da.span(), db.span()).ok());
  CHECK(ToHost(*backend, db.span()) == std::vector<float>{2.5f, 3, 8, 8, 11, 9});
  DeviceBuffer v = Upload(*backend, {10, 20, 30});
  REQUIRE(backend->AddRowVector(2, 3, v.span(), da.span()).ok());
  CHECK(ToHost(*backend, da.span()) == std::vector<float>{11, 22, 33, 14, 25, 36});
  REQUIRE(backend->ColumnSums(2, 3, da.span(), v.span()).ok());
  CHECK(ToHost(*backend, v.span()) == std::vector<float>{25, 47, 69});
  REQUIRE(backend->Fill(out.span(), 7.0f).ok());
  CHECK(ToHost(*backend, out.span()) == std::vector<float>(6, 7.0f));
  DeviceBuffer short_buf = backend->Allocate(5).value();
  CHECK(backend->Add(da.span(), db.span(), short_buf.span()).code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("activations' first and second derivatives match finite differences", "[backend]") {
  for (Activation act : {Activation::kRelu, Activation::kTanh, Activation::kGelu,
                         Activation::kIdentity}) {
    for (double a : {-2.5, -0.7, -0.1, 0.3, 1.1, 3.0}) {
      INFO("activation " << static_cast<int>(act) << " at " << a);
      const ActivationDerivatives got = EvalActivation(act, static_cast<float>(a));
      const testing::RefActivation ref = testing::RefEval(act, a);
      const double h = 1e-5;
      const testing::RefActivation hi = testing::RefEval(act, a + h);
      const testing::RefActivation lo = testing::RefEval(act, a - h);
      CHECK(ref.d1 == Approx((hi.f - lo.f) / (2 * h)).margin(1e-7));
      CHECK(ref.d2 == Approx((hi.d1 - lo.d1) / (2 * h)).margin(1e-7));
      CHECK(got.f == Approx(ref.f).margin(1e-6));
      CHECK(got.d1 == Approx(ref.d1).margin(1e-6));
      CHECK(got.d2 == Approx(ref.d2).margin(1e-6));
    }
  }
}

TEST_CASE("the fused layer kernels add the bias and propagate the R-op pairs", "[backend]") {
  auto backend = testing::CpuBackend();
  const int rows = 2, cols = 3;
  const std::vector<float> a_host = UniformFloats(2 * rows * cols, -2, 2, 9);
  const std::vector<float> b = {0.1f, -0.2f, 0.3f};
  const std::vector<float> rb = {1.0f, -1.0f, 1.0f};
  DeviceBuffer a = Upload(*backend, a_host), h = backend->Allocate(a_host.size()).value();
  DeviceBuffer db = Upload(*backend, b), drb = Upload(*backend, rb);
  REQUIRE(backend->BiasActivationForward(Activation::kTanh, rows, cols, true, db.span(),
                                         drb.span(), a.span(), h.span())
              .ok());
  const std::vector<float> a_out = ToHost(*backend, a.span());
  const std::vector<float> h_out = ToHost(*backend, h.span());
  const int half = rows * cols;
  for (int i = 0; i < half; ++i) {
    const double x = static_cast<double>(a_host[i]) + b[i % cols];
    const double rx = static_cast<double>(a_host[half + i]) + rb[i % cols];
    CHECK(a_out[i] == Approx(x).margin(1e-6));
    CHECK(a_out[half + i] == Approx(rx).margin(1e-6));
    CHECK(h_out[i] == Approx(std::tanh(x)).margin(1e-6));
    CHECK(h_out[half + i] == Approx((1 - std::tanh(x) * std::tanh(x)) * rx).margin(1e-6));
  }
  // Backward: [R{e}; e] -> [R{delta}; delta] = [R{e} f' + e f'' R{a}; e f'].
  const std::vector<float> e_host = UniformFloats(2 * half, -1, 1, 10);
  DeviceBuffer e = Upload(*backend, e_host), out = backend->Allocate(2 * half).value();
  REQUIRE(backend->ActivationBackward(Activation::kTanh, rows, cols, true, a.span(), e.span(),
                                      out.span())
              .ok());
  const std::vector<float> d = ToHost(*backend, out.span());
  for (int i = 0; i < half; ++i) {
    const testing::RefActivation ev = testing::RefEval(Activation::kTanh, a_out[i]);
    CHECK(d[half + i] == Approx(e_host[half + i] * ev.d1).margin(1e-6));
    CHECK(d[i] == Approx(e_host[i] * ev.d1 + e_host[half + i] * ev.d2 * a_out[half + i])
                      .margin(1e-6));
  }
}

TEST_CASE("softmax cross-entropy gives the loss, its gradient and its R-op", "[backend]") {
  auto backend = testing::CpuBackend();
  const int rows = 3, classes = 4;
  const std::vector<float> logits = UniformFloats(2 * rows * classes, -3, 3, 12);
  const std::vector<int32_t> labels = {2, 0, 3};
  DeviceBuffer dl = Upload(*backend, logits);
  DeviceBuffer dy = backend->Allocate(rows, DType::kInt32).value();
  REQUIRE(backend->CopyToDevice(labels, dy.int_span()).ok());
  DeviceBuffer delta = backend->Allocate(2 * rows * classes).value();
  DeviceBuffer stats = backend->Allocate(2).value();
  const float scale = 0.25f;
  REQUIRE(backend->SoftmaxCrossEntropy(rows, classes, true, dl.span(), dy.int_span(), scale,
                                       delta.span(), stats.span())
              .ok());
  const std::vector<float> d = ToHost(*backend, delta.span());
  const std::vector<float> s = ToHost(*backend, stats.span());
  const int half = rows * classes;
  double loss = 0;
  int correct = 0;
  for (int r = 0; r < rows; ++r) {
    const float* a = logits.data() + r * classes;
    const float* ra = logits.data() + half + r * classes;
    double sum = 0, dot = 0;
    int argmax = 0;
    for (int j = 0; j < classes; ++j) {
      sum += std::exp(static_cast<double>(a[j]));
      if (a[j] > a[argmax]) argmax = j;
    }
    for (int j = 0; j < classes; ++j) dot += std::exp(a[j]) / sum * ra[j];
    loss += std::log(sum) - a[labels[r]];
    correct += argmax == labels[r];
    for (int j = 0; j < classes; ++j) {
      const double p = std::exp(a[j]) / sum;
      CHECK(d[half + r * classes + j] == Approx(scale * (p - (j == labels[r]))).margin(1e-6));
      CHECK(d[r * classes + j] == Approx(scale * p * (ra[j] - dot)).margin(1e-6));
    }
  }
  CHECK(s[0] == Approx(scale * loss).epsilon(1e-6));
  CHECK(s[1] == correct);
}

TEST_CASE("Rademacher fills reproduce common/rng.h draw for draw", "[backend]") {
  auto backend = testing::CpuBackend();
  for (int64_t n : {1, 3, 4, 5, 1031}) {
    RngStream stream;
    stream.seed = 0x1234567890ull;
    stream.replica = 3;
    stream.step = (uint64_t{1} << 33) + 17;
    stream.tensor_id = 5;
    stream.purpose = kRngHutchinson;
    DeviceBuffer z = backend->Allocate(n).value();
    REQUIRE(backend->RademacherFill(stream, z.span()).ok());
    const std::vector<float> host = ToHost(*backend, z.span());
    int plus = 0;
    for (int64_t i = 0; i < n; ++i) {
      INFO("n " << n << " index " << i);
      REQUIRE(host[i] == RngRademacher(stream, static_cast<uint64_t>(i)));
      plus += host[i] > 0;
    }
    if (n == 1031) CHECK(std::abs(plus - 515.5) < 80);
  }
}

TEST_CASE("block averaging on the backend matches the definition", "[backend]") {
  auto backend = testing::CpuBackend();
  DeviceBuffer x = Upload(*backend, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14});
  REQUIRE(backend->BlockAverageRows(2, 7, 3, x.span()).ok());
  CHECK(ToHost(*backend, x.span()) ==
        std::vector<float>{2, 2, 2, 5, 5, 5, 7, 9, 9, 9, 12, 12, 12, 14});
  CHECK(backend->BlockAverageRows(2, 7, 0, x.span()).code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("device buffers are zero-filled, typed and movable", "[backend]") {
  auto backend = testing::CpuBackend();
  DeviceBuffer f = backend->Allocate(10).value();
  CHECK(ToHost(*backend, f.span()) == std::vector<float>(10, 0.0f));
  DeviceBuffer i = backend->Allocate(4, DType::kInt32).value();
  CHECK(i.span().data == nullptr);
  CHECK(i.int_span().size == 4);
  DeviceBuffer moved = std::move(f);
  CHECK(moved.size() == 10);
  CHECK(f.size() == 0);  // NOLINT: moved-from state is specified
  CHECK(backend->Allocate(-1).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("the factory builds the CPU backend and explains why CUDA is unavailable",
          "[backend]") {
  ComputeConfig config;
  auto cpu = CreateBackend(config);
  REQUIRE(cpu.ok());
  CHECK((*cpu)->host_addressable());
  CHECK_THAT((*cpu)->name(), Catch::Contains("cpu"));

  config.set_threads(0);
  CHECK(CreateBackend(config).status().code() == absl::StatusCode::kInvalidArgument);
  config.set_threads(1);
  config.set_backend(BACKEND_UNSPECIFIED);
  CHECK(CreateBackend(config).status().code() == absl::StatusCode::kInvalidArgument);

  config.set_backend(CUDA);
  auto cuda = CreateBackend(config);
  if (!CudaBackendCompiledIn()) {
    CHECK(cuda.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(std::string(cuda.status().message()), Catch::Contains("--config=cuda"));
  } else if (!cuda.ok()) {
    // A CUDA build on a machine without a device.
    CHECK(cuda.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(std::string(cuda.status().message()), Catch::Contains("CUDA"));
  }
}

}  // namespace
}  // namespace compute
}  // namespace rebound
