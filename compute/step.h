#pragma once

// One local AdaHessian step of a slot (docs/design.md §4.2, §4.3, §5.3) and evaluation.
//
// StageOptimizer is the AdaHessian state (m, v, last D) of one stage on the device and applies a
// step to the stage's parameters from the step's reduced sums; a worker owning one stage uses it
// with MlpStage and TreeAccumulator directly.
//
// LocalTrainer runs whole steps in one process: the model, or several stages of it chained in
// memory (for tests that split a model), the M micro-batches of a batch, the tree reduction, D
// and the AdaHessian update. Its pieces (LoadBatch, ComputeBlock, Apply) are what parallel replay
// needs: spares compute tree-aligned blocks, the leader combines them with TreeAccumulator and
// every spare applies the identical update. ComputeGradients runs a step without its update and
// hands out the step's gradient and D instead: what a trainer pushes in mode ASYNC_ADAHESSIAN.
//
// A step t (1-based):
//   1. with_hessian = HessianDue(t, hessian_every); if so, each stage draws z for
//      (seed, replica, t) (compute/mlp.h, HutchinsonKey);
//   2. micro-batch m (rows [m B/M, (m+1) B/M) of the batch) runs forward through all stages and
//      backward from its labels, with the R-op iff with_hessian, each stage writing its gradient,
//      Hz and (last stage) loss into a sums buffer (loss scale 1/B: compute/mlp.h);
//   3. the sums of the M micro-batches are reduced along the fixed tree (reduction_tree.h);
//   4. per stage: if with_hessian, D = z * Hz, block-averaged along rows per tensor when
//      block_size > 1, becomes the stage's last D; then AdaHessianUpdate(t) with g and last D.
// The loss of the step is the reduced stats[kStatsLoss] of the last stage: the mean CE over the
// batch, with the parameters from before the update.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "compute/backend.h"
#include "compute/mlp.h"
#include "compute/model_layout.h"
#include "compute/reduction_tree.h"
#include "proto/config.pb.h"

namespace rebound {
namespace compute {

// The AdaHessian state of one stage, in the stage's padded layout, on the device.
class StageOptimizer {
 public:
  // Zero state. INVALID_ARGUMENT if the config is out of range (ValidateAdaHessianConfig).
  static absl::StatusOr<std::unique_ptr<StageOptimizer>> Create(Backend* backend,
                                                                const StageLayout& layout,
                                                                const AdaHessianConfig& config);

  StageOptimizer(const StageOptimizer&) = delete;
  StageOptimizer& operator=(const StageOptimizer&) = delete;

  // Applies step t >= 1 to `params` (padded layout). `sums` are the step's sums reduced over all
  // micro-batches (at least sums_size() floats if with_hessian, else sums_size_without_hz());
  // `z` is the step's direction (ignored unless with_hessian). If with_hessian the stage's last D
  // becomes block_average(z * Hz); otherwise the last D is reused (zero before the first D).
  absl::Status Apply(int64_t t, bool with_hessian, ConstDSpan sums, ConstDSpan z,
                     DSpan params);

  // The first half of Apply, alone: if with_hessian the stage's last D becomes
  // block_average(z * Hz) from `sums` (at least sums_size() floats) and `z` (padded_size()
  // floats); otherwise the last D is kept and `sums` and `z` are not read. Apply(t, h, sums, z,
  // params) is UpdateHessianDiag(h, sums, z) followed by AdaHessianUpdate(t) with the sums'
  // gradient and the last D. m, v and the parameters are untouched. INVALID_ARGUMENT on wrong
  // sizes (nothing changes then).
  absl::Status UpdateHessianDiag(bool with_hessian, ConstDSpan sums, ConstDSpan z);

  // The state in the padded layout: first moment m, second moment v, last D.
  DSpan m() { return m_.span(); }
  DSpan v() { return v_.span(); }
  DSpan d() { return d_.span(); }
  const AdaHessianConfig& config() const { return config_; }

  // Host copies in the packed layout (packed_size() floats each), e.g. for snapshots.
  absl::Status GetState(absl::Span<float> m, absl::Span<float> v, absl::Span<float> d) const;
  absl::Status SetState(absl::Span<const float> m, absl::Span<const float> v,
                        absl::Span<const float> d);

 private:
  StageOptimizer(Backend* backend, const StageLayout& layout, const AdaHessianConfig& config)
      : backend_(backend), layout_(layout), config_(config) {}

  Backend* backend_;
  StageLayout layout_;
  AdaHessianConfig config_;
  DeviceBuffer m_;
  DeviceBuffer v_;
  DeviceBuffer d_;
};

struct TrainerOptions {
  ModelSpec model;
  AdaHessianConfig optimizer;
  int batch_size = 64;     // B
  int micro_batches = 4;   // M, divides B
  uint64_t seed = 42;      // job seed of the Hutchinson RNG (DataConfig.seed)
  uint32_t replica = 0;
  // First layers of stages 1..S-1, strictly increasing in (first_layer, end layer); empty: one
  // stage.
  std::vector<int> stage_boundaries;
  // The layers this trainer holds, [first_layer, end_layer) (end_layer -1: through the model's
  // last layer): a pipeline stage, or a group of stages, of a model split across machines. A
  // segment past layer 0 takes each micro-batch's input from the previous stage's forward pair
  // (SetForwardInput) instead of images; one that ends before the last layer takes its top
  // gradient from the next stage's backward pair (SetBackwardInput) instead of labels, and has
  // no loss.
  int first_layer = 0;
  int end_layer = -1;
};

struct EvalResult {
  double loss = 0.0;      // mean cross-entropy over the samples
  double accuracy = 0.0;  // fraction of samples whose argmax is the label
  int64_t samples = 0;
};

class LocalTrainer {
 public:
  // Zero parameters and optimizer state (call InitParams or load them).
  static absl::StatusOr<std::unique_ptr<LocalTrainer>> Create(Backend* backend,
                                                              const TrainerOptions& options);

  LocalTrainer(const LocalTrainer&) = delete;
  LocalTrainer& operator=(const LocalTrainer&) = delete;

  const TrainerOptions& options() const { return options_; }
  int num_stages() const { return static_cast<int>(stages_.size()); }
  MlpStage& stage(int s) { return *stages_[s]; }
  StageOptimizer& optimizer(int s) { return *optimizers_[s]; }

  // Deterministic initialisation of every stage (model_layout.h).
  absl::Status InitParams();

  // Runs step t >= 1 on a batch of B samples: `images` B x input_dim row-major, `labels` B
  // values in [0, classes). Returns the step's loss (one 4-byte device-to-host copy at the end;
  // nothing else leaves the device). INVALID_ARGUMENT on wrong sizes or labels out of range.
  absl::StatusOr<float> Step(int64_t t, absl::Span<const float> images,
                             absl::Span<const int32_t> labels);

  // The pieces of Step. LoadBatch uploads a batch; ComputeBlock runs the micro-batches of the
  // tree node `block` of step t on it and returns, per stage, their tree-reduced sums (valid
  // until the next ComputeBlock or Step); Apply applies step t with per-stage sums reduced over
  // all M micro-batches (e.g. the ComputeBlock of the root, or blocks combined with
  // TreeAccumulator).
  absl::Status LoadBatch(absl::Span<const float> images, absl::Span<const int32_t> labels);
  // Uploads only the rows of the micro-batches of `block` (block.size() x B/M samples), for a
  // spare that computes that block alone; ComputeBlock then takes that block or a node inside it.
  // INVALID_ARGUMENT on wrong sizes, labels out of range or a block that is not a tree node.
  // A segment past layer 0 takes no images (pass an empty span; labels only matter if it ends at
  // the last layer, else pass them anyway or all zero).
  absl::Status LoadBlock(TreeNode block, absl::Span<const float> images,
                         absl::Span<const int32_t> labels);
  // FAILED_PRECONDITION unless the rows of `block` are loaded.
  absl::StatusOr<std::vector<ConstDSpan>> ComputeBlock(int64_t t, TreeNode block);
  absl::Status Apply(int64_t t, absl::Span<const ConstDSpan> sums);

  // Boundary inputs of a segment (see TrainerOptions), per micro-batch mb in [0, M): the forward
  // pair [h; R{h}] (2 x B/M x input_dim floats on a Hessian step, the plain h of B/M x input_dim
  // otherwise) and the backward pair [R{e}; e] (same shapes over output_dim), as the
  // neighbouring stages send them (compute/mlp.h). They stay until replaced. INVALID_ARGUMENT on
  // a size that fits neither shape; FAILED_PRECONDITION for a segment that takes no such input.
  absl::Status SetForwardInput(int mb, absl::Span<const float> pair);
  absl::Status SetBackwardInput(int mb, absl::Span<const float> pair);

  // A step one micro-batch at a time, in any order that runs each micro-batch's Forward before
  // its Backward (a pipeline's schedule: GPipe runs every forward, then every backward).
  // BeginStep(t) draws z if due and starts the reduction; ForwardMicroBatch(mb) returns the
  // segment's output pair for the next stage (valid until the next Forward of mb; for a segment
  // that ends at the last layer, the logits pair); BackwardMicroBatch(mb) commits mb's sums and
  // returns the backward pair for the previous stage (empty for a segment at layer 0), valid
  // until the next Backward of mb; FinishStep applies step t once all M are committed and returns
  // the loss (NaN unless the segment ends at the last layer). The result is bit-identical to
  // Step(t) of the whole model on the same batch. FAILED_PRECONDITION when called out of order.
  absl::Status BeginStep(int64_t t);
  absl::StatusOr<ConstDSpan> ForwardMicroBatch(int mb);
  absl::StatusOr<ConstDSpan> BackwardMicroBatch(int mb);
  absl::StatusOr<float> FinishStep();

  // Floats of the forward pair this segment takes per micro-batch (0 at layer 0) and of the
  // backward pair it takes (0 at the last layer), on step t.
  int64_t ForwardInputLength(int64_t t) const;
  int64_t BackwardInputLength(int64_t t) const;
  bool starts_at_input() const { return stages_.front()->layout().is_first(); }
  bool ends_at_loss() const { return stages_.back()->layout().is_last(); }

  // Step t without its update, for mode ASYNC_ADAHESSIAN (docs/design.md §4.6), where the server applies
  // AdaHessian to the center: runs points 1-3 of a step on the batch as Step does, updates each
  // stage's last D as point 4 does, and instead of AdaHessianUpdate copies to the host
  //   g: the step's gradient (the batch mean, reduced along the tree over the M micro-batches);
  //   d: the D that Step(t) would use: block_average(z * Hz) of this step if
  //      HessianDue(t, hessian_every), else the last D computed (zero before the first one).
  // Both are in the model's packed layout: stage 0's tensors, then stage 1's, ... (ascending
  // tensor id, so the result does not depend on the split), packed_size() floats each.
  // Returns the step's loss. The parameters and m, v do not change; the last D does (as in Step),
  // so that later steps between Hessian steps reuse it. Hence, on the CPU backend, applying
  // ServerAdaHessianApply(optimizer, w = 1, t, g, d, m, v, theta) to the packed parameters theta
  // and this trainer's m, v gives bit-identical results to Step(t) (the CUDA backend evaluates
  // the same per-element expressions, compute/elementwise_math.h). INVALID_ARGUMENT on wrong
  // sizes or labels out of range.
  absl::StatusOr<float> ComputeGradients(int64_t t, absl::Span<const float> images,
                                         absl::Span<const int32_t> labels, absl::Span<float> g,
                                         absl::Span<float> d);

  // The whole model's parameter count: the sum of the stages' packed_size().
  int64_t packed_size() const;

  // Sums-buffer length of stage s for step t: sums_size() with Hessian, else the prefix.
  int64_t ActiveSumsLength(int s, int64_t t) const;

  // Loss and accuracy of the current parameters on a data set of N samples (images N x
  // input_dim, labels N), evaluated in chunks of `chunk_rows` samples. The result leaves the
  // device once, at the end.
  absl::StatusOr<EvalResult> Evaluate(absl::Span<const float> images,
                                      absl::Span<const int32_t> labels, int chunk_rows = 1000);

 private:
  LocalTrainer(Backend* backend, TrainerOptions options)
      : backend_(backend), options_(std::move(options)) {}

  absl::Status CheckBatch(absl::Span<const float> images, absl::Span<const int32_t> labels,
                          int64_t expected_samples) const;
  // Forward and backward of micro-batch mb of the current step through every stage, in each
  // stage's workspace `ws`; Backward leaves each stage's sums in its accumulator's leaf mb (not
  // committed).
  absl::StatusOr<ConstDSpan> ForwardOne(int mb, bool with_hessian, int ws);
  absl::StatusOr<ConstDSpan> BackwardOne(int mb, bool with_hessian, int ws);
  // SetForwardInput (forward) or SetBackwardInput.
  absl::Status SetBoundaryInput(bool forward, int mb, absl::Span<const float> pair);
  // FAILED_PRECONDITION unless micro-batch mb's inputs for step t are in place.
  absl::Status CheckInputs(int mb, int64_t t) const;
  absl::Status EnsureDirection(int64_t t);
  // The loss of a step from its per-stage sums reduced over all micro-batches (4 bytes leave the
  // device).
  absl::StatusOr<float> LossOf(absl::Span<const ConstDSpan> sums);

  Backend* backend_;
  TrainerOptions options_;
  std::vector<std::unique_ptr<MlpStage>> stages_;
  std::vector<std::unique_ptr<StageOptimizer>> optimizers_;
  // Per stage: workspace 0 for whole blocks; one per micro-batch once BeginStep ran (a pipeline
  // keeps all M in flight).
  std::vector<std::vector<std::unique_ptr<StageWorkspace>>> workspaces_;
  std::vector<std::unique_ptr<TreeAccumulator>> accumulators_;
  std::vector<std::unique_ptr<StageWorkspace>> eval_workspaces_;
  DeviceBuffer images_;
  DeviceBuffer labels_;
  TreeNode loaded_;  // micro-batches whose rows are on the device (empty: none)
  int64_t direction_step_ = -1;  // step whose z the stages hold
  // Boundary inputs (segments only): M slots of the largest pair each, and the floats set.
  DeviceBuffer forward_in_;
  DeviceBuffer backward_in_;
  std::vector<int64_t> forward_in_length_;
  std::vector<int64_t> backward_in_length_;
  // The step BeginStep started (-1: none) and how many micro-batches it has committed.
  int64_t pipelined_step_ = -1;
  int pipelined_committed_ = 0;
};

}  // namespace compute
}  // namespace rebound
