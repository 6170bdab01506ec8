// The metrics registry's exposition (common/metrics.h), read back by a strict parser of the
// Prometheus text format, and the HTTP endpoint (common/metrics_http.h) scraped over loopback.

#include <catch2/catch.hpp>
#include <httplib.h>

#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "common/metrics.h"
#include "common/metrics_http.h"
#include "tests/common/prometheus_text.h"

namespace rebound {
namespace {

using testing::Exposition;
using testing::ParseExposition;

TEST_CASE("counters, gauges and histograms render in the Prometheus text format") {
  MetricsRegistry registry;
  registry.GetCounter("rebound_syncs_total", "Syncs applied.", {{"slot", "0,0"}})->Increment(3);
  registry.GetCounter("rebound_syncs_total", "Syncs applied.", {{"slot", "1,0"}})->Increment();
  registry.GetCounter("rebound_syncs_total", "Syncs applied.", {{"slot", "1,0"}})->Increment(-5);
  registry.GetGauge("rebound_weight", "Weight.", {{"slot", "a\"b\\c\nd"}})->Set(0.25);
  Histogram* latency =
      registry.GetHistogram("rebound_rpc_seconds", "Latency.", {0.001, 0.01}, {{"method", "Sync"}});
  latency->Observe(0.0005);
  latency->Observe(0.001);  // on the bound: in that bucket (le is inclusive)
  latency->Observe(0.005);
  latency->Observe(3.0);
  registry.AddCollector([](MetricsWriter* w) {
    w->Family("rebound_collected", "From a collector.", "gauge");
    w->Sample("rebound_collected", {}, 1e-7);
  });

  const std::string text = registry.Render();
  INFO(text);
  absl::StatusOr<Exposition> parsed = ParseExposition(text);
  INFO(parsed.status());
  REQUIRE(parsed.ok());
  CHECK(parsed->types.at("rebound_syncs_total") == "counter");
  CHECK(parsed->types.at("rebound_rpc_seconds") == "histogram");
  CHECK(parsed->helps.at("rebound_weight") == "Weight.");
  CHECK(parsed->samples.at("rebound_syncs_total{slot=\"0,0\"}") == 3);
  CHECK(parsed->samples.at("rebound_syncs_total{slot=\"1,0\"}") == 1);  // never goes down
  CHECK(parsed->samples.at("rebound_weight{slot=\"a\\\"b\\\\c\\nd\"}") == 0.25);
  CHECK(parsed->samples.at("rebound_rpc_seconds_bucket{method=\"Sync\",le=\"0.001\"}") == 2);
  CHECK(parsed->samples.at("rebound_rpc_seconds_bucket{method=\"Sync\",le=\"0.01\"}") == 3);
  CHECK(parsed->samples.at("rebound_rpc_seconds_bucket{method=\"Sync\",le=\"+Inf\"}") == 4);
  CHECK(parsed->samples.at("rebound_rpc_seconds_count{method=\"Sync\"}") == 4);
  CHECK(std::fabs(parsed->samples.at("rebound_rpc_seconds_sum{method=\"Sync\"}") - 3.0065) < 1e-9);
  CHECK(parsed->samples.at("rebound_collected") == 1e-7);
  // Shortest round-trip forms, not 17 digits.
  CHECK(text.find("le=\"0.001\"") != std::string::npos);
  CHECK(text.find("rebound_collected 1e-07\n") != std::string::npos);
}

TEST_CASE("the parser refuses what Prometheus would refuse") {
  CHECK_FALSE(ParseExposition("x 1\n").ok());  // no TYPE
  CHECK_FALSE(ParseExposition("# TYPE x gauge\nx{a=\"1\"} one\n").ok());
  CHECK_FALSE(ParseExposition("# TYPE x gauge\nx 1\nx 2\n").ok());
  CHECK_FALSE(ParseExposition("# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\n"
                              "h_count 1\n").ok());
  CHECK_FALSE(ParseExposition("# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_count 3\n").ok());
  CHECK(ParseExposition("# TYPE x gauge\nx 1\n").ok());
}

TEST_CASE("updates from many threads are all counted") {
  MetricsRegistry registry;
  Counter* counter = registry.GetCounter("c_total", "C.");
  Histogram* histogram = registry.GetHistogram("h", "H.", LatencyBuckets());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        counter->Increment();
        histogram->Observe(0.002);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  CHECK(counter->value() == 40000);
  CHECK(histogram->count() == 40000);
  CHECK(std::fabs(histogram->sum() - 80.0) < 1e-6);
}

TEST_CASE("the process collector reports the heap in use, whichever allocator is linked") {
  // glibc's here, TSan's under --config=tsan (where mallinfo2 reads zeros), tcmalloc's in the
  // server: 4 MiB held while collecting must show.
  std::vector<char> held(4 << 20, 1);
  asm volatile("" : : "r"(held.data()) : "memory");  // the compiler may not elide it
  MetricsRegistry registry;
  AddProcessMetrics(&registry);
  const std::string text = registry.Render();
  INFO(text);
  absl::StatusOr<Exposition> parsed = ParseExposition(text);
  REQUIRE(parsed.ok());
  REQUIRE(parsed->samples.count("rebound_process_heap_bytes{state=\"in_use\"}") == 1);
  CHECK(parsed->samples.at("rebound_process_heap_bytes{state=\"in_use\"}") >= held.size());
  CHECK(parsed->samples.at("rebound_process_heap_bytes{state=\"free\"}") >= 0);
}

TEST_CASE("GET /metrics serves the registry over HTTP; other paths are 404") {
  MetricsRegistry registry;
  registry.GetGauge("rebound_up", "Up.")->Set(1);
  auto server = MetricsHttpServer::Start("127.0.0.1:0", &registry);
  REQUIRE(server.ok());
  REQUIRE((*server)->port() > 0);
  CHECK((*server)->address() == "127.0.0.1:" + std::to_string((*server)->port()));
  httplib::Client client("127.0.0.1", (*server)->port());
  client.set_connection_timeout(5, 0);
  client.set_read_timeout(5, 0);
  auto response = client.Get("/metrics");
  REQUIRE(response);
  CHECK(response->status == 200);
  CHECK(response->get_header_value("Content-Type") == "text/plain; version=0.0.4; charset=utf-8");
  auto parsed = ParseExposition(response->body);
  REQUIRE(parsed.ok());
  CHECK(parsed->samples.at("rebound_up") == 1);
  auto missing = client.Get("/other");
  REQUIRE(missing);
  CHECK(missing->status == 404);
  // A port in use is refused clearly.
  auto twice = MetricsHttpServer::Start((*server)->address(), &registry);
  CHECK(twice.status().code() == absl::StatusCode::kUnavailable);
  CHECK(MetricsHttpServer::Start("no-port", &registry).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rebound
