#pragma once

// RangeClient: a worker's calls to the K server groups of a sharded job (docs/design.md §10.2,
// docs/sharding.md): the CenterClient of that topology (worker/center_client.h). Range k of a stage (compute/shard_ranges.h) lives in group k; the client
// holds one channel per group (a replicated group's entry lists its members: the channel follows
// its leader) and talks to all K at once, one thread per group, each call under the worker's
// retry policy (worker/retry.h) with its deadline.
//
// A sync of step t: SyncRange of every range in parallel, the post-sync parameters assembled
// from the answers (x_k - alpha (x_k - c_k) from a fresh answer, the stored x_k after from a
// range that had applied the step already), then CommitSync at group 0 once every range
// answered. A trainer that dies between two ranges' answers leaves the step applied in some
// groups; its successor syncs the same step again and each group applies it exactly once.
//
// Thread-safety: thread-safe (gRPC stubs). Ownership: shares the worker's credential; borrows
// the clock, which must outlive it. Status codes: the first failing range's status (the retried
// call's, worker/retry.h), INVALID_ARGUMENT for an answer that does not fit the range.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/types/span.h"
#include "common/clock.h"
#include "common/security.h"
#include "compute/model_layout.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "proto/sharding.grpc.pb.h"
#include "worker/center_client.h"

namespace rebound::worker {

class RangeClient final : public CenterClient {
 public:
  // `addresses`: RegisterResponse.range_addresses (K entries). INVALID_ARGUMENT for a list that
  // does not match the job's sharding.groups; MakeChannel's errors.
  static absl::StatusOr<std::shared_ptr<RangeClient>> Create(
      const WorkerConfig& config, const JobConfig& job, const std::vector<std::string>& addresses,
      std::shared_ptr<const WorkerCredential> credential, const Clock* clock);

  int groups() const override { return static_cast<int>(stubs_.size()); }

  // The sync of step t of `slot` (stage layout `layout`): every range, then the commit at group
  // 0 through `coordinator`. The weight is the commit's, the version range 0's.
  absl::StatusOr<Synced> Sync(const absl::Notification& stop, ParameterServer::Stub* coordinator,
                              uint64_t incarnation, const SlotId& slot, int64_t t,
                              const compute::StageLayout& layout, const SyncState& state,
                              int ranges = kAllRanges) const override;

  // Mode ASYNC_ADAHESSIAN: the push of (g, D) with `sequence` at step t: every range's part in
  // parallel (a range that applied the sequence already answers applied: false), then the commit
  // at group 0. Returns the commit's answer as a PushResponse (applied: false when group 0 had
  // committed the sequence already; applied_sequence: the slot's committed one).
  absl::StatusOr<PushResponse> Push(const absl::Notification& stop,
                                    ParameterServer::Stub* coordinator, uint64_t incarnation,
                                    const SlotId& slot, int64_t t, uint64_t sequence,
                                    const compute::StageLayout& layout, absl::Span<const float> g,
                                    absl::Span<const float> d, double loss) const override;

  // The center of stage `stage`, gathered from every range (center_version: range 0's).
  absl::StatusOr<PullResponse> Pull(const absl::Notification& stop,
                                    ParameterServer::Stub* coordinator, uint64_t incarnation,
                                    int stage, const compute::StageLayout& layout) const override;

  // Fills the tensors of `snapshot` (a recovery task's: a header from group 0 at a step > 0)
  // from every range's snapshot at that step: params and optimizer state, in `layout`.
  absl::Status FillSnapshot(const absl::Notification& stop, uint64_t incarnation,
                            const compute::StageLayout& layout,
                            Snapshot* snapshot) const override;

 private:
  RangeClient(const WorkerConfig& config, const Clock* clock)
      : config_(config), clock_(clock) {}

  // Runs fn(k) for every range k on a thread of its own; the first error (by range).
  absl::Status ForEachRange(int ranges, const std::function<absl::Status(int)>& fn) const;

  const WorkerConfig config_;
  const Clock* const clock_;
  std::vector<std::unique_ptr<CenterRange::Stub>> stubs_;
};

}  // namespace rebound::worker
