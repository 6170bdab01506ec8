#include "server/shard/range_check.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/fan_out.h"
#include "common/grpc_status.h"
#include "common/slot.h"
#include "common/status_macros.h"
#include "server/shard/range_groups.h"

namespace rebound::server {

absl::StatusOr<std::unique_ptr<RangeCheck>> RangeCheck::Create(const ServerConfig& config,
                                                               const RangeService* local) {
  const absl::Duration deadline =
      std::min(absl::Milliseconds(config.max_wait_ms()), absl::Seconds(5));
  std::unique_ptr<RangeCheck> check(new RangeCheck(local, deadline));
  ASSIGN_OR_RETURN(check->stubs_, RangeGroupStubs(config));
  return check;
}

absl::Status RangeCheck::Check(const SlotId& slot, int64_t step) const {
  const std::string what = absl::StrCat("the sync of slot ", SlotName(slot), " at step ", step,
                                        ": sync every range (CenterRange.SyncRange)");
  if (!local_->Holds(slot, step)) {
    return absl::FailedPreconditionError(
        absl::StrCat("range 0 has not applied ", what, " before the commit"));
  }
  return AskRanges(
      slot,
      [step](const RangeStepsResponse& reply) {
        return std::find(reply.steps().begin(), reply.steps().end(), step) != reply.steps().end();
      },
      what);
}

absl::Status RangeCheck::CheckPushed(const SlotId& slot, uint64_t sequence) const {
  const std::string what = absl::StrCat("the push of slot ", SlotName(slot), " with sequence ",
                                        sequence, ": push every range (CenterRange.PushRange)");
  if (local_->AppliedSequence(slot) < sequence) {
    return absl::FailedPreconditionError(
        absl::StrCat("range 0 has not applied ", what, " before the commit"));
  }
  return AskRanges(
      slot,
      [sequence](const RangeStepsResponse& reply) {
        return reply.applied_sequence() >= sequence;
      },
      what);
}

absl::Status RangeCheck::AskRanges(const SlotId& slot,
                                   const std::function<bool(const RangeStepsResponse&)>& held,
                                   const std::string& what) const {
  const std::vector<absl::Status> statuses = FanOut(stubs_.size(), [&](size_t i) {
    const int range = static_cast<int>(i) + 1;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(absl::ToInt64Milliseconds(deadline_)));
    RangeStepsRequest request;
    *request.mutable_slot() = slot;
    RangeStepsResponse response;
    const absl::Status status =
        FromGrpcStatus(stubs_[i]->RangeSteps(&context, request, &response));
    if (!status.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "range ", range, " did not say whether it holds ", what, ": ", status.message()));
    }
    if (!held(response)) {
      return absl::FailedPreconditionError(
          absl::StrCat("range ", range, " has not applied ", what, " before the commit"));
    }
    return absl::OkStatus();
  });
  for (const absl::Status& status : statuses) RETURN_IF_ERROR(status);
  return absl::OkStatus();
}

}  // namespace rebound::server
