#include "server/checkpoint_transfer.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "glog/logging.h"
#include "storage/format_version.h"

namespace rebound::server {
namespace {

namespace fs = std::filesystem;

constexpr size_t kChunkBytes = size_t{1} << 20;

// A path inside the checkpoint: relative, without "..".
bool SafeRelativePath(const std::string& path) {
  if (path.empty() || path[0] == '/') return false;
  for (const fs::path& part : fs::path(path)) {
    if (part == ".." || part == ".") return false;
  }
  return true;
}

}  // namespace

grpc::Status SendCheckpoint(const storage::DurableStore& store, const std::string& dir,
                            grpc::ServerContext* context,
                            grpc::ServerWriterInterface<CheckpointChunk>* writer,
                            absl::string_view what, storage::DurableStore::Position* position,
                            int64_t max_bytes_per_second) {
  std::error_code error;
  fs::create_directories(fs::path(dir).parent_path(), error);
  auto made = store.Checkpoint(dir);
  if (!made.ok()) return ToGrpcStatus(made.status());
  struct RemoveOnExit {
    fs::path dir;
    ~RemoveOnExit() {
      std::error_code ignored;
      fs::remove_all(dir, ignored);
    }
  } remove{dir};
  LOG(INFO) << what << ": sending a checkpoint at sequence " << made->sequence;
  uint64_t files = 0;
  // Pacing: the bytes sent so far may not be ahead of the rate since the first chunk.
  const absl::Time started = absl::Now();
  uint64_t sent = 0;
  auto pace = [&]() -> bool {
    if (max_bytes_per_second <= 0) return true;
    const absl::Time due =
        started + absl::Seconds(static_cast<double>(sent) / static_cast<double>(max_bytes_per_second));
    while (absl::Now() < due) {
      if (context->IsCancelled()) return false;
      absl::SleepFor(std::min(due - absl::Now(), absl::Milliseconds(100)));
    }
    return true;
  };
  std::string buffer(kChunkBytes, '\0');
  for (auto entry = fs::recursive_directory_iterator(dir, error);
       !error && entry != fs::recursive_directory_iterator(); entry.increment(error)) {
    if (!entry->is_regular_file()) continue;
    const std::string relative = fs::relative(entry->path(), dir).string();
    std::ifstream in(entry->path(), std::ios::binary);
    uint64_t offset = 0;
    while (true) {
      in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
      const std::streamsize n = in.gcount();
      if (in.bad()) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            absl::StrCat(what, ": reading ", entry->path().string()));
      }
      CheckpointChunk chunk;
      chunk.set_path(relative);
      chunk.set_offset(offset);
      chunk.set_data(buffer.data(), static_cast<size_t>(n));
      chunk.set_last_chunk(in.eof());
      if (!pace() || context->IsCancelled() || !writer->Write(chunk)) {
        return grpc::Status(grpc::StatusCode::CANCELLED, absl::StrCat(what, ": the receiver left"));
      }
      offset += static_cast<uint64_t>(n);
      sent += static_cast<uint64_t>(n);
      if (in.eof()) break;
    }
    ++files;
  }
  if (error) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        absl::StrCat(what, ": listing ", dir, ": ", error.message()));
  }
  CheckpointChunk done;
  done.set_done(true);
  done.set_epoch(made->epoch);
  done.set_sequence(made->sequence);
  done.set_files(files);
  done.set_data_format_version(storage::kDataFormatVersion);
  writer->Write(done);
  if (position != nullptr) *position = *made;
  return grpc::Status::OK;
}

absl::StatusOr<CheckpointChunk> ReceiveCheckpoint(
    grpc::ClientReaderInterface<CheckpointChunk>* reader, grpc::ClientContext* context,
    const std::string& dir, absl::string_view from) {
  CheckpointChunk chunk;
  std::optional<CheckpointChunk> done;
  std::ofstream out;
  std::string open_path;
  uint64_t written = 0;
  uint64_t files = 0;
  absl::Status failed;
  std::error_code error;
  while (failed.ok() && reader->Read(&chunk)) {
    if (chunk.done()) {
      done = chunk;
      break;
    }
    if (!SafeRelativePath(chunk.path())) {
      failed = absl::DataLossError(
          absl::StrCat("checkpoint from ", from, ": bad path \"", chunk.path(), "\""));
      break;
    }
    if (chunk.path() != open_path) {
      if (chunk.offset() != 0 || out.is_open()) {
        failed = absl::DataLossError(absl::StrCat("checkpoint from ", from, ": file ",
                                                  chunk.path(), " starts at offset ",
                                                  chunk.offset(), " or the previous is unfinished"));
        break;
      }
      const fs::path path = fs::path(dir) / chunk.path();
      fs::create_directories(path.parent_path(), error);
      out.open(path, std::ios::binary | std::ios::trunc);
      if (!out) {
        failed = absl::UnavailableError(absl::StrCat("writing ", path.string()));
        break;
      }
      open_path = chunk.path();
      written = 0;
    }
    if (chunk.offset() != written) {
      failed = absl::DataLossError(absl::StrCat("checkpoint from ", from, ": file ", chunk.path(),
                                                " chunk at ", chunk.offset(), ", expected ",
                                                written));
      break;
    }
    out.write(chunk.data().data(), static_cast<std::streamsize>(chunk.data().size()));
    written += chunk.data().size();
    if (chunk.last_chunk()) {
      out.close();
      if (!out) {
        failed = absl::UnavailableError(absl::StrCat("writing ", dir, "/", open_path));
        break;
      }
      open_path.clear();
      ++files;
    }
  }
  if (!failed.ok()) context->TryCancel();
  const grpc::Status finished = reader->Finish();
  if (!failed.ok()) return failed;
  if (!finished.ok()) return FromGrpcStatus(finished);
  if (!done.has_value() || done->files() != files) {
    return absl::DataLossError(absl::StrCat("checkpoint from ", from,
                                            " ended without its end mark or with ", files,
                                            " files of ", done.has_value() ? done->files() : 0));
  }
  ::sync();  // the copy is durable before anyone uses it
  return *done;
}

}  // namespace rebound::server
