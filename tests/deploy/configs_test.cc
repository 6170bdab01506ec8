// The configs of the Kubernetes ConfigMap (deploy/k8s/config) pass the validation that
// rebound_server and rebound_worker run at start, as shipped and as the workers' init container
// rewrites them (the pod IP as the peer address).

#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>
#include <string>

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

TEST_CASE("the worker's config loads and joins only the ConfigMap's job") {
  auto worker = LoadWorkerConfig(std::string(kConfigDir) + "/worker.pbtxt");
  REQUIRE(worker.ok());
  CHECK(worker->server_address() == "rebound-server-0.rebound-server:7070");
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

}  // namespace
}  // namespace rebound
