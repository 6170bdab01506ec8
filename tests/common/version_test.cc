// common/version: versions parse as MAJOR.MINOR.PATCH[-label]; two are compatible when their
// majors are equal and their minors at most one apart; a peer's incompatible version is
// FAILED_PRECONDITION naming both; an empty one counts as 0.12.0; the build's version is VERSION's.

#include "common/version.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/file.h"

namespace rebound {
namespace {

Version V(const std::string& text) {
  absl::StatusOr<Version> version = ParseVersion(text);
  INFO(text);
  REQUIRE(version.ok());
  return *version;
}

TEST_CASE("a version parses into its numbers and label") {
  const Version plain = V("0.13.0");
  CHECK(plain.major == 0);
  CHECK(plain.minor == 13);
  CHECK(plain.patch == 0);
  CHECK(plain.label.empty());
  const Version labelled = V("12.345.6789-rc.1-b2");
  CHECK(labelled.major == 12);
  CHECK(labelled.minor == 345);
  CHECK(labelled.patch == 6789);
  CHECK(labelled.label == "rc.1-b2");
  CHECK(labelled.ToString() == "12.345.6789-rc.1-b2");
  CHECK(V("1.02.3").ToString() == "1.2.3");
}

TEST_CASE("malformed versions are INVALID_ARGUMENT naming the text") {
  for (const std::string text :
       {"", "1", "1.2", "1.2.3.4", "v1.2.3", "1.2.x", "1.2.3-", "-1.2.3", "1.-2.3", "1.2.3-a b",
        "1.2.3 ", "+1.2.3", "1..3", "1234567890.0.0", "rebound 0.13.0"}) {
    INFO("\"" << text << "\"");
    absl::StatusOr<Version> version = ParseVersion(text);
    REQUIRE(version.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(version.status().message(), absl::StrCat("\"", text, "\"")));
  }
}

TEST_CASE("same major and minors at most one apart are compatible, patch and label aside") {
  CHECK(Compatible(V("0.13.0"), V("0.13.9")));
  CHECK(Compatible(V("0.13.0"), V("0.12.5")));
  CHECK(Compatible(V("0.13.0"), V("0.14.0-rc1")));
  CHECK(Compatible(V("0.14.0-rc1"), V("0.13.0")));
  CHECK_FALSE(Compatible(V("0.13.0"), V("0.15.0")));
  CHECK_FALSE(Compatible(V("0.13.0"), V("0.11.0")));
  CHECK_FALSE(Compatible(V("0.13.0"), V("1.13.0")));
  CHECK_FALSE(Compatible(V("1.0.0"), V("0.99.0")));  // a new major, even one minor "apart"
  CHECK(Compatible(V("2.0.0"), V("2.1.3")));
}

TEST_CASE("an incompatible peer is FAILED_PRECONDITION naming both versions and the rule") {
  const absl::Status status =
      CheckPeerVersion(V("0.13.0"), "this server", "0.15.2", "the worker 'w0'");
  REQUIRE(status.code() == absl::StatusCode::kFailedPrecondition);
  const std::string message(status.message());
  CHECK(absl::StrContains(message, "this server is rebound 0.13.0"));
  CHECK(absl::StrContains(message, "the worker 'w0' is rebound 0.15.2"));
  CHECK(absl::StrContains(message, "docs/upgrading.md"));
  CHECK(CheckPeerVersion(V("0.13.0"), "this server", "0.14.1", "the worker 'w0'").ok());
}

TEST_CASE("a peer that sends no version counts as 0.12.0") {
  CHECK(std::string(kVersionBeforeExchange) == "0.12.0");
  CHECK(CheckPeerVersion(V("0.13.0"), "this server", "", "the worker 'w0'").ok());
  CHECK(CheckPeerVersion(V("0.11.4"), "this server", "", "the worker 'w0'").ok());
  const absl::Status status = CheckPeerVersion(V("0.14.0"), "the leader", "", "standby 'b'");
  REQUIRE(status.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(status.message(), "the leader is rebound 0.14.0"));
  CHECK(absl::StrContains(status.message(), "standby 'b' is rebound 0.12.0 or older (it sent "
                                            "no version)"));
}

TEST_CASE("a malformed peer version is INVALID_ARGUMENT naming the peer") {
  const absl::Status status = CheckPeerVersion(V("0.13.0"), "this server", "13", "the worker 'w'");
  REQUIRE(status.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StartsWith(status.message(), "the worker 'w' sent a malformed version"));
}

TEST_CASE("this build's version is the one in VERSION, and it parses") {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  REQUIRE(srcdir != nullptr);
  absl::StatusOr<std::string> file = ReadFile(absl::StrCat(srcdir, "/rebound/VERSION"), 1024);
  REQUIRE(file.ok());
  const std::string expected(absl::StripAsciiWhitespace(*file));
  CHECK(std::string(ProjectVersion()) == expected);
  CHECK(ParseVersion(ProjectVersion()).ok());
  CHECK(absl::StartsWith(VersionLine(), absl::StrCat("rebound ", expected, " (commit ")));
  CHECK(CheckPeerVersion("this server", ProjectVersion(), "the worker").ok());
}

TEST_CASE("the rule gives the golden answers the Python package gives too") {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  REQUIRE(srcdir != nullptr);
  absl::StatusOr<std::string> file = ReadFile(
      absl::StrCat(srcdir, "/rebound/tests/common/testdata/version_compatibility.txt"), 1 << 16);
  REQUIRE(file.ok());
  int cases = 0;
  for (absl::string_view line : absl::StrSplit(*file, '\n', absl::SkipWhitespace())) {
    if (absl::StartsWith(line, "#")) continue;
    const std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    REQUIRE(fields.size() == 3);
    INFO(line);
    const bool expected = fields[2] == "yes";
    const std::string peer = fields[1] == "-" ? "" : fields[1];
    const absl::Status checked = CheckPeerVersion(V(fields[0]), "a", peer, "b");
    CHECK(checked.ok() == expected);
    if (!expected) CHECK(checked.code() == absl::StatusCode::kFailedPrecondition);
    if (!peer.empty()) {
      CHECK(Compatible(V(fields[0]), V(peer)) == expected);
      CHECK(Compatible(V(peer), V(fields[0])) == expected);  // symmetric
    }
    ++cases;
  }
  CHECK(cases >= 10);
}

// Runs ExitIfVersionFlag(args) in a child; its stdout, or "(returned)" when it did not exit.
std::string RunVersionFlag(std::vector<std::string> args, int* exit_code) {
  int pipe_fds[2];
  REQUIRE(pipe(pipe_fds) == 0);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    dup2(pipe_fds[1], STDOUT_FILENO);
    close(pipe_fds[0]);
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    ExitIfVersionFlag(static_cast<int>(argv.size()), argv.data());
    const char returned[] = "(returned)";
    (void)!write(STDOUT_FILENO, returned, sizeof(returned) - 1);
    _exit(42);
  }
  close(pipe_fds[1]);
  std::string out;
  char buffer[256];
  for (ssize_t n; (n = read(pipe_fds[0], buffer, sizeof(buffer))) > 0;) out.append(buffer, n);
  close(pipe_fds[0]);
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  *exit_code = WEXITSTATUS(status);
  return out;
}

TEST_CASE("--version prints the version line and exits 0, unless after --") {
  int code = -1;
  CHECK(RunVersionFlag({"prog", "--config", "x", "--version"}, &code) == VersionLine() + "\n");
  CHECK(code == 0);
  CHECK(RunVersionFlag({"prog", "-version"}, &code) == VersionLine() + "\n");
  CHECK(code == 0);
  CHECK(RunVersionFlag({"prog", "--", "--version"}, &code) == "(returned)");
  CHECK(code == 42);
  CHECK(RunVersionFlag({"prog", "--versions"}, &code) == "(returned)");
  CHECK(code == 42);
}

}  // namespace
}  // namespace rebound
