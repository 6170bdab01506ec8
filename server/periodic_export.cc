#include "server/periodic_export.h"

#include <glog/logging.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checksum.h"
#include "common/export_file.h"
#include "common/file.h"

namespace rebound::server {
namespace {

namespace fs = std::filesystem;

constexpr char kLatest[] = "latest.safetensors";
constexpr char kPrefix[] = "model-v";
constexpr char kSuffix[] = ".safetensors";

int64_t TotalVersion(const ExportCenterResponse& exported) {
  int64_t total = 0;
  for (const ExportedStage& stage : exported.stages()) total += stage.center_version();
  return total;
}

// Points `dir`/latest.safetensors at `name` in one rename, so a reader never finds it missing.
absl::Status PointLatestAt(const std::string& dir, const std::string& name) {
  const fs::path link = fs::path(dir) / kLatest;
  const fs::path temp = fs::path(dir) / absl::StrCat(kLatest, ".tmp");
  std::error_code error;
  fs::remove(temp, error);
  fs::create_symlink(name, temp, error);
  if (!error) fs::rename(temp, link, error);
  if (error) {
    fs::remove(temp, error);
    return absl::UnavailableError(
        absl::StrCat("cannot point ", link.string(), " at ", name, ": ", error.message()));
  }
  return absl::OkStatus();
}

}  // namespace

std::string ExportFileName(int64_t total_version) {
  return absl::StrFormat("%s%010d%s", kPrefix, total_version, kSuffix);
}

PeriodicExporter::PeriodicExporter(const ExportConfig& config, std::string dir,
                                   const Clock* clock, ExportSource source)
    : config_(config), dir_(std::move(dir)), clock_(clock), source_(std::move(source)) {}

absl::Status PeriodicExporter::Init() {
  std::error_code error;
  fs::create_directories(dir_, error);
  if (error) {
    return absl::UnavailableError(
        absl::StrCat("export.dir: cannot create ", dir_, ": ", error.message()));
  }
  if (config_.every_steps() > 0) step_bucket_ = source_.job_step() / config_.every_steps();
  last_export_ = clock_->Now();
  return absl::OkStatus();
}

void PeriodicExporter::Run(const absl::Notification* stop) {
  absl::Duration tick = absl::Milliseconds(100);
  if (config_.every_seconds() > 0) tick = std::min(tick, absl::Seconds(config_.every_seconds()));
  while (!clock_->WaitFor(tick, stop)) {
    absl::StatusOr<std::optional<std::string>> written = Pass();
    if (!written.ok()) {
      LOG(WARNING) << "export to " << dir_ << " failed (training goes on; next try when due): "
                   << written.status();
    }
  }
}

absl::StatusOr<std::optional<std::string>> PeriodicExporter::Pass() {
  bool due = false;
  if (config_.every_steps() > 0) {
    const int64_t bucket = source_.job_step() / config_.every_steps();
    if (bucket > step_bucket_) {
      step_bucket_ = bucket;
      due = true;
    }
  }
  if (config_.every_seconds() > 0 &&
      clock_->Now() - last_export_ >= absl::Seconds(config_.every_seconds())) {
    due = true;
  }
  if (!due) return std::optional<std::string>();
  return Write();
}

absl::StatusOr<std::optional<std::string>> PeriodicExporter::ExportIfMoved() { return Write(); }

absl::StatusOr<std::optional<std::string>> PeriodicExporter::Write() {
  // The time schedule restarts at each attempt, failed or not: a failing disk is retried once
  // per period, not at every pass.
  last_export_ = clock_->Now();
  const int64_t job_step = source_.job_step();
  absl::StatusOr<ExportCenterResponse> exported = source_.read();
  if (!exported.ok()) {
    failed_.fetch_add(1, std::memory_order_relaxed);
    return exported.status();
  }
  const int64_t version = TotalVersion(*exported);
  if (version == exported_version_) return std::optional<std::string>();
  absl::StatusOr<std::string> bytes =
      ExportToSafetensors(*exported, {{"rebound.job_step", absl::StrCat(job_step)}});
  if (!bytes.ok()) {
    failed_.fetch_add(1, std::memory_order_relaxed);
    return bytes.status();
  }
  const std::string name = ExportFileName(version);
  const std::string path = (fs::path(dir_) / name).string();
  const std::string sum =
      absl::StrFormat("%016x  %s\n", Checksum(bytes->data(), bytes->size()), name);
  absl::Status status = WriteFileDurably(path, *bytes);
  if (status.ok()) status = WriteFileDurably(absl::StrCat(path, ".xxh64"), sum);
  if (status.ok()) status = PointLatestAt(dir_, name);
  if (!status.ok()) {
    failed_.fetch_add(1, std::memory_order_relaxed);
    return status;
  }
  exported_version_ = version;
  written_.fetch_add(1, std::memory_order_relaxed);
  last_center_version_.store(version, std::memory_order_relaxed);
  LOG(INFO) << "exported the center (version " << version << ", job step " << job_step << ", "
            << bytes->size() << " bytes) to " << path;
  Prune();
  return std::optional<std::string>(path);
}

void PeriodicExporter::Prune() {
  if (config_.keep_last() <= 0) return;
  std::vector<std::pair<fs::file_time_type, fs::path>> exports;
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir_, error)) {
    const std::string name = entry.path().filename().string();
    if (!absl::StartsWith(name, kPrefix) || !absl::EndsWith(name, kSuffix)) continue;
    std::error_code time_error;
    const fs::file_time_type time = entry.last_write_time(time_error);
    if (!time_error) exports.emplace_back(time, entry.path());
  }
  if (error || static_cast<int64_t>(exports.size()) <= config_.keep_last()) return;
  std::sort(exports.begin(), exports.end());  // oldest first
  const size_t drop = exports.size() - config_.keep_last();
  for (size_t i = 0; i < drop; ++i) {
    std::error_code removed;
    fs::remove(exports[i].second, removed);
    fs::remove(fs::path(exports[i].second.string() + ".xxh64"), removed);
  }
}

PeriodicExporter::Stats PeriodicExporter::stats() const {
  Stats stats;
  stats.written = written_.load(std::memory_order_relaxed);
  stats.failed = failed_.load(std::memory_order_relaxed);
  stats.last_center_version = last_center_version_.load(std::memory_order_relaxed);
  return stats;
}

}  // namespace rebound::server
