#pragma once

// The launcher's command line, the workers it starts for a job, and the config files it writes
// into its work dir. Pure functions: nothing here touches processes or the network, so every rule
// is unit-tested (tests/launch/options_test.cc).

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/config.pb.h"

namespace rebound::launch {

// The usage text printed for --help and after a flag error.
extern const char kUsage[];

// A slot (r, s) of the R x S grid.
struct SlotCoord {
  int replica = 0;
  int stage = 0;

  bool operator==(const SlotCoord& other) const {
    return replica == other.replica && stage == other.stage;
  }
  bool operator!=(const SlotCoord& other) const { return !(*this == other); }
};

struct LaunchOptions {
  std::string job_file;       // --job, required
  std::string data_dir;       // --data_dir: the server's RocksDB directory; empty = in memory
  int port = 0;               // --port: the server's port on 127.0.0.1; 0 = any free port
  std::string workdir;        // --workdir: empty = a fresh directory under /tmp
  // --kill_trainer_at_step: SIGKILL the trainer of kill_slot once its step reaches this.
  std::optional<int64_t> kill_trainer_at_step;
  SlotCoord kill_slot;        // --kill_slot R,S (default 0,0)
  std::string progress_csv;   // --progress_csv: append progress rows here; empty = none
  int timeout_s = 0;          // --timeout_s: give up after this long (exit 1); 0 = never
  std::string server_binary;  // --server_binary: empty = found next to the launcher
  std::string worker_binary;  // --worker_binary: empty = found next to the launcher
  // --worker_command: run this command (split at spaces, no quoting) instead of rebound_worker,
  // with --server, --name and --role appended; e.g. a Python worker (docs/python.md).
  std::string worker_command;
  bool help = false;          // --help
};

// Parses the arguments after argv[0]. Flags are "--name value" or "--name=value"; a repeated
// flag keeps its last value. INVALID_ARGUMENT names the offending flag for an unknown flag, a
// missing or malformed value, a positional argument, or a missing --job (unless --help).
absl::StatusOr<LaunchOptions> ParseLaunchArgs(const std::vector<std::string>& args);

// Parses "R,S" (two non-negative integers, optional spaces around them).
absl::StatusOr<SlotCoord> ParseSlot(const std::string& text);

// Checks the options that depend on the job: --kill_slot must lie inside the R x S grid.
absl::Status CheckOptionsAgainstJob(const LaunchOptions& options, const JobConfig& job);

enum class LaunchRole { kTrainer, kSpare, kEvaluator };

// The value of rebound_worker's --role flag for `role`.
const char* RoleFlag(LaunchRole role);

// One worker the launcher starts.
struct WorkerPlan {
  std::string name;
  LaunchRole role = LaunchRole::kTrainer;
  std::optional<SlotCoord> slot;  // trainers: the slot it is expected to own
};

// The workers of a job in start order: R x S trainers in slot order (replica-major, the order in
// which the server hands out slots), named trainer-r<r>s<s>; then topology.spares spares named
// spare-<i>; then one evaluator named "evaluator" if topology.evaluator. REQUIRES: a valid job.
std::vector<WorkerPlan> PlanWorkers(const JobConfig& job);

// server.pbtxt for the launcher's server: listens on 127.0.0.1:<port>, names the job by
// `job_file` (must be absolute: the config lives in the work dir) and, when `data_dir` is not
// empty, keeps durable state there (absolute as well).
std::string ServerConfigText(const std::string& job_file, int port, const std::string& data_dir);

// worker.pbtxt for the launcher's workers: joins only `job_id`, 10 s RPC deadline, retry backoff
// from 100 ms to 2000 ms.
std::string WorkerConfigText(const std::string& job_id);

// `path` made absolute against the current directory (lexically; the file need not exist).
std::string AbsolutePath(const std::string& path);

}  // namespace rebound::launch
