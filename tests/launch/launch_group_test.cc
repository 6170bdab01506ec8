// rebound_launch --standbys: the real launcher starts real etcd members (/usr/bin/etcd), a
// replicated group of real rebound_server members and real workers on loopback; it kills the
// leader (--kill_leader_at_step), prints the failover and the killed member's return, and leaves
// no process behind.

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
#include "testing/cluster/processes.h"
#include "tests/launch/launch_testing.h"

namespace rebound::testing {
namespace {

// R = 2, S = 1, one spare; fast failure detection; more steps than the test waits for.
const char kJob[] =
    "job_id: \"launch-group\"\n"
    "model { layers { width: 16 } layers { width: 10 activation: IDENTITY } }\n"
    "topology { replicas: 2 stages: 1 spares: 1 }\n"
    "data { batch_size: 32 train_limit: 2000 test_limit: 500 }\n"
    "adahessian { lr: 0.01 }\n"
    "fault_tolerance { heartbeat_interval_ms: 200 failure_timeout_ms: 1000 }\n"
    "training { max_steps: 100000000 }\n";

// The seconds in "... <seconds> s after ..." following `prefix` on its line, or -1.
double SecondsAfter(const std::string& output, const std::string& prefix) {
  const std::string line = LineAfter(output, prefix);
  const size_t end = line.find(" s after");
  double seconds = -1;
  if (end == std::string::npos) return -1;
  const size_t start = line.rfind(' ', end - 1);
  if (!absl::SimpleAtod(line.substr(start + 1, end - start - 1), &seconds)) return -1;
  return seconds;
}

TEST_CASE("a killed leader fails over to its standby and comes back in sync; nothing is left") {
  Launch launch("launch-group", kJob);
  const std::string workdir = launch.dir() + "/work";
  launch.Start({"--workdir", workdir, "--standbys", "1", "--kill_leader_at_step", "20",
                "--timeout_s", "240"});
  std::string output = launch.WaitForOutput("server group up: ");

  // etcd, two members with their own data dirs under the work dir, one of them leading.
  CHECK(absl::StrContains(output, "starting etcd: 3 members (/usr/bin/etcd) on loopback"));
  const std::string etcd_line = LineAfter(output, "(data and logs in ");
  REQUIRE(absl::StrContains(etcd_line, ", removed at exit)"));
  const std::string etcd_dir = etcd_line.substr(0, etcd_line.find(','));
  for (const char* member : {"server-0", "server-1"}) {
    INFO(member);
    CHECK(absl::StrContains(output, absl::StrCat("started ", member, " (rebound_server, pid ")));
    CHECK(absl::StrContains(output, absl::StrCat("data dir ", workdir, "/", member, ", log ")));
    const std::string config = ReadFileOrEmpty(absl::StrCat(workdir, "/", member, ".pbtxt"));
    CHECK(absl::StrContains(config, "replication {"));
    CHECK(absl::StrContains(config, absl::StrCat("name: \"", member, "\"")));
  }
  // The workers get both members' addresses and the group's shorter backoff.
  const std::string list = LineAfter(output, "workers get --server ");
  CHECK(std::vector<std::string>(absl::StrSplit(list, ',')).size() == 2);
  CHECK(absl::StrContains(ReadFileOrEmpty(workdir + "/worker.pbtxt"), "backoff_max_ms: 250"));

  // The kill, the failover to the other member, the killed one started again and in sync.
  output = launch.WaitForOutput(" is back in sync, a standby of ");
  const std::string killed_line = LineAfter(output, "] leader server-");
  REQUIRE_FALSE(killed_line.empty());
  const std::string killed = "server-" + killed_line.substr(0, 1);
  const std::string survivor = killed == "server-0" ? "server-1" : "server-0";
  CHECK(absl::StrContains(killed_line, "SIGKILLed at mean trainer step "));
  CHECK(absl::StrContains(killed_line, "1 standby(s) in sync"));
  CHECK(absl::StrContains(output, absl::StrCat(killed, " (pid ")));
  CHECK(absl::StrContains(output, "exited: killed by SIGKILL, as the launcher killed it"));
  CHECK(absl::StrContains(output, absl::StrCat("group: ", survivor, " leads (epoch ")));
  const double failover =
      SecondsAfter(output, absl::StrCat("failover: ", survivor, " acknowledged its first sync "));
  INFO(output);
  // The lease (2 s, renewed every third of it) is the floor; the bound is loose for a loaded
  // 2-core machine.
  CHECK(failover >= 1.0);
  CHECK(failover < 20);
  CHECK(absl::StrContains(output, absl::StrCat("started ", killed, " again (pid ")));
  CHECK(absl::StrContains(output, absl::StrCat("group: ", killed, " is back in sync, a standby of ",
                                               survivor)));

  // Training goes on under the new leader.
  const int64_t steps_then = MaxStepOf(launch.Output(), "0,0");
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (MaxStepOf(launch.Output(), "0,0") <= steps_then && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  CHECK(MaxStepOf(launch.Output(), "0,0") > steps_then);

  launch.process().Signal(SIGTERM);
  REQUIRE(launch.WaitForExit() == 143);
  output = launch.Output();
  CHECK(absl::StrContains(output, "stopping the server group's 2 running members"));
  CHECK(absl::StrContains(output, "stopped etcd (3 members)"));
  CHECK(absl::StrContains(output, absl::StrCat("failover summary: the leader ", killed)));
  CHECK(output.find("SIGKILLed at mean") == output.rfind("SIGKILLed at mean"));  // once
  CHECK(ProcessesMentioning(workdir).empty());
  CHECK(ProcessesMentioning(etcd_dir).empty());
  CHECK_FALSE(std::filesystem::exists(etcd_dir));
}

TEST_CASE("the group's flags are refused with exit 2 before anything starts") {
  Launch launch("launch-group-flags", kJob);
  const std::string workdir = launch.dir() + "/work";
  launch.Start({"--workdir", workdir, "--kill_leader_at_step", "10"});
  REQUIRE(launch.WaitForExit() == 2);
  CHECK(absl::StrContains(launch.Output(), "--kill_leader_at_step needs --standbys >= 1"));
  CHECK_FALSE(std::filesystem::exists(workdir));

  Launch late("launch-group-late", kJob);
  WriteFileOrDie(late.job_file(), absl::StrReplaceAll(kJob, {{"100000000", "100"}}));
  late.Start({"--standbys", "1", "--kill_leader_at_step", "100"});
  REQUIRE(late.WaitForExit() == 2);
  CHECK(absl::StrContains(late.Output(), "--kill_leader_at_step 100 is not below the job's "
                                         "training.max_steps 100"));
}

}  // namespace
}  // namespace rebound::testing
