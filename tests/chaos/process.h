#pragma once

// Child processes of the chaos harness (tests/chaos/chaos.h): daemons started with fork/exec,
// optionally inside a network namespace, and short tools (ip, tc) run to completion with a
// deadline.
//
// Every child gets PR_SET_PDEATHSIG(SIGKILL), so it dies with the harness even when the harness
// is killed, and a process group of its own (a terminal's Ctrl-C reaches only the harness).
// A ChaosProcess's destructor SIGKILLs (a stopped process too) and reaps it if it still runs.
// REQUIRES: Start() and RunTool() from the thread that owns the children for their whole life
// (the parent-death signal follows the thread that forked).

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace rebound::chaos {

class ChaosProcess {
 public:
  // Starts argv[0] (an absolute path) with stdout and stderr appended to `log_path` and stdin on
  // /dev/null. With `netns_fd` >= 0 the child enters that network namespace (setns) before exec.
  static absl::StatusOr<std::unique_ptr<ChaosProcess>> Start(const std::vector<std::string>& argv,
                                                             const std::string& log_path,
                                                             int netns_fd = -1);
  ~ChaosProcess();

  ChaosProcess(const ChaosProcess&) = delete;
  ChaosProcess& operator=(const ChaosProcess&) = delete;

  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }

  // Sends the signal unless the process has been reaped.
  void Signal(int signal_number) const;

  // The exit code (128 + N when killed by signal N) once it has exited, else nullopt.
  std::optional<int> Poll();

  // Poll() until it exits or `timeout` passes.
  std::optional<int> WaitFor(absl::Duration timeout);

  // SIGTERM and SIGCONT, SIGKILL after `grace`; returns the exit code (-1 if it never exits).
  int Stop(absl::Duration grace);

 private:
  ChaosProcess(pid_t pid, std::string log_path) : pid_(pid), log_path_(std::move(log_path)) {}

  const pid_t pid_;
  const std::string log_path_;
  std::optional<int> exit_code_;
};

// The outcome of RunTool.
struct ToolResult {
  int exit_code = -1;  // 128 + N when killed by signal N; -1 when it could not be started
  std::string output;  // stdout and stderr together
};

// Runs `argv` (argv[0] an absolute path) to completion, inside `netns_fd` when >= 0; SIGKILLed
// after `timeout`.
ToolResult RunTool(const std::vector<std::string>& argv, int netns_fd = -1,
                   absl::Duration timeout = absl::Seconds(10));

// The first of /usr/sbin, /sbin, /usr/bin, /bin that holds an executable `name`; empty if none
// (test environments often have a PATH without the sbin directories).
std::string FindTool(const std::string& name);

// The file's whole content; empty when it cannot be read.
std::string ReadFileOrEmpty(const std::string& path);

// The last `lines` lines of the file, each indented by four spaces.
std::string LastLines(const std::string& path, int lines);

}  // namespace rebound::chaos
