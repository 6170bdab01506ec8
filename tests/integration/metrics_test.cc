// Prometheus metrics (docs/operations.md#metrics) of the real rebound_server and rebound_worker
// binaries: both serve /metrics on 127.0.0.1 by default and announce where (GetStatus); a scrape
// parses as the text format and its values agree with the server's status taken just before.

#include <catch2/catch.hpp>

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "proto/rebound.grpc.pb.h"
#include "tests/common/prometheus_text.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/scrape.h"
#include "tests/integration/status_util.h"

namespace rebound::testing {
namespace {

// GET http://address/metrics, parsed; the server and workers serve it locally by default.
Exposition Scrape(const std::string& address) {
  CHECK(address.rfind("127.0.0.1:", 0) == 0);  // local unless configured
  return ScrapeMetrics(address);
}

double Sample(const Exposition& e, const std::string& series) {
  INFO(series);
  REQUIRE(e.samples.count(series) == 1);
  return e.samples.at(series);
}

TEST_CASE("the server and the workers serve /metrics that agree with the server's status") {
  LocalCluster cluster(
      "  job_id: \"mt\"\n"
      "  model { layers { width: 16 } layers { width: 10 activation: IDENTITY } }\n"
      "  topology { replicas: 2 evaluator: true }\n"
      "  data { batch_size: 32 micro_batches: 2 train_limit: 1000 test_limit: 200 }\n"
      "  easgd { sync_period: 10 }\n"
      "  step_log { linger_ms: 10 }\n"
      "  training { max_steps: 100000 eval_every_ms: 200 }\n",
      LocalClusterOptions{"metrics"});
  cluster.StartWorker("a", TRAINER);
  cluster.StartWorker("b", TRAINER);
  cluster.StartWorker("e", EVALUATOR);
  const GetStatusResponse status = cluster.WaitFor("20 syncs and an evaluation", [](const auto& s) {
    return s.slots(0).update_count() >= 10 && s.slots(1).update_count() >= 10 &&
           s.has_last_eval();
  });
  INFO(status.DebugString());

  // The server.
  REQUIRE(status.has_metrics_address());
  const Exposition server = Scrape(status.metrics_address());
  CHECK(server.types.at("rebound_rpcs_total") == "counter");
  CHECK(server.types.at("rebound_rpc_duration_seconds") == "histogram");
  CHECK(Sample(server, "rebound_up{job=\"mt\",version=\"" + status.server_version() + "\"}") == 1);
  for (int r = 0; r < 2; ++r) {
    const std::string slot = absl::StrCat("{slot=\"", r, ",0\"}");
    // Scraped after the status: never behind it.
    CHECK(Sample(server, "rebound_slot_updates" + slot) >= status.slots(r).update_count());
    CHECK(Sample(server, "rebound_slot_snapshot_step" + slot) >= status.slots(r).snapshot_step());
    CHECK(Sample(server, "rebound_slot_logged_step" + slot) >= status.slots(r).logged_step());
    CHECK(Sample(server, "rebound_slot_weight" + slot) > 0);
    CHECK(Sample(server, "rebound_slot_state{slot=\"" + absl::StrCat(r) + ",0\",state=\"ACTIVE\"}") ==
          1);
  }
  const double syncs = Sample(server, "rebound_rpcs_total{method=\"Sync\",code=\"OK\"}");
  CHECK(syncs >= status.slots(0).update_count() + status.slots(1).update_count());
  CHECK(Sample(server, "rebound_rpc_duration_seconds_count{method=\"Sync\"}") >= syncs);
  CHECK(Sample(server, "rebound_rpcs_total{method=\"Heartbeat\",code=\"OK\"}") >= 1);
  CHECK(Sample(server, "rebound_center_version{stage=\"0\"}") >= status.centers(0).version());
  CHECK(Sample(server, "rebound_workers{role=\"TRAINER\",state=\"ALIVE\"}") == 2);
  CHECK(Sample(server, "rebound_workers{role=\"EVALUATOR\",state=\"ALIVE\"}") == 1);
  // Fault scores by worker name (docs/design.md §4.5): a sample per alive worker; nobody has failed.
  CHECK(server.types.at("rebound_worker_fault_score") == "gauge");
  for (const char* name : {"a", "b", "e"}) {
    CHECK(Sample(server, absl::StrCat("rebound_worker_fault_score{worker=\"", name, "\"}")) ==
          0.0);
  }
  CHECK(Sample(server, "rebound_steplog_records_written_total") >=
        status.step_log().records_written());
  CHECK(Sample(server, "rebound_test_accuracy") > 0);
  CHECK(server.samples.count("rebound_store_bytes{part=\"steplog\"}") == 1);
  // Goodput (docs/metrics.md#goodput): nothing failed, so no slot lost any time. (This job is
  // done in about a second: a slot's accounts start at its first step a heartbeat reports, and
  // may see little of it; its goodput is what the failure_detector_test cases check.)
  CHECK(server.types.at("rebound_goodput_seconds_total") == "counter");
  CHECK(server.types.at("rebound_badput_seconds_total") == "counter");
  for (int r = 0; r < 2; ++r) {
    const std::string slot = absl::StrCat("slot=\"", r, ",0\"");
    CHECK(Sample(server, "rebound_goodput_seconds_total{" + slot + "}") >= 0);
    for (const char* cause : {"detect", "replay", "restore", "rollback", "idle"}) {
      INFO(cause);
      CHECK(Sample(server, absl::StrCat("rebound_badput_seconds_total{", slot, ",cause=\"",
                                        cause, "\"}")) == 0);
    }
  }
  if (server.samples.count("rebound_job_ettr") > 0) {
    CHECK(Sample(server, "rebound_job_ettr") == 1);
  }
  // The process's memory: the server holds the model's center and snapshots, so megabytes in use.
  CHECK(server.types.at("rebound_process_resident_bytes") == "gauge");
  const double resident = Sample(server, "rebound_process_resident_bytes");
  const double in_use = Sample(server, "rebound_process_heap_bytes{state=\"in_use\"}");
  CHECK(resident > 4e6);
  CHECK(resident < 64e9);
  CHECK(in_use > 1e5);
  CHECK(in_use < 64e9);
  CHECK(Sample(server, "rebound_process_heap_bytes{state=\"free\"}") >= 0);

  // A trainer: its steps and syncs, at least what the server saw of it.
  const WorkerStatus* a = FindWorker(status, "a", TRAINER);
  REQUIRE(a != nullptr);
  REQUIRE(a->has_metrics_address());
  CHECK(a->metrics_address() != status.metrics_address());
  const Exposition trainer = Scrape(a->metrics_address());
  CHECK(Sample(trainer, "rebound_worker_steps_total") >= status.slots(0).snapshot_step());
  CHECK(Sample(trainer, "rebound_worker_syncs_total") >= status.slots(0).update_count());
  CHECK(Sample(trainer, "rebound_worker_step_duration_seconds_count") ==
        Sample(trainer, "rebound_worker_steps_total"));
  CHECK(Sample(trainer, "rebound_worker_steplog_records_total") >=
        3 * Sample(trainer, "rebound_worker_steps_total") - 3 * 10);  // M + 1 per step
  CHECK(Sample(trainer, "rebound_worker_loss") > 0);
  CHECK(Sample(trainer, "rebound_process_resident_bytes") > 4e6);
  CHECK(Sample(trainer, "rebound_process_heap_bytes{state=\"in_use\"}") > 1e5);

  // The evaluator reports what the server shows.
  const WorkerStatus* evaluator = nullptr;
  for (const WorkerStatus& w : status.workers()) {
    if (w.role() == EVALUATOR) evaluator = &w;
  }
  REQUIRE(evaluator != nullptr);
  const Exposition eval = Scrape(evaluator->metrics_address());
  CHECK(Sample(eval, "rebound_worker_test_accuracy") > 0);
  CHECK(Sample(eval, "rebound_worker_steps_total") == 0);
}

}  // namespace
}  // namespace rebound::testing
