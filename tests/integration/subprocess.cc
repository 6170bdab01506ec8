#include "tests/integration/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace rebound::testing {
namespace {

int DecodeWaitStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

pid_t Spawn(const std::vector<std::string>& argv, int out_fd) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    // The test process may block signals; the child must start with a clean mask.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    dup2(out_fd, STDOUT_FILENO);
    dup2(out_fd, STDERR_FILENO);
    execv(args[0], args.data());
    _exit(127);
  }
  return pid;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Start(const std::vector<std::string>& argv,
                                                              const std::string& log_path) {
  const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot open ", log_path));
  const pid_t pid = Spawn(argv, fd);
  close(fd);
  if (pid < 0) return absl::InternalError("fork failed");
  return std::unique_ptr<Subprocess>(new Subprocess(pid, log_path));
}

Subprocess::~Subprocess() {
  if (!exit_code_.has_value()) {
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
}

void Subprocess::Signal(int signal_number) const {
  if (!exit_code_.has_value()) kill(pid_, signal_number);
}

std::optional<int> Subprocess::WaitFor(absl::Duration timeout) {
  if (exit_code_.has_value()) return exit_code_;
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    const pid_t done = waitpid(pid_, &status, WNOHANG);
    if (done == pid_) {
      exit_code_ = DecodeWaitStatus(status);
      return exit_code_;
    }
    if (absl::Now() >= deadline) return std::nullopt;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

std::string Runfile(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr) return path;
  return absl::StrCat(srcdir, "/", workspace != nullptr ? workspace : "rebound", "/", path);
}

std::string MakeTempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(base != nullptr ? base : "/tmp", "/", name, "-", getpid(), "-",
                                 absl::ToUnixNanos(absl::Now()));
  mkdir(dir.c_str(), 0755);
  return dir;
}

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

void WriteFileOrDie(const std::string& path, const std::string& content) {
  std::ofstream out(path);
  out << content;
  if (!out.good()) std::abort();
}

absl::StatusOr<int> WaitForPortFile(const std::string& path, Subprocess& process,
                                    absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    int port = 0;
    const std::string text(absl::StripAsciiWhitespace(ReadFileOrEmpty(path)));
    if (!text.empty() && absl::SimpleAtoi(text, &port) && port > 0) return port;
    if (process.WaitFor(absl::ZeroDuration()).has_value()) {
      return absl::InternalError(absl::StrCat("process exited before writing ", path, "; log:\n",
                                              ReadFileOrEmpty(process.log_path())));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat("no port in ", path));
}

int RunCommand(const std::vector<std::string>& argv, std::string* output, absl::Duration timeout) {
  const std::string log = MakeTempDir("cmd") + "/out";
  auto process = Subprocess::Start(argv, log);
  if (!process.ok()) return -1;
  std::optional<int> code = (*process)->WaitFor(timeout);
  if (!code.has_value()) {
    (*process)->Signal(SIGKILL);
    code = (*process)->WaitFor(absl::Seconds(5));
  }
  *output = ReadFileOrEmpty(log);
  return code.value_or(-1);
}

}  // namespace rebound::testing
