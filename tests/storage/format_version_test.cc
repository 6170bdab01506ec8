// storage/format_version: a data directory records its format; a newer one is refused before
// RocksDB touches it, naming the directory and both formats; an older one (or one without
// FORMAT, as rebound 0.12 and older left them) loads, is migrated step by step and recorded; the
// data directory main wrote before formats were recorded (testdata/data_dir_0.12) loads.

#include "storage/format_version.h"

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/version.h"
#include "storage/durable_store.h"
#include "testing/cluster/processes.h"

namespace rebound::storage {
namespace {

namespace fs = std::filesystem;

std::string Runfile(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr) return path;
  return absl::StrCat(srcdir, "/", workspace != nullptr ? workspace : "rebound", "/", path);
}

DurableStoreOptions At(const std::string& dir) {
  DurableStoreOptions options;
  options.data_dir = dir;
  return options;
}

CenterRecord Center(int64_t version) {
  CenterRecord record;
  record.set_stage(0);
  record.set_version(version);
  Tensor* tensor = record.mutable_params()->add_tensors();
  tensor->set_id(0);
  tensor->set_name("w");
  tensor->set_dtype(FLOAT32);
  tensor->add_shape(1);
  tensor->set_data(std::string(sizeof(float), '\0'));
  return record;
}

// A store made without OpenDataDir (no FORMAT, as before formats were recorded) at center
// version `version`.
std::string StoreWithoutFormat(const std::string& name, int64_t version) {
  const std::string dir = testing::MakeTempDir(name) + "/data";
  auto store = DurableStore::Open(At(dir));
  REQUIRE(store.ok());
  WriteBatch batch;
  batch.PutCenter(Center(version));
  REQUIRE((*store)->Commit(batch).ok());
  return dir;
}

std::string FormatFileText(const std::string& dir) {
  absl::StatusOr<std::string> text = ReadFile(dir + "/FORMAT", 4096);
  REQUIRE(text.ok());
  return *text;
}

TEST_CASE("a new data directory records the current format") {
  const std::string dir = testing::MakeTempDir("new") + "/data";
  auto store = OpenDataDir(At(dir));
  REQUIRE(store.ok());
  CHECK(FormatFileText(dir) == absl::StrCat("rebound data directory format ",
                                            kDataFormatVersion, "\n"));
  auto format = ReadDataFormat(dir);
  REQUIRE(format.ok());
  CHECK(*format == std::optional<int>(kDataFormatVersion));
}

TEST_CASE("a data directory without FORMAT is format 1: it loads and gets its FORMAT") {
  const std::string dir = StoreWithoutFormat("unrecorded", 7);
  REQUIRE(!fs::exists(dir + "/FORMAT"));
  auto store = OpenDataDir(At(dir));
  REQUIRE(store.ok());
  auto state = (*store)->LoadAll();
  REQUIRE(state.ok());
  CHECK(state->centers.at(0).version() == 7);
  CHECK(FormatFileText(dir) == "rebound data directory format 1\n");
}

TEST_CASE("a data directory of a newer format is refused before it is opened") {
  const std::string dir = StoreWithoutFormat("newer", 3);
  REQUIRE(WriteDataFormat(dir, kDataFormatVersion + 1).ok());
  const auto files_before = std::distance(fs::directory_iterator(dir), fs::directory_iterator());

  auto store = OpenDataDir(At(dir));
  REQUIRE(store.status().code() == absl::StatusCode::kFailedPrecondition);
  const std::string message(store.status().message());
  INFO(message);
  CHECK(absl::StrContains(message, absl::StrCat("data directory ", dir, " has format ",
                                                kDataFormatVersion + 1)));
  CHECK(absl::StrContains(message, absl::StrCat("newer than format ", kDataFormatVersion,
                                                " that rebound ", ProjectVersion(), " reads")));
  CHECK(absl::StrContains(message, "docs/upgrading.md"));
  // Untouched: the FORMAT it had, no file RocksDB would have added (a new WAL, OPTIONS).
  CHECK(FormatFileText(dir) ==
        absl::StrCat("rebound data directory format ", kDataFormatVersion + 1, "\n"));
  CHECK(std::distance(fs::directory_iterator(dir), fs::directory_iterator()) == files_before);
  // And it still holds its store for the newer release.
  auto reopened = DurableStore::Open(At(dir));
  REQUIRE(reopened.ok());
  CHECK((*reopened)->LoadAll()->centers.at(0).version() == 3);
}

TEST_CASE("an older format is migrated step by step, each step recorded") {
  const std::string dir = StoreWithoutFormat("older", 5);
  REQUIRE(WriteDataFormat(dir, 1).ok());
  // A current format 3 whose migrations bump the center's version: 1 -> 2 adds 10, 2 -> 3
  // doubles, so the result also says they ran in order (5 + 10) * 2 = 30, not 5 * 2 + 10.
  std::vector<int> formats_seen;
  const auto bump = [&](int from, auto change) {
    return DataFormatMigration{from, [&, from, change](DurableStore* store) -> absl::Status {
                                 auto format = ReadDataFormat(dir);
                                 REQUIRE(format.ok());
                                 formats_seen.push_back(format->value_or(0));
                                 auto state = store->LoadAll();
                                 if (!state.ok()) return state.status();
                                 WriteBatch batch;
                                 batch.PutCenter(Center(change(state->centers.at(0).version())));
                                 return store->Commit(batch);
                               }};
  };
  const std::vector<DataFormatMigration> migrations = {
      bump(2, [](int64_t v) { return v * 2; }),
      bump(1, [](int64_t v) { return v + 10; }),
  };
  auto store = OpenDataDir(At(dir), 3, migrations);
  REQUIRE(store.ok());
  CHECK((*store)->LoadAll()->centers.at(0).version() == 30);
  CHECK(formats_seen == std::vector<int>{1, 2});  // FORMAT said 2 when the second step ran
  CHECK(FormatFileText(dir) == "rebound data directory format 3\n");
}

TEST_CASE("a migration that fails leaves the format it reached and names the step") {
  const std::string dir = StoreWithoutFormat("failing", 1);
  const std::vector<DataFormatMigration> migrations = {
      {1, [](DurableStore*) { return absl::OkStatus(); }},
      {2, [](DurableStore*) { return absl::ResourceExhaustedError("disk full"); }},
  };
  auto store = OpenDataDir(At(dir), 3, migrations);
  REQUIRE(store.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(absl::StrContains(store.status().message(),
                          absl::StrCat("migrating data directory ", dir,
                                       " from format 2 to 3: disk full")));
  CHECK(FormatFileText(dir) == "rebound data directory format 2\n");
}

TEST_CASE("a FORMAT file that is not one is DATA_LOSS, naming it") {
  const std::string dir = StoreWithoutFormat("garbage", 1);
  REQUIRE(WriteFile(dir + "/FORMAT", "format: two\n").ok());
  auto store = OpenDataDir(At(dir));
  REQUIRE(store.status().code() == absl::StatusCode::kDataLoss);
  CHECK(absl::StrContains(store.status().message(), dir + "/FORMAT"));
}

TEST_CASE("the data directory main wrote before formats were recorded loads as format 1") {
  const std::string fixture = Runfile("tests/storage/testdata/data_dir_0.12");
  REQUIRE(fs::exists(fixture + "/CURRENT"));
  REQUIRE(!fs::exists(fixture + "/FORMAT"));
  // A writable copy (runfiles are read-only links).
  const std::string dir = testing::MakeTempDir("fixture") + "/data";
  fs::copy(fixture, dir, fs::copy_options::recursive);
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    fs::permissions(entry.path(), fs::perms::owner_write, fs::perm_options::add);
  }

  auto store = OpenDataDir(At(dir));
  REQUIRE(store.ok());
  auto state = (*store)->LoadAll();
  REQUIRE(state.ok());
  // The job of testdata/data_dir_0.12.job.pbtxt: one trainer, 8 steps, a 784-2-10 MLP.
  REQUIRE(state->server.has_value());
  CHECK(state->server->job_id() == "format-fixture");
  REQUIRE(state->slots.size() == 1);
  CHECK(state->slots.begin()->second.step() == 8);
  REQUIRE(state->centers.size() == 1);
  const CenterRecord& center = state->centers.at(0);
  CHECK(center.version() > 0);
  int64_t parameters = 0;
  for (const Tensor& tensor : center.params().tensors()) {
    int64_t count = 1;
    for (int64_t dim : tensor.shape()) count *= dim;
    CHECK(static_cast<int64_t>(tensor.data().size()) == count * 4);
    parameters += count;
  }
  CHECK(parameters == 784 * 2 + 2 + 2 * 10 + 10);
  CHECK(FormatFileText(dir) == "rebound data directory format 1\n");

  // Opened again, it stays format 1 with the same state.
  store->reset();
  auto again = OpenDataDir(At(dir));
  REQUIRE(again.ok());
  CHECK((*again)->LoadAll()->centers.at(0).version() == center.version());
}

}  // namespace
}  // namespace rebound::storage
