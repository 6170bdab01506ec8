#include "worker/data/idx_reader.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace rebound::worker {
namespace {

constexpr size_t kReadChunkBytes = size_t{1} << 18;
constexpr size_t kMinFreeOutputBytes = size_t{1} << 16;

struct FileCloser {
  void operator()(FILE* file) const { std::fclose(file); }
};

// Ends an inflate stream on every return path.
class InflateStream {
 public:
  InflateStream() { std::memset(&stream_, 0, sizeof(stream_)); }
  InflateStream(const InflateStream&) = delete;
  InflateStream& operator=(const InflateStream&) = delete;
  ~InflateStream() {
    if (initialised_) inflateEnd(&stream_);
  }

  // windowBits 15 + 16: a gzip wrapper only (no zlib or raw deflate).
  bool Init() {
    initialised_ = inflateInit2(&stream_, 15 + 16) == Z_OK;
    return initialised_;
  }
  z_stream* get() { return &stream_; }

 private:
  z_stream stream_;
  bool initialised_ = false;
};

absl::Status ErrnoError(const std::string& path, const char* what, int error_number) {
  return absl::Status(absl::ErrnoToStatusCode(error_number),
                      absl::StrFormat("%s: %s: %s", path, what, std::strerror(error_number)));
}

// Decompresses every gzip member of the file at `path`; any damage or trailing garbage is
// DATA_LOSS.
absl::StatusOr<std::vector<uint8_t>> ReadGzipFile(const std::string& path) {
  errno = 0;
  std::unique_ptr<FILE, FileCloser> file(std::fopen(path.c_str(), "rb"));
  if (file == nullptr) return ErrnoError(path, "cannot open", errno);

  InflateStream inflater;
  if (!inflater.Init()) {
    return absl::ResourceExhaustedError(absl::StrFormat("%s: cannot initialise zlib", path));
  }
  z_stream* zs = inflater.get();

  std::vector<uint8_t> input(kReadChunkBytes);
  std::vector<uint8_t> output(kReadChunkBytes);
  size_t produced = 0;
  int members = 1;
  bool member_done = false;
  bool eof = false;
  for (;;) {
    if (zs->avail_in == 0 && !eof) {
      const size_t n = std::fread(input.data(), 1, input.size(), file.get());
      if (n == 0) {
        if (std::ferror(file.get())) return ErrnoError(path, "read failed", errno);
        eof = true;
      }
      zs->next_in = input.data();
      zs->avail_in = static_cast<uInt>(n);
    }
    if (member_done) {
      if (zs->avail_in == 0) {
        if (eof) break;
        continue;
      }
      // More bytes after a complete member: the next member, or garbage that inflate rejects.
      inflateReset(zs);
      member_done = false;
      ++members;
    }
    constexpr size_t kLimit = static_cast<size_t>(kIdxMaxFileBytes);
    if (output.size() - produced < kMinFreeOutputBytes && output.size() < kLimit) {
      output.resize(std::min(output.size() * 2, kLimit));
    }
    if (produced == output.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: decompresses to more than %d bytes, the limit for an IDX file", path, kLimit));
    }
    zs->next_out = output.data() + produced;
    zs->avail_out = static_cast<uInt>(output.size() - produced);
    const int ret = inflate(zs, Z_NO_FLUSH);
    produced = static_cast<size_t>(zs->next_out - output.data());
    switch (ret) {
      case Z_STREAM_END:
        member_done = true;
        break;
      case Z_OK:
        break;
      case Z_BUF_ERROR:
        // No progress was possible: output space is guaranteed above, so input is missing.
        if (eof && zs->avail_in == 0) {
          return absl::DataLossError(absl::StrFormat(
              "%s: truncated gzip stream: the file ends inside gzip member %d after %d "
              "decompressed bytes",
              path, members, produced));
        }
        break;
      default:
        return absl::DataLossError(absl::StrFormat(
            "%s: corrupt gzip data in member %d after %d decompressed bytes: %s%s", path, members,
            produced, zs->msg != nullptr ? zs->msg : zError(ret),
            members > 1 ? " (trailing garbage after the gzip stream?)" : ""));
    }
  }
  output.resize(produced);
  return output;
}

uint32_t BigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// Checks the magic and header length of `bytes` and returns the `dims` sizes it declares.
absl::StatusOr<std::vector<int64_t>> ParseIdxHeader(const std::string& path,
                                                    const std::vector<uint8_t>& bytes,
                                                    uint32_t magic, int dims, const char* kind) {
  if (bytes.size() < 4) {
    return absl::DataLossError(absl::StrFormat(
        "%s: truncated IDX header: %d decompressed bytes, the magic number alone needs 4", path,
        bytes.size()));
  }
  const uint32_t actual = BigEndian32(bytes.data());
  if (actual != magic) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: wrong IDX magic 0x%08x, expected 0x%08x (%s: unsigned bytes, %d "
                        "dimension%s)",
                        path, actual, magic, kind, dims, dims == 1 ? "" : "s"));
  }
  const size_t header_bytes = 4 + 4 * static_cast<size_t>(dims);
  if (bytes.size() < header_bytes) {
    return absl::DataLossError(
        absl::StrFormat("%s: truncated IDX header: %d decompressed bytes, the header needs %d",
                        path, bytes.size(), header_bytes));
  }
  std::vector<int64_t> sizes(dims);
  for (int d = 0; d < dims; ++d) sizes[d] = BigEndian32(bytes.data() + 4 + 4 * d);
  return sizes;
}

// Checks that exactly `payload` bytes follow a header of `header_bytes`.
absl::Status CheckPayloadSize(const std::string& path, const std::vector<uint8_t>& bytes,
                              size_t header_bytes, int64_t payload, const std::string& shape) {
  const int64_t actual = static_cast<int64_t>(bytes.size() - header_bytes);
  if (actual < payload) {
    return absl::DataLossError(absl::StrFormat(
        "%s: truncated IDX payload: %d bytes, the header's shape %s needs %d", path, actual,
        shape, payload));
  }
  if (actual > payload) {
    return absl::DataLossError(absl::StrFormat(
        "%s: %d trailing bytes after the IDX payload of shape %s (%d bytes)", path,
        actual - payload, shape, payload));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<IdxImages> ReadIdxImages(const std::string& path) {
  ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadGzipFile(path));
  ASSIGN_OR_RETURN(const std::vector<int64_t> sizes,
                   ParseIdxHeader(path, bytes, kIdxImagesMagic, 3, "images"));
  const int64_t count = sizes[0];
  const int64_t rows = sizes[1];
  const int64_t cols = sizes[2];
  const std::string shape = absl::StrFormat("%d x %d x %d", count, rows, cols);
  if (rows < 1 || cols < 1 || rows * cols > kIdxMaxImageBytes || count > kIdxMaxCount) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: unsupported IDX image shape %s: need rows, cols >= 1, rows * cols <= %d and "
        "count <= %d",
        path, shape, kIdxMaxImageBytes, kIdxMaxCount));
  }
  constexpr size_t kHeaderBytes = 16;
  RETURN_IF_ERROR(CheckPayloadSize(path, bytes, kHeaderBytes, count * rows * cols, shape));

  IdxImages images;
  images.count = count;
  images.rows = static_cast<int32_t>(rows);
  images.cols = static_cast<int32_t>(cols);
  bytes.erase(bytes.begin(), bytes.begin() + kHeaderBytes);
  images.pixels = std::move(bytes);
  return images;
}

absl::StatusOr<std::vector<uint8_t>> ReadIdxLabels(const std::string& path, int num_classes) {
  if (num_classes < 1 || num_classes > 256) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: num_classes %d is outside [1, 256]", path, num_classes));
  }
  ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadGzipFile(path));
  ASSIGN_OR_RETURN(const std::vector<int64_t> sizes,
                   ParseIdxHeader(path, bytes, kIdxLabelsMagic, 1, "labels"));
  const int64_t count = sizes[0];
  const std::string shape = absl::StrFormat("%d", count);
  if (count > kIdxMaxCount) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: unsupported IDX label count %d, the limit is %d", path, count, kIdxMaxCount));
  }
  constexpr size_t kHeaderBytes = 8;
  RETURN_IF_ERROR(CheckPayloadSize(path, bytes, kHeaderBytes, count, shape));
  bytes.erase(bytes.begin(), bytes.begin() + kHeaderBytes);
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (bytes[i] >= num_classes) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: label %d of sample %d is outside [0, %d)", path, bytes[i], i,
                          num_classes));
    }
  }
  return bytes;
}

}  // namespace rebound::worker
