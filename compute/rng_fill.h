#pragma once

// Bulk generation of the draws of common/rng.h. RngWord(stream, i) runs one Philox call per
// element although a call yields four words; the fill kernels instead run one call per group of
// four consecutive indices and hoist the key. The values are exactly RngRademacher(stream, i):
// tests/compute/backend_test.cc checks this against common/rng.h, so a change of the counter
// layout there cannot go unnoticed.
//
// Header-only, usable from CUDA device code.

#include <cstdint>

#include "common/philox.h"
#include "common/rng.h"

namespace rebound {
namespace compute {

// The Philox key of `stream`, as RngWord computes it.
REBOUND_HOST_DEVICE inline uint64_t RngStreamKey(const RngStream& s) {
  return RngMix64(s.seed ^ RngMix64((static_cast<uint64_t>(s.replica) << 32) |
                                    static_cast<uint64_t>(s.purpose)));
}

// The four words of indices 4 * quad .. 4 * quad + 3 of `stream` under key `key`.
REBOUND_HOST_DEVICE inline Philox4x32 RngQuad(const RngStream& s, uint64_t key, uint64_t quad) {
  const uint64_t index = quad << 2;
  Philox4x32 counter;
  counter.v[0] = static_cast<uint32_t>(index >> 2);
  counter.v[1] = s.tensor_id ^ static_cast<uint32_t>(index >> 34) * 0x85EBCA6Bu;
  counter.v[2] = static_cast<uint32_t>(s.step);
  counter.v[3] = static_cast<uint32_t>(s.step >> 32);
  return Philox4x32Round10(counter, static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32));
}

REBOUND_HOST_DEVICE inline float RademacherFromWord(uint32_t word) {
  return (word & 1u) ? 1.0f : -1.0f;
}

}  // namespace compute
}  // namespace rebound
