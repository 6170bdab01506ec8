#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "common/checksum.h"
#include "common/philox.h"
#include "common/rng.h"
#include "common/tensor_codec.h"

namespace rebound {
namespace {

Philox4x32 Counter(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return Philox4x32{{a, b, c, d}}; }

TEST_CASE("Philox4x32-10 matches the Random123 known-answer vectors") {
  // tests/kat_vectors of the Random123 distribution (DEShawResearch/random123).
  Philox4x32 out = Philox4x32Round10(Counter(0, 0, 0, 0), 0, 0);
  CHECK(out.v[0] == 0x6627e8d5u);
  CHECK(out.v[1] == 0xe169c58du);
  CHECK(out.v[2] == 0xbc57ac4cu);
  CHECK(out.v[3] == 0x9b00dbd8u);

  out = Philox4x32Round10(Counter(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu),
                          0xffffffffu, 0xffffffffu);
  CHECK(out.v[0] == 0x408f276du);
  CHECK(out.v[1] == 0x41c83b0eu);
  CHECK(out.v[2] == 0xa20bc7c6u);
  CHECK(out.v[3] == 0x6d5451fdu);

  out = Philox4x32Round10(Counter(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u),
                          0xa4093822u, 0x299f31d0u);
  CHECK(out.v[0] == 0xd16cfe09u);
  CHECK(out.v[1] == 0x94fdccebu);
  CHECK(out.v[2] == 0x5001e420u);
  CHECK(out.v[3] == 0x24126ea1u);
}

TEST_CASE("the same coordinates always draw the same number") {
  RngStream a{42, 3, 17, 5, kRngHutchinson};
  RngStream b = a;
  for (uint64_t i = 0; i < 1000; ++i) REQUIRE(RngWord(a, i) == RngWord(b, i));
}

TEST_CASE("each coordinate of the key changes the stream") {
  const RngStream base{42, 3, 17, 5, kRngHutchinson};
  auto differs = [&](RngStream other) {
    int same = 0;
    for (uint64_t i = 0; i < 256; ++i) same += RngWord(base, i) == RngWord(other, i);
    return same < 4;  // independent 32-bit words collide with probability 2^-32 each
  };
  RngStream s = base;
  s.seed = 43;
  CHECK(differs(s));
  s = base;
  s.replica = 4;
  CHECK(differs(s));
  s = base;
  s.step = 18;
  CHECK(differs(s));
  s = base;
  s.step = 17 + (uint64_t{1} << 32);  // the high half of the step counts too
  CHECK(differs(s));
  s = base;
  s.tensor_id = 6;
  CHECK(differs(s));
  s = base;
  s.purpose = kRngInit;
  CHECK(differs(s));
}

TEST_CASE("indices address distinct words, also beyond 2^34") {
  const RngStream s{1, 0, 1, 0, kRngHutchinson};
  std::set<uint32_t> words;
  for (uint64_t i = 0; i < 4096; ++i) words.insert(RngWord(s, i));
  CHECK(words.size() >= 4094);
  CHECK(RngWord(s, 5) != RngWord(s, 5 + (uint64_t{1} << 34)));
}

TEST_CASE("Rademacher draws are +1 or -1 with mean near zero") {
  const RngStream s{7, 1, 9, 2, kRngHutchinson};
  const int n = 200000;
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    const float z = RngRademacher(s, i);
    REQUIRE((z == 1.0f || z == -1.0f));
    sum += z;
  }
  // Standard deviation of the mean is 1/sqrt(n) = 0.0022; 5 sigma.
  CHECK(std::abs(sum / n) < 0.0112);
}

TEST_CASE("uniform draws lie in [0, 1) with mean one half") {
  const RngStream s{7, 1, 9, 2, kRngInit};
  const int n = 100000;
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    const float u = RngUniform(s, i);
    REQUIRE(u >= 0.0f);
    REQUIRE(u < 1.0f);
    sum += u;
  }
  CHECK(std::abs(sum / n - 0.5) < 0.005);  // sd of the mean = 0.00091
}

TEST_CASE("xxHash64 matches the reference value of the empty input") {
  CHECK(Checksum("", 0) == 0xEF46DB3751D8E999ull);
}

TEST_CASE("a bundle checksum changes with any bit, id or shape") {
  std::vector<float> values = {1.0f, -2.5f, 3.25f, 0.0f, 7.0f, 8.0f};
  TensorBundle bundle;
  *bundle.add_tensors() = MakeFloatTensor(0, "w", {2, 3}, values);
  const uint64_t reference = ChecksumBundle(bundle);
  CHECK(ChecksumBundle(bundle) == reference);

  TensorBundle flipped = bundle;
  std::string data = flipped.tensors(0).data();
  data[5] ^= 1;
  flipped.mutable_tensors(0)->set_data(data);
  CHECK(ChecksumBundle(flipped) != reference);

  TensorBundle renumbered = bundle;
  renumbered.mutable_tensors(0)->set_id(1);
  CHECK(ChecksumBundle(renumbered) != reference);

  TensorBundle reshaped = bundle;
  reshaped.mutable_tensors(0)->set_shape(0, 3);
  reshaped.mutable_tensors(0)->set_shape(1, 2);
  CHECK(ChecksumBundle(reshaped) != reference);

  CHECK(ChecksumFloats(values) == Checksum(values.data(), values.size() * 4));
}

TEST_CASE("a float tensor survives the wire format and bad tensors are rejected") {
  const std::vector<float> values = {1.5f, -0.0f, 3e-38f, 1e30f};
  Tensor tensor = MakeFloatTensor(3, "layer1.bias", {4}, values);
  CHECK(tensor.data().size() == 16);
  auto back = ReadFloats(tensor);
  REQUIRE(back.ok());
  CHECK(std::memcmp(back->data(), values.data(), 16) == 0);

  Tensor short_data = tensor;
  short_data.set_data(tensor.data().substr(0, 15));
  absl::Status status = ValidateFloatTensor(short_data, "params.tensors[0]");
  CHECK(status.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(status.message()) == "params.tensors[0]: 15 data bytes, shape needs 16");

  Tensor wrong_type = tensor;
  wrong_type.set_dtype(INT32);
  CHECK(std::string(ValidateFloatTensor(wrong_type, "x").message()) ==
        "x: dtype must be FLOAT32, got INT32");

  Tensor negative = tensor;
  negative.set_shape(0, -4);
  CHECK(ValidateFloatTensor(negative, "x").code() == absl::StatusCode::kInvalidArgument);

  Tensor huge = tensor;
  huge.clear_shape();
  huge.add_shape(int64_t{1} << 31);
  huge.add_shape(int64_t{1} << 31);
  CHECK(ValidateFloatTensor(huge, "x").code() == absl::StatusCode::kInvalidArgument);

  const std::vector<float> bad = {1.0f, NAN};
  CHECK(std::string(CheckFinite(bad, "gradient").message()) ==
        "gradient: non-finite value nan at index 1");
}

}  // namespace
}  // namespace rebound
