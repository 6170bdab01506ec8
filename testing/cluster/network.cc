#include "testing/cluster/network.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "common/child_process.h"
#include "testing/cluster/processes.h"

namespace rebound::testing {
namespace {

constexpr int kMaxHosts = 200;
constexpr int kFirstHostOctet = 10;
// `ip` and `tc` answer in milliseconds; a hung one is killed.
constexpr absl::Duration kToolTimeout = absl::Seconds(10);

std::string HostLink(int index) { return absl::StrCat("h", index); }

}  // namespace

absl::StatusOr<NetworkLab::Namespace> NetworkLab::NewNamespace() {
  int ready[2];
  if (pipe2(ready, O_CLOEXEC) != 0) return absl::InternalError("pipe failed");
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    // The holder: only async-signal-safe calls (the harness has threads).
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    for (int fd = 3; fd < 4096; ++fd) {
      if (fd != ready[1]) close(fd);
    }
    const char ok = unshare(CLONE_NEWNET) == 0 ? 1 : 0;
    (void)!write(ready[1], &ok, 1);
    close(ready[1]);
    if (!ok) _exit(1);
    while (true) pause();
  }
  close(ready[1]);
  if (pid < 0) {
    close(ready[0]);
    return absl::InternalError("fork failed");
  }
  Namespace ns;
  ns.holder = pid;
  struct pollfd p = {ready[0], POLLIN, 0};
  char ok = 0;
  const bool answered = poll(&p, 1, 5000) == 1 && read(ready[0], &ok, 1) == 1;
  close(ready[0]);
  if (!answered || !ok) {
    Release(ns);
    return absl::FailedPreconditionError(
        "cannot create a network namespace (unshare(CLONE_NEWNET) refused: not root, or no "
        "CAP_SYS_ADMIN here)");
  }
  ns.fd = open(absl::StrCat("/proc/", pid, "/ns/net").c_str(), O_RDONLY | O_CLOEXEC);
  if (ns.fd < 0) {
    Release(ns);
    return absl::FailedPreconditionError("cannot open the namespace of its holder");
  }
  return ns;
}

void NetworkLab::Release(Namespace& ns) {
  if (ns.holder > 0) {
    kill(ns.holder, SIGKILL);
    int status = 0;
    waitpid(ns.holder, &status, 0);
    ns.holder = -1;
  }
  if (ns.fd >= 0) {
    close(ns.fd);
    ns.fd = -1;
  }
}

absl::Status NetworkLab::Ip(int ns_fd, const std::vector<std::string>& args) const {
  return RunTool("ip", ip_, ns_fd, args);
}

absl::Status NetworkLab::Tc(int ns_fd, const std::vector<std::string>& args) const {
  if (tc_.empty()) return absl::FailedPreconditionError("no tc on this machine");
  return RunTool("tc", tc_, ns_fd, args);
}

absl::Status NetworkLab::RunTool(const std::string& name, const std::string& path, int ns_fd,
                                 const std::vector<std::string>& args) {
  std::vector<std::string> argv = {path};
  argv.insert(argv.end(), args.begin(), args.end());
  const CompletedCommand result = RunToCompletion(argv, kToolTimeout, ns_fd);
  if (result.exit_code == 0) return absl::OkStatus();
  std::string command = name;
  for (const std::string& a : args) absl::StrAppend(&command, " ", a);
  return absl::FailedPreconditionError(
      absl::StrCat("'", command, "' failed (exit ", result.exit_code,
                   "): ", absl::StripAsciiWhitespace(result.output)));
}

absl::StatusOr<std::unique_ptr<NetworkLab>> NetworkLab::Create() {
  std::unique_ptr<NetworkLab> lab(new NetworkLab());
  lab->ip_ = FindTool("ip");
  lab->tc_ = FindTool("tc");
  if (lab->ip_.empty()) {
    return absl::FailedPreconditionError("no `ip` (iproute2) in /usr/sbin, /sbin, /usr/bin, /bin");
  }
  // A 10.a.b.0/24 that no address or route of this machine uses.
  const CompletedCommand addresses =
      RunToCompletion({lab->ip_, "-o", "-4", "addr", "show"}, kToolTimeout);
  const CompletedCommand routes =
      RunToCompletion({lab->ip_, "-4", "route", "show", "table", "all"}, kToolTimeout);
  if (addresses.exit_code != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("`ip addr show` failed: ", absl::StripAsciiWhitespace(addresses.output)));
  }
  const int pid = getpid();
  for (int attempt = 0; attempt < 64 && lab->prefix_.empty(); ++attempt) {
    const int v = pid + attempt * 4099;
    const std::string prefix = absl::StrFormat("10.%d.%d.", 64 + (v / 251) % 128, 1 + v % 251);
    if (!absl::StrContains(addresses.output, prefix) && !absl::StrContains(routes.output, prefix)) {
      lab->prefix_ = prefix;
    }
  }
  if (lab->prefix_.empty()) return absl::FailedPreconditionError("no free 10.a.b.0/24 subnet");
  lab->gateway_ = absl::StrCat(lab->prefix_, "1");
  lab->root_link_ = absl::StrCat("rbc", pid);

  auto ns = NewNamespace();
  if (!ns.ok()) return ns.status();
  lab->lab_ = *ns;
  const int lab_fd = lab->lab_.fd;
  absl::Status built = lab->Ip(-1, {"link", "add", lab->root_link_, "type", "veth", "peer", "name",
                                    "up0", "netns", absl::StrCat(lab->lab_.holder)});
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"link", "set", "lo", "up"},
                                             {"link", "add", "br0", "type", "bridge"},
                                             {"link", "set", "br0", "up"},
                                             {"link", "set", "up0", "master", "br0"},
                                             {"link", "set", "up0", "up"}}) {
    if (built.ok()) built = lab->Ip(lab_fd, args);
  }
  if (built.ok()) {
    built =
        lab->Ip(-1, {"addr", "add", absl::StrCat(lab->gateway_, "/24"), "dev", lab->root_link_});
  }
  if (built.ok()) built = lab->Ip(-1, {"link", "set", lab->root_link_, "up"});
  if (!built.ok()) return built;  // the destructor removes what was made

  // Which qdiscs this kernel has, tried on the lab's bridge.
  absl::Status netem =
      lab->Tc(lab_fd, {"qdisc", "add", "dev", "br0", "root", "netem", "delay", "1ms"});
  lab->netem_problem_ = netem.ok() ? "" : std::string(netem.message());
  (void)lab->Tc(lab_fd, {"qdisc", "del", "dev", "br0", "root"});
  absl::Status tbf = lab->Tc(lab_fd, {"qdisc", "add", "dev", "br0", "root", "tbf", "rate", "10mbit",
                                      "burst", "32kbit", "latency", "100ms"});
  lab->tbf_problem_ = tbf.ok() ? "" : std::string(tbf.message());
  (void)lab->Tc(lab_fd, {"qdisc", "del", "dev", "br0", "root"});
  return lab;
}

NetworkLab::~NetworkLab() {
  if (!root_link_.empty() && lab_.fd >= 0) (void)Ip(-1, {"link", "del", root_link_});
  for (Namespace& ns : hosts_) Release(ns);
  Release(lab_);
}

absl::StatusOr<NetworkLab::Host> NetworkLab::AddHost() {
  const int index = static_cast<int>(hosts_.size());
  if (index >= kMaxHosts) return absl::ResourceExhaustedError("the lab has 200 hosts already");
  auto ns = NewNamespace();
  if (!ns.ok()) return ns.status();
  hosts_.push_back(*ns);
  partitioned_.push_back(false);
  Host host;
  host.index = index;
  host.address = absl::StrCat(prefix_, kFirstHostOctet + index);
  host.netns_fd = ns->fd;
  const std::string link = HostLink(index);
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"link", "add", link, "type", "veth", "peer", "name",
                                              "eth0", "netns", absl::StrCat(ns->holder)},
                                             {"link", "set", link, "master", "br0"},
                                             {"link", "set", link, "up"}}) {
    RETURN_IF_ERROR(Ip(lab_.fd, args));
  }
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"link", "set", "lo", "up"},
           {"addr", "add", absl::StrCat(host.address, "/24"), "dev", "eth0"},
           {"link", "set", "eth0", "up"}}) {
    RETURN_IF_ERROR(Ip(ns->fd, args));
  }
  return host;
}

void NetworkLab::ClearQdiscs(int index) {
  (void)Tc(lab_.fd, {"qdisc", "del", "dev", HostLink(index), "root"});
  (void)Tc(hosts_[index].fd, {"qdisc", "del", "dev", "eth0", "root"});
}

absl::Status NetworkLab::Partition(int index) {
  if (index < 0 || index >= static_cast<int>(hosts_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("no host ", index));
  }
  absl::Status down = Ip(lab_.fd, {"link", "set", HostLink(index), "down"});
  if (down.ok()) partitioned_[index] = true;
  return down;
}

absl::Status NetworkLab::Throttle(int index, int kbit_per_second) {
  if (index < 0 || index >= static_cast<int>(hosts_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("no host ", index));
  }
  if (!tbf()) return absl::FailedPreconditionError(tbf_problem_);
  const std::vector<std::string> shape = {
      "root",  "tbf",    "rate",    absl::StrCat(kbit_per_second, "kbit"),
      "burst", "32kbit", "latency", "2000ms"};
  return ShapeBothEnds(index, shape);
}

absl::Status NetworkLab::Netem(int index, int delay_ms, int jitter_ms, double loss_percent) {
  if (index < 0 || index >= static_cast<int>(hosts_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("no host ", index));
  }
  if (!netem()) return absl::FailedPreconditionError(netem_problem_);
  const std::vector<std::string> shape = {"root",
                                          "netem",
                                          "delay",
                                          absl::StrCat(delay_ms, "ms"),
                                          absl::StrCat(jitter_ms, "ms"),
                                          "loss",
                                          absl::StrFormat("%.2f%%", loss_percent)};
  return ShapeBothEnds(index, shape);
}

absl::Status NetworkLab::ShapeBothEnds(int index, const std::vector<std::string>& shape) {
  std::vector<std::string> lab_side = {"qdisc", "replace", "dev", HostLink(index)};
  lab_side.insert(lab_side.end(), shape.begin(), shape.end());
  std::vector<std::string> host_side = {"qdisc", "replace", "dev", "eth0"};
  host_side.insert(host_side.end(), shape.begin(), shape.end());
  absl::Status done = Tc(lab_.fd, lab_side);
  if (done.ok()) done = Tc(hosts_[index].fd, host_side);
  if (!done.ok()) ClearQdiscs(index);
  return done;
}

absl::Status NetworkLab::Heal(int index) {
  if (index < 0 || index >= static_cast<int>(hosts_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("no host ", index));
  }
  ClearQdiscs(index);
  if (!partitioned_[index]) return absl::OkStatus();
  absl::Status up = Ip(lab_.fd, {"link", "set", HostLink(index), "up"});
  if (up.ok()) partitioned_[index] = false;
  return up;
}

std::string NetworkLab::Describe() const {
  return absl::StrCat(
      "network namespaces: on (subnet ", prefix_, "0/24 via ", root_link_, ", server at ", gateway_,
      "); partitions: on; tbf throttling: ",
      tbf() ? "on" : absl::StrCat("unavailable (", tbf_problem_, ")"),
      "; netem delay/loss: ", netem() ? "on" : absl::StrCat("unavailable (", netem_problem_, ")"));
}

}  // namespace rebound::testing
