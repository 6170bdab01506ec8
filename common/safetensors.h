#pragma once

// Safetensors, the weight format the PyTorch ecosystem loads models from
// (https://github.com/huggingface/safetensors; `safetensors.torch.load_file`), for exports of
// the trained center (docs/design.md §12, docs/operations.md#export).
//
// A file is: an unsigned 64-bit little-endian N; N bytes of a UTF-8 JSON header, an object that
// maps each tensor's name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the
// data that follows the header) and may hold "__metadata__", an object of strings; then the
// data, every tensor's bytes back to back in the order the header lists them, no holes. The
// header is padded with spaces to a multiple of 8 bytes, so that the data starts aligned.
// Only FLOAT32 tensors ("F32", little-endian) are written: Rebound's centers are float32.
//
// Thread-safety: stateless functions. Status codes: INVALID_ARGUMENT for a tensor that is not
// FLOAT32, whose data does not fit its shape, whose name is empty, repeated or "__metadata__";
// Decode: INVALID_ARGUMENT naming what is malformed.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/tensor.pb.h"

namespace rebound {

// `tensors` in the order they are written; `metadata` goes to "__metadata__" (none if empty).
absl::StatusOr<std::string> EncodeSafetensors(const std::vector<const Tensor*>& tensors,
                                              const std::map<std::string, std::string>& metadata);

struct DecodedSafetensors {
  std::vector<Tensor> tensors;  // in data order; FLOAT32, name, shape and data set
  std::map<std::string, std::string> metadata;
};

// Reads a file EncodeSafetensors wrote (F32 tensors only).
absl::StatusOr<DecodedSafetensors> DecodeSafetensors(absl::string_view bytes);

}  // namespace rebound
