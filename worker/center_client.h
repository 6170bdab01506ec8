#pragma once

// CenterClient: a worker's calls about the center (docs/design.md §4.4, §4.6, §10.2), one
// implementation per topology, chosen once at registration (as the Python client's
// python/rebound/torch/center.py): a job of one server group talks to that server
// (UnshardedCenter: Sync, Push and Pull on ParameterServer); a sharded job's K groups are
// RangeClient's (worker/range_client.h: every range at once, then the commit at group 0). The
// trainers, the evaluator and the replay never ask which.
//
// Every call runs under the worker's retry policy (worker/retry.h) with its deadline.
// RefusedUpdate turns the server's refusal of an update into the trainer's end.
//
// Thread-safety: implementations are thread-safe (gRPC stubs, no mutable state).
// Ownership: `server` (the stub of the job's server, or of group 0) is borrowed for the call.
// Status codes: the retried call's status (worker/retry.h: UNAVAILABLE on giving up, CANCELLED
// when stopped, FAILED_PRECONDITION when fenced, ABORTED when the server no longer knows the
// incarnation), INVALID_ARGUMENT for an answer that does not fit the layout. RefusedUpdate
// returns `status` unchanged unless it is INVALID_ARGUMENT, which it returns as
// INVALID_ARGUMENT "<what> of step <t> refused: ...".

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/types/span.h"
#include "common/clock.h"
#include "compute/model_layout.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"

namespace rebound::worker {

class CenterClient {
 public:
  // The slot's state at the sync of step t.
  struct SyncState {
    absl::Span<float> x;          // in: the parameters; out: after the sync
    absl::Span<const float> m;    // AdaHessian state (the snapshot's)
    absl::Span<const float> v;
    absl::Span<const float> d;
    double loss = 0.0;            // NaN: none
    int64_t data_epoch = 0;
    int64_t data_offset = 0;
    // A fault injection (--fault_poison_from_step): the parameters sent in place of x (empty:
    // x). The move after the sync is still x's.
    absl::Span<const float> sent;
  };
  // What a sync answered.
  struct Synced {
    double weight = 1.0;         // the weight the center applied it with
    int64_t center_version = 0;  // the center's (range 0's) version after it
  };
  // A test hook (--fault_die_in_sync_at_step): a sharded job's sync goes to ranges [0, ranges)
  // only and returns ABORTED without committing, as a trainer that died between its ranges. A
  // job of one group has no ranges to stop between: its sync is whole.
  static constexpr int kAllRanges = -1;

  virtual ~CenterClient() = default;

  // The number of server groups that hold the center (1: unsharded).
  virtual int groups() const = 0;

  // The sync of step t of `slot` (stage layout `layout`); `state.x` becomes the parameters
  // after it (x - alpha (x - c) from a fresh answer, the stored ones from a retry's).
  virtual absl::StatusOr<Synced> Sync(const absl::Notification& stop,
                                      ParameterServer::Stub* server, uint64_t incarnation,
                                      const SlotId& slot, int64_t t,
                                      const compute::StageLayout& layout, const SyncState& state,
                                      int ranges = kAllRanges) const = 0;

  // Mode ASYNC_ADAHESSIAN: the push of (g, D) with `sequence` at step t (applied: false when the
  // sequence was applied before).
  virtual absl::StatusOr<PushResponse> Push(const absl::Notification& stop,
                                            ParameterServer::Stub* server, uint64_t incarnation,
                                            const SlotId& slot, int64_t t, uint64_t sequence,
                                            const compute::StageLayout& layout,
                                            absl::Span<const float> g, absl::Span<const float> d,
                                            double loss) const = 0;

  // The center of stage `stage`, checked against `layout`.
  virtual absl::StatusOr<PullResponse> Pull(const absl::Notification& stop,
                                            ParameterServer::Stub* server, uint64_t incarnation,
                                            int stage,
                                            const compute::StageLayout& layout) const = 0;

  // Fills the tensors of a recovery task's `snapshot` at a step > 0 where the server sent its
  // header only (a sharded job: the tensors are the range groups'); nothing to do otherwise.
  virtual absl::Status FillSnapshot(const absl::Notification& stop, uint64_t incarnation,
                                    const compute::StageLayout& layout,
                                    Snapshot* snapshot) const = 0;
};

// The worker's parameters after a sync (or one range's: `layout`), from its answer: the stored
// post-sync parameters when the server had applied the step before (`stored_after` not null: a
// lost reply, or the step's replay), else x - alpha (x - c) from the center before the move.
// INVALID_ARGUMENT for an answer that does not fit `layout`.
absl::Status MoveAfterSync(const compute::StageLayout& layout, const TensorBundle* stored_after,
                           const TensorBundle& center_before, double moving_rate,
                           absl::Span<float> x);

// The center of a job of one server group. `clock` must outlive it.
std::shared_ptr<const CenterClient> UnshardedCenter(const WorkerConfig& config,
                                                    const Clock* clock);

// The trainer's end when the server refuses its update (`what`: "sync" or "push") of step t as
// invalid (malformed, non-finite, or breaking the center's integrity): retrying would send the
// same state again, so it stops (logged at ERROR).
absl::Status RefusedUpdate(const char* what, int64_t t, const absl::Status& status);

}  // namespace rebound::worker
