#pragma once

// The checksummed envelope around every value the DurableStore writes (docs/design.md §6).
//
// | offset | bytes | field                                                     |
// |--------|-------|-----------------------------------------------------------|
// | 0      | 4     | format version, u32 little-endian; currently 1            |
// | 4      | 4     | payload length n, u32 little-endian                       |
// | 8      | 8     | xxHash64 (seed 0) of the payload, u64 little-endian       |
// | 16     | n     | payload: the record's protobuf serialization (proto2)     |
//
// A value is accepted only if it is exactly 16 + n bytes, its version is 1, its checksum
// matches and its payload parses as the expected message. Anything else is reported as
// absl::DataLossError; nothing here crashes or CHECKs on stored bytes. The error message says
// what is wrong ("checksum mismatch (stored 0x..., computed 0x...)", "truncated: ...") but not
// which key: the caller prefixes it with storage::DescribeKey().
//
// Thread-safety: pure functions, safe from any thread. Ownership: the Wrap functions return new
// strings; OpenEnvelope's result is a view into `value` (valid while `value` is);
// DecodeEnvelope parses into the caller's message. Errors: DATA_LOSS only, as above.

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace google::protobuf {
class MessageLite;
}  // namespace google::protobuf

namespace rebound::storage {

inline constexpr uint32_t kEnvelopeVersion = 1;
inline constexpr size_t kEnvelopeHeaderSize = 16;
// Largest payload an envelope can describe (protobuf itself stops at 2 GiB).
inline constexpr size_t kMaxEnvelopePayload = 0x7fffffff;

// The 16-byte header for `payload`. REQUIRES: payload.size() <= kMaxEnvelopePayload.
std::string EnvelopeHeader(absl::string_view payload);

// Header + payload in one string. REQUIRES: payload.size() <= kMaxEnvelopePayload.
std::string WrapInEnvelope(absl::string_view payload);

// Checks `value` and returns a view of its payload (pointing into `value`), or DATA_LOSS.
absl::StatusOr<absl::string_view> OpenEnvelope(absl::string_view value);

// OpenEnvelope, then parses the payload into `*message` (cleared first), or DATA_LOSS, e.g.
// "payload (12 bytes) does not parse as rebound.LogRecord".
absl::Status DecodeEnvelope(absl::string_view value, google::protobuf::MessageLite* message);

}  // namespace rebound::storage
