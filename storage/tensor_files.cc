#include "storage/tensor_files.h"

#include <rocksdb/env.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>

#include <glog/logging.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace rebound::storage {
namespace {

absl::Status IoError(const rocksdb::Status& status, absl::string_view context) {
  const std::string message = absl::StrCat(context, ": ", status.ToString());
  if (status.IsNoSpace()) return absl::ResourceExhaustedError(message);
  return absl::UnavailableError(message);
}

// The generation of a file named `<prefix>-<generation>`, or 0.
uint64_t GenerationOf(absl::string_view file) {
  const size_t dash = file.rfind('-');
  uint64_t generation = 0;
  if (dash == absl::string_view::npos ||
      !absl::SimpleAtoi(file.substr(dash + 1), &generation)) {
    return 0;
  }
  return generation;
}

struct Xxh3StateDeleter {
  void operator()(XXH3_state_t* state) const { XXH3_freeState(state); }
};
using Xxh3State = std::unique_ptr<XXH3_state_t, Xxh3StateDeleter>;

Xxh3State NewXxh3State() {
  Xxh3State state(XXH3_createState());
  XXH3_64bits_reset(state.get());
  return state;
}

}  // namespace

TensorFiles::TensorFiles(rocksdb::Env* env, std::string dir, bool fsync)
    : env_(env), dir_(std::move(dir)), fsync_(fsync) {}

std::string TensorFiles::PathOf(absl::string_view file) const {
  return absl::StrCat(dir_, "/", file);
}

absl::Status TensorFiles::Open(const std::set<std::string>& referenced,
                               bool remove_unreferenced) {
  rocksdb::Status status = env_->CreateDirIfMissing(dir_);
  if (!status.ok()) return IoError(status, absl::StrCat("creating ", dir_));
  std::vector<std::string> children;
  status = env_->GetChildren(dir_, &children);
  if (!status.ok()) return IoError(status, absl::StrCat("listing ", dir_));
  uint64_t highest = 0;
  for (const std::string& child : children) {
    if (child == "." || child == "..") continue;
    highest = std::max(highest, GenerationOf(child));
    if (!remove_unreferenced || referenced.count(child) > 0) continue;
    // A file whose commit never happened (or whose record was replaced before its removal).
    LOG(INFO) << "removing unreferenced tensor file " << PathOf(child);
    Remove(child);
  }
  next_generation_.store(highest + 1);
  return absl::OkStatus();
}

absl::StatusOr<TensorBlob> TensorFiles::Write(absl::string_view prefix,
                                              absl::Span<const absl::string_view> parts,
                                              const std::string& reuse) {
  TensorBlob blob;
  blob.set_file(absl::StrCat(prefix, "-", next_generation_.fetch_add(1)));
  const std::string path = PathOf(blob.file());
  std::unique_ptr<rocksdb::WritableFile> file;
  rocksdb::Status status;
  if (!reuse.empty()) {
    status = env_->ReuseWritableFile(path, PathOf(reuse), &file, rocksdb::EnvOptions());
    if (!status.ok()) {
      LOG(WARNING) << "cannot reuse tensor file " << PathOf(reuse) << " (" << status.ToString()
                   << "); writing a new one";
      Remove(reuse);
    }
  }
  if (file == nullptr) status = env_->NewWritableFile(path, &file, rocksdb::EnvOptions());
  if (!status.ok()) return IoError(status, absl::StrCat("creating ", path));
  Xxh3State hash = NewXxh3State();
  uint64_t length = 0;
  for (absl::string_view part : parts) {
    if (status.ok()) status = file->Append(rocksdb::Slice(part.data(), part.size()));
    XXH3_64bits_update(hash.get(), part.data(), part.size());
    length += part.size();
    blob.add_part_bytes(part.size());
  }
  // A reused file may have been longer.
  if (status.ok() && !reuse.empty()) status = file->Truncate(length);
  if (status.ok() && fsync_) status = file->Sync();
  const rocksdb::Status closed = file->Close();
  if (status.ok()) status = closed;
  if (status.ok() && fsync_) {
    // The new directory entry must survive a power loss too.
    std::unique_ptr<rocksdb::Directory> directory;
    status = env_->NewDirectory(dir_, &directory);
    if (status.ok()) status = directory->Fsync();
  }
  if (!status.ok()) {
    Remove(blob.file());
    return IoError(status, absl::StrCat("writing ", path));
  }
  blob.set_length(length);
  blob.set_checksum(XXH3_64bits_digest(hash.get()));
  return blob;
}

absl::Status TensorFiles::Read(const TensorBlob& blob, absl::Span<std::string* const> parts,
                               absl::string_view what) const {
  const std::string path = PathOf(blob.file());
  auto lost = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat(what, ": tensor file ", path, ": ", why));
  };
  if (blob.file().empty() || blob.file().find('/') != std::string::npos) {
    return lost("the record names no valid file");
  }
  uint64_t size = 0;
  rocksdb::Status status = env_->GetFileSize(path, &size);
  if (!status.ok()) return lost(absl::StrCat("cannot be read: ", status.ToString()));
  if (size != blob.length()) {
    return lost(absl::StrCat("holds ", size, " bytes, the record says ", blob.length()));
  }
  uint64_t sum = 0;
  for (uint64_t bytes : blob.part_bytes()) sum += bytes;
  if (sum != blob.length() || static_cast<size_t>(blob.part_bytes_size()) != parts.size()) {
    return lost("the record's part sizes do not add up to its length");
  }
  std::unique_ptr<rocksdb::RandomAccessFile> file;
  status = env_->NewRandomAccessFile(path, &file, rocksdb::EnvOptions());
  if (!status.ok()) return lost(absl::StrCat("cannot be opened: ", status.ToString()));
  Xxh3State hash = NewXxh3State();
  uint64_t offset = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    std::string& out = *parts[i];
    out.resize(blob.part_bytes(i));
    size_t done = 0;
    while (done < out.size()) {
      rocksdb::Slice got;
      status = file->Read(offset + done, out.size() - done, &got, out.data() + done);
      if (!status.ok()) return lost(absl::StrCat("read failed: ", status.ToString()));
      if (got.empty()) return lost(absl::StrCat("ends early at byte ", offset + done));
      if (got.data() != out.data() + done) std::memmove(out.data() + done, got.data(), got.size());
      done += got.size();
    }
    XXH3_64bits_update(hash.get(), out.data(), out.size());
    offset += out.size();
  }
  if (XXH3_64bits_digest(hash.get()) != blob.checksum()) {
    return lost("checksum mismatch (the file is corrupt)");
  }
  return absl::OkStatus();
}

void TensorFiles::Remove(const std::string& file) {
  const rocksdb::Status status = env_->DeleteFile(PathOf(file));
  if (!status.ok() && !status.IsNotFound()) {
    LOG(WARNING) << "cannot remove tensor file " << PathOf(file) << ": " << status.ToString();
  }
}

absl::StatusOr<uint64_t> TensorFiles::TotalBytes() const {
  std::vector<std::string> children;
  rocksdb::Status status = env_->GetChildren(dir_, &children);
  if (!status.ok()) return IoError(status, absl::StrCat("listing ", dir_));
  uint64_t total = 0;
  for (const std::string& child : children) {
    if (child == "." || child == "..") continue;
    uint64_t size = 0;
    if (env_->GetFileSize(PathOf(child), &size).ok()) total += size;
  }
  return total;
}

}  // namespace rebound::storage
