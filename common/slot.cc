#include "common/slot.h"

#include "absl/strings/str_cat.h"

namespace rebound {

std::string SlotName(const SlotId& slot) {
  return absl::StrCat("(", slot.replica(), ", ", slot.stage(), ")");
}

SlotId Normalized(const SlotId& slot) {
  SlotId out;
  out.set_replica(slot.replica());
  out.set_stage(slot.stage());
  return out;
}

absl::Status CheckSlotInTopology(const SlotId& slot, const TopologyConfig& topology) {
  if (slot.replica() < 0 || slot.replica() >= topology.replicas() || slot.stage() < 0 ||
      slot.stage() >= topology.stages()) {
    return absl::InvalidArgumentError(absl::StrCat("slot ", SlotName(slot), " is outside the ",
                                                   topology.replicas(), " x ",
                                                   topology.stages(), " topology"));
  }
  return absl::OkStatus();
}

}  // namespace rebound
