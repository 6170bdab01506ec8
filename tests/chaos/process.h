#pragma once

// Helpers of the chaos harness (tests/chaos/chaos.h) around its child processes: where the
// network tools are, and reading the children's logs.

#include <string>

#include "common/child_process.h"

namespace rebound::chaos {

// Every process the harness starts is a ChildProcess (common/child_process.h), the daemons with
// their log appended to and maybe inside a host's network namespace; `ip` and `tc` run with
// RunToCompletion.

// The first of /usr/sbin, /sbin, /usr/bin, /bin that holds an executable `name`; empty if none
// (test environments often have a PATH without the sbin directories).
std::string FindTool(const std::string& name);

// The file's whole content; empty when it cannot be read.
std::string ReadFileOrEmpty(const std::string& path);

// The last `lines` lines of the file, each indented by four spaces.
std::string LastLines(const std::string& path, int lines);

}  // namespace rebound::chaos
