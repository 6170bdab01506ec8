#include "storage/wal_tail.h"

#include <catch2/catch.hpp>

#include <rocksdb/db.h>
#include <rocksdb/options.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "testing/cluster/processes.h"

namespace rebound::storage {
namespace {

namespace fs = std::filesystem;
using ::Catch::Contains;

constexpr size_t kBlockSize = 32768;
constexpr uint8_t kFull = 1;
constexpr uint8_t kFirst = 2;
constexpr uint8_t kLast = 4;

void AppendFixed32(std::string* out, uint32_t value) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>(value >> (8 * i)));
}

// One physical record, byte by byte as RocksDB's log::Writer emits it.
std::string Record(uint8_t type, const std::string& payload) {
  std::string record;
  AppendFixed32(&record, MaskedRecordCrc(type, payload));
  record.push_back(static_cast<char>(payload.size() & 0xff));
  record.push_back(static_cast<char>(payload.size() >> 8));
  record.push_back(static_cast<char>(type));
  return record + payload;
}

std::string Payload(size_t size, char seed) {
  std::string payload(size, '\0');
  for (size_t i = 0; i < size; ++i) payload[i] = static_cast<char>(seed + 31 * i);
  return payload;
}

// Three whole records in the first block: 7 + 20, 7 + 30, 7 + 100 bytes.
std::string ThreeRecords() {
  return Record(kFull, Payload(20, 'a')) + Record(kFull, Payload(30, 'b')) +
         Record(kFull, Payload(100, 'c'));
}
constexpr size_t kLastRecordAt = 7 + 20 + 7 + 30;

void SetLength(std::string* wal, size_t record_at, size_t length) {
  (*wal)[record_at + 4] = static_cast<char>(length & 0xff);
  (*wal)[record_at + 5] = static_cast<char>(length >> 8);
}

std::string WriteWal(const std::string& dir, const std::string& name, const std::string& bytes) {
  const std::string path = absl::StrCat(dir, "/", name);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  return path;
}

std::string DropLine(const std::string& file, size_t bytes, const std::string& reason) {
  return absl::StrCat(file, ": dropping ", bytes, " bytes; Corruption: ", reason);
}

std::string LastBlock(const std::string& wal) {
  return wal.substr(wal.size() / kBlockSize * kBlockSize);
}

TEST_CASE("Crc32c is CRC-32C (Castagnoli)") {
  CHECK(Crc32c("123456789") == 0xE3069283u);  // the standard check value
  CHECK(Crc32c(std::string(32, '\0')) == 0x8A9136AAu);  // RFC 3720, B.4
  CHECK(Crc32c(std::string(32, '\xff')) == 0x62A8AB43u);
  CHECK(Crc32c("") == 0u);
}

TEST_CASE("a drop line of RocksDB's info log parses into file, bytes and reason") {
  const std::optional<WalDrop> drop =
      ParseWalDrop("/data/000026.log: dropping 208 bytes; Corruption: checksum mismatch");
  REQUIRE(drop.has_value());
  CHECK(drop->file == "/data/000026.log");
  CHECK(drop->bytes == 208);
  CHECK(drop->reason == "checksum mismatch");
  // As RocksDB's logging macros write it, with the source position first.
  const std::optional<WalDrop> logged = ParseWalDrop(
      "[db/db_impl/db_impl_open.cc:982] /data/000004.log: dropping 37 bytes; Corruption: "
      "truncated record body");
  REQUIRE(logged.has_value());
  CHECK(logged->file == "/data/000004.log");
  CHECK(logged->bytes == 37);
  CHECK(logged->reason == "truncated record body");
  CHECK_FALSE(ParseWalDrop("Recovering log #26 mode 1").has_value());
  CHECK_FALSE(ParseWalDrop("/data/000026.log: dropping many bytes; Corruption: x").has_value());
}

TEST_CASE("a log ending at a record boundary ends whole") {
  CHECK(InspectLastBlock(ThreeRecords()) == WalEnd::kWhole);
  CHECK(InspectLastBlock("") == WalEnd::kWhole);
}

TEST_CASE("a last record cut short is a torn write") {
  const std::string dir = testing::MakeTempDir("wal-tail-torn");
  const std::string wal = ThreeRecords().substr(0, kLastRecordAt + 7 + 40);
  CHECK(InspectLastBlock(wal) == WalEnd::kTornRecord);
  // Cut anywhere in the body, even one byte before its end, or right after the header.
  CHECK(InspectLastBlock(ThreeRecords().substr(0, kLastRecordAt + 7 + 99)) == WalEnd::kTornRecord);
  CHECK(InspectLastBlock(ThreeRecords().substr(0, kLastRecordAt + 7)) == WalEnd::kTornRecord);

  const std::string path = WriteWal(dir, "000007.log", wal);
  const WalDamage damage =
      ClassifyWalDamage({DropLine(path, 47, "truncated record body")}, dir);
  INFO(damage.why_not);
  CHECK(damage.torn_write);
  CHECK(damage.file == path);
  CHECK(damage.dropped_bytes == 47);
  CHECK(damage.reasons == "truncated record body");
}

TEST_CASE("a complete last record whose length field grew past the end of the file is damage") {
  const std::string dir = testing::MakeTempDir("wal-tail-length");
  std::string wal = ThreeRecords();
  SetLength(&wal, kLastRecordAt, 150);
  CHECK(InspectLastBlock(wal) == WalEnd::kDamagedLength);
  // The same with the length's high byte damaged.
  std::string high = ThreeRecords();
  SetLength(&high, kLastRecordAt, 100 + 256);
  CHECK(InspectLastBlock(high) == WalEnd::kDamagedLength);

  const std::string path = WriteWal(dir, "000007.log", wal);
  const WalDamage damage =
      ClassifyWalDamage({DropLine(path, 107, "truncated record body")}, dir);
  CHECK_FALSE(damage.torn_write);
  CHECK_THAT(damage.why_not, Contains("length field damaged"));
  CHECK_THAT(damage.why_not, Contains(path));
}

TEST_CASE("a complete record whose length grew over the records after it is damage") {
  std::string wal = ThreeRecords();
  SetLength(&wal, 7 + 20, 200);  // the second record now runs over the third and past the end
  CHECK(InspectLastBlock(wal) == WalEnd::kDamagedLength);
}

TEST_CASE("a log ending inside a header is a torn write") {
  const std::string dir = testing::MakeTempDir("wal-tail-header");
  for (size_t header_bytes = 1; header_bytes < 7; ++header_bytes) {
    CHECK(InspectLastBlock(ThreeRecords().substr(0, kLastRecordAt + header_bytes)) ==
          WalEnd::kTornHeader);
  }
  const std::string path =
      WriteWal(dir, "000007.log", ThreeRecords().substr(0, kLastRecordAt + 3));
  const WalDamage damage = ClassifyWalDamage({DropLine(path, 3, "truncated header")}, dir);
  INFO(damage.why_not);
  CHECK(damage.torn_write);
  CHECK(damage.dropped_bytes == 3);
}

TEST_CASE("a fragmented record whose last fragment was never written is a torn write") {
  const std::string dir = testing::MakeTempDir("wal-tail-fragment");
  // A whole record, then the FIRST fragment of a long one filling the rest of block 0; the log
  // ends at the block boundary, before the LAST fragment.
  const std::string head = Record(kFull, Payload(20, 'a'));
  const std::string first = Record(kFirst, Payload(kBlockSize - head.size() - 7, 'f'));
  const std::string wal = head + first;
  REQUIRE(wal.size() == kBlockSize);
  CHECK(InspectLastBlock(LastBlock(wal)) == WalEnd::kWhole);
  const std::string path = WriteWal(dir, "000007.log", wal);
  WalDamage damage =
      ClassifyWalDamage({DropLine(path, first.size() - 7, "error reading trailing data")}, dir);
  INFO(damage.why_not);
  CHECK(damage.torn_write);

  // The LAST fragment's header begun but not finished: both kinds are reported.
  const std::string torn_header = wal + Record(kLast, Payload(10, 'l')).substr(0, 5);
  CHECK(InspectLastBlock(LastBlock(torn_header)) == WalEnd::kTornHeader);
  WriteWal(dir, "000007.log", torn_header);
  damage = ClassifyWalDamage({DropLine(path, 5, "truncated header"),
                              DropLine(path, first.size() - 7, "error reading trailing data")},
                             dir);
  INFO(damage.why_not);
  CHECK(damage.torn_write);
  CHECK(damage.dropped_bytes == static_cast<int64_t>(5 + first.size() - 7));
  CHECK(damage.reasons == "truncated header; error reading trailing data");
}

TEST_CASE("a checksum mismatch is damage, even in the last record") {
  const std::string dir = testing::MakeTempDir("wal-tail-checksum");
  std::string wal = ThreeRecords();
  wal[wal.size() - 10] ^= 0x5a;
  CHECK(InspectLastBlock(wal) == WalEnd::kWhole);  // its end is intact; its checksum is not
  const std::string path = WriteWal(dir, "000007.log", wal);
  const WalDamage damage = ClassifyWalDamage({DropLine(path, 107, "checksum mismatch")}, dir);
  CHECK_FALSE(damage.torn_write);
  CHECK_THAT(damage.why_not, Contains("checksum mismatch"));
  // One damage kind among torn ones is enough to refuse.
  CHECK_FALSE(ClassifyWalDamage({DropLine(path, 107, "checksum mismatch"),
                                 DropLine(path, 10, "truncated record body")},
                                dir)
                  .torn_write);
  CHECK_FALSE(ClassifyWalDamage({DropLine(path, 107, "bad record length")}, dir).torn_write);
  CHECK_FALSE(
      ClassifyWalDamage({DropLine(path, 107, "missing start of fragmented record(2)")}, dir)
          .torn_write);
}

TEST_CASE("a torn-looking report the file's end does not bear out is damage") {
  const std::string dir = testing::MakeTempDir("wal-tail-disagree");
  const std::string path = WriteWal(dir, "000007.log", ThreeRecords());
  CHECK_FALSE(ClassifyWalDamage({DropLine(path, 3, "truncated header")}, dir).torn_write);
  CHECK_FALSE(ClassifyWalDamage({DropLine(path, 3, "truncated record body")}, dir).torn_write);
  CHECK_FALSE(ClassifyWalDamage({}, dir).torn_write);
}

TEST_CASE("only the newest WAL file, by number, can end in a torn write") {
  const std::string dir = testing::MakeTempDir("wal-tail-newest");
  const std::string torn = ThreeRecords().substr(0, kLastRecordAt + 3);
  const std::string older = WriteWal(dir, "999999.log", torn);
  const std::string newer = WriteWal(dir, "1000000.log", torn);
  const WalDamage in_older = ClassifyWalDamage({DropLine(older, 3, "truncated header")}, dir);
  CHECK_FALSE(in_older.torn_write);
  CHECK_THAT(in_older.why_not, Contains("not the newest"));
  const WalDamage in_newer = ClassifyWalDamage({DropLine(newer, 3, "truncated header")}, dir);
  CHECK(in_newer.torn_write);
  CHECK(in_newer.file == newer);
}

TEST_CASE("recyclable records are not judged") {
  std::string wal = ThreeRecords();
  wal[kLastRecordAt + 6] = 5;
  CHECK(InspectLastBlock(wal.substr(0, kLastRecordAt + 11 + 10)) == WalEnd::kNotJudged);
}

// The checksum and the framing agree with what RocksDB itself writes.
TEST_CASE("every record of a WAL RocksDB wrote carries the checksum MaskedRecordCrc computes") {
  const std::string dir = testing::MakeTempDir("wal-tail-rocksdb");
  rocksdb::Options options;
  options.create_if_missing = true;
  rocksdb::DB* raw = nullptr;
  REQUIRE(rocksdb::DB::Open(options, dir, &raw).ok());
  std::unique_ptr<rocksdb::DB> db(raw);
  for (int i = 0; i < 50; ++i) {
    // Some records longer than a block, so that they are fragmented.
    const std::string value = Payload(i % 10 == 9 ? 70000 : 100 + 37 * i, static_cast<char>(i));
    REQUIRE(db->Put(rocksdb::WriteOptions(), absl::StrCat("key", i), value).ok());
  }
  REQUIRE(db->FlushWAL(/*sync=*/true).ok());

  std::string newest;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() == ".log") newest = entry.path().string();
  }
  REQUIRE_FALSE(newest.empty());
  std::ifstream in(newest, std::ios::binary);
  const std::string wal((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  int records = 0;
  int fragments = 0;
  for (size_t block = 0; block < wal.size(); block += kBlockSize) {
    const std::string bytes = wal.substr(block, kBlockSize);
    size_t at = 0;
    while (bytes.size() - at >= 7) {
      const size_t length = static_cast<uint8_t>(bytes[at + 4]) |
                            static_cast<size_t>(static_cast<uint8_t>(bytes[at + 5])) << 8;
      const auto type = static_cast<uint8_t>(bytes[at + 6]);
      REQUIRE(at + 7 + length <= bytes.size());
      uint32_t stored = 0;
      for (int i = 3; i >= 0; --i) stored = stored << 8 | static_cast<uint8_t>(bytes[at + i]);
      CHECK(stored == MaskedRecordCrc(type, bytes.substr(at + 7, length)));
      ++records;
      fragments += type != kFull ? 1 : 0;
      at += 7 + length;
    }
  }
  CHECK(records >= 50);
  CHECK(fragments >= 10);  // five 70000-byte values, each in at least three fragments
  CHECK(InspectLastBlock(LastBlock(wal)) == WalEnd::kWhole);
}

}  // namespace
}  // namespace rebound::storage
