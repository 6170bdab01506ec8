// The silent-corruption fault (worker/injected_faults.h, --fault_flip_bit_at_step, issue R22): at
// the steps it names, and only there, exactly one parameter of the stage changes, by the one
// mantissa bit kFlippedBitMask, and stays finite; with flip_bit_repeat_every it comes back every
// K steps. Checked on a real CPU-backend MlpStage through GetParams/SetParams.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "compute/backend_factory.h"
#include "compute/mlp.h"
#include "proto/config.pb.h"
#include "worker/injected_faults.h"

namespace rebound::worker {
namespace {

uint32_t Bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// A 6 -> 5 -> 10 MLP stage on the CPU backend, every parameter a distinct nonzero value (the
// initialisation's zero biases would make a flip a denormal, which says less).
struct Stage {
  std::unique_ptr<compute::Backend> backend;
  std::unique_ptr<compute::MlpStage> stage;

  Stage() {
    ModelSpec spec;
    spec.set_input_dim(6);
    spec.add_layers()->set_width(5);
    LayerSpec* out = spec.add_layers();
    out->set_width(10);
    out->set_activation(IDENTITY);
    backend = *compute::CreateBackend(ComputeConfig());
    stage = *compute::MlpStage::Create(backend.get(), spec, 0, 2);
    std::vector<float> params(stage->layout().packed_size());
    for (size_t i = 0; i < params.size(); ++i) {
      params[i] = (i % 2 == 0 ? 1.0f : -1.0f) * (0.01f + 0.003f * static_cast<float>(i));
    }
    REQUIRE(stage->SetParams(params).ok());
  }

  std::vector<float> Params() const {
    std::vector<float> params(stage->layout().packed_size());
    REQUIRE(stage->GetParams(absl::MakeSpan(params)).ok());
    return params;
  }
};

// The indices where `after` differs from `before`.
std::vector<int64_t> Changed(const std::vector<float>& before, const std::vector<float>& after) {
  std::vector<int64_t> changed;
  for (size_t i = 0; i < before.size(); ++i) {
    if (Bits(before[i]) != Bits(after[i])) changed.push_back(static_cast<int64_t>(i));
  }
  return changed;
}

TEST_CASE("a bit flip changes exactly one parameter by bit 12 of its mantissa, at its step only") {
  Stage s;
  InjectedFaults faults;
  faults.flip_bit_at_step = 7;
  const int64_t n = s.stage->layout().packed_size();  // 6*5 + 5 + 5*10 + 10 = 95

  for (int64_t t = 1; t <= 12; ++t) {
    const std::vector<float> before = s.Params();
    const absl::StatusOr<bool> flipped = MaybeFlipBit(faults, t, s.stage.get());
    REQUIRE(flipped.ok());
    const std::vector<float> after = s.Params();
    if (t != 7) {
      CHECK_FALSE(*flipped);
      CHECK(Changed(before, after).empty());
      continue;
    }
    CHECK(*flipped);
    const std::vector<int64_t> changed = Changed(before, after);
    REQUIRE(changed.size() == 1);
    const int64_t i = changed[0];
    CHECK(i == FlippedParameter(7, n));
    CHECK(i == static_cast<int64_t>((uint64_t{7} * 2654435761u) % 95));
    CHECK((Bits(before[i]) ^ Bits(after[i])) == kFlippedBitMask);
    CHECK(kFlippedBitMask == (uint32_t{1} << 12));
    CHECK(std::isfinite(after[i]));
    // A mantissa bit of a normal float: a relative change of at most 2^-11.
    const double relative = std::abs((after[i] - before[i]) / before[i]);
    CHECK(relative > 0);
    CHECK(relative <= std::ldexp(1.0, -11));
  }
}

TEST_CASE("a repeated bit flip comes back every K steps from its first step, and not before") {
  InjectedFaults faults;
  faults.flip_bit_at_step = 3;
  faults.flip_bit_repeat_every = 4;
  std::vector<int64_t> steps;
  for (int64_t t = 1; t <= 20; ++t) {
    if (FlipsBitAt(faults, t)) steps.push_back(t);
  }
  CHECK(steps == std::vector<int64_t>{3, 7, 11, 15, 19});

  faults.flip_bit_repeat_every = 0;  // once
  steps.clear();
  for (int64_t t = 1; t <= 20; ++t) {
    if (FlipsBitAt(faults, t)) steps.push_back(t);
  }
  CHECK(steps == std::vector<int64_t>{3});

  faults.flip_bit_at_step = 0;  // off, whatever the repeat says
  faults.flip_bit_repeat_every = 2;
  for (int64_t t = 0; t <= 20; ++t) CHECK_FALSE(FlipsBitAt(faults, t));
}

TEST_CASE("repeated flips each change one parameter, the one their step names") {
  Stage s;
  InjectedFaults faults;
  faults.flip_bit_at_step = 2;
  faults.flip_bit_repeat_every = 3;
  const int64_t n = s.stage->layout().packed_size();
  const std::vector<float> original = s.Params();
  std::vector<float> expected = original;
  for (int64_t t = 1; t <= 9; ++t) {
    const std::vector<float> before = s.Params();
    const absl::StatusOr<bool> flipped = MaybeFlipBit(faults, t, s.stage.get());
    REQUIRE(flipped.ok());
    const std::vector<int64_t> changed = Changed(before, s.Params());
    if (t == 2 || t == 5 || t == 8) {
      CHECK(*flipped);
      REQUIRE(changed.size() == 1);
      CHECK(changed[0] == FlippedParameter(t, n));
      uint32_t bits = Bits(expected[changed[0]]) ^ kFlippedBitMask;
      std::memcpy(&expected[changed[0]], &bits, sizeof(bits));
    } else {
      CHECK_FALSE(*flipped);
      CHECK(changed.empty());
    }
  }
  // Three flips at three distinct parameters (Knuth's hash spreads them), nothing else.
  const std::vector<float> final_params = s.Params();
  CHECK(Changed(original, final_params).size() == 3);
  CHECK(Changed(expected, final_params).empty());
  for (float value : final_params) CHECK(std::isfinite(value));
}

TEST_CASE("the flipped parameter is the step times 2654435761, modulo the parameter count") {
  CHECK(FlippedParameter(7, 100) == 27);  // 18581050327 mod 100
  CHECK(FlippedParameter(1, 95) == static_cast<int64_t>(uint64_t{2654435761} % 95));
  for (int64_t t = 1; t < 1000; ++t) {
    const int64_t i = FlippedParameter(t, 95);
    CHECK(i >= 0);
    CHECK(i < 95);
  }
  // A very late step does not overflow into a negative index.
  CHECK(FlippedParameter(int64_t{1} << 40, 95) >= 0);
}

}  // namespace
}  // namespace rebound::worker
