// DataSetCache (worker/slot_compute.h): the data set one role of a worker process loaded goes to
// the next role, once, and only to one that loads it with the same DataConfig. Each cache is an
// object of its own (it replaced a process-global stash).

#include <catch2/catch.hpp>

#include <optional>

#include "proto/config.pb.h"
#include "worker/data/fashion_mnist.h"
#include "worker/slot_compute.h"

namespace rebound::worker {
namespace {

FashionMnist Marked(int64_t count) {
  FashionMnist data;
  data.train.count = count;
  data.test.count = count + 1;
  return data;
}

TEST_CASE("a data-set cache hands its set out once, to an equal DataConfig") {
  DataSetCache cache;
  DataConfig config;
  config.set_train_limit(600);
  DataConfig other = config;
  other.set_train_limit(700);

  CHECK_FALSE(cache.Take(config).has_value());
  cache.Put(config, Marked(600));
  CHECK_FALSE(cache.Take(other).has_value());  // another config: not this set
  std::optional<FashionMnist> taken = cache.Take(config);
  REQUIRE(taken.has_value());
  CHECK(taken->train.count == 600);
  CHECK(taken->test.count == 601);
  CHECK_FALSE(cache.Take(config).has_value());  // moved out, not copied
}

TEST_CASE("a data-set cache keeps the last set put, and caches are independent") {
  DataSetCache first;
  DataSetCache second;
  DataConfig config;
  first.Put(config, Marked(1));
  first.Put(config, Marked(2));
  CHECK_FALSE(second.Take(config).has_value());
  std::optional<FashionMnist> taken = first.Take(config);
  REQUIRE(taken.has_value());
  CHECK(taken->train.count == 2);
}

TEST_CASE("Load takes a kept set without reading files") {
  DataSetCache cache;
  DataConfig config;
  config.set_dataset_dir("/nonexistent/rebound-test");  // reading it would fail
  cache.Put(config, Marked(5));
  absl::StatusOr<FashionMnist> loaded = cache.Load(config);
  REQUIRE(loaded.ok());
  CHECK(loaded->train.count == 5);
  CHECK_FALSE(cache.Load(config).ok());  // nothing kept now: it reads, and fails
}

}  // namespace
}  // namespace rebound::worker
