#pragma once

// RangeReader: how a sharded job's group 0 reads every range (docs/design.md §10.2): a stage's
// center for ExportCenter (docs/sharding.md#exporting-the-center; server/center_export.h joins
// them) and a slot's range snapshots at a step for an audited window's start
// (docs/recovery.md#audits; compute/range_snapshot.h joins them). Range 0 is read in process,
// the others at once over CenterRange (ExportRange; ReadRangeSnapshot without an incarnation),
// one channel per group (a replicated group's entry lists its members: the channel follows its
// leader).
//
// The calls are operator calls: they carry this server's operator token
// (security.operator_token_file), which every group must share; without one a range group takes
// them from its own host only (PERMISSION_DENIED otherwise).
//
// Thread-safety: thread-safe (gRPC stubs; the local range service is thread-safe). Ownership:
// borrows `local`, which must outlive it. Status codes: each range's own, its message naming the
// range and its address; DEADLINE_EXCEEDED / UNAVAILABLE from a group that does not answer by
// the deadline.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "compute/model_layout.h"
#include "proto/config.pb.h"
#include "proto/sharding.grpc.pb.h"
#include "server/shard/range_service.h"

namespace rebound::server {

class RangeReader {
 public:
  static absl::StatusOr<std::unique_ptr<RangeReader>> Create(const ServerConfig& config,
                                                             const RangeService* local,
                                                             std::string operator_token);

  // Range k's ExportRange answer of `stage` (or its error) at index k, for every k in [0, K).
  std::vector<absl::StatusOr<ExportRangeResponse>> ReadStage(int stage, absl::Time deadline) const;

  // Every range's snapshot of `slot` at `step` (parts[k]: range k's), or the first range's error
  // (NOT_FOUND where a range no longer holds that step).
  absl::StatusOr<std::vector<Snapshot>> ReadSnapshot(const SlotId& slot, int64_t step,
                                                     absl::Time deadline) const;
  // `header` (a slot's snapshot as group 0 stores it: step and data cursor) with its tensors
  // joined from every range's snapshot at its step (compute/range_snapshot.h), in `layout` (the
  // whole stage's).
  absl::Status FillSnapshot(const compute::StageLayout& layout, Snapshot* header,
                            absl::Time deadline) const;

 private:
  RangeReader(const ServerConfig& config, const RangeService* local, std::string operator_token)
      : addresses_(config.shard().group_addresses().begin(),
                   config.shard().group_addresses().end()),
        local_(local),
        operator_token_(std::move(operator_token)) {}

  const std::vector<std::string> addresses_;  // by group, for messages
  const RangeService* const local_;
  const std::string operator_token_;
  std::vector<std::unique_ptr<CenterRange::Stub>> stubs_;  // stubs_[k - 1]: group k
};

}  // namespace rebound::server
