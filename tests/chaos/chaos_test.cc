// A short seeded chaos run (tests/chaos/chaos.h, docs/chaos.md) against the real rebound_server
// and rebound_worker: a fault-free run of a small job, then the same job under a seeded schedule
// of faults that always holds a trainer SIGKILL and a server SIGKILL with restart; the run must
// finish with every sync applied exactly once (status and the RocksDB store read back), every
// rebuilt slot a verified REPLAY, and, the job being DETERMINISTIC with UNIFORM weights, the
// fault-free run's center bit for bit (hence its accuracy).
//
// The seed is printed; REBOUND_CHAOS_SEED=<n> replays another schedule, e.g.
//   bazel test //tests/chaos:chaos_test --test_env=REBOUND_CHAOS_SEED=7 --test_output=all

#include "tests/chaos/chaos.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <set>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace rebound::chaos {
namespace {

constexpr uint64_t kDefaultSeed = 20241203;
constexpr int kFaults = 5;

std::string Runfile(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr) return path;
  return absl::StrCat(srcdir, "/", workspace != nullptr ? workspace : "rebound", "/", path);
}

ChaosOptions Options(uint64_t seed, int faults) {
  ChaosOptions options;
  options.seed = seed;
  options.faults = faults;
  options.must_include = {FaultKind::kKillTrainer, FaultKind::kKillServer};
  options.server_binary = Runfile("server/rebound_server");
  options.worker_binary = Runfile("worker/rebound_worker");
  const char* tmp = std::getenv("TEST_TMPDIR");
  options.work_dir = tmp != nullptr ? tmp : "/tmp";
  options.time_limit = absl::Minutes(2);  // each run; Bazel's moderate timeout is 5 minutes
  options.log = [](const std::string& line) { std::cout << "chaos: " << line << std::endl; };
  return options;
}

TEST_CASE("a seed plans the same bounded schedule every time, with the kinds it must hold") {
  const ChaosJob job;
  const std::vector<FaultKind> must = {FaultKind::kKillTrainer, FaultKind::kKillServer};
  const std::vector<PlannedFault> a = PlanFaults(42, 8, AllFaultKinds(), must, job);
  const std::vector<PlannedFault> b = PlanFaults(42, 8, AllFaultKinds(), must, job);
  REQUIRE(a.size() == 8);
  REQUIRE(b.size() == 8);
  std::set<FaultKind> kinds;
  for (size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].ToString());
    CHECK(a[i].ToString() == b[i].ToString());
    CHECK(a[i].pick == b[i].pick);
    CHECK(a[i].at_progress >= 0.08);
    CHECK(a[i].at_progress <= 0.8);
    if (i > 0) CHECK(a[i].at_progress >= a[i - 1].at_progress);
    CHECK(a[i].duration <= absl::Milliseconds(2.5 * job.failure_timeout_ms));
    kinds.insert(a[i].kind);
  }
  CHECK(kinds.count(FaultKind::kKillTrainer) == 1);
  CHECK(kinds.count(FaultKind::kKillServer) == 1);
  // Another seed, another schedule; no kind outside those allowed.
  const std::vector<PlannedFault> c = PlanFaults(43, 8, AllFaultKinds(), must, job);
  bool differs = false;
  for (size_t i = 0; i < c.size(); ++i) differs = differs || c[i].ToString() != a[i].ToString();
  CHECK(differs);
  const std::vector<FaultKind> process_only = {FaultKind::kKillSpare, FaultKind::kStopServer};
  for (const PlannedFault& f : PlanFaults(7, 6, process_only, must, job)) {
    CHECK((f.kind == FaultKind::kKillSpare || f.kind == FaultKind::kStopServer));
  }
  CHECK(PlanFaults(7, 0, AllFaultKinds(), must, job).empty());
}

TEST_CASE(
    "a seeded chaos run finishes with every sync applied once, every rebuilt slot a "
    "verified replay, and the fault-free run's center") {
  uint64_t seed = kDefaultSeed;
  if (const char* text = std::getenv("REBOUND_CHAOS_SEED"); text != nullptr) {
    REQUIRE(absl::SimpleAtoi(text, &seed));
  }
  std::cout << "chaos_test: seed " << seed << " (REBOUND_CHAOS_SEED overrides it)" << std::endl;
  const ChaosJob job;  // 3 trainers, DETERMINISTIC, UNIFORM

  const RunReport reference = RunChaos(job, Options(seed, 0));
  std::cout << "chaos_test: fault-free run: " << reference.Summary() << std::endl;
  INFO("fault-free run: " << reference.Summary());
  REQUIRE(reference.ok());
  REQUIRE(reference.finished);
  CHECK(reference.recoveries == 0);

  const RunReport run = RunChaos(job, Options(seed, kFaults), &reference);
  std::cout << "chaos_test: run with faults: " << run.Summary() << std::endl;
  INFO("seed " << seed << "\n" << run.Summary());
  CHECK(run.errors.empty());
  CHECK(run.violations.empty());
  REQUIRE(run.finished);
  CHECK(run.total_faults() + run.skipped_faults + run.unfired_faults == kFaults);
  CHECK(run.faults.count("kill_trainer") == 1);
  CHECK(run.faults.count("kill_server") == 1);
  CHECK(run.server_restarts >= 1);
  CHECK(run.recoveries >= 1);
  CHECK(run.accuracy > 0.5);  // it learned
  CHECK(run.accuracy == reference.accuracy);
  CHECK(run.center_identical);
}

}  // namespace
}  // namespace rebound::chaos
