#pragma once

// The durable record of one EASGD sync (docs/design.md §4.4, §5.2, §6), as one write batch: the
// stage's new center, the slot's snapshot (its post-sync parameters and the optimizer state the
// worker sent), the slot's weight record, and the GC of the step log the snapshot covers.
//
// Thread-safety: a pure function of its arguments. Ownership: see AddSyncToBatch (the batch
// references the tensors it is given). Status codes: none (the batch's Commit reports errors).

#include <cstdint>

#include "absl/types/span.h"
#include "compute/model_layout.h"
#include "proto/rebound.pb.h"
#include "proto/storage.pb.h"
#include "storage/durable_store.h"

namespace rebound::server {

// Copies the tensors' metadata of `from` to `to` and appends views of their bytes to `data`
// (the bytes stay `from`'s).
void AddHeaderAndViews(const TensorBundle& from, TensorBundle* to,
                       std::vector<absl::string_view>* data);

// Adds the center of `stage` at `version` and its AdaHessian state (step `opt_step`, m, v) to
// `batch`: the records of an applied push (mode ASYNC_ADAHESSIAN). The tensors are referenced:
// the spans must stay valid until the batch's last Commit returns.
void AddCenterAndOptToBatch(const compute::StageLayout& layout, int stage, int64_t version,
                            absl::Span<const float> center, int64_t opt_step,
                            absl::Span<const float> m, absl::Span<const float> v,
                            storage::WriteBatch* batch);

// Adds the sync's records to `batch`. The tensors are referenced, not copied (the store writes
// them to tensor files from where they are): `center`, `worker_after` and `request` must stay
// valid and unchanged until the batch's last Commit returns. `slot` is the normalized slot of
// the request; `center` the stage's center after the move, at `version`. The GC deletes the
// slot's step log through `log_gc_step` (-1: the request's step; a pipeline slot in a recovery
// group of several stages keeps its log back to the group's oldest snapshot, docs/design.md §5.2),
// from `log_gc_from` on: the slot's previous floor, below which an earlier sync deleted the log
// already (a range from step 0 at every sync would pile up overlapping range deletions, which
// RocksDB replays ever more slowly when it opens the store).
void AddSyncToBatch(const compute::StageLayout& layout, const SlotId& slot,
                    const SyncRequest& request, int64_t version, absl::Span<const float> center,
                    absl::Span<const float> worker_after, const WeightRecord& weight,
                    storage::WriteBatch* batch, int64_t log_gc_step = -1,
                    int64_t log_gc_from = 0);

}  // namespace rebound::server
