#pragma once

// Xxh64: xxHash64 with seed 0, computed inline, so that a loop that produces the bytes can hash
// them while they are still in registers (the per-step parameter checksum of DESIGN.md §5.2,
// fused into the optimizer's update: compute/adahessian_checksum.h). Digest() is bit-for-bit
// Checksum() of common/checksum.h (libxxhash's XXH64 with seed 0) of the concatenation of every
// Update's bytes, however they were split (tests/common/xxhash64_test.cc checks it against the
// library): the checksum is part of the stored log's format.
//
// Why not libxxhash's streaming state: its XXH64_update is an out-of-line call per chunk, which a
// compiler cannot interleave with the producing loop; the algorithm's four lanes are two 64-bit
// multiplies per 8 bytes, which the CPU can run beside a float loop's vector work.
//
// Thread-safety: a value type; one thread at a time. Ownership: copies what it buffers (< 32
// bytes); keeps no pointer. No status: every input is valid.

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace rebound {

class Xxh64 {
 public:
  static constexpr size_t kStripe = 32;  // bytes per round of the four lanes

  // The four lanes, for a loop that hashes whole stripes as it produces them: with no partial
  // stripe buffered (aligned()), it copies them out (lanes()), calls Stripe per 32 bytes in
  // order, and gives them back (set_lanes). As locals they stay in registers, which the members
  // of an Xxh64 (whose buffer is written through memcpy) do not.
  struct Lanes {
    uint64_t v0, v1, v2, v3;
    void Stripe(const void* data) {
      const unsigned char* p = static_cast<const unsigned char*>(data);
      v0 = Round(v0, Read64(p));
      v1 = Round(v1, Read64(p + 8));
      v2 = Round(v2, Read64(p + 16));
      v3 = Round(v3, Read64(p + 24));
    }
  };

  Xxh64() = default;

  // Appends `size` bytes at `data` (which may be null when size is 0).
  inline void Update(const void* data, size_t size);

  // The xxHash64 of every byte appended so far; the state is unchanged.
  inline uint64_t Digest() const;

  uint64_t total_bytes() const { return total_; }

  // True when no partial stripe is buffered (total_bytes() is a multiple of kStripe).
  bool aligned() const { return buffered_ == 0; }
  Lanes lanes() const { return Lanes{lane0_, lane1_, lane2_, lane3_}; }
  // Takes back lanes that hashed `bytes` more bytes. REQUIRES: aligned(); bytes % kStripe == 0.
  void set_lanes(const Lanes& lanes, uint64_t bytes) {
    lane0_ = lanes.v0;
    lane1_ = lanes.v1;
    lane2_ = lanes.v2;
    lane3_ = lanes.v3;
    total_ += bytes;
  }

 private:
  static constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ULL;
  static constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4FULL;
  static constexpr uint64_t kPrime3 = 0x165667B19E3779F9ULL;
  static constexpr uint64_t kPrime4 = 0x85EBCA77C2B2AE63ULL;
  static constexpr uint64_t kPrime5 = 0x27D4EB2F165667C5ULL;

  static uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
  // Little-endian 8 and 4 bytes (x86-64 and aarch64 are little-endian, as ChecksumFloats assumes).
  static uint64_t Read64(const unsigned char* p) {
    uint64_t v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static uint32_t Read32(const unsigned char* p) {
    uint32_t v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static uint64_t Round(uint64_t acc, uint64_t input) {
    acc += input * kPrime2;
    acc = Rotl(acc, 31);
    return acc * kPrime1;
  }
  static uint64_t Merge(uint64_t acc, uint64_t lane) {
    acc ^= Round(0, lane);
    return acc * kPrime1 + kPrime4;
  }
  void Stripe(const unsigned char* p) {
    Lanes lanes = this->lanes();
    lanes.Stripe(p);
    set_lanes(lanes, 0);
  }

  // The lanes as XXH64 seeds them for seed 0.
  uint64_t lane0_ = kPrime1 + kPrime2;
  uint64_t lane1_ = kPrime2;
  uint64_t lane2_ = 0;
  uint64_t lane3_ = 0 - kPrime1;
  uint64_t total_ = 0;
  unsigned char buffer_[kStripe] = {};
  size_t buffered_ = 0;  // < kStripe; == total_ % kStripe
};

inline void Xxh64::Update(const void* data, size_t size) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  total_ += size;
  if (buffered_ > 0) {
    const size_t take = size < kStripe - buffered_ ? size : kStripe - buffered_;
    std::memcpy(buffer_ + buffered_, p, take);
    buffered_ += take;
    p += take;
    size -= take;
    if (buffered_ < kStripe) return;
    Stripe(buffer_);
    buffered_ = 0;
  }
  for (; size >= kStripe; p += kStripe, size -= kStripe) Stripe(p);
  if (size > 0) {
    std::memcpy(buffer_, p, size);
    buffered_ = size;
  }
}

inline uint64_t Xxh64::Digest() const {
  uint64_t h;
  if (total_ >= kStripe) {
    h = Rotl(lane0_, 1) + Rotl(lane1_, 7) + Rotl(lane2_, 12) + Rotl(lane3_, 18);
    h = Merge(h, lane0_);
    h = Merge(h, lane1_);
    h = Merge(h, lane2_);
    h = Merge(h, lane3_);
  } else {
    h = kPrime5;  // seed + prime 5
  }
  h += total_;
  const unsigned char* p = buffer_;
  size_t left = buffered_;
  for (; left >= 8; p += 8, left -= 8) {
    h ^= Round(0, Read64(p));
    h = Rotl(h, 27) * kPrime1 + kPrime4;
  }
  if (left >= 4) {
    h ^= static_cast<uint64_t>(Read32(p)) * kPrime1;
    h = Rotl(h, 23) * kPrime2 + kPrime3;
    p += 4;
    left -= 4;
  }
  for (; left > 0; ++p, --left) {
    h ^= static_cast<uint64_t>(*p) * kPrime5;
    h = Rotl(h, 11) * kPrime1;
  }
  h ^= h >> 33;
  h *= kPrime2;
  h ^= h >> 29;
  h *= kPrime3;
  h ^= h >> 32;
  return h;
}

}  // namespace rebound
