#pragma once

// The project's one version (docs/upgrading.md) and the rule by which two Rebound processes of
// different versions decide whether they may work together.
//
// Source. The version is the file VERSION at the repository root: Bazel turns it into a header
// (//common:version_number), the Python package reads the same file. The git commit is baked in
// by stamped builds only (`bazel build --config=release`: --stamp plus
// tools/workspace_status.sh); every other build (tests, `bazel build //...`) says "unknown", so
// a new commit rebuilds nothing but the stamped binaries.
//
// Compatibility (docs/upgrading.md#compatibility). Versions are MAJOR.MINOR.PATCH with an
// optional "-label" ("0.13.0", "1.0.0-rc1"). Two versions are compatible when their MAJORs are
// equal and their MINORs differ by at most one; PATCH and label never matter. So a rolling
// upgrade goes one minor release at a time, and every pair of processes that can meet during it
// (the old and the new release) works together. An empty version is a peer from before versions
// were exchanged (rebound 0.12 and earlier): it counts as kVersionBeforeExchange.
//
// Thread-safety: stateless functions and constants.

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rebound {

// What a peer that sends no version is taken to be.
inline constexpr char kVersionBeforeExchange[] = "0.12.0";

struct Version {
  int major = 0;
  int minor = 0;
  int patch = 0;
  std::string label;  // after '-', may be empty

  std::string ToString() const;  // "MAJOR.MINOR.PATCH[-label]"
};

// "MAJOR.MINOR.PATCH" or "MAJOR.MINOR.PATCH-label", each number a decimal without sign (at most
// 9 digits), the label of [0-9A-Za-z.-]. INVALID_ARGUMENT naming the text otherwise.
absl::StatusOr<Version> ParseVersion(absl::string_view text);

// The rule above.
bool Compatible(const Version& a, const Version& b);

// This build's version ("0.13.0", from VERSION) and git commit ("0123456789ab", with "-dirty"
// when the checkout had changes, or "unknown" in an unstamped build).
const char* ProjectVersion();
const char* BuildCommit();
// "rebound <version> (commit <commit>)": what every binary's --version prints and what the
// server reports as GetStatusResponse.server_version.
std::string VersionLine();

// OK when `peer_version` (as the peer sent it; empty = kVersionBeforeExchange) is compatible
// with `mine`. Else FAILED_PRECONDITION naming both, e.g. "incompatible versions: this server is
// rebound 0.13.0, the worker 'w0' is rebound 1.0.0; ..."; INVALID_ARGUMENT when the peer's
// version does not parse. `self` and `peer` name the two sides ("this server", "the worker
// 'w0'"). The one-argument form checks against ProjectVersion().
absl::Status CheckPeerVersion(const Version& mine, absl::string_view self,
                              absl::string_view peer_version, absl::string_view peer);
absl::Status CheckPeerVersion(absl::string_view self, absl::string_view peer_version,
                              absl::string_view peer);

// When argv holds --version or -version (before a "--"), prints VersionLine() to stdout and
// exits with 0. Call it first in main, before any flag parsing (gflags' own --version prints
// another format).
void ExitIfVersionFlag(int argc, char** argv);

}  // namespace rebound
