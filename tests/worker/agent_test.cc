// WorkerAgent (worker/agent.h) without a server: its retries run on the injected clock (a fake
// one gives up after give_up_after_ms of fake time, with no real waiting), and Stop() may be
// called by several threads at once (the worker's signal thread and its main thread do). Against
// a fake server that answers Register and Heartbeat (real gRPC on 127.0.0.1): the agent says it
// runs audits, and PREEMPT_AUDIT (docs/recovery.md#audits) preempts an audit only while one
// runs, never the next one.

#include <catch2/catch.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "grpcpp/grpcpp.h"
#include "common/version.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "worker/agent.h"

namespace rebound::worker {
namespace {

// A channel to a loopback port nothing listens on: every call fails at once with UNAVAILABLE.
std::shared_ptr<grpc::Channel> ChannelToNowhere() {
  return grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials());
}

WorkerConfig Config() {
  WorkerConfig config;
  config.set_rpc_deadline_ms(1000);
  config.set_backoff_initial_ms(1000);
  config.set_backoff_max_ms(30000);
  config.set_give_up_after_ms(600000);  // ten minutes: only a fake clock gets there quickly
  return config;
}

TEST_CASE("an agent that cannot reach the server gives up after give_up_after_ms of its clock") {
  FakeClock clock;
  const absl::Time start = clock.Now();
  WorkerAgent agent(Config(), ChannelToNowhere(), "job", "w", "127.0.0.1:2", "", nullptr,
                    &clock);
  const absl::Time real_start = absl::Now();
  CHECK(agent.Run() == AgentExit::kUnreachable);
  CHECK(clock.Now() - start >= absl::Minutes(10));
  CHECK(absl::Now() - real_start < absl::Minutes(2));
  CHECK(agent.exit_reason().find("server unreachable for 600000 ms") != std::string::npos);
  CHECK(agent.registration().incarnation == 0);
}

TEST_CASE("an agent stopped before it runs returns kStopped, and Stop may race with itself") {
  FakeClock clock;
  WorkerAgent agent(Config(), ChannelToNowhere(), "job", "w", "127.0.0.1:2", "", nullptr,
                    &clock);
  std::vector<std::thread> stoppers;
  for (int i = 0; i < 8; ++i) stoppers.emplace_back([&agent] { agent.Stop(); });
  for (std::thread& t : stoppers) t.join();
  agent.Stop();  // idempotent
  absl::Notification registered;
  CHECK(agent.Run(&registered) == AgentExit::kStopped);
  CHECK(registered.HasBeenNotified());
}

// A server that registers every worker as a spare and answers heartbeats, with PREEMPT_AUDIT
// while `preempt` is set.
class FakeServer final : public ParameterServer::Service {
 public:
  FakeServer() {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
    REQUIRE(server_ != nullptr);
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  ~FakeServer() override { server_->Shutdown(); }

  grpc::Status Register(grpc::ServerContext*, const RegisterRequest* request,
                        RegisterResponse* response) override {
    audits_ = request->audits();
    response->set_incarnation(11);
    response->set_role(SPARE);
    response->mutable_job()->set_job_id("job");
    response->mutable_job()->mutable_fault_tolerance()->set_heartbeat_interval_ms(10);
    response->set_server_version(ProjectVersion());
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const HeartbeatRequest*,
                         HeartbeatResponse* response) override {
    if (preempt) response->add_commands(PREEMPT_AUDIT);
    ++heartbeats_;
    return grpc::Status::OK;
  }
  grpc::Status Deregister(grpc::ServerContext*, const DeregisterRequest*,
                          DeregisterResponse*) override {
    return grpc::Status::OK;
  }

  // Waits (real time, bounded) until `n` more heartbeats were answered.
  bool WaitForHeartbeats(int n) {
    const int target = heartbeats_ + n;
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (heartbeats_ < target) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return true;
  }

  const std::string& address() const { return address_; }
  bool audits() const { return audits_; }

  std::atomic<bool> preempt{false};

 private:
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::atomic<bool> audits_{false};
  std::atomic<int> heartbeats_{0};
};

TEST_CASE("PREEMPT_AUDIT preempts the running audit only, and never the next one") {
  FakeServer server;
  WorkerConfig config = Config();
  config.set_backoff_initial_ms(10);
  config.set_backoff_max_ms(100);
  WorkerAgent agent(config,
                    grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()),
                    "job", "spare-0", "127.0.0.1:2");
  absl::Notification registered;
  std::thread run([&] { agent.Run(&registered); });
  registered.WaitForNotification();
  CHECK(agent.registration().incarnation == 11);
  CHECK(server.audits());  // this worker serves audit tasks

  // Not auditing: the command is ignored.
  server.preempt = true;
  REQUIRE(server.WaitForHeartbeats(3));
  CHECK_FALSE(agent.audit_preempted());

  // Auditing: the next heartbeat's command preempts it.
  agent.BeginAudit();
  REQUIRE(server.WaitForHeartbeats(3));
  CHECK(agent.audit_preempted());
  agent.EndAudit();
  CHECK_FALSE(agent.audit_preempted());

  // A command that came during one audit does not carry over to the next.
  agent.BeginAudit();
  REQUIRE(server.WaitForHeartbeats(3));
  server.preempt = false;
  REQUIRE(server.WaitForHeartbeats(2));  // no PREEMPT_AUDIT in flight any more
  REQUIRE(agent.audit_preempted());
  agent.BeginAudit();  // the next audit
  REQUIRE(server.WaitForHeartbeats(3));
  CHECK_FALSE(agent.audit_preempted());
  agent.EndAudit();

  agent.Stop();
  run.join();
}

}  // namespace
}  // namespace rebound::worker
