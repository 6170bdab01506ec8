#pragma once

// TensorFiles: the bulk bytes of stored tensors, kept outside RocksDB's LSM tree
// (docs/storage.md, "Tensor files").
//
// A center or a snapshot is rewritten whole at every sync; through RocksDB each byte would be
// copied into the WAL, the memtable, an SST file and again by every compaction. Instead each
// record's tensor data is written once, to a fresh file of its own (`<prefix>-<generation>`
// in one directory), and the RocksDB record names the file with its length and checksum
// (TensorBlob). The writer commits the RocksDB record after the file is complete, and removes
// the previous file only after that commit, so the committed record always names a whole file,
// across process crashes and, with fsync, power loss. Files no record names (a write whose
// commit never happened) are removed when the store opens.
//
// The files live in a rocksdb::Env: the default (POSIX) one on disk, the store's private
// MemEnv in memory.
//
// Thread safety: Write, Read and Remove may run concurrently on different files; what a
// caller reads must not be removed meanwhile (DurableStore orders this with its own lock).
// Ownership: the rocksdb::Env is borrowed and must outlive the TensorFiles.
//
// Errors: RESOURCE_EXHAUSTED when the disk is full, UNAVAILABLE for other I/O errors (creating,
// listing, writing), DATA_LOSS naming the record and the file for a tensor file that is
// missing, has the wrong length or fails its checksum.

#include <atomic>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "proto/tensor.pb.h"

namespace rocksdb {
class Env;
}  // namespace rocksdb

namespace rebound::storage {

class TensorFiles {
 public:
  // `dir` in `env`; with `fsync` every written file and the directory entry are synced before
  // Write returns.
  TensorFiles(rocksdb::Env* env, std::string dir, bool fsync);

  TensorFiles(const TensorFiles&) = delete;
  TensorFiles& operator=(const TensorFiles&) = delete;

  // Creates the directory if missing, removes (if `remove_unreferenced`) every file in it that
  // is not in `referenced` (file names as in TensorBlob.file), and numbers the next files after
  // the highest generation found. UNAVAILABLE on I/O errors.
  absl::Status Open(const std::set<std::string>& referenced, bool remove_unreferenced);

  // Writes `parts` back to back to a new file named `<prefix>-<generation>` and returns its
  // TensorBlob. If `reuse` names a file no record refers to any more, that file is renamed and
  // overwritten in place (no new disk blocks or page-cache pages to allocate, none to free),
  // else a file is created. The file is complete (and synced, with fsync) when this returns OK;
  // on error nothing is left behind (nor `reuse`). RESOURCE_EXHAUSTED when the disk is full,
  // else UNAVAILABLE.
  absl::StatusOr<TensorBlob> Write(absl::string_view prefix,
                                   absl::Span<const absl::string_view> parts,
                                   const std::string& reuse = "");

  // Reads the file of `blob` into `parts` (resized to blob.part_bytes, one string each) and
  // verifies length and checksum. DATA_LOSS naming `what` and the file if the file is missing,
  // shorter or longer than recorded, or its bytes do not match the checksum.
  // REQUIRES: parts.size() == blob.part_bytes_size().
  absl::Status Read(const TensorBlob& blob, absl::Span<std::string* const> parts,
                    absl::string_view what) const;

  // Removes a file, logging (not returning) a failure: a leftover file is removed at the next
  // Open.
  void Remove(const std::string& file);

  // Total bytes of the files in the directory (for Stats).
  absl::StatusOr<uint64_t> TotalBytes() const;

  const std::string& dir() const { return dir_; }

 private:
  std::string PathOf(absl::string_view file) const;

  rocksdb::Env* const env_;
  const std::string dir_;
  const bool fsync_;
  std::atomic<uint64_t> next_generation_{1};
};

}  // namespace rebound::storage
