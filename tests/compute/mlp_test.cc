// The MLP stage (compute/mlp.h): gradients and exact Hessian-vector products against finite
// differences of an independent double-precision model, Hutchinson's estimator against the exact
// Hessian diagonal, and bit-identity of stage splits.

#include "compute/mlp.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/checksum.h"
#include "compute/model_layout.h"
#include "tests/compute/reference_mlp.h"
#include "tests/compute/test_util.h"

namespace rebound {
namespace compute {
namespace {

using testing::BitEqual;
using testing::MakeSpec;
using testing::ToHost;
using testing::UniformFloats;
using testing::UniformLabels;

// What one forward + backward pass of a single stage holding the whole model produces, in the
// packed layout.
struct PassResult {
  std::vector<float> logits;  // [logits; R{logits}] with the R-op
  std::vector<float> grad;
  std::vector<float> hz;
  float loss = 0.0f;
};

PassResult RunWholeModel(Backend& backend, MlpStage& stage, const std::vector<float>& x,
                         const std::vector<int32_t>& y, int rows, bool with_rop) {
  const StageLayout& layout = stage.layout();
  auto ws = stage.NewWorkspace(rows).value();
  auto x_dev = backend.Allocate(x.size()).value();
  auto y_dev = backend.Allocate(y.size(), DType::kInt32).value();
  REQUIRE(backend.CopyToDevice(x, x_dev.span()).ok());
  REQUIRE(backend.CopyToDevice(y, y_dev.int_span()).ok());
  auto sums = stage.NewSumsBuffer().value();
  auto logits = stage.Forward(x_dev.span(), rows, with_rop, ws.get());
  REQUIRE(logits.ok());
  PassResult result;
  result.logits = ToHost(backend, *logits);
  auto back = stage.BackwardFromLabels(y_dev.int_span(), rows,
                                       static_cast<float>(1.0 / rows), with_rop, ws.get(),
                                       sums.span());
  REQUIRE(back.ok());
  CHECK(back->empty());  // nothing flows below the model's input
  const std::vector<float> host = ToHost(backend, sums.span());
  const int64_t p = layout.padded_size();
  result.grad.resize(layout.packed_size());
  result.hz.resize(layout.packed_size());
  REQUIRE(layout.Pack(absl::MakeSpan(host).subspan(layout.grad_offset(), p),
                      absl::MakeSpan(result.grad)).ok());
  REQUIRE(layout.Pack(absl::MakeSpan(host).subspan(layout.hz_offset(), p),
                      absl::MakeSpan(result.hz)).ok());
  result.loss = host[layout.stats_offset() + kStatsLoss];
  return result;
}

std::vector<double> ToDouble(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

double MaxAbs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// Perturbs every parameter (biases included) so that no activation sits at a special point.
void PerturbParams(MlpStage& stage, uint32_t seed) {
  std::vector<float> packed(stage.layout().packed_size());
  REQUIRE(stage.GetParams(absl::MakeSpan(packed)).ok());
  const std::vector<float> noise = UniformFloats(packed.size(), -0.3f, 0.3f, seed);
  for (size_t i = 0; i < packed.size(); ++i) packed[i] += noise[i];
  REQUIRE(stage.SetParams(packed).ok());
}

std::vector<float> PackedDirection(Backend& backend, MlpStage& stage) {
  const StageLayout& layout = stage.layout();
  const std::vector<float> padded = ToHost(backend, stage.direction());
  std::vector<float> packed(layout.packed_size());
  REQUIRE(layout.Pack(padded, absl::MakeSpan(packed)).ok());
  return packed;
}

TEST_CASE("gradient and Hz match central finite differences for every activation", "[mlp]") {
  const rebound::Activation kinds[] = {rebound::RELU, rebound::TANH, rebound::GELU,
                                       rebound::IDENTITY};
  auto backend = testing::CpuBackend();
  for (rebound::Activation act : kinds) {
    INFO("hidden activation " << rebound::Activation_Name(act));
    const ModelSpec spec =
        MakeSpec(5, {{7, act}, {6, act}, {4, rebound::IDENTITY}}, /*init_seed=*/11);
    const int rows = 6;
    auto stage = MlpStage::Create(backend.get(), spec, 0, 3).value();
    REQUIRE(stage->InitParams().ok());
    PerturbParams(*stage, 5);
    REQUIRE(stage->DrawDirection(HutchinsonKey{3, 0, 1}).ok());
    const std::vector<float> x = UniformFloats(rows * 5, -1.0f, 1.0f, 17);
    const std::vector<int32_t> y = UniformLabels(rows, 4, 19);
    const PassResult pass = RunWholeModel(*backend, *stage, x, y, rows, /*with_rop=*/true);

    const std::vector<LayerInfo> layers = ModelLayers(spec).value();
    std::vector<float> params_f(stage->layout().packed_size());
    REQUIRE(stage->GetParams(absl::MakeSpan(params_f)).ok());
    const std::vector<double> theta = ToDouble(params_f);
    const std::vector<double> xd = ToDouble(x);
    const std::vector<int> yd(y.begin(), y.end());
    const int n = testing::RefParamCount(layers);
    REQUIRE(n == static_cast<int>(theta.size()));

    // Loss: the stats slot holds the batch mean.
    CHECK(pass.loss == Approx(testing::RefLoss(layers, theta, xd, yd, rows)).epsilon(1e-5));

    // Gradient: central differences of the double loss.
    const double h = 1e-6;
    std::vector<double> fd(n);
    for (int i = 0; i < n; ++i) {
      std::vector<double> plus = theta, minus = theta;
      plus[i] += h;
      minus[i] -= h;
      fd[i] = (testing::RefLoss(layers, plus, xd, yd, rows) -
               testing::RefLoss(layers, minus, xd, yd, rows)) /
              (2 * h);
    }
    const std::vector<double> ref_grad = testing::RefGradient(layers, theta, xd, yd, rows);
    const double gmax = MaxAbs(fd);
    REQUIRE(gmax > 1e-3);
    for (int i = 0; i < n; ++i) {
      INFO("parameter " << i);
      CHECK(std::abs(ref_grad[i] - fd[i]) <= 1e-6 * gmax + 1e-9);
      CHECK(std::abs(pass.grad[i] - fd[i]) <= 1e-4 * gmax + 1e-6);
    }

    // Hz: central differences of the (finite-difference-checked) double gradient along z.
    const std::vector<float> z = PackedDirection(*backend, *stage);
    const double eps = 1e-5;
    std::vector<double> plus = theta, minus = theta;
    for (int i = 0; i < n; ++i) {
      REQUIRE(std::abs(z[i]) == 1.0f);
      plus[i] += eps * z[i];
      minus[i] -= eps * z[i];
    }
    const std::vector<double> g_plus = testing::RefGradient(layers, plus, xd, yd, rows);
    const std::vector<double> g_minus = testing::RefGradient(layers, minus, xd, yd, rows);
    std::vector<double> hz_fd(n);
    for (int i = 0; i < n; ++i) hz_fd[i] = (g_plus[i] - g_minus[i]) / (2 * eps);
    const double hmax = MaxAbs(hz_fd);
    REQUIRE(hmax > 1e-3);
    for (int i = 0; i < n; ++i) {
      INFO("parameter " << i);
      CHECK(std::abs(pass.hz[i] - hz_fd[i]) <= 1e-4 * hmax + 1e-6);
    }
  }
}

TEST_CASE("without the R-op the gradient and loss match the R-op pass", "[mlp]") {
  auto backend = testing::CpuBackend();
  const ModelSpec spec = MakeSpec(6, {{9, rebound::GELU}, {5, rebound::IDENTITY}});
  auto stage = MlpStage::Create(backend.get(), spec, 0, 2).value();
  REQUIRE(stage->InitParams().ok());
  REQUIRE(stage->DrawDirection(HutchinsonKey{1, 0, 1}).ok());
  const std::vector<float> x = UniformFloats(4 * 6, -1, 1, 3);
  const std::vector<int32_t> y = UniformLabels(4, 5, 4);
  const PassResult with = RunWholeModel(*backend, *stage, x, y, 4, true);
  const PassResult without = RunWholeModel(*backend, *stage, x, y, 4, false);
  CHECK(without.logits.size() * 2 == with.logits.size());
  CHECK(without.loss == Approx(with.loss).epsilon(1e-6));
  for (size_t i = 0; i < with.grad.size(); ++i) {
    CHECK(without.grad[i] == Approx(with.grad[i]).epsilon(1e-5).margin(1e-7));
  }
}

TEST_CASE("mean of Hutchinson D over many draws approaches the exact Hessian diagonal",
          "[mlp]") {
  auto backend = testing::CpuBackend();
  const ModelSpec spec = MakeSpec(3, {{4, rebound::TANH}, {3, rebound::IDENTITY}}, 23);
  const int rows = 5;
  auto stage = MlpStage::Create(backend.get(), spec, 0, 2).value();
  REQUIRE(stage->InitParams().ok());
  PerturbParams(*stage, 29);
  const StageLayout& layout = stage->layout();
  const int n = static_cast<int>(layout.packed_size());
  const std::vector<float> x = UniformFloats(rows * 3, -2, 2, 31);
  const std::vector<int32_t> y = UniformLabels(rows, 3, 37);

  // The exact Hessian, column by column: H e_j by the R-op with unit directions.
  std::vector<std::vector<double>> hessian(n);
  for (int j = 0; j < n; ++j) {
    std::vector<float> unit(n, 0.0f), padded(layout.padded_size());
    unit[j] = 1.0f;
    REQUIRE(layout.Unpack(unit, absl::MakeSpan(padded)).ok());
    REQUIRE(backend->CopyToDevice(padded, stage->direction()).ok());
    hessian[j] = ToDouble(RunWholeModel(*backend, *stage, x, y, rows, true).hz);
  }
  double hmax = 0;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) hmax = std::max(hmax, std::abs(hessian[j][i]));
  }
  REQUIRE(hmax > 1e-2);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < i; ++j) {
      INFO("H[" << i << "][" << j << "]");
      CHECK(std::abs(hessian[j][i] - hessian[i][j]) <= 1e-5 * hmax);
    }
  }

  // D = z * Hz averaged over N draws of z (steps 1..N of one job).
  const int kDraws = 3000;
  std::vector<double> mean(n, 0.0);
  for (int t = 1; t <= kDraws; ++t) {
    REQUIRE(stage->DrawDirection(HutchinsonKey{41, 2, static_cast<uint64_t>(t)}).ok());
    const std::vector<float> z = PackedDirection(*backend, *stage);
    const std::vector<float> hz = RunWholeModel(*backend, *stage, x, y, rows, true).hz;
    for (int i = 0; i < n; ++i) mean[i] += static_cast<double>(z[i]) * hz[i] / kDraws;
  }
  for (int i = 0; i < n; ++i) {
    // Var(z_i (Hz)_i) = sum_{j != i} H_ij^2 for Rademacher z.
    double var = 0;
    for (int j = 0; j < n; ++j) {
      if (j != i) var += hessian[j][i] * hessian[j][i];
    }
    const double sigma = std::sqrt(var / kDraws);
    INFO("diagonal element " << i << ": mean " << mean[i] << " exact " << hessian[i][i]
                             << " sigma " << sigma);
    CHECK(std::abs(mean[i] - hessian[i][i]) <= 5 * sigma + 1e-6);
  }
}

// Runs layers split at `boundaries` as a chain of stages and returns the concatenated packed
// gradient and Hz, the logits and the loss.
PassResult RunSplit(Backend& backend, const ModelSpec& spec, const std::vector<int>& firsts,
                    const std::vector<float>& x, const std::vector<int32_t>& y, int rows,
                    bool with_rop, const HutchinsonKey& key) {
  const int num_layers = spec.layers_size();
  std::vector<std::unique_ptr<MlpStage>> stages;
  std::vector<std::unique_ptr<StageWorkspace>> workspaces;
  std::vector<DeviceBuffer> sums;
  for (size_t s = 0; s < firsts.size(); ++s) {
    const int end = s + 1 < firsts.size() ? firsts[s + 1] : num_layers;
    stages.push_back(MlpStage::Create(&backend, spec, firsts[s], end).value());
    REQUIRE(stages.back()->InitParams().ok());
    REQUIRE(stages.back()->DrawDirection(key).ok());
    workspaces.push_back(stages.back()->NewWorkspace(rows).value());
    sums.push_back(stages.back()->NewSumsBuffer().value());
  }
  auto x_dev = backend.Allocate(x.size()).value();
  auto y_dev = backend.Allocate(y.size(), DType::kInt32).value();
  REQUIRE(backend.CopyToDevice(x, x_dev.span()).ok());
  REQUIRE(backend.CopyToDevice(y, y_dev.int_span()).ok());
  ConstDSpan h = x_dev.span();
  for (size_t s = 0; s < stages.size(); ++s) {
    auto out = stages[s]->Forward(h, rows, with_rop, workspaces[s].get());
    REQUIRE(out.ok());
    h = *out;
  }
  PassResult result;
  result.logits = ToHost(backend, h);
  const int last = static_cast<int>(stages.size()) - 1;
  auto grad = stages[last]->BackwardFromLabels(y_dev.int_span(), rows,
                                               static_cast<float>(1.0 / rows), with_rop,
                                               workspaces[last].get(), sums[last].span());
  REQUIRE(grad.ok());
  for (int s = last - 1; s >= 0; --s) {
    grad = stages[s]->Backward(*grad, rows, with_rop, workspaces[s].get(), sums[s].span());
    REQUIRE(grad.ok());
  }
  for (size_t s = 0; s < stages.size(); ++s) {
    const StageLayout& layout = stages[s]->layout();
    const std::vector<float> host = ToHost(backend, sums[s].span());
    std::vector<float> g(layout.packed_size()), hz(layout.packed_size());
    REQUIRE(layout.Pack(absl::MakeSpan(host).subspan(0, layout.padded_size()),
                        absl::MakeSpan(g)).ok());
    result.grad.insert(result.grad.end(), g.begin(), g.end());
    if (with_rop) {
      REQUIRE(layout.Pack(absl::MakeSpan(host).subspan(layout.hz_offset(), layout.padded_size()),
                          absl::MakeSpan(hz)).ok());
      result.hz.insert(result.hz.end(), hz.begin(), hz.end());
    }
    if (s == stages.size() - 1) result.loss = host[layout.stats_offset() + kStatsLoss];
  }
  return result;
}

TEST_CASE("a model split into stages gives the same bits as the whole model", "[mlp]") {
  auto backend = testing::CpuBackend();
  const ModelSpec spec = MakeSpec(
      6, {{8, rebound::GELU}, {7, rebound::TANH}, {5, rebound::RELU}, {3, rebound::IDENTITY}});
  const int rows = 4;
  const std::vector<float> x = UniformFloats(rows * 6, -1, 1, 43);
  const std::vector<int32_t> y = UniformLabels(rows, 3, 47);
  const HutchinsonKey key{5, 1, 9};
  for (bool with_rop : {true, false}) {
    INFO("with_rop " << with_rop);
    const PassResult whole = RunSplit(*backend, spec, {0}, x, y, rows, with_rop, key);
    for (const std::vector<int>& firsts :
         std::vector<std::vector<int>>{{0, 2}, {0, 1, 3}, {0, 1, 2, 3}}) {
      INFO("stages starting at layers " << ::Catch::Detail::stringify(firsts));
      const PassResult split = RunSplit(*backend, spec, firsts, x, y, rows, with_rop, key);
      CHECK(BitEqual(split.logits, whole.logits));
      CHECK(BitEqual(split.grad, whole.grad));
      CHECK(BitEqual(split.hz, whole.hz));
      CHECK(std::memcmp(&split.loss, &whole.loss, sizeof(float)) == 0);
    }
  }
}

TEST_CASE("initialisation depends only on the seed and the global tensor ids", "[mlp]") {
  auto backend = testing::CpuBackend();
  const ModelSpec spec = MakeSpec(10, {{12, rebound::RELU}, {8, rebound::TANH},
                                       {4, rebound::IDENTITY}}, 99);
  auto whole = MlpStage::Create(backend.get(), spec, 0, 3).value();
  auto first = MlpStage::Create(backend.get(), spec, 0, 1).value();
  auto rest = MlpStage::Create(backend.get(), spec, 1, 3).value();
  for (MlpStage* s : {whole.get(), first.get(), rest.get()}) REQUIRE(s->InitParams().ok());
  std::vector<float> w(whole->layout().packed_size()), a(first->layout().packed_size()),
      b(rest->layout().packed_size());
  REQUIRE(whole->GetParams(absl::MakeSpan(w)).ok());
  REQUIRE(first->GetParams(absl::MakeSpan(a)).ok());
  REQUIRE(rest->GetParams(absl::MakeSpan(b)).ok());
  a.insert(a.end(), b.begin(), b.end());
  CHECK(BitEqual(w, a));

  // He uniform for the ReLU layer, Glorot for tanh/identity; biases zero.
  for (const TensorInfo& t : whole->layout().tensors()) {
    const LayerInfo& layer = whole->layout().layers()[t.layer];
    const double limit = layer.activation == Activation::kRelu
                             ? std::sqrt(6.0 / layer.in)
                             : std::sqrt(6.0 / (layer.in + layer.out));
    double max_abs = 0;
    for (int64_t k = 0; k < t.size(); ++k) {
      max_abs = std::max(max_abs, std::abs(static_cast<double>(w[t.packed_offset + k])));
    }
    if (t.is_bias) {
      CHECK(max_abs == 0.0);
    } else {
      CHECK(max_abs <= limit);
      CHECK(max_abs > 0.5 * limit);
    }
  }

  ModelSpec other = spec;
  other.set_init_seed(100);
  auto reseeded = MlpStage::Create(backend.get(), other, 0, 3).value();
  REQUIRE(reseeded->InitParams().ok());
  std::vector<float> r(reseeded->layout().packed_size());
  REQUIRE(reseeded->GetParams(absl::MakeSpan(r)).ok());
  CHECK_FALSE(BitEqual(w, r));
}

TEST_CASE("tensor ids, names and offsets follow the global layer index", "[mlp]") {
  const ModelSpec spec =
      MakeSpec(5, {{33, rebound::RELU}, {7, rebound::RELU}, {2, rebound::IDENTITY}});
  const StageLayout layout = StageLayout::Create(spec, 1, 3).value();
  REQUIRE(layout.tensors().size() == 4);
  CHECK(layout.tensors()[0].id == 2);
  CHECK(layout.tensors()[0].name == "layer1.weight");
  CHECK(layout.tensors()[0].rows == 7);
  CHECK(layout.tensors()[0].cols == 33);
  CHECK(layout.tensors()[1].id == 3);
  CHECK(layout.tensors()[1].name == "layer1.bias");
  CHECK(layout.tensors()[3].id == 5);
  for (const TensorInfo& t : layout.tensors()) CHECK(t.offset % kTensorAlignment == 0);
  CHECK(layout.packed_size() == 7 * 33 + 7 + 2 * 7 + 2);
  CHECK(layout.input_dim() == 33);
  CHECK(layout.output_dim() == 2);
  CHECK_FALSE(layout.is_first());
  CHECK(layout.is_last());
  CHECK(layout.sums_size() == 2 * layout.padded_size() + kStatsSlot);
}

TEST_CASE("invalid model specs and stage ranges are rejected with the offending field",
          "[mlp]") {
  ModelSpec relu_last = MakeSpec(4, {{3, rebound::RELU}, {2, rebound::RELU}});
  absl::Status s = ValidateModelSpec(relu_last);
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(s.message()), Catch::Contains("layers[1].activation"));

  ModelSpec zero_width = MakeSpec(4, {{0, rebound::RELU}, {2, rebound::IDENTITY}});
  s = ValidateModelSpec(zero_width);
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(s.message()), Catch::Contains("layers[0].width"));

  ModelSpec empty;
  CHECK(ValidateModelSpec(empty).code() == absl::StatusCode::kInvalidArgument);

  const ModelSpec ok = MakeSpec(4, {{3, rebound::RELU}, {2, rebound::IDENTITY}});
  CHECK(ValidateModelSpec(ok).ok());
  CHECK(StageLayout::Create(ok, 1, 1).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(StageLayout::Create(ok, 0, 3).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("backward needs a matching forward and the right stage kind", "[mlp]") {
  auto backend = testing::CpuBackend();
  const ModelSpec spec = MakeSpec(4, {{3, rebound::RELU}, {2, rebound::IDENTITY}});
  auto first = MlpStage::Create(backend.get(), spec, 0, 1).value();
  auto ws = first->NewWorkspace(2).value();
  auto sums = first->NewSumsBuffer().value();
  auto grad = backend->Allocate(2 * 2 * 3).value();
  CHECK(first->Backward(grad.span(), 2, true, ws.get(), sums.span()).status().code() ==
        absl::StatusCode::kFailedPrecondition);
  auto x = backend->Allocate(2 * 4).value();
  REQUIRE(first->Forward(x.span(), 2, true, ws.get()).ok());
  CHECK(first->Backward(grad.span(), 1, true, ws.get(), sums.span()).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(first->Backward(grad.span(), 2, true, ws.get(), sums.span()).ok());
  auto labels = backend->Allocate(2, DType::kInt32).value();
  CHECK(first->BackwardFromLabels(labels.int_span(), 2, 0.5f, true, ws.get(), sums.span())
            .status()
            .code() == absl::StatusCode::kFailedPrecondition);
  CHECK(first->Forward(x.span(), 3, true, ws.get()).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("ParamsChecksum hashes the packed parameters without a copy", "[mlp]") {
  auto backend = testing::CpuBackend();
  const ModelSpec spec = MakeSpec(10, {{12, rebound::RELU}, {4, rebound::IDENTITY}}, 7);
  auto stage = MlpStage::Create(backend.get(), spec, 0, 2).value();
  REQUIRE(stage->InitParams().ok());
  std::vector<float> packed(stage->layout().packed_size());
  REQUIRE(stage->GetParams(absl::MakeSpan(packed)).ok());
  const uint64_t checksum = stage->ParamsChecksum().value();
  CHECK(checksum == ChecksumFloats(packed));
  // Any change of a value, in any tensor, changes it; the zero padding does not count.
  packed.back() += 1.0f;
  REQUIRE(stage->SetParams(packed).ok());
  CHECK(stage->ParamsChecksum().value() != checksum);
  CHECK(stage->ParamsChecksum().value() == ChecksumFloats(packed));
}

}  // namespace
}  // namespace compute
}  // namespace rebound
