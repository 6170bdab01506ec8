#pragma once

// The testing/cluster library's cluster: a real rebound_server and real rebound_worker trainers,
// spares and an evaluator, each a process of its own on loopback, for the integration tests
// (tests/integration/local_cluster.h wraps it in Catch2 checks), the benchmarks that measure a
// cluster (bench/local_cluster.h) and any harness that needs one. The chaos harness
// (tests/chaos) starts its daemons with this library's processes.h and partitions their links
// with network.h.
//
// The server runs on 127.0.0.1 with a port of its choosing (--listen 127.0.0.1:0, the port read
// from --port_file) or, with a NetworkLab (ClusterOptions::network), on the lab's gateway with
// every trainer and spare in a network namespace of its own, so that their links can be cut
// (Partition) and healed (with ClusterOptions::groups_in_hosts, each server group in a lab host
// of its own too, behind a link of its own); its config and log in the cluster's directory
// (server.pbtxt, server.log, port); workers are known by the unique names they are started with
// (which the server reports in GetStatus), each with its log <name>.log beside the workers'
// config (worker.pbtxt, or worker-<name>.pbtxt with a worker's own additions). The cluster kills
// (SIGKILL), stops (SIGSTOP) and resumes (SIGCONT) workers, partitions them where it has a lab,
// kills and stops the server, watches everything through GetStatus, and stops it all in order.
//
// A worker killed through KillWorker, or named to ExpectExit, is expected to be gone; with
// ClusterOptions::fail_on_exit, any other child that exits before StopAll fails the waits
// (CheckChildren).
//
// Thread-safety: not thread-safe. REQUIRES: one thread, which lives as long as the processes
// should (the main thread), uses a Cluster: Linux delivers the children's parent-death signal
// when the thread that forked them exits (common/child_process.h).
// Ownership: the Cluster owns every process it starts; its destructor SIGKILLs and reaps each
// that still runs, stopped or not (workers first, newest first, then the server), every wait
// bounded. ChildProcess pointers and references it hands out live as long as the Cluster. It
// borrows ClusterOptions::network, which must outlive it.
// Time: every bound a Cluster keeps or is given (ClusterOptions' rpc_deadline, start_wait and
// stop_grace, WaitForStatus' limit, StopServer's grace, WaitForFirstSyncs' 120 s) is in the normal
// build's time and multiplied by testing/cluster/time_scale.h's TimeScale() where it is applied;
// so are the timing fields of the server's inline job and of the workers' configs it writes
// (ScaleTimingFields). At scale 1 (REBOUND_TEST_TIME_SCALE unset) the configs are written as
// given, byte for byte. Watch's `end` and `tick` are not scaled: the caller chose that moment.
// Status codes: INVALID_ARGUMENT for a bad request (a worker name used twice, an unknown role);
// NOT_FOUND for a worker never started; FAILED_PRECONDITION when the process is not in the state
// the call needs (already exited, no server); INTERNAL when a process cannot be started, exits
// early (with the tail of its log) or survives SIGKILL, or a file cannot be written;
// UNAVAILABLE when GetStatus fails; DEADLINE_EXCEEDED, naming what was awaited, when a wait
// passes its limit.

#include <sys/types.h>

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/child_process.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "testing/cluster/firewall.h"
#include "testing/cluster/network.h"
#include "testing/etcd/etcd_process.h"

namespace rebound::testing {

struct ClusterOptions {
  std::string server_binary;  // absolute paths of rebound_server and rebound_worker
  std::string worker_binary;
  std::string dir;  // exists: configs, logs and the port file go here
  // How the cluster's own calls (GetStatus, stub()) reach the server.
  SecurityConfig client_security;
  absl::Duration rpc_deadline = absl::Seconds(5);  // of each GetStatus
  // WaitForStatus: when a GetStatus fails, keep polling until the limit (true) or return its
  // UNAVAILABLE at once (false: a test that asserts the server answers every time).
  bool retry_status_errors = true;
  // WaitForStatus and Watch fail with CheckChildren's INTERNAL as soon as a child exits that was
  // neither killed by KillWorker nor named to ExpectExit.
  bool fail_on_exit = true;
  absl::Duration start_wait = absl::Seconds(30);  // the server's port; each registration
  absl::Duration stop_grace = absl::Seconds(10);  // SIGTERM to SIGKILL; a SIGKILL to the reaping
  // Where set (NetworkLab::Create succeeded: root), the server listens on the lab's gateway and
  // each trainer and spare runs in a host of the lab of its own (the evaluator stays beside the
  // server), so that Partition can cut its link. Borrowed: must outlive the Cluster.
  NetworkLab* network = nullptr;
  // Where set (ProcessFirewall::Create succeeded: root), every member of a replicated group
  // (standbys > 0) runs in a firewall group named after it (server-<i>, or g<g>-server-<i>),
  // across its restarts, so that its traffic can be cut (firewall->CutFromPorts, Isolate).
  // Borrowed: must outlive the Cluster.
  ProcessFirewall* firewall = nullptr;
  // A replicated server group (docs/design.md §10.1) instead of one server: 1 + `standbys` members
  // server-0, server-1, ..., each with a fixed port, its own config (server-<i>.pbtxt: the
  // given server config plus the replication block and durability.data_dir <dir>/server-<i>),
  // log (server-<i>.log) and port files, coordinated by an etcd cluster of `etcd_members`
  // members that StartServer starts first (testing/etcd, its own directory); member i writes
  // its peer port to <dir>/peer-port-<i>. Workers and the
  // cluster's own calls get every member's address and follow the leader. 0: one server, no
  // etcd, exactly as before.
  int standbys = 0;
  int etcd_members = 3;
  int leader_lease_ms = 2000;
  bool replication_sync = true;
  // The center sharded across `shard_groups` server groups (docs/design.md §10.2, docs/sharding.md):
  // K > 1 starts K groups, each a single server or (standbys > 0) a replicated group of
  // 1 + standbys members sharing one etcd cluster; the job's sharding.groups is set to K and
  // every member's config gets its shard block (its group, every group's addresses). Members
  // are numbered group by group: member g * (1 + standbys) + i is member i of group g, named
  // g<g>-server-<i>, its data directory <dir>/g<g>-server-<i>. Workers and the cluster's own
  // calls go to group 0. 1: as many groups as the server config's inline job names in
  // sharding.groups (one group, exactly as before, when it names none).
  int shard_groups = 1;
  // With a `network` and no standbys: every server group (the single server too) runs in a lab
  // host of its own and listens on that host's address, so that all of a group's traffic (the
  // workers', the other groups', the cluster's own calls) crosses that host's link, which
  // NetworkLab::Throttle, Netem or Partition shape or cut (GroupHost names the host). Workers
  // are placed as without it. StartServer refuses it with INVALID_ARGUMENT without a network
  // or with standbys (their etcd members listen on the harness's loopback).
  bool groups_in_hosts = false;
};

class Cluster {
 public:
  explicit Cluster(ClusterOptions options);
  ~Cluster();

  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  // Writes `server_config` (ServerConfig text; --listen and --port_file override its address) to
  // server.pbtxt and `worker_config` (WorkerConfig text, without server, name and role, which
  // StartWorker passes as flags) to worker.pbtxt, starts rebound_server and waits (start_wait)
  // for its port. FAILED_PRECONDITION when a server was started before.
  absl::Status StartServer(const std::string& server_config, const std::string& worker_config);

  // Starts worker `name` with --role `role` (auto, trainer, spare or evaluator) and `extra_args`
  // appended to its command line; `config_extra` (WorkerConfig text), when not empty, is appended
  // to this worker's config only. Does not wait for it.
  absl::Status StartWorker(const std::string& name, const std::string& role,
                           const std::vector<std::string>& extra_args = {},
                           const std::string& config_extra = "");

  // Starts trainer-0 .. trainer-(count - 1) one at a time, each once the one before registered
  // (start_wait each), so that trainer i owns slot i (the server hands out the lowest free slot);
  // INTERNAL if one gets another slot. `extra_flags(i)`, when given, is appended to trainer i's
  // command line.
  absl::Status StartTrainers(
      int count, const std::function<std::vector<std::string>(int trainer)>& extra_flags = nullptr);

  // Starts the worker "evaluator"; does not wait for it.
  absl::Status StartEvaluator();

  // Starts spares `names` one after the other and waits (start_wait each) until each is
  // registered ALIVE as a SPARE and, when `until_polling`, waiting in its WaitForTask long poll
  // (its data loaded: it can join a replay at once). The server flags that poll only under the
  // policies that hand out tasks (REPLAY, GLOBAL_CHECKPOINT): under RESTART_FROM_CENTER pass
  // false.
  absl::Status StartSpares(const std::vector<std::string>& names, bool until_polling = true);

  // SIGKILLs the worker `name` (no goodbye: its heartbeats just stop) and reaps it (stop_grace);
  // from then on its exit is expected. NOT_FOUND, FAILED_PRECONDITION when it had already
  // exited, INTERNAL when it survives the SIGKILL.
  absl::Status KillWorker(const std::string& name);
  // SIGSTOP / SIGCONT to the worker `name`. NOT_FOUND.
  absl::Status StopWorker(const std::string& name);
  absl::Status ResumeWorker(const std::string& name);

  // Cuts / restores the link of worker `name` (NetworkLab::Partition / Heal on its host): its
  // connections stall, then recover or time out. NOT_FOUND for no such worker;
  // FAILED_PRECONDITION when the cluster has no lab or the worker no host of its own (the
  // evaluator), or the lab's command fails.
  absl::Status Partition(const std::string& name);
  absl::Status Heal(const std::string& name);

  // The worker started under `name`; nullptr when there is none.
  ChildProcess* FindWorker(const std::string& name);
  const ChildProcess* FindWorker(const std::string& name) const;

  // The workers expected to exit on their own from now on (e.g. fenced ones, exit code 3):
  // CheckChildren no longer counts their exit as a failure.
  void ExpectExit(const std::string& name) { expected_exits_.insert(name); }

  // SIGTERM to the server (SIGKILL after `grace`) and its exit code, as ChildProcess::Stop.
  // REQUIRES: StartServer succeeded.
  int StopServer(absl::Duration grace);
  // SIGKILL to the server: it dies without flushing anything; reaped (stop_grace). INTERNAL when
  // it is not reaped. REQUIRES: StartServer succeeded.
  absl::Status KillServer();

  // A replicated group's members (ClusterOptions::standbys > 0); a single server is member 0.
  int members() const { return static_cast<int>(members_.size()); }
  // Member i's process. REQUIRES: StartServer succeeded, 0 <= i < members().
  ChildProcess& member(int i) { return *members_.at(i).process; }
  const std::string& member_name(int i) const { return members_.at(i).name; }
  // The data directory of member i (a group's); empty for a single server.
  const std::string& member_data_dir(int i) const { return members_.at(i).data_dir; }
  // Waits (limit) until a member serves as the group's leader (GetStatus through the group's
  // channel) and returns its index. DEADLINE_EXCEEDED naming the last answer.
  absl::StatusOr<int> WaitForLeader(absl::Duration limit);
  // SIGKILLs member i and reaps it; its exit is expected until RestartMember.
  absl::Status KillMember(int i);
  // SIGSTOP / SIGCONT to member i; StopMember returns once the process is stopped (or after 2 s).
  void StopMember(int i);
  void ResumeMember(int i);
  // Starts member i again (after KillMember) on its port and data directory, the directory
  // first deleted when `wipe_data` (a lost disk). Does not wait for it.
  absl::Status RestartMember(int i, bool wipe_data);
  // The group's etcd cluster; null for a single server.
  EtcdCluster* etcd() { return etcd_.get(); }
  // A sharded cluster (shard_groups > 1): the members of each group; member i's group.
  int members_per_group() const { return 1 + options_.standbys; }
  int group_of(int member) const { return member / members_per_group(); }
  // The number of server groups: ClusterOptions::shard_groups, or the job's sharding.groups.
  // REQUIRES: StartServer succeeded.
  int shard_groups() const { return shard_groups_; }
  // Group g's address (its members' host:port, separated by commas) and one GetStatus of it.
  // REQUIRES: StartServer succeeded, 0 <= g < shard_groups().
  const std::string& group_address(int g) const { return group_addresses_.at(g); }
  // The NetworkLab host group g runs in (ClusterOptions::groups_in_hosts): the index that
  // NetworkLab::Throttle and Partition take. FAILED_PRECONDITION when the groups do not run in
  // lab hosts; INVALID_ARGUMENT for a group that does not exist.
  absl::StatusOr<int> GroupHost(int g) const;
  absl::StatusOr<GetStatusResponse> GetGroupStatus(int g);

  // One GetStatus call (rpc_deadline). UNAVAILABLE, with gRPC's message, when it fails.
  absl::StatusOr<GetStatusResponse> GetStatus();

  // Polls GetStatus every `poll` until `done` holds, for at most `limit`; see
  // ClusterOptions::retry_status_errors and fail_on_exit for the failures that end it sooner.
  absl::StatusOr<GetStatusResponse> WaitForStatus(
      const std::function<bool(const GetStatusResponse&)>& done, absl::Duration limit,
      const std::string& what, absl::Duration poll = absl::Milliseconds(100));

  // Waits (up to 120 s) until there are `slots` slots, each ACTIVE and synced at least once.
  absl::Status WaitForFirstSyncs(int slots);

  // Until `end`, every `tick`: checks the children, then calls `on_tick(now)`. Returns at `end`,
  // or with CheckChildren's error as soon as a child exits (with fail_on_exit).
  absl::Status Watch(absl::Time end, absl::Duration tick,
                     const std::function<void(absl::Time now)>& on_tick);

  // INTERNAL, with the tail of its log, when a child exited that should not have before StopAll
  // (any but those killed by KillWorker or named to ExpectExit).
  absl::Status CheckChildren();

  // Stops the workers (SIGTERM and SIGCONT to all still running, then each waited for up to
  // stop_grace, SIGKILL after), then the server likewise. `worker_exited(worker, code)` sees
  // each worker's exit code (128 + N when killed by signal N: 137 for those KillWorker killed);
  // when `report`, a server exit code other than 0 is noted on stderr.
  void StopAll(bool report,
               const std::function<void(const ChildProcess& worker, int code)>& worker_exited);

  // The last `server_lines` lines of the server's log and `worker_lines` of every worker's, each
  // under a "--- <name>.log" header, for failure messages.
  std::string Logs(size_t server_lines = 25, size_t worker_lines = 12) const;

  const std::string& dir() const { return options_.dir; }
  // The server's host:port (a group's: every member's, separated by commas). REQUIRES:
  // StartServer succeeded.
  const std::string& address() const { return address_; }
  // A stub on the server's channel (client_security). REQUIRES: StartServer succeeded.
  ParameterServer::Stub& stub() { return *stub_; }
  // REQUIRES: StartServer succeeded.
  ChildProcess& server() { return *server_; }
  const ChildProcess& server() const { return *server_; }
  // The trainers started by StartTrainers, trainer i at index i.
  const std::vector<ChildProcess*>& trainers() const { return trainers_; }

 private:
  struct Worker {
    std::string name;
    std::unique_ptr<ChildProcess> process;
    int host = -1;  // its NetworkLab host; -1: in the cluster's own namespace
  };

  // The lab host of worker `name`, or why there is none.
  absl::StatusOr<int> HostOf(const std::string& name);

  // Waits (start_wait) until GetStatus lists a worker named `name` for which `listed` holds.
  absl::StatusOr<GetStatusResponse> WaitForWorker(
      const std::string& name, const std::function<bool(const WorkerStatus&)>& listed,
      const std::string& what);

  struct Member {
    std::string name;
    std::string config;    // its config file
    std::string data_dir;  // a group's member's
    std::string port_file;
    std::string log;
    std::vector<std::string> argv;
    std::unique_ptr<ChildProcess> process;
    bool expect_exit = false;  // killed, not restarted yet
    int netns_fd = -1;         // its lab host's namespace (groups_in_hosts); -1: the cluster's
    std::string cgroup;        // its firewall group's cgroup (ClusterOptions::firewall)
  };

  // The address a group's members listen on (groups_in_hosts: group g's lab host, added here on
  // first use; else the gateway or loopback) and the namespace they run in (-1: the cluster's).
  absl::StatusOr<std::pair<std::string, int>> GroupHostAddress(int g);

  // StartServer for a replicated group or several shard groups.
  absl::Status StartGroups(const std::string& server_config);
  // Waits (limit) until every group of a sharded cluster answers GetStatus ready (a replicated
  // group: its leader). DEADLINE_EXCEEDED naming the group.
  absl::Status WaitForShardGroups(absl::Duration limit);

  const ClusterOptions options_;
  std::unique_ptr<EtcdCluster> etcd_;
  std::vector<Member> members_;
  // Member 0's process (the single server's): what StopServer, KillServer and server() use.
  ChildProcess* server_ = nullptr;
  std::vector<Worker> workers_;         // in start order
  std::vector<ChildProcess*> trainers_;  // StartTrainers', in slot order
  std::set<std::string> expected_exits_;  // killed, or expected to exit on their own
  std::string worker_config_;  // as StartServer was given it, unscaled
  std::string address_;
  std::unique_ptr<ParameterServer::Stub> stub_;
  int shard_groups_ = 1;
  std::vector<std::string> group_addresses_;  // a sharded cluster's, by group
  std::vector<NetworkLab::Host> group_hosts_;  // groups_in_hosts: group g's lab host
  std::vector<std::unique_ptr<ParameterServer::Stub>> group_stubs_;
};

}  // namespace rebound::testing
