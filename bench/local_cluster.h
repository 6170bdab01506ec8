#pragma once

// A real Rebound cluster on loopback for the benchmarks that measure one (weighting,
// logging_overhead, recovery, failures): the flags that say where its binaries and job are, the
// working directory its runs keep their configs and logs in, and LocalCluster: the testing/cluster
// library's Cluster, which starts rebound_server and rebound_worker processes, watches them
// through GetStatus, kills the ones a benchmark means to fail and stops the rest.

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/flags.h"
#include "proto/config.pb.h"
#include "testing/cluster/cluster.h"

namespace rebound::bench {

// The flags every local-cluster benchmark takes.
struct ClusterFlags {
  std::string job;            // --job: configs/job.pbtxt from the runfiles when empty
  std::string server_binary;  // --server_binary: server/rebound_server from the runfiles
  std::string worker_binary;  // --worker_binary: worker/rebound_worker from the runfiles
  bool keep_logs = false;     // --keep_logs: keep every run's directory, not only failed ones'

  // Adds --job, --server_binary, --worker_binary and --keep_logs to `command_line`.
  void AddTo(CommandLine* command_line);
};

// Fills in the paths left empty from the runfiles (//bench:local_cluster carries the binaries
// and //configs) and loads the job. INVALID_ARGUMENT, with a message meant to be printed above
// the usage line, when a binary cannot be found or the job cannot be loaded.
absl::StatusOr<JobConfig> ResolveClusterFlags(ClusterFlags* flags);

// A benchmark's working directory, /tmp/rebound-<name>-XXXXXX, with one subdirectory per run.
// A run's subdirectory is removed when the run succeeded and the whole directory at the end when
// every run did, unless --keep_logs; a failed run's logs are always kept.
class RunDirectories {
 public:
  // INTERNAL when the directory cannot be created.
  static absl::StatusOr<RunDirectories> Create(const std::string& name, bool keep_logs);

  const std::string& path() const { return path_; }
  bool all_ok() const { return all_ok_; }

  // Creates path()/run and returns it.
  std::string StartRun(const std::string& run) const;

  // Records how the run in `dir` (from StartRun) ended; removes `dir` when it succeeded.
  void FinishRun(const std::string& dir, bool ok);

  // When a run failed, prints "some runs FAILED; their logs are kept in <path>"; else removes
  // path(). REQUIRES: every run finished.
  void Finish() const;

 private:
  RunDirectories(std::string path, bool keep_logs)
      : path_(std::move(path)), keep_logs_(keep_logs) {}

  std::string path_;
  bool keep_logs_;
  bool all_ok_ = true;
};

// One run's cluster: testing/cluster's Cluster (which owns the processes: see there for what it
// starts, kills and stops, and its thread-safety) with the benchmarks' binaries (ClusterFlags),
// their run directory and their job: a rebound_server with the job inline (in-memory state
// unless a data directory is given) and rebound_worker trainers (trainer-<i>), spares and an
// evaluator (evaluator), each with its log in `dir` beside the configs written for them.
// REQUIRES: used from the main thread (see ChildProcess).
class LocalCluster : public testing::Cluster {
 public:
  // REQUIRES: `flags` resolved (ResolveClusterFlags) and `dir` exists. `standbys` > 0: a
  // replicated server group of 1 + standbys members with an etcd cluster of 3 and that leader
  // lease (ClusterOptions).
  LocalCluster(const ClusterFlags& flags, std::string dir, int standbys = 0,
               int leader_lease_ms = 2000);

  // Starts rebound_server with `job` inline and waits (up to 30 s) for the port it listens on;
  // writes the workers' config for job.job_id() (backoff 50..1000 ms, give up after 30 s). With
  // a `data_dir`, the server keeps its state there (RocksDB, durability.data_dir) instead of in
  // memory. Status codes: Cluster::StartServer's.
  // `worker_timing` (WorkerConfig text) replaces the workers' default backoff_initial_ms: 50,
  // backoff_max_ms: 1000 and give_up_after_ms: 30000 when not empty.
  absl::Status StartServer(const JobConfig& job, const std::string& data_dir = "",
                           const std::string& worker_timing = "");
};

}  // namespace rebound::bench
