#include "compute/mlp.h"

#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/checksum.h"
#include "common/status_macros.h"

namespace rebound {
namespace compute {

MlpStage::MlpStage(Backend* backend, StageLayout layout)
    : backend_(backend), layout_(std::move(layout)) {}

absl::StatusOr<std::unique_ptr<MlpStage>> MlpStage::Create(Backend* backend,
                                                           const ModelSpec& spec,
                                                           int first_layer, int end_layer) {
  if (backend == nullptr) return absl::InvalidArgumentError("MlpStage: null backend");
  ASSIGN_OR_RETURN(StageLayout layout, StageLayout::Create(spec, first_layer, end_layer));
  std::unique_ptr<MlpStage> stage(new MlpStage(backend, std::move(layout)));
  ASSIGN_OR_RETURN(stage->params_, backend->Allocate(stage->layout_.padded_size()));
  ASSIGN_OR_RETURN(stage->direction_, backend->Allocate(stage->layout_.padded_size()));
  stage->spec_ = spec;
  return stage;
}

absl::Status MlpStage::InitParams() {
  std::vector<float> host(layout_.padded_size());
  RETURN_IF_ERROR(compute::InitParams(spec_, layout_, absl::MakeSpan(host)));
  return backend_->CopyToDevice(host, params_.span());
}

absl::Status MlpStage::SetParams(absl::Span<const float> packed) {
  std::vector<float> host(layout_.padded_size());
  RETURN_IF_ERROR(layout_.Unpack(packed, absl::MakeSpan(host)));
  return backend_->CopyToDevice(host, params_.span());
}

absl::Status MlpStage::GetParams(absl::Span<float> packed) const {
  std::vector<float> host(layout_.padded_size());
  RETURN_IF_ERROR(backend_->CopyToHost(params_.span(), absl::MakeSpan(host)));
  return layout_.Pack(host, packed);
}

absl::StatusOr<uint64_t> MlpStage::ParamsChecksum() const {
  if (!backend_->host_addressable()) {
    std::vector<float> packed(layout_.packed_size());
    RETURN_IF_ERROR(GetParams(absl::MakeSpan(packed)));
    return ChecksumFloats(packed);
  }
  RETURN_IF_ERROR(backend_->Synchronize());
  // The packed layout is the tensors back to back in id order: streaming each tensor's bytes
  // from the padded buffer hashes exactly the packed bytes.
  ChecksumStream hash;
  const ConstDSpan params = params_.span();
  for (const TensorInfo& t : layout_.tensors()) {
    hash.Update(params.data + t.offset, t.size() * sizeof(float));
  }
  return hash.Digest();
}

absl::StatusOr<std::vector<uint64_t>> MlpStage::TensorChecksums() const {
  std::vector<uint64_t> checksums;
  checksums.reserve(layout_.tensors().size());
  if (!backend_->host_addressable()) {
    std::vector<float> packed(layout_.packed_size());
    RETURN_IF_ERROR(GetParams(absl::MakeSpan(packed)));
    for (const TensorInfo& t : layout_.tensors()) {
      checksums.push_back(
          ChecksumFloats(absl::MakeConstSpan(packed).subspan(t.packed_offset, t.size())));
    }
    return checksums;
  }
  RETURN_IF_ERROR(backend_->Synchronize());
  const ConstDSpan params = params_.span();
  for (const TensorInfo& t : layout_.tensors()) {
    checksums.push_back(ChecksumFloats(absl::MakeConstSpan(params.data + t.offset, t.size())));
  }
  return checksums;
}

absl::Status MlpStage::DrawDirection(const HutchinsonKey& key) {
  DSpan z = direction_.span();
  for (const TensorInfo& t : layout_.tensors()) {
    RngStream stream;
    stream.seed = key.seed;
    stream.replica = key.replica;
    stream.step = key.step;
    stream.tensor_id = t.id;
    stream.purpose = kRngHutchinson;
    RETURN_IF_ERROR(backend_->RademacherFill(stream, z.sub(t.offset, t.size())));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StageWorkspace>> MlpStage::NewWorkspace(int max_rows) const {
  if (max_rows < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("NewWorkspace: max_rows must be >= 1, got %d", max_rows));
  }
  std::unique_ptr<StageWorkspace> ws(new StageWorkspace());
  ws->max_rows_ = max_rows;
  for (const LayerInfo& layer : layout_.layers()) {
    const int64_t pair = 2 * static_cast<int64_t>(max_rows) * layer.out;
    ASSIGN_OR_RETURN(DeviceBuffer pre, backend_->Allocate(pair));
    ws->pre_.push_back(std::move(pre));
    DeviceBuffer post;
    if (layer.activation != Activation::kIdentity) {
      ASSIGN_OR_RETURN(post, backend_->Allocate(pair));
    }
    ws->post_.push_back(std::move(post));
  }
  const int64_t back = 2 * static_cast<int64_t>(max_rows) * layout_.max_width();
  for (DeviceBuffer& b : ws->back_) {
    ASSIGN_OR_RETURN(b, backend_->Allocate(back));
  }
  return ws;
}

absl::StatusOr<DeviceBuffer> MlpStage::NewSumsBuffer() const {
  return backend_->Allocate(layout_.sums_size());
}

ConstDSpan MlpStage::LayerOutput(int i, int rows, bool with_rop, const StageWorkspace& ws) const {
  const LayerInfo& layer = layout_.layers()[i];
  const int64_t n = (with_rop ? 2 : 1) * static_cast<int64_t>(rows) * layer.out;
  const DeviceBuffer& buf =
      layer.activation == Activation::kIdentity ? ws.pre_[i] : ws.post_[i];
  return buf.span().sub(0, n);
}

absl::StatusOr<ConstDSpan> MlpStage::Forward(ConstDSpan input, int rows, bool with_rop,
                                             StageWorkspace* ws) const {
  if (ws == nullptr) return absl::InvalidArgumentError("Forward: null workspace");
  if (rows < 1 || rows > ws->max_rows()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Forward: rows must be in [1, %d] (the workspace's max_rows), got %d", ws->max_rows(),
        rows));
  }
  const bool input_is_pair = with_rop && !layout_.is_first();
  const int64_t want =
      (input_is_pair ? 2 : 1) * static_cast<int64_t>(rows) * layout_.input_dim();
  if (input.size != want) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Forward: input of layers [%d, %d) has %d floats, expected %d (%s%d rows x %d)",
        layout_.first_layer(), layout_.end_layer(), input.size, want,
        input_is_pair ? "pair of 2 x " : "", rows, layout_.input_dim()));
  }
  ws->forward_done_ = false;
  const ConstDSpan params = params_.span();
  const ConstDSpan z = direction_.span();
  ConstDSpan h = input;
  for (int i = 0; i < static_cast<int>(layout_.layers().size()); ++i) {
    const LayerInfo& layer = layout_.layers()[i];
    const TensorInfo& wt = layout_.weight(i);
    const TensorInfo& bt = layout_.bias(i);
    const int in = layer.in;
    const int out = layer.out;
    const int64_t half_out = static_cast<int64_t>(rows) * out;
    const int64_t half_in = static_cast<int64_t>(rows) * in;
    const ConstDSpan w = params.sub(wt.offset, wt.size());
    const ConstDSpan b = params.sub(bt.offset, bt.size());
    const ConstDSpan v = z.sub(wt.offset, wt.size());
    const ConstDSpan rb = z.sub(bt.offset, bt.size());
    DSpan a = ws->pre_[i].span().sub(0, (with_rop ? 2 : 1) * half_out);
    if (!with_rop) {
      RETURN_IF_ERROR(backend_->Gemm(Transpose::kNo, Transpose::kYes, rows, out, in, 1.0f, h, in,
                                     w, in, 0.0f, a, out));
    } else if (layer.index == 0) {
      // R{x} = 0: a = x W^T, R{a} = x V^T.
      RETURN_IF_ERROR(backend_->Gemm(Transpose::kNo, Transpose::kYes, rows, out, in, 1.0f, h, in,
                                     w, in, 0.0f, a.sub(0, half_out), out));
      RETURN_IF_ERROR(backend_->Gemm(Transpose::kNo, Transpose::kYes, rows, out, in, 1.0f, h, in,
                                     v, in, 0.0f, a.sub(half_out, half_out), out));
    } else {
      // [a; R{a}] = [h; R{h}] W^T, then R{a} += h V^T.
      RETURN_IF_ERROR(backend_->Gemm(Transpose::kNo, Transpose::kYes, 2 * rows, out, in, 1.0f, h,
                                     in, w, in, 0.0f, a, out));
      RETURN_IF_ERROR(backend_->Gemm(Transpose::kNo, Transpose::kYes, rows, out, in, 1.0f,
                                     h.sub(0, half_in), in, v, in, 1.0f,
                                     a.sub(half_out, half_out), out));
    }
    DSpan post;
    if (layer.activation != Activation::kIdentity) {
      post = ws->post_[i].span().sub(0, a.size);
    }
    RETURN_IF_ERROR(backend_->BiasActivationForward(layer.activation, rows, out, with_rop, b, rb,
                                                    a, post));
    h = LayerOutput(i, rows, with_rop, *ws);
  }
  ws->input_ = input;
  ws->rows_ = rows;
  ws->with_rop_ = with_rop;
  ws->forward_done_ = true;
  return h;
}

absl::Status MlpStage::CheckBackward(int rows, bool with_rop, const StageWorkspace* ws,
                                     const DSpan& sums) const {
  if (ws == nullptr) return absl::InvalidArgumentError("Backward: null workspace");
  if (!ws->forward_done_) {
    return absl::FailedPreconditionError("Backward: the workspace holds no completed Forward");
  }
  if (rows != ws->rows_ || with_rop != ws->with_rop_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Backward: rows %d / with_rop %d differ from the Forward's %d / %d", rows, with_rop,
        ws->rows_, ws->with_rop_));
  }
  const int64_t need = with_rop ? layout_.sums_size() : layout_.sums_size_without_hz();
  if (sums.size < need) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Backward: sums has %d floats, needs %d", sums.size, need));
  }
  return absl::OkStatus();
}

absl::StatusOr<ConstDSpan> MlpStage::Backward(ConstDSpan grad, int rows, bool with_rop,
                                              StageWorkspace* ws, DSpan sums) const {
  if (layout_.is_last()) {
    return absl::FailedPreconditionError(
        "Backward: the last stage starts from labels (use BackwardFromLabels)");
  }
  RETURN_IF_ERROR(CheckBackward(rows, with_rop, ws, sums));
  const int last = static_cast<int>(layout_.layers().size()) - 1;
  const LayerInfo& layer = layout_.layers()[last];
  const int64_t want = (with_rop ? 2 : 1) * static_cast<int64_t>(rows) * layer.out;
  if (grad.size != want) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Backward: gradient of layers [%d, %d) has %d floats, expected %d", layout_.first_layer(),
        layout_.end_layer(), grad.size, want));
  }
  if (layer.activation == Activation::kIdentity) {
    return BackwardLayers(grad, -1, rows, with_rop, ws, sums);
  }
  DSpan delta = ws->back_[0].span().sub(0, want);
  RETURN_IF_ERROR(backend_->ActivationBackward(layer.activation, rows, layer.out, with_rop,
                                               ws->pre_[last].span().sub(0, want), grad, delta));
  return BackwardLayers(delta, 0, rows, with_rop, ws, sums);
}

absl::StatusOr<ConstDSpan> MlpStage::BackwardFromLabels(ConstDIntSpan labels, int rows,
                                                        float inv_batch, bool with_rop,
                                                        StageWorkspace* ws, DSpan sums) const {
  if (!layout_.is_last()) {
    return absl::FailedPreconditionError(
        "BackwardFromLabels: only the last stage sees the labels");
  }
  RETURN_IF_ERROR(CheckBackward(rows, with_rop, ws, sums));
  if (labels.size != rows) {
    return absl::InvalidArgumentError(
        absl::StrFormat("BackwardFromLabels: %d labels for %d rows", labels.size, rows));
  }
  const int last = static_cast<int>(layout_.layers().size()) - 1;
  const int classes = layout_.layers()[last].out;
  const int64_t n = (with_rop ? 2 : 1) * static_cast<int64_t>(rows) * classes;
  DSpan stats = sums.sub(layout_.stats_offset(), kStatsSlot);
  RETURN_IF_ERROR(backend_->Fill(stats, 0.0f));
  DSpan delta = ws->back_[0].span().sub(0, n);
  RETURN_IF_ERROR(backend_->SoftmaxCrossEntropy(rows, classes, with_rop,
                                                ws->pre_[last].span().sub(0, n), labels,
                                                inv_batch, delta, stats));
  return BackwardLayers(delta, 0, rows, with_rop, ws, sums);
}

absl::StatusOr<ConstDSpan> MlpStage::BackwardLayers(ConstDSpan delta, int delta_buffer, int rows,
                                                    bool with_rop, StageWorkspace* ws,
                                                    DSpan sums) const {
  if (!layout_.is_last()) {
    RETURN_IF_ERROR(backend_->Fill(sums.sub(layout_.stats_offset(), kStatsSlot), 0.0f));
  }
  const ConstDSpan params = params_.span();
  const ConstDSpan z = direction_.span();
  DSpan grad = sums.sub(layout_.grad_offset(), layout_.padded_size());
  DSpan hz = with_rop ? sums.sub(layout_.hz_offset(), layout_.padded_size()) : DSpan();
  for (int i = static_cast<int>(layout_.layers().size()) - 1; i >= 0; --i) {
    const LayerInfo& layer = layout_.layers()[i];
    const TensorInfo& wt = layout_.weight(i);
    const TensorInfo& bt = layout_.bias(i);
    const int in = layer.in;
    const int out = layer.out;
    const int64_t half_out = static_cast<int64_t>(rows) * out;
    const int64_t half_in = static_cast<int64_t>(rows) * in;
    // The layer's input: [h; R{h}] (or x for global layer 0).
    const ConstDSpan h_in = i == 0 ? ws->input_ : LayerOutput(i - 1, rows, with_rop, *ws);
    const ConstDSpan h = h_in.sub(0, half_in);
    // delta pair = [R{delta}; delta].
    const ConstDSpan d = with_rop ? delta.sub(half_out, half_out) : delta;
    const ConstDSpan w = params.sub(wt.offset, wt.size());
    const ConstDSpan v = z.sub(wt.offset, wt.size());

    RETURN_IF_ERROR(backend_->Gemm(Transpose::kYes, Transpose::kNo, out, in, rows, 1.0f, d, out,
                                   h, in, 0.0f, grad.sub(wt.offset, wt.size()), in));
    RETURN_IF_ERROR(backend_->ColumnSums(rows, out, d, grad.sub(bt.offset, bt.size())));
    if (with_rop) {
      const ConstDSpan rd = delta.sub(0, half_out);
      if (layer.index == 0) {
        // R{h} = R{x} = 0: Hz W = R{delta}^T x.
        RETURN_IF_ERROR(backend_->Gemm(Transpose::kYes, Transpose::kNo, out, in, rows, 1.0f, rd,
                                       out, h, in, 0.0f, hz.sub(wt.offset, wt.size()), in));
      } else {
        // [R{delta}; delta]^T [h; R{h}] = R{delta}^T h + delta^T R{h}.
        RETURN_IF_ERROR(backend_->Gemm(Transpose::kYes, Transpose::kNo, out, in, 2 * rows, 1.0f,
                                       delta, out, h_in, in, 0.0f,
                                       hz.sub(wt.offset, wt.size()), in));
      }
      RETURN_IF_ERROR(backend_->ColumnSums(rows, out, rd, hz.sub(bt.offset, bt.size())));
    }
    if (layer.index == 0) return ConstDSpan();  // nothing flows below the model's input

    // [R{e}; e] = [R{delta}; delta] W, then R{e} += delta V.
    const int target = delta_buffer == 0 ? 1 : 0;
    DSpan e = ws->back_[target].span().sub(0, (with_rop ? 2 : 1) * half_in);
    if (with_rop) {
      RETURN_IF_ERROR(backend_->Gemm(Transpose::kNo, Transpose::kNo, 2 * rows, in, out, 1.0f,
                                     delta, out, w, in, 0.0f, e, in));
      RETURN_IF_ERROR(backend_->Gemm(Transpose::kNo, Transpose::kNo, rows, in, out, 1.0f, d, out,
                                     v, in, 1.0f, e.sub(0, half_in), in));
    } else {
      RETURN_IF_ERROR(backend_->Gemm(Transpose::kNo, Transpose::kNo, rows, in, out, 1.0f, d, out,
                                     w, in, 0.0f, e, in));
    }
    if (i == 0) return ConstDSpan(e);  // the backward pair for the previous stage

    const LayerInfo& below = layout_.layers()[i - 1];
    if (below.activation != Activation::kIdentity) {
      RETURN_IF_ERROR(backend_->ActivationBackward(below.activation, rows, in, with_rop,
                                                   ws->pre_[i - 1].span().sub(0, e.size), e, e));
    }
    delta = e;
    delta_buffer = target;
  }
  return ConstDSpan();
}

}  // namespace compute
}  // namespace rebound
