#pragma once

// Helpers of the worker data tests: scratch files under TEST_TMPDIR, gzip and IDX encoding, and
// an independent decoding of the Debian data set files (zlib's gz* API, not the code under test).
// Also teaches Catch2 to print absl::Status and absl::StatusCode.

#include <cstdint>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/status/status.h"

namespace rebound::worker::testing {

inline constexpr char kDebianFashionMnistDir[] = "/usr/share/datasets/fashion-mnist";

// $TEST_TMPDIR/<name>; fails the test when TEST_TMPDIR is unset.
std::string TempPath(const std::string& name);

// Writes `bytes` to `path`, replacing the file.
void WriteFile(const std::string& path, const std::string& bytes);
std::string ReadFile(const std::string& path);

// One gzip member holding `raw`.
std::string Gzip(const std::string& raw);

// The whole decompressed content of the gzip file at `path`, read with gzopen/gzread.
std::string GunzipFile(const std::string& path);

// An IDX file: big-endian `magic`, big-endian `dims`, then `payload` verbatim.
std::string IdxBytes(uint32_t magic, const std::vector<uint32_t>& dims,
                     const std::string& payload);

// `n` bytes whose i-th is (i * 7 + salt) mod `modulus`.
std::string PatternBytes(size_t n, int modulus, int salt = 0);

}  // namespace rebound::worker::testing

namespace Catch {

template <>
struct StringMaker<absl::StatusCode> {
  static std::string convert(absl::StatusCode code) { return absl::StatusCodeToString(code); }
};

template <>
struct StringMaker<absl::Status> {
  static std::string convert(const absl::Status& status) { return status.ToString(); }
};

}  // namespace Catch
