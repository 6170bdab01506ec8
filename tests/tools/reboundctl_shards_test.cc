// reboundctl status and reboundctl shards against real sharded clusters on loopback
// (testing/cluster with shard_groups): real rebound_server groups, one server each or replicated
// with real etcd; a group stopped (SIGSTOP) or killed shows as DEGRADED.

#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "testing/cluster/cluster.h"
#include "testing/cluster/processes.h"

namespace rebound::testing {
namespace {

// A job the center of which can be sharded: EASGD (the default), a model spec, REPLAY (the
// default). 16 x 784 + 16 + 10 x 16 + 10 = 12730 parameters in its one stage.
const char kServerConfig[] =
    "listen_address: \"127.0.0.1:0\"\n"
    "job {\n"
    "  job_id: \"ctl-shards\"\n"
    "  model { layers { width: 16 } layers { width: 10 activation: IDENTITY } }\n"
    "  topology { replicas: 2 }\n"
    "  data { batch_size: 16 train_limit: 2000 test_limit: 500 }\n"
    "}\n";

const char kWorkerConfig[] = "job_id: \"ctl-shards\"\n";

ClusterOptions Options(const std::string& name, int groups, int standbys) {
  ClusterOptions options;
  options.server_binary = Runfile("server/rebound_server");
  options.worker_binary = Runfile("worker/rebound_worker");
  options.dir = MakeTempDir(name);
  options.shard_groups = groups;
  options.standbys = standbys;
  return options;
}

// Runs reboundctl with `args`; its exit code, its output (stdout and stderr) in *output.
int Ctl(const std::vector<std::string>& args, std::string* output) {
  std::vector<std::string> argv = {Runfile("tools/reboundctl")};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv, output, absl::Seconds(30));
}

// The row of group `g` in a shards table.
std::string RowOf(const std::string& table, int g) {
  for (absl::string_view line : absl::StrSplit(table, '\n')) {
    if (absl::StartsWith(line, absl::StrCat(g, " "))) return std::string(line);
  }
  return "";
}

TEST_CASE("status shows the ranges and the group it asked; shards a row per group, DEGRADED") {
  Cluster cluster(Options("ctl-shards", 2, 0));
  REQUIRE(cluster.StartServer(kServerConfig, kWorkerConfig).ok());
  const std::string g0 = cluster.group_address(0);
  const std::string g1 = cluster.group_address(1);

  std::string out;
  REQUIRE(Ctl({"--server", g0, "status"}, &out) == 0);
  CHECK(absl::StrContains(out, absl::StrCat("center sharded across 2 groups; this server is "
                                            "group 0 (", g0, ") and holds the ranges marked *")));
  CHECK(absl::StrContains(out, "stage 0: 12730 parameters: g0 [0, 6365)*  g1 [6365, 12730)\n"));
  // A range group answers status too: its own range, its own center version.
  REQUIRE(Ctl({"--server", g1, "status"}, &out) == 0);
  CHECK(absl::StrContains(out, absl::StrCat("this server is group 1 (", g1, ")")));
  CHECK(absl::StrContains(out, "g0 [0, 6365)  g1 [6365, 12730)*\n"));
  CHECK(absl::StrContains(out, "center stage 0: version 0, 6365 parameters"));

  // Asked through either group, shards lists both.
  for (const std::string& through : {g0, g1}) {
    INFO(through);
    REQUIRE(Ctl({"--server", through, "shards"}, &out) == 0);
    INFO(out);
    CHECK(absl::StrContains(out, "job ctl-shards: center sharded across 2 groups (asked through " +
                                     through));
    for (int g = 0; g < 2; ++g) {
      const std::string row = RowOf(out, g);
      INFO(row);
      CHECK(absl::StrContains(row, g == 0 ? g0 : g1));
      CHECK(absl::StrContains(row, " yes "));
      CHECK(absl::StrContains(row, "single server"));
      CHECK(absl::StrContains(row, "s0:v0"));
    }
    CHECK(absl::StrContains(out, "all 2 groups answer\n"));
  }
  REQUIRE(Ctl({"--server", g0, "--output", "json", "shards"}, &out) == 0);
  CHECK(absl::StartsWith(out, "{\"groups\":2,\"degraded\":false,\"shards\":[{\"group\":0,"));

  // A stopped group answers nothing within --timeout_ms: DEGRADED, exit 1; the rest still shown.
  const int g1_member = cluster.members_per_group();
  REQUIRE(cluster.group_of(g1_member) == 1);
  cluster.StopMember(g1_member);
  const absl::Time asked = absl::Now();
  CHECK(Ctl({"--server", g0, "--timeout_ms", "1000", "shards"}, &out) == 1);
  CHECK(absl::Now() - asked < absl::Seconds(10));
  INFO(out);
  CHECK(absl::StrContains(RowOf(out, 0), " yes "));
  CHECK(absl::StrContains(RowOf(out, 1), " NO "));
  CHECK(absl::StrContains(out, absl::StrCat("DEGRADED: group 1 (", g1,
                                            ") does not answer: DEADLINE_EXCEEDED")));
  CHECK_FALSE(absl::StrContains(out, "all 2 groups answer"));
  CHECK(Ctl({"--server", g0, "--timeout_ms", "1000", "--output", "json", "shards"}, &out) == 1);
  CHECK(absl::StrContains(out, "\"degraded\":true"));
  CHECK(absl::StrContains(out, "{\"group\":1,\"address\":\"" + g1 + "\",\"reachable\":false,"));
  cluster.ResumeMember(g1_member);
  CHECK(Ctl({"--server", g0, "shards"}, &out) == 0);

  // A dead one: refused at once.
  REQUIRE(cluster.KillMember(g1_member).ok());
  CHECK(Ctl({"--server", g0, "shards"}, &out) == 1);
  CHECK(absl::StrContains(out, absl::StrCat("DEGRADED: group 1 (", g1,
                                            ") does not answer: UNAVAILABLE")));
  // And through the dead group itself: nothing to ask, exit 2 as for any unreachable server.
  CHECK(Ctl({"--server", g1, "--timeout_ms", "2000", "shards"}, &out) == 2);
}

TEST_CASE("with replicated groups every row names its own group's leader") {
  Cluster cluster(Options("ctl-shards-group", 2, 1));
  REQUIRE(cluster.StartServer(kServerConfig, kWorkerConfig).ok());
  std::string out;
  REQUIRE(Ctl({"--server", cluster.group_address(0), "shards"}, &out) == 0);
  INFO(out);
  for (int g = 0; g < 2; ++g) {
    const std::string row = RowOf(out, g);
    INFO(row);
    // The group's address is both members', and its leader is one of them.
    CHECK(absl::StrContains(row, cluster.group_address(g)));
    CHECK(absl::StrContains(row, absl::StrCat("g", g, "-server-")));
    CHECK(absl::StrContains(row, " LEADER (epoch "));
  }
  CHECK(absl::StrContains(out, "all 2 groups answer\n"));
}

TEST_CASE("shards on a job that is not sharded says so and exits 1") {
  ClusterOptions options = Options("ctl-shards-one", 1, 0);
  Cluster cluster(options);
  REQUIRE(cluster.StartServer(kServerConfig, kWorkerConfig).ok());
  std::string out;
  CHECK(Ctl({"--server", cluster.address(), "shards"}, &out) == 1);
  CHECK(absl::StrContains(out, "is not sharded (sharding.groups 1"));
  REQUIRE(Ctl({"--server", cluster.address(), "status"}, &out) == 0);
  CHECK_FALSE(absl::StrContains(out, "center sharded"));
}

}  // namespace
}  // namespace rebound::testing
