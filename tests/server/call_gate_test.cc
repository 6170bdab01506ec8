#include "server/call_gate.h"

#include <catch2/catch.hpp>

#include <optional>
#include <utility>

#include "absl/strings/match.h"

namespace rebound::server {
namespace {

TEST_CASE("a call gate admits up to its capacity and refuses beyond it, naming the bound") {
  CallGate gate("parked long polls (max_parked_calls)", "calls", 2);
  auto first = gate.Enter();
  auto second = gate.Enter();
  REQUIRE(first.ok());
  REQUIRE(second.ok());
  CHECK(gate.in_use() == 2);
  auto third = gate.Enter();
  REQUIRE(third.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(absl::StrContains(third.status().message(), "max_parked_calls"));
  CHECK(absl::StrContains(third.status().message(), "2 calls in use of 2"));
  CHECK(gate.refused() == 1);
  CHECK(gate.in_use() == 2);
}

TEST_CASE("a call gate's pass gives its units back when the call ends, moved or not") {
  CallGate gate("request bytes in flight (max_inflight_bytes)", "bytes", 100);
  {
    auto big = gate.Enter(60);
    REQUIRE(big.ok());
    CHECK_FALSE(gate.Enter(41).ok());
    std::optional<CallGate::Pass> held;
    held.emplace(*std::move(big));
    CHECK(gate.in_use() == 60);
    auto rest = gate.Enter(40);
    REQUIRE(rest.ok());
    CHECK(gate.in_use() == 100);
  }
  CHECK(gate.in_use() == 0);
  CHECK(gate.Enter(100).ok());
  CHECK_FALSE(gate.Enter(101).ok());
}

TEST_CASE("admission bounds are sized from the job unless set") {
  ServerConfig config;
  config.mutable_job()->mutable_topology()->set_replicas(4);
  config.mutable_job()->mutable_topology()->set_stages(1);
  config.mutable_job()->mutable_topology()->set_spares(1);
  // A 1 M-parameter model: 8 x 4 replicas x 4 MB = 128 MB, below the 256 MiB floor.
  AdmissionBounds small = EffectiveAdmissionBounds(config, 1'000'000);
  CHECK(small.parked_calls == 32 + 2 * 5);
  CHECK(small.inflight_bytes == int64_t{256} << 20);
  CHECK(small.threads == small.parked_calls + 4 * 5 + 64);
  // 100 M parameters: every replica's sync fits eight times over.
  CHECK(EffectiveAdmissionBounds(config, 100'000'000).inflight_bytes ==
        int64_t{8} * 4 * 4 * 100'000'000);
  config.set_max_parked_calls(7);
  config.set_max_inflight_bytes(int64_t{1} << 30);
  config.set_max_threads(50);
  AdmissionBounds set = EffectiveAdmissionBounds(config, 1'000'000);
  CHECK(set.parked_calls == 7);
  CHECK(set.inflight_bytes == int64_t{1} << 30);
  CHECK(set.threads == 50);
}

}  // namespace
}  // namespace rebound::server
