#include "tests/chaos/process.h"

#include <unistd.h>

#include <deque>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace rebound::chaos {

std::string FindTool(const std::string& name) {
  for (const char* dir : {"/usr/sbin", "/sbin", "/usr/bin", "/bin"}) {
    const std::string path = absl::StrCat(dir, "/", name);
    if (access(path.c_str(), X_OK) == 0) return path;
  }
  return "";
}

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::string LastLines(const std::string& path, int lines) {
  std::ifstream in(path);
  std::deque<std::string> tail;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    tail.push_back(line);
    if (static_cast<int>(tail.size()) > lines) tail.pop_front();
  }
  std::string out;
  for (const std::string& l : tail) absl::StrAppend(&out, "    ", l, "\n");
  return out;
}

}  // namespace rebound::chaos
