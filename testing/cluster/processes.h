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

// How to start one rebound_server (or any daemon that takes --config, --listen and
// --port_file): the one way every harness of this library, the integration tests and the chaos
// runs start a server that is not a replicated group's member.
struct ServerStart {
  std::string binary;  // absolute path of rebound_server
  std::string config;  // its --config file, written by the caller
  std::string listen;  // its --listen, "host:port"; port 0 for any (the port file says which)
  std::string port_file;  // removed first, so a restart's old port is never read
  std::string log;        // appended to (a restarted server's log keeps its earlier lives)
  std::vector<std::string> extra_args;  // after the flags above
  ChildProcessOptions child;            // a network namespace, a cgroup
  absl::Duration wait = absl::Seconds(30);  // for the port file; callers scale it (time_scale.h)
};

// The command line StartServerProcess runs (kept by a harness that restarts the server).
std::vector<std::string> ServerArgv(const ServerStart& start);

// Starts the server as `start` says and returns the port it serves on once its port file names
// it. `*process` holds the child from its start on, also when it fails: a caller that expects
// the server to refuse to start reads its exit code (process->WaitFor). INTERNAL "rebound_server
// did not start: ..." with its log's last lines if it exits first (or cannot be started),
// DEADLINE_EXCEEDED after `start.wait`.
absl::StatusOr<int> StartServerProcess(const ServerStart& start,
                                       std::unique_ptr<Subprocess>* process);

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
