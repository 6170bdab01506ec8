// AdaHessianUpdateChecksummed (compute/adahessian_checksum.h): the fused update leaves m, v and
// the parameters bit-identical to AdaHessianUpdate and returns the packed parameters' xxHash64,
// and StageOptimizer::ParamsChecksumAfter(t), which a trainer logs per step, equals
// MlpStage::ParamsChecksum() after real steps.

#include "compute/adahessian_checksum.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/checksum.h"
#include "compute/adahessian.h"
#include "compute/model_layout.h"
#include "compute/step.h"
#include "tests/compute/test_util.h"

namespace rebound {
namespace compute {
namespace {

using testing::BitEqual;
using testing::MakeSpec;
using testing::UniformFloats;
using testing::UniformLabels;

// Odd widths: tensors of sizes that are not multiples of 16 floats or of a 32-byte stripe, with
// padding between them in the padded layout.
ModelSpec OddModel() {
  return MakeSpec(13, {{17, rebound::RELU}, {9, rebound::TANH}, {3, rebound::IDENTITY}},
                  /*init_seed=*/5);
}

std::vector<float> Packed(const StageLayout& layout, const std::vector<float>& padded) {
  std::vector<float> packed(layout.packed_size());
  REQUIRE(layout.Pack(padded, absl::MakeSpan(packed)).ok());
  return packed;
}

TEST_CASE("the fused update is AdaHessianUpdate's, bit for bit, plus the packed checksum",
          "[adahessian]") {
  const StageLayout layout = StageLayout::Create(OddModel(), 0, 3).value();
  const size_t n = layout.padded_size();
  REQUIRE(n > static_cast<size_t>(layout.packed_size()));  // there is padding to skip
  for (double power : {1.0, 0.0, 0.5}) {
    AdaHessianConfig config;
    config.set_lr(0.05);
    config.set_hessian_power(power);
    config.set_weight_decay(1e-3);
    for (int64_t t : {1, 7}) {
      const AdaHessianScalars s = MakeAdaHessianScalars(config, t, 1.0);
      const std::vector<float> g = UniformFloats(n, -1, 1, 11);
      const std::vector<float> d = UniformFloats(n, -2, 2, 12);
      std::vector<float> m = UniformFloats(n, -0.1f, 0.1f, 13);
      std::vector<float> v = UniformFloats(n, 0, 0.1f, 14);
      std::vector<float> theta = UniformFloats(n, -1, 1, 15);
      std::vector<float> m2 = m, v2 = v, theta2 = theta;
      REQUIRE(AdaHessianUpdate(s, g, d, absl::MakeSpan(m), absl::MakeSpan(v),
                               absl::MakeSpan(theta))
                  .ok());
      absl::StatusOr<uint64_t> checksum =
          AdaHessianUpdateChecksummed(s, g, d, absl::MakeSpan(m2), absl::MakeSpan(v2),
                                      absl::MakeSpan(theta2), layout.tensors());
      REQUIRE(checksum.ok());
      INFO("hessian_power " << power << ", t " << t);
      CHECK(BitEqual(m2, m));
      CHECK(BitEqual(v2, v));
      CHECK(BitEqual(theta2, theta));
      CHECK(*checksum == ChecksumFloats(Packed(layout, theta)));
    }
  }
}

TEST_CASE("the fused update refuses tensors out of order or outside, changing nothing",
          "[adahessian]") {
  const StageLayout layout = StageLayout::Create(OddModel(), 0, 3).value();
  const size_t n = layout.padded_size();
  const AdaHessianScalars s = MakeAdaHessianScalars(AdaHessianConfig(), 1, 1.0);
  const std::vector<float> g = UniformFloats(n, -1, 1, 1);
  const std::vector<float> d = UniformFloats(n, -1, 1, 2);
  std::vector<float> m(n), v(n), theta = UniformFloats(n, -1, 1, 3);
  const std::vector<float> before = theta;

  std::vector<TensorInfo> reversed(layout.tensors().rbegin(), layout.tensors().rend());
  CHECK(AdaHessianUpdateChecksummed(s, g, d, absl::MakeSpan(m), absl::MakeSpan(v),
                                    absl::MakeSpan(theta), reversed)
            .status()
            .code() == absl::StatusCode::kInvalidArgument);
  std::vector<TensorInfo> outside = layout.tensors();
  outside.back().offset = static_cast<int64_t>(n) - outside.back().size() + 1;
  CHECK(AdaHessianUpdateChecksummed(s, g, d, absl::MakeSpan(m), absl::MakeSpan(v),
                                    absl::MakeSpan(theta), outside)
            .status()
            .code() == absl::StatusCode::kInvalidArgument);
  CHECK(AdaHessianUpdateChecksummed(s, g, d, absl::MakeSpan(m).subspan(1), absl::MakeSpan(v),
                                    absl::MakeSpan(theta), layout.tensors())
            .status()
            .code() == absl::StatusCode::kInvalidArgument);
  CHECK(BitEqual(theta, before));
}

TEST_CASE("ParamsChecksumAfter(t) is MlpStage::ParamsChecksum after step t, and only then",
          "[adahessian][step]") {
  auto backend = testing::CpuBackend();
  TrainerOptions options;
  options.model = OddModel();
  options.optimizer.set_lr(0.05);
  options.batch_size = 12;
  options.micro_batches = 3;
  options.seed = 7;
  for (bool split : {false, true}) {
    if (split) options.stage_boundaries = {2};  // two stages in one trainer
    auto trainer = LocalTrainer::Create(backend.get(), options).value();
    REQUIRE(trainer->InitParams().ok());
    CHECK_FALSE(trainer->optimizer(0).ParamsChecksumAfter(1).has_value());
    // Off by default: nothing is computed.
    const std::vector<float> images0 = UniformFloats(12 * 13, -1, 1, 20);
    const std::vector<int32_t> labels0 = UniformLabels(12, 3, 30);
    REQUIRE(trainer->Step(1, images0, labels0).ok());
    CHECK_FALSE(trainer->optimizer(0).ParamsChecksumAfter(1).has_value());
    for (int s = 0; s < trainer->num_stages(); ++s) {
      trainer->optimizer(s).set_params_checksum(true);
    }
    for (int64_t t = 2; t <= 4; ++t) {
      const std::vector<float> images = UniformFloats(12 * 13, -1, 1, 20 + t);
      const std::vector<int32_t> labels = UniformLabels(12, 3, 30 + t);
      REQUIRE(trainer->Step(t, images, labels).ok());
      for (int s = 0; s < trainer->num_stages(); ++s) {
        INFO("split " << split << ", step " << t << ", stage " << s);
        const std::optional<uint64_t> fused = trainer->optimizer(s).ParamsChecksumAfter(t);
        REQUIRE(fused.has_value());
        CHECK(*fused == trainer->stage(s).ParamsChecksum().value());
        CHECK_FALSE(trainer->optimizer(s).ParamsChecksumAfter(t - 1).has_value());
        CHECK_FALSE(trainer->optimizer(s).ParamsChecksumAfter(t + 1).has_value());
      }
    }
  }
}

}  // namespace
}  // namespace compute
}  // namespace rebound
