#include "worker/center_client.h"

#include <glog/logging.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "compute/adahessian.h"
#include "compute/tensor_bundle.h"
#include "worker/retry.h"

namespace rebound::worker {

namespace {

class Unsharded final : public CenterClient {
 public:
  Unsharded(const WorkerConfig& config, const Clock* clock) : config_(config), clock_(clock) {}

  int groups() const override { return 1; }

  absl::StatusOr<Synced> Sync(const absl::Notification& stop, ParameterServer::Stub* server,
                              uint64_t incarnation, const SlotId& slot, int64_t t,
                              const compute::StageLayout& layout, const SyncState& state,
                              int /*ranges*/) const override {
    SyncRequest request;
    request.set_incarnation(incarnation);
    *request.mutable_slot() = slot;
    request.set_step(t);
    *request.mutable_params() =
        compute::BundleFromPacked(layout, state.sent.empty() ? state.x : state.sent);
    OptimizerState* optimizer = request.mutable_optimizer();
    optimizer->set_step(t);
    *optimizer->mutable_m() = compute::BundleFromPacked(layout, state.m);
    *optimizer->mutable_v() = compute::BundleFromPacked(layout, state.v);
    *optimizer->mutable_last_hdiag() = compute::BundleFromPacked(layout, state.d);
    if (std::isfinite(state.loss)) request.set_loss(state.loss);
    request.set_data_epoch(state.data_epoch);
    request.set_data_offset(state.data_offset);
    SyncResponse response;
    RETURN_IF_ERROR(CallWithRetry(config_, clock_, stop, "sync",
                                  [&](grpc::ClientContext* context) {
                                    response.Clear();
                                    return server->Sync(context, request, &response);
                                  }));
    RETURN_IF_ERROR(MoveAfterSync(
        layout, response.has_worker_params_after() ? &response.worker_params_after() : nullptr,
        response.center_before(), response.moving_rate(), state.x));
    Synced synced;
    synced.weight = response.weight();
    synced.center_version = response.center_version();
    return synced;
  }

  absl::StatusOr<PushResponse> Push(const absl::Notification& stop, ParameterServer::Stub* server,
                                    uint64_t incarnation, const SlotId& slot, int64_t t,
                                    uint64_t sequence, const compute::StageLayout& layout,
                                    absl::Span<const float> g, absl::Span<const float> d,
                                    double loss) const override {
    PushRequest request;
    request.set_incarnation(incarnation);
    *request.mutable_slot() = slot;
    request.set_sequence(sequence);
    request.set_step(t);
    *request.mutable_gradient() = compute::BundleFromPacked(layout, g);
    *request.mutable_hessian_diag() = compute::BundleFromPacked(layout, d);
    if (std::isfinite(loss)) request.set_loss(loss);
    PushResponse response;
    // A retry after a lost reply is harmless: the server recognises the sequence and answers
    // applied: false.
    RETURN_IF_ERROR(CallWithRetry(config_, clock_, stop, "push",
                                  [&](grpc::ClientContext* context) {
                                    response.Clear();
                                    return server->Push(context, request, &response);
                                  }));
    return response;
  }

  absl::StatusOr<PullResponse> Pull(const absl::Notification& stop, ParameterServer::Stub* server,
                                    uint64_t incarnation, int stage,
                                    const compute::StageLayout& layout) const override {
    PullRequest pull;
    pull.set_incarnation(incarnation);
    pull.set_stage(stage);
    PullResponse center;
    RETURN_IF_ERROR(CallWithRetry(config_, clock_, stop, "pull",
                                  [&](grpc::ClientContext* context) {
                                    center.Clear();
                                    return server->Pull(context, pull, &center);
                                  }));
    RETURN_IF_ERROR(compute::ValidateBundle(layout, center.center(), "center"));
    return center;
  }

  absl::Status FillSnapshot(const absl::Notification& /*stop*/, uint64_t /*incarnation*/,
                            const compute::StageLayout& /*layout*/,
                            Snapshot* /*snapshot*/) const override {
    return absl::OkStatus();  // the server's snapshots carry their tensors
  }

 private:
  const WorkerConfig config_;
  const Clock* const clock_;
};

}  // namespace

absl::Status MoveAfterSync(const compute::StageLayout& layout, const TensorBundle* stored_after,
                           const TensorBundle& center_before, double moving_rate,
                           absl::Span<float> x) {
  if (stored_after != nullptr) {
    RETURN_IF_ERROR(compute::ValidateBundle(layout, *stored_after, "worker_params_after"));
    const std::vector<float> after = compute::PackedFromBundle(layout, *stored_after);
    std::copy(after.begin(), after.end(), x.begin());
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(compute::ValidateBundle(layout, center_before, "center_before"));
  const std::vector<float> c_before = compute::PackedFromBundle(layout, center_before);
  return compute::ElasticPullWorker(moving_rate, c_before, x);
}

std::shared_ptr<const CenterClient> UnshardedCenter(const WorkerConfig& config,
                                                    const Clock* clock) {
  return std::make_shared<Unsharded>(config, clock);
}

absl::Status RefusedUpdate(const char* what, int64_t t, const absl::Status& status) {
  if (status.code() != absl::StatusCode::kInvalidArgument) return status;
  LOG(ERROR) << "the server refused this trainer's " << what << " of step " << t
             << " as invalid; this trainer cannot go on and exits: " << status.message();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " of step ", t, " refused: ", status.message()));
}

}  // namespace rebound::worker
