#pragma once

// GET http://address/metrics of a real rebound_server or rebound_worker, parsed by the strict
// Prometheus text reader (tests/common/prometheus_text.h). Catch2 REQUIREs on any failure.

#include <string>

#include "tests/common/prometheus_text.h"

namespace rebound::testing {

// `address` is host:port as GetStatus announces it (127.0.0.1 unless configured).
Exposition ScrapeMetrics(const std::string& address);

}  // namespace rebound::testing
