// server/center_export.h for a sharded job: group 0 joins each stage from its K range reads
// (here a fake reader over an unsharded table's values) only when every range holds the same
// syncs and pushes, reading again while they differ, until a deadline on an injected clock.

#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "common/clock.h"
#include "compute/shard_ranges.h"
#include "proto/sharding.pb.h"
#include "server/center_export.h"
#include "server/center_table.h"
#include "tests/server/server_testing.h"

namespace rebound::server {
namespace {

constexpr int kGroups = 2;

// The job unsharded and sharded across kGroups groups (the tiny MLP: 23 parameters).
struct Fixture {
  Fixture()
      : unsharded_job(testing::TinyModelJob(2, 1)),
        sharded_job(testing::TinyModelJob(2, 1, "sharding { groups: 2 }\n")) {
    auto whole = CenterTable::Create(unsharded_job);
    REQUIRE(whole.ok());
    unsharded = *std::move(whole);
    auto range0 = CenterTable::Create(sharded_job, 0);
    REQUIRE(range0.ok());
    group0 = *std::move(range0);
    auto read = unsharded->Read(0);
    REQUIRE(read.ok());
    values = read->first;
  }

  // Range k's answer: its slice of `values` at `version`, having applied `steps` by replica.
  ExportRangeResponse Range(int k, int64_t version, std::vector<int64_t> steps) const {
    const std::vector<int64_t> begins =
        compute::RangeBegins(static_cast<int64_t>(values.size()), kGroups);
    ExportRangeResponse range;
    Tensor* tensor = range.mutable_center()->add_tensors();
    tensor->set_id(0);
    tensor->set_dtype(FLOAT32);
    tensor->add_shape(begins[k + 1] - begins[k]);
    tensor->set_data(std::string(reinterpret_cast<const char*>(values.data() + begins[k]),
                                 (begins[k + 1] - begins[k]) * sizeof(float)));
    range.set_center_version(version);
    for (int64_t step : steps) {
      range.add_applied_steps(step);
      range.add_applied_sequences(0);
    }
    return range;
  }

  absl::StatusOr<ExportCenterResponse> Export(const StageRangesRead& reader) {
    return ReadShardedCenterExport(sharded_job, *group0, reader,
                                   clock.Now() + absl::Seconds(2), clock, "test");
  }

  JobConfig unsharded_job;
  JobConfig sharded_job;
  std::unique_ptr<CenterTable> unsharded;
  std::unique_ptr<CenterTable> group0;
  std::vector<float> values;
  FakeClock clock;
  int reads = 0;
};

using Reads = std::vector<absl::StatusOr<ExportRangeResponse>>;

TEST_CASE("a sharded stage is joined from its ranges with the unsharded export's names, shapes "
          "and values") {
  Fixture f;
  absl::StatusOr<ExportCenterResponse> exported = f.Export([&](int stage, absl::Time) {
    ++f.reads;
    REQUIRE(stage == 0);
    return Reads{f.Range(0, 7, {20, 40}), f.Range(1, 7, {20, 40})};
  });
  INFO(exported.status());
  REQUIRE(exported.ok());
  CHECK(f.reads == 1);
  absl::StatusOr<ExportCenterResponse> reference =
      ReadCenterExport(f.unsharded_job, *f.unsharded, "test");
  REQUIRE(reference.ok());
  REQUIRE(exported->stages_size() == 1);
  const ExportedStage& stage = exported->stages(0);
  CHECK(stage.center().SerializeAsString() ==
        reference->stages(0).center().SerializeAsString());
  CHECK(stage.center().tensors(0).name() == "layer0.weight");
  CHECK(stage.center_version() == 7);
  CHECK(std::vector<int64_t>(stage.range_versions().begin(), stage.range_versions().end()) ==
        std::vector<int64_t>{7, 7});
}

TEST_CASE("a stage whose ranges hold different syncs is read again until they hold the same") {
  Fixture f;
  absl::StatusOr<ExportCenterResponse> exported = f.Export([&](int, absl::Time) {
    // Range 1 reaches slot 1's sync of step 40 at the third read.
    ++f.reads;
    return Reads{f.Range(0, 8, {20, 40}), f.Range(1, f.reads < 3 ? 7 : 8,
                                                  {20, f.reads < 3 ? 20 : 40})};
  });
  INFO(exported.status());
  REQUIRE(exported.ok());
  CHECK(f.reads == 3);
  CHECK(exported->stages(0).range_versions(1) == 8);
}

TEST_CASE("ranges that still hold different syncs at the deadline are DEADLINE_EXCEEDED naming "
          "the slot and both ranges' steps") {
  Fixture f;
  const absl::Time start = f.clock.Now();
  absl::StatusOr<ExportCenterResponse> exported = f.Export([&](int, absl::Time) {
    ++f.reads;
    return Reads{f.Range(0, 8, {20, 40}), f.Range(1, 7, {20, 20})};
  });
  CHECK(exported.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(absl::StrContains(exported.status().message(), "different updates of slot"));
  CHECK(absl::StrContains(exported.status().message(), "range 0 its sync of step 40"));
  CHECK(absl::StrContains(exported.status().message(), "range 1 its sync of step 20"));
  // Bounded: read again with growing pauses, never past the deadline.
  CHECK(f.reads > 3);
  CHECK(f.reads < 30);
  CHECK(f.clock.Now() <= start + absl::Seconds(2));
}

TEST_CASE("a range's refusal is answered at once; a range that does not answer is read again, "
          "then UNAVAILABLE naming it") {
  Fixture f;
  absl::StatusOr<ExportCenterResponse> refused = f.Export([&](int, absl::Time) {
    ++f.reads;
    return Reads{f.Range(0, 1, {0, 0}),
                 absl::PermissionDeniedError("range 1 (group 1 at h:1) did not export")};
  });
  CHECK(refused.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK(f.reads == 1);

  f.reads = 0;
  absl::StatusOr<ExportCenterResponse> down = f.Export([&](int, absl::Time) {
    ++f.reads;
    return Reads{f.Range(0, 1, {0, 0}),
                 absl::UnavailableError("range 1 (group 1 at h:1) did not export stage 0")};
  });
  CHECK(down.status().code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(down.status().message(), "range 1 (group 1 at h:1)"));
  CHECK(f.reads > 1);

  // A group that comes back within the deadline is read.
  f.reads = 0;
  absl::StatusOr<ExportCenterResponse> back = f.Export([&](int, absl::Time) {
    ++f.reads;
    if (f.reads == 1) return Reads{f.Range(0, 1, {0, 0}), absl::UnavailableError("restarting")};
    return Reads{f.Range(0, 1, {0, 0}), f.Range(1, 1, {0, 0})};
  });
  CHECK(back.ok());
}

TEST_CASE("a range whose size is not its range of the stage is DATA_LOSS") {
  Fixture f;
  absl::StatusOr<ExportCenterResponse> exported = f.Export([&](int, absl::Time) {
    ExportRangeResponse short_range = f.Range(1, 1, {0, 0});
    std::string* data = short_range.mutable_center()->mutable_tensors(0)->mutable_data();
    data->resize(data->size() - sizeof(float));
    return Reads{f.Range(0, 1, {0, 0}), short_range};
  });
  CHECK(exported.status().code() == absl::StatusCode::kDataLoss);
  CHECK(absl::StrContains(exported.status().message(), "range 1 of stage 0"));
}

}  // namespace
}  // namespace rebound::server
