// Fuzz target: every RPC of the ParameterServer service (server/service.h), on arbitrary requests
// in arbitrary order, against a real in-process server: Membership, CenterTable,
// ReliabilityTracker, an in-memory DurableStore, a fake clock and the service itself, the objects
// server/main.cc wires together, without the network.
//
// Input: a fuzz.ServerSession (fuzz/sessions.proto) in protobuf binary: which of kJobs the server
// runs and up to kMaxCalls calls. Every input gets a fresh server, so whatever an input finds it
// reproduces on its own. The server's max_wait_ms is 0: no handler waits (there is no other
// thread to wait for), so every call returns at once.
//
// Properties, beyond "no crash, no sanitizer report, no leak":
//   * every status has a canonical code;
//   * a center's version never decreases, and an OK Sync, Push or Pull reports the version the
//     center now has;
//   * an OK Pull returns the stage's tensors;
//   * a recovery task's spare rank and micro-batch block lie inside the task and the job;
//   * GetStatus answers OK at the end and describes the job's topology, and each of its
//     recovery-duration histograms adds up (buckets = bounds + 1, their counts = its count);
//   * an incarnation holds at most Membership::kMaxSessionsPerWorker WorkerSessions at a time
//     (calls `session`: the Attach and stream ends server/worker_sessions.cc drives);
//   * a sharded job (group 0): an authorized or committed weight lies in (0, 1]; an OK SyncRange
//     reports the range's version and answers one tensor of the range's size.
//   * a sharded GLOBAL_CHECKPOINT job: an OK CheckpointRange kept bytes; an OK RollbackRange
//     reports every stage's range version as it now is.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/config.h"
#include "common/export_file.h"
#include "fuzz/fuzz_check.h"
#include "fuzz/sessions.pb.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/sync_stream.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "server/center_table.h"
#include "server/membership.h"
#include "server/reliability.h"
#include "server/service.h"
#include "server/shard/range_service.h"
#include "storage/durable_store.h"

namespace rebound::fuzz {
namespace {

using server::CenterTable;
using server::FailedWorker;
using server::Membership;
using server::ParameterServerService;
using server::ReliabilityTracker;

constexpr int kMaxCalls = 64;

// A small model (4 -> 3 -> 2: 23 parameters) so that a valid Sync fits in a few hundred bytes,
// under each recovery policy and sync mode.
constexpr char kModel[] = R"(
  job_id: "fuzz"
  model { input_dim: 4 layers { width: 3 activation: RELU } layers { width: 2 activation: IDENTITY } }
  data { batch_size: 4 micro_batches: 2 }
  step_log { buffer_bytes: 1048576 }
  training { max_steps: 16 }
)";
constexpr const char* kJobs[] = {
    // 0: two pipeline stages, REPLAY by two spares.
    R"(topology { replicas: 2 stages: 2 spares: 2 }
       easgd { sync_period: 2 }
       fault_tolerance { heartbeat_interval_ms: 100 failure_timeout_ms: 1000
                         recovery_parallelism: 2 })",
    // 1: DETERMINISTIC scheduling.
    R"(topology { replicas: 2 stages: 1 }
       easgd { sync_period: 2 }
       scheduling: DETERMINISTIC
       fault_tolerance { heartbeat_interval_ms: 100 failure_timeout_ms: 1000 })",
    // 2: ASYNC_ADAHESSIAN (Push and Pull).
    R"(topology { replicas: 2 stages: 1 }
       easgd { mode: ASYNC_ADAHESSIAN sync_period: 2 }
       fault_tolerance { heartbeat_interval_ms: 100 failure_timeout_ms: 1000 })",
    // 3: GLOBAL_CHECKPOINT every 2 steps.
    R"(topology { replicas: 2 stages: 1 }
       easgd { sync_period: 2 }
       fault_tolerance { policy: GLOBAL_CHECKPOINT checkpoint_every_steps: 2
                         heartbeat_interval_ms: 100 failure_timeout_ms: 1000 })",
    // 4: RESTART_FROM_CENTER (one stage: pipelines recover by REPLAY only).
    R"(topology { replicas: 2 stages: 1 }
       easgd { sync_period: 2 }
       fault_tolerance { policy: RESTART_FROM_CENTER heartbeat_interval_ms: 100
                         failure_timeout_ms: 1000 })",
    // 5: a model its workers declare (the Python client, RegisterRequest.model): the MLP of
    // kModel is replaced below by model { declared_by_worker: true }.
    R"(model { declared_by_worker: true }
       topology { replicas: 2 stages: 1 spares: 1 }
       easgd { sync_period: 2 }
       fault_tolerance { heartbeat_interval_ms: 100 failure_timeout_ms: 1000 })",
    // 6: the center sharded across 2 groups (docs/design.md §10.2); the server is group 0, with its
    // CenterRange service for range 0 (range 1's group is not there: nothing calls it).
    R"(topology { replicas: 2 stages: 2 spares: 1 }
       easgd { sync_period: 2 }
       scheduling: DETERMINISTIC
       sharding { groups: 2 }
       fault_tolerance { heartbeat_interval_ms: 100 failure_timeout_ms: 1000 })",
    // 7: ASYNC_ADAHESSIAN sharded across 2 groups (PushRange, CommitPush, PullRange).
    R"(topology { replicas: 2 stages: 1 }
       easgd { mode: ASYNC_ADAHESSIAN sync_period: 2 }
       sharding { groups: 2 }
       fault_tolerance { heartbeat_interval_ms: 100 failure_timeout_ms: 1000 })",
    // 8: GLOBAL_CHECKPOINT sharded across 2 groups: group 0's cuts and rollbacks reach range 0
    // in process (CheckpointRange, RollbackRange: the fuzzer may call them as group 0 would).
    R"(topology { replicas: 2 stages: 1 spares: 1 }
       easgd { sync_period: 2 }
       sharding { groups: 2 }
       fault_tolerance { policy: GLOBAL_CHECKPOINT checkpoint_every_steps: 2
                         heartbeat_interval_ms: 100 failure_timeout_ms: 1000 })",
    // 9: a model its workers declare, sharded across 2 groups (range 0 in process; a range
    // group's RANGE_DECLARATION ask can be made by hand with authorize_range).
    R"(model { declared_by_worker: true }
       topology { replicas: 2 stages: 1 spares: 1 }
       easgd { sync_period: 2 }
       sharding { groups: 2 }
       fault_tolerance { heartbeat_interval_ms: 100 failure_timeout_ms: 1000 })",
};
// kModel without its `model { ... }` line, for a job that declares its own model.
std::string WithoutMlp(const std::string& model) {
  const size_t begin = model.find("  model {");
  const size_t end = model.find('\n', begin);
  return model.substr(0, begin) + model.substr(end + 1);
}
const std::vector<JobConfig>& Jobs() {
  static const std::vector<JobConfig>* jobs = [] {
    auto* parsed = new std::vector<JobConfig>;
    for (const char* job : kJobs) {
      const std::string text = std::string(job).find("declared_by_worker") != std::string::npos
                                   ? WithoutMlp(kModel) + job
                                   : std::string(kModel) + job;
      absl::StatusOr<JobConfig> config = ParseJobConfig(text, "fuzz-job");
      if (!config.ok()) std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
      FUZZ_CHECK(config.ok());
      parsed->push_back(*std::move(config));
    }
    return parsed;
  }();
  return *jobs;
}

// One AppendLog stream: reads the session's batches, collects the acks.
class BatchStream final : public grpc::ServerReaderWriterInterface<AppendLogAck, AppendLogRequest> {
 public:
  explicit BatchStream(const AppendLogStream& batches) : batches_(batches) {}

  void SendInitialMetadata() override {}
  bool Write(const AppendLogAck& ack, grpc::WriteOptions) override {
    // Acks never go backwards within a stream.
    FUZZ_CHECK(ack.acked_through() >= last_ack_);
    last_ack_ = ack.acked_through();
    return true;
  }
  bool NextMessageSize(uint32_t* size) override {
    if (next_ >= batches_.batches_size()) return false;
    *size = static_cast<uint32_t>(batches_.batches(next_).ByteSizeLong());
    return true;
  }
  bool Read(AppendLogRequest* batch) override {
    if (next_ >= batches_.batches_size()) return false;
    *batch = batches_.batches(next_++);
    return true;
  }

 private:
  const AppendLogStream& batches_;
  int next_ = 0;
  uint64_t last_ack_ = 0;
};

// One ReadLog stream: counts what the server writes.
class RecordSink final : public grpc::ServerWriterInterface<LogRecord> {
 public:
  void SendInitialMetadata() override {}
  bool Write(const LogRecord&, grpc::WriteOptions) override {
    ++records_;
    return true;
  }
  int records() const { return records_; }

 private:
  int records_ = 0;
};

// The objects server/main.cc makes, in memory.
class Server {
 public:
  explicit Server(const JobConfig& job) : job_(job) {
    config_.set_listen_address("127.0.0.1:0");
    config_.set_max_wait_ms(0);
    *config_.mutable_job() = job;
    if (job.sharding().groups() > 1) {
      config_.mutable_shard()->set_group(0);
      for (int g = 0; g < job.sharding().groups(); ++g) {
        config_.mutable_shard()->add_group_addresses(absl::StrCat("127.0.0.1:", 7070 + g));
      }
    }
    auto store = storage::DurableStore::Open(
        storage::DurableStoreOptions::FromConfig(DurabilityConfig(), job.step_log()));
    FUZZ_CHECK(store.ok());
    store_ = *std::move(store);
    auto centers = CenterTable::Create(job, /*range=*/0);
    FUZZ_CHECK(centers.ok());
    centers_ = *std::move(centers);
    tracker_ = std::make_unique<ReliabilityTracker>(job.weighting(), job.topology().replicas());
    storage::DurableStore* db = store_.get();
    membership_ = std::make_unique<Membership>(
        job, &clock_, [db](const ServerRecord& server, const std::vector<SlotRecord>& slots) {
          storage::WriteBatch batch;
          batch.PutServer(server);
          for (const SlotRecord& slot : slots) batch.PutSlot(slot);
          return db->Commit(batch);
        });
    service_ = std::make_unique<ParameterServerService>(config_, membership_.get(), centers_.get(),
                                                        tracker_.get(), store_.get(), &clock_);
    if (job.sharding().groups() > 1) {
      ParameterServerService* service = service_.get();
      ranges_ = std::make_unique<server::RangeService>(
          config_, centers_.get(), store_.get(),
          [service](const grpc::ServerContext* context, const AuthorizeRangeRequest& request) {
            return service->Authorize(context, request);
          },
          [service](const grpc::ServerContext* context) { return service->CheckServing(context); },
          service->admission().inflight_bytes);
      // Group 0's ExportRange (and ReadRangeSnapshot without an incarnation, an audit's start)
      // are operator calls, as server/main.cc admits them; the fuzzer plays group 0.
      ranges_->SetOperatorCheck([](const grpc::ServerContext*) { return absl::OkStatus(); });
      // Range 0 is checked as the server checks it; range 1's group is not there, and is taken
      // to hold what range 0 holds.
      server::RangeService* ranges = ranges_.get();
      service_->SetRangeCheck([ranges](const SlotId& slot, int64_t step) {
        return ranges->Holds(slot, step)
                   ? absl::OkStatus()
                   : absl::FailedPreconditionError("range 0 has not applied the sync");
      });
      service_->SetPushCheck([ranges](const SlotId& slot, uint64_t sequence) {
        return ranges->AppliedSequence(slot) >= sequence
                   ? absl::OkStatus()
                   : absl::FailedPreconditionError("range 0 has not applied the push");
      });
    }
    if (EffectiveRecoveryPolicy(job) == GLOBAL_CHECKPOINT) {
      server::RangeCheckpointCalls calls;
      if (ranges_ != nullptr) {
        // Operator calls are the fuzzer's to make (it plays group 0); range 1 is range 0's twin.
        FUZZ_CHECK(ranges_
                       ->EnableGlobalCheckpoint(
                           "", [](const grpc::ServerContext*) { return absl::OkStatus(); })
                       .ok());
        server::RangeService* ranges = ranges_.get();
        calls.take = [ranges](int64_t step, int64_t keep_from) {
          return ranges->TakeCheckpoint(step, keep_from).status();
        };
        calls.roll_back = [ranges](int64_t step, uint64_t id) {
          return ranges->RollBack(step, id).status();
        };
      }
      FUZZ_CHECK(service_->EnableGlobalCheckpoint("", std::move(calls)).ok());
    }
    service_->MarkReady();
    for (int s = 0; s < centers_->num_stages(); ++s) versions_.push_back(centers_->version(s));
  }

  void Run(const ServerCall& input) {
    ServerCall call = input;
    if (call.has_use_incarnation() && !incarnations_.empty()) {
      SetIncarnation(&call, incarnations_[call.use_incarnation() % incarnations_.size()]);
    }
    grpc::ServerContext context;  // Register's: it logs the peer of a refusal
    // Every other call comes in process (a null context): trusted as the worker its incarnation
    // names, so the fuzzer reaches the handlers' checks behind the worker credential (which the
    // integration tests cover: tests/integration/security_test.cc).
    grpc::ServerContext* const in_process = nullptr;
    grpc::Status status;
    std::string detail;  // for REBOUND_FUZZ_LOG=1
    switch (call.call_case()) {
      case ServerCall::kRegisterWorker: {
        RegisterResponse response;
        status = service_->Register(&context, &call.register_worker(), &response);
        if (status.ok()) incarnations_.push_back(response.incarnation());
        break;
      }
      case ServerCall::kHeartbeat: {
        HeartbeatResponse response;
        status = service_->Heartbeat(in_process, &call.heartbeat(), &response);
        if (status.ok() && response.has_takeover()) {
          incarnations_.push_back(response.takeover().incarnation());
          detail = "takeover";
        }
        break;
      }
      case ServerCall::kDeregister: {
        DeregisterResponse response;
        status = service_->Deregister(in_process, &call.deregister(), &response);
        break;
      }
      case ServerCall::kSync: {
        SyncResponse response;
        status = service_->Sync(in_process, &call.sync(), &response);
        if (status.ok()) CheckReportedVersion(call.sync().slot().stage(), response.center_version());
        break;
      }
      case ServerCall::kPush: {
        PushResponse response;
        status = service_->Push(in_process, &call.push(), &response);
        if (status.ok()) CheckReportedVersion(call.push().slot().stage(), response.center_version());
        break;
      }
      case ServerCall::kPull: {
        PullResponse response;
        status = service_->Pull(in_process, &call.pull(), &response);
        if (status.ok()) {
          const int stage = call.pull().stage();
          CheckReportedVersion(stage, response.center_version());
          FUZZ_CHECK(response.center().tensors_size() ==
                     static_cast<int>(centers_->layout(stage).tensors().size()));
        }
        break;
      }
      case ServerCall::kAppendLog: {
        BatchStream stream(call.append_log());
        status = service_->ServeAppendLog(in_process, &stream);
        break;
      }
      case ServerCall::kWaitForTask: {
        WaitForTaskResponse response;
        status = service_->WaitForTask(in_process, &call.wait_for_task(), &response);
        if (status.ok() && response.has_task()) {
          CheckTask(response.task());
          detail = absl::StrCat("task ", response.task().task_id(), " rank ",
                                response.task().rank());
        }
        break;
      }
      case ServerCall::kReadLog: {
        RecordSink sink;
        status = service_->ServeReadLog(in_process, &call.read_log(), &sink);
        detail = absl::StrCat(sink.records(), " records");
        break;
      }
      case ServerCall::kReportRecovery: {
        ReportRecoveryResponse response;
        status = service_->ReportRecovery(in_process, &call.report_recovery(), &response);
        if (status.ok() && response.incarnation() != 0) {
          incarnations_.push_back(response.incarnation());
        }
        break;
      }
      case ServerCall::kReportEval: {
        ReportEvalResponse response;
        status = service_->ReportEval(in_process, &call.report_eval(), &response);
        break;
      }
      case ServerCall::kReportAudit: {
        ReportAuditResponse response;
        status = service_->ReportAudit(in_process, &call.report_audit(), &response);
        // No audit runs in a job without audits: every report is refused.
        if (!(job_.audit().fraction() > 0)) FUZZ_CHECK(!status.ok());
        break;
      }
      case ServerCall::kDrain: {
        DrainResponse response;
        status = service_->Drain(in_process, &call.drain(), &response);
        break;
      }
      case ServerCall::kExportCenter: {
        ExportCenterResponse response;
        status = service_->ExportCenter(in_process, &call.export_center(), &response);
        if (status.ok()) {
          // Every stage, each tensor FLOAT32 and whole, and a file safetensors can hold.
          FUZZ_CHECK(response.stages_size() == centers_->num_stages());
          for (const ExportedStage& stage : response.stages()) {
            for (const Tensor& tensor : stage.center().tensors()) {
              int64_t elements = 1;
              for (int64_t dim : tensor.shape()) elements *= dim;
              FUZZ_CHECK(tensor.dtype() == FLOAT32);
              FUZZ_CHECK(static_cast<int64_t>(tensor.data().size()) == 4 * elements);
            }
          }
          FUZZ_CHECK(ExportToSafetensors(response).ok());
        }
        break;
      }
      case ServerCall::kGetStatus:
        CheckStatus();
        break;
      case ServerCall::kAdvanceClockMs:
        clock_.Advance(absl::Milliseconds(call.advance_clock_ms()));
        DetectFailures();
        break;
      case ServerCall::kAuthorizeRange: {
        AuthorizeRangeResponse response;
        status = service_->AuthorizeRange(in_process, &call.authorize_range(), &response);
        if (status.ok() && call.authorize_range().access() == RANGE_SYNC) {
          FUZZ_CHECK(response.weight() > 0.0 && response.weight() <= 1.0);
        }
        break;
      }
      case ServerCall::kCommitSync: {
        CommitSyncResponse response;
        status = service_->CommitSync(in_process, &call.commit_sync(), &response);
        if (status.ok()) FUZZ_CHECK(response.next_weight() > 0.0 && response.next_weight() <= 1.0);
        break;
      }
      case ServerCall::kSyncRange: {
        if (ranges_ == nullptr) break;
        SyncRangeResponse response;
        status = ranges_->SyncRange(in_process, &call.sync_range(), &response);
        if (status.ok()) {
          CheckReportedVersion(call.sync_range().slot().stage(), response.center_version());
          // Either the fresh reply or the kept one, each one tensor of the range's size.
          const TensorBundle& range = response.has_worker_params_after()
                                          ? response.worker_params_after()
                                          : response.center_before();
          FUZZ_CHECK(range.tensors_size() == 1);
          FUZZ_CHECK(static_cast<int64_t>(range.tensors(0).data().size()) ==
                     4 * centers_->layout(call.sync_range().slot().stage()).packed_size());
        }
        break;
      }
      case ServerCall::kPushRange: {
        if (ranges_ == nullptr) break;
        PushRangeResponse response;
        status = ranges_->PushRange(in_process, &call.push_range(), &response);
        if (status.ok()) {
          CheckReportedVersion(call.push_range().slot().stage(), response.center_version());
          FUZZ_CHECK(response.applied_sequence() >= call.push_range().sequence());
        }
        break;
      }
      case ServerCall::kCommitPush: {
        CommitPushResponse response;
        status = service_->CommitPush(in_process, &call.commit_push(), &response);
        if (status.ok()) FUZZ_CHECK(response.applied_sequence() >= call.commit_push().sequence());
        break;
      }
      case ServerCall::kPullRange: {
        if (ranges_ == nullptr) break;
        PullRangeResponse response;
        status = ranges_->PullRange(in_process, &call.pull_range(), &response);
        if (status.ok()) CheckReportedVersion(call.pull_range().stage(), response.center_version());
        break;
      }
      case ServerCall::kReadRangeSnapshot: {
        if (ranges_ == nullptr) break;
        Snapshot response;
        status = ranges_->ReadRangeSnapshot(in_process, &call.read_range_snapshot(), &response);
        if (status.ok()) FUZZ_CHECK(response.step() == call.read_range_snapshot().step());
        break;
      }
      case ServerCall::kCheckpointRange: {
        if (ranges_ == nullptr) break;
        CheckpointRangeResponse response;
        status = ranges_->CheckpointRange(in_process, &call.checkpoint_range(), &response);
        if (status.ok()) FUZZ_CHECK(response.bytes() > 0);
        break;
      }
      case ServerCall::kExportRange: {
        if (ranges_ == nullptr) break;
        ExportRangeResponse response;
        status = ranges_->ExportRange(in_process, &call.export_range(), &response);
        if (status.ok() && !response.model_unknown()) {
          // One tensor, the range of the stage at a version the range really had, and one
          // applied step and sequence per replica.
          CheckReportedVersion(call.export_range().stage(), response.center_version());
          FUZZ_CHECK(response.center().tensors_size() == 1);
          FUZZ_CHECK(response.applied_steps_size() == response.applied_sequences_size());
          FUZZ_CHECK(response.applied_steps_size() > 0);
        }
        break;
      }
      case ServerCall::kRollbackRange: {
        if (ranges_ == nullptr) break;
        RollbackRangeResponse response;
        status = ranges_->RollbackRange(in_process, &call.rollback_range(), &response);
        if (status.ok()) {
          FUZZ_CHECK(response.center_versions_size() == centers_->num_stages());
          for (int s = 0; s < response.center_versions_size(); ++s) {
            CheckReportedVersion(s, response.center_versions(s));
          }
        }
        break;
      }
      case ServerCall::kSession: {
        const uint64_t incarnation = call.session().incarnation();
        if (call.session().end()) {
          // Only an admitted session ends (WorkerSessions tracks those alone).
          auto open = open_sessions_.find(incarnation);
          if (open == open_sessions_.end()) {
            detail = " (no open session)";
            break;
          }
          if (--open->second == 0) open_sessions_.erase(open);
          membership_->DetachSession(incarnation, call.session().lost());
          break;
        }
        absl::Status admitted = service_->CheckWorkerCall(in_process, incarnation);
        if (admitted.ok()) admitted = membership_->AttachSession(incarnation);
        if (admitted.ok()) {
          // At most kMaxSessionsPerWorker at a time; a fenced worker never gets one.
          FUZZ_CHECK(++open_sessions_[incarnation] <= Membership::kMaxSessionsPerWorker);
        }
        status = grpc::Status(static_cast<grpc::StatusCode>(admitted.code()),
                              std::string(admitted.message()));
        break;
      }
      case ServerCall::CALL_NOT_SET:
        break;
    }
    FUZZ_CHECK(status.error_code() >= grpc::StatusCode::OK &&
               status.error_code() <= grpc::StatusCode::UNAUTHENTICATED);
    if (Verbose() && call.call_case() != ServerCall::CALL_NOT_SET) {
      std::fprintf(stderr, "%s: %d %s%s\n",
                   ServerCall::descriptor()->FindFieldByNumber(call.call_case())->name().c_str(),
                   status.error_code(), status.error_message().c_str(), detail.c_str());
    }
    CheckVersions();
  }

  // GetStatus answers and describes the job.
  void CheckStatus() {
    grpc::ServerContext context;
    GetStatusRequest request;
    GetStatusResponse response;
    FUZZ_CHECK(service_->GetStatus(&context, &request, &response).ok());
    FUZZ_CHECK(response.replicas() == job_.topology().replicas());
    FUZZ_CHECK(response.stages() == job_.topology().stages());
    FUZZ_CHECK(response.centers_size() == centers_->num_stages());
    FUZZ_CHECK(response.slots_size() == job_.topology().replicas() * job_.topology().stages());
    // Each recovery-duration histogram is whole: one count per bucket and +Inf, adding up to
    // its count, a non-negative sum, ascending bounds.
    for (const RecoveryDurations& h : response.recovery_durations()) {
      FUZZ_CHECK(h.bucket_counts_size() == h.bucket_le_seconds_size() + 1);
      uint64_t total = 0;
      for (uint64_t n : h.bucket_counts()) total += n;
      FUZZ_CHECK(total == h.count());
      FUZZ_CHECK(h.count() > 0 && h.sum_seconds() >= 0);
      for (int i = 1; i < h.bucket_le_seconds_size(); ++i) {
        FUZZ_CHECK(h.bucket_le_seconds(i - 1) < h.bucket_le_seconds(i));
      }
    }
  }

 private:
  static void SetIncarnation(ServerCall* call, uint64_t incarnation) {
    switch (call->call_case()) {
      case ServerCall::kHeartbeat:
        call->mutable_heartbeat()->set_incarnation(incarnation);
        break;
      case ServerCall::kDeregister:
        call->mutable_deregister()->set_incarnation(incarnation);
        break;
      case ServerCall::kSync:
        call->mutable_sync()->set_incarnation(incarnation);
        break;
      case ServerCall::kPush:
        call->mutable_push()->set_incarnation(incarnation);
        break;
      case ServerCall::kPull:
        call->mutable_pull()->set_incarnation(incarnation);
        break;
      case ServerCall::kAppendLog:
        for (AppendLogRequest& batch : *call->mutable_append_log()->mutable_batches()) {
          batch.set_incarnation(incarnation);
        }
        break;
      case ServerCall::kWaitForTask:
        call->mutable_wait_for_task()->set_incarnation(incarnation);
        break;
      case ServerCall::kReadLog:
        call->mutable_read_log()->set_incarnation(incarnation);
        break;
      case ServerCall::kReportRecovery:
        call->mutable_report_recovery()->set_incarnation(incarnation);
        break;
      case ServerCall::kReportEval:
        call->mutable_report_eval()->set_incarnation(incarnation);
        break;
      case ServerCall::kReportAudit:
        call->mutable_report_audit()->set_incarnation(incarnation);
        break;
      case ServerCall::kRegisterWorker:
        call->mutable_register_worker()->set_previous_incarnation(incarnation);
        break;
      case ServerCall::kAuthorizeRange:
        call->mutable_authorize_range()->set_incarnation(incarnation);
        break;
      case ServerCall::kCommitSync:
        call->mutable_commit_sync()->set_incarnation(incarnation);
        break;
      case ServerCall::kSyncRange:
        call->mutable_sync_range()->set_incarnation(incarnation);
        break;
      case ServerCall::kPullRange:
        call->mutable_pull_range()->set_incarnation(incarnation);
        break;
      case ServerCall::kPushRange:
        call->mutable_push_range()->set_incarnation(incarnation);
        break;
      case ServerCall::kCommitPush:
        call->mutable_commit_push()->set_incarnation(incarnation);
        break;
      case ServerCall::kReadRangeSnapshot:
        call->mutable_read_range_snapshot()->set_incarnation(incarnation);
        break;
      case ServerCall::kSession:
        call->mutable_session()->set_incarnation(incarnation);
        break;
      default:
        break;
    }
  }

  // The failure detector's pass of server/main.cc.
  void DetectFailures() {
    for (const FailedWorker& failed : membership_->DetectFailures()) {
      tracker_->OnFault(failed.name, clock_.Now());  // the worker's fault, by name
      if (failed.had_slot) tracker_->SetLive(failed.slot, false);
    }
    service_->MaybeRollBack();
  }

  void CheckReportedVersion(int stage, int64_t version) {
    FUZZ_CHECK(stage >= 0 && stage < centers_->num_stages());
    FUZZ_CHECK(version == centers_->version(stage));
  }

  void CheckVersions() {
    // A declared model's stage appears at its first declaration, at version 0.
    if (versions_.size() < static_cast<size_t>(centers_->num_stages())) {
      versions_.resize(centers_->num_stages(), 0);
    }
    for (int s = 0; s < centers_->num_stages(); ++s) {
      const int64_t now = centers_->version(s);
      FUZZ_CHECK(now >= versions_[s]);
      versions_[s] = now;
    }
  }

  void CheckTask(const RecoveryTask& task) {
    FUZZ_CHECK(task.spares_size() >= 1);
    FUZZ_CHECK(task.rank() >= 0 && task.rank() < task.spares_size());
    FUZZ_CHECK(task.slot().replica() >= 0 && task.slot().replica() < job_.topology().replicas());
    FUZZ_CHECK(task.slot().stage() >= 0 && task.slot().stage() < job_.topology().stages());
    FUZZ_CHECK(task.micro_batch_count() >= 1 && task.first_micro_batch() >= 0 &&
               task.first_micro_batch() + task.micro_batch_count() <= job_.data().micro_batches());
  }

  const JobConfig job_;
  ServerConfig config_;
  FakeClock clock_;
  std::unique_ptr<storage::DurableStore> store_;
  std::unique_ptr<CenterTable> centers_;
  std::unique_ptr<ReliabilityTracker> tracker_;
  std::unique_ptr<Membership> membership_;
  std::unique_ptr<ParameterServerService> service_;
  std::unique_ptr<server::RangeService> ranges_;  // a sharded job's range 0
  std::vector<uint64_t> incarnations_;
  std::map<uint64_t, int> open_sessions_;  // admitted WorkerSessions per incarnation
  std::vector<int64_t> versions_;
};

}  // namespace
}  // namespace rebound::fuzz

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  rebound::fuzz::QuietLogging();
  rebound::fuzz::Jobs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  rebound::fuzz::ServerSession session;
  if (!session.ParseFromArray(data, static_cast<int>(size))) return 0;
  const auto& jobs = rebound::fuzz::Jobs();
  rebound::fuzz::Server server(jobs[session.job() % jobs.size()]);
  const int calls = std::min(session.calls_size(), rebound::fuzz::kMaxCalls);
  for (int i = 0; i < calls; ++i) server.Run(session.calls(i));
  server.CheckStatus();
  return 0;
}
