#include "server/shard/range_checkpoint_files.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/status_macros.h"

namespace rebound::server {
namespace {

constexpr char kSuffix[] = ".pb";

}  // namespace

RangeCheckpointFiles::RangeCheckpointFiles(std::string job_id, int range, std::string dir)
    : job_id_(std::move(job_id)),
      range_(range),
      dir_(std::move(dir)),
      prefix_(absl::StrCat("range-", range, "-")) {}

std::string RangeCheckpointFiles::PathOf(int64_t step) const {
  return absl::StrCat(dir_, "/", prefix_, step, kSuffix);
}

absl::StatusOr<std::vector<int64_t>> RangeCheckpointFiles::Steps() const {
  absl::MutexLock lock(&mu_);
  std::vector<int64_t> steps;
  if (dir_.empty()) {
    for (const auto& [step, record] : memory_) steps.push_back(step);
    return steps;
  }
  std::error_code error;
  if (!std::filesystem::exists(dir_, error)) return steps;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, error)) {
    const std::string name = entry.path().filename().string();
    if (!absl::StartsWith(name, prefix_) || !absl::EndsWith(name, kSuffix)) continue;
    int64_t step = -1;
    if (absl::SimpleAtoi(name.substr(prefix_.size(),
                                     name.size() - prefix_.size() - (sizeof(kSuffix) - 1)),
                         &step) &&
        step >= 0) {
      steps.push_back(step);
    }
  }
  if (error) {
    return absl::UnavailableError(absl::StrCat("cannot list ", dir_, ": ", error.message()));
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

absl::StatusOr<int64_t> RangeCheckpointFiles::Put(CheckpointRecord record, int64_t keep_from) {
  record.set_job_id(job_id_);
  const int64_t step = record.step();
  const int64_t bytes = static_cast<int64_t>(record.ByteSizeLong());
  ASSIGN_OR_RETURN(const std::vector<int64_t> held, Steps());
  absl::MutexLock lock(&mu_);
  if (dir_.empty()) {
    memory_[step] = std::move(record);
  } else {
    std::error_code error;
    std::filesystem::create_directories(dir_, error);
    if (error) {
      return absl::UnavailableError(absl::StrCat("cannot create ", dir_, ": ", error.message()));
    }
    std::string serialized;
    if (!record.SerializeToString(&serialized)) {
      return absl::InternalError("cannot serialize the range checkpoint");
    }
    RETURN_IF_ERROR(WriteFileDurably(PathOf(step), serialized));
  }
  for (const int64_t old : held) {
    if (old >= keep_from || old == step) continue;
    if (dir_.empty()) {
      memory_.erase(old);
    } else {
      std::error_code error;
      std::filesystem::remove(PathOf(old), error);
    }
  }
  return bytes;
}

absl::StatusOr<CheckpointRecord> RangeCheckpointFiles::Get(int64_t step) const {
  absl::MutexLock lock(&mu_);
  if (dir_.empty()) {
    auto it = memory_.find(step);
    if (it == memory_.end()) {
      return absl::NotFoundError(
          absl::StrCat("range ", range_, " holds no checkpoint of step ", step));
    }
    return it->second;
  }
  const std::string path = PathOf(step);
  std::error_code error;
  if (!std::filesystem::exists(path, error)) {
    return absl::NotFoundError(absl::StrCat("range ", range_, " holds no checkpoint of step ",
                                            step, " (no file ", path, ")"));
  }
  ASSIGN_OR_RETURN(const std::string bytes, ReadFile(path, kNoFileSizeLimit, "range checkpoint"));
  CheckpointRecord record;
  if (!record.ParseFromString(bytes)) {
    return absl::DataLossError(absl::StrCat(path, " is not a checkpoint record"));
  }
  if (record.job_id() != job_id_ || record.step() != step) {
    return absl::DataLossError(absl::StrCat(path, " holds step ", record.step(), " of job \"",
                                            record.job_id(), "\", not this job's (\"", job_id_,
                                            "\") step ", step));
  }
  return record;
}

}  // namespace rebound::server
