#include "storage/durable_store.h"

#include <catch2/catch.hpp>

#include <rocksdb/convenience.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/table_properties.h>
#include <rocksdb/utilities/options_util.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <google/protobuf/util/message_differencer.h>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "storage/envelope.h"
#include "storage/keys.h"
#include "testing/cluster/processes.h"
#include "tests/storage/raw_db.h"

namespace rebound::storage {
namespace {

namespace fs = std::filesystem;
using ::Catch::Contains;
using ::rebound::testing::RawDb;

#define REQUIRE_OK(expr)                     \
  do {                                       \
    const absl::Status require_ok_ = (expr); \
    INFO(require_ok_.ToString());            \
    REQUIRE(require_ok_.ok());               \
  } while (false)

template <typename T>
T ValueOrFail(absl::StatusOr<T> value) {
  INFO(value.status().ToString());
  REQUIRE(value.ok());
  return std::move(value).value();
}

bool SameProto(const google::protobuf::Message& a, const google::protobuf::Message& b) {
  return google::protobuf::util::MessageDifferencer::Equals(a, b);
}

std::string Message(const absl::Status& status) { return std::string(status.message()); }

std::unique_ptr<DurableStore> OpenOrFail(const std::string& dir, bool fsync = false,
                                         Compression compression = ZSTD) {
  DurableStoreOptions options;
  options.data_dir = dir;
  options.fsync = fsync;
  options.steplog_compression = compression;
  return ValueOrFail(DurableStore::Open(options));
}

SlotId Slot(int32_t replica, int32_t stage) {
  SlotId slot;
  slot.set_replica(replica);
  slot.set_stage(stage);
  return slot;
}

TensorBundle Bundle(float base, int n) {
  TensorBundle bundle;
  Tensor* tensor = bundle.add_tensors();
  tensor->set_id(0);
  tensor->set_name("layer0.weight");
  tensor->set_dtype(FLOAT32);
  tensor->add_shape(n);
  std::string data(n * sizeof(float), '\0');
  for (int i = 0; i < n; ++i) {
    const float value = base + static_cast<float>(i);
    std::memcpy(&data[i * sizeof(float)], &value, sizeof(float));
  }
  tensor->set_data(data);
  return bundle;
}

CenterRecord Center(int32_t stage, int64_t version) {
  CenterRecord record;
  record.set_stage(stage);
  record.set_version(version);
  *record.mutable_params() = Bundle(static_cast<float>(stage), 64);
  return record;
}

CenterOptRecord CenterOpt(int32_t stage) {
  CenterOptRecord record;
  record.set_stage(stage);
  record.mutable_state()->set_step(12);
  *record.mutable_state()->mutable_m() = Bundle(0.5f, 32);
  *record.mutable_state()->mutable_v() = Bundle(0.25f, 32);
  return record;
}

Snapshot MakeSnapshot(int32_t replica, int32_t stage, int64_t step) {
  Snapshot snapshot;
  *snapshot.mutable_slot() = Slot(replica, stage);
  snapshot.set_step(step);
  *snapshot.mutable_params() = Bundle(static_cast<float>(step), 128);
  snapshot.mutable_optimizer()->set_step(step);
  *snapshot.mutable_optimizer()->mutable_m() = Bundle(1.0f, 128);
  snapshot.set_checksum(0x0123456789abcdefULL);
  snapshot.set_data_epoch(2);
  snapshot.set_data_offset(4096);
  return snapshot;
}

WeightRecord Weight(int32_t replica, int32_t stage, double weight) {
  WeightRecord record;
  *record.mutable_slot() = Slot(replica, stage);
  record.set_weight(weight);
  record.set_fault_score(0.5);
  record.set_fault_updated_unix_ms(1700000000000);
  record.set_last_sync_unix_ms(1700000001000);
  record.set_center_version_at_last_sync(41);
  record.set_last_divergence(3.25);
  record.mutable_inputs()->set_staleness(1.5);
  return record;
}

SlotRecord SlotState(int32_t replica, int32_t stage, int64_t step) {
  SlotRecord record;
  *record.mutable_slot() = Slot(replica, stage);
  record.set_state(ACTIVE);
  record.set_owner_incarnation(7);
  record.set_step(step);
  record.set_owner_name("trainer-" + std::to_string(replica));
  return record;
}

ServerRecord Server() {
  ServerRecord record;
  record.set_job_id("job-42");
  record.set_incarnation_epoch(3);
  record.set_next_incarnation_counter(17);
  return record;
}

LogRecord Log(int32_t replica, int32_t stage, int64_t step, int32_t micro_batch) {
  LogRecord record;
  *record.mutable_slot() = Slot(replica, stage);
  record.set_step(step);
  record.set_micro_batch(micro_batch);
  if (micro_batch == -1) {
    record.set_params_checksum(static_cast<uint64_t>(step) * 0x9e3779b97f4a7c15ULL);
  } else {
    for (int i = 0; i < 4; ++i) record.add_sample_ids(step * 1000 + micro_batch * 10 + i);
    BoundaryPayload* boundary = record.add_boundaries();
    boundary->set_direction(FORWARD);
    *boundary->mutable_value() = Bundle(static_cast<float>(step), 16).tensors(0);
  }
  record.set_sender_incarnation(5);
  record.set_record_id(static_cast<uint64_t>(step * 100 + micro_batch + 1));
  return record;
}

using LogId = std::tuple<int32_t, int32_t, int64_t, int32_t>;

LogId IdOf(const LogRecord& record) {
  return LogId(record.slot().replica(), record.slot().stage(), record.step(), record.micro_batch());
}

std::vector<LogId> Ids(const std::vector<LogRecord>& records) {
  std::vector<LogId> ids;
  for (const LogRecord& record : records) ids.push_back(IdOf(record));
  return ids;
}

// The records of steps (from, to] of one slot, micro-batches -1..m-1, in order.
std::vector<LogId> ExpectedIds(int32_t r, int32_t s, int64_t from, int64_t to, int32_t m) {
  std::vector<LogId> ids;
  for (int64_t step = from + 1; step <= to; ++step) {
    for (int32_t mb = -1; mb < m; ++mb) ids.emplace_back(r, s, step, mb);
  }
  return ids;
}

std::string TempDir(const std::string& name) { return testing::MakeTempDir(name); }

std::set<std::string> ListTree(const std::string& dir) {
  std::set<std::string> paths;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) paths.insert(entry.path());
  return paths;
}

// ---------------------------------------------------------------------------------------------

TEST_CASE("every record kind survives closing and reopening the directory") {
  const std::string dir = TempDir("roundtrip");
  {
    std::unique_ptr<DurableStore> store = OpenOrFail(dir, /*fsync=*/true);
    WriteBatch batch;
    batch.PutCenter(Center(0, 5));
    batch.PutCenter(Center(1, 6));
    batch.PutCenterOpt(CenterOpt(1));
    batch.PutSnapshot(MakeSnapshot(0, 1, 16));
    batch.PutSnapshot(MakeSnapshot(1, 0, 24));
    batch.PutWeight(Weight(0, 1, 0.75));
    batch.PutSlot(SlotState(0, 1, 19));
    batch.PutServer(Server());
    for (int64_t step = 17; step <= 19; ++step) {
      for (int32_t mb = -1; mb < 2; ++mb) batch.PutLogRecord(Log(0, 1, step, mb));
    }
    REQUIRE(batch.Count() == 17);
    REQUIRE_OK(store->Commit(batch));
  }

  std::unique_ptr<DurableStore> store = OpenOrFail(dir);
  const LoadedState state = ValueOrFail(store->LoadAll());
  REQUIRE(state.centers.size() == 2);
  CHECK(SameProto(state.centers.at(0), Center(0, 5)));
  CHECK(SameProto(state.centers.at(1), Center(1, 6)));
  REQUIRE(state.center_opts.size() == 1);
  CHECK(SameProto(state.center_opts.at(1), CenterOpt(1)));
  REQUIRE(state.snapshots.size() == 2);
  CHECK(SameProto(state.snapshots.at({0, 1}), MakeSnapshot(0, 1, 16)));
  CHECK(SameProto(state.snapshots.at({1, 0}), MakeSnapshot(1, 0, 24)));
  REQUIRE(state.weights.size() == 1);
  CHECK(SameProto(state.weights.at({0, 1}), Weight(0, 1, 0.75)));
  REQUIRE(state.slots.size() == 1);
  CHECK(SameProto(state.slots.at({0, 1}), SlotState(0, 1, 19)));
  REQUIRE(state.server.has_value());
  CHECK(SameProto(*state.server, Server()));

  const std::vector<LogRecord> log = ValueOrFail(store->ReadLog(Slot(0, 1), 16, 19));
  REQUIRE(Ids(log) == ExpectedIds(0, 1, 16, 19, 2));
  for (const LogRecord& record : log) {
    CHECK(SameProto(record, Log(0, 1, record.step(), record.micro_batch())));
  }
  CHECK(SameProto(ValueOrFail(store->ReadSnapshot(Slot(1, 0))), MakeSnapshot(1, 0, 24)));
}

TEST_CASE("a range group's two range snapshots per slot sit beside the slot's own snapshot") {
  const std::string dir = TempDir("ranges");
  {
    std::unique_ptr<DurableStore> store = OpenOrFail(dir);
    WriteBatch batch;
    batch.PutSnapshot(MakeSnapshot(0, 0, 8));
    batch.PutRangeSnapshot(MakeSnapshot(0, 0, 16), 0);
    batch.PutRangeSnapshot(MakeSnapshot(0, 0, 24), 1);
    batch.PutRangeSnapshot(MakeSnapshot(1, 0, 24), 1);
    REQUIRE_OK(store->Commit(batch));
    // The next sync replaces copy 0 only.
    WriteBatch next;
    next.PutRangeSnapshot(MakeSnapshot(0, 0, 32), 0);
    REQUIRE_OK(store->Commit(next));
    WriteBatch bad;
    bad.PutRangeSnapshot(MakeSnapshot(0, 0, 40), 2);
    CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
  }
  std::unique_ptr<DurableStore> store = OpenOrFail(dir);
  const LoadedState state = ValueOrFail(store->LoadAll());
  REQUIRE(state.snapshots.size() == 1);
  CHECK(state.snapshots.at({0, 0}).step() == 8);
  REQUIRE(state.range_snapshots.size() == 3);
  CHECK(state.range_snapshots.at({{0, 0}, 0}).step() == 32);
  CHECK(state.range_snapshots.at({{0, 0}, 1}).step() == 24);
  CHECK(state.range_snapshots.at({{1, 0}, 1}).step() == 24);
  // LoadAll keeps the headers; ReadRangeSnapshot brings the tensors.
  CHECK(state.range_snapshots.at({{0, 0}, 0}).params().tensors(0).data().empty());
  CHECK(SameProto(ValueOrFail(store->ReadRangeSnapshot(Slot(0, 0), 0)), MakeSnapshot(0, 0, 32)));
  CHECK(SameProto(ValueOrFail(store->ReadRangeSnapshot(Slot(1, 0), 1)), MakeSnapshot(1, 0, 24)));
  CHECK(store->ReadRangeSnapshot(Slot(1, 0), 0).status().code() == absl::StatusCode::kNotFound);
  CHECK(SameProto(ValueOrFail(store->ReadSnapshot(Slot(0, 0))), MakeSnapshot(0, 0, 8)));
}

TEST_CASE("a range group's push books load back, apart from the slots' weight records") {
  const std::string dir = TempDir("range-books");
  {
    std::unique_ptr<DurableStore> store = OpenOrFail(dir);
    WriteBatch batch;
    WeightRecord book;
    *book.mutable_slot() = Slot(1, 0);
    book.set_applied_sequence(17);
    book.set_update_count(17);
    batch.PutRangeBook(book);
    batch.PutWeight(Weight(1, 0, 0.5));
    REQUIRE_OK(store->Commit(batch));
  }
  std::unique_ptr<DurableStore> store = OpenOrFail(dir);
  const LoadedState state = ValueOrFail(store->LoadAll());
  REQUIRE(state.range_books.size() == 1);
  CHECK(state.range_books.at({1, 0}).applied_sequence() == 17);
  REQUIRE(state.weights.size() == 1);
  CHECK(state.weights.at({1, 0}).weight() == 0.5);
}

TEST_CASE("a fresh store loads empty") {
  std::unique_ptr<DurableStore> store = OpenOrFail(TempDir("fresh"));
  const LoadedState state = ValueOrFail(store->LoadAll());
  CHECK(state.centers.empty());
  CHECK(state.center_opts.empty());
  CHECK(state.snapshots.empty());
  CHECK(state.weights.empty());
  CHECK(state.slots.empty());
  CHECK_FALSE(state.server.has_value());
  CHECK(ValueOrFail(store->ReadLog(Slot(0, 0), 0, 100)).empty());
  CHECK(store->ReadSnapshot(Slot(0, 0)).status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("the directory holds exactly the documented column families") {
  const std::string dir = TempDir("families");
  OpenOrFail(dir).reset();
  RawDb raw(dir);
  CHECK(raw.names() == std::set<std::string>{"default", "center", "center_opt", "snapshot",
                                             "steplog", "weights", "meta"});
}

TEST_CASE("a later put of the same key wins, within a batch and across batches") {
  std::unique_ptr<DurableStore> store = OpenOrFail("");
  WriteBatch batch;
  batch.PutCenter(Center(0, 1));
  batch.PutCenter(Center(0, 2));
  REQUIRE_OK(store->Commit(batch));
  CHECK(ValueOrFail(store->LoadAll()).centers.at(0).version() == 2);
  batch.Clear();
  CHECK(batch.Count() == 0);
  batch.PutCenter(Center(0, 3));
  REQUIRE_OK(store->Commit(batch));
  CHECK(ValueOrFail(store->LoadAll()).centers.at(0).version() == 3);
}

TEST_CASE("a committed batch is visible whole") {
  std::unique_ptr<DurableStore> store = OpenOrFail(TempDir("batch"));
  WriteBatch batch;
  batch.PutCenter(Center(0, 9));
  batch.PutSnapshot(MakeSnapshot(2, 0, 8));
  batch.PutWeight(Weight(2, 0, 0.5));
  batch.PutSlot(SlotState(2, 0, 8));
  batch.PutLogRecord(Log(2, 0, 9, -1));
  batch.DeleteLogRange(Slot(2, 0), 0, 9);
  REQUIRE(batch.status().ok());
  CHECK(batch.ApproximateBytes() > 0);
  REQUIRE_OK(store->Commit(batch));

  const LoadedState state = ValueOrFail(store->LoadAll());
  CHECK(state.centers.at(0).version() == 9);
  CHECK(state.snapshots.at({2, 0}).step() == 8);
  CHECK(state.weights.at({2, 0}).weight() == 0.5);
  CHECK(state.slots.at({2, 0}).step() == 8);
  CHECK(Ids(ValueOrFail(store->ReadLog(Slot(2, 0), 0, 100))) == std::vector<LogId>{{2, 0, 9, -1}});
}

TEST_CASE("concurrent readers never see part of a batch") {
  std::unique_ptr<DurableStore> store = OpenOrFail("");
  constexpr int kCommits = 200;
  std::atomic<bool> done{false};
  std::atomic<int> torn{0};
  std::atomic<int> loads{0};
  std::thread reader([&] {
    while (!done.load()) {
      absl::StatusOr<LoadedState> state = store->LoadAll();
      if (!state.ok()) {
        ++torn;
        continue;
      }
      ++loads;
      if (state->centers.empty()) continue;
      const int64_t version = state->centers.at(0).version();
      if (state->centers.size() != 2 || state->centers.at(1).version() != version ||
          state->weights.at({0, 0}).center_version_at_last_sync() != version) {
        ++torn;
      }
    }
  });
  for (int i = 1; i <= kCommits; ++i) {
    WriteBatch batch;
    batch.PutCenter(Center(0, i));
    batch.PutCenter(Center(1, i));
    WeightRecord weight = Weight(0, 0, 1.0);
    weight.set_center_version_at_last_sync(i);
    batch.PutWeight(weight);
    REQUIRE_OK(store->Commit(batch));
  }
  done = true;
  reader.join();
  CHECK(torn.load() == 0);
  CHECK(loads.load() > 0);
  CHECK(ValueOrFail(store->LoadAll()).centers.at(1).version() == kCommits);
}

TEST_CASE("commits from many threads at once all land") {
  std::unique_ptr<DurableStore> store = OpenOrFail("");
  constexpr int kThreads = 4;
  constexpr int kSteps = 40;
  std::vector<std::thread> writers;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    writers.emplace_back([&store, &failures, t] {
      for (int64_t step = 1; step <= kSteps; ++step) {
        WriteBatch batch;
        for (int32_t mb = -1; mb < 2; ++mb) batch.PutLogRecord(Log(t, 0, step, mb));
        if (!store->Commit(batch).ok()) ++failures;
      }
    });
  }
  for (std::thread& writer : writers) writer.join();
  CHECK(failures.load() == 0);
  for (int t = 0; t < kThreads; ++t) {
    CHECK(Ids(ValueOrFail(store->ReadLog(Slot(t, 0), 0, kSteps))) ==
          ExpectedIds(t, 0, 0, kSteps, 2));
  }
}

TEST_CASE("an invalid record poisons its batch and nothing of it is written") {
  std::unique_ptr<DurableStore> store = OpenOrFail("");
  WriteBatch batch;
  batch.PutCenter(Center(0, 1));

  SECTION("a center without a stage") {
    CenterRecord center = Center(1, 1);
    center.clear_stage();
    batch.PutCenter(center);
    CHECK_THAT(Message(batch.status()), Contains("PutCenter: stage must be set"));
  }
  SECTION("a snapshot with a negative replica") {
    batch.PutSnapshot(MakeSnapshot(-1, 0, 8));
    CHECK_THAT(Message(batch.status()), Contains("PutSnapshot: slot must not be negative"));
  }
  SECTION("a weight without a slot") {
    WeightRecord weight = Weight(0, 0, 1.0);
    weight.clear_slot();
    batch.PutWeight(weight);
    CHECK_THAT(Message(batch.status()), Contains("PutWeight"));
  }
  SECTION("a slot record whose slot lacks its stage") {
    SlotRecord slot = SlotState(0, 0, 1);
    slot.mutable_slot()->clear_stage();
    batch.PutSlot(slot);
    CHECK_THAT(Message(batch.status()), Contains("PutSlot"));
  }
  SECTION("a log record with micro_batch below -1") {
    batch.PutLogRecord(Log(0, 0, 3, -2));
    CHECK_THAT(Message(batch.status()), Contains("micro_batch >= -1"));
  }
  SECTION("a log record without a step") {
    LogRecord record = Log(0, 0, 3, 0);
    record.clear_step();
    batch.PutLogRecord(record);
    CHECK_THAT(Message(batch.status()), Contains("step and micro_batch must be set"));
  }
  SECTION("a log range of a negative slot") {
    batch.DeleteLogRange(Slot(0, -3), 0, 10);
    CHECK_THAT(Message(batch.status()), Contains("DeleteLogRange"));
  }

  CHECK(batch.status().code() == absl::StatusCode::kInvalidArgument);
  batch.PutCenter(Center(2, 1));  // ignored: the batch is poisoned
  CHECK(batch.Count() == 1);
  CHECK(store->Commit(batch).code() == absl::StatusCode::kInvalidArgument);
  CHECK(ValueOrFail(store->LoadAll()).centers.empty());
}

TEST_CASE("ReadLog returns exactly the requested steps of one slot in (step, micro-batch) order") {
  const std::string dir = TempDir("readlog");
  constexpr int32_t kMicroBatches = 4;
  // Steps chosen so that byte order differs from little-endian or text order.
  const std::vector<int64_t> steps = {1, 2, 3, 9, 10, 255, 256, 257, 65536, 65537};
  {
    std::unique_ptr<DurableStore> store = OpenOrFail(dir);
    std::vector<LogRecord> records;
    for (auto [r, s] : std::vector<std::pair<int32_t, int32_t>>{{0, 1}, {0, 0}, {0, 2}, {1, 1}}) {
      for (int64_t step : steps) {
        for (int32_t mb = -1; mb < kMicroBatches; ++mb) records.push_back(Log(r, s, step, mb));
      }
    }
    std::shuffle(records.begin(), records.end(), std::mt19937(7));
    // Several batches, in random order.
    WriteBatch batch;
    for (size_t i = 0; i < records.size(); ++i) {
      batch.PutLogRecord(records[i]);
      if (i % 37 == 36) {
        REQUIRE_OK(store->Commit(batch));
        batch.Clear();
      }
    }
    REQUIRE_OK(store->Commit(batch));
  }
  std::unique_ptr<DurableStore> store = OpenOrFail(dir);
  auto expected = [&](int32_t r, int32_t s, int64_t from, int64_t to) {
    std::vector<LogId> ids;
    for (int64_t step : steps) {
      if (step <= from || step > to) continue;
      for (int32_t mb = -1; mb < kMicroBatches; ++mb) ids.emplace_back(r, s, step, mb);
    }
    return ids;
  };
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  // (from_step_exclusive, to_step_inclusive)
  const std::vector<std::pair<int64_t, int64_t>> ranges = {
      {3, 10}, {0, 1},         {2, 2},    {9, 257},    {256, 65536}, {10, 9},
      {-5, 3}, {65537, 70000}, {0, kMax}, {kMin, 256}, {kMax, kMax},
  };
  for (auto [r, s] : std::vector<std::pair<int32_t, int32_t>>{{0, 1}, {0, 0}, {1, 1}, {0, 2}}) {
    for (auto [from, to] : ranges) {
      INFO("slot (" << r << ", " << s << ") steps (" << from << ", " << to << "]");
      const std::vector<LogRecord> log = ValueOrFail(store->ReadLog(Slot(r, s), from, to));
      CHECK(Ids(log) == expected(r, s, from, to));
    }
  }
  CHECK(ValueOrFail(store->ReadLog(Slot(2, 1), 0, 1000)).empty());
  CHECK(ValueOrFail(store->ReadLog(Slot(0, 3), 0, 1000)).empty());
  CHECK(store->ReadLog(Slot(-1, 0), 0, 10).status().code() == absl::StatusCode::kInvalidArgument);
  SlotId stage_only;  // replica unset: reads as 0
  stage_only.set_stage(1);
  CHECK(Ids(ValueOrFail(store->ReadLog(stage_only, 0, 3))) == expected(0, 1, 0, 3));
}

TEST_CASE("DeleteLogRange removes exactly the slot's records of the older steps") {
  const std::string dir = TempDir("gc");
  std::unique_ptr<DurableStore> store = OpenOrFail(dir);
  WriteBatch batch;
  for (auto [r, s] : std::vector<std::pair<int32_t, int32_t>>{{0, 1}, {0, 0}, {0, 2}, {1, 1}}) {
    for (int64_t step = 1; step <= 20; ++step) {
      for (int32_t mb = -1; mb < 3; ++mb) batch.PutLogRecord(Log(r, s, step, mb));
    }
  }
  REQUIRE_OK(store->Commit(batch));
  REQUIRE_OK(store->Flush());  // half of the records in SST files, half in the memtable

  // The GC of docs/design.md §5.2: a new snapshot at step 16 and the older records, in one batch.
  batch.Clear();
  batch.PutSnapshot(MakeSnapshot(0, 1, 16));
  batch.DeleteLogRange(Slot(0, 1), 0, 17);
  batch.DeleteLogRange(Slot(1, 1), 5, 5);  // empty range: nothing
  CHECK(batch.Count() == 2);
  REQUIRE_OK(store->Commit(batch));

  CHECK(Ids(ValueOrFail(store->ReadLog(Slot(0, 1), 0, 100))) == ExpectedIds(0, 1, 16, 20, 3));
  CHECK(Ids(ValueOrFail(store->ReadLog(Slot(0, 0), 0, 100))) == ExpectedIds(0, 0, 0, 20, 3));
  CHECK(Ids(ValueOrFail(store->ReadLog(Slot(0, 2), 0, 100))) == ExpectedIds(0, 2, 0, 20, 3));
  CHECK(Ids(ValueOrFail(store->ReadLog(Slot(1, 1), 0, 100))) == ExpectedIds(1, 1, 0, 20, 3));

  // A middle range, then the effect survives a flush and a reopen.
  batch.Clear();
  batch.DeleteLogRange(Slot(0, 2), 5, 8);
  REQUIRE_OK(store->Commit(batch));
  REQUIRE_OK(store->Flush());
  store.reset();
  store = OpenOrFail(dir);
  std::vector<LogId> expected = ExpectedIds(0, 2, 0, 4, 3);
  const std::vector<LogId> tail = ExpectedIds(0, 2, 7, 20, 3);
  expected.insert(expected.end(), tail.begin(), tail.end());
  CHECK(Ids(ValueOrFail(store->ReadLog(Slot(0, 2), 0, 100))) == expected);
  CHECK(Ids(ValueOrFail(store->ReadLog(Slot(0, 1), 0, 100))) == ExpectedIds(0, 1, 16, 20, 3));
}

TEST_CASE("a slot's own records and the pairs its neighbours logged share (step, micro-batch)") {
  const std::string dir = TempDir("parts");
  std::unique_ptr<DurableStore> store = OpenOrFail(dir);
  // Slot (0, 1) of a pipeline: stage 0 logs the FORWARD pair it sent, stage 2 the BACKWARD one,
  // the slot itself its per-step checksum.
  auto pair = [](int64_t step, int32_t mb, BoundaryDirection direction) {
    LogRecord record = Log(0, 1, step, mb);
    record.mutable_boundaries(0)->set_direction(direction);
    return record;
  };
  WriteBatch batch;
  for (int64_t step = 1; step <= 3; ++step) {
    batch.PutLogRecord(Log(0, 1, step, -1));
    for (int32_t mb = 0; mb < 2; ++mb) {
      batch.PutLogRecord(pair(step, mb, BACKWARD));
      batch.PutLogRecord(pair(step, mb, FORWARD));
    }
  }
  REQUIRE_OK(store->Commit(batch));
  const std::vector<LogRecord> records = ValueOrFail(store->ReadLog(Slot(0, 1), 1, 3));
  REQUIRE(records.size() == 10);  // steps 2 and 3: one checksum and 2 x 2 pairs each
  std::vector<std::tuple<int64_t, int32_t, int>> order;
  for (const LogRecord& r : records) {
    order.emplace_back(r.step(), r.micro_batch(),
                       r.boundaries_size() == 0 ? 0 : r.boundaries(0).direction());
  }
  CHECK(order == std::vector<std::tuple<int64_t, int32_t, int>>{
                     {2, -1, 0}, {2, 0, FORWARD}, {2, 0, BACKWARD}, {2, 1, FORWARD},
                     {2, 1, BACKWARD}, {3, -1, 0}, {3, 0, FORWARD}, {3, 0, BACKWARD},
                     {3, 1, FORWARD}, {3, 1, BACKWARD}});
  // The GC of a snapshot at step 2 removes every part of steps 1 and 2.
  batch.Clear();
  batch.DeleteLogRange(Slot(0, 1), 0, 3);
  REQUIRE_OK(store->Commit(batch));
  CHECK(ValueOrFail(store->ReadLog(Slot(0, 1), 0, 100)).size() == 5);
}

TEST_CASE("a corrupt value is DATA_LOSS naming its key, and reading does not crash") {
  const std::string dir = TempDir("corrupt");
  {
    std::unique_ptr<DurableStore> store = OpenOrFail(dir);
    WriteBatch batch;
    batch.PutCenter(Center(0, 1));
    batch.PutCenter(Center(1, 1));
    batch.PutCenterOpt(CenterOpt(1));
    batch.PutSnapshot(MakeSnapshot(0, 1, 16));
    batch.PutWeight(Weight(0, 1, 1.0));
    batch.PutSlot(SlotState(0, 1, 20));
    batch.PutServer(Server());
    for (int64_t step = 16; step <= 18; ++step) {
      for (int32_t mb = -1; mb < 4; ++mb) batch.PutLogRecord(Log(0, 1, step, mb));
    }
    REQUIRE_OK(store->Commit(batch));
  }
  // Log() records carry a FORWARD pair: their keys have part 1 (storage/keys.h).
  const std::string log_key = EncodeLogKey(0, 1, 17, 3, /*part=*/1);

  SECTION("one flipped byte in a step-log record") {
    {
      RawDb raw(dir);
      std::string value = raw.Get("steplog", log_key);
      value[kEnvelopeHeaderSize + 5] ^= 0x04;
      raw.Put("steplog", log_key, value);
    }
    std::unique_ptr<DurableStore> store = OpenOrFail(dir);
    const absl::Status status = store->ReadLog(Slot(0, 1), 16, 18).status();
    CHECK(status.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(Message(status),
               Contains("steplog key (r=0, s=1, step=17, mb=3, forward): checksum mismatch"));
    // Ranges that avoid the bad record still read, and LoadAll does not read the log.
    CHECK(Ids(ValueOrFail(store->ReadLog(Slot(0, 1), 17, 18))) == ExpectedIds(0, 1, 17, 18, 4));
    CHECK(ValueOrFail(store->LoadAll()).centers.size() == 2);
  }
  SECTION("a truncated step-log record") {
    {
      RawDb raw(dir);
      const std::string value = raw.Get("steplog", log_key);
      raw.Put("steplog", log_key, value.substr(0, value.size() / 2));
    }
    const absl::Status status = OpenOrFail(dir)->ReadLog(Slot(0, 1), 0, 100).status();
    CHECK(status.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(Message(status), Contains("steplog key (r=0, s=1, step=17, mb=3, forward): truncated"));
  }
  SECTION("a truncated center") {
    {
      RawDb raw(dir);
      const std::string value = raw.Get("center", EncodeStageKey(1));
      raw.Put("center", EncodeStageKey(1), value.substr(0, 10));
    }
    const absl::Status status = OpenOrFail(dir)->LoadAll().status();
    CHECK(status.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(Message(status), Contains("center key (s=1): truncated: 10 bytes"));
  }
  SECTION("one flipped byte in a snapshot") {
    {
      RawDb raw(dir);
      std::string value = raw.Get("snapshot", EncodeSlotKey(0, 1));
      value[value.size() - 1] ^= 0x01;
      raw.Put("snapshot", EncodeSlotKey(0, 1), value);
    }
    std::unique_ptr<DurableStore> store = OpenOrFail(dir);
    absl::Status status = store->LoadAll().status();
    CHECK(status.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(Message(status), Contains("snapshot key (r=0, s=1): checksum mismatch"));
    status = store->ReadSnapshot(Slot(0, 1)).status();
    CHECK(status.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(Message(status), Contains("snapshot key (r=0, s=1): checksum mismatch"));
  }
  SECTION("garbage bytes as the server record") {
    {
      RawDb raw(dir);
      raw.Put("meta", kServerMetaKey, "definitely not an envelope, but long enough");
    }
    const absl::Status status = OpenOrFail(dir)->LoadAll().status();
    CHECK(status.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(Message(status), Contains("meta key \"server\": unsupported envelope version"));
  }
  SECTION("a valid envelope around bytes that are not a slot record") {
    {
      RawDb raw(dir);
      raw.Put("meta", EncodeSlotMetaKey(0, 1), WrapInEnvelope(std::string("\x0a\x64\x08\x01", 4)));
    }
    const absl::Status status = OpenOrFail(dir)->LoadAll().status();
    CHECK(status.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(Message(status),
               Contains("meta key slot/(r=0, s=1): payload (4 bytes) does not parse as "
                        "rebound.SlotRecord"));
  }
  SECTION("a weight record stored under another slot's key") {
    {
      RawDb raw(dir);
      raw.Put("weights", EncodeSlotKey(3, 0), raw.Get("weights", EncodeSlotKey(0, 1)));
    }
    const absl::Status status = OpenOrFail(dir)->LoadAll().status();
    CHECK(status.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(Message(status), Contains("weights key (r=3, s=0): the record does not belong to "
                                         "its key (record says (r=0, s=1))"));
  }
  SECTION("a step-log record stored under another step's key") {
    {
      RawDb raw(dir);
      raw.Put("steplog", EncodeLogKey(0, 1, 18, 1, 1), raw.Get("steplog", log_key));
    }
    const absl::Status status = OpenOrFail(dir)->ReadLog(Slot(0, 1), 0, 100).status();
    CHECK(status.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(Message(status), Contains("steplog key (r=0, s=1, step=18, mb=1, forward): the record "
                                         "does not belong to its key"));
  }
  SECTION("a malformed key") {
    {
      RawDb raw(dir);
      raw.Put("center_opt", std::string("\x00\x01", 2), raw.Get("center_opt", EncodeStageKey(1)));
    }
    const absl::Status status = OpenOrFail(dir)->LoadAll().status();
    CHECK(status.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(Message(status), Contains("center_opt key \"\\x00\\x01\" (malformed, 2 bytes)"));
  }
  SECTION("an empty value") {
    {
      RawDb raw(dir);
      raw.Put("center_opt", EncodeStageKey(1), "");
    }
    const absl::Status status = OpenOrFail(dir)->LoadAll().status();
    CHECK(status.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(Message(status), Contains("center_opt key (s=1): truncated: 0 bytes"));
  }
}

TEST_CASE("unknown meta keys and unknown column families are tolerated") {
  const std::string dir = TempDir("forward");
  {
    std::unique_ptr<DurableStore> store = OpenOrFail(dir);
    WriteBatch batch;
    batch.PutServer(Server());
    REQUIRE_OK(store->Commit(batch));
  }
  {
    RawDb raw(dir);
    raw.Put("meta", "future/thing", "whatever");
    rocksdb::ColumnFamilyHandle* extra = nullptr;
    REQUIRE(raw.db()->CreateColumnFamily(rocksdb::ColumnFamilyOptions(), "future", &extra).ok());
    REQUIRE(raw.db()->DestroyColumnFamilyHandle(extra).ok());
  }
  std::unique_ptr<DurableStore> store = OpenOrFail(dir);
  const LoadedState state = ValueOrFail(store->LoadAll());
  REQUIRE(state.server.has_value());
  CHECK(state.server->job_id() == "job-42");
}

TEST_CASE("the in-memory store works, is private, and leaves no files") {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string watched = TempDir("in-memory-watch");
  const std::string cwd = fs::current_path();
  const std::set<std::string> tmp_before = ListTree(tmp != nullptr ? tmp : watched);
  {
    std::unique_ptr<DurableStore> store = OpenOrFail("");
    CHECK(store->in_memory());
    CHECK(store->data_dir().empty());
    WriteBatch batch;
    batch.PutCenter(Center(0, 4));
    batch.PutServer(Server());
    for (int32_t mb = -1; mb < 2; ++mb) batch.PutLogRecord(Log(0, 0, 1, mb));
    REQUIRE_OK(store->Commit(batch));
    REQUIRE_OK(store->Flush());
    CHECK(ValueOrFail(store->LoadAll()).centers.at(0).version() == 4);
    CHECK(Ids(ValueOrFail(store->ReadLog(Slot(0, 0), 0, 1))) == ExpectedIds(0, 0, 0, 1, 2));
    CHECK(ValueOrFail(store->Stats()).column_families.at("steplog").sst_bytes > 0);

    // A second in-memory store is independent (its own Env), not locked out.
    std::unique_ptr<DurableStore> other = OpenOrFail("");
    CHECK(ValueOrFail(other->LoadAll()).centers.empty());
  }
  // Nothing appeared on disk, and a new in-memory store starts empty.
  CHECK(ListTree(tmp != nullptr ? tmp : watched) == tmp_before);
  CHECK_FALSE(fs::exists("/rebound-in-memory"));
  CHECK_FALSE(fs::exists(cwd + "/rebound-in-memory"));
  CHECK_FALSE(fs::exists(cwd + "/LOCK"));
  CHECK(ValueOrFail(OpenOrFail("")->LoadAll()).centers.empty());
}

TEST_CASE("a directory that is open cannot be opened again, in this process or another") {
  const std::string dir = TempDir("locked");
  std::unique_ptr<DurableStore> store = OpenOrFail(dir);

  DurableStoreOptions options;
  options.data_dir = dir;
  const absl::Status again = DurableStore::Open(options).status();
  CHECK(again.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(Message(again), Contains("data_dir " + dir + " is in use"));

  std::string output;
  const int exit_code = testing::RunCommand(
      {testing::Runfile("tests/storage/store_process"), "open", dir}, &output, absl::Seconds(30));
  INFO(output);
  CHECK(exit_code == 1);
  CHECK_THAT(output, Contains("FAILED_PRECONDITION"));
  CHECK_THAT(output, Contains("data_dir " + dir + " is in use"));
  CHECK_THAT(output, Contains("Resource temporarily unavailable"));

  // The first store is unharmed; once it is closed the directory opens again, here and there.
  WriteBatch batch;
  batch.PutCenter(Center(0, 1));
  REQUIRE_OK(store->Commit(batch));
  store.reset();
  CHECK(testing::RunCommand({testing::Runfile("tests/storage/store_process"), "open", dir}, &output,
                            absl::Seconds(30)) == 0);
  CHECK(ValueOrFail(OpenOrFail(dir)->LoadAll()).centers.at(0).version() == 1);
}

// The highest i of the "committed i" lines in `log`, or 0.
int64_t LastCommitted(const std::string& log) {
  int64_t last = 0;
  size_t pos = 0;
  while ((pos = log.find("committed ", pos)) != std::string::npos) {
    pos += std::strlen("committed ");
    const size_t end = log.find('\n', pos);
    if (end == std::string::npos) break;  // a line cut short by the kill
    last = std::max<int64_t>(last, std::stoll(log.substr(pos, end - pos)));
  }
  return last;
}

TEST_CASE("after a process crash every batch is whole and no acknowledged batch is lost") {
  const std::string dir = TempDir("crash");
  const std::string log_path = TempDir("crash-log") + "/store_process.log";
  auto process = testing::Subprocess::Start(
      {testing::Runfile("tests/storage/store_process"), "commit_forever", dir}, log_path);
  REQUIRE(process.ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (LastCommitted(testing::ReadFileOrEmpty(log_path)) < 200 && absl::Now() < deadline) {
    REQUIRE_FALSE((*process)->WaitFor(absl::Milliseconds(5)).has_value());
  }
  (*process)->Signal(SIGKILL);
  REQUIRE((*process)->WaitFor(absl::Seconds(10)).has_value());
  const int64_t acknowledged = LastCommitted(testing::ReadFileOrEmpty(log_path));
  INFO("last acknowledged batch: " << acknowledged);
  REQUIRE(acknowledged >= 200);

  std::unique_ptr<DurableStore> store = OpenOrFail(dir);
  const LoadedState state = ValueOrFail(store->LoadAll());
  REQUIRE(state.centers.size() == 2);
  const int64_t version = state.centers.at(0).version();
  CHECK(version >= acknowledged);
  CHECK(state.centers.at(1).version() == version);
  CHECK(state.weights.at({0, 0}).center_version_at_last_sync() == version);
}

// Runs store_process commit_forever in `dir` until it has acknowledged at least `at_least`
// batches, kills it with SIGKILL and returns the last acknowledged batch.
// Batches of weight records only: a batch dropped from the WAL leaves no tensor file behind
// (docs/storage.md: what --accept_wal_loss cannot bring back).
int64_t CommitThenKill(const std::string& dir, const std::string& log_path, int64_t at_least,
                       const std::string& mode = "commit_weights_forever") {
  auto process =
      testing::Subprocess::Start({testing::Runfile("tests/storage/store_process"), mode, dir},
                                 log_path);
  REQUIRE(process.ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (LastCommitted(testing::ReadFileOrEmpty(log_path)) < at_least && absl::Now() < deadline) {
    REQUIRE_FALSE((*process)->WaitFor(absl::Milliseconds(5)).has_value());
  }
  (*process)->Signal(SIGKILL);
  REQUIRE((*process)->WaitFor(absl::Seconds(10)).has_value());
  const int64_t acknowledged = LastCommitted(testing::ReadFileOrEmpty(log_path));
  REQUIRE(acknowledged >= at_least);
  return acknowledged;
}

// The newest write-ahead log file of a RocksDB directory.
std::string NewestWal(const std::string& dir) {
  std::string newest;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() == ".log" && entry.path().string() > newest) {
      newest = entry.path().string();
    }
  }
  REQUIRE_FALSE(newest.empty());
  return newest;
}

void FlipByte(const std::string& path, uint64_t offset) {
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(file.good());
  file.seekg(static_cast<std::streamoff>(offset));
  char byte = 0;
  file.read(&byte, 1);
  byte = static_cast<char>(byte ^ 0x5a);
  file.seekp(static_cast<std::streamoff>(offset));
  file.write(&byte, 1);
  REQUIRE(file.good());
}

TEST_CASE("a byte flipped in the WAL tail after kill -9 fails Open with DATA_LOSS naming the WAL") {
  const std::string dir = TempDir("wal-flip");
  const int64_t acknowledged =
      CommitThenKill(dir, TempDir("wal-flip-log") + "/store_process.log", 100);
  // Undamaged, the killed store opens with every acknowledged batch (absolute consistency
  // does not refuse a clean kill -9).
  {
    std::string output;
    REQUIRE(testing::RunCommand({testing::Runfile("tests/storage/store_process"), "open", dir},
                                &output, absl::Seconds(30)) == 0);
  }
  // That open replayed the WAL into a new one: kill again for a WAL that ends mid-stream.
  const int64_t acknowledged_again =
      CommitThenKill(dir, TempDir("wal-flip-log2") + "/store_process.log", acknowledged + 50);
  const std::string wal = NewestWal(dir);
  const uint64_t size = fs::file_size(wal);
  REQUIRE(size > 64);
  FlipByte(wal, size - 16);  // inside the last record: the last acknowledged batch

  DurableStoreOptions options;
  options.data_dir = dir;
  const absl::Status refused = DurableStore::Open(options).status();
  CHECK(refused.code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(Message(refused), Contains(wal));
  CHECK_THAT(Message(refused), Contains("checksum mismatch"));
  CHECK_THAT(Message(refused), Contains("--accept_wal_loss"));
  // Refusing changed nothing: it refuses again, from another process too.
  std::string output;
  CHECK(testing::RunCommand({testing::Runfile("tests/storage/store_process"), "open", dir}, &output,
                            absl::Seconds(30)) == 1);
  CHECK_THAT(output, Contains("DATA_LOSS"));
  CHECK_THAT(output, Contains(wal));

  // The operator accepts the loss: the store opens at the last intact batch, says what it
  // dropped, and keeps a copy of the damaged log.
  const int exit_code = testing::RunCommand(
      {testing::Runfile("tests/storage/store_process"), "open_accepting_wal_loss", dir}, &output,
      absl::Seconds(30));
  INFO(output);
  REQUIRE(exit_code == 0);
  CHECK_THAT(output, Contains("--accept_wal_loss"));
  CHECK_THAT(output, Contains("DROPPING"));
  CHECK_THAT(output, Contains(wal));
  CHECK_THAT(output, Contains("checksum mismatch"));
  const size_t at = output.find("OK version=");
  REQUIRE(at != std::string::npos);
  const int64_t recovered = std::stoll(output.substr(at + std::strlen("OK version=")));
  // The damaged last batch (the last acknowledged one, or one written but not yet reported) is
  // the one lost; everything before it is there.
  CHECK(recovered <= acknowledged_again);
  CHECK(recovered >= acknowledged);
  bool copied = false;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (absl::StartsWith(entry.path().filename().string(), "wal-damaged-")) {
      copied = fs::exists(entry.path() / fs::path(wal).filename());
    }
  }
  CHECK(copied);
  // After the accepted recovery the directory opens normally.
  std::unique_ptr<DurableStore> store = OpenOrFail(dir);
  CHECK(ValueOrFail(store->LoadAll()).weights.at({0, 0}).center_version_at_last_sync() ==
        recovered);
  CHECK_FALSE(store->wal_loss_accepted());
}

// A physical record of a WAL file: its header's offset, its payload's length, its type.
struct WalRecord {
  uint64_t offset = 0;
  uint64_t length = 0;
  int type = 0;
  uint64_t end() const { return offset + 7 + length; }
};

// The logical records (one write batch each) that a WAL file holds whole, each as its physical
// records (FULL, or FIRST, MIDDLE..., LAST), parsed by RocksDB's framing (db/log_format.h):
// crc (4) | length (2, little endian) | type (1) | payload, in 32 KiB blocks whose last < 7
// bytes are padding. A record the kill left unfinished at the end is not among them.
std::vector<std::vector<WalRecord>> WholeWalRecords(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string wal((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  constexpr uint64_t kBlock = 32768;
  std::vector<std::vector<WalRecord>> whole;
  std::vector<WalRecord> open;
  for (uint64_t at = 0; at + 7 <= wal.size();) {
    if (kBlock - at % kBlock < 7) {  // the padding at a block's end
      at += kBlock - at % kBlock;
      continue;
    }
    WalRecord record;
    record.offset = at;
    record.length = static_cast<uint8_t>(wal[at + 4]) | static_cast<uint8_t>(wal[at + 5]) << 8;
    record.type = static_cast<uint8_t>(wal[at + 6]);
    if (record.type < 1 || record.type > 4) FAIL("record type " << record.type << " at " << at);
    if (record.end() > wal.size()) break;  // cut short by the kill
    open.push_back(record);
    if (record.type == 1 || record.type == 4) {  // FULL or LAST
      whole.push_back(std::move(open));
      open.clear();
    }
    at = record.end();
  }
  return whole;
}

// A store_process killed in the middle of committing batches, and what its newest WAL holds.
struct KilledStore {
  std::string dir;
  std::string wal;            // the newest WAL file
  int64_t acknowledged = 0;   // the last batch the process reported committed
  int64_t last_whole = 0;     // the last batch whole in the WAL: what an untouched copy recovers
  std::vector<WalRecord> last_record;  // the physical records of that batch
};

KilledStore KillMidStream(const std::string& name, const std::string& mode, int64_t at_least) {
  KilledStore killed;
  killed.dir = TempDir(name);
  killed.acknowledged =
      CommitThenKill(killed.dir, TempDir(name + "-log") + "/store_process.log", at_least, mode);
  killed.wal = NewestWal(killed.dir);
  const std::vector<std::vector<WalRecord>> records = WholeWalRecords(killed.wal);
  REQUIRE(records.size() >= 2);
  killed.last_record = records.back();
  // What the kill itself left, recovered from a copy of the directory.
  const std::string copy = TempDir(name + "-copy");
  fs::copy(killed.dir, copy, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  std::string output;
  INFO(output);
  REQUIRE(testing::RunCommand({testing::Runfile("tests/storage/store_process"), "open", copy},
                              &output, absl::Seconds(30)) == 0);
  const size_t at = output.find("OK version=");
  REQUIRE(at != std::string::npos);
  killed.last_whole = std::stoll(output.substr(at + std::strlen("OK version=")));
  // A batch is committed only after the one before it was acknowledged: the WAL ends with the
  // last acknowledged batch or with the one after it, written but not yet reported.
  INFO("acknowledged " << killed.acknowledged << ", whole in the WAL " << killed.last_whole);
  REQUIRE(killed.last_whole >= killed.acknowledged);
  REQUIRE(killed.last_whole <= killed.acknowledged + 1);
  return killed;
}

// Opens `dir` in a store_process and returns the version it recovered; `output` gets its
// output, its log included.
int64_t OpenInProcess(const std::string& dir, std::string* output) {
  const int exit_code = testing::RunCommand(
      {testing::Runfile("tests/storage/store_process"), "open", dir}, output, absl::Seconds(30));
  INFO(*output);
  REQUIRE(exit_code == 0);
  const size_t at = output->find("OK version=");
  REQUIRE(at != std::string::npos);
  return std::stoll(output->substr(at + std::strlen("OK version=")));
}

bool HasWalCopy(const std::string& dir) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (absl::StartsWith(entry.path().filename().string(), "wal-damaged-")) return true;
  }
  return false;
}

// The newest WAL cut at `size`, as a write torn by the kill would leave it: the store opens by
// itself with every batch before the torn one, says what it dropped, and opens normally after.
void ExpectTornWriteRecovered(const KilledStore& killed, uint64_t size,
                              const std::string& reported_kind) {
  fs::resize_file(killed.wal, size);
  std::string output;
  const int64_t recovered = OpenInProcess(killed.dir, &output);
  INFO(output);
  CHECK(recovered == killed.last_whole - 1);
  CHECK(recovered >= killed.acknowledged - 1);
  CHECK_THAT(output, Contains("a write torn by a crash, never acknowledged: dropped"));
  CHECK_THAT(output, Contains(killed.wal));
  CHECK_THAT(output, Contains(reported_kind));
  CHECK_FALSE(HasWalCopy(killed.dir));
  // The torn write is gone for good: the next open finds an intact log.
  std::string again;
  CHECK(OpenInProcess(killed.dir, &again) == recovered);
  CHECK_THAT(again, !Contains("torn"));
  CHECK_THAT(again, !Contains("dropping"));
}

TEST_CASE("a WAL cut inside its last record's body after kill -9 opens without that batch") {
  const KilledStore killed = KillMidStream("wal-torn-body", "commit_weights_forever", 100);
  const WalRecord& last = killed.last_record.back();
  REQUIRE(last.length >= 2);
  ExpectTornWriteRecovered(killed, last.offset + 7 + last.length / 2, "truncated record body");
}

TEST_CASE("a WAL cut inside its last record's header after kill -9 opens without that batch", "[.full]") {
  const KilledStore killed = KillMidStream("wal-torn-header", "commit_weights_forever", 100);
  ExpectTornWriteRecovered(killed, killed.last_record.front().offset + 3, "truncated header");
}

TEST_CASE("a WAL cut after the first fragment of its last batch after kill -9 opens without it", "[.full]") {
  const KilledStore killed =
      KillMidStream("wal-torn-fragment", "commit_large_weights_forever", 30);
  REQUIRE(killed.last_record.size() >= 3);  // a batch of about 70 KiB spans three blocks
  const WalRecord& first = killed.last_record.front();
  REQUIRE(first.type == 2);
  REQUIRE(first.end() % 32768 == 0);  // a FIRST fragment fills its block
  ExpectTornWriteRecovered(killed, first.end(), "error reading trailing data");
}

TEST_CASE("a WAL cut inside a middle fragment of its last batch after kill -9 opens without it", "[.full]") {
  const KilledStore killed =
      KillMidStream("wal-torn-middle", "commit_large_weights_forever", 30);
  REQUIRE(killed.last_record.size() >= 3);
  const WalRecord& second = killed.last_record[1];
  ExpectTornWriteRecovered(killed, second.offset + 7 + second.length / 3,
                           "truncated record body");
}

TEST_CASE("a whole last WAL record whose length field grew past the end is refused DATA_LOSS") {
  const KilledStore killed = KillMidStream("wal-long-length", "commit_weights_forever", 100);
  const WalRecord last = killed.last_record.back();
  fs::resize_file(killed.wal, last.end());  // whatever the kill left unfinished after it
  REQUIRE(last.end() % 32768 != 0);  // else RocksDB reports a "bad record length"
  const uint64_t length = last.length + 100;
  REQUIRE(length < 65536);
  {
    std::fstream file(killed.wal, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(static_cast<std::streamoff>(last.offset + 4));
    const char bytes[2] = {static_cast<char>(length & 0xff), static_cast<char>(length >> 8)};
    file.write(bytes, 2);
    REQUIRE(file.good());
  }

  DurableStoreOptions options;
  options.data_dir = killed.dir;
  const absl::Status refused = DurableStore::Open(options).status();
  CHECK(refused.code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(Message(refused), Contains(killed.wal));
  CHECK_THAT(Message(refused), Contains("truncated record body"));
  CHECK_THAT(Message(refused), Contains("length field damaged"));
  CHECK_THAT(Message(refused), Contains("--accept_wal_loss"));
  // Refusing changed nothing: the file is as it was and another process is refused too.
  CHECK(fs::file_size(killed.wal) == last.end());
  std::string output;
  CHECK(testing::RunCommand({testing::Runfile("tests/storage/store_process"), "open", killed.dir},
                            &output, absl::Seconds(30)) == 1);
  CHECK_THAT(output, Contains("DATA_LOSS"));
  // The operator's way past it still works, and loses the batch whose length was damaged.
  const int exit_code = testing::RunCommand(
      {testing::Runfile("tests/storage/store_process"), "open_accepting_wal_loss", killed.dir},
      &output, absl::Seconds(30));
  INFO(output);
  REQUIRE(exit_code == 0);
  CHECK_THAT(output, Contains("DROPPING"));
  CHECK_THAT(output, Contains("OK version=" + std::to_string(killed.last_whole - 1)));
}

TEST_CASE("a corrupt SST found by a compaction turns into a background error and refuses writes") {
  const std::string dir = TempDir("bad-sst");
  {
    std::unique_ptr<DurableStore> store = OpenOrFail(dir);
    for (int round = 0; round < 2; ++round) {
      WriteBatch batch;
      for (int step = 0; step < 200; ++step) {
        LogRecord record;
        *record.mutable_slot() = Slot(0, 0);
        record.set_step(round * 1000 + step);
        record.set_micro_batch(0);
        record.add_sample_ids(step);
        batch.PutLogRecord(record);
      }
      REQUIRE_OK(store->Commit(batch));
      REQUIRE_OK(store->Flush());
    }
    REQUIRE_OK(store->CompactAll());  // undamaged, it compacts cleanly
    REQUIRE_OK(store->BackgroundError());
    CHECK(store->background_errors() == 0);
    // Two level-0 files again, for the compaction to come.
    for (int round = 2; round < 4; ++round) {
      WriteBatch batch;
      for (int step = 0; step < 200; ++step) {
        LogRecord record;
        *record.mutable_slot() = Slot(0, 0);
        record.set_step(round * 1000 + step);
        record.set_micro_batch(0);
        record.add_sample_ids(step);
        batch.PutLogRecord(record);
      }
      REQUIRE_OK(store->Commit(batch));
      REQUIRE_OK(store->Flush());
    }
  }
  // Damage the middle of the steplog family's largest SST (a data block; the footer and index
  // that Open reads stay intact).
  std::string sst;
  uint64_t sst_size = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() == ".sst" && entry.file_size() > sst_size) {
      sst = entry.path().string();
      sst_size = entry.file_size();
    }
  }
  REQUIRE_FALSE(sst.empty());
  FlipByte(sst, sst_size / 4);

  std::unique_ptr<DurableStore> store = OpenOrFail(dir);
  // RocksDB may start the compaction on its own right after Open; else this one meets the SST.
  const absl::Status compacted = store->CompactAll();
  CHECK_FALSE(compacted.ok());
  const absl::Status error = store->BackgroundError();
  INFO(error.ToString());
  CHECK(error.code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(Message(error), Contains("data_dir " + dir));
  CHECK_THAT(Message(error), Contains("compaction"));
  CHECK(store->background_errors() >= 1);
  // RocksDB now refuses writes; the store says why.
  WriteBatch batch;
  batch.PutCenter(Center(0, 5));
  CHECK_FALSE(store->Commit(batch).ok());
}

TEST_CASE("a data_dir that cannot be created is FAILED_PRECONDITION naming it") {
  const std::string base = TempDir("not-a-dir");
  const std::string file = base + "/file";
  std::ofstream(file) << "x";
  DurableStoreOptions options;
  options.data_dir = file + "/db";
  const absl::Status status = DurableStore::Open(options).status();
  CHECK(status.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(Message(status), Contains(options.data_dir));
}

TEST_CASE("missing parent directories are created") {
  const std::string dir = TempDir("parents") + "/a/b/c";
  std::unique_ptr<DurableStore> store = OpenOrFail(dir);
  CHECK(fs::exists(dir + "/CURRENT"));
}

TEST_CASE("steplog uses the configured compression, tensor families none, the others the default") {
  const std::string supported_names = [] {
    std::string names;
    for (rocksdb::CompressionType type : rocksdb::GetSupportedCompressions()) {
      names += std::to_string(static_cast<int>(type)) + " ";
    }
    return names;
  }();
  INFO("supported: " << supported_names);
  auto [configured, expected_type, expected_name] =
      GENERATE(table<Compression, rocksdb::CompressionType, std::string>({
          {ZSTD, rocksdb::kZSTD, "ZSTD"},
          {COMPRESSION_UNSPECIFIED, rocksdb::kZSTD, "ZSTD"},
          {LZ4, rocksdb::kLZ4Compression, "LZ4"},
          {NO_COMPRESSION, rocksdb::kNoCompression, "NoCompression"},
      }));
  INFO("configured " << Compression_Name(configured));
  const std::string dir = TempDir("compression");
  {
    std::unique_ptr<DurableStore> store = OpenOrFail(dir, false, configured);
    CHECK(store->steplog_compression() ==
          (configured == COMPRESSION_UNSPECIFIED ? ZSTD : configured));
    WriteBatch batch;
    for (int64_t step = 1; step <= 8; ++step) {
      for (int32_t mb = -1; mb < 4; ++mb) batch.PutLogRecord(Log(0, 0, step, mb));
    }
    batch.PutCenter(Center(0, 1));
    REQUIRE_OK(store->Commit(batch));
    REQUIRE_OK(store->Flush());
  }
  // The options RocksDB persisted in the directory.
  rocksdb::DBOptions db_options;
  std::vector<rocksdb::ColumnFamilyDescriptor> descriptors;
  REQUIRE(
      rocksdb::LoadLatestOptions(rocksdb::ConfigOptions(), dir, &db_options, &descriptors).ok());
  std::map<std::string, rocksdb::CompressionType> by_family;
  for (const auto& descriptor : descriptors) {
    by_family[descriptor.name] = descriptor.options.compression;
  }
  CHECK(by_family.at("steplog") == expected_type);
  const rocksdb::CompressionType default_type = rocksdb::ColumnFamilyOptions().compression;
  for (const char* name : {"weights", "meta"}) {
    INFO(name);
    CHECK(by_family.at(name) == default_type);
  }
  // Whole float tensors are stored uncompressed: they barely compress.
  for (const char* name : {"center", "center_opt", "snapshot"}) {
    INFO(name);
    CHECK(by_family.at(name) == rocksdb::kNoCompression);
  }
  // And the SST files written for steplog.
  RawDb raw(dir);
  rocksdb::TablePropertiesCollection tables;
  REQUIRE(raw.db()->GetPropertiesOfAllTables(raw.Family("steplog"), &tables).ok());
  REQUIRE_FALSE(tables.empty());
  for (const auto& [file, properties] : tables) {
    INFO(file);
    CHECK(properties->compression_name == expected_name);
  }
}

TEST_CASE("Stats reports every family and the step-log key estimate") {
  std::unique_ptr<DurableStore> store = OpenOrFail(TempDir("stats"));
  WriteBatch batch;
  for (int64_t step = 1; step <= 25; ++step) {
    for (int32_t mb = -1; mb < 3; ++mb) batch.PutLogRecord(Log(0, 0, step, mb));
  }
  batch.PutSnapshot(MakeSnapshot(0, 0, 0));
  REQUIRE_OK(store->Commit(batch));

  StoreStats stats = ValueOrFail(store->Stats());
  std::set<std::string> names;
  for (const auto& [name, family] : stats.column_families) names.insert(name);
  CHECK(names ==
        std::set<std::string>{"center", "center_opt", "snapshot", "steplog", "weights", "meta"});
  CHECK(stats.steplog_keys_estimate == 100);
  CHECK(stats.column_families.at("steplog").memtable_bytes > 0);
  CHECK(stats.total_bytes > 0);

  REQUIRE_OK(store->Flush());
  stats = ValueOrFail(store->Stats());
  const ColumnFamilyStats& steplog = stats.column_families.at("steplog");
  CHECK(steplog.sst_bytes > 0);
  CHECK(steplog.live_data_bytes > 0);
  CHECK(steplog.keys_estimate == 100);
  CHECK(stats.column_families.at("snapshot").sst_bytes > 0);
  CHECK(stats.column_families.at("center").approximate_bytes() < steplog.approximate_bytes());
  uint64_t sum = 0;
  for (const auto& [name, family] : stats.column_families) sum += family.approximate_bytes();
  // The snapshot's tensors: params and m, 128 floats each, in a tensor file.
  CHECK(stats.tensor_file_bytes == 2 * 128 * sizeof(float));
  CHECK(stats.total_bytes == sum + stats.tensor_file_bytes);
}

// The files in a store's tensors/ directory.
std::set<std::string> TensorFileNames(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir + "/tensors")) {
    names.insert(entry.path().filename().string());
  }
  return names;
}

TEST_CASE("tensors live in one file per record, replaced at each commit, outside RocksDB") {
  const std::string dir = TempDir("tensor-files");
  const Snapshot first = MakeSnapshot(0, 1, 8);
  {
    std::unique_ptr<DurableStore> store = OpenOrFail(dir);
    WriteBatch batch;
    batch.PutSnapshot(first);
    batch.PutCenter(Center(0, 1));
    REQUIRE_OK(store->Commit(batch));
    CHECK(TensorFileNames(dir).size() == 2);
  }
  {
    // The RocksDB value holds the metadata and the file's name, not the data.
    RawDb raw(dir);
    const std::string value = raw.Get("snapshot", EncodeSlotKey(0, 1));
    CHECK(value.size() < 128 * sizeof(float));
  }
  std::unique_ptr<DurableStore> store = OpenOrFail(dir);
  CHECK(SameProto(ValueOrFail(store->ReadSnapshot(Slot(0, 1))), first));
  const std::set<std::string> before = TensorFileNames(dir);

  // A new snapshot of the slot: a new file; the previous one stays as the key's spare.
  Snapshot second = MakeSnapshot(0, 1, 16);
  WriteBatch batch;
  batch.PutSnapshot(second);
  REQUIRE_OK(store->Commit(batch));
  const std::set<std::string> after = TensorFileNames(dir);
  CHECK(after.size() == 3);
  CHECK(std::includes(after.begin(), after.end(), before.begin(), before.end()));
  CHECK(SameProto(ValueOrFail(store->ReadSnapshot(Slot(0, 1))), second));

  // The next one overwrites the spare in place (renamed, and cut to its shorter length): still
  // three files, and reads see the newest record.
  Snapshot third = MakeSnapshot(0, 1, 24);
  third.mutable_params()->mutable_tensors(0)->mutable_data()->resize(64);  // shorter than before
  batch.Clear();
  batch.PutSnapshot(third);
  REQUIRE_OK(store->Commit(batch));
  CHECK(TensorFileNames(dir).size() == 3);
  CHECK(SameProto(ValueOrFail(store->ReadSnapshot(Slot(0, 1))), third));
  const LoadedState state = ValueOrFail(store->LoadAll());
  CHECK(SameProto(state.snapshots.at({0, 1}), third));
  CHECK(SameProto(state.centers.at(0), Center(0, 1)));

  // Reopening drops the spares.
  store.reset();
  store = OpenOrFail(dir);
  CHECK(TensorFileNames(dir).size() == 2);
  CHECK(SameProto(ValueOrFail(store->ReadSnapshot(Slot(0, 1))), third));
}

TEST_CASE("the zero-copy puts store what the copying puts store") {
  std::unique_ptr<DurableStore> store = OpenOrFail("");
  const Snapshot full = MakeSnapshot(1, 0, 24);
  Snapshot header = full;
  std::vector<std::string> data;
  for (Tensor& tensor : *header.mutable_params()->mutable_tensors()) {
    data.push_back(tensor.data());
    tensor.clear_data();
  }
  for (Tensor& tensor : *header.mutable_optimizer()->mutable_m()->mutable_tensors()) {
    data.push_back(tensor.data());
    tensor.clear_data();
  }
  std::vector<absl::string_view> views(data.begin(), data.end());
  WriteBatch batch;
  batch.PutSnapshot(header, views);
  REQUIRE_OK(store->Commit(batch));
  CHECK(SameProto(ValueOrFail(store->ReadSnapshot(Slot(1, 0))), full));

  SECTION("a wrong number of parts poisons the batch") {
    WriteBatch bad;
    views.pop_back();
    bad.PutSnapshot(header, views);
    CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(Message(bad.status()), Contains("data parts"));
  }
  SECTION("a header tensor with data poisons the batch") {
    WriteBatch bad;
    bad.PutSnapshot(full, views);
    CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(Message(bad.status()), Contains("carries data"));
  }
}

TEST_CASE("a damaged tensor file is DATA_LOSS naming the key and the file") {
  const std::string dir = TempDir("tensor-damage");
  {
    std::unique_ptr<DurableStore> store = OpenOrFail(dir);
    WriteBatch batch;
    batch.PutSnapshot(MakeSnapshot(0, 0, 8));
    REQUIRE_OK(store->Commit(batch));
  }
  REQUIRE(TensorFileNames(dir).size() == 1);
  const std::string file = dir + "/tensors/" + *TensorFileNames(dir).begin();
  std::string bytes = testing::ReadFileOrEmpty(file);
  REQUIRE(bytes.size() == 2 * 128 * sizeof(float));
  std::string expected;
  SECTION("one flipped byte") {
    bytes[300] ^= 0x10;
    expected = "checksum mismatch";
  }
  SECTION("truncated") {
    bytes.resize(100);
    expected = "holds 100 bytes, the record says 1024";
  }
  SECTION("missing") {
    bytes.clear();
    expected = "cannot be read";
  }
  if (bytes.empty()) {
    fs::remove(file);
  } else {
    testing::WriteFileOrDie(file, bytes);
  }
  std::unique_ptr<DurableStore> store = OpenOrFail(dir);
  for (const absl::Status& status :
       {store->ReadSnapshot(Slot(0, 0)).status(), store->LoadAll().status()}) {
    CHECK(status.code() == absl::StatusCode::kDataLoss);
    CHECK_THAT(Message(status), Contains("snapshot key (r=0, s=0): tensor file " + file));
    CHECK_THAT(Message(status), Contains(expected));
  }
}

TEST_CASE("a tensor file whose commit never happened is removed at open") {
  const std::string dir = TempDir("tensor-stray");
  {
    std::unique_ptr<DurableStore> store = OpenOrFail(dir);
    WriteBatch batch;
    batch.PutCenter(Center(0, 3));
    REQUIRE_OK(store->Commit(batch));
  }
  const std::set<std::string> committed = TensorFileNames(dir);
  REQUIRE(committed.size() == 1);
  // What a crash between a file's write and its commit leaves behind.
  testing::WriteFileOrDie(dir + "/tensors/center-s0-999", "partial");
  std::unique_ptr<DurableStore> store = OpenOrFail(dir);
  CHECK(TensorFileNames(dir) == committed);
  CHECK(ValueOrFail(store->LoadAll()).centers.at(0).version() == 3);
  // New files are numbered after the stray one, so no name is ever reused.
  WriteBatch batch;
  batch.PutCenter(Center(0, 4));
  REQUIRE_OK(store->Commit(batch));
  CHECK(TensorFileNames(dir) == std::set<std::string>{"center-s0-1000", *committed.begin()});
}

TEST_CASE("options come from the durability and step-log configuration") {
  DurabilityConfig durability;
  durability.set_data_dir("/var/lib/rebound");
  durability.set_fsync(true);
  StepLogConfig step_log;
  DurableStoreOptions options = DurableStoreOptions::FromConfig(durability, step_log);
  CHECK(options.data_dir == "/var/lib/rebound");
  CHECK(options.fsync);
  CHECK(options.steplog_compression == ZSTD);  // the config default
  step_log.set_compression(LZ4);
  CHECK(DurableStoreOptions::FromConfig(DurabilityConfig(), step_log).steplog_compression == LZ4);
  CHECK(DurableStoreOptions::FromConfig(DurabilityConfig(), step_log).data_dir.empty());
}


// ---------------------------------------------------------------------------------------------
// Replicated commits

// A replication sink that keeps every commit it is handed, in the order handed.
struct CommitLog {
  absl::Mutex mu;
  std::vector<ReplicatedCommit> commits ABSL_GUARDED_BY(mu);

  std::function<void(ReplicatedCommit)> Sink() {
    return [this](ReplicatedCommit commit) {
      absl::MutexLock lock(&mu);
      commits.push_back(std::move(commit));
    };
  }
  std::vector<ReplicatedCommit> Take() {
    absl::MutexLock lock(&mu);
    return std::exchange(commits, {});
  }
};

std::unique_ptr<DurableStore> OpenCapturing(const std::string& dir, CommitLog* log) {
  DurableStoreOptions options;
  options.data_dir = dir;
  options.replication_sink = log->Sink();
  return ValueOrFail(DurableStore::Open(options));
}

// Every loaded record of `a` equals `b`'s, and so do the step logs of the given slots.
void CheckSameState(const DurableStore& a, const DurableStore& b,
                    const std::vector<ReplicaStage>& log_slots) {
  const LoadedState x = ValueOrFail(a.LoadAll());
  const LoadedState y = ValueOrFail(b.LoadAll());
  auto same_maps = [](const auto& left, const auto& right) {
    REQUIRE(left.size() == right.size());
    for (const auto& [key, record] : left) {
      REQUIRE(right.count(key) == 1);
      CHECK(SameProto(record, right.at(key)));
    }
  };
  same_maps(x.centers, y.centers);
  same_maps(x.center_opts, y.center_opts);
  same_maps(x.snapshots, y.snapshots);
  same_maps(x.weights, y.weights);
  same_maps(x.slots, y.slots);
  REQUIRE(x.server.has_value() == y.server.has_value());
  if (x.server.has_value()) CHECK(SameProto(*x.server, *y.server));
  for (const auto& [replica, stage] : log_slots) {
    const std::vector<LogRecord> left =
        ValueOrFail(a.ReadLog(Slot(replica, stage), -1, std::numeric_limits<int64_t>::max()));
    const std::vector<LogRecord> right =
        ValueOrFail(b.ReadLog(Slot(replica, stage), -1, std::numeric_limits<int64_t>::max()));
    REQUIRE(left.size() == right.size());
    for (size_t i = 0; i < left.size(); ++i) CHECK(SameProto(left[i], right[i]));
  }
}

bool HasReplicationRecord(const std::string& dir) {
  RawDb raw(dir);
  std::string value;
  const rocksdb::Status status =
      raw.db()->Get(rocksdb::ReadOptions(), raw.Family("meta"), kReplicationMetaKey, &value);
  INFO(status.ToString());
  REQUIRE((status.ok() || status.IsNotFound()));
  return status.ok();
}

TEST_CASE("a capturing store ships every commit, in order, and a standby redoes them exactly") {
  const std::string leader_dir = TempDir("repl-leader");
  const std::string standby_dir = TempDir("repl-standby");
  CommitLog log;
  std::unique_ptr<DurableStore> leader = OpenCapturing(leader_dir, &log);
  REQUIRE_OK(leader->SetEpoch(7));

  // Four threads, each owning replica t: log records, snapshots, weights, slot records, log GC;
  // thread 0 also writes centers (with tensors) and the server record.
  constexpr int kThreads = 4;
  constexpr int kSteps = 12;
  std::atomic<int> failures{0};
  std::atomic<int> batches{0};
  absl::Mutex numbered_mu;
  std::set<uint64_t> numbered_sequences;  // what each Commit said it got: all distinct
  std::vector<std::thread> writers;
  for (int t = 0; t < kThreads; ++t) {
    writers.emplace_back([&, t] {
      for (int64_t step = 1; step <= kSteps; ++step) {
        WriteBatch batch;
        for (int32_t mb = -1; mb < 2; ++mb) batch.PutLogRecord(Log(t, 0, step, mb));
        if (step % 3 == 0) {
          batch.PutSnapshot(MakeSnapshot(t, 0, step));
          batch.PutWeight(Weight(t, 0, 0.1 * static_cast<double>(step)));
          batch.DeleteLogRange(Slot(t, 0), 0, step - 2);
        }
        if (step % 4 == 0) batch.PutSlot(SlotState(t, 0, step));
        if (t == 0) {
          batch.PutCenter(Center(static_cast<int32_t>(step % 2), step));
          if (step == 5) {
            batch.PutCenterOpt(CenterOpt(1));
            batch.PutServer(Server());
          }
        }
        DurableStore::Position numbered;
        if (!leader->Commit(batch, &numbered).ok()) ++failures;
        if (numbered.epoch != 7 || numbered.sequence == 0) ++failures;
        {
          absl::MutexLock lock(&numbered_mu);
          if (!numbered_sequences.insert(numbered.sequence).second) ++failures;
        }
        ++batches;
      }
    });
  }
  for (std::thread& writer : writers) writer.join();
  REQUIRE(failures.load() == 0);
  WriteBatch empty;
  REQUIRE_OK(leader->Commit(empty));  // an empty batch is not a commit

  const std::vector<ReplicatedCommit> commits = log.Take();
  REQUIRE(static_cast<int>(commits.size()) == batches.load());
  for (size_t i = 0; i < commits.size(); ++i) {
    CHECK(commits[i].sequence() == i + 1);
    CHECK(commits[i].epoch() == 7);
    CHECK(commits[i].previous_epoch() == (i == 0 ? 0u : 7u));
  }
  CHECK(leader->LastApplied() == DurableStore::Position{7, commits.size()});
  CHECK(numbered_sequences.size() == commits.size());
  CHECK(*numbered_sequences.rbegin() == commits.size());

  std::unique_ptr<DurableStore> standby = OpenOrFail(standby_dir);
  for (const ReplicatedCommit& commit : commits) REQUIRE_OK(standby->ApplyReplicated(commit));
  CHECK(standby->LastApplied() == DurableStore::Position{7, commits.size()});
  std::vector<ReplicaStage> slots;
  for (int t = 0; t < kThreads; ++t) slots.emplace_back(t, 0);
  CheckSameState(*leader, *standby, slots);
  const LoadedState loaded = ValueOrFail(standby->LoadAll());
  CHECK(loaded.centers.size() == 2);
  CHECK(loaded.snapshots.size() == kThreads);
  CHECK(loaded.server.has_value());
  // The standby wrote tensor files of its own (in its directory), read back with checksums by
  // LoadAll above; they still verify after a reopen, which also drops unreferenced ones.
  CHECK(!TensorFileNames(standby_dir).empty());
  standby.reset();
  standby = OpenOrFail(standby_dir);
  CHECK(TensorFileNames(standby_dir).size() == 2 + kThreads + 1);  // centers, snapshots, center_opt
  CHECK(standby->LastApplied() == DurableStore::Position{7, commits.size()});
  CheckSameState(*leader, *standby, slots);
}

TEST_CASE("a duplicate is a no-op; a gap, an older epoch and a diverged history change nothing") {
  CommitLog log;
  std::unique_ptr<DurableStore> leader = OpenCapturing("", &log);
  REQUIRE_OK(leader->SetEpoch(3));
  for (int64_t step = 1; step <= 3; ++step) {
    WriteBatch batch;
    batch.PutLogRecord(Log(0, 0, step, -1));
    batch.PutWeight(Weight(0, 0, static_cast<double>(step)));
    REQUIRE_OK(leader->Commit(batch));
  }
  std::vector<ReplicatedCommit> commits = log.Take();
  REQUIRE(commits.size() == 3);

  std::unique_ptr<DurableStore> standby = OpenOrFail("");
  // A gap: commit 2 before commit 1.
  absl::Status gap = standby->ApplyReplicated(commits[1]);
  CHECK(gap.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(Message(gap), Contains("expected sequence 1") && Contains("got 2"));
  CHECK(standby->LastApplied() == DurableStore::Position{});
  CHECK(ValueOrFail(standby->LoadAll()).weights.empty());

  REQUIRE_OK(standby->ApplyReplicated(commits[0]));
  REQUIRE_OK(standby->ApplyReplicated(commits[1]));
  // A duplicate (a retried send) is OK and writes nothing: a doctored copy of commit 1 with
  // another weight would show if it were applied.
  ReplicatedCommit doctored = commits[0];
  WeightRecord other = Weight(0, 0, 99.0);
  for (ReplicatedOperation& operation : *doctored.mutable_operations()) {
    if (operation.column_family() == static_cast<int>(ColumnFamily::kWeights)) {
      operation.set_value(other.SerializeAsString());
    }
  }
  REQUIRE_OK(standby->ApplyReplicated(doctored));
  REQUIRE_OK(standby->ApplyReplicated(commits[1]));
  CHECK(standby->LastApplied() == DurableStore::Position{3, 2});
  CHECK(ValueOrFail(standby->LoadAll()).weights.at({0, 0}).weight() == 2.0);

  // An older epoch.
  ReplicatedCommit old = commits[2];
  old.set_epoch(2);
  absl::Status older = standby->ApplyReplicated(old);
  CHECK(older.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(Message(older), Contains("epoch 2") && Contains("epoch 3"));
  CHECK(standby->LastApplied() == DurableStore::Position{3, 2});

  // A newer epoch at a sequence this standby already has: it holds commits the new leader
  // never had.
  ReplicatedCommit diverged = commits[1];
  diverged.set_epoch(4);
  CHECK(standby->ApplyReplicated(diverged).code() == absl::StatusCode::kFailedPrecondition);
  // The next sequence, but after a commit of another epoch than the standby's last.
  ReplicatedCommit wrong_parent = commits[2];
  wrong_parent.set_epoch(4);
  wrong_parent.set_previous_epoch(4);
  CHECK(standby->ApplyReplicated(wrong_parent).code() == absl::StatusCode::kFailedPrecondition);
  // A malformed operation.
  ReplicatedCommit malformed = commits[2];
  malformed.mutable_operations(0)->set_column_family(kNumColumnFamilies);
  CHECK(standby->ApplyReplicated(malformed).code() == absl::StatusCode::kInvalidArgument);
  ReplicatedCommit meta_write = commits[2];
  meta_write.mutable_operations(0)->set_column_family(static_cast<int>(ColumnFamily::kMeta));
  meta_write.mutable_operations(0)->set_key(kReplicationMetaKey);
  CHECK(standby->ApplyReplicated(meta_write).code() == absl::StatusCode::kInvalidArgument);
  CHECK(standby->LastApplied() == DurableStore::Position{3, 2});
  CHECK(ValueOrFail(standby->LoadAll()).weights.at({0, 0}).weight() == 2.0);
  CHECK(ValueOrFail(standby->ReadLog(Slot(0, 0), 0, 10)).size() == 2);

  // The real commit 3 still applies after all the refusals.
  REQUIRE_OK(standby->ApplyReplicated(commits[2]));
  CHECK(standby->LastApplied() == DurableStore::Position{3, 3});
  CheckSameState(*leader, *standby, {{0, 0}});

  // A leader does not apply replicated commits.
  CHECK(leader->ApplyReplicated(commits[2]).code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("a promoted standby continues the numbering in its new epoch; its standby follows") {
  CommitLog log;
  std::unique_ptr<DurableStore> leader = OpenCapturing("", &log);
  REQUIRE_OK(leader->SetEpoch(5));
  for (int64_t step = 1; step <= 2; ++step) {
    WriteBatch batch;
    batch.PutLogRecord(Log(0, 0, step, -1));
    REQUIRE_OK(leader->Commit(batch));
  }
  const std::vector<ReplicatedCommit> first = log.Take();
  // Standby B is promoted (reopened with capture, a new epoch); standby C follows it.
  const std::string b_dir = TempDir("repl-promoted");
  {
    std::unique_ptr<DurableStore> b = OpenOrFail(b_dir);
    for (const ReplicatedCommit& commit : first) REQUIRE_OK(b->ApplyReplicated(commit));
  }
  std::unique_ptr<DurableStore> c = OpenOrFail("");
  for (const ReplicatedCommit& commit : first) REQUIRE_OK(c->ApplyReplicated(commit));

  CommitLog b_log;
  std::unique_ptr<DurableStore> b = OpenCapturing(b_dir, &b_log);
  CHECK(b->LastApplied() == DurableStore::Position{5, 2});
  CHECK(b->SetEpoch(4).code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE_OK(b->SetEpoch(9));
  WriteBatch batch;
  batch.PutLogRecord(Log(0, 0, 3, -1));
  REQUIRE_OK(b->Commit(batch));
  const std::vector<ReplicatedCommit> second = b_log.Take();
  REQUIRE(second.size() == 1);
  CHECK(second[0].sequence() == 3);
  CHECK(second[0].epoch() == 9);
  CHECK(second[0].previous_epoch() == 5);
  REQUIRE_OK(c->ApplyReplicated(second[0]));
  CHECK(c->LastApplied() == DurableStore::Position{9, 3});
  CheckSameState(*b, *c, {{0, 0}});
  // The old leader's next commit (epoch 5) is refused by C now.
  REQUIRE_OK(leader->Commit(batch));
  const std::vector<ReplicatedCommit> stale = log.Take();
  REQUIRE(stale.size() == 1);
  CHECK(c->ApplyReplicated(stale[0]).code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("StartCapturing turns an open standby into a leader; Commit returns its barrier's answer") {
  const std::string dir = TempDir("repl-start-capturing");
  std::unique_ptr<DurableStore> store = OpenOrFail(dir);
  {
    CommitLog feed;
    std::unique_ptr<DurableStore> leader = OpenCapturing("", &feed);
    REQUIRE_OK(leader->SetEpoch(3));
    WriteBatch batch;
    batch.PutLogRecord(Log(0, 0, 1, -1));
    REQUIRE_OK(leader->Commit(batch));
    for (const ReplicatedCommit& commit : feed.Take()) REQUIRE_OK(store->ApplyReplicated(commit));
  }
  REQUIRE(store->LastApplied() == DurableStore::Position{3, 1});
  CommitLog log;
  std::vector<DurableStore::Position> barriers;
  absl::Status answer = absl::OkStatus();
  CHECK(store->StartCapturing(log.Sink(), nullptr, 2).code() ==
        absl::StatusCode::kFailedPrecondition);  // an older epoch
  REQUIRE_OK(store->StartCapturing(
      log.Sink(),
      [&](const DurableStore::Position& position) {
        barriers.push_back(position);
        return answer;
      },
      8));
  CHECK(store->StartCapturing(log.Sink(), nullptr, 9).code() ==
        absl::StatusCode::kFailedPrecondition);  // captures already
  WriteBatch batch;
  batch.PutLogRecord(Log(0, 0, 2, -1));
  DurableStore::Position numbered;
  REQUIRE_OK(store->Commit(batch, &numbered));
  CHECK(numbered == DurableStore::Position{8, 2});
  REQUIRE(barriers.size() == 1);
  CHECK(barriers[0] == numbered);
  // A barrier's error is Commit's; the batch is written all the same (the leader must not
  // acknowledge it, not forget it).
  answer = absl::UnavailableError("not the leader any more");
  batch.Clear();
  batch.PutLogRecord(Log(0, 0, 3, -1));
  const absl::Status refused = store->Commit(batch);
  CHECK(refused.code() == absl::StatusCode::kUnavailable);
  CHECK(refused.message() == "not the leader any more");
  REQUIRE(barriers.size() == 2);
  CHECK(barriers[1] == DurableStore::Position{8, 3});
  const std::vector<ReplicatedCommit> shipped = log.Take();
  REQUIRE(shipped.size() == 2);
  CHECK(shipped[0].previous_epoch() == 3);
  CHECK(shipped[1].sequence() == 3);
  CHECK(ValueOrFail(store->ReadLog(Slot(0, 0), 0, 10)).size() == 3);
  // An empty batch neither numbers nor waits.
  REQUIRE_OK(store->Commit(WriteBatch()));
  CHECK(barriers.size() == 2);
  // A leader's store refuses replicated commits.
  CHECK(store->ApplyReplicated(shipped[0]).code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("Commit in three parts: files prepared in any order, records written in the caller's") {
  const std::string dir = TempDir("three-part-commit");
  std::unique_ptr<DurableStore> store = OpenOrFail(dir);
  const Snapshot one = MakeSnapshot(0, 1, 8), two = MakeSnapshot(1, 1, 16);
  WriteBatch first, second, dropped;
  first.PutSnapshot(one);
  second.PutSnapshot(two);
  dropped.PutCenter(Center(0, 4));
  DurableStore::Prepared prepared_second = ValueOrFail(store->Prepare(second));
  DurableStore::Prepared prepared_first = ValueOrFail(store->Prepare(first));
  {
    DurableStore::Prepared prepared_dropped = ValueOrFail(store->Prepare(dropped));
    // The files are written, the records are not.
    CHECK(TensorFileNames(dir).size() == 3);
    CHECK(store->ReadSnapshot(Slot(0, 1)).status().code() == absl::StatusCode::kNotFound);
  }
  // Destroyed without a Write: its file is gone and its record never existed.
  CHECK(TensorFileNames(dir).size() == 2);
  CHECK(ValueOrFail(store->LoadAll()).centers.empty());
  // A store without replication: nothing to await.
  CHECK(ValueOrFail(store->Write(prepared_first)) == DurableStore::Position{});
  CHECK(SameProto(ValueOrFail(store->ReadSnapshot(Slot(0, 1))), one));
  CHECK(store->ReadSnapshot(Slot(1, 1)).status().code() == absl::StatusCode::kNotFound);
  CHECK(ValueOrFail(store->Write(prepared_second)) == DurableStore::Position{});
  REQUIRE_OK(store->AwaitReplicated(DurableStore::Position{}));
  CHECK(SameProto(ValueOrFail(store->ReadSnapshot(Slot(1, 1))), two));
  // Written batches keep their files, reopened or not.
  CHECK(TensorFileNames(dir).size() == 2);
  store.reset();
  store = OpenOrFail(dir);
  CHECK(SameProto(ValueOrFail(store->ReadSnapshot(Slot(0, 1))), one));
  CHECK(SameProto(ValueOrFail(store->ReadSnapshot(Slot(1, 1))), two));
}

TEST_CASE("a capturing store numbers at Write and waits at AwaitReplicated; a failed wait fences") {
  CommitLog log;
  std::unique_ptr<DurableStore> store = OpenOrFail("");
  std::vector<DurableStore::Position> barriers;
  absl::Status answer = absl::OkStatus();
  REQUIRE_OK(store->StartCapturing(
      log.Sink(),
      [&](const DurableStore::Position& position) {
        barriers.push_back(position);
        return answer;
      },
      5));
  WriteBatch batch;
  batch.PutSnapshot(MakeSnapshot(0, 0, 8));
  DurableStore::Prepared prepared = ValueOrFail(store->Prepare(batch));
  CHECK(log.Take().empty());  // nothing numbered or shipped by Prepare
  const DurableStore::Position position = ValueOrFail(store->Write(prepared));
  CHECK(position == DurableStore::Position{5, 1});
  CHECK(log.Take().size() == 1);
  CHECK(barriers.empty());  // the wait is the caller's next step
  REQUIRE_OK(store->AwaitReplicated(position));
  REQUIRE(barriers.size() == 1);
  CHECK(barriers[0] == position);
  answer = absl::DeadlineExceededError("the standby is silent");
  CHECK(store->AwaitReplicated(position).code() == absl::StatusCode::kDeadlineExceeded);
  // Fenced: nothing is prepared, written or numbered any more.
  CHECK(store->Prepare(batch).status().code() == absl::StatusCode::kUnavailable);
  CHECK(store->Commit(batch).code() == absl::StatusCode::kUnavailable);
  CHECK(log.Take().empty());
}

TEST_CASE("the numbering continues after reopening a capturing store") {
  const std::string dir = TempDir("repl-reopen");
  CommitLog log;
  {
    std::unique_ptr<DurableStore> store = OpenCapturing(dir, &log);
    REQUIRE_OK(store->SetEpoch(2));
    for (int64_t step = 1; step <= 3; ++step) {
      WriteBatch batch;
      batch.PutSnapshot(MakeSnapshot(0, 0, step));
      REQUIRE_OK(store->Commit(batch));
    }
  }
  CHECK(HasReplicationRecord(dir));
  std::unique_ptr<DurableStore> store = OpenCapturing(dir, &log);
  CHECK(store->LastApplied() == DurableStore::Position{2, 3});
  CHECK(store->SetEpoch(1).code() == absl::StatusCode::kFailedPrecondition);
  WriteBatch batch;
  batch.PutSnapshot(MakeSnapshot(0, 0, 4));
  REQUIRE_OK(store->Commit(batch));  // still epoch 2: SetEpoch is not needed after a restart
  const std::vector<ReplicatedCommit> commits = log.Take();
  REQUIRE(commits.size() == 4);
  for (size_t i = 0; i < commits.size(); ++i) {
    CHECK(commits[i].sequence() == i + 1);
    CHECK(commits[i].epoch() == 2);
  }
  // The replication record is not part of the loaded state.
  CHECK(ValueOrFail(store->LoadAll()).slots.empty());
}

TEST_CASE("a standby catches up from a checkpoint plus the commits after it") {
  const std::string leader_dir = TempDir("repl-cp-leader");
  const std::string copy_dir = TempDir("repl-cp-parent") + "/copy";
  CommitLog log;
  std::unique_ptr<DurableStore> leader = OpenCapturing(leader_dir, &log);
  REQUIRE_OK(leader->SetEpoch(4));
  auto commit_step = [&](int64_t step) {
    WriteBatch batch;
    batch.PutSnapshot(MakeSnapshot(0, 0, step));
    batch.PutCenter(Center(0, step));
    batch.PutLogRecord(Log(0, 0, step, -1));
    batch.DeleteLogRange(Slot(0, 0), 0, step - 1);
    REQUIRE_OK(leader->Commit(batch));
  };
  for (int64_t step = 1; step <= 5; ++step) commit_step(step);
  const DurableStore::Position cut = ValueOrFail(leader->Checkpoint(copy_dir));
  CHECK(cut == DurableStore::Position{4, 5});
  CHECK(leader->Checkpoint(copy_dir).status().code() == absl::StatusCode::kFailedPrecondition);
  for (int64_t step = 6; step <= 8; ++step) commit_step(step);

  // The copy opens as a standby at the cut; every commit the sink was handed is sent: those up
  // to the cut are duplicates, the rest apply.
  std::unique_ptr<DurableStore> standby = OpenOrFail(copy_dir);
  CHECK(standby->LastApplied() == cut);
  CHECK(ValueOrFail(standby->ReadSnapshot(Slot(0, 0))).step() == 5);
  const std::vector<ReplicatedCommit> commits = log.Take();
  REQUIRE(commits.size() == 8);
  for (const ReplicatedCommit& commit : commits) REQUIRE_OK(standby->ApplyReplicated(commit));
  CHECK(standby->LastApplied() == DurableStore::Position{4, 8});
  CheckSameState(*leader, *standby, {{0, 0}});
  CHECK(ValueOrFail(standby->ReadSnapshot(Slot(0, 0))).step() == 8);

  std::unique_ptr<DurableStore> in_memory = OpenOrFail("");
  CHECK(in_memory->Checkpoint(TempDir("repl-cp-mem") + "/copy").status().code() ==
        absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("a store without a sink writes no replication record and numbers nothing") {
  const std::string dir = TempDir("repl-off");
  {
    std::unique_ptr<DurableStore> store = OpenOrFail(dir);
    WriteBatch batch;
    batch.PutSnapshot(MakeSnapshot(0, 0, 1));
    batch.PutSlot(SlotState(0, 0, 1));
    batch.PutServer(Server());
    DurableStore::Position numbered{9, 9};
    REQUIRE_OK(store->Commit(batch, &numbered));
    CHECK(numbered == DurableStore::Position{9, 9});  // untouched: nothing is numbered
    CHECK(store->LastApplied() == DurableStore::Position{});
    const LoadedState state = ValueOrFail(store->LoadAll());
    CHECK(state.slots.size() == 1);
    CHECK(SameProto(state.snapshots.at({0, 0}), MakeSnapshot(0, 0, 1)));
  }
  CHECK(!HasReplicationRecord(dir));
  // Exactly the records committed are in `meta`: "server" and one slot record.
  RawDb raw(dir);
  std::unique_ptr<rocksdb::Iterator> it(
      raw.db()->NewIterator(rocksdb::ReadOptions(), raw.Family("meta")));
  std::vector<std::string> keys;
  for (it->SeekToFirst(); it->Valid(); it->Next()) keys.push_back(it->key().ToString());
  CHECK(keys == std::vector<std::string>{kServerMetaKey, EncodeSlotMetaKey(0, 0)});
}

}  // namespace
}  // namespace rebound::storage
