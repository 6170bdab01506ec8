// WorkerAgent (worker/agent.h) without a server: its retries run on the injected clock (a fake
// one gives up after give_up_after_ms of fake time, with no real waiting), and Stop() may be
// called by several threads at once (the worker's signal thread and its main thread do).

#include <catch2/catch.hpp>

#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "grpcpp/grpcpp.h"
#include "proto/config.pb.h"
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

}  // namespace
}  // namespace rebound::worker
