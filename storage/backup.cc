#include "storage/backup.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checksum.h"
#include "common/file.h"
#include "common/status_macros.h"
#include "storage/durable_store.h"

namespace rebound::storage {
namespace {

namespace fs = std::filesystem;

constexpr char kFormat[] = "rebound-backup";
constexpr int64_t kMaxManifestBytes = int64_t{64} << 20;

absl::Status FileError(const std::string& what, const std::error_code& error) {
  const std::string message = absl::StrCat(what, ": ", error.message());
  return error == std::errc::no_space_on_device ? absl::ResourceExhaustedError(message)
                                                : absl::UnavailableError(message);
}

struct FileFacts {
  int64_t bytes = 0;
  std::string xxh64;  // 16 hex digits
};

absl::StatusOr<FileFacts> Facts(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::UnavailableError(absl::StrCat("reading ", path.string()));
  ChecksumStream checksum;
  FileFacts facts;
  std::vector<char> buffer(size_t{1} << 20);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const std::streamsize n = in.gcount();
    if (in.bad()) return absl::UnavailableError(absl::StrCat("reading ", path.string()));
    checksum.Update(buffer.data(), static_cast<size_t>(n));
    facts.bytes += n;
  }
  facts.xxh64 = absl::StrFormat("%016x", checksum.Digest());
  return facts;
}

// Every regular file under `dir` but the manifest, as paths relative to it, sorted.
absl::StatusOr<std::vector<std::string>> ListFiles(const std::string& dir) {
  std::vector<std::string> files;
  std::error_code error;
  for (auto entry = fs::recursive_directory_iterator(dir, error);
       !error && entry != fs::recursive_directory_iterator(); entry.increment(error)) {
    if (!entry->is_regular_file()) continue;
    const std::string relative = fs::relative(entry->path(), dir).string();
    if (relative != kBackupManifest) files.push_back(relative);
  }
  if (error) return FileError(absl::StrCat("listing ", dir), error);
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

absl::StatusOr<BackupInfo> WriteBackupManifest(const std::string& dir, const BackupInfo& info) {
  ASSIGN_OR_RETURN(const std::vector<std::string> files, ListFiles(dir));
  BackupInfo written = info;
  written.files = 0;
  written.bytes = 0;
  nlohmann::ordered_json listed = nlohmann::ordered_json::array();
  for (const std::string& file : files) {
    ASSIGN_OR_RETURN(const FileFacts facts, Facts(fs::path(dir) / file));
    listed.push_back({{"path", file}, {"bytes", facts.bytes}, {"xxh64", facts.xxh64}});
    ++written.files;
    written.bytes += facts.bytes;
  }
  nlohmann::ordered_json manifest;
  manifest["format"] = kFormat;
  manifest["format_version"] = kBackupFormatVersion;
  manifest["epoch"] = info.epoch;
  manifest["sequence"] = info.sequence;
  manifest["server_version"] = info.server_version;
  manifest["created_unix_ms"] = info.created_unix_ms;
  manifest["data_format_version"] = info.data_format_version;
  manifest["files"] = std::move(listed);
  RETURN_IF_ERROR(WriteFileDurably((fs::path(dir) / kBackupManifest).string(),
                                   manifest.dump(1) + "\n"));
  return written;
}

absl::StatusOr<BackupInfo> VerifyBackup(const std::string& dir) {
  const std::string path = (fs::path(dir) / kBackupManifest).string();
  absl::StatusOr<std::string> text = ReadFile(path, kMaxManifestBytes, "backup manifest");
  if (!text.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, " is not a Rebound backup: ", text.status().message()));
  }
  const nlohmann::json manifest = nlohmann::json::parse(*text, nullptr, false);
  if (!manifest.is_object() || manifest.value("format", "") != kFormat ||
      !manifest.contains("format_version") || !manifest["format_version"].is_number_integer() ||
      !manifest.contains("files") || !manifest["files"].is_array()) {
    return absl::DataLossError(absl::StrCat(path, ": not a Rebound backup manifest"));
  }
  const int version = manifest["format_version"].get<int>();
  if (version > kBackupFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": backup format version ", version, " is newer than this server's (",
        kBackupFormatVersion, "): restore it with the Rebound version that made it or a later one"));
  }
  BackupInfo info;
  info.epoch = manifest.value("epoch", uint64_t{0});
  info.sequence = manifest.value("sequence", uint64_t{0});
  info.server_version = manifest.value("server_version", "");
  info.created_unix_ms = manifest.value("created_unix_ms", int64_t{0});
  info.data_format_version = manifest.value("data_format_version", kUnrecordedDataFormat);
  if (info.data_format_version > kDataFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": the backup holds a data directory of format ", info.data_format_version,
        ", newer than format ", kDataFormatVersion, " that this server reads: restore it with the "
        "Rebound version that made it or a later one (docs/upgrading.md)"));
  }
  std::map<std::string, bool> listed;
  for (const nlohmann::json& file : manifest["files"]) {
    const std::string name = file.value("path", "");
    if (name.empty() || !file.contains("bytes") || !file.contains("xxh64")) {
      return absl::DataLossError(absl::StrCat(path, ": a file entry without path, bytes or xxh64"));
    }
    listed[name] = true;
    const fs::path file_path = fs::path(dir) / name;
    std::error_code error;
    if (!fs::is_regular_file(file_path, error)) {
      return absl::DataLossError(absl::StrCat("backup ", dir, ": ", name, " is missing"));
    }
    ASSIGN_OR_RETURN(const FileFacts facts, Facts(file_path));
    if (facts.bytes != file.value("bytes", int64_t{-1}) ||
        facts.xxh64 != file.value("xxh64", "")) {
      return absl::DataLossError(absl::StrCat(
          "backup ", dir, ": ", name, " is damaged: ", facts.bytes, " bytes with xxh64 ",
          facts.xxh64, ", the manifest says ", file.value("bytes", int64_t{-1}), " bytes with ",
          file.value("xxh64", "")));
    }
    ++info.files;
    info.bytes += facts.bytes;
  }
  ASSIGN_OR_RETURN(const std::vector<std::string> present, ListFiles(dir));
  for (const std::string& name : present) {
    if (listed.count(name) == 0) {
      return absl::DataLossError(
          absl::StrCat("backup ", dir, ": ", name, " is not in the manifest"));
    }
  }
  return info;
}

absl::StatusOr<BackupInfo> RestoreBackup(const std::string& backup_dir,
                                         const std::string& data_dir) {
  ASSIGN_OR_RETURN(const BackupInfo info, VerifyBackup(backup_dir));
  std::error_code error;
  if (fs::exists(data_dir, error) && !fs::is_empty(data_dir, error)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "restoring ", backup_dir, ": the data directory ", data_dir,
        " is not empty; a restore never overwrites state (move it away first)"));
  }
  const std::string restoring = data_dir + ".restoring";
  fs::remove_all(restoring, error);
  fs::create_directories(restoring, error);
  if (error) return FileError(absl::StrCat("creating ", restoring), error);
  ASSIGN_OR_RETURN(const std::vector<std::string> files, ListFiles(backup_dir));
  for (const std::string& file : files) {
    const fs::path to = fs::path(restoring) / file;
    fs::create_directories(to.parent_path(), error);
    fs::copy_file(fs::path(backup_dir) / file, to, error);
    if (error) return FileError(absl::StrCat("copying ", file, " to ", restoring), error);
  }
  RETURN_IF_ERROR(WriteDataFormat(restoring, info.data_format_version));
  ::sync();
  fs::remove(data_dir, error);  // absent or empty
  fs::rename(restoring, data_dir, error);
  if (error) return FileError(absl::StrCat("renaming ", restoring, " to ", data_dir), error);
  {
    DurableStoreOptions options;
    options.data_dir = data_dir;
    ASSIGN_OR_RETURN(const std::unique_ptr<DurableStore> store, DurableStore::Open(options));
    const DurableStore::Position position = store->LastApplied();
    if (position.epoch != info.epoch || position.sequence != info.sequence) {
      return absl::DataLossError(absl::StrCat(
          "the restored store opens at (epoch ", position.epoch, ", sequence ", position.sequence,
          "), the backup's manifest says (", info.epoch, ", ", info.sequence, ")"));
    }
  }
  return info;
}

}  // namespace rebound::storage
