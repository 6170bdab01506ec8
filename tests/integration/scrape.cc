#include "tests/integration/scrape.h"

#include <catch2/catch.hpp>
#include <httplib.h>

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace rebound::testing {

Exposition ScrapeMetrics(const std::string& address) {
  const std::vector<std::string> parts = absl::StrSplit(address, ':');
  REQUIRE(parts.size() == 2);
  int port = 0;
  REQUIRE(absl::SimpleAtoi(parts[1], &port));
  httplib::Client client(parts[0], port);
  client.set_connection_timeout(5, 0);
  client.set_read_timeout(5, 0);
  auto response = client.Get("/metrics");
  REQUIRE(response);
  REQUIRE(response->status == 200);
  absl::StatusOr<Exposition> parsed = ParseExposition(response->body);
  INFO(response->body);
  INFO(parsed.status());
  REQUIRE(parsed.ok());
  return *parsed;
}

}  // namespace rebound::testing
