#include "tests/worker/test_files.h"

#include <zlib.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>

#include "common/file.h"

namespace rebound::worker::testing {

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  REQUIRE(dir != nullptr);
  return std::string(dir) + "/" + name;
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  REQUIRE(out.good());
}

std::string ReadFile(const std::string& path) {
  absl::StatusOr<std::string> bytes = ::rebound::ReadFile(path, kNoFileSizeLimit);
  INFO(bytes.status());
  REQUIRE(bytes.ok());
  return *std::move(bytes);
}

std::string Gzip(const std::string& raw) {
  z_stream zs;
  std::memset(&zs, 0, sizeof(zs));
  REQUIRE(deflateInit2(&zs, Z_BEST_SPEED, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  std::string out(deflateBound(&zs, raw.size()) + 64, '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(raw.data()));
  zs.avail_in = static_cast<uInt>(raw.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  const int ret = deflate(&zs, Z_FINISH);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  REQUIRE(ret == Z_STREAM_END);
  return out;
}

std::string GunzipFile(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  REQUIRE(file != nullptr);
  std::string content;
  char buffer[1 << 16];
  int n;
  while ((n = gzread(file, buffer, sizeof(buffer))) > 0) content.append(buffer, n);
  int error = Z_OK;
  gzerror(file, &error);
  gzclose(file);
  REQUIRE(n == 0);
  REQUIRE(error == Z_OK);
  return content;
}

std::string IdxBytes(uint32_t magic, const std::vector<uint32_t>& dims,
                     const std::string& payload) {
  std::string out;
  auto put = [&out](uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>(v >> shift));
  };
  put(magic);
  for (uint32_t d : dims) put(d);
  return out + payload;
}

std::string PatternBytes(size_t n, int modulus, int salt) {
  std::string out(n, '\0');
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<char>((i * 7 + salt) % modulus);
  return out;
}

}  // namespace rebound::worker::testing
