#include "testing/cluster/firewall.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/child_process.h"
#include "common/status_macros.h"

namespace rebound::testing {
namespace {

constexpr int kFirstMark = 0x5200;

// The mount point of the cgroup v2 hierarchy ("" if none), from /proc/self/mountinfo.
std::string CgroupV2Mount() {
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  while (std::getline(in, line)) {
    // ... mount_point ... - fstype source options
    const size_t dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    const std::vector<std::string> after = absl::StrSplit(line.substr(dash + 3), ' ');
    if (after.empty() || after[0] != "cgroup2") continue;
    const std::vector<std::string> before = absl::StrSplit(line.substr(0, dash), ' ');
    if (before.size() >= 5) return before[4];
  }
  return "";
}

// This process's cgroup v2 path ("/..."), from /proc/self/cgroup's "0::" line.
std::string OwnCgroupV2Path() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "0::")) return line.substr(3);
  }
  return "/";
}

bool ValidName(const std::string& name) {
  if (name.empty()) return false;
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_')) return false;
  }
  return true;
}

}  // namespace

absl::Status ProcessFirewall::Iptables(const std::vector<std::string>& args) const {
  std::vector<std::string> argv = {iptables_, "-w", "5"};
  argv.insert(argv.end(), args.begin(), args.end());
  const CompletedCommand done = RunToCompletion(argv, absl::Seconds(20));
  if (done.exit_code != 0) {
    return absl::InternalError(absl::StrCat("`", absl::StrJoin(argv, " "), "` failed (",
                                            DescribeExitCode(done.exit_code),
                                            "): ", done.output));
  }
  return absl::OkStatus();
}

void ProcessFirewall::RemoveStaleChains() const {
  const CompletedCommand listed = RunToCompletion({iptables_, "-w", "5", "-S"}, absl::Seconds(20));
  if (listed.exit_code != 0) return;
  for (absl::string_view line : absl::StrSplit(listed.output, '\n')) {
    if (!absl::ConsumePrefix(&line, "-N RBFW")) continue;
    int pid = 0;
    if (!absl::SimpleAtoi(line, &pid) || pid <= 0) continue;
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;  // its owner runs (or is not ours)
    const std::string chain = absl::StrCat("RBFW", pid);
    (void)Iptables({"-D", "OUTPUT", "-o", "lo", "-j", chain});
    (void)Iptables({"-F", chain});
    (void)Iptables({"-X", chain});
  }
}

absl::StatusOr<std::unique_ptr<ProcessFirewall>> ProcessFirewall::Create() {
  std::unique_ptr<ProcessFirewall> firewall(new ProcessFirewall());
  for (const char* path : {"/usr/sbin/iptables", "/sbin/iptables", "/usr/bin/iptables"}) {
    if (access(path, X_OK) == 0) {
      firewall->iptables_ = path;
      break;
    }
  }
  if (firewall->iptables_.empty()) {
    return absl::FailedPreconditionError(
        "no iptables (Debian package iptables; tools/setup.sh installs it)");
  }
  firewall->cgroup_root_ = CgroupV2Mount();
  if (firewall->cgroup_root_.empty()) {
    return absl::FailedPreconditionError("no cgroup v2 hierarchy is mounted");
  }
  std::string own = OwnCgroupV2Path();
  if (own == "/") own.clear();
  const std::string leaf = absl::StrCat("rebound-fw-", getpid());
  firewall->base_dir_ = absl::StrCat(firewall->cgroup_root_, own, "/", leaf);
  firewall->base_path_ = absl::StrCat(absl::StripPrefix(own, "/"), own.empty() ? "" : "/", leaf);
  std::error_code error;
  std::filesystem::create_directories(firewall->base_dir_, error);
  if (error) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot make the cgroup ", firewall->base_dir_, ": ", error.message(), " (needs root)"));
  }
  firewall->RemoveStaleChains();
  firewall->chain_ = absl::StrCat("RBFW", getpid());
  absl::Status made = firewall->Iptables({"-N", firewall->chain_});
  if (!made.ok()) {
    std::filesystem::remove(firewall->base_dir_, error);
    firewall->chain_.clear();
    return absl::FailedPreconditionError(
        absl::StrCat("iptables refuses a chain (needs root, CAP_NET_ADMIN): ", made.message()));
  }
  // The cgroup and connmark matches must exist in this kernel: try them once.
  const std::vector<std::string> probe = {
      "-A", firewall->chain_, "-m", "cgroup", "--path", firewall->base_path_, "-j", "CONNMARK",
      "--set-mark", "0"};
  if (absl::Status works = firewall->Iptables(probe); !works.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("iptables' cgroup match or CONNMARK target is missing: ", works.message()));
  }
  if (absl::Status flushed = firewall->Iptables({"-F", firewall->chain_}); !flushed.ok()) {
    return absl::FailedPreconditionError(flushed.message());
  }
  if (absl::Status hooked =
          firewall->Iptables({"-I", "OUTPUT", "-o", "lo", "-j", firewall->chain_});
      !hooked.ok()) {
    return absl::FailedPreconditionError(hooked.message());
  }
  return firewall;
}

ProcessFirewall::~ProcessFirewall() {
  if (!chain_.empty()) {
    (void)Iptables({"-D", "OUTPUT", "-o", "lo", "-j", chain_});
    (void)Iptables({"-F", chain_});
    (void)Iptables({"-X", chain_});
  }
  std::error_code ignored;
  for (const auto& [name, group] : groups_) std::filesystem::remove(group.dir, ignored);
  if (!base_dir_.empty()) std::filesystem::remove(base_dir_, ignored);
}

absl::StatusOr<std::string> ProcessFirewall::Group(const std::string& name) {
  if (!ValidName(name)) {
    return absl::InvalidArgumentError(absl::StrCat("firewall group name '", name, "'"));
  }
  auto it = groups_.find(name);
  if (it != groups_.end()) return it->second.dir;
  GroupState group;
  group.dir = absl::StrCat(base_dir_, "/", name);
  group.path = absl::StrCat(base_path_, "/", name);
  group.mark = kFirstMark + static_cast<int>(groups_.size()) + 1;
  std::error_code error;
  std::filesystem::create_directories(group.dir, error);
  if (error) {
    return absl::InternalError(absl::StrCat("cannot make the cgroup ", group.dir, ": ",
                                            error.message()));
  }
  const std::string dir = group.dir;
  groups_.emplace(name, std::move(group));
  return dir;
}

absl::Status ProcessFirewall::AddCut(const std::string& name,
                                     const std::vector<std::string>& match) {
  RETURN_IF_ERROR(Heal(name));
  GroupState& group = groups_.at(name);
  const std::string mark = absl::StrCat(group.mark);
  std::vector<std::string> marking = {"-m", "cgroup", "--path", group.path};
  marking.insert(marking.end(), match.begin(), match.end());
  for (const std::string& part : {"-j", "CONNMARK", "--set-mark"}) marking.push_back(part);
  marking.push_back(mark);
  const std::vector<std::string> dropping = {"-m", "connmark", "--mark", mark, "-j", "DROP"};
  for (const std::vector<std::string>& rule : {marking, dropping}) {
    std::vector<std::string> add = {"-A", chain_};
    add.insert(add.end(), rule.begin(), rule.end());
    RETURN_IF_ERROR(Iptables(add));
    group.rules.push_back(rule);
  }
  return absl::OkStatus();
}

absl::Status ProcessFirewall::CutFromPorts(const std::string& name, const std::vector<int>& ports) {
  if (groups_.count(name) == 0) return absl::NotFoundError(absl::StrCat("no group '", name, "'"));
  if (ports.empty()) return absl::InvalidArgumentError("CutFromPorts: no port");
  std::vector<std::string> numbers;
  for (int port : ports) numbers.push_back(absl::StrCat(port));
  return AddCut(name, {"-p", "tcp", "-m", "multiport", "--dports", absl::StrJoin(numbers, ",")});
}

absl::Status ProcessFirewall::Isolate(const std::string& name) {
  if (groups_.count(name) == 0) return absl::NotFoundError(absl::StrCat("no group '", name, "'"));
  return AddCut(name, {});
}

absl::Status ProcessFirewall::Heal(const std::string& name) {
  auto it = groups_.find(name);
  if (it == groups_.end()) return absl::NotFoundError(absl::StrCat("no group '", name, "'"));
  absl::Status healed = absl::OkStatus();
  for (const std::vector<std::string>& rule : it->second.rules) {
    std::vector<std::string> remove = {"-D", chain_};
    remove.insert(remove.end(), rule.begin(), rule.end());
    if (absl::Status s = Iptables(remove); !s.ok() && healed.ok()) healed = s;
  }
  it->second.rules.clear();
  return healed;
}

std::string ProcessFirewall::Describe() const {
  return absl::StrCat("process firewall: iptables chain ", chain_, ", cgroups under ", base_dir_);
}

}  // namespace rebound::testing
