#include "storage/format_version.h"

#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/file.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "glog/logging.h"

namespace rebound::storage {
namespace {

namespace fs = std::filesystem;

constexpr char kPrefix[] = "rebound data directory format ";
constexpr int64_t kMaxFormatFileBytes = 4096;

std::string FormatPath(const std::string& data_dir) {
  return (fs::path(data_dir) / kDataFormatFile).string();
}

// The migrations from each older format to the next; none yet (format 1 is the first).
const std::vector<DataFormatMigration>& Migrations() {
  static const auto* migrations = new std::vector<DataFormatMigration>();
  return *migrations;
}

}  // namespace

absl::StatusOr<std::optional<int>> ReadDataFormat(const std::string& data_dir) {
  const std::string path = FormatPath(data_dir);
  std::error_code error;
  if (!fs::exists(path, error)) {
    if (error && error != std::errc::no_such_file_or_directory) {
      return absl::UnavailableError(absl::StrCat(path, ": ", error.message()));
    }
    return std::nullopt;
  }
  absl::StatusOr<std::string> text = ReadFile(path, kMaxFormatFileBytes, "data format file");
  if (!text.ok()) {
    return absl::UnavailableError(text.status().message());
  }
  absl::string_view line = absl::StripTrailingAsciiWhitespace(*text);
  int format = 0;
  if (!absl::ConsumePrefix(&line, kPrefix) || !absl::SimpleAtoi(line, &format) || format < 1) {
    return absl::DataLossError(absl::StrCat(
        path, ": not a Rebound data format file (expected \"", kPrefix, "<N>\", N >= 1)"));
  }
  return format;
}

absl::Status WriteDataFormat(const std::string& data_dir, int format) {
  return WriteFileDurably(FormatPath(data_dir), absl::StrCat(kPrefix, format, "\n"));
}

absl::Status CheckDataFormat(const std::string& data_dir, int current) {
  ASSIGN_OR_RETURN(std::optional<int> format, ReadDataFormat(data_dir));
  if (!format.has_value() || *format <= current) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "data directory ", data_dir, " has format ", *format, ", newer than format ", current,
      " that rebound ", ProjectVersion(), " reads: it was written by a newer Rebound. Run that "
      "release (or a newer one) on it, or start this one on a backup made before the upgrade "
      "(docs/upgrading.md#the-data-directory-format)"));
}

absl::StatusOr<std::unique_ptr<DurableStore>> OpenDataDir(const DurableStoreOptions& options) {
  return OpenDataDir(options, kDataFormatVersion, Migrations());
}

absl::StatusOr<std::unique_ptr<DurableStore>> OpenDataDir(
    const DurableStoreOptions& options, int current,
    const std::vector<DataFormatMigration>& migrations) {
  if (options.data_dir.empty()) return DurableStore::Open(options);
  const std::string& dir = options.data_dir;
  RETURN_IF_ERROR(CheckDataFormat(dir, current));
  ASSIGN_OR_RETURN(std::optional<int> recorded, ReadDataFormat(dir));
  // RocksDB's CURRENT names its manifest: a directory that has it holds a store.
  std::error_code error;
  const bool existing = fs::exists(fs::path(dir) / "CURRENT", error);
  ASSIGN_OR_RETURN(std::unique_ptr<DurableStore> store, DurableStore::Open(options));
  int format = current;
  if (recorded.has_value()) {
    format = *recorded;
  } else if (existing) {
    format = kUnrecordedDataFormat;
  }
  if (recorded.has_value() && format == current) return store;
  if (!recorded.has_value() && existing) {
    LOG(INFO) << "data directory " << dir << " has no " << kDataFormatFile
              << " file (made by rebound " << kVersionBeforeExchange
              << " or older): it is format " << kUnrecordedDataFormat;
  }
  for (; format < current; ++format) {
    const DataFormatMigration* step = nullptr;
    for (const DataFormatMigration& migration : migrations) {
      if (migration.from == format) step = &migration;
    }
    if (step == nullptr) {
      return absl::InternalError(absl::StrCat("no migration of data directory ", dir,
                                              " from format ", format, " to ", format + 1));
    }
    absl::Status migrated = step->migrate(store.get());
    if (!migrated.ok()) {
      return absl::Status(migrated.code(),
                          absl::StrCat("migrating data directory ", dir, " from format ", format,
                                       " to ", format + 1, ": ", migrated.message()));
    }
    // Each step recorded: a crash between two steps resumes at the next one.
    RETURN_IF_ERROR(WriteDataFormat(dir, format + 1));
    LOG(WARNING) << "migrated data directory " << dir << " from format " << format << " to "
                 << format + 1;
  }
  RETURN_IF_ERROR(WriteDataFormat(dir, current));
  return store;
}

}  // namespace rebound::storage
