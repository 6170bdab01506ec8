#pragma once

// The one way Rebound reads a whole file (configs, token files, TLS material, port files, logs,
// /proc files): bounded, so that /dev/zero or a file that keeps growing cannot make a reader read
// without end, and with messages that name the path and the file's role.
//
// Thread-safety: every function is safe to call from any number of threads (they share no
// state; concurrent writers of the same file are the caller's business). Ownership: nothing is
// kept; the functions return copies.

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rebound {

// For ReadFile's `max_bytes`: no limit beyond memory.
inline constexpr int64_t kNoFileSizeLimit = std::numeric_limits<int64_t>::max();

// The contents of `path`, at most `max_bytes` (checked while reading). `what` names the file's
// role in messages ("config file", "security.tls.cert_file"). Returns
//   NOT_FOUND          "<path>: cannot open <what>" when it does not exist or cannot be opened;
//   INVALID_ARGUMENT   "<path>: the <what> must be a regular file, this is a directory" (a
//                      device, a FIFO, ...); "<path>: the <what> is over the limit of N MiB"
//                      (N bytes when the limit is not whole MiB); "<path>: read error".
// /proc files count as regular files (their size is read, not stat'ed).
absl::StatusOr<std::string> ReadFile(const std::string& path, int64_t max_bytes,
                                     const std::string& what = "file");

// The whole file, or "" when it cannot be read: for logs and /proc files, where a missing file
// and an empty one mean the same to the caller.
std::string ReadFileOrEmpty(const std::string& path);

// Replaces the file's content with `content` (not atomically: see WriteFileAtomically in
// common/process.h for files others read while it is written). INTERNAL naming the path when it
// cannot be written.
absl::Status WriteFile(const std::string& path, const std::string& content);

// Replaces `path` with `content` so that a crash leaves the old file or the new one, whole, and a
// returned OK means the new one survives a power loss: written to "<path>.tmp", fsynced, renamed,
// and the directory fsynced. UNAVAILABLE naming the path when a step fails (the temporary file
// is removed). For files a server must find after a restart (GLOBAL_CHECKPOINT checkpoints).
absl::Status WriteFileDurably(const std::string& path, const std::string& content);

// The port in a port file, as a daemon's --port_file writes it once it serves ("<port>\n",
// written atomically); nullopt while the file is missing, empty or holds no port > 0.
std::optional<int> ReadPortFile(const std::string& path);

}  // namespace rebound
