#pragma once

// NetworkLab: a private network a test harness builds for itself, so that it can cut (partition)
// and degrade the links of single workers (the chaos harness, tests/chaos/chaos.h), where the
// machine permits network namespaces (root, or CAP_NET_ADMIN). Part of the testing/cluster
// library: the partitions of a local cluster.
//
//   harness's namespace            "lab" namespace                 one namespace per host
//   rbc<pid>: 10.a.b.1/24  <-veth->  up0 - bridge br0 - h<i>  <-veth->  eth0: 10.a.b.(10+i)/24
//
// The server listens on 10.a.b.1 (in the harness's own namespace, so the harness, the evaluator
// and anything else there reach it as a local address); each worker process runs in a host's
// namespace (ChildProcess::Start with the host's netns_fd) and reaches the server and the other
// hosts through the bridge. Nothing leaves the machine: the only addresses are the ones made
// here, in a 10.a.b.0/24 subnet picked (from the pid) so that it is not in use.
//
// Faults act on the lab's end of a host's link (h<i>) and on the host's eth0:
//   * partition: h<i> down (both directions cut; TCP connections stall, then recover or time out),
//   * throttle: a tbf rate limit on both ends,
//   * delay and loss: a netem qdisc on both ends, when the kernel has netem (sch_netem).
//
// Clean-up needs no bookkeeping: each namespace is held by a child process that dies with the
// harness (PR_SET_PDEATHSIG), and a veth pair vanishes when the namespace of either end does; the
// destructor kills the holders and deletes rbc<pid>.
//
// Thread-safety: not thread-safe; one thread (the one that created it, as for ChildProcess) uses
// a lab. Ownership: the lab owns its namespaces and their holder processes; a Host's netns_fd
// belongs to the lab and stays valid until the lab is destroyed. Status codes: see each function
// (FAILED_PRECONDITION where the machine does not permit a lab, RESOURCE_EXHAUSTED past 200
// hosts; FAILED_PRECONDITION naming the `ip`/`tc` command and its output when one fails).

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rebound::testing {

class NetworkLab {
 public:
  // Builds the lab. FAILED_PRECONDITION, saying why, where the machine does not permit it (no
  // `ip`, no network namespaces, no veth or bridge, no free subnet); nothing is left behind then.
  static absl::StatusOr<std::unique_ptr<NetworkLab>> Create();
  ~NetworkLab();

  NetworkLab(const NetworkLab&) = delete;
  NetworkLab& operator=(const NetworkLab&) = delete;

  // The address on the harness's side (10.a.b.1).
  const std::string& gateway() const { return gateway_; }

  // Which link faults this kernel supports, and why not.
  bool netem() const { return netem_problem_.empty(); }
  const std::string& netem_problem() const { return netem_problem_; }
  bool tbf() const { return tbf_problem_.empty(); }
  const std::string& tbf_problem() const { return tbf_problem_; }

  struct Host {
    int index = 0;
    std::string address;  // 10.a.b.(10+index)
    int netns_fd = -1;    // for ChildProcessOptions::netns_fd
  };
  // A new namespace joined to the bridge. RESOURCE_EXHAUSTED after 200 hosts.
  absl::StatusOr<Host> AddHost();

  // Link faults of host `index`. Each replaces the one before on that host; Heal() ends any.
  absl::Status Partition(int index);
  absl::Status Throttle(int index, int kbit_per_second);
  absl::Status Netem(int index, int delay_ms, int jitter_ms, double loss_percent);
  absl::Status Heal(int index);

  // A line for the run's header: the subnet, and which faults are available.
  std::string Describe() const;

 private:
  struct Namespace {
    pid_t holder = -1;
    int fd = -1;
  };

  NetworkLab() = default;

  // A fresh network namespace held by a child process.
  static absl::StatusOr<Namespace> NewNamespace();
  static void Release(Namespace& ns);
  // Runs `ip`/`tc` with `args` in `ns_fd` (-1: the harness's namespace).
  absl::Status Ip(int ns_fd, const std::vector<std::string>& args) const;
  absl::Status Tc(int ns_fd, const std::vector<std::string>& args) const;
  // Puts the root qdisc `shape` ("root", kind, parameters...) on both ends of host `index`'s
  // link; on failure clears both.
  absl::Status ShapeBothEnds(int index, const std::vector<std::string>& shape);
  // Runs `path` (the tool `name`) with `args` in `ns_fd` (-1: the harness's namespace); the
  // error names the command and holds its output.
  static absl::Status RunTool(const std::string& name, const std::string& path, int ns_fd,
                              const std::vector<std::string>& args);
  // Removes any qdisc on both ends of host `index`'s link.
  void ClearQdiscs(int index);

  std::string ip_;
  std::string tc_;
  std::string root_link_;  // rbc<pid>, in the harness's namespace
  std::string prefix_;     // "10.a.b."
  std::string gateway_;
  std::string netem_problem_ = "not probed";
  std::string tbf_problem_ = "not probed";
  Namespace lab_;
  std::vector<Namespace> hosts_;
  std::vector<bool> partitioned_;
};

}  // namespace rebound::testing
