#pragma once

// The file an export of the trained center becomes (docs/design.md §12, docs/operations.md#export):
// every stage's tensors of an ExportCenterResponse in one safetensors file (common/safetensors.h),
// in stage order. The tensor names are global (layer<l>.weight / layer<l>.bias for the built-in
// MLP, whatever stage holds them; a declared model's own names), so the stages' tensors join into
// one state_dict. Metadata: "format": "pt" (what PyTorch loaders look for), and
// "rebound.job_id", "rebound.server_version", "rebound.center_versions" (each stage's, comma-
// separated).
//
// Status codes: INVALID_ARGUMENT for a response without stages or with a tensor safetensors
// cannot hold (common/safetensors.h), naming it.

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "proto/rebound.pb.h"

namespace rebound {

// `extra_metadata` joins the metadata above (e.g. "rebound.job_step" of a periodic export).
absl::StatusOr<std::string> ExportToSafetensors(
    const ExportCenterResponse& exported,
    const std::map<std::string, std::string>& extra_metadata = {});

}  // namespace rebound
