// FanOut and FirstFailure (common/fan_out.h): every part called once, at once, statuses by index.

#include <catch2/catch.hpp>

#include <atomic>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/barrier.h"
#include "common/fan_out.h"

namespace rebound {
namespace {

TEST_CASE("FanOut calls every part once, all at once, and returns their statuses by index") {
  constexpr size_t kParts = 5;
  std::vector<std::atomic<int>> calls(kParts);
  // Every call waits for all the others: this returns only if the five run at the same time.
  absl::Barrier* all_started = new absl::Barrier(kParts);
  const std::vector<absl::Status> statuses = FanOut(kParts, [&](size_t i) {
    calls[i].fetch_add(1);
    if (all_started->Block()) delete all_started;
    return i % 2 == 1 ? absl::UnavailableError(std::to_string(i)) : absl::OkStatus();
  });
  REQUIRE(statuses.size() == kParts);
  for (size_t i = 0; i < kParts; ++i) {
    CHECK(calls[i].load() == 1);
    CHECK(statuses[i].ok() == (i % 2 == 0));
  }
  CHECK(statuses[3].message() == "3");
  CHECK(FanOut(0, [](size_t) { return absl::InternalError("never called"); }).empty());
}

TEST_CASE("FirstFailure names the first failed part and keeps its code") {
  CHECK(FirstFailure({absl::OkStatus(), absl::OkStatus()}, "range").ok());
  const absl::Status first = FirstFailure(
      {absl::OkStatus(), absl::FailedPreconditionError("fenced"), absl::UnavailableError("down")},
      "range");
  CHECK(first.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(first.message() == "range 1: fenced");
}

}  // namespace
}  // namespace rebound
