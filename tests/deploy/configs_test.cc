// The configs of the Kubernetes ConfigMap (deploy/k8s/config, and deploy/k8s-sharded/config's
// for the sharded overlay) pass the validation that rebound_server and rebound_worker run at
// start, as shipped and as the init containers rewrite them (the pod IP as a worker's peer
// address and as a server member's advertised host).

#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/config.h"

namespace rebound {
namespace {

constexpr char kConfigDir[] = "deploy/k8s/config";

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// What the init container's sed does: the host of peer_listen_address becomes `host`.
std::string WithPeerHost(std::string text, const std::string& host) {
  const std::string from = "peer_listen_address: \"0.0.0.0:";
  const size_t at = text.find(from);
  REQUIRE(at != std::string::npos);
  return text.replace(at, from.size(), "peer_listen_address: \"" + host + ":");
}

// What the server's init container's sed does: the empty advertise_host becomes `host`.
std::string WithAdvertiseHost(std::string text, const std::string& host) {
  const std::string from = "  advertise_host: \"\"";
  const size_t at = text.find(from);
  REQUIRE(at != std::string::npos);
  return text.replace(at, from.size(), "  advertise_host: \"" + host + "\"");
}

TEST_CASE("the server's config loads with its job from the same ConfigMap") {
  auto server = LoadServerConfig(std::string(kConfigDir) + "/server.pbtxt");
  REQUIRE(server.ok());
  CHECK(server->listen_address() == "0.0.0.0:7070");
  CHECK(server->durability().data_dir() == "/var/lib/rebound/data");
  CHECK(server->durability().fsync());
  REQUIRE(server->has_job());
  CHECK(server->job().job_id() == "fashion-mnist-cluster");
  CHECK(server->job().topology().replicas() == 4);
  CHECK(server->job().topology().spares() == 2);
  CHECK(server->job().topology().evaluator());
}

TEST_CASE("the server's config makes each pod a member of a synchronous group of three") {
  auto server = LoadServerConfig(std::string(kConfigDir) + "/server.pbtxt");
  REQUIRE(server.ok());
  REQUIRE(server->has_replication());
  const ReplicationConfig& replication = server->replication();
  REQUIRE(replication.etcd_endpoints_size() == 3);
  for (int i = 0; i < 3; ++i) {
    CHECK(replication.etcd_endpoints(i) ==
          "rebound-etcd-" + std::to_string(i) + ".rebound-etcd:2379");
  }
  CHECK(replication.standbys() == 2);
  CHECK(replication.leader_lease_ms() == 2000);
  CHECK(replication.group() == "0");
  CHECK(replication.name().empty());  // --name=$(POD_NAME)
  CHECK(replication.peer_listen_address() == "0.0.0.0:7071");
  CHECK(replication.advertise_host().empty());  // written per pod
  CHECK(replication.sync());
}

TEST_CASE("the server's config with a pod IP as advertised host is valid, IPv4 and IPv6") {
  const std::string text = Read(std::string(kConfigDir) + "/server.pbtxt");
  for (const std::string host : {"10.244.2.9", "[fd00:10:244::9]"}) {
    auto server = ParseServerConfig(WithAdvertiseHost(text, host), "server.pbtxt", kConfigDir);
    INFO(host);
    REQUIRE(server.ok());
    CHECK(server->replication().advertise_host() == host);
    CHECK(server->job().job_id() == "fashion-mnist-cluster");
  }
}

TEST_CASE("the worker's config loads and joins only the ConfigMap's job") {
  auto worker = LoadWorkerConfig(std::string(kConfigDir) + "/worker.pbtxt");
  REQUIRE(worker.ok());
  // The Service that routes to the group's leader; retries fast enough to find a new one soon.
  CHECK(worker->server_address() == "rebound-server:7070");
  CHECK(worker->backoff_max_ms() == 250);
  CHECK(worker->give_up_after_ms() >= 600000);
  CHECK(worker->peer_listen_address() == "0.0.0.0:7071");
  auto job = LoadJobConfig(std::string(kConfigDir) + "/job.pbtxt");
  REQUIRE(job.ok());
  CHECK(worker->job_id() == job->job_id());
}

TEST_CASE("the worker's config with a pod IP as peer host is valid, IPv4 and IPv6") {
  const std::string text = Read(std::string(kConfigDir) + "/worker.pbtxt");
  for (const std::string host : {"10.244.1.7", "[fd00:10:244::7]"}) {
    auto worker = ParseWorkerConfig(WithPeerHost(text, host), "worker.pbtxt", kConfigDir);
    INFO(host);
    REQUIRE(worker.ok());
    CHECK(worker->peer_listen_address() == host + ":7071");
  }
}

// deploy/k8s-sharded: group g's config, as its StatefulSet's init container renders it.
constexpr char kShardedConfigDir[] = "deploy/k8s-sharded/config";

TEST_CASE("the sharded overlay's group configs load: each its group, every group's Service") {
  const std::vector<std::string> services = {"rebound-server:7070", "rebound-server-g1:7070"};
  for (int g = 0; g < 2; ++g) {
    const std::string file = g == 0 ? "server.pbtxt" : "server-g1.pbtxt";
    INFO(file);
    const std::string text = Read(std::string(kShardedConfigDir) + "/" + file);
    auto server = ParseServerConfig(WithAdvertiseHost(text, "10.244.3.4"), file,
                                    kShardedConfigDir);
    INFO(server.status().message());
    REQUIRE(server.ok());
    CHECK(server->job().job_id() == "fashion-mnist-cluster");
    CHECK(server->job().sharding().groups() == 2);
    CHECK(server->shard().group() == g);
    CHECK(std::vector<std::string>(server->shard().group_addresses().begin(),
                                   server->shard().group_addresses().end()) == services);
    // Its own leader election, in the one etcd.
    CHECK(server->replication().group() == std::to_string(g));
    CHECK(server->replication().etcd_endpoints_size() == 3);
    CHECK(server->replication().advertise_host() == "10.244.3.4");
  }
  // The workers of the base reach group 0, the first entry.
  auto worker = LoadWorkerConfig(std::string(kConfigDir) + "/worker.pbtxt");
  REQUIRE(worker.ok());
  CHECK(worker->server_address() == services[0]);
}

}  // namespace
}  // namespace rebound
