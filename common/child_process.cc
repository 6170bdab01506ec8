#include "common/child_process.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <deque>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace rebound {
namespace {

// Writes "<prefix><path>: errno <n>\n" to stderr with async-signal-safe calls only.
void WriteChildError(const char* prefix, const char* path) {
  char number[16];
  int at = sizeof(number);
  number[--at] = '\n';
  int e = errno;
  do {
    number[--at] = static_cast<char>('0' + e % 10);
    e /= 10;
  } while (e > 0 && at > 0);
  static const char kErrno[] = ": errno ";
  (void)!write(STDERR_FILENO, prefix, strlen(prefix));
  (void)!write(STDERR_FILENO, path, strlen(path));
  (void)!write(STDERR_FILENO, kErrno, sizeof(kErrno) - 1);
  (void)!write(STDERR_FILENO, number + at, sizeof(number) - at);
}

// Forks and execs `args` with stdin on /dev/null and stdout, stderr on `out_fd`, in `netns_fd`
// when >= 0, in the cgroup whose cgroup.procs file is `cgroup_procs` when not empty. Returns the
// child's pid, or -1 with errno set.
pid_t Spawn(const std::vector<std::string>& argv, int out_fd, int netns_fd,
            const std::string& cgroup_procs) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const int stdin_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (stdin_fd < 0) return -1;
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    // Only async-signal-safe calls until exec: the parent has gRPC threads by now.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the parent died before prctl took effect
    setpgid(0, 0);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    dup2(stdin_fd, STDIN_FILENO);
    dup2(out_fd, STDOUT_FILENO);
    dup2(out_fd, STDERR_FILENO);
    if (netns_fd >= 0 && setns(netns_fd, CLONE_NEWNET) != 0) {
      WriteChildError("cannot enter the network namespace for ", args[0]);
      _exit(126);
    }
    if (!cgroup_procs.empty()) {
      // "0": the writing process itself.
      const int fd = open(cgroup_procs.c_str(), O_WRONLY | O_CLOEXEC);
      if (fd < 0 || write(fd, "0", 1) != 1) {
        WriteChildError("cannot join the cgroup ", cgroup_procs.c_str());
        _exit(126);
      }
      close(fd);
    }
    execv(args[0], args.data());
    WriteChildError("cannot execute ", args[0]);
    _exit(127);
  }
  const int fork_errno = errno;
  close(stdin_fd);
  errno = fork_errno;
  return pid;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Start(
    const std::vector<std::string>& argv, const std::string& log_path,
    const ChildProcessOptions& options) {
  if (argv.empty()) return absl::InvalidArgumentError("empty argv");
  const int log_fd = open(log_path.c_str(),
                          O_WRONLY | O_CREAT | O_CLOEXEC | (options.truncate_log ? O_TRUNC : O_APPEND),
                          0644);
  if (log_fd < 0) {
    return absl::InternalError(absl::StrCat("cannot open ", log_path, ": ", strerror(errno)));
  }
  const pid_t pid = Spawn(argv, log_fd, options.netns_fd,
                          options.cgroup.empty() ? std::string() : options.cgroup + "/cgroup.procs");
  const int spawn_errno = errno;
  close(log_fd);
  if (pid < 0) {
    return absl::InternalError(
        absl::StrCat("cannot start ", argv[0], ": ", strerror(spawn_errno)));
  }
  return std::unique_ptr<ChildProcess>(new ChildProcess(pid, log_path));
}

ChildProcess::~ChildProcess() {
  if (!exit_code_.has_value()) {
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
}

void ChildProcess::Signal(int signal_number) const {
  if (!exit_code_.has_value()) kill(pid_, signal_number);
}

std::optional<int> ChildProcess::Poll() {
  if (exit_code_.has_value()) return exit_code_;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) == pid_) exit_code_ = DecodeWaitStatus(status);
  return exit_code_;
}

std::optional<int> ChildProcess::WaitFor(absl::Duration timeout) {
  const absl::Time deadline = DefaultClock()->Now() + timeout;
  while (!Poll().has_value() && DefaultClock()->Now() < deadline) DefaultClock()->WaitFor(absl::Milliseconds(5), nullptr);
  return exit_code_;
}

int ChildProcess::Stop(absl::Duration grace) {
  Signal(SIGTERM);
  Signal(SIGCONT);
  std::optional<int> code = WaitFor(grace);
  if (!code.has_value()) {
    Signal(SIGKILL);
    code = WaitFor(absl::Seconds(10));
  }
  return code.value_or(-1);
}

CompletedCommand RunToCompletion(const std::vector<std::string>& argv, absl::Duration timeout,
                                 int netns_fd) {
  CompletedCommand result;
  if (argv.empty()) {
    result.output = "empty argv";
    return result;
  }
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) {
    result.output = absl::StrCat("cannot create a pipe: ", strerror(errno));
    return result;
  }
  const pid_t pid = Spawn(argv, pipe_fds[1], netns_fd, std::string());
  const int spawn_errno = errno;
  close(pipe_fds[1]);
  if (pid < 0) {
    close(pipe_fds[0]);
    result.output = absl::StrCat("cannot start ", argv[0], ": ", strerror(spawn_errno));
    return result;
  }
  fcntl(pipe_fds[0], F_SETFL, O_NONBLOCK);
  auto drain = [&] {
    char buffer[4096];
    ssize_t n = 0;
    while ((n = read(pipe_fds[0], buffer, sizeof(buffer))) > 0) result.output.append(buffer, n);
  };
  const absl::Time deadline = DefaultClock()->Now() + timeout;
  int status = 0;
  while (true) {
    drain();
    if (waitpid(pid, &status, WNOHANG) == pid) break;
    if (DefaultClock()->Now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      absl::StrAppend(&result.output, "(killed after ", absl::FormatDuration(timeout), ")");
      break;
    }
    DefaultClock()->WaitFor(absl::Milliseconds(1), nullptr);
  }
  drain();
  close(pipe_fds[0]);
  result.exit_code = DecodeWaitStatus(status);
  return result;
}

int DecodeWaitStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

std::string DescribeExitCode(int exit_code) {
  if (exit_code > 128 && exit_code < 128 + NSIG) {
    const char* abbrev = sigabbrev_np(exit_code - 128);
    return abbrev != nullptr ? absl::StrCat("killed by SIG", abbrev)
                             : absl::StrCat("killed by signal ", exit_code - 128);
  }
  return absl::StrCat("exit code ", exit_code);
}

std::string TailOfFile(const std::string& path, int lines) {
  std::ifstream in(path);
  std::deque<std::string> tail;
  std::string line;
  while (std::getline(in, line)) {
    tail.push_back(line);
    if (static_cast<int>(tail.size()) > lines) tail.pop_front();
  }
  std::string text;
  for (const std::string& l : tail) absl::StrAppend(&text, l, "\n");
  return text;
}

}  // namespace rebound
