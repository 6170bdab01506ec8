#pragma once

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), a
// counter-based generator: the output is a pure function of (key, counter), so any machine,
// CPU or GPU, regenerates the same numbers for the same coordinates without shared state.
//
// Header-only and usable from CUDA device code (REBOUND_HOST_DEVICE).

#include <cstdint>

#if defined(__CUDACC__)
#define REBOUND_HOST_DEVICE __host__ __device__
#else
#define REBOUND_HOST_DEVICE
#endif

namespace rebound {

struct Philox4x32 {
  uint32_t v[4];
};

REBOUND_HOST_DEVICE inline void PhiloxMulHiLo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(product >> 32);
  *lo = static_cast<uint32_t>(product);
}

// Ten rounds of Philox4x32 on `counter` under the 64-bit key (key0, key1).
REBOUND_HOST_DEVICE inline Philox4x32 Philox4x32Round10(Philox4x32 counter, uint32_t key0,
                                                        uint32_t key1) {
  constexpr uint32_t kMul0 = 0xD2511F53u;
  constexpr uint32_t kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u;
  constexpr uint32_t kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    PhiloxMulHiLo(kMul0, counter.v[0], &hi0, &lo0);
    PhiloxMulHiLo(kMul1, counter.v[2], &hi1, &lo1);
    Philox4x32 next;
    next.v[0] = hi1 ^ counter.v[1] ^ key0;
    next.v[1] = lo1;
    next.v[2] = hi0 ^ counter.v[3] ^ key1;
    next.v[3] = lo0;
    counter = next;
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return counter;
}

}  // namespace rebound
