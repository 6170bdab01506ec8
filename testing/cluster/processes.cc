#include "testing/cluster/processes.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/clock.h"

namespace rebound::testing {

std::string Runfile(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr) return path;
  return absl::StrCat(srcdir, "/", workspace != nullptr ? workspace : "rebound", "/", path);
}

bool IsExecutableFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
}

bool IsReadableFile(const std::string& path) { return access(path.c_str(), R_OK) == 0; }

std::string FindRunfile(const std::string& relative, bool (*usable)(const std::string&)) {
  std::vector<std::string> candidates;
  if (const char* dir = std::getenv("RUNFILES_DIR"); dir != nullptr) {
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

std::string MakeTempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(base != nullptr ? base : "/tmp", "/", name, "-", getpid(), "-",
                                 absl::ToUnixNanos(DefaultClock()->Now()));
  mkdir(dir.c_str(), 0755);
  return dir;
}

void WriteFileOrDie(const std::string& path, const std::string& content) {
  if (!WriteFile(path, content).ok()) std::abort();
}

absl::StatusOr<int> WaitForPortFile(const std::string& path, Subprocess& process,
                                    absl::Duration timeout) {
  const Clock& clock = *DefaultClock();
  const absl::Time deadline = clock.Now() + timeout;
  while (clock.Now() < deadline) {
    if (std::optional<int> port = ReadPortFile(path)) return *port;
    if (std::optional<int> code = process.Poll()) {
      return absl::InternalError(absl::StrCat("process exited (", DescribeExitCode(*code),
                                              ") before writing ", path, "; its log ends:\n",
                                              LastLines(process.log_path(), 20)));
    }
    clock.WaitFor(absl::Milliseconds(10), nullptr);
  }
  return absl::DeadlineExceededError(
      absl::StrCat("no port in ", path, " within ", absl::FormatDuration(timeout)));
}

std::vector<std::string> ServerArgv(const ServerStart& start) {
  std::vector<std::string> argv = {start.binary, "--config", start.config, "--listen",
                                   start.listen, "--port_file", start.port_file};
  argv.insert(argv.end(), start.extra_args.begin(), start.extra_args.end());
  return argv;
}

absl::StatusOr<int> StartServerProcess(const ServerStart& start,
                                       std::unique_ptr<Subprocess>* process) {
  std::remove(start.port_file.c_str());
  absl::StatusOr<std::unique_ptr<Subprocess>> started =
      Subprocess::Start(ServerArgv(start), start.log, start.child);
  if (!started.ok()) {
    return absl::InternalError(
        absl::StrCat("rebound_server did not start: ", started.status().message()));
  }
  *process = *std::move(started);
  absl::StatusOr<int> port = WaitForPortFile(start.port_file, **process, start.wait);
  if (!port.ok()) {
    return absl::Status(port.status().code(),
                        absl::StrCat("rebound_server did not start: ", port.status().message()));
  }
  return *port;
}

int RunCommand(const std::vector<std::string>& argv, std::string* output, absl::Duration timeout) {
  CompletedCommand done = RunToCompletion(argv, timeout);
  *output = std::move(done.output);
  return done.exit_code;
}

std::string LastLines(const std::string& path, size_t count) {
  std::vector<std::string> lines =
      absl::StrSplit(ReadFileOrEmpty(path), '\n', absl::SkipEmpty());
  if (lines.size() > count) lines.erase(lines.begin(), lines.end() - count);
  std::string out;
  for (const std::string& line : lines) absl::StrAppend(&out, "    ", line, "\n");
  return out;
}

std::string FindTool(const std::string& name) {
  for (const char* dir : {"/usr/sbin", "/sbin", "/usr/bin", "/bin"}) {
    const std::string path = absl::StrCat(dir, "/", name);
    if (access(path.c_str(), X_OK) == 0) return path;
  }
  return "";
}

absl::StatusOr<std::vector<int>> FreeLoopbackPorts(int count) {
  std::vector<int> fds;
  std::vector<int> ports;
  absl::Status status;
  for (int i = 0; i < count && status.ok(); ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      status = absl::InternalError(absl::StrCat("socket: ", strerror(errno)));
      break;
    }
    fds.push_back(fd);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = 0;
    socklen_t length = sizeof(address);
    if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      status = absl::InternalError(absl::StrCat("bind 127.0.0.1:0: ", strerror(errno)));
      break;
    }
    ports.push_back(ntohs(address.sin_port));
  }
  for (int fd : fds) close(fd);
  if (!status.ok()) return status;
  return ports;
}


}  // namespace rebound::testing
