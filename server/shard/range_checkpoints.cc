#include "server/shard/range_checkpoints.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/fan_out.h"
#include "common/grpc_status.h"
#include "common/security.h"
#include "common/status_macros.h"
#include "server/shard/range_groups.h"

namespace rebound::server {

absl::StatusOr<std::unique_ptr<RangeCheckpoints>> RangeCheckpoints::Create(
    const ServerConfig& config, RangeService* local, std::string operator_token) {
  std::unique_ptr<RangeCheckpoints> made(new RangeCheckpoints(local, std::move(operator_token)));
  ASSIGN_OR_RETURN(made->stubs_, RangeGroupStubs(config));
  return made;
}

absl::Status RangeCheckpoints::OnEveryRange(
    const std::function<absl::Status()>& local,
    const std::function<grpc::Status(CenterRange::Stub*, int range, grpc::ClientContext*)>& remote,
    const std::string& what) const {
  const std::vector<absl::Status> statuses = FanOut(stubs_.size() + 1, [&](size_t i) {
    const int range = static_cast<int>(i);
    absl::Status status;
    if (range == 0) {
      status = local();
    } else {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() +
                           absl::ToChronoMilliseconds(kCallDeadline));
      if (!operator_token_.empty()) context.AddMetadata(kOperatorTokenKey, operator_token_);
      status = FromGrpcStatus(remote(stubs_[i - 1].get(), range, &context));
    }
    if (status.ok()) return status;
    return absl::Status(status.code(),
                        absl::StrCat("range ", range, " ", what, ": ", status.message()));
  });
  for (const absl::Status& status : statuses) RETURN_IF_ERROR(status);
  return absl::OkStatus();
}

absl::Status RangeCheckpoints::Take(int64_t step, int64_t keep_from) const {
  return OnEveryRange(
      [&] { return local_->TakeCheckpoint(step, keep_from).status(); },
      [&](CenterRange::Stub* stub, int range, grpc::ClientContext* context) {
        CheckpointRangeRequest request;
        request.set_step(step);
        request.set_range(range);
        request.set_keep_from(keep_from);
        CheckpointRangeResponse response;
        return stub->CheckpointRange(context, request, &response);
      },
      absl::StrCat("did not keep its checkpoint of step ", step));
}

absl::Status RangeCheckpoints::RollBack(int64_t step, uint64_t rollback_id) const {
  return OnEveryRange(
      [&] { return local_->RollBack(step, rollback_id).status(); },
      [&](CenterRange::Stub* stub, int range, grpc::ClientContext* context) {
        RollbackRangeRequest request;
        request.set_step(step);
        request.set_range(range);
        request.set_rollback_id(rollback_id);
        RollbackRangeResponse response;
        return stub->RollbackRange(context, request, &response);
      },
      absl::StrCat("did not roll back to its checkpoint of step ", step));
}

}  // namespace rebound::server
