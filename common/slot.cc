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

}  // namespace rebound
