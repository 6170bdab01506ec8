#pragma once

// Which samples a replica trains on, in which order: a deterministic function of the job seed,
// the replica, the epoch and a cursor, so that a spare that takes over a slot (or replays it)
// draws exactly the batches the lost trainer would have drawn.
//
// 1. Shuffle. ShuffleSampleIds is a Fisher-Yates shuffle driven by common/rng.h: for i = n-1 down
//    to 1 it swaps ids[i] with ids[j], j uniform in [0, i], drawn from the words RngWord(stream,
//    k), k = 0, 1, 2, ... consumed in order, by Lemire's multiply-shift with rejection:
//    m = word * (i + 1); if (m mod 2^32) < (2^32 mod (i + 1)) draw again; else j = m >> 32.
//    The streams (all with purpose kRngShuffle) are:
//      global order           {seed, replica 0, step 0,     tensor_id kShuffleGlobalOrder}
//      epoch e of replica r   {seed, replica r, step e,     tensor_id kShuffleEpoch}
//    tensor_id is only a domain tag here; the purpose already separates these streams from the
//    Hutchinson and initialisation draws of the same coordinates.
// 2. Shard. The global order P is ShuffleSampleIds(global stream, [0, 1, ..., N-1]). Replica r of
//    R owns P[floor(r N / R), floor((r+1) N / R)) (own size n_r, sizes differ by at most one),
//    extended by E_r = min(round(overlap * n_r), N - n_r) ids (halves round up) that follow it
//    in P, wrapping from P[N-1] to P[0]. These are the first E_r ids of replica r+1's part (for
//    r = R-1: replica 0's); they spill into the part after it only when rounding makes E_r
//    exceed that part's size. No replica holds an id twice; with R = 1 overlap has no effect.
//    Shard ids are kept in P's order.
// 3. Epochs. Epoch e's order of replica r is its shard shuffled with the epoch stream above.
//    Batches are consecutive runs of batch_size ids of that order. The tail of fewer than
//    batch_size ids that ends an epoch is skipped (a batch never straddles epochs); it falls
//    elsewhere in the next epoch's order. An epoch thus has floor(L / batch_size) batches, L the
//    shard size.
// 4. Cursor. A DataCursor (epoch, offset) names the next batch: ids [offset, offset + batch_size)
//    of epoch `epoch`'s order. It always satisfies 0 <= offset <= L - batch_size: taking the last
//    batch of an epoch moves it to (epoch + 1, 0). Snapshots store its two int64s; Seek restores
//    it.
//
// Thread-safety: the functions are stateless; a ShardSampler is not thread-safe (each trainer
// owns one). Status codes: see each function (INVALID_ARGUMENT for a configuration or cursor
// out of range).

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/rng.h"
#include "proto/config.pb.h"

namespace rebound::worker {

// RngStream::tensor_id domain tags of the two kinds of shuffle.
inline constexpr uint32_t kShuffleGlobalOrder = 0;
inline constexpr uint32_t kShuffleEpoch = 1;

// The stream of the global order of `seed`, and of `replica`'s order in `epoch`.
RngStream GlobalOrderStream(uint64_t seed);
RngStream EpochStream(uint64_t seed, int32_t replica, int64_t epoch);

// Shuffles `ids` in place as described in point 1. REQUIRES: ids.size() < 2^32.
void ShuffleSampleIds(const RngStream& stream, absl::Span<int64_t> ids);

// The sample ids of replica `replica` of `replicas` over a data set of `num_samples`, in global
// order (point 2). INVALID_ARGUMENT unless 1 <= replicas <= num_samples <= 2^31 - 1,
// 0 <= replica < replicas and overlap is in [0, 1).
absl::StatusOr<std::vector<int64_t>> ReplicaShard(uint64_t seed, int64_t num_samples,
                                                  int32_t replicas, int32_t replica,
                                                  double overlap);

// The position of a replica in its data: see point 4.
struct DataCursor {
  int64_t epoch = 0;
  int64_t offset = 0;

  friend bool operator==(const DataCursor& a, const DataCursor& b) {
    return a.epoch == b.epoch && a.offset == b.offset;
  }
  friend bool operator!=(const DataCursor& a, const DataCursor& b) { return !(a == b); }
};

struct SamplerOptions {
  uint64_t seed = 0;
  int64_t num_samples = 0;  // the training set's count (after train_limit)
  int32_t replicas = 1;
  int32_t replica = 0;
  double overlap = 0.0;     // in [0, 1)
  int32_t batch_size = 1;   // >= 1 and <= the shard size
};

// Yields the batches of sample ids of one replica, epoch after epoch, from a cursor.
// Not thread-safe; each trainer owns one. Movable, not copyable.
class ShardSampler {
 public:
  // INVALID_ARGUMENT for options that ReplicaShard rejects or a batch_size outside
  // [1, shard size].
  static absl::StatusOr<ShardSampler> Create(const SamplerOptions& options);
  // The same with seed, shard_overlap and batch_size taken from `config`.
  static absl::StatusOr<ShardSampler> Create(const DataConfig& config, int64_t num_samples,
                                             int32_t replicas, int32_t replica);

  ShardSampler(ShardSampler&&) = default;
  ShardSampler& operator=(ShardSampler&&) = default;
  ShardSampler(const ShardSampler&) = delete;
  ShardSampler& operator=(const ShardSampler&) = delete;

  // The replica's shard in global order.
  const std::vector<int64_t>& shard() const { return shard_; }
  int32_t batch_size() const { return options_.batch_size; }
  int64_t batches_per_epoch() const;

  // The order of epoch `epoch` (a permutation of shard()). REQUIRES: epoch >= 0.
  std::vector<int64_t> EpochOrder(int64_t epoch) const;

  // Returns the batch_size ids the cursor names and advances the cursor past them.
  std::vector<int64_t> NextBatch();

  DataCursor cursor() const { return cursor_; }
  // Moves to `cursor`; INVALID_ARGUMENT (cursor unchanged) unless epoch >= 0 and
  // 0 <= offset <= shard().size() - batch_size().
  absl::Status Seek(const DataCursor& cursor);

 private:
  ShardSampler(const SamplerOptions& options, std::vector<int64_t> shard);

  SamplerOptions options_;
  std::vector<int64_t> shard_;
  DataCursor cursor_;
  int64_t order_epoch_ = -1;  // the epoch that order_ holds, -1 = none yet
  std::vector<int64_t> order_;
};

}  // namespace rebound::worker
