// CUDA backend against the CPU backend (built only with --config=cuda; tagged "gpu").
// Without a CUDA device every test case prints "SKIPPED: no CUDA device" and passes with a
// warning (Catch2 v2 has no SKIP).

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "compute/adahessian.h"
#include "compute/backend.h"
#include "compute/backend_factory.h"
#include "compute/step.h"
#include "tests/compute/test_util.h"

namespace rebound {
namespace compute {
namespace {

using testing::BitEqual;
using testing::MakeSpec;
using testing::ToHost;
using testing::UniformFloats;
using testing::UniformLabels;

// The CUDA backend, or null after reporting the test as skipped.
std::unique_ptr<Backend> CudaOrSkip() {
  ComputeConfig config;
  config.set_backend(CUDA);
  auto backend = CreateBackend(config);
  if (!backend.ok()) {
    std::cout << "SKIPPED: no CUDA device (" << backend.status().message() << ")" << std::endl;
    WARN("SKIPPED: no CUDA device: " << backend.status().message());
    return nullptr;
  }
  return std::move(backend).value();
}

DeviceBuffer Upload(Backend& backend, const std::vector<float>& host) {
  DeviceBuffer buffer = backend.Allocate(host.size()).value();
  REQUIRE(backend.CopyToDevice(host, buffer.span()).ok());
  return buffer;
}

void CheckClose(const std::vector<float>& got, const std::vector<float>& want, double rel) {
  REQUIRE(got.size() == want.size());
  double scale = 0;
  for (float w : want) scale = std::max(scale, std::abs(static_cast<double>(w)));
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i);
    CHECK(std::abs(static_cast<double>(got[i]) - want[i]) <= rel * scale + 1e-7);
  }
}

TEST_CASE("CUDA kernels agree with the CPU backend", "[gpu]") {
  std::unique_ptr<Backend> gpu = CudaOrSkip();
  if (gpu == nullptr) return;
  auto cpu = testing::CpuBackend();
  INFO(gpu->name());

  SECTION("GEMM in every transpose combination") {
    const int m = 37, n = 29, k = 41;
    for (Transpose ta : {Transpose::kNo, Transpose::kYes}) {
      for (Transpose tb : {Transpose::kNo, Transpose::kYes}) {
        const std::vector<float> a = UniformFloats(m * k, -1, 1, 1);
        const std::vector<float> b = UniformFloats(k * n, -1, 1, 2);
        const std::vector<float> c = UniformFloats(m * n, -1, 1, 3);
        const int lda = ta == Transpose::kYes ? m : k;
        const int ldb = tb == Transpose::kYes ? k : n;
        std::vector<float> results[2];
        Backend* backends[2] = {cpu.get(), gpu.get()};
        for (int i = 0; i < 2; ++i) {
          DeviceBuffer da = Upload(*backends[i], a), db = Upload(*backends[i], b),
                       dc = Upload(*backends[i], c);
          REQUIRE(backends[i]->Gemm(ta, tb, m, n, k, 0.75f, da.span(), lda, db.span(), ldb, 0.5f,
                                    dc.span(), n)
                      .ok());
          results[i] = ToHost(*backends[i], dc.span());
        }
        CheckClose(results[1], results[0], 1e-5);
      }
    }
  }

  SECTION("order-fixed reductions, RNG and optimizer kernels give identical bits") {
    const std::vector<float> x = UniformFloats(64 * 33, -1, 1, 4);
    const std::vector<float> g = UniformFloats(1000, -1, 1, 5);
    const std::vector<float> d = UniformFloats(1000, -1, 1, 6);
    const std::vector<float> theta = UniformFloats(1000, -1, 1, 7);
    const AdaHessianScalars s = MakeAdaHessianScalars(AdaHessianConfig(), 3);
    RngStream stream;
    stream.seed = 99;
    stream.step = 5;
    stream.tensor_id = 4;
    stream.purpose = kRngHutchinson;
    std::vector<float> out[2][6];
    Backend* backends[2] = {cpu.get(), gpu.get()};
    for (int i = 0; i < 2; ++i) {
      Backend& be = *backends[i];
      DeviceBuffer dx = Upload(be, x), sums = be.Allocate(33).value();
      REQUIRE(be.ColumnSums(64, 33, dx.span(), sums.span()).ok());
      out[i][0] = ToHost(be, sums.span());
      DeviceBuffer z = be.Allocate(1001).value();
      REQUIRE(be.RademacherFill(stream, z.span()).ok());
      out[i][1] = ToHost(be, z.span());
      DeviceBuffer dg = Upload(be, g), dd = Upload(be, d), dt = Upload(be, theta),
                   dm = be.Allocate(1000).value(), dv = be.Allocate(1000).value();
      REQUIRE(be.AdaHessianUpdate(s, dg.span(), dd.span(), dm.span(), dv.span(), dt.span()).ok());
      out[i][2] = ToHost(be, dt.span());
      out[i][3] = ToHost(be, dv.span());
      REQUIRE(be.ElasticMove(0.3f, dg.span(), dd.span()).ok());
      out[i][4] = ToHost(be, dd.span());
      REQUIRE(be.BlockAverageRows(64, 33, 4, dx.span()).ok());
      out[i][5] = ToHost(be, dx.span());
    }
    for (int k = 0; k < 6; ++k) {
      INFO("output " << k);
      CHECK(BitEqual(out[1][k], out[0][k]));
    }
  }

  SECTION("fused layer kernels and softmax cross-entropy") {
    const int rows = 16, cols = 24, classes = 10;
    const std::vector<float> a = UniformFloats(2 * rows * cols, -3, 3, 8);
    const std::vector<float> e = UniformFloats(2 * rows * cols, -1, 1, 9);
    const std::vector<float> b = UniformFloats(cols, -1, 1, 10);
    const std::vector<float> logits = UniformFloats(2 * rows * classes, -4, 4, 11);
    const std::vector<int32_t> labels = UniformLabels(rows, classes, 12);
    for (Activation act : {Activation::kRelu, Activation::kTanh, Activation::kGelu}) {
      std::vector<float> res[2][3];
      Backend* backends[2] = {cpu.get(), gpu.get()};
      for (int i = 0; i < 2; ++i) {
        Backend& be = *backends[i];
        DeviceBuffer da = Upload(be, a), db = Upload(be, b), de = Upload(be, e),
                     h = be.Allocate(a.size()).value(), out = be.Allocate(a.size()).value();
        REQUIRE(be.BiasActivationForward(act, rows, cols, true, db.span(), db.span(), da.span(),
                                         h.span())
                    .ok());
        REQUIRE(be.ActivationBackward(act, rows, cols, true, da.span(), de.span(), out.span())
                    .ok());
        res[i][0] = ToHost(be, h.span());
        res[i][1] = ToHost(be, out.span());
        DeviceBuffer dl = Upload(be, logits), dy = be.Allocate(rows, DType::kInt32).value(),
                     delta = be.Allocate(logits.size()).value(), stats = be.Allocate(2).value();
        REQUIRE(be.CopyToDevice(labels, dy.int_span()).ok());
        REQUIRE(be.SoftmaxCrossEntropy(rows, classes, true, dl.span(), dy.int_span(), 0.5f,
                                       delta.span(), stats.span())
                    .ok());
        res[i][2] = ToHost(be, delta.span());
        const std::vector<float> st = ToHost(be, stats.span());
        res[i][2].insert(res[i][2].end(), st.begin(), st.end());
      }
      INFO("activation " << static_cast<int>(act));
      for (int k = 0; k < 3; ++k) CheckClose(res[1][k], res[0][k], 1e-5);
    }
  }
}

TrainerOptions ParityOptions() {
  TrainerOptions options;
  options.model = MakeSpec(64, {{96, rebound::GELU}, {80, rebound::RELU}, {48, rebound::TANH},
                                {10, rebound::IDENTITY}});
  options.batch_size = 64;
  options.micro_batches = 4;
  options.seed = 8;
  return options;
}

TEST_CASE("CUDA step sums match the CPU and CUDA steps are deterministic", "[gpu]") {
  std::unique_ptr<Backend> gpu = CudaOrSkip();
  if (gpu == nullptr) return;
  auto cpu = testing::CpuBackend();
  const TrainerOptions options = ParityOptions();
  const std::vector<float> images = UniformFloats(64 * 64, -1, 1, 21);
  const std::vector<int32_t> labels = UniformLabels(64, 10, 22);

  // Gradient, Hz and loss of step 1 on both backends.
  std::vector<float> sums[2];
  Backend* backends[2] = {cpu.get(), gpu.get()};
  for (int i = 0; i < 2; ++i) {
    auto trainer = LocalTrainer::Create(backends[i], options).value();
    REQUIRE(trainer->InitParams().ok());
    REQUIRE(trainer->LoadBatch(images, labels).ok());
    auto result = trainer->ComputeBlock(1, {0, options.micro_batches});
    REQUIRE(result.ok());
    sums[i] = ToHost(*backends[i], (*result)[0]);
  }
  const StageLayout layout = StageLayout::Create(options.model, 0, 4).value();
  const int64_t p = layout.padded_size();
  auto part = [&](const std::vector<float>& v, int64_t offset, int64_t n) {
    return std::vector<float>(v.begin() + offset, v.begin() + offset + n);
  };
  CheckClose(part(sums[1], layout.grad_offset(), p), part(sums[0], layout.grad_offset(), p),
             1e-4);
  CheckClose(part(sums[1], layout.hz_offset(), p), part(sums[0], layout.hz_offset(), p), 1e-4);
  CHECK(sums[1][layout.stats_offset()] ==
        Approx(sums[0][layout.stats_offset()]).epsilon(1e-5));

  // CUDA: repeated runs and a k = 2 block split give identical bits.
  std::vector<float> runs[2];
  for (int run = 0; run < 2; ++run) {
    auto trainer = LocalTrainer::Create(gpu.get(), options).value();
    REQUIRE(trainer->InitParams().ok());
    for (int t = 1; t <= 3; ++t) REQUIRE(trainer->Step(t, images, labels).ok());
    runs[run].resize(layout.packed_size());
    REQUIRE(trainer->stage(0).GetParams(absl::MakeSpan(runs[run])).ok());
  }
  CHECK(BitEqual(runs[0], runs[1]));

  auto trainer = LocalTrainer::Create(gpu.get(), options).value();
  REQUIRE(trainer->InitParams().ok());
  auto leader = TreeAccumulator::Create(gpu.get(), layout.sums_size()).value();
  const std::vector<TreeNode> blocks = TreeAlignedBlocks(options.micro_batches, 2).value();
  for (int t = 1; t <= 3; ++t) {
    REQUIRE(trainer->LoadBatch(images, labels).ok());
    std::vector<DeviceBuffer> partials;
    for (const TreeNode& block : blocks) {
      auto s = trainer->ComputeBlock(t, block);
      REQUIRE(s.ok());
      partials.push_back(gpu->Allocate((*s)[0].size).value());
      REQUIRE(gpu->Copy((*s)[0], partials.back().span()).ok());
    }
    REQUIRE(leader->Start(options.micro_batches, {0, options.micro_batches},
                          layout.sums_size())
                .ok());
    for (size_t b = 0; b < blocks.size(); ++b) {
      REQUIRE(leader->CommitCopy(blocks[b], partials[b].span()).ok());
    }
    const std::vector<ConstDSpan> combined = {leader->Result().value()};
    REQUIRE(trainer->Apply(t, combined).ok());
  }
  std::vector<float> split(layout.packed_size());
  REQUIRE(trainer->stage(0).GetParams(absl::MakeSpan(split)).ok());
  CHECK(BitEqual(split, runs[0]));
}

}  // namespace
}  // namespace compute
}  // namespace rebound
