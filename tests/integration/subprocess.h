#pragma once

// Real processes for integration tests: start a binary of this workspace, signal it, wait for it
// with a bound, and always clean up (the destructor SIGKILLs a child still running, and every
// child is started with PR_SET_PDEATHSIG so it dies with the test even if the test crashes).

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace rebound::testing {

class Subprocess {
 public:
  // Starts argv[0] with stdout and stderr appended to `log_path`.
  static absl::StatusOr<std::unique_ptr<Subprocess>> Start(const std::vector<std::string>& argv,
                                                           const std::string& log_path);
  ~Subprocess();

  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  pid_t pid() const { return pid_; }
  void Signal(int signal_number) const;

  // Waits up to `timeout` for the process to exit. Returns its exit code (128 + signal when
  // killed by a signal), or nullopt if it is still running.
  std::optional<int> WaitFor(absl::Duration timeout);

  const std::string& log_path() const { return log_path_; }

 private:
  Subprocess(pid_t pid, std::string log_path) : pid_(pid), log_path_(std::move(log_path)) {}

  pid_t pid_;
  std::string log_path_;
  std::optional<int> exit_code_;
};

// Absolute path of a workspace-relative runfile, e.g. "server/rebound_server".
std::string Runfile(const std::string& path);

// A fresh directory under TEST_TMPDIR.
std::string MakeTempDir(const std::string& name);

std::string ReadFileOrEmpty(const std::string& path);
void WriteFileOrDie(const std::string& path, const std::string& content);

// Waits until `path` holds a port number written by a daemon's --port_file; fails if the
// process exits first or the timeout passes.
absl::StatusOr<int> WaitForPortFile(const std::string& path, Subprocess& process,
                                    absl::Duration timeout);

// Runs a command to completion (bounded by `timeout`, then SIGKILL) and returns its exit code;
// stdout is stored in `*output`.
int RunCommand(const std::vector<std::string>& argv, std::string* output, absl::Duration timeout);

}  // namespace rebound::testing
