#pragma once

// The server's Prometheus metrics (docs/operations.md#metrics):
//  * every RPC, counted and timed by a gRPC server interceptor: rebound_rpcs_total{method,code}
//    and rebound_rpc_duration_seconds{method} (from the call's start to its status);
//  * at each scrape, from the server's own status (the GetStatus reply) and the store's
//    statistics: slots (step, snapshot and logged steps, syncs applied, state), weights and their
//    inputs, workers by role and state, center versions, recoveries (by policy and outcome,
//    steps replayed, phase durations), the step log, global checkpoints, test accuracy and loss,
//    and RocksDB sizes.
//
// Thread-safety: the interceptors run on gRPC's threads and the scrape families on the metrics
// server's; both are thread-safe as long as `status` is. Ownership: `registry` and `store` are
// borrowed and must outlive the server. Status codes: none.

#include <functional>
#include <memory>

#include "common/clock.h"
#include "common/metrics.h"
#include "grpcpp/support/server_interceptor.h"
#include "proto/rebound.pb.h"
#include "storage/durable_store.h"

namespace rebound::server {

// Counts and times every RPC into `registry`, timed by `clock` (both not owned; they outlive the
// server).
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewRpcMetricsFactory(
    MetricsRegistry* registry, const Clock* clock);

// Adds the scrape-time families. `status` returns the server's current status; `store` (may be
// null) gives the storage sizes.
void AddStatusMetrics(MetricsRegistry* registry, std::function<GetStatusResponse()> status,
                      const storage::DurableStore* store);

}  // namespace rebound::server
