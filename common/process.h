#pragma once

// Small process-level helpers shared by the daemons' main() functions.

#include <string>

#include "absl/status/status.h"

namespace rebound {

// Blocks SIGTERM and SIGINT in the calling thread (call first in main, before any thread starts,
// so every thread inherits the mask) and returns; WaitForTerminationSignal() then receives them.
void BlockTerminationSignals();

// Waits until SIGTERM or SIGINT arrives and returns its number.
int WaitForTerminationSignal();

// Sends SIGTERM to this process (used to wake WaitForTerminationSignal from inside).
void RaiseTermination();

// Writes `content` to `path` atomically (temp file + rename), so a reader never sees half of it.
absl::Status WriteFileAtomically(const std::string& path, const std::string& content);

// Initialises glog to log to stderr, as daemons under a supervisor should.
void InitLogging(const char* argv0);

}  // namespace rebound
