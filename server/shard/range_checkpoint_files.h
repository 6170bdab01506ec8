#pragma once

// RangeCheckpointFiles: where a range group of a sharded job keeps its part of each
// GLOBAL_CHECKPOINT cut (docs/sharding.md#global-checkpoint): a CheckpointRecord per step with
// the group's range of every stage's center and every slot's range snapshot at that step.
//
// A range group keeps every range checkpoint that group 0 may still roll back to: group 0 keeps
// its own checkpoint of step C until the next cut has been persisted everywhere, so each cut
// request carries C (`keep_from`) and the range checkpoints below it go. A cut that fails in
// some group leaves the others one checkpoint more, which the next cut removes.
//
// With a directory: one file per step, <dir>/range-<range>-<step>.pb, written durably
// (common/file.h WriteFileDurably), read back at a rollback and listed at start. Without one
// (a server without a data directory): in memory.
//
// Thread-safety: thread-safe. Ownership: records are copied in and out. Status codes:
// UNAVAILABLE (a file cannot be written or listed), NOT_FOUND (no checkpoint of a step),
// DATA_LOSS (a file that does not parse or is another job's or range's).

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/storage.pb.h"

namespace rebound::server {

class RangeCheckpointFiles {
 public:
  // `dir` empty: in memory.
  RangeCheckpointFiles(std::string job_id, int range, std::string dir);

  // The steps held (from the directory's file names, or memory), ascending.
  absl::StatusOr<std::vector<int64_t>> Steps() const ABSL_LOCKS_EXCLUDED(mu_);
  // Keeps `record` (job_id and range set here), then drops every checkpoint below `keep_from`
  // other than it. Returns its size in bytes.
  absl::StatusOr<int64_t> Put(CheckpointRecord record, int64_t keep_from) ABSL_LOCKS_EXCLUDED(mu_);
  // The checkpoint of `step`.
  absl::StatusOr<CheckpointRecord> Get(int64_t step) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  std::string PathOf(int64_t step) const;

  const std::string job_id_;
  const int range_;
  const std::string dir_;
  const std::string prefix_;  // "range-<range>-"

  mutable absl::Mutex mu_;
  std::map<int64_t, CheckpointRecord> memory_ ABSL_GUARDED_BY(mu_);  // dir_ empty only
};

}  // namespace rebound::server
