#include "tools/launch/launcher.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/clock.h"
#include "common/config.h"
#include "common/export_file.h"
#include "common/file.h"
#include "common/process.h"
#include "common/server_addresses.h"
#include "grpcpp/grpcpp.h"
#include "testing/etcd/etcd_process.h"
#include "tools/shard_table.h"

namespace rebound::launch {
namespace {

constexpr absl::Duration kStartupWait = absl::Seconds(60);
constexpr absl::Duration kStatusDeadline = absl::Seconds(5);
// GetStatus's deadline while a group elects its first leader or fails over: a call that a
// connection attempt holds up is given up soon and retried on a fresh channel.
constexpr absl::Duration kElectionStatusDeadline = absl::Seconds(1);
// --kill_trainer_at_step under REPLAY: how many logged steps past the snapshot to wait for, and
// for how long at most.
constexpr int64_t kKillLoggedSteps = 3;
constexpr absl::Duration kKillAlignLimit = absl::Seconds(5);
constexpr absl::Duration kProgressPeriod = absl::Seconds(1);
constexpr absl::Duration kStopGrace = absl::Seconds(10);
constexpr int kLogTailLines = 20;
// --kill_leader_at_step: how long to wait for a standby in sync before killing anyway; when to
// start the killed member again (after the kill, and not before a new leader answered, unless
// that takes longer than kNewLeaderWait); how often to poll, and for how long at most, while the
// failover and the return are watched.
constexpr absl::Duration kInSyncWait = absl::Seconds(60);
constexpr absl::Duration kRestartDelay = absl::Seconds(5);
constexpr absl::Duration kNewLeaderWait = absl::Seconds(30);
constexpr absl::Duration kFailoverPoll = absl::Milliseconds(50);
// After every slot finished: how long the evaluator gets to evaluate the final center.
constexpr absl::Duration kFinalEvalWait = absl::Seconds(60);
constexpr absl::Duration kFailoverWatchLimit = absl::Seconds(120);

constexpr int kExitFinished = 0;
// ExportCenter's deadline: the whole model in one answer.
constexpr absl::Duration kExportDeadline = absl::Seconds(60);
constexpr int kExitFailed = 1;

// Each run of the launcher starts its children's logs afresh.
ChildProcessOptions FreshLog() {
  ChildProcessOptions options;
  options.truncate_log = true;
  return options;
}

bool IsExecutableFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
}

std::string DirName(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return "";
  return slash == 0 ? "/" : path.substr(0, slash);
}

absl::StatusOr<std::string> FindBinary(const std::string& argv0, const std::string& explicit_path,
                                       const std::string& flag, const std::string& package,
                                       const std::string& name) {
  if (!explicit_path.empty()) {
    if (!IsExecutableFile(explicit_path)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " ", explicit_path, " is not an executable file"));
    }
    return AbsolutePath(explicit_path);
  }
  std::vector<std::string> dirs;
  if (const std::string dir = DirName(argv0); !dir.empty()) dirs.push_back(dir);
  char self[4096] = {0};
  const ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (length > 0) dirs.push_back(DirName(std::string(self, length)));
  std::vector<std::string> candidates;
  for (const std::string& dir : dirs) {
    candidates.push_back(absl::StrCat(dir, "/", name));
    candidates.push_back(absl::StrCat(dir, "/../../", package, "/", name));
  }
  if (const char* path = getenv("PATH"); path != nullptr) {
    for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
      candidates.push_back(absl::StrCat(dir, "/", name));
    }
  }
  for (const std::string& candidate : candidates) {
    if (IsExecutableFile(candidate)) return AbsolutePath(candidate);
  }
  return absl::NotFoundError(absl::StrCat("cannot find ", name, " (looked at ",
                                          absl::StrJoin(candidates, ", "), "); pass --", flag));
}

// What rebound_worker's exit code means (docs/operations.md).
std::string DescribeWorkerExit(int code) {
  std::string text = DescribeExitCode(code);
  switch (code) {
    case 0:
      return text + " (stopped)";
    case 2:
      return text + " (bad config or flags)";
    case 3:
      return text + " (fenced by the server)";
    case 4:
      return text + " (server unreachable for give_up_after_ms)";
    case 5:
      return text + " (registration refused)";
    case 127:
      return text + " (could not be executed)";
    default:
      return text;
  }
}

const char* SignalName(int signal_number) {
  return signal_number == SIGINT ? "SIGINT" : signal_number == SIGTERM ? "SIGTERM" : "signal";
}

// Waits up to `wait` for SIGTERM or SIGINT (blocked, so they stay pending until taken here).
// Returns the signal, or 0 when none arrived.
int TakeTerminationSignal(absl::Duration wait) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  wait = std::max(wait, absl::ZeroDuration());
  const timespec timeout = absl::ToTimespec(wait);
  const int signal_number = sigtimedwait(&set, nullptr, &timeout);
  return signal_number > 0 ? signal_number : 0;
}

// `count` distinct free TCP ports on 127.0.0.1: all bound at once (so none repeats), then
// released for the group's members to bind.
absl::StatusOr<std::vector<int>> FreeLoopbackPorts(int count) {
  std::vector<int> fds;
  std::vector<int> ports;
  absl::Status status;
  for (int i = 0; i < count && status.ok(); ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      status = absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
      break;
    }
    fds.push_back(fd);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      status = absl::InternalError(absl::StrCat("bind 127.0.0.1:0: ", std::strerror(errno)));
      break;
    }
    ports.push_back(ntohs(address.sin_port));
  }
  for (int fd : fds) close(fd);
  if (!status.ok()) return status;
  return ports;
}

// A channel to every member of a group at once, as the workers' (common/server_addresses.h):
// pick_first connects to the first address that accepts, the leader's (standbys do not listen on
// the workers' port). With subchannels of its own: the launcher makes a new channel after each
// failed call (PollStatus) so that its next call tries every member at once, instead of after
// the reconnect backoff of a channel whose attempts failed; a failover is then seen as soon as
// the new leader serves.
std::shared_ptr<grpc::Channel> GroupChannel(const std::string& address_list) {
  grpc::ChannelArguments args;
  AddFailoverChannelArgs(&args);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  absl::StatusOr<std::string> target = ChannelTarget(address_list);  // numeric: cannot fail
  return grpc::CreateCustomChannel(target.ok() ? *target : address_list,
                                   grpc::InsecureChannelCredentials(), args);
}

}  // namespace

absl::StatusOr<Binaries> FindBinaries(const std::string& argv0, const LaunchOptions& options) {
  Binaries binaries;
  absl::StatusOr<std::string> server =
      FindBinary(argv0, options.server_binary, "server_binary", "server", "rebound_server");
  if (!server.ok()) return server.status();
  binaries.server = *std::move(server);
  if (!options.worker_command.empty()) {
    binaries.worker_command = absl::StrSplit(options.worker_command, ' ', absl::SkipEmpty());
    return binaries;
  }
  absl::StatusOr<std::string> worker =
      FindBinary(argv0, options.worker_binary, "worker_binary", "worker", "rebound_worker");
  if (!worker.ok()) return worker.status();
  binaries.worker = *std::move(worker);
  return binaries;
}

Launcher::Launcher(LaunchOptions options, JobConfig job, Binaries binaries, const Clock* clock)
    : options_(std::move(options)),
      job_(std::move(job)),
      shard_groups_(ShardGroups(options_, job_)),
      binaries_(std::move(binaries)),
      clock_(clock),
      start_(clock_->Now()) {
  if (options_.timeout_s > 0) deadline_ = start_ + absl::Seconds(options_.timeout_s);
}

Launcher::~Launcher() {
  if (csv_ != nullptr) std::fclose(csv_);
}

int Launcher::Run() {
  std::optional<int> code = PrepareWorkDir();
  if (!code.has_value()) code = StartServer();
  if (!code.has_value()) code = StartWorkers();
  if (!code.has_value()) code = Supervise();
  if (code == kExitFinished) AwaitFinalEvaluation();
  if (code == kExitFinished && !options_.export_path.empty()) code = ExportModel();
  if (sharded() && !shard_stubs_.empty()) PrintShardSummary();
  StopAll();
  if (const std::string summary = group_watch_.Summary(); !summary.empty()) Print(summary);
  PrintFinalEvaluation();
  if (!workdir_.empty()) Print(absl::StrCat("work dir (kept, one log per process): ", workdir_));
  Print(absl::StrCat("exit ", *code));
  return *code;
}

void Launcher::AwaitFinalEvaluation() {
  const Worker* evaluator = nullptr;
  for (const Worker& w : workers_) {
    if (w.plan.role == LaunchRole::kEvaluator) evaluator = &w;
  }
  if (evaluator == nullptr) return;
  // Every slot finished: the evaluator evaluates the final center once more, reports it and
  // leaves (worker/evaluator.h, rebound.torch's evaluator). Wait for that report, bounded.
  const absl::Time limit = clock_->Now() + kFinalEvalWait;
  while (clock_->Now() < limit) {
    const bool left = evaluator->process->Poll().has_value();
    if (PollStatus().has_value() && tracker_.evaluated_version().has_value() &&
        tracker_.evaluated_version() == tracker_.center_version()) {
      return;
    }
    if (left) return;  // its last report is in the status just read
    clock_->WaitFor(absl::Milliseconds(100), nullptr);
  }
  Print(absl::StrCat("the evaluator did not report the final center within ",
                     absl::FormatDuration(kFinalEvalWait)));
}

void Launcher::PrintFinalEvaluation() {
  if (!tracker_.test_accuracy().has_value() && !tracker_.test_loss().has_value()) return;
  std::string figures =
      tracker_.test_accuracy().has_value()
          ? absl::StrFormat("test accuracy %.4f", *tracker_.test_accuracy())
          : std::string();
  if (tracker_.test_loss().has_value()) {
    absl::StrAppend(&figures, figures.empty() ? "" : ", ",
                    absl::StrFormat("test loss %.4f", *tracker_.test_loss()));
  }
  const std::optional<int64_t> evaluated = tracker_.evaluated_version();
  const std::optional<int64_t> center = tracker_.center_version();
  if (tracker_.AllFinished() && evaluated.has_value() && evaluated == center) {
    Print(absl::StrCat("final ", figures, " of the final center (version ", *center,
                       ", evaluated after every slot finished)"));
  } else {
    Print(absl::StrCat("last ", figures,
                       evaluated.has_value() ? absl::StrCat(" of center version ", *evaluated)
                                             : std::string(),
                       center.has_value() ? absl::StrCat(" (the center is at version ",
                                                         *center, ")")
                                          : std::string()));
  }
}

std::optional<int> Launcher::PrepareWorkDir() {
  if (options_.workdir.empty()) {
    char pattern[] = "/tmp/rebound-launch-XXXXXX";
    if (mkdtemp(pattern) == nullptr) {
      Print(absl::StrCat("cannot create a work dir under /tmp: ", std::strerror(errno)));
      return kExitFailed;
    }
    workdir_ = pattern;
  } else {
    workdir_ = AbsolutePath(options_.workdir);
    std::error_code error;
    std::filesystem::create_directories(workdir_, error);
    if (error || !std::filesystem::is_directory(workdir_)) {
      Print(absl::StrCat("cannot create the work dir ", workdir_, ": ", error.message()));
      workdir_.clear();
      return kExitFailed;
    }
  }
  Print(absl::StrCat("work dir ", workdir_));

  const std::string data_dir = options_.data_dir.empty() ? "" : AbsolutePath(options_.data_dir);
  const std::string server_config = workdir_ + "/server.pbtxt";
  const std::string worker_config = workdir_ + "/worker.pbtxt";
  job_file_ = AbsolutePath(options_.job_file);
  std::vector<std::pair<std::string, std::string>> files;
  // A job file that does not shard (CheckOptionsAgainstJob) or sets no start barrier: the servers
  // read its copy with sharding.groups = K and min_trainers = every slot.
  std::string changes;
  const JobConfig launched = LaunchedJob(job_, shard_groups_, &changes,
                                         options_.corrupt_trainer_at_step.has_value());
  launched_ = launched;
  if (!changes.empty()) {
    const std::string copy = workdir_ + "/job.launch.pbtxt";
    files.emplace_back(copy, LaunchedJobText(launched, job_file_, changes));
    job_file_ = copy;
    Print(absl::StrCat("the servers read ", copy, ": the job with ", changes));
  }
  // The members get their configs once etcd runs and their ports are known (StartMembers).
  if (!uses_members()) {
    files.emplace_back(server_config, ServerConfigText(job_file_, options_.port, data_dir));
  }
  files.emplace_back(worker_config, replicated() ? GroupWorkerConfigText(job_.job_id())
                                                 : WorkerConfigText(job_.job_id()));
  for (const auto& [path, text] : files) {
    if (absl::Status written = WriteFileAtomically(path, text); !written.ok()) {
      Print(std::string(written.message()));
      return kExitFailed;
    }
  }
  // The daemons would reject a bad file only after they started; check both here.
  if (!uses_members()) {
    if (absl::StatusOr<ServerConfig> loaded = LoadServerConfig(server_config); !loaded.ok()) {
      Print(absl::StrCat("the generated server config does not load:\n",
                         loaded.status().message()));
      return kExitFailed;
    }
  }
  if (absl::StatusOr<WorkerConfig> loaded = LoadWorkerConfig(worker_config); !loaded.ok()) {
    Print(absl::StrCat("the generated worker config does not load:\n", loaded.status().message()));
    return kExitFailed;
  }

  if (!options_.progress_csv.empty()) {
    csv_ = std::fopen(options_.progress_csv.c_str(), "ae");
    if (csv_ == nullptr) {
      Print(absl::StrCat("cannot open --progress_csv ", options_.progress_csv, ": ",
                         std::strerror(errno)));
      return kExitFailed;
    }
    std::fseek(csv_, 0, SEEK_END);
    if (std::ftell(csv_) == 0) WriteCsv(kCsvHeader);
  }
  return std::nullopt;
}

std::optional<int> Launcher::StartServer() {
  if (uses_members()) return StartMembers();
  const std::string port_file = workdir_ + "/server.port";
  unlink(port_file.c_str());  // a port left by an earlier run in the same work dir is stale
  absl::StatusOr<std::unique_ptr<ChildProcess>> started = ChildProcess::Start(
      {binaries_.server, "--config", workdir_ + "/server.pbtxt", "--port_file", port_file},
      workdir_ + "/server.log", FreshLog());
  if (!started.ok()) {
    Print(absl::StrCat("cannot start rebound_server: ", started.status().message()));
    return kExitFailed;
  }
  server_ = *std::move(started);
  Print(absl::StrCat("started rebound_server (pid ", server_->pid(), "), log ",
                     server_->log_path()));

  const absl::Time give_up = clock_->Now() + kStartupWait;
  while (true) {
    if (std::optional<int> port = ReadPortFile(port_file)) {
      port_ = *port;
      break;
    }
    if (std::optional<int> code = Watch(absl::Milliseconds(50))) return code;
    if (clock_->Now() >= give_up) {
      Print(absl::StrCat("rebound_server wrote no port within ", absl::FormatDuration(kStartupWait),
                         "; the last lines of its log:\n",
                         TailOfFile(server_->log_path(), kLogTailLines)));
      return kExitFailed;
    }
  }
  const std::string address = absl::StrCat("127.0.0.1:", port_);
  server_address_ = address;
  stub_ = ParameterServer::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  Print(absl::StrCat("server listening on ", address));
  return std::nullopt;
}

std::optional<int> Launcher::StartMembers() {
  std::vector<std::string> endpoints;
  if (replicated()) {
    testing::EtcdClusterOptions etcd_options;
    etcd_options.members = options_.etcd_members;
    Print(absl::StrCat("starting etcd: ", etcd_options.members, " member",
                       etcd_options.members == 1 ? "" : "s", " (", etcd_options.etcd_binary,
                       ") on loopback"));
    absl::StatusOr<std::unique_ptr<testing::EtcdCluster>> etcd =
        testing::EtcdCluster::Start(etcd_options);
    if (!etcd.ok()) {
      Print(absl::StrCat("cannot start etcd: ", etcd.status().message()));
      return kExitFailed;
    }
    etcd_ = *std::move(etcd);
    endpoints = etcd_->client_endpoints();
    Print(absl::StrCat("etcd serving on ", absl::StrJoin(endpoints, ","), " (data and logs in ",
                       etcd_->dir(), ", removed at exit)"));
  }

  const int count = shard_groups_ * (1 + options_.standbys);
  std::vector<int> ports;
  if (options_.port != 0) {
    for (int i = 0; i < count; ++i) ports.push_back(options_.port + i);
  } else {
    absl::StatusOr<std::vector<int>> free_ports = FreeLoopbackPorts(count);
    if (!free_ports.ok()) {
      Print(absl::StrCat("cannot find free ports: ", free_ports.status().message()));
      return kExitFailed;
    }
    ports = *std::move(free_ports);
  }
  // A replicated group's members keep their state on disk (a standby catches up from it), in
  // the work dir without --data_dir; a shard group of one server keeps it in memory then, as one
  // server does.
  std::string data_parent;
  if (!options_.data_dir.empty()) {
    data_parent = AbsolutePath(options_.data_dir);
  } else if (replicated()) {
    data_parent = workdir_;
  }
  const std::vector<GroupMemberPlan> plans =
      PlanShardGroups(shard_groups_, options_.standbys, ports, data_parent);
  shard_addresses_ = ShardAddressLists(plans, shard_groups_);
  for (const GroupMemberPlan& plan : plans) {
    if (options_.data_dir.empty() && !plan.data_dir.empty() &&
        std::filesystem::exists(plan.data_dir)) {
      // Without --data_dir a job starts afresh, as one server's in-memory state does.
      std::error_code error;
      std::filesystem::remove_all(plan.data_dir, error);
      Print(absl::StrCat("removed ", plan.data_dir, ", left by an earlier run in this work dir",
                         error ? absl::StrCat(" (failed: ", error.message(), ")") : ""));
    }
    const std::string config = absl::StrCat(workdir_, "/", plan.name, ".pbtxt");
    const std::string text =
        sharded() ? ShardMemberConfigText(job_file_, plan, options_.standbys, endpoints,
                                          shard_addresses_)
                  : GroupMemberConfigText(job_file_, plan, options_.standbys, endpoints);
    if (absl::Status written = WriteFileAtomically(config, text); !written.ok()) {
      Print(std::string(written.message()));
      return kExitFailed;
    }
    if (absl::StatusOr<ServerConfig> loaded = LoadServerConfig(config); !loaded.ok()) {
      Print(absl::StrCat("the generated config of ", plan.name, " does not load:\n",
                         loaded.status().message()));
      return kExitFailed;
    }
    Member member;
    member.plan = plan;
    member.argv = {binaries_.server, "--config", config};
    const std::string log = absl::StrCat(workdir_, "/", plan.name, ".log");
    absl::StatusOr<std::unique_ptr<ChildProcess>> started =
        ChildProcess::Start(member.argv, log, FreshLog());
    if (!started.ok()) {
      Print(absl::StrCat("cannot start ", plan.name, ": ", started.status().message()));
      return kExitFailed;
    }
    member.process = *std::move(started);
    Print(absl::StrCat("started ", plan.name, " (rebound_server, pid ", member.process->pid(),
                       ") for 127.0.0.1:", plan.port,
                       sharded() ? absl::StrCat(", shard group ", plan.shard_group) : "",
                       plan.data_dir.empty() ? ", state in memory"
                                             : absl::StrCat(", data dir ", plan.data_dir),
                       ", log ", log));
    members_.push_back(std::move(member));
  }
  server_address_ = shard_addresses_.front();
  stub_ = ParameterServer::NewStub(GroupChannel(server_address_));
  if (sharded()) return WaitForShardGroups();

  // Nobody serves the list until a member leads: no need to print each refusal meanwhile.
  quiet_status_errors_ = true;
  const absl::Time give_up = clock_->Now() + kStartupWait;
  while (true) {
    if (PollStatus().has_value() && !group_watch_.leader().empty()) break;
    if (std::optional<int> code = Watch(absl::Milliseconds(100))) return code;
    if (clock_->Now() >= give_up) {
      Print(absl::StrCat("cannot start the server group: no member leads within ",
                         absl::FormatDuration(kStartupWait), " (last: ", quiet_status_error_,
                         "); the last lines of ",
                         members_.front().plan.name, "'s log:\n",
                         TailOfFile(members_.front().process->log_path(), kLogTailLines)));
      return kExitFailed;
    }
  }
  quiet_status_errors_ = false;
  Print(absl::StrCat("server group up: ", group_watch_.leader(),
                     " leads; workers get --server ", server_address_));
  return std::nullopt;
}

std::optional<int> Launcher::WaitForShardGroups() {
  for (const std::string& address : shard_addresses_) {
    shard_stubs_.push_back(ParameterServer::NewStub(GroupChannel(address)));
  }
  const absl::Time give_up = clock_->Now() + kStartupWait;
  GetStatusResponse group0;
  for (int g = 0; g < shard_groups_; ++g) {
    std::string last = "no answer yet";
    while (true) {
      GetStatusResponse response;
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(clock_->Now() + kElectionStatusDeadline));
      const grpc::Status status = shard_stubs_[g]->GetStatus(&context, GetStatusRequest(),
                                                            &response);
      if (status.ok()) {
        const bool leads =
            !replicated() || response.group().role() == GroupStatus::LEADER;
        if (response.has_sharding() && response.sharding().group() != g) {
          Print(absl::StrCat("cannot start the shard groups: the server at ", shard_addresses_[g],
                             " says it holds range ", response.sharding().group(), ", not ", g));
          return kExitFailed;
        }
        if (response.has_sharding() && leads) {
          Print(absl::StrCat("shard group ", g, " up at ", shard_addresses_[g], ": ",
                             tools::DescribeRole(response)));
          if (g == 0) group0 = std::move(response);
          break;
        }
        last = response.has_sharding() ? "no member leads yet" : "no sharding status";
      } else {
        last = absl::StrCat("GetStatus failed: code ", status.error_code(), ": ",
                            status.error_message());
        // A fresh channel: the next call tries every member at once (see GroupChannel).
        shard_stubs_[g] = ParameterServer::NewStub(GroupChannel(shard_addresses_[g]));
      }
      if (std::optional<int> code = Watch(absl::Milliseconds(100))) return code;
      if (clock_->Now() >= give_up) {
        const Member* first = nullptr;
        for (const Member& m : members_) {
          if (m.plan.shard_group == g) {
            first = &m;
            break;
          }
        }
        Print(absl::StrCat("cannot start shard group ", g, " (", shard_addresses_[g],
                           "): not ready within ", absl::FormatDuration(kStartupWait), " (last: ",
                           last, "); the last lines of ", first->plan.name, "'s log:\n",
                           TailOfFile(first->process->log_path(), kLogTailLines)));
        return kExitFailed;
      }
    }
  }
  Print(absl::StrCat("center sharded across ", shard_groups_,
                     " groups; each holds one range of every stage:\n",
                     tools::FormatRanges(group0.sharding(), std::nullopt),
                     "workers get group 0's address: --server ", server_address_));
  return std::nullopt;
}

void Launcher::PrintShardSummary() {
  for (int g = 0; g < static_cast<int>(shard_stubs_.size()); ++g) {
    GetStatusResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(clock_->Now() + absl::Seconds(2)));
    const grpc::Status status =
        shard_stubs_[g]->GetStatus(&context, GetStatusRequest(), &response);
    Print(absl::StrCat("shard group ", g, " (", shard_addresses_[g], "): ",
                       status.ok() ? absl::StrCat("center versions ",
                                                  tools::DescribeCenters(response))
                                   : absl::StrCat("no answer: ", status.error_message())));
  }
}

std::optional<int> Launcher::StartWorker(const WorkerPlan& plan, size_t* index) {
  const std::string log = absl::StrCat(workdir_, "/", plan.name, ".log");
  std::vector<std::string> argv = binaries_.worker_command;
  if (argv.empty()) argv = {binaries_.worker, "--config", workdir_ + "/worker.pbtxt"};
  for (const std::string& arg : {std::string("--server"), server_address_,
                                 std::string("--name"), plan.name, std::string("--role"),
                                 std::string(RoleFlag(plan.role))}) {
    argv.push_back(arg);
  }
  const bool corrupt = options_.corrupt_trainer_at_step.has_value() &&
                       plan.role == LaunchRole::kTrainer && plan.slot == options_.corrupt_slot;
  if (corrupt) {
    argv.push_back(absl::StrCat("--fault_flip_bit_at_step=", *options_.corrupt_trainer_at_step));
    argv.push_back(absl::StrCat("--fault_flip_bit_repeat_every=", options_.corrupt_every));
  }
  absl::StatusOr<std::unique_ptr<ChildProcess>> started =
      ChildProcess::Start(argv, log, FreshLog());
  if (!started.ok()) {
    Print(absl::StrCat("cannot start ", plan.name, ": ", started.status().message()));
    return kExitFailed;
  }
  Worker worker;
  worker.plan = plan;
  worker.process = *std::move(started);
  Print(absl::StrCat("started ", plan.name, " (pid ", worker.process->pid(), ", --role ",
                     RoleFlag(plan.role), "), log ", log,
                     corrupt ? absl::StrCat("; it flips a bit after step ",
                                            *options_.corrupt_trainer_at_step,
                                            options_.corrupt_every > 0
                                                ? absl::StrCat(" and every ", options_.corrupt_every,
                                                               " steps")
                                                : std::string())
                             : std::string()));
  workers_.push_back(std::move(worker));
  *index = workers_.size() - 1;
  return std::nullopt;
}

std::optional<int> Launcher::StartWorkers() {
  // The launched job's: --corrupt_trainer_at_step adds a spare.
  const std::vector<WorkerPlan> plan = PlanWorkers(launched_);
  int trainers = 0;
  std::vector<size_t> others;
  for (const WorkerPlan& p : plan) {
    size_t index = 0;
    if (std::optional<int> code = StartWorker(p, &index)) return code;
    if (p.role != LaunchRole::kTrainer) {
      others.push_back(index);
      continue;
    }
    // One trainer at a time: the server gives the first UNASSIGNED slot to each registration.
    ++trainers;
    if (std::optional<int> code = WaitForRegistration({index})) return code;
    const WorkerStatus* registered = tracker_.FindAliveWorker(p.name);
    const SlotCoord got{registered->slot().replica(), registered->slot().stage()};
    if (p.slot.has_value() && got != *p.slot) {
      Print(absl::StrCat("warning: ", p.name, " owns slot ", FormatSlot(got), ", not ",
                         FormatSlot(*p.slot), " (the server had other trainers already)"));
    }
  }
  if (!others.empty()) {
    if (std::optional<int> code = WaitForRegistration(others)) return code;
  }
  cluster_up_ = true;
  const int spares = launched_.topology().spares();
  Print(absl::StrFormat("cluster up: %d trainer%s, %d spare%s, %s", trainers,
                        trainers == 1 ? "" : "s", spares, spares == 1 ? "" : "s",
                        job_.topology().evaluator() ? "1 evaluator" : "no evaluator"));
  return std::nullopt;
}

std::optional<int> Launcher::WaitForRegistration(const std::vector<size_t>& indices) {
  const absl::Time give_up = clock_->Now() + kStartupWait;
  while (true) {
    std::vector<std::string> missing;
    if (PollStatus().has_value()) {
      for (size_t i : indices) {
        if (tracker_.FindAliveWorker(workers_[i].plan.name) == nullptr) {
          missing.push_back(workers_[i].plan.name);
        }
      }
      if (missing.empty()) return std::nullopt;
    }
    if (std::optional<int> code = Watch(absl::Milliseconds(100))) return code;
    for (size_t i : indices) {
      Worker& w = workers_[i];
      if (w.process->Poll().has_value() && tracker_.FindAliveWorker(w.plan.name) == nullptr) {
        Print(absl::StrCat("cannot start the cluster: ", w.plan.name,
                           " exited before registering; the last lines of its log:\n",
                           TailOfFile(w.process->log_path(), kLogTailLines)));
        return kExitFailed;
      }
    }
    if (clock_->Now() >= give_up) {
      Print(absl::StrCat("cannot start the cluster: ",
                         missing.empty() ? "the server" : absl::StrJoin(missing, ", "),
                         missing.empty() ? " did not answer GetStatus" : " did not register",
                         " within ", absl::FormatDuration(kStartupWait)));
      return kExitFailed;
    }
  }
}

int Launcher::ExportModel() {
  ExportCenterResponse response;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(clock_->Now() + kExportDeadline));
  // An operator call from the server's own host: the launcher's servers have no operator token.
  const grpc::Status status = stub_->ExportCenter(&context, ExportCenterRequest(), &response);
  if (!status.ok()) {
    Print(absl::StrCat("cannot export the model: ", status.error_message()));
    return kExitFailed;
  }
  absl::StatusOr<std::string> bytes = ExportToSafetensors(response);
  absl::Status written = bytes.ok() ? WriteFileDurably(AbsolutePath(options_.export_path), *bytes)
                                    : bytes.status();
  if (!written.ok()) {
    Print(absl::StrCat("cannot export the model: ", written.message()));
    return kExitFailed;
  }
  std::vector<int64_t> versions;
  for (const ExportedStage& stage : response.stages()) versions.push_back(stage.center_version());
  Print(absl::StrCat("the trained model (center version ", absl::StrJoin(versions, ","), ", ",
                     bytes->size(), " bytes, safetensors) is in ",
                     AbsolutePath(options_.export_path),
                     "; in Python: rebound.torch.load_safetensors(\"",
                     AbsolutePath(options_.export_path), "\") (docs/operations.md)"));
  return kExitFinished;
}

std::optional<int> Launcher::Supervise() {
  absl::Time next = clock_->Now();
  absl::Time next_line = next;
  while (true) {
    if (std::optional<int> code = Watch(next - clock_->Now())) return code;
    const absl::Time now = clock_->Now();
    if (now < next) continue;  // woken early; nothing to do yet
    // While a failover is watched, poll often enough to time it; print once a second anyway.
    const bool watching_failover =
        group_watch_.watching() && now - killed_at_ < kFailoverWatchLimit;
    // Also while a trainer kill waits for its step: the slot's step is then read every 50 ms,
    // so the kill lands within one sync period of the step asked (the step status shows moves
    // at each sync), not up to a second of training later.
    const bool kill_pending = options_.kill_trainer_at_step.has_value() && !kill_done_;
    next = std::max(
        next + (watching_failover || kill_pending ? kFailoverPoll : kProgressPeriod), now);
    MaybeRestartKilledMember();
    if (!PollStatus().has_value()) continue;
    if (now >= next_line) {
      next_line = std::max(next_line + kProgressPeriod, now);
      Print(tracker_.ProgressLine());
      for (const std::string& row : tracker_.CsvRows(Elapsed())) WriteCsv(row);
    }
    MaybeKillTrainer();
    if (MaybeKillLeader()) next = clock_->Now() + kFailoverPoll;  // time the failover from now
    if (tracker_.AllFinished()) {
      Print("every slot FINISHED");
      return kExitFinished;
    }
  }
}

std::optional<int> Launcher::Watch(absl::Duration wait) {
  if (const int signal_number = TakeTerminationSignal(std::min(wait, deadline_ - clock_->Now()))) {
    Print(absl::StrCat("received ", SignalName(signal_number), ": stopping everything"));
    return 128 + signal_number;
  }
  if (server_ != nullptr) {
    if (std::optional<int> code = server_->Poll()) {
      Print(absl::StrCat("rebound_server (pid ", server_->pid(), ") exited unexpectedly: ",
                         DescribeExitCode(*code), "; the last lines of its log:\n",
                         TailOfFile(server_->log_path(), kLogTailLines)));
      return kExitFailed;
    }
  }
  if (std::optional<int> code = WatchMembers()) return code;
  for (Worker& w : workers_) {
    if (w.exit_reported) continue;
    std::optional<int> code = w.process->Poll();
    if (!code.has_value()) continue;
    w.exit_reported = true;
    std::string text = absl::StrCat(w.plan.name, " (pid ", w.process->pid(), ") exited: ",
                                    DescribeWorkerExit(*code));
    const SlotProgress* slot = w.plan.slot.has_value() ? tracker_.FindSlot(*w.plan.slot) : nullptr;
    if (w.killed_by_launcher) {
      absl::StrAppend(&text, ", as the launcher killed it");
    } else if (slot != nullptr && slot->state == FINISHED) {
      absl::StrAppend(&text, " after its slot FINISHED");
    } else if (w.plan.role == LaunchRole::kTrainer && cluster_up_ && *code != 0) {
      // Exit 0 is a clean departure (the job's end, seen here before the next status poll).
      absl::StrAppend(&text, "; the server rebuilds its slot");
    }
    PrintEvent({w.plan.slot, text});
  }
  if (clock_->Now() >= deadline_) {
    Print(absl::StrCat("timeout: --timeout_s ", options_.timeout_s, " passed"));
    return kExitFailed;
  }
  return std::nullopt;
}

std::optional<GetStatusResponse> Launcher::PollStatus() {
  GetStatusResponse response;
  grpc::ClientContext context;
  const bool electing = quiet_status_errors_ || (group_watch_.leader_killed() &&
                                                 !group_watch_.failover().has_value());
  context.set_deadline(absl::ToChronoTime(
      clock_->Now() + (electing ? kElectionStatusDeadline : kStatusDeadline)));
  const grpc::Status status = stub_->GetStatus(&context, GetStatusRequest(), &response);
  if (!status.ok()) {
    const std::string error = absl::StrCat("GetStatus failed: code ", status.error_code(), ": ",
                                           status.error_message());
    if (uses_members()) stub_ = ParameterServer::NewStub(GroupChannel(server_address_));
    if (quiet_status_errors_) {
      quiet_status_error_ = error;
      return std::nullopt;
    }
    if (error != last_status_error_) Print(error);
    last_status_error_ = error;
    return std::nullopt;
  }
  if (!last_status_error_.empty()) {
    Print("GetStatus answers again");
    last_status_error_.clear();
  }
  for (const ProgressEvent& event : tracker_.Update(response)) PrintEvent(event);
  if (replicated()) {
    for (std::string& text : group_watch_.Update(response, clock_->Now())) {
      PrintEvent({std::nullopt, std::move(text)});
    }
  }
  return response;
}

std::optional<int> Launcher::WatchMembers() {
  std::vector<bool> running(shard_groups_, false);  // by shard group
  for (Member& m : members_) {
    if (m.exit_reported) continue;
    std::optional<int> code = m.process->Poll();
    if (!code.has_value()) {
      running[m.plan.shard_group] = true;
      continue;
    }
    m.exit_reported = true;
    if (m.killed_by_launcher) {
      PrintEvent({std::nullopt, absl::StrCat(m.plan.name, " (pid ", m.process->pid(), ") exited: ",
                                             DescribeExitCode(*code),
                                             ", as the launcher killed it")});
      continue;
    }
    PrintEvent({std::nullopt,
                absl::StrCat(m.plan.name, " (rebound_server, pid ", m.process->pid(),
                             ") exited unexpectedly: ", DescribeExitCode(*code),
                             "; the last lines of its log:\n",
                             TailOfFile(m.process->log_path(), kLogTailLines))});
    if (!cluster_up_) return kExitFailed;
  }
  if (members_.empty()) return std::nullopt;
  const bool restart_due = killed_member_.has_value() && !restart_done_;
  for (int g = 0; g < shard_groups_; ++g) {
    if (running[g]) continue;
    if (restart_due && members_[*killed_member_].plan.shard_group == g) continue;
    if (!sharded()) {
      Print("every member of the server group has exited");
    } else {
      Print(absl::StrCat(replicated() ? "every member of shard group " : "the server of shard group ",
                         g, " has exited: its range of the center is gone, training cannot go on"));
    }
    return kExitFailed;
  }
  return std::nullopt;
}

bool Launcher::MaybeKillLeader() {
  if (!options_.kill_leader_at_step.has_value() || killed_member_.has_value()) return false;
  const std::vector<SlotProgress>& slots = tracker_.slots();
  if (slots.empty()) return false;
  double mean_step = 0;
  for (const SlotProgress& s : slots) mean_step += static_cast<double>(s.step);
  mean_step /= static_cast<double>(slots.size());
  if (mean_step < static_cast<double>(*options_.kill_leader_at_step)) return false;
  const absl::Time now = clock_->Now();
  if (group_watch_.in_sync_standbys() == 0) {
    // Only an in-sync standby may take over: killed now, the leader would have no successor.
    if (!waiting_for_in_sync_since_.has_value()) {
      waiting_for_in_sync_since_ = now;
      Print(absl::StrCat("mean trainer step ", static_cast<int64_t>(mean_step),
                         ": waiting (at most ", absl::FormatDuration(kInSyncWait),
                         ") for a standby in sync before killing the leader"));
    }
    if (now - *waiting_for_in_sync_since_ < kInSyncWait) return false;
    Print("no standby in sync: killing the leader anyway; nobody can take over until it is back");
  }
  for (size_t i = 0; i < members_.size(); ++i) {
    Member& m = members_[i];
    if (m.plan.name != group_watch_.leader() || m.process->Poll().has_value()) continue;
    m.process->Signal(SIGKILL);
    m.killed_by_launcher = true;
    killed_member_ = i;
    killed_at_ = now;
    group_watch_.LeaderKilled(m.plan.name, group_watch_.epoch(), now);
    PrintEvent({std::nullopt,
                absl::StrFormat("leader %s (pid %d, epoch %d) SIGKILLed at mean trainer step %d, "
                                "%d standby(s) in sync: failover under way",
                                m.plan.name, m.process->pid(), group_watch_.epoch(),
                                static_cast<int64_t>(mean_step),
                                group_watch_.in_sync_standbys())});
    return true;
  }
  return false;
}

void Launcher::MaybeRestartKilledMember() {
  if (!killed_member_.has_value() || restart_done_) return;
  Member& m = members_[*killed_member_];
  const absl::Duration since_kill = clock_->Now() - killed_at_;
  if (!m.exit_reported || since_kill < kRestartDelay) return;
  const bool new_leader = group_watch_.new_leader_answered();
  if (!new_leader && since_kill < kNewLeaderWait) return;
  restart_done_ = true;
  // Its log keeps its first life: appended to.
  absl::StatusOr<std::unique_ptr<ChildProcess>> started =
      ChildProcess::Start(m.argv, m.process->log_path());
  if (!started.ok()) {
    Print(absl::StrCat("cannot start ", m.plan.name, " again: ", started.status().message()));
    return;
  }
  m.process = *std::move(started);
  m.exit_reported = false;
  m.killed_by_launcher = false;
  group_watch_.Restarted(clock_->Now());
  PrintEvent({std::nullopt,
              absl::StrCat("started ", m.plan.name, " again (pid ", m.process->pid(), ") ",
                           absl::FormatDuration(absl::Trunc(since_kill, absl::Milliseconds(100))),
                           " after the kill, on its data dir ", m.plan.data_dir,
                           new_leader ? ": it rejoins as a standby"
                                      : absl::StrCat(": no new leader answered within ",
                                                     absl::FormatDuration(kNewLeaderWait)))});
}

void Launcher::MaybeKillTrainer() {
  if (!options_.kill_trainer_at_step.has_value() || kill_done_) return;
  const SlotProgress* slot = tracker_.FindSlot(options_.kill_slot);
  if (slot == nullptr || slot->step < *options_.kill_trainer_at_step) return;
  const std::optional<std::string> owner = tracker_.OwnerName(options_.kill_slot);
  if (!owner.has_value()) return;  // no owner right now (LOST, RECOVERING): wait for one
  for (Worker& w : workers_) {
    if (w.plan.name != *owner || w.process->Poll().has_value()) continue;
    // Under REPLAY, kill it while the server holds logged steps past the slot's snapshot (up to
    // kKillAlignLimit of waiting), so that the demonstration shows steps replayed, not only a
    // snapshot restored: a trainer killed right after its sync leaves nothing to replay.
    int64_t logged_ahead = -1;
    int64_t step_at_kill = slot->step;  // as the server saw it at the last read
    const absl::Time limit = clock_->Now() + kKillAlignLimit;
    while (clock_->Now() < limit) {
      GetStatusResponse status;
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(clock_->Now() + kStatusDeadline));
      if (!stub_->GetStatus(&context, GetStatusRequest(), &status).ok() ||
          status.recovery_policy() != REPLAY) {
        break;
      }
      for (const SlotStatus& s : status.slots()) {
        if (s.slot().replica() == options_.kill_slot.replica &&
            s.slot().stage() == options_.kill_slot.stage) {
          logged_ahead = s.logged_step() - s.snapshot_step();
          step_at_kill = std::max(step_at_kill, s.step());
        }
      }
      if (logged_ahead >= kKillLoggedSteps) break;
      clock_->WaitFor(absl::Milliseconds(2), nullptr);
    }
    w.process->Signal(SIGKILL);
    w.killed_by_launcher = true;
    kill_done_ = true;
    PrintEvent({options_.kill_slot,
                absl::StrCat("killed ", w.plan.name, " (pid ", w.process->pid(), ") at step ",
                             step_at_kill,
                             logged_ahead > 0
                                 ? absl::StrCat("; the server held ", logged_ahead,
                                                " logged step(s) past its snapshot")
                                 : std::string())});
    return;
  }
}

void Launcher::StopAll() {
  std::vector<ChildProcess*> running;
  std::vector<std::string> names;
  for (Worker& w : workers_) {
    if (w.process->Poll().has_value() && w.exit_reported) continue;
    running.push_back(w.process.get());
    names.push_back(w.plan.name);
  }
  if (!running.empty()) {
    Print(absl::StrCat("stopping ", running.size(), " workers (SIGTERM, SIGKILL after ",
                       absl::FormatDuration(kStopGrace), ")"));
    StopGroup(running, names);
  }
  if (server_ != nullptr) {
    if (server_->Poll().has_value()) return;  // reported by Watch
    stub_.reset();  // an open connection would hold up the server's graceful shutdown
    Print(absl::StrCat("stopping rebound_server (SIGTERM, SIGKILL after ",
                       absl::FormatDuration(kStopGrace), ")"));
    StopGroup({server_.get()}, {"rebound_server"});
  }
  std::vector<ChildProcess*> members;
  std::vector<std::string> member_names;
  for (Member& m : members_) {
    if (m.process->Poll().has_value()) continue;  // reported by Watch, or never restarted
    members.push_back(m.process.get());
    member_names.push_back(m.plan.name);
  }
  if (!members.empty()) {
    stub_.reset();
    shard_stubs_.clear();
    const std::string what =
        sharded() ? absl::StrCat(members.size(), " running server", members.size() == 1 ? "" : "s",
                                 " of the ", shard_groups_, " shard groups")
                  : absl::StrCat("the server group's ", members.size(), " running member",
                                 members.size() == 1 ? "" : "s");
    Print(absl::StrCat("stopping ", what, " (SIGTERM, SIGKILL after ",
                       absl::FormatDuration(kStopGrace), ")"));
    StopGroup(members, member_names);
  }
  if (etcd_ != nullptr) {
    const int size = etcd_->size();
    etcd_.reset();  // SIGKILLs and reaps every member, removes its directory
    Print(absl::StrCat("stopped etcd (", size, " member", size == 1 ? "" : "s", ")"));
  }
}

void Launcher::StopGroup(const std::vector<ChildProcess*>& group,
                         const std::vector<std::string>& names) {
  for (ChildProcess* child : group) child->Signal(SIGTERM);
  const absl::Time give_up = clock_->Now() + kStopGrace;
  bool hurry = false;
  while (true) {
    const bool all_done = std::all_of(group.begin(), group.end(),
                                      [](ChildProcess* c) { return c->Poll().has_value(); });
    if (all_done) break;
    if (const int signal_number = TakeTerminationSignal(absl::Milliseconds(50))) {
      Print(absl::StrCat("received ", SignalName(signal_number), " again: SIGKILL now"));
      hurry = true;
    }
    if (hurry || clock_->Now() >= give_up) {
      for (ChildProcess* child : group) child->Signal(SIGKILL);
      for (ChildProcess* child : group) child->WaitFor(absl::Seconds(5));
      break;
    }
  }
  for (size_t i = 0; i < group.size(); ++i) {
    std::optional<int> code = group[i]->Poll();
    Print(absl::StrCat("stopped ", names[i], " (pid ", group[i]->pid(), "): ",
                       code.has_value() ? DescribeExitCode(*code) : "still running after SIGKILL"));
  }
  for (Worker& w : workers_) {
    if (w.process->Poll().has_value()) w.exit_reported = true;
  }
}

double Launcher::Elapsed() const { return absl::ToDoubleSeconds(clock_->Now() - start_); }

void Launcher::Print(const std::string& text) {
  const std::string prefix = absl::StrFormat("[%7.1fs] ", Elapsed());
  std::string out;
  bool first = true;
  for (absl::string_view line : absl::StrSplit(absl::StripTrailingAsciiWhitespace(text), '\n')) {
    absl::StrAppend(&out, first ? prefix : std::string(prefix.size() + 2, ' '), line, "\n");
    first = false;
  }
  std::fputs(out.c_str(), stdout);
  std::fflush(stdout);
}

void Launcher::PrintEvent(const ProgressEvent& event) {
  Print(event.text);
  WriteCsv(tracker_.CsvEventRow(Elapsed(), event));
}

void Launcher::WriteCsv(const std::string& row) {
  if (csv_ == nullptr) return;
  std::fputs(row.c_str(), csv_);
  std::fputc('\n', csv_);
  std::fflush(csv_);
}

}  // namespace rebound::launch
