#pragma once

// A binary's --help (docs/cli.md): a short usage of that program and its own flags, not the
// hundred flags of gflags, glog and every library linked in (gflags' own --help, which also
// exits 1). The flags are read from the gflags registry, so the text cannot fall behind them:
// every flag defined in the binary's main file, with its description and default.
//
// docs/cli.md holds every binary's --help text; tests/docs/cli_doc_test compares them.
//
// Thread-safety: call from main, before other threads start (the registry is read, and
// CheckCommandLineFlags sets flags).

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace rebound {

// `header` (synopsis and what the program does, ending in "\n"), then "Flags:" and every flag
// defined in the file `main_file` (the binary's __FILE__, as gflags records it) in name order,
// as "  --name (type, default D)" and the description wrapped below it, then the --help and
// --version lines, then `footer` (e.g. the exit codes; may be empty). Flags whose description
// starts with "testing only" are named on one line, not described.
std::string UsageText(absl::string_view header, absl::string_view main_file,
                      absl::string_view footer);

// When argv holds --help, -help, -h, --helpshort or -helpshort (before a "--"), prints `usage`
// to stdout and exits 0. Call it first in main, before any flag parsing.
void ExitIfHelpFlag(int argc, char** argv, const std::string& usage);

// Checks argv's flags (up to "--") as gflags::ParseCommandLineFlags would parse them, so that a
// binary can report a usage error with its own exit code (gflags exits 1): OK, or
// INVALID_ARGUMENT naming an unknown flag, a flag without its value, or a value that does not
// parse. Sets the flags it checks (ParseCommandLineFlags then sets them again, to the same).
absl::Status CheckCommandLineFlags(int argc, char** argv);

}  // namespace rebound
