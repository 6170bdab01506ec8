// storage/backup: a checkpoint of a real store with its manifest verifies and restores into an
// empty directory at the checkpoint's commit, with every record; a damaged, extra or missing
// file, a newer format and a non-empty data directory are refused, naming what is wrong.

#include "storage/backup.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "common/file.h"
#include "storage/durable_store.h"
#include "testing/cluster/processes.h"

namespace rebound::storage {
namespace {

namespace fs = std::filesystem;

CenterRecord Center(int64_t version, float base) {
  CenterRecord record;
  record.set_stage(0);
  record.set_version(version);
  Tensor* tensor = record.mutable_params()->add_tensors();
  tensor->set_id(0);
  tensor->set_name("layer0.weight");
  tensor->set_dtype(FLOAT32);
  tensor->add_shape(256);
  std::string data(256 * sizeof(float), '\0');
  for (int i = 0; i < 256; ++i) {
    const float value = base + static_cast<float>(i);
    std::memcpy(&data[i * sizeof(float)], &value, sizeof(float));
  }
  tensor->set_data(data);
  return record;
}

// A store at center version 2 (two commits) and a backup of it: its checkpoint and manifest.
struct Fixture {
  std::string root = testing::MakeTempDir("backup");
  std::string backup = root + "/backup";
  DurableStore::Position position;

  Fixture() {
    DurableStoreOptions options;
    options.data_dir = root + "/data";
    auto store = DurableStore::Open(options);
    REQUIRE(store.ok());
    for (int64_t version = 1; version <= 2; ++version) {
      WriteBatch batch;
      batch.PutCenter(Center(version, static_cast<float>(version)));
      REQUIRE((*store)->Commit(batch).ok());
    }
    auto made = (*store)->Checkpoint(backup);
    REQUIRE(made.ok());
    position = *made;
    BackupInfo info;
    info.epoch = position.epoch;
    info.sequence = position.sequence;
    info.server_version = "rebound test";
    auto written = WriteBackupManifest(backup, info);
    INFO(written.status());
    REQUIRE(written.ok());
    REQUIRE(written->files > 0);
  }

  // The first tensor file of the backup (the center's), relative to it.
  std::string TensorFile() const {
    for (const auto& entry : fs::directory_iterator(fs::path(backup) / "tensors")) {
      return "tensors/" + entry.path().filename().string();
    }
    FAIL("no tensor file in the backup");
    return "";
  }
};

TEST_CASE("a backup verifies and restores into an empty directory at its commit") {
  Fixture f;
  auto verified = VerifyBackup(f.backup);
  INFO(verified.status());
  REQUIRE(verified.ok());
  CHECK(verified->sequence == f.position.sequence);
  CHECK(verified->server_version == "rebound test");
  const std::string restored_dir = f.root + "/restored";
  auto restored = RestoreBackup(f.backup, restored_dir);
  INFO(restored.status());
  REQUIRE(restored.ok());
  DurableStoreOptions options;
  options.data_dir = restored_dir;
  auto store = DurableStore::Open(options);
  REQUIRE(store.ok());
  CHECK((*store)->LastApplied().sequence == f.position.sequence);
  auto state = (*store)->LoadAll();
  REQUIRE(state.ok());
  REQUIRE(state->centers.count(0) == 1);
  CHECK(state->centers.at(0).version() == 2);
  CHECK(state->centers.at(0).params().tensors(0).data() == Center(2, 2.0f).params().tensors(0).data());
  // The backup is kept: it restores again elsewhere.
  CHECK(RestoreBackup(f.backup, f.root + "/again").ok());
}

TEST_CASE("a backup records its data format, and a restore writes it as the directory's FORMAT") {
  Fixture f;  // the manifest written with BackupInfo's default: a store of format 1
  CHECK(absl::StrContains(ReadFileOrEmpty(f.backup + "/" + kBackupManifest),
                          "\"data_format_version\": 1"));
  const std::string restored_dir = f.root + "/restored";
  auto restored = RestoreBackup(f.backup, restored_dir);
  REQUIRE(restored.ok());
  CHECK(restored->data_format_version == 1);
  CHECK(ReadFileOrEmpty(restored_dir + "/FORMAT") == "rebound data directory format 1\n");

  // A manifest from before 0.13 (no data_format_version) is format 1 too.
  const std::string manifest = f.backup + "/" + kBackupManifest;
  std::string text = ReadFileOrEmpty(manifest);
  const std::string field = "\n \"data_format_version\": 1,";
  const size_t at = text.find(field);
  REQUIRE(at != std::string::npos);
  text.erase(at, field.size());
  REQUIRE(WriteFile(manifest, text).ok());
  auto old = VerifyBackup(f.backup);
  REQUIRE(old.ok());
  CHECK(old->data_format_version == 1);
}

TEST_CASE("a backup of a newer data format is refused, and nothing is restored") {
  Fixture f;
  const std::string manifest = f.backup + "/" + kBackupManifest;
  std::string text = ReadFileOrEmpty(manifest);
  const std::string field = "\"data_format_version\": 1";
  const size_t at = text.find(field);
  REQUIRE(at != std::string::npos);
  text.replace(at, field.size(),
               absl::StrCat("\"data_format_version\": ", kDataFormatVersion + 1));
  REQUIRE(WriteFile(manifest, text).ok());
  auto restored = RestoreBackup(f.backup, f.root + "/restored");
  REQUIRE(restored.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(restored.status().message(),
                          absl::StrCat("data directory of format ", kDataFormatVersion + 1,
                                       ", newer than format ", kDataFormatVersion)));
  CHECK_FALSE(fs::exists(f.root + "/restored"));
}

TEST_CASE("a damaged, unlisted or missing file fails the check, naming it") {
  Fixture f;
  const std::string tensor = f.TensorFile();
  {
    std::fstream file(fs::path(f.backup) / tensor, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(17);
    file.put('\x5a');  // one byte changed, the size kept
  }
  absl::StatusOr<BackupInfo> damaged = VerifyBackup(f.backup);
  CHECK(damaged.status().code() == absl::StatusCode::kDataLoss);
  CHECK(absl::StrContains(damaged.status().message(), tensor));
  CHECK(absl::StrContains(damaged.status().message(), "damaged"));
  // Nothing is restored from it.
  CHECK(RestoreBackup(f.backup, f.root + "/restored").status().code() ==
        absl::StatusCode::kDataLoss);
  CHECK_FALSE(fs::exists(f.root + "/restored"));

  Fixture g;
  REQUIRE(WriteFile(g.backup + "/stray", "x").ok());
  CHECK(absl::StrContains(VerifyBackup(g.backup).status().message(), "stray is not in the manifest"));

  Fixture h;
  fs::remove(fs::path(h.backup) / h.TensorFile());
  CHECK(absl::StrContains(VerifyBackup(h.backup).status().message(), "is missing"));
}

TEST_CASE("a directory without a manifest, a newer format and a non-empty data directory are "
          "refused") {
  Fixture f;
  CHECK(VerifyBackup(f.root + "/data").status().code() == absl::StatusCode::kFailedPrecondition);
  const std::string manifest = f.backup + "/" + kBackupManifest;
  std::string text = ReadFileOrEmpty(manifest);
  const size_t at = text.find("\"format_version\": 1");
  REQUIRE(at != std::string::npos);
  text.replace(at, std::strlen("\"format_version\": 1"), "\"format_version\": 99");
  REQUIRE(WriteFile(manifest, text).ok());
  absl::StatusOr<BackupInfo> newer = VerifyBackup(f.backup);
  CHECK(newer.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(newer.status().message(), "newer"));

  Fixture g;
  absl::StatusOr<BackupInfo> over = RestoreBackup(g.backup, g.root + "/data");  // the live store
  CHECK(over.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(over.status().message(), "not empty"));
}

}  // namespace
}  // namespace rebound::storage
