// StepLogger against an in-process server on 127.0.0.1: real gRPC, the real StepLogService over a
// real in-memory DurableStore and a real Membership. The server can hold back or drop its acks
// (a stalled or lossy server) and can be stopped and started again on the same port.

#include "worker/step_logger.h"

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/config.h"
#include "common/security.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"
#include "proto/rebound.grpc.pb.h"
#include "server/membership.h"
#include "server/step_log.h"
#include "storage/durable_store.h"

namespace rebound::worker {
namespace {

using Catch::Matchers::Contains;

constexpr int kMicroBatches = 4;
constexpr int kBatchSize = 8;
constexpr int kSamplesPerMicroBatch = kBatchSize / kMicroBatches;

// What the test server does with the acks of StepLogService.
enum class Acks {
  kPass,  // sends them
  kHold,  // holds each until release_acks() (bounded), or the call is cancelled
  kDrop,  // commits the records but never sends the acks
};

// Wraps the server's stream to hold back or drop acks.
class AckGate final : public grpc::ServerReaderWriterInterface<AppendLogAck, AppendLogRequest> {
 public:
  AckGate(grpc::ServerContext* context,
          grpc::ServerReaderWriterInterface<AppendLogAck, AppendLogRequest>* inner, Acks mode,
          absl::Notification* release)
      : context_(context), inner_(inner), mode_(mode), release_(release) {}

  void SendInitialMetadata() override { inner_->SendInitialMetadata(); }
  bool NextMessageSize(uint32_t* size) override { return inner_->NextMessageSize(size); }
  bool Read(AppendLogRequest* request) override { return inner_->Read(request); }
  bool Write(const AppendLogAck& ack, grpc::WriteOptions options) override {
    if (mode_ == Acks::kDrop) return true;
    if (mode_ == Acks::kHold) {
      const absl::Time give_up = absl::Now() + absl::Seconds(10);
      while (!release_->WaitForNotificationWithTimeout(absl::Milliseconds(10))) {
        if (context_->IsCancelled() || absl::Now() > give_up) return false;
      }
    }
    return inner_->Write(ack, options);
  }

 private:
  grpc::ServerContext* const context_;
  grpc::ServerReaderWriterInterface<AppendLogAck, AppendLogRequest>* const inner_;
  const Acks mode_;
  absl::Notification* const release_;
};

class GatedStepLogService final : public ParameterServer::Service {
 public:
  GatedStepLogService(server::StepLogService* log, Acks mode, absl::Notification* release)
      : log_(log), mode_(mode), release_(release) {}

  grpc::Status AppendLog(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<AppendLogAck, AppendLogRequest>* stream) override {
    AckGate gate(context, stream, mode_, release_);
    return log_->HandleAppendLog(context, &gate);
  }

 private:
  server::StepLogService* const log_;
  const Acks mode_;
  absl::Notification* const release_;
};

JobConfig OneReplicaJob() {
  auto job = ParseJobConfig(
      absl::StrCat("job_id: \"j\"\n"
                   "model { layers { width: 8 } layers { width: 4 activation: IDENTITY } }\n"
                   "topology { replicas: 1 stages: 1 }\n"
                   "data { batch_size: ",
                   kBatchSize, " micro_batches: ", kMicroBatches, " }\n"),
      "job.pbtxt");
  REQUIRE(job.ok());
  return *job;
}

std::unique_ptr<storage::DurableStore> OpenInMemoryStore() {
  auto store = storage::DurableStore::Open(storage::DurableStoreOptions{});
  REQUIRE(store.ok());
  return *std::move(store);
}

// A server holding slot (0, 0)'s trainer; its gRPC front can be stopped and started again on the
// same port while the state (membership, store, dedup state) lives on.
class Cluster {
 public:
  Cluster()
      : job_(OneReplicaJob()),
        membership_(job_, &clock_),
        store_(OpenInMemoryStore()),
        log_(job_, &membership_, store_.get()) {
    RegisterRequest request;
    request.set_job_id("j");
    request.set_worker_name("trainer");
    request.set_requested_role(TRAINER);
    request.set_peer_address("127.0.0.1:1");
    auto registered = membership_.Register(request);
    REQUIRE(registered.ok());
    trainer_ = registered->incarnation();
    credential_->Set(registered->credential());
    slot_ = registered->slot();
  }

  ~Cluster() { StopServer(); }

  // Starts serving with `acks` on `port` (0: any; the first start's port is kept).
  void StartServer(Acks acks) {
    service_ = std::make_unique<GatedStepLogService>(&log_, acks, &release_acks_);
    grpc::ServerBuilder builder;
    int bound = 0;
    builder.AddListeningPort(absl::StrCat("127.0.0.1:", port_), grpc::InsecureServerCredentials(),
                             &bound);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    REQUIRE(server_ != nullptr);
    REQUIRE(bound > 0);
    port_ = bound;
  }

  void StopServer() {
    if (server_ == nullptr) return;
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    server_.reset();
    service_.reset();
  }

  // A channel that reconnects quickly after the server comes back.
  std::shared_ptr<grpc::Channel> Channel() const {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 200);
    // The trainer's channel carries its worker credential, as rebound_worker's does.
    auto channel = MakeChannel(absl::StrCat("127.0.0.1:", port_), SecurityConfig(), args,
                               credential_);
    REQUIRE(channel.ok());
    return *channel;
  }

  std::vector<LogRecord> Stored() const {
    auto records = store_->ReadLog(slot_, 0, std::numeric_limits<int64_t>::max());
    REQUIRE(records.ok());
    return *records;
  }

  void release_acks() { release_acks_.Notify(); }
  server::Membership& membership() { return membership_; }
  server::StepLogService& log() { return log_; }
  uint64_t trainer() const { return trainer_; }
  const SlotId& slot() const { return slot_; }

 private:
  const JobConfig job_;
  FakeClock clock_;
  server::Membership membership_;
  std::unique_ptr<storage::DurableStore> store_;
  server::StepLogService log_;
  absl::Notification release_acks_;
  std::unique_ptr<GatedStepLogService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  uint64_t trainer_ = 0;
  std::shared_ptr<WorkerCredential> credential_ = std::make_shared<WorkerCredential>();
  SlotId slot_;
};

StepLoggerOptions TestOptions(int64_t buffer_bytes) {
  StepLoggerOptions options;
  options.buffer_bytes = buffer_bytes;
  options.max_batch_bytes = std::min<int64_t>(buffer_bytes, 64 * 1024);
  options.ack_timeout = absl::Seconds(5);
  options.backoff_initial = absl::Milliseconds(20);
  options.backoff_max = absl::Milliseconds(200);
  return options;
}

std::vector<int64_t> SampleIds(int64_t step, int micro_batch) {
  std::vector<int64_t> ids;
  for (int k = 0; k < kSamplesPerMicroBatch; ++k) {
    ids.push_back(step * 100 + micro_batch * kSamplesPerMicroBatch + k);
  }
  return ids;
}

// Appends step `step` the way a trainer does: its micro-batches, then its checksum.
void AppendStep(StepLogger* logger, const SlotId& slot, int64_t step) {
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    REQUIRE(
        logger->Append(MakeMicroBatchRecord(slot, step, mb, SampleIds(step, mb)), absl::Seconds(5))
            .ok());
  }
  REQUIRE(logger->Append(MakeStepRecord(slot, step, 0xABC000 + step), absl::Seconds(5)).ok());
}

std::vector<std::pair<int64_t, int>> Keys(const std::vector<LogRecord>& records) {
  std::vector<std::pair<int64_t, int>> keys;
  for (const LogRecord& record : records) keys.emplace_back(record.step(), record.micro_batch());
  return keys;
}

std::vector<std::pair<int64_t, int>> ExpectedKeys(int64_t first_step, int64_t last_step) {
  std::vector<std::pair<int64_t, int>> keys;
  for (int64_t step = first_step; step <= last_step; ++step) {
    for (int mb = -1; mb < kMicroBatches; ++mb) keys.emplace_back(step, mb);
  }
  return keys;
}

// Waits up to `timeout` for `condition`.
template <typename Condition>
bool Eventually(Condition condition, absl::Duration timeout = absl::Seconds(5)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

TEST_CASE("the record helpers fill in the slot, step, micro-batch and content") {
  SlotId slot;
  slot.set_replica(3);  // stage left unset: the helpers set it explicitly
  const std::vector<int64_t> ids = {7, 3, 11};
  const LogRecord micro = MakeMicroBatchRecord(slot, 12, 2, ids);
  CHECK(micro.slot().replica() == 3);
  CHECK(micro.slot().has_stage());
  CHECK(micro.step() == 12);
  CHECK(micro.micro_batch() == 2);
  CHECK(std::vector<int64_t>(micro.sample_ids().begin(), micro.sample_ids().end()) == ids);
  CHECK_FALSE(micro.has_params_checksum());
  const LogRecord step = MakeStepRecord(slot, 12, 0xFEEDu);
  CHECK(step.micro_batch() == -1);
  CHECK(step.params_checksum() == 0xFEEDu);
  CHECK(step.sample_ids_size() == 0);
}

TEST_CASE("records reach the server in order and Flush returns once they are acknowledged") {
  Cluster cluster;
  cluster.StartServer(Acks::kPass);
  StepLogger logger(cluster.Channel(), cluster.trainer(), TestOptions(1 << 20));
  CHECK(logger.Flush(absl::Seconds(1)).ok());  // nothing to wait for
  for (int64_t step = 1; step <= 20; ++step) AppendStep(&logger, cluster.slot(), step);
  REQUIRE(logger.Flush(absl::Seconds(10)).ok());

  const StepLoggerStats stats = logger.stats();
  CHECK(stats.appended_through == 100);
  CHECK(stats.acked_through == 100);
  CHECK(stats.pending_records == 0);
  CHECK(stats.pending_bytes == 0);
  CHECK(stats.records_shipped == 100);
  CHECK(stats.bytes_shipped > 100 * 10);
  CHECK(stats.streams_opened == 1);

  const std::vector<LogRecord> stored = cluster.Stored();
  CHECK(Keys(stored) == ExpectedKeys(1, 20));
  // Record ids follow the order of Append: micro-batches 0..3, then the step's checksum.
  const LogRecord& step7_checksum = stored[6 * 5];
  CHECK(step7_checksum.record_id() == 35);
  CHECK(step7_checksum.params_checksum() == 0xABC000 + 7);
  CHECK(step7_checksum.sender_incarnation() == cluster.trainer());
  const LogRecord& step7_mb1 = stored[6 * 5 + 2];
  CHECK(step7_mb1.record_id() == 32);
  CHECK(std::vector<int64_t>(step7_mb1.sample_ids().begin(), step7_mb1.sample_ids().end()) ==
        SampleIds(7, 1));
  CHECK(cluster.log().LastCompleteStep(cluster.slot(), 0).value() == 20);
}

TEST_CASE("AppendAll adds a step's records together, in order, like Append one by one") {
  Cluster cluster;
  cluster.StartServer(Acks::kPass);
  StepLogger logger(cluster.Channel(), cluster.trainer(), TestOptions(1 << 20));
  for (int64_t step = 1; step <= 10; ++step) {
    std::vector<LogRecord> records;
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      records.push_back(MakeMicroBatchRecord(cluster.slot(), step, mb, SampleIds(step, mb)));
    }
    records.push_back(MakeStepRecord(cluster.slot(), step, 0xABC000 + step));
    REQUIRE(logger.AppendAll(&records, absl::Seconds(5)).ok());
  }
  REQUIRE(logger.Flush(absl::Seconds(10)).ok());
  CHECK(logger.stats().appended_through == 50);
  const std::vector<LogRecord> stored = cluster.Stored();
  CHECK(Keys(stored) == ExpectedKeys(1, 10));
  CHECK(stored[4 * 5].record_id() == 25);  // step 5 checksum (sorts first), the 25th record
  CHECK(stored[4 * 5].params_checksum() == 0xABC000 + 5);
  CHECK(cluster.log().LastCompleteStep(cluster.slot(), 0).value() == 10);

  // A step that cannot fit the buffer as a whole is refused whole.
  StepLogger tiny(cluster.Channel(), cluster.trainer(), TestOptions(64));
  std::vector<LogRecord> too_many;
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    too_many.push_back(MakeMicroBatchRecord(cluster.slot(), 11, mb, SampleIds(11, mb)));
  }
  CHECK(tiny.AppendAll(&too_many, absl::Milliseconds(10)).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(tiny.stats().appended_through == 0);
}

TEST_CASE("a refused AppendAll leaves the records with the caller, who may try them again") {
  Cluster cluster;
  cluster.StartServer(Acks::kHold);
  constexpr int64_t kBuffer = 1000;
  StepLogger logger(cluster.Channel(), cluster.trainer(), TestOptions(kBuffer));
  auto step_records = [&cluster](int64_t step) {
    std::vector<LogRecord> records;
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      records.push_back(MakeMicroBatchRecord(cluster.slot(), step, mb, SampleIds(step, mb)));
    }
    records.push_back(MakeStepRecord(cluster.slot(), step, 0xABC000 + step));
    return records;
  };
  int64_t step = 0;
  std::vector<LogRecord> records;
  absl::Status status;
  while (status.ok()) {
    records = step_records(++step);
    status = logger.AppendAll(&records, absl::ZeroDuration());
    if (status.ok()) CHECK(records.empty());  // moved into the buffer
  }
  REQUIRE(status.code() == absl::StatusCode::kUnavailable);
  REQUIRE(step > 1);
  const uint64_t appended = logger.stats().appended_through;
  CHECK(appended == static_cast<uint64_t>(step - 1) * (kMicroBatches + 1));
  // Refused: the step's records are all still there, unchanged but for sender_incarnation.
  REQUIRE(records.size() == kMicroBatches + 1);
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    CHECK(records[mb].step() == step);
    CHECK(records[mb].micro_batch() == mb);
    CHECK(std::vector<int64_t>(records[mb].sample_ids().begin(), records[mb].sample_ids().end()) ==
          SampleIds(step, mb));
  }
  CHECK(records.back().params_checksum() == 0xABC000 + static_cast<uint64_t>(step));

  // Once acks free room, the same vector goes in, with the next record_ids.
  cluster.release_acks();
  REQUIRE(logger.AppendAll(&records, absl::Seconds(10)).ok());
  CHECK(records.empty());
  REQUIRE(logger.Flush(absl::Seconds(10)).ok());
  CHECK(logger.stats().appended_through == appended + kMicroBatches + 1);
  const std::vector<LogRecord> stored = cluster.Stored();
  CHECK(Keys(stored) == ExpectedKeys(1, step));
  CHECK(cluster.log().LastCompleteStep(cluster.slot(), 0).value() == step);
}

TEST_CASE("a full buffer blocks Append, which gives up with UNAVAILABLE after max_block") {
  Cluster cluster;
  cluster.StartServer(Acks::kHold);
  constexpr int64_t kBuffer = 1000;
  StepLogger logger(cluster.Channel(), cluster.trainer(), TestOptions(kBuffer));
  int accepted = 0;
  absl::Status status;
  for (int64_t step = 1; step <= 1000 && status.ok(); ++step) {
    status = logger.Append(MakeMicroBatchRecord(cluster.slot(), step, 0, SampleIds(step, 0)),
                           absl::ZeroDuration());
    if (status.ok()) ++accepted;
  }
  REQUIRE(status.code() == absl::StatusCode::kUnavailable);
  CHECK(accepted > 10);
  StepLoggerStats stats = logger.stats();
  CHECK(stats.pending_bytes <= kBuffer);
  CHECK(stats.pending_records == accepted);
  CHECK(stats.acked_through == 0);

  const absl::Time start = absl::Now();
  status = logger.Append(MakeMicroBatchRecord(cluster.slot(), 900, 0, SampleIds(900, 0)),
                         absl::Milliseconds(300));
  const absl::Duration blocked = absl::Now() - start;
  CHECK(status.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(status.message()), Contains("the step-log buffer is full"));
  CHECK(blocked >= absl::Milliseconds(290));
  CHECK(blocked < absl::Seconds(5));
  CHECK(logger.stats().pending_bytes <= kBuffer);
  CHECK(logger.Flush(absl::Milliseconds(100)).code() == absl::StatusCode::kDeadlineExceeded);

  SECTION("acks free the room and the blocked Append goes through") {
    std::thread release([&cluster] {
      absl::SleepFor(absl::Milliseconds(200));
      cluster.release_acks();
    });
    const absl::Status unblocked = logger.Append(
        MakeMicroBatchRecord(cluster.slot(), 950, 0, SampleIds(950, 0)), absl::Seconds(10));
    release.join();
    CHECK(unblocked.ok());
    REQUIRE(logger.Flush(absl::Seconds(10)).ok());
    CHECK(cluster.Stored().size() == static_cast<size_t>(accepted) + 1);
    CHECK(logger.stats().pending_bytes == 0);
  }
  SECTION("Stop unblocks a waiting Append, and later calls report CANCELLED") {
    absl::Status waited;
    std::thread appender([&] {
      waited = logger.Append(MakeMicroBatchRecord(cluster.slot(), 950, 0, SampleIds(950, 0)),
                             absl::Seconds(10));
    });
    absl::SleepFor(absl::Milliseconds(100));
    const absl::Time stop_at = absl::Now();
    logger.Stop();
    appender.join();
    CHECK(absl::Now() - stop_at < absl::Seconds(5));
    CHECK(waited.code() == absl::StatusCode::kCancelled);
    CHECK(logger.Flush(absl::Seconds(1)).code() == absl::StatusCode::kCancelled);
    CHECK(logger.Append(MakeStepRecord(cluster.slot(), 1, 1), absl::ZeroDuration()).code() ==
          absl::StatusCode::kCancelled);
  }
}

TEST_CASE("a record larger than the whole buffer is refused") {
  Cluster cluster;
  cluster.StartServer(Acks::kPass);
  StepLogger logger(cluster.Channel(), cluster.trainer(), TestOptions(64));
  std::vector<int64_t> many(100, 1);
  const absl::Status status =
      logger.Append(MakeMicroBatchRecord(cluster.slot(), 1, 0, many), absl::Seconds(1));
  CHECK(status.code() == absl::StatusCode::kInvalidArgument);
  CHECK(logger.stats().appended_through == 0);
}

TEST_CASE("a stream without acks is reopened after ack_timeout and the resend is deduplicated") {
  Cluster cluster;
  cluster.StartServer(Acks::kHold);
  StepLoggerOptions options = TestOptions(1 << 20);
  options.ack_timeout = absl::Milliseconds(200);
  StepLogger logger(cluster.Channel(), cluster.trainer(), options);
  AppendStep(&logger, cluster.slot(), 1);
  CHECK(Eventually([&] { return logger.stats().streams_opened >= 3; }));
  // Every reopened stream sent the 5 records again; the server had them already.
  CHECK(Eventually([&] { return cluster.log().stats().duplicates_dropped >= 5; }));
  cluster.release_acks();
  REQUIRE(logger.Flush(absl::Seconds(10)).ok());
  CHECK(cluster.log().stats().records_written == 5);
  CHECK(Keys(cluster.Stored()) == ExpectedKeys(1, 1));
}

TEST_CASE("after a server restart the logger sends again what was not acknowledged") {
  Cluster cluster;
  // The first server stores every record but its acks are lost.
  cluster.StartServer(Acks::kDrop);
  StepLogger logger(cluster.Channel(), cluster.trainer(), TestOptions(1 << 20));
  for (int64_t step = 1; step <= 10; ++step) AppendStep(&logger, cluster.slot(), step);
  REQUIRE(Eventually([&] { return cluster.log().stats().records_written == 50; }));
  CHECK(logger.stats().acked_through == 0);
  CHECK(logger.stats().pending_records == 50);

  cluster.StopServer();
  cluster.StartServer(Acks::kPass);  // the same port
  REQUIRE(logger.Flush(absl::Seconds(10)).ok());
  CHECK(logger.stats().streams_opened >= 2);
  CHECK(logger.stats().acked_through == 50);
  CHECK(cluster.log().stats().duplicates_dropped == 50);
  CHECK(cluster.log().stats().records_written == 50);

  AppendStep(&logger, cluster.slot(), 11);
  REQUIRE(logger.Flush(absl::Seconds(10)).ok());
  CHECK(Keys(cluster.Stored()) == ExpectedKeys(1, 11));
}

TEST_CASE("a fenced incarnation's logger reports FAILED_PRECONDITION from Append and Flush") {
  Cluster cluster;
  cluster.StartServer(Acks::kPass);
  StepLogger logger(cluster.Channel(), cluster.trainer(), TestOptions(1 << 20));
  AppendStep(&logger, cluster.slot(), 1);
  REQUIRE(logger.Flush(absl::Seconds(10)).ok());

  REQUIRE(cluster.membership().Deregister(cluster.trainer()).ok());
  // Queued before the logger learns of the fence, or refused at once: never stored.
  const absl::Status queued =
      logger.Append(MakeMicroBatchRecord(cluster.slot(), 2, 0, SampleIds(2, 0)), absl::Seconds(1));
  CHECK((queued.ok() || queued.code() == absl::StatusCode::kFailedPrecondition));
  const absl::Status flushed = logger.Flush(absl::Seconds(10));
  CHECK(flushed.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(flushed.message()), Contains("is fenced"));
  const absl::Status later = logger.Append(MakeStepRecord(cluster.slot(), 2, 1), absl::Seconds(1));
  CHECK(later.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(logger.Flush(absl::Seconds(1)).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(Keys(cluster.Stored()) == ExpectedKeys(1, 1));
}

}  // namespace
}  // namespace rebound::worker
