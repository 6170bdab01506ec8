#include "storage/wal_tail.h"

#include <array>
#include <filesystem>
#include <fstream>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace rebound::storage {
namespace {

constexpr size_t kBlockSize = 32768;
constexpr size_t kHeaderSize = 7;
constexpr uint8_t kFirstRecyclableType = 5;
constexpr uint8_t kLastRecyclableType = 8;

constexpr absl::string_view kTruncatedHeader = "truncated header";
constexpr absl::string_view kTrailingData = "error reading trailing data";
constexpr absl::string_view kTruncatedBody = "truncated record body";

constexpr std::array<uint32_t, 256> MakeCrc32cTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1) != 0 ? 0x82F63B78u : 0u);
    table[i] = crc;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kCrc32cTable = MakeCrc32cTable();

// The running state of a CRC-32C: Crc32c(data) is ~state after extending ~0 by data.
uint32_t Extend(uint32_t state, uint8_t byte) {
  return kCrc32cTable[(state ^ byte) & 0xff] ^ (state >> 8);
}

uint32_t Mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

uint32_t DecodeFixed32(const char* p) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  return uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
}

bool IsTornTailKind(absl::string_view reason) {
  return reason == kTruncatedHeader || reason == kTrailingData || reason == kTruncatedBody;
}

// The WAL files' numbers are compared as numbers: "1000000.log" is newer than "999999.log".
std::optional<std::filesystem::path> NewestWal(const std::string& dir) {
  std::optional<std::filesystem::path> newest;
  uint64_t newest_number = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    uint64_t number = 0;
    if (entry.path().extension() != ".log" ||
        !absl::SimpleAtoi(entry.path().stem().string(), &number)) {
      continue;
    }
    if (!newest || number > newest_number) {
      newest = entry.path();
      newest_number = number;
    }
  }
  return newest;
}

std::optional<std::string> ReadLastBlock(const std::filesystem::path& file) {
  std::error_code error;
  const uintmax_t size = std::filesystem::file_size(file, error);
  if (error) return std::nullopt;
  std::ifstream in(file, std::ios::binary);
  std::string block(size % kBlockSize, '\0');
  in.seekg(static_cast<std::streamoff>(size - block.size()));
  in.read(block.data(), static_cast<std::streamsize>(block.size()));
  if (!in) return std::nullopt;
  return block;
}

WalDamage NotTorn(std::string why) {
  WalDamage damage;
  damage.why_not = std::move(why);
  return damage;
}

}  // namespace

uint32_t Crc32c(absl::string_view data) {
  uint32_t state = ~0u;
  for (char c : data) state = Extend(state, static_cast<uint8_t>(c));
  return ~state;
}

uint32_t MaskedRecordCrc(uint8_t type, absl::string_view payload) {
  uint32_t state = Extend(~0u, type);
  for (char c : payload) state = Extend(state, static_cast<uint8_t>(c));
  return Mask(~state);
}

std::optional<WalDrop> ParseWalDrop(absl::string_view line) {
  constexpr absl::string_view kDropping = ": dropping ";
  constexpr absl::string_view kBytes = " bytes; ";
  const size_t dropping = line.find(kDropping);
  if (dropping == absl::string_view::npos) return std::nullopt;
  const size_t number = dropping + kDropping.size();
  const size_t bytes = line.find(kBytes, number);
  if (bytes == absl::string_view::npos) return std::nullopt;
  WalDrop drop;
  if (!absl::SimpleAtoi(line.substr(number, bytes - number), &drop.bytes)) return std::nullopt;
  // RocksDB's logging macros put "[source file:line] " first.
  absl::string_view file = line.substr(0, dropping);
  const size_t source_end = file.find("] ");
  if (absl::StartsWith(file, "[") && source_end != absl::string_view::npos) {
    file.remove_prefix(source_end + 2);
  }
  absl::ConsumePrefix(&file, "(ignoring error) ");
  drop.file = std::string(file);
  absl::string_view reason = line.substr(bytes + kBytes.size());
  absl::ConsumePrefix(&reason, "Corruption: ");
  drop.reason = std::string(reason);
  return drop;
}

WalEnd InspectLastBlock(absl::string_view last_block) {
  if (last_block.size() >= kBlockSize) return WalEnd::kNotJudged;
  size_t at = 0;
  while (at < last_block.size()) {
    const absl::string_view rest = last_block.substr(at);
    if (rest.size() < kHeaderSize) return WalEnd::kTornHeader;
    const auto type = static_cast<uint8_t>(rest[6]);
    const size_t length =
        static_cast<uint8_t>(rest[4]) | static_cast<size_t>(static_cast<uint8_t>(rest[5])) << 8;
    if ((type >= kFirstRecyclableType && type <= kLastRecyclableType) ||
        (type == 0 && length == 0)) {
      return WalEnd::kNotJudged;
    }
    if (kHeaderSize + length <= rest.size()) {
      at += kHeaderSize + length;
      continue;
    }
    // The record runs past the end of the file. Had it been written whole and its length
    // damaged afterwards, its checksum would match the payload at its true length, which is
    // at most the bytes present.
    const uint32_t stored = DecodeFixed32(rest.data());
    uint32_t state = Extend(~0u, type);
    if (Mask(~state) == stored) return WalEnd::kDamagedLength;
    for (char c : rest.substr(kHeaderSize)) {
      state = Extend(state, static_cast<uint8_t>(c));
      if (Mask(~state) == stored) return WalEnd::kDamagedLength;
    }
    return WalEnd::kTornRecord;
  }
  return WalEnd::kWhole;
}

WalDamage ClassifyWalDamage(const std::vector<std::string>& drop_lines,
                            const std::string& wal_dir) {
  if (drop_lines.empty()) return NotTorn("RocksDB reported no dropped bytes");
  const std::optional<std::filesystem::path> newest = NewestWal(wal_dir);
  if (!newest) return NotTorn(absl::StrCat("no WAL file in ", wal_dir));
  bool truncated_header = false;
  bool truncated_body = false;
  int64_t dropped_bytes = 0;
  std::vector<std::string> reasons;
  for (const std::string& line : drop_lines) {
    const std::optional<WalDrop> drop = ParseWalDrop(line);
    if (!drop) return NotTorn(absl::StrCat("an unrecognised report: ", line));
    if (!IsTornTailKind(drop->reason)) {
      return NotTorn(absl::StrCat("\"", drop->reason, "\" is damage, not a torn write"));
    }
    if (std::filesystem::path(drop->file).filename() != newest->filename()) {
      return NotTorn(absl::StrCat(drop->file, " is not the newest WAL file (", newest->string(),
                                  "): only the last write can be torn"));
    }
    truncated_header |= drop->reason == kTruncatedHeader;
    truncated_body |= drop->reason == kTruncatedBody;
    dropped_bytes += drop->bytes;
    reasons.push_back(drop->reason);
  }
  const std::optional<std::string> last_block = ReadLastBlock(*newest);
  if (!last_block) return NotTorn(absl::StrCat("cannot read ", newest->string()));
  const WalEnd end = InspectLastBlock(*last_block);
  // The file must end as RocksDB said: inside a record's body, inside a header, or (the
  // fragments of an unfinished record all read) at a record boundary.
  const WalEnd expected = truncated_body     ? WalEnd::kTornRecord
                          : truncated_header ? WalEnd::kTornHeader
                                             : WalEnd::kWhole;
  if (end == WalEnd::kDamagedLength) {
    return NotTorn(absl::StrCat("the last record of ", newest->string(),
                                " is complete, its length field damaged: a prefix of its "
                                "bytes carries its checksum"));
  }
  if (end != expected) {
    return NotTorn(absl::StrCat("the end of ", newest->string(),
                                " does not look like a torn write"));
  }
  WalDamage damage;
  damage.torn_write = true;
  damage.file = newest->string();
  damage.dropped_bytes = dropped_bytes;
  damage.reasons = absl::StrJoin(reasons, "; ");
  return damage;
}

}  // namespace rebound::storage
