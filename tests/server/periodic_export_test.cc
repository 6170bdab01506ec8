// PeriodicExporter (server/periodic_export.h) over a real CenterTable read by ReadCenterExport
// (server/center_export.h), on a fake clock, writing real files.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/checksum.h"
#include "common/clock.h"
#include "common/file.h"
#include "common/safetensors.h"
#include "proto/storage.pb.h"
#include "server/center_export.h"
#include "server/center_table.h"
#include "server/periodic_export.h"
#include "tests/server/server_testing.h"

namespace rebound::server {
namespace {

namespace fs = std::filesystem;

std::string TempDir(const std::string& name) {
  const char* root = std::getenv("TEST_TMPDIR");
  const fs::path dir = fs::path(root != nullptr ? root : "/tmp") / name;
  fs::remove_all(dir);
  return dir.string();
}

// A center whose stage 0 is at `version`, every value `value`.
void MoveCenter(CenterTable* table, int64_t version, float value) {
  std::vector<float> theta(table->StageParameters(0), value);
  CenterRecord record;
  record.set_stage(0);
  record.set_version(version);
  *record.mutable_params() = table->Bundle(0, theta);
  REQUIRE(table->Restore(record, nullptr).ok());
}

struct Fixture {
  explicit Fixture(ExportConfig config, const std::string& name)
      : job(testing::TinyModelJob(2, 1)), dir(TempDir(name)) {
    auto created = CenterTable::Create(job);
    REQUIRE(created.ok());
    table = *std::move(created);
    ExportSource source;
    source.read = [this] { return ReadCenterExport(job, *table, "rebound test"); };
    source.job_step = [this] { return step; };
    exporter = std::make_unique<PeriodicExporter>(config, dir, &clock, source);
    REQUIRE(exporter->Init().ok());
  }

  std::vector<std::string> Exports() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir)) {
      const std::string file = entry.path().filename().string();
      if (absl::StartsWith(file, "model-v") && absl::EndsWith(file, ".safetensors")) {
        names.push_back(file);
      }
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  JobConfig job;
  std::string dir;
  FakeClock clock;
  std::unique_ptr<CenterTable> table;
  int64_t step = 0;
  std::unique_ptr<PeriodicExporter> exporter;
};

ExportConfig EverySteps(int64_t steps, int keep_last = 3) {
  ExportConfig config;
  config.set_every_steps(steps);
  config.set_keep_last(keep_last);
  return config;
}

TEST_CASE("an export is due each time the job's step reaches a new multiple of every_steps") {
  Fixture f(EverySteps(100), "every-steps");
  auto none = f.exporter->Pass();
  REQUIRE(none.ok());
  CHECK_FALSE(none->has_value());
  f.step = 99;
  MoveCenter(f.table.get(), 5, 0.25f);
  CHECK_FALSE(f.exporter->Pass()->has_value());
  f.step = 130;  // past 100: due
  auto first = f.exporter->Pass();
  REQUIRE(first.ok());
  REQUIRE(first->has_value());
  CHECK(**first == f.dir + "/" + ExportFileName(5));
  CHECK(ExportFileName(5) == "model-v0000000005.safetensors");
  f.step = 199;  // the same hundred: not due, although the center moves
  MoveCenter(f.table.get(), 7, 0.5f);
  CHECK_FALSE(f.exporter->Pass()->has_value());
  f.step = 420;  // several multiples at once: one export
  auto second = f.exporter->Pass();
  REQUIRE(second.ok());
  REQUIRE(second->has_value());
  CHECK(**second == f.dir + "/" + ExportFileName(7));
  CHECK_FALSE(f.exporter->Pass()->has_value());
  CHECK(f.Exports() == std::vector<std::string>{ExportFileName(5), ExportFileName(7)});
  CHECK(f.exporter->stats().written == 2);
  CHECK(f.exporter->stats().last_center_version == 7);
}

TEST_CASE("an export holds the center as it was, with its checksum file and latest pointing at it") {
  Fixture f(EverySteps(10), "content");
  MoveCenter(f.table.get(), 3, 1.5f);
  f.step = 10;
  auto written = f.exporter->Pass();
  REQUIRE(written.ok());
  REQUIRE(written->has_value());
  // The center moves on after the export: the file keeps what was exported.
  MoveCenter(f.table.get(), 4, -2.0f);

  auto bytes = ReadFile(**written, 64 << 20, "export");
  REQUIRE(bytes.ok());
  auto decoded = DecodeSafetensors(*bytes);
  REQUIRE(decoded.ok());
  REQUIRE(!decoded->tensors.empty());
  int64_t floats = 0;
  for (const Tensor& tensor : decoded->tensors) {
    REQUIRE(tensor.data().size() % sizeof(float) == 0);
    const float* values = reinterpret_cast<const float*>(tensor.data().data());
    for (size_t i = 0; i < tensor.data().size() / sizeof(float); ++i) CHECK(values[i] == 1.5f);
    floats += tensor.data().size() / sizeof(float);
  }
  CHECK(floats == f.table->StageParameters(0));
  CHECK(decoded->metadata.at("rebound.center_versions") == "3");
  CHECK(decoded->metadata.at("rebound.job_step") == "10");
  CHECK(decoded->metadata.at("format") == "pt");

  // "<xxh64>  <name>", as xxhsum writes it.
  auto sum = ReadFile(**written + ".xxh64", 1024, "checksum");
  REQUIRE(sum.ok());
  CHECK(*sum == absl::StrFormat("%016x  %s\n", Checksum(bytes->data(), bytes->size()),
                                ExportFileName(3)));
  CHECK(fs::read_symlink(fs::path(f.dir) / "latest.safetensors") == ExportFileName(3));
  CHECK_FALSE(fs::exists(**written + ".tmp"));
}

TEST_CASE("every_seconds exports only a center that moved; keep_last deletes the oldest") {
  ExportConfig config;
  config.set_every_seconds(60);
  config.set_keep_last(2);
  Fixture f(config, "every-seconds");
  MoveCenter(f.table.get(), 1, 0.1f);
  f.clock.Advance(absl::Seconds(59));
  CHECK_FALSE(f.exporter->Pass()->has_value());
  f.clock.Advance(absl::Seconds(1));
  CHECK(f.exporter->Pass()->has_value());
  // A minute later the center has not moved: nothing new.
  f.clock.Advance(absl::Seconds(60));
  CHECK_FALSE(f.exporter->Pass()->has_value());
  for (int64_t version : {2, 3, 4}) {
    MoveCenter(f.table.get(), version, 0.1f * version);
    f.clock.Advance(absl::Seconds(60));
    REQUIRE(f.exporter->Pass()->has_value());
  }
  CHECK(f.Exports() == std::vector<std::string>{ExportFileName(3), ExportFileName(4)});
  CHECK_FALSE(fs::exists(fs::path(f.dir) / (ExportFileName(2) + ".xxh64")));
  CHECK(fs::exists(fs::path(f.dir) / (ExportFileName(4) + ".xxh64")));
  CHECK(fs::read_symlink(fs::path(f.dir) / "latest.safetensors") == ExportFileName(4));
  CHECK(f.exporter->stats().written == 4);
}

TEST_CASE("ExportIfMoved writes off schedule, once per center version") {
  Fixture f(EverySteps(1000), "if-moved");
  MoveCenter(f.table.get(), 9, 0.75f);
  auto written = f.exporter->ExportIfMoved();
  REQUIRE(written.ok());
  REQUIRE(written->has_value());
  auto again = f.exporter->ExportIfMoved();
  REQUIRE(again.ok());
  CHECK_FALSE(again->has_value());
  CHECK(f.exporter->stats().written == 1);
}

TEST_CASE("a directory that cannot be written fails the export, counts it, and tries again") {
  Fixture f(EverySteps(10), "unwritable");
  // The directory goes away and a file takes its place (a read-only directory would not do:
  // tests may run as root, who writes there anyway).
  fs::remove_all(f.dir);
  REQUIRE(WriteFile(f.dir, "in the way").ok());
  MoveCenter(f.table.get(), 2, 1.0f);
  f.step = 10;
  auto failed = f.exporter->Pass();
  REQUIRE_FALSE(failed.ok());
  CHECK(failed.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(failed.status().message()), Catch::Contains(f.dir));
  CHECK(f.exporter->stats().failed == 1);
  CHECK(f.exporter->stats().written == 0);
  // Repaired: the next due pass writes it.
  fs::remove(f.dir);
  fs::create_directories(f.dir);
  f.step = 20;
  auto written = f.exporter->Pass();
  REQUIRE(written.ok());
  CHECK(written->has_value());
}

TEST_CASE("a declared model before its first worker: no model yet, FAILED_PRECONDITION") {
  JobConfig job = testing::TinyModelJob(1, 1);
  job.mutable_model()->clear_layers();
  job.mutable_model()->set_declared_by_worker(true);
  auto created = CenterTable::Create(job);
  REQUIRE(created.ok());
  auto read = ReadCenterExport(job, **created, "rebound test");
  CHECK(read.status().code() == absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace rebound::server
