// ParameterServerService's calls of a sharded job's group 0 (docs/design.md §10.2, docs/sharding.md):
// the range groups' authorizations and the trainers' sync commits.

#include <glog/logging.h>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/grpc_status.h"
#include "common/request_fields.h"
#include "common/slot.h"
#include "common/status_macros.h"
#include "server/service.h"

namespace rebound::server {

absl::Status ParameterServerService::CheckUnsharded(const char* what) const {
  if (job_.sharding().groups() <= 1) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "this job's center is sharded across ", job_.sharding().groups(),
      " server groups: trainers sync (push) each range with CenterRange.SyncRange (PushRange) and "
      "commit with CommitSync (CommitPush), and read it with CenterRange.PullRange "
      "(docs/sharding.md); ",
      what, " is for unsharded jobs"));
}

absl::Status ParameterServerService::CheckCoordinator() const {
  if (job_.sharding().groups() <= 1 || config_.shard().group() == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "this server group holds range ", config_.shard().group(), " of a sharded center; workers "
      "register with group 0 at ", config_.shard().group_addresses(0), " (docs/sharding.md)"));
}

absl::StatusOr<AuthorizeRangeResponse> ParameterServerService::Authorize(
    const grpc::ServerContext* context, const AuthorizeRangeRequest& request) {
  RETURN_IF_ERROR(CheckWorker(context, request.incarnation()));
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
  switch (request.access()) {
    case RANGE_READ:
      RETURN_IF_ERROR(membership_->CheckAlive(request.incarnation()));
      return response;
    case RANGE_FAULT: {
      // Only the owner's own update can be its fault; its credential is checked above.
      const SlotId slot = Normalized(request.slot());
      RETURN_IF_ERROR(ValidateSlot(slot));
      RETURN_IF_ERROR(membership_->CheckOwner(request.incarnation(), slot));
      applier_->OnRefused(slot, request.incarnation(),
                          absl::StrCat("an update in range ", request.range()),
                          absl::InvalidArgumentError(request.reason().substr(0, 1024)));
      return response;
    }
    case RANGE_DECLARATION: {
      // A range group learns the declared model from here (RangeService::EnsureDeclared).
      RETURN_IF_ERROR(membership_->CheckAlive(request.incarnation()));
      ASSIGN_OR_RETURN(*response.mutable_model(), centers_->Declaration());
      return response;
    }
    case RANGE_PUSH: {
      const SlotId slot = Normalized(request.slot());
      RETURN_IF_ERROR(ValidateSlot(slot));
      ASSIGN_OR_RETURN(const double weight,
                       applier_->AuthorizeRangePush(slot, request.incarnation(),
                                                    request.sequence(), request.step()));
      response.set_weight(weight);
      return response;
    }
    case RANGE_SYNC: {
      const SlotId slot = Normalized(request.slot());
      RETURN_IF_ERROR(ValidateSlot(slot));
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

grpc::Status ParameterServerService::AuthorizeRange(grpc::ServerContext* context,
                                                    const AuthorizeRangeRequest* request,
                                                    AuthorizeRangeResponse* response) {
  absl::StatusOr<AuthorizeRangeResponse> allowed = Authorize(context, *request);
  if (!allowed.ok()) return ToGrpcStatus(allowed.status());
  *response = *std::move(allowed);
  return grpc::Status::OK;
}

grpc::Status ParameterServerService::CommitSync(grpc::ServerContext* context,
                                                const CommitSyncRequest* request,
                                                CommitSyncResponse* response) {
  if (absl::Status ok = CheckWorker(context, request->incarnation()); !ok.ok()) {
    return ToGrpcStatus(ok);
  }
  if (absl::Status enums = CheckEnumValues(*request); !enums.ok()) return ToGrpcStatus(enums);
  if (job_.sharding().groups() <= 1 || config_.shard().group() != 0 ||
      job_.easgd().mode() != EASGD) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        "CommitSync is for a sharded EASGD job's group 0; an unsharded job's trainers Sync"));
  }
  const SlotId slot = Normalized(request->slot());
  if (absl::Status ok = ValidateSlot(slot); !ok.ok()) return ToGrpcStatus(ok);
  if (absl::Status ok = membership_->CheckOwner(request->incarnation(), slot); !ok.ok()) {
    return ToGrpcStatus(ok);
  }
  if (!range_check_) {
    return ToGrpcStatus(absl::FailedPreconditionError("this server cannot check its ranges"));
  }
  return ToGrpcStatus(applier_->CommitSync(slot, *request, range_check_, response));
}

grpc::Status ParameterServerService::CommitPush(grpc::ServerContext* context,
                                                const CommitPushRequest* request,
                                                CommitPushResponse* response) {
  if (absl::Status ok = CheckWorker(context, request->incarnation()); !ok.ok()) {
    return ToGrpcStatus(ok);
  }
  if (absl::Status enums = CheckEnumValues(*request); !enums.ok()) return ToGrpcStatus(enums);
  if (job_.sharding().groups() <= 1 || config_.shard().group() != 0 ||
      job_.easgd().mode() != ASYNC_ADAHESSIAN) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        "CommitPush is for a sharded ASYNC_ADAHESSIAN job's group 0; an unsharded job's "
        "trainers Push"));
  }
  const SlotId slot = Normalized(request->slot());
  if (absl::Status ok = ValidateSlot(slot); !ok.ok()) return ToGrpcStatus(ok);
  if (absl::Status ok = membership_->CheckOwner(request->incarnation(), slot); !ok.ok()) {
    return ToGrpcStatus(ok);
  }
  if (!push_check_) {
    return ToGrpcStatus(absl::FailedPreconditionError("this server cannot check its ranges"));
  }
  return ToGrpcStatus(applier_->CommitPush(slot, *request, push_check_, response));
}

}  // namespace rebound::server
