#include "common/checksum.h"

#include <xxhash.h>

#include <memory>
#include <vector>

namespace rebound {
namespace {

struct StateDeleter {
  void operator()(XXH64_state_t* state) const { XXH64_freeState(state); }
};

void UpdateU64(XXH64_state_t* state, uint64_t value) {
  unsigned char bytes[8];
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<unsigned char>(value >> (8 * i));
  XXH64_update(state, bytes, sizeof(bytes));
}

}  // namespace

uint64_t Checksum(const void* data, size_t size, uint64_t seed) {
  return XXH64(data, size, seed);
}

ChecksumStream::ChecksumStream() : state_(XXH64_createState()) {
  XXH64_reset(static_cast<XXH64_state_t*>(state_), 0);
}

ChecksumStream::~ChecksumStream() { XXH64_freeState(static_cast<XXH64_state_t*>(state_)); }

void ChecksumStream::Update(const void* data, size_t size) {
  XXH64_update(static_cast<XXH64_state_t*>(state_), data, size);
}

uint64_t ChecksumStream::Digest() const {
  return XXH64_digest(static_cast<const XXH64_state_t*>(state_));
}

uint64_t ChecksumFloats(absl::Span<const float> values) {
  static_assert(sizeof(float) == 4, "float32 expected");
  // x86-64 and aarch64 are little-endian, so the in-memory bytes are the wire bytes.
  return XXH64(values.data(), values.size() * sizeof(float), 0);
}

uint64_t ChecksumBundle(const TensorBundle& header, absl::Span<const absl::string_view> data) {
  std::unique_ptr<XXH64_state_t, StateDeleter> state(XXH64_createState());
  XXH64_reset(state.get(), 0);
  for (int i = 0; i < header.tensors_size(); ++i) {
    const Tensor& tensor = header.tensors(i);
    UpdateU64(state.get(), tensor.id());
    UpdateU64(state.get(), static_cast<uint64_t>(tensor.dtype()));
    UpdateU64(state.get(), static_cast<uint64_t>(tensor.shape_size()));
    for (int64_t dim : tensor.shape()) UpdateU64(state.get(), static_cast<uint64_t>(dim));
    const absl::string_view bytes = data[i];
    UpdateU64(state.get(), bytes.size());
    XXH64_update(state.get(), bytes.data(), bytes.size());
  }
  return XXH64_digest(state.get());
}

uint64_t ChecksumBundle(const TensorBundle& bundle) {
  std::vector<absl::string_view> data;
  for (const Tensor& tensor : bundle.tensors()) data.push_back(tensor.data());
  return ChecksumBundle(bundle, data);
}

}  // namespace rebound
