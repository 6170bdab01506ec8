#include "common/file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace rebound {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

absl::Status WriteAndSync(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    return absl::UnavailableError(absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const std::string why = std::strerror(errno);
      ::close(fd);
      return absl::UnavailableError(absl::StrCat("cannot write ", path, ": ", why));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("cannot fsync ", path, ": ", why));
  }
  ::close(fd);
  return absl::OkStatus();
}

std::string LimitText(int64_t max_bytes) {
  if (max_bytes % kMiB == 0) return absl::StrCat(max_bytes / kMiB, " MiB");
  return absl::StrCat(max_bytes, " bytes");
}

}  // namespace

absl::StatusOr<std::string> ReadFile(const std::string& path, int64_t max_bytes,
                                     const std::string& what) {
  std::error_code error;
  const std::filesystem::file_status status = std::filesystem::status(path, error);
  if (error || !std::filesystem::exists(status)) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open ", what));
  }
  if (!std::filesystem::is_regular_file(status)) {
    const char* kind = std::filesystem::is_directory(status)          ? "a directory"
                       : std::filesystem::is_character_file(status) ? "a character device"
                       : std::filesystem::is_block_file(status)     ? "a block device"
                       : std::filesystem::is_fifo(status)           ? "a FIFO"
                                                                    : "not a regular file";
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": the ", what, " must be a regular file, this is ", kind));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in.is_open()) return absl::NotFoundError(absl::StrCat(path, ": cannot open ", what));
  std::string bytes;
  char buffer[65536];
  while (in.read(buffer, sizeof(buffer)) || in.gcount() > 0) {
    bytes.append(buffer, static_cast<size_t>(in.gcount()));
    if (static_cast<int64_t>(bytes.size()) > max_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": the ", what, " is over the limit of ", LimitText(max_bytes)));
    }
  }
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat(path, ": read error"));
  return bytes;
}

std::string ReadFileOrEmpty(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadFile(path, kNoFileSizeLimit);
  return bytes.ok() ? *std::move(bytes) : std::string();
}

absl::Status WriteFile(const std::string& path, const std::string& content) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(content.data(), static_cast<std::streamsize>(content.size()));
  out.close();
  if (!out.good()) return absl::InternalError(absl::StrCat(path, ": cannot write"));
  return absl::OkStatus();
}

std::optional<int> ReadPortFile(const std::string& path) {
  int port = 0;
  const std::string text(absl::StripAsciiWhitespace(ReadFileOrEmpty(path)));
  if (!text.empty() && absl::SimpleAtoi(text, &port) && port > 0) return port;
  return std::nullopt;
}

absl::Status WriteFileDurably(const std::string& path, const std::string& content) {
  const std::string temp = absl::StrCat(path, ".tmp");
  if (absl::Status written = WriteAndSync(temp, content); !written.ok()) {
    std::remove(temp.c_str());
    return written;
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    std::remove(temp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot rename ", temp, " to ", path));
  }
  // The directory entry too.
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  if (const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
  return absl::OkStatus();
}

}  // namespace rebound
