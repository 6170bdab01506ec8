#pragma once

// The format of a server's data directory (docs/upgrading.md#the-data-directory-format): a
// number recorded in <data_dir>/FORMAT, so that a server never opens a directory whose layout it
// does not know.
//
//   FORMAT:  "rebound data directory format 1\n"
//
// It says how to read the directory as a whole: the column families and key layout of
// storage/keys.h, the record envelopes, tensors/. A change a reader of an older release would
// misread raises kDataFormatVersion; additions an older release ignores (a new column family, a
// new optional proto field) do not.
//
// Formats:
//   1  rebound 0.13 (and, without the FORMAT file, every release before it: 0.12 and older
//      wrote the same layout but did not record it).
//
// OpenDataDir is how the server opens its store (a single server, a standby, a standby's
// catch-up): before RocksDB touches the directory it reads FORMAT and refuses a newer format
// with FAILED_PRECONDITION naming the directory, both formats and what to do; an older one (or
// a directory without FORMAT: format 1) is opened, migrated step by step to the current format
// and then recorded; a new directory is recorded as the current format. FORMAT is written after
// the store opened (so a directory RocksDB refuses is left as it was), atomically and durably.
//
// Backups (storage/backup.h) record the format in their manifest and a restore writes FORMAT.
//
// Status codes: FAILED_PRECONDITION for a newer format; DATA_LOSS for a FORMAT file that is not
// what this unit writes; UNAVAILABLE for I/O errors naming the path; the store's Open errors.
// Thread-safety: stateless functions; the caller opens a directory once (the store's lock).

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "storage/durable_store.h"

namespace rebound::storage {

inline constexpr int kDataFormatVersion = 1;
// The format of a directory without FORMAT (made by rebound 0.12 or older).
inline constexpr int kUnrecordedDataFormat = 1;
inline constexpr char kDataFormatFile[] = "FORMAT";

// The format recorded in `data_dir`; nullopt when the directory or its FORMAT file is missing.
absl::StatusOr<std::optional<int>> ReadDataFormat(const std::string& data_dir);

// Records `format` in `data_dir` (which must exist): "<data_dir>/FORMAT.tmp", fsynced, renamed.
absl::Status WriteDataFormat(const std::string& data_dir, int format);

// FAILED_PRECONDITION when `data_dir` records a format newer than `current`, else OK (also for
// a missing directory or FORMAT file). The message says what to do:
//   "data directory /d has format 2, newer than format 1 that rebound 0.13.0 reads: it was
//    written by a newer Rebound. Run that release (or a newer one) on it, or start this one
//    on a backup made before the upgrade (docs/upgrading.md#the-data-directory-format)"
absl::Status CheckDataFormat(const std::string& data_dir, int current = kDataFormatVersion);

// One step of a migration: rewrites an open store of format `from` to format `from + 1`.
struct DataFormatMigration {
  int from = 0;
  std::function<absl::Status(DurableStore*)> migrate;
};

// Opens the server's store as described above. With an empty data_dir (in memory) this is
// DurableStore::Open.
absl::StatusOr<std::unique_ptr<DurableStore>> OpenDataDir(const DurableStoreOptions& options);

// OpenDataDir with another current format and migration steps (tests).
absl::StatusOr<std::unique_ptr<DurableStore>> OpenDataDir(
    const DurableStoreOptions& options, int current,
    const std::vector<DataFormatMigration>& migrations);

}  // namespace rebound::storage
