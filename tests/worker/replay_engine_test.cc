// ReplayEngine (worker/replay_engine.h) alone, k = 1, against a fake ParameterServer that serves
// only ReadLog (real gRPC on 127.0.0.1) from a log written here by a reference trainer on the
// same small job: a replay equal to the log rebuilds the slot; a logged step whose checksum
// differs ends the replay with CHECKSUM_MISMATCH and report.mismatch naming the step, both
// checksums and, when the log holds per-tensor checksums, the first tensor that differs (as an
// audit of a trainer that flipped a bit, --fault_flip_bit_at_step, would find it); a preempted
// replay stops at the next step. A failed replay gives the data set back.

#include <catch2/catch.hpp>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "compute/mlp.h"
#include "grpcpp/grpcpp.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "worker/injected_faults.h"
#include "worker/replay_engine.h"
#include "worker/replay_mailbox.h"
#include "worker/slot_compute.h"
#include "worker/step_logger.h"

namespace rebound::worker {
namespace {

constexpr int kSteps = 3;
constexpr int kSamples = 32;
constexpr int kFeatures = 6;
constexpr int kMicroBatches = 2;
constexpr uint64_t kTaskId = 5;

JobConfig Job() {
  JobConfig job;
  ModelSpec* model = job.mutable_model();
  model->set_input_dim(kFeatures);
  model->add_layers()->set_width(8);
  LayerSpec* out = model->add_layers();
  out->set_width(10);
  out->set_activation(IDENTITY);
  job.mutable_data()->set_batch_size(8);
  job.mutable_data()->set_micro_batches(kMicroBatches);
  job.mutable_training()->set_max_steps(10);
  return job;
}

FashionMnist Data() {
  FashionMnist data;
  data.train.count = kSamples;
  data.train.rows = 1;
  data.train.cols = kFeatures;
  data.train.features = kFeatures;
  for (int i = 0; i < kSamples * kFeatures; ++i) {
    data.train.images.push_back(static_cast<float>((i * 37) % 101) / 50.0f - 1.0f);
  }
  for (int i = 0; i < kSamples; ++i) data.train.labels.push_back(static_cast<uint8_t>(i % 10));
  data.test = data.train;
  return data;
}

SlotId Slot() {
  SlotId slot;
  slot.set_replica(0);
  slot.set_stage(0);
  return slot;
}

// What the reference trainer did: per step, the log's records, the checksum after the step and
// each tensor's.
struct Reference {
  std::vector<LogRecord> records;
  std::vector<uint64_t> checksums;                   // by step - 1
  std::vector<std::vector<uint64_t>> tensor_sums;    // by step - 1
  std::vector<std::string> tensor_names;
  int64_t parameters = 0;
};

// Trains steps 1..kSteps of the job from its initialisation and logs them as EasgdTrainer::LogStep
// does (with tensor checksums when `tensors`), flipping bits as `faults` says after each update.
Reference Train(bool tensors, const InjectedFaults& faults = {}) {
  Reference ref;
  auto compute = SlotCompute::Create(WorkerConfig(), Job(), Slot(), Data());
  REQUIRE(compute.ok());
  compute::MlpStage& stage = (*compute)->trainer->stage(0);
  for (const compute::TensorInfo& t : stage.layout().tensors()) ref.tensor_names.push_back(t.name);
  ref.parameters = stage.layout().packed_size();
  for (int64_t t = 1; t <= kSteps; ++t) {
    const std::vector<int64_t> ids = (*compute)->sampler->NextBatch();
    REQUIRE((*compute)->Step(t, ids, {}).ok());
    REQUIRE(MaybeFlipBit(faults, t, &stage).ok());
    const size_t per = ids.size() / kMicroBatches;
    for (int k = 0; k < kMicroBatches; ++k) {
      ref.records.push_back(MakeMicroBatchRecord(
          Slot(), t, k, absl::MakeConstSpan(ids).subspan(k * per, per)));
    }
    const absl::StatusOr<uint64_t> checksum = stage.ParamsChecksum();
    const absl::StatusOr<std::vector<uint64_t>> each = stage.TensorChecksums();
    REQUIRE(checksum.ok());
    REQUIRE(each.ok());
    ref.checksums.push_back(*checksum);
    ref.tensor_sums.push_back(*each);
    ref.records.push_back(MakeStepRecord(Slot(), t, *checksum,
                                         tensors ? *each : std::vector<uint64_t>()));
  }
  return ref;
}

// The per-step record of step t in `records`.
LogRecord& StepRecord(std::vector<LogRecord>& records, int64_t t) {
  for (LogRecord& r : records) {
    if (r.step() == t && r.micro_batch() == -1) return r;
  }
  FAIL("no per-step record of step " << t);
  return records.front();
}

// A ParameterServer that knows only ReadLog, serving `records` of the asked range.
class FakeLogServer final : public ParameterServer::Service {
 public:
  explicit FakeLogServer(std::vector<LogRecord> records) : records_(std::move(records)) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
    REQUIRE(server_ != nullptr);
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  ~FakeLogServer() override { server_->Shutdown(); }

  grpc::Status ReadLog(grpc::ServerContext*, const ReadLogRequest* request,
                       grpc::ServerWriter<LogRecord>* writer) override {
    if (request->task_id() != kTaskId) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "no such task");
    }
    for (const LogRecord& r : records_) {
      if (r.step() > request->from_step() && r.step() <= request->to_step()) writer->Write(r);
    }
    return grpc::Status::OK;
  }

  const std::string& address() const { return address_; }

 private:
  const std::vector<LogRecord> records_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

RecoveryTask Task(bool audit) {
  RecoveryTask task;
  task.set_task_id(kTaskId);
  *task.mutable_slot() = Slot();
  task.set_policy(REPLAY);
  task.set_failed_step(kSteps);
  *task.mutable_snapshot()->mutable_slot() = Slot();
  task.mutable_snapshot()->set_step(0);  // the model's initialisation: no tensors to load
  task.add_spares()->set_incarnation(7);
  task.set_rank(0);
  task.set_first_micro_batch(0);
  task.set_micro_batch_count(kMicroBatches);
  task.set_audit(audit);
  if (audit) task.set_audited_worker("trainer-0");
  return task;
}

// One replay of `records` by a fresh engine.
struct Replayed {
  absl::StatusOr<std::unique_ptr<SlotCompute>> rebuilt = absl::UnknownError("not run");
  ReportRecoveryRequest report;
  FashionMnist data = Data();  // what the caller holds after the replay
  bool data_returned = false;
};

Replayed RunReplay(std::vector<LogRecord> records, bool audit = false,
                   std::function<bool()> preempted = nullptr) {
  FakeLogServer server(std::move(records));
  auto stub = ParameterServer::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  WorkerConfig config;
  ReplayMailbox mailbox(int64_t{1} << 20);
  absl::Notification stop;
  ReplayEngine engine(config, stub.get(), &mailbox, stop, DefaultClock());
  Replayed out;
  ReplayControl control;
  control.preempted = std::move(preempted);
  control.data_returned = &out.data_returned;
  const RecoveryTask task = Task(audit);
  mailbox.Open(task.task_id());
  out.rebuilt = engine.Replay(Job(), task, /*incarnation=*/7, &out.data, &out.report, control);
  mailbox.Close();
  return out;
}

TEST_CASE("a replay equal to the log rebuilds the slot at the failed step") {
  const Reference ref = Train(/*tensors=*/true);
  Replayed r = RunReplay(ref.records);
  REQUIRE(r.rebuilt.ok());
  CHECK(r.report.outcome() == RECOVERED);
  CHECK(r.report.steps_replayed() == kSteps);
  CHECK(r.report.final_checksum() == ref.checksums.back());
  CHECK_FALSE(r.report.has_mismatch());
  CHECK_FALSE(r.data_returned);  // the rebuilt slot holds it
  CHECK((*r.rebuilt)->data.train.count == kSamples);
}

TEST_CASE("a logged step whose checksums differ is a CHECKSUM_MISMATCH naming the first tensor") {
  Reference ref = Train(/*tensors=*/true);
  REQUIRE(ref.tensor_names.size() == 4);
  // Step 2 as a trainer whose bias of layer 0 (tensor 1) came out different would have logged it.
  LogRecord& logged = StepRecord(ref.records, 2);
  logged.set_params_checksum(ref.checksums[1] ^ 0x1);
  logged.set_tensor_checksums(1, ref.tensor_sums[1][1] ^ 0x1);
  logged.set_tensor_checksums(3, ref.tensor_sums[1][3] ^ 0x1);  // a later one differs too

  Replayed r = RunReplay(ref.records);
  REQUIRE_FALSE(r.rebuilt.ok());
  CHECK(r.rebuilt.status().code() == absl::StatusCode::kDataLoss);
  CHECK(r.report.outcome() == CHECKSUM_MISMATCH);
  CHECK(r.report.steps_replayed() == 1);  // step 1 matched
  REQUIRE(r.report.has_mismatch());
  const ReplayMismatch& mismatch = r.report.mismatch();
  CHECK(mismatch.step() == 2);
  CHECK(mismatch.logged_checksum() == (ref.checksums[1] ^ 0x1));
  CHECK(mismatch.replayed_checksum() == ref.checksums[1]);
  CHECK(mismatch.tensor_index() == 1);
  CHECK(mismatch.tensor_name() == "layer0.bias");
  CHECK(r.report.detail().find("layer0.bias") != std::string::npos);
  // The data set came back to the caller: the next task needs no reload.
  CHECK(r.data_returned);
  CHECK(r.data.train.images.size() == static_cast<size_t>(kSamples * kFeatures));
}

TEST_CASE("without per-tensor checksums in the log a mismatch names no tensor") {
  Reference ref = Train(/*tensors=*/false);
  StepRecord(ref.records, 3).set_params_checksum(ref.checksums[2] + 1);
  Replayed r = RunReplay(ref.records);
  REQUIRE_FALSE(r.rebuilt.ok());
  CHECK(r.report.outcome() == CHECKSUM_MISMATCH);
  CHECK(r.report.steps_replayed() == 2);
  CHECK(r.report.mismatch().step() == 3);
  CHECK(r.report.mismatch().logged_checksum() == ref.checksums[2] + 1);
  CHECK(r.report.mismatch().replayed_checksum() == ref.checksums[2]);
  CHECK(r.report.mismatch().tensor_index() == -1);
  CHECK(r.report.mismatch().tensor_name().empty());
}

TEST_CASE("an audit of a trainer that flipped a bit finds the step and the tensor of the flip") {
  InjectedFaults faults;
  faults.flip_bit_at_step = 2;
  const Reference corrupted = Train(/*tensors=*/true, faults);
  const Reference clean = Train(/*tensors=*/true);
  // The flipped parameter and the tensor that holds it (packed layout: tensors back to back).
  const int64_t flipped = FlippedParameter(2, corrupted.parameters);
  auto compute = SlotCompute::Create(WorkerConfig(), Job(), Slot(), Data());
  REQUIRE(compute.ok());
  int tensor = -1;
  const auto& tensors = (*compute)->trainer->stage(0).layout().tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (flipped >= tensors[i].packed_offset &&
        flipped < tensors[i].packed_offset + tensors[i].size()) {
      tensor = static_cast<int>(i);
    }
  }
  REQUIRE(tensor >= 0);

  Replayed r = RunReplay(corrupted.records, /*audit=*/true);
  REQUIRE_FALSE(r.rebuilt.ok());
  CHECK(r.report.outcome() == CHECKSUM_MISMATCH);
  CHECK(r.report.mismatch().step() == 2);
  CHECK(r.report.mismatch().logged_checksum() == corrupted.checksums[1]);
  CHECK(r.report.mismatch().replayed_checksum() == clean.checksums[1]);
  CHECK(r.report.mismatch().tensor_index() == tensor);
  CHECK(r.report.mismatch().tensor_name() == tensors[tensor].name);
}

TEST_CASE("a preempted replay stops at its next step and gives the data set back") {
  const Reference ref = Train(/*tensors=*/true);
  std::atomic<int> asked{0};
  // Preempted once the first step is done: asked before step 1 (no), before step 2 (yes).
  Replayed r = RunReplay(ref.records, /*audit=*/true, [&asked] { return ++asked >= 2; });
  REQUIRE_FALSE(r.rebuilt.ok());
  CHECK(r.rebuilt.status().code() == absl::StatusCode::kCancelled);
  CHECK(r.rebuilt.status().message().find("preempted after 1 of 3 steps") != std::string::npos);
  CHECK(asked == 2);
  CHECK(r.report.outcome() != CHECKSUM_MISMATCH);
  CHECK(r.data_returned);
  CHECK(r.data.train.images.size() == static_cast<size_t>(kSamples * kFeatures));
}

TEST_CASE("a replay nobody preempts runs to the end whatever the control asks") {
  const Reference ref = Train(/*tensors=*/true);
  int asked = 0;
  Replayed r = RunReplay(ref.records, /*audit=*/true, [&asked] {
    ++asked;
    return false;
  });
  REQUIRE(r.rebuilt.ok());
  CHECK(asked == kSteps);
  CHECK(r.report.steps_replayed() == kSteps);
}

}  // namespace
}  // namespace rebound::worker
