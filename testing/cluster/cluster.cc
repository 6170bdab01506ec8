#include "testing/cluster/cluster.h"

#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/clock.h"
#include "common/file.h"
#include "common/grpc_polling.h"
#include "common/security.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "grpcpp/grpcpp.h"
#include "testing/cluster/processes.h"
#include "testing/cluster/time_scale.h"

namespace rebound::testing {
namespace {

constexpr absl::Duration kFirstSyncWait = absl::Seconds(120);
constexpr size_t kExitLogLines = 15;

class IgnoreErrors : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int, google::protobuf::io::ColumnNumber, const std::string&) override {}
};

// The sharding.groups of the config's inline job; 1 when it has none or does not parse (the
// server then says why).
int JobShardGroups(const std::string& server_config) {
  google::protobuf::TextFormat::Parser parser;
  IgnoreErrors ignore;
  parser.RecordErrorsTo(&ignore);
  ServerConfig parsed;
  if (!parser.ParseFromString(server_config, &parsed)) return 1;
  return std::max(1, parsed.job().sharding().groups());
}

}  // namespace

Cluster::Cluster(ClusterOptions options) : options_(std::move(options)) {
  // For a benchmark's process (tests get it from .bazelrc); too late if gRPC is up already.
  ShortenGrpcBackupPolling();
}

Cluster::~Cluster() {
  // Workers first, newest first, then the server: each ChildProcess's destructor SIGKILLs and
  // reaps it if it still runs.
  trainers_.clear();
  while (!workers_.empty()) workers_.pop_back();
  server_ = nullptr;
  while (!members_.empty()) members_.pop_back();
  etcd_.reset();
}

absl::Status Cluster::StartServer(const std::string& server_config,
                                  const std::string& worker_config) {
  if (!members_.empty()) return absl::FailedPreconditionError("the server was started before");
  const std::string& dir = options_.dir;
  if (options_.groups_in_hosts && (options_.network == nullptr || options_.standbys > 0)) {
    return absl::InvalidArgumentError(
        "groups_in_hosts needs a network lab and no standbys (etcd listens on loopback)");
  }
  worker_config_ = worker_config;
  if (absl::Status written =
          WriteFile(dir + "/worker.pbtxt", ScaledWorkerConfig(worker_config));
      !written.ok()) {
    return absl::InternalError(written.message());
  }
  shard_groups_ = std::max(1, options_.shard_groups);
  if (shard_groups_ == 1) shard_groups_ = JobShardGroups(server_config);
  if (options_.standbys > 0 || shard_groups_ > 1) return StartGroups(server_config);
  if (absl::Status written =
          WriteFile(dir + "/server.pbtxt", ScaledServerConfig(server_config));
      !written.ok()) {
    return absl::InternalError(written.message());
  }
  const std::string port_file = dir + "/port";
  absl::StatusOr<std::pair<std::string, int>> place = GroupHostAddress(0);
  if (!place.ok()) return place.status();
  const auto& [host, netns_fd] = *place;
  ServerStart start;
  start.binary = options_.server_binary;
  start.config = dir + "/server.pbtxt";
  start.listen = host + ":0";
  start.port_file = port_file;
  start.log = dir + "/server.log";
  start.child.netns_fd = netns_fd;
  start.wait = Scaled(options_.start_wait);
  std::unique_ptr<ChildProcess> process;
  absl::StatusOr<int> port = StartServerProcess(start, &process);
  if (process != nullptr) {
    members_.push_back(Member{"server", start.config, "", port_file, start.log,
                              ServerArgv(start), std::move(process), false, netns_fd});
    server_ = members_.back().process.get();
  }
  if (!port.ok()) return port.status();
  address_ = absl::StrCat(host, ":", *port);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      MakeChannel(address_, options_.client_security, grpc::ChannelArguments());
  if (!channel.ok()) return channel.status();
  stub_ = ParameterServer::NewStub(*channel);
  // The one group's address and status, as a sharded cluster's group 0's.
  group_addresses_ = {address_};
  group_stubs_.push_back(ParameterServer::NewStub(*channel));
  return absl::OkStatus();
}

absl::StatusOr<std::pair<std::string, int>> Cluster::GroupHostAddress(int g) {
  if (!options_.groups_in_hosts) {
    return std::make_pair(
        options_.network != nullptr ? options_.network->gateway() : std::string("127.0.0.1"), -1);
  }
  while (static_cast<int>(group_hosts_.size()) <= g) {
    absl::StatusOr<NetworkLab::Host> host = options_.network->AddHost();
    if (!host.ok()) return host.status();
    group_hosts_.push_back(*host);
  }
  return std::make_pair(group_hosts_[g].address, group_hosts_[g].netns_fd);
}

absl::StatusOr<int> Cluster::GroupHost(int g) const {
  if (!options_.groups_in_hosts) {
    return absl::FailedPreconditionError("the server groups do not run in lab hosts");
  }
  if (g < 0 || g >= static_cast<int>(group_hosts_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("no group ", g));
  }
  return group_hosts_[g].index;
}

absl::Status Cluster::StartGroups(const std::string& server_config) {
  const std::string& dir = options_.dir;
  ServerConfig base;
  if (!google::protobuf::TextFormat::ParseFromString(ScaledServerConfig(server_config), &base)) {
    return absl::InvalidArgumentError("the server config does not parse as a ServerConfig");
  }
  const bool replicated = options_.standbys > 0;
  const bool sharded = shard_groups_ > 1;
  if (replicated) {
    EtcdClusterOptions etcd;
    etcd.members = options_.etcd_members;
    absl::StatusOr<std::unique_ptr<EtcdCluster>> started = EtcdCluster::Start(etcd);
    if (!started.ok()) return started.status();
    etcd_ = *std::move(started);
  }
  const int groups = shard_groups_;
  const int per_group = 1 + options_.standbys;
  // Free here; a lab host's namespace has every port free.
  absl::StatusOr<std::vector<int>> ports = FreeLoopbackPorts(groups * per_group);
  if (!ports.ok()) return ports.status();
  std::vector<std::pair<std::string, int>> places;  // each group's host and namespace
  for (int g = 0; g < groups; ++g) {
    absl::StatusOr<std::pair<std::string, int>> place = GroupHostAddress(g);
    if (!place.ok()) return place.status();
    places.push_back(*place);
  }
  // A replicated group's peers listen beside their members (without groups_in_hosts: here).
  const std::string host = places.front().first;
  std::vector<std::vector<std::string>> addresses(groups);
  for (int i = 0; i < groups * per_group; ++i) {
    addresses[i / per_group].push_back(absl::StrCat(places[i / per_group].first, ":", (*ports)[i]));
  }
  group_addresses_.clear();
  for (const std::vector<std::string>& group : addresses) {
    group_addresses_.push_back(absl::StrJoin(group, ","));
  }
  if (sharded) base.mutable_job()->mutable_sharding()->set_groups(groups);
  for (int i = 0; i < groups * per_group; ++i) {
    const int g = i / per_group;
    const int index = i % per_group;
    Member member;
    member.name = sharded ? absl::StrCat("g", g, "-server-", index) : absl::StrCat("server-", i);
    member.config = absl::StrCat(dir, "/", member.name, ".pbtxt");
    member.port_file = absl::StrCat(dir, "/port-", i);
    member.log = absl::StrCat(dir, "/", member.name, ".log");
    ServerConfig config = base;
    config.set_listen_address(addresses[g][index]);
    if (replicated || config.durability().data_dir() != "") {
      member.data_dir = absl::StrCat(dir, "/", member.name);
      config.mutable_durability()->set_data_dir(member.data_dir);
    }
    if (sharded) {
      ShardConfig* shard = config.mutable_shard();
      shard->set_group(g);
      for (const std::string& address : group_addresses_) shard->add_group_addresses(address);
    }
    member.argv = {options_.server_binary, "--config", member.config, "--port_file",
                   member.port_file};
    if (replicated) {
      ReplicationConfig* replication = config.mutable_replication();
      replication->clear_etcd_endpoints();
      for (const std::string& endpoint : etcd_->client_endpoints()) {
        replication->add_etcd_endpoints(endpoint);
      }
      replication->set_standbys(options_.standbys);
      // Scaled like every timing field, in etcd's whole seconds.
      const int64_t lease_ms = absl::ToInt64Milliseconds(
          Scaled(absl::Milliseconds(options_.leader_lease_ms)));
      replication->set_leader_lease_ms(static_cast<int32_t>((lease_ms + 999) / 1000 * 1000));
      replication->set_group(absl::StrCat(g));
      replication->set_name(member.name);
      replication->set_peer_listen_address(host + ":0");
      replication->set_sync(options_.replication_sync);
      member.argv.push_back("--peer_port_file");
      member.argv.push_back(absl::StrCat(dir, "/peer-port-", i));
    }
    std::string text;
    google::protobuf::TextFormat::PrintToString(config, &text);
    if (absl::Status written = WriteFile(member.config, text); !written.ok()) {
      return absl::InternalError(written.message());
    }
    member.netns_fd = places[g].second;
    if (options_.firewall != nullptr && options_.standbys > 0) {
      absl::StatusOr<std::string> cgroup = options_.firewall->Group(member.name);
      if (!cgroup.ok()) return cgroup.status();
      member.cgroup = *cgroup;
    }
    ChildProcessOptions child;
    child.netns_fd = member.netns_fd;
    child.cgroup = member.cgroup;
    absl::StatusOr<std::unique_ptr<ChildProcess>> process =
        ChildProcess::Start(member.argv, member.log, child);
    if (!process.ok()) return process.status();
    member.process = *std::move(process);
    members_.push_back(std::move(member));
  }
  server_ = members_.front().process.get();
  address_ = group_addresses_.front();
  group_stubs_.clear();
  // The groups start at once, each answering when it is ready: a channel that found its group
  // not listening yet tries again soon, not after gRPC's default backoff (1 s, then 1.6 s, ...).
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  for (const std::string& address : group_addresses_) {
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        MakeChannel(address, options_.client_security, args);
    if (!channel.ok()) return channel.status();
    group_stubs_.push_back(ParameterServer::NewStub(*channel));
  }
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      MakeChannel(address_, options_.client_security, grpc::ChannelArguments());
  if (!channel.ok()) return channel.status();
  stub_ = ParameterServer::NewStub(*channel);
  if (sharded) return WaitForShardGroups(Scaled(options_.start_wait));
  absl::StatusOr<int> leader = WaitForLeader(options_.start_wait);
  if (!leader.ok()) {
    return absl::Status(leader.status().code(),
                        absl::StrCat("the server group did not elect a leader: ",
                                     leader.status().message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<GetStatusResponse> Cluster::GetGroupStatus(int g) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(DefaultClock()->Now() + Scaled(options_.rpc_deadline)));
  GetStatusResponse response;
  const grpc::Status status = group_stubs_.at(g)->GetStatus(&context, GetStatusRequest(), &response);
  if (!status.ok()) {
    return absl::UnavailableError(
        absl::StrCat("GetStatus of group ", g, " failed: ", status.error_message()));
  }
  return response;
}

absl::Status Cluster::WaitForShardGroups(absl::Duration limit) {
  const absl::Time deadline = DefaultClock()->Now() + limit;
  for (int g = 0; g < static_cast<int>(group_stubs_.size()); ++g) {
    std::string last = "no answer";
    while (true) {
      if (absl::Status children = CheckChildren(); !children.ok()) return children;
      absl::StatusOr<GetStatusResponse> status = GetGroupStatus(g);
      if (status.ok()) {
        const bool ready = options_.standbys == 0 ? status->has_sharding()
                                                  : status->group().role() == GroupStatus::LEADER;
        if (ready) break;
        last = status->ShortDebugString().substr(0, 200);
      } else {
        last = std::string(status.status().message());
      }
      if (DefaultClock()->Now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("shard group ", g, " did not start: ", last));
      }
      DefaultClock()->WaitFor(absl::Milliseconds(100), nullptr);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int> Cluster::WaitForLeader(absl::Duration limit) {
  absl::StatusOr<GetStatusResponse> status = WaitForStatus(
      [](const GetStatusResponse& s) { return s.group().role() == GroupStatus::LEADER; }, limit,
      "a leader of the server group");
  if (!status.ok()) return status.status();
  for (int i = 0; i < members(); ++i) {
    if (members_[i].name == status->group().name()) return i;
  }
  return absl::InternalError(
      absl::StrCat("the leader '", status->group().name(), "' is no member of this cluster"));
}

absl::Status Cluster::KillMember(int i) {
  Member& member = members_.at(i);
  member.expect_exit = true;
  member.process->Signal(SIGKILL);
  if (!member.process->WaitFor(Scaled(options_.stop_grace)).has_value()) {
    return absl::InternalError(absl::StrCat(member.name, " survived SIGKILL"));
  }
  return absl::OkStatus();
}

void Cluster::StopMember(int i) {
  ChildProcess& process = *members_.at(i).process;
  process.Signal(SIGSTOP);
  // kill() returns before every thread has stopped: a call sent at once may still be answered.
  // Wait (bounded) until /proc says the process is stopped ('T').
  const std::string stat = absl::StrCat("/proc/", process.pid(), "/stat");
  const absl::Time limit = DefaultClock()->Now() + absl::Seconds(2);
  while (DefaultClock()->Now() < limit) {
    const std::string text = ReadFileOrEmpty(stat);
    const size_t close = text.rfind(')');
    if (close != std::string::npos && close + 2 < text.size() && text[close + 2] == 'T') return;
    DefaultClock()->WaitFor(absl::Milliseconds(1), nullptr);
  }
}
void Cluster::ResumeMember(int i) { members_.at(i).process->Signal(SIGCONT); }

absl::Status Cluster::RestartMember(int i, bool wipe_data) {
  Member& member = members_.at(i);
  if (!member.process->Poll().has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(member.name, " still runs"));
  }
  if (wipe_data && !member.data_dir.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(member.data_dir, ignored);
  }
  std::remove(member.port_file.c_str());
  ChildProcessOptions child;
  child.netns_fd = member.netns_fd;
  child.cgroup = member.cgroup;
  absl::StatusOr<std::unique_ptr<ChildProcess>> process =
      ChildProcess::Start(member.argv, member.log, child);
  if (!process.ok()) return process.status();
  member.process = *std::move(process);
  member.expect_exit = false;
  if (i == 0) server_ = member.process.get();
  return absl::OkStatus();
}

absl::Status Cluster::StartWorker(const std::string& name, const std::string& role,
                                  const std::vector<std::string>& extra_args,
                                  const std::string& config_extra) {
  if (role != "auto" && role != "trainer" && role != "spare" && role != "evaluator") {
    return absl::InvalidArgumentError(absl::StrCat("no role '", role, "'"));
  }
  if (FindWorker(name) != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("a worker named ", name, " was started before"));
  }
  std::string config = options_.dir + "/worker.pbtxt";
  if (!config_extra.empty()) {
    const std::string own = absl::StrCat(options_.dir, "/worker-", name, ".pbtxt");
    if (absl::Status written =
            WriteFile(own, ScaledWorkerConfig(worker_config_ + config_extra));
        !written.ok()) {
      return absl::InternalError(written.message());
    }
    config = own;
  }
  std::vector<std::string> argv = {options_.worker_binary, "--config", config, "--server",
                                   address_, "--name", name, "--role", role};
  ChildProcessOptions child;
  int host = -1;
  if (options_.network != nullptr && role != "evaluator") {
    absl::StatusOr<NetworkLab::Host> added = options_.network->AddHost();
    if (!added.ok()) return added.status();
    host = added->index;
    child.netns_fd = added->netns_fd;
    argv.push_back("--peer_listen");
    argv.push_back(added->address + ":0");
  }
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  absl::StatusOr<std::unique_ptr<ChildProcess>> worker =
      ChildProcess::Start(argv, absl::StrCat(options_.dir, "/", name, ".log"), child);
  if (!worker.ok()) return worker.status();
  workers_.push_back({name, *std::move(worker), host});
  return absl::OkStatus();
}

absl::StatusOr<GetStatusResponse> Cluster::WaitForWorker(
    const std::string& name, const std::function<bool(const WorkerStatus&)>& listed,
    const std::string& what) {
  return WaitForStatus(
      [&](const GetStatusResponse& s) {
        for (const WorkerStatus& w : s.workers()) {
          if (w.name() == name && listed(w)) return true;
        }
        return false;
      },
      options_.start_wait, what);
}

absl::Status Cluster::StartTrainers(
    int count, const std::function<std::vector<std::string>(int trainer)>& extra_flags) {
  for (int i = 0; i < count; ++i) {
    const std::string name = absl::StrCat("trainer-", i);
    if (absl::Status started = StartWorker(
            name, "trainer", extra_flags ? extra_flags(i) : std::vector<std::string>{});
        !started.ok()) {
      return started;
    }
    trainers_.push_back(workers_.back().process.get());
    absl::StatusOr<GetStatusResponse> registered = WaitForWorker(
        name, [](const WorkerStatus& w) { return w.role() == TRAINER; }, name + " to register");
    if (!registered.ok()) return registered.status();
    for (const WorkerStatus& w : registered->workers()) {
      if (w.name() == name && w.slot().replica() != i) {
        return absl::InternalError(absl::StrCat(name, " got slot ", w.slot().replica()));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Cluster::StartEvaluator() { return StartWorker("evaluator", "evaluator"); }

absl::Status Cluster::StartSpares(const std::vector<std::string>& names, bool until_polling) {
  for (const std::string& name : names) {
    if (absl::Status started = StartWorker(name, "spare"); !started.ok()) return started;
    absl::StatusOr<GetStatusResponse> waiting = WaitForWorker(
        name,
        [until_polling](const WorkerStatus& w) {
          return w.state() == ALIVE && w.role() == SPARE &&
                 (w.waiting_for_task() || !until_polling);
        },
        name + (until_polling ? " to register as a spare and wait for a task"
                              : " to register as a spare"));
    if (!waiting.ok()) return waiting.status();
  }
  return absl::OkStatus();
}

ChildProcess* Cluster::FindWorker(const std::string& name) {
  for (Worker& worker : workers_) {
    if (worker.name == name) return worker.process.get();
  }
  return nullptr;
}

const ChildProcess* Cluster::FindWorker(const std::string& name) const {
  return const_cast<Cluster*>(this)->FindWorker(name);
}

absl::Status Cluster::KillWorker(const std::string& name) {
  ChildProcess* worker = FindWorker(name);
  if (worker == nullptr) return absl::NotFoundError(absl::StrCat("no worker named ", name));
  if (worker->Poll().has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(name, " had already exited"));
  }
  expected_exits_.insert(name);
  worker->Signal(SIGKILL);
  if (!worker->WaitFor(Scaled(options_.stop_grace)).has_value()) {
    return absl::InternalError(absl::StrCat(name, " survived SIGKILL"));
  }
  return absl::OkStatus();
}

absl::Status Cluster::StopWorker(const std::string& name) {
  ChildProcess* worker = FindWorker(name);
  if (worker == nullptr) return absl::NotFoundError(absl::StrCat("no worker named ", name));
  worker->Signal(SIGSTOP);
  return absl::OkStatus();
}

absl::Status Cluster::ResumeWorker(const std::string& name) {
  ChildProcess* worker = FindWorker(name);
  if (worker == nullptr) return absl::NotFoundError(absl::StrCat("no worker named ", name));
  worker->Signal(SIGCONT);
  return absl::OkStatus();
}

absl::StatusOr<int> Cluster::HostOf(const std::string& name) {
  for (const Worker& worker : workers_) {
    if (worker.name != name) continue;
    if (options_.network == nullptr) {
      return absl::FailedPreconditionError("the cluster has no network lab");
    }
    if (worker.host < 0) {
      return absl::FailedPreconditionError(absl::StrCat(name, " has no link of its own"));
    }
    return worker.host;
  }
  return absl::NotFoundError(absl::StrCat("no worker named ", name));
}

absl::Status Cluster::Partition(const std::string& name) {
  absl::StatusOr<int> host = HostOf(name);
  if (!host.ok()) return host.status();
  return options_.network->Partition(*host);
}

absl::Status Cluster::Heal(const std::string& name) {
  absl::StatusOr<int> host = HostOf(name);
  if (!host.ok()) return host.status();
  return options_.network->Heal(*host);
}

int Cluster::StopServer(absl::Duration grace) { return server_->Stop(Scaled(grace)); }

absl::Status Cluster::KillServer() {
  server_->Signal(SIGKILL);
  if (!server_->WaitFor(Scaled(options_.stop_grace)).has_value()) {
    return absl::InternalError("rebound_server survived SIGKILL");
  }
  return absl::OkStatus();
}

absl::StatusOr<GetStatusResponse> Cluster::GetStatus() {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(DefaultClock()->Now() + Scaled(options_.rpc_deadline)));
  GetStatusResponse response;
  const grpc::Status status = stub_->GetStatus(&context, GetStatusRequest(), &response);
  if (!status.ok()) {
    return absl::UnavailableError(absl::StrCat("GetStatus: ", status.error_message()));
  }
  return response;
}

absl::StatusOr<GetStatusResponse> Cluster::WaitForStatus(
    const std::function<bool(const GetStatusResponse&)>& done, absl::Duration limit,
    const std::string& what, absl::Duration poll) {
  limit = Scaled(limit);
  const Clock& clock = *DefaultClock();
  const absl::Time deadline = clock.Now() + limit;
  while (true) {
    if (absl::Status children = CheckChildren(); !children.ok()) return children;
    absl::StatusOr<GetStatusResponse> status = GetStatus();
    if (!status.ok() && !options_.retry_status_errors) return status.status();
    if (status.ok() && done(*status)) return status;
    if (clock.Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("timed out after ", absl::FormatDuration(limit), " waiting for ", what,
                       status.ok() ? "" : absl::StrCat(" (", status.status().message(), ")")));
    }
    clock.WaitFor(poll, nullptr);
  }
}

absl::Status Cluster::WaitForFirstSyncs(int slots) {
  return WaitForStatus(
             [slots](const GetStatusResponse& s) {
               if (s.slots_size() != slots) return false;
               for (const SlotStatus& slot : s.slots()) {
                 if (slot.state() != ACTIVE || slot.update_count() < 1) return false;
               }
               return true;
             },
             kFirstSyncWait, "every slot's first sync")
      .status();
}

absl::Status Cluster::Watch(absl::Time end, absl::Duration tick,
                            const std::function<void(absl::Time now)>& on_tick) {
  const Clock& clock = *DefaultClock();
  while (true) {
    const absl::Time now = clock.Now();
    if (now >= end) return absl::OkStatus();
    if (absl::Status children = CheckChildren(); !children.ok()) return children;
    on_tick(now);
    clock.WaitFor(std::min(tick, end - now), nullptr);
  }
}

absl::Status Cluster::CheckChildren() {
  if (!options_.fail_on_exit) return absl::OkStatus();
  auto check = [](ChildProcess* child, const std::string& what) -> absl::Status {
    if (child == nullptr) return absl::OkStatus();
    if (const std::optional<int> code = child->Poll(); code.has_value()) {
      return absl::InternalError(absl::StrCat(what, " exited early with code ", *code, ":\n",
                                              TailOfFile(child->log_path(), kExitLogLines)));
    }
    return absl::OkStatus();
  };
  absl::Status status;
  for (Member& member : members_) {
    if (!status.ok()) break;
    if (!member.expect_exit) {
      status = check(member.process.get(),
                     members_.size() == 1 ? std::string("rebound_server") : member.name);
    }
  }
  for (Worker& worker : workers_) {
    if (!status.ok()) break;
    if (expected_exits_.count(worker.name) == 0) status = check(worker.process.get(), worker.name);
  }
  return status;
}

void Cluster::StopAll(
    bool report, const std::function<void(const ChildProcess& worker, int code)>& worker_exited) {
  for (Worker& worker : workers_) {
    worker.process->Signal(SIGTERM);
    worker.process->Signal(SIGCONT);
  }
  for (Worker& worker : workers_) {
    worker_exited(*worker.process, worker.process->Stop(Scaled(options_.stop_grace)));
  }
  for (Member& member : members_) {
    if (member.expect_exit) continue;
    member.process->Signal(SIGCONT);
    const int code = member.process->Stop(Scaled(options_.stop_grace));
    if (code != 0 && report) {
      std::fprintf(stderr, "note: %s exited with code %d\n",
                   members_.size() == 1 ? "rebound_server" : member.name.c_str(), code);
    }
  }
}

std::string Cluster::Logs(size_t server_lines, size_t worker_lines) const {
  std::string out = "\n";
  for (const Member& member : members_) {
    absl::StrAppend(&out, "--- ", member.name, ".log\n", LastLines(member.log, server_lines));
  }
  for (const Worker& worker : workers_) {
    absl::StrAppend(&out, "--- ", worker.name, ".log\n",
                    LastLines(worker.process->log_path(), worker_lines));
  }
  return out;
}

}  // namespace rebound::testing
