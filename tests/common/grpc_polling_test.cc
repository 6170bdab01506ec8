// ShortenGrpcBackupPolling (common/grpc_polling.h): sets gRPC's backup poll interval when the
// environment has none, and keeps an operator's value.

#include "common/grpc_polling.h"

#include <stdlib.h>

#include <string>

#include <catch2/catch.hpp>

namespace rebound {
namespace {

constexpr char kVariable[] = "GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS";

TEST_CASE("without a value in the environment, the short interval is set") {
  unsetenv(kVariable);
  ShortenGrpcBackupPolling();
  const char* value = getenv(kVariable);
  REQUIRE(value != nullptr);
  CHECK(std::string(value) == std::to_string(kGrpcBackupPollIntervalMs));
  CHECK(kGrpcBackupPollIntervalMs < 5000);  // gRPC's default, the 5 s stalls
}

TEST_CASE("an operator's value is kept") {
  setenv(kVariable, "1234", 1);
  ShortenGrpcBackupPolling();
  const char* value = getenv(kVariable);
  REQUIRE(value != nullptr);
  CHECK(std::string(value) == "1234");
}

}  // namespace
}  // namespace rebound
