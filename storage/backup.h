#pragma once

// An online backup of a server's durable state, as an operator keeps it
// (docs/operations.md#backup-and-restore): a directory holding the store's checkpoint (what
// ParameterServer.Backup streams: RocksDB's files and tensors/, server/checkpoint_transfer.h)
// and MANIFEST.json:
//
//   {"format": "rebound-backup", "format_version": 1, "epoch": E, "sequence": S,
//    "server_version": "...", "created_unix_ms": T, "data_format_version": F,
//    "files": [{"path": "tensors/center-s0-12", "bytes": N, "xxh64": "0123abcd..."}, ...]}
//
// `reboundctl backup DIR` writes it (WriteBackupManifest after the stream); `rebound_server
// --restore_from DIR` checks it (VerifyBackup) and copies the files into an empty data
// directory (RestoreBackup), which then opens at (E, S).
//
// `format_version` is the manifest's own format; `data_format_version` that of the store's files
// (storage/format_version.h: the server's, as the Backup stream says it; a manifest without it is
// from before 0.13: format 1), which a restore records as the data directory's FORMAT.
//
// Thread-safety: stateless functions. Status codes: FAILED_PRECONDITION for a directory without
// a manifest, a newer format_version or data_format_version, or a data directory that is not
// empty; DATA_LOSS naming
// the file that is missing, of another size or checksum, or not in the manifest; UNAVAILABLE /
// RESOURCE_EXHAUSTED for I/O errors, naming the path.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "storage/format_version.h"

namespace rebound::storage {

inline constexpr char kBackupManifest[] = "MANIFEST.json";
inline constexpr int kBackupFormatVersion = 1;

struct BackupInfo {
  uint64_t epoch = 0;     // the position the backup holds (the store's LastApplied)
  uint64_t sequence = 0;
  std::string server_version;
  int64_t created_unix_ms = 0;
  int data_format_version = kUnrecordedDataFormat;  // of the store's files
  int64_t files = 0;      // listed in the manifest
  int64_t bytes = 0;      // their sizes, summed
};

// Lists every file under `dir` (but the manifest) with its size and xxHash64 and writes the
// manifest with `info`'s position and version (files and bytes are filled in; returned).
absl::StatusOr<BackupInfo> WriteBackupManifest(const std::string& dir, const BackupInfo& info);

// Reads the manifest of `dir` and checks every file against it; no file may be missing, differ,
// or be there without being listed.
absl::StatusOr<BackupInfo> VerifyBackup(const std::string& dir);

// VerifyBackup(backup_dir), then copies its files into `data_dir`, which must not exist or be
// empty (a restore never overwrites state), through "<data_dir>.restoring" renamed into place,
// and checks that the store opens there at the manifest's position.
absl::StatusOr<BackupInfo> RestoreBackup(const std::string& backup_dir,
                                         const std::string& data_dir);

}  // namespace rebound::storage
