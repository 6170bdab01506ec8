#pragma once

// StepLogService: the server's side of the step log (docs/design.md §5.2, §5.3): it stores the log
// records that senders stream over AppendLog, serves them back to spares over ReadLog, and tells
// the recovery coordinator up to which step a slot's log is complete (t_f).
//
// AppendLog (HandleAppendLog). A stream of record batches from one sender incarnation. Per batch:
//   * the incarnation must be alive: fenced -> the stream ends with FAILED_PRECONDITION (a fenced
//     worker never writes again), unknown -> ABORTED; every batch of one stream must name the
//     same incarnation (INVALID_ARGUMENT otherwise);
//   * at most kMaxRecordsPerBatch records and at most job.step_log.buffer_bytes serialized bytes;
//   * every record must be well formed: slot inside the topology and owned by the sender, step
//     >= 1, micro_batch in [-1, M), record_id >= 1 and strictly increasing within the batch,
//     sender_incarnation unset or equal to the batch's; a micro-batch record carries exactly
//     batch_size / M sample ids, each >= 0, and only the boundary payloads its stage receives
//     (FORWARD for s > 0, BACKWARD for s < S-1, valid FLOAT32 tensors); a per-step record
//     (micro_batch = -1) carries params_checksum and nothing else.
//   The first malformed record ends the stream with INVALID_ARGUMENT naming it (its index in the
//   batch, record_id, slot, step and micro-batch), and nothing of that batch is written.
//   Records with record_id <= the sender's acknowledged id are duplicates (a resend after a
//   reconnect) and records at or below their slot's snapshot step are garbage (GC already deleted
//   that range): both are dropped silently but count as acknowledged. The rest of the batch is
//   written in ONE storage::WriteBatch; only after Commit returns OK is AppendLogAck sent, with
//   acked_through = the sender's highest record_id now durable or dropped. A failed commit ends
//   the stream with the store's code (UNAVAILABLE, RESOURCE_EXHAUSTED, ...): the sender resends.
//   The stream ends OK when the client half-closes, CANCELLED when it goes away.
//
//   Dedup state (the highest acknowledged record_id per sender) lives in memory: after a server
//   restart a resent record is written again under the same key with the same value, which is
//   harmless. At most kMaxSenders senders are remembered; the oldest incarnations are forgotten
//   first, and a sender is forgotten as soon as it is found fenced.
//
// Snapshot floor. A record for a step at or below its slot's snapshot step must not resurrect a
// range the sync's GC deleted. The floor of a slot is max(snapshot_step(slot), the highest step
// passed to a successful CommitSnapshot). Use CommitSnapshot around the sync's write batch to
// make the floor exact: an AppendLog batch of the slot then commits either entirely before the
// sync's batch (and its GC deletes the records) or after it (and sees the new floor). With only
// the snapshot_step function, an AppendLog batch that checked the floor just before a sync
// committed may leave a few records at or below the new snapshot step; they are harmless to
// recovery (ReadLog and LastCompleteStep only look above the snapshot) and the next sync's GC
// (which deletes from step 0) removes them.
//
// ReadLog (HandleReadLog): the records of one slot with from_step < step <= to_step, streamed in
// (step, micro_batch) order, the per-step record of each step first. The requester must be alive.
// INVALID_ARGUMENT for a slot outside the topology, a negative from_step or from_step >= to_step;
// DATA_LOSS (naming the key) from storage is passed through and nothing is streamed then.
//
// Thread safety: every method may be called from any number of threads (one gRPC handler thread
// per stream). Lock order: a sender's lock, then slot locks (ascending slot index), then the
// Membership's lock and whatever snapshot_step takes; CommitSnapshot takes one slot lock, so the
// caller may hold its own locks (e.g. the stage lock) around it as long as snapshot_step never
// takes them.

#include <cstddef>
#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"
#include "grpcpp/support/sync_stream.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"

namespace rebound::storage {
class DurableStore;
}  // namespace rebound::storage

namespace rebound::server {

class Membership;

// Counters for status and metrics; all monotonic.
struct StepLogStats {
  int64_t batches_committed = 0;       // AppendLog batches acknowledged (after their commit)
  int64_t records_written = 0;         // records put into the store
  int64_t bytes_written = 0;           // their serialized bytes
  int64_t duplicates_dropped = 0;      // record_id <= the sender's acknowledged id
  int64_t below_snapshot_dropped = 0;  // step <= the slot's snapshot floor
  int64_t batches_rejected = 0;        // streams ended by INVALID_ARGUMENT
};

class StepLogService {
 public:
  // The step of `slot`'s current snapshot (its last applied sync), 0 if none.
  using SnapshotStepFn = std::function<int64_t(const SlotId& slot)>;

  static constexpr int kMaxRecordsPerBatch = 4096;
  static constexpr size_t kMaxSenders = 4096;

  // REQUIRES: `job` is validated; `membership` and `store` outlive this object; `snapshot_step`
  // (may be empty: every floor starts at 0) is thread-safe and must not call into this object.
  // `sync_step` (may be empty: `snapshot_step` is used) gives the slot's last applied sync, which
  // bounds how far past it a record may be; `snapshot_step` is then the floor below which records
  // are dropped, which a held log (a recovery group's, an audited window's) keeps lower.
  StepLogService(const JobConfig& job, Membership* membership, storage::DurableStore* store,
                 SnapshotStepFn snapshot_step = nullptr, SnapshotStepFn sync_step = nullptr);

  StepLogService(const StepLogService&) = delete;
  StepLogService& operator=(const StepLogService&) = delete;

  // Serves one AppendLog stream until the client half-closes, the call is cancelled or an error
  // ends it (see the header comment). `context` may be null (tests).
  grpc::Status HandleAppendLog(
      grpc::ServerContext* context,
      grpc::ServerReaderWriterInterface<AppendLogAck, AppendLogRequest>* stream);

  // Streams `slot`'s records in (request.from_step, request.to_step] to `writer`, checking that
  // request.incarnation is alive. `slot` is the recovery task's slot (ReadLogRequest names the
  // task, the caller maps it). CANCELLED if the client goes away. `context` may be null.
  grpc::Status HandleReadLog(grpc::ServerContext* context, const ReadLogRequest& request,
                             const SlotId& slot, grpc::ServerWriterInterface<LogRecord>* writer);

  // t_f of docs/design.md §5.3: the highest step t > after_step such that every step in
  // (after_step, t] has what a replay of the slot's recovery group [first, end) (common/config.h
  // RecoveryGroup; the slot alone when the boundaries around it are logged) reads: the slot's
  // per-step record (micro_batch = -1, with params_checksum) and, per micro-batch, stage 0's own
  // sample-id record (first = 0) or the FORWARD pair logged for stage `first`, and the BACKWARD
  // pair logged for stage end-1 (end < S); after_step itself if step after_step + 1 is
  // incomplete. INVALID_ARGUMENT for a slot outside the topology or a negative after_step;
  // DATA_LOSS from storage passed through.
  // `until_step`: only steps up to it are read (an audit's window, (after_step, until_step]).
  absl::StatusOr<int64_t> LastCompleteStep(
      const SlotId& slot, int64_t after_step,
      int64_t until_step = std::numeric_limits<int64_t>::max()) const;

  // Runs `commit` (the write batch of a sync that snapshots `slot` at `snapshot_step` and deletes
  // its log up to it) while no AppendLog batch touching `slot` is being checked or committed;
  // if `commit` returns OK, the slot's floor becomes at least `snapshot_step`. Returns what
  // `commit` returns. INVALID_ARGUMENT (without running `commit`) for a slot outside the
  // topology. `commit` must not call into this object.
  absl::Status CommitSnapshot(const SlotId& slot, int64_t snapshot_step,
                              const std::function<absl::Status()>& commit);

  StepLogStats stats() const;

  // The highest step of `slot` whose per-step record (its last record) this server has committed
  // since it started; 0 if none. Compared with the slot's snapshot step it tells how many steps
  // a replay would rebuild now. 0 for a slot outside the topology.
  int64_t LoggedStep(const SlotId& slot) const;

 private:
  struct Sender {
    absl::Mutex mu;
    uint64_t acked_through ABSL_GUARDED_BY(mu) = 0;
  };
  struct SlotGuard {
    absl::Mutex mu;  // readers: AppendLog batches; writer: CommitSnapshot
    int64_t floor ABSL_GUARDED_BY(mu) = 0;
    std::atomic<int64_t> logged_step{0};
  };
  // The outcome of one batch: the ack to send, or the status that ends the stream.
  struct BatchResult {
    absl::Status status;
    uint64_t acked_through = 0;
  };

  // Validates and commits one batch. Normalizes the records in place (slot, sender_incarnation)
  // so that they are stored without a copy.
  BatchResult ProcessBatch(AppendLogRequest* request);
  // INVALID_ARGUMENT naming the record, or OK. `index` is its position in the batch.
  absl::Status ValidateRecord(uint64_t incarnation, const LogRecord& record, int index) const;
  absl::Status ValidateSlot(const SlotId& slot) const;
  // The slot that wrote `record`: its own slot, or for a boundary record the neighbour that
  // sent the tensor (REQUIRES: a validated record).
  static SlotId WriterOf(const LogRecord& record);
  int SlotIndex(const SlotId& slot) const;
  std::shared_ptr<Sender> FindOrAddSender(uint64_t incarnation);
  void ForgetSender(uint64_t incarnation);
  void AddStats(const StepLogStats& delta);
  void CountRejected();

  const JobConfig job_;
  Membership* const membership_;
  storage::DurableStore* const store_;
  const SnapshotStepFn snapshot_step_;
  const SnapshotStepFn sync_step_;
  const int replicas_;
  const int stages_;
  const int micro_batches_;
  const int samples_per_micro_batch_;
  const int64_t max_batch_bytes_;
  const std::vector<bool> logged_;  // LoggedBoundaries(job)

  // One per slot, index = replica * S + stage; never resized.
  const std::unique_ptr<SlotGuard[]> slots_;

  mutable absl::Mutex senders_mu_;
  std::map<uint64_t, std::shared_ptr<Sender>> senders_ ABSL_GUARDED_BY(senders_mu_);

  mutable absl::Mutex stats_mu_;
  StepLogStats stats_ ABSL_GUARDED_BY(stats_mu_);
};

}  // namespace rebound::server
