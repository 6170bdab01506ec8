#pragma once

// A real Rebound cluster on loopback for the benchmarks that measure one (weighting,
// logging_overhead, recovery, failures): the flags that say where its binaries and job are, the
// working directory its runs keep their configs and logs in, and LocalCluster, which starts
// rebound_server and rebound_worker processes, watches them through GetStatus, kills the ones a
// benchmark means to fail and stops the rest.

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "bench/flags.h"
#include "bench/process_util.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"

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

// One run's cluster: a rebound_server with the job inline (in-memory state, 127.0.0.1, a port of
// its choosing) and rebound_worker trainers, spares and evaluator, each a ChildProcess of this
// one with its log in `dir` (server.log, <worker name>.log) beside the configs written for them
// (server.pbtxt, worker.pbtxt, port). Workers are known by the unique names they are started
// with (trainer-<i>, evaluator, and whatever StartWorker is given), which the server reports in
// GetStatus. A worker the benchmark killed (KillWorker) is expected to be gone; any other child
// that exits before StopAll is a failure of the run (CheckChildren). Whatever still runs when the
// cluster is destroyed is SIGKILLed. Not thread-safe; REQUIRES: used from the main thread (see
// ChildProcess).
class LocalCluster {
 public:
  // REQUIRES: `flags` resolved (ResolveClusterFlags) and `dir` exists.
  LocalCluster(const ClusterFlags& flags, std::string dir);

  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  // Starts rebound_server with `job` inline and waits (up to 30 s) for the port it listens on;
  // writes the workers' config for job.job_id(). With a `data_dir`, the server keeps its state
  // there (RocksDB, durability.data_dir) instead of in memory.
  absl::Status StartServer(const JobConfig& job, const std::string& data_dir = "");

  // Starts trainer-0 .. trainer-(count - 1) one at a time, each once the one before registered
  // (up to 30 s each), so that trainer i owns slot i (the server hands out the lowest free
  // slot); fails if one gets another slot. `extra_flags(i)`, when given, is appended to trainer
  // i's command line.
  absl::Status StartTrainers(
      int count, const std::function<std::vector<std::string>(int trainer)>& extra_flags = nullptr);

  // Starts the evaluator; does not wait for it.
  absl::Status StartEvaluator();

  // Starts a worker named `name` with `--role role` (auto, trainer, spare or evaluator) and
  // `extra` appended to its command line; does not wait for it. INVALID_ARGUMENT when a worker
  // of that name was started before.
  absl::Status StartWorker(const std::string& name, const std::string& role,
                           const std::vector<std::string>& extra = {});

  // Starts spares `names` one after the other and waits (up to 30 s each) until each is
  // registered as a SPARE and, when `until_polling`, waiting in its WaitForTask long poll (its
  // data loaded: it can join a replay at once). The server flags that poll only under the
  // policies that hand out tasks (REPLAY, GLOBAL_CHECKPOINT): under RESTART_FROM_CENTER pass
  // false.
  absl::Status StartSpares(const std::vector<std::string>& names, bool until_polling = true);

  // SIGKILLs the worker named `name` (no goodbye: its heartbeats just stop) and reaps it; from
  // then on its exit is expected. NOT_FOUND when no such worker was started, FAILED_PRECONDITION
  // when it had already exited.
  absl::Status KillWorker(const std::string& name);

  // The worker started under `name`; nullptr when there is none.
  const ChildProcess* FindWorker(const std::string& name) const;

  // The workers a benchmark expects to exit on their own from now on (e.g. fenced ones, exit
  // code 3): CheckChildren no longer counts their exit as a failure.
  void ExpectExit(const std::string& name) { expected_exits_.insert(name); }

  // Waits (up to 120 s) until there are `slots` slots, each ACTIVE and synced at least once.
  absl::Status WaitForFirstSyncs(int slots);

  // One GetStatus call (5 s deadline). UNAVAILABLE when it fails.
  absl::StatusOr<GetStatusResponse> GetStatus();

  // Polls GetStatus every `poll` until `done` holds, for at most `limit`; fails as soon as a
  // child exits (CheckChildren) and with DEADLINE_EXCEEDED, naming `what`, at the limit.
  absl::StatusOr<GetStatusResponse> WaitForStatus(
      const std::function<bool(const GetStatusResponse&)>& done, absl::Duration limit,
      const std::string& what, absl::Duration poll = absl::Milliseconds(100));

  // Until `end`, every `tick`: checks the children, then calls `on_tick(now)`. Returns at `end`,
  // or with CheckChildren's error as soon as a child exits.
  absl::Status Watch(absl::Time end, absl::Duration tick,
                     const std::function<void(absl::Time now)>& on_tick);

  // INTERNAL, with the tail of its log, when a child exited that should not have before StopAll
  // (any but those killed by KillWorker or named to ExpectExit).
  absl::Status CheckChildren();

  // Stops the workers (SIGTERM and SIGCONT to all still running, then each waited for up to
  // 10 s, SIGKILL after), then the server likewise. `worker_exited(worker, code)` sees each
  // worker's exit code (128 + N when killed by signal N: 137 for those KillWorker killed); when
  // `report`, a server exit code other than 0 is noted on stderr.
  void StopAll(bool report,
               const std::function<void(const ChildProcess& worker, int code)>& worker_exited);

  // REQUIRES: StartServer succeeded.
  const ChildProcess& server() const { return *server_; }
  // The trainers started by StartTrainers, trainer i at index i.
  const std::vector<std::unique_ptr<ChildProcess>>& trainers() const { return trainers_; }

 private:
  absl::StatusOr<std::unique_ptr<ChildProcess>> LaunchWorker(const std::string& name,
                                                             const std::string& role,
                                                             const std::vector<std::string>& extra);

  // Every worker started, in start order, with its name.
  std::vector<std::pair<std::string, ChildProcess*>> AllWorkers() const;

  const ClusterFlags& flags_;
  const std::string dir_;
  std::unique_ptr<ChildProcess> server_;
  std::vector<std::unique_ptr<ChildProcess>> trainers_;
  std::unique_ptr<ChildProcess> evaluator_;
  // Workers started by StartWorker / StartSpares, by name.
  std::vector<std::pair<std::string, std::unique_ptr<ChildProcess>>> others_;
  std::set<std::string> expected_exits_;  // killed, or expected to exit on their own
  std::string address_;
  std::unique_ptr<ParameterServer::Stub> stub_;
};

}  // namespace rebound::bench
