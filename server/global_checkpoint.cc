#include "server/global_checkpoint.h"

#include <glog/logging.h>

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file.h"
#include "common/status_macros.h"

namespace rebound::server {
namespace {

constexpr char kPrefix[] = "checkpoint-";
constexpr char kSuffix[] = ".pb";

// The step of a checkpoint file's name, or -1.
int64_t StepOfFile(const std::string& name) {
  if (!absl::StartsWith(name, kPrefix) || !absl::EndsWith(name, kSuffix)) return -1;
  const std::string digits =
      name.substr(sizeof(kPrefix) - 1, name.size() - (sizeof(kPrefix) - 1) - (sizeof(kSuffix) - 1));
  int64_t step = -1;
  if (!absl::SimpleAtoi(digits, &step) || step < 0) return -1;
  return step;
}

}  // namespace

GlobalCheckpoint::GlobalCheckpoint(const JobConfig& job, std::string dir, CheckpointRecord initial,
                                   const Clock* clock)
    : job_id_(job.job_id()),
      num_slots_(job.topology().replicas() * job.topology().stages()),
      every_(job.fault_tolerance().checkpoint_every_steps()),
      max_steps_(job.training().max_steps()),
      dir_(std::move(dir)),
      clock_(clock) {
  initial.set_job_id(job_id_);
  initial.set_step(0);
  current_ = std::move(initial);
}

absl::Status GlobalCheckpoint::Load() {
  if (dir_.empty()) return absl::OkStatus();
  std::error_code error;
  if (!std::filesystem::exists(dir_, error)) return absl::OkStatus();
  int64_t newest = -1;
  std::string newest_path;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, error)) {
    const int64_t step = StepOfFile(entry.path().filename().string());
    if (step > newest) {
      newest = step;
      newest_path = entry.path().string();
    }
  }
  if (error) {
    return absl::UnavailableError(absl::StrCat("cannot list ", dir_, ": ", error.message()));
  }
  if (newest < 0) return absl::OkStatus();
  const absl::StatusOr<std::string> bytes =
      ReadFile(newest_path, kNoFileSizeLimit, "global checkpoint");
  if (!bytes.ok()) {
    return absl::DataLossError(absl::StrCat("cannot read ", newest_path, ": ",
                                            bytes.status().message()));
  }
  CheckpointRecord record;
  if (!record.ParseFromString(*bytes)) {
    return absl::DataLossError(absl::StrCat(newest_path, " is not a checkpoint record"));
  }
  if (record.job_id() != job_id_ || record.step() != newest) {
    return absl::DataLossError(absl::StrCat(newest_path, " holds step ", record.step(),
                                            " of job \"", record.job_id(), "\", not this job's (\"",
                                            job_id_, "\") step ", newest));
  }
  absl::MutexLock lock(&mu_);
  current_ = std::move(record);
  completed_step_ = newest;
  LOG(INFO) << "global checkpoint of step " << newest << " loaded from " << newest_path;
  return absl::OkStatus();
}

bool GlobalCheckpoint::IsCut(int64_t step) const {
  return step > 0 && (step % every_ == 0 || step == max_steps_);
}

absl::Status GlobalCheckpoint::Persist(const CheckpointRecord& record) const {
  if (dir_.empty()) return absl::OkStatus();
  std::error_code error;
  std::filesystem::create_directories(dir_, error);
  if (error)
    return absl::UnavailableError(absl::StrCat("cannot create ", dir_, ": ", error.message()));
  const std::string name = absl::StrCat(kPrefix, record.step(), kSuffix);
  const std::string path = absl::StrCat(dir_, "/", name);
  std::string bytes;
  if (!record.SerializeToString(&bytes)) {
    return absl::InternalError("cannot serialize the checkpoint");
  }
  RETURN_IF_ERROR(WriteFileDurably(path, bytes));
  // Then the older checkpoints go.
  for (const auto& entry : std::filesystem::directory_iterator(dir_, error)) {
    const std::string file = entry.path().filename().string();
    const int64_t step = StepOfFile(file);
    if (file != name && (step >= 0 || absl::EndsWith(file, ".tmp"))) {
      std::filesystem::remove(entry.path(), error);
    }
  }
  return absl::OkStatus();
}

uint64_t GlobalCheckpoint::epoch() const {
  absl::MutexLock lock(&mu_);
  return epoch_;
}

absl::Status GlobalCheckpoint::Arrive(int slot_index, int64_t step, uint64_t epoch,
                                      absl::Duration timeout, const TakeFn& take) {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  if (epoch != epoch_) {
    return absl::AbortedError(
        absl::StrCat("GLOBAL_CHECKPOINT: every slot was rolled back to the checkpoint of step ",
                     current_.step(), " after this sync of step ", step, " was applied"));
  }
  if (frozen_) {
    return absl::AbortedError(absl::StrCat(
        "GLOBAL_CHECKPOINT: every slot is being rolled back to the checkpoint of step ",
        current_.step(), "; this sync of step ", step, " is undone"));
  }
  if (step <= completed_step_) return absl::OkStatus();
  if (pending_step_ == 0) pending_step_ = step;
  if (step != pending_step_) {
    return absl::InternalError(absl::StrCat("slot ", slot_index, " arrived at cut ", step,
                                            " while the barrier waits at cut ", pending_step_));
  }
  arrived_.emplace(slot_index, now);  // a retry keeps its first arrival
  if (static_cast<int>(arrived_.size()) == num_slots_) {
    const absl::Time started = clock_->Now();
    absl::StatusOr<CheckpointRecord> record = take(step, current_.step());
    if (record.ok()) {
      record->set_job_id(job_id_);
      record->set_step(step);
    }
    absl::Status persisted = record.ok() ? Persist(*record) : record.status();
    const absl::Time released = clock_->Now();
    write_ += released - started;
    for (const auto& [slot, arrived_at] : arrived_) barrier_wait_ += released - arrived_at;
    if (persisted.ok()) {
      bytes_ = static_cast<int64_t>(record->ByteSizeLong());
      current_ = *std::move(record);
      ++count_;
      LOG(INFO) << "global checkpoint of step " << step << " taken: " << bytes_ << " bytes in "
                << absl::ToInt64Milliseconds(released - started) << " ms";
    } else {
      LOG(ERROR) << "global checkpoint of step " << step << " failed (" << persisted
                 << "); keeping the checkpoint of step " << current_.step();
    }
    completed_step_ = step;
    pending_step_ = 0;
    arrived_.clear();
    return absl::OkStatus();
  }
  auto released = [this, step, epoch]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return completed_step_ >= step || epoch_ != epoch || frozen_;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&released), timeout)) {
    std::vector<int> missing;
    for (int s = 0; s < num_slots_; ++s) {
      if (arrived_.count(s) == 0) missing.push_back(s);
    }
    return absl::UnavailableError(absl::StrCat("GLOBAL_CHECKPOINT: waiting at the barrier of step ",
                                               step, " for slot(s) ", absl::StrJoin(missing, ", "),
                                               "; retry"));
  }
  if (epoch_ != epoch || (frozen_ && completed_step_ < step)) {
    return absl::AbortedError(
        absl::StrCat("GLOBAL_CHECKPOINT: every slot was rolled back to the checkpoint of step ",
                     current_.step(), " while this sync waited at the barrier of step ", step));
  }
  return absl::OkStatus();
}

CheckpointRecord GlobalCheckpoint::Freeze() {
  absl::MutexLock lock(&mu_);
  frozen_ = true;
  return current_;
}

CheckpointRecord GlobalCheckpoint::BeginRollback() {
  absl::MutexLock lock(&mu_);
  frozen_ = false;
  ++epoch_;
  pending_step_ = 0;
  arrived_.clear();
  completed_step_ = current_.step();
  return current_;
}

CheckpointRecord GlobalCheckpoint::Current() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

void GlobalCheckpoint::FillStatus(CheckpointStatus* out) const {
  absl::MutexLock lock(&mu_);
  out->set_every_steps(every_);
  out->set_step(current_.step());
  out->set_count(count_);
  out->set_barrier_wait_ms(absl::ToInt64Milliseconds(barrier_wait_));
  out->set_write_ms(absl::ToInt64Milliseconds(write_));
  out->set_bytes(bytes_);
  out->set_rollbacks(static_cast<int64_t>(epoch_));
  out->set_pending_step(pending_step_);
  out->set_pending_arrived(static_cast<int>(arrived_.size()));
}

}  // namespace rebound::server
