#include "tests/chaos/process.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <deque>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace rebound::chaos {
namespace {

int DecodeWaitStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// Forks and execs `argv` with stdin on /dev/null and stdout, stderr on `out_fd`, in `netns_fd`
// when >= 0. Returns the child's pid, or -1.
pid_t Spawn(const std::vector<std::string>& argv, int out_fd, int netns_fd) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const int stdin_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (stdin_fd < 0) return -1;
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
    if (netns_fd >= 0 && setns(netns_fd, CLONE_NEWNET) != 0) {
      static const char kMessage[] = "chaos: setns failed\n";
      (void)!write(out_fd, kMessage, sizeof(kMessage) - 1);
      _exit(126);
    }
    dup2(stdin_fd, STDIN_FILENO);
    dup2(out_fd, STDOUT_FILENO);
    dup2(out_fd, STDERR_FILENO);
    execv(args[0], args.data());
    static const char kMessage[] = "chaos: exec failed\n";
    (void)!write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
    _exit(127);
  }
  close(stdin_fd);
  return pid;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ChaosProcess>> ChaosProcess::Start(
    const std::vector<std::string>& argv, const std::string& log_path, int netns_fd) {
  const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot open ", log_path));
  const pid_t pid = Spawn(argv, fd, netns_fd);
  close(fd);
  if (pid < 0) return absl::InternalError(absl::StrCat("cannot start ", argv[0]));
  return std::unique_ptr<ChaosProcess>(new ChaosProcess(pid, log_path));
}

ChaosProcess::~ChaosProcess() {
  if (!exit_code_.has_value()) {
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
}

void ChaosProcess::Signal(int signal_number) const {
  if (!exit_code_.has_value()) kill(pid_, signal_number);
}

std::optional<int> ChaosProcess::Poll() {
  if (exit_code_.has_value()) return exit_code_;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) == pid_) exit_code_ = DecodeWaitStatus(status);
  return exit_code_;
}

std::optional<int> ChaosProcess::WaitFor(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!Poll().has_value() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  return exit_code_;
}

int ChaosProcess::Stop(absl::Duration grace) {
  Signal(SIGTERM);
  Signal(SIGCONT);
  std::optional<int> code = WaitFor(grace);
  if (!code.has_value()) {
    Signal(SIGKILL);
    code = WaitFor(absl::Seconds(10));
  }
  return code.value_or(-1);
}

ToolResult RunTool(const std::vector<std::string>& argv, int netns_fd, absl::Duration timeout) {
  ToolResult result;
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) {
    result.output = "cannot create a pipe";
    return result;
  }
  const pid_t pid = Spawn(argv, pipe_fds[1], netns_fd);
  close(pipe_fds[1]);
  if (pid < 0) {
    close(pipe_fds[0]);
    result.output = absl::StrCat("cannot start ", argv[0]);
    return result;
  }
  fcntl(pipe_fds[0], F_SETFL, O_NONBLOCK);
  auto drain = [&] {
    char buffer[4096];
    ssize_t n = 0;
    while ((n = read(pipe_fds[0], buffer, sizeof(buffer))) > 0) result.output.append(buffer, n);
  };
  const absl::Time deadline = absl::Now() + timeout;
  int status = 0;
  while (true) {
    drain();
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (absl::Now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      absl::StrAppend(&result.output, "(killed after ", absl::FormatDuration(timeout), ")");
      break;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  drain();
  close(pipe_fds[0]);
  result.exit_code = DecodeWaitStatus(status);
  return result;
}

std::string FindTool(const std::string& name) {
  for (const char* dir : {"/usr/sbin", "/sbin", "/usr/bin", "/bin"}) {
    const std::string path = absl::StrCat(dir, "/", name);
    if (access(path.c_str(), X_OK) == 0) return path;
  }
  return "";
}

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::string LastLines(const std::string& path, int lines) {
  std::ifstream in(path);
  std::deque<std::string> tail;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    tail.push_back(line);
    if (static_cast<int>(tail.size()) > lines) tail.pop_front();
  }
  std::string out;
  for (const std::string& l : tail) absl::StrAppend(&out, "    ", l, "\n");
  return out;
}

}  // namespace rebound::chaos
