#include "common/retry.h"

#include <catch2/catch.hpp>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"

namespace rebound {
namespace {

RetryPolicy Policy() {
  RetryPolicy policy;
  policy.initial_backoff = absl::Milliseconds(100);
  policy.max_backoff = absl::Milliseconds(400);
  policy.give_up_after = absl::Seconds(2);
  policy.log_retries = false;
  return policy;
}

TEST_CASE("Retry returns the first success and the first final error", "[retry]") {
  FakeClock clock;
  int attempts = 0;
  absl::Status status = Retry(Policy(), &clock, nullptr, "call", [&] {
    ++attempts;
    return attempts < 3 ? absl::UnavailableError("down") : absl::OkStatus();
  });
  CHECK(status.ok());
  CHECK(attempts == 3);

  attempts = 0;
  status = Retry(Policy(), &clock, nullptr, "call", [&] {
    ++attempts;
    return attempts < 2 ? absl::DeadlineExceededError("slow") : absl::NotFoundError("gone");
  });
  CHECK(status.code() == absl::StatusCode::kNotFound);
  CHECK(attempts == 2);
}

TEST_CASE("Retry gives up after give_up_after with UNAVAILABLE naming the last error",
          "[retry]") {
  FakeClock clock;
  const absl::Time start = clock.Now();
  int attempts = 0;
  const absl::Status status = Retry(Policy(), &clock, nullptr, "Sync", [&] {
    ++attempts;
    return absl::UnavailableError("connection refused");
  });
  CHECK(status.code() == absl::StatusCode::kUnavailable);
  CHECK(status.message() == "Sync failed for 2000 ms: connection refused");
  // The backoff waited on the clock: at least the give-up time, and it grew up to its cap
  // (delays of 50-100, 100-200, 200-400, then 200-400 ms), so far fewer than 2000/50 attempts.
  CHECK(clock.Now() - start >= absl::Seconds(2));
  CHECK(attempts >= 6);
  CHECK(attempts <= 12);
}

TEST_CASE("A notified stop ends the loop with CANCELLED", "[retry]") {
  FakeClock clock;
  absl::Notification stop;
  int attempts = 0;
  const absl::Status status = Retry(Policy(), &clock, &stop, "call", [&] {
    if (++attempts == 2) stop.Notify();
    return absl::UnavailableError("down");
  });
  CHECK(status.code() == absl::StatusCode::kCancelled);
  CHECK(attempts == 2);
}

TEST_CASE("Reset starts the give-up time over", "[retry]") {
  FakeClock clock;
  RetryLoop loop(Policy(), &clock, nullptr, "stream");
  absl::Status status = absl::UnavailableError("down");
  REQUIRE(loop.ShouldRetry(&status));
  clock.Advance(absl::Milliseconds(1900));
  loop.Reset();
  clock.Advance(absl::Milliseconds(1000));  // 2.9 s since the start, 1 s since the reset
  status = absl::UnavailableError("down");
  CHECK(loop.ShouldRetry(&status));
  CHECK(loop.retries() == 2);
}

TEST_CASE("RealClock::WaitFor returns early when stopped", "[retry]") {
  RealClock clock;
  absl::Notification stop;
  stop.Notify();
  const absl::Time start = absl::Now();
  CHECK(clock.WaitFor(absl::Seconds(30), &stop));
  CHECK(absl::Now() - start < absl::Seconds(10));
  CHECK_FALSE(clock.WaitFor(absl::Milliseconds(1), nullptr));
}

}  // namespace
}  // namespace rebound
