#pragma once

// A strict reader of the Prometheus text exposition format (0.0.4), for tests that scrape
// /metrics: it checks what a Prometheus server would refuse and returns the samples.

#include <map>
#include <string>

#include "absl/status/statusor.h"

namespace rebound::testing {

struct Exposition {
  std::map<std::string, std::string> types;  // family name -> counter|gauge|histogram|...
  std::map<std::string, std::string> helps;
  // "name{label="value",...}" exactly as written (labels in written order) -> value.
  std::map<std::string, double> samples;
};

// INVALID_ARGUMENT naming the line when: a sample's family has no # TYPE before it, a name or
// label is malformed, a value does not parse, a series repeats, a family's TYPE or HELP repeats,
// a histogram's buckets are not cumulative or lack le="+Inf", or its _count differs from the
// +Inf bucket.
absl::StatusOr<Exposition> ParseExposition(const std::string& text);

}  // namespace rebound::testing
