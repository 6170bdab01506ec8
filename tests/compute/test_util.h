#pragma once

// Small helpers shared by the compute tests: model specs, synthetic data, backends.

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "compute/backend.h"
#include "compute/cpu/cpu_backend.h"
#include "proto/config.pb.h"

namespace rebound {
namespace compute {
namespace testing {

// A ModelSpec with `input_dim` inputs and the given (width, activation) layers.
inline ModelSpec MakeSpec(int input_dim, const std::vector<std::pair<int, rebound::Activation>>& layers,
                          uint64_t init_seed = 7) {
  ModelSpec spec;
  spec.set_input_dim(input_dim);
  spec.set_init_seed(init_seed);
  for (const auto& [width, act] : layers) {
    LayerSpec* l = spec.add_layers();
    l->set_width(width);
    l->set_activation(act);
  }
  return spec;
}

inline std::vector<float> UniformFloats(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

inline std::vector<int32_t> UniformLabels(size_t n, int classes, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> dist(0, classes - 1);
  std::vector<int32_t> v(n);
  for (int32_t& y : v) y = dist(gen);
  return v;
}

inline std::unique_ptr<Backend> CpuBackend() {
  auto backend = CreateCpuBackend(1);
  return std::move(backend).value();
}

inline bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Device -> host copy of a whole span.
inline std::vector<float> ToHost(Backend& backend, ConstDSpan span) {
  std::vector<float> host(span.size);
  auto status = backend.CopyToHost(span, absl::MakeSpan(host));
  if (!status.ok()) host.clear();
  return host;
}

}  // namespace testing
}  // namespace compute
}  // namespace rebound
