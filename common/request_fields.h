#pragma once

// Checks of request fields that the generated parsers let through (docs/bad_input.md).
//
// Every enum of rebound.proto is a proto2 (closed) enum: a value the schema does not list is not
// an error at parse time; the parser puts the field in the message's unknown fields and the
// getter returns the default, so `requested_role: 77` read as ROLE_UNSPECIFIED ("auto").
// CheckEnumValues finds such values: an unknown field whose number is a known enum field.
// Unknown fields of numbers the schema does not know (a newer client's fields) stay allowed.
//
// Worker names appear in logs, reboundctl's output and /metrics labels: ValidateWorkerName
// allows 1 to 256 characters of [A-Za-z0-9._:@+-].

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace google::protobuf {
class Message;
}  // namespace google::protobuf

namespace rebound {

// OK, or INVALID_ARGUMENT naming the field by its path and the value, e.g.
// "requested_role: unknown enum value 77 (rebound.WorkerRole)" or
// "records[3].boundaries[0].direction: unknown enum value 9 (...)". Looks into every set
// sub-message, repeated ones included.
absl::Status CheckEnumValues(const google::protobuf::Message& message);

// OK, or INVALID_ARGUMENT naming `field` and the first offending byte (as hex, never raw).
absl::Status ValidateWorkerName(absl::string_view name, absl::string_view field = "worker_name");

}  // namespace rebound
