#include "compute/step.h"

#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "compute/adahessian.h"

namespace rebound {
namespace compute {

// ---- StageOptimizer ----------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<StageOptimizer>> StageOptimizer::Create(
    Backend* backend, const StageLayout& layout, const AdaHessianConfig& config) {
  if (backend == nullptr) return absl::InvalidArgumentError("StageOptimizer: null backend");
  RETURN_IF_ERROR(ValidateAdaHessianConfig(config));
  std::unique_ptr<StageOptimizer> opt(new StageOptimizer(backend, layout, config));
  ASSIGN_OR_RETURN(opt->m_, backend->Allocate(layout.padded_size()));
  ASSIGN_OR_RETURN(opt->v_, backend->Allocate(layout.padded_size()));
  ASSIGN_OR_RETURN(opt->d_, backend->Allocate(layout.padded_size()));
  return opt;
}

absl::Status StageOptimizer::UpdateHessianDiag(bool with_hessian, ConstDSpan sums,
                                               ConstDSpan z) {
  if (!with_hessian) return absl::OkStatus();
  const int64_t p = layout_.padded_size();
  if (sums.size < layout_.sums_size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "UpdateHessianDiag: sums have %d floats, need %d", sums.size, layout_.sums_size()));
  }
  if (z.size != p) {
    return absl::InvalidArgumentError(
        absl::StrFormat("UpdateHessianDiag: direction has %d floats, expected %d", z.size, p));
  }
  DSpan d = d_.span();
  RETURN_IF_ERROR(backend_->Multiply(z, sums.sub(layout_.hz_offset(), p), d));
  if (config_.block_size() > 1) {
    for (const TensorInfo& tensor : layout_.tensors()) {
      RETURN_IF_ERROR(backend_->BlockAverageRows(tensor.rows, tensor.cols, config_.block_size(),
                                                 d.sub(tensor.offset, tensor.size())));
    }
  }
  return absl::OkStatus();
}

absl::Status StageOptimizer::Apply(int64_t t, bool with_hessian, ConstDSpan sums, ConstDSpan z,
                                   DSpan params) {
  const int64_t p = layout_.padded_size();
  if (t < 1) return absl::InvalidArgumentError(absl::StrFormat("Apply: step t = %d < 1", t));
  if (params.size != p) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Apply: params have %d floats, expected %d", params.size, p));
  }
  if (sums.size < layout_.sums_size_without_hz()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Apply: sums have %d floats, need %d", sums.size, layout_.sums_size_without_hz()));
  }
  RETURN_IF_ERROR(UpdateHessianDiag(with_hessian, sums, z));
  return backend_->AdaHessianUpdate(MakeAdaHessianScalars(config_, t, 1.0),
                                    sums.sub(layout_.grad_offset(), p), d_.span(), m_.span(),
                                    v_.span(), params);
}

absl::Status StageOptimizer::GetState(absl::Span<float> m, absl::Span<float> v,
                                      absl::Span<float> d) const {
  std::vector<float> host(layout_.padded_size());
  const DeviceBuffer* sources[3] = {&m_, &v_, &d_};
  absl::Span<float> targets[3] = {m, v, d};
  for (int i = 0; i < 3; ++i) {
    RETURN_IF_ERROR(backend_->CopyToHost(sources[i]->span(), absl::MakeSpan(host)));
    RETURN_IF_ERROR(layout_.Pack(host, targets[i]));
  }
  return absl::OkStatus();
}

absl::Status StageOptimizer::SetState(absl::Span<const float> m, absl::Span<const float> v,
                                      absl::Span<const float> d) {
  std::vector<float> host(layout_.padded_size());
  DeviceBuffer* targets[3] = {&m_, &v_, &d_};
  absl::Span<const float> sources[3] = {m, v, d};
  for (int i = 0; i < 3; ++i) {
    RETURN_IF_ERROR(layout_.Unpack(sources[i], absl::MakeSpan(host)));
    RETURN_IF_ERROR(backend_->CopyToDevice(host, targets[i]->span()));
  }
  return absl::OkStatus();
}

// ---- LocalTrainer ------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<LocalTrainer>> LocalTrainer::Create(
    Backend* backend, const TrainerOptions& options) {
  if (backend == nullptr) return absl::InvalidArgumentError("LocalTrainer: null backend");
  const int b = options.batch_size;
  const int m = options.micro_batches;
  if (b < 1 || m < 1 || b % m != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LocalTrainer: micro_batches (%d) must be >= 1 and divide batch_size (%d)", m, b));
  }
  RETURN_IF_ERROR(ValidateAdaHessianConfig(options.optimizer));
  ASSIGN_OR_RETURN(std::vector<LayerInfo> layers, ModelLayers(options.model));
  const int num_layers = static_cast<int>(layers.size());
  const int first_layer = options.first_layer;
  const int end_layer = options.end_layer < 0 ? num_layers : options.end_layer;
  if (first_layer < 0 || first_layer >= end_layer || end_layer > num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LocalTrainer: the layers [%d, %d) are not a range of the model's %d", first_layer,
        end_layer, num_layers));
  }
  std::vector<int> firsts = {first_layer};
  for (int boundary : options.stage_boundaries) {
    if (boundary <= firsts.back() || boundary >= end_layer) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "LocalTrainer: stage boundaries must increase strictly within (%d, %d), got %d",
          first_layer, end_layer, boundary));
    }
    firsts.push_back(boundary);
  }
  std::unique_ptr<LocalTrainer> trainer(new LocalTrainer(backend, options));
  const int rows = b / m;
  for (size_t s = 0; s < firsts.size(); ++s) {
    const int end = s + 1 < firsts.size() ? firsts[s + 1] : end_layer;
    ASSIGN_OR_RETURN(std::unique_ptr<MlpStage> stage,
                     MlpStage::Create(backend, options.model, firsts[s], end));
    ASSIGN_OR_RETURN(std::unique_ptr<StageOptimizer> opt,
                     StageOptimizer::Create(backend, stage->layout(), options.optimizer));
    // One workspace, reused micro-batch after micro-batch (hot in cache); BeginStep adds one
    // per micro-batch in flight for a pipelined step.
    std::vector<std::unique_ptr<StageWorkspace>> workspaces;
    ASSIGN_OR_RETURN(std::unique_ptr<StageWorkspace> ws, stage->NewWorkspace(rows));
    workspaces.push_back(std::move(ws));
    ASSIGN_OR_RETURN(std::unique_ptr<TreeAccumulator> acc,
                     TreeAccumulator::Create(backend, stage->layout().sums_size()));
    trainer->stages_.push_back(std::move(stage));
    trainer->optimizers_.push_back(std::move(opt));
    trainer->workspaces_.push_back(std::move(workspaces));
    trainer->accumulators_.push_back(std::move(acc));
  }
  const int64_t input_dim = trainer->stages_.front()->layout().input_dim();
  const int64_t output_dim = trainer->stages_.back()->layout().output_dim();
  if (first_layer == 0) {
    ASSIGN_OR_RETURN(trainer->images_, backend->Allocate(static_cast<int64_t>(b) * input_dim));
  } else {
    ASSIGN_OR_RETURN(trainer->forward_in_, backend->Allocate(2 * static_cast<int64_t>(b) * input_dim));
    trainer->forward_in_length_.assign(m, 0);
  }
  if (end_layer < num_layers) {
    ASSIGN_OR_RETURN(trainer->backward_in_,
                     backend->Allocate(2 * static_cast<int64_t>(b) * output_dim));
    trainer->backward_in_length_.assign(m, 0);
  }
  ASSIGN_OR_RETURN(trainer->labels_, backend->Allocate(b, DType::kInt32));
  return trainer;
}

absl::Status LocalTrainer::InitParams() {
  for (auto& stage : stages_) RETURN_IF_ERROR(stage->InitParams());
  return absl::OkStatus();
}

absl::Status LocalTrainer::CheckBatch(absl::Span<const float> images,
                                      absl::Span<const int32_t> labels,
                                      int64_t expected_samples) const {
  const int64_t input_dim = starts_at_input() ? stages_.front()->layout().input_dim() : 0;
  const int classes = stages_.back()->layout().output_dim();
  if (expected_samples >= 0 && static_cast<int64_t>(labels.size()) != expected_samples) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "batch has %d labels, expected batch_size = %d", labels.size(), expected_samples));
  }
  if (static_cast<int64_t>(images.size()) != static_cast<int64_t>(labels.size()) * input_dim) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%d images floats for %d samples of %d features", images.size(), labels.size(),
        input_dim));
  }
  for (size_t i = 0; i < labels.size() && ends_at_loss(); ++i) {
    if (labels[i] < 0 || labels[i] >= classes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "label %d of sample %d is outside [0, %d)", labels[i], i, classes));
    }
  }
  return absl::OkStatus();
}

absl::Status LocalTrainer::LoadBatch(absl::Span<const float> images,
                                     absl::Span<const int32_t> labels) {
  loaded_ = TreeNode{};
  RETURN_IF_ERROR(CheckBatch(images, labels, options_.batch_size));
  if (starts_at_input()) RETURN_IF_ERROR(backend_->CopyToDevice(images, images_.span()));
  RETURN_IF_ERROR(backend_->CopyToDevice(labels, labels_.int_span()));
  loaded_ = TreeNode{0, options_.micro_batches};
  return absl::OkStatus();
}

absl::Status LocalTrainer::LoadBlock(TreeNode block, absl::Span<const float> images,
                                     absl::Span<const int32_t> labels) {
  loaded_ = TreeNode{};
  if (!IsTreeNode(options_.micro_batches, block)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LoadBlock: [%d, %d) is not a node of the tree over %d micro-batches", block.begin,
        block.end, options_.micro_batches));
  }
  const int rows = options_.batch_size / options_.micro_batches;
  RETURN_IF_ERROR(CheckBatch(images, labels, static_cast<int64_t>(block.size()) * rows));
  const int64_t input_dim = stages_.front()->layout().input_dim();
  if (starts_at_input()) {
    RETURN_IF_ERROR(backend_->CopyToDevice(
        images,
        images_.span().sub(block.begin * rows * input_dim, block.size() * rows * input_dim)));
  }
  RETURN_IF_ERROR(backend_->CopyToDevice(
      labels, labels_.int_span().sub(block.begin * rows, block.size() * rows)));
  loaded_ = block;
  return absl::OkStatus();
}

absl::Status LocalTrainer::EnsureDirection(int64_t t) {
  if (direction_step_ == t) return absl::OkStatus();
  HutchinsonKey key;
  key.seed = options_.seed;
  key.replica = options_.replica;
  key.step = static_cast<uint64_t>(t);
  for (auto& stage : stages_) RETURN_IF_ERROR(stage->DrawDirection(key));
  direction_step_ = t;
  return absl::OkStatus();
}

int64_t LocalTrainer::ActiveSumsLength(int s, int64_t t) const {
  const StageLayout& layout = stages_[s]->layout();
  return HessianDue(t, options_.optimizer.hessian_every()) ? layout.sums_size()
                                                           : layout.sums_size_without_hz();
}

absl::StatusOr<std::vector<ConstDSpan>> LocalTrainer::ComputeBlock(int64_t t, TreeNode block) {
  if (t < 1) return absl::InvalidArgumentError(absl::StrFormat("step t = %d < 1", t));
  if (block.begin < loaded_.begin || block.end > loaded_.end || block.size() <= 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "ComputeBlock: micro-batches [%d, %d) are not loaded (loaded: [%d, %d))", block.begin,
        block.end, loaded_.begin, loaded_.end));
  }
  for (int mb = block.begin; mb < block.end; ++mb) RETURN_IF_ERROR(CheckInputs(mb, t));
  pipelined_step_ = -1;
  const int m_count = options_.micro_batches;
  const bool with_hessian = HessianDue(t, options_.optimizer.hessian_every());
  if (with_hessian) RETURN_IF_ERROR(EnsureDirection(t));
  const int num_stages = static_cast<int>(stages_.size());
  for (int s = 0; s < num_stages; ++s) {
    RETURN_IF_ERROR(accumulators_[s]->Start(m_count, block, ActiveSumsLength(s, t)));
  }
  for (int mb = block.begin; mb < block.end; ++mb) {
    RETURN_IF_ERROR(ForwardOne(mb, with_hessian, /*ws=*/0).status());
    RETURN_IF_ERROR(BackwardOne(mb, with_hessian, /*ws=*/0).status());
    for (int s = 0; s < num_stages; ++s) {
      RETURN_IF_ERROR(accumulators_[s]->Commit(TreeNode{mb, mb + 1}));
    }
  }
  std::vector<ConstDSpan> result;
  for (int s = 0; s < num_stages; ++s) {
    ASSIGN_OR_RETURN(ConstDSpan sum, accumulators_[s]->Result());
    result.push_back(sum);
  }
  return result;
}

absl::StatusOr<ConstDSpan> LocalTrainer::ForwardOne(int mb, bool with_hessian, int ws) {
  const int rows = options_.batch_size / options_.micro_batches;
  const int64_t input_dim = stages_.front()->layout().input_dim();
  ConstDSpan x;
  if (starts_at_input()) {
    x = ConstDSpan(images_.span()).sub(mb * rows * input_dim, rows * input_dim);
  } else {
    x = ConstDSpan(forward_in_.span())
            .sub(mb * 2 * rows * input_dim, (with_hessian ? 2 : 1) * rows * input_dim);
  }
  for (size_t s = 0; s < stages_.size(); ++s) {
    ASSIGN_OR_RETURN(x, stages_[s]->Forward(x, rows, with_hessian, workspaces_[s][ws].get()));
  }
  return x;
}

absl::StatusOr<ConstDSpan> LocalTrainer::BackwardOne(int mb, bool with_hessian, int ws) {
  const int rows = options_.batch_size / options_.micro_batches;
  const int num_stages = static_cast<int>(stages_.size());
  ASSIGN_OR_RETURN(DSpan sums, accumulators_[num_stages - 1]->LeafBuffer(mb));
  ConstDSpan grad;
  if (ends_at_loss()) {
    const float inv_batch = static_cast<float>(1.0 / options_.batch_size);
    ASSIGN_OR_RETURN(grad, stages_[num_stages - 1]->BackwardFromLabels(
                               ConstDIntSpan(labels_.int_span()).sub(mb * rows, rows), rows,
                               inv_batch, with_hessian, workspaces_[num_stages - 1][ws].get(),
                               sums));
  } else {
    const int64_t output_dim = stages_.back()->layout().output_dim();
    const ConstDSpan top =
        ConstDSpan(backward_in_.span())
            .sub(mb * 2 * rows * output_dim, (with_hessian ? 2 : 1) * rows * output_dim);
    ASSIGN_OR_RETURN(grad, stages_[num_stages - 1]->Backward(
                               top, rows, with_hessian, workspaces_[num_stages - 1][ws].get(),
                               sums));
  }
  for (int s = num_stages - 2; s >= 0; --s) {
    ASSIGN_OR_RETURN(sums, accumulators_[s]->LeafBuffer(mb));
    ASSIGN_OR_RETURN(grad,
                     stages_[s]->Backward(grad, rows, with_hessian, workspaces_[s][ws].get(), sums));
  }
  return grad;
}

int64_t LocalTrainer::ForwardInputLength(int64_t t) const {
  if (starts_at_input()) return 0;
  const int64_t rows = options_.batch_size / options_.micro_batches;
  const bool with_hessian = HessianDue(t, options_.optimizer.hessian_every());
  return (with_hessian ? 2 : 1) * rows * stages_.front()->layout().input_dim();
}

int64_t LocalTrainer::BackwardInputLength(int64_t t) const {
  if (ends_at_loss()) return 0;
  const int64_t rows = options_.batch_size / options_.micro_batches;
  const bool with_hessian = HessianDue(t, options_.optimizer.hessian_every());
  return (with_hessian ? 2 : 1) * rows * stages_.back()->layout().output_dim();
}

absl::Status LocalTrainer::CheckInputs(int mb, int64_t t) const {
  if (!starts_at_input() && forward_in_length_[mb] != ForwardInputLength(t)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "micro-batch %d of step %d: the forward input holds %d floats, the step needs %d", mb, t,
        forward_in_length_[mb], ForwardInputLength(t)));
  }
  if (!ends_at_loss() && backward_in_length_[mb] != BackwardInputLength(t)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "micro-batch %d of step %d: the backward input holds %d floats, the step needs %d", mb,
        t, backward_in_length_[mb], BackwardInputLength(t)));
  }
  return absl::OkStatus();
}

absl::Status LocalTrainer::SetBoundaryInput(bool forward, int mb, absl::Span<const float> pair) {
  const char* what = forward ? "SetForwardInput" : "SetBackwardInput";
  if (forward ? starts_at_input() : ends_at_loss()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("%s: this segment %s", what,
                        forward ? "starts at the input" : "ends at the loss"));
  }
  if (mb < 0 || mb >= options_.micro_batches) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: micro-batch %d", what, mb));
  }
  const int64_t width = forward ? stages_.front()->layout().input_dim()
                                : stages_.back()->layout().output_dim();
  const int64_t plain =
      static_cast<int64_t>(options_.batch_size / options_.micro_batches) * width;
  const int64_t n = static_cast<int64_t>(pair.size());
  if (n != plain && n != 2 * plain) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %d floats, expected %d (%s) or %d (with its R-op half)", what, n,
                        plain, forward ? "h" : "e", 2 * plain));
  }
  std::vector<int64_t>& lengths = forward ? forward_in_length_ : backward_in_length_;
  DeviceBuffer& buffer = forward ? forward_in_ : backward_in_;
  lengths[mb] = 0;
  RETURN_IF_ERROR(backend_->CopyToDevice(pair, buffer.span().sub(mb * 2 * plain, n)));
  lengths[mb] = n;
  return absl::OkStatus();
}

absl::Status LocalTrainer::SetForwardInput(int mb, absl::Span<const float> pair) {
  return SetBoundaryInput(/*forward=*/true, mb, pair);
}

absl::Status LocalTrainer::SetBackwardInput(int mb, absl::Span<const float> pair) {
  return SetBoundaryInput(/*forward=*/false, mb, pair);
}

absl::Status LocalTrainer::BeginStep(int64_t t) {
  if (t < 1) return absl::InvalidArgumentError(absl::StrFormat("step t = %d < 1", t));
  const bool with_hessian = HessianDue(t, options_.optimizer.hessian_every());
  if (with_hessian) RETURN_IF_ERROR(EnsureDirection(t));
  const TreeNode root{0, options_.micro_batches};
  const int rows = options_.batch_size / options_.micro_batches;
  for (size_t s = 0; s < stages_.size(); ++s) {
    while (static_cast<int>(workspaces_[s].size()) < options_.micro_batches) {
      ASSIGN_OR_RETURN(std::unique_ptr<StageWorkspace> ws, stages_[s]->NewWorkspace(rows));
      workspaces_[s].push_back(std::move(ws));
    }
    RETURN_IF_ERROR(accumulators_[s]->Start(options_.micro_batches, root,
                                            ActiveSumsLength(static_cast<int>(s), t)));
  }
  pipelined_step_ = t;
  pipelined_committed_ = 0;
  return absl::OkStatus();
}

absl::StatusOr<ConstDSpan> LocalTrainer::ForwardMicroBatch(int mb) {
  if (pipelined_step_ < 1) return absl::FailedPreconditionError("ForwardMicroBatch before BeginStep");
  if (mb < 0 || mb >= options_.micro_batches) {
    return absl::InvalidArgumentError(absl::StrFormat("ForwardMicroBatch: micro-batch %d", mb));
  }
  if (mb < loaded_.begin || mb >= loaded_.end) {
    return absl::FailedPreconditionError(
        absl::StrFormat("ForwardMicroBatch: micro-batch %d is not loaded", mb));
  }
  if (!starts_at_input() && forward_in_length_[mb] != ForwardInputLength(pipelined_step_)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "micro-batch %d of step %d: the forward input holds %d floats, the step needs %d", mb,
        pipelined_step_, forward_in_length_[mb], ForwardInputLength(pipelined_step_)));
  }
  return ForwardOne(mb, HessianDue(pipelined_step_, options_.optimizer.hessian_every()), mb);
}

absl::StatusOr<ConstDSpan> LocalTrainer::BackwardMicroBatch(int mb) {
  if (pipelined_step_ < 1) {
    return absl::FailedPreconditionError("BackwardMicroBatch before BeginStep");
  }
  if (mb < 0 || mb >= options_.micro_batches) {
    return absl::InvalidArgumentError(absl::StrFormat("BackwardMicroBatch: micro-batch %d", mb));
  }
  RETURN_IF_ERROR(CheckInputs(mb, pipelined_step_));
  ASSIGN_OR_RETURN(ConstDSpan grad,
                   BackwardOne(mb, HessianDue(pipelined_step_, options_.optimizer.hessian_every()),
                               mb));
  for (auto& accumulator : accumulators_) RETURN_IF_ERROR(accumulator->Commit(TreeNode{mb, mb + 1}));
  ++pipelined_committed_;
  return grad;
}

absl::StatusOr<float> LocalTrainer::FinishStep() {
  if (pipelined_step_ < 1 || pipelined_committed_ != options_.micro_batches) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "FinishStep: %d of %d micro-batches committed", pipelined_committed_,
        options_.micro_batches));
  }
  const int64_t t = pipelined_step_;
  pipelined_step_ = -1;
  std::vector<ConstDSpan> sums;
  for (auto& accumulator : accumulators_) {
    ASSIGN_OR_RETURN(ConstDSpan sum, accumulator->Result());
    sums.push_back(sum);
  }
  RETURN_IF_ERROR(Apply(t, sums));
  if (!ends_at_loss()) return std::nanf("");
  return LossOf(sums);
}

absl::Status LocalTrainer::Apply(int64_t t, absl::Span<const ConstDSpan> sums) {
  if (sums.size() != stages_.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Apply: %d sums for %d stages", sums.size(), stages_.size()));
  }
  const bool with_hessian = HessianDue(t, options_.optimizer.hessian_every());
  if (with_hessian) RETURN_IF_ERROR(EnsureDirection(t));
  for (size_t s = 0; s < stages_.size(); ++s) {
    RETURN_IF_ERROR(optimizers_[s]->Apply(t, with_hessian, sums[s], stages_[s]->direction(),
                                          stages_[s]->params()));
  }
  return absl::OkStatus();
}

absl::StatusOr<float> LocalTrainer::LossOf(absl::Span<const ConstDSpan> sums) {
  if (!ends_at_loss()) return std::nanf("");
  float loss = 0.0f;
  const StageLayout& last = stages_.back()->layout();
  RETURN_IF_ERROR(backend_->CopyToHost(sums.back().sub(last.stats_offset() + kStatsLoss, 1),
                                       absl::MakeSpan(&loss, 1)));
  return loss;
}

absl::StatusOr<float> LocalTrainer::Step(int64_t t, absl::Span<const float> images,
                                         absl::Span<const int32_t> labels) {
  RETURN_IF_ERROR(LoadBatch(images, labels));
  ASSIGN_OR_RETURN(std::vector<ConstDSpan> sums,
                   ComputeBlock(t, TreeNode{0, options_.micro_batches}));
  RETURN_IF_ERROR(Apply(t, sums));
  return LossOf(sums);
}

int64_t LocalTrainer::packed_size() const {
  int64_t total = 0;
  for (const auto& stage : stages_) total += stage->layout().packed_size();
  return total;
}

absl::StatusOr<float> LocalTrainer::ComputeGradients(int64_t t, absl::Span<const float> images,
                                                     absl::Span<const int32_t> labels,
                                                     absl::Span<float> g, absl::Span<float> d) {
  const int64_t n = packed_size();
  if (static_cast<int64_t>(g.size()) != n || static_cast<int64_t>(d.size()) != n) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ComputeGradients: g has %d floats and d %d, expected %d each", g.size(), d.size(), n));
  }
  RETURN_IF_ERROR(LoadBatch(images, labels));
  ASSIGN_OR_RETURN(std::vector<ConstDSpan> sums,
                   ComputeBlock(t, TreeNode{0, options_.micro_batches}));
  // ComputeBlock drew this step's z if the step computes the Hessian.
  const bool with_hessian = HessianDue(t, options_.optimizer.hessian_every());
  std::vector<float> padded;
  int64_t offset = 0;
  for (size_t s = 0; s < stages_.size(); ++s) {
    const StageLayout& layout = stages_[s]->layout();
    const int64_t p = layout.padded_size();
    const int64_t packed = layout.packed_size();
    RETURN_IF_ERROR(
        optimizers_[s]->UpdateHessianDiag(with_hessian, sums[s], stages_[s]->direction()));
    padded.resize(p);
    RETURN_IF_ERROR(backend_->CopyToHost(sums[s].sub(layout.grad_offset(), p),
                                         absl::MakeSpan(padded)));
    RETURN_IF_ERROR(layout.Pack(padded, g.subspan(offset, packed)));
    RETURN_IF_ERROR(backend_->CopyToHost(optimizers_[s]->d(), absl::MakeSpan(padded)));
    RETURN_IF_ERROR(layout.Pack(padded, d.subspan(offset, packed)));
    offset += packed;
  }
  return LossOf(sums);
}

absl::StatusOr<EvalResult> LocalTrainer::Evaluate(absl::Span<const float> images,
                                                  absl::Span<const int32_t> labels,
                                                  int chunk_rows) {
  if (chunk_rows < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Evaluate: chunk_rows must be >= 1, got %d", chunk_rows));
  }
  if (!starts_at_input() || !ends_at_loss()) {
    return absl::FailedPreconditionError("Evaluate needs the whole model, not a segment of it");
  }
  RETURN_IF_ERROR(CheckBatch(images, labels, -1));
  const int64_t n = static_cast<int64_t>(labels.size());
  EvalResult result;
  if (n == 0) return result;
  const int num_stages = static_cast<int>(stages_.size());
  if (eval_workspaces_.empty() || eval_workspaces_.front()->max_rows() < chunk_rows) {
    eval_workspaces_.clear();
    for (auto& stage : stages_) {
      ASSIGN_OR_RETURN(std::unique_ptr<StageWorkspace> ws, stage->NewWorkspace(chunk_rows));
      eval_workspaces_.push_back(std::move(ws));
    }
  }
  const int64_t input_dim = stages_.front()->layout().input_dim();
  const int classes = stages_.back()->layout().output_dim();
  ASSIGN_OR_RETURN(DeviceBuffer x_dev, backend_->Allocate(static_cast<int64_t>(images.size())));
  ASSIGN_OR_RETURN(DeviceBuffer y_dev, backend_->Allocate(n, DType::kInt32));
  RETURN_IF_ERROR(backend_->CopyToDevice(images, x_dev.span()));
  RETURN_IF_ERROR(backend_->CopyToDevice(labels, y_dev.int_span()));
  const int64_t chunks = (n + chunk_rows - 1) / chunk_rows;
  ASSIGN_OR_RETURN(DeviceBuffer stats, backend_->Allocate(2 * chunks));
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t first = c * chunk_rows;
    const int rows = static_cast<int>(n - first < chunk_rows ? n - first : chunk_rows);
    ConstDSpan x = ConstDSpan(x_dev.span()).sub(first * input_dim, rows * input_dim);
    for (int s = 0; s < num_stages; ++s) {
      ASSIGN_OR_RETURN(x, stages_[s]->Forward(x, rows, false, eval_workspaces_[s].get()));
    }
    RETURN_IF_ERROR(backend_->SoftmaxCrossEntropy(
        rows, classes, false, x, ConstDIntSpan(y_dev.int_span()).sub(first, rows), 1.0f, DSpan(),
        stats.span().sub(2 * c, 2)));
  }
  std::vector<float> host(2 * chunks);
  RETURN_IF_ERROR(backend_->CopyToHost(stats.span(), absl::MakeSpan(host)));
  double loss = 0.0;
  double correct = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    loss += host[2 * c];
    correct += host[2 * c + 1];
  }
  result.samples = n;
  result.loss = loss / static_cast<double>(n);
  result.accuracy = correct / static_cast<double>(n);
  return result;
}

}  // namespace compute
}  // namespace rebound
