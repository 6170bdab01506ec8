#pragma once

// Prometheus metrics (text exposition format 0.0.4) for the server and the workers.
//
// A MetricsRegistry holds families of counters, gauges and histograms, each family a name, a
// help text and a type, with one time series per label set. Updates are lock-free atomics on the
// series (look a series up once and keep the pointer: series live as long as the registry);
// Render writes every family in registration order, its series in label order. A collector
// (AddCollector) adds series computed at scrape time, e.g. from the server's status.
//
//   MetricsRegistry registry;
//   Counter* syncs = registry.GetCounter("rebound_rpcs_total", "RPCs handled.",
//                                        {{"method", "Sync"}, {"code", "OK"}});
//   syncs->Increment();
//   std::string text = registry.Render();
//
// Names must match [a-zA-Z_:][a-zA-Z0-9_:]*, label names [a-zA-Z_][a-zA-Z0-9_]*; label values are
// escaped on output. Asking for a family again with another type or help is a programming error
// (CHECK-fails). Thread-safe.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/clock.h"
#include "absl/time/time.h"

namespace rebound {

using MetricLabels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  void Increment(double by = 1.0);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Add(double by);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Cumulative buckets with upper bounds `bounds` (ascending, finite), plus +Inf, sum and count.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double value);
  void ObserveDuration(absl::Duration d) { Observe(absl::ToDoubleSeconds(d)); }

  const std::vector<double>& bounds() const { return bounds_; }
  // Per bucket (bounds().size() + 1, the last is +Inf), not cumulative.
  std::vector<uint64_t> bucket_counts() const;
  double sum() const { return sum_.load(std::memory_order_relaxed); }
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }

 private:
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;
  std::atomic<double> sum_{0.0};
  std::atomic<uint64_t> count_{0};
};

// Latency buckets in seconds: 100 us to 10 s.
std::vector<double> LatencyBuckets();

// Series written by a collector at scrape time.
class MetricsWriter {
 public:
  // A family header (once per family per scrape), then its samples.
  void Family(const std::string& name, const std::string& help, const std::string& type);
  void Sample(const std::string& name, const MetricLabels& labels, double value);

  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class MetricsRegistry {
 public:
  MetricsRegistry() = default;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  Counter* GetCounter(const std::string& name, const std::string& help,
                      const MetricLabels& labels = {});
  Gauge* GetGauge(const std::string& name, const std::string& help,
                  const MetricLabels& labels = {});
  Histogram* GetHistogram(const std::string& name, const std::string& help,
                          const std::vector<double>& bounds, const MetricLabels& labels = {});

  // Called at every Render, after the registered families; must be thread-safe.
  void AddCollector(std::function<void(MetricsWriter*)> collector);

  std::string Render() const;

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Family {
    std::string name;
    std::string help;
    Type type;
    std::map<MetricLabels, std::unique_ptr<Counter>> counters;
    std::map<MetricLabels, std::unique_ptr<Gauge>> gauges;
    std::map<MetricLabels, std::unique_ptr<Histogram>> histograms;
  };
  Family& FamilyLocked(const std::string& name, const std::string& help, Type type)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Family>> families_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void(MetricsWriter*)>> collectors_ ABSL_GUARDED_BY(mu_);
};

// Formats a label set as {a="x",b="y"} with values escaped (\\, \", \n); "" when empty.
std::string FormatLabels(const MetricLabels& labels);

// Times a scope into a histogram, on `clock` (borrowed; outlives the scope).
class ScopedLatency {
 public:
  explicit ScopedLatency(Histogram* histogram, const Clock* clock = DefaultClock())
      : histogram_(histogram), clock_(clock), start_(clock->Now()) {}
  ~ScopedLatency() {
    if (histogram_ != nullptr) histogram_->ObserveDuration(clock_->Now() - start_);
  }

 private:
  Histogram* histogram_;
  const Clock* clock_;
  absl::Time start_;
};

// Registers a collector of the process's own memory: rebound_process_resident_bytes (what the
// kernel counts, /proc/self/statm) and rebound_process_heap_bytes{state="in_use"|"free"} (malloc:
// bytes handed out, and bytes it holds free without returning them to the kernel; tcmalloc's
// figures where it is linked, as in the server, the sanitizer allocator's under --config=tsan
// or --config=fuzz, else glibc's). A
// leak shows as in_use growing; RSS alone also moves with the allocator's retention.
void AddProcessMetrics(MetricsRegistry* registry);

}  // namespace rebound
