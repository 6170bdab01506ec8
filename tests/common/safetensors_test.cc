// common/safetensors: the bytes of a file against the format's definition, a round trip, and
// malformed files refused with what is wrong.

#include "common/safetensors.h"

#include <cstring>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"

namespace rebound {
namespace {

Tensor Floats(const std::string& name, std::vector<int64_t> shape, std::vector<float> values) {
  Tensor tensor;
  tensor.set_name(name);
  tensor.set_dtype(FLOAT32);
  for (int64_t dim : shape) tensor.add_shape(dim);
  tensor.set_data(std::string(reinterpret_cast<const char*>(values.data()),
                              values.size() * sizeof(float)));
  return tensor;
}

TEST_CASE("a file is the header's length, the JSON header padded to 8 bytes, then the data") {
  const Tensor a = Floats("a", {2}, {1.0f, 2.0f});
  absl::StatusOr<std::string> file = EncodeSafetensors({&a}, {});
  REQUIRE(file.ok());
  // Written out from the format's definition: 54 bytes of JSON, 2 spaces of padding.
  const std::string json = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  REQUIRE(json.size() == 54);
  std::string expected("\x38\0\0\0\0\0\0\0", 8);
  expected += json + "  ";
  expected += std::string("\x00\x00\x80\x3f\x00\x00\x00\x40", 8);  // 1.0f, 2.0f little-endian
  CHECK(*file == expected);
}

TEST_CASE("tensors and metadata come back as written, in order") {
  const Tensor w = Floats("layer0.weight", {2, 3}, {1, 2, 3, 4, 5, 6});
  const Tensor b = Floats("layer0.bias", {2}, {-0.5f, 0.25f});
  const Tensor scalar = Floats("scale", {}, {7.0f});
  absl::StatusOr<std::string> file =
      EncodeSafetensors({&w, &b, &scalar}, {{"rebound.center_versions", "12"}});
  REQUIRE(file.ok());
  absl::StatusOr<DecodedSafetensors> decoded = DecodeSafetensors(*file);
  INFO(decoded.status());
  REQUIRE(decoded.ok());
  REQUIRE(decoded->tensors.size() == 3);
  CHECK(decoded->tensors[0].name() == "layer0.weight");
  CHECK(decoded->tensors[0].shape_size() == 2);
  CHECK(decoded->tensors[0].data() == w.data());
  CHECK(decoded->tensors[1].data() == b.data());
  CHECK(decoded->tensors[2].shape_size() == 0);
  CHECK(decoded->tensors[2].data() == scalar.data());
  CHECK(decoded->metadata.at("rebound.center_versions") == "12");
}

TEST_CASE("tensors that cannot be written are refused, naming them") {
  Tensor short_data = Floats("w", {3}, {1, 2});
  CHECK(absl::StrContains(EncodeSafetensors({&short_data}, {}).status().message(), "'w'"));
  Tensor a = Floats("a", {1}, {1});
  Tensor again = Floats("a", {1}, {2});
  CHECK(EncodeSafetensors({&a, &again}, {}).status().code() ==
        absl::StatusCode::kInvalidArgument);
  Tensor reserved = Floats("__metadata__", {1}, {1});
  CHECK(EncodeSafetensors({&reserved}, {}).status().code() ==
        absl::StatusCode::kInvalidArgument);
  Tensor ints = Floats("i", {1}, {1});
  ints.set_dtype(INT64);
  CHECK(absl::StrContains(EncodeSafetensors({&ints}, {}).status().message(), "FLOAT32"));
}

TEST_CASE("malformed files are refused") {
  const Tensor a = Floats("a", {2}, {1.0f, 2.0f});
  const std::string good = *EncodeSafetensors({&a}, {});
  CHECK_FALSE(DecodeSafetensors("").ok());
  CHECK_FALSE(DecodeSafetensors(good.substr(0, good.size() - 1)).ok());  // data cut short
  CHECK_FALSE(DecodeSafetensors(good + "x").ok());                       // bytes after the data
  std::string huge = good;
  huge[7] = '\x7f';  // a header length past the file
  CHECK_FALSE(DecodeSafetensors(huge).ok());
  std::string not_json = good;
  not_json[8] = '[';
  CHECK_FALSE(DecodeSafetensors(not_json).ok());
  std::string wrong_dtype = good;
  wrong_dtype.replace(wrong_dtype.find("F32"), 3, "F16");
  CHECK(absl::StrContains(DecodeSafetensors(wrong_dtype).status().message(), "not F32"));
}

}  // namespace
}  // namespace rebound
