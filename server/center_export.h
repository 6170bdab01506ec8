#pragma once

// The whole center of an unsharded job as an export (DESIGN.md §12): each stage's center read
// under its stage lock at a committed version (CenterTable::Read), named and shaped
// (CenterTable::Bundle). Stages have versions of their own (each syncs on its own), so a
// multi-stage export names each stage's version. What the ExportCenter call answers and what
// the periodic exports (server/periodic_export.h) write.
//
// Thread-safety: as CenterTable::Read (any thread).
// Status codes: FAILED_PRECONDITION when there is no model yet (a declared model before its
// first worker registered); CenterTable::Read's errors.

#include <string>

#include "absl/status/statusor.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "server/center_table.h"

namespace rebound::server {

absl::StatusOr<ExportCenterResponse> ReadCenterExport(const JobConfig& job,
                                                      const CenterTable& centers,
                                                      const std::string& server_version);

}  // namespace rebound::server
