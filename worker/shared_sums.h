#pragma once

// Same-host transport of a parallel replay's partial sums (docs/recovery.md,
// "Exchange between spares on one host").
//
// Spares on one machine need not push each step's ~2 MB of sums through gRPC,
// the loopback TCP stack and five copies: the sender writes them once into a
// POSIX shared-memory region of its own and sends only a reference (name,
// offset, length) over WorkerPeer; the receiver copies them out of its
// read-only mapping. The first step of a task goes both ways (inline and in the
// region); a receiver that can map the region and finds the same bytes there
// acknowledges it, and only then does the sender send references to it. A
// receiver that cannot (another host, another user, no /dev/shm) declines and
// keeps receiving inline sums.
//
// The region has two slots, by step parity. The sender writes step t + 2 into
// step t's slot only after every other spare's sums of step t + 1 have reached
// it, and a spare sends those only after it has applied step t, that is after
// it has read step t's slot: so no slot is overwritten while a receiver may
// still read it, for any k.
//
// Each slot starts with a header (task, step, rank, float count) that the
// receiver checks against the reference before reading, so a stale or foreign
// slot is an error, never silent data. The writer unlinks the region's name as
// soon as every receiver has answered the first step (the mappings stay valid),
// so a killed process leaves no file behind past its first replayed step;
// SweepStaleRegions removes what dead processes left in that window.
//
// Thread-safety: a SharedSumsWriter belongs to one spare's replay; a SharedSumsReader is
// immutable after Open and may be read from any thread. Ownership: each owns its mapping
// (unmapped when destroyed); readers are shared (std::shared_ptr) by the mailbox and the replay.
// Status codes: Create UNAVAILABLE when shared memory cannot be had; Open NOT_FOUND,
// PERMISSION_DENIED or UNAVAILABLE as the system says; Read DATA_LOSS for a reference outside
// the region or a slot whose header does not match it.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace rebound::worker {

// The header at the start of each slot.
struct SharedSlotHeader {
  uint64_t magic;
  uint64_t task_id;
  int64_t step;
  int64_t rank;
  int64_t floats;
  uint64_t reserved[3];
};
static_assert(sizeof(SharedSlotHeader) == 64, "the slot data stays 64-byte aligned");

// The sender's region: created, sized and reserved (no SIGBUS later on a full
// /dev/shm), mapped read-write; unlinked and unmapped on destruction.
class SharedSumsWriter {
 public:
  // A region for slots of `max_floats` floats for spare `rank` of replay task
  // `task_id`. UNAVAILABLE if shared memory cannot be had (the caller sends
  // inline then).
  static absl::StatusOr<std::unique_ptr<SharedSumsWriter>> Create(uint64_t task_id, int rank,
                                                                  int64_t max_floats);
  ~SharedSumsWriter();
  SharedSumsWriter(const SharedSumsWriter&) = delete;
  SharedSumsWriter& operator=(const SharedSumsWriter&) = delete;

  const std::string& name() const { return name_; }
  int64_t max_floats() const { return max_floats_; }

  // Step t's slot: `floats` floats to fill (floats <= max_floats). Its header
  // is written now.
  absl::Span<float> Begin(int64_t step, int64_t floats);
  // The byte offset of step t's slot in the region (its header).
  int64_t SlotOffset(int64_t step) const;

  // Removes the name (receivers that mapped the region keep it). Idempotent.
  void Unlink();

 private:
  SharedSumsWriter(std::string name, uint64_t task_id, int rank, int64_t max_floats, void* base,
                   int64_t bytes);

  const std::string name_;
  const uint64_t task_id_;
  const int rank_;
  const int64_t max_floats_;
  void* const base_;
  const int64_t bytes_;
  bool linked_ = true;
};

// A receiver's read-only mapping of another spare's region.
class SharedSumsReader {
 public:
  // Maps region `name`; NOT_FOUND / PERMISSION_DENIED / UNAVAILABLE as the
  // system says.
  static absl::StatusOr<std::unique_ptr<SharedSumsReader>> Open(const std::string& name);
  ~SharedSumsReader();
  SharedSumsReader(const SharedSumsReader&) = delete;
  SharedSumsReader& operator=(const SharedSumsReader&) = delete;

  const std::string& name() const { return name_; }

  // The floats of the slot at `offset`, after checking that it lies inside the
  // region and that its header says (task_id, step, rank, floats): DATA_LOSS
  // otherwise.
  absl::StatusOr<absl::Span<const float>> Read(int64_t offset, uint64_t task_id, int64_t step,
                                               int rank, int64_t floats) const;

 private:
  SharedSumsReader(std::string name, const void* base, int64_t bytes)
      : name_(std::move(name)), base_(base), bytes_(bytes) {}

  const std::string name_;
  const void* const base_;
  const int64_t bytes_;
};

// Unlinks the regions of this product whose creating process no longer exists
// (left by a process killed before its first step was answered). Returns how
// many.
int SweepStaleRegions();

}  // namespace rebound::worker
