#pragma once

// Real processes for integration tests: start a binary of this workspace, signal it, wait for it
// with a bound, and always clean up (the destructor SIGKILLs a child still running, and every
// child is started with PR_SET_PDEATHSIG so it dies with the test even if the test crashes).

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/child_process.h"

namespace rebound::testing {

// The test's children: ChildProcess appends to its log, so a restarted daemon's log keeps its
// earlier lives.
using Subprocess = ::rebound::ChildProcess;

// Absolute path of a workspace-relative runfile, e.g. "server/rebound_server".
std::string Runfile(const std::string& path);

// A fresh directory under TEST_TMPDIR.
std::string MakeTempDir(const std::string& name);

std::string ReadFileOrEmpty(const std::string& path);
void WriteFileOrDie(const std::string& path, const std::string& content);

// Waits until `path` holds a port number written by a daemon's --port_file; fails if the
// process exits first or the timeout passes.
absl::StatusOr<int> WaitForPortFile(const std::string& path, Subprocess& process,
                                    absl::Duration timeout);

// Runs a command to completion (bounded by `timeout`, then SIGKILL) and returns its exit code;
// its stdout and stderr are stored in `*output`.
int RunCommand(const std::vector<std::string>& argv, std::string* output, absl::Duration timeout);

}  // namespace rebound::testing
