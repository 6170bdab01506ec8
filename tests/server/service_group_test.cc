// Recovery groups of a pipelined job (docs/design.md §5.2-§5.3, docs/protocol.md "Pipeline stages"),
// against a real in-process ParameterServerService: an in-memory DurableStore, a Membership on a
// fake clock, a CenterTable and a ReliabilityTracker, wired as server/main.cc wires them, with
// the handlers called directly (as fuzz/service_fuzzer.cc does; no network).
//
// The job: a 4 -> 3 -> 3 -> 2 MLP split into two stages (layer 0 | layers 1, 2), one replica,
// M = 2 micro-batches of 2 samples, a sync every 2 steps. Under `step_log { log_no_boundaries:
// true }` boundary 1 is not logged, so stages 0 and 1 form ONE recovery group [0, 2): a lost
// stage is replayed with its whole group from every member's snapshot at the group's oldest
// sync step, and a member's sync GCs its log only down to that step. Under the default step log
// every boundary is logged and each stage is a group of its own.
//
// The lost trainer leaves by Deregister (its slot is LOST at once); the replay then waits for
// its live neighbour's FLUSH_LOG, which the tests carry out by a heartbeat reporting
// flushes_done = the flush_sequence the server sent (the clock never moves).

#include <catch2/catch.hpp>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/config.h"
#include "common/slot.h"
#include "common/tensor_codec.h"
#include "compute/adahessian.h"
#include "compute/model_layout.h"
#include "compute/tensor_bundle.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/sync_stream.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "server/center_table.h"
#include "server/membership.h"
#include "server/reliability.h"
#include "server/service.h"
#include "server/step_log.h"
#include "storage/durable_store.h"
#include "tests/server/server_testing.h"

namespace rebound::server {
namespace {

using Catch::Matchers::Contains;
using testing::Slot;

constexpr int kMicroBatches = 2;
constexpr int kSamplesPerMicroBatch = 2;  // batch_size 4 / M
constexpr int64_t kLastStep = std::numeric_limits<int64_t>::max();

// Every boundary logged (the default) or none (one group of both stages).
constexpr char kAllBoundaries[] = "";
constexpr char kNoBoundaries[] = "log_no_boundaries: true";

JobConfig PipelineJob(const std::string& step_log) {
  auto job = ParseJobConfig(absl::StrCat(R"(
      job_id: "groups"
      model {
        input_dim: 4
        layers { width: 3 activation: RELU }
        layers { width: 3 activation: TANH }
        layers { width: 2 activation: IDENTITY }
      }
      topology { replicas: 1 stages: 2 }
      data { batch_size: 4 micro_batches: 2 }
      easgd { sync_period: 2 }
      fault_tolerance { policy: REPLAY heartbeat_interval_ms: 100 failure_timeout_ms: 1000 }
      training { max_steps: 16 }
      step_log { )",
                                         step_log, " }\n"),
                            "job.pbtxt");
  if (!job.ok()) FAIL(job.status().ToString());
  return *job;
}

// The sample ids stage 0 logs for (step, micro-batch): step * 100 + mb * 2 + {0, 1}.
std::vector<int64_t> SampleIds(int64_t step, int micro_batch) {
  std::vector<int64_t> ids;
  for (int k = 0; k < kSamplesPerMicroBatch; ++k) {
    ids.push_back(step * 100 + micro_batch * kSamplesPerMicroBatch + k);
  }
  return ids;
}

// The checksum stage `stage` logs after `step`.
uint64_t Checksum(int stage, int64_t step) { return 0xC0FFEE0000ull + stage * 1000 + step; }

LogRecord StepRecord(int stage, int64_t step) {
  LogRecord record;
  *record.mutable_slot() = Slot(0, stage);
  record.set_step(step);
  record.set_micro_batch(-1);
  record.set_params_checksum(Checksum(stage, step));
  return record;
}

// Stage 0's own record of a micro-batch: its sample ids.
LogRecord SampleRecord(int64_t step, int micro_batch) {
  LogRecord record;
  *record.mutable_slot() = Slot(0, 0);
  record.set_step(step);
  record.set_micro_batch(micro_batch);
  for (int64_t id : SampleIds(step, micro_batch)) record.add_sample_ids(id);
  return record;
}

// A boundary pair (B/M x width 3) its sender logs for the receiving stage: FORWARD from stage 0
// for stage 1, BACKWARD from stage 1 for stage 0.
LogRecord PairRecord(BoundaryDirection direction, int64_t step, int micro_batch) {
  LogRecord record = SampleRecord(step, micro_batch);
  record.mutable_slot()->set_stage(direction == FORWARD ? 1 : 0);
  BoundaryPayload* pair = record.add_boundaries();
  pair->set_direction(direction);
  const std::vector<float> value(kSamplesPerMicroBatch * 3, 0.25f * static_cast<float>(step));
  *pair->mutable_value() = MakeFloatTensor(0, "h", {kSamplesPerMicroBatch, 3}, value);
  *pair->mutable_r_value() = MakeFloatTensor(0, "r_h", {kSamplesPerMicroBatch, 3}, value);
  return record;
}

// What a trainer of stage `stage` logs for `step`: stage 0 its sample ids (and, with `pairs`, the
// FORWARD pairs it sends to stage 1), stage 1 (with `pairs`) the BACKWARD pairs it sends to
// stage 0; then its checksum.
std::vector<LogRecord> StepLog(int stage, int64_t step, bool pairs = false) {
  std::vector<LogRecord> records;
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    if (stage == 0) records.push_back(SampleRecord(step, mb));
    if (pairs) records.push_back(PairRecord(stage == 0 ? FORWARD : BACKWARD, step, mb));
  }
  records.push_back(StepRecord(stage, step));
  return records;
}

// "step/micro_batch" of each record, with "/F" or "/B" for a FORWARD or BACKWARD pair (the
// store's key part), e.g. "3/-1" for step 3's checksum, "3/0/F" for a forward pair.
std::vector<std::string> Keys(const std::vector<LogRecord>& records) {
  std::vector<std::string> keys;
  for (const LogRecord& r : records) {
    std::string key = absl::StrCat(r.step(), "/", r.micro_batch());
    if (r.boundaries_size() > 0) key += r.boundaries(0).direction() == FORWARD ? "/F" : "/B";
    keys.push_back(std::move(key));
  }
  return keys;
}

// An AppendLog stream in process: hands the server its batches, collects the acks.
class BatchStream final : public grpc::ServerReaderWriterInterface<AppendLogAck, AppendLogRequest> {
 public:
  explicit BatchStream(std::vector<AppendLogRequest> batches) : batches_(std::move(batches)) {}

  void SendInitialMetadata() override {}
  bool Write(const AppendLogAck& ack, grpc::WriteOptions) override {
    acks_.push_back(ack.acked_through());
    return true;
  }
  bool NextMessageSize(uint32_t* size) override {
    if (next_ >= batches_.size()) return false;
    *size = static_cast<uint32_t>(batches_[next_].ByteSizeLong());
    return true;
  }
  bool Read(AppendLogRequest* batch) override {
    if (next_ >= batches_.size()) return false;
    *batch = batches_[next_++];
    return true;
  }
  const std::vector<uint64_t>& acks() const { return acks_; }

 private:
  const std::vector<AppendLogRequest> batches_;
  size_t next_ = 0;
  std::vector<uint64_t> acks_;
};

// A ReadLog stream in process: keeps what the server writes.
class RecordSink final : public grpc::ServerWriterInterface<LogRecord> {
 public:
  void SendInitialMetadata() override {}
  bool Write(const LogRecord& record, grpc::WriteOptions) override {
    records_.push_back(record);
    return true;
  }
  const std::vector<LogRecord>& records() const { return records_; }

 private:
  std::vector<LogRecord> records_;
};

// The objects server/main.cc makes, in memory, and the calls of the job's workers.
class GroupServer {
 public:
  explicit GroupServer(const std::string& step_log) : job_(PipelineJob(step_log)) {
    config_.set_listen_address("127.0.0.1:0");
    config_.set_max_wait_ms(0);  // no handler waits: there is no other thread to wait for
    *config_.mutable_job() = job_;
    store_ = testing::OpenInMemoryStore(job_);
    auto centers = CenterTable::Create(job_);
    REQUIRE(centers.ok());
    centers_ = *std::move(centers);
    tracker_ = std::make_unique<ReliabilityTracker>(job_.weighting(), job_.topology().replicas());
    membership_ =
        std::make_unique<Membership>(job_, &clock_, testing::StorePersist(store_.get()));
    service_ = std::make_unique<ParameterServerService>(config_, membership_.get(), centers_.get(),
                                                        tracker_.get(), store_.get(), &clock_);
    service_->MarkReady();
    const std::vector<int> starts = StageLayerStarts(job_);
    for (int s = 0; s < job_.topology().stages(); ++s) {
      auto layout = compute::StageLayout::Create(job_.model(), starts[s], starts[s + 1]);
      REQUIRE(layout.ok());
      layouts_.push_back(*std::move(layout));
    }
  }

  const JobConfig& job() const { return job_; }
  Membership& membership() { return *membership_; }
  storage::DurableStore& store() { return *store_; }
  const compute::StageLayout& layout(int stage) const { return layouts_[stage]; }

  // Registers a worker in `role`; a trainer gets the first free slot.
  RegisterResponse Register(const std::string& name, WorkerRole role) {
    RegisterRequest request;
    request.set_job_id("groups");
    request.set_worker_name(name);
    request.set_requested_role(role);
    request.set_peer_address(absl::StrCat(name, ":1"));
    RegisterResponse response;
    REQUIRE(service_->Register(&context_, &request, &response).ok());
    return response;
  }

  // The parameters a trainer of `stage` holds at `step` (packed): distinct per stage and step.
  std::vector<float> Params(int stage, int64_t step) const {
    std::vector<float> x(layouts_[stage].packed_size());
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = 0.05f * static_cast<float>(i % 7) - 0.1f + 0.01f * static_cast<float>(step) +
             0.5f * static_cast<float>(stage);
    }
    return x;
  }

  // The Sync of worker/training.cc sync_at: params and the whole optimizer state of the stage.
  SyncRequest SyncOf(uint64_t incarnation, int stage, int64_t step) const {
    const compute::StageLayout& layout = layouts_[stage];
    const size_t n = layout.packed_size();
    std::vector<float> m(n), v(n), d(n);
    for (size_t i = 0; i < n; ++i) {
      m[i] = 0.001f * static_cast<float>(i) + static_cast<float>(step);
      v[i] = 0.002f * static_cast<float>(i + 1);
      d[i] = 0.003f * static_cast<float>(i + 1) + static_cast<float>(stage);
    }
    SyncRequest request;
    request.set_incarnation(incarnation);
    *request.mutable_slot() = Slot(0, stage);
    request.set_step(step);
    *request.mutable_params() = compute::BundleFromPacked(layout, Params(stage, step));
    request.mutable_optimizer()->set_step(step);
    *request.mutable_optimizer()->mutable_m() = compute::BundleFromPacked(layout, m);
    *request.mutable_optimizer()->mutable_v() = compute::BundleFromPacked(layout, v);
    *request.mutable_optimizer()->mutable_last_hdiag() = compute::BundleFromPacked(layout, d);
    request.set_data_epoch(0);
    request.set_data_offset(step * 4);
    return request;
  }

  SyncResponse Sync(uint64_t incarnation, int stage, int64_t step) {
    const SyncRequest request = SyncOf(incarnation, stage, step);
    SyncResponse response;
    const grpc::Status status = service_->Sync(nullptr, &request, &response);
    INFO(status.error_message());
    REQUIRE(status.ok());
    return response;
  }

  // One AppendLog stream of one batch; record ids continue the sender's sequence.
  grpc::Status TryAppend(uint64_t incarnation, std::vector<LogRecord> records) {
    AppendLogRequest batch;
    batch.set_incarnation(incarnation);
    for (LogRecord& record : records) {
      record.set_record_id(++next_record_id_[incarnation]);
      *batch.add_records() = std::move(record);
    }
    BatchStream stream({batch});
    return service_->ServeAppendLog(nullptr, &stream);
  }
  void Append(uint64_t incarnation, std::vector<LogRecord> records) {
    const grpc::Status status = TryAppend(incarnation, std::move(records));
    INFO(status.error_message());
    REQUIRE(status.ok());
  }

  HeartbeatResponse Heartbeat(uint64_t incarnation, int64_t step, int64_t flushes_done = 0) {
    HeartbeatRequest request;
    request.set_incarnation(incarnation);
    request.set_step(step);
    if (flushes_done > 0) request.set_flushes_done(flushes_done);
    HeartbeatResponse response;
    REQUIRE(service_->Heartbeat(nullptr, &request, &response).ok());
    return response;
  }

  void Deregister(uint64_t incarnation) {
    DeregisterRequest request;
    request.set_incarnation(incarnation);
    DeregisterResponse response;
    REQUIRE(service_->Deregister(nullptr, &request, &response).ok());
  }

  WaitForTaskResponse WaitForTask(uint64_t spare) {
    WaitForTaskRequest request;
    request.set_incarnation(spare);
    request.set_wait_ms(0);
    WaitForTaskResponse response;
    const grpc::Status status = service_->WaitForTask(nullptr, &request, &response);
    INFO(status.error_message());
    REQUIRE(status.ok());
    return response;
  }

  // ReadLog (from, to] of task `task_id` held by `spare`, of the task's slot or `slot`.
  grpc::Status ReadLog(uint64_t spare, uint64_t task_id, int64_t from, int64_t to,
                       const SlotId* slot, std::vector<LogRecord>* records) {
    ReadLogRequest request;
    request.set_incarnation(spare);
    request.set_task_id(task_id);
    request.set_from_step(from);
    request.set_to_step(to);
    if (slot != nullptr) *request.mutable_slot() = *slot;
    RecordSink sink;
    const grpc::Status status = service_->ServeReadLog(nullptr, &request, &sink);
    *records = sink.records();
    return status;
  }

  // The step-log records the store holds for `slot` (after from_step).
  std::vector<LogRecord> Stored(const SlotId& slot, int64_t from_step = 0) const {
    auto records = store_->ReadLog(slot, from_step, kLastStep);
    REQUIRE(records.ok());
    return *records;
  }

  Snapshot StoredSnapshot(const SlotId& slot) const {
    auto snapshot = store_->ReadSnapshot(slot);
    INFO(snapshot.status().ToString());
    REQUIRE(snapshot.ok());
    return *snapshot;
  }

 private:
  const JobConfig job_;
  ServerConfig config_;
  FakeClock clock_;
  // Register's context (it logs the peer on a refusal). Every other call is in process (a null
  // context: trusted, no worker credential checked, as for fuzz/service_fuzzer.cc).
  grpc::ServerContext context_;
  std::unique_ptr<storage::DurableStore> store_;
  std::unique_ptr<CenterTable> centers_;
  std::unique_ptr<ReliabilityTracker> tracker_;
  std::unique_ptr<Membership> membership_;
  std::unique_ptr<ParameterServerService> service_;
  std::vector<compute::StageLayout> layouts_;
  std::map<uint64_t, uint64_t> next_record_id_;
};

// The job's workers: the trainers of (0, 0) and (0, 1) and a spare.
struct Workers {
  uint64_t stage0 = 0;
  uint64_t stage1 = 0;
  uint64_t spare = 0;
};

Workers RegisterWorkers(GroupServer& server) {
  Workers workers;
  const RegisterResponse first = server.Register("trainer-0", TRAINER);
  const RegisterResponse second = server.Register("trainer-1", TRAINER);
  const RegisterResponse spare = server.Register("spare", SPARE);
  REQUIRE(first.role() == TRAINER);
  REQUIRE(first.slot().stage() == 0);
  REQUIRE(second.role() == TRAINER);
  REQUIRE(second.slot().stage() == 1);
  REQUIRE(spare.role() == SPARE);
  workers.stage0 = first.incarnation();
  workers.stage1 = second.incarnation();
  workers.spare = spare.incarnation();
  return workers;
}

// The post-sync state the worker computes from the reply (worker/training.cc sync_at), which
// the server must have stored as the snapshot: x - alpha (x - c_before).
std::vector<float> PostSyncParams(const GroupServer& server, int stage, int64_t step,
                                  const SyncResponse& reply) {
  const compute::StageLayout& layout = server.layout(stage);
  REQUIRE(compute::ValidateBundle(layout, reply.center_before(), "center_before").ok());
  std::vector<float> x = server.Params(stage, step);
  REQUIRE(compute::ElasticPullWorker(reply.moving_rate(),
                                     compute::PackedFromBundle(layout, reply.center_before()),
                                     absl::MakeSpan(x))
              .ok());
  return x;
}

// The history every scenario shares, up to the loss of (0, 1):
//   steps 1-2 logged by both trainers; (0, 1) syncs step 2, then (0, 0) does;
//   steps 3-4 logged by (0, 0), step 3 only by (0, 1) (it dies during step 4);
//   (0, 0) syncs step 4; (0, 1)'s trainer leaves (Deregister).
// With `pairs` the trainers also log the boundary pairs they send (every boundary logged).
struct History {
  Workers workers;
  Snapshot stage0_at_2;  // (0, 0)'s snapshot as stored by its step-2 sync
  Snapshot stage1_at_2;
  std::vector<float> stage0_post_sync_2;  // the worker's post-sync state of that sync
};

History RunUntilStage1IsLost(GroupServer& server, bool pairs) {
  History history;
  Workers& w = history.workers;
  w = RegisterWorkers(server);
  for (int64_t step = 1; step <= 2; ++step) {
    server.Append(w.stage0, StepLog(0, step, pairs));
    server.Append(w.stage1, StepLog(1, step, pairs));
  }
  server.Sync(w.stage1, 1, 2);
  const SyncResponse stage0_sync = server.Sync(w.stage0, 0, 2);
  history.stage0_post_sync_2 = PostSyncParams(server, 0, 2, stage0_sync);
  history.stage0_at_2 = server.StoredSnapshot(Slot(0, 0));
  history.stage1_at_2 = server.StoredSnapshot(Slot(0, 1));
  for (int64_t step = 3; step <= 4; ++step) server.Append(w.stage0, StepLog(0, step, pairs));
  server.Append(w.stage1, StepLog(1, 3, pairs));
  if (pairs) {
    // It sent step 4's backward pairs (so (0, 0) could finish step 4) before it died.
    server.Append(w.stage1, {PairRecord(BACKWARD, 4, 0), PairRecord(BACKWARD, 4, 1)});
  }
  server.Sync(w.stage0, 0, 4);
  REQUIRE(server.StoredSnapshot(Slot(0, 0)).step() == 4);
  server.Deregister(w.stage1);
  return history;
}

// (0, 0)'s trainer carries out the FLUSH_LOG the loss of (0, 1) asked of it. Returns the
// flush_sequence.
int64_t FlushNeighbour(GroupServer& server, uint64_t stage0) {
  const HeartbeatResponse asked = server.Heartbeat(stage0, 4);
  REQUIRE(asked.commands_size() == 1);
  REQUIRE(asked.commands(0) == FLUSH_LOG);
  REQUIRE(asked.flush_sequence() > 0);
  const HeartbeatResponse done = server.Heartbeat(stage0, 4, asked.flush_sequence());
  CHECK(done.commands_size() == 0);
  return asked.flush_sequence();
}

TEST_CASE("the stages between unlogged boundaries form one recovery group") {
  const JobConfig grouped = PipelineJob(kNoBoundaries);
  CHECK(RecoveryGroup(grouped, 0) == std::make_pair(0, 2));
  CHECK(RecoveryGroup(grouped, 1) == std::make_pair(0, 2));
  const JobConfig logged = PipelineJob(kAllBoundaries);
  CHECK(RecoveryGroup(logged, 0) == std::make_pair(0, 1));
  CHECK(RecoveryGroup(logged, 1) == std::make_pair(1, 2));
}

TEST_CASE(
    "a lost stage of a group is replayed from every member's snapshot at the group's oldest "
    "sync, the one its live neighbour's later sync replaced included") {
  GroupServer server(kNoBoundaries);
  const History history = RunUntilStage1IsLost(server, /*pairs=*/false);
  const Workers& w = history.workers;

  // The server stored the worker's own post-sync state, x - alpha (x - c_before), at step 2.
  REQUIRE(history.stage0_at_2.step() == 2);
  CHECK(compute::PackedFromBundle(server.layout(0), history.stage0_at_2.params()) ==
        history.stage0_post_sync_2);
  CHECK(history.stage0_at_2.optimizer().step() == 2);
  CHECK(history.stage0_at_2.data_offset() == 8);
  REQUIRE(history.stage1_at_2.step() == 2);

  // No task before the live neighbour has flushed its step log (FLUSH_LOG gating).
  CHECK_FALSE(server.WaitForTask(w.spare).has_task());
  FlushNeighbour(server, w.stage0);
  const WaitForTaskResponse response = server.WaitForTask(w.spare);
  REQUIRE(response.has_task());
  const RecoveryTask& task = response.task();

  CHECK(task.slot().replica() == 0);
  CHECK(task.slot().stage() == 1);
  CHECK(task.policy() == REPLAY);
  CHECK(task.has_group_first_stage());
  CHECK(task.group_first_stage() == 0);
  REQUIRE(task.group_snapshots_size() == 2);
  // (0, 0) has synced step 4 since: its entry is the step-2 snapshot that sync replaced, to the
  // byte (parameters, optimizer state, checksum, data cursor).
  const Snapshot& member = task.group_snapshots(0);
  CHECK(member.slot().stage() == 0);
  CHECK(member.step() == 2);
  CHECK(member.SerializeAsString() == history.stage0_at_2.SerializeAsString());
  CHECK(compute::PackedFromBundle(server.layout(0), member.params()) == history.stage0_post_sync_2);
  CHECK(member.params().SerializeAsString() !=
        server.StoredSnapshot(Slot(0, 0)).params().SerializeAsString());
  const Snapshot& lost = task.group_snapshots(1);
  CHECK(lost.slot().stage() == 1);
  CHECK(lost.step() == 2);
  CHECK(lost.SerializeAsString() == history.stage1_at_2.SerializeAsString());
  // The task's own snapshot is the lost slot's entry again.
  CHECK(task.snapshot().step() == 2);
  CHECK(task.snapshot().SerializeAsString() == lost.SerializeAsString());
  // t_f: step 3 has (0, 1)'s checksum and stage 0's sample ids; step 4 lacks the checksum.
  CHECK(task.failed_step() == 3);
  CHECK(task.rank() == 0);
  REQUIRE(task.spares_size() == 1);
  CHECK(task.spares(0).incarnation() == w.spare);
  CHECK(task.spares(0).peer_address() == "spare:1");
  CHECK(task.first_micro_batch() == 0);
  CHECK(task.micro_batch_count() == kMicroBatches);
}

TEST_CASE(
    "a group member's log above the group's floor survives its sync and the task reads it "
    "through ReadLog's slot") {
  GroupServer server(kNoBoundaries);
  const History history = RunUntilStage1IsLost(server, /*pairs=*/false);
  const Workers& w = history.workers;

  // (0, 0)'s step-2 sync found the group's floor at 2 ((0, 1) had synced step 2) and GC'd steps
  // 1-2; its step-4 sync found it still at 2 and kept steps 3-4.
  const std::vector<std::string> stage0_log = {"3/-1", "3/0", "3/1", "4/-1", "4/0", "4/1"};
  CHECK(Keys(server.Stored(Slot(0, 0))) == stage0_log);
  // (0, 1) synced step 2 first, while (0, 0) was at 0: the floor was 0 and its log was kept.
  const std::vector<std::string> stage1_log = {"1/-1", "2/-1", "3/-1"};
  CHECK(Keys(server.Stored(Slot(0, 1))) == stage1_log);

  FlushNeighbour(server, w.stage0);
  const WaitForTaskResponse response = server.WaitForTask(w.spare);
  REQUIRE(response.has_task());
  const uint64_t task = response.task().task_id();

  SECTION("slot (0, 0) reads the member's records of steps 3-4") {
    const SlotId member = Slot(0, 0);
    std::vector<LogRecord> records;
    const grpc::Status status = server.ReadLog(w.spare, task, 2, 4, &member, &records);
    INFO(status.error_message());
    REQUIRE(status.ok());
    REQUIRE(Keys(records) == stage0_log);
    for (const LogRecord& record : records) {
      CHECK(record.slot().stage() == 0);
      CHECK(record.sender_incarnation() == w.stage0);
      if (record.micro_batch() == -1) {
        CHECK(record.params_checksum() == Checksum(0, record.step()));
      } else {
        const std::vector<int64_t> ids(record.sample_ids().begin(), record.sample_ids().end());
        CHECK(ids == SampleIds(record.step(), record.micro_batch()));
      }
    }
    // From 0 too: nothing below the floor is left.
    REQUIRE(server.ReadLog(w.spare, task, 0, 4, &member, &records).ok());
    CHECK(Keys(records) == stage0_log);
  }

  SECTION("no slot, or the task's own slot, reads the lost slot's checksums") {
    std::vector<LogRecord> records;
    REQUIRE(server.ReadLog(w.spare, task, 2, 4, nullptr, &records).ok());
    REQUIRE(Keys(records) == std::vector<std::string>{"3/-1"});
    CHECK(records[0].params_checksum() == Checksum(1, 3));
    const SlotId own = Slot(0, 1);
    REQUIRE(server.ReadLog(w.spare, task, 2, 4, &own, &records).ok());
    CHECK(Keys(records) == std::vector<std::string>{"3/-1"});
  }

  SECTION("a slot outside the group is INVALID_ARGUMENT and streams nothing") {
    for (const SlotId& outside : {Slot(0, 2), Slot(1, 0), Slot(-1, 1)}) {
      INFO(SlotName(outside));
      std::vector<LogRecord> records;
      const grpc::Status status = server.ReadLog(w.spare, task, 2, 4, &outside, &records);
      CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
      CHECK_THAT(status.error_message(), Contains("stages [0, 2) of replica 0"));
      CHECK(records.empty());
    }
  }
}

TEST_CASE(
    "with every boundary logged a stage is its own group: its sync GCs its whole log and a "
    "task has no group snapshots") {
  GroupServer server(kAllBoundaries);
  const History history = RunUntilStage1IsLost(server, /*pairs=*/true);
  const Workers& w = history.workers;

  // (0, 0)'s step-4 sync deleted everything through step 4, the backward pairs (0, 1) logged
  // for it included.
  CHECK(server.Stored(Slot(0, 0)).empty());
  // (0, 1)'s step-2 sync GC'd its own steps 1-2 at once: its step 3, and the forward pairs
  // (0, 0) logged for steps 3-4, are left.
  const std::vector<std::string> stage1_log = {"3/-1", "3/0/F", "3/1/F", "4/0/F", "4/1/F"};
  CHECK(Keys(server.Stored(Slot(0, 1))) == stage1_log);

  FlushNeighbour(server, w.stage0);
  const WaitForTaskResponse response = server.WaitForTask(w.spare);
  REQUIRE(response.has_task());
  const RecoveryTask& task = response.task();
  CHECK(task.slot().stage() == 1);
  CHECK(task.group_snapshots_size() == 0);
  CHECK_FALSE(task.has_group_first_stage());
  CHECK(task.snapshot().SerializeAsString() == history.stage1_at_2.SerializeAsString());
  // Step 3 has the checksum and the forward pairs; step 4 lacks the checksum.
  CHECK(task.failed_step() == 3);

  std::vector<LogRecord> records;
  REQUIRE(server.ReadLog(w.spare, task.task_id(), 2, 4, nullptr, &records).ok());
  CHECK(Keys(records) == stage1_log);
  const SlotId neighbour = Slot(0, 0);
  const grpc::Status status = server.ReadLog(w.spare, task.task_id(), 2, 4, &neighbour, &records);
  CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(status.error_message(), Contains("stages [1, 2) of replica 0"));
}

TEST_CASE(
    "a group's t_f grows only while the lost slot's checksums and stage 0's sample ids are both "
    "logged") {
  GroupServer server(kNoBoundaries);
  const Workers w = RegisterWorkers(server);
  // LastCompleteStep reads only the store: a second StepLogService over it sees what the
  // service's AppendLog committed.
  StepLogService log(server.job(), &server.membership(), &server.store());
  auto t_f = [&log](int stage, int64_t after) {
    absl::StatusOr<int64_t> last = log.LastCompleteStep(Slot(0, stage), after);
    INFO(last.status().ToString());
    REQUIRE(last.ok());
    return *last;
  };

  CHECK(t_f(1, 0) == 0);
  server.Append(w.stage1, {StepRecord(1, 1), StepRecord(1, 2), StepRecord(1, 3)});
  CHECK(t_f(1, 0) == 0);  // no sample ids yet
  server.Append(w.stage0, {SampleRecord(1, 0)});
  CHECK(t_f(1, 0) == 0);  // micro-batch 1 of step 1 missing
  server.Append(w.stage0, {SampleRecord(1, 1)});
  CHECK(t_f(1, 0) == 1);
  server.Append(w.stage0, {SampleRecord(3, 0), SampleRecord(3, 1)});
  CHECK(t_f(1, 0) == 1);  // step 2's sample ids missing
  server.Append(w.stage0, {SampleRecord(2, 0), SampleRecord(2, 1)});
  CHECK(t_f(1, 0) == 3);
  // A member's own checksum is not the lost slot's.
  server.Append(w.stage0, {SampleRecord(4, 0), SampleRecord(4, 1), StepRecord(0, 4)});
  CHECK(t_f(1, 0) == 3);
  server.Append(w.stage1, {StepRecord(1, 4)});
  CHECK(t_f(1, 0) == 4);  // no boundary pair is needed anywhere
  CHECK(t_f(1, 2) == 4);
  CHECK(t_f(1, 4) == 4);
  // Stage 0 of the group: its own checksums (only step 4's is logged) and its sample ids.
  CHECK(t_f(0, 0) == 0);
  CHECK(t_f(0, 3) == 4);

  // Boundary 1 is not logged: its pairs are refused, naming it.
  const grpc::Status pair = server.TryAppend(w.stage0, {PairRecord(FORWARD, 4, 0)});
  CHECK(pair.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(pair.error_message(), Contains("boundary 1 is not in step_log.logged_boundaries"));
}

TEST_CASE("with boundary 1 logged the same records leave stage 1's t_f at 0: it reads pairs") {
  GroupServer server(kAllBoundaries);
  const Workers w = RegisterWorkers(server);
  StepLogService log(server.job(), &server.membership(), &server.store());
  for (int64_t step = 1; step <= 2; ++step) {
    server.Append(w.stage0, StepLog(0, step));
    server.Append(w.stage1, {StepRecord(1, step)});
  }
  auto last = log.LastCompleteStep(Slot(0, 1), 0);
  REQUIRE(last.ok());
  CHECK(*last == 0);
  // Stage 0, a group of its own, needs stage 1's backward pairs as well.
  last = log.LastCompleteStep(Slot(0, 0), 0);
  REQUIRE(last.ok());
  CHECK(*last == 0);
  server.Append(w.stage0, {PairRecord(FORWARD, 1, 0), PairRecord(FORWARD, 1, 1)});
  last = log.LastCompleteStep(Slot(0, 1), 0);
  REQUIRE(last.ok());
  CHECK(*last == 1);
}

// The lost (0, 1) had synced step 4 and (0, 0) step 2, so the task replays from t0 = 2; (0, 0)'s
// step-4 sync, which its trainer may still send while (0, 1) is RECOVERING, must not delete the
// sample ids of steps 3-4 the task reads: while a member is down the group's GC stops.
TEST_CASE("a live member's sync during a group replay keeps the log the replay reads") {
  GroupServer server(kNoBoundaries);
  const Workers w = RegisterWorkers(server);
  for (int64_t step = 1; step <= 4; ++step) {
    server.Append(w.stage0, StepLog(0, step));
    server.Append(w.stage1, StepLog(1, step));
    if (step == 2) {
      server.Sync(w.stage0, 0, 2);
      server.Sync(w.stage1, 1, 2);
    }
  }
  // Stage 1 finishes step 4 (it has sent stage 0 every backward pair of it) and syncs first.
  server.Sync(w.stage1, 1, 4);
  server.Deregister(w.stage1);
  FlushNeighbour(server, w.stage0);
  const WaitForTaskResponse response = server.WaitForTask(w.spare);
  REQUIRE(response.has_task());
  const RecoveryTask& task = response.task();
  REQUIRE(task.snapshot().step() == 2);
  REQUIRE(task.group_snapshots_size() == 2);
  REQUIRE(task.failed_step() == 4);

  server.Sync(w.stage0, 0, 4);

  const SlotId member = Slot(0, 0);
  std::vector<LogRecord> records;
  REQUIRE(server.ReadLog(w.spare, task.task_id(), 2, 4, &member, &records).ok());
  CHECK(Keys(records) == std::vector<std::string>{"3/-1", "3/0", "3/1", "4/-1", "4/0", "4/1"});
}

}  // namespace
}  // namespace rebound::server
