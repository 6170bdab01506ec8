#include "worker/shared_sums.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace rebound::worker {
namespace {

constexpr uint64_t kMagic = 0x5245424f554e4431ULL;  // "REBOUND1"
constexpr char kPrefix[] = "rebound-replay-";

int64_t SlotBytes(int64_t max_floats) {
  // Header plus data, rounded up to 64 bytes so the next slot's header stays
  // aligned.
  const int64_t bytes = static_cast<int64_t>(sizeof(SharedSlotHeader)) +
                        max_floats * static_cast<int64_t>(sizeof(float));
  return (bytes + 63) / 64 * 64;
}

absl::Status Errno(const std::string& what) {
  const int error = errno;
  const std::string message = absl::StrCat(what, ": ", std::strerror(error));
  switch (error) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    default:
      return absl::UnavailableError(message);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedSumsWriter>> SharedSumsWriter::Create(uint64_t task_id,
                                                                           int rank,
                                                                           int64_t max_floats) {
  if (max_floats <= 0) return absl::InvalidArgumentError("max_floats must be positive");
  std::random_device device;
  const uint64_t nonce = (static_cast<uint64_t>(device()) << 32) | device();
  const std::string name =
      absl::StrCat("/", kPrefix, getpid(), "-", task_id, "-", rank, "-", absl::Hex(nonce));
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return Errno(absl::StrCat("shm_open ", name));
  const int64_t bytes = 2 * SlotBytes(max_floats);
  // Reserve the pages now: a full /dev/shm is an error here, not a SIGBUS in
  // the middle of a step.
  const int reserved = posix_fallocate(fd, 0, bytes);
  if (reserved != 0) {
    close(fd);
    shm_unlink(name.c_str());
    errno = reserved;
    return Errno(absl::StrCat("reserve ", bytes, " bytes of shared memory for ", name));
  }
  void* base = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int mapped_errno = errno;
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(name.c_str());
    errno = mapped_errno;
    return Errno(absl::StrCat("mmap ", name));
  }
  return std::unique_ptr<SharedSumsWriter>(
      new SharedSumsWriter(name, task_id, rank, max_floats, base, bytes));
}

SharedSumsWriter::SharedSumsWriter(std::string name, uint64_t task_id, int rank, int64_t max_floats,
                                   void* base, int64_t bytes)
    : name_(std::move(name)),
      task_id_(task_id),
      rank_(rank),
      max_floats_(max_floats),
      base_(base),
      bytes_(bytes) {}

SharedSumsWriter::~SharedSumsWriter() {
  Unlink();
  munmap(base_, static_cast<size_t>(bytes_));
}

void SharedSumsWriter::Unlink() {
  if (!linked_) return;
  shm_unlink(name_.c_str());
  linked_ = false;
}

int64_t SharedSumsWriter::SlotOffset(int64_t step) const {
  return (step % 2) * SlotBytes(max_floats_);
}

absl::Span<float> SharedSumsWriter::Begin(int64_t step, int64_t floats) {
  floats = std::min(floats, max_floats_);
  char* slot = static_cast<char*>(base_) + SlotOffset(step);
  SharedSlotHeader header{};
  header.magic = kMagic;
  header.task_id = task_id_;
  header.step = step;
  header.rank = rank_;
  header.floats = floats;
  std::memcpy(slot, &header, sizeof(header));
  return absl::MakeSpan(reinterpret_cast<float*>(slot + sizeof(SharedSlotHeader)),
                        static_cast<size_t>(floats));
}

absl::StatusOr<std::unique_ptr<SharedSumsReader>> SharedSumsReader::Open(const std::string& name) {
  if (!absl::StartsWith(name, absl::StrCat("/", kPrefix)) ||
      name.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("'", name, "' is not a replay region name"));
  }
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return Errno(absl::StrCat("shm_open ", name));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const absl::Status status = Errno(absl::StrCat("fstat ", name));
    close(fd);
    return status;
  }
  if (st.st_uid != geteuid()) {
    close(fd);
    return absl::PermissionDeniedError(absl::StrCat(name, " belongs to another user"));
  }
  const int64_t bytes = st.st_size;
  if (bytes < static_cast<int64_t>(sizeof(SharedSlotHeader))) {
    close(fd);
    return absl::DataLossError(absl::StrCat(name, " holds only ", bytes, " bytes"));
  }
  void* base = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ, MAP_SHARED, fd, 0);
  const int mapped_errno = errno;
  close(fd);
  if (base == MAP_FAILED) {
    errno = mapped_errno;
    return Errno(absl::StrCat("mmap ", name));
  }
  return std::unique_ptr<SharedSumsReader>(new SharedSumsReader(name, base, bytes));
}

SharedSumsReader::~SharedSumsReader() {
  munmap(const_cast<void*>(base_), static_cast<size_t>(bytes_));
}

absl::StatusOr<absl::Span<const float>> SharedSumsReader::Read(int64_t offset, uint64_t task_id,
                                                               int64_t step, int rank,
                                                               int64_t floats) const {
  const int64_t header_bytes = static_cast<int64_t>(sizeof(SharedSlotHeader));
  if (offset < 0 || offset % 64 != 0 || floats < 0 || offset > bytes_ - header_bytes ||
      floats > (bytes_ - offset - header_bytes) / static_cast<int64_t>(sizeof(float))) {
    return absl::DataLossError(absl::StrCat(name_, ": ", floats, " floats at offset ", offset,
                                            " do not fit in its ", bytes_, " bytes"));
  }
  const char* slot = static_cast<const char*>(base_) + offset;
  SharedSlotHeader header;
  std::memcpy(&header, slot, sizeof(header));
  if (header.magic != kMagic || header.task_id != task_id || header.step != step ||
      header.rank != rank || header.floats != floats) {
    return absl::DataLossError(
        absl::StrCat(name_, " at offset ", offset, " holds task ", header.task_id, " step ",
                     header.step, " rank ", header.rank, " (", header.floats, " floats), not task ",
                     task_id, " step ", step, " rank ", rank, " (", floats, " floats)"));
  }
  return absl::MakeConstSpan(reinterpret_cast<const float*>(slot + header_bytes),
                             static_cast<size_t>(floats));
}

int SweepStaleRegions() {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  while (const dirent* entry = readdir(dir)) {
    const absl::string_view file = entry->d_name;
    if (!absl::StartsWith(file, kPrefix)) continue;
    const std::vector<absl::string_view> parts =
        absl::StrSplit(file.substr(sizeof(kPrefix) - 1), '-');
    int pid = 0;
    if (parts.empty() || !absl::SimpleAtoi(parts[0], &pid) || pid <= 0) continue;
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;  // alive, or not ours to judge
    if (shm_unlink(absl::StrCat("/", file).c_str()) == 0) ++removed;
  }
  closedir(dir);
  return removed;
}

}  // namespace rebound::worker
