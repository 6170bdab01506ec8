// ParameterServerService::ExportCenter: the trained model for an operator (DESIGN.md §12,
// docs/operations.md#export): the center as server/center_export.h reads it, which the periodic
// exports write too.

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/version.h"
#include "server/center_export.h"
#include "server/service.h"

namespace rebound::server {

grpc::Status ParameterServerService::ExportCenter(grpc::ServerContext* context,
                                                  const ExportCenterRequest* request,
                                                  ExportCenterResponse* response) {
  (void)request;
  if (absl::Status allowed = CheckOperator(context); !allowed.ok()) return ToGrpcStatus(allowed);
  if (job_.sharding().groups() > 1) {
    // Group 0 holds no center; each range group holds a slice. Not built yet (R17): say so.
    return ToGrpcStatus(absl::UnimplementedError(absl::StrCat(
        "ExportCenter: this job's center is sharded across ", job_.sharding().groups(),
        " server groups; exporting a sharded center is not supported yet (read it range by "
        "range with CenterRange.PullRange, docs/sharding.md)")));
  }
  absl::StatusOr<ExportCenterResponse> read = ReadCenterExport(job_, *centers_, VersionLine());
  if (!read.ok()) {
    return ToGrpcStatus(absl::Status(read.status().code(),
                                     absl::StrCat("ExportCenter: ", read.status().message())));
  }
  *response = *std::move(read);
  return grpc::Status::OK;
}

}  // namespace rebound::server
