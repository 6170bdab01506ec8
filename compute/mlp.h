#pragma once

// One stage of the MLP of docs/design.md §4.1 on a Backend: forward, backward (softmax cross-entropy)
// and the exact Hessian-vector product Hz by the R-operator (Pearlmutter 1994, forward-over-
// reverse), all in one pass per direction (§4.2).
//
// Notation for layer l with input h_l (rows x in), weight W_l (out x in), bias b_l:
//   a_l = h_l W_l^T + b_l,   h_{l+1} = f_l(a_l);  logits = a_{L-1} (last layer IDENTITY).
// The direction of the R-op is the stage's Hutchinson vector z: R{W_l} = V_l, R{b_l} = rb_l (the
// matching pieces of z). Forward, beside the ordinary pass:
//   R{a_l} = R{h_l} W_l^T + h_l V_l^T + rb_l,   R{h_{l+1}} = f'(a_l) R{a_l},   R{h_0} = R{x} = 0.
// Backward, with e_l = dL/dh_{l+1} and delta_l = dL/da_l:
//   delta_l = e_l f'(a_l),   R{delta_l} = R{e_l} f'(a_l) + e_l f''(a_l) R{a_l}
//   grad W_l = delta_l^T h_l,   Hz W_l = R{grad W_l} = R{delta_l}^T h_l + delta_l^T R{h_l}
//   grad b_l = colsum delta_l,  Hz b_l = colsum R{delta_l}
//   e_{l-1} = delta_l W_l,      R{e_{l-1}} = R{delta_l} W_l + delta_l V_l
// and at the top, with p = softmax(logits) and 1/N the loss normalisation (below):
//   delta = (p - onehot(y)) / N,   R{delta} = p (R{logits} - <p, R{logits}>) / N.
//
// Loss normalisation. The loss of a step is the mean over the step's whole batch of N samples,
// L = (1/N) sum_i CE_i. A micro-batch contributes scale * sum over its rows of CE_i with
// scale = float(1.0 / N) (BackwardFromLabels' inv_batch); its gradient and Hz are the exact
// derivatives of that contribution. Summing the micro-batches (compute/reduction_tree.h) gives
// the full-batch mean loss, gradient and Hz (up to float rounding, which the fixed tree fixes).
//
// Stage boundaries. Only the pairs cross them, as stacked matrices of 2 * rows rows:
//   forward pair  = [h; R{h}]      (rows [0, rows) = h,        rows [rows, 2 rows) = R{h})
//   backward pair = [R{e}; e]      (rows [0, rows) = R{e},     rows [rows, 2 rows) = e)
// where h is the stage's input activation (after the previous stage's activation function) and
// e = dL/dh. Without the R-op (with_rop = false, on steps that reuse the last D) a "pair" is just
// its plain half (h or e, rows rows). The first stage takes the input batch x (rows x input_dim,
// never a pair: R{x} = 0). Because every stage runs exactly the kernels the whole model runs for
// the same layers, a run split into stages is bit-identical to the unsplit run.
//
// Lifetimes. Forward keeps a reference to its `input`, which must stay alive and unchanged until
// the matching Backward returns. Spans returned by Forward/Backward point into the workspace and
// stay valid until its next Forward or Backward.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "compute/backend.h"
#include "compute/model_layout.h"
#include "proto/config.pb.h"

namespace rebound {
namespace compute {

// The Hutchinson coordinates of one step (§4.2): z_i of tensor `id` is
// RngRademacher({seed, replica, step, id, kRngHutchinson}, i).
struct HutchinsonKey {
  uint64_t seed = 0;    // the job seed (DataConfig.seed)
  uint32_t replica = 0;
  uint64_t step = 0;    // 1-based step t
};

// Activation storage of a stage for one micro-batch in flight. A pipeline that keeps several
// micro-batches in flight uses one workspace per micro-batch.
class StageWorkspace {
 public:
  int max_rows() const { return max_rows_; }

 private:
  friend class MlpStage;
  StageWorkspace() = default;

  int max_rows_ = 0;
  std::vector<DeviceBuffer> pre_;   // per stage layer: [a; R{a}], 2 max_rows x out
  std::vector<DeviceBuffer> post_;  // per stage layer: [h; R{h}] (empty for IDENTITY)
  DeviceBuffer back_[2];            // backward ping-pong, 2 max_rows x max_width
  // What the last Forward saw.
  ConstDSpan input_;
  int rows_ = 0;
  bool with_rop_ = false;
  bool forward_done_ = false;
};

class MlpStage {
 public:
  // A stage holding layers [first_layer, end_layer) of `spec` on `backend` (not owned; must
  // outlive the stage), with zero parameters (call InitParams or load them).
  static absl::StatusOr<std::unique_ptr<MlpStage>> Create(Backend* backend,
                                                          const ModelSpec& spec, int first_layer,
                                                          int end_layer);

  MlpStage(const MlpStage&) = delete;
  MlpStage& operator=(const MlpStage&) = delete;

  const StageLayout& layout() const { return layout_; }
  Backend* backend() const { return backend_; }

  // Parameters in the padded layout (model_layout.h), on the device.
  DSpan params() { return params_.span(); }
  ConstDSpan params() const { return params_.span(); }
  // The R-op direction (Hutchinson z) in the padded layout. DrawDirection fills it; tests may
  // write any direction here.
  DSpan direction() { return direction_.span(); }

  // Deterministic initialisation (InitParams of model_layout.h) uploaded to the device.
  absl::Status InitParams();
  // Host <-> device in the packed layout. REQUIRES: packed_size() floats.
  absl::Status SetParams(absl::Span<const float> packed);
  absl::Status GetParams(absl::Span<float> packed) const;
  // xxHash64 of the parameters' packed bytes: ChecksumFloats of what GetParams returns (the
  // step log's per-step checksum, docs/design.md §5.2). On a host-addressable backend it hashes the
  // tensors where they are, with no copy (it runs after every logged step).
  absl::StatusOr<uint64_t> ParamsChecksum() const;
  // The same hash over each tensor's packed bytes alone, one per tensor in id order (the step
  // log's tensor_checksums: a replay that differs names the first tensor that does). Copy-free
  // on a host-addressable backend, like ParamsChecksum.
  absl::StatusOr<std::vector<uint64_t>> TensorChecksums() const;

  // direction = z of step `key` for this stage's tensors (padding left zero).
  absl::Status DrawDirection(const HutchinsonKey& key);

  // A workspace for micro-batches of up to max_rows rows.
  absl::StatusOr<std::unique_ptr<StageWorkspace>> NewWorkspace(int max_rows) const;
  // A zeroed buffer of layout().sums_size() floats for Backward's output.
  absl::StatusOr<DeviceBuffer> NewSumsBuffer() const;

  // Forward pass of `rows` samples (1 <= rows <= ws->max_rows()). `input` is x (first stage:
  // rows x input_dim) or the forward pair of the previous stage (2 rows x input_dim; rows x
  // input_dim without the R-op). With the R-op, direction() must hold this step's z.
  // Returns the output: the forward pair for the next stage, or for the last stage the logits
  // pair [logits; R{logits}] (rows x classes each).
  absl::StatusOr<ConstDSpan> Forward(ConstDSpan input, int rows, bool with_rop,
                                     StageWorkspace* ws) const;

  // Backward pass of a non-last stage after Forward on `ws` (same rows and with_rop).
  // `grad` is the backward pair [R{e}; e] of the stage output from the next stage. Writes the
  // stage's gradient (and Hz with the R-op) into `sums` (layout().sums_size() floats, or at
  // least sums_size_without_hz() without the R-op; its Hz part is then untouched) and zeroes its
  // stats slot; every other element written is overwritten, not accumulated. The padding
  // elements of `sums` are never written: they must be zero (true for NewSumsBuffer and
  // TreeAccumulator buffers). Returns the backward pair for the previous stage, or an empty span
  // for the first stage (nothing to return).
  absl::StatusOr<ConstDSpan> Backward(ConstDSpan grad, int rows, bool with_rop,
                                      StageWorkspace* ws, DSpan sums) const;

  // Backward pass of the last stage: the top gradient comes from softmax cross-entropy against
  // `labels` (device int32, `rows` values in [0, classes), not checked here) with
  // scale = inv_batch (= float(1.0 / N), N the step's full batch; see the header comment). Also
  // writes stats[kStatsLoss] = inv_batch * sum of the rows' CE and stats[kStatsCorrect].
  absl::StatusOr<ConstDSpan> BackwardFromLabels(ConstDIntSpan labels, int rows, float inv_batch,
                                                bool with_rop, StageWorkspace* ws,
                                                DSpan sums) const;

 private:
  MlpStage(Backend* backend, StageLayout layout);

  absl::Status CheckBackward(int rows, bool with_rop, const StageWorkspace* ws,
                             const DSpan& sums) const;
  // Back-propagates from the last layer's delta pair `delta` (already through its activation).
  absl::StatusOr<ConstDSpan> BackwardLayers(ConstDSpan delta, int delta_buffer, int rows,
                                            bool with_rop, StageWorkspace* ws,
                                            DSpan sums) const;
  // Output span of stage layer i for `rows` rows.
  ConstDSpan LayerOutput(int i, int rows, bool with_rop, const StageWorkspace& ws) const;

  Backend* backend_;
  StageLayout layout_;
  ModelSpec spec_;
  DeviceBuffer params_;
  DeviceBuffer direction_;
};

}  // namespace compute
}  // namespace rebound
