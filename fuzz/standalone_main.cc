// A main() for the fuzz targets without libFuzzer (the default gcc build): runs
// LLVMFuzzerTestOneInput once on every file named on the command line, or every regular file of a
// named directory (not recursive), in name order. It prints how many inputs ran and exits 0;
// a target that crashes on an input crashes here too, naming the input on stderr first.
//
// `bazel test //fuzz/...` runs every target this way over its seed corpus (fuzz/corpus/<target>),
// so the fuzz sources compile, link and run in every build; --config=fuzz links libFuzzer's
// main instead (docs/fuzzing.md).

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc, char*** argv);

namespace {

bool IsDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool IsRegularFile(const std::string& path) {
  struct stat st;  // follows symbolic links: runfiles are links
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// The inputs `path` names, or an empty list (and a message) if it names nothing readable.
std::vector<std::string> Inputs(const std::string& path) {
  std::vector<std::string> inputs;
  if (!IsDirectory(path)) {
    if (IsRegularFile(path)) inputs.push_back(path);
    return inputs;
  }
  DIR* dir = opendir(path.c_str());
  if (dir == nullptr) return inputs;
  while (const dirent* entry = readdir(dir)) {
    const std::string file = path + "/" + entry->d_name;
    if (entry->d_name[0] != '.' && IsRegularFile(file)) inputs.push_back(file);
  }
  closedir(dir);
  std::sort(inputs.begin(), inputs.end());
  return inputs;
}

}  // namespace

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FILE_OR_DIRECTORY...\n", argv[0]);
    return 64;
  }
  int ran = 0;
  for (int i = 1; i < argc; ++i) {
    const std::vector<std::string> inputs = Inputs(argv[i]);
    if (inputs.empty()) {
      std::fprintf(stderr, "%s: no inputs in %s\n", argv[0], argv[i]);
      return 1;
    }
    for (const std::string& input : inputs) {
      std::ifstream in(input, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (!in.good() && !in.eof()) {
        std::fprintf(stderr, "%s: cannot read %s\n", argv[0], input.c_str());
        return 1;
      }
      std::fprintf(stderr, "running %s (%zu bytes)\n", input.c_str(), bytes.size());
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      ++ran;
    }
  }
  std::fprintf(stderr, "%s: %d inputs ran\n", argv[0], ran);
  return 0;
}
