#pragma once

// The counter-based RNG of docs/design.md §4.2. Every draw is addressed by
// (job seed, replica, step, global tensor id, element index) and by nothing else: in particular
// never by the stage, so that any split of the model into stages draws the same numbers, and a
// spare replaying step t of replica r regenerates exactly what the lost trainer drew.
//
// Header-only and usable from CUDA device code.

#include <cstdint>

#include "common/philox.h"

namespace rebound {

// Addresses one stream of draws: a (seed, replica, step, tensor) quadruple.
struct RngStream {
  uint64_t seed = 0;
  uint32_t replica = 0;
  uint64_t step = 0;
  uint32_t tensor_id = 0;
  // A purpose tag so that independent uses (Hutchinson z, initialisation, dropout, ...) of the
  // same coordinates never share numbers.
  uint32_t purpose = 0;
};

enum RngPurpose : uint32_t {
  kRngHutchinson = 1,
  kRngInit = 2,
  kRngShuffle = 3,
};

// SplitMix64 finaliser: mixes the seed, replica and purpose into the 64-bit Philox key.
REBOUND_HOST_DEVICE inline uint64_t RngMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The 32-bit word at `index` of `stream`. Words are produced four at a time by one Philox call
// (counter = {index / 4, tensor_id, step low, step high}); the key mixes seed, replica, purpose.
REBOUND_HOST_DEVICE inline uint32_t RngWord(const RngStream& s, uint64_t index) {
  const uint64_t key = RngMix64(s.seed ^ RngMix64((static_cast<uint64_t>(s.replica) << 32) |
                                                  static_cast<uint64_t>(s.purpose)));
  Philox4x32 counter;
  counter.v[0] = static_cast<uint32_t>(index >> 2);
  counter.v[1] = s.tensor_id ^ static_cast<uint32_t>(index >> 34) * 0x85EBCA6Bu;
  counter.v[2] = static_cast<uint32_t>(s.step);
  counter.v[3] = static_cast<uint32_t>(s.step >> 32);
  const Philox4x32 out =
      Philox4x32Round10(counter, static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32));
  return out.v[index & 3];
}

// A Rademacher draw: +1.0f or -1.0f with equal probability.
REBOUND_HOST_DEVICE inline float RngRademacher(const RngStream& s, uint64_t index) {
  return (RngWord(s, index) & 1u) ? 1.0f : -1.0f;
}

// A uniform float in [0, 1) with 24 random bits.
REBOUND_HOST_DEVICE inline float RngUniform(const RngStream& s, uint64_t index) {
  return static_cast<float>(RngWord(s, index) >> 8) * (1.0f / 16777216.0f);
}

}  // namespace rebound
