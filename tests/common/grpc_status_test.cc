#include <catch2/catch.hpp>

#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace rebound {
namespace {

TEST_CASE("every canonical code and its message survive the round trip to gRPC") {
  for (int code = 0; code <= 16; ++code) {
    const absl::Status status(static_cast<absl::StatusCode>(code), code == 0 ? "" : "why");
    const grpc::Status wire = ToGrpcStatus(status);
    CHECK(static_cast<int>(wire.error_code()) == code);
    CHECK(wire.error_message() == (code == 0 ? "" : "why"));
    const absl::Status back = FromGrpcStatus(wire);
    CHECK(back.code() == status.code());
    CHECK(back.message() == status.message());
  }
}

TEST_CASE("the retry-relevant codes map to their gRPC names") {
  CHECK(ToGrpcStatus(absl::UnavailableError("u")).error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(ToGrpcStatus(absl::AbortedError("a")).error_code() == grpc::StatusCode::ABORTED);
  CHECK(ToGrpcStatus(absl::FailedPreconditionError("f")).error_code() ==
        grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(ToGrpcStatus(absl::DataLossError("d")).error_code() == grpc::StatusCode::DATA_LOSS);
}

TEST_CASE("a gRPC code outside the canonical range becomes UNKNOWN") {
  const grpc::Status odd(static_cast<grpc::StatusCode>(99), "odd");
  const absl::Status back = FromGrpcStatus(odd);
  CHECK(back.code() == absl::StatusCode::kUnknown);
  CHECK(back.message() == "odd");
}

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  ASSIGN_OR_RETURN(int half, Half(x));
  ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

absl::Status CheckQuarter(int x, int* out) {
  RETURN_IF_ERROR(Half(x).status());
  ASSIGN_OR_RETURN(*out, Quarter(x));
  return absl::OkStatus();
}

TEST_CASE("ASSIGN_OR_RETURN and RETURN_IF_ERROR pass values and stop at the first error") {
  CHECK(*Quarter(12) == 3);
  CHECK(Quarter(6).status().code() == absl::StatusCode::kInvalidArgument);
  int out = -1;
  CHECK(CheckQuarter(8, &out).ok());
  CHECK(out == 2);
  out = -1;
  CHECK(CheckQuarter(7, &out).code() == absl::StatusCode::kInvalidArgument);
  CHECK(out == -1);
}

}  // namespace
}  // namespace rebound
