// docs/cli.md holds every binary's --help text: each "## <binary>" section's ```text block is
// exactly what `<binary> --help` prints, so the page cannot fall behind the flags (rebound_launch's
// usage too). The usage
// itself is also a specification: --help and -h print it to stdout and exit 0.
//
// After changing a binary's flags or usage, regenerate the blocks:
//   REBOUND_WRITE_CLI_DOC=1 bazel run //tests/docs:cli_doc_test

#include <catch2/catch.hpp>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "testing/cluster/processes.h"

namespace {

using rebound::testing::RunCommand;
using rebound::testing::Runfile;

struct Binary {
  const char* name;        // the section's heading
  const char* path;        // in the runfiles
  const char* value_flag;  // one of its flags that takes a value
  const char* before;      // what goes before it (reboundctl: a command)
};

constexpr Binary kBinaries[] = {
    {"rebound_server", "server/rebound_server", "--config", ""},
    {"rebound_worker", "worker/rebound_worker", "--config", ""},
    {"rebound_train", "worker/rebound_train", "--config", ""},
    {"reboundctl", "tools/reboundctl", "--timeout_ms", "health "},
    {"rebound_launch", "tools/launch/rebound_launch", "--job", ""},
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string Help(const Binary& binary, const char* flag, int* exit_code) {
  std::string output;
  *exit_code = RunCommand({Runfile(binary.path), flag}, &output, absl::Seconds(30));
  return output;
}

// The [begin, end) of the text block under "## <name>" in `doc`; begin == npos if none.
std::pair<size_t, size_t> Block(const std::string& doc, const std::string& name) {
  const size_t heading = doc.find(absl::StrCat("\n## ", name, "\n"));
  if (heading == std::string::npos) return {std::string::npos, 0};
  const std::string open = "\n```text\n";
  const size_t start = doc.find(open, heading);
  const size_t next = doc.find("\n## ", heading + 1);
  if (start == std::string::npos || (next != std::string::npos && start > next)) {
    return {std::string::npos, 0};
  }
  const size_t begin = start + open.size();
  const size_t end = doc.find("```\n", begin);
  return {begin, end};
}

}  // namespace

TEST_CASE("every binary's --help and -h print its usage to stdout and exit 0") {
  for (const Binary& binary : kBinaries) {
    INFO(binary.name);
    int long_exit = -1;
    int short_exit = -1;
    const std::string help = Help(binary, "--help", &long_exit);
    INFO(help);
    CHECK(long_exit == 0);
    CHECK(Help(binary, "-h", &short_exit) == help);
    CHECK(short_exit == 0);
    CHECK_THAT(help, Catch::Matchers::StartsWith(absl::StrCat("usage: ", binary.name, " ")));
    CHECK_THAT(help, Catch::Matchers::Contains("--version"));
    // Its own flags only, not gflags' and glog's (gflags' --help lists them and exits 1).
    CHECK_THAT(help, !Catch::Matchers::Contains("--logtostderr"));
    CHECK_THAT(help, !Catch::Matchers::Contains("--flagfile"));
    CHECK(help.size() < 6000);
  }
}

TEST_CASE("a flag a binary does not know is a usage error: reboundctl exits 64, the others 2") {
  for (const Binary& binary : kBinaries) {
    INFO(binary.name);
    const int usage_exit = std::string(binary.name) == "reboundctl" ? 64 : 2;
    // An unknown flag; a flag whose value is missing (the last argument).
    const std::pair<std::string, std::string> cases[] = {
        {"--no_such_flag=1 health", "unknown flag --no_such_flag"},
        {absl::StrCat(binary.before, binary.value_flag),
         absl::StrCat("flag ", binary.value_flag, " needs a value")}};
    for (const auto& [args, message] : cases) {
      INFO(args);
      std::string output;
      CHECK(RunCommand({"/bin/sh", "-c", absl::StrCat("\"$0\" ", args), Runfile(binary.path)},
                       &output, absl::Seconds(30)) == usage_exit);
      CHECK_THAT(output, Catch::Matchers::Contains(message));
      // The message goes to stderr: stdout stays empty.
      std::string stdout_only;
      CHECK(RunCommand({"/bin/sh", "-c", absl::StrCat("\"$0\" ", args, " 2>/dev/null"),
                        Runfile(binary.path)},
                       &stdout_only, absl::Seconds(30)) == usage_exit);
      CHECK(stdout_only.empty());
    }
  }
  std::string output;
  CHECK(RunCommand({Runfile("tools/reboundctl"), "--timeout_ms=soon", "health"}, &output,
                   absl::Seconds(30)) == 64);
  CHECK_THAT(output, Catch::Matchers::Contains("--timeout_ms: 'soon' is not a valid int32"));
  CHECK_THAT(output, Catch::Matchers::Contains("usage: reboundctl"));
}

TEST_CASE("docs/cli.md holds exactly each binary's --help text") {
  const std::string path = Runfile("docs/cli.md");
  std::string doc = ReadFile(path);
  REQUIRE(!doc.empty());
  std::vector<std::string> stale;
  for (const Binary& binary : kBinaries) {
    int exit_code = -1;
    const std::string help = Help(binary, "--help", &exit_code);
    REQUIRE(exit_code == 0);
    const auto [begin, end] = Block(doc, binary.name);
    INFO("docs/cli.md needs a section \"## " << binary.name << "\" with a ```text block");
    REQUIRE(begin != std::string::npos);
    REQUIRE(end != std::string::npos);
    if (doc.substr(begin, end - begin) != help) {
      stale.push_back(binary.name);
      doc.replace(begin, end - begin, help);
    }
  }
  const char* write = std::getenv("REBOUND_WRITE_CLI_DOC");
  const char* workspace = std::getenv("BUILD_WORKSPACE_DIRECTORY");  // set by `bazel run`
  if (write != nullptr && workspace != nullptr && !stale.empty()) {
    std::ofstream(absl::StrCat(workspace, "/docs/cli.md")) << doc;
    WARN("rewrote docs/cli.md");
    return;
  }
  std::string names;
  for (const std::string& name : stale) absl::StrAppend(&names, " ", name);
  INFO("stale sections:" << names
       << "; regenerate: REBOUND_WRITE_CLI_DOC=1 bazel run //tests/docs:cli_doc_test");
  CHECK(stale.empty());
}
