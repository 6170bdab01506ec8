// StepLogService over real gRPC on 127.0.0.1:0, a real DurableStore and a real Membership.

#include "server/step_log.h"

#include <catch2/catch.hpp>

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <stdlib.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/config.h"
#include "common/security.h"
#include "common/slot.h"
#include "common/tensor_codec.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "proto/rebound.grpc.pb.h"
#include "server/membership.h"
#include "storage/durable_store.h"
#include "tests/server/server_testing.h"

namespace rebound::server {
namespace {

using Catch::Matchers::Contains;
using testing::Request;
using testing::Slot;

constexpr int kMicroBatches = 4;
constexpr int kBatchSize = 2048;
constexpr int kSamplesPerMicroBatch = kBatchSize / kMicroBatches;

JobConfig TwoReplicaJob() {
  return testing::ParseJob(
      absl::StrCat("job_id: \"j\"\n"
                   "model { layers { width: 8 } layers { width: 4 activation: IDENTITY } }\n"
                   "topology { replicas: 2 stages: 1 }\n"
                   "data { batch_size: ",
                   kBatchSize, " micro_batches: ", kMicroBatches,
                   " }\n"
                   "step_log { buffer_bytes: 1048576 }\n"));
}

LogRecord MicroBatch(uint64_t id, int replica, int64_t step, int micro_batch) {
  LogRecord record;
  *record.mutable_slot() = Slot(replica);
  record.set_step(step);
  record.set_micro_batch(micro_batch);
  for (int k = 0; k < kSamplesPerMicroBatch; ++k) {
    record.add_sample_ids(step * 10000 + micro_batch * kSamplesPerMicroBatch + k);
  }
  record.set_record_id(id);
  return record;
}

LogRecord StepRecord(uint64_t id, int replica, int64_t step) {
  LogRecord record;
  *record.mutable_slot() = Slot(replica);
  record.set_step(step);
  record.set_micro_batch(-1);
  record.set_params_checksum(0xC0FFEE00u + step);
  record.set_record_id(id);
  return record;
}

// The M + 1 records of one step, record ids from *next_id on.
std::vector<LogRecord> WholeStep(uint64_t* next_id, int replica, int64_t step) {
  std::vector<LogRecord> records;
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    records.push_back(MicroBatch((*next_id)++, replica, step, mb));
  }
  records.push_back(StepRecord((*next_id)++, replica, step));
  return records;
}

AppendLogRequest Batch(uint64_t incarnation, const std::vector<LogRecord>& records) {
  AppendLogRequest request;
  request.set_incarnation(incarnation);
  for (const LogRecord& record : records) *request.add_records() = record;
  return request;
}

// (step, micro_batch) of each record.
std::vector<std::pair<int64_t, int>> Keys(const std::vector<LogRecord>& records) {
  std::vector<std::pair<int64_t, int>> keys;
  for (const LogRecord& record : records) keys.emplace_back(record.step(), record.micro_batch());
  return keys;
}

std::vector<std::pair<int64_t, int>> ExpectedKeys(std::vector<int64_t> steps) {
  std::vector<std::pair<int64_t, int>> keys;
  for (int64_t step : steps) {
    for (int mb = -1; mb < kMicroBatches; ++mb) keys.emplace_back(step, mb);
  }
  return keys;
}

// ParameterServer with only the step-log calls, forwarded; ReadLog's task_id is the slot's index
// replica * S + stage (the replica when S = 1).
class StepLogOnlyService final : public ParameterServer::Service {
 public:
  StepLogOnlyService(StepLogService* log, int stages) : log_(log), stages_(stages) {}

  grpc::Status AppendLog(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<AppendLogAck, AppendLogRequest>* stream) override {
    return log_->HandleAppendLog(context, stream);
  }

  grpc::Status ReadLog(grpc::ServerContext* context, const ReadLogRequest* request,
                       grpc::ServerWriter<LogRecord>* writer) override {
    const int task = static_cast<int>(request->task_id());
    return log_->HandleReadLog(context, *request, Slot(task / stages_, task % stages_), writer);
  }

 private:
  StepLogService* const log_;
  const int stages_;
};

std::unique_ptr<storage::DurableStore> OpenStore(const std::string& data_dir) {
  storage::DurableStoreOptions options;
  options.data_dir = data_dir;
  auto store = storage::DurableStore::Open(options);
  INFO(store.status().ToString());
  REQUIRE(store.ok());
  return *std::move(store);
}

std::string MakeTempDir() {
  const char* base = getenv("TEST_TMPDIR");
  std::string pattern = absl::StrCat(base != nullptr ? base : "/tmp", "/step_log_test.XXXXXX");
  REQUIRE(mkdtemp(pattern.data()) != nullptr);
  return pattern;
}

// A server serving the step log, with a trainer on every slot of `job` (registered in slot order)
// and a spare; by default the two-replica job: trainers of slots (0, 0) and (1, 0).
class Harness {
 public:
  explicit Harness(const std::string& data_dir = "") : Harness(TwoReplicaJob(), data_dir) {}

  explicit Harness(const JobConfig& job, const std::string& data_dir = "")
      : job_(job),
        membership_(job_, &clock_),
        store_(OpenStore(data_dir)),
        log_(job_, &membership_, store_.get(),
             [this](const SlotId& slot) {
               absl::MutexLock lock(&mu_);
               auto it = snapshot_steps_.find(slot.replica());
               return it == snapshot_steps_.end() ? int64_t{0} : it->second;
             }),
        service_(&log_, job_.topology().stages()) {
    const int stages = job_.topology().stages();
    for (int index = 0; index < job_.topology().replicas() * stages; ++index) {
      auto trainer = membership_.Register(Request(absl::StrCat("t", index), TRAINER));
      REQUIRE(trainer.ok());
      REQUIRE(trainer->slot().replica() == index / stages);
      REQUIRE(trainer->slot().stage() == index % stages);
      trainers_.push_back(trainer->incarnation());
      credentials_[trainer->incarnation()] = trainer->credential();
    }
    auto spare = membership_.Register(Request("spare", SPARE));
    REQUIRE(spare.ok());
    spare_ = spare->incarnation();
    credentials_[spare_] = spare->credential();

    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    REQUIRE(server_ != nullptr);
    REQUIRE(port > 0);
    stub_ = ParameterServer::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }

  ~Harness() { server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1)); }

  struct AppendResult {
    std::vector<uint64_t> acks;
    grpc::Status status;
  };

  // One AppendLog stream: each batch is written and its ack awaited; then half-close.
  // `before_batch(i)`, if given, runs before batch i is written.
  // The stream carries the worker credential of the first batch's incarnation, or `credential`
  // when given.
  AppendResult Append(const std::vector<AppendLogRequest>& batches,
                      const std::function<void(size_t)>& before_batch = nullptr,
                      std::optional<std::string> credential = std::nullopt) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!credential.has_value() && !batches.empty()) {
      credential = CredentialOf(batches[0].incarnation());
    }
    if (credential.has_value() && !credential->empty()) {
      context.AddMetadata(kWorkerCredentialKey, *credential);
    }
    auto stream = stub_->AppendLog(&context);
    AppendResult result;
    for (size_t i = 0; i < batches.size(); ++i) {
      if (before_batch) before_batch(i);
      if (!stream->Write(batches[i])) break;
      AppendLogAck ack;
      if (!stream->Read(&ack)) break;
      result.acks.push_back(ack.acked_through());
    }
    stream->WritesDone();
    AppendLogAck extra;
    while (stream->Read(&extra)) result.acks.push_back(extra.acked_through());
    result.status = stream->Finish();
    return result;
  }

  struct ReadResult {
    std::vector<LogRecord> records;
    grpc::Status status;
  };

  ReadResult Read(uint64_t incarnation, int replica, int64_t from_step, int64_t to_step) {
    return Read(incarnation, Slot(replica), from_step, to_step);
  }

  ReadResult Read(uint64_t incarnation, const SlotId& slot, int64_t from_step, int64_t to_step) {
    ReadLogRequest request;
    request.set_incarnation(incarnation);
    request.set_task_id(slot.replica() * job_.topology().stages() + slot.stage());
    request.set_from_step(from_step);
    request.set_to_step(to_step);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    context.AddMetadata(kWorkerCredentialKey, CredentialOf(incarnation));
    auto reader = stub_->ReadLog(&context, request);
    ReadResult result;
    LogRecord record;
    while (reader->Read(&record)) result.records.push_back(record);
    result.status = reader->Finish();
    return result;
  }

  // Everything stored for `replica`, read by the spare.
  std::vector<LogRecord> Stored(int replica) { return Stored(Slot(replica)); }

  std::vector<LogRecord> Stored(const SlotId& slot) {
    ReadResult read = Read(spare_, slot, 0, 1000000);
    INFO(read.status.error_message());
    REQUIRE(read.status.ok());
    return read.records;
  }

  void SetSnapshotStep(int replica, int64_t step) {
    absl::MutexLock lock(&mu_);
    snapshot_steps_[replica] = step;
  }

  Membership& membership() { return membership_; }
  StepLogService& log() { return log_; }
  storage::DurableStore& store() { return *store_; }
  uint64_t trainer0() const { return trainers_.at(0); }
  uint64_t trainer1() const { return trainers_.at(1); }
  // The trainer of slot (replica, stage).
  uint64_t trainer(int replica, int stage) const {
    return trainers_.at(replica * job_.topology().stages() + stage);
  }
  uint64_t spare() const { return spare_; }
  // The credential Register gave `incarnation` (empty for one this harness did not register).
  std::string CredentialOf(uint64_t incarnation) const {
    auto it = credentials_.find(incarnation);
    return it == credentials_.end() ? std::string() : it->second;
  }

 private:
  const JobConfig job_;
  FakeClock clock_;
  Membership membership_;
  std::unique_ptr<storage::DurableStore> store_;
  absl::Mutex mu_;
  std::map<int, int64_t> snapshot_steps_ ABSL_GUARDED_BY(mu_);
  StepLogService log_;
  StepLogOnlyService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<ParameterServer::Stub> stub_;
  std::vector<uint64_t> trainers_;  // by slot index
  uint64_t spare_ = 0;
  std::map<uint64_t, std::string> credentials_;  // by incarnation
};

TEST_CASE("appended records are acknowledged after the commit and read back in step order") {
  Harness h;
  uint64_t id = 1;
  // Step 2 is sent before step 1, and each step's per-step record last.
  std::vector<LogRecord> step2 = WholeStep(&id, 0, 2);
  std::vector<LogRecord> step1 = WholeStep(&id, 0, 1);
  std::vector<LogRecord> step3 = WholeStep(&id, 0, 3);
  std::vector<LogRecord> first = step2;
  first.insert(first.end(), step1.begin(), step1.end());
  Harness::AppendResult result = h.Append({Batch(h.trainer0(), first), Batch(h.trainer0(), step3)});
  INFO(result.status.error_message());
  REQUIRE(result.status.ok());
  CHECK(result.acks == std::vector<uint64_t>{10, 15});

  Harness::ReadResult read = h.Read(h.spare(), 0, 0, 3);
  REQUIRE(read.status.ok());
  CHECK(Keys(read.records) == ExpectedKeys({1, 2, 3}));
  const LogRecord& mb2_of_step1 = read.records[3];  // -1, 0, 1, 2
  CHECK(mb2_of_step1.step() == 1);
  CHECK(mb2_of_step1.micro_batch() == 2);
  CHECK(mb2_of_step1.record_id() == 8);
  CHECK(mb2_of_step1.sender_incarnation() == h.trainer0());
  REQUIRE(mb2_of_step1.sample_ids_size() == kSamplesPerMicroBatch);
  CHECK(mb2_of_step1.sample_ids(0) == 10000 + 2 * kSamplesPerMicroBatch);
  CHECK(read.records[0].params_checksum() == 0xC0FFEE01u);

  // (from, to] is honoured, and the other slot's log is separate.
  CHECK(Keys(h.Read(h.spare(), 0, 1, 2).records) == ExpectedKeys({2}));
  CHECK(h.Read(h.spare(), 1, 0, 3).records.empty());
  CHECK(h.log().stats().records_written == 15);
  CHECK(h.log().stats().batches_committed == 2);
}

TEST_CASE("a resent record is acknowledged again but stored once") {
  Harness h;
  uint64_t id = 1;
  const std::vector<LogRecord> step1 = WholeStep(&id, 0, 1);
  REQUIRE(h.Append({Batch(h.trainer0(), step1)}).status.ok());

  // A reconnect resends ids 1..5 (one of them now with other content) together with ids 6..10.
  std::vector<LogRecord> resend = step1;
  resend[0].set_sample_ids(0, 424242);
  const std::vector<LogRecord> step2 = WholeStep(&id, 0, 2);
  resend.insert(resend.end(), step2.begin(), step2.end());
  Harness::AppendResult again = h.Append({Batch(h.trainer0(), resend)});
  REQUIRE(again.status.ok());
  CHECK(again.acks == std::vector<uint64_t>{10});
  // A batch of nothing but duplicates is acknowledged as well.
  Harness::AppendResult only_duplicates = h.Append({Batch(h.trainer0(), step1)});
  REQUIRE(only_duplicates.status.ok());
  CHECK(only_duplicates.acks == std::vector<uint64_t>{10});

  const std::vector<LogRecord> stored = h.Stored(0);
  CHECK(Keys(stored) == ExpectedKeys({1, 2}));
  CHECK(stored[1].sample_ids(0) == 10000);  // the first write of record 1 stands
  CHECK(h.log().stats().duplicates_dropped == 10);
  CHECK(h.log().stats().records_written == 10);
}

TEST_CASE("a fenced incarnation's stream ends with FAILED_PRECONDITION and writes nothing") {
  Harness h;
  uint64_t id = 1;
  SECTION("fenced before the stream") {
    REQUIRE(h.membership().Deregister(h.trainer0()).ok());
    Harness::AppendResult result = h.Append({Batch(h.trainer0(), WholeStep(&id, 0, 1))});
    CHECK(result.status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK_THAT(result.status.error_message(), Contains("is fenced"));
    CHECK(result.acks.empty());
    CHECK(h.Stored(0).empty());
  }
  SECTION("fenced while its stream is open") {
    // One batch goes through, then the worker is fenced, then its next batch is refused.
    Harness::AppendResult result = h.Append(
        {Batch(h.trainer0(), WholeStep(&id, 0, 1)), Batch(h.trainer0(), WholeStep(&id, 0, 2))},
        [&](size_t batch) {
          if (batch == 1) REQUIRE(h.membership().Deregister(h.trainer0()).ok());
        });
    CHECK(result.status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(result.acks == std::vector<uint64_t>{5});
    CHECK(Keys(h.Stored(0)) == ExpectedKeys({1}));
  }
  // The other trainer is unaffected.
  uint64_t other_id = 1;
  CHECK(h.Append({Batch(h.trainer1(), WholeStep(&other_id, 1, 1))}).status.ok());
  CHECK(Keys(h.Stored(1)) == ExpectedKeys({1}));
}

TEST_CASE("a fenced store answers a batch UNAVAILABLE before checking its steps against the books") {
  // A leader whose replication barrier failed (R15): its books may lag what the group
  // acknowledged, so a record past "snapshot step + 2 x sync_period" by those books must send
  // the trainer to the new leader (UNAVAILABLE), not end its log stream for good
  // (INVALID_ARGUMENT, which a deposed leader answered before).
  Harness h;
  uint64_t id = 1;
  const int64_t far_step = 2 * TwoReplicaJob().easgd().sync_period() + 1;  // past the bound
  SECTION("not fenced: the bound refuses the record") {
    Harness::AppendResult result = h.Append({Batch(h.trainer0(), WholeStep(&id, 0, far_step))});
    CHECK(result.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  }
  SECTION("fenced: UNAVAILABLE, nothing written") {
    REQUIRE(h.store()
                .StartCapturing([](ReplicatedCommit) {},
                                [](const storage::DurableStore::Position&) {
                                  return absl::UnavailableError("the leadership was lost");
                                },
                                1)
                .ok());
    storage::WriteBatch batch;
    ServerRecord server;
    server.set_job_id("j");
    batch.PutServer(server);
    REQUIRE(h.store().Commit(batch).code() == absl::StatusCode::kUnavailable);
    Harness::AppendResult result = h.Append({Batch(h.trainer0(), WholeStep(&id, 0, far_step))});
    CHECK(result.status.error_code() == grpc::StatusCode::UNAVAILABLE);
    CHECK_THAT(result.status.error_message(), Contains("fenced"));
    CHECK(result.acks.empty());
    CHECK(h.Stored(0).empty());
  }
}

TEST_CASE(
    "a stream that names another worker's incarnation without its credential is refused with "
    "UNAUTHENTICATED and writes nothing") {
  Harness h;
  uint64_t id = 1;
  SECTION("no credential") {
    Harness::AppendResult result =
        h.Append({Batch(h.trainer0(), WholeStep(&id, 0, 1))}, nullptr, std::string());
    CHECK(result.status.error_code() == grpc::StatusCode::UNAUTHENTICATED);
    CHECK_THAT(result.status.error_message(),
               Contains(absl::StrCat("acts as incarnation ", h.trainer0())));
    CHECK(result.acks.empty());
  }
  SECTION("another live worker's credential") {
    Harness::AppendResult result = h.Append({Batch(h.trainer0(), WholeStep(&id, 0, 1))}, nullptr,
                                            h.CredentialOf(h.trainer1()));
    CHECK(result.status.error_code() == grpc::StatusCode::UNAUTHENTICATED);
    CHECK(result.acks.empty());
  }
  CHECK(h.Stored(0).empty());
  // The victim's own stream still goes through.
  uint64_t own_id = 1;
  CHECK(h.Append({Batch(h.trainer0(), WholeStep(&own_id, 0, 1))}).status.ok());
  CHECK(Keys(h.Stored(0)) == ExpectedKeys({1}));
}

TEST_CASE(
    "a malformed record ends the stream with INVALID_ARGUMENT and none of its batch is "
    "stored") {
  Harness h;
  std::vector<LogRecord> records = {MicroBatch(1, 0, 1, 0), MicroBatch(2, 0, 1, 1)};
  LogRecord& bad = records[1];
  std::string why;
  SECTION("a slot outside the topology") {
    bad.mutable_slot()->set_replica(2);
    why = "slot (2, 0) is outside the 2 x 1 topology";
  }
  SECTION("another trainer's slot") {
    bad.mutable_slot()->set_replica(1);
    why = "does not own slot (1, 0)";
  }
  SECTION("micro_batch M") {
    bad.set_micro_batch(kMicroBatches);
    why = "micro_batch must be in [-1, 4)";
  }
  SECTION("micro_batch -2") {
    bad.set_micro_batch(-2);
    why = "micro_batch must be in [-1, 4)";
  }
  SECTION("too few sample ids") {
    bad.mutable_sample_ids()->RemoveLast();
    why = "needs batch_size / M = 512 sample ids, got 511";
  }
  SECTION("a negative sample id") {
    bad.set_sample_ids(7, -1);
    why = "sample_ids[7] is negative";
  }
  SECTION("step 0") {
    bad.set_step(0);
    why = "step must be >= 1";
  }
  SECTION("a per-step record without its checksum") {
    bad = StepRecord(2, 0, 1);
    bad.clear_params_checksum();
    why = "a per-step record needs params_checksum";
  }
  SECTION("a record_id that does not increase") {
    bad.set_record_id(1);
    why = "record_id must be above the previous one (1)";
  }
  SECTION("another sender's incarnation") {
    bad.set_sender_incarnation(h.trainer1());
    why = "differs from the batch's incarnation";
  }
  SECTION("a boundary payload on a single-stage job") {
    bad.add_boundaries()->set_direction(FORWARD);
    why = "stage 0 receives no FORWARD boundary";
  }
  Harness::AppendResult result = h.Append({Batch(h.trainer0(), records)});
  CHECK(result.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(result.status.error_message(), Contains("record 1 of the batch (record_id "));
  CHECK_THAT(result.status.error_message(), Contains(why));
  CHECK(result.acks.empty());
  CHECK(h.Stored(0).empty());
  CHECK(h.log().stats().batches_rejected == 1);
}

TEST_CASE("an oversized batch is refused whole with INVALID_ARGUMENT") {
  Harness h;
  std::vector<LogRecord> records;
  uint64_t id = 1;
  std::string why;
  SECTION("more than 4096 records") {
    for (int64_t step = 1; records.size() <= 4096; ++step) {
      for (int mb = -1; mb < kMicroBatches; ++mb) {
        LogRecord record = mb < 0 ? StepRecord(id, 0, step) : MicroBatch(id, 0, step, mb);
        if (mb >= 0) record.mutable_sample_ids()->Truncate(0);  // small, to stay under 1 MiB
        ++id;
        records.push_back(record);
      }
    }
    why = "a batch holds at most 4096 records, got ";
  }
  SECTION("more than step_log.buffer_bytes") {
    // ~2 KB per micro-batch record (512 ids of 4 bytes on the wire): 1 MiB is passed within
    // 150 steps.
    for (int64_t step = 1; step <= 150; ++step) {
      for (const LogRecord& record : WholeStep(&id, 0, step)) records.push_back(record);
    }
    why = "over step_log.buffer_bytes = 1048576";
  }
  Harness::AppendResult result = h.Append({Batch(h.trainer0(), records)});
  CHECK(result.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(result.status.error_message(), Contains(why));
  CHECK_THAT(result.status.error_message(), Contains("of the batch (record_id "));
  CHECK(h.Stored(0).empty());
}

TEST_CASE("records at or below the slot's snapshot step are dropped but acknowledged") {
  Harness h;
  h.SetSnapshotStep(0, 5);
  uint64_t id = 1;
  std::vector<LogRecord> records;
  for (int64_t step = 4; step <= 6; ++step) {
    for (const LogRecord& record : WholeStep(&id, 0, step)) records.push_back(record);
  }
  Harness::AppendResult result = h.Append({Batch(h.trainer0(), records)});
  REQUIRE(result.status.ok());
  CHECK(result.acks == std::vector<uint64_t>{15});
  CHECK(Keys(h.Stored(0)) == ExpectedKeys({6}));
  CHECK(h.log().stats().below_snapshot_dropped == 10);

  SECTION("CommitSnapshot raises the floor together with the sync's GC") {
    const absl::Status committed = h.log().CommitSnapshot(Slot(0), 7, [&] {
      storage::WriteBatch batch;
      batch.DeleteLogRange(Slot(0), 0, 8);
      return h.store().Commit(batch);
    });
    REQUIRE(committed.ok());
    std::vector<LogRecord> later = WholeStep(&id, 0, 7);
    for (const LogRecord& record : WholeStep(&id, 0, 8)) later.push_back(record);
    REQUIRE(h.Append({Batch(h.trainer0(), later)}).status.ok());
    CHECK(Keys(h.Stored(0)) == ExpectedKeys({8}));
  }
  SECTION("a failed snapshot commit leaves the floor where it was") {
    const absl::Status failed =
        h.log().CommitSnapshot(Slot(0), 7, [] { return absl::UnavailableError("disk busy"); });
    CHECK(failed.code() == absl::StatusCode::kUnavailable);
    REQUIRE(h.Append({Batch(h.trainer0(), WholeStep(&id, 0, 7))}).status.ok());
    CHECK(Keys(h.Stored(0)) == ExpectedKeys({6, 7}));
  }
}

TEST_CASE("LastCompleteStep is the end of the first run of complete steps") {
  Harness h;
  uint64_t id = 1;
  std::vector<LogRecord> records;
  auto add_step = [&](int64_t step, int skip_micro_batch) {
    for (const LogRecord& record : WholeStep(&id, 0, step)) {
      if (record.micro_batch() != skip_micro_batch) records.push_back(record);
    }
  };
  add_step(1, /*skip=*/-2);
  add_step(2, -2);
  add_step(3, 2);  // micro-batch 2 missing
  add_step(4, -2);
  add_step(5, -1);  // per-step record missing
  add_step(6, -2);
  add_step(8, -2);  // step 7 missing entirely
  REQUIRE(h.Append({Batch(h.trainer0(), records)}).status.ok());

  auto last = [&](int64_t after) {
    absl::StatusOr<int64_t> step = h.log().LastCompleteStep(Slot(0), after);
    REQUIRE(step.ok());
    return *step;
  };
  CHECK(last(0) == 2);
  CHECK(last(1) == 2);
  CHECK(last(2) == 2);  // step 3 is incomplete: nothing after 2
  CHECK(last(3) == 4);
  CHECK(last(5) == 6);
  CHECK(last(7) == 8);
  CHECK(last(8) == 8);
  CHECK(last(100) == 100);
  CHECK(h.log().LastCompleteStep(Slot(1), 0).value() == 0);  // an empty log
  CHECK(h.log().LastCompleteStep(Slot(2), 0).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("ReadLog refuses bad ranges and fenced readers") {
  Harness h;
  CHECK(h.Read(h.spare(), 0, 3, 3).status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(h.Read(h.spare(), 0, -1, 3).status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(h.Read(h.spare(), 2, 0, 3).status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  REQUIRE(h.membership().Deregister(h.spare()).ok());
  CHECK(h.Read(h.spare(), 0, 0, 3).status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
}

// Flips one byte of a stored step-log value, the way a bad disk would.
void DamageLogRecord(const std::string& dir, const std::string& key) {
  rocksdb::DBOptions options;
  std::vector<std::string> names;
  REQUIRE(rocksdb::DB::ListColumnFamilies(options, dir, &names).ok());
  std::vector<rocksdb::ColumnFamilyDescriptor> descriptors;
  for (const std::string& name : names) {
    descriptors.emplace_back(name, rocksdb::ColumnFamilyOptions());
  }
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  REQUIRE(rocksdb::DB::Open(options, dir, descriptors, &handles, &raw).ok());
  std::unique_ptr<rocksdb::DB> db(raw);
  rocksdb::ColumnFamilyHandle* steplog = nullptr;
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == "steplog") steplog = handles[i];
  }
  REQUIRE(steplog != nullptr);
  std::string value;
  REQUIRE(db->Get(rocksdb::ReadOptions(), steplog, key, &value).ok());
  value.back() ^= 0x10;
  REQUIRE(db->Put(rocksdb::WriteOptions(), steplog, key, value).ok());
  for (rocksdb::ColumnFamilyHandle* handle : handles) {
    REQUIRE(db->DestroyColumnFamilyHandle(handle).ok());
  }
  REQUIRE(db->Close().ok());
}

TEST_CASE("ReadLog passes DATA_LOSS through, naming the damaged key") {
  const std::string dir = MakeTempDir();
  {
    Harness h(dir);
    uint64_t id = 1;
    std::vector<LogRecord> records = WholeStep(&id, 0, 1);
    for (const LogRecord& record : WholeStep(&id, 0, 2)) records.push_back(record);
    REQUIRE(h.Append({Batch(h.trainer0(), records)}).status.ok());
  }
  DamageLogRecord(dir, storage::EncodeLogKey(0, 0, 2, 1));
  Harness h(dir);
  Harness::ReadResult read = h.Read(h.spare(), 0, 0, 2);
  CHECK(read.status.error_code() == grpc::StatusCode::DATA_LOSS);
  CHECK_THAT(read.status.error_message(), Contains("steplog key (r=0, s=0, step=2, mb=1)"));
  CHECK(read.records.empty());
  CHECK(h.log().LastCompleteStep(Slot(0), 0).status().code() == absl::StatusCode::kDataLoss);
  // The undamaged range still reads.
  CHECK(Keys(h.Read(h.spare(), 0, 0, 1).records) == ExpectedKeys({1}));
}

// ---------------------------------------------------------------------------------------------
// Pipelines: a 1 x 3 job. Stage s receives FORWARD pairs over boundary s from stage s-1 and
// BACKWARD pairs over boundary s+1 from stage s+1; the sender of each logs it (docs/design.md §5.2).

constexpr int kPipeMicroBatches = 2;
constexpr int kPipeBatchSize = 8;
constexpr int kPipeRows = kPipeBatchSize / kPipeMicroBatches;
// Features of boundary 1 (stage 0 -> 1) and boundary 2 (stage 1 -> 2).
constexpr int64_t kBoundaryWidth[3] = {0, 8, 6};

// `step_log_extra`: more step_log fields, e.g. "logged_boundaries: 1".
JobConfig PipelineJob(const std::string& step_log_extra = "") {
  return testing::ParseJob(absl::StrCat("job_id: \"j\"\n"
                                        "model { layers { width: 8 } layers { width: 6 } "
                                        "layers { width: 4 activation: IDENTITY } }\n"
                                        "topology { replicas: 1 stages: 3 }\n"
                                        "data { batch_size: ",
                                        kPipeBatchSize, " micro_batches: ", kPipeMicroBatches,
                                        " }\n"
                                        "step_log { buffer_bytes: 1048576 ",
                                        step_log_extra, " }\n"));
}

void AddSampleIds(int64_t step, int micro_batch, LogRecord* record) {
  for (int k = 0; k < kPipeRows; ++k) {
    record->add_sample_ids(step * 100 + micro_batch * kPipeRows + k);
  }
}

// Stage `stage`'s own record of (step, micro_batch): its sample ids, no boundary payload.
LogRecord OwnRecord(uint64_t id, int stage, int64_t step, int micro_batch) {
  LogRecord record;
  *record.mutable_slot() = Slot(0, stage);
  record.set_step(step);
  record.set_micro_batch(micro_batch);
  AddSampleIds(step, micro_batch, &record);
  record.set_record_id(id);
  return record;
}

// The per-step checksum record of slot (0, stage).
LogRecord PipeStepRecord(uint64_t id, int stage, int64_t step) {
  LogRecord record;
  *record.mutable_slot() = Slot(0, stage);
  record.set_step(step);
  record.set_micro_batch(-1);
  record.set_params_checksum(0xAB000000u + stage * 1000 + step);
  record.set_record_id(id);
  return record;
}

// The boundary record of slot (0, stage) that its neighbour logs when it sends `direction`'s
// pair of (step, micro_batch): FORWARD (from stage - 1, with R{h}) or BACKWARD (from stage + 1,
// without R{delta}: a step without Hessian).
LogRecord BoundaryRecord(uint64_t id, int stage, int64_t step, int micro_batch,
                         BoundaryDirection direction) {
  LogRecord record = OwnRecord(id, stage, step, micro_batch);
  const int boundary = direction == BACKWARD ? stage + 1 : stage;
  const int64_t width = boundary >= 1 && boundary <= 2 ? kBoundaryWidth[boundary] : 4;
  std::vector<float> value(kPipeRows * width);
  for (size_t i = 0; i < value.size(); ++i) {
    value[i] = static_cast<float>(direction * 100000 + step * 1000 + micro_batch * 100 + i);
  }
  BoundaryPayload* payload = record.add_boundaries();
  payload->set_direction(direction);
  *payload->mutable_value() = MakeFloatTensor(0, "value", {kPipeRows, width}, value);
  if (direction == FORWARD) {
    *payload->mutable_r_value() = MakeFloatTensor(1, "r_value", {kPipeRows, width}, value);
  } else {
    *payload->mutable_r_value() = MakeFloatTensor(1, "r_value", {0, width}, {});
  }
  return record;
}

// (step, micro_batch, part) of each record: part 0 own, 1 FORWARD, 2 BACKWARD.
std::vector<std::tuple<int64_t, int, int>> PartKeys(const std::vector<LogRecord>& records) {
  std::vector<std::tuple<int64_t, int, int>> keys;
  for (const LogRecord& record : records) {
    const int part = record.boundaries_size() == 0 ? 0 : record.boundaries(0).direction();
    keys.emplace_back(record.step(), record.micro_batch(), part);
  }
  return keys;
}

int64_t LastComplete(Harness& h, int stage, int64_t after = 0) {
  absl::StatusOr<int64_t> step = h.log().LastCompleteStep(Slot(0, stage), after);
  INFO(step.status().ToString());
  REQUIRE(step.ok());
  return *step;
}

// One AppendLog stream of one batch from `incarnation`, which must be acknowledged.
void AppendOk(Harness& h, uint64_t incarnation, const std::vector<LogRecord>& records) {
  Harness::AppendResult result = h.Append({Batch(incarnation, records)});
  INFO(result.status.error_message());
  REQUIRE(result.status.ok());
  REQUIRE(result.acks.size() == 1);
  CHECK(result.acks[0] == records.back().record_id());
}

TEST_CASE(
    "pipeline neighbours log the boundary tensors they send; ReadLog returns each "
    "(step, micro-batch)'s own, FORWARD and BACKWARD records in that order") {
  Harness h(PipelineJob());
  const uint64_t t0 = h.trainer(0, 0);
  const uint64_t t1 = h.trainer(0, 1);
  const uint64_t t2 = h.trainer(0, 2);
  // Every sender's batch in an order of its own; the store orders by key.
  AppendOk(h, t2,
           {BoundaryRecord(1, 1, 1, 1, BACKWARD), BoundaryRecord(2, 1, 1, 0, BACKWARD),
            PipeStepRecord(3, 2, 1)});
  AppendOk(h, t1,
           {PipeStepRecord(1, 1, 1), BoundaryRecord(2, 0, 1, 1, BACKWARD),
            BoundaryRecord(3, 2, 1, 1, FORWARD), BoundaryRecord(4, 0, 1, 0, BACKWARD),
            BoundaryRecord(5, 2, 1, 0, FORWARD)});
  AppendOk(h, t0,
           {BoundaryRecord(1, 1, 1, 1, FORWARD), OwnRecord(2, 0, 1, 1), OwnRecord(3, 0, 1, 0),
            BoundaryRecord(4, 1, 1, 0, FORWARD), PipeStepRecord(5, 0, 1)});
  CHECK(h.log().stats().records_written == 13);

  using Key = std::tuple<int64_t, int, int>;
  const std::vector<LogRecord> middle = h.Stored(Slot(0, 1));
  CHECK(PartKeys(middle) ==
        std::vector<Key>{{1, -1, 0}, {1, 0, 1}, {1, 0, 2}, {1, 1, 1}, {1, 1, 2}});
  REQUIRE(middle.size() == 5);
  CHECK(middle[0].sender_incarnation() == t1);
  CHECK(middle[0].params_checksum() == 0xAB000000u + 1000 + 1);
  CHECK(middle[1].sender_incarnation() == t0);
  CHECK(middle[1].record_id() == 4);
  CHECK(middle[2].sender_incarnation() == t2);
  CHECK(middle[2].record_id() == 2);
  CHECK(middle[3].sender_incarnation() == t0);
  CHECK(middle[4].sender_incarnation() == t2);
  // The payload comes back as it was sent.
  CHECK(middle[3].SerializeAsString() == [&] {
    LogRecord sent = BoundaryRecord(1, 1, 1, 1, FORWARD);
    sent.set_sender_incarnation(t0);
    return sent.SerializeAsString();
  }());
  REQUIRE(middle[4].boundaries_size() == 1);
  CHECK(middle[4].boundaries(0).value().shape(1) == kBoundaryWidth[2]);
  CHECK(middle[4].boundaries(0).r_value().shape(0) == 0);
  CHECK(middle[4].sample_ids(0) == 100 + kPipeRows);

  CHECK(PartKeys(h.Stored(Slot(0, 0))) ==
        std::vector<Key>{{1, -1, 0}, {1, 0, 0}, {1, 0, 2}, {1, 1, 0}, {1, 1, 2}});
  CHECK(PartKeys(h.Stored(Slot(0, 2))) == std::vector<Key>{{1, -1, 0}, {1, 0, 1}, {1, 1, 1}});
  for (int stage = 0; stage < 3; ++stage) CHECK(LastComplete(h, stage) == 1);
}

TEST_CASE(
    "a boundary record from anyone but the sending neighbour is refused with "
    "INVALID_ARGUMENT and none of its batch is stored") {
  Harness h(PipelineJob());
  uint64_t sender = 0;
  int own_stage = 0;
  LogRecord bad;
  std::string why;
  SECTION("stage 0 logging a FORWARD pair for stage 2, which it does not send to") {
    sender = h.trainer(0, 0);
    own_stage = 0;
    bad = BoundaryRecord(2, 2, 1, 0, FORWARD);
    why = "does not own slot (0, 1)";
  }
  SECTION("stage 0 logging a BACKWARD pair for stage 1: that comes from stage 2") {
    sender = h.trainer(0, 0);
    own_stage = 0;
    bad = BoundaryRecord(2, 1, 1, 0, BACKWARD);
    why = "does not own slot (0, 2)";
  }
  SECTION("stage 2 logging a FORWARD pair for stage 1: that comes from stage 0") {
    sender = h.trainer(0, 2);
    own_stage = 2;
    bad = BoundaryRecord(2, 1, 1, 1, FORWARD);
    why = "does not own slot (0, 0)";
  }
  SECTION("stage 1 logging a boundary payload in its own record") {
    sender = h.trainer(0, 1);
    own_stage = 1;
    bad = BoundaryRecord(2, 1, 1, 0, FORWARD);
    why = "does not own slot (0, 0)";
  }
  SECTION("stage 1 logging a FORWARD pair for stage 0") {
    sender = h.trainer(0, 1);
    own_stage = 1;
    bad = BoundaryRecord(2, 0, 1, 0, FORWARD);
    why = "stage 0 receives no FORWARD boundary";
  }
  SECTION("stage 1 logging a BACKWARD pair for the last stage") {
    sender = h.trainer(0, 1);
    own_stage = 1;
    bad = BoundaryRecord(2, 2, 1, 0, BACKWARD);
    why = "the last stage receives no BACKWARD boundary";
  }
  SECTION("two payloads in one record") {
    sender = h.trainer(0, 0);
    own_stage = 0;
    bad = BoundaryRecord(2, 1, 1, 0, FORWARD);
    *bad.add_boundaries() = bad.boundaries(0);
    why = "at most one boundary payload";
  }
  SECTION("a payload without direction") {
    sender = h.trainer(0, 0);
    own_stage = 0;
    bad = BoundaryRecord(2, 1, 1, 0, FORWARD);
    bad.mutable_boundaries(0)->clear_direction();
    why = "direction must be FORWARD or BACKWARD";
  }
  SECTION("a payload value that is not a valid FLOAT32 tensor") {
    sender = h.trainer(0, 0);
    own_stage = 0;
    bad = BoundaryRecord(2, 1, 1, 0, FORWARD);
    bad.mutable_boundaries(0)->mutable_value()->mutable_data()->pop_back();
    why = "boundaries[0].value";
  }
  const std::vector<LogRecord> records = {PipeStepRecord(1, own_stage, 1), bad};
  Harness::AppendResult result = h.Append({Batch(sender, records)});
  CHECK(result.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(result.status.error_message(),
             Contains(absl::StrCat("record 1 of the batch (record_id 2, slot ",
                                   SlotName(bad.slot()), ", step 1")));
  CHECK_THAT(result.status.error_message(), Contains(why));
  CHECK(result.acks.empty());
  for (int stage = 0; stage < 3; ++stage) CHECK(h.Stored(Slot(0, stage)).empty());
  CHECK(h.log().stats().batches_rejected == 1);
  CHECK(h.log().stats().records_written == 0);
}

TEST_CASE(
    "a boundary outside step_log.logged_boundaries is not logged: its records are "
    "INVALID_ARGUMENT") {
  SECTION("logged_boundaries: [1], BACKWARD over boundary 2") {
    Harness h(PipelineJob("logged_boundaries: 1"));
    Harness::AppendResult result = h.Append(
        {Batch(h.trainer(0, 2), {PipeStepRecord(1, 2, 1), BoundaryRecord(2, 1, 1, 0, BACKWARD)})});
    CHECK(result.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(result.status.error_message(),
               Contains("boundary 2 is not in step_log.logged_boundaries"));
    CHECK(h.Stored(Slot(0, 1)).empty());
    CHECK(h.Stored(Slot(0, 2)).empty());
  }
  SECTION("logged_boundaries: [1], FORWARD over boundary 2") {
    Harness h(PipelineJob("logged_boundaries: 1"));
    Harness::AppendResult result =
        h.Append({Batch(h.trainer(0, 1), {BoundaryRecord(1, 0, 1, 0, BACKWARD),
                                          BoundaryRecord(2, 2, 1, 0, FORWARD)})});
    CHECK(result.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(result.status.error_message(), Contains("record 1 of the batch"));
    CHECK_THAT(result.status.error_message(),
               Contains("boundary 2 is not in step_log.logged_boundaries"));
    CHECK(h.Stored(Slot(0, 0)).empty());
    CHECK(h.Stored(Slot(0, 2)).empty());
  }
  SECTION("logged_boundaries: [2], FORWARD over boundary 1") {
    Harness h(PipelineJob("logged_boundaries: 2"));
    Harness::AppendResult result =
        h.Append({Batch(h.trainer(0, 0), {BoundaryRecord(1, 1, 1, 0, FORWARD)})});
    CHECK(result.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(result.status.error_message(),
               Contains("boundary 1 is not in step_log.logged_boundaries"));
    // Boundary 2 is logged.
    AppendOk(h, h.trainer(0, 1), {BoundaryRecord(1, 2, 1, 0, FORWARD)});
    CHECK(h.Stored(Slot(0, 1)).empty());
    CHECK(h.Stored(Slot(0, 2)).size() == 1);
  }
  SECTION("log_no_boundaries: stage 0 still logs its sample ids") {
    Harness h(PipelineJob("log_no_boundaries: true"));
    Harness::AppendResult result =
        h.Append({Batch(h.trainer(0, 1), {BoundaryRecord(1, 0, 1, 0, BACKWARD)})});
    CHECK(result.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(result.status.error_message(),
               Contains("boundary 1 is not in step_log.logged_boundaries"));
    AppendOk(h, h.trainer(0, 0),
             {OwnRecord(1, 0, 1, 0), OwnRecord(2, 0, 1, 1), PipeStepRecord(3, 0, 1)});
    AppendOk(h, h.trainer(0, 1), {PipeStepRecord(1, 1, 1)});
    // Nothing but checksums and stage 0's sample ids makes a complete step.
    CHECK(LastComplete(h, 0) == 1);
    CHECK(LastComplete(h, 1) == 1);
    CHECK(LastComplete(h, 2) == 0);
  }
}

TEST_CASE("a pipeline slot's step is complete only once every part of it is logged") {
  Harness h(PipelineJob());
  const uint64_t t0 = h.trainer(0, 0);
  const uint64_t t1 = h.trainer(0, 1);
  const uint64_t t2 = h.trainer(0, 2);
  uint64_t id0 = 1, id1 = 1, id2 = 1;

  // Each stage's own checksum of step 1; stage 0 its sample ids as well.
  AppendOk(h, t0,
           {OwnRecord(id0++, 0, 1, 0), OwnRecord(id0++, 0, 1, 1), PipeStepRecord(id0++, 0, 1)});
  AppendOk(h, t1, {PipeStepRecord(id1++, 1, 1)});
  AppendOk(h, t2, {PipeStepRecord(id2++, 2, 1)});
  for (int stage = 0; stage < 3; ++stage) CHECK(LastComplete(h, stage) == 0);

  // The middle stage: both FORWARD records are not enough, nor is one BACKWARD record.
  AppendOk(h, t0,
           {BoundaryRecord(id0++, 1, 1, 0, FORWARD), BoundaryRecord(id0++, 1, 1, 1, FORWARD)});
  CHECK(LastComplete(h, 1) == 0);
  AppendOk(h, t2, {BoundaryRecord(id2++, 1, 1, 1, BACKWARD)});
  CHECK(LastComplete(h, 1) == 0);
  AppendOk(h, t2, {BoundaryRecord(id2++, 1, 1, 0, BACKWARD)});
  CHECK(LastComplete(h, 1) == 1);

  // Stage 0 needs stage 1's BACKWARD records, stage 2 its FORWARD records.
  CHECK(LastComplete(h, 0) == 0);
  CHECK(LastComplete(h, 2) == 0);
  AppendOk(h, t1,
           {BoundaryRecord(id1++, 0, 1, 0, BACKWARD), BoundaryRecord(id1++, 2, 1, 0, FORWARD)});
  CHECK(LastComplete(h, 0) == 0);
  CHECK(LastComplete(h, 2) == 0);
  AppendOk(h, t1,
           {BoundaryRecord(id1++, 0, 1, 1, BACKWARD), BoundaryRecord(id1++, 2, 1, 1, FORWARD)});
  CHECK(LastComplete(h, 0) == 1);
  CHECK(LastComplete(h, 2) == 1);

  // Step 2 of the middle stage: every boundary record but no checksum yet.
  AppendOk(h, t0,
           {BoundaryRecord(id0++, 1, 2, 0, FORWARD), BoundaryRecord(id0++, 1, 2, 1, FORWARD)});
  AppendOk(h, t2,
           {BoundaryRecord(id2++, 1, 2, 0, BACKWARD), BoundaryRecord(id2++, 1, 2, 1, BACKWARD)});
  CHECK(LastComplete(h, 1) == 1);
  AppendOk(h, t1, {PipeStepRecord(id1++, 1, 2)});
  CHECK(LastComplete(h, 1) == 2);
  CHECK(LastComplete(h, 1, /*after=*/1) == 2);
  CHECK(LastComplete(h, 1, /*after=*/2) == 2);
  // Stage 0's own sample ids of step 2 stand in for nothing else: it still lacks BACKWARD.
  AppendOk(h, t0,
           {OwnRecord(id0++, 0, 2, 0), OwnRecord(id0++, 0, 2, 1), PipeStepRecord(id0++, 0, 2)});
  CHECK(LastComplete(h, 0) == 1);
  CHECK(h.log().LoggedStep(Slot(0, 1)) == 2);
  CHECK(h.log().LoggedStep(Slot(0, 2)) == 1);
}

TEST_CASE("with logged_boundaries [1] the middle stage needs only its FORWARD records") {
  Harness h(PipelineJob("logged_boundaries: 1"));
  const uint64_t t0 = h.trainer(0, 0);
  const uint64_t t1 = h.trainer(0, 1);
  const uint64_t t2 = h.trainer(0, 2);

  AppendOk(h, t1, {PipeStepRecord(1, 1, 1)});
  CHECK(LastComplete(h, 1) == 0);
  AppendOk(h, t0, {BoundaryRecord(1, 1, 1, 0, FORWARD)});
  CHECK(LastComplete(h, 1) == 0);
  AppendOk(h, t0, {BoundaryRecord(2, 1, 1, 1, FORWARD)});
  CHECK(LastComplete(h, 1) == 1);

  // Stage 2 receives over boundary 2 only, which is not logged: its checksum is its step.
  CHECK(LastComplete(h, 2) == 0);
  AppendOk(h, t2, {PipeStepRecord(1, 2, 1)});
  CHECK(LastComplete(h, 2) == 1);

  // Stage 0 still needs stage 1's BACKWARD records over boundary 1.
  AppendOk(h, t0, {OwnRecord(3, 0, 1, 0), OwnRecord(4, 0, 1, 1), PipeStepRecord(5, 0, 1)});
  CHECK(LastComplete(h, 0) == 0);
  AppendOk(h, t1, {BoundaryRecord(2, 0, 1, 0, BACKWARD), BoundaryRecord(3, 0, 1, 1, BACKWARD)});
  CHECK(LastComplete(h, 0) == 1);
}

TEST_CASE("a fenced neighbour's boundary records are refused with FAILED_PRECONDITION") {
  Harness h(PipelineJob());
  const uint64_t t0 = h.trainer(0, 0);
  SECTION("fenced before its stream") {
    REQUIRE(h.membership().Deregister(t0).ok());
    Harness::AppendResult result = h.Append({Batch(t0, {BoundaryRecord(1, 1, 1, 0, FORWARD)})});
    CHECK(result.status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK_THAT(result.status.error_message(), Contains("is fenced"));
    CHECK(result.acks.empty());
    CHECK(h.Stored(Slot(0, 1)).empty());
  }
  SECTION("fenced while its stream is open") {
    Harness::AppendResult result = h.Append({Batch(t0, {BoundaryRecord(1, 1, 1, 0, FORWARD)}),
                                             Batch(t0, {BoundaryRecord(2, 1, 1, 1, FORWARD)})},
                                            [&](size_t batch) {
                                              if (batch == 1)
                                                REQUIRE(h.membership().Deregister(t0).ok());
                                            });
    CHECK(result.status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(result.acks == std::vector<uint64_t>{1});
    using Key = std::tuple<int64_t, int, int>;
    CHECK(PartKeys(h.Stored(Slot(0, 1))) == std::vector<Key>{{1, 0, 1}});
  }
  // The other neighbour still logs for the middle stage.
  AppendOk(h, h.trainer(0, 2), {BoundaryRecord(1, 1, 1, 0, BACKWARD)});
  CHECK(PartKeys(h.Stored(Slot(0, 1))).back() == std::make_tuple(int64_t{1}, 0, 2));
}

}  // namespace
}  // namespace rebound::server
