#include "bench/local_cluster.h"

#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/config.h"
#include "google/protobuf/text_format.h"
#include "grpcpp/grpcpp.h"

namespace rebound::bench {
namespace {

constexpr absl::Duration kRpcDeadline = absl::Seconds(5);
constexpr absl::Duration kServerStartWait = absl::Seconds(30);
constexpr absl::Duration kPortPoll = absl::Milliseconds(20);
constexpr absl::Duration kRegistrationWait = absl::Seconds(30);
constexpr absl::Duration kFirstSyncWait = absl::Seconds(120);
constexpr absl::Duration kStopGrace = absl::Seconds(10);

}  // namespace

void ClusterFlags::AddTo(CommandLine* command_line) {
  command_line->AddText("job", &job);
  command_line->AddText("server_binary", &server_binary);
  command_line->AddText("worker_binary", &worker_binary);
  command_line->AddSwitch("keep_logs", &keep_logs);
}

absl::StatusOr<JobConfig> ResolveClusterFlags(ClusterFlags* flags) {
  if (flags->server_binary.empty()) {
    flags->server_binary = FindRunfile("server/rebound_server", IsExecutableFile);
  }
  if (flags->worker_binary.empty()) {
    flags->worker_binary = FindRunfile("worker/rebound_worker", IsExecutableFile);
  }
  if (flags->job.empty()) flags->job = FindRunfile("configs/job.pbtxt", IsReadableFile);
  if (!IsExecutableFile(flags->server_binary) || !IsExecutableFile(flags->worker_binary)) {
    return absl::InvalidArgumentError(
        "cannot find rebound_server / rebound_worker; pass --server_binary and --worker_binary");
  }
  absl::StatusOr<JobConfig> job = LoadJobConfig(flags->job);
  if (!job.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--job: ", job.status().message()));
  }
  return job;
}

// ---------------------------------------------------------------------------------------------
// RunDirectories

absl::StatusOr<RunDirectories> RunDirectories::Create(const std::string& name, bool keep_logs) {
  std::string dir_template = absl::StrCat("/tmp/rebound-", name, "-XXXXXX");
  if (mkdtemp(dir_template.data()) == nullptr) {
    return absl::InternalError("cannot create a directory under /tmp");
  }
  return RunDirectories(std::move(dir_template), keep_logs);
}

std::string RunDirectories::StartRun(const std::string& run) const {
  const std::string dir = absl::StrCat(path_, "/", run);
  std::filesystem::create_directories(dir);
  return dir;
}

void RunDirectories::FinishRun(const std::string& dir, bool ok) {
  if (!ok) {
    all_ok_ = false;
  } else if (!keep_logs_) {
    std::filesystem::remove_all(dir);
  }
}

void RunDirectories::Finish() const {
  if (!all_ok_) std::printf("some runs FAILED; their logs are kept in %s\n", path_.c_str());
  if (all_ok_ && !keep_logs_) std::filesystem::remove_all(path_);
}

// ---------------------------------------------------------------------------------------------
// LocalCluster

LocalCluster::LocalCluster(const ClusterFlags& flags, std::string dir)
    : flags_(flags), dir_(std::move(dir)) {}

absl::Status LocalCluster::StartServer(const JobConfig& job, const std::string& data_dir) {
  ServerConfig config;
  config.set_listen_address("127.0.0.1:0");
  *config.mutable_job() = job;
  if (!data_dir.empty()) config.mutable_durability()->set_data_dir(data_dir);
  std::string text;
  google::protobuf::TextFormat::PrintToString(config, &text);
  const std::string config_path = dir_ + "/server.pbtxt";
  const std::string port_file = dir_ + "/port";
  if (!WriteFile(config_path, text)) return absl::InternalError("cannot write " + config_path);
  auto server = ChildProcess::Start({flags_.server_binary, "--config", config_path, "--listen",
                                     "127.0.0.1:0", "--port_file", port_file},
                                    dir_ + "/server.log");
  if (!server.ok()) return server.status();
  server_ = *std::move(server);
  const absl::Time deadline = absl::Now() + kServerStartWait;
  int port = 0;
  while (true) {
    const std::string port_text(absl::StripAsciiWhitespace(ReadFile(port_file)));
    if (!port_text.empty() && absl::SimpleAtoi(port_text, &port) && port > 0) break;
    if (server_->Poll().has_value()) {
      return absl::InternalError("rebound_server exited at start:\n" +
                                 TailOfFile(server_->log_path(), 20));
    }
    if (absl::Now() > deadline) return absl::DeadlineExceededError("no port from the server");
    absl::SleepFor(kPortPoll);
  }
  address_ = absl::StrCat("127.0.0.1:", port);
  stub_ = ParameterServer::NewStub(
      grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  const std::string worker_config = absl::StrCat("job_id: \"", job.job_id(),
                                                 "\"\n"
                                                 "backoff_initial_ms: 50\n"
                                                 "backoff_max_ms: 1000\n"
                                                 "give_up_after_ms: 30000\n");
  if (!WriteFile(dir_ + "/worker.pbtxt", worker_config)) {
    return absl::InternalError("cannot write worker.pbtxt");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ChildProcess>> LocalCluster::LaunchWorker(
    const std::string& name, const std::string& role, const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {flags_.worker_binary, "--config", dir_ + "/worker.pbtxt",
                                   "--server", address_, "--name", name, "--role", role};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return ChildProcess::Start(argv, dir_ + "/" + name + ".log");
}

absl::Status LocalCluster::StartTrainers(
    int count, const std::function<std::vector<std::string>(int trainer)>& extra_flags) {
  for (int i = 0; i < count; ++i) {
    const std::string name = absl::StrCat("trainer-", i);
    auto trainer =
        LaunchWorker(name, "trainer", extra_flags ? extra_flags(i) : std::vector<std::string>{});
    if (!trainer.ok()) return trainer.status();
    trainers_.push_back(*std::move(trainer));
    auto registered = WaitForStatus(
        [&](const GetStatusResponse& s) {
          for (const WorkerStatus& w : s.workers()) {
            if (w.name() == name && w.role() == TRAINER) return true;
          }
          return false;
        },
        kRegistrationWait, name + " to register");
    if (!registered.ok()) return registered.status();
    for (const WorkerStatus& w : registered->workers()) {
      if (w.name() == name && w.slot().replica() != i) {
        return absl::InternalError(absl::StrCat(name, " got slot ", w.slot().replica()));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status LocalCluster::StartEvaluator() {
  auto evaluator = LaunchWorker("evaluator", "evaluator", {});
  if (!evaluator.ok()) return evaluator.status();
  evaluator_ = *std::move(evaluator);
  return absl::OkStatus();
}

absl::Status LocalCluster::StartWorker(const std::string& name, const std::string& role,
                                       const std::vector<std::string>& extra) {
  if (FindWorker(name) != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("a worker named ", name, " was started before"));
  }
  auto worker = LaunchWorker(name, role, extra);
  if (!worker.ok()) return worker.status();
  others_.emplace_back(name, *std::move(worker));
  return absl::OkStatus();
}

absl::Status LocalCluster::StartSpares(const std::vector<std::string>& names,
                                       bool until_polling) {
  for (const std::string& name : names) {
    if (absl::Status started = StartWorker(name, "spare"); !started.ok()) return started;
    auto waiting = WaitForStatus(
        [&](const GetStatusResponse& s) {
          for (const WorkerStatus& w : s.workers()) {
            if (w.name() == name && w.state() == ALIVE && w.role() == SPARE &&
                (w.waiting_for_task() || !until_polling)) {
              return true;
            }
          }
          return false;
        },
        kRegistrationWait,
        name + (until_polling ? " to register as a spare and wait for a task"
                              : " to register as a spare"));
    if (!waiting.ok()) return waiting.status();
  }
  return absl::OkStatus();
}

absl::Status LocalCluster::KillWorker(const std::string& name) {
  ChildProcess* worker = nullptr;
  for (const auto& [n, child] : AllWorkers()) {
    if (n == name) worker = child;
  }
  if (worker == nullptr) return absl::NotFoundError(absl::StrCat("no worker named ", name));
  if (worker->Poll().has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(name, " had already exited"));
  }
  expected_exits_.insert(name);
  worker->Signal(SIGKILL);
  if (!worker->WaitFor(kStopGrace).has_value()) {
    return absl::InternalError(absl::StrCat(name, " survived SIGKILL"));
  }
  return absl::OkStatus();
}

const ChildProcess* LocalCluster::FindWorker(const std::string& name) const {
  for (const auto& [n, child] : AllWorkers()) {
    if (n == name) return child;
  }
  return nullptr;
}

std::vector<std::pair<std::string, ChildProcess*>> LocalCluster::AllWorkers() const {
  std::vector<std::pair<std::string, ChildProcess*>> all;
  for (size_t i = 0; i < trainers_.size(); ++i) {
    all.emplace_back(absl::StrCat("trainer-", i), trainers_[i].get());
  }
  if (evaluator_ != nullptr) all.emplace_back("evaluator", evaluator_.get());
  for (const auto& [name, child] : others_) all.emplace_back(name, child.get());
  return all;
}

absl::Status LocalCluster::WaitForFirstSyncs(int slots) {
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

absl::StatusOr<GetStatusResponse> LocalCluster::GetStatus() {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kRpcDeadline));
  GetStatusResponse response;
  const grpc::Status status = stub_->GetStatus(&context, GetStatusRequest(), &response);
  if (!status.ok()) {
    return absl::UnavailableError(absl::StrCat("GetStatus: ", status.error_message()));
  }
  return response;
}

absl::StatusOr<GetStatusResponse> LocalCluster::WaitForStatus(
    const std::function<bool(const GetStatusResponse&)>& done, absl::Duration limit,
    const std::string& what, absl::Duration poll) {
  const absl::Time deadline = absl::Now() + limit;
  while (true) {
    if (absl::Status children = CheckChildren(); !children.ok()) return children;
    absl::StatusOr<GetStatusResponse> status = GetStatus();
    if (status.ok() && done(*status)) return status;
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("timed out after ", absl::FormatDuration(limit), " waiting for ", what,
                       status.ok() ? "" : absl::StrCat(" (", status.status().message(), ")")));
    }
    absl::SleepFor(poll);
  }
}

absl::Status LocalCluster::Watch(absl::Time end, absl::Duration tick,
                                 const std::function<void(absl::Time now)>& on_tick) {
  while (true) {
    const absl::Time now = absl::Now();
    if (now >= end) return absl::OkStatus();
    if (absl::Status children = CheckChildren(); !children.ok()) return children;
    on_tick(now);
    absl::SleepFor(std::min(tick, end - now));
  }
}

absl::Status LocalCluster::CheckChildren() {
  auto check = [](ChildProcess* child, const std::string& what) -> absl::Status {
    if (child == nullptr) return absl::OkStatus();
    if (const std::optional<int> code = child->Poll(); code.has_value()) {
      return absl::InternalError(absl::StrCat(what, " exited early with code ", *code, ":\n",
                                              TailOfFile(child->log_path(), 15)));
    }
    return absl::OkStatus();
  };
  absl::Status status = check(server_.get(), "rebound_server");
  for (const auto& [name, child] : AllWorkers()) {
    if (!status.ok()) break;
    if (expected_exits_.count(name) == 0) status = check(child, name);
  }
  return status;
}

void LocalCluster::StopAll(
    bool report, const std::function<void(const ChildProcess& worker, int code)>& worker_exited) {
  std::vector<ChildProcess*> workers;
  for (const auto& [name, child] : AllWorkers()) workers.push_back(child);
  for (ChildProcess* worker : workers) {
    worker->Signal(SIGTERM);
    worker->Signal(SIGCONT);
  }
  for (ChildProcess* worker : workers) worker_exited(*worker, worker->Stop(kStopGrace));
  if (server_ != nullptr) {
    const int code = server_->Stop(kStopGrace);
    if (code != 0 && report) {
      std::fprintf(stderr, "note: rebound_server exited with code %d\n", code);
    }
  }
}

}  // namespace rebound::bench
