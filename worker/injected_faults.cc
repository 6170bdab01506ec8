#include "worker/injected_faults.h"

#include <glog/logging.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_format.h"
#include "common/rng.h"
#include "common/status_macros.h"
#include "compute/model_layout.h"
#include "worker/data/fashion_mnist.h"

namespace rebound::worker {

// Fault injection, a byzantine trainer: from step faults.poison_from_step on, `values` become
// +value, -value, +value, ... (returns whether it did).
bool MaybePoison(const InjectedFaults& faults, int64_t t, std::vector<float>* values) {
  if (faults.poison_from_step <= 0 || t < faults.poison_from_step) return false;
  for (size_t i = 0; i < values->size(); ++i) {
    (*values)[i] = i % 2 == 0 ? faults.poison_value : -faults.poison_value;
  }
  LOG(WARNING) << "FAULT INJECTION: poisoned update at step " << t << " (every value +-"
               << faults.poison_value << ")";
  return true;
}

// The labels a trainer sees under fault injection: perm[y] for a fixed random permutation of the
// classes; empty (labels unchanged) without it.
std::vector<int32_t> InjectedLabelMap(const InjectedFaults& faults) {
  std::vector<int32_t> label_map;
  if (faults.label_permutation_seed == 0) return label_map;
  label_map.resize(kFashionMnistClasses);
  for (int i = 0; i < kFashionMnistClasses; ++i) label_map[i] = i;
  const RngStream stream{faults.label_permutation_seed, 0, 0, 0, kRngShuffle};
  for (int i = kFashionMnistClasses - 1; i > 0; --i) {
    std::swap(label_map[i], label_map[RngWord(stream, i) % (i + 1)]);
  }
  LOG(WARNING) << "FAULT INJECTION: this trainer's labels are permuted";
  return label_map;
}

bool FlipsBitAt(const InjectedFaults& faults, int64_t t) {
  const int64_t first = faults.flip_bit_at_step;
  if (first <= 0 || t < first) return false;
  if (faults.flip_bit_repeat_every <= 0) return t == first;
  return (t - first) % faults.flip_bit_repeat_every == 0;
}

int64_t FlippedParameter(int64_t t, int64_t count) {
  return static_cast<int64_t>((static_cast<uint64_t>(t) * uint64_t{2654435761}) %
                              static_cast<uint64_t>(count));
}

absl::StatusOr<bool> MaybeFlipBit(const InjectedFaults& faults, int64_t t,
                                  compute::MlpStage* stage) {
  if (!FlipsBitAt(faults, t)) return false;
  const compute::StageLayout& layout = stage->layout();
  std::vector<float> params(layout.packed_size());
  RETURN_IF_ERROR(stage->GetParams(absl::MakeSpan(params)));
  const int64_t i = FlippedParameter(t, layout.packed_size());
  const float before = params[i];
  uint32_t bits;
  std::memcpy(&bits, &params[i], sizeof(bits));
  bits ^= kFlippedBitMask;
  std::memcpy(&params[i], &bits, sizeof(bits));
  RETURN_IF_ERROR(stage->SetParams(params));
  std::string tensor = "?";
  for (const compute::TensorInfo& info : layout.tensors()) {
    if (i >= info.packed_offset && i < info.packed_offset + info.size()) tensor = info.name;
  }
  LOG(ERROR) << "fault injection: flipped bit 12 of parameter " << i << " (tensor " << tensor
             << ") after step " << t << ": " << absl::StrFormat("%.9g -> %.9g", before, params[i]);
  return true;
}

// Fault injection, a naive supervisor's restart before step t (when one is due): fresh random
// parameters (the `resets`-th draw of this replica), zero optimizer state.
absl::Status MaybeResetFromScratch(const InjectedFaults& faults, int64_t t, const JobConfig& job,
                                   const SlotId& slot, int64_t* resets,
                                   compute::LocalTrainer* trainer) {
  if (faults.reset_every_steps <= 0 || t <= 1 || (t - 1) % faults.reset_every_steps != 0) {
    return absl::OkStatus();
  }
  const compute::StageLayout& layout = trainer->stage(0).layout();
  ModelSpec fresh = job.model();
  fresh.set_init_seed(job.model().init_seed() + 7919 * (++*resets) + 104729 * slot.replica());
  std::vector<float> padded(layout.padded_size());
  std::vector<float> packed(layout.packed_size());
  RETURN_IF_ERROR(compute::InitParams(fresh, layout, absl::MakeSpan(padded)));
  RETURN_IF_ERROR(layout.Pack(padded, absl::MakeSpan(packed)));
  RETURN_IF_ERROR(trainer->stage(0).SetParams(packed));
  std::fill(packed.begin(), packed.end(), 0.0f);
  RETURN_IF_ERROR(trainer->optimizer(0).SetState(packed, packed, packed));
  LOG(WARNING) << "FAULT INJECTION: restarted from scratch at step " << t;
  return absl::OkStatus();
}

}  // namespace rebound::worker
