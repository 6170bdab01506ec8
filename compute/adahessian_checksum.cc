#include "compute/adahessian_checksum.h"

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/xxhash64.h"

namespace rebound {
namespace compute {
namespace {

// Floats per block: 64 bytes, two xxHash64 stripes.
constexpr int64_t kBlock = 16;

// AdaHessianLoop of adahessian.cc on [begin, end), hashing the updated theta when `hash` is set.
template <int kPowerMode>
void UpdateRange(const AdaHessianScalars& scalars, const float* __restrict g,
                 const float* __restrict d, float* __restrict m, float* __restrict v,
                 float* __restrict theta, int64_t begin, int64_t end, Xxh64* hash) {
  AdaHessianScalars s = scalars;
  s.power_mode = kPowerMode;
  auto update = [&](int64_t i) {
    float mi = m[i];
    float vi = v[i];
    float ti = theta[i];
    AdaHessianElement(s, g[i], d[i], &mi, &vi, &ti);
    m[i] = mi;
    v[i] = vi;
    theta[i] = ti;
  };
  int64_t i = begin;
  if (hash == nullptr) {
    for (; i < end; ++i) update(i);
    return;
  }
  if (hash->aligned()) {
    // Two stripes per block, hashed right after the block is computed, the lanes in registers.
    Xxh64::Lanes lanes = hash->lanes();
    for (; i + kBlock <= end; i += kBlock) {
      for (int64_t j = i; j < i + kBlock; ++j) update(j);
      lanes.Stripe(theta + i);
      lanes.Stripe(theta + i + kBlock / 2);
    }
    hash->set_lanes(lanes, static_cast<uint64_t>(i - begin) * sizeof(float));
  }
  // The rest of the range (all of it after a tensor that left a partial stripe): updated, then
  // hashed.
  const int64_t rest = i;
  for (; i < end; ++i) update(i);
  hash->Update(theta + rest, static_cast<size_t>(end - rest) * sizeof(float));
}

template <int kPowerMode>
uint64_t UpdateAll(const AdaHessianScalars& s, absl::Span<const float> g,
                   absl::Span<const float> d, absl::Span<float> m, absl::Span<float> v,
                   absl::Span<float> theta, absl::Span<const TensorInfo> tensors) {
  Xxh64 hash;
  int64_t done = 0;
  for (const TensorInfo& t : tensors) {
    UpdateRange<kPowerMode>(s, g.data(), d.data(), m.data(), v.data(), theta.data(), done,
                            t.offset, nullptr);  // padding before the tensor
    UpdateRange<kPowerMode>(s, g.data(), d.data(), m.data(), v.data(), theta.data(), t.offset,
                            t.offset + t.size(), &hash);
    done = t.offset + t.size();
  }
  UpdateRange<kPowerMode>(s, g.data(), d.data(), m.data(), v.data(), theta.data(), done,
                          static_cast<int64_t>(theta.size()), nullptr);
  return hash.Digest();
}

}  // namespace

absl::StatusOr<uint64_t> AdaHessianUpdateChecksummed(const AdaHessianScalars& s,
                                                     absl::Span<const float> g,
                                                     absl::Span<const float> d,
                                                     absl::Span<float> m, absl::Span<float> v,
                                                     absl::Span<float> theta,
                                                     absl::Span<const TensorInfo> tensors) {
  const size_t n = theta.size();
  if (g.size() != n || d.size() != n || m.size() != n || v.size() != n) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "AdaHessianUpdateChecksummed: sizes differ (g %d, d %d, m %d, v %d, theta %d)", g.size(),
        d.size(), m.size(), v.size(), n));
  }
  int64_t end = 0;
  for (const TensorInfo& t : tensors) {
    if (t.offset < end || t.size() < 0 || t.offset + t.size() > static_cast<int64_t>(n)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "AdaHessianUpdateChecksummed: tensor %s [%d, %d) is out of order or outside the %d "
          "parameters",
          t.name, t.offset, t.offset + t.size(), n));
    }
    end = t.offset + t.size();
  }
  switch (s.power_mode) {
    case 0:
      return UpdateAll<0>(s, g, d, m, v, theta, tensors);
    case 1:
      return UpdateAll<1>(s, g, d, m, v, theta, tensors);
    default:
      return UpdateAll<2>(s, g, d, m, v, theta, tensors);
  }
}

}  // namespace compute
}  // namespace rebound
