#include "worker/replay.h"

#include <glog/logging.h>

#include <chrono>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/grpc_status.h"
#include "common/slot.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "worker/replay_engine.h"
#include "worker/retry.h"
#include "worker/worker_metrics.h"

namespace rebound::worker {

namespace {

// A sharded job's recovery task names its snapshots' steps; their tensors are the range groups'
// (docs/design.md §10.2). Fills every snapshot of the task at a step > 0 that came without its
// tensors (step 0 is the model's initialisation, which the replay builds itself).
absl::Status FillRangeSnapshots(const Registration& registration, const absl::Notification& stop,
                                RecoveryTask* task) {
  const JobConfig& job = registration.job;
  const std::vector<int> starts = StageLayerStarts(job);
  auto fill = [&](Snapshot* snapshot) -> absl::Status {
    if (snapshot->step() == 0 || snapshot->params().tensors_size() > 0) return absl::OkStatus();
    const int stage = snapshot->slot().stage();
    if (stage < 0 || stage + 1 >= static_cast<int>(starts.size())) {
      return absl::InvalidArgumentError(absl::StrCat("a snapshot of stage ", stage));
    }
    ASSIGN_OR_RETURN(const compute::StageLayout layout,
                     compute::StageLayout::Create(job.model(), starts[stage], starts[stage + 1]));
    return registration.center->FillSnapshot(stop, registration.incarnation, layout, snapshot);
  };
  RETURN_IF_ERROR(fill(task->mutable_snapshot()));
  for (Snapshot& snapshot : *task->mutable_group_snapshots()) RETURN_IF_ERROR(fill(&snapshot));
  return absl::OkStatus();
}

// The report of an audit whose replay ended with `replayed` (`replay` is the report the engine
// filled as for a recovery; `preempted`: the agent's PREEMPT_AUDIT stopped it).
ReportAuditRequest AuditReport(uint64_t incarnation, const RecoveryTask& task,
                               const absl::Status& replayed, const ReportRecoveryRequest& replay,
                               bool preempted) {
  ReportAuditRequest report;
  report.set_incarnation(incarnation);
  report.set_audit_id(task.task_id());
  report.set_steps_replayed(replay.steps_replayed());
  if (replayed.ok()) {
    report.set_result(AUDIT_MATCHED);
  } else if (replay.outcome() == CHECKSUM_MISMATCH) {
    report.set_result(AUDIT_MISMATCHED);
    *report.mutable_mismatch() = replay.mismatch();
    report.set_detail(replay.detail());
  } else if (preempted && replayed.code() == absl::StatusCode::kCancelled) {
    report.set_result(AUDIT_PREEMPTED);
    report.set_detail(std::string(replayed.message()));
  } else {
    report.set_result(AUDIT_INCOMPLETE);
    report.set_detail(std::string(replayed.message()));
  }
  return report;
}

Counter* AuditCounter(AuditResult result) {
  switch (result) {
    case AUDIT_MATCHED:
      return Metrics().audits_matched;
    case AUDIT_MISMATCHED:
      return Metrics().audits_mismatched;
    case AUDIT_PREEMPTED:
      return Metrics().audits_preempted;
    default:
      return Metrics().audits_incomplete;
  }
}

// Audit `task` (docs/recovery.md#audits): replays the trainer's window on `*data` like a
// recovery, reports the result with ReportAudit and takes nothing over. A report the server
// refuses (the audit is over without this spare) or that cannot reach it is logged, not fatal:
// the spare goes back to waiting for tasks either way. Returns whether `*data` holds the data
// set again (moved back from the replay, which it is unless the replay failed before its first
// step). REQUIRES: agent->BeginAudit() was called for this task; ServeAudit calls EndAudit.
bool ServeAudit(const WorkerConfig& config, const Registration& registration,
                ReplayEngine* engine, ParameterServer::Stub* stub, WorkerAgent* agent,
                ReplayMailbox* mailbox, const absl::Notification& stop, const Clock* clock,
                RecoveryTask* task, FashionMnist* data) {
  LOG(INFO) << "audit " << task->task_id() << ": replaying steps " << task->snapshot().step() + 1
            << ".." << task->failed_step() << " of slot " << SlotName(task->slot())
            << " (trainer '" << task->audited_worker() << "')";
  ReportRecoveryRequest replay;
  bool preempted = false;
  bool data_returned = false;
  ReplayControl control;
  control.preempted = [agent, &preempted, &registration] {
    // PREEMPT_AUDIT, or a heartbeat handed this spare a slot (a restart from the center): the
    // slot must not wait for the audit.
    preempted = agent->audit_preempted() ||
                agent->registration().incarnation != registration.incarnation;
    return preempted;
  };
  control.data_returned = &data_returned;
  mailbox->Open(task->task_id());
  const absl::Status filled = FillRangeSnapshots(registration, stop, task);
  absl::StatusOr<std::unique_ptr<SlotCompute>> rebuilt =
      filled.ok() ? engine->Replay(registration.job, *task, registration.incarnation, data,
                                   &replay, control)
                  : absl::StatusOr<std::unique_ptr<SlotCompute>>(filled);
  mailbox->Close();
  agent->EndAudit();
  const ReportAuditRequest report =
      AuditReport(registration.incarnation, *task, rebuilt.status(), replay, preempted);
  AuditCounter(report.result())->Increment();
  // A match the engine has logged.
  if (report.result() != AUDIT_MATCHED) {
    LOG(WARNING) << "audit " << task->task_id() << " of trainer '" << task->audited_worker()
                 << "': " << AuditResult_Name(report.result()) << ": " << report.detail();
  }
  ReportAuditResponse ack;
  const absl::Status reported =
      CallWithRetry(config, clock, stop, "report audit", [&](grpc::ClientContext* context) {
        return stub->ReportAudit(context, report, &ack);
      });
  if (!reported.ok()) {
    // FAILED_PRECONDITION, ABORTED, NOT_FOUND: the audit is over without us (or this spare is,
    // which the next WaitForTask tells); UNAVAILABLE: the server stayed away past the give-up
    // time. An audit is no reason to end the spare.
    LOG(WARNING) << "audit " << task->task_id() << ": report not taken: " << reported;
  }
  if (rebuilt.ok()) {
    *data = std::move((*rebuilt)->data);
    return true;
  }
  return !filled.ok() || data_returned;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SlotCompute>> RunSpare(const WorkerConfig& config,
                                                      const Registration& registration,
                                                      const std::shared_ptr<grpc::Channel>& channel,
                                                      WorkerAgent* agent, ReplayMailbox* mailbox,
                                                      const absl::Notification& stop,
                                                      const Clock* clock, DataSetCache* data_sets) {
  auto stub = ParameterServer::NewStub(channel);
  // One engine for every task this spare serves: its sender thread lives as long as the role.
  ReplayEngine engine(config, stub.get(), mailbox, stop, clock);
  // Load the data set now, not when a trainer has died: it is on the recovery's critical path.
  ASSIGN_OR_RETURN(FashionMnist data, data_sets->Load(registration.job.data()));
  bool data_loaded = true;
  // A role that ends here leaves the data set to the next one.
  struct StashOnExit {
    const DataConfig& config;
    DataSetCache* data_sets;
    FashionMnist& data;
    bool& loaded;
    ~StashOnExit() {
      if (loaded) data_sets->Put(config, std::move(data));
    }
  } stash_on_exit{registration.job.data(), data_sets, data, data_loaded};
  while (!stop.HasBeenNotified()) {
    if (agent->registration().incarnation != registration.incarnation) {
      return absl::NotFoundError("the registration changed");
    }
    WaitForTaskRequest request;
    request.set_incarnation(registration.incarnation);
    request.set_wait_ms(1000);
    WaitForTaskResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(config.rpc_deadline_ms() + 1000));
    const absl::Status status = FromGrpcStatus(stub->WaitForTask(&context, request, &response));
    if (!status.ok()) {
      if (status.code() == absl::StatusCode::kFailedPrecondition ||
          status.code() == absl::StatusCode::kAborted) {
        // Fenced, replaced by a takeover, or unknown: the agent's registration tells what next.
        if (!agent->WaitForNewRegistration(registration.incarnation, absl::Seconds(2))) {
          return status;
        }
        return absl::NotFoundError("the registration changed");
      }
      clock->WaitFor(absl::Milliseconds(config.backoff_max_ms()), &stop);
      continue;
    }
    if (!response.has_task()) continue;
    RecoveryTask& task = *response.mutable_task();
    // An audit: from here a PREEMPT_AUDIT stops it (and one left from an earlier audit does not).
    if (task.audit()) agent->BeginAudit();
    if (!data_loaded) {
      absl::StatusOr<FashionMnist> loaded = data_sets->Load(registration.job.data());
      if (!loaded.ok()) {
        if (task.audit()) agent->EndAudit();
        return loaded.status();
      }
      data = *std::move(loaded);
      data_loaded = true;
    }
    if (task.audit()) {
      data_loaded = ServeAudit(config, registration, &engine, stub.get(), agent, mailbox, stop,
                               clock, &task, &data);
      continue;
    }
    const bool leader = task.rank() == 0;
    LOG(WARNING) << "replay task " << task.task_id() << ": rebuilding slot "
                 << SlotName(task.slot()) << " from step "
                 << task.snapshot().step() << " to " << task.failed_step() << " as spare "
                 << task.rank() + 1 << " of " << task.spares_size();
    ReportRecoveryRequest report;
    report.set_incarnation(registration.incarnation);
    report.set_task_id(task.task_id());
    data_loaded = false;  // moved into the replay's state
    Metrics().recoveries->Increment();
    mailbox->Open(task.task_id());
    // A sharded job's snapshots come from its K server groups.
    const absl::Status filled = FillRangeSnapshots(registration, stop, &task);
    bool data_returned = false;
    ReplayControl control;
    control.data_returned = &data_returned;
    absl::StatusOr<std::unique_ptr<SlotCompute>> rebuilt =
        filled.ok() ? engine.Replay(registration.job, task, registration.incarnation, &data,
                                    &report, control)
                    : absl::StatusOr<std::unique_ptr<SlotCompute>>(filled);
    mailbox->Close();
    // A replay that failed at a step gave the data set back (and one never started kept it).
    data_loaded = !filled.ok() || data_returned;
    if (!rebuilt.ok()) {
      if (report.outcome() != CHECKSUM_MISMATCH) {
        report.set_outcome(ABANDONED);
        report.set_detail(std::string(rebuilt.status().message()));
      }
      LOG(ERROR) << "replay task " << task.task_id() << " failed: " << rebuilt.status();
    }
    if (!leader) {
      // A helper's part ends here; the leader reports the task. Back to the pool.
      if (rebuilt.ok()) {
        data = std::move((*rebuilt)->data);
        data_loaded = true;
      }
      continue;
    }
    const absl::Time reporting = clock->Now();
    ReportRecoveryResponse granted;
    absl::Status reported = CallWithRetry(config, clock, stop, "report recovery",
                                          [&](grpc::ClientContext* context) {
                                            granted.Clear();
                                            return stub->ReportRecovery(context, report, &granted);
                                          });
    if (!reported.ok() && reported.code() != absl::StatusCode::kFailedPrecondition) {
      return reported;
    }
    if (!reported.ok()) {
      // The task is over without us (a rollback, or our report came too late); whether this
      // spare is still in the job, the next WaitForTask tells.
      LOG(WARNING) << "replay task " << task.task_id() << ": report refused: " << reported;
    }
    if (!reported.ok() || !rebuilt.ok() || granted.incarnation() == 0) {
      if (rebuilt.ok()) {
        data = std::move((*rebuilt)->data);
        data_loaded = true;
      }
      continue;
    }
    RegisterResponse adopted;
    adopted.set_incarnation(granted.incarnation());
    adopted.set_role(TRAINER);
    *adopted.mutable_slot() = granted.slot();
    adopted.set_start_step(task.failed_step());
    *adopted.mutable_neighbours() = granted.neighbours();
    agent->Adopt(adopted);
    LOG(WARNING) << "took over slot " << SlotName(granted.slot()) << " as incarnation " << granted.incarnation()
                 << " at step " << task.failed_step() << " ("
                 << absl::ToInt64Milliseconds(clock->Now() - reporting) << " ms)";
    return rebuilt;
  }
  return absl::CancelledError("stopped");
}

}  // namespace rebound::worker
