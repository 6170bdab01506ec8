#include "storage/keys.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace rebound::storage {
namespace {

std::string Bytes(std::initializer_list<int> bytes) {
  std::string out;
  for (int b : bytes) out.push_back(static_cast<char>(b));
  return out;
}

constexpr int32_t kMaxInt32 = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();

TEST_CASE("keys are fixed-width big-endian integers") {
  CHECK(EncodeStageKey(0) == Bytes({0, 0, 0, 0}));
  CHECK(EncodeStageKey(0x01020304) == Bytes({1, 2, 3, 4}));
  CHECK(EncodeSlotKey(1, 258) == Bytes({0, 0, 0, 1, 0, 0, 1, 2}));
  CHECK(EncodeLogKey(0, 1, 17, 3) ==
        Bytes({0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 17, 0, 0, 0, 4}));
  // The per-step record (micro_batch = -1) is stored as 0.
  CHECK(EncodeLogKey(2, 0, 0x0102030405060708, -1) ==
        Bytes({0, 0, 0, 2, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0}));
  CHECK(EncodeStageKey(7).size() == kStageKeySize);
  CHECK(EncodeSlotKey(7, 7).size() == kSlotKeySize);
  CHECK(EncodeLogKey(7, 7, 7, 7).size() == kLogKeySize);
  CHECK(EncodeSlotMetaKey(1, 2) == std::string("slot/") + Bytes({0, 0, 0, 1, 0, 0, 0, 2}));
}

TEST_CASE("a pipeline's boundary records get a part byte that sorts after the slot's own record") {
  // Part 0 (the slot's own record) keeps the 20-byte key; parts 1 (FORWARD) and 2 (BACKWARD)
  // append one byte.
  CHECK(EncodeLogKey(0, 1, 17, 3, 0) == EncodeLogKey(0, 1, 17, 3));
  CHECK(EncodeLogKey(0, 1, 17, 3, 1) == EncodeLogKey(0, 1, 17, 3) + Bytes({1}));
  CHECK(EncodeLogKey(0, 1, 17, 3, 2) == EncodeLogKey(0, 1, 17, 3) + Bytes({2}));
  std::vector<std::string> keys;
  for (int64_t t : {16, 17}) {
    for (int32_t mb : {-1, 0, 1}) {
      for (int32_t part : {0, 1, 2}) {
        if (mb == -1 && part != 0) continue;
        keys.push_back(EncodeLogKey(0, 1, static_cast<uint64_t>(t), mb, part));
      }
    }
  }
  keys.push_back(EncodeLogKey(0, 1, 18, -1));  // the next step, and a DeleteRange end bound
  for (size_t i = 1; i < keys.size(); ++i) {
    INFO("i = " << i);
    CHECK(keys[i - 1] < keys[i]);
  }
  CHECK(ParseLogKey(EncodeLogKey(1, 2, 17, 3, 2)) == LogKeyFields{1, 2, 17, 3, 2});
  CHECK(ParseLogKey(EncodeLogKey(1, 2, 17, 3, 1))->part == 1);
  CHECK_FALSE(ParseLogKey(EncodeLogKey(1, 2, 17, 3) + Bytes({3})).has_value());
  CHECK_FALSE(ParseLogKey(EncodeLogKey(1, 2, 17, 3) + Bytes({0})).has_value());
  CHECK(DescribeKey(ColumnFamily::kStepLog, EncodeLogKey(0, 1, 17, 3, 2)) ==
        "steplog key (r=0, s=1, step=17, mb=3, backward)");
}

TEST_CASE("step-log keys sort by (replica, stage, step, micro_batch), per-step record first") {
  const std::vector<int32_t> small = {0, 1, 255, 256, 65535, 65536, kMaxInt32};
  const std::vector<int64_t> steps = {0, 1, 2, 255, 256, 65536, int64_t{1} << 32, kMaxInt64};
  const std::vector<int32_t> micro_batches = {-1, 0, 1, 255, 256, kMaxInt32};
  std::vector<std::tuple<int32_t, int32_t, int64_t, int32_t>> tuples;
  for (int32_t r : small) {
    for (int32_t s : {0, 1, 256, kMaxInt32}) {
      for (int64_t t : steps) {
        for (int32_t mb : micro_batches) tuples.emplace_back(r, s, t, mb);
      }
    }
  }
  std::vector<std::string> keys;
  for (const auto& [r, s, t, mb] : tuples) {
    keys.push_back(EncodeLogKey(r, s, static_cast<uint64_t>(t), mb));
  }
  // `tuples` was generated in ascending order; so must the keys be, strictly.
  REQUIRE(std::is_sorted(tuples.begin(), tuples.end()));
  for (size_t i = 1; i < keys.size(); ++i) {
    INFO("i = " << i);
    REQUIRE(keys[i - 1] < keys[i]);
  }
  // The slot key is a prefix of each of the slot's log keys, and sorts before them.
  CHECK(EncodeLogKey(3, 4, 0, -1).compare(0, kSlotKeySize, EncodeSlotKey(3, 4)) == 0);
  CHECK(EncodeSlotKey(3, 4) < EncodeLogKey(3, 4, 0, -1));
}

TEST_CASE("stage and slot keys sort numerically") {
  const std::vector<int32_t> values = {0, 1, 255, 256, 65535, 65536, 1 << 24, kMaxInt32};
  for (size_t i = 1; i < values.size(); ++i) {
    CHECK(EncodeStageKey(values[i - 1]) < EncodeStageKey(values[i]));
    CHECK(EncodeSlotKey(values[i - 1], kMaxInt32) < EncodeSlotKey(values[i], 0));
    CHECK(EncodeSlotKey(5, values[i - 1]) < EncodeSlotKey(5, values[i]));
  }
}

TEST_CASE("parsers invert the encoders") {
  CHECK(ParseStageKey(EncodeStageKey(0)) == 0);
  CHECK(ParseStageKey(EncodeStageKey(kMaxInt32)) == kMaxInt32);
  CHECK(ParseSlotKey(EncodeSlotKey(3, 9)) == SlotKeyFields{3, 9});
  CHECK(ParseSlotMetaKey(EncodeSlotMetaKey(kMaxInt32, 0)) == SlotKeyFields{kMaxInt32, 0});
  CHECK(ParseLogKey(EncodeLogKey(1, 2, 17, 3)) == LogKeyFields{1, 2, 17, 3});
  CHECK(ParseLogKey(EncodeLogKey(1, 2, 17, -1)) == LogKeyFields{1, 2, 17, -1});
  CHECK(ParseLogKey(EncodeLogKey(kMaxInt32, kMaxInt32, kMaxInt64, kMaxInt32)) ==
        LogKeyFields{kMaxInt32, kMaxInt32, kMaxInt64, kMaxInt32});
}

TEST_CASE("parsers reject wrong lengths and fields out of range") {
  CHECK_FALSE(ParseStageKey("").has_value());
  CHECK_FALSE(ParseStageKey(Bytes({0, 0, 1})).has_value());
  CHECK_FALSE(ParseStageKey(Bytes({0, 0, 0, 1, 0})).has_value());
  CHECK_FALSE(ParseStageKey(Bytes({0x80, 0, 0, 0})).has_value());  // > INT32_MAX
  CHECK_FALSE(ParseSlotKey(EncodeStageKey(1)).has_value());
  CHECK_FALSE(ParseSlotKey(Bytes({0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff})).has_value());
  CHECK_FALSE(ParseLogKey(EncodeSlotKey(1, 1)).has_value());
  CHECK_FALSE(ParseLogKey(EncodeLogKey(1, 1, 1, 1) + "x").has_value());
  // step >= 2^63
  CHECK_FALSE(ParseLogKey(EncodeLogKey(0, 0, uint64_t{1} << 63, 0)).has_value());
  // micro_batch + 1 > 2^31
  std::string key = EncodeLogKey(0, 0, 1, 0);
  key.replace(16, 4, Bytes({0x80, 0, 0, 1}));
  CHECK_FALSE(ParseLogKey(key).has_value());
  key.replace(16, 4, Bytes({0x80, 0, 0, 0}));  // exactly 2^31: micro_batch = INT32_MAX
  CHECK(ParseLogKey(key) == LogKeyFields{0, 0, 1, kMaxInt32});
  CHECK_FALSE(ParseSlotMetaKey("server").has_value());
  CHECK_FALSE(ParseSlotMetaKey("slot/" + EncodeStageKey(1)).has_value());
}

TEST_CASE("keys are described readably, malformed ones in escaped hex") {
  CHECK(DescribeKey(ColumnFamily::kCenter, EncodeStageKey(2)) == "center key (s=2)");
  CHECK(DescribeKey(ColumnFamily::kCenterOpt, EncodeStageKey(0)) == "center_opt key (s=0)");
  CHECK(DescribeKey(ColumnFamily::kSnapshot, EncodeSlotKey(0, 1)) == "snapshot key (r=0, s=1)");
  CHECK(DescribeKey(ColumnFamily::kWeights, EncodeSlotKey(3, 0)) == "weights key (r=3, s=0)");
  CHECK(DescribeKey(ColumnFamily::kStepLog, EncodeLogKey(0, 1, 17, 3)) ==
        "steplog key (r=0, s=1, step=17, mb=3)");
  CHECK(DescribeKey(ColumnFamily::kStepLog, EncodeLogKey(0, 1, 17, -1)) ==
        "steplog key (r=0, s=1, step=17, mb=-1)");
  CHECK(DescribeKey(ColumnFamily::kMeta, kServerMetaKey) == "meta key \"server\"");
  CHECK(DescribeKey(ColumnFamily::kMeta, EncodeSlotMetaKey(1, 2)) == "meta key slot/(r=1, s=2)");
  CHECK(DescribeKey(ColumnFamily::kMeta, "other") == "meta key \"other\"");
  CHECK(DescribeKey(ColumnFamily::kSnapshot, Bytes({0, 1})) ==
        "snapshot key \"\\x00\\x01\" (malformed, 2 bytes)");
  CHECK(DescribeKey(ColumnFamily::kMeta, "slot/x") == "meta key \"slot/x\" (malformed, 6 bytes)");
}

TEST_CASE("a range group's snapshot keys: the slot key and a copy byte") {
  CHECK(EncodeRangeSnapshotKey(1, 2, 1) == EncodeSlotKey(1, 2) + std::string(1, '\x01'));
  CHECK(ParseRangeSnapshotKey(EncodeRangeSnapshotKey(3, 0, 0))->slot == SlotKeyFields{3, 0});
  CHECK(ParseRangeSnapshotKey(EncodeRangeSnapshotKey(3, 0, 1))->copy == 1);
  CHECK_FALSE(ParseRangeSnapshotKey(EncodeSlotKey(3, 0) + std::string(1, '\x02')).has_value());
  CHECK_FALSE(ParseRangeSnapshotKey(EncodeSlotKey(3, 0)).has_value());
  CHECK(DescribeKey(ColumnFamily::kSnapshot, EncodeRangeSnapshotKey(0, 1, 1)) ==
        "snapshot key (r=0, s=1, range copy 1)");
  // A range group's push book.
  CHECK(EncodeRangeMetaKey(2, 1) == "range/" + EncodeSlotKey(2, 1));
  CHECK(ParseRangeMetaKey(EncodeRangeMetaKey(2, 1)) == SlotKeyFields{2, 1});
  CHECK_FALSE(ParseRangeMetaKey(EncodeSlotMetaKey(2, 1)).has_value());
  CHECK(DescribeKey(ColumnFamily::kMeta, EncodeRangeMetaKey(2, 1)) == "meta key range/(r=2, s=1)");
}

TEST_CASE("column families have their documented names") {
  CHECK(std::string(ColumnFamilyName(ColumnFamily::kCenter)) == "center");
  CHECK(std::string(ColumnFamilyName(ColumnFamily::kCenterOpt)) == "center_opt");
  CHECK(std::string(ColumnFamilyName(ColumnFamily::kSnapshot)) == "snapshot");
  CHECK(std::string(ColumnFamilyName(ColumnFamily::kStepLog)) == "steplog");
  CHECK(std::string(ColumnFamilyName(ColumnFamily::kWeights)) == "weights");
  CHECK(std::string(ColumnFamilyName(ColumnFamily::kMeta)) == "meta");
}

}  // namespace
}  // namespace rebound::storage
