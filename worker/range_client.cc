#include "worker/range_client.h"

#include <glog/logging.h>

#include <cmath>
#include <functional>

#include "absl/strings/str_cat.h"
#include "common/fan_out.h"
#include "common/status_macros.h"
#include "compute/range_snapshot.h"
#include "compute/shard_ranges.h"
#include "compute/tensor_bundle.h"
#include "worker/retry.h"

namespace rebound::worker {

namespace {

// Range k of `packed` (a stage's packed vector of n elements).
template <typename T>
absl::Span<T> RangeOf(absl::Span<T> packed, int groups, int k) {
  const int64_t n = static_cast<int64_t>(packed.size());
  const int64_t begin = compute::RangeBegin(n, groups, k);
  return packed.subspan(begin, compute::RangeBegin(n, groups, k + 1) - begin);
}

}  // namespace

absl::StatusOr<std::shared_ptr<RangeClient>> RangeClient::Create(
    const WorkerConfig& config, const JobConfig& job, const std::vector<std::string>& addresses,
    std::shared_ptr<const WorkerCredential> credential, const Clock* clock) {
  if (static_cast<int>(addresses.size()) != job.sharding().groups()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the server named ", addresses.size(), " range groups for a job sharded across ",
        job.sharding().groups()));
  }
  std::shared_ptr<RangeClient> client(new RangeClient(config, clock));
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, config.backoff_initial_ms());
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, config.backoff_initial_ms());
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, config.backoff_max_ms());
  for (const std::string& address : addresses) {
    ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                     MakeChannel(address, config.security(), args, credential));
    client->stubs_.push_back(CenterRange::NewStub(channel));
  }
  return client;
}

absl::Status RangeClient::ForEachRange(int ranges,
                                       const std::function<absl::Status(int)>& fn) const {
  return FirstFailure(FanOut(static_cast<size_t>(ranges),
                             [&fn](size_t k) { return fn(static_cast<int>(k)); }),
                      "range");
}

absl::StatusOr<CenterClient::Synced> RangeClient::Sync(const absl::Notification& stop,
                                                       ParameterServer::Stub* coordinator,
                                                       uint64_t incarnation, const SlotId& slot,
                                                       int64_t t,
                                                       const compute::StageLayout& layout,
                                                       const SyncState& state, int ranges) const {
  const int groups = this->groups();
  const int64_t n = layout.packed_size();
  std::vector<RangeSyncResult> results(groups);
  auto sync_range = [&](int k) -> absl::Status {
    ASSIGN_OR_RETURN(const compute::StageLayout range,
                     compute::RangeLayout(slot.stage(), n, groups, k));
    SyncRangeRequest request;
    request.set_incarnation(incarnation);
    *request.mutable_slot() = slot;
    request.set_step(t);
    request.set_range(k);
    const absl::Span<float> x = RangeOf(state.x, groups, k);
    *request.mutable_params() = compute::BundleFromPacked(
        range, state.sent.empty() ? absl::Span<const float>(x) : RangeOf(state.sent, groups, k));
    OptimizerState* optimizer = request.mutable_optimizer();
    optimizer->set_step(t);
    *optimizer->mutable_m() = compute::BundleFromPacked(range, RangeOf(state.m, groups, k));
    *optimizer->mutable_v() = compute::BundleFromPacked(range, RangeOf(state.v, groups, k));
    *optimizer->mutable_last_hdiag() =
        compute::BundleFromPacked(range, RangeOf(state.d, groups, k));
    SyncRangeResponse response;
    const std::string what = absl::StrCat("sync of range ", k);
    RETURN_IF_ERROR(CallWithRetry(config_, clock_, stop, what.c_str(),
                                  [&](grpc::ClientContext* context) {
                                    response.Clear();
                                    return stubs_[k]->SyncRange(context, request, &response);
                                  }));
    RETURN_IF_ERROR(MoveAfterSync(
        range, response.has_worker_params_after() ? &response.worker_params_after() : nullptr,
        response.center_before(), response.moving_rate(), x));
    results[k].set_range(k);
    results[k].set_center_version(response.center_version());
    results[k].set_partial_sq_norm(response.partial_sq_norm());
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(ForEachRange(ranges == kAllRanges ? groups : ranges, sync_range));
  if (ranges != kAllRanges) {
    return absl::AbortedError(absl::StrCat("synced ranges [0, ", ranges, ") only (test hook)"));
  }
  CommitSyncRequest commit;
  commit.set_incarnation(incarnation);
  *commit.mutable_slot() = slot;
  commit.set_step(t);
  if (std::isfinite(state.loss)) commit.set_loss(state.loss);
  commit.set_data_epoch(state.data_epoch);
  commit.set_data_offset(state.data_offset);
  for (RangeSyncResult& result : results) *commit.add_ranges() = std::move(result);
  CommitSyncResponse committed;
  RETURN_IF_ERROR(CallWithRetry(config_, clock_, stop, "commit of the sync",
                                [&](grpc::ClientContext* context) {
                                  committed.Clear();
                                  return coordinator->CommitSync(context, commit, &committed);
                                }));
  Synced synced;
  synced.weight = committed.weight();
  synced.center_version = commit.ranges(0).center_version();
  return synced;
}

absl::StatusOr<PushResponse> RangeClient::Push(const absl::Notification& stop,
                                               ParameterServer::Stub* coordinator,
                                               uint64_t incarnation, const SlotId& slot,
                                               int64_t t, uint64_t sequence,
                                               const compute::StageLayout& layout,
                                               absl::Span<const float> g,
                                               absl::Span<const float> d, double loss) const {
  const int groups = this->groups();
  const int64_t n = layout.packed_size();
  std::vector<RangeSyncResult> results(groups);
  RETURN_IF_ERROR(ForEachRange(groups, [&](int k) -> absl::Status {
    ASSIGN_OR_RETURN(const compute::StageLayout range,
                     compute::RangeLayout(slot.stage(), n, groups, k));
    PushRangeRequest request;
    request.set_incarnation(incarnation);
    *request.mutable_slot() = slot;
    request.set_sequence(sequence);
    request.set_step(t);
    request.set_range(k);
    *request.mutable_gradient() = compute::BundleFromPacked(range, RangeOf(g, groups, k));
    *request.mutable_hessian_diag() = compute::BundleFromPacked(range, RangeOf(d, groups, k));
    PushRangeResponse response;
    const std::string what = absl::StrCat("push of range ", k);
    RETURN_IF_ERROR(CallWithRetry(config_, clock_, stop, what.c_str(),
                                  [&](grpc::ClientContext* context) {
                                    response.Clear();
                                    return stubs_[k]->PushRange(context, request, &response);
                                  }));
    results[k].set_range(k);
    results[k].set_center_version(response.center_version());
    results[k].set_partial_sq_norm(response.partial_sq_norm());
    return absl::OkStatus();
  }));
  CommitPushRequest commit;
  commit.set_incarnation(incarnation);
  *commit.mutable_slot() = slot;
  commit.set_sequence(sequence);
  commit.set_step(t);
  if (std::isfinite(loss)) commit.set_loss(loss);
  for (RangeSyncResult& result : results) *commit.add_ranges() = std::move(result);
  CommitPushResponse committed;
  RETURN_IF_ERROR(CallWithRetry(config_, clock_, stop, "commit of the push",
                                [&](grpc::ClientContext* context) {
                                  committed.Clear();
                                  return coordinator->CommitPush(context, commit, &committed);
                                }));
  PushResponse pushed;
  pushed.set_applied(committed.applied());
  pushed.set_applied_sequence(committed.applied_sequence());
  pushed.set_weight(committed.weight());
  pushed.set_center_version(commit.ranges(0).center_version());
  return pushed;
}

absl::StatusOr<PullResponse> RangeClient::Pull(const absl::Notification& stop,
                                               ParameterServer::Stub* /*coordinator*/,
                                               uint64_t incarnation, int stage,
                                               const compute::StageLayout& layout) const {
  const int groups = this->groups();
  const int64_t n = layout.packed_size();
  std::vector<float> center(n);
  int64_t version = 0;
  RETURN_IF_ERROR(ForEachRange(groups, [&](int k) -> absl::Status {
    ASSIGN_OR_RETURN(const compute::StageLayout range, compute::RangeLayout(stage, n, groups, k));
    PullRangeRequest request;
    request.set_incarnation(incarnation);
    request.set_stage(stage);
    request.set_range(k);
    PullRangeResponse response;
    const std::string what = absl::StrCat("pull of range ", k);
    RETURN_IF_ERROR(CallWithRetry(config_, clock_, stop, what.c_str(),
                                  [&](grpc::ClientContext* context) {
                                    response.Clear();
                                    return stubs_[k]->PullRange(context, request, &response);
                                  }));
    RETURN_IF_ERROR(compute::ValidateBundle(range, response.center(), "center"));
    const std::vector<float> values = compute::PackedFromBundle(range, response.center());
    std::copy(values.begin(), values.end(),
              RangeOf(absl::MakeSpan(center), groups, k).begin());
    if (k == 0) version = response.center_version();
    return absl::OkStatus();
  }));
  PullResponse pulled;
  *pulled.mutable_center() = compute::BundleFromPacked(layout, center);
  pulled.set_center_version(version);
  return pulled;
}

absl::Status RangeClient::FillSnapshot(const absl::Notification& stop, uint64_t incarnation,
                                       const compute::StageLayout& layout,
                                       Snapshot* snapshot) const {
  std::vector<Snapshot> parts(groups());
  RETURN_IF_ERROR(ForEachRange(groups(), [&](int k) -> absl::Status {
    ReadRangeSnapshotRequest request;
    request.set_incarnation(incarnation);
    *request.mutable_slot() = snapshot->slot();
    request.set_step(snapshot->step());
    request.set_range(k);
    const std::string what = absl::StrCat("read of range ", k, "'s snapshot");
    return CallWithRetry(config_, clock_, stop, what.c_str(), [&](grpc::ClientContext* context) {
      parts[k].Clear();
      return stubs_[k]->ReadRangeSnapshot(context, request, &parts[k]);
    });
  }));
  return compute::JoinRangeSnapshots(layout, parts, snapshot);
}

}  // namespace rebound::worker
