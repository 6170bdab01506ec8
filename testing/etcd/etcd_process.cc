#include "testing/etcd/etcd_process.h"

#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_join.h"
#include "common/clock.h"
#include "testing/cluster/processes.h"
#include "grpcpp/grpcpp.h"
#include "proto/etcd/rpc.grpc.pb.h"

namespace rebound::testing {
namespace {

// A fresh directory <TEST_TMPDIR or /tmp>/etcd-XXXXXX.
absl::StatusOr<std::string> MakeDir() {
  const char* base = getenv("TEST_TMPDIR");
  std::string pattern = absl::StrCat(base != nullptr && base[0] != '\0' ? base : "/tmp",
                                     "/etcd-XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", pattern, ": ", strerror(errno)));
  }
  return pattern;
}

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdCluster>> EtcdCluster::Start(
    const EtcdClusterOptions& options) {
  if (access(options.etcd_binary.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("etcd is not installed (", options.etcd_binary,
                     " is missing or not executable): run tools/setup.sh"));
  }
  if (options.members < 1) return absl::InvalidArgumentError("members must be >= 1");
  std::unique_ptr<EtcdCluster> cluster(new EtcdCluster(options));
  absl::StatusOr<std::string> dir = MakeDir();
  if (!dir.ok()) return dir.status();
  cluster->dir_ = *dir;
  absl::StatusOr<std::vector<int>> ports = FreeLoopbackPorts(2 * options.members);
  if (!ports.ok()) return ports.status();
  std::vector<std::string> peers;
  for (int i = 0; i < options.members; ++i) {
    Member member;
    member.name = absl::StrCat("m", i);
    member.client_port = (*ports)[2 * i];
    member.peer_port = (*ports)[2 * i + 1];
    member.data_dir = absl::StrCat(cluster->dir_, "/", member.name, ".etcd");
    member.log_path = absl::StrCat(cluster->dir_, "/", member.name, ".log");
    peers.push_back(absl::StrCat(member.name, "=http://127.0.0.1:", member.peer_port));
    cluster->members_.push_back(std::move(member));
  }
  cluster->initial_cluster_ = absl::StrJoin(peers, ",");
  for (int i = 0; i < options.members; ++i) {
    absl::Status status = cluster->StartMember(i, "new");
    if (!status.ok()) return status;
  }
  const absl::Time deadline = DefaultClock()->Now() + options.start_timeout;
  for (int i = 0; i < options.members; ++i) {
    absl::Status status = cluster->WaitUntilServing(i, deadline);
    if (!status.ok()) return status;
  }
  return cluster;
}

EtcdCluster::~EtcdCluster() {
  for (Member& member : members_) member.process.reset();  // SIGKILL and reap
  if (!dir_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
}

std::string EtcdCluster::client_endpoint(int i) const {
  return absl::StrCat("127.0.0.1:", members_.at(i).client_port);
}

std::vector<std::string> EtcdCluster::client_endpoints() const {
  std::vector<std::string> endpoints;
  for (int i = 0; i < size(); ++i) endpoints.push_back(client_endpoint(i));
  return endpoints;
}

absl::StatusOr<int> EtcdCluster::RaftLeader() {
  for (int i = 0; i < size(); ++i) {
    if (!running(i)) continue;
    httplib::Client client("127.0.0.1", members_[i].client_port);
    client.set_connection_timeout(2, 0);
    client.set_read_timeout(2, 0);
    const auto response = client.Get("/metrics");
    if (!response || response->status != 200) continue;
    for (absl::string_view line : absl::StrSplit(response->body, '\n')) {
      if (line == "etcd_server_is_leader 1") return i;
    }
  }
  return absl::NotFoundError("no running etcd member says it leads etcd's raft");
}

std::vector<int> EtcdCluster::client_ports() const {
  std::vector<int> ports;
  for (const Member& member : members_) ports.push_back(member.client_port);
  return ports;
}

std::string EtcdCluster::log_path(int i) const { return members_.at(i).log_path; }

bool EtcdCluster::running(int i) {
  Member& member = members_.at(i);
  return member.process != nullptr && !member.process->Poll().has_value();
}

void EtcdCluster::Pause(int i) {
  if (members_.at(i).process != nullptr) members_.at(i).process->Signal(SIGSTOP);
}

void EtcdCluster::Resume(int i) {
  if (members_.at(i).process != nullptr) members_.at(i).process->Signal(SIGCONT);
}

void EtcdCluster::Kill(int i) {
  Member& member = members_.at(i);
  if (member.process == nullptr) return;
  member.process->Signal(SIGKILL);
  member.process->WaitFor(absl::Seconds(10));
  member.process.reset();
}

absl::Status EtcdCluster::Restart(int i) {
  Kill(i);
  // Its data dir holds its membership: "existing" is what etcd expects on a restart (it reads
  // the data dir and ignores the initial cluster flags).
  absl::Status status = StartMember(i, "existing");
  if (!status.ok()) return status;
  int running_members = 0;
  for (int m = 0; m < size(); ++m) running_members += running(m) ? 1 : 0;
  if (2 * running_members <= size()) return absl::OkStatus();  // no quorum yet: cannot serve
  const absl::Time deadline = DefaultClock()->Now() + options_.start_timeout;
  for (int m = 0; m < size(); ++m) {
    if (!running(m)) continue;
    status = WaitUntilServing(m, deadline);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::Status EtcdCluster::StartMember(int i, const std::string& cluster_state) {
  Member& member = members_.at(i);
  const std::string client_url = absl::StrCat("http://127.0.0.1:", member.client_port);
  const std::string peer_url = absl::StrCat("http://127.0.0.1:", member.peer_port);
  const std::vector<std::string> argv = {
      options_.etcd_binary,
      "--name", member.name,
      "--data-dir", member.data_dir,
      "--listen-client-urls", client_url,
      "--advertise-client-urls", client_url,
      "--listen-peer-urls", peer_url,
      "--initial-advertise-peer-urls", peer_url,
      "--initial-cluster", initial_cluster_,
      "--initial-cluster-state", cluster_state,
      "--initial-cluster-token", absl::StrCat("rebound-test-", getpid()),
      "--heartbeat-interval", absl::StrCat(options_.heartbeat_ms),
      "--election-timeout", absl::StrCat(options_.election_timeout_ms),
      "--log-level", "warn",
      "--logger", "zap",
  };
  absl::StatusOr<std::unique_ptr<ChildProcess>> process =
      ChildProcess::Start(argv, member.log_path);
  if (!process.ok()) return process.status();
  member.process = std::move(*process);
  return absl::OkStatus();
}

absl::Status EtcdCluster::WaitUntilServing(int i, absl::Time deadline) {
  Member& member = members_.at(i);
  grpc::Status last;
  while (true) {
    if (member.process == nullptr) return absl::InternalError(member.name + " is not running");
    if (std::optional<int> code = member.process->Poll(); code.has_value()) {
      return absl::InternalError(absl::StrCat("etcd member ", member.name, " exited (",
                                              DescribeExitCode(*code), "); its log ends:\n",
                                              TailOfFile(member.log_path, 20)));
    }
    // A fresh channel each time: a channel that failed to connect while the member started
    // would wait out gRPC's reconnect backoff (seconds) before trying again.
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto stub = etcdserverpb::KV::NewStub(
        grpc::CreateCustomChannel(client_endpoint(i), grpc::InsecureChannelCredentials(), args));
    grpc::ClientContext context;
    context.set_wait_for_ready(true);
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    etcdserverpb::RangeRequest request;
    request.set_key("rebound-test-health");  // linearizable: needs a leader and a quorum
    etcdserverpb::RangeResponse response;
    last = stub->Range(&context, request, &response);
    if (last.ok()) return absl::OkStatus();
    if (DefaultClock()->Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "etcd member ", member.name, " at ", client_endpoint(i), " did not serve within ",
          absl::FormatDuration(options_.start_timeout), " (last: ", last.error_message(),
          "); its log ends:\n", TailOfFile(member.log_path, 20)));
    }
    DefaultClock()->WaitFor(absl::Milliseconds(50), nullptr);
  }
}

}  // namespace rebound::testing
