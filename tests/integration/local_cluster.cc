#include "tests/integration/local_cluster.h"

#include <catch2/catch.hpp>
#include <google/protobuf/text_format.h>
#include <signal.h>

#include "absl/strings/str_cat.h"
#include "tests/integration/status_util.h"

namespace rebound::testing {
namespace {

ClusterOptions OptionsFor(const std::string& dir, const LocalClusterOptions& options) {
  ClusterOptions cluster;
  cluster.server_binary = Runfile("server/rebound_server");
  cluster.worker_binary = Runfile("worker/rebound_worker");
  cluster.dir = dir;
  cluster.client_security = options.client_security;
  cluster.rpc_deadline = absl::Seconds(10);
  cluster.retry_status_errors = false;  // every GetStatus of a test must succeed
  cluster.fail_on_exit = false;         // tests check exits themselves
  cluster.stop_grace = absl::Seconds(20);
  return cluster;
}

}  // namespace

LocalCluster::LocalCluster(const std::string& job_text, const LocalClusterOptions& options)
    : dir_(MakeTempDir(options.name)),
      wait_limit_(options.wait_limit),
      cluster_(OptionsFor(dir_, options)) {
  REQUIRE(google::protobuf::TextFormat::ParseFromString(job_text, &job_));
  std::string config = absl::StrCat("listen_address: \"127.0.0.1:0\"\njob {\n", job_text,
                                    "}\nmax_wait_ms: ", options.max_wait_ms, "\n");
  if (options.durable) absl::StrAppend(&config, "durability { data_dir: \"", data_dir(), "\" }\n");
  absl::StrAppend(&config, options.server_config_extra);
  const absl::Status started = cluster_.StartServer(
      config,
      absl::StrCat("backoff_initial_ms: 20\nbackoff_max_ms: 200\n", options.worker_config_extra));
  INFO(started);
  REQUIRE(started.ok());
}

Subprocess& LocalCluster::StartWorker(const std::string& name, WorkerRole role,
                                      const std::string& config_extra,
                                      const std::vector<std::string>& extra_args) {
  REQUIRE((role == TRAINER || role == SPARE || role == EVALUATOR));
  REQUIRE(cluster_.FindWorker(name) == nullptr);
  const absl::Status started = cluster_.StartWorker(
      name, role == TRAINER ? "trainer" : role == SPARE ? "spare" : "evaluator", extra_args,
      config_extra);
  INFO(started);
  REQUIRE(started.ok());
  WaitFor(absl::StrCat(name, " registered"), [&](const GetStatusResponse& s) {
    const WorkerStatus* w = FindWorker(s, name, role);
    return w != nullptr && w->state() == ALIVE;
  });
  return worker(name);
}

Subprocess& LocalCluster::worker(const std::string& name) {
  Subprocess* found = cluster_.FindWorker(name);
  REQUIRE(found != nullptr);
  return *found;
}

void LocalCluster::Kill(const std::string& name) {
  const absl::Status killed = cluster_.KillWorker(name);
  INFO(killed);
  REQUIRE(killed.ok());
  REQUIRE(ExitCode(name, absl::Seconds(10)) == 128 + SIGKILL);
}

int LocalCluster::ExitCode(const std::string& name, absl::Duration limit) {
  return worker(name).WaitFor(Scaled(limit)).value_or(-1);
}

void LocalCluster::StopServer() { REQUIRE(cluster_.StopServer(absl::Seconds(20)) == 0); }

void LocalCluster::KillServer() {
  const absl::Status killed = cluster_.KillServer();
  INFO(killed);
  REQUIRE(killed.ok());
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
  const grpc::Status status = Call(&ParameterServer::Stub::Register, request, &response);
  INFO(status.error_message() << Logs());
  REQUIRE(status.ok());
  REQUIRE(response.credential().size() == 64);
  credentials_.Remember(response);
  return response;
}

PullResponse LocalCluster::Pull(uint64_t incarnation) {
  PullRequest request;
  request.set_incarnation(incarnation);
  request.set_stage(0);
  PullResponse response;
  const grpc::Status status = Call(&ParameterServer::Stub::Pull, request, &response);
  INFO(status.error_message() << Logs());
  REQUIRE(status.ok());
  return response;
}

GetStatusResponse LocalCluster::WaitFor(const std::string& what,
                                        const std::function<bool(const GetStatusResponse&)>& done,
                                        absl::Duration limit, absl::Duration poll) {
  if (limit == absl::ZeroDuration()) limit = wait_limit_;
  absl::StatusOr<GetStatusResponse> status = cluster_.WaitForStatus(done, limit, what, poll);
  if (absl::IsDeadlineExceeded(status.status())) {
    FAIL("not reached within " << Scaled(limit) << ": " << what << "\n"
                               << Status().DebugString() << Logs());
  }
  INFO(status.status().message() << Logs());
  REQUIRE(status.ok());
  return *std::move(status);
}

std::string LocalCluster::Logs() const { return cluster_.Logs(25, 12); }

}  // namespace rebound::testing
