// DataSetCache (worker/slot_compute.h): the data set one role of a worker process loaded goes to
// the next role, once, and only to one that loads it with the same DataConfig. Each cache is an
// object of its own (it replaced a process-global stash). SlotCompute::Create marks a model that
// does not fit the data set, and a backend this build lacks, as the configuration's mismatch
// (worker/main.cc then exits 2 without waiting for the server's word on a fence).

#include <catch2/catch.hpp>

#include <memory>
#include <optional>

#include "absl/status/status.h"

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

FashionMnist Tiny(int64_t features) {
  FashionMnist data;
  data.train.count = 8;
  data.train.rows = 1;
  data.train.cols = static_cast<int32_t>(features);
  data.train.features = features;
  data.train.images.assign(8 * features, 0.5f);
  data.train.labels.assign(8, 1);
  data.test = data.train;
  return data;
}

JobConfig TinyJob(int input_dim) {
  JobConfig job;
  job.mutable_model()->set_input_dim(input_dim);
  job.mutable_model()->add_layers()->set_width(kFashionMnistClasses);
  job.mutable_data()->set_batch_size(4);
  job.mutable_topology()->set_replicas(1);
  return job;
}

TEST_CASE("a model that does not fit the data set is the configuration's mismatch, not a fence") {
  const absl::StatusOr<std::unique_ptr<SlotCompute>> slot =
      SlotCompute::Create(WorkerConfig(), TinyJob(5), SlotId(), Tiny(4));
  REQUIRE_FALSE(slot.ok());
  CHECK(slot.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(IsConfigMismatch(slot.status()));
  // The server's FAILED_PRECONDITION (a fence) carries no such mark; nor does another code.
  CHECK_FALSE(IsConfigMismatch(absl::FailedPreconditionError("fenced by the server")));
  CHECK_FALSE(IsConfigMismatch(MarkConfigMismatch(absl::InvalidArgumentError("bad"))));
  CHECK(IsConfigMismatch(MarkConfigMismatch(absl::FailedPreconditionError("x"))));
}

#if !defined(REBOUND_HAVE_CUDA)
TEST_CASE("a CUDA backend in a build without CUDA is the configuration's mismatch") {
  WorkerConfig config;
  config.mutable_compute()->set_backend(CUDA);
  const absl::StatusOr<std::unique_ptr<SlotCompute>> slot =
      SlotCompute::Create(config, TinyJob(4), SlotId(), Tiny(4));
  REQUIRE_FALSE(slot.ok());
  CHECK(IsConfigMismatch(slot.status()));
  CHECK(slot.status().message().find("built without CUDA") != absl::string_view::npos);
}
#endif

}  // namespace
}  // namespace rebound::worker
