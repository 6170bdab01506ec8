#pragma once

// RangeCheck: how a sharded job's group 0 makes sure, before it commits a slot's sync of step t
// (ParameterServer.CommitSync), that every range holds that sync (docs/design.md §10.2,
// docs/sharding.md). A trainer commits only after every range answered it; a commit without
// them (a buggy or hostile client) would leave group 0's committed step ahead of a range, and a
// later recovery without that range's snapshot. Range 0 is checked in process; the others are
// asked in parallel (CenterRange.RangeSteps), each with a deadline.
//
// Thread-safety: thread-safe (gRPC stubs; the local range service is thread-safe). Ownership:
// borrows `local`, which must outlive it. Status codes: FAILED_PRECONDITION naming the first
// range that does not hold the step; UNAVAILABLE when a range group does not answer in time
// (the trainer retries its commit).

#include <cstdint>
#include <functional>
#include <string>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "proto/sharding.grpc.pb.h"
#include "server/shard/range_service.h"

namespace rebound::server {

class RangeCheck {
 public:
  // Channels to groups 1..K-1 (config.shard().group_addresses) with the server's security.
  static absl::StatusOr<std::unique_ptr<RangeCheck>> Create(const ServerConfig& config,
                                                            const RangeService* local);

  // OK iff every range holds the slot's sync of `step`.
  absl::Status Check(const SlotId& slot, int64_t step) const;
  // Mode ASYNC_ADAHESSIAN: OK iff every range applied the slot's push of `sequence`.
  absl::Status CheckPushed(const SlotId& slot, uint64_t sequence) const;

 private:
  RangeCheck(const RangeService* local, absl::Duration deadline)
      : local_(local), deadline_(deadline) {}

  // Asks every range group k > 0 at once for the slot's steps; `held(k, reply)` says whether
  // range k holds what the caller needs. `what` names it in the error.
  absl::Status AskRanges(const SlotId& slot,
                         const std::function<bool(const RangeStepsResponse&)>& held,
                         const std::string& what) const;

  const RangeService* const local_;
  const absl::Duration deadline_;
  std::vector<std::unique_ptr<CenterRange::Stub>> stubs_;  // stubs_[k - 1]: group k
};

}  // namespace rebound::server
