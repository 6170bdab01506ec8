#pragma once

// One stage of a pipelined replica (topology.stages S > 1; docs/design.md §2, §4.2, §5.2, §5.3;
// docs/protocol.md "Pipeline stages").
//
// Schedule (GPipe). Step t of stage s on the batch that every stage of the replica draws alike:
//   1. for micro-batch m = 0..M-1: take the forward pair (h, R{h}) of (t, m) from stage s-1
//      (stage 0 reads its images), run the stage forward, send the output pair to stage s+1;
//   2. for m = M-1..0: take the backward pair (delta, R{delta}) of (t, m) from stage s+1 (the
//      last stage starts from its labels), run the stage backward, send the pair to stage s-1;
//   3. reduce the M micro-batches along the fixed tree and apply AdaHessian (compute/step.h).
// Every stage runs exactly the kernels the whole model would, on bit-identical inputs, so a run
// split into stages ends bit-identical to the same run with one stage.
//
// Sender-side logging (§5.2): before sending a pair across a logged boundary, the sender appends
// it, with the micro-batch's sample ids, to its own step log as a record of the receiving slot.
//
// Transport. Pairs travel over WorkerPeer.SendBoundary to the neighbour's current owner as the
// server last described it (worker/agent.h). A send retries (capped backoff) until acknowledged;
// a wait polls the port (worker/pipeline_port.h). Each direction keeps its last kWindowSteps
// steps of sent pairs: when the neighbour's slot gets a new owner (a replay rebuilt it), the
// window goes to the new owner again, so it finds the pairs of the steps it redoes live;
// the ones it does not need come back as duplicates. A send or wait that lasts longer than
// fault_tolerance.neighbour_timeout_ms reports the trainer BLOCKED (status shows what it waits
// for, from whom); one that lasts longer than give_up_after_ms ends the trainer with
// DEADLINE_EXCEEDED naming the neighbour. Nothing waits without a bound.
//
// Thread-safety: a PipelineExchange belongs to its trainer's thread. Ownership: it borrows the
// agent, the port, `stop` and the clock (they outlive it), opens the port on Create and closes it
// when destroyed; it owns its channels to the neighbours and the windows of sent pairs.
// Status codes (Step): CANCELLED when stopped; DEADLINE_EXCEEDED when a neighbour stays silent
// or unreachable past give_up_after_ms; INTERNAL when a neighbour refuses a pair as malformed;
// INVALID_ARGUMENT for a received pair that is not valid FLOAT32; the log function's errors
// (logged boundaries); the compute layer's errors.

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "worker/agent.h"
#include "worker/pipeline_port.h"
#include "worker/slot_compute.h"

namespace rebound::worker {

// The pair a stage takes (compute/mlp.h: forward [h; R{h}], backward [R{e}; e]) from a payload
// whose value is h or e and r_value R{h} or R{e} (empty on a step without the R-op).
// INVALID_ARGUMENT for tensors that are not valid FLOAT32.
absl::Status PairFromPayload(const BoundaryPayload& payload, std::vector<float>* pair);

class PipelineExchange {
 public:
  // Steps of sent pairs each direction keeps for a replaced neighbour.
  static constexpr int64_t kWindowSteps = 4;

  // Appends records to the trainer's step log (waiting out back-pressure, bounded).
  using LogFn = std::function<absl::Status(const std::vector<LogRecord>& records)>;

  // Opens `port` for the registered slot, whose steps through registration.start_step are done.
  // `log` is null when nothing is logged. `agent`, `port`, `stop` and `clock` must outlive the
  // exchange. FAILED_PRECONDITION without a port; INVALID_ARGUMENT for a model the job cannot
  // split.
  static absl::StatusOr<std::unique_ptr<PipelineExchange>> Create(
      const WorkerConfig& config, const Registration& registration, WorkerAgent* agent,
      PipelinePort* port, const absl::Notification& stop, const Clock* clock, LogFn log);
  // Closes the port.
  ~PipelineExchange();

  PipelineExchange(const PipelineExchange&) = delete;
  PipelineExchange& operator=(const PipelineExchange&) = delete;

  // Runs step t of this stage on the batch `ids` (B sample ids), exchanging pairs with the
  // neighbours. Returns the step's loss on the last stage, NaN on the others.
  absl::StatusOr<float> Step(int64_t t, absl::Span<const int64_t> ids,
                             const std::vector<int32_t>& label_map, SlotCompute* compute);
  // Step t is done: later copies of its pairs are duplicates.
  void Complete(int64_t t);

  // After the last step: keeps the port open and sends the windows again to neighbours that get
  // a new owner (one rebuilt near the end redoes its last steps with this stage's pairs) until
  // `done` (the job's end) or give_up_after_ms.
  void Linger(const absl::Notification& done);

 private:
  struct Link {
    SlotId to;
    BoundaryDirection direction = FORWARD;
    bool logged = false;                 // the boundary is in step_log.logged_boundaries
    std::deque<BoundaryMessage> window;  // sent and acknowledged, the last kWindowSteps steps
    uint64_t acked_by = 0;               // the incarnation that acknowledged the window
    std::string address;
    std::unique_ptr<WorkerPeer::Stub> stub;
  };

  PipelineExchange(const WorkerConfig& config, const Registration& registration,
                   WorkerAgent* agent, PipelinePort* port, const absl::Notification& stop,
                   const Clock* clock, LogFn log);

  absl::Status Send(Link& link, BoundaryMessage message);
  // One attempt to `neighbour`; the RPC's status.
  grpc::Status SendOnce(Link& link, const Neighbour& neighbour, const BoundaryMessage& message,
                        BoundaryAck* ack);
  // The window again to the slot's new owner, if it has one that has not acknowledged it.
  void ResendIfReplaced(Link& link);
  absl::StatusOr<BoundaryMessage> Await(BoundaryDirection direction, int64_t t, int mb);
  // Reports BLOCKED once `waited` passes neighbour_timeout_ms; an error past give_up_after_ms.
  absl::Status CheckWait(absl::Duration waited, const std::string& what, const SlotId& from);
  BoundaryMessage MakeMessage(const Link& link, int64_t t, int mb,
                              absl::Span<const int64_t> ids, absl::Span<const float> pair,
                              bool with_rop, int64_t width) const;

  const WorkerConfig config_;
  const JobConfig job_;
  const SlotId slot_;
  const uint64_t incarnation_;
  WorkerAgent* const agent_;
  PipelinePort* const port_;
  const absl::Notification& stop_;
  const Clock* const clock_;
  const LogFn log_;
  const absl::Duration neighbour_timeout_;
  const absl::Duration give_up_;
  std::optional<Link> up_;    // to stage s+1 (forward pairs)
  std::optional<Link> down_;  // to stage s-1 (backward pairs)
  bool blocked_ = false;
  std::vector<float> host_;   // one pair, reused
};

}  // namespace rebound::worker
