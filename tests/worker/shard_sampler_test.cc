#include "worker/data/shard_sampler.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <vector>

#include <catch2/catch.hpp>

#include "common/rng.h"
#include "tests/worker/test_files.h"

namespace rebound::worker {
namespace {

std::vector<int64_t> Iota(int64_t n) {
  std::vector<int64_t> ids(n);
  std::iota(ids.begin(), ids.end(), int64_t{0});
  return ids;
}

std::vector<int64_t> Shuffled(const RngStream& stream, int64_t n) {
  std::vector<int64_t> ids = Iota(n);
  ShuffleSampleIds(stream, absl::MakeSpan(ids));
  return ids;
}

bool IsPermutationOfIota(std::vector<int64_t> ids) {
  std::sort(ids.begin(), ids.end());
  return ids == Iota(static_cast<int64_t>(ids.size()));
}

std::vector<int64_t> Shard(uint64_t seed, int64_t n, int32_t replicas, int32_t replica,
                           double overlap) {
  absl::StatusOr<std::vector<int64_t>> shard = ReplicaShard(seed, n, replicas, replica, overlap);
  INFO(shard.status());
  REQUIRE(shard.ok());
  return *shard;
}

ShardSampler MakeSampler(const SamplerOptions& options) {
  absl::StatusOr<ShardSampler> sampler = ShardSampler::Create(options);
  INFO(sampler.status());
  REQUIRE(sampler.ok());
  return std::move(*sampler);
}

SamplerOptions Options(int64_t n, int32_t replicas, int32_t replica, double overlap,
                       int32_t batch_size) {
  SamplerOptions options;
  options.seed = 42;
  options.num_samples = n;
  options.replicas = replicas;
  options.replica = replica;
  options.overlap = overlap;
  options.batch_size = batch_size;
  return options;
}

TEST_CASE("the shuffle streams carry seed, replica and epoch as documented") {
  const RngStream global = GlobalOrderStream(7);
  CHECK(global.seed == 7);
  CHECK(global.replica == 0);
  CHECK(global.step == 0);
  CHECK(global.tensor_id == kShuffleGlobalOrder);
  CHECK(global.purpose == kRngShuffle);
  const RngStream epoch = EpochStream(7, 3, 11);
  CHECK(epoch.seed == 7);
  CHECK(epoch.replica == 3);
  CHECK(epoch.step == 11);
  CHECK(epoch.tensor_id == kShuffleEpoch);
  CHECK(epoch.purpose == kRngShuffle);
}

TEST_CASE("the shuffle is the documented Fisher-Yates over RngWord with Lemire's rejection") {
  const RngStream stream = EpochStream(1234, 2, 5);
  std::vector<int64_t> expected = Iota(1000);
  uint64_t k = 0;
  for (uint64_t i = expected.size() - 1; i >= 1; --i) {
    const uint64_t bound = i + 1;
    uint64_t m;
    do {
      m = uint64_t{RngWord(stream, k++)} * bound;
    } while ((m & 0xffffffffu) < (uint64_t{1} << 32) % bound);
    std::swap(expected[i], expected[m >> 32]);
  }
  CHECK(Shuffled(stream, 1000) == expected);
}

TEST_CASE("a shuffle is a deterministic permutation of its ids") {
  const RngStream stream = EpochStream(42, 1, 3);
  const std::vector<int64_t> a = Shuffled(stream, 60000);
  CHECK(a == Shuffled(stream, 60000));
  CHECK(IsPermutationOfIota(a));
  CHECK(a != Iota(60000));

  std::vector<int64_t> empty;
  ShuffleSampleIds(stream, absl::MakeSpan(empty));
  std::vector<int64_t> one = {17};
  ShuffleSampleIds(stream, absl::MakeSpan(one));
  CHECK(one == std::vector<int64_t>{17});
}

TEST_CASE("another epoch, replica or seed shuffles differently") {
  const std::vector<int64_t> base = Shuffled(EpochStream(42, 1, 3), 1000);
  CHECK(base != Shuffled(EpochStream(42, 1, 4), 1000));
  CHECK(base != Shuffled(EpochStream(42, 2, 3), 1000));
  CHECK(base != Shuffled(EpochStream(43, 1, 3), 1000));
  CHECK(Shuffled(GlobalOrderStream(42), 1000) != Shuffled(EpochStream(42, 0, 0), 1000));
}

TEST_CASE("the shuffle draws each permutation of three ids about equally often") {
  std::map<std::vector<int64_t>, int> counts;
  constexpr int kTrials = 6000;
  for (int seed = 0; seed < kTrials; ++seed) ++counts[Shuffled(EpochStream(seed, 0, 0), 3)];
  REQUIRE(counts.size() == 6);
  double chi_square = 0.0;
  for (const auto& [permutation, count] : counts) {
    chi_square += std::pow(count - kTrials / 6.0, 2) / (kTrials / 6.0);
  }
  CHECK(chi_square < 20.5);  // the 0.999 quantile of chi-square with 5 degrees of freedom
}

TEST_CASE("without overlap the replicas' shards partition the data set into near-equal parts") {
  for (const int64_t n : {int64_t{1000}, int64_t{1003}}) {
    std::vector<int64_t> all;
    for (int32_t r = 0; r < 4; ++r) {
      const std::vector<int64_t> shard = Shard(42, n, 4, r, 0.0);
      CHECK(static_cast<int64_t>(shard.size()) == (r + 1) * n / 4 - r * n / 4);
      all.insert(all.end(), shard.begin(), shard.end());
    }
    INFO("n = " << n);
    CHECK(static_cast<int64_t>(all.size()) == n);
    CHECK(IsPermutationOfIota(all));
  }
}

TEST_CASE("the shards are consecutive runs of the seed's global order") {
  const std::vector<int64_t> order = Shuffled(GlobalOrderStream(42), 1000);
  CHECK(Shard(42, 1000, 4, 0, 0.0) == std::vector<int64_t>(order.begin(), order.begin() + 250));
  CHECK(Shard(42, 1000, 4, 2, 0.0) ==
        std::vector<int64_t>(order.begin() + 500, order.begin() + 750));
  CHECK(Shard(43, 1000, 4, 0, 0.0) != Shard(42, 1000, 4, 0, 0.0));
}

TEST_CASE("with overlap each shard extends into the next replica's part, the last wrapping") {
  constexpr int64_t kN = 1000;
  constexpr double kOverlap = 0.2;
  std::vector<std::vector<int64_t>> base;
  std::vector<std::vector<int64_t>> shards;
  for (int32_t r = 0; r < 4; ++r) {
    base.push_back(Shard(42, kN, 4, r, 0.0));
    shards.push_back(Shard(42, kN, 4, r, kOverlap));
  }
  std::set<int64_t> covered;
  for (int32_t r = 0; r < 4; ++r) {
    INFO("replica " << r);
    const std::vector<int64_t>& shard = shards[r];
    REQUIRE(shard.size() == 250 + 50);
    CHECK(std::vector<int64_t>(shard.begin(), shard.begin() + 250) == base[r]);
    const std::vector<int64_t>& next = base[(r + 1) % 4];
    CHECK(std::vector<int64_t>(shard.begin() + 250, shard.end()) ==
          std::vector<int64_t>(next.begin(), next.begin() + 50));
    CHECK(std::set<int64_t>(shard.begin(), shard.end()).size() == shard.size());
    covered.insert(shard.begin(), shard.end());

    // Replica r shares exactly 50 ids with replica r + 1 and none with replica r + 2.
    std::vector<int64_t> a = shard;
    std::vector<int64_t> b = shards[(r + 1) % 4];
    std::vector<int64_t> c = shards[(r + 2) % 4];
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    std::sort(c.begin(), c.end());
    std::vector<int64_t> shared;
    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(shared));
    CHECK(shared.size() == 50);
    shared.clear();
    std::set_intersection(a.begin(), a.end(), c.begin(), c.end(), std::back_inserter(shared));
    CHECK(shared.empty());
  }
  CHECK(static_cast<int64_t>(covered.size()) == kN);
}

TEST_CASE("the overlap rounds to the nearest id and never repeats an id in one shard") {
  // 0.29 * 100 is 28.999... in binary floating point: the extension is still 29 ids.
  CHECK(Shard(42, 400, 4, 1, 0.29).size() == 100 + 29);
  CHECK(Shard(42, 400, 4, 1, 0.125).size() == 100 + 13);  // 12.5 rounds up
  // With one replica the shard is the whole data set, whatever the overlap.
  const std::vector<int64_t> whole = Shard(42, 1000, 1, 0, 0.9);
  CHECK(whole == Shuffled(GlobalOrderStream(42), 1000));
  // With two replicas of 1 and 2 ids, 0.99 * 2 rounds to 2 but only 1 other id exists.
  const std::vector<int64_t> spill = Shard(42, 3, 2, 1, 0.99);
  CHECK(spill.size() == 3);
  CHECK(IsPermutationOfIota(spill));
}

TEST_CASE("invalid shard parameters are INVALID_ARGUMENT") {
  const auto code = [](int64_t n, int32_t replicas, int32_t replica, double overlap) {
    return ReplicaShard(42, n, replicas, replica, overlap).status().code();
  };
  constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
  CHECK(code(100, 4, 0, 1.0) == kInvalid);
  CHECK(code(100, 4, 0, -0.1) == kInvalid);
  CHECK(code(100, 4, 0, std::numeric_limits<double>::quiet_NaN()) == kInvalid);
  CHECK(code(100, 4, 4, 0.0) == kInvalid);
  CHECK(code(100, 4, -1, 0.0) == kInvalid);
  CHECK(code(100, 0, 0, 0.0) == kInvalid);
  CHECK(code(3, 4, 0, 0.0) == kInvalid);
  CHECK(code(0, 1, 0, 0.0) == kInvalid);
  CHECK(code(int64_t{1} << 31, 1, 0, 0.0) == kInvalid);
  CHECK(code(4, 4, 3, 0.0) == absl::StatusCode::kOk);
}

TEST_CASE("a batch size larger than the shard is INVALID_ARGUMENT") {
  CHECK(ShardSampler::Create(Options(100, 4, 0, 0.0, 26)).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(ShardSampler::Create(Options(100, 4, 0, 0.0, 0)).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(ShardSampler::Create(Options(100, 4, 0, 0.0, 25)).ok());
}

TEST_CASE("an epoch's order is a permutation of the shard that changes with the epoch") {
  const ShardSampler sampler = MakeSampler(Options(1000, 4, 1, 0.2, 32));
  const std::vector<int64_t> epoch0 = sampler.EpochOrder(0);
  const std::vector<int64_t> epoch1 = sampler.EpochOrder(1);
  CHECK(epoch0 != epoch1);
  CHECK(epoch0 != sampler.shard());
  CHECK(std::is_permutation(epoch0.begin(), epoch0.end(), sampler.shard().begin(),
                            sampler.shard().end()));
  CHECK(std::is_permutation(epoch1.begin(), epoch1.end(), sampler.shard().begin(),
                            sampler.shard().end()));
  const ShardSampler other_replica = MakeSampler(Options(1000, 4, 2, 0.2, 32));
  CHECK(other_replica.EpochOrder(0) != epoch0);
  CHECK(MakeSampler(Options(1000, 4, 1, 0.2, 32)).EpochOrder(0) == epoch0);
}

TEST_CASE("batches walk each epoch's order, skip the short tail and roll into the next epoch") {
  // Shard of 250 + 50 = 300 ids, batches of 64: 4 batches an epoch, 44 ids of tail skipped.
  ShardSampler sampler = MakeSampler(Options(1000, 4, 3, 0.2, 64));
  REQUIRE(sampler.shard().size() == 300);
  CHECK(sampler.batches_per_epoch() == 4);
  CHECK(sampler.cursor() == DataCursor{0, 0});
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    const std::vector<int64_t> order = sampler.EpochOrder(epoch);
    for (int64_t b = 0; b < 4; ++b) {
      INFO("epoch " << epoch << ", batch " << b);
      CHECK(sampler.cursor() == DataCursor{epoch, b * 64});
      const std::vector<int64_t> batch = sampler.NextBatch();
      CHECK(batch == std::vector<int64_t>(order.begin() + b * 64, order.begin() + (b + 1) * 64));
    }
  }
  CHECK(sampler.cursor() == DataCursor{3, 0});
}

TEST_CASE("a shard that divides into batches exactly uses every id every epoch") {
  ShardSampler sampler = MakeSampler(Options(1000, 4, 0, 0.0, 50));
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    std::vector<int64_t> seen;
    for (int b = 0; b < 5; ++b) {
      const std::vector<int64_t> batch = sampler.NextBatch();
      seen.insert(seen.end(), batch.begin(), batch.end());
    }
    CHECK(std::is_permutation(seen.begin(), seen.end(), sampler.shard().begin(),
                              sampler.shard().end()));
    CHECK(sampler.cursor() == DataCursor{epoch + 1, 0});
  }
}

TEST_CASE("a restored cursor resumes the same batches, across epoch boundaries") {
  const SamplerOptions options = Options(1000, 4, 2, 0.2, 64);
  ShardSampler original = MakeSampler(options);
  for (int i = 0; i < 7; ++i) original.NextBatch();
  const DataCursor saved = original.cursor();
  CHECK(saved == DataCursor{1, 3 * 64});
  std::vector<std::vector<int64_t>> expected;
  for (int i = 0; i < 10; ++i) expected.push_back(original.NextBatch());

  ShardSampler restored = MakeSampler(options);
  restored.NextBatch();  // its own position is irrelevant once restored
  REQUIRE(restored.Seek(DataCursor{saved.epoch, saved.offset}).ok());
  CHECK(restored.cursor() == saved);
  for (int i = 0; i < 10; ++i) {
    INFO("batch " << i << " after the restore");
    CHECK(restored.NextBatch() == expected[i]);
  }
  CHECK(restored.cursor() == original.cursor());
}

TEST_CASE("an invalid cursor is INVALID_ARGUMENT and leaves the sampler where it was") {
  ShardSampler sampler = MakeSampler(Options(1000, 4, 0, 0.0, 64));  // 250 ids
  sampler.NextBatch();
  const DataCursor before = sampler.cursor();
  for (const DataCursor bad : {DataCursor{-1, 0}, DataCursor{0, -1}, DataCursor{0, 187}}) {
    INFO("epoch " << bad.epoch << ", offset " << bad.offset);
    CHECK(sampler.Seek(bad).code() == absl::StatusCode::kInvalidArgument);
    CHECK(sampler.cursor() == before);
  }
  REQUIRE(sampler.Seek(DataCursor{5, 186}).ok());
  const std::vector<int64_t> order = sampler.EpochOrder(5);
  CHECK(sampler.NextBatch() == std::vector<int64_t>(order.begin() + 186, order.end()));
  CHECK(sampler.cursor() == DataCursor{6, 0});
}

TEST_CASE("a sampler made from a DataConfig uses its seed, overlap and batch size") {
  DataConfig config;
  config.set_seed(7);
  config.set_shard_overlap(0.1);
  config.set_batch_size(20);
  absl::StatusOr<ShardSampler> from_config = ShardSampler::Create(config, 1000, 4, 1);
  REQUIRE(from_config.ok());
  SamplerOptions options = Options(1000, 4, 1, 0.1, 20);
  options.seed = 7;
  ShardSampler from_options = MakeSampler(options);
  CHECK(from_config->batch_size() == 20);
  CHECK(from_config->shard() == from_options.shard());
  CHECK(from_config->shard().size() == 250 + 25);
  CHECK(from_config->NextBatch() == from_options.NextBatch());
}

}  // namespace
}  // namespace rebound::worker
