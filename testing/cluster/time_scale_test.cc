// testing/cluster/time_scale.h: the factor, the scaled bounds and the configs rewritten with them.
// Built twice (BUILD): with REBOUND_TIME_SCALE_UNDER_TEST 3, and with 1, where every config must
// come back byte for byte.

#include "testing/cluster/time_scale.h"

#include <stdlib.h>

#include <catch2/catch.hpp>
#include <google/protobuf/text_format.h>

#include "absl/strings/str_cat.h"

namespace rebound::testing {
namespace {

constexpr int kScale = REBOUND_TIME_SCALE_UNDER_TEST;

// Set before any test runs (TimeScale() reads the variable once), whatever `--test_env` gave.
const bool kScaleSet = setenv(kTimeScaleVariable, absl::StrCat(kScale).c_str(), 1) == 0;

template <typename Config>
Config Parse(const std::string& text) {
  Config config;
  REQUIRE(google::protobuf::TextFormat::ParseFromString(text, &config));
  return config;
}

TEST_CASE("the factor comes from the environment and multiplies durations and milliseconds") {
  REQUIRE(kScaleSet);
  CHECK(TimeScale() == kScale);
  CHECK(Scaled(absl::Seconds(2)) == absl::Seconds(2 * kScale));
  CHECK(Scaled(absl::Milliseconds(250)) == absl::Milliseconds(250 * kScale));
  CHECK(ScaledMs(200) == 200 * kScale);
}

TEST_CASE("a job's timeouts are scaled, defaults included, and its paces are not") {
  const std::string text =
      "job_id: \"t\"\n"
      "fault_tolerance { heartbeat_interval_ms: 200 failure_timeout_ms: 3000 }\n"
      "easgd { sync_period: 300 }\n"
      "step_log { linger_ms: 20 }\n";
  JobConfig job = Parse<JobConfig>(text);
  ScaleTimingFields(&job);
  const FaultToleranceConfig& ft = job.fault_tolerance();
  CHECK(ft.heartbeat_interval_ms() == 200 * kScale);
  CHECK(ft.failure_timeout_ms() == 3000 * kScale);
  const FaultToleranceConfig defaults;
  CHECK(ft.neighbour_timeout_ms() == defaults.neighbour_timeout_ms() * kScale);
  CHECK(ft.reconnect_grace_ms() == defaults.reconnect_grace_ms() * kScale);
  CHECK(ft.recovery_timeout_ms() == defaults.recovery_timeout_ms() * kScale);
  CHECK(ft.policy() == defaults.policy());
  CHECK(job.easgd().sync_period() == 300);
  CHECK(job.step_log().linger_ms() == 20);
  if (kScale == 1) CHECK(job.SerializeAsString() == Parse<JobConfig>(text).SerializeAsString());
}

TEST_CASE("a worker's RPC deadline and give-up bound are scaled, its backoff is not") {
  WorkerConfig worker =
      Parse<WorkerConfig>("backoff_initial_ms: 20\nbackoff_max_ms: 200\nrpc_deadline_ms: 3000\n");
  ScaleTimingFields(&worker);
  CHECK(worker.rpc_deadline_ms() == 3000 * kScale);
  CHECK(worker.give_up_after_ms() == WorkerConfig().give_up_after_ms() * kScale);
  CHECK(worker.backoff_initial_ms() == 20);
  CHECK(worker.backoff_max_ms() == 200);
}

TEST_CASE("config texts are rewritten scaled, and left as written at scale 1") {
  const std::string server =
      "listen_address: \"127.0.0.1:0\"\n"
      "job {\n  fault_tolerance { failure_timeout_ms: 5000 }\n}\nmax_wait_ms: 2000\n";
  const std::string worker = "backoff_initial_ms: 20\nbackoff_max_ms: 300\n";
  const std::string scaled_server = ScaledServerConfig(server);
  const std::string scaled_worker = ScaledWorkerConfig(worker);
  if (kScale == 1) {
    CHECK(scaled_server == server);
    CHECK(scaled_worker == worker);
  }
  const ServerConfig s = Parse<ServerConfig>(scaled_server);
  CHECK(s.job().fault_tolerance().failure_timeout_ms() == 5000 * kScale);
  CHECK(s.max_wait_ms() == 2000);  // a bound the server sets itself on a wait: a pace here
  CHECK(s.listen_address() == "127.0.0.1:0");
  const WorkerConfig w = Parse<WorkerConfig>(scaled_worker);
  CHECK(w.rpc_deadline_ms() == WorkerConfig().rpc_deadline_ms() * kScale);
  CHECK(w.backoff_max_ms() == 300);
}

TEST_CASE("a config that does not parse, or names a job file, is left for the daemon to judge") {
  const std::string broken = "max_wait_msec: 100\n";
  CHECK(ScaledServerConfig(broken) == broken);
  CHECK(ScaledWorkerConfig(broken) == broken);
  const std::string job_file = "job_file: \"job.pbtxt\"\n";
  CHECK(ScaledServerConfig(job_file) == job_file);
}

}  // namespace
}  // namespace rebound::testing
