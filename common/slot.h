#pragma once

// The two ways every part of the product writes a slot id.

#include <string>

#include "proto/rebound.pb.h"

namespace rebound {

// "(replica, stage)", for log lines and error messages.
std::string SlotName(const SlotId& slot);

// A SlotId with both fields explicitly set (storage keys and stored records require it), from
// one whose unset fields read as 0.
SlotId Normalized(const SlotId& slot);

}  // namespace rebound
