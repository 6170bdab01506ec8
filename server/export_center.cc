// ParameterServerService::ExportCenter: the trained model for an operator (docs/design.md §12,
// docs/operations.md#export): the center as server/center_export.h reads it, which the periodic
// exports write too. A sharded job's group 0 gathers it from every range
// (docs/sharding.md#exporting-the-center).

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/version.h"
#include "server/center_export.h"
#include "server/service.h"
#include "server/shard/range_authority.h"

namespace rebound::server {

namespace {

// How long a sharded export keeps reading a stage whose ranges hold different syncs (or whose
// range group does not answer) when the caller's deadline allows more.
constexpr absl::Duration kShardedExportLimit = absl::Seconds(30);

}  // namespace

grpc::Status ParameterServerService::ExportCenter(grpc::ServerContext* context,
                                                  const ExportCenterRequest* request,
                                                  ExportCenterResponse* response) {
  (void)request;
  if (absl::Status allowed = CheckOperator(context); !allowed.ok()) return ToGrpcStatus(allowed);
  absl::StatusOr<ExportCenterResponse> read;
  if (job_.sharding().groups() > 1) {
    if (absl::Status coordinator = CoordinatorOnly(config_); !coordinator.ok()) {
      return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
          "ExportCenter of a sharded job is group 0's (at ", config_.shard().group_addresses(0),
          "), which gathers every range; this server holds range ", config_.shard().group())));
    }
    if (!sharded_export_) {
      return ToGrpcStatus(
          absl::FailedPreconditionError("ExportCenter: this server cannot read its ranges"));
    }
    // Leave the caller a tenth of its time (at most a second) to receive the answer.
    absl::Time deadline = clock_->Now() + kShardedExportLimit;
    if (context != nullptr) {
      const absl::Time caller = absl::FromChrono(context->deadline());
      const absl::Duration margin =
          std::min(absl::Seconds(1), (caller - clock_->Now()) / 10);
      deadline = std::min(deadline, caller - margin);
    }
    read = sharded_export_(deadline);
  } else {
    read = ReadCenterExport(job_, *centers_, VersionLine());
  }
  if (!read.ok()) {
    return ToGrpcStatus(absl::Status(read.status().code(),
                                     absl::StrCat("ExportCenter: ", read.status().message())));
  }
  *response = *std::move(read);
  return grpc::Status::OK;
}

}  // namespace rebound::server
