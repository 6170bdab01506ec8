#include "tests/integration/local_cluster.h"

#include <catch2/catch.hpp>
#include <google/protobuf/text_format.h>
#include <signal.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/security.h"
#include "tests/integration/status_util.h"

namespace rebound::testing {

LocalCluster::LocalCluster(const std::string& job_text, const LocalClusterOptions& options)
    : dir_(MakeTempDir(options.name)), wait_limit_(options.wait_limit) {
  REQUIRE(google::protobuf::TextFormat::ParseFromString(job_text, &job_));
  std::string config = absl::StrCat("listen_address: \"127.0.0.1:0\"\njob {\n", job_text,
                                    "}\nmax_wait_ms: ", options.max_wait_ms, "\n");
  if (options.durable) absl::StrAppend(&config, "durability { data_dir: \"", data_dir(), "\" }\n");
  absl::StrAppend(&config, options.server_config_extra);
  WriteFileOrDie(dir_ + "/server.pbtxt", config);
  WriteFileOrDie(dir_ + "/worker.pbtxt", absl::StrCat("backoff_initial_ms: 20\nbackoff_max_ms: 200\n",
                                                     options.worker_config_extra));

  const std::string port_file = dir_ + "/port";
  auto server = Subprocess::Start({Runfile("server/rebound_server"), "--config",
                                   dir_ + "/server.pbtxt", "--listen", "127.0.0.1:0",
                                   "--port_file", port_file},
                                  dir_ + "/server.log");
  REQUIRE(server.ok());
  server_ = *std::move(server);
  auto port = WaitForPortFile(port_file, *server_, absl::Seconds(30));
  REQUIRE(port.ok());
  address_ = absl::StrCat("127.0.0.1:", *port);
  auto channel = MakeChannel(address_, options.client_security, grpc::ChannelArguments());
  REQUIRE(channel.ok());
  stub_ = ParameterServer::NewStub(*channel);
}

Subprocess& LocalCluster::StartWorker(const std::string& name, WorkerRole role,
                                      const std::string& config_extra,
                                      const std::vector<std::string>& extra_args) {
  REQUIRE((role == TRAINER || role == SPARE || role == EVALUATOR));
  REQUIRE(workers_.count(name) == 0);
  std::string config = dir_ + "/worker.pbtxt";
  if (!config_extra.empty()) {
    config = dir_ + "/worker-" + name + ".pbtxt";
    WriteFileOrDie(config, ReadFileOrEmpty(dir_ + "/worker.pbtxt") + config_extra);
  }
  std::vector<std::string> args = {
      Runfile("worker/rebound_worker"), "--config", config, "--server", address_, "--name", name,
      "--role", role == TRAINER ? "trainer" : role == SPARE ? "spare" : "evaluator"};
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  auto worker = Subprocess::Start(args, dir_ + "/" + name + ".log");
  REQUIRE(worker.ok());
  Subprocess& started = *(workers_[name] = *std::move(worker));
  WaitFor(absl::StrCat(name, " registered"), [&](const GetStatusResponse& s) {
    const WorkerStatus* w = FindWorker(s, name, role);
    return w != nullptr && w->state() == ALIVE;
  });
  return started;
}

Subprocess& LocalCluster::worker(const std::string& name) {
  auto it = workers_.find(name);
  REQUIRE(it != workers_.end());
  return *it->second;
}

void LocalCluster::Kill(const std::string& name) {
  Signal(name, SIGKILL);
  REQUIRE(ExitCode(name, absl::Seconds(10)) == 128 + SIGKILL);
}

int LocalCluster::ExitCode(const std::string& name, absl::Duration limit) {
  return worker(name).WaitFor(limit).value_or(-1);
}

void LocalCluster::StopServer() {
  server_->Signal(SIGTERM);
  REQUIRE(server_->WaitFor(absl::Seconds(20)).value_or(-1) == 0);
}

void LocalCluster::KillServer() {
  server_->Signal(SIGKILL);
  REQUIRE(server_->WaitFor(absl::Seconds(20)).has_value());
}

GetStatusResponse LocalCluster::Status() {
  GetStatusResponse response;
  const grpc::Status status =
      Call(&ParameterServer::Stub::GetStatus, GetStatusRequest(), &response);
  INFO(status.error_message() << Logs());
  REQUIRE(status.ok());
  return response;
}

RegisterResponse LocalCluster::Register(const std::string& name, WorkerRole role) {
  RegisterRequest request;
  request.set_worker_name(name);
  request.set_requested_role(role);
  RegisterResponse response;
  REQUIRE(Call(&ParameterServer::Stub::Register, request, &response).ok());
  REQUIRE(response.credential().size() == 64);
  credentials_.Remember(response);
  return response;
}

PullResponse LocalCluster::Pull(uint64_t incarnation) {
  PullRequest request;
  request.set_incarnation(incarnation);
  request.set_stage(0);
  PullResponse response;
  REQUIRE(Call(&ParameterServer::Stub::Pull, request, &response).ok());
  return response;
}

GetStatusResponse LocalCluster::WaitFor(const std::string& what,
                                        const std::function<bool(const GetStatusResponse&)>& done,
                                        absl::Duration limit, absl::Duration poll) {
  if (limit == absl::ZeroDuration()) limit = wait_limit_;
  const absl::Time deadline = absl::Now() + limit;
  GetStatusResponse status = Status();
  while (!done(status)) {
    if (absl::Now() > deadline) {
      FAIL("not reached within " << limit << ": " << what << "\n"
                                 << status.DebugString() << Logs());
    }
    absl::SleepFor(poll);
    status = Status();
  }
  return status;
}

std::string LocalCluster::Logs() const {
  std::string out = absl::StrCat("\n--- server.log\n", LastLines(dir_ + "/server.log", 25));
  for (const auto& [name, process] : workers_) {
    absl::StrAppend(&out, "--- ", name, ".log\n", LastLines(process->log_path(), 12));
  }
  return out;
}

}  // namespace rebound::testing
