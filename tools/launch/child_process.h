#pragma once

// A child process of the launcher: started with fork/exec, its stdout and stderr in a log file,
// its stdin on /dev/null, in a process group of its own (so a terminal's Ctrl-C reaches only the
// launcher, which then stops its children in order) and with PR_SET_PDEATHSIG(SIGKILL), so it
// dies with the launcher even if the launcher is killed.
//
// REQUIRES: Start() is called from a thread that lives as long as the child should (the main
// thread): Linux delivers the parent-death signal when the *thread* that forked exits.
// Not thread-safe; one owner polls and signals it.

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace rebound::launch {

class ChildProcess {
 public:
  // Starts argv[0] (a path; PATH is not searched) with stdout and stderr written to `log_path`
  // (truncated). The child starts with no blocked signals. INTERNAL if the log cannot be opened
  // or fork fails; an exec failure shows as exit code 127 with the reason in the log.
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(const std::vector<std::string>& argv,
                                                             const std::string& log_path);

  // SIGKILLs and reaps the child if it is still running.
  ~ChildProcess();

  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }

  // Sends `signal_number` unless the child has already been reaped.
  void Signal(int signal_number) const;

  // Reaps the child if it has exited, without waiting. Returns its exit code (128 + N when killed
  // by signal N), or nullopt while it runs.
  std::optional<int> Poll();

  // Like Poll(), waiting up to `timeout`.
  std::optional<int> WaitFor(absl::Duration timeout);

 private:
  ChildProcess(pid_t pid, std::string log_path) : pid_(pid), log_path_(std::move(log_path)) {}

  const pid_t pid_;
  const std::string log_path_;
  std::optional<int> exit_code_;
};

// "exit code 3", "killed by SIGKILL" ...: a human reading of an exit code from Poll().
std::string DescribeExitCode(int exit_code);

// The last `lines` lines of a text file ("" if it cannot be read).
std::string TailOfFile(const std::string& path, int lines);

}  // namespace rebound::launch
