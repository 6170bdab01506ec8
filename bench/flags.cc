#include "bench/flags.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace rebound::bench {
namespace {

// The text after "name=" when `arg` starts with it, else nullptr.
const char* ValueOf(const char* arg, const char* name) {
  const size_t len = std::strlen(name);
  if (std::strncmp(arg, name, len) != 0 || arg[len] != '=') return nullptr;
  return arg + len + 1;
}

}  // namespace

bool ParseIntFlag(const char* arg, const char* name, int* out) {
  const char* value = ValueOf(arg, name);
  if (value == nullptr) return false;
  *out = std::atoi(value);
  return true;
}

bool ParseBoolFlag(const char* arg, const char* name, bool* out) {
  int number = 0;
  if (!ParseIntFlag(arg, name, &number)) return false;
  *out = number != 0;
  return true;
}

bool ParseTextFlag(const char* arg, const char* name, std::string* out) {
  const char* value = ValueOf(arg, name);
  if (value == nullptr) return false;
  *out = value;
  return true;
}

void ExitUnknownFlag(const char* arg) {
  std::fprintf(stderr, "unknown flag %s\n", arg);
  std::exit(2);
}

void ExitBadFlags(const std::string& problem) {
  std::fprintf(stderr, "%s\n", problem.c_str());
  std::exit(2);
}

void ExitWithUsage(const std::string& problem, const std::string& usage) {
  std::fprintf(stderr, "%s\n%s\n", problem.c_str(), usage.c_str());
  std::exit(2);
}

void CommandLine::AddInt(const std::string& name, int* value) {
  valued_[name] = [this, name, value](const std::string& text) {
    if (!absl::SimpleAtoi(text, value)) Usage(absl::StrCat("--", name, ": not a number"));
  };
}

void CommandLine::AddText(const std::string& name, std::string* value) {
  valued_[name] = [value](const std::string& text) { *value = text; };
}

void CommandLine::AddSwitch(const std::string& name, bool* value) { switches_[name] = value; }

void CommandLine::AddCustom(const std::string& name,
                            std::function<void(const std::string&)> parse) {
  valued_[name] = std::move(parse);
}

void CommandLine::Parse(int argc, char** argv) const {
  for (int i = 1; i < argc; ++i) {
    absl::string_view full = argv[i];
    if (!absl::ConsumePrefix(&full, "--")) Usage(absl::StrCat("unexpected argument ", argv[i]));
    const std::string arg(full);
    if (auto s = switches_.find(arg); s != switches_.end()) {
      *s->second = true;
      continue;
    }
    std::string name = arg;
    std::string value;
    if (const size_t eq = arg.find('='); eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      Usage(absl::StrCat("--", name, " needs a value"));
    }
    auto it = valued_.find(name);
    if (it == valued_.end()) Usage(absl::StrCat("unknown flag --", name));
    it->second(value);
  }
}

void CommandLine::Usage(const std::string& problem) const { ExitWithUsage(problem, usage_); }

}  // namespace rebound::bench
