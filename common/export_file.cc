#include "common/export_file.h"

#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/safetensors.h"

namespace rebound {

absl::StatusOr<std::string> ExportToSafetensors(
    const ExportCenterResponse& exported,
    const std::map<std::string, std::string>& extra_metadata) {
  if (exported.stages_size() == 0) {
    return absl::InvalidArgumentError("an export without stages: nothing to write");
  }
  std::vector<const Tensor*> tensors;
  std::vector<int64_t> versions;
  for (const ExportedStage& stage : exported.stages()) {
    versions.push_back(stage.center_version());
    for (const Tensor& tensor : stage.center().tensors()) tensors.push_back(&tensor);
  }
  std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"rebound.job_id", exported.job_id()},
      {"rebound.server_version", exported.server_version()},
      {"rebound.center_versions", absl::StrJoin(versions, ",")},
  };
  for (const auto& [key, value] : extra_metadata) metadata.emplace(key, value);
  return EncodeSafetensors(tensors, metadata);
}

}  // namespace rebound
