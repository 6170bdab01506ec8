// common/file.h: the one bounded whole-file reader, its messages, and the port-file reader.

#include "common/file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include <catch2/catch.hpp>

namespace rebound {
namespace {

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/file_test-" + name;
}

TEST_CASE("ReadFile returns the whole file, binary bytes included") {
  const std::string path = TempPath("bytes");
  const std::string bytes("a\0b\nc\xff", 6);
  REQUIRE(WriteFile(path, bytes).ok());
  absl::StatusOr<std::string> read = ReadFile(path, 6);
  REQUIRE(read.ok());
  CHECK(*read == bytes);
  CHECK(ReadFileOrEmpty(path) == bytes);
}

TEST_CASE("ReadFile says NOT_FOUND naming the path and the file's role") {
  absl::StatusOr<std::string> read = ReadFile("/nonexistent/x.pbtxt", 100, "config file");
  CHECK(read.status().code() == absl::StatusCode::kNotFound);
  CHECK(read.status().message() == "/nonexistent/x.pbtxt: cannot open config file");
  CHECK(ReadFileOrEmpty("/nonexistent/x.pbtxt").empty());
}

TEST_CASE("ReadFile refuses what is not a regular file") {
  const std::string dir = TempPath("dir");
  mkdir(dir.c_str(), 0755);
  absl::StatusOr<std::string> read = ReadFile(dir, 100, "token file");
  CHECK(read.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(read.status().message() ==
        dir + ": the token file must be a regular file, this is a directory");
  absl::StatusOr<std::string> zero = ReadFile("/dev/zero", 100);
  CHECK(zero.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(zero.status().message() ==
        "/dev/zero: the file must be a regular file, this is a character device");
}

TEST_CASE("ReadFile stops at the limit") {
  const std::string path = TempPath("large");
  REQUIRE(WriteFile(path, std::string(11, 'x')).ok());
  CHECK(ReadFile(path, 11).ok());
  absl::StatusOr<std::string> read = ReadFile(path, 10, "log");
  CHECK(read.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(read.status().message() == path + ": the log is over the limit of 10 bytes");
  REQUIRE(WriteFile(path, std::string((1 << 20) + 1, 'x')).ok());
  CHECK(ReadFile(path, 1 << 20, "config file").status().message() ==
        path + ": the config file is over the limit of 1 MiB");
}

TEST_CASE("ReadFile reads /proc files, whose stat size is 0") {
  absl::StatusOr<std::string> read = ReadFile("/proc/self/status", kNoFileSizeLimit);
  REQUIRE(read.ok());
  CHECK(read->find("Pid:") != std::string::npos);
}

TEST_CASE("WriteFile says INTERNAL when the file cannot be written") {
  const absl::Status status = WriteFile("/nonexistent/dir/file", "x");
  CHECK(status.code() == absl::StatusCode::kInternal);
  CHECK(status.message() == "/nonexistent/dir/file: cannot write");
}

TEST_CASE("ReadPortFile reads a daemon's port file, nothing before it holds a port") {
  const std::string path = TempPath("port");
  unlink(path.c_str());
  CHECK(!ReadPortFile(path).has_value());
  REQUIRE(WriteFile(path, "").ok());
  CHECK(!ReadPortFile(path).has_value());
  REQUIRE(WriteFile(path, "0\n").ok());
  CHECK(!ReadPortFile(path).has_value());
  REQUIRE(WriteFile(path, "not a port\n").ok());
  CHECK(!ReadPortFile(path).has_value());
  REQUIRE(WriteFile(path, "43125\n").ok());
  CHECK(ReadPortFile(path) == 43125);
}

}  // namespace
}  // namespace rebound
