#include "worker/worker_metrics.h"

namespace rebound::worker {

MetricsRegistry& WorkerRegistry() {
  static MetricsRegistry* registry = new MetricsRegistry();
  return *registry;
}

const WorkerMetrics& Metrics() {
  static const WorkerMetrics* metrics = [] {
    MetricsRegistry& r = WorkerRegistry();
    auto* m = new WorkerMetrics();
    m->steps = r.GetCounter("rebound_worker_steps_total", "Training steps done.");
    m->step_seconds = r.GetHistogram("rebound_worker_step_duration_seconds",
                                     "Compute time of one training step.", LatencyBuckets());
    m->step = r.GetGauge("rebound_worker_step", "The trained slot's current step.");
    m->loss = r.GetGauge("rebound_worker_loss", "Training loss of the last step.");
    m->syncs = r.GetCounter("rebound_worker_syncs_total",
                            "Syncs (mode EASGD) or pushes (ASYNC_ADAHESSIAN) acknowledged.");
    m->sync_seconds = r.GetHistogram("rebound_worker_sync_duration_seconds",
                                     "Round trip of a sync or push, retries included.",
                                     LatencyBuckets());
    m->weight = r.GetGauge("rebound_worker_weight",
                           "Reliability weight the server gave the last sync.");
    m->replayed_steps = r.GetCounter("rebound_worker_replayed_steps_total",
                                     "Steps replayed as a spare (every replay task's part).");
    m->replay_step_seconds =
        r.GetHistogram("rebound_worker_replay_step_duration_seconds",
                       "One replayed step, exchanges with the other spares included.",
                       LatencyBuckets());
    m->recoveries = r.GetCounter("rebound_worker_replay_tasks_total",
                                 "Replay or restore tasks this worker took part in.");
    // The label values are the server's rebound_audits_total{result} values (docs/metrics.md).
    const char* const audits_help = "Audit tasks this worker replayed as a spare, by result.";
    m->audits_matched =
        r.GetCounter("rebound_worker_audits_total", audits_help, {{"result", "matched"}});
    m->audits_mismatched =
        r.GetCounter("rebound_worker_audits_total", audits_help, {{"result", "mismatched"}});
    m->audits_incomplete =
        r.GetCounter("rebound_worker_audits_total", audits_help, {{"result", "incomplete"}});
    m->audits_preempted =
        r.GetCounter("rebound_worker_audits_total", audits_help, {{"result", "preempted"}});
    m->test_accuracy = r.GetGauge("rebound_worker_test_accuracy",
                                  "The evaluator's last test accuracy of the center.");
    m->test_loss = r.GetGauge("rebound_worker_test_loss",
                              "The evaluator's last test loss of the center.");
    m->log_records = r.GetCounter("rebound_worker_steplog_records_total",
                                  "Step-log records handed to the step logger.");
    m->log_buffered_bytes = r.GetGauge("rebound_worker_steplog_buffered_bytes",
                                       "Step-log bytes held until the server acknowledges them.");
    m->boundary_pairs_sent =
        r.GetCounter("rebound_worker_boundary_pairs_sent_total",
                     "Pipeline boundary pairs a neighbour acknowledged (resends included).");
    m->boundary_wait_seconds =
        r.GetHistogram("rebound_worker_boundary_wait_seconds",
                       "Wait of a pipeline stage for one pair from a neighbour.", LatencyBuckets());
    m->blocked = r.GetGauge("rebound_worker_blocked",
                            "1 while the pipeline stage waits past neighbour_timeout_ms (BLOCKED).");
    return m;
  }();
  return *metrics;
}

}  // namespace rebound::worker
