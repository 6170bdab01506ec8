#pragma once

// Reads gzip-compressed IDX files (the format of MNIST and Fashion-MNIST; Yann LeCun's
// description: a big-endian 32-bit magic 0x000008TD, where T = 0x08 is the unsigned-byte element
// type and D the number of dimensions, then D big-endian uint32 sizes, then the elements).
//
// Every failure is an absl::Status whose message starts with the file's path and says what is
// wrong; nothing throws or crashes on a bad file. The codes:
//   NOT_FOUND          the file does not exist (other open/read errors map their errno the way
//                      absl::ErrnoToStatusCode does, e.g. PERMISSION_DENIED);
//   DATA_LOSS          the bytes are damaged: not gzip, corrupt deflate data, CRC or length
//                      mismatch, truncated gzip stream, an IDX payload shorter than its header
//                      promises, or bytes after it (trailing garbage is rejected, both inside the
//                      decompressed stream and after the last gzip member);
//   INVALID_ARGUMENT   intact bytes that are not what was asked for: a wrong magic (e.g. a labels
//                      file read as images), zero or oversized dimensions, more than
//                      kIdxMaxFileBytes decompressed, a label outside [0, num_classes).
// The whole gzip stream is decompressed and verified (CRC-32 and length of every member) before
// the IDX structure is looked at, so a damaged file always reports DATA_LOSS.
//
// Thread-safety: the readers are stateless and may run on any thread. Ownership: results own
// their bytes.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace rebound::worker {

// Magic numbers of the two IDX kinds read here: unsigned bytes with 3 and 1 dimensions.
inline constexpr uint32_t kIdxImagesMagic = 0x00000803;
inline constexpr uint32_t kIdxLabelsMagic = 0x00000801;

// Upper bounds that keep a hostile header from asking for absurd allocations.
inline constexpr int64_t kIdxMaxCount = 0x7fffffff;  // sample ids stay below 2^31
inline constexpr int64_t kIdxMaxImageBytes = int64_t{1} << 24;  // rows * cols
inline constexpr int64_t kIdxMaxFileBytes = int64_t{1} << 30;   // decompressed size

// An IDX image file: `count` images of rows x cols unsigned bytes.
struct IdxImages {
  int64_t count = 0;
  int32_t rows = 0;
  int32_t cols = 0;
  std::vector<uint8_t> pixels;  // count * rows * cols bytes; image i, row y, column x at
                                // pixels[(i * rows + y) * cols + x]
};

// Reads a gzip'ed IDX file of magic kIdxImagesMagic. rows and cols must be >= 1 and
// rows * cols <= kIdxMaxImageBytes; count may be 0.
absl::StatusOr<IdxImages> ReadIdxImages(const std::string& path);

// Reads a gzip'ed IDX file of magic kIdxLabelsMagic; every label must lie in [0, num_classes).
// num_classes outside [1, 256] is INVALID_ARGUMENT.
absl::StatusOr<std::vector<uint8_t>> ReadIdxLabels(const std::string& path, int num_classes);

}  // namespace rebound::worker
