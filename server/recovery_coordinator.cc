#include "server/recovery_coordinator.h"

#include <glog/logging.h>

#include <algorithm>
#include <iterator>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/config.h"
#include "common/slot.h"
#include "common/status_macros.h"
#include "compute/reduction_tree.h"

namespace rebound::server {
namespace {

// How long a spare whose long poll ended with nothing still counts as idle: it polls again at
// once (worker/replay.cc), so this only needs to cover a round trip under load. A helper that
// never comes back fails the task's exchange within its bound, as a helper that dies does.
constexpr absl::Duration kRepollGrace = absl::Milliseconds(500);

// The end of a task that did not rebuild its slot, under every policy (see RecoveryPolicy::EndOf).
Membership::ReplayEnd EndOfFailedTask(const JobConfig& job, const ReportRecoveryRequest& report) {
  Membership::ReplayEnd end;
  if (report.outcome() == CHECKSUM_MISMATCH && job.topology().stages() > 1) {
    // A pipeline stage restarted from the center would not match the step its live neighbours
    // are at: there is no fallback. Another spare (another machine, maybe the right backend and
    // threads) replays it again.
    end.outcome = CHECKSUM_MISMATCH;
    end.why = absl::StrCat("DATA_LOSS: ", report.detail(),
                           "; a pipeline stage has no fallback: the next spare replays it again "
                           "(same backend, hardware and compute.threads as the lost trainer "
                           "needed, docs/design.md §5.6)");
  } else if (report.outcome() == CHECKSUM_MISMATCH) {
    end.outcome = CHECKSUM_MISMATCH;
    end.why = absl::StrCat("DATA_LOSS: ", report.detail(), "; falling back to RESTART_FROM_CENTER");
    end.fallback_restart = true;
  } else if (report.outcome() == UNREPLAYABLE) {
    // No replay of it can verify: retrying would fail the same way.
    end.outcome = UNREPLAYABLE;
    if (job.topology().stages() > 1) {
      end.why = absl::StrCat("UNREPLAYABLE: ", report.detail(),
                             "; a pipeline stage has no fallback: the next spare replays it again");
    } else {
      end.why = absl::StrCat("UNREPLAYABLE: ", report.detail(),
                             "; falling back to RESTART_FROM_CENTER");
      end.fallback_restart = true;
    }
  } else {
    end.outcome =
        report.outcome() == RECOVERY_OUTCOME_UNSPECIFIED ? ABANDONED : report.outcome();
    end.why = report.detail();
  }
  return end;
}

// Policy REPLAY (docs/design.md §5.3); also a GLOBAL_CHECKPOINT job's until EnableGlobalCheckpoint.
class ReplayPolicy : public RecoveryPolicy {
 public:
  ReplayPolicy(const RecoveryUnits& units, RecoveryCoordinator* coordinator)
      : u_(units), job_(units.config->job()), coordinator_(coordinator) {}

  rebound::RecoveryPolicy kind() const override { return REPLAY; }

  absl::Status Assemble(const ReplayClaim& task, uint64_t incarnation,
                        RecoveryTask* response) override {
    const SlotId slot = Normalized(task.slot);
    // The snapshot to start from; none yet means the slot never synced: the model's init at 0.
    // The slot is RECOVERING, so no sync changes it while the task's spares read it. A stage in
    // a recovery group of several (an unlogged boundary next to it) is replayed with its whole
    // group, from every member's snapshot at the group's oldest snapshot step.
    const auto [group_first, group_end] = RecoveryGroup(job_, slot.stage());
    RecoveryTask group;
    Snapshot snapshot;
    if (group_end - group_first > 1) {
      auto t0 = GroupSnapshots(slot, group_first, group_end,
                               task.rank == 0 ? -1 : task.snapshot_step, &group);
      if (!t0.ok()) {
        return absl::AbortedError(absl::StrCat("recovery group of stages [", group_first, ", ",
                                               group_end, "): ", t0.status().message()));
      }
      group.set_group_first_stage(group_first);
      snapshot = group.group_snapshots(slot.stage() - group_first);
    } else {
      auto stored = u_.store->ReadSnapshot(slot);
      if (stored.ok()) {
        snapshot = *std::move(stored);
      } else if (stored.status().code() == absl::StatusCode::kNotFound) {
        *snapshot.mutable_slot() = slot;
        snapshot.set_step(0);
      } else {
        return stored.status();
      }
    }
    int64_t failed_step = task.failed_step;
    if (task.rank == 0) {
      // The leader fixes the task's range once for all its spares.
      ASSIGN_OR_RETURN(const int64_t last, u_.step_log->LastCompleteStep(slot, snapshot.step()));
      failed_step = std::max(last, snapshot.step());
      coordinator_->PublishReplay(task.task_id, snapshot.step(), failed_step);
    } else if (snapshot.step() != task.snapshot_step) {
      return absl::AbortedError(absl::StrCat("the snapshot of slot ", SlotName(slot),
                                             " moved from step ", task.snapshot_step, " to ",
                                             snapshot.step(), " during the replay task"));
    }
    absl::StatusOr<std::vector<compute::TreeNode>> blocks = compute::TreeAlignedBlocks(
        job_.data().micro_batches(), static_cast<int>(task.spares.size()));
    if (!blocks.ok() || static_cast<int>(blocks->size()) != static_cast<int>(task.spares.size())) {
      return absl::InternalError(absl::StrCat("cannot split ", job_.data().micro_batches(),
                                              " micro-batches among ", task.spares.size(),
                                              " spares"));
    }
    RecoveryTask* out = response;
    *out = std::move(group);
    out->set_task_id(task.task_id);
    *out->mutable_slot() = slot;
    out->set_policy(REPLAY);
    out->set_failed_step(failed_step);
    *out->mutable_snapshot() = std::move(snapshot);
    for (const TaskSpare& spare : task.spares) {
      Neighbour* n = out->add_spares();
      n->set_incarnation(spare.incarnation);
      n->set_peer_address(spare.peer_address);
    }
    out->set_rank(task.rank);
    const compute::TreeNode block = (*blocks)[task.rank];
    out->set_first_micro_batch(block.begin);
    out->set_micro_batch_count(block.size());
    if (out->group_snapshots_size() > 0) {
      LOG(WARNING) << "replay task " << task.task_id << ": slot " << SlotName(slot)
                   << " is rebuilt with its recovery group, stages [" << group_first << ", "
                   << group_end << ")";
    }
    LOG(WARNING) << "replay task " << task.task_id << ": slot " << SlotName(slot)
                 << " from its snapshot at step " << out->snapshot().step() << " to step "
                 << out->failed_step() << " (the trainer had reached step " << task.reached_step
                 << "); spare " << task.rank + 1 << " of " << task.spares.size()
                 << " replays micro-batches [" << block.begin << ", " << block.end << ")";
    return absl::OkStatus();
  }

  // A RECOVERED report proves its replay: it covers the whole published range, says every step
  // was verified, and its final checksum is the log's for failed_step. Only a REPLAY job's (a
  // GLOBAL_CHECKPOINT job before its checkpoints are enabled replays nothing to prove).
  absl::Status CheckRecovered(const ReportRecoveryRequest& report) const override {
    if (EffectiveRecoveryPolicy(job_) != REPLAY) return absl::OkStatus();
    ASSIGN_OR_RETURN(const auto range,
                     coordinator_->PublishedRange(report.task_id(), report.incarnation()));
    const auto [t0, tf] = range;
    if (!report.verified() || report.steps_replayed() != tf - t0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "a RECOVERED report must replay and verify every step of (", t0, ", ", tf,
          "]: it says ", report.steps_replayed(), " steps, ",
          report.verified() ? "verified" : "not verified"));
    }
    if (tf == t0) return absl::OkStatus();  // nothing replayed: the slot is its stored snapshot
    ASSIGN_OR_RETURN(const SlotId slot,
                     coordinator_->TaskSlot(report.task_id(), report.incarnation()));
    ASSIGN_OR_RETURN(const std::vector<LogRecord> records, u_.store->ReadLog(slot, tf - 1, tf));
    for (const LogRecord& record : records) {
      if (record.step() != tf || record.micro_batch() != -1) continue;
      if (record.params_checksum() != report.final_checksum()) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "the replayed parameters of step %d hash to %016x, the log says %016x", tf,
            report.final_checksum(), record.params_checksum()));
      }
      return absl::OkStatus();
    }
    return absl::FailedPreconditionError(
        absl::StrCat("the log holds no checksum of step ", tf, " to verify the replay against"));
  }

  Membership::ReplayEnd EndOf(const ReportRecoveryRequest& report) const override {
    return EndOfFailedTask(job_, report);
  }

  void OnRecovered(const ReportRecoveryRequest& report,
                   const RegisterResponse& takeover) override {
    // A replay charges nobody (docs/design.md §4.5): it rebuilt the state the slot would have had; the
    // lost trainer was charged when it was declared failed. The new owner brings its own score.
    u_.tracker->SetOwner(takeover.slot(), u_.membership->NameOf(takeover.incarnation()));
    LOG(WARNING) << "slot " << SlotName(takeover.slot()) << " rebuilt by replay of "
                 << report.steps_replayed() << " steps"
                 << (report.verified() ? ", verified bit-identical" : "")
                 << "; its trainer is now incarnation " << takeover.incarnation() << " at step "
                 << takeover.start_step();
  }

 protected:
  const RecoveryUnits u_;
  const JobConfig& job_;
  RecoveryCoordinator* const coordinator_;

 private:
  // The snapshots and range of a replay task of a multi-stage recovery group [first, end): fills
  // out->group_snapshots; returns t0 (the group's oldest snapshot step).
  absl::StatusOr<int64_t> GroupSnapshots(const SlotId& slot, int first, int end,
                                         int64_t published_t0, RecoveryTask* out) const {
    const int64_t t0 = published_t0 >= 0 ? published_t0 : u_.books->GroupFloor(slot, -1);
    for (int m = first; m < end; ++m) {
      SlotId member = slot;
      member.set_stage(m);
      ASSIGN_OR_RETURN(Snapshot snapshot, u_.retention->SnapshotAt(member, t0));
      *snapshot.mutable_slot() = member;
      *out->add_group_snapshots() = std::move(snapshot);
    }
    return t0;
  }
};

// Policy RESTART_FROM_CENTER (docs/design.md §5.1): Membership hands a LOST slot to a spare's heartbeat;
// there are no tasks to assemble or finish (RecoveryCoordinator::ClaimReplay never claims one).
class RestartFromCenterPolicy : public ReplayPolicy {
 public:
  using ReplayPolicy::ReplayPolicy;
  rebound::RecoveryPolicy kind() const override { return RESTART_FROM_CENTER; }
};

// Policy GLOBAL_CHECKPOINT (docs/design.md §5.4): the barrier of every cut, the rollback, and restore
// tasks.
class GlobalCheckpointPolicy : public RecoveryPolicy {
 public:
  GlobalCheckpointPolicy(const RecoveryUnits& units, RecoveryCoordinator* coordinator,
                         std::unique_ptr<GlobalCheckpoint> checkpoint, RangeCheckpointCalls ranges)
      : u_(units),
        job_(units.config->job()),
        coordinator_(coordinator),
        checkpoint_(std::move(checkpoint)),
        ranges_(std::move(ranges)) {}

  rebound::RecoveryPolicy kind() const override { return GLOBAL_CHECKPOINT; }

  // A restore of the slot's checkpointed state; nothing to replay.
  absl::Status Assemble(const ReplayClaim& task, uint64_t incarnation,
                        RecoveryTask* out) override {
    const SlotId slot = Normalized(task.slot);
    const CheckpointRecord checkpoint = checkpoint_->Current();
    out->set_task_id(task.task_id);
    *out->mutable_slot() = slot;
    out->set_policy(GLOBAL_CHECKPOINT);
    Snapshot* snapshot = out->mutable_snapshot();
    *snapshot->mutable_slot() = slot;
    snapshot->set_step(0);  // the job's start: the model's initialisation
    for (const Snapshot& s : checkpoint.snapshots()) {
      if (s.slot().replica() == slot.replica() && s.slot().stage() == slot.stage()) *snapshot = s;
    }
    out->set_failed_step(snapshot->step());
    coordinator_->PublishReplay(task.task_id, snapshot->step(), snapshot->step());
    Neighbour* self = out->add_spares();
    self->set_incarnation(incarnation);
    out->set_rank(0);
    out->set_first_micro_batch(0);
    out->set_micro_batch_count(job_.data().micro_batches());
    LOG(WARNING) << "restore task " << task.task_id << ": slot " << SlotName(slot)
                 << " from the global checkpoint of step " << snapshot->step();
    return absl::OkStatus();
  }

  absl::Status CheckRecovered(const ReportRecoveryRequest&) const override {
    return absl::OkStatus();
  }

  Membership::ReplayEnd EndOf(const ReportRecoveryRequest& report) const override {
    return EndOfFailedTask(job_, report);
  }

  void OnRecovered(const ReportRecoveryRequest&, const RegisterResponse& takeover) override {
    // A restore charges nobody (docs/design.md §4.5, docs/weighting.md): the trainer that was lost was
    // charged when it was declared failed, and the rollback restores every slot to a state that
    // every live trainer's center agrees with. The restoring spare brings its own score.
    u_.tracker->SetOwner(takeover.slot(), u_.membership->NameOf(takeover.incarnation()));
    LOG(WARNING) << "slot " << SlotName(takeover.slot())
                 << " restored from the global checkpoint; its trainer is now incarnation "
                 << takeover.incarnation() << " at step " << takeover.start_step();
  }

  uint64_t SyncEpoch() const override { return checkpoint_->epoch(); }

  absl::Status AfterSync(const SlotId& slot, int64_t step, uint64_t epoch) override {
    if (!checkpoint_->IsCut(step)) return absl::OkStatus();
    const int index = slot.replica() * job_.topology().stages() + slot.stage();
    return checkpoint_->Arrive(index, step, epoch,
                               absl::Milliseconds(u_.config->max_wait_ms()),
                               [this](int64_t cut, int64_t current) {
                                 return Gather(cut, current);
                               });
  }

  // If a trainer was lost since the last call, rolls every slot and the center back to the last
  // checkpoint: every trainer is fenced as ROLLED_BACK (it registers again, as a spare), every
  // slot is restored by a spare from its checkpointed snapshot.
  void AfterDetection() override {
    // A sharded job's rollback waits for every range group (one may be restarting).
    if (range_rollback_.has_value()) {
      FinishRangeRollback();
      return;
    }
    std::string why;
    if (!u_.membership->TakeRollbackRequest(&why)) return;
    // 1. The checkpoint to go back to is fixed first: a cut completing between here and the
    //    fence would otherwise restore a later checkpoint than the one the slots restart from.
    const CheckpointRecord checkpoint = checkpoint_->Freeze();
    // 2. No trainer writes again: every one is fenced as ROLLED_BACK and every slot is LOST. A
    //    sync applied before this point can no longer arrive at a barrier (its epoch is over).
    u_.membership->RollBackAll(checkpoint.step(), why);
    const CheckpointRecord restored = checkpoint_->BeginRollback();
    if (restored.step() != checkpoint.step()) {
      LOG(ERROR) << "GLOBAL_CHECKPOINT: the frozen checkpoint moved from step "
                 << checkpoint.step() << " to " << restored.step();
    }
    LOG(WARNING) << "GLOBAL_CHECKPOINT: " << why << "; rolling every slot and the center back to "
                 << "the checkpoint of step " << restored.step();
    // 3. The centers go back to the checkpoint (their versions keep increasing), and the store
    //    holds what was restored: the centers and every slot's checkpointed snapshot.
    storage::WriteBatch batch;
    // A sharded job's centers are its range groups' (range 0 is this server's range service):
    // each restores its own below.
    for (CenterRecord center : restored.centers()) {
      if (ranges_.roll_back) break;
      // A staged sync decided before the fence may still be writing: its version is taken.
      u_.centers->AwaitWrites(center.stage());
      center.set_version(u_.centers->version(center.stage()) + 1);
      if (absl::Status ok = u_.centers->Restore(center, nullptr); !ok.ok()) {
        LOG(ERROR) << "GLOBAL_CHECKPOINT: cannot restore the center of stage " << center.stage()
                   << ": " << ok;
        continue;
      }
      batch.PutCenter(center);
    }
    for (const Snapshot& snapshot : restored.snapshots()) batch.PutSnapshot(snapshot);
    // The slots' bookkeeping as it was at the cut (nothing applied yet at the job's start).
    u_.books->Clear();
    u_.books->Restore({restored.books().begin(), restored.books().end()});
    for (const WeightRecord& book : restored.books()) {
      batch.PutWeight(WithBook(u_.tracker->ExportSlot(book.slot(), u_.clock->Now()), book.slot(),
                               u_.books->Get(book.slot())));
    }
    if (absl::Status committed = u_.store->Commit(batch); !committed.ok()) {
      LOG(ERROR) << "GLOBAL_CHECKPOINT: cannot store the restored state: " << committed;
    }
    for (int r = 0; r < job_.topology().replicas(); ++r) {
      for (int s = 0; s < job_.topology().stages(); ++s) {
        SlotId slot;
        slot.set_replica(r);
        slot.set_stage(s);
        u_.tracker->SetLive(slot, false);
      }
    }
    // 4. Only now may spares restore the slots: a restore handed out earlier would sync against
    //    the center and bookkeeping of before the rollback. A sharded job's ranges first.
    if (ranges_.roll_back) {
      // An id that no earlier rollback had, also across restarts of this server: a range group
      // takes each rollback once, and a retry of it again changes nothing.
      std::random_device random;
      uint64_t id = 0;
      while (id == 0) id = (uint64_t{random()} << 32) ^ random();
      range_rollback_ = std::make_pair(restored.step(), id);
      FinishRangeRollback();
      return;
    }
    u_.membership->FinishRollback();
  }

  void FillStatus(GetStatusResponse* response) const override {
    checkpoint_->FillStatus(response->mutable_checkpoint());
  }

 private:
  // Every range group goes back to the rollback's checkpoint; then the restores are handed out.
  // Until every group answered, retried after each detection pass.
  void FinishRangeRollback() {
    const auto [step, id] = *range_rollback_;
    if (absl::Status rolled = ranges_.roll_back(step, id); !rolled.ok()) {
      LOG(WARNING) << "GLOBAL_CHECKPOINT: rollback " << id << " to step " << step
                   << " waits for the range groups (retried after the next detection pass): "
                   << rolled;
      return;
    }
    range_rollback_.reset();
    LOG(WARNING) << "GLOBAL_CHECKPOINT: every range rolled back to step " << step;
    u_.membership->FinishRollback();
  }

  // The checkpoint of a complete cut: every stage's center and every slot's stored snapshot,
  // which the barrier guarantees are all at `step`. A sharded job's: the slots' headers and
  // books, once every range group kept its part (`current`: the checkpoint kept until then).
  absl::StatusOr<CheckpointRecord> Gather(int64_t step, int64_t current) const {
    CheckpointRecord record;
    record.set_step(step);
    record.set_taken_unix_ms(absl::ToUnixMillis(u_.clock->Now()));
    for (int stage = 0; stage < u_.centers->num_stages(); ++stage) {
      ASSIGN_OR_RETURN(auto center, u_.centers->Read(stage));
      CenterRecord* out = record.add_centers();
      out->set_stage(stage);
      out->set_version(center.second);
      *out->mutable_params() = u_.centers->Bundle(stage, center.first);
    }
    for (int r = 0; r < job_.topology().replicas(); ++r) {
      for (int s = 0; s < job_.topology().stages(); ++s) {
        SlotId slot;
        slot.set_replica(r);
        slot.set_stage(s);
        ASSIGN_OR_RETURN(Snapshot snapshot, u_.store->ReadSnapshot(slot));
        if (snapshot.step() != step) {
          return absl::InternalError(absl::StrCat("the snapshot of slot ", SlotName(slot),
                                                  " is at step ", snapshot.step(),
                                                  ", not at the cut ", step));
        }
        snapshot.clear_stored_tensors();
        *record.add_snapshots() = std::move(snapshot);
        *record.add_books() =
            WithBook(u_.tracker->ExportSlot(slot, u_.clock->Now()), slot, u_.books->Get(slot));
      }
    }
    if (ranges_.take) RETURN_IF_ERROR(ranges_.take(step, current));
    return record;
  }

  const RecoveryUnits u_;
  const JobConfig& job_;
  RecoveryCoordinator* const coordinator_;
  const std::unique_ptr<GlobalCheckpoint> checkpoint_;
  const RangeCheckpointCalls ranges_;
  // A sharded rollback not yet done in every range: (step, rollback id). The failure detector's
  // thread only (AfterDetection).
  std::optional<std::pair<int64_t, uint64_t>> range_rollback_;
};

}  // namespace

RecoveryCoordinator::RecoveryCoordinator(const RecoveryUnits& units)
    : units_(units),
      initial_(EffectiveRecoveryPolicy(units.config->job()) == RESTART_FROM_CENTER
                   ? std::unique_ptr<RecoveryPolicy>(new RestartFromCenterPolicy(units, this))
                   : std::unique_ptr<RecoveryPolicy>(new ReplayPolicy(units, this))),
      policy_(initial_.get()) {
  units_.membership->SetRecoveryObserver(this);
}

RecoveryCoordinator::~RecoveryCoordinator() { units_.membership->SetRecoveryObserver(nullptr); }

absl::Status RecoveryCoordinator::EnableGlobalCheckpoint(const std::string& dir,
                                                         RangeCheckpointCalls ranges) {
  CheckpointRecord initial;
  for (int stage = 0; stage < units_.centers->num_stages(); ++stage) {
    ASSIGN_OR_RETURN(auto center, units_.centers->Read(stage));
    CenterRecord* out = initial.add_centers();
    out->set_stage(stage);
    out->set_version(center.second);
    *out->mutable_params() = units_.centers->Bundle(stage, center.first);
  }
  auto checkpoint = std::make_unique<GlobalCheckpoint>(units_.config->job(), dir,
                                                       std::move(initial), units_.clock);
  absl::Status loaded = checkpoint->Load();
  checkpoint_ = std::make_unique<GlobalCheckpointPolicy>(units_, this, std::move(checkpoint),
                                                         std::move(ranges));
  policy_.store(checkpoint_.get(), std::memory_order_release);
  return loaded;
}

absl::StatusOr<std::optional<RecoveryTask>> RecoveryCoordinator::NextTask(uint64_t incarnation,
                                                                          absl::Duration wait) {
  ASSIGN_OR_RETURN(std::optional<ReplayClaim> claim, ClaimReplay(incarnation, wait));
  if (!claim.has_value()) return std::optional<RecoveryTask>();
  RecoveryTask task;
  if (absl::Status assembled = policy()->Assemble(*claim, incarnation, &task); !assembled.ok()) {
    AbandonReplay(claim->task_id, std::string(assembled.message()));
    return assembled;
  }
  return std::optional<RecoveryTask>(std::move(task));
}

absl::StatusOr<std::optional<RegisterResponse>> RecoveryCoordinator::Finish(
    const ReportRecoveryRequest& report) {
  RecoveryPolicy* const p = policy();
  if (report.outcome() == RECOVERED) {
    if (absl::Status proven = p->CheckRecovered(report); !proven.ok()) {
      LOG(WARNING) << "refused the RECOVERED report of incarnation " << report.incarnation()
                   << " for replay task " << report.task_id() << ": " << proven;
      return proven;
    }
  }
  // The task's slot, for the log line of a failed replay (gone once the task has ended).
  const absl::StatusOr<SlotId> slot = TaskSlot(report.task_id(), report.incarnation());
  const Membership::ReplayEnd end = p->EndOf(report);
  ASSIGN_OR_RETURN(std::optional<RegisterResponse> takeover,
                   FinishReplay(report.incarnation(), report, end));
  if (!takeover.has_value()) {
    if (report.outcome() == CHECKSUM_MISMATCH && slot.ok()) {
      const bool pipeline = units_.config->job().topology().stages() > 1;
      LOG(ERROR) << "REPLAY of " << (pipeline ? "pipeline " : "") << "slot " << SlotName(*slot) << " did not reproduce the logged checksums ("
                 << report.detail() << "): DATA_LOSS; "
                 << (end.fallback_restart ? "falling back to RESTART_FROM_CENTER for this slot"
                                          : "it waits for another replay");
    }
    LOG(WARNING) << "replay task " << report.task_id() << " ended "
                 << RecoveryOutcome_Name(report.outcome()) << ": " << report.detail();
    return takeover;
  }
  units_.tracker->SetLive(takeover->slot(), true);
  p->OnRecovered(report, *takeover);
  return takeover;
}

absl::StatusOr<SlotId> RecoveryCoordinator::TaskSlot(uint64_t task_id,
                                                     uint64_t incarnation) const {
  RETURN_IF_ERROR(units_.membership->CheckAlive(incarnation));
  absl::MutexLock lock(&mu_);
  auto it = tasks_.find(task_id);
  if (it != tasks_.end() && ActiveRank(it->second, incarnation) >= 0) return it->second.slot;
  return absl::FailedPreconditionError(
      absl::StrCat("incarnation ", incarnation, " takes part in no replay task ", task_id));
}

int RecoveryCoordinator::ActiveRank(const Task& task, uint64_t incarnation) {
  for (size_t r = 0; r < task.spares.size(); ++r) {
    if (task.spares[r].incarnation == incarnation) {
      return task.active[r] ? static_cast<int>(r) : -1;
    }
  }
  return -1;
}

ReplayClaim RecoveryCoordinator::ClaimOf(uint64_t task_id, const Task& task, int rank) {
  ReplayClaim claim;
  claim.task_id = task_id;
  claim.slot = task.slot;
  claim.reached_step = task.reached_step;
  claim.rank = rank;
  claim.spares = task.spares;
  claim.snapshot_step = task.snapshot_step;
  claim.failed_step = task.failed_step;
  return claim;
}

uint64_t RecoveryCoordinator::PendingLocked(uint64_t incarnation) const {
  for (const auto& [id, task] : tasks_) {
    const int rank = ActiveRank(task, incarnation);
    if (task.published && rank > 0 && !task.picked[rank]) return id;
  }
  return 0;
}

std::optional<ReplayClaim> RecoveryCoordinator::TryClaim(uint64_t incarnation) {
  {
    absl::MutexLock lock(&mu_);
    if (const uint64_t id = PendingLocked(incarnation); id != 0) {
      Task& task = tasks_.at(id);
      const int rank = ActiveRank(task, incarnation);
      task.picked[rank] = true;
      return ClaimOf(id, task, rank);
    }
  }
  // A GLOBAL_CHECKPOINT restore has nothing to replay: one spare.
  const int wanted =
      EffectiveRecoveryPolicy(units_.config->job()) == REPLAY
          ? std::max(1, units_.config->job().fault_tolerance().recovery_parallelism())
          : 1;
  // Membership tells this coordinator of the task (OnRecoveryStarted) under its own lock.
  std::optional<RecoveryStart> start = units_.membership->StartRecovery(incarnation, wanted);
  if (!start.has_value()) return std::nullopt;
  ReplayClaim claim;
  claim.task_id = start->task_id;
  claim.slot = start->slot;
  claim.reached_step = start->reached_step;
  claim.rank = 0;
  claim.spares = start->spares;
  return claim;
}

absl::StatusOr<std::optional<ReplayClaim>> RecoveryCoordinator::ClaimReplay(
    uint64_t incarnation, absl::Duration timeout) {
  RETURN_IF_ERROR(units_.membership->CheckSpare(incarnation));
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, task] : tasks_) {
      const int rank = ActiveRank(task, incarnation);
      if (rank == 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("incarnation ", incarnation, " leads replay task ", id));
      }
      // A helper asking for work again has finished its part of a task (or given up on it).
      if (rank > 0 && task.picked[rank]) task.active[rank] = false;
    }
  }
  const rebound::RecoveryPolicy kind = EffectiveRecoveryPolicy(units_.config->job());
  if (kind != REPLAY && kind != GLOBAL_CHECKPOINT) {
    // No tasks under this policy: the spare just waits out its long poll (a heartbeat hands it
    // a lost slot), and status shows it waiting.
    static const bool kNever = false;
    absl::MutexLock lock(&mu_);
    waiting_.insert(incarnation);
    mu_.AwaitWithTimeout(absl::Condition(&kNever), timeout);
    waiting_.erase(incarnation);
    return std::optional<ReplayClaim>();
  }
  {
    absl::MutexLock lock(&mu_);
    waiting_.insert(incarnation);
    between_polls_.erase(incarnation);
  }
  const absl::Time start = units_.clock->Now();
  absl::StatusOr<std::optional<ReplayClaim>> result = std::optional<ReplayClaim>();
  for (bool first = true;; first = false) {
    if (!first) {
      // It may have been fenced while waiting.
      if (absl::Status spare = units_.membership->CheckSpare(incarnation); !spare.ok()) {
        result = spare;
        break;
      }
    }
    if (std::optional<ReplayClaim> claim = TryClaim(incarnation); claim.has_value()) {
      result = std::move(claim);
      break;
    }
    const absl::Duration left = timeout - (units_.clock->Now() - start);
    if (left <= absl::ZeroDuration()) break;
    // Woken by a publication for this spare or by Membership saying a slot may be claimed; a
    // claim another spare won meanwhile sends it back to waiting.
    absl::MutexLock lock(&mu_);
    auto claimable = [this, incarnation]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return claimable_ || PendingLocked(incarnation) != 0;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&claimable), left)) break;
  }
  absl::MutexLock lock(&mu_);
  waiting_.erase(incarnation);
  // Empty-handed: it polls again at once, and is idle until then. (Spares that never came back,
  // gone or busy elsewhere, are forgotten here.)
  const absl::Time now = units_.clock->Now();
  for (auto it = between_polls_.begin(); it != between_polls_.end();) {
    it = now - it->second > kRepollGrace ? between_polls_.erase(it) : std::next(it);
  }
  if (result.ok() && !result->has_value()) between_polls_[incarnation] = now;
  return result;
}

void RecoveryCoordinator::PublishReplay(uint64_t task_id, int64_t snapshot_step,
                                        int64_t failed_step) {
  absl::MutexLock lock(&mu_);
  auto it = tasks_.find(task_id);
  if (it == tasks_.end()) return;
  it->second.snapshot_step = snapshot_step;
  it->second.failed_step = failed_step;
  it->second.published = true;
}

absl::StatusOr<std::pair<int64_t, int64_t>> RecoveryCoordinator::PublishedRange(
    uint64_t task_id, uint64_t incarnation) const {
  absl::MutexLock lock(&mu_);
  auto it = tasks_.find(task_id);
  if (it != tasks_.end() && ActiveRank(it->second, incarnation) == 0 && it->second.published) {
    return std::make_pair(it->second.snapshot_step, it->second.failed_step);
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "incarnation ", incarnation, " leads no published replay task ", task_id));
}

void RecoveryCoordinator::AbandonReplay(uint64_t task_id, const std::string& why) {
  units_.membership->AbandonRecovery(task_id, ABANDONED, why);
}

absl::StatusOr<std::optional<RegisterResponse>> RecoveryCoordinator::FinishReplay(
    uint64_t incarnation, const ReportRecoveryRequest& report, const Membership::ReplayEnd& end) {
  RETURN_IF_ERROR(units_.membership->CheckAlive(incarnation));
  std::optional<int64_t> replayed_from;
  {
    absl::MutexLock lock(&mu_);
    auto it = tasks_.find(report.task_id());
    if (it == tasks_.end() || ActiveRank(it->second, incarnation) != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "incarnation ", incarnation, " leads no replay task ", report.task_id()));
    }
    // From the task's snapshot: a recovery group's oldest, which may precede the slot's own.
    if (it->second.published) replayed_from = it->second.snapshot_step;
  }
  // The task may end meanwhile (a fence, the timeout): Membership then finds its slot no longer
  // RECOVERING under it and answers FAILED_PRECONDITION, as above.
  return units_.membership->FinishRecovery(incarnation, report, end, replayed_from);
}

std::vector<uint64_t> RecoveryCoordinator::IdleSpares() const {
  const absl::Time now = units_.clock->Now();
  absl::MutexLock lock(&mu_);
  std::vector<uint64_t> idle;
  auto add_unless_busy = [&](uint64_t spare) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    bool busy = false;
    for (const auto& [id, task] : tasks_) busy = busy || ActiveRank(task, spare) >= 0;
    if (!busy) idle.push_back(spare);
  };
  for (uint64_t spare : waiting_) add_unless_busy(spare);
  for (const auto& [spare, left] : between_polls_) {
    if (now - left <= kRepollGrace) add_unless_busy(spare);
  }
  return idle;
}

void RecoveryCoordinator::OnRecoveryStarted(const RecoveryStart& start) {
  const absl::Time now = units_.clock->Now();
  absl::MutexLock lock(&mu_);
  Task& task = tasks_[start.task_id];
  task.slot = start.slot;
  task.reached_step = start.reached_step;
  task.spares = start.spares;
  task.active.assign(start.spares.size(), true);
  task.picked.assign(start.spares.size(), false);
  task.picked[0] = true;
  task.started = now;
}

uint64_t RecoveryCoordinator::TaskOf(uint64_t incarnation) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, task] : tasks_) {
    if (ActiveRank(task, incarnation) >= 0) return id;
  }
  return 0;
}

void RecoveryCoordinator::OnRecoveryEnded(uint64_t task_id) {
  absl::MutexLock lock(&mu_);
  tasks_.erase(task_id);
}

void RecoveryCoordinator::OnClaimableChanged(bool claimable) {
  absl::MutexLock lock(&mu_);
  claimable_ = claimable;
}

void RecoveryCoordinator::OnServerPaused(absl::Duration paused) {
  const absl::Time now = units_.clock->Now();
  absl::MutexLock lock(&mu_);
  for (auto& [id, task] : tasks_) task.started = std::min(now, task.started + paused);
}

void RecoveryCoordinator::OnRestartedFromCenter(uint64_t spare_incarnation,
                                                const RegisterResponse& takeover) {
  const SlotId& slot = takeover.slot();
  // A restart from the center charges nobody (docs/weighting.md): the lost trainer was charged
  // when declared failed; a slot that is really off shows in its divergence at once. The spare
  // brings its own score.
  units_.tracker->SetOwner(slot, units_.membership->NameOf(takeover.incarnation()));
  units_.tracker->SetLive(slot, true);
  LOG(WARNING) << "slot " << SlotName(slot) << " restarted from the center by incarnation "
               << spare_incarnation << ", now incarnation " << takeover.incarnation()
               << " from step " << takeover.start_step();
}

uint64_t RecoveryCoordinator::SyncEpoch() const { return policy()->SyncEpoch(); }

absl::Status RecoveryCoordinator::AfterSync(const SlotId& slot, int64_t step, uint64_t epoch) {
  return policy()->AfterSync(slot, step, epoch);
}

void RecoveryCoordinator::AfterDetection() {
  const absl::Duration timeout =
      absl::Milliseconds(units_.config->job().fault_tolerance().recovery_timeout_ms());
  const absl::Time now = units_.clock->Now();
  std::vector<uint64_t> expired;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, task] : tasks_) {
      if (now - task.started > timeout) expired.push_back(id);
    }
  }
  for (uint64_t id : expired) {
    units_.membership->AbandonRecovery(
        id, ABANDONED,
        absl::StrCat("the replay took longer than recovery_timeout_ms = ",
                     absl::ToInt64Milliseconds(timeout)));
  }
  policy()->AfterDetection();
}

void RecoveryCoordinator::FillStatus(GetStatusResponse* response) const {
  {
    absl::MutexLock lock(&mu_);
    for (WorkerStatus& worker : *response->mutable_workers()) {
      if (worker.role() != SPARE || worker.state() != ALIVE) continue;
      worker.set_waiting_for_task(waiting_.count(worker.incarnation()) > 0);
      for (const auto& [id, task] : tasks_) {
        if (ActiveRank(task, worker.incarnation()) >= 0) worker.set_replay_task(id);
      }
    }
  }
  policy()->FillStatus(response);
}

}  // namespace rebound::server
