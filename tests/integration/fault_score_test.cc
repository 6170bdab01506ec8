// Fault scores follow workers, not slots (docs/design.md §4.5, issue R11), on a real cluster: a
// trainer is SIGKILLed under policy REPLAY with DYNAMIC weights; the spare that rebuilds its slot
// trains it at full weight (a verified replay charges nobody; the slot weighs its new owner's
// score), while the killed worker's name carries the failure's score when it registers again.
// No timing is asserted: every wait is bounded and fails with the logs.

#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "proto/rebound.pb.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/status_util.h"
#include "testing/cluster/processes.h"

namespace rebound::testing {
namespace {

// 784 -> 64 -> 10, 2 trainers, a sync every 100 steps: a job of 15 syncs per slot, long enough
// for several syncs of the rebuilt slot after its takeover.
const char kJob[] =
    "  job_id: \"fault-score\"\n"
    "  model { layers { width: 64 } layers { width: 10 activation: IDENTITY } }\n"
    "  topology { replicas: 2 }\n"
    "  weighting { policy: DYNAMIC }\n"
    "  fault_tolerance { policy: REPLAY heartbeat_interval_ms: 200 failure_timeout_ms: 3000 }\n"
    "  data { batch_size: 64 micro_batches: 4 train_limit: 2000 test_limit: 100 }\n"
    "  adahessian { lr: 0.01 }\n"
    "  easgd { sync_period: 100 }\n"
    "  step_log { linger_ms: 20 }\n"
    "  training { max_steps: 1500 }\n";

TEST_CASE("a slot rebuilt by replay trains at full weight; the killed worker's name keeps its "
          "fault score when it registers again") {
  LocalCluster cluster(kJob, LocalClusterOptions{"fault-score"});
  cluster.StartWorker("a", TRAINER);
  cluster.StartWorker("b", TRAINER);
  cluster.StartWorker("spare", SPARE);
  const GetStatusResponse synced = cluster.WaitFor(
      "b synced once", [](const GetStatusResponse& s) { return s.slots(1).snapshot_step() > 0; });
  const int64_t snapshot = synced.slots(1).snapshot_step();
  cluster.WaitFor("b trained past its snapshot", [&](const GetStatusResponse& s) {
    return s.slots(1).step() >= snapshot + 30 || s.slots(1).snapshot_step() > snapshot;
  });
  cluster.Kill("b");

  const GetStatusResponse rebuilt = cluster.WaitFor(
      "b's slot rebuilt by the spare", [](const GetStatusResponse& s) {
        return s.recoveries_size() == 1 && s.recoveries(0).outcome() == RECOVERED &&
               s.slots(1).state() == ACTIVE;
      });
  INFO(rebuilt.DebugString());
  const WorkerStatus* killed = FindWorker(rebuilt, "b", TRAINER);
  REQUIRE(killed != nullptr);
  CHECK(killed->state() == FAILED);
  // The failure is b's (+0.5, decaying with the default 60 s half-life).
  CHECK(killed->fault_score() > 0.0);
  CHECK(killed->fault_score() <= 0.5);
  const WorkerStatus* owner = FindIncarnation(rebuilt, rebuilt.slots(1).owner_incarnation());
  REQUIRE(owner != nullptr);
  CHECK(owner->name() == "spare");
  // The rebuilt slot weighs its new owner's score: the spare never failed.
  CHECK(owner->fault_score() == 0.0);
  CHECK(rebuilt.slots(1).weight().fault_score() == 0.0);

  // It trains at weight >= 0.9 at a sync after the takeover (under the slot-based rule of
  // before, the recovery's +0.5 kept it at 0.5 or below for a minute).
  const int64_t updates_at_takeover = rebuilt.slots(1).update_count();
  const GetStatusResponse trained = cluster.WaitFor(
      "the rebuilt slot syncs at weight >= 0.9", [&](const GetStatusResponse& s) {
        return s.slots(1).update_count() > updates_at_takeover &&
               s.slots(1).weight().weight() >= 0.9;
      });
  CHECK(trained.slots(1).weight().fault_score() == 0.0);

  // b registers again under the same name (here the test registers as "b"): the new incarnation
  // carries the name's score.
  const RegisterResponse again = cluster.Register("b", SPARE);
  const GetStatusResponse back = cluster.Status();
  const WorkerStatus* returned = FindIncarnation(back, again.incarnation());
  REQUIRE(returned != nullptr);
  CHECK(returned->name() == "b");
  CHECK(returned->fault_score() > 0.0);
  CHECK(returned->fault_score() <= killed->fault_score());

  // reboundctl workers shows it in column FAULT (INCARNATION NAME ROLE STATE SLOT STEP FAULT ...).
  std::string output;
  REQUIRE(RunCommand({Runfile("tools/reboundctl"), "--server", cluster.address(), "workers"},
                     &output, absl::Seconds(30)) == 0);
  INFO(output);
  const std::vector<std::string> lines = absl::StrSplit(output, '\n');
  REQUIRE(!lines.empty());
  const std::vector<std::string> header = absl::StrSplit(lines[0], ' ', absl::SkipEmpty());
  REQUIRE(header.size() > 6);
  CHECK(header[6] == "FAULT");
  bool listed = false;
  for (const std::string& line : lines) {
    const std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (fields.size() < 7 || fields[0] != absl::StrCat(again.incarnation())) continue;
    listed = true;
    CHECK(fields[1] == "b");
    double fault = 0.0;
    CHECK(absl::SimpleAtod(fields[6], &fault));
    CHECK(fault > 0.0);
  }
  CHECK(listed);
}

}  // namespace
}  // namespace rebound::testing
