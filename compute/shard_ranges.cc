#include "compute/shard_ranges.h"

#include "absl/strings/str_cat.h"
#include "proto/tensor.pb.h"

namespace rebound::compute {

std::vector<int64_t> RangeBegins(int64_t n, int groups) {
  std::vector<int64_t> begins;
  begins.reserve(groups + 1);
  for (int k = 0; k <= groups; ++k) begins.push_back(RangeBegin(n, groups, k));
  return begins;
}

absl::StatusOr<StageLayout> RangeLayout(int stage, int64_t n, int groups, int k) {
  if (groups < 1 || k < 0 || k >= groups) {
    return absl::InvalidArgumentError(
        absl::StrCat("range ", k, " of ", groups, " groups does not exist"));
  }
  const int64_t size = RangeBegin(n, groups, k + 1) - RangeBegin(n, groups, k);
  if (size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage ", stage, " has ", n, " parameters, fewer than sharding.groups = ",
                     groups, ": range ", k, " would be empty"));
  }
  TensorBundle declared;
  Tensor* tensor = declared.add_tensors();
  tensor->set_id(0);
  tensor->set_name(absl::StrCat("stage", stage, ".range", k));
  tensor->set_dtype(FLOAT32);
  tensor->add_shape(size);
  return StageLayout::FromDeclared(declared);
}

}  // namespace rebound::compute
