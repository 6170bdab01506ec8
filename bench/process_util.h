#pragma once

// Process helpers shared by the benchmarks that run real clusters (weighting, logging_overhead,
// through bench/local_cluster.h): daemons started with fork/exec, their logs, the runfiles they
// are found in, and the machine's load average. Header-only.

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <deque>
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

namespace rebound::bench {

// The exit code of a waitpid() status: 128 + N when killed by signal N, -1 when neither.
inline int DecodeWaitStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// A daemon started with fork/exec: stdout and stderr in a log file, stdin on /dev/null, a process
// group of its own (a terminal's Ctrl-C reaches only the benchmark) and PR_SET_PDEATHSIG(SIGKILL),
// so it dies with the benchmark even if the benchmark is killed. The destructor SIGKILLs and
// reaps it if it still runs. REQUIRES: Start() from the main thread (the parent-death signal
// follows the thread that forked).
class ChildProcess {
 public:
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(const std::vector<std::string>& argv,
                                                             const std::string& log_path) {
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    const int log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (log_fd < 0) return absl::InternalError(absl::StrCat("cannot open ", log_path));
    const int stdin_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (stdin_fd < 0) {
      close(log_fd);
      return absl::InternalError("cannot open /dev/null");
    }
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid == 0) {
      // Only async-signal-safe calls until exec: gRPC threads exist by now.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      setpgid(0, 0);
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      dup2(stdin_fd, STDIN_FILENO);
      dup2(log_fd, STDOUT_FILENO);
      dup2(log_fd, STDERR_FILENO);
      execv(args[0], args.data());
      static const char kMessage[] = "bench: exec failed\n";
      (void)!write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
      _exit(127);
    }
    close(stdin_fd);
    close(log_fd);
    if (pid < 0) return absl::InternalError("fork failed");
    return std::unique_ptr<ChildProcess>(new ChildProcess(pid, log_path));
  }

  ~ChildProcess() {
    if (!exit_code_.has_value()) {
      kill(pid_, SIGKILL);
      int status = 0;
      waitpid(pid_, &status, 0);
    }
  }

  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }

  void Signal(int signal_number) const {
    if (!exit_code_.has_value()) kill(pid_, signal_number);
  }

  // The exit code (128 + N when killed by signal N) once it has exited, else nullopt.
  std::optional<int> Poll() {
    if (exit_code_.has_value()) return exit_code_;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) exit_code_ = DecodeWaitStatus(status);
    return exit_code_;
  }

  // Poll() until it has exited or `timeout` passed.
  std::optional<int> WaitFor(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (!Poll().has_value() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
    return exit_code_;
  }

  // Sends SIGTERM (and SIGCONT, in case it is frozen); SIGKILL after `grace`. Returns the exit
  // code.
  int Stop(absl::Duration grace) {
    Signal(SIGTERM);
    Signal(SIGCONT);
    std::optional<int> code = WaitFor(grace);
    if (!code.has_value()) {
      Signal(SIGKILL);
      code = WaitFor(absl::Seconds(5));
    }
    return code.value_or(-1);
  }

 private:
  ChildProcess(pid_t pid, std::string log_path) : pid_(pid), log_path_(std::move(log_path)) {}

  const pid_t pid_;
  const std::string log_path_;
  std::optional<int> exit_code_;
};

// The whole file; empty when it cannot be read.
inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// The last `lines` lines of the file, joined by newlines.
inline std::string TailOfFile(const std::string& path, int lines) {
  std::ifstream in(path);
  std::deque<std::string> tail;
  std::string line;
  while (std::getline(in, line)) {
    tail.push_back(line);
    if (static_cast<int>(tail.size()) > lines) tail.pop_front();
  }
  return absl::StrJoin(tail, "\n");
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
