#pragma once

// StepLogger: ships a sender's step-log records (docs/design.md §5.2) to the server, asynchronously and
// off the training path, from a bounded buffer.
//
// Append() gives the record the next record_id (1, 2, ...) and this logger's incarnation as
// sender_incarnation and queues it; it never waits for the network unless the buffer is full.
// The buffer holds every record until the server acknowledges it, at most `buffer_bytes` of
// serialized records (counted with a worst-case record_id, so the real wire size is never more):
// an Append that does not fit blocks (back-pressure) until acknowledgements free room, for at
// most its `max_block`, then returns UNAVAILABLE. Memory stays bounded whatever the server does.
//
// A background thread keeps one long-lived AppendLog stream open while records are pending and
// writes them in batches (at most max_batch_records records and max_batch_bytes bytes; a single
// larger record goes alone). A second thread reads the acks (acked_through) and frees the
// records they cover. The stream is reopened with capped exponential backoff with jitter when it
// breaks (server down or restarted, UNAVAILABLE, ...) or when records have been in flight for
// ack_timeout without any ack (a hung server); after a reopen every unacknowledged record is sent
// again, in order: the server drops those it already has by record_id, or rewrites the same key
// with the same value.
//
// Statuses that retrying the same stream cannot fix end the logger for good and are reported by
// every later Append and Flush, with the server's code and message:
//   FAILED_PRECONDITION  this incarnation is fenced (it must never write again);
//   ABORTED              the server does not know the incarnation (register again, then make a
//                        new logger for the new incarnation);
//   INVALID_ARGUMENT, UNIMPLEMENTED, PERMISSION_DENIED, UNAUTHENTICATED, NOT_FOUND,
//   ALREADY_EXISTS, OUT_OF_RANGE, DATA_LOSS   a bug or a misconfiguration.
// Everything else (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, INTERNAL, UNKNOWN, a
// CANCELLED stream) is retried. After Stop(), Append and Flush return CANCELLED.
//
// Thread safety: every method may be called from any thread. The destructor calls Stop().
// Ownership: the logger shares the channel, owns its buffer and threads (joined by Stop()), and
// borrows options.clock.

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/clock.h"
#include "grpcpp/channel.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"

namespace rebound::worker {

struct StepLoggerOptions {
  // Most bytes of unacknowledged records held (job.step_log.buffer_bytes). >= 1.
  int64_t buffer_bytes = int64_t{64} << 20;
  // Most record bytes per AppendLogRequest: well under gRPC's default 4 MiB message limit and
  // the smallest allowed max_message_bytes (1 MiB), and, capped by buffer_bytes, under the
  // server's per-batch limit. A single larger record is sent alone. >= 1.
  int64_t max_batch_bytes = int64_t{512} << 10;
  // Most records per AppendLogRequest; the server accepts at most 4096. In [1, 4096].
  int max_batch_records = 1024;
  // Records in flight this long without any ack: the stream is presumed dead and reopened.
  absl::Duration ack_timeout = absl::Seconds(10);
  // How long the writer lets records gather before sending a batch (unless a full batch is
  // waiting or the logger stops): many steps per stream write and per server commit instead of
  // one each. Recovery only needs the log up to t_f; steps not shipped yet when a trainer dies
  // are recomputed by its successor. >= 0. The job's step_log.linger_ms.
  absl::Duration linger = absl::Milliseconds(100);
  // Delay before reopening a broken stream: initial, doubling up to max, with jitter.
  absl::Duration backoff_initial = absl::Milliseconds(100);
  absl::Duration backoff_max = absl::Seconds(5);
  // What the ack timeout is measured with (null: DefaultClock()); must outlive the logger.
  const Clock* clock = nullptr;

  // buffer_bytes and linger from the job's step_log; max_batch_bytes = min(512 KiB,
  // buffer_bytes); ack_timeout = rpc_deadline_ms; backoff from backoff_initial_ms and
  // backoff_max_ms.
  static StepLoggerOptions FromConfig(const WorkerConfig& config, const StepLogConfig& step_log);
};

struct StepLoggerStats {
  int64_t pending_bytes = 0;  // appended, not yet acknowledged (what the buffer holds)
  int64_t pending_records = 0;
  uint64_t appended_through = 0;  // highest record_id given out
  uint64_t acked_through = 0;     // every record_id <= this is durable on the server
  int64_t bytes_shipped = 0;      // AppendLogRequest bytes handed to streams, resends included
  int64_t records_shipped = 0;    // records handed to streams, resends included
  int64_t streams_opened = 0;     // AppendLog streams started (1 + reconnects)
};

class StepLogger {
 public:
  // Starts the background thread; nothing is sent before the first Append.
  // REQUIRES: `incarnation` is this worker's current one.
  StepLogger(std::shared_ptr<grpc::Channel> channel, uint64_t incarnation,
             const StepLoggerOptions& options);
  // The same with StepLoggerOptions::FromConfig(config, step_log) and `clock`.
  StepLogger(std::shared_ptr<grpc::Channel> channel, uint64_t incarnation,
             const StepLogConfig& step_log, const WorkerConfig& config,
             const Clock* clock = nullptr);
  ~StepLogger();

  StepLogger(const StepLogger&) = delete;
  StepLogger& operator=(const StepLogger&) = delete;

  // Queues `record` (its record_id and sender_incarnation are overwritten). OK once queued.
  // Blocks while the buffer has no room for it, up to `max_block`: UNAVAILABLE then.
  // INVALID_ARGUMENT if the record alone exceeds buffer_bytes; the logger's terminal status once
  // it has ended; CANCELLED after Stop().
  absl::Status Append(LogRecord record, absl::Duration max_block);
  // Appends all of `*records` at once (one step's records), as Append does for one: they enter
  // the buffer together or not at all. On OK they have been moved into the buffer (*records is
  // left empty); on any error *records still holds them (with sender_incarnation set), so the
  // caller may try again with the same vector. Same statuses as Append.
  absl::Status AppendAll(std::vector<LogRecord>* records, absl::Duration max_block);

  // Waits until every record appended before the call is acknowledged. DEADLINE_EXCEEDED after
  // `timeout`; the terminal status if the logger ends first (also if it had already ended);
  // CANCELLED after Stop().
  absl::Status Flush(absl::Duration timeout);

  // Ends the stream and the background threads, dropping what is not acknowledged (Flush first
  // to ship it). Unblocks waiting Append and Flush calls. Idempotent.
  void Stop();

  StepLoggerStats stats() const;
  uint64_t incarnation() const { return incarnation_; }

 private:
  struct Entry {
    LogRecord record;
    int64_t bytes = 0;  // accounted size
  };
  struct Stream;

  void Run();
  // Opens one stream, runs its writer and reader until it ends; returns its final status (OK
  // if Stop() ended it) and whether any ack arrived on it.
  absl::Status RunStream(bool* acked_any);
  void WriteLoop(Stream* stream);
  void ReadLoop(Stream* stream);
  void OnAck(uint64_t acked_through) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::unique_ptr<ParameterServer::Stub> stub_;
  const uint64_t incarnation_;
  const StepLoggerOptions options_;
  const Clock* const clock_;

  mutable absl::Mutex mu_;
  std::deque<Entry> buffer_ ABSL_GUARDED_BY(mu_);  // record_ids acked_through_+1 .. last_id_
  int64_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_id_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t acked_through_ ABSL_GUARDED_BY(mu_) = 0;
  // Highest record_id handed to the current stream's writer (reset to acked_through_ per stream).
  uint64_t sent_through_ ABSL_GUARDED_BY(mu_) = 0;
  // Since when the oldest in-flight record has waited for an ack (or the last ack).
  absl::Time waiting_since_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status terminal_ ABSL_GUARDED_BY(mu_);      // not OK once the logger has ended
  Stream* current_ ABSL_GUARDED_BY(mu_) = nullptr;  // for Stop() to cancel
  int64_t bytes_shipped_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t records_shipped_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t streams_opened_ ABSL_GUARDED_BY(mu_) = 0;

  std::thread thread_;
  std::once_flag join_once_;
};

// A micro-batch record of `slot`'s step `step` (stage 0's content: the micro-batch's sample
// ids, in the order the step used them).
LogRecord MakeMicroBatchRecord(const SlotId& slot, int64_t step, int32_t micro_batch,
                               absl::Span<const int64_t> sample_ids);

// The per-step record of `slot`'s step `step`: micro_batch -1, the checksum of the slot's
// parameters after the step and, when given (a job with audits), each parameter tensor's
// checksum in id order (compute::MlpStage::TensorChecksums).
LogRecord MakeStepRecord(const SlotId& slot, int64_t step, uint64_t params_checksum,
                         absl::Span<const uint64_t> tensor_checksums = {});

}  // namespace rebound::worker
