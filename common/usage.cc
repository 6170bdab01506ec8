#include "common/usage.h"

#include <gflags/gflags.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace rebound {
namespace {

constexpr size_t kWidth = 100;
constexpr char kIndent[] = "      ";

// `text` wrapped at kWidth after kIndent, one "\n" after each line.
std::string Wrapped(absl::string_view text) {
  std::string out;
  std::string line;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!line.empty() && line.size() + 1 + word.size() > kWidth) {
      absl::StrAppend(&out, line, "\n");
      line.clear();
    }
    absl::StrAppend(&line, line.empty() ? kIndent : " ", word);
  }
  if (!line.empty()) absl::StrAppend(&out, line, "\n");
  return out;
}

std::string Default(const gflags::CommandLineFlagInfo& flag) {
  if (flag.type == "string") {
    return flag.default_value.empty() ? "" : absl::StrCat(", default \"", flag.default_value, "\"");
  }
  return absl::StrCat(", default ", flag.default_value);
}

}  // namespace

std::string UsageText(absl::string_view header, absl::string_view main_file,
                      absl::string_view footer) {
  std::vector<gflags::CommandLineFlagInfo> flags;
  gflags::GetAllFlags(&flags);  // sorted by name
  std::string text = absl::StrCat(header, "\nFlags:\n");
  std::vector<std::string> testing_only;
  for (const gflags::CommandLineFlagInfo& flag : flags) {
    if (flag.filename != main_file) continue;
    if (absl::StartsWith(flag.description, "testing only")) {
      testing_only.push_back(absl::StrCat("--", flag.name));
      continue;
    }
    absl::StrAppend(&text, "  --", flag.name, " (", flag.type, Default(flag), ")\n",
                    Wrapped(flag.description));
  }
  absl::StrAppend(&text, "  --help, -h\n", Wrapped("print this text and exit 0"),
                  "  --version\n", Wrapped("print \"rebound <version> (commit <commit>)\" and exit 0"));
  if (!testing_only.empty()) {
    absl::StrAppend(&text, "Testing only (fault injection, docs/operations.md):\n",
                    Wrapped(absl::StrJoin(testing_only, " ")));
  }
  if (!footer.empty()) absl::StrAppend(&text, "\n", footer);
  return text;
}

void ExitIfHelpFlag(int argc, char** argv, const std::string& usage) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") return;
    if (arg == "--help" || arg == "-help" || arg == "-h" || arg == "--helpshort" ||
        arg == "-helpshort") {
      std::fwrite(usage.data(), 1, usage.size(), stdout);
      std::fflush(stdout);
      std::exit(0);
    }
  }
}

absl::Status CheckCommandLineFlags(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;  // an argument, not a flag
    arg.remove_prefix(arg[1] == '-' ? 2 : 1);
    const size_t equals = arg.find('=');
    const std::string name(arg.substr(0, equals));
    gflags::CommandLineFlagInfo flag;
    if (!gflags::GetCommandLineFlagInfo(name.c_str(), &flag)) {
      // --noNAME sets a bool flag NAME to false.
      if (equals == absl::string_view::npos && absl::StartsWith(name, "no") &&
          gflags::GetCommandLineFlagInfo(name.substr(2).c_str(), &flag) && flag.type == "bool") {
        continue;
      }
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
    std::string value;
    if (equals != absl::string_view::npos) {
      value = std::string(arg.substr(equals + 1));
    } else if (flag.type == "bool") {
      continue;
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
    }
    // gflags' own flags that act when set (reading a file, the environment) are left to it.
    if (flag.filename.find("gflags") != std::string::npos) continue;
    if (gflags::SetCommandLineOption(name.c_str(), value.c_str()).empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, ": '", value, "' is not a valid ", flag.type));
    }
  }
  return absl::OkStatus();
}

}  // namespace rebound
