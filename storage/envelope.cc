#include "storage/envelope.h"

#include <cassert>

#include <google/protobuf/message_lite.h>

#include "absl/strings/str_format.h"
#include "common/checksum.h"

namespace rebound::storage {
namespace {

void AppendLittleEndian(std::string* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

uint64_t ReadLittleEndian(absl::string_view bytes, size_t offset, int size) {
  uint64_t value = 0;
  for (int i = size - 1; i >= 0; --i) {
    value = (value << 8) | static_cast<unsigned char>(bytes[offset + i]);
  }
  return value;
}

}  // namespace

std::string EnvelopeHeader(absl::string_view payload) {
  assert(payload.size() <= kMaxEnvelopePayload);
  std::string header;
  header.reserve(kEnvelopeHeaderSize);
  AppendLittleEndian(&header, kEnvelopeVersion, 4);
  AppendLittleEndian(&header, payload.size(), 4);
  AppendLittleEndian(&header, Checksum(payload.data(), payload.size()), 8);
  return header;
}

std::string WrapInEnvelope(absl::string_view payload) {
  std::string value = EnvelopeHeader(payload);
  value.append(payload.data(), payload.size());
  return value;
}

absl::StatusOr<absl::string_view> OpenEnvelope(absl::string_view value) {
  if (value.size() < kEnvelopeHeaderSize) {
    return absl::DataLossError(
        absl::StrFormat("truncated: %d bytes, shorter than the %d-byte envelope header",
                        value.size(), kEnvelopeHeaderSize));
  }
  const uint64_t version = ReadLittleEndian(value, 0, 4);
  if (version != kEnvelopeVersion) {
    return absl::DataLossError(
        absl::StrFormat("unsupported envelope version %d (want %d)", version, kEnvelopeVersion));
  }
  const uint64_t length = ReadLittleEndian(value, 4, 4);
  const size_t actual = value.size() - kEnvelopeHeaderSize;
  if (length != actual) {
    return absl::DataLossError(absl::StrFormat("%s: header says %d payload bytes, value holds %d",
                                               length > actual ? "truncated" : "length mismatch",
                                               length, actual));
  }
  const absl::string_view payload = value.substr(kEnvelopeHeaderSize);
  const uint64_t stored = ReadLittleEndian(value, 8, 8);
  const uint64_t computed = Checksum(payload.data(), payload.size());
  if (stored != computed) {
    return absl::DataLossError(absl::StrFormat(
        "checksum mismatch (stored 0x%016x, computed 0x%016x over %d payload bytes)", stored,
        computed, payload.size()));
  }
  return payload;
}

absl::Status DecodeEnvelope(absl::string_view value, google::protobuf::MessageLite* message) {
  absl::StatusOr<absl::string_view> payload = OpenEnvelope(value);
  if (!payload.ok()) return payload.status();
  message->Clear();
  if (!message->ParseFromArray(payload->data(), static_cast<int>(payload->size()))) {
    return absl::DataLossError(absl::StrFormat("payload (%d bytes) does not parse as %s",
                                               payload->size(), message->GetTypeName()));
  }
  return absl::OkStatus();
}

}  // namespace rebound::storage
