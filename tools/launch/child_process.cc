#include "tools/launch/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <deque>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace rebound::launch {
namespace {

int DecodeWaitStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// Only async-signal-safe calls between fork and exec: the launcher has gRPC threads by then.
[[noreturn]] void ExecChild(char* const* args, pid_t parent, int stdin_fd, int log_fd) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);  // the launcher died before prctl took effect
  setpgid(0, 0);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  dup2(stdin_fd, STDIN_FILENO);
  dup2(log_fd, STDOUT_FILENO);
  dup2(log_fd, STDERR_FILENO);
  execv(args[0], args);
  // strerror may allocate; the errno number is written by hand.
  char number[16];
  int at = sizeof(number);
  number[--at] = '\n';
  for (int e = errno; at > 0 && (e > 0 || at == static_cast<int>(sizeof(number)) - 1); e /= 10) {
    number[--at] = static_cast<char>('0' + e % 10);
  }
  static const char kPrefix[] = "rebound_launch: cannot execute ";
  static const char kErrno[] = ": errno ";
  (void)!write(STDERR_FILENO, kPrefix, sizeof(kPrefix) - 1);
  (void)!write(STDERR_FILENO, args[0], strlen(args[0]));
  (void)!write(STDERR_FILENO, kErrno, sizeof(kErrno) - 1);
  (void)!write(STDERR_FILENO, number + at, sizeof(number) - at);
  _exit(127);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Start(
    const std::vector<std::string>& argv, const std::string& log_path) {
  if (argv.empty()) return absl::InvalidArgumentError("empty argv");
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);

  const int log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0) {
    return absl::InternalError(absl::StrCat("cannot open ", log_path, ": ", strerror(errno)));
  }
  const int stdin_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (stdin_fd < 0) {
    close(log_fd);
    return absl::InternalError(absl::StrCat("cannot open /dev/null: ", strerror(errno)));
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) ExecChild(args.data(), parent, stdin_fd, log_fd);
  const int fork_errno = errno;
  close(stdin_fd);
  close(log_fd);
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", strerror(fork_errno)));
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
  const absl::Time deadline = absl::Now() + timeout;
  while (!Poll().has_value() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  return exit_code_;
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

}  // namespace rebound::launch
