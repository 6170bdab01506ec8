#pragma once

// PartialSumExchange: the per-step all-gather of a parallel replay (docs/design.md §5.3), from one
// spare's side. Each of a task's k spares computes the sums of its tree-aligned block of a
// step's micro-batches; Publish writes them where the other spares will read them (this spare's
// shared-memory region, worker/shared_sums.h, and/or the message inline), SendToOthers sends the
// message (or a reference into the region) to every other spare over WorkerPeer.SendPartialSum,
// GatherOthers takes every other spare's message of the step from this worker's mailbox
// (worker/replay_mailbox.h), and RegionSums reads a reference-only message's sums from the
// sender's region. The sums helpers pack, check and unpack a step's sums as FLOAT32 tensors.
//
// A peer that does not answer within Bound(first) (rpc_deadline_ms per step; twice that for the
// first step, which waits for the slowest spare's snapshot and log transfer), or whose port stops
// accepting connections, ends the exchange with an error naming it.
//
// Thread-safety: one exchange belongs to one replay; SendToOthers may run on another thread
// (JobThread) while the replay's thread calls GatherOthers and RegionSums, and Publish is not
// called while a send is in flight. Ownership: `config`, `task`, `mailbox`, `stop` and `clock`
// are borrowed and must outlive the exchange; the exchange owns its channels and its region.
//
// Status codes: DEADLINE_EXCEEDED when a peer does not answer or send within the bound;
// UNAVAILABLE when a peer cannot be reached any more; CANCELLED when `stop` is notified;
// FAILED_PRECONDITION for a reference to a region this spare has not mapped (and the mailbox's
// codes); INVALID_ARGUMENT for sums of the wrong shape; INTERNAL when the region's slots are too
// small or a message was not packed for an inline peer. Every error about a peer names it.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/clock.h"
#include "compute/backend.h"
#include "grpcpp/grpcpp.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "worker/replay_mailbox.h"
#include "worker/shared_sums.h"

namespace rebound::worker {

// Per stage, the first `active[s]` floats of `sums[s]` as FLOAT32 tensors (id = stage).
absl::Status PackSums(compute::Backend* backend, absl::Span<const compute::ConstDSpan> sums,
                      absl::Span<const int64_t> active, TensorBundle* out);

// INVALID_ARGUMENT unless `sums` holds one tensor per stage of the expected active lengths.
absl::Status CheckSums(const TensorBundle& sums, absl::Span<const int64_t> active,
                       const std::string& what);

// Copies a stage's received sums (raw little-endian floats) to the device (through `scratch`
// when the message's bytes are not aligned for float).
absl::Status UnpackSums(compute::Backend* backend, const Tensor& tensor,
                        std::vector<float>* scratch, compute::DSpan dst);

class PartialSumExchange {
 public:
  // `max_floats`: the most floats one step's sums of all stages take.
  PartialSumExchange(const WorkerConfig& config, const RecoveryTask& task, ReplayMailbox* mailbox,
                     const absl::Notification& stop, const Clock* clock, int64_t max_floats);

  PartialSumExchange(const PartialSumExchange&) = delete;
  PartialSumExchange& operator=(const PartialSumExchange&) = delete;

  // How long one exchange may wait for a peer.
  absl::Duration Bound(bool first) const;

  // Writes this spare's sums of step t (per stage, its first active[s] floats) where its peers
  // will read them: the shared-memory slot (if there is a region) and, for the peers that take
  // them inline, `partial`'s sums; on the first step `partial` also offers the region. `partial`
  // holds the step's other fields.
  absl::Status Publish(compute::Backend* backend, absl::Span<const compute::ConstDSpan> sums,
                       absl::Span<const int64_t> active, bool first, PartialSum* partial);

  // Sends this spare's partial sum of a step (as Publish left it) to every other spare of the
  // task: a reference to the peers that mapped the region, the sums inline to the others.
  absl::Status SendToOthers(const PartialSum& partial, bool first);

  // Every other spare's partial sum of step t, in rank order (this spare's rank skipped).
  absl::StatusOr<std::vector<PartialSum>> GatherOthers(int64_t t, bool first);

  // Per stage, the active[s] floats of a reference-only `partial`, read from the sender's region,
  // which this spare mapped when the sender offered it.
  absl::StatusOr<std::vector<absl::Span<const float>>> RegionSums(
      const PartialSum& partial, absl::Span<const int64_t> active);

 private:
  static constexpr absl::Duration kProbePeriod = absl::Milliseconds(100);

  // Sends one message to peer `r`, retrying UNAVAILABLE (the peer has not opened the task yet,
  // or a connection hiccup) with a short capped backoff until `deadline`.
  template <typename Call>
  absl::Status SendToPeer(const char* what, absl::Time deadline, int r, Call call);
  // Waits for a message with `take(slice)` until `bound`, checking between slices that peer `r`
  // is still reachable: a peer process that died refuses connections at once, and the task ends
  // then rather than at the bound.
  template <typename Message, typename Take>
  absl::StatusOr<Message> Await(int r, absl::Duration bound, Take take);
  // `status` with the spare it concerns named.
  absl::Status Name(int r, const absl::Status& status) const;

  const WorkerConfig& config_;
  const RecoveryTask& task_;
  ReplayMailbox* const mailbox_;
  const absl::Notification& stop_;
  const Clock* const clock_;

  std::vector<std::shared_ptr<grpc::Channel>> channels_;  // by rank; null where not needed
  std::vector<std::unique_ptr<WorkerPeer::Stub>> stubs_;
  std::unique_ptr<SharedSumsWriter> region_;  // null: inline to everyone
  std::vector<bool> by_reference_;             // by rank: the peer reads our region
  std::map<int, std::shared_ptr<const SharedSumsReader>> regions_in_use_;
};

}  // namespace rebound::worker
