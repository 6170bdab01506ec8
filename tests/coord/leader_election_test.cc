// coord/leader_election against real etcd members (testing/etcd): one winner with the key's
// create revision as its epoch, a waiting candidate that wins a higher epoch once the leader
// resigns or its lease expires, and self-fencing when etcd stops renewing the lease. Fails (never
// skips) when /usr/bin/etcd is missing.

#include "coord/leader_election.h"

#include <catch2/catch.hpp>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "coord/etcd_client.h"
#include "testing/etcd/etcd_process.h"

namespace rebound {
namespace {

using ::rebound::testing::EtcdCluster;
using ::rebound::testing::EtcdClusterOptions;

constexpr char kKey[] = "/rebound/job/group0/leader";

std::unique_ptr<EtcdCluster> StartEtcd() {
  EtcdClusterOptions options;
  options.members = 1;
  absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster = EtcdCluster::Start(options);
  INFO("starting etcd: " << cluster.status()
                         << " (etcd comes from Debian's etcd-server: run tools/setup.sh)");
  REQUIRE(cluster.ok());
  return std::move(*cluster);
}

std::unique_ptr<EtcdClient> Client(const EtcdCluster& cluster) {
  EtcdClientOptions options;
  options.endpoints = cluster.client_endpoints();
  options.call_deadline = absl::Seconds(1);
  options.retry.initial_backoff = absl::Milliseconds(20);
  options.retry.max_backoff = absl::Milliseconds(200);
  options.retry.give_up_after = absl::Seconds(3);
  auto client = EtcdClient::Create(options);
  REQUIRE(client.ok());
  return std::move(*client);
}

std::unique_ptr<LeaderElection> Candidate(EtcdClient* client, const std::string& address) {
  LeaderElectionOptions options;
  options.key = kKey;
  options.value = address;
  options.lease_ttl = absl::Seconds(1);
  auto election = LeaderElection::Create(client, options);
  REQUIRE(election.ok());
  return std::move(*election);
}

TEST_CASE("one candidate wins; the other waits and wins a higher epoch when the first resigns") {
  auto cluster = StartEtcd();
  auto client = Client(*cluster);
  auto a = Candidate(client.get(), "10.0.0.1:7070");
  auto b = Candidate(client.get(), "10.0.0.2:7070");
  CHECK(b->CheckLeadership().code() == absl::StatusCode::kFailedPrecondition);

  REQUIRE(a->Campaign(nullptr).ok());
  CHECK(a->CheckLeadership().ok());
  auto leader = a->Leader();
  REQUIRE(leader.ok());
  REQUIRE(leader->has_value());
  CHECK((*leader)->address == "10.0.0.1:7070");
  CHECK((*leader)->epoch == a->epoch());
  CHECK(a->epoch() > 0);

  std::atomic<bool> b_won{false};
  absl::Notification stop;
  std::thread campaign([&] { b_won = b->Campaign(&stop).ok(); });
  absl::SleepFor(absl::Milliseconds(1500));  // longer than a TTL: a keeps its lease alive
  CHECK_FALSE(b_won.load());
  CHECK(a->CheckLeadership().ok());

  REQUIRE(a->Resign().ok());
  CHECK(a->CheckLeadership().code() == absl::StatusCode::kFailedPrecondition);
  campaign.join();  // bounded: b wins as soon as the key is gone
  CHECK(b_won.load());
  CHECK(b->CheckLeadership().ok());
  CHECK(b->epoch() > a->epoch());
  leader = b->Leader();
  REQUIRE(leader.ok());
  REQUIRE(leader->has_value());
  CHECK((*leader)->address == "10.0.0.2:7070");
}

TEST_CASE("a stopped campaign returns CANCELLED and holds no lease") {
  auto cluster = StartEtcd();
  auto client = Client(*cluster);
  auto a = Candidate(client.get(), "a:1");
  auto b = Candidate(client.get(), "b:1");
  REQUIRE(a->Campaign(nullptr).ok());
  absl::Notification stop;
  absl::Status result;
  std::thread campaign([&] { result = b->Campaign(&stop); });
  absl::SleepFor(absl::Milliseconds(300));
  stop.Notify();
  campaign.join();
  CHECK(result.code() == absl::StatusCode::kCancelled);
  CHECK(b->CheckLeadership().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(a->CheckLeadership().ok());
}

TEST_CASE("a leader that etcd stops renewing holds its answers from TTL/2 and has lost the "
          "leadership at TTL, before the lease can expire; a new campaign wins a new epoch") {
  auto cluster = StartEtcd();
  auto client = Client(*cluster);
  auto a = Candidate(client.get(), "a:1");
  REQUIRE(a->Campaign(nullptr).ok());
  const int64_t first = a->epoch();
  const absl::Duration ttl = a->granted_ttl();
  REQUIRE(ttl >= absl::Seconds(1));
  cluster->Pause(0);  // SIGSTOP: no renewal is acknowledged any more
  const absl::Time paused = absl::Now();
  absl::Status held;
  while ((held = a->CheckLeadership()).ok() && absl::Now() - paused < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  const absl::Duration late_after = absl::Now() - paused;
  INFO(held.message());
  // The lease was renewed at most TTL/6 (plus an answer's time) before the pause; answers are
  // held TTL/2 after the last renewal, so at most TTL/2 after the pause (plus the polling).
  CHECK(held.code() == absl::StatusCode::kUnavailable);
  CHECK(late_after <= ttl / 2 + absl::Milliseconds(100));
  while ((held = a->CheckLeadership()).code() == absl::StatusCode::kUnavailable &&
         absl::Now() - paused < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  const absl::Duration lost_after = absl::Now() - paused;
  INFO(held.message());
  // Lost TTL after the last renewal: not before TTL - TTL/6 after the pause (a renewal's
  // period, less the time its answer took), and never after TTL (when etcd may expire it).
  CHECK(held.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(lost_after >= ttl - ttl / 6 - absl::Milliseconds(100));
  CHECK(lost_after <= ttl + absl::Milliseconds(100));
  cluster->Resume(0);
  // Lost is lost, even if a late renewal arrives now.
  absl::SleepFor(absl::Milliseconds(500));
  CHECK(a->CheckLeadership().code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(a->Campaign(nullptr).ok());
  CHECK(a->CheckLeadership().ok());
  CHECK(a->epoch() > first);
}

TEST_CASE("a renewal that comes late, but before the lease's TTL, gives the leadership back in "
          "the same epoch (what an etcd election costs: a pause, not a failover)") {
  auto cluster = StartEtcd();
  auto client = Client(*cluster);
  auto a = Candidate(client.get(), "a:1");
  auto b = Candidate(client.get(), "b:1");
  REQUIRE(a->Campaign(nullptr).ok());
  const int64_t epoch = a->epoch();
  cluster->Pause(0);
  const absl::Time paused = absl::Now();
  absl::Status held;
  while ((held = a->CheckLeadership()).ok() && absl::Now() - paused < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  INFO(held.message());
  REQUIRE(held.code() == absl::StatusCode::kUnavailable);
  cluster->Resume(0);  // about TTL/2 after the last renewal: the keeper has TTL/2 to renew
  const absl::Time resumed = absl::Now();
  while ((held = a->CheckLeadership()).code() == absl::StatusCode::kUnavailable &&
         absl::Now() - resumed < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  INFO(held.message());
  CHECK(held.ok());
  CHECK(a->epoch() == epoch);
  // The key never went: nobody else could win meanwhile.
  absl::StatusOr<std::optional<LeaderInfo>> holder = b->TryCampaign();
  REQUIRE(holder.ok());
  REQUIRE(holder->has_value());
  CHECK((*holder)->address == "a:1");
  CHECK((*holder)->epoch == epoch);
}

TEST_CASE("options are validated") {
  auto cluster = StartEtcd();
  auto client = Client(*cluster);
  LeaderElectionOptions options;
  options.value = "a:1";
  CHECK(LeaderElection::Create(client.get(), options).status().code() ==
        absl::StatusCode::kInvalidArgument);
  options.key = kKey;
  options.lease_ttl = absl::Milliseconds(500);
  CHECK(LeaderElection::Create(client.get(), options).status().code() ==
        absl::StatusCode::kInvalidArgument);
  options.lease_ttl = absl::Seconds(1);
  CHECK(LeaderElection::Create(nullptr, options).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(LeaderElection::Create(client.get(), options).ok());
}

}  // namespace
}  // namespace rebound
