#include "tests/integration/subprocess.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace rebound::testing {

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
  CompletedCommand done = RunToCompletion(argv, timeout);
  *output = std::move(done.output);
  return done.exit_code;
}

}  // namespace rebound::testing
