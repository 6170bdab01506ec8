#pragma once

// The shape of the MLP of docs/design.md §4.1 and of one stage of it: which layers and tensors a stage
// owns, where each tensor lives in the stage's flat device buffers, and the deterministic
// initialisation.
//
// Tensors. Layer l (0-based over the whole model) has a weight W_l of shape out x in (row-major,
// PyTorch's nn.Linear layout; a "row" is the fan-in of one output unit) with global tensor id
// 2l, and a bias b_l of `out` elements with id 2l + 1. Ids, RNG streams and checksums never depend
// on how the model is split into stages.
//
// Flat layouts. A stage keeps each of its per-parameter quantities (parameters, gradient, Hz,
// Hutchinson z, AdaHessian m, v, D) in one flat buffer of padded_size() floats in the "padded"
// layout: tensors in ascending id order, each starting at a multiple of kTensorAlignment floats,
// with zero padding in between. The "packed" layout (packed_size() floats) is the same tensors
// back to back without padding; it is what leaves the process (snapshots, pushes, checksums).
//
// Step sums. The per-micro-batch quantities that are summed over micro-batches live in one
// "sums" buffer of sums_size() floats: [grad (padded) | stats (kStatsSlot) | Hz (padded)], where
// stats[0] is the loss and stats[1] the number of correct predictions (both only on the last
// stage; zero elsewhere). A step without Hessian reduces only the prefix
// sums_size_without_hz().

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "compute/elementwise_math.h"
#include "proto/config.pb.h"
#include "proto/tensor.pb.h"

namespace rebound {
namespace compute {

inline constexpr int64_t kTensorAlignment = 32;  // floats (128 bytes)
inline constexpr int64_t kStatsSlot = 32;        // floats
inline constexpr int kStatsLoss = 0;
inline constexpr int kStatsCorrect = 1;
inline constexpr int kMaxDeclaredTensors = 4096;

struct LayerInfo {
  int index = 0;  // global layer index l
  int in = 0;     // fan-in
  int out = 0;    // width
  Activation activation = Activation::kRelu;
};

struct TensorInfo {
  uint32_t id = 0;   // 2l (weight) or 2l + 1 (bias)
  std::string name;  // "layer<l>.weight" / "layer<l>.bias"
  int layer = 0;
  bool is_bias = false;
  int rows = 0;  // weight: out; bias: 1
  int cols = 0;  // weight: in;  bias: out
  int64_t offset = 0;         // in the padded layout
  int64_t packed_offset = 0;  // in the packed layout
  // The tensor's shape on the wire: {rows, cols} for a weight, {cols} for a bias; a declared
  // model's tensor keeps its declared shape (rows 1, cols its element count).
  std::vector<int64_t> shape;
  int64_t size() const { return static_cast<int64_t>(rows) * cols; }
};

// OK iff the spec describes a valid MLP: input_dim >= 1, at least one layer, every width >= 1,
// hidden activations RELU, TANH, GELU or IDENTITY, the last layer IDENTITY, and every weight
// tensor below 2^31 elements. INVALID_ARGUMENT naming the field otherwise.
absl::Status ValidateModelSpec(const ModelSpec& spec);

// The layers of a valid spec. INVALID_ARGUMENT as ValidateModelSpec.
absl::StatusOr<std::vector<LayerInfo>> ModelLayers(const ModelSpec& spec);

// The layers [first_layer, end_layer) of a model and their tensors.
class StageLayout {
 public:
  // INVALID_ARGUMENT if the spec is invalid or not 0 <= first_layer < end_layer <= layers.
  static absl::StatusOr<StageLayout> Create(const ModelSpec& spec, int first_layer,
                                            int end_layer);

  // The layout of a model its workers declare (model.declared_by_worker, docs/design.md §11): one
  // stage holding `model`'s tensors in order, with their names and shapes (their data, if any,
  // is ignored) and no layers. INVALID_ARGUMENT naming the tensor unless there are 1 to
  // kMaxDeclaredTensors tensors, with ids 0, 1, ... in order, distinct non-empty names of at most
  // 256 bytes, dtype FLOAT32, at most 8 dimensions each >= 1, and fewer than 2^31 elements in
  // all.
  static absl::StatusOr<StageLayout> FromDeclared(const TensorBundle& model);

  int first_layer() const { return first_layer_; }
  int end_layer() const { return end_layer_; }
  int num_model_layers() const { return num_model_layers_; }
  bool is_first() const { return first_layer_ == 0; }
  bool is_last() const { return end_layer_ == num_model_layers_; }
  int input_dim() const { return layers_.front().in; }
  int output_dim() const { return layers_.back().out; }
  // Width of the widest activation the stage handles (inputs included).
  int max_width() const { return max_width_; }

  // The stage's layers in order, and their tensors in ascending id order.
  const std::vector<LayerInfo>& layers() const { return layers_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // Tensors of the stage's i-th layer (0-based within the stage).
  const TensorInfo& weight(int i) const { return tensors_[2 * i]; }
  const TensorInfo& bias(int i) const { return tensors_[2 * i + 1]; }

  int64_t padded_size() const { return padded_size_; }
  int64_t packed_size() const { return packed_size_; }

  int64_t grad_offset() const { return 0; }
  int64_t stats_offset() const { return padded_size_; }
  int64_t hz_offset() const { return padded_size_ + kStatsSlot; }
  int64_t sums_size() const { return 2 * padded_size_ + kStatsSlot; }
  int64_t sums_size_without_hz() const { return padded_size_ + kStatsSlot; }

  // Padded <-> packed. REQUIRES: sizes padded_size() / packed_size() (else INVALID_ARGUMENT).
  // Unpack writes zeros into the padding.
  absl::Status Pack(absl::Span<const float> padded, absl::Span<float> packed) const;
  absl::Status Unpack(absl::Span<const float> packed, absl::Span<float> padded) const;

 private:
  StageLayout() = default;

  int first_layer_ = 0;
  int end_layer_ = 0;
  int num_model_layers_ = 0;
  int max_width_ = 0;
  std::vector<LayerInfo> layers_;
  std::vector<TensorInfo> tensors_;
  int64_t padded_size_ = 0;
  int64_t packed_size_ = 0;
};

// The deterministic initialisation of the stage's parameters, keyed by spec.init_seed and the
// global tensor ids only (so every split of the model starts from the same values):
//   weight of layer l, element i:  limit * (2 u - 1),  u = RngUniform({seed = init_seed,
//     replica = 0, step = 0, tensor_id = 2l, purpose = kRngInit}, i)
//   limit = sqrt(6 / in) for RELU and GELU layers (He uniform),
//           sqrt(6 / (in + out)) for TANH and IDENTITY layers (Glorot uniform);
//   biases: 0.
// Writes `padded` (padded_size() floats, padding zero). INVALID_ARGUMENT on a size mismatch.
absl::Status InitParams(const ModelSpec& spec, const StageLayout& layout,
                        absl::Span<float> padded);

}  // namespace compute
}  // namespace rebound
