#include "worker/data/shard_sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace rebound::worker {
namespace {

// A uniform draw from [0, bound) by Lemire's multiply-shift with rejection, reading words of
// `stream` from *word_index on. REQUIRES: bound >= 1.
uint32_t UniformBelow(const RngStream& stream, uint32_t bound, uint64_t* word_index) {
  uint64_t m = uint64_t{RngWord(stream, (*word_index)++)} * bound;
  if (static_cast<uint32_t>(m) < bound) {
    const uint32_t threshold = (0u - bound) % bound;  // 2^32 mod bound
    while (static_cast<uint32_t>(m) < threshold) {
      m = uint64_t{RngWord(stream, (*word_index)++)} * bound;
    }
  }
  return static_cast<uint32_t>(m >> 32);
}

}  // namespace

RngStream GlobalOrderStream(uint64_t seed) {
  RngStream stream;
  stream.seed = seed;
  stream.replica = 0;
  stream.step = 0;
  stream.tensor_id = kShuffleGlobalOrder;
  stream.purpose = kRngShuffle;
  return stream;
}

RngStream EpochStream(uint64_t seed, int32_t replica, int64_t epoch) {
  RngStream stream;
  stream.seed = seed;
  stream.replica = static_cast<uint32_t>(replica);
  stream.step = static_cast<uint64_t>(epoch);
  stream.tensor_id = kShuffleEpoch;
  stream.purpose = kRngShuffle;
  return stream;
}

void ShuffleSampleIds(const RngStream& stream, absl::Span<int64_t> ids) {
  uint64_t word_index = 0;
  for (size_t i = ids.size(); i > 1; --i) {
    const uint32_t j = UniformBelow(stream, static_cast<uint32_t>(i), &word_index);
    std::swap(ids[i - 1], ids[j]);
  }
}

absl::StatusOr<std::vector<int64_t>> ReplicaShard(uint64_t seed, int64_t num_samples,
                                                  int32_t replicas, int32_t replica,
                                                  double overlap) {
  if (replicas < 1 || num_samples < replicas || num_samples > int64_t{0x7fffffff}) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cannot shard %d samples over %d replicas: need 1 <= replicas <= samples <= 2^31 - 1",
        num_samples, replicas));
  }
  if (replica < 0 || replica >= replicas) {
    return absl::InvalidArgumentError(
        absl::StrFormat("replica %d is outside [0, %d)", replica, replicas));
  }
  if (!(overlap >= 0.0 && overlap < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("shard overlap %g is outside [0, 1)", overlap));
  }
  std::vector<int64_t> order(num_samples);
  std::iota(order.begin(), order.end(), int64_t{0});
  ShuffleSampleIds(GlobalOrderStream(seed), absl::MakeSpan(order));

  const int64_t begin = replica * num_samples / replicas;
  const int64_t end = (replica + int64_t{1}) * num_samples / replicas;
  const int64_t own = end - begin;
  const int64_t extra = std::min<int64_t>(std::llround(overlap * static_cast<double>(own)),
                                          num_samples - own);
  std::vector<int64_t> shard(order.begin() + begin, order.begin() + end);
  shard.reserve(own + extra);
  for (int64_t k = 0; k < extra; ++k) shard.push_back(order[(end + k) % num_samples]);
  return shard;
}

ShardSampler::ShardSampler(const SamplerOptions& options, std::vector<int64_t> shard)
    : options_(options), shard_(std::move(shard)) {}

absl::StatusOr<ShardSampler> ShardSampler::Create(const SamplerOptions& options) {
  ASSIGN_OR_RETURN(std::vector<int64_t> shard,
                   ReplicaShard(options.seed, options.num_samples, options.replicas,
                                options.replica, options.overlap));
  if (options.batch_size < 1 || options.batch_size > static_cast<int64_t>(shard.size())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "batch size %d is outside [1, %d], the shard size of replica %d of %d over %d samples",
        options.batch_size, shard.size(), options.replica, options.replicas,
        options.num_samples));
  }
  return ShardSampler(options, std::move(shard));
}

absl::StatusOr<ShardSampler> ShardSampler::Create(const DataConfig& config, int64_t num_samples,
                                                  int32_t replicas, int32_t replica) {
  SamplerOptions options;
  options.seed = config.seed();
  options.num_samples = num_samples;
  options.replicas = replicas;
  options.replica = replica;
  options.overlap = config.shard_overlap();
  options.batch_size = config.batch_size();
  return Create(options);
}

int64_t ShardSampler::batches_per_epoch() const {
  return static_cast<int64_t>(shard_.size()) / options_.batch_size;
}

std::vector<int64_t> ShardSampler::EpochOrder(int64_t epoch) const {
  std::vector<int64_t> order = shard_;
  ShuffleSampleIds(EpochStream(options_.seed, options_.replica, epoch), absl::MakeSpan(order));
  return order;
}

std::vector<int64_t> ShardSampler::NextBatch() {
  if (order_epoch_ != cursor_.epoch) {
    order_ = EpochOrder(cursor_.epoch);
    order_epoch_ = cursor_.epoch;
  }
  const auto first = order_.begin() + cursor_.offset;
  std::vector<int64_t> batch(first, first + options_.batch_size);
  cursor_.offset += options_.batch_size;
  if (cursor_.offset + options_.batch_size > static_cast<int64_t>(shard_.size())) {
    ++cursor_.epoch;
    cursor_.offset = 0;
  }
  return batch;
}

absl::Status ShardSampler::Seek(const DataCursor& cursor) {
  const int64_t last = static_cast<int64_t>(shard_.size()) - options_.batch_size;
  if (cursor.epoch < 0 || cursor.offset < 0 || cursor.offset > last) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "data cursor (epoch %d, offset %d) is invalid: need epoch >= 0 and offset in [0, %d] "
        "(shard of %d ids, batches of %d)",
        cursor.epoch, cursor.offset, last, shard_.size(), options_.batch_size));
  }
  cursor_ = cursor;
  return absl::OkStatus();
}

}  // namespace rebound::worker
