#include "common/metrics.h"

#include <glog/logging.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "absl/strings/str_cat.h"

// gperftools' C API, present when tcmalloc is linked (the server): weak, so that binaries on
// glibc's malloc link without it.
extern "C" int MallocExtension_GetNumericProperty(const char* property, size_t* value)
    __attribute__((weak));
// The sanitizers' allocator (sanitizer/allocator_interface.h), present under --config=tsan and
// --config=fuzz, where it replaces malloc and glibc's mallinfo2 reads zeros.
extern "C" size_t __sanitizer_get_current_allocated_bytes() __attribute__((weak));
extern "C" size_t __sanitizer_get_free_bytes() __attribute__((weak));

namespace rebound {
namespace {

struct HeapBytes {
  size_t in_use = 0;
  size_t free = 0;
};

HeapBytes ReadHeapBytes() {
  HeapBytes heap;
  size_t allocated = 0, size = 0, unmapped = 0;
  if (MallocExtension_GetNumericProperty != nullptr &&
      MallocExtension_GetNumericProperty("generic.current_allocated_bytes", &allocated) &&
      MallocExtension_GetNumericProperty("generic.heap_size", &size) &&
      MallocExtension_GetNumericProperty("tcmalloc.pageheap_unmapped_bytes", &unmapped)) {
    heap.in_use = allocated;
    heap.free = size > allocated + unmapped ? size - allocated - unmapped : 0;
    return heap;
  }
  if (__sanitizer_get_current_allocated_bytes != nullptr && __sanitizer_get_free_bytes != nullptr) {
    heap.in_use = __sanitizer_get_current_allocated_bytes();
    heap.free = __sanitizer_get_free_bytes();
    return heap;
  }
  const struct mallinfo2 info = mallinfo2();
  heap.in_use = info.uordblks + info.hblkhd;
  heap.free = info.fordblks;
  return heap;
}

void AtomicAdd(std::atomic<double>* target, double by) {
  double seen = target->load(std::memory_order_relaxed);
  while (!target->compare_exchange_weak(seen, seen + by, std::memory_order_relaxed)) {
  }
}

bool ValidName(const std::string& name, bool allow_colon) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                       (allow_colon && c == ':');
    const bool digit = c >= '0' && c <= '9';
    if (!alpha && !(digit && i > 0)) return false;
  }
  return true;
}

// Prometheus' float format: integers without a fraction, +Inf/-Inf/NaN spelled out.
std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  if (value == std::floor(value) && std::fabs(value) < 1e15) {
    return absl::StrCat(static_cast<int64_t>(value));
  }
  // The shortest form that reads back as the same double.
  char buffer[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buffer, sizeof(buffer), "%.*g", precision, value);
    if (std::strtod(buffer, nullptr) == value) break;
  }
  return buffer;
}

std::string EscapeHelp(const std::string& help) {
  std::string out;
  for (char c : help) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

void CheckLabels(const MetricLabels& labels) {
  for (const auto& [name, value] : labels) {
    CHECK(ValidName(name, /*allow_colon=*/false) && name.rfind("__", 0) != 0)
        << "bad metric label name '" << name << "'";
  }
}

}  // namespace

void Counter::Increment(double by) {
  if (by < 0 || std::isnan(by)) return;  // counters only go up
  AtomicAdd(&value_, by);
}

void Gauge::Add(double by) { AtomicAdd(&value_, by); }

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  CHECK(std::is_sorted(bounds_.begin(), bounds_.end())) << "histogram bounds must ascend";
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0);
}

void Histogram::Observe(double value) {
  if (std::isnan(value)) return;
  const size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(&sum_, value);
  count_.fetch_add(1, std::memory_order_relaxed);
}

std::vector<uint64_t> Histogram::bucket_counts() const {
  std::vector<uint64_t> counts(bounds_.size() + 1);
  for (size_t i = 0; i < counts.size(); ++i) counts[i] = buckets_[i].load(std::memory_order_relaxed);
  return counts;
}

std::vector<double> LatencyBuckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
          0.1,    0.25,    0.5,    1.0,   2.5,    5.0,   10.0};
}

std::string FormatLabels(const MetricLabels& labels) {
  if (labels.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i > 0) out += ",";
    absl::StrAppend(&out, labels[i].first, "=\"");
    for (char c : labels[i].second) {
      if (c == '\\') out += "\\\\";
      else if (c == '"') out += "\\\"";
      else if (c == '\n') out += "\\n";
      else out += c;
    }
    out += "\"";
  }
  return out + "}";
}

void MetricsWriter::Family(const std::string& name, const std::string& help,
                           const std::string& type) {
  CHECK(ValidName(name, /*allow_colon=*/true)) << "bad metric name '" << name << "'";
  absl::StrAppend(&out_, "# HELP ", name, " ", EscapeHelp(help), "\n# TYPE ", name, " ", type,
                  "\n");
}

void MetricsWriter::Sample(const std::string& name, const MetricLabels& labels, double value) {
  absl::StrAppend(&out_, name, FormatLabels(labels), " ", FormatValue(value), "\n");
}

MetricsRegistry::Family& MetricsRegistry::FamilyLocked(const std::string& name,
                                                       const std::string& help, Type type) {
  for (auto& family : families_) {
    if (family->name == name) {
      CHECK(family->type == type && family->help == help)
          << "metric '" << name << "' registered again with another type or help";
      return *family;
    }
  }
  CHECK(ValidName(name, /*allow_colon=*/true)) << "bad metric name '" << name << "'";
  auto family = std::make_unique<Family>();
  family->name = name;
  family->help = help;
  family->type = type;
  families_.push_back(std::move(family));
  return *families_.back();
}

Counter* MetricsRegistry::GetCounter(const std::string& name, const std::string& help,
                                     const MetricLabels& labels) {
  CheckLabels(labels);
  absl::MutexLock lock(&mu_);
  auto& series = FamilyLocked(name, help, Type::kCounter).counters[labels];
  if (series == nullptr) series = std::make_unique<Counter>();
  return series.get();
}

Gauge* MetricsRegistry::GetGauge(const std::string& name, const std::string& help,
                                 const MetricLabels& labels) {
  CheckLabels(labels);
  absl::MutexLock lock(&mu_);
  auto& series = FamilyLocked(name, help, Type::kGauge).gauges[labels];
  if (series == nullptr) series = std::make_unique<Gauge>();
  return series.get();
}

Histogram* MetricsRegistry::GetHistogram(const std::string& name, const std::string& help,
                                         const std::vector<double>& bounds,
                                         const MetricLabels& labels) {
  CheckLabels(labels);
  for (const auto& [label, value] : labels) CHECK(label != "le") << "'le' is the bucket label";
  absl::MutexLock lock(&mu_);
  auto& series = FamilyLocked(name, help, Type::kHistogram).histograms[labels];
  if (series == nullptr) series = std::make_unique<Histogram>(bounds);
  return series.get();
}

void MetricsRegistry::AddCollector(std::function<void(MetricsWriter*)> collector) {
  absl::MutexLock lock(&mu_);
  collectors_.push_back(std::move(collector));
}

std::string MetricsRegistry::Render() const {
  MetricsWriter writer;
  std::vector<std::function<void(MetricsWriter*)>> collectors;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& family : families_) {
      switch (family->type) {
        case Type::kCounter:
          writer.Family(family->name, family->help, "counter");
          for (const auto& [labels, c] : family->counters) {
            writer.Sample(family->name, labels, c->value());
          }
          break;
        case Type::kGauge:
          writer.Family(family->name, family->help, "gauge");
          for (const auto& [labels, g] : family->gauges) {
            writer.Sample(family->name, labels, g->value());
          }
          break;
        case Type::kHistogram:
          writer.Family(family->name, family->help, "histogram");
          for (const auto& [labels, h] : family->histograms) {
            const std::vector<uint64_t> counts = h->bucket_counts();
            uint64_t cumulative = 0;
            for (size_t i = 0; i < counts.size(); ++i) {
              cumulative += counts[i];
              MetricLabels with_le = labels;
              with_le.emplace_back("le", i < h->bounds().size() ? FormatValue(h->bounds()[i])
                                                                : std::string("+Inf"));
              writer.Sample(family->name + "_bucket", with_le, static_cast<double>(cumulative));
            }
            writer.Sample(family->name + "_sum", labels, h->sum());
            writer.Sample(family->name + "_count", labels, static_cast<double>(cumulative));
          }
          break;
      }
    }
    collectors = collectors_;
  }
  for (const auto& collector : collectors) collector(&writer);
  return writer.Take();
}

void AddProcessMetrics(MetricsRegistry* registry) {
  registry->AddCollector([](MetricsWriter* w) {
    // statm: size resident shared text lib data dt, in pages.
    int64_t size_pages = 0, resident_pages = 0;
    std::ifstream statm("/proc/self/statm");
    if (statm >> size_pages >> resident_pages) {
      w->Family("rebound_process_resident_bytes",
                "Resident memory of this process (RSS), as the kernel counts it.", "gauge");
      w->Sample("rebound_process_resident_bytes", {},
                static_cast<double>(resident_pages) * static_cast<double>(sysconf(_SC_PAGESIZE)));
    }
    const HeapBytes heap = ReadHeapBytes();
    w->Family("rebound_process_heap_bytes",
              "malloc (tcmalloc where linked, a sanitizer's allocator under one, else glibc): "
              "bytes in use (allocated) and bytes "
              "held free for reuse, not returned to the system.",
              "gauge");
    w->Sample("rebound_process_heap_bytes", {{"state", "in_use"}},
              static_cast<double>(heap.in_use));
    w->Sample("rebound_process_heap_bytes", {{"state", "free"}}, static_cast<double>(heap.free));
  });
}

}  // namespace rebound
