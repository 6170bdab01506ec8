#pragma once

// PeriodicExporter: the trained center written to files a user can load while the job trains
// (job config `export { ... }`, docs/design.md §12, docs/operations.md#exports-while-training).
//
// Each export is the whole center, every stage at a committed version (ExportSource::read), in
// one safetensors file named after the center's total version (the sum of its stages' versions):
// model-v<10 digits>.safetensors. It is written beside as "<name>.tmp", fsynced and renamed into
// place (common/file.h WriteFileDurably), with a checksum file "<name>.xxh64" ("<16 hex
// digits>  <name>", the xxhsum format), and latest.safetensors, a symbolic link, is switched to
// it. The newest keep_last exports are kept (by modification time: a restored server's versions
// may be lower than older files'), the rest deleted with their checksum files.
//
// When an export is due (Pass):
//  * every_steps > 0: the job's step (ExportSource::job_step: the newest step whose update the
//    center applied, over every slot) reached a multiple of every_steps it had not reached at the
//    last pass (a restarted server starts counting from the step it restarted at);
//  * every_seconds > 0: every_seconds passed since the last export (or the exporter's start);
// and in both cases only when the center moved since the last export. ExportIfMoved writes one
// regardless of the schedule (the server's orderly stop).
//
// Failures (a full disk, a directory that went away) never stop training: Pass returns the
// error, Run logs it, counts it, and tries again at the next due time.
//
// Thread-safety: one thread at a time: Run's, and the owner's after Run returned. Stats may be
// read from any thread.
// Ownership: owns copies of the config and the source's functions; borrows the clock, which must
// outlive it.
// Status codes: Init: UNAVAILABLE when the directory cannot be created. Pass / ExportIfMoved:
// the source's errors (e.g. FAILED_PRECONDITION: no model declared yet), UNAVAILABLE when a file
// cannot be written, INVALID_ARGUMENT from the encoder.

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"

namespace rebound::server {

struct ExportSource {
  // The whole center at committed versions, as ExportCenter answers it.
  std::function<absl::StatusOr<ExportCenterResponse>()> read;
  // The newest step whose sync or push the center applied, over every slot (0 before any).
  std::function<int64_t()> job_step;
};

class PeriodicExporter {
 public:
  // `dir`: where the files go (the config's dir, or the data directory's exports/).
  PeriodicExporter(const ExportConfig& config, std::string dir, const Clock* clock,
                   ExportSource source);

  PeriodicExporter(const PeriodicExporter&) = delete;
  PeriodicExporter& operator=(const PeriodicExporter&) = delete;

  // Creates the directory and starts the schedule at the job's current step and the clock's now.
  absl::Status Init();

  // Passes until `stop` is notified, one every 100 ms (a job's step may cross several multiples
  // of every_steps between two: one export for them); logs each export and each failure.
  void Run(const absl::Notification* stop);

  // One pass: the path of the export written, nullopt when none was due or the center had not
  // moved.
  absl::StatusOr<std::optional<std::string>> Pass();

  // An export now, unless the center has not moved since the last one (nullopt then).
  absl::StatusOr<std::optional<std::string>> ExportIfMoved();

  struct Stats {
    int64_t written = 0;
    int64_t failed = 0;
    int64_t last_center_version = -1;  // the total version of the newest export; -1: none yet
  };
  Stats stats() const;

  const std::string& dir() const { return dir_; }

 private:
  absl::StatusOr<std::optional<std::string>> Write();
  void Prune();

  const ExportConfig config_;
  const std::string dir_;
  const Clock* const clock_;
  const ExportSource source_;

  int64_t step_bucket_ = 0;          // job_step / every_steps at the last pass
  absl::Time last_export_;           // or the start
  int64_t exported_version_ = -1;    // the total center version of the last export
  std::atomic<int64_t> written_{0};
  std::atomic<int64_t> failed_{0};
  std::atomic<int64_t> last_center_version_{-1};
};

// The name of the export of a center whose stages' versions sum to `total_version`.
std::string ExportFileName(int64_t total_version);

}  // namespace rebound::server
