#include "testing/cluster/cluster.h"

#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/file.h"
#include "common/security.h"
#include "grpcpp/grpcpp.h"
#include "testing/cluster/processes.h"
#include "testing/cluster/time_scale.h"

namespace rebound::testing {
namespace {

constexpr absl::Duration kFirstSyncWait = absl::Seconds(120);
constexpr size_t kExitLogLines = 15;

}  // namespace

Cluster::Cluster(ClusterOptions options) : options_(std::move(options)) {}

Cluster::~Cluster() {
  // Workers first, newest first, then the server: each ChildProcess's destructor SIGKILLs and
  // reaps it if it still runs.
  trainers_.clear();
  while (!workers_.empty()) workers_.pop_back();
  server_.reset();
}

absl::Status Cluster::StartServer(const std::string& server_config,
                                  const std::string& worker_config) {
  if (server_ != nullptr) return absl::FailedPreconditionError("the server was started before");
  const std::string& dir = options_.dir;
  if (absl::Status written =
          WriteFile(dir + "/server.pbtxt", ScaledServerConfig(server_config));
      !written.ok()) {
    return absl::InternalError(written.message());
  }
  worker_config_ = worker_config;
  if (absl::Status written =
          WriteFile(dir + "/worker.pbtxt", ScaledWorkerConfig(worker_config));
      !written.ok()) {
    return absl::InternalError(written.message());
  }
  const std::string port_file = dir + "/port";
  const std::string host =
      options_.network != nullptr ? options_.network->gateway() : std::string("127.0.0.1");
  absl::StatusOr<std::unique_ptr<ChildProcess>> server =
      ChildProcess::Start({options_.server_binary, "--config", dir + "/server.pbtxt", "--listen",
                           host + ":0", "--port_file", port_file},
                          dir + "/server.log");
  if (!server.ok()) return server.status();
  server_ = *std::move(server);
  absl::StatusOr<int> port = WaitForPortFile(port_file, *server_, Scaled(options_.start_wait));
  if (!port.ok()) {
    return absl::Status(port.status().code(),
                        absl::StrCat("rebound_server did not start: ", port.status().message()));
  }
  address_ = absl::StrCat(host, ":", *port);
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      MakeChannel(address_, options_.client_security, grpc::ChannelArguments());
  if (!channel.ok()) return channel.status();
  stub_ = ParameterServer::NewStub(*channel);
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
  absl::Status status = check(server_.get(), "rebound_server");
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
  if (server_ != nullptr) {
    const int code = server_->Stop(Scaled(options_.stop_grace));
    if (code != 0 && report) {
      std::fprintf(stderr, "note: rebound_server exited with code %d\n", code);
    }
  }
}

std::string Cluster::Logs(size_t server_lines, size_t worker_lines) const {
  std::string out = absl::StrCat("\n--- server.log\n",
                                 LastLines(options_.dir + "/server.log", server_lines));
  for (const Worker& worker : workers_) {
    absl::StrAppend(&out, "--- ", worker.name, ".log\n",
                    LastLines(worker.process->log_path(), worker_lines));
  }
  return out;
}

}  // namespace rebound::testing
