#pragma once

// Real etcd members for tests: one member or a cluster of several on loopback (127.0.0.1), each
// with free client and peer ports and its own data directory under a fresh temporary directory
// (under TEST_TMPDIR, else /tmp), started from /usr/bin/etcd (Debian's etcd-server; installed by
// tools/setup.sh). Start() returns once every member answers a linearizable read (the cluster
// has a leader and every member has joined). Kill() SIGKILLs one member (its data stays, so
// Restart() brings it back with its data), Pause() SIGSTOPs one (Resume() continues it); the destructor SIGKILLs and reaps every member that
// still runs (common/child_process.h) and removes the temporary directory.
//
// Members run with short raft timings (heartbeat 50 ms, election 500 ms by default), so a lost
// leader is replaced within about a second and etcd's minimum lease TTL is 1 s.
//
// Thread-safety: not thread-safe; one thread (the test's main thread, which must outlive the
// members: PR_SET_PDEATHSIG) starts, kills and destroys an EtcdCluster. Ownership: the cluster
// owns its processes and its directory.
//
// Status codes: Start and Restart return FAILED_PRECONDITION when the etcd binary is missing
// ("... run tools/setup.sh"), INTERNAL (with the tail of the member's log) when a member exits
// or cannot be started, DEADLINE_EXCEEDED when a member does not serve within
// `start_timeout`.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/child_process.h"

namespace rebound::testing {

struct EtcdClusterOptions {
  int members = 1;
  std::string etcd_binary = "/usr/bin/etcd";
  int heartbeat_ms = 50;
  int election_timeout_ms = 500;
  absl::Duration start_timeout = absl::Seconds(20);
};

class EtcdCluster {
 public:
  static absl::StatusOr<std::unique_ptr<EtcdCluster>> Start(const EtcdClusterOptions& options);

  ~EtcdCluster();
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  int size() const { return static_cast<int>(members_.size()); }
  // "127.0.0.1:<port>" of member i's client (gRPC) listener.
  std::string client_endpoint(int i) const;
  // Every member's, in member order.
  std::vector<std::string> client_endpoints() const;
  // Every member's client port, in member order (a firewall cuts a process from them).
  std::vector<int> client_ports() const;
  // The directory of logs and data dirs.
  const std::string& dir() const { return dir_; }
  // Member i's log file.
  std::string log_path(int i) const;
  // Whether member i's process runs.
  bool running(int i);
  // The member that leads etcd's raft now, read from the running members' /metrics
  // (`etcd_server_is_leader 1`, on the client port); NOT_FOUND while none does (an election).
  absl::StatusOr<int> RaftLeader();

  // SIGSTOPs / SIGCONTs member i: a hung member (its connections stay open, nothing answers).
  void Pause(int i);
  void Resume(int i);
  // SIGKILLs member i and reaps it (no-op if it is not running).
  void Kill(int i);
  // Starts member i again on its ports and data dir (killing it first if it runs). When a
  // majority of the members then runs, waits until every running member serves; otherwise
  // returns once it is started (restart the others, and the last Restart waits).
  absl::Status Restart(int i);

 private:
  struct Member {
    std::string name;
    int client_port = 0;
    int peer_port = 0;
    std::string data_dir;
    std::string log_path;
    std::unique_ptr<ChildProcess> process;
  };

  explicit EtcdCluster(EtcdClusterOptions options) : options_(std::move(options)) {}
  absl::Status StartMember(int i, const std::string& cluster_state);
  absl::Status WaitUntilServing(int i, absl::Time deadline);

  const EtcdClusterOptions options_;
  std::string dir_;
  std::string initial_cluster_;
  std::vector<Member> members_;
};

}  // namespace rebound::testing
