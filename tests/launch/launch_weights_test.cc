// Reliability weights as a user sees them in the launcher's --progress_csv (issue R11, docs/design.md
// §4.5): a short launch of four trainers on the real rebound_launch, server and workers, one
// trainer SIGKILLed and its slot rebuilt by a verified replay. The rebuilt slot is not charged
// for its old owner's failure, so it trains at a weight of at least 0.9 within 5 s of its
// takeover (the old rule charged the slot: 0.05 for a minute). The healthy slots' mean weight
// is checked against a loose bound only: on 2 cores shared by 4 trainers, a spare, the server and
// the launcher, the scheduler's unfairness over a few hundred milliseconds is real staleness and
// lateness, which the rule is meant to see (measured 0.87-0.93 here; the shipped demo's figure is
// in docs/weighting.md). Rows of the first 2 s, while the trainers start one after another, are
// left out of that mean.
//
// Tagged exclusive in BUILD: the weights follow wall-clock pace, and other tests' load is not
// what this test measures.

#include <catch2/catch.hpp>
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "testing/cluster/processes.h"
#include "tests/launch/launch_testing.h"

namespace rebound::testing {
namespace {

// R = 4 trainers and a spare, like the shipped job, on a slice of the data set with a smaller
// model; DYNAMIC weights (the default); fast failure detection; more steps than the test waits.
const char kJob[] =
    "job_id: \"launch-weights\"\n"
    "model { layers { width: 64 } layers { width: 10 activation: IDENTITY } }\n"
    "topology { replicas: 4 stages: 1 spares: 1 }\n"
    "data { batch_size: 64 micro_batches: 4 train_limit: 8000 test_limit: 500 }\n"
    "adahessian { lr: 0.01 }\n"
    "easgd { sync_period: 8 }\n"
    "fault_tolerance { policy: REPLAY heartbeat_interval_ms: 200 failure_timeout_ms: 1000 }\n"
    "training { max_steps: 100000000 }\n";

constexpr double kTakeoverWindowS = 5.0;
// Start-up: trainers start one after another and their first syncs meet a moving center.
constexpr double kStartupS = 2.0;
// The healthy slots' mean weight after start-up must exceed this.
constexpr double kHealthyMeanFloor = 0.85;

struct Row {
  double elapsed_s = 0;
  std::string slot;  // "r1s0"
  bool has_weight = false;
  double weight = 0;
  std::string event;  // empty for a progress row
};

// The rows of a --progress_csv file, header skipped.
std::vector<Row> ReadRows(const std::string& csv) {
  std::vector<Row> rows;
  bool header = true;
  for (absl::string_view line : absl::StrSplit(csv, '\n', absl::SkipEmpty())) {
    if (header) {
      header = false;
      continue;
    }
    // elapsed_s,slot,step,loss,weight,test_accuracy,event (the event may hold commas).
    std::vector<std::string> fields = absl::StrSplit(line, absl::MaxSplits(',', 6));
    REQUIRE(fields.size() == 7);
    Row row;
    REQUIRE(absl::SimpleAtod(fields[0], &row.elapsed_s));
    row.slot = fields[1];
    row.has_weight = absl::SimpleAtod(fields[4], &row.weight);
    row.event = fields[6];
    rows.push_back(row);
  }
  return rows;
}

// The time of the last row of `csv`, or -1.
double LastElapsed(const std::string& csv) {
  const std::vector<Row> rows = ReadRows(csv);
  return rows.empty() ? -1 : rows.back().elapsed_s;
}

TEST_CASE("a slot rebuilt by a verified replay trains at full weight; healthy slots stay high") {
  Launch launch("launch-weights", kJob);
  const std::string workdir = launch.dir() + "/work";
  const std::string csv = launch.dir() + "/progress.csv";
  launch.Start({"--workdir", workdir, "--kill_trainer_at_step", "200", "--kill_slot", "1,0",
                "--progress_csv", csv, "--timeout_s", "150"});
  launch.WaitForOutput("recovery 1 of slot (1,0): RECOVERED, policy REPLAY");

  // The takeover's row, then progress rows for kTakeoverWindowS + 1 s after it (bounded).
  double takeover_s = -1;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    const std::string text = ReadFileOrEmpty(csv);
    for (const Row& row : ReadRows(text)) {
      if (takeover_s < 0 && row.slot == "r1s0" && absl::StrContains(row.event, "RECOVERED")) {
        takeover_s = row.elapsed_s;
      }
    }
    if (takeover_s >= 0 && LastElapsed(text) >= takeover_s + kTakeoverWindowS + 1) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  launch.process().Signal(SIGTERM);
  REQUIRE(launch.WaitForExit() == 143);
  const std::string text = ReadFileOrEmpty(csv);
  INFO(text);
  REQUIRE(takeover_s >= 0);
  REQUIRE(LastElapsed(text) >= takeover_s + kTakeoverWindowS);
  // The replay was verified bit-identical and the spare took the slot over.
  const std::string output = launch.Output();
  CHECK(absl::StrContains(output, "worker spare-0 registered: TRAINER of slot (1,0)"));
  CHECK_FALSE(absl::StrContains(output, "RESTART_FROM_CENTER"));

  double best_after_takeover = 0;
  std::map<std::string, std::vector<double>> healthy;
  for (const Row& row : ReadRows(text)) {
    if (!row.event.empty() || !row.has_weight) continue;
    if (row.slot == "r1s0") {
      if (row.elapsed_s > takeover_s && row.elapsed_s <= takeover_s + kTakeoverWindowS) {
        best_after_takeover = std::max(best_after_takeover, row.weight);
      }
    } else if (row.elapsed_s >= kStartupS) {
      healthy[row.slot].push_back(row.weight);
    }
  }
  CHECK(best_after_takeover >= 0.9);
  REQUIRE(healthy.size() == 3);
  double sum = 0;
  int count = 0;
  for (const auto& [slot, weights] : healthy) {
    for (double w : weights) {
      sum += w;
      ++count;
    }
  }
  REQUIRE(count > 0);
  CHECK(sum / count >= kHealthyMeanFloor);
  std::filesystem::remove_all(launch.dir());
}

}  // namespace
}  // namespace rebound::testing
