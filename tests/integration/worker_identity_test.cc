// Worker credentials and operator calls (docs/operations.md#security) against the real
// rebound_server: a client that knows a worker's incarnation (GetStatus lists every one) but not
// its credential is refused on every call that acts as that worker, and changes nothing; the
// credential never appears in GetStatus; only an evaluator reports evaluations; Drain needs the
// operator token; and a spare that holds a replay task takes the slot over only with a report
// that proves the replay against the server's own log.
//
// The test registers itself as workers (test clients that never heartbeat), so the job has a
// failure timeout longer than any test case.

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "proto/rebound.grpc.pb.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/status_util.h"
#include "testing/cluster/processes.h"
#include "testing/cluster/time_scale.h"
#include "tests/integration/worker_credentials.h"

namespace rebound::testing {
namespace {

using ::Catch::Contains;
using Code = grpc::StatusCode;

constexpr int kMicroBatches = 4;
constexpr int kSamplesPerMicroBatch = 4;  // batch_size 16 / 4 micro-batches

std::string JobText() {
  return absl::StrCat(
      "  job_id: \"identity\"\n"
      "  model { layers { width: 8 } layers { width: 10 activation: IDENTITY } }\n"
      "  topology { replicas: 2 }\n"
      "  weighting { policy: UNIFORM }\n"
      // Test clients never heartbeat: nobody is declared failed while a test case runs.
      "  fault_tolerance { failure_timeout_ms: 120000 }\n"
      "  data { batch_size: 16 micro_batches: ",
      kMicroBatches,
      " train_limit: 1000 test_limit: 100 }\n"
      "  easgd { sync_period: 8 }\n"
      "  training { max_steps: 80 }\n");
}

LocalClusterOptions Options(const std::string& server_extra = "") {
  LocalClusterOptions options;
  options.name = "identity";
  options.wait_limit = absl::Seconds(60);
  options.server_config_extra = server_extra;
  return options;
}

SyncRequest MakeSync(const RegisterResponse& trainer, int64_t step, TensorBundle params) {
  SyncRequest request;
  request.set_incarnation(trainer.incarnation());
  *request.mutable_slot() = trainer.slot();
  request.set_step(step);
  *request.mutable_params() = std::move(params);
  return request;
}

uint64_t LoggedChecksum(int64_t step) { return 0xC0FFEE00u + static_cast<uint64_t>(step); }

// The M + 1 records of one logged step of stage 0: the sample ids of each micro-batch and the
// per-step record with the parameters' checksum.
std::vector<LogRecord> WholeStep(uint64_t* next_id, const SlotId& slot, int64_t step) {
  std::vector<LogRecord> records;
  for (int mb = -1; mb < kMicroBatches; ++mb) {
    LogRecord record;
    *record.mutable_slot() = slot;
    record.set_step(step);
    record.set_micro_batch(mb);
    if (mb < 0) {
      record.set_params_checksum(LoggedChecksum(step));
    } else {
      for (int k = 0; k < kSamplesPerMicroBatch; ++k) {
        record.add_sample_ids(mb * kSamplesPerMicroBatch + k);
      }
    }
    record.set_record_id((*next_id)++);
    records.push_back(record);
  }
  return records;
}

// The streaming calls, which LocalCluster::Call does not make.
class Streams {
 public:
  explicit Streams(const std::string& address)
      : channel_(grpc::CreateChannel(address, grpc::InsecureChannelCredentials())),
        stub_(ParameterServer::NewStub(channel_)),
        sessions_(WorkerSession::NewStub(channel_)) {}

  // One AppendLog stream of one batch, with `credential`; the stream's final status.
  grpc::Status Append(const std::string& credential, uint64_t incarnation,
                      const std::vector<LogRecord>& records) {
    grpc::ClientContext context;
    Deadline(&context);
    WorkerCredentials::AddTo(&context, credential);
    auto stream = stub_->AppendLog(&context);
    AppendLogRequest batch;
    batch.set_incarnation(incarnation);
    for (const LogRecord& record : records) *batch.add_records() = record;
    stream->Write(batch);
    stream->WritesDone();
    AppendLogAck ack;
    while (stream->Read(&ack)) acked_through_ = ack.acked_through();
    return stream->Finish();
  }

  grpc::Status Read(const std::string& credential, const ReadLogRequest& request,
                    std::vector<LogRecord>* records) {
    grpc::ClientContext context;
    Deadline(&context);
    WorkerCredentials::AddTo(&context, credential);
    auto reader = stub_->ReadLog(&context, request);
    LogRecord record;
    while (reader->Read(&record)) records->push_back(record);
    return reader->Finish();
  }

  // One WorkerSession.Attach with `credential` that the server refuses: its final status. (An
  // admitted session stays open until the deadline; these calls are all refused at once.)
  grpc::Status AttachRefused(const std::string& credential, uint64_t incarnation) {
    grpc::ClientContext context;
    Deadline(&context);
    WorkerCredentials::AddTo(&context, credential);
    AttachRequest request;
    request.set_incarnation(incarnation);
    auto reader = sessions_->Attach(&context, request);
    SessionEvent event;
    while (reader->Read(&event)) attached_ += event.attached() ? 1 : 0;
    return reader->Finish();
  }

  uint64_t acked_through() const { return acked_through_; }
  int attached() const { return attached_; }

 private:
  static void Deadline(grpc::ClientContext* context) {
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  }

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<ParameterServer::Stub> stub_;
  std::unique_ptr<WorkerSession::Stub> sessions_;
  uint64_t acked_through_ = 0;
  int attached_ = 0;
};

TEST_CASE("a client that knows a worker's incarnation but not its credential cannot act as it, "
          "and changes nothing") {
  LocalCluster cluster(JobText(), Options());
  const RegisterResponse victim = cluster.Register("victim", TRAINER);
  const RegisterResponse other = cluster.Register("other", TRAINER);
  const RegisterResponse spare = cluster.Register("spare", SPARE);
  const RegisterResponse judge = cluster.Register("judge", EVALUATOR);
  REQUIRE(victim.role() == TRAINER);
  REQUIRE(victim.credential().size() == 64);
  REQUIRE(victim.credential() != other.credential());
  const TensorBundle center = cluster.Pull(spare.incarnation()).center();
  SyncResponse synced;
  REQUIRE(cluster.Call(&ParameterServer::Stub::Sync, MakeSync(victim, 8, Shifted(center, 0.01f)),
                       &synced)
              .ok());

  // GetStatus lists every incarnation, never a credential.
  const GetStatusResponse before = cluster.Status();
  const std::string before_center = cluster.Pull(spare.incarnation()).center().SerializeAsString();
  const std::string listed = before.SerializeAsString();
  REQUIRE(FindWorker(before, "victim", TRAINER) != nullptr);
  CHECK(FindWorker(before, "victim", TRAINER)->incarnation() == victim.incarnation());
  for (const RegisterResponse* who : {&victim, &other, &spare, &judge}) {
    CHECK_FALSE(absl::StrContains(listed, who->credential()));
  }

  Streams streams(cluster.address());
  uint64_t record_id = 1;
  const std::string impostor_credentials[] = {"", other.credential(), std::string(64, '0'),
                                              victim.credential().substr(0, 63)};
  for (const std::string& credential : impostor_credentials) {
    INFO("credential '" << credential << "'");
    const std::string as_victim = absl::StrCat("acts as incarnation ", victim.incarnation());
    HeartbeatRequest beat;
    beat.set_incarnation(victim.incarnation());
    beat.set_step(70);
    HeartbeatResponse beaten;
    CheckStatus(cluster.CallWithCredential(credential, &ParameterServer::Stub::Heartbeat, beat,
                                           &beaten),
                Code::UNAUTHENTICATED, as_victim);
    SyncResponse sync_reply;
    CheckStatus(cluster.CallWithCredential(credential, &ParameterServer::Stub::Sync,
                                           MakeSync(victim, 16, Shifted(center, 5.0f)),
                                           &sync_reply),
                Code::UNAUTHENTICATED, as_victim);
    PullRequest pull;
    pull.set_incarnation(victim.incarnation());
    PullResponse pulled;
    CheckStatus(cluster.CallWithCredential(credential, &ParameterServer::Stub::Pull, pull, &pulled),
                Code::UNAUTHENTICATED, as_victim);
    DeregisterRequest leave;
    leave.set_incarnation(victim.incarnation());
    DeregisterResponse left;
    CheckStatus(cluster.CallWithCredential(credential, &ParameterServer::Stub::Deregister, leave,
                                           &left),
                Code::UNAUTHENTICATED, as_victim);
    CheckStatus(streams.Append(credential, victim.incarnation(),
                               WholeStep(&record_id, victim.slot(), 9)),
                Code::UNAUTHENTICATED, as_victim);
    // A session opened as the victim: refused, so its end can never declare the victim crashed.
    CheckStatus(streams.AttachRefused(credential, victim.incarnation()), Code::UNAUTHENTICATED,
                as_victim);
    // The spare's and the evaluator's calls, made as them.
    WaitForTaskRequest wait;
    wait.set_incarnation(spare.incarnation());
    wait.set_wait_ms(10);
    WaitForTaskResponse task;
    CheckStatus(cluster.CallWithCredential(credential, &ParameterServer::Stub::WaitForTask, wait,
                                           &task),
                Code::UNAUTHENTICATED, absl::StrCat("acts as incarnation ", spare.incarnation()));
    ReadLogRequest read;
    read.set_incarnation(spare.incarnation());
    read.set_task_id(1);
    read.set_from_step(0);
    read.set_to_step(10);
    std::vector<LogRecord> records;
    CheckStatus(streams.Read(credential, read, &records), Code::UNAUTHENTICATED,
                absl::StrCat("acts as incarnation ", spare.incarnation()));
    CHECK(records.empty());
    ReportRecoveryRequest report;
    report.set_incarnation(spare.incarnation());
    report.set_task_id(1);
    report.set_outcome(RECOVERED);
    ReportRecoveryResponse granted;
    CheckStatus(cluster.CallWithCredential(credential, &ParameterServer::Stub::ReportRecovery,
                                           report, &granted),
                Code::UNAUTHENTICATED, absl::StrCat("acts as incarnation ", spare.incarnation()));
    // An audit's verdict, as the spare: it could convict a trainer, so it is the spare's alone.
    ReportAuditRequest audit;
    audit.set_incarnation(spare.incarnation());
    audit.set_audit_id((uint64_t{1} << 62) | 1);
    audit.set_result(AUDIT_MISMATCHED);
    audit.mutable_mismatch()->set_step(4);
    ReportAuditResponse audited;
    CheckStatus(cluster.CallWithCredential(credential, &ParameterServer::Stub::ReportAudit, audit,
                                           &audited),
                Code::UNAUTHENTICATED, absl::StrCat("acts as incarnation ", spare.incarnation()));
    ReportEvalRequest eval;
    eval.set_incarnation(judge.incarnation());
    eval.set_test_accuracy(1.0);
    ReportEvalResponse evaluated;
    CheckStatus(cluster.CallWithCredential(credential, &ParameterServer::Stub::ReportEval, eval,
                                           &evaluated),
                Code::UNAUTHENTICATED, absl::StrCat("acts as incarnation ", judge.incarnation()));
  }
  // With their own credentials: a trainer reports no audit, and a spare none it does not run.
  {
    ReportAuditRequest audit;
    audit.set_incarnation(other.incarnation());
    audit.set_audit_id((uint64_t{1} << 62) | 1);
    audit.set_result(AUDIT_MATCHED);
    ReportAuditResponse audited;
    CheckStatus(cluster.CallWithCredential(other.credential(),
                                           &ParameterServer::Stub::ReportAudit, audit, &audited),
                Code::FAILED_PRECONDITION, "");
    audit.set_incarnation(spare.incarnation());
    CheckStatus(cluster.CallWithCredential(spare.credential(),
                                           &ParameterServer::Stub::ReportAudit, audit, &audited),
                Code::FAILED_PRECONDITION, "runs no audit");
  }

  // Nothing changed: the victim is alive in its slot, with its one sync; no log, no evaluation.
  // Waited past the crash confirmation window (200 ms) of the refused sessions' ends first.
  CHECK(streams.attached() == 0);
  absl::SleepFor(Scaled(absl::Seconds(1)));
  const GetStatusResponse after = cluster.Status();
  CHECK(FindWorker(after, "victim", TRAINER)->state() == ALIVE);
  CHECK(FindWorker(after, "victim", TRAINER)->step() ==
        FindWorker(before, "victim", TRAINER)->step());
  CHECK(after.slots(0).owner_incarnation() == victim.incarnation());
  CHECK(after.slots(0).update_count() == 1);
  CHECK(after.slots(0).logged_step() == before.slots(0).logged_step());
  CHECK(after.centers(0).version() == before.centers(0).version());
  CHECK_FALSE(after.has_last_eval());
  const PullResponse center_after = cluster.Pull(spare.incarnation());
  CHECK(center_after.center().SerializeAsString() == before_center);
  CHECK(center_after.center_version() == 1);

  // The victim itself, with its credential, goes on.
  CHECK(cluster.Call(&ParameterServer::Stub::Sync,
                     MakeSync(victim, 16, Shifted(center_after.center(), 0.01f)), &synced)
            .ok());
  CHECK(cluster.Status().slots(0).update_count() == 2);
}

TEST_CASE("only an evaluator reports evaluations") {
  LocalCluster cluster(JobText(), Options());
  const RegisterResponse trainer = cluster.Register("t", TRAINER);
  const RegisterResponse spare = cluster.Register("s", SPARE);
  const RegisterResponse judge = cluster.Register("judge", EVALUATOR);
  ReportEvalRequest eval;
  eval.set_test_accuracy(1.0);
  eval.set_test_loss(0.0);
  ReportEvalResponse evaluated;
  for (const RegisterResponse* who : {&trainer, &spare}) {
    eval.set_incarnation(who->incarnation());
    CheckStatus(cluster.Call(&ParameterServer::Stub::ReportEval, eval, &evaluated),
                Code::PERMISSION_DENIED, absl::StrCat("not a EVALUATOR"));
  }
  CHECK_FALSE(cluster.Status().has_last_eval());
  eval.set_incarnation(judge.incarnation());
  eval.set_test_accuracy(0.75);
  REQUIRE(cluster.Call(&ParameterServer::Stub::ReportEval, eval, &evaluated).ok());
  const GetStatusResponse status = cluster.Status();
  REQUIRE(status.has_last_eval());
  CHECK(status.last_eval().test_accuracy() == 0.75);
}

TEST_CASE("Drain needs the operator token when the server has one") {
  const std::string dir = MakeTempDir("identity-operator");
  WriteFileOrDie(dir + "/operator", "op-s3cr3t\n");
  WriteFileOrDie(dir + "/wrong", "not-it\n");
  LocalCluster cluster(
      JobText(),
      Options(absl::StrCat("security { operator_token_file: \"", dir, "/operator\" }\n")));
  const RegisterResponse trainer = cluster.Register("t", TRAINER);
  DrainRequest drain;
  *drain.mutable_slot() = trainer.slot();
  DrainResponse drained;
  // A worker's credential is not an operator's.
  CheckStatus(cluster.CallWithCredential(trainer.credential(), &ParameterServer::Stub::Drain,
                                         drain, &drained),
              Code::UNAUTHENTICATED, "operator calls need the operator token");
  auto commands = [&] {
    HeartbeatRequest beat;
    beat.set_incarnation(trainer.incarnation());
    HeartbeatResponse reply;
    REQUIRE(cluster.Call(&ParameterServer::Stub::Heartbeat, beat, &reply).ok());
    return std::vector<int>(reply.commands().begin(), reply.commands().end());
  };
  CHECK(commands().empty());

  auto ctl = [&](const std::string& token_file, std::string* out) {
    std::vector<std::string> argv = {Runfile("tools/reboundctl"), "--server", cluster.address()};
    if (!token_file.empty()) argv.push_back("--operator_token_file=" + token_file);
    argv.insert(argv.end(), {"drain", "0,0"});
    return RunCommand(argv, out, absl::Seconds(30));
  };
  std::string out;
  CHECK(ctl("", &out) == 1);
  CHECK_THAT(out, Contains("operator calls need the operator token"));
  CHECK(ctl(dir + "/wrong", &out) == 1);
  CHECK_THAT(out, Contains("operator calls need the operator token"));
  CHECK(commands().empty());
  CHECK(cluster.Status().slots(0).state() == ACTIVE);

  INFO(out);
  CHECK(ctl(dir + "/operator", &out) == 0);
  CHECK_THAT(out, Contains(absl::StrCat("incarnation ", trainer.incarnation())));
  CHECK(commands() == std::vector<int>{DRAIN});
}

TEST_CASE("a spare that holds a replay task takes the slot over only with a report that proves "
          "the replay") {
  LocalCluster cluster(JobText(), Options());
  const RegisterResponse trainer = cluster.Register("t", TRAINER);
  const RegisterResponse leader = cluster.Register("leader", SPARE);
  const RegisterResponse bystander = cluster.Register("bystander", SPARE);
  const TensorBundle center = cluster.Pull(leader.incarnation()).center();
  SyncResponse synced;
  REQUIRE(cluster.Call(&ParameterServer::Stub::Sync, MakeSync(trainer, 8, Shifted(center, 0.01f)),
                       &synced)
              .ok());
  // Steps 9 and 10 logged past the snapshot of step 8; then the trainer leaves.
  Streams streams(cluster.address());
  uint64_t record_id = 1;
  std::vector<LogRecord> records = WholeStep(&record_id, trainer.slot(), 9);
  for (const LogRecord& record : WholeStep(&record_id, trainer.slot(), 10)) {
    records.push_back(record);
  }
  REQUIRE(streams.Append(cluster.credentials().Of(trainer.incarnation()), trainer.incarnation(),
                         records)
              .ok());
  DeregisterRequest leave;
  leave.set_incarnation(trainer.incarnation());
  DeregisterResponse left;
  REQUIRE(cluster.Call(&ParameterServer::Stub::Deregister, leave, &left).ok());

  WaitForTaskRequest wait;
  wait.set_incarnation(leader.incarnation());
  wait.set_wait_ms(2000);
  WaitForTaskResponse claimed;
  REQUIRE(cluster.Call(&ParameterServer::Stub::WaitForTask, wait, &claimed).ok());
  REQUIRE(claimed.has_task());
  const RecoveryTask& task = claimed.task();
  REQUIRE(task.rank() == 0);
  REQUIRE(task.snapshot().step() == 8);
  REQUIRE(task.failed_step() == 10);

  ReportRecoveryRequest report;
  report.set_incarnation(leader.incarnation());
  report.set_task_id(task.task_id());
  report.set_outcome(RECOVERED);
  ReportRecoveryResponse granted;
  SECTION("nothing replayed, nothing verified") {
    CheckStatus(cluster.Call(&ParameterServer::Stub::ReportRecovery, report, &granted),
                Code::FAILED_PRECONDITION, "must replay and verify every step of (8, 10]");
  }
  SECTION("verified, but too few steps") {
    report.set_steps_replayed(1);
    report.set_verified(true);
    report.set_final_checksum(LoggedChecksum(9));
    CheckStatus(cluster.Call(&ParameterServer::Stub::ReportRecovery, report, &granted),
                Code::FAILED_PRECONDITION, "it says 1 steps, verified");
  }
  SECTION("every step claimed verified, but the parameters are not the logged ones") {
    report.set_steps_replayed(2);
    report.set_verified(true);
    report.set_final_checksum(LoggedChecksum(10) + 1);
    CheckStatus(cluster.Call(&ParameterServer::Stub::ReportRecovery, report, &granted),
                Code::FAILED_PRECONDITION, "the replayed parameters of step 10 hash to");
  }
  SECTION("a spare that does not hold the task, with the right checksum") {
    report.set_incarnation(bystander.incarnation());
    report.set_steps_replayed(2);
    report.set_verified(true);
    report.set_final_checksum(LoggedChecksum(10));
    CheckStatus(cluster.Call(&ParameterServer::Stub::ReportRecovery, report, &granted),
                Code::FAILED_PRECONDITION, "leads no published replay task");
  }
  // Refused: the slot is still being recovered by its leader, nobody took it over.
  GetStatusResponse status = cluster.Status();
  CHECK(status.slots(0).state() == RECOVERING);
  CHECK(FindWorker(status, "leader", SPARE)->state() == ALIVE);
  CHECK(FindWorker(status, "bystander", SPARE)->state() == ALIVE);
  CHECK(FindWorker(status, "leader", TRAINER) == nullptr);

  // The proof that matches the log is accepted: the leader becomes the slot's trainer.
  report.set_incarnation(leader.incarnation());
  report.set_steps_replayed(2);
  report.set_verified(true);
  report.set_final_checksum(LoggedChecksum(10));
  REQUIRE(cluster.Call(&ParameterServer::Stub::ReportRecovery, report, &granted).ok());
  CHECK(granted.slot().replica() == 0);
  status = cluster.Status();
  CHECK(status.slots(0).state() == ACTIVE);
  CHECK(status.slots(0).owner_incarnation() == granted.incarnation());
  // Under its new incarnation the leader keeps its credential.
  cluster.credentials().Adopt(granted.incarnation(), leader.incarnation());
  HeartbeatRequest beat;
  beat.set_incarnation(granted.incarnation());
  beat.set_step(10);
  HeartbeatResponse beaten;
  CHECK(cluster.Call(&ParameterServer::Stub::Heartbeat, beat, &beaten).ok());
  CheckStatus(cluster.CallWithCredential(bystander.credential(), &ParameterServer::Stub::Heartbeat,
                                         beat, &beaten),
              Code::UNAUTHENTICATED, absl::StrCat("acts as incarnation ", granted.incarnation()));
}

}  // namespace
}  // namespace rebound::testing
