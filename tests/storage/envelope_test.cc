#include "storage/envelope.h"

#include <catch2/catch.hpp>

#include <string>

#include "common/checksum.h"
#include "proto/rebound.pb.h"
#include "proto/storage.pb.h"

namespace rebound::storage {
namespace {

LogRecord SampleRecord() {
  LogRecord record;
  record.mutable_slot()->set_replica(1);
  record.mutable_slot()->set_stage(2);
  record.set_step(17);
  record.set_micro_batch(3);
  for (int i = 0; i < 8; ++i) record.add_sample_ids(1000 + i);
  BoundaryPayload* boundary = record.add_boundaries();
  boundary->set_direction(FORWARD);
  boundary->mutable_value()->set_dtype(FLOAT32);
  boundary->mutable_value()->add_shape(4);
  boundary->mutable_value()->set_data(std::string(16, '\x3f'));
  return record;
}

uint64_t ReadLe(const std::string& bytes, size_t offset, int size) {
  uint64_t value = 0;
  for (int i = size - 1; i >= 0; --i)
    value = (value << 8) | static_cast<unsigned char>(bytes[offset + i]);
  return value;
}

TEST_CASE("an envelope is version, length and xxHash64, little-endian, then the payload") {
  const std::string payload = SampleRecord().SerializeAsString();
  const std::string value = WrapInEnvelope(payload);
  REQUIRE(value.size() == kEnvelopeHeaderSize + payload.size());
  CHECK(ReadLe(value, 0, 4) == 1);
  CHECK(ReadLe(value, 4, 4) == payload.size());
  CHECK(ReadLe(value, 8, 8) == Checksum(payload.data(), payload.size()));
  CHECK(value.substr(kEnvelopeHeaderSize) == payload);
  CHECK(EnvelopeHeader(payload) == value.substr(0, kEnvelopeHeaderSize));
}

TEST_CASE("a record round-trips through its envelope") {
  const LogRecord record = SampleRecord();
  LogRecord decoded;
  decoded.set_record_id(99);  // cleared by DecodeEnvelope
  const absl::Status status = DecodeEnvelope(WrapInEnvelope(record.SerializeAsString()), &decoded);
  INFO(status.ToString());
  REQUIRE(status.ok());
  CHECK(decoded.SerializeAsString() == record.SerializeAsString());
  CHECK_FALSE(decoded.has_record_id());

  // An empty message is an empty payload.
  ServerRecord empty;
  REQUIRE(DecodeEnvelope(WrapInEnvelope(""), &empty).ok());
  CHECK(empty.ByteSizeLong() == 0);
}

TEST_CASE("every single flipped byte of an envelope is DATA_LOSS") {
  const std::string value = WrapInEnvelope(SampleRecord().SerializeAsString());
  for (size_t i = 0; i < value.size(); ++i) {
    for (unsigned char mask : {0x01, 0x80, 0xff}) {
      std::string corrupt = value;
      corrupt[i] = static_cast<char>(static_cast<unsigned char>(corrupt[i]) ^ mask);
      LogRecord decoded;
      const absl::Status status = DecodeEnvelope(corrupt, &decoded);
      INFO("byte " << i << " mask " << int{mask} << ": " << status.ToString());
      REQUIRE(status.code() == absl::StatusCode::kDataLoss);
    }
  }
}

TEST_CASE("each kind of damage is named in the message") {
  const std::string value = WrapInEnvelope(SampleRecord().SerializeAsString());
  LogRecord decoded;

  std::string flipped = value;
  flipped[kEnvelopeHeaderSize + 3] ^= 0x10;
  absl::Status status = DecodeEnvelope(flipped, &decoded);
  CHECK(status.code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(std::string(status.message()), Catch::Contains("checksum mismatch"));

  status = DecodeEnvelope(value.substr(0, value.size() - 5), &decoded);
  CHECK(status.code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(std::string(status.message()), Catch::StartsWith("truncated"));

  status = DecodeEnvelope(value.substr(0, 7), &decoded);
  CHECK(status.code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(std::string(status.message()), Catch::Contains("shorter than the 16-byte"));

  status = DecodeEnvelope(value + "xyz", &decoded);
  CHECK(status.code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(std::string(status.message()), Catch::StartsWith("length mismatch"));

  std::string version = value;
  version[0] = 2;
  status = DecodeEnvelope(version, &decoded);
  CHECK(status.code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(std::string(status.message()), Catch::Contains("unsupported envelope version 2"));

  CHECK(DecodeEnvelope("", &decoded).code() == absl::StatusCode::kDataLoss);
}

TEST_CASE("a well-formed envelope around bytes that are not the record is DATA_LOSS") {
  // Field 1 (slot), length-delimited, claiming 100 bytes that are not there.
  const std::string not_a_record("\x0a\x64\x08\x01", 4);
  LogRecord decoded;
  const absl::Status status = DecodeEnvelope(WrapInEnvelope(not_a_record), &decoded);
  CHECK(status.code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(std::string(status.message()), Catch::Contains("does not parse as rebound.LogRecord"));
}

}  // namespace
}  // namespace rebound::storage
