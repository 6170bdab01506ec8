#pragma once

// The whole center as an export (docs/design.md §12): each stage's tensors named and shaped
// (CenterTable::Bundle: a declared model's own names, the built-in MLP's layer<l>.weight and
// layer<l>.bias) at a committed version. Stages have versions of their own (each syncs on its
// own), so a multi-stage export names each stage's version. What the ExportCenter call answers
// and what the periodic exports (server/periodic_export.h) write.
//
// An unsharded job (ReadCenterExport): each stage's center read under its stage lock
// (CenterTable::Read).
//
// A sharded job (ReadShardedCenterExport, docs/sharding.md#exporting-the-center): group 0 holds
// range 0 only; each stage is joined from its K ranges, read at once (`read_ranges`: range 0 in
// process, the others by CenterRange.ExportRange). Each range's read names what it had applied:
// every slot's last sync step and push sequence. A stage is answered only when all K ranges name
// the same ones, i.e. hold the same syncs and pushes (every range applies every sync, so a range
// that differs has a sync in flight that the others have not reached yet); otherwise the stage's
// ranges are read again, with a growing pause, until `deadline`.
//
// Thread-safety: as CenterTable::Read (any thread); `read_ranges` must be callable from it.
// Status codes: FAILED_PRECONDITION when there is no model yet (a declared model before its
// first worker registered); CenterTable::Read's errors. Sharded: a range's refusal with its code
// (PERMISSION_DENIED, UNAUTHENTICATED: the operator token), its message naming the range;
// UNAVAILABLE naming the range when one did not answer by `deadline`; DEADLINE_EXCEEDED naming
// the stage, slot and ranges when the ranges still held different syncs at `deadline`;
// DATA_LOSS when a range's size is not its range of the stage.

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "compute/model_layout.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "proto/sharding.pb.h"
#include "server/center_table.h"

namespace rebound::server {

absl::StatusOr<ExportCenterResponse> ReadCenterExport(const JobConfig& job,
                                                      const CenterTable& centers,
                                                      const std::string& server_version);

// Reads range k of `stage` for every k in [0, K), all by `deadline`: result[k] is range k's
// answer or its error (whose message names the range).
using StageRangesRead = std::function<std::vector<absl::StatusOr<ExportRangeResponse>>(
    int stage, absl::Time deadline)>;

// `centers` is group 0's table (range 0; the declared model's declaration). `clock` times the
// pauses between reads.
absl::StatusOr<ExportCenterResponse> ReadShardedCenterExport(const JobConfig& job,
                                                             const CenterTable& centers,
                                                             const StageRangesRead& read_ranges,
                                                             absl::Time deadline,
                                                             const Clock& clock,
                                                             const std::string& server_version);

// OK iff the K reads of `stage` name the same applied syncs and pushes for every slot (a range
// that does not know a declared model yet has applied none); otherwise UNAVAILABLE naming the
// stage, the first slot and two ranges that differ.
absl::Status SameUpdatesInEveryRange(const JobConfig& job, int stage,
                                     const std::vector<ExportRangeResponse>& ranges);

// The whole layout of stage `stage` (every range's): the job's MLP stage or its declared model
// (FAILED_PRECONDITION before the model is declared). A sharded group's table holds its range.
absl::StatusOr<compute::StageLayout> WholeStageLayout(const JobConfig& job,
                                                      const CenterTable& centers, int stage);

// The stage joined from its K ranges (range k = elements [floor(k n / K), floor((k+1) n / K))
// of the packed vector), named and shaped as an unsharded job's export; center_version is range
// 0's, range_versions every range's. A range that does not know a declared model yet is its
// slice of the declaration. DATA_LOSS when a range's size is not its range's.
absl::StatusOr<ExportedStage> JoinRanges(const JobConfig& job, const CenterTable& centers,
                                         int stage,
                                         const std::vector<ExportRangeResponse>& ranges);

}  // namespace rebound::server
