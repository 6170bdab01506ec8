// rebound_launch --shard_groups: the real launcher starts the center sharded across real
// rebound_server groups (one server each, or replicated groups with real etcd) and real workers
// on loopback; a trainer killed on the way is rebuilt, every group applies every sync, a group
// that dies ends the launch, and no process is left behind.

#include <catch2/catch.hpp>
#include <signal.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/file.h"
#include "common/safetensors.h"
#include "testing/cluster/processes.h"
#include "tests/launch/launch_testing.h"

namespace rebound::testing {
namespace {

// R = 2, S = 1, one spare; fast failure detection; short enough to finish. No sharding block:
// --shard_groups shards it.
const char kJob[] =
    "job_id: \"launch-shard\"\n"
    "model { layers { width: 16 } layers { width: 10 activation: IDENTITY } }\n"
    "topology { replicas: 2 stages: 1 spares: 1 }\n"
    "data { batch_size: 32 train_limit: 2000 test_limit: 500 }\n"
    "adahessian { lr: 0.01 }\n"
    "fault_tolerance { heartbeat_interval_ms: 200 failure_timeout_ms: 1000 }\n"
    // Long enough that the kill lands mid-run: the launcher sees step 100 at its first 1 s
    // poll (this model does hundreds of steps a second) and may wait up to 5 s more for logged
    // steps to replay; a 600-step job could finish first.
    "training { max_steps: 5000 }\n";

// The same job, sharded in its own file, with more steps than any test waits for.
const char kShardedLongJob[] =
    "job_id: \"launch-shard-long\"\n"
    "model { layers { width: 16 } layers { width: 10 activation: IDENTITY } }\n"
    "topology { replicas: 2 stages: 1 spares: 1 }\n"
    "data { batch_size: 32 train_limit: 2000 test_limit: 500 }\n"
    "adahessian { lr: 0.01 }\n"
    "fault_tolerance { heartbeat_interval_ms: 200 failure_timeout_ms: 1000 }\n"
    "sharding { groups: 2 }\n"
    "training { max_steps: 100000000 }\n";

// The center versions the launcher printed for group `g` at the end ("s0:v<version>"), or -1.
int64_t FinalVersionOf(const std::string& output, int g) {
  const std::string line = LineAfter(output, absl::StrCat("] shard group ", g, " ("));
  const size_t at = line.find("center versions s0:v");
  int64_t version = -1;
  if (at == std::string::npos) return -1;
  const std::string rest = line.substr(at + std::string("center versions s0:v").size());
  if (!absl::SimpleAtoi(rest.substr(0, rest.find(' ')), &version)) return -1;
  return version;
}

TEST_CASE("a job sharded across two groups trains to the end through a killed trainer") {
  Launch launch("launch-shard", kJob);
  const std::string workdir = launch.dir() + "/work";
  const std::string model = launch.dir() + "/model.safetensors";
  launch.Start({"--workdir", workdir, "--shard_groups", "2", "--kill_trainer_at_step", "100",
                "--kill_slot", "1,0", "--timeout_s", "240", "--export", model});
  REQUIRE(launch.WaitForExit() == 0);
  const std::string output = launch.Output();
  INFO(output);

  // The job's copy with sharding.groups = 2 (and the start barrier over its slots), read by
  // both servers, each with its shard block.
  const std::string copy = workdir + "/job.launch.pbtxt";
  CHECK(absl::StrContains(output, absl::StrCat("the servers read ", copy,
                                               ": the job with sharding.groups = 2")));
  CHECK(absl::StrContains(ReadFileOrEmpty(copy), "sharding {\n  groups: 2\n}"));
  std::vector<std::string> addresses;
  for (int g = 0; g < 2; ++g) {
    const std::string name = absl::StrCat("g", g, "-server");
    INFO(name);
    const std::string started = LineAfter(output, absl::StrCat("started ", name, " (rebound_server, pid "));
    REQUIRE(absl::StrContains(started, absl::StrCat(", shard group ", g, ", state in memory")));
    const std::string port = started.substr(started.find("for 127.0.0.1:") + 14);
    addresses.push_back("127.0.0.1:" + port.substr(0, port.find(',')));
    CHECK(absl::StrContains(output, absl::StrCat("shard group ", g, " up at ", addresses.back(),
                                                 ": single server")));
  }
  for (int g = 0; g < 2; ++g) {
    const std::string config = ReadFileOrEmpty(absl::StrCat(workdir, "/g", g, "-server.pbtxt"));
    INFO(config);
    CHECK(absl::StrContains(config, absl::StrCat("job_file: \"", copy, "\"")));
    CHECK(absl::StrContains(config, absl::StrCat("shard {\n  group: ", g, "\n  group_addresses: \"",
                                                 addresses[0], "\"\n  group_addresses: \"",
                                                 addresses[1], "\"\n}")));
    CHECK(absl::StrContains(ReadFileOrEmpty(absl::StrCat(workdir, "/g", g, "-server.log")),
                            "serving job 'launch-shard'"));
  }
  // The ranges: 16 x 784 + 16 + 10 x 16 + 10 = 12730 parameters, halved.
  CHECK(absl::StrContains(output, "stage 0: 12730 parameters: g0 [0, 6365)  g1 [6365, 12730)"));
  CHECK(absl::StrContains(output, absl::StrCat("workers get group 0's address: --server ",
                                               addresses[0])));

  // The kill and the rebuild, as without sharding.
  const int pid = NumberAfter(output, "started trainer-r1s0 (pid ");
  REQUIRE(pid > 0);
  CHECK(absl::StrContains(output, absl::StrCat("killed trainer-r1s0 (pid ", pid, ") at step ")));
  CHECK(absl::StrContains(output, "recovery 1 of slot (1,0): RECOVERED, policy REPLAY"));
  CHECK(absl::StrContains(output, "slot (0,0): ACTIVE -> FINISHED"));
  CHECK(absl::StrContains(output, "slot (1,0): ACTIVE -> FINISHED"));
  CHECK(absl::StrContains(output, "every slot FINISHED"));
  // Every sync reached both groups once: their ranges' versions agree.
  const int64_t v0 = FinalVersionOf(output, 0);
  CHECK(v0 > 0);
  CHECK(FinalVersionOf(output, 1) == v0);
  // --export: group 0 gathered the center from both groups, named as the unsharded job's, at
  // the groups' final version.
  absl::StatusOr<std::string> bytes = ReadFile(model, int64_t{64} << 20);
  REQUIRE(bytes.ok());
  absl::StatusOr<DecodedSafetensors> decoded = DecodeSafetensors(*bytes);
  INFO(decoded.status());
  REQUIRE(decoded.ok());
  std::vector<std::string> names;
  for (const Tensor& tensor : decoded->tensors) names.push_back(tensor.name());
  CHECK(names == std::vector<std::string>{"layer0.weight", "layer0.bias", "layer1.weight",
                                          "layer1.bias"});
  CHECK(decoded->metadata.at("rebound.center_versions") == absl::StrCat(v0));
  CHECK(absl::StrContains(output, absl::StrCat("the trained model (center version ", v0, ",")));
  CHECK(absl::StrContains(output, "stopping 2 running servers of the 2 shard groups"));
  CHECK(LineAfter(output, "stopped g1-server (pid ").find("exit code 0") != std::string::npos);
  CHECK(ProcessesMentioning(workdir).empty());
}

TEST_CASE("a shard group that dies ends the launch with exit 1; nothing is left") {
  Launch launch("launch-shard-dies", kShardedLongJob);
  const std::string workdir = launch.dir() + "/work";
  // No --shard_groups: the job's own sharding.groups, read from its own file.
  launch.Start({"--workdir", workdir, "--timeout_s", "120"});
  std::string output = launch.WaitForOutput("cluster up");
  // Its copy changes the start barrier only (the job sets no min_trainers).
  const std::string copy = workdir + "/job.launch.pbtxt";
  CHECK(absl::StrContains(output, absl::StrCat("the servers read ", copy,
                                               ": the job with topology.min_trainers = ")));
  CHECK_FALSE(absl::StrContains(output, "sharding.groups = "));
  CHECK(absl::StrContains(ReadFileOrEmpty(workdir + "/g1-server.pbtxt"),
                          absl::StrCat("job_file: \"", copy, "\"")));
  const int g1 = NumberAfter(output, "started g1-server (rebound_server, pid ");
  REQUIRE(g1 > 0);
  launch.WaitForOutput("recoveries=0");
  REQUIRE(kill(g1, SIGKILL) == 0);
  REQUIRE(launch.WaitForExit() == 1);
  output = launch.Output();
  INFO(output);
  CHECK(absl::StrContains(output, absl::StrCat("g1-server (rebound_server, pid ", g1,
                                               ") exited unexpectedly: killed by SIGKILL")));
  CHECK(absl::StrContains(output, "the server of shard group 1 has exited: its range of the "
                                  "center is gone, training cannot go on"));
  CHECK(absl::StrContains(output, "shard group 1 (127.0.0.1:"));  // its summary: no answer
  CHECK(absl::StrContains(output, "stopped g0-server (pid "));
  CHECK(ProcessesMentioning(workdir).empty());
}

TEST_CASE("replicated shard groups: group 0's leader fails over, group 1 is untouched") {
  Launch launch("launch-shard-group", kShardedLongJob);
  const std::string workdir = launch.dir() + "/work";
  launch.Start({"--workdir", workdir, "--shard_groups", "2", "--standbys", "1",
                "--kill_leader_at_step", "20", "--timeout_s", "240"});
  std::string output = launch.WaitForOutput("center sharded across 2 groups");
  const std::string etcd_line = LineAfter(output, "(data and logs in ");
  const std::string etcd_dir = etcd_line.substr(0, etcd_line.find(','));
  for (const std::string member : {"g0-server-0", "g0-server-1", "g1-server-0", "g1-server-1"}) {
    INFO(member);
    const std::string group = member.substr(1, 1);
    CHECK(absl::StrContains(output, absl::StrCat("data dir ", workdir, "/", member, ", log ")));
    const std::string config = ReadFileOrEmpty(absl::StrCat(workdir, "/", member, ".pbtxt"));
    CHECK(absl::StrContains(config, absl::StrCat("name: \"", member, "\"")));
    // Each shard group elects its own leader: its own replication.group.
    CHECK(absl::StrContains(config, absl::StrCat("  group: \"", group, "\"\n")));
    CHECK(absl::StrContains(config, absl::StrCat("shard {\n  group: ", group, "\n")));
  }
  // Group 1 has a leader of its own; the workers get group 0's two members.
  CHECK(absl::StrContains(LineAfter(output, "shard group 1 up at "), " LEADER (epoch "));
  CHECK(std::vector<std::string>(
            absl::StrSplit(LineAfter(output, "workers get group 0's address: --server "), ','))
            .size() == 2);

  // Group 0's leader is killed, a standby of group 0 takes over, the killed one comes back.
  output = launch.WaitForOutput(" is back in sync, a standby of ");
  const std::string killed_line = LineAfter(output, "] leader g0-server-");
  REQUIRE_FALSE(killed_line.empty());
  const std::string killed = "g0-server-" + killed_line.substr(0, 1);
  const std::string survivor = killed == "g0-server-0" ? "g0-server-1" : "g0-server-0";
  INFO(output);
  CHECK(absl::StrContains(output, absl::StrCat("failover: ", survivor,
                                               " acknowledged its first sync ")));
  CHECK(absl::StrContains(output, absl::StrCat("group: ", killed, " is back in sync, a standby of ",
                                               survivor)));
  CHECK_FALSE(absl::StrContains(output, "] leader g1-server-"));  // only group 0's

  // Training goes on across both groups.
  const int64_t steps_then = MaxStepOf(launch.Output(), "0,0");
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (MaxStepOf(launch.Output(), "0,0") <= steps_then + 50 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  CHECK(MaxStepOf(launch.Output(), "0,0") > steps_then + 50);

  launch.process().Signal(SIGTERM);
  REQUIRE(launch.WaitForExit() == 143);
  output = launch.Output();
  CHECK(absl::StrContains(output, "stopping 4 running servers of the 2 shard groups"));
  CHECK(absl::StrContains(output, "stopped etcd (3 members)"));
  CHECK(FinalVersionOf(output, 0) > 0);
  CHECK(FinalVersionOf(output, 1) > 0);
  CHECK(ProcessesMentioning(workdir).empty());
  CHECK(ProcessesMentioning(etcd_dir).empty());
}

TEST_CASE("--shard_groups is refused with exit 2 for a job it cannot shard, before anything") {
  Launch launch("launch-shard-bad", kJob);
  WriteFileOrDie(launch.job_file(),
                 absl::StrReplaceAll(
                     kJob, {{"model { layers { width: 16 } layers { width: 10 activation: "
                             "IDENTITY } }",
                             "model { declared_by_worker: true }"},
                            {"fault_tolerance {", "fault_tolerance { policy: GLOBAL_CHECKPOINT"}}));
  const std::string workdir = launch.dir() + "/work";
  launch.Start({"--workdir", workdir, "--shard_groups", "2"});
  REQUIRE(launch.WaitForExit() == 2);
  CHECK(absl::StrContains(launch.Output(),
                          "--shard_groups 2: the job cannot be sharded: sharding.groups > 1 with "
                          "a model declared by its workers needs fault_tolerance.policy REPLAY"));
  CHECK_FALSE(std::filesystem::exists(workdir));

  Launch disagree("launch-shard-disagree", kShardedLongJob);
  disagree.Start({"--workdir", workdir, "--shard_groups", "3"});
  REQUIRE(disagree.WaitForExit() == 2);
  CHECK(absl::StrContains(disagree.Output(),
                          "--shard_groups 3 disagrees with the job's sharding.groups 2"));
  CHECK_FALSE(std::filesystem::exists(workdir));
}

}  // namespace
}  // namespace rebound::testing
