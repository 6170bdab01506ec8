#pragma once

// Command-line flags of the benchmarks, in two forms:
//   * "--name=value" only, read one argument at a time with ParseIntFlag / ParseBoolFlag /
//     ParseTextFlag (apply, compute, transport): an unknown flag is ExitUnknownFlag();
//   * CommandLine (the local-cluster benchmarks): "--name=value" or "--name value", bare
//     "--name" for a switch, any problem printed above the benchmark's usage line.
// Every bad command line exits with code 2.

#include <functional>
#include <map>
#include <string>

namespace rebound::bench {

// When `arg` is `name` followed by '=' ("--calls=5" for name "--calls"), sets *out to the number
// after the '=' (std::atoi: 0 when it is not a number) and returns true; else returns false and
// leaves *out alone.
bool ParseIntFlag(const char* arg, const char* name, int* out);

// As ParseIntFlag, with *out = (the number != 0): "--optimizer=0" is false.
bool ParseBoolFlag(const char* arg, const char* name, bool* out);

// As ParseIntFlag, with *out = everything after the '=' (possibly empty).
bool ParseTextFlag(const char* arg, const char* name, std::string* out);

// Prints "unknown flag ARG" to stderr and exits with code 2.
[[noreturn]] void ExitUnknownFlag(const char* arg);

// Prints `problem` and a newline to stderr and exits with code 2.
[[noreturn]] void ExitBadFlags(const std::string& problem);

// Prints `problem`, a newline and `usage` (one line, e.g. "usage: weighting [--seconds=S] ...")
// to stderr and exits with code 2.
[[noreturn]] void ExitWithUsage(const std::string& problem, const std::string& usage);

// The flags a benchmark takes, each bound to where its value goes, then Parse(). Values are
// written as they are parsed, in command-line order, so a flag given twice keeps the last one.
// A value is either "--name=value" or the next argument ("--name value"); a switch is only ever
// the bare "--name". Unknown flags, arguments that do not start with "--", a missing value and a
// value that is not a number (for AddInt) all end in Usage().
class CommandLine {
 public:
  explicit CommandLine(std::string usage) : usage_(std::move(usage)) {}

  CommandLine(const CommandLine&) = delete;
  CommandLine& operator=(const CommandLine&) = delete;

  // REQUIRES for all Add*: `name` (without "--") not added before; `value` outlives Parse().
  void AddInt(const std::string& name, int* value);
  void AddText(const std::string& name, std::string* value);
  // Bare "--name" sets *value to true.
  void AddSwitch(const std::string& name, bool* value);
  // "--name=value": `parse(value)`, which calls Usage() when the value is bad.
  void AddCustom(const std::string& name, std::function<void(const std::string&)> parse);

  void Parse(int argc, char** argv) const;

  // ExitWithUsage(problem, the usage line).
  [[noreturn]] void Usage(const std::string& problem) const;

 private:
  const std::string usage_;
  std::map<std::string, std::function<void(const std::string&)>> valued_;
  std::map<std::string, bool*> switches_;
};

}  // namespace rebound::bench
