// testing/cluster/processes.h: port files, log tails, tools, commands.

#include "testing/cluster/processes.h"

#include <unistd.h>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"

namespace rebound::testing {
namespace {

TEST_CASE("WaitForPortFile returns the port a process writes") {
  const std::string dir = MakeTempDir("port");
  const std::string port_file = dir + "/port";
  auto writer = Subprocess::Start(
      {"/bin/sh", "-c", "sleep 0.2; echo 4242 > " + port_file + ".tmp; mv " + port_file +
                            ".tmp " + port_file + "; sleep 30"},
      dir + "/writer.log");
  REQUIRE(writer.ok());
  absl::StatusOr<int> port = WaitForPortFile(port_file, **writer, absl::Seconds(10));
  INFO(port.status());
  REQUIRE(port.ok());
  CHECK(*port == 4242);
}

TEST_CASE("WaitForPortFile says INTERNAL, with the log, when the process exits first") {
  const std::string dir = MakeTempDir("exits");
  auto quitter =
      Subprocess::Start({"/bin/sh", "-c", "echo cannot listen; exit 3"}, dir + "/quitter.log");
  REQUIRE(quitter.ok());
  absl::StatusOr<int> port = WaitForPortFile(dir + "/port", **quitter, absl::Seconds(10));
  CHECK(port.status().code() == absl::StatusCode::kInternal);
  CHECK(absl::StrContains(port.status().message(), "exit code 3"));
  CHECK(absl::StrContains(port.status().message(), "    cannot listen\n"));
}

TEST_CASE("WaitForPortFile says DEADLINE_EXCEEDED when no port comes") {
  const std::string dir = MakeTempDir("silent");
  auto silent = Subprocess::Start({"/bin/sh", "-c", "sleep 30"}, dir + "/silent.log");
  REQUIRE(silent.ok());
  absl::StatusOr<int> port = WaitForPortFile(dir + "/port", **silent, absl::Milliseconds(100));
  CHECK(port.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(absl::StrContains(port.status().message(), dir + "/port"));
}

TEST_CASE("LastLines keeps the last non-empty lines, indented") {
  const std::string path = MakeTempDir("lines") + "/log";
  WriteFileOrDie(path, "one\n\ntwo\nthree\n\n");
  CHECK(LastLines(path, 2) == "    two\n    three\n");
  CHECK(LastLines(path, 10) == "    one\n    two\n    three\n");
  CHECK(LastLines(path + ".missing", 3).empty());
}

TEST_CASE("RunCommand returns the exit code and the output") {
  std::string output;
  CHECK(RunCommand({"/bin/sh", "-c", "echo out; echo err >&2; exit 2"}, &output,
                   absl::Seconds(10)) == 2);
  CHECK(absl::StrContains(output, "out"));
  CHECK(absl::StrContains(output, "err"));
}

TEST_CASE("FindTool finds sh and not a tool that does not exist") {
  CHECK(!FindTool("sh").empty());
  CHECK(FindTool("no-such-tool-rebound").empty());
}

TEST_CASE("Runfile resolves under the test's runfiles") {
  CHECK(IsExecutableFile(Runfile("server/rebound_server")));
  CHECK(!IsExecutableFile(Runfile("server/no_such_binary")));
}

}  // namespace
}  // namespace rebound::testing
