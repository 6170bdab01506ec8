#include "server/shard/range_authority.h"

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/request_fields.h"
#include "common/slot.h"
#include "common/status_macros.h"

namespace rebound::server {

RangeAuthority::RangeAuthority(const ServerConfig& config, Membership* membership,
                               CenterTable* centers, apply::UpdateApplier* applier)
    : config_(config),
      job_(config_.job()),
      membership_(membership),
      centers_(centers),
      applier_(applier) {}

absl::StatusOr<AuthorizeRangeResponse> RangeAuthority::Authorize(
    const AuthorizeRangeRequest& request) const {
  RETURN_IF_ERROR(CheckEnumValues(request));
  if (job_.sharding().groups() <= 1 || config_.shard().group() != 0) {
    return absl::FailedPreconditionError(
        "AuthorizeRange is answered by a sharded job's group 0 only");
  }
  if (request.range() < 0 || request.range() >= job_.sharding().groups()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "range must be in [0, ", job_.sharding().groups(), "), got ", request.range()));
  }
  AuthorizeRangeResponse response;
  response.set_moving_rate(EffectiveMovingRate(job_));
  const SlotId slot = Normalized(request.slot());
  switch (request.access()) {
    case RANGE_READ:
      RETURN_IF_ERROR(membership_->CheckAlive(request.incarnation()));
      return response;
    case RANGE_DECLARATION: {
      // A range group learns the declared model from here (RangeService::EnsureDeclared).
      RETURN_IF_ERROR(membership_->CheckAlive(request.incarnation()));
      ASSIGN_OR_RETURN(*response.mutable_model(), centers_->Declaration());
      return response;
    }
    case RANGE_FAULT:
      // Only the owner's own update can be its fault.
      RETURN_IF_ERROR(CheckSlotInTopology(slot, job_.topology()));
      RETURN_IF_ERROR(membership_->CheckOwner(request.incarnation(), slot));
      applier_->OnRefused(slot, request.incarnation(),
                          absl::StrCat("an update in range ", request.range()),
                          absl::InvalidArgumentError(request.reason().substr(0, 1024)));
      return response;
    case RANGE_PUSH: {
      RETURN_IF_ERROR(CheckSlotInTopology(slot, job_.topology()));
      ASSIGN_OR_RETURN(const double weight,
                       applier_->AuthorizeRangePush(slot, request.incarnation(),
                                                    request.sequence(), request.step()));
      response.set_weight(weight);
      return response;
    }
    case RANGE_SYNC: {
      RETURN_IF_ERROR(CheckSlotInTopology(slot, job_.topology()));
      ASSIGN_OR_RETURN(const double weight,
                       applier_->AuthorizeRangeSync(slot, request.incarnation(), request.step()));
      response.set_weight(weight);
      return response;
    }
    default:
      return absl::InvalidArgumentError(
          "access must be RANGE_SYNC, RANGE_PUSH, RANGE_READ, RANGE_DECLARATION or RANGE_FAULT");
  }
}

absl::Status UnshardedOnly(const JobConfig& job, const char* what) {
  if (job.sharding().groups() <= 1) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "this job's center is sharded across ", job.sharding().groups(),
      " server groups: trainers sync (push) each range with CenterRange.SyncRange (PushRange) and "
      "commit with CommitSync (CommitPush), and read it with CenterRange.PullRange "
      "(docs/sharding.md); ",
      what, " is for unsharded jobs"));
}

absl::Status CoordinatorOnly(const ServerConfig& config) {
  if (config.job().sharding().groups() <= 1 || config.shard().group() == 0) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "this server group holds range ", config.shard().group(), " of a sharded center; workers "
      "register with group 0 at ", config.shard().group_addresses(0), " (docs/sharding.md)"));
}

}  // namespace rebound::server
