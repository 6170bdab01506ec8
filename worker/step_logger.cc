#include "worker/step_logger.h"

#include <glog/logging.h>

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "common/backoff.h"
#include "common/grpc_status.h"
#include "common/slot.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/sync_stream.h"

namespace rebound::worker {
namespace {

// Codes that reopening the stream cannot fix (see the header).
bool IsTerminal(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kUnimplemented:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kDataLoss:
      return true;
    default:
      return false;
  }
}

}  // namespace

// One AppendLog call. `done`, `writer_exited` and `reader_exited` are guarded by the logger's
// mu_; `context` is thread-safe for TryCancel; `rw` is used by one writer and one reader thread
// at a time, and Finish only after both have exited.
struct StepLogger::Stream {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<AppendLogRequest, AppendLogAck>> rw;
  bool done = false;
  bool writer_exited = false;
  bool reader_exited = false;
};

StepLoggerOptions StepLoggerOptions::FromConfig(const WorkerConfig& config,
                                                const StepLogConfig& step_log) {
  StepLoggerOptions options;
  const int64_t buffer_bytes = step_log.buffer_bytes();
  options.buffer_bytes = buffer_bytes;
  options.linger = absl::Milliseconds(step_log.linger_ms());
  options.max_batch_bytes = std::min<int64_t>(options.max_batch_bytes, buffer_bytes);
  options.ack_timeout = absl::Milliseconds(config.rpc_deadline_ms());
  options.backoff_initial = absl::Milliseconds(config.backoff_initial_ms());
  options.backoff_max = absl::Milliseconds(config.backoff_max_ms());
  return options;
}

StepLogger::StepLogger(std::shared_ptr<grpc::Channel> channel, uint64_t incarnation,
                       const StepLoggerOptions& options)
    : stub_(ParameterServer::NewStub(channel)), incarnation_(incarnation), options_([&options] {
        StepLoggerOptions sane = options;
        sane.buffer_bytes = std::max<int64_t>(1, sane.buffer_bytes);
        sane.max_batch_bytes = std::max<int64_t>(1, sane.max_batch_bytes);
        sane.max_batch_records = std::clamp(sane.max_batch_records, 1, 4096);
        sane.ack_timeout = std::max(sane.ack_timeout, absl::Milliseconds(10));
        sane.backoff_initial = std::max(sane.backoff_initial, absl::Milliseconds(1));
        sane.backoff_max = std::max(sane.backoff_max, sane.backoff_initial);
        return sane;
      }()),
      clock_(options.clock != nullptr ? options.clock : DefaultClock()) {
  thread_ = std::thread([this] { Run(); });
}

StepLogger::StepLogger(std::shared_ptr<grpc::Channel> channel, uint64_t incarnation,
                       const StepLogConfig& step_log, const WorkerConfig& config,
                       const Clock* clock)
    : StepLogger(std::move(channel), incarnation, [&] {
        StepLoggerOptions options = StepLoggerOptions::FromConfig(config, step_log);
        options.clock = clock;
        return options;
      }()) {}

StepLogger::~StepLogger() { Stop(); }

void StepLogger::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (current_ != nullptr) current_->context.TryCancel();
  }
  std::call_once(join_once_, [this] {
    if (thread_.joinable()) thread_.join();
  });
}

absl::Status StepLogger::Append(LogRecord record, absl::Duration max_block) {
  record.set_sender_incarnation(incarnation_);
  // Accounted with the widest record_id, so the real size never exceeds it.
  record.set_record_id(std::numeric_limits<uint64_t>::max());
  const int64_t bytes = static_cast<int64_t>(record.ByteSizeLong());
  if (bytes > options_.buffer_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("a step-log record of ", bytes,
                                                   " bytes does not fit the buffer of ",
                                                   options_.buffer_bytes, " bytes"));
  }
  absl::MutexLock lock(&mu_);
  auto room = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !terminal_.ok() || pending_bytes_ + bytes <= options_.buffer_bytes;
  };
  mu_.AwaitWithTimeout(absl::Condition(&room), max_block);
  if (!terminal_.ok()) return terminal_;
  if (stopping_) return absl::CancelledError("the step logger is stopped");
  if (pending_bytes_ + bytes > options_.buffer_bytes) {
    return absl::UnavailableError(absl::StrCat("the step-log buffer is full: ", pending_bytes_,
                                               " unacknowledged bytes in ", buffer_.size(),
                                               " records (buffer_bytes ", options_.buffer_bytes,
                                               "), acknowledged through record ", acked_through_,
                                               "; waited ", absl::FormatDuration(max_block)));
  }
  record.set_record_id(++last_id_);
  pending_bytes_ += bytes;
  buffer_.push_back(Entry{std::move(record), bytes});
  return absl::OkStatus();
}

absl::Status StepLogger::AppendAll(std::vector<LogRecord>* records, absl::Duration max_block) {
  int64_t total = 0;
  absl::InlinedVector<int64_t, 8> sizes;
  sizes.reserve(records->size());
  for (LogRecord& record : *records) {
    record.set_sender_incarnation(incarnation_);
    // Accounted with the widest record_id, as Append does.
    record.set_record_id(std::numeric_limits<uint64_t>::max());
    sizes.push_back(static_cast<int64_t>(record.ByteSizeLong()));
    total += sizes.back();
  }
  if (total > options_.buffer_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(records->size(), " step-log records of ", total,
                                                   " bytes do not fit the buffer of ",
                                                   options_.buffer_bytes, " bytes"));
  }
  absl::MutexLock lock(&mu_);
  auto room = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !terminal_.ok() || pending_bytes_ + total <= options_.buffer_bytes;
  };
  // Only a full buffer waits: the common case takes no timed wait at all.
  if (!room()) mu_.AwaitWithTimeout(absl::Condition(&room), max_block);
  if (!terminal_.ok()) return terminal_;
  if (stopping_) return absl::CancelledError("the step logger is stopped");
  if (pending_bytes_ + total > options_.buffer_bytes) {
    return absl::UnavailableError(absl::StrCat("the step-log buffer is full: ", pending_bytes_,
                                               " unacknowledged bytes in ", buffer_.size(),
                                               " records (buffer_bytes ", options_.buffer_bytes,
                                               "); waited ", absl::FormatDuration(max_block)));
  }
  for (size_t i = 0; i < records->size(); ++i) {
    LogRecord& record = (*records)[i];
    record.set_record_id(++last_id_);
    pending_bytes_ += sizes[i];
    buffer_.push_back(Entry{std::move(record), sizes[i]});
  }
  records->clear();
  return absl::OkStatus();
}

absl::Status StepLogger::Flush(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  const uint64_t target = last_id_;
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return acked_through_ >= target || !terminal_.ok() || stopping_;
  };
  mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
  if (!terminal_.ok()) return terminal_;
  if (acked_through_ >= target) return absl::OkStatus();
  if (stopping_) return absl::CancelledError("the step logger is stopped");
  return absl::DeadlineExceededError(
      absl::StrCat("step-log flush: the server acknowledged through record ", acked_through_,
                   " of ", target, " within ", absl::FormatDuration(timeout)));
}

StepLoggerStats StepLogger::stats() const {
  absl::MutexLock lock(&mu_);
  StepLoggerStats stats;
  stats.pending_bytes = pending_bytes_;
  stats.pending_records = static_cast<int64_t>(buffer_.size());
  stats.appended_through = last_id_;
  stats.acked_through = acked_through_;
  stats.bytes_shipped = bytes_shipped_;
  stats.records_shipped = records_shipped_;
  stats.streams_opened = streams_opened_;
  return stats;
}

void StepLogger::OnAck(uint64_t acked_through) {
  const uint64_t through = std::min(acked_through, last_id_);
  if (through <= acked_through_) return;
  while (!buffer_.empty() && buffer_.front().record.record_id() <= through) {
    pending_bytes_ -= buffer_.front().bytes;
    buffer_.pop_front();
  }
  acked_through_ = through;
  waiting_since_ = clock_->Now();
}

void StepLogger::Run() {
  Backoff backoff(options_.backoff_initial, options_.backoff_max, incarnation_);
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !buffer_.empty();
      };
      mu_.Await(absl::Condition(&work));
      if (stopping_) return;
    }
    bool acked_any = false;
    const absl::Status status = RunStream(&acked_any);
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    if (acked_any) backoff.Reset();
    if (IsTerminal(status.code())) {
      terminal_ = absl::Status(status.code(),
                               absl::StrCat("the step-log stream of incarnation ", incarnation_,
                                            " ended for good: ", status.message()));
      LOG(ERROR) << terminal_;
      return;
    }
    const absl::Duration delay = backoff.Next();
    LOG(WARNING) << "step-log stream broke (" << status << "); " << buffer_.size()
                 << " unacknowledged records are sent again in " << delay;
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), delay);
    if (stopping_) return;
  }
}

absl::Status StepLogger::RunStream(bool* acked_any) {
  auto stream = std::make_unique<Stream>();
  uint64_t acked_at_start = 0;
  {
    absl::MutexLock lock(&mu_);
    current_ = stream.get();
    if (stopping_) stream->context.TryCancel();
    sent_through_ = acked_through_;
    acked_at_start = acked_through_;
    waiting_since_ = clock_->Now();
    ++streams_opened_;
  }
  stream->rw = stub_->AppendLog(&stream->context);
  std::thread writer([this, s = stream.get()] { WriteLoop(s); });
  std::thread reader([this, s = stream.get()] { ReadLoop(s); });

  // Supervise: until the call ends, Stop() is called, or in-flight records go unacknowledged
  // for ack_timeout.
  bool cancelled = false;
  bool hung = false;
  {
    absl::MutexLock lock(&mu_);
    auto ended = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stream->done || stopping_; };
    while (!ended()) {
      if (sent_through_ > acked_through_ && clock_->Now() - waiting_since_ >= options_.ack_timeout) {
        hung = true;
        break;
      }
      mu_.AwaitWithTimeout(absl::Condition(&ended), options_.ack_timeout / 4);
    }
    cancelled = hung || stopping_;
  }
  if (cancelled) stream->context.TryCancel();
  {
    // A call the server ended ends both loops by itself; cancel one that does not.
    absl::MutexLock lock(&mu_);
    auto exited = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stream->writer_exited && stream->reader_exited;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&exited), options_.ack_timeout)) {
      stream->context.TryCancel();
    }
  }
  writer.join();
  reader.join();
  const grpc::Status finished = stream->rw->Finish();
  absl::MutexLock lock(&mu_);
  current_ = nullptr;
  *acked_any = acked_through_ > acked_at_start;
  if (stopping_) return absl::OkStatus();
  if (hung) {
    return absl::UnavailableError(absl::StrCat(
        "no ack for ", absl::FormatDuration(options_.ack_timeout), " with records in flight"));
  }
  if (finished.ok()) return absl::UnavailableError("the server ended the AppendLog stream");
  return FromGrpcStatus(finished);
}

void StepLogger::WriteLoop(Stream* stream) {
  while (true) {
    AppendLogRequest request;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stream->done || stopping_ || last_id_ > std::max(sent_through_, acked_through_);
      };
      mu_.Await(absl::Condition(&ready));
      if (stream->done || stopping_) break;
      if (options_.linger > absl::ZeroDuration()) {
        auto full = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stream->done || stopping_ ||
                 last_id_ - std::max(sent_through_, acked_through_) >=
                     static_cast<uint64_t>(options_.max_batch_records);
        };
        mu_.AwaitWithTimeout(absl::Condition(&full), options_.linger);
        if (stream->done || stopping_) break;
      }
      // buffer_[k] holds record_id acked_through_ + 1 + k.
      const uint64_t first = std::max(sent_through_, acked_through_) + 1;
      request.set_incarnation(incarnation_);
      int64_t bytes = 0;
      for (size_t k = first - (acked_through_ + 1);
           k < buffer_.size() && request.records_size() < options_.max_batch_records; ++k) {
        const Entry& entry = buffer_[k];
        if (request.records_size() > 0 && bytes + entry.bytes > options_.max_batch_bytes) break;
        *request.add_records() = entry.record;
        bytes += entry.bytes;
      }
      if (sent_through_ <= acked_through_) waiting_since_ = clock_->Now();  // nothing was in flight
      sent_through_ = request.records(request.records_size() - 1).record_id();
      // Counted before the write: its ack may arrive before Write returns.
      bytes_shipped_ += static_cast<int64_t>(request.ByteSizeLong());
      records_shipped_ += request.records_size();
    }
    if (!stream->rw->Write(request)) {
      absl::MutexLock lock(&mu_);
      stream->done = true;
      break;
    }
  }
  absl::MutexLock lock(&mu_);
  stream->writer_exited = true;
}

void StepLogger::ReadLoop(Stream* stream) {
  AppendLogAck ack;
  while (stream->rw->Read(&ack)) {
    absl::MutexLock lock(&mu_);
    OnAck(ack.acked_through());
  }
  absl::MutexLock lock(&mu_);
  stream->done = true;
  stream->reader_exited = true;
}

LogRecord MakeMicroBatchRecord(const SlotId& slot, int64_t step, int32_t micro_batch,
                               absl::Span<const int64_t> sample_ids) {
  LogRecord record;
  *record.mutable_slot() = Normalized(slot);
  record.set_step(step);
  record.set_micro_batch(micro_batch);
  record.mutable_sample_ids()->Add(sample_ids.begin(), sample_ids.end());
  return record;
}

LogRecord MakeStepRecord(const SlotId& slot, int64_t step, uint64_t params_checksum,
                         absl::Span<const uint64_t> tensor_checksums) {
  LogRecord record;
  *record.mutable_slot() = Normalized(slot);
  record.set_step(step);
  record.set_micro_batch(-1);
  record.set_params_checksum(params_checksum);
  record.mutable_tensor_checksums()->Add(tensor_checksums.begin(), tensor_checksums.end());
  return record;
}

}  // namespace rebound::worker
