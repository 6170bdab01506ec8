#pragma once

// The machine's load average, which every benchmark prints beside its figures (a figure measured
// under load reads differently). Header-only. The cluster the benchmarks measure, its processes
// and runfiles are the testing/cluster library's (bench/local_cluster.h).
//
// Thread-safety: LoadAverage() may be called from any thread; a LoadAverageMeter is used by one.
// Nothing is borrowed or kept beyond a call.

#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/file.h"

namespace rebound::bench {

// The 1-minute load average from /proc/loadavg; -1 when it cannot be read.
inline double LoadAverage() {
  double load = 0.0;
  const std::string text = ReadFileOrEmpty("/proc/loadavg");
  std::vector<std::string> fields = absl::StrSplit(text, ' ');
  if (fields.empty() || !absl::SimpleAtod(fields[0], &load)) return -1.0;
  return load;
}

// The mean of the load averages sampled during a run.
class LoadAverageMeter {
 public:
  void Sample() {
    sum_ += LoadAverage();
    ++samples_;
  }
  // The mean of the samples; the load average now when there was none.
  double Mean() const { return samples_ > 0 ? sum_ / samples_ : LoadAverage(); }

 private:
  double sum_ = 0.0;
  int samples_ = 0;
};

}  // namespace rebound::bench
