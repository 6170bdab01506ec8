#pragma once

// The process-level half of the testing/cluster library: finding this workspace's binaries,
// scratch directories, a daemon's port file, commands run to completion, the tails of logs and the
// system tools a harness needs. The processes themselves are common/child_process.h's
// ChildProcess (fork/exec, log file, PR_SET_PDEATHSIG, SIGKILL and reap in the destructor);
// testing/cluster/cluster.h starts a whole cluster of them.
//
// Thread-safety: every function is safe to call from any thread, except that WaitForPortFile
// polls `process`, which (as any ChildProcess) one thread owns. Ownership: nothing is kept; the
// functions borrow their arguments for the call. Status codes: see WaitForPortFile; the others
// report failure in their return value (an empty string, -1) or abort (WriteFileOrDie).

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/child_process.h"
#include "common/file.h"

namespace rebound::testing {

// The children of tests and benchmarks: ChildProcess appends to its log, so a restarted daemon's
// log keeps its earlier lives.
using Subprocess = ::rebound::ChildProcess;

using ::rebound::ReadFileOrEmpty;

// Absolute path of a workspace-relative runfile of a test ("server/rebound_server"), from
// TEST_SRCDIR and TEST_WORKSPACE; `path` itself outside a test.
std::string Runfile(const std::string& path);

// A workspace-relative runfile of a binary (a benchmark) that is not a test: under `bazel run`
// (the working directory is the runfiles tree), beside the binary's .runfiles, from RUNFILES_DIR,
// or in bazel-bin next to its package. The first candidate `usable` accepts, made absolute; empty
// if none.
std::string FindRunfile(const std::string& relative, bool (*usable)(const std::string&));
// For FindRunfile's `usable`: a regular file this process may execute, or read.
bool IsExecutableFile(const std::string& path);
bool IsReadableFile(const std::string& path);

// A fresh directory under TEST_TMPDIR (/tmp outside a test): <name>-<pid>-<nanoseconds>.
std::string MakeTempDir(const std::string& name);

// Replaces the file's content; aborts the process when it cannot (a test's own scratch files).
void WriteFileOrDie(const std::string& path, const std::string& content);

// Waits until `path` holds a port number written by a daemon's --port_file (ReadPortFile) and
// returns it. INTERNAL, with the last lines of its log, if `process` exits first;
// DEADLINE_EXCEEDED naming the file after `timeout`.
absl::StatusOr<int> WaitForPortFile(const std::string& path, Subprocess& process,
                                    absl::Duration timeout);

// Runs a command to completion (bounded by `timeout`, then SIGKILL) and returns its exit code
// (-1 if it could not be started); its stdout and stderr are stored in `*output`.
int RunCommand(const std::vector<std::string>& argv, std::string* output, absl::Duration timeout);

// The last `count` non-empty lines of the file at `path`, each indented by four spaces; "" if it
// cannot be read.
std::string LastLines(const std::string& path, size_t count);

// `count` distinct free TCP ports on 127.0.0.1: all bound at once (so none repeats), then
// released for the caller's daemons to bind. INTERNAL when a socket cannot be bound.
absl::StatusOr<std::vector<int>> FreeLoopbackPorts(int count);

// The first of /usr/sbin, /sbin, /usr/bin, /bin that holds an executable `name`; empty if none
// (test environments often have a PATH without the sbin directories).
std::string FindTool(const std::string& name);

}  // namespace rebound::testing
