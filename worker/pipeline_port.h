#pragma once

// The receiving end of a pipeline trainer's boundary exchange (docs/design.md §2, §4.2): the
// WorkerPeer service puts each SendBoundary message here, the trainer takes them by (direction,
// step, micro-batch). docs/protocol.md "Pipeline stages" describes the exchange.
//
// A port is open while a pipeline trainer runs (Open/Close); closed, every message is answered
// UNAVAILABLE (a neighbour resends until this worker trains its slot, or its deadline ends).
// Put checks, in order, and answers:
//   * FAILED_PRECONDITION: the message is for another slot (the sender's view of who trains
//     which slot is stale: it asks the server again);
//   * INVALID_ARGUMENT: no payload, a direction other than FORWARD (from stage s-1) or BACKWARD
//     (from stage s+1), a micro-batch outside [0, M), sample ids other than B/M, a value that is
//     not FLOAT32 with B/M x width elements (width: the boundary's features), an r_value that is
//     neither empty nor the value's shape, or a from_slot that is not that neighbour;
//   * UNAVAILABLE: the sender is not the neighbour incarnation this trainer knows (it has just
//     taken its slot over and this trainer's next heartbeat will tell; a fenced worker stays
//     refused), the step is more than kAheadSteps past the last completed one, or the port holds
//     max_bytes already: resend later;
//   * OK with duplicate = true: a step already completed, or a (direction, step, micro-batch)
//     already received (a resend after a neighbour was replaced, or a lost acknowledgement):
//     dropped;
//   * OK: held until Take.
// Every acknowledgement names this trainer's incarnation, so that a sender can tell when a
// replaced neighbour needs the messages again.
//
// Thread-safety: thread-safe (the WorkerPeer service's handlers put, the trainer takes).
// Ownership: the port is owned by the composition root (worker/main.cc) and outlives the
// service and the trainers; it owns the messages it holds. The functions given to Open and
// SetFlush are called on the callers' threads (Put's, Flush's) and must stay valid until Close
// or until they are replaced.

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <tuple>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/rebound.pb.h"

namespace rebound::worker {

class PipelinePort {
 public:
  // Steps a message may be ahead of the last completed step.
  static constexpr int64_t kAheadSteps = 2;

  struct Shape {
    SlotId slot;                    // the trainer's slot (r, s)
    uint64_t incarnation = 0;       // the trainer's
    int stages = 1;                 // S
    int micro_batches = 1;          // M
    int rows = 1;                   // B / M
    int64_t forward_width = 0;      // features of boundary s (from stage s-1), 0 for s = 0
    int64_t backward_width = 0;     // features of boundary s+1 (from stage s+1), 0 for s = S-1
    int64_t max_bytes = 64 << 20;   // held messages' payload bytes at most
  };
  // The incarnation that owns `slot` as this trainer knows it (0: unknown or none).
  using OwnerFn = std::function<uint64_t(const SlotId& slot)>;

  PipelinePort() = default;
  PipelinePort(const PipelinePort&) = delete;
  PipelinePort& operator=(const PipelinePort&) = delete;

  // Starts receiving for a trainer whose completed steps are <= `completed_step`. `owner` says
  // who may send; `on_unknown_sender` (may be null) is called when a sender is refused as
  // unknown (e.g. to send a heartbeat at once). Forgets whatever an earlier Open held.
  void Open(const Shape& shape, int64_t completed_step, OwnerFn owner,
            std::function<void()> on_unknown_sender);
  void Close();

  // The WorkerPeer side (see the header comment).
  absl::StatusOr<BoundaryAck> Put(const BoundaryMessage& message);

  // Waits up to `timeout` for the message (direction, step, mb) and removes it. DEADLINE_EXCEEDED
  // when it has not come, FAILED_PRECONDITION when the port is closed.
  absl::StatusOr<BoundaryMessage> Take(BoundaryDirection direction, int64_t step, int mb,
                                       absl::Duration timeout);

  // Step `step` is done: its messages and older ones are duplicates from now on.
  void Complete(int64_t step);

  // The flush of the trainer's step log (FlushLog RPC); null: nothing to flush.
  void SetFlush(std::function<absl::Status(absl::Duration)> flush);
  absl::Status Flush(absl::Duration timeout);

  int64_t held_bytes() const;

 private:
  using Key = std::tuple<int64_t, int, int>;  // step, direction, micro-batch
  absl::Status Validate(const BoundaryMessage& message) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void DropThroughLocked(int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = false;
  Shape shape_ ABSL_GUARDED_BY(mu_);
  OwnerFn owner_ ABSL_GUARDED_BY(mu_);
  std::function<void()> on_unknown_sender_ ABSL_GUARDED_BY(mu_);
  int64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<Key, BoundaryMessage> held_ ABSL_GUARDED_BY(mu_);
  std::set<Key> taken_ ABSL_GUARDED_BY(mu_);  // taken, of steps above completed_
  int64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<absl::Status(absl::Duration)> flush_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rebound::worker
