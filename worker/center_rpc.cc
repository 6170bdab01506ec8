#include "worker/center_rpc.h"

#include <glog/logging.h>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "compute/tensor_bundle.h"
#include "worker/retry.h"

namespace rebound::worker {

absl::StatusOr<PullResponse> PullCenter(const WorkerConfig& config, const Clock* clock,
                                        const absl::Notification& stop,
                                        ParameterServer::Stub* stub, uint64_t incarnation,
                                        int stage_index, const compute::StageLayout& layout,
                                        const RangeClient* ranges) {
  if (ranges != nullptr) return ranges->Pull(stop, incarnation, stage_index, layout);
  PullRequest pull;
  pull.set_incarnation(incarnation);
  pull.set_stage(stage_index);
  PullResponse center;
  RETURN_IF_ERROR(CallWithRetry(config, clock, stop, "pull", [&](grpc::ClientContext* context) {
    center.Clear();
    return stub->Pull(context, pull, &center);
  }));
  RETURN_IF_ERROR(compute::ValidateBundle(layout, center.center(), "center"));
  return center;
}

absl::Status RefusedUpdate(const char* what, int64_t t, const absl::Status& status) {
  if (status.code() != absl::StatusCode::kInvalidArgument) return status;
  LOG(ERROR) << "the server refused this trainer's " << what << " of step " << t
             << " as invalid; this trainer cannot go on and exits: " << status.message();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " of step ", t, " refused: ", status.message()));
}

}  // namespace rebound::worker
