#pragma once

// ProcessFirewall: a firewall between single processes on this machine, the way one stands
// between hosts: the faults a network partition makes (packets silently dropped, no reset, both
// directions), aimed at chosen processes while every other process on loopback talks as before.
// Part of the testing/cluster library, for the partitions of a server group (a leader cut from
// etcd while its workers and standby still reach it; a standby cut from everything).
//
// How. Each process to be cut is started in a cgroup v2 of its own
// (ChildProcessOptions::cgroup = Group(name)); a socket belongs to the cgroup of the process
// that made it, and iptables' cgroup match sees it on every packet that process sends. A cut
// adds two rules to a chain of this firewall's own (hooked into OUTPUT for loopback): the first
// marks the connection (CONNMARK) of every packet the group sends that the cut matches, the
// second drops every packet of a marked connection, whichever end sent it. So a TCP connection
// across the cut stalls in both directions, as behind a real firewall; a new connection cannot
// be opened (its SYN-ACK or SYN is dropped). Heal removes the group's rules; connections come
// back by TCP's retransmission or the peers' reconnects. A process that re-executes itself (a
// deposed leader) stays in its cgroup.
//
// Needs root (CAP_NET_ADMIN), iptables with the cgroup and connmark matches and a writable
// cgroup v2 hierarchy (tools/setup.sh installs iptables): Create says precisely what is missing.
// Clean-up: the destructor removes the chain and its hook and every cgroup it made (once their
// processes are gone). A harness killed before that leaves a chain that matches no process.
//
// Thread-safety: not thread-safe (one harness thread). Status codes: FAILED_PRECONDITION where
// the machine does not permit it (naming the command and its output), NOT_FOUND for a name
// never given to Group, INTERNAL when an iptables command fails later.

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rebound::testing {

class ProcessFirewall {
 public:
  static absl::StatusOr<std::unique_ptr<ProcessFirewall>> Create();
  ~ProcessFirewall();

  ProcessFirewall(const ProcessFirewall&) = delete;
  ProcessFirewall& operator=(const ProcessFirewall&) = delete;

  // The cgroup directory for the processes called `name` (made at the first call), for
  // ChildProcessOptions::cgroup. Names are letters, digits, '-' and '_'.
  absl::StatusOr<std::string> Group(const std::string& name);

  // Cuts every TCP connection between `name`'s processes and the local TCP ports `ports` (a
  // server's listeners, e.g. etcd's client ports), both directions. Replaces any cut of `name`.
  absl::Status CutFromPorts(const std::string& name, const std::vector<int>& ports);
  // Cuts every TCP connection of `name`'s processes. Replaces any cut of `name`.
  absl::Status Isolate(const std::string& name);
  // Ends `name`'s cut, if any.
  absl::Status Heal(const std::string& name);

  // A line for a run's header.
  std::string Describe() const;

 private:
  struct GroupState {
    std::string dir;                  // the cgroup's directory
    std::string path;                 // the same, as iptables' --path (from the v2 root)
    int mark = 0;                     // the connection mark of its cuts
    std::vector<std::vector<std::string>> rules;  // the rules of its cut (for Heal)
  };

  ProcessFirewall() = default;

  absl::Status Iptables(const std::vector<std::string>& args) const;
  // Removes the chains of earlier firewalls whose process is gone without its destructor (a
  // test killed at its timeout, a crash), so that their DROP rules never outlive them.
  void RemoveStaleChains() const;
  absl::Status AddCut(const std::string& name, const std::vector<std::string>& match);

  std::string iptables_;
  std::string chain_;
  std::string cgroup_root_;  // the v2 mount point
  std::string base_dir_;     // <mount>/<own cgroup>/rebound-fw-<pid>
  std::string base_path_;    // the same, relative to the v2 root
  std::map<std::string, GroupState> groups_;
};

}  // namespace rebound::testing
