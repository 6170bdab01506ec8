#pragma once

// xxHash64 checksums of parameters (docs/design.md §5.2): per step the trainer logs the checksum of
// its parameters, and replay verifies its rebuilt state against it.

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "proto/tensor.pb.h"

namespace rebound {

// xxHash64 of raw bytes.
uint64_t Checksum(const void* data, size_t size, uint64_t seed = 0);

// xxHash64 of the concatenation of every Update's bytes, in order: the same value as Checksum of
// the concatenated bytes (seed 0).
class ChecksumStream {
 public:
  ChecksumStream();
  ~ChecksumStream();
  ChecksumStream(const ChecksumStream&) = delete;
  ChecksumStream& operator=(const ChecksumStream&) = delete;
  void Update(const void* data, size_t size);
  uint64_t Digest() const;

 private:
  void* state_;  // XXH64_state_t
};

// xxHash64 of the float values' little-endian bytes.
uint64_t ChecksumFloats(absl::Span<const float> values);

// xxHash64 over every tensor of the bundle in order: each tensor's id, dtype, shape and data.
// Two bundles have the same checksum iff (with overwhelming probability) they are identical.
uint64_t ChecksumBundle(const TensorBundle& bundle);
// The same for a bundle given as its tensors' metadata (`header`, data ignored) and each
// tensor's bytes (`data[i]` for tensor i). REQUIRES: data.size() == header.tensors_size().
uint64_t ChecksumBundle(const TensorBundle& header, absl::Span<const absl::string_view> data);

}  // namespace rebound
