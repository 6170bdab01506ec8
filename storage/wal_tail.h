#pragma once

// Tells a write torn by a crash at the end of a RocksDB write-ahead log from damage to it.
//
// RocksDB 7.x (db/log_format.h) writes a WAL file as 32 KiB blocks of physical records:
//
//   masked crc32c (4, little endian) | length (2, little endian) | type (1) | payload (length)
//
// The crc covers the type byte and the payload, not the length. A logical record (one write
// batch) longer than the rest of its block is split into FIRST, MIDDLE..., LAST fragments; a
// block's last bytes, when fewer than a header, are zero padding. Types 5-8 ("recyclable") have
// an 11-byte header with the log number; RocksDB writes them only with recycle_log_file_num,
// which the store does not set, and this unit does not judge them.
//
// A process killed (SIGKILL, the OOM killer) while RocksDB appends a record leaves the file
// ending inside that record. Such a record was never acknowledged: RocksDB's Write returns only
// after every byte of it was written (and synced, with fsync), and a killed process loses nothing
// it wrote to the page cache. Recovery in absolute consistency still refuses the directory,
// reporting for that file one of the torn-tail kinds (db/log_reader.cc):
//
//   "truncated header"             fewer bytes than a header before the end of the file;
//   "error reading trailing data"  the file ends after a FIRST or MIDDLE fragment; every fragment
//                                  read was checksummed, type byte included, so no bit flip
//                                  makes one;
//   "truncated record body"        a header whose length runs past the end of the file: a torn
//                                  write, or a complete record whose length field was damaged.
//
// ClassifyWalDamage accepts a report as a torn write only if every drop is one of these, all in
// the newest WAL file, and the file's end agrees; for "truncated record body" it proves the record
// incomplete: no prefix of the bytes present carries the record's checksum (a complete record
// with a damaged length would match at its true length). Anything else is damage.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace rebound::storage {

// CRC-32C (Castagnoli) of `data`, as RocksDB's crc32c::Value computes it.
uint32_t Crc32c(absl::string_view data);

// The checksum as a WAL header stores it: RocksDB's crc32c::Mask of Crc32c(type byte + payload).
uint32_t MaskedRecordCrc(uint8_t type, absl::string_view payload);

// One line in which RocksDB's WAL recovery reports what it dropped:
// "[db/db_impl/db_impl_open.cc:982] <wal_dir>/000012.log: dropping 93 bytes; Corruption:
// checksum mismatch" (the source position is optional).
struct WalDrop {
  std::string file;    // the WAL file, as RocksDB names it
  int64_t bytes = 0;   // how many bytes it dropped
  std::string reason;  // "checksum mismatch", "truncated record body", ...
};

// The drop a RocksDB info-log line reports; nullopt for any other line.
std::optional<WalDrop> ParseWalDrop(absl::string_view line);

// How a WAL file's last physical record ends.
enum class WalEnd {
  kWhole,          // at a record boundary
  kTornHeader,     // after fewer bytes than a header
  kTornRecord,     // inside a record whose length runs past the end of the file, and no prefix
                   // of the bytes present carries its checksum: a write cut short
  kDamagedLength,  // inside a record whose length runs past the end of the file, but a prefix of
                   // the bytes present carries its checksum: a complete record, its length
                   // field damaged
  kNotJudged,      // a recyclable record (types 5-8) or a zero header: not judged
};

// How the WAL file whose last, partial block is `last_block` ends.
// REQUIRES: `last_block` holds the file's bytes from its last multiple of 32 KiB to its end
// (empty when the size is such a multiple).
WalEnd InspectLastBlock(absl::string_view last_block);

// The verdict on a failed WAL recovery.
struct WalDamage {
  // True when the damage is only a write torn by a crash at the end of the newest WAL file,
  // which was never acknowledged; recovering up to it (point-in-time recovery) loses no
  // acknowledged write.
  bool torn_write = false;
  std::string file;           // the newest WAL file (when torn_write)
  int64_t dropped_bytes = 0;  // the bytes RocksDB reported dropping from it (when torn_write)
  std::string reasons;        // RocksDB's reasons, "; "-separated (when torn_write)
  std::string why_not;        // why it is not taken for a torn write (when !torn_write)
};

// Judges what RocksDB reported (`drop_lines`, as RocksDB's info log wrote them) while failing to
// recover the WAL files in `wal_dir`, reading the newest one's last block.
WalDamage ClassifyWalDamage(const std::vector<std::string>& drop_lines,
                            const std::string& wal_dir);

}  // namespace rebound::storage
