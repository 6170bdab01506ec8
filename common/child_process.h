#pragma once

// Child processes started with fork/exec, shared by the launcher (tools/launch), the
// integration tests, the chaos harness and the benchmarks.
//
// Every child gets stdin on /dev/null, stdout and stderr in a log file, an empty signal mask, a
// process group of its own (a terminal's Ctrl-C reaches only the parent, which stops its children
// in order) and PR_SET_PDEATHSIG(SIGKILL), so it dies with the parent even when the parent is
// killed. A ChildProcess's destructor SIGKILLs (a stopped child too) and reaps it if it still
// runs. Exit codes are the shell's: the status of exit(), or 128 + N when killed by signal N.
//
// REQUIRES: Start() and RunToCompletion() are called from a thread that lives as long as the
// child should (the main thread): Linux delivers the parent-death signal when the *thread* that
// forked exits. Not thread-safe: one owner polls and signals a ChildProcess.
//
//   auto server = ChildProcess::Start({"/opt/rebound/server/rebound_server", "--config", path},
//                                     "/tmp/server.log");
//   if (!server.ok()) return server.status();
//   ...
//   const int code = (*server)->Stop(absl::Seconds(5));

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace rebound {

struct ChildProcessOptions {
  // Empty the log file first; by default the child's output is appended to it (a restarted
  // daemon's log keeps its earlier lives).
  bool truncate_log = false;
  // When >= 0, a network namespace (an fd of /proc/<pid>/ns/net) the child enters before exec.
  int netns_fd = -1;
  // When not empty, a cgroup v2 directory the child moves itself into before exec, so that
  // every socket it makes belongs to that cgroup (testing/cluster/firewall.h). A failure shows
  // as exit code 126 with the reason in the log.
  std::string cgroup;
};

class ChildProcess {
 public:
  // Starts argv[0] (a path; PATH is not searched). INVALID_ARGUMENT for an empty argv, INTERNAL
  // if the log cannot be opened or fork fails; a failed exec (or setns) shows as exit code 127
  // (126) with the reason in the log.
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(
      const std::vector<std::string>& argv, const std::string& log_path,
      const ChildProcessOptions& options);
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(const std::vector<std::string>& argv,
                                                             const std::string& log_path) {
    return Start(argv, log_path, ChildProcessOptions());
  }

  ~ChildProcess();

  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }

  // Sends `signal_number` unless the child has already been reaped.
  void Signal(int signal_number) const;

  // Reaps the child if it has exited, without waiting. Its exit code, or nullopt while it runs.
  std::optional<int> Poll();

  // Like Poll(), waiting up to `timeout`.
  std::optional<int> WaitFor(absl::Duration timeout);

  // SIGTERM (and SIGCONT, for a stopped child), SIGKILL after `grace`. Returns the exit code,
  // or -1 if it did not exit even 10 s after the SIGKILL.
  int Stop(absl::Duration grace);

 private:
  ChildProcess(pid_t pid, std::string log_path) : pid_(pid), log_path_(std::move(log_path)) {}

  const pid_t pid_;
  const std::string log_path_;
  std::optional<int> exit_code_;
};

// What RunToCompletion saw.
struct CompletedCommand {
  int exit_code = -1;  // as above; -1 when it could not be started
  std::string output;  // stdout and stderr together
};

// Runs argv (argv[0] a path) to completion with stdout and stderr captured, inside `netns_fd`
// when >= 0; SIGKILLed after `timeout` (and the output then says so).
CompletedCommand RunToCompletion(const std::vector<std::string>& argv, absl::Duration timeout,
                                 int netns_fd = -1);

// The exit code of a waitpid() status: 128 + N when killed by signal N, -1 when neither.
int DecodeWaitStatus(int status);

// "exit code 3", "killed by SIGKILL": a human reading of an exit code.
std::string DescribeExitCode(int exit_code);

// The last `lines` lines of a text file (a child's log), each ending in a newline; "" if it
// cannot be read.
std::string TailOfFile(const std::string& path, int lines);

}  // namespace rebound
