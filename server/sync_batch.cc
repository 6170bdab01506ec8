#include "server/sync_batch.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/checksum.h"
#include "compute/tensor_bundle.h"

namespace rebound::server {
void AddHeaderAndViews(const TensorBundle& from, TensorBundle* to,
                       std::vector<absl::string_view>* data) {
  for (const Tensor& tensor : from.tensors()) {
    Tensor* header = to->add_tensors();
    header->set_id(tensor.id());
    header->set_name(tensor.name());
    header->set_dtype(tensor.dtype());
    *header->mutable_shape() = tensor.shape();
    data->push_back(tensor.data());
  }
}

void AddCenterAndOptToBatch(const compute::StageLayout& layout, int stage, int64_t version,
                            absl::Span<const float> center, int64_t opt_step,
                            absl::Span<const float> m, absl::Span<const float> v,
                            storage::WriteBatch* batch) {
  CenterRecord center_header;
  center_header.set_stage(stage);
  center_header.set_version(version);
  *center_header.mutable_params() = compute::BundleHeader(layout);
  std::vector<absl::string_view> center_data;
  compute::AppendTensorViews(layout, center, &center_data);
  batch->PutCenter(center_header, std::move(center_data));
  CenterOptRecord opt;
  opt.set_stage(stage);
  opt.mutable_state()->set_step(opt_step);
  *opt.mutable_state()->mutable_m() = compute::BundleHeader(layout);
  *opt.mutable_state()->mutable_v() = compute::BundleHeader(layout);
  std::vector<absl::string_view> opt_data;
  compute::AppendTensorViews(layout, m, &opt_data);
  compute::AppendTensorViews(layout, v, &opt_data);
  batch->PutCenterOpt(opt, std::move(opt_data));
}

void AddSyncToBatch(const compute::StageLayout& layout, const SlotId& slot,
                    const SyncRequest& request, int64_t version, absl::Span<const float> center,
                    absl::Span<const float> worker_after, const WeightRecord& weight,
                    storage::WriteBatch* batch, int64_t log_gc_step, int64_t log_gc_from) {
  CenterRecord center_header;
  center_header.set_stage(slot.stage());
  center_header.set_version(version);
  *center_header.mutable_params() = compute::BundleHeader(layout);
  std::vector<absl::string_view> center_data;
  compute::AppendTensorViews(layout, center, &center_data);
  batch->PutCenter(center_header, std::move(center_data));

  Snapshot snapshot;
  *snapshot.mutable_slot() = slot;
  snapshot.set_step(request.step());
  *snapshot.mutable_params() = compute::BundleHeader(layout);
  std::vector<absl::string_view> data;
  compute::AppendTensorViews(layout, worker_after, &data);
  snapshot.set_checksum(ChecksumBundle(snapshot.params(), data));
  const OptimizerState& optimizer = request.optimizer();
  if (request.has_optimizer()) {
    OptimizerState* state = snapshot.mutable_optimizer();
    state->set_step(optimizer.step());
    if (optimizer.has_m()) AddHeaderAndViews(optimizer.m(), state->mutable_m(), &data);
    if (optimizer.has_v()) AddHeaderAndViews(optimizer.v(), state->mutable_v(), &data);
    if (optimizer.has_last_hdiag()) {
      AddHeaderAndViews(optimizer.last_hdiag(), state->mutable_last_hdiag(), &data);
    }
  }
  snapshot.set_data_epoch(request.data_epoch());
  snapshot.set_data_offset(request.data_offset());
  batch->PutSnapshot(snapshot, std::move(data));
  batch->PutWeight(weight);
  // The new snapshot makes the slot's older step-log records useless (docs/design.md §5.2 GC).
  batch->DeleteLogRange(slot, log_gc_from,
                        (log_gc_step < 0 ? request.step() : log_gc_step) + 1);
}

}  // namespace rebound::server
