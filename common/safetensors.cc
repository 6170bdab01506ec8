#include "common/safetensors.h"

#include <algorithm>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace rebound {
namespace {

constexpr char kMetadataKey[] = "__metadata__";
constexpr size_t kHeaderAlignment = 8;
// A header this large is not one of ours (the format's own readers refuse headers over 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100 << 20;

int64_t Elements(const google::protobuf::RepeatedField<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t dim : shape) n *= dim;
  return n;
}

}  // namespace

absl::StatusOr<std::string> EncodeSafetensors(const std::vector<const Tensor*>& tensors,
                                              const std::map<std::string, std::string>& metadata) {
  // ordered_json keeps the header's keys in the data's order, which a reader may rely on.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header[kMetadataKey] = std::move(meta);
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const Tensor* tensor : tensors) {
    const std::string& name = tensor->name();
    if (name.empty() || name == kMetadataKey || !names.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "safetensors: tensor ", tensor->id(), " has an empty, reserved or repeated name '",
          name, "'"));
    }
    if (tensor->dtype() != FLOAT32) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors: tensor '", name, "' is not FLOAT32"));
    }
    for (int64_t dim : tensor->shape()) {
      if (dim < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("safetensors: tensor '", name, "' has a negative dimension"));
      }
    }
    const uint64_t bytes = static_cast<uint64_t>(Elements(tensor->shape())) * sizeof(float);
    if (tensor->data().size() != bytes) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor '", name, "' holds ",
                                                     tensor->data().size(), " bytes, its shape ",
                                                     bytes));
    }
    nlohmann::ordered_json entry;
    entry["dtype"] = "F32";
    entry["shape"] = std::vector<int64_t>(tensor->shape().begin(), tensor->shape().end());
    entry["data_offsets"] = {offset, offset + bytes};
    header[name] = std::move(entry);
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((kHeaderAlignment - text.size() % kHeaderAlignment) % kHeaderAlignment, ' ');
  std::string out;
  out.reserve(8 + text.size() + offset);
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += text;
  for (const Tensor* tensor : tensors) {
    // FLOAT32 data on the wire is little-endian (proto/tensor.proto), as safetensors' F32.
    out += tensor->data();
  }
  return out;
}

absl::StatusOr<DecodedSafetensors> DecodeSafetensors(absl::string_view bytes) {
  if (bytes.size() < 8) return absl::InvalidArgumentError("safetensors: shorter than 8 bytes");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  if (n > kMaxHeaderBytes || n > bytes.size() - 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors: a header of ", n, " bytes in a file of ", bytes.size()));
  }
  const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n), nullptr,
                                                      /*allow_exceptions=*/false);
  if (!header.is_object()) {
    return absl::InvalidArgumentError("safetensors: the header is not a JSON object");
  }
  const absl::string_view data = bytes.substr(8 + n);
  DecodedSafetensors decoded;
  std::vector<std::pair<uint64_t, Tensor>> by_offset;
  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      if (!entry.is_object()) {
        return absl::InvalidArgumentError("safetensors: __metadata__ is not an object");
      }
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat("safetensors: metadata '", key, "' is not a string"));
        }
        decoded.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    const auto dtype = entry.find("dtype");
    const auto shape = entry.find("shape");
    const auto offsets = entry.find("data_offsets");
    if (!entry.is_object() || dtype == entry.end() || shape == entry.end() ||
        offsets == entry.end() || !shape->is_array() || !offsets->is_array() ||
        offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
        !(*offsets)[1].is_number_unsigned()) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors: tensor '", name, "' lacks dtype, shape or data_offsets"));
    }
    if (*dtype != "F32") {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor '", name,
                                                     "' is ", dtype->dump(), ", not F32"));
    }
    Tensor tensor;
    tensor.set_name(name);
    tensor.set_dtype(FLOAT32);
    uint64_t elements = 1;
    for (const auto& dim : *shape) {
      if (!dim.is_number_unsigned()) {
        return absl::InvalidArgumentError(
            absl::StrCat("safetensors: tensor '", name, "' has a bad dimension"));
      }
      tensor.add_shape(dim.get<int64_t>());
      elements *= dim.get<uint64_t>();
    }
    const uint64_t begin = (*offsets)[0].get<uint64_t>();
    const uint64_t end = (*offsets)[1].get<uint64_t>();
    if (begin > end || end > data.size() || end - begin != elements * sizeof(float)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "safetensors: tensor '", name, "' has data_offsets [", begin, ", ", end,
          ") that do not fit its shape or the file's ", data.size(), " data bytes"));
    }
    tensor.set_data(std::string(data.substr(begin, end - begin)));
    by_offset.emplace_back(begin, std::move(tensor));
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  uint64_t expected = 0;
  for (auto& [begin, tensor] : by_offset) {
    if (begin != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          "safetensors: the data has a hole or an overlap before tensor '", tensor.name(), "'"));
    }
    expected += tensor.data().size();
    decoded.tensors.push_back(std::move(tensor));
  }
  if (expected != data.size()) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: ", data.size() - expected,
                                                   " data bytes after the last tensor"));
  }
  return decoded;
}

}  // namespace rebound
