// ParameterServerService::ExportCenter: the trained model for an operator (DESIGN.md §12,
// docs/operations.md#export). Each stage's center is read under its stage lock, at a version
// that is committed (CenterTable::Read); stages have versions of their own (each syncs on its
// own), so a multi-stage export names each stage's version.

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/version.h"
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
  const int stages = centers_->num_stages();
  if (stages == 0) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        "ExportCenter: no model yet: a declared model exists once its first worker registered "
        "and declared it (docs/python.md)"));
  }
  response->set_job_id(job_.job_id());
  response->set_server_version(VersionLine());
  for (int stage = 0; stage < stages; ++stage) {
    auto read = centers_->Read(stage);
    if (!read.ok()) return ToGrpcStatus(read.status());
    const auto& [center, version] = *read;
    ExportedStage* exported = response->add_stages();
    exported->set_stage(stage);
    exported->set_center_version(version);
    *exported->mutable_center() = centers_->Bundle(stage, center);
  }
  return grpc::Status::OK;
}

}  // namespace rebound::server
