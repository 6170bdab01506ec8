#pragma once

// A sharded center's slot snapshot, joined from its ranges (docs/design.md §10.2,
// docs/sharding.md): every server group keeps range k of each slot's snapshot (params and the
// AdaHessian state m, v, last D, as compute/shard_ranges.h splits a stage's packed vector), and
// what replays it (a spare's recovery, group 0's audit of a window) needs the whole stage. One
// join for both: worker/range_client.cc's FillSnapshot and server/log_retention.cc's HoldAudit.
//
// Thread-safety: pure function. Status codes: INVALID_ARGUMENT for a part of another step, a
// part whose tensors do not fit its range (or are not finite), or an optimizer state that some
// ranges hold and others do not.

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "compute/model_layout.h"
#include "proto/rebound.pb.h"

namespace rebound::compute {

// Fills `snapshot`'s params and optimizer m, v and last_hdiag (its slot, step and data cursor
// are kept) from `parts`, where parts[k] is range k's snapshot (CenterRange.ReadRangeSnapshot's
// answer) and parts.size() is the number of groups. Each optimizer part is joined when every
// range holds it and left empty when none does (a client that cannot export its optimizer's
// state sends none; a replay then restarts from the center, docs/python.md).
// REQUIRES: `layout` is the stage of snapshot->slot().
absl::Status JoinRangeSnapshots(const StageLayout& layout, absl::Span<const Snapshot> parts,
                                Snapshot* snapshot);

}  // namespace rebound::compute
