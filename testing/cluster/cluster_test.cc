// testing/cluster/cluster.h against the real binaries: a server and workers on loopback, a worker
// stopped, resumed and killed, an unexpected exit reported, everything stopped and reaped.

#include "testing/cluster/cluster.h"

#include <signal.h>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "testing/cluster/processes.h"

namespace rebound::testing {
namespace {

constexpr char kServerConfig[] =
    "listen_address: \"127.0.0.1:0\"\n"
    "job {\n"
    "  job_id: \"ct\"\n"
    "  model { layers { width: 16 } layers { width: 10 activation: IDENTITY } }\n"
    "  topology { replicas: 1 }\n"
    "  data { batch_size: 32 micro_batches: 2 train_limit: 1000 test_limit: 200 }\n"
    "  easgd { sync_period: 10 }\n"
    "  training { max_steps: 1000000 eval_every_ms: 200 }\n"
    "}\n";
constexpr char kWorkerConfig[] = "backoff_initial_ms: 20\nbackoff_max_ms: 200\n";

// kServerConfig with `job_fields` added to its job.
std::string ServerConfigWith(const std::string& job_fields) {
  std::string config = kServerConfig;
  config.insert(config.rfind('}'), job_fields);
  return config;
}

ClusterOptions Options(const std::string& name) {
  ClusterOptions options;
  options.server_binary = Runfile("server/rebound_server");
  options.worker_binary = Runfile("worker/rebound_worker");
  options.dir = MakeTempDir(name);
  return options;
}

TEST_CASE("a cluster starts, stops, resumes and kills its processes and reaps them all") {
  Cluster cluster(Options("cluster"));
  absl::Status status = cluster.StartServer(kServerConfig, kWorkerConfig);
  INFO(status);
  REQUIRE(status.ok());
  CHECK(absl::StartsWith(cluster.address(), "127.0.0.1:"));
  CHECK(cluster.StartServer(kServerConfig, kWorkerConfig).code() ==
        absl::StatusCode::kFailedPrecondition);

  REQUIRE(cluster.StartTrainers(1).ok());
  REQUIRE(cluster.trainers().size() == 1);
  REQUIRE(cluster.StartSpares({"spare-0"}).ok());
  CHECK(cluster.StartWorker("spare-0", "spare").code() == absl::StatusCode::kInvalidArgument);
  CHECK(cluster.StartWorker("x", "boss").code() == absl::StatusCode::kInvalidArgument);
  status = cluster.WaitForFirstSyncs(1);
  INFO(status << cluster.Logs());
  REQUIRE(status.ok());

  // SIGSTOP and SIGCONT: the spare is stopped (state T in /proc), then runs on.
  REQUIRE(cluster.StopWorker("spare-0").ok());
  const pid_t spare = cluster.FindWorker("spare-0")->pid();
  auto state = [spare] {
    const std::string stat = ReadFileOrEmpty(absl::StrCat("/proc/", spare, "/stat"));
    const size_t paren = stat.rfind(')');
    return paren == std::string::npos || paren + 2 >= stat.size() ? '?' : stat[paren + 2];
  };
  for (int i = 0; i < 200 && state() != 'T'; ++i) usleep(10000);
  CHECK(state() == 'T');
  REQUIRE(cluster.ResumeWorker("spare-0").ok());
  for (int i = 0; i < 200 && state() == 'T'; ++i) usleep(10000);
  CHECK(state() != 'T');
  CHECK(cluster.StopWorker("nobody").code() == absl::StatusCode::kNotFound);

  // A kill is expected; the trainer's exit does not fail the waits.
  REQUIRE(cluster.KillWorker("trainer-0").ok());
  CHECK(cluster.FindWorker("trainer-0")->Poll() == 128 + SIGKILL);
  CHECK(cluster.KillWorker("trainer-0").code() == absl::StatusCode::kFailedPrecondition);
  CHECK(cluster.KillWorker("nobody").code() == absl::StatusCode::kNotFound);
  CHECK(cluster.CheckChildren().ok());

  // An exit nobody asked for does.
  cluster.FindWorker("spare-0")->Signal(SIGKILL);
  REQUIRE(cluster.FindWorker("spare-0")->WaitFor(absl::Seconds(10)).has_value());
  const absl::Status children = cluster.CheckChildren();
  CHECK(children.code() == absl::StatusCode::kInternal);
  CHECK(absl::StrContains(children.message(), "spare-0 exited early with code 137"));
  const absl::StatusOr<GetStatusResponse> waited = cluster.WaitForStatus(
      [](const GetStatusResponse&) { return true; }, absl::Seconds(5), "anything");
  CHECK(waited.status().code() == absl::StatusCode::kInternal);

  std::vector<int> codes;
  cluster.StopAll(/*report=*/true,
                  [&codes](const ChildProcess&, int code) { codes.push_back(code); });
  CHECK(codes == std::vector<int>{128 + SIGKILL, 128 + SIGKILL});
  CHECK(cluster.server().Poll() == 0);
}

TEST_CASE("the destructor kills and reaps what still runs, a stopped worker too") {
  pid_t server = 0, spare = 0;
  {
    Cluster cluster(Options("destructor"));
    REQUIRE(cluster.StartServer(kServerConfig, kWorkerConfig).ok());
    REQUIRE(cluster.StartWorker("spare-0", "spare").ok());
    REQUIRE(cluster.StopWorker("spare-0").ok());
    server = cluster.server().pid();
    spare = cluster.FindWorker("spare-0")->pid();
  }
  CHECK(kill(server, 0) != 0);  // reaped: no such process any more
  CHECK(kill(spare, 0) != 0);
}

TEST_CASE("a server that cannot start is reported with its log") {
  Cluster cluster(Options("bad-server"));
  const absl::Status status = cluster.StartServer("no_such_field: 1\n", kWorkerConfig);
  CHECK(status.code() == absl::StatusCode::kInternal);
  CHECK(absl::StrContains(status.message(), "rebound_server did not start"));
  CHECK(absl::StrContains(status.message(), "no_such_field"));
}

// Needs network namespaces (root); where the machine refuses them the test says so and passes.
TEST_CASE("with a network lab, a partitioned trainer is declared failed") {
  absl::StatusOr<std::unique_ptr<NetworkLab>> lab = NetworkLab::Create();
  if (!lab.ok()) {
    WARN("no network lab on this machine, partitions not tested: " << lab.status().message());
    return;
  }
  ClusterOptions options = Options("partition");
  options.network = lab->get();
  Cluster cluster(options);
  absl::Status status = cluster.StartServer(kServerConfig, kWorkerConfig);
  INFO(status);
  REQUIRE(status.ok());
  CHECK(absl::StartsWith(cluster.address(), (*lab)->gateway() + ":"));
  REQUIRE(cluster.StartTrainers(1).ok());
  REQUIRE(cluster.StartSpares({"spare-0"}).ok());
  REQUIRE(cluster.WaitForFirstSyncs(1).ok());
  REQUIRE(cluster.StartEvaluator().ok());
  CHECK(cluster.Partition("evaluator").code() == absl::StatusCode::kFailedPrecondition);
  CHECK(cluster.Partition("nobody").code() == absl::StatusCode::kNotFound);

  // Cut off, the trainer stops heartbeating: the server declares it failed.
  cluster.ExpectExit("trainer-0");  // fenced (3) or unreachable (4) once it is cut off
  REQUIRE(cluster.Partition("trainer-0").ok());
  const absl::StatusOr<GetStatusResponse> failed = cluster.WaitForStatus(
      [](const GetStatusResponse& s) {
        for (const WorkerStatus& w : s.workers()) {
          if (w.name() == "trainer-0" && w.state() != ALIVE) return true;
        }
        return false;
      },
      absl::Seconds(60), "trainer-0 declared failed");
  INFO(failed.status() << cluster.Logs());
  CHECK(failed.ok());
  CHECK(cluster.Heal("trainer-0").ok());
}

// The job's sharding.groups decides the number of groups when ClusterOptions::shard_groups is
// left at 1: a sharded job cannot run on one server.
TEST_CASE("a job that names sharding.groups gets that many server groups") {
  Cluster cluster(Options("job-sharded"));
  const std::string config = ServerConfigWith("  sharding { groups: 2 }\n");
  absl::Status status = cluster.StartServer(config, kWorkerConfig);
  INFO(config << status << cluster.Logs());
  REQUIRE(status.ok());
  CHECK(cluster.shard_groups() == 2);
  CHECK(cluster.members() == 2);
  CHECK(cluster.member_name(1) == "g1-server-0");
  for (int g = 0; g < 2; ++g) {
    const absl::StatusOr<GetStatusResponse> group = cluster.GetGroupStatus(g);
    INFO("group " << g << ": " << group.status());
    REQUIRE(group.ok());
    CHECK(group->sharding().groups() == 2);
    CHECK(group->sharding().group() == g);
  }
  CHECK(cluster.GroupHost(0).status().code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(cluster.StartTrainers(1).ok());
  status = cluster.WaitForFirstSyncs(1);
  INFO(status << cluster.Logs());
  CHECK(status.ok());
}

TEST_CASE("groups_in_hosts needs a network lab") {
  ClusterOptions options = Options("hosts-without-lab");
  options.groups_in_hosts = true;
  Cluster cluster(options);
  CHECK(cluster.StartServer(kServerConfig, kWorkerConfig).code() ==
        absl::StatusCode::kInvalidArgument);
}

// Needs network namespaces (root); where the machine refuses them the test says so and passes.
TEST_CASE("with groups_in_hosts, each server group listens in a lab host of its own") {
  absl::StatusOr<std::unique_ptr<NetworkLab>> lab = NetworkLab::Create();
  if (!lab.ok()) {
    WARN("no network lab on this machine, groups in hosts not tested: " << lab.status().message());
    return;
  }
  for (const int groups : {1, 2}) {
    INFO(groups << " group(s)");
    ClusterOptions options = Options(absl::StrCat("hosts-", groups));
    options.network = lab->get();
    options.groups_in_hosts = true;
    options.shard_groups = groups;
    options.rpc_deadline = absl::Seconds(1);  // the partitioned group's GetStatus
    Cluster cluster(options);
    absl::Status status = cluster.StartServer(kServerConfig, kWorkerConfig);
    INFO(status << cluster.Logs());
    REQUIRE(status.ok());
    std::vector<int> hosts;
    for (int g = 0; g < groups; ++g) {
      const absl::StatusOr<int> host = cluster.GroupHost(g);
      REQUIRE(host.ok());
      hosts.push_back(*host);
      // The lab's hosts are 10.a.b.(10 + index); the gateway is 10.a.b.1.
      const std::string prefix = (*lab)->gateway().substr(0, (*lab)->gateway().size() - 1);
      const std::string address = cluster.group_address(g);
      CHECK(absl::StartsWith(address, absl::StrCat(prefix, 10 + *host, ":")));
      CHECK(cluster.GetGroupStatus(g).ok());
    }
    if (groups == 2) CHECK(hosts[0] != hosts[1]);
    CHECK(cluster.GroupHost(groups).status().code() == absl::StatusCode::kInvalidArgument);
    REQUIRE(cluster.StartTrainers(1).ok());
    status = cluster.WaitForFirstSyncs(1);
    INFO(status << cluster.Logs());
    REQUIRE(status.ok());

    // Cut off, the last group answers nothing; healed, it answers again.
    REQUIRE((*lab)->Partition(hosts.back()).ok());
    CHECK(!cluster.GetGroupStatus(groups - 1).ok());
    REQUIRE((*lab)->Heal(hosts.back()).ok());
    const absl::Time limit = absl::Now() + absl::Seconds(30);
    while (!cluster.GetGroupStatus(groups - 1).ok() && absl::Now() < limit) {
      absl::SleepFor(absl::Milliseconds(100));
    }
    CHECK(cluster.GetGroupStatus(groups - 1).ok());
    cluster.StopAll(/*report=*/true, [](const ChildProcess&, int) {});
    CHECK(cluster.server().Poll() == 0);
  }
}

}  // namespace
}  // namespace rebound::testing
