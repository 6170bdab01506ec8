#pragma once

// RangeCheckpoints: group 0's side of GLOBAL_CHECKPOINT in a sharded job
// (docs/sharding.md#global-checkpoint). The cut's barrier, the slots' headers and books stay
// group 0's (server/global_checkpoint.h); the ranges' tensors stay in their groups. At a complete
// cut group 0 asks every range, its own in process and the others at once
// (CenterRange.CheckpointRange), to keep its part; the cut counts only if every range kept it.
// At a rollback it asks every range to go back (CenterRange.RollbackRange, once per rollback
// id); the restores are handed out only once every range answered.
//
// The calls to other groups are operator calls: they carry this server's operator token
// (security.operator_token_file), which every group must share; without one they are accepted
// from loopback only (config validation refuses other addresses).
//
// Thread-safety: thread-safe (gRPC stubs; the local range service is thread-safe). Ownership:
// borrows `local`, which must outlive it. Status codes: the first failing range's status, its
// message naming the range; DEADLINE_EXCEEDED / UNAVAILABLE from a group that does not answer in
// kCallDeadline.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/config.pb.h"
#include "proto/sharding.grpc.pb.h"
#include "server/shard/range_service.h"

namespace rebound::server {

class RangeCheckpoints {
 public:
  // A range keeps or restores its part of the center and of every slot's snapshot: a write or
  // read of that many bytes and an fsync, far below this.
  static constexpr absl::Duration kCallDeadline = absl::Seconds(60);

  static absl::StatusOr<std::unique_ptr<RangeCheckpoints>> Create(const ServerConfig& config,
                                                                  RangeService* local,
                                                                  std::string operator_token);

  // Every range keeps its part of the cut `step`; older than `keep_from` may go.
  absl::Status Take(int64_t step, int64_t keep_from) const;
  // Every range back to its part of `step`, once per `rollback_id` (the same id on a retry).
  absl::Status RollBack(int64_t step, uint64_t rollback_id) const;

 private:
  RangeCheckpoints(RangeService* local, std::string operator_token)
      : local_(local), operator_token_(std::move(operator_token)) {}

  // Runs the local call and every group's call at once; the first error by range.
  absl::Status OnEveryRange(const std::function<absl::Status()>& local,
                            const std::function<grpc::Status(CenterRange::Stub*, int range,
                                                             grpc::ClientContext*)>& remote,
                            const std::string& what) const;

  RangeService* const local_;
  const std::string operator_token_;
  std::vector<std::unique_ptr<CenterRange::Stub>> stubs_;  // stubs_[k - 1]: group k
};

}  // namespace rebound::server
