#include "common/version.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/version_number.h"  // REBOUND_VERSION, generated from VERSION

namespace rebound {

// Generated: "unknown", or the commit of a stamped build (common/BUILD).
extern const char kBuildCommit[];

namespace {

bool ParseNumber(absl::string_view digits, int* out) {
  if (digits.empty() || digits.size() > 9) return false;
  for (char c : digits) {
    if (!absl::ascii_isdigit(c)) return false;
  }
  return absl::SimpleAtoi(digits, out);
}

}  // namespace

std::string Version::ToString() const {
  std::string text = absl::StrCat(major, ".", minor, ".", patch);
  if (!label.empty()) absl::StrAppend(&text, "-", label);
  return text;
}

absl::StatusOr<Version> ParseVersion(absl::string_view text) {
  const auto invalid = [text] {
    return absl::InvalidArgumentError(absl::StrCat(
        "version \"", text, "\" is not MAJOR.MINOR.PATCH[-label] (e.g. \"0.13.0\")"));
  };
  Version version;
  absl::string_view numbers = text;
  if (const size_t dash = text.find('-'); dash != absl::string_view::npos) {
    numbers = text.substr(0, dash);
    version.label = std::string(text.substr(dash + 1));
    if (version.label.empty()) return invalid();
    for (char c : version.label) {
      if (!absl::ascii_isalnum(c) && c != '.' && c != '-') return invalid();
    }
  }
  const std::vector<absl::string_view> parts = absl::StrSplit(numbers, '.');
  if (parts.size() != 3 || !ParseNumber(parts[0], &version.major) ||
      !ParseNumber(parts[1], &version.minor) || !ParseNumber(parts[2], &version.patch)) {
    return invalid();
  }
  return version;
}

bool Compatible(const Version& a, const Version& b) {
  return a.major == b.major && std::abs(a.minor - b.minor) <= 1;
}

const char* ProjectVersion() { return REBOUND_VERSION; }

const char* BuildCommit() { return kBuildCommit; }

std::string VersionLine() {
  return absl::StrCat("rebound ", ProjectVersion(), " (commit ", BuildCommit(), ")");
}

absl::Status CheckPeerVersion(const Version& mine, absl::string_view self,
                              absl::string_view peer_version, absl::string_view peer) {
  const bool sent = !peer_version.empty();
  absl::StatusOr<Version> theirs = ParseVersion(sent ? peer_version : kVersionBeforeExchange);
  if (!theirs.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(peer, " sent a malformed version: ", theirs.status().message()));
  }
  if (Compatible(mine, *theirs)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "incompatible versions: ", self, " is rebound ", mine.ToString(), ", ", peer,
      " is rebound ",
      sent ? std::string(peer_version)
           : absl::StrCat(kVersionBeforeExchange, " or older (it sent no version)"),
      "; versions work together when they have the same major version and their minor "
      "versions differ by at most 1: upgrade one minor release at a time (docs/upgrading.md)"));
}

absl::Status CheckPeerVersion(absl::string_view self, absl::string_view peer_version,
                              absl::string_view peer) {
  absl::StatusOr<Version> mine = ParseVersion(ProjectVersion());
  if (!mine.ok()) return absl::InternalError(mine.status().message());
  return CheckPeerVersion(*mine, self, peer_version, peer);
}

void ExitIfVersionFlag(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--") == 0) return;
    if (std::strcmp(argv[i], "--version") == 0 || std::strcmp(argv[i], "-version") == 0) {
      std::printf("%s\n", VersionLine().c_str());
      std::fflush(stdout);
      std::exit(0);
    }
  }
}

}  // namespace rebound
