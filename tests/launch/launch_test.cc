// Runs the real rebound_launch, which runs the real rebound_server and rebound_workers on
// loopback; checks what it prints, what the server reports, and that no child outlives it.

#include <catch2/catch.hpp>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/file.h"
#include "common/safetensors.h"
#include "testing/cluster/processes.h"
#include "tests/launch/launch_testing.h"

namespace rebound::testing {
namespace {

// R = 2, S = 1, one spare; fast failure detection; a slice of the data set and more steps than
// any test waits for, so the job is still training when a test stops it.
const char kJob[] =
    "job_id: \"launch-it\"\n"
    "model { layers { width: 16 } layers { width: 10 activation: IDENTITY } }\n"
    "topology { replicas: 2 stages: 1 spares: 1 }\n"
    "data { batch_size: 32 train_limit: 2000 test_limit: 500 }\n"
    "adahessian { lr: 0.01 }\n"
    "fault_tolerance { heartbeat_interval_ms: 200 failure_timeout_ms: 1000 }\n"
    "training { max_steps: 100000000 }\n";

// The same job, short enough to finish, with an evaluator and a spare.
const char kFinishingJob[] =
    "job_id: \"launch-finish\"\n"
    "model { layers { width: 32 } layers { width: 10 activation: IDENTITY } }\n"
    "topology { replicas: 2 stages: 1 spares: 1 evaluator: true }\n"
    "fault_tolerance { heartbeat_interval_ms: 200 failure_timeout_ms: 1000 }\n"
    "data { batch_size: 32 train_limit: 4000 test_limit: 1000 }\n"
    "adahessian { lr: 0.01 }\n"
    "training { max_steps: 400 eval_every_ms: 200 }\n";

// Every child the launcher printed as started is gone, and no process runs with its work dir.
void CheckNoChildLeft(const std::string& output, const std::string& workdir) {
  const std::vector<std::string> children = {"rebound_server", "trainer-r0s0", "trainer-r1s0",
                                             "spare-0"};
  for (const std::string& child : children) {
    const int pid = NumberAfter(output, absl::StrCat("started ", child, " (pid "));
    INFO(child);
    REQUIRE(pid > 0);
    CHECK_FALSE(ProcessExists(pid));
  }
  CHECK(ProcessesMentioning(workdir).empty());
}

// What every run prints once the cluster is up: the server, both trainers in slot order, and
// the spare.
void CheckClusterCameUp(const std::string& output) {
  CHECK(absl::StrContains(output, "server listening on 127.0.0.1:"));
  CHECK(absl::StrContains(output, "worker trainer-r0s0 registered: TRAINER of slot (0,0)"));
  CHECK(absl::StrContains(output, "worker trainer-r1s0 registered: TRAINER of slot (1,0)"));
  CHECK(absl::StrContains(output, "worker spare-0 registered: SPARE"));
  CHECK(absl::StrContains(output, "slot (0,0): UNASSIGNED -> ACTIVE"));
  CHECK(absl::StrContains(output, "slot (1,0): UNASSIGNED -> ACTIVE"));
  CHECK(absl::StrContains(output, "cluster up: 2 trainers, 1 spare, no evaluator"));
}

TEST_CASE("SIGTERM to the launcher stops the server and every worker and exits 143") {
  Launch launch("launch-sigterm", kJob);
  const std::string workdir = launch.dir() + "/work";
  launch.Start({"--workdir", workdir, "--timeout_s", "120"});
  std::string output = launch.WaitForOutput("cluster up");
  CheckClusterCameUp(output);

  // The server itself reports the three workers alive, in their roles and slots.
  const int port = NumberAfter(output, "server listening on 127.0.0.1:");
  REQUIRE(port > 0);
  std::string status;
  REQUIRE(RunCommand({Runfile("tools/reboundctl"), "--server", absl::StrCat("127.0.0.1:", port),
                      "status"},
                     &status, absl::Seconds(30)) == 0);
  CHECK(absl::StrContains(status, "job launch-it"));
  for (absl::string_view row : absl::StrSplit(status, '\n')) {
    if (absl::StrContains(row, "trainer-r0s0") || absl::StrContains(row, "trainer-r1s0") ||
        absl::StrContains(row, "spare-0")) {
      INFO(row);
      CHECK(absl::StrContains(row, "ALIVE"));
      CHECK(absl::StrContains(row, absl::StrContains(row, "spare") ? "SPARE" : "TRAINER"));
    }
  }
  CHECK(absl::StrContains(status, "trainer-r0s0"));
  CHECK(absl::StrContains(status, "trainer-r1s0"));
  CHECK(absl::StrContains(status, "spare-0"));

  // A progress line per second; both slots train (their steps grow), no recovery.
  launch.WaitForOutput("recoveries=0");
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while ((MaxStepOf(launch.Output(), "0,0") <= 0 || MaxStepOf(launch.Output(), "1,0") <= 0) &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  CHECK(MaxStepOf(launch.Output(), "0,0") > 0);
  CHECK(MaxStepOf(launch.Output(), "1,0") > 0);

  // The work dir holds the generated configs and one log per process.
  // The job sets no start barrier: the server reads its copy with one over both slots.
  const std::string copy = workdir + "/job.launch.pbtxt";
  CHECK(absl::StrContains(launch.Output(),
                          absl::StrCat("the servers read ", copy,
                                       ": the job with topology.min_trainers = 2 (every slot)")));
  CHECK(absl::StrContains(ReadFileOrEmpty(workdir + "/server.pbtxt"), copy));
  CHECK(absl::StrContains(ReadFileOrEmpty(copy), launch.job_file()));
  CHECK(absl::StrContains(ReadFileOrEmpty(copy), "min_trainers: 2"));
  CHECK(absl::StrContains(ReadFileOrEmpty(workdir + "/server.log"), "serving job 'launch-it'"));
  CHECK(absl::StrContains(ReadFileOrEmpty(workdir + "/trainer-r1s0.log"),
                          "registered as TRAINER"));
  CHECK(absl::StrContains(ReadFileOrEmpty(workdir + "/spare-0.log"), "registered as SPARE"));

  launch.process().Signal(SIGTERM);
  REQUIRE(launch.WaitForExit() == 143);
  output = launch.Output();
  CHECK(absl::StrContains(output, "received SIGTERM: stopping everything"));
  // Workers stop first (they deregister), then the server; all cleanly.
  for (const char* child : {"trainer-r0s0", "trainer-r1s0", "spare-0"}) {
    CHECK(absl::StrContains(output, absl::StrCat("stopped ", child, " (pid ")));
  }
  CHECK(absl::StrContains(output, "stopped rebound_server (pid "));
  CHECK(LineAfter(output, "stopped rebound_server (pid ").find("exit code 0") != std::string::npos);
  CHECK(LineAfter(output, "stopped spare-0 (pid ").find("exit code 0") != std::string::npos);
  CHECK(output.find("stopped spare-0") < output.find("stopped rebound_server"));
  CHECK(absl::StrContains(output, absl::StrCat("work dir (kept, one log per process): ", workdir)));
  CheckNoChildLeft(output, workdir);
}

TEST_CASE("--timeout_s ends an unfinished job with exit 1 and no child left") {
  Launch launch("launch-timeout", kJob);
  const std::string workdir = launch.dir() + "/work";
  const std::string csv = launch.dir() + "/progress.csv";
  const absl::Time started = absl::Now();
  launch.Start({"--workdir", workdir, "--timeout_s", "6", "--progress_csv", csv});
  // The job has far more steps than 6 s allow, so no slot finishes.
  REQUIRE(launch.WaitForExit() == 1);
  CHECK(absl::Now() - started >= absl::Seconds(6));
  const std::string output = launch.Output();
  CheckClusterCameUp(output);
  CHECK(absl::StrContains(output, "timeout: --timeout_s 6 passed"));
  CHECK_FALSE(absl::StrContains(output, "every slot FINISHED"));
  CheckNoChildLeft(output, workdir);

  const std::string rows = ReadFileOrEmpty(csv);
  CHECK(absl::StartsWith(rows, "elapsed_s,slot,step,loss,weight,test_accuracy,event\n"));
  CHECK(absl::StrContains(rows, ",r0s0,"));
  CHECK(absl::StrContains(rows, ",r1s0,"));
  CHECK(absl::StrContains(rows, "\"worker spare-0 registered: SPARE, incarnation "));
}

TEST_CASE("--kill_trainer_at_step kills the trainer of --kill_slot once; the server loses it") {
  Launch launch("launch-kill", kJob);
  // No --workdir: the launcher makes one under /tmp and prints it.
  launch.Start({"--kill_trainer_at_step", "0", "--kill_slot", "1,0", "--timeout_s", "120"});
  // The spare rebuilds the slot by replay (the default policy), often between two polls of the
  // launcher, so the slot may never be seen LOST: the recovery line is what shows it.
  std::string output = launch.WaitForOutput("recovery 1 of slot (1,0): RECOVERED, policy REPLAY");
  const std::string workdir = LineAfter(output, "] work dir ");
  REQUIRE(absl::StartsWith(workdir, "/tmp/rebound-launch-"));

  const int pid = NumberAfter(output, "started trainer-r1s0 (pid ");
  REQUIRE(pid > 0);
  // The step printed is the slot's when the kill was sent: at 0 or later (the launcher first
  // waits for logged steps to replay).
  CHECK(NumberAfter(output, absl::StrCat("killed trainer-r1s0 (pid ", pid, ") at step ")) >= 0);
  CHECK(absl::StrContains(output, absl::StrCat("trainer-r1s0 (pid ", pid,
                                               ") exited: killed by SIGKILL")));
  // Killed: declared on its session's end (crash detection), not after failure_timeout.
  CHECK(absl::StrContains(output, "ALIVE -> FAILED: its session ended"));
  // Only that slot: the other trainer is untouched.
  CHECK_FALSE(absl::StrContains(output, "killed trainer-r0s0"));
  CHECK_FALSE(absl::StrContains(output, "slot (0,0): ACTIVE -> LOST"));
  CHECK(absl::StrContains(output, "worker spare-0 registered: TRAINER of slot (1,0)"));

  launch.process().Signal(SIGTERM);
  REQUIRE(launch.WaitForExit() == 143);
  output = launch.Output();
  // Killed once: one kill line in the whole run.
  CHECK(output.find("killed trainer-") == output.rfind("killed trainer-"));
  CheckNoChildLeft(output, workdir);
  std::filesystem::remove_all(workdir);
}

TEST_CASE("when the server dies the launcher stops the workers and exits 1 with its log") {
  Launch launch("launch-server-dies", kJob);
  const std::string workdir = launch.dir() + "/work";
  launch.Start({"--workdir", workdir, "--timeout_s", "120"});
  std::string output = launch.WaitForOutput("cluster up");
  const int server = NumberAfter(output, "started rebound_server (pid ");
  REQUIRE(server > 0);
  REQUIRE(kill(server, SIGKILL) == 0);
  REQUIRE(launch.WaitForExit() == 1);
  output = launch.Output();
  CHECK(absl::StrContains(output, absl::StrCat("rebound_server (pid ", server,
                                               ") exited unexpectedly: killed by SIGKILL")));
  CHECK(absl::StrContains(output, "serving job 'launch-it'"));  // the tail of server.log
  CheckNoChildLeft(output, workdir);
}

TEST_CASE("a job that trains to max_steps ends with exit 0, its trainers started together, the "
          "final center's accuracy and, with --export, the trained model in a safetensors file") {
  Launch launch("launch-finish", kJob);
  WriteFileOrDie(launch.job_file(), kFinishingJob);
  const std::string workdir = launch.dir() + "/work";
  const std::string model = launch.dir() + "/model.safetensors";
  launch.Start({"--workdir", workdir, "--timeout_s", "240", "--export", model});
  REQUIRE(launch.WaitForExit() == 0);
  const std::string output = launch.Output();
  INFO(output);
  // The start barrier (min_trainers = both slots, set by the launcher): the first trainer
  // waited for the second, and the server released them once both were there.
  CHECK(absl::StrContains(ReadFileOrEmpty(workdir + "/trainer-r0s0.log"),
                          "waiting for the job's other trainers"));
  CHECK(absl::StrContains(ReadFileOrEmpty(workdir + "/server.log"),
                          "start barrier: 2 of 2 slots have a trainer"));
  CHECK(absl::StrContains(output, "slot (0,0): ACTIVE -> FINISHED"));
  CHECK(absl::StrContains(output, "slot (1,0): ACTIVE -> FINISHED"));
  CHECK(absl::StrContains(output, "every slot FINISHED"));
  CHECK(MaxStepOf(output, "0,0") == 400);
  CHECK(MaxStepOf(output, "1,0") == 400);
  // 10 classes: chance is 0.1; the EASGD center of two trainers learns far better. The figure
  // is the final center's: the version the evaluator evaluated is the exported model's.
  double accuracy = 0;
  REQUIRE(absl::SimpleAtod(LineAfter(output, "final test accuracy ").substr(0, 6), &accuracy));
  CHECK(accuracy > 0.6);
  const int evaluated = NumberAfter(output, "of the final center (version ");
  CHECK(evaluated > 0);
  CHECK(evaluated == NumberAfter(output, "the trained model (center version "));
  CHECK(ProcessesMentioning(workdir).empty());
  // The model: every tensor of the job's MLP, at the final center version (2 trainers x 400
  // steps / tau syncs), as the launcher's last lines say.
  CHECK(absl::StrContains(output, "the trained model (center version "));
  absl::StatusOr<std::string> bytes = ReadFile(model, int64_t{64} << 20);
  REQUIRE(bytes.ok());
  absl::StatusOr<DecodedSafetensors> decoded = DecodeSafetensors(*bytes);
  INFO(decoded.status());
  REQUIRE(decoded.ok());
  std::vector<std::string> names;
  for (const Tensor& tensor : decoded->tensors) names.push_back(tensor.name());
  CHECK(names == std::vector<std::string>{"layer0.weight", "layer0.bias", "layer1.weight",
                                          "layer1.bias"});
  CHECK(absl::StrContains(output, absl::StrCat("the trained model (center version ",
                                               decoded->metadata.at("rebound.center_versions"),
                                               ",")));
}

TEST_CASE("a bad job exits 2 with the validation message before starting anything") {
  Launch launch("launch-bad-job", kJob);
  WriteFileOrDie(launch.job_file(), "job_id: \"bad\"\neasgd { moving_rate: 1.5 }\n");
  const std::string workdir = launch.dir() + "/work";
  launch.Start({"--workdir", workdir});
  REQUIRE(launch.WaitForExit() == 2);
  CHECK(absl::StrContains(launch.Output(), "job.pbtxt:2: easgd.moving_rate must be in (0, 1], got 1.5"));
  CHECK_FALSE(std::filesystem::exists(workdir));

  Launch flags("launch-bad-flags", kJob);
  flags.Start({"--kill_trainer_at_step", "1", "--kill_slot", "2,0"});
  REQUIRE(flags.WaitForExit() == 2);
  CHECK(absl::StrContains(flags.Output(), "--kill_slot 2,0 is outside the job's 2 x 1 slots"));
}

}  // namespace
}  // namespace rebound::testing
