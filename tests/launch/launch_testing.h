#pragma once

// A run of the real rebound_launch for tests: its own temporary directory with the job file,
// the launcher's output in launch.log, and helpers to read what it printed and to find the
// processes it left. Used by launch_test.cc, launch_group_test.cc and launch_weights_test.cc.
//
// Not thread-safe. Ownership: a Launch owns the launcher process (killed by Subprocess's
// destructor if still running) and leaves its directory for inspection.

#include <catch2/catch.hpp>
#include <dirent.h>
#include <signal.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "testing/cluster/processes.h"

namespace rebound::testing {

// A launcher run: its own directory with the job, the launcher's output in launch.log.
class Launch {
 public:
  // Writes `job` as the job file.
  Launch(const std::string& name, const std::string& job) : dir_(MakeTempDir(name)) {
    WriteFileOrDie(job_file(), job);
  }

  void Start(const std::vector<std::string>& flags) {
    std::vector<std::string> argv = {Runfile("tools/launch/rebound_launch"), "--job", job_file()};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto process = Subprocess::Start(argv, output_file());
    REQUIRE(process.ok());
    process_ = *std::move(process);
  }

  // Waits (at most 60 s) until the output contains `text`; fails with the output otherwise.
  std::string WaitForOutput(const std::string& text) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (true) {
      // Read before checking for exit, so that the last lines of an exited launcher count.
      const bool exited = process_->WaitFor(absl::ZeroDuration()).has_value();
      const std::string output = Output();
      if (absl::StrContains(output, text)) return output;
      if (exited || absl::Now() > deadline) {
        FAIL("the launcher " << (exited ? "exited" : "ran 60 s") << " without printing '" << text
                             << "'; output:\n"
                             << output);
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
  }

  std::optional<int> WaitForExit() { return process_->WaitFor(absl::Seconds(60)); }

  std::string Output() const { return ReadFileOrEmpty(output_file()); }
  Subprocess& process() { return *process_; }
  std::string job_file() const { return dir_ + "/job.pbtxt"; }
  std::string output_file() const { return dir_ + "/launch.log"; }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::unique_ptr<Subprocess> process_;
};

// The number after `prefix` in `text` (e.g. the pid in "started spare-0 (pid 123"), or -1.
inline int NumberAfter(const std::string& text, const std::string& prefix) {
  const size_t at = text.find(prefix);
  if (at == std::string::npos) return -1;
  size_t end = at + prefix.size();
  while (end < text.size() && isdigit(static_cast<unsigned char>(text[end]))) ++end;
  int number = -1;
  if (!absl::SimpleAtoi(text.substr(at + prefix.size(), end - at - prefix.size()), &number)) {
    return -1;
  }
  return number;
}

// The largest step printed for slot `slot` ("0,0") in the progress lines of `output`.
inline int64_t MaxStepOf(const std::string& output, const std::string& slot) {
  int64_t best = -1;
  const std::string prefix = " " + slot + ":";
  for (size_t at = output.find(prefix); at != std::string::npos;
       at = output.find(prefix, at + 1)) {
    size_t end = at + prefix.size();
    while (end < output.size() && isdigit(static_cast<unsigned char>(output[end]))) ++end;
    int64_t step = -1;
    if (absl::SimpleAtoi(output.substr(at + prefix.size(), end - at - prefix.size()), &step)) {
      best = std::max(best, step);
    }
  }
  return best;
}

// Pids of every process in /proc whose command line mentions `text`.
inline std::vector<int> ProcessesMentioning(const std::string& text) {
  std::vector<int> found;
  DIR* proc = opendir("/proc");
  REQUIRE(proc != nullptr);
  while (dirent* entry = readdir(proc)) {
    int pid = 0;
    if (!absl::SimpleAtoi(entry->d_name, &pid)) continue;
    std::string cmdline = ReadFileOrEmpty(absl::StrCat("/proc/", pid, "/cmdline"));
    for (char& c : cmdline) {
      if (c == '\0') c = ' ';
    }
    if (absl::StrContains(cmdline, text)) found.push_back(pid);
  }
  closedir(proc);
  return found;
}

inline bool ProcessExists(int pid) { return kill(pid, 0) == 0 || errno != ESRCH; }

// The rest of the line after `prefix`.
inline std::string LineAfter(const std::string& text, const std::string& prefix) {
  const size_t at = text.find(prefix);
  if (at == std::string::npos) return "";
  const size_t start = at + prefix.size();
  return text.substr(start, text.find('\n', start) - start);
}

}  // namespace rebound::testing
