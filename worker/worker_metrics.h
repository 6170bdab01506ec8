#pragma once

// The worker's Prometheus metrics (docs/operations.md#metrics), in one process-wide registry
// that rebound_worker serves at /metrics. The training, evaluation, replay and step-log code
// updates these series; each is looked up once.
//
// Thread-safety: Metrics() and every series are safe from any thread. Ownership: the registry
// and the series live for the process. No function returns a status.

#include "common/metrics.h"

namespace rebound::worker {

struct WorkerMetrics {
  Counter* steps;               // training steps done (rate() = steps/s)
  Histogram* step_seconds;      // one training step's compute
  Gauge* step;                  // the slot's current step
  Gauge* loss;                  // the last step's training loss
  Counter* syncs;               // syncs (or pushes) acknowledged
  Histogram* sync_seconds;      // a sync's round trip, retries included
  Gauge* weight;                // the reliability weight of the last sync's reply
  Counter* replayed_steps;      // steps this worker replayed as a spare
  Histogram* replay_step_seconds;  // one replayed step, exchanges included
  Counter* recoveries;          // replay tasks taken part in, by outcome
  // Audits replayed (docs/recovery.md#audits): rebound_worker_audits_total{result}, one series
  // per AuditResult (result="matched", "mismatched", "incomplete", "preempted").
  Counter* audits_matched;
  Counter* audits_mismatched;
  Counter* audits_incomplete;
  Counter* audits_preempted;
  Gauge* test_accuracy;         // the evaluator's last test accuracy
  Gauge* test_loss;             // the evaluator's last test loss
  Counter* log_records;         // step-log records handed to the logger
  Gauge* log_buffered_bytes;    // step-log bytes not yet acknowledged by the server
  Counter* boundary_pairs_sent;  // pipeline pairs acknowledged by a neighbour (resends too)
  Histogram* boundary_wait_seconds;  // a pipeline stage's wait for one pair from a neighbour
  Gauge* blocked;                // 1 while the stage is BLOCKED on a neighbour, else 0
};

MetricsRegistry& WorkerRegistry();
const WorkerMetrics& Metrics();

}  // namespace rebound::worker
