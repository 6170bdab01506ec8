#include "compute/model_layout.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/rng.h"

namespace rebound {
namespace compute {
namespace {

int64_t RoundUp(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

absl::StatusOr<Activation> ToActivation(rebound::Activation a, int layer, bool last) {
  switch (a) {
    case rebound::RELU:
      if (!last) return Activation::kRelu;
      break;
    case rebound::TANH:
      if (!last) return Activation::kTanh;
      break;
    case rebound::GELU:
      if (!last) return Activation::kGelu;
      break;
    case rebound::IDENTITY:
      return Activation::kIdentity;
    default:
      return absl::InvalidArgumentError(absl::StrFormat(
          "model.layers[%d].activation must be RELU, TANH, GELU or IDENTITY, got %d", layer,
          static_cast<int>(a)));
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "model.layers[%d].activation must be IDENTITY for the last layer (its logits feed softmax "
      "cross-entropy), got %s",
      layer, rebound::Activation_Name(a)));
}

}  // namespace

absl::StatusOr<std::vector<LayerInfo>> ModelLayers(const ModelSpec& spec) {
  if (spec.input_dim() < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("model.input_dim must be >= 1, got %d", spec.input_dim()));
  }
  if (spec.layers_size() < 1) {
    return absl::InvalidArgumentError("model.layers must hold at least one layer");
  }
  std::vector<LayerInfo> layers;
  int in = spec.input_dim();
  for (int l = 0; l < spec.layers_size(); ++l) {
    const LayerSpec& ls = spec.layers(l);
    if (!ls.has_width() || ls.width() < 1) {
      return absl::InvalidArgumentError(
          absl::StrFormat("model.layers[%d].width must be >= 1, got %d", l, ls.width()));
    }
    if (static_cast<int64_t>(in) * ls.width() >= (int64_t{1} << 31)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "model.layers[%d]: weight of %d x %d elements is too large", l, ls.width(), in));
    }
    absl::StatusOr<Activation> act =
        ToActivation(ls.activation(), l, l + 1 == spec.layers_size());
    if (!act.ok()) return act.status();
    LayerInfo info;
    info.index = l;
    info.in = in;
    info.out = ls.width();
    info.activation = *act;
    layers.push_back(info);
    in = ls.width();
  }
  return layers;
}

absl::Status ValidateModelSpec(const ModelSpec& spec) { return ModelLayers(spec).status(); }

absl::StatusOr<StageLayout> StageLayout::Create(const ModelSpec& spec, int first_layer,
                                                int end_layer) {
  absl::StatusOr<std::vector<LayerInfo>> all = ModelLayers(spec);
  if (!all.ok()) return all.status();
  const int num_layers = static_cast<int>(all->size());
  if (first_layer < 0 || first_layer >= end_layer || end_layer > num_layers) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "stage layers [%d, %d) are not a non-empty range of the model's %d layers", first_layer,
        end_layer, num_layers));
  }
  StageLayout layout;
  layout.first_layer_ = first_layer;
  layout.end_layer_ = end_layer;
  layout.num_model_layers_ = num_layers;
  layout.layers_.assign(all->begin() + first_layer, all->begin() + end_layer);
  int64_t offset = 0;
  int64_t packed = 0;
  int max_width = layout.layers_.front().in;
  for (const LayerInfo& layer : layout.layers_) {
    max_width = std::max(max_width, layer.out);
    for (int kind = 0; kind < 2; ++kind) {
      TensorInfo t;
      t.layer = layer.index;
      t.is_bias = kind == 1;
      t.id = static_cast<uint32_t>(2 * layer.index + kind);
      t.name = absl::StrFormat("layer%d.%s", layer.index, t.is_bias ? "bias" : "weight");
      t.rows = t.is_bias ? 1 : layer.out;
      t.cols = t.is_bias ? layer.out : layer.in;
      t.shape = t.is_bias ? std::vector<int64_t>{t.cols} : std::vector<int64_t>{t.rows, t.cols};
      t.offset = offset;
      t.packed_offset = packed;
      offset = RoundUp(offset + t.size(), kTensorAlignment);
      packed += t.size();
      layout.tensors_.push_back(t);
    }
  }
  layout.max_width_ = max_width;
  layout.padded_size_ = offset;
  layout.packed_size_ = packed;
  return layout;
}

absl::StatusOr<StageLayout> StageLayout::FromDeclared(const TensorBundle& model) {
  if (model.tensors_size() < 1 || model.tensors_size() > kMaxDeclaredTensors) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "model: must declare 1 to %d tensors, got %d", kMaxDeclaredTensors, model.tensors_size()));
  }
  constexpr int64_t kMaxElements = (int64_t{1} << 31) - 1;
  StageLayout layout;
  layout.first_layer_ = 0;
  layout.end_layer_ = 0;
  layout.num_model_layers_ = 0;
  absl::flat_hash_set<std::string> names;
  int64_t offset = 0;
  int64_t packed = 0;
  for (int i = 0; i < model.tensors_size(); ++i) {
    const Tensor& tensor = model.tensors(i);
    const std::string what = absl::StrFormat("model.tensors[%d] ('%s')", i, tensor.name());
    if (tensor.id() != static_cast<uint32_t>(i)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: ids must be 0, 1, ... in order, got id %d", what, tensor.id()));
    }
    if (tensor.name().empty() || tensor.name().size() > 256) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "model.tensors[%d]: name must be 1 to 256 bytes, got %d", i, tensor.name().size()));
    }
    if (!names.insert(tensor.name()).second) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": the name is declared twice"));
    }
    if (tensor.dtype() != FLOAT32) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": dtype must be FLOAT32 (parameters are float32), got ",
          DType_Name(tensor.dtype())));
    }
    if (tensor.shape_size() > 8) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: at most 8 dimensions, got %d", what, tensor.shape_size()));
    }
    int64_t elements = 1;
    for (int d = 0; d < tensor.shape_size(); ++d) {
      if (tensor.shape(d) < 1 || tensor.shape(d) > kMaxElements) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: shape[%d] must be in [1, 2^31), got %d", what, d, tensor.shape(d)));
      }
      elements *= tensor.shape(d);
      if (elements > kMaxElements) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": 2^31 or more elements"));
      }
    }
    TensorInfo t;
    t.id = tensor.id();
    t.name = tensor.name();
    t.rows = 1;
    t.cols = static_cast<int>(elements);
    t.shape.assign(tensor.shape().begin(), tensor.shape().end());
    t.offset = offset;
    t.packed_offset = packed;
    offset = RoundUp(offset + t.size(), kTensorAlignment);
    packed += t.size();
    if (packed > kMaxElements) {
      return absl::InvalidArgumentError(
          absl::StrCat("model: 2^31 or more parameters in all (at ", what, ")"));
    }
    layout.tensors_.push_back(std::move(t));
  }
  layout.padded_size_ = offset;
  layout.packed_size_ = packed;
  return layout;
}

absl::Status StageLayout::Pack(absl::Span<const float> padded, absl::Span<float> packed) const {
  if (static_cast<int64_t>(padded.size()) != padded_size_ ||
      static_cast<int64_t>(packed.size()) != packed_size_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Pack: got %d padded / %d packed floats, expected %d / %d", padded.size(), packed.size(),
        padded_size_, packed_size_));
  }
  for (const TensorInfo& t : tensors_) {
    std::memcpy(packed.data() + t.packed_offset, padded.data() + t.offset,
                static_cast<size_t>(t.size()) * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status StageLayout::Unpack(absl::Span<const float> packed,
                                 absl::Span<float> padded) const {
  if (static_cast<int64_t>(padded.size()) != padded_size_ ||
      static_cast<int64_t>(packed.size()) != packed_size_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Unpack: got %d packed / %d padded floats, expected %d / %d", packed.size(),
        padded.size(), packed_size_, padded_size_));
  }
  std::fill(padded.begin(), padded.end(), 0.0f);
  for (const TensorInfo& t : tensors_) {
    std::memcpy(padded.data() + t.offset, packed.data() + t.packed_offset,
                static_cast<size_t>(t.size()) * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status InitParams(const ModelSpec& spec, const StageLayout& layout,
                        absl::Span<float> padded) {
  if (static_cast<int64_t>(padded.size()) != layout.padded_size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "InitParams: got %d floats, expected %d", padded.size(), layout.padded_size()));
  }
  std::fill(padded.begin(), padded.end(), 0.0f);
  for (int i = 0; i < static_cast<int>(layout.layers().size()); ++i) {
    const LayerInfo& layer = layout.layers()[i];
    const TensorInfo& w = layout.weight(i);
    const bool he = layer.activation == Activation::kRelu || layer.activation == Activation::kGelu;
    const double fan = he ? layer.in : static_cast<double>(layer.in) + layer.out;
    const float limit = static_cast<float>(std::sqrt(6.0 / fan));
    RngStream stream;
    stream.seed = spec.init_seed();
    stream.replica = 0;
    stream.step = 0;
    stream.tensor_id = w.id;
    stream.purpose = kRngInit;
    float* out = padded.data() + w.offset;
    for (int64_t k = 0; k < w.size(); ++k) {
      out[k] = limit * (2.0f * RngUniform(stream, static_cast<uint64_t>(k)) - 1.0f);
    }
  }
  return absl::OkStatus();
}

}  // namespace compute
}  // namespace rebound
