#pragma once

// The local launcher (docs/design.md §8): one rebound_server (or a replicated server group, or the
// shard groups of a sharded center) and the job's workers on this machine, started from one job file, watched with a progress line per
// second, and stopped together.
//
//   Launcher launcher(options, job, binaries);
//   return launcher.Run();  // the process's exit code
//
// Run() writes the work dir (server.pbtxt, worker.pbtxt, one log per process), starts the server
// and waits (at most 60 s) for its port, then starts the trainers one at a time, each after the
// previous one is ALIVE in GetStatus (at most 60 s each), so that trainer-r<r>s<s> owns slot
// (r, s); then the spares and the evaluator, and waits for them to register. Afterwards it polls
// GetStatus every second and prints events and progress to stdout (and --progress_csv). It ends
//   * when every slot is FINISHED: exit 0;
//   * when --timeout_s passes, the server exits, or the cluster cannot start: exit 1;
//   * on SIGINT/SIGTERM: exit 128 + the signal.
// A worker that exits is reported and not fatal once the cluster is up (the server rebuilds its
// slot). In every case every child is stopped before Run() returns: SIGTERM to the workers (they
// deregister), SIGKILL after 10 s; then the same for the server. A second SIGINT/SIGTERM while
// stopping escalates to SIGKILL at once.
//
// With --standbys N (a replicated server group, docs/design.md §10.1) Run() first starts
// --etcd_members etcd members (testing/etcd's EtcdCluster: /usr/bin/etcd on free loopback ports,
// at most 20 s), then members server-0..server-N, each on a fixed port (--port + i, or a free one)
// with its data in <--data_dir>/server-<i> (kept: a later run resumes from it) or else in
// <work dir>/server-<i> (emptied first: a fresh job), its config server-<i>.pbtxt, and
// waits (at most 60 s) until one leads; workers get every member's address, comma-separated, and
// follow the leader. It prints who leads and each standby's state as they change. A member that
// exits is reported, and is fatal only before the cluster is up or once no member runs.
// --kill_leader_at_step S: once the mean trainer step reaches S (and, for up to 60 s, a standby
// is in sync), the leader is SIGKILLed; 5 s later, and once a new leader answered (at most 30 s),
// it is started again on its data dir and rejoins as a standby. Meanwhile the launcher polls
// every 50 ms (for at most 120 s) and prints the failover (the kill to the new leader's first
// acknowledged sync) and when the restarted member is back in sync (GroupWatch), and both again
// at the end. Stopping: the workers, then every member, then etcd (its directory removed).
//
// With --shard_groups K > 1 (the center sharded across K server groups, docs/design.md §10.2) Run()
// starts K groups instead: group g is one server, g<g>-server, or with --standbys N the
// replicated group g<g>-server-0..N (etcd first, one cluster for every group, each group its own
// replication.group "<g>"); every server has a fixed port (--port + its index, group by group,
// or a free one), its config g<g>-server[-<i>].pbtxt with the shard block (its group, every
// group's addresses), its log, and its data in <--data_dir>/<name> (kept) or else, for a
// replicated group, in <work dir>/<name> (emptied first), or else in memory. The servers read
// the job file itself when its sharding.groups is K, else a copy with sharding.groups = K in the
// work dir (job.launch.pbtxt). Run() waits (at most 60 s) until every group answers GetStatus
// with its sharding status (a replicated group: from its leader), prints each group and the
// ranges, and gives the workers group 0's address. Progress, kills and the failover watch are
// group 0's (--kill_leader_at_step kills group 0's leader); a group none of whose servers runs
// any more ends the launch (exit 1): its range of the center is gone. Before stopping, it prints
// each group's center versions.
//
// REQUIRES: SIGTERM and SIGINT are blocked in every thread of the process (call
// BlockTerminationSignals() first thing in main), and Run() is called on the main thread (the
// children's parent-death signal follows the thread that forked them).

#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "common/child_process.h"
#include "common/clock.h"
#include "tools/launch/group_watch.h"
#include "tools/launch/options.h"
#include "tools/launch/progress.h"

namespace rebound::testing {
class EtcdCluster;
}  // namespace rebound::testing

namespace rebound::launch {

struct Binaries {
  std::string server;  // rebound_server
  std::string worker;  // rebound_worker
  // --worker_command split at spaces; when set, started instead of `worker` (with --server,
  // --name and --role appended, no --config).
  std::vector<std::string> worker_command;
};

// Finds the daemons for a launcher started as `argv0`: the explicit --server_binary and
// --worker_binary when given, else next to the launcher (installed side by side), else where the
// Bazel output tree and runfiles put them (<launcher dir>/../../server/rebound_server, same for
// worker/), looked up from argv0 and from /proc/self/exe, else on PATH. NOT_FOUND lists where it
// looked; an explicit path that is not an executable file is INVALID_ARGUMENT.
absl::StatusOr<Binaries> FindBinaries(const std::string& argv0, const LaunchOptions& options);

class Launcher {
 public:
  // REQUIRES: `job` is the validated content of options.job_file. `clock` (borrowed; it must
  // outlive the launcher) is how the launcher reads time and waits: its deadlines, the one-second
  // progress poll, the start-up and stop waits.
  Launcher(LaunchOptions options, JobConfig job, Binaries binaries,
           const Clock* clock = DefaultClock());
  ~Launcher();

  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  // Runs the job to its end (see the file comment) and returns the exit code.
  int Run();

 private:
  struct Worker {
    WorkerPlan plan;
    std::unique_ptr<ChildProcess> process;
    bool exit_reported = false;
    bool killed_by_launcher = false;
  };

  // A member of the replicated server group (--standbys), or a server of a shard group
  // (--shard_groups).
  struct Member {
    GroupMemberPlan plan;
    std::vector<std::string> argv;
    std::unique_ptr<ChildProcess> process;
    bool exit_reported = false;
    bool killed_by_launcher = false;
  };

  bool replicated() const { return options_.standbys > 0; }
  bool sharded() const { return shard_groups_ > 1; }
  // The servers are members_ (fixed ports, configs of their own), not server_.
  bool uses_members() const { return replicated() || sharded(); }

  // Each returns an exit code when the launcher must stop, nullopt to go on.
  std::optional<int> PrepareWorkDir();
  std::optional<int> StartServer();
  // StartServer for a replicated group or for shard groups: etcd (if replicated), the members,
  // a leader in each group.
  std::optional<int> StartMembers();
  // Waits until every shard group answers GetStatus, from its leader if replicated (at most
  // 60 s in all), and prints the groups and the ranges.
  std::optional<int> WaitForShardGroups();
  // Prints each shard group's center versions (one GetStatus each, 2 s deadline).
  void PrintShardSummary();
  std::optional<int> StartWorkers();
  // --export: the trained model to options_.export_path (safetensors); kExitFinished or
  // kExitFailed (said why).
  int ExportModel();
  std::optional<int> Supervise();

  // Starts one worker and returns its index in workers_, or an exit code.
  std::optional<int> StartWorker(const WorkerPlan& plan, size_t* index);
  // Waits (at most 60 s, and not past the deadline) until every worker at `indices` is ALIVE in
  // GetStatus; a worker that exits first ends the launch.
  std::optional<int> WaitForRegistration(const std::vector<size_t>& indices);

  // Waits up to `wait` for a termination signal, then checks the deadline and the children.
  std::optional<int> Watch(absl::Duration wait);
  // GetStatus with a 5 s deadline (1 s while a group elects a leader: a stuck connection attempt
  // is left for a fresh channel); a reply is passed to the trackers and their events printed.
  std::optional<GetStatusResponse> PollStatus();
  // After every slot finished: waits (at most 60 s) until the evaluator, if the job has one,
  // reported the final center or left.
  void AwaitFinalEvaluation();
  // "final test accuracy A, test loss L of the final center (version V, evaluated after every
  // slot finished)", or "last ..." naming the version evaluated when that is not the final one.
  void PrintFinalEvaluation();
  // SIGKILLs the trainer of --kill_slot once its step reaches --kill_trainer_at_step.
  void MaybeKillTrainer();
  // SIGKILLs the group's leader once the mean trainer step reaches --kill_leader_at_step; true
  // when it did now.
  bool MaybeKillLeader();
  // Starts the killed leader again once it is due (see the file comment).
  void MaybeRestartKilledMember();
  // Reports members that exited; an exit code when that ends the launch.
  std::optional<int> WatchMembers();
  // Stops every child: workers first, then the server (SIGTERM, SIGKILL after 10 s).
  void StopAll();
  void StopGroup(const std::vector<ChildProcess*>& group, const std::vector<std::string>& names);

  double Elapsed() const;
  // Prints "[  12.3s] text" to stdout and flushes; also the CSV event row when `event` is set.
  void Print(const std::string& text);
  void PrintEvent(const ProgressEvent& event);
  void WriteCsv(const std::string& row);

  const LaunchOptions options_;
  const JobConfig job_;
  JobConfig launched_;  // the job the servers run (LaunchedJob), set before the workers start
  const int shard_groups_;  // K: ShardGroups(options_, job_)
  const Binaries binaries_;
  const Clock* const clock_;
  const absl::Time start_;
  absl::Time deadline_ = absl::InfiniteFuture();

  std::string workdir_;
  std::FILE* csv_ = nullptr;
  std::unique_ptr<ChildProcess> server_;
  int port_ = 0;
  std::string job_file_;        // what the servers read: the job file, or its sharded copy
  std::string server_address_;  // the workers' --server (group 0's, when sharded)
  std::vector<std::string> shard_addresses_;  // each shard group's address list (sharded)
  std::vector<std::unique_ptr<ParameterServer::Stub>> shard_stubs_;  // one per shard group
  std::unique_ptr<testing::EtcdCluster> etcd_;  // a group's
  std::vector<Member> members_;                  // a group's
  GroupWatch group_watch_;
  std::optional<size_t> killed_member_;  // the leader --kill_leader_at_step killed
  absl::Time killed_at_;
  bool restart_done_ = false;
  std::optional<absl::Time> waiting_for_in_sync_since_;
  std::unique_ptr<ParameterServer::Stub> stub_;
  std::vector<Worker> workers_;
  ProgressTracker tracker_;
  bool cluster_up_ = false;  // every worker registered once
  bool kill_done_ = false;
  std::string last_status_error_;
  bool quiet_status_errors_ = false;  // while a group elects its first leader
  std::string quiet_status_error_;    // the last error meanwhile
};

}  // namespace rebound::launch
