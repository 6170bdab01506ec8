#pragma once

// The two ways every part of the product writes a slot id.

#include <string>

#include "absl/status/status.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"

namespace rebound {

// "(replica, stage)", for log lines and error messages.
std::string SlotName(const SlotId& slot);

// OK iff `slot` lies inside the R x S grid of `topology`; INVALID_ARGUMENT "slot (r, s) is
// outside the R x S topology" otherwise.
absl::Status CheckSlotInTopology(const SlotId& slot, const TopologyConfig& topology);

// A SlotId with both fields explicitly set (storage keys and stored records require it), from
// one whose unset fields read as 0.
SlotId Normalized(const SlotId& slot);

}  // namespace rebound
