#pragma once

// The one place where absl::Status and grpc::Status are converted. The canonical codes of both
// are the same numbers; the conversion keeps code and message.

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace rebound {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace rebound
