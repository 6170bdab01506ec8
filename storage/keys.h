#pragma once

// Key layout of the DurableStore's RocksDB column families (docs/design.md §6).
//
// Every integer in a key is fixed-width big-endian, so RocksDB's bytewise order is numeric
// order and a slot's step-log records sort by (replica, stage, step, micro-batch).
//
// | column family | key                                   | bytes | value (in an envelope)  |
// |---------------|---------------------------------------|-------|-------------------------|
// | `center`      | stage u32                             | 4     | rebound.CenterRecord    |
// | `center_opt`  | stage u32                             | 4     | rebound.CenterOptRecord |
// | `snapshot`    | replica u32, stage u32                | 8     | rebound.Snapshot        |
// | `snapshot`    | replica u32, stage u32, copy u8       | 9     | rebound.Snapshot (a     |
// |               |                                       |       | range group's, below)   |
// | `weights`     | replica u32, stage u32                | 8     | rebound.WeightRecord    |
// | `steplog`     | replica u32, stage u32, step u64,     | 20    | rebound.LogRecord       |
// |               | (micro_batch + 1) u32                 |       |                         |
// | `meta`        | "server"                              | 6     | rebound.ServerRecord    |
// | `meta`        | "slot/", replica u32, stage u32       | 13    | rebound.SlotRecord      |
// | `meta`        | "replication"                         | 11    | rebound.ReplicationRecord |
// | `meta`        | "range/", replica u32, stage u32      | 14    | rebound.WeightRecord (a |
// |               |                                       |       | range group's push book)|
//
// The step-log key stores micro_batch + 1 so that the per-step record (micro_batch = -1, the
// step's parameter checksum) is 0 and sorts before micro-batch 0 of the same step. All of a
// slot's log keys share the 8-byte (replica, stage) prefix, so the records of steps [a, b) are
// exactly the keys in [LogKey(r, s, a, -1), LogKey(r, s, b, -1)).
//
// A range group of a sharded job (docs/design.md §10.2) keeps a slot's last two range snapshots,
// copy (sync number mod 2) 0 and 1, under the 9-byte snapshot keys; a server of an unsharded job
// never writes them.
//
// Replica, stage and step are never negative in a key; the encoders require it and the parsers
// reject keys whose fields would not fit their signed types (int32 / int64).
//
// Thread-safety: pure functions of their arguments, safe from any thread. Ownership: they return
// new strings and keep nothing. Errors: no status codes; the parsers return nullopt for a key
// that does not fit (wrong length or prefix, a field out of range) and their callers turn that
// into DATA_LOSS naming the key (DescribeKey); the encoders' REQUIREs are the callers'.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace rebound::storage {

// The column families of the store, besides RocksDB's `default` (which stays empty).
enum class ColumnFamily {
  kCenter = 0,
  kCenterOpt = 1,
  kSnapshot = 2,
  kStepLog = 3,
  kWeights = 4,
  kMeta = 5,
};
inline constexpr int kNumColumnFamilies = 6;

// "center", "center_opt", "snapshot", "steplog", "weights", "meta".
const char* ColumnFamilyName(ColumnFamily family);

inline constexpr size_t kStageKeySize = 4;
inline constexpr size_t kSlotKeySize = 8;
inline constexpr size_t kLogKeySize = 20;
inline constexpr size_t kRangeSnapshotKeySize = 9;
inline constexpr char kServerMetaKey[] = "server";
inline constexpr char kSlotMetaKeyPrefix[] = "slot/";
// A range group's book of a slot's pushes (sharded ASYNC_ADAHESSIAN): its applied sequence.
inline constexpr char kRangeMetaKeyPrefix[] = "range/";
// (epoch, sequence) of the last replicated commit (DurableStore, docs/storage.md).
inline constexpr char kReplicationMetaKey[] = "replication";

// A step-log key's fields.
struct LogKeyFields {
  int32_t replica = 0;
  int32_t stage = 0;
  int64_t step = 0;
  int32_t micro_batch = 0;  // -1 = the per-step record
  // Who wrote the record (pipelines, docs/design.md §5.2): 0 the slot itself (sample ids, checksum);
  // 1 (FORWARD) stage s-1 and 2 (BACKWARD) stage s+1, boundary tensors the slot received.
  int32_t part = 0;

  bool operator==(const LogKeyFields& other) const {
    return replica == other.replica && stage == other.stage && step == other.step &&
           micro_batch == other.micro_batch && part == other.part;
  }
};

// A (replica, stage) key's fields.
struct SlotKeyFields {
  int32_t replica = 0;
  int32_t stage = 0;

  bool operator==(const SlotKeyFields& other) const {
    return replica == other.replica && stage == other.stage;
  }
};

// Key of the `center` and `center_opt` families. REQUIRES: stage >= 0.
std::string EncodeStageKey(int32_t stage);

// Key of the `snapshot` and `weights` families, and the prefix of a slot's step-log keys.
// REQUIRES: replica >= 0, stage >= 0.
std::string EncodeSlotKey(int32_t replica, int32_t stage);

// A range group's snapshot key: EncodeSlotKey(replica, stage) and the copy byte. REQUIRES:
// replica >= 0, stage >= 0, copy in {0, 1}.
std::string EncodeRangeSnapshotKey(int32_t replica, int32_t stage, int copy);

struct RangeSnapshotKeyFields {
  SlotKeyFields slot;
  int copy = 0;
};
std::optional<RangeSnapshotKeyFields> ParseRangeSnapshotKey(absl::string_view key);

// Key of the `steplog` family. REQUIRES: replica >= 0, stage >= 0, micro_batch >= -1,
// part in [0, kMaxLogPart]. `step` is unsigned so that a range bound one past the largest int64
// step is expressible. Part 0 (the slot's own records) is kLogKeySize bytes; a boundary record
// (part 1 or 2) appends one byte, so it sorts right after the slot's own record of the same
// (step, micro-batch) and every key of a step still sorts before the next step's.
std::string EncodeLogKey(int32_t replica, int32_t stage, uint64_t step, int32_t micro_batch,
                         int32_t part = 0);
inline constexpr int32_t kMaxLogPart = 2;

// Key of a slot's SlotRecord in `meta`: "slot/" + EncodeSlotKey(replica, stage).
// REQUIRES: replica >= 0, stage >= 0.
std::string EncodeSlotMetaKey(int32_t replica, int32_t stage);

// Parsers: nullopt when `key` has the wrong length or a field out of range for its type.
std::optional<int32_t> ParseStageKey(absl::string_view key);
std::optional<SlotKeyFields> ParseSlotKey(absl::string_view key);
std::optional<LogKeyFields> ParseLogKey(absl::string_view key);
// Parses a "slot/..." meta key; nullopt for any other meta key.
std::optional<SlotKeyFields> ParseSlotMetaKey(absl::string_view key);
// A range group's push book key: "range/" + EncodeSlotKey(replica, stage), and its parser.
std::string EncodeRangeMetaKey(int32_t replica, int32_t stage);
std::optional<SlotKeyFields> ParseRangeMetaKey(absl::string_view key);

// A readable description of `key` in `family`, for error messages and logs, e.g.
//   "steplog key (r=0, s=1, step=17, mb=3)", "center key (s=2)", "meta key \"server\"",
//   "meta key slot/(r=0, s=1)", or "snapshot key \"\\x00\\x01\" (malformed, 2 bytes)".
std::string DescribeKey(ColumnFamily family, absl::string_view key);

}  // namespace rebound::storage
