// Xxh64 (common/xxhash64.h) against libxxhash's XXH64 (common/checksum.h Checksum): the step
// log's checksum is part of its stored format, so the inline version must agree for every length
// and every way of splitting the input.

#include "common/xxhash64.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "common/checksum.h"

namespace rebound {
namespace {

std::vector<unsigned char> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> bytes(n);
  for (unsigned char& b : bytes) b = static_cast<unsigned char>(rng());
  return bytes;
}

TEST_CASE("Xxh64 of one Update equals XXH64 for every length up to 300 bytes", "[checksum]") {
  const std::vector<unsigned char> bytes = RandomBytes(300 + 7, 1);
  for (size_t offset : {size_t{0}, size_t{3}}) {  // aligned and unaligned starts
    for (size_t n = 0; n <= 300; ++n) {
      Xxh64 hash;
      hash.Update(bytes.data() + offset, n);
      INFO("offset " << offset << ", " << n << " bytes");
      CHECK(hash.Digest() == Checksum(bytes.data() + offset, n));
      CHECK(hash.total_bytes() == n);
    }
  }
  CHECK(Xxh64().Digest() == Checksum(nullptr, 0));
}

TEST_CASE("Xxh64 fed in random pieces equals XXH64 of the whole", "[checksum]") {
  const std::vector<unsigned char> bytes = RandomBytes(100000, 2);
  std::mt19937_64 rng(3);
  for (int round = 0; round < 50; ++round) {
    const size_t n = rng() % bytes.size();
    Xxh64 hash;
    size_t done = 0;
    while (done < n) {
      // Pieces from 0 to 100 bytes: below, at and above a 32-byte stripe, unaligned.
      const size_t piece = std::min<size_t>(n - done, rng() % 101);
      hash.Update(bytes.data() + done, piece);
      done += piece;
    }
    INFO("round " << round << ", " << n << " bytes");
    CHECK(hash.Digest() == Checksum(bytes.data(), n));
  }
}

TEST_CASE("Xxh64's Digest leaves the state as it was", "[checksum]") {
  const std::vector<unsigned char> bytes = RandomBytes(1000, 4);
  Xxh64 hash;
  hash.Update(bytes.data(), 500);
  CHECK(hash.Digest() == Checksum(bytes.data(), 500));
  hash.Update(bytes.data() + 500, 500);
  CHECK(hash.Digest() == Checksum(bytes.data(), 1000));
}

TEST_CASE("Xxh64 of floats equals ChecksumFloats, the parameter checksum", "[checksum]") {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> values(235146);  // the shipped model's parameter count
  for (float& x : values) x = normal(rng);
  Xxh64 hash;
  for (size_t i = 0; i < values.size(); i += 16) {
    hash.Update(values.data() + i, std::min<size_t>(16, values.size() - i) * sizeof(float));
  }
  CHECK(hash.Digest() == ChecksumFloats(values));
}

}  // namespace
}  // namespace rebound
