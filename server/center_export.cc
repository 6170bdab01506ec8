#include "server/center_export.h"

namespace rebound::server {

absl::StatusOr<ExportCenterResponse> ReadCenterExport(const JobConfig& job,
                                                      const CenterTable& centers,
                                                      const std::string& server_version) {
  const int stages = centers.num_stages();
  if (stages == 0) {
    return absl::FailedPreconditionError(
        "no model yet: a declared model exists once its first worker registered and declared "
        "it (docs/python.md)");
  }
  ExportCenterResponse response;
  response.set_job_id(job.job_id());
  response.set_server_version(server_version);
  for (int stage = 0; stage < stages; ++stage) {
    auto read = centers.Read(stage);
    if (!read.ok()) return read.status();
    const auto& [center, version] = *read;
    ExportedStage* exported = response.add_stages();
    exported->set_stage(stage);
    exported->set_center_version(version);
    *exported->mutable_center() = centers.Bundle(stage, center);
  }
  return response;
}

}  // namespace rebound::server
