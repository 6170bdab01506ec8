// Fuzz target: decoding a wire Tensor (common/tensor_codec.h). The input is a Tensor in protobuf
// binary, as a receiver gets it inside a Sync, Push, PartialSum or step-log record.
//
// Properties, beyond "no crash, no sanitizer report, no leak":
//   * ReadFloats accepts exactly what ValidateFloatTensor accepts, and then returns
//     ElementCount values, the tensor's bytes;
//   * CopyFloats fills a buffer of that size with the same values and refuses any other size;
//   * MakeFloatTensor of the decoded values rebuilds the same bytes, which validate again;
//   * CheckFinite is OK iff every value is finite.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "common/tensor_codec.h"
#include "fuzz/fuzz_check.h"
#include "proto/tensor.pb.h"

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  rebound::fuzz::QuietLogging();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rebound;
  Tensor tensor;
  if (!tensor.ParseFromArray(data, static_cast<int>(size))) return 0;

  const absl::StatusOr<int64_t> count = ElementCount(tensor);
  if (count.ok()) FUZZ_CHECK(*count >= 0);
  const absl::Status valid = ValidateFloatTensor(tensor, "fuzz");
  const absl::StatusOr<std::vector<float>> floats = ReadFloats(tensor);
  FUZZ_CHECK(valid.ok() == floats.ok());
  if (!valid.ok()) {
    FUZZ_CHECK(valid.code() == absl::StatusCode::kInvalidArgument);
    FUZZ_CHECK(floats.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  FUZZ_CHECK(count.ok() && static_cast<int64_t>(floats->size()) == *count);
  FUZZ_CHECK(floats->size() * sizeof(float) == tensor.data().size());
  FUZZ_CHECK(std::memcmp(floats->data(), tensor.data().data(), tensor.data().size()) == 0);

  std::vector<float> copy(floats->size() + 1);
  FUZZ_CHECK(CopyFloats(tensor, absl::MakeSpan(copy.data(), floats->size())).ok());
  FUZZ_CHECK(std::memcmp(copy.data(), floats->data(), floats->size() * sizeof(float)) == 0);
  FUZZ_CHECK(CopyFloats(tensor, absl::MakeSpan(copy)).code() ==
             absl::StatusCode::kInvalidArgument);
  if (!floats->empty()) {
    FUZZ_CHECK(CopyFloats(tensor, absl::MakeSpan(copy.data(), floats->size() - 1)).code() ==
               absl::StatusCode::kInvalidArgument);
  }

  const std::vector<int64_t> shape(tensor.shape().begin(), tensor.shape().end());
  const Tensor rebuilt = MakeFloatTensor(tensor.id(), tensor.name(), shape, *floats);
  FUZZ_CHECK(rebuilt.data() == tensor.data());
  FUZZ_CHECK(ValidateFloatTensor(rebuilt, "rebuilt").ok());

  bool all_finite = true;
  for (float value : *floats) all_finite = all_finite && std::isfinite(value);
  FUZZ_CHECK(CheckFinite(*floats, "fuzz").ok() == all_finite);
  return 0;
}
