#pragma once

// Helpers shared by the benchmarks that run real clusters (weighting, logging_overhead, through
// bench/local_cluster.h): files, the runfiles the daemons are found in, and the machine's load
// average. Header-only. The daemons themselves are common/child_process.h's ChildProcess.

#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/child_process.h"

namespace rebound::bench {

// The whole file; empty when it cannot be read.
inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Replaces the file's content; false when it cannot be written.
inline bool WriteFile(const std::string& path, const std::string& content) {
  std::ofstream out(path);
  out << content;
  return out.good();
}

// A regular file this process may execute (for FindRunfile's `usable`).
inline bool IsExecutableFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
}

// A file this process may read (for FindRunfile's `usable`).
inline bool IsReadableFile(const std::string& path) { return access(path.c_str(), R_OK) == 0; }

// A workspace-relative file of the runfiles ("server/rebound_server"): under `bazel run` (the
// working directory is the runfiles tree), beside the binary's .runfiles, from RUNFILES_DIR, or
// in bazel-bin next to bench/. The first candidate `usable` accepts, made absolute; empty if none.
inline std::string FindRunfile(const std::string& relative, bool (*usable)(const std::string&)) {
  std::vector<std::string> candidates;
  if (const char* dir = getenv("RUNFILES_DIR"); dir != nullptr) {
    candidates.push_back(absl::StrCat(dir, "/rebound/", relative));
  }
  char self[4096] = {0};
  const ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (length > 0) {
    const std::string exe(self, length);
    candidates.push_back(absl::StrCat(exe, ".runfiles/rebound/", relative));
    candidates.push_back(absl::StrCat(exe.substr(0, exe.rfind('/')), "/../", relative));
  }
  candidates.push_back(relative);
  for (const std::string& candidate : candidates) {
    if (usable(candidate)) return std::filesystem::absolute(candidate).lexically_normal();
  }
  return "";
}

// The 1-minute load average from /proc/loadavg; -1 when it cannot be read.
inline double LoadAverage() {
  double load = 0.0;
  const std::string text = ReadFile("/proc/loadavg");
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
