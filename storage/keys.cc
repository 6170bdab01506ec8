#include "storage/keys.h"

#include <cassert>
#include <limits>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_format.h"

namespace rebound::storage {
namespace {

void AppendU32(std::string* out, uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) {
    out->push_back(static_cast<char>((value >> shift) & 0xff));
  }
}

void AppendU64(std::string* out, uint64_t value) {
  for (int shift = 56; shift >= 0; shift -= 8) {
    out->push_back(static_cast<char>((value >> shift) & 0xff));
  }
}

uint32_t ReadU32(absl::string_view bytes) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value = (value << 8) | static_cast<unsigned char>(bytes[i]);
  return value;
}

uint64_t ReadU64(absl::string_view bytes) {
  uint64_t value = 0;
  for (int i = 0; i < 8; ++i) value = (value << 8) | static_cast<unsigned char>(bytes[i]);
  return value;
}

constexpr uint32_t kMaxInt32 = static_cast<uint32_t>(std::numeric_limits<int32_t>::max());
constexpr uint64_t kMaxInt64 = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

std::optional<int32_t> ReadNonNegativeInt32(absl::string_view bytes) {
  const uint32_t value = ReadU32(bytes);
  if (value > kMaxInt32) return std::nullopt;
  return static_cast<int32_t>(value);
}

std::string Malformed(ColumnFamily family, absl::string_view key) {
  return absl::StrFormat("%s key \"%s\" (malformed, %d bytes)", ColumnFamilyName(family),
                         absl::CHexEscape(key), key.size());
}

}  // namespace

const char* ColumnFamilyName(ColumnFamily family) {
  switch (family) {
    case ColumnFamily::kCenter:
      return "center";
    case ColumnFamily::kCenterOpt:
      return "center_opt";
    case ColumnFamily::kSnapshot:
      return "snapshot";
    case ColumnFamily::kStepLog:
      return "steplog";
    case ColumnFamily::kWeights:
      return "weights";
    case ColumnFamily::kMeta:
      return "meta";
  }
  return "unknown";
}

std::string EncodeStageKey(int32_t stage) {
  assert(stage >= 0);
  std::string key;
  key.reserve(kStageKeySize);
  AppendU32(&key, static_cast<uint32_t>(stage));
  return key;
}

std::string EncodeSlotKey(int32_t replica, int32_t stage) {
  assert(replica >= 0 && stage >= 0);
  std::string key;
  key.reserve(kSlotKeySize);
  AppendU32(&key, static_cast<uint32_t>(replica));
  AppendU32(&key, static_cast<uint32_t>(stage));
  return key;
}

std::string EncodeRangeSnapshotKey(int32_t replica, int32_t stage, int copy) {
  assert(copy == 0 || copy == 1);
  std::string key = EncodeSlotKey(replica, stage);
  key.push_back(static_cast<char>(copy));
  return key;
}

std::optional<RangeSnapshotKeyFields> ParseRangeSnapshotKey(absl::string_view key) {
  if (key.size() != kRangeSnapshotKeySize) return std::nullopt;
  const int copy = static_cast<unsigned char>(key.back());
  if (copy > 1) return std::nullopt;
  std::optional<SlotKeyFields> slot = ParseSlotKey(key.substr(0, kSlotKeySize));
  if (!slot.has_value()) return std::nullopt;
  return RangeSnapshotKeyFields{*slot, copy};
}

std::string EncodeLogKey(int32_t replica, int32_t stage, uint64_t step, int32_t micro_batch,
                         int32_t part) {
  assert(replica >= 0 && stage >= 0 && micro_batch >= -1 && part >= 0 && part <= kMaxLogPart);
  std::string key;
  key.reserve(kLogKeySize + 1);
  AppendU32(&key, static_cast<uint32_t>(replica));
  AppendU32(&key, static_cast<uint32_t>(stage));
  AppendU64(&key, step);
  AppendU32(&key, static_cast<uint32_t>(static_cast<int64_t>(micro_batch) + 1));
  if (part != 0) key.push_back(static_cast<char>(part));
  return key;
}

std::string EncodeSlotMetaKey(int32_t replica, int32_t stage) {
  std::string key = kSlotMetaKeyPrefix;
  key += EncodeSlotKey(replica, stage);
  return key;
}

std::optional<int32_t> ParseStageKey(absl::string_view key) {
  if (key.size() != kStageKeySize) return std::nullopt;
  return ReadNonNegativeInt32(key);
}

std::optional<SlotKeyFields> ParseSlotKey(absl::string_view key) {
  if (key.size() != kSlotKeySize) return std::nullopt;
  std::optional<int32_t> replica = ReadNonNegativeInt32(key.substr(0, 4));
  std::optional<int32_t> stage = ReadNonNegativeInt32(key.substr(4, 4));
  if (!replica.has_value() || !stage.has_value()) return std::nullopt;
  return SlotKeyFields{*replica, *stage};
}

std::optional<LogKeyFields> ParseLogKey(absl::string_view key) {
  int32_t part = 0;
  if (key.size() == kLogKeySize + 1) {
    part = static_cast<unsigned char>(key.back());
    if (part < 1 || part > kMaxLogPart) return std::nullopt;
  } else if (key.size() != kLogKeySize) {
    return std::nullopt;
  }
  std::optional<SlotKeyFields> slot = ParseSlotKey(key.substr(0, kSlotKeySize));
  if (!slot.has_value()) return std::nullopt;
  const uint64_t step = ReadU64(key.substr(8, 8));
  const uint32_t micro_batch_plus_one = ReadU32(key.substr(16, 4));
  // micro_batch + 1 lies in [0, INT32_MAX + 1].
  if (step > kMaxInt64 || micro_batch_plus_one > kMaxInt32 + 1u) return std::nullopt;
  return LogKeyFields{slot->replica, slot->stage, static_cast<int64_t>(step),
                      static_cast<int32_t>(static_cast<int64_t>(micro_batch_plus_one) - 1),
                      part};
}

std::string EncodeRangeMetaKey(int32_t replica, int32_t stage) {
  std::string key = kRangeMetaKeyPrefix;
  key += EncodeSlotKey(replica, stage);
  return key;
}

std::optional<SlotKeyFields> ParseRangeMetaKey(absl::string_view key) {
  if (!absl::ConsumePrefix(&key, kRangeMetaKeyPrefix)) return std::nullopt;
  return ParseSlotKey(key);
}

std::optional<SlotKeyFields> ParseSlotMetaKey(absl::string_view key) {
  if (!absl::ConsumePrefix(&key, kSlotMetaKeyPrefix)) return std::nullopt;
  return ParseSlotKey(key);
}

std::string DescribeKey(ColumnFamily family, absl::string_view key) {
  const char* name = ColumnFamilyName(family);
  switch (family) {
    case ColumnFamily::kCenter:
    case ColumnFamily::kCenterOpt: {
      std::optional<int32_t> stage = ParseStageKey(key);
      if (!stage.has_value()) return Malformed(family, key);
      return absl::StrFormat("%s key (s=%d)", name, *stage);
    }
    case ColumnFamily::kSnapshot:
      if (key.size() == kRangeSnapshotKeySize) {
        std::optional<RangeSnapshotKeyFields> range = ParseRangeSnapshotKey(key);
        if (!range.has_value()) return Malformed(family, key);
        return absl::StrFormat("%s key (r=%d, s=%d, range copy %d)", name, range->slot.replica,
                               range->slot.stage, range->copy);
      }
      [[fallthrough]];
    case ColumnFamily::kWeights: {
      std::optional<SlotKeyFields> slot = ParseSlotKey(key);
      if (!slot.has_value()) return Malformed(family, key);
      return absl::StrFormat("%s key (r=%d, s=%d)", name, slot->replica, slot->stage);
    }
    case ColumnFamily::kStepLog: {
      std::optional<LogKeyFields> log = ParseLogKey(key);
      if (!log.has_value()) return Malformed(family, key);
      return absl::StrFormat("%s key (r=%d, s=%d, step=%d, mb=%d%s)", name, log->replica,
                             log->stage, log->step, log->micro_batch,
                             log->part == 1   ? ", forward"
                             : log->part == 2 ? ", backward"
                                              : "");
    }
    case ColumnFamily::kMeta: {
      if (key == kServerMetaKey) return absl::StrFormat("%s key \"%s\"", name, kServerMetaKey);
      if (absl::StartsWith(key, kRangeMetaKeyPrefix)) {
        std::optional<SlotKeyFields> slot = ParseRangeMetaKey(key);
        if (!slot.has_value()) return Malformed(family, key);
        return absl::StrFormat("%s key %s(r=%d, s=%d)", name, kRangeMetaKeyPrefix, slot->replica,
                               slot->stage);
      }
      if (absl::StartsWith(key, kSlotMetaKeyPrefix)) {
        std::optional<SlotKeyFields> slot = ParseSlotMetaKey(key);
        if (!slot.has_value()) return Malformed(family, key);
        return absl::StrFormat("%s key %s(r=%d, s=%d)", name, kSlotMetaKeyPrefix, slot->replica,
                               slot->stage);
      }
      return absl::StrFormat("%s key \"%s\"", name, absl::CHexEscape(key));
    }
  }
  return Malformed(family, key);
}

}  // namespace rebound::storage
