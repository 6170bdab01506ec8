#include "server/membership.h"

#include "common/request_fields.h"

#include <glog/logging.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/config.h"
#include "common/security.h"
#include "common/slot.h"
#include "common/status_macros.h"

namespace rebound::server {
namespace {

int64_t Millis(absl::Duration d) { return absl::ToInt64Milliseconds(d); }

// Upper bounds of RecoveryDurations' buckets, in seconds: a crash found by its session and
// rebuilt by a short replay takes a few hundred ms; a hang (the heartbeat timeout) seconds; a
// slot that waits for a spare minutes.
constexpr double kRecoveryDurationBounds[] = {0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800};

void ObserveRecoveryDuration(absl::Duration d, RecoveryPolicy policy, RecoveryDurations* h) {
  constexpr int kBounds = sizeof(kRecoveryDurationBounds) / sizeof(kRecoveryDurationBounds[0]);
  if (h->bucket_counts_size() == 0) {
    h->set_policy(policy);
    for (double bound : kRecoveryDurationBounds) h->add_bucket_le_seconds(bound);
    for (int i = 0; i <= kBounds; ++i) h->add_bucket_counts(0);
  }
  const double seconds = absl::ToDoubleSeconds(d);
  int bucket = 0;
  while (bucket < kBounds && seconds > kRecoveryDurationBounds[bucket]) ++bucket;
  h->set_bucket_counts(bucket, h->bucket_counts(bucket) + 1);
  h->set_sum_seconds(h->sum_seconds() + seconds);
  h->set_count(h->count() + 1);
}

}  // namespace

Membership::Membership(const JobConfig& job, const Clock* clock, PersistFn persist)
    : job_(job),
      clock_(clock),
      persist_(std::move(persist)),
      failure_timeout_(absl::Milliseconds(job.fault_tolerance().failure_timeout_ms())),
      crash_confirm_(absl::Milliseconds(job.fault_tolerance().crash_confirm_ms())),
      stall_after_(absl::Milliseconds(2 * job.fault_tolerance().heartbeat_interval_ms())),
      epoch_(static_cast<uint64_t>(absl::ToUnixSeconds(clock->Now())) & 0xFFFFFFFFu) {
  {
    absl::MutexLock lock(&mu_);
    last_flush_sequence_ = std::max<int64_t>(0, absl::ToUnixMicros(clock->Now()));
  }
  const int replicas = job.topology().replicas();
  const int stages = job.topology().stages();
  for (int r = 0; r < replicas; ++r) {
    for (int s = 0; s < stages; ++s) {
      Slot slot;
      slot.id.set_replica(r);
      slot.id.set_stage(s);
      slots_.push_back(slot);
    }
  }
}

absl::StatusOr<RegisterResponse> Membership::Register(const RegisterRequest& request) {
  if (!request.job_id().empty() && request.job_id() != job_.job_id()) {
    return absl::FailedPreconditionError(absl::StrCat("this server runs job \"", job_.job_id(),
                                                      "\", not \"", request.job_id(), "\""));
  }
  RETURN_IF_ERROR(ValidateWorkerName(request.worker_name()));
  if (request.peer_address().size() > 256) {
    return absl::InvalidArgumentError("peer_address is longer than 256 characters");
  }
  if (request.metrics_address().size() > 256) {
    return absl::InvalidArgumentError("metrics_address is longer than 256 characters");
  }
  const WorkerRole requested = request.requested_role();
  if (!WorkerRole_IsValid(requested)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown requested_role ", requested));
  }

  absl::StatusOr<std::string> credential = NewWorkerCredential();
  if (!credential.ok()) return credential.status();

  const absl::Time now = clock_->Now();
  absl::ReleasableMutexLock lock(&mu_);
  int slot_index = -1;
  WorkerRole role = requested;
  if (requested == TRAINER || requested == ROLE_UNSPECIFIED) {
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (slots_[i].state == UNASSIGNED) {
        slot_index = static_cast<int>(i);
        break;
      }
    }
    if (slot_index < 0 && requested == TRAINER) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "all ", slots_.size(), " trainer slots are owned; register as a spare instead"));
    }
    role = slot_index >= 0 ? TRAINER : SPARE;
  }

  Worker worker;
  worker.incarnation = (epoch_ << 32) | next_counter_++;
  worker.name = request.worker_name();
  worker.role = role;
  worker.peer_address = request.peer_address();
  worker.metrics_address = request.metrics_address();
  worker.registered = now;
  worker.last_heartbeat = now;
  worker.heard = now;
  worker.slot_index = slot_index;
  worker.credential = *credential;

  RegisterResponse response;
  response.set_incarnation(worker.incarnation);
  response.set_credential(*std::move(credential));
  response.set_role(role);
  *response.mutable_job() = job_;
  if (slot_index >= 0) {
    Slot& slot = slots_[slot_index];
    slot.state = ACTIVE;
    slot.owner = worker.incarnation;
    slot.detail.clear();
    *response.mutable_slot() = slot.id;
    response.set_start_step(slot.step);
  }
  workers_.emplace(worker.incarnation, worker);
  const uint64_t seq = MarkDirtyLocked();
  if (slot_index >= 0) {
    for (Neighbour& n : NeighboursLocked(slot_index)) *response.add_neighbours() = n;
    if (!first_trainer_at_.has_value()) first_trainer_at_ = now;
    if (StartHeldLocked(now)) response.set_hold_start(true);
  }
  lock.Release();
  // Written without mu_ (see the class comment); the worker learns its incarnation only after.
  absl::Status persisted = Persist(seq);
  if (persisted.ok()) return response;
  // Undone: its record goes, and its slot if it still owns it (a failure detection may have
  // fenced it meanwhile, making the slot LOST). The undoing is written in turn: a later write
  // that held the registration would otherwise leave a restarted server waiting, until its
  // failure_timeout, for an owner that never heard of its slot.
  uint64_t undo = 0;
  {
    absl::MutexLock relock(&mu_);
    if (workers_.erase(worker.incarnation) > 0) undo = MarkDirtyLocked();
    if (slot_index >= 0 && slots_[slot_index].owner == worker.incarnation) {
      slots_[slot_index].state = UNASSIGNED;
      slots_[slot_index].owner = 0;
      undo = MarkDirtyLocked();
    }
  }
  PersistOrLog(undo, "the undoing of a registration that could not be persisted");
  return absl::UnavailableError(
      absl::StrCat("cannot persist the registration: ", persisted.message()));
}

bool Membership::StartHeldLocked(absl::Time now) {
  if (start_released_) return false;
  const TopologyConfig& topology = job_.topology();
  int owned = 0;
  bool progressed = false;
  for (const Slot& slot : slots_) {
    if (slot.owner != 0) ++owned;
    progressed = progressed || slot.step > 0 || slot.synced_step > 0;
  }
  const absl::Duration waited =
      first_trainer_at_.has_value() ? now - *first_trainer_at_ : absl::ZeroDuration();
  if (topology.min_trainers() <= 0 || progressed) {
    start_released_ = true;
  } else if (owned >= topology.min_trainers()) {
    start_released_ = true;
    LOG(INFO) << "start barrier: " << owned << " of " << slots_.size()
              << " slots have a trainer (min_trainers " << topology.min_trainers()
              << "); training starts after " << absl::FormatDuration(waited);
  } else if (first_trainer_at_.has_value() &&
             waited >= absl::Milliseconds(topology.start_barrier_ms())) {
    start_released_ = true;
    LOG(WARNING) << "start barrier: only " << owned << " of min_trainers "
                 << topology.min_trainers() << " trainers registered within start_barrier_ms "
                 << topology.start_barrier_ms() << "; training starts with them";
  }
  return !start_released_;
}

absl::Status Membership::CheckAliveLocked(uint64_t incarnation) const {
  auto it = workers_.find(incarnation);
  if (it == workers_.end()) {
    const uint64_t epoch = incarnation >> 32;
    const uint64_t counter = incarnation & 0xFFFFFFFFu;
    // Issued in this server life and forgotten: fenced (its record was pruned). Issued before a
    // restart (Restore brings back only the slots' owners): unknown, like a stranger's.
    if (epoch == epoch_ && counter >= first_counter_of_life_ && counter < next_counter_) {
      return absl::FailedPreconditionError(
          absl::StrCat("incarnation ", incarnation, " is fenced; register again"));
    }
    return absl::AbortedError(absl::StrCat("incarnation ", incarnation,
                                           " is unknown to this server (restarted?); register "
                                           "again"));
  }
  const Worker& worker = it->second;
  if (worker.state == ROLLED_BACK) {
    return absl::AbortedError(absl::StrCat("incarnation ", incarnation, " (worker ", worker.name,
                                           ") was rolled back: ", worker.state_reason,
                                           "; register again"));
  }
  if (worker.state != ALIVE) {
    return absl::FailedPreconditionError(absl::StrCat(
        "incarnation ", incarnation, " (worker ", worker.name, ") is fenced: ",
        WorkerState_Name(worker.state), ": ", worker.state_reason, "; register again"));
  }
  return absl::OkStatus();
}

absl::Status Membership::Authenticate(uint64_t incarnation,
                                      absl::string_view credential) const {
  absl::MutexLock lock(&mu_);
  // Unknown or fenced: the call can do nothing as that worker, whoever sends it; say why.
  RETURN_IF_ERROR(CheckAliveLocked(incarnation));
  const Worker& worker = workers_.at(incarnation);
  if (worker.credential.empty()) {
    return absl::AbortedError(absl::StrCat(
        "incarnation ", incarnation, " was restored from a data directory that holds no worker "
        "credential for it; register again"));
  }
  if (!ConstantTimeEquals(credential, worker.credential)) {
    return absl::UnauthenticatedError(absl::StrCat(
        "the call acts as incarnation ", incarnation, " but does not carry its worker credential "
        "(metadata ", kWorkerCredentialKey, ", from the reply to its Register)"));
  }
  return absl::OkStatus();
}

absl::Status Membership::CheckAlive(uint64_t incarnation) const {
  absl::MutexLock lock(&mu_);
  return CheckAliveLocked(incarnation);
}

absl::Status Membership::CheckRole(uint64_t incarnation, WorkerRole role) const {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckAliveLocked(incarnation));
  const Worker& worker = workers_.at(incarnation);
  if (worker.role != role) {
    return absl::PermissionDeniedError(absl::StrCat("incarnation ", incarnation, " is a ",
                                                    WorkerRole_Name(worker.role), ", not a ",
                                                    WorkerRole_Name(role)));
  }
  return absl::OkStatus();
}

absl::StatusOr<HeartbeatResponse> Membership::Heartbeat(const HeartbeatRequest& request) {
  if (request.step() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("step must be >= 0, got ", request.step()));
  }
  if (request.step() > job_.training().max_steps()) {
    return absl::InvalidArgumentError(absl::StrCat("step must be <= training.max_steps = ",
                                                   job_.training().max_steps(), ", got ",
                                                   request.step()));
  }
  const absl::Time now = clock_->Now();
  WriteLock lock(this, "a takeover");
  absl::Status alive = CheckAliveLocked(request.incarnation());
  if (!alive.ok()) return alive;
  Worker& worker = workers_.at(request.incarnation());
  worker.last_heartbeat = now;
  worker.heard = now;
  if (worker.takeover_task != 0) {
    if (RecoveryStatus* r = FindRecoveryLocked(worker.takeover_task)) {
      r->mutable_phases()->set_takeover_ms(Millis(now - worker.handed_over));
    }
    worker.takeover_task = 0;
  }
  worker.step = request.step();
  if (request.has_loss() && std::isfinite(request.loss())) worker.loss = request.loss();
  if (request.has_flushes_done()) {
    worker.flushes_done = std::max(worker.flushes_done, request.flushes_done());
  }
  worker.blocked_reason = request.blocked_reason().substr(0, 512);
  HeartbeatResponse response;
  response.set_server_time_ms(absl::ToUnixMillis(now));
  if (worker.role == SPARE) {
    std::optional<RegisterResponse> takeover = MaybeTakeOverLocked(worker, now);
    if (takeover.has_value()) *response.mutable_takeover() = *std::move(takeover);
  }
  bool all_finished = true;
  for (const Slot& slot : slots_) all_finished = all_finished && slot.state == FINISHED;
  if (all_finished) response.add_commands(STOP);
  if (worker.draining) response.add_commands(DRAIN);
  if (worker.flushes_done < worker.flushes_requested) {
    response.add_commands(FLUSH_LOG);
    response.set_flush_sequence(worker.flushes_requested);
  }
  if (worker.slot_index >= 0) {
    slots_[worker.slot_index].step = std::max(slots_[worker.slot_index].step, request.step());
    for (Neighbour& n : NeighboursLocked(worker.slot_index)) *response.add_neighbours() = n;
    if (worker.role == TRAINER && StartHeldLocked(now)) response.set_hold_start(true);
  }
  // A neighbour's flush or the time passed may have made a lost slot claimable.
  NotifyClaimableLocked();
  return response;
}

void Membership::FenceLocked(Worker& worker, WorkerState state, const std::string& why) {
  worker.state = state;
  worker.state_reason = why;
  if (observer_ != nullptr) {
    if (Slot* slot = RecoveringSlotLocked(observer_->TaskOf(worker.incarnation))) {
      ReleaseTaskLocked(*slot, SPARE_FAILED,
                        absl::StrCat("spare ", worker.incarnation, " ", WorkerState_Name(state),
                                     " during the replay: ", why));
    }
  }
  if (worker.slot_index >= 0) {
    Slot& slot = slots_[worker.slot_index];
    if (slot.owner == worker.incarnation && slot.state != FINISHED) {
      slot.state = LOST;
      slot.owner = 0;
      slot.lost_at = clock_->Now();
      slot.detection_ms = state == FAILED ? worker.detection_ms_at_failure : 0;
      slot.detection_ms_total += slot.detection_ms;
      slot.failed_replays = 0;  // a new loss
      slot.detail = absl::StrCat("owner incarnation ", worker.incarnation, " ",
                                 WorkerState_Name(state), ": ", why);
      if (EffectiveRecoveryPolicy(job_) == REPLAY) {
        absl::StrAppend(&slot.detail, "; waiting for a spare to replay it");
        std::vector<Worker*> neighbours = NeighbourOwnersLocked(worker.slot_index);
        if (!neighbours.empty()) {
          // Sender-side logging (docs/design.md §5.2): what the lost stage received may still sit in its
          // neighbours' log buffers. They flush on their next heartbeat; the replay waits for
          // that, at most one failure_timeout (a neighbour that does not answer is failing too).
          const int64_t sequence = ++last_flush_sequence_;
          for (Worker* n : neighbours) n->flushes_requested = sequence;
          slot.flush_deadline = clock_->Now() + failure_timeout_;
          absl::StrAppend(&slot.detail, " once its neighbours have flushed their step logs");
        }
      } else if (EffectiveRecoveryPolicy(job_) == GLOBAL_CHECKPOINT) {
        absl::StrAppend(&slot.detail, "; every slot rolls back to the last global checkpoint");
        if (state != ROLLED_BACK && !rollback_requested_) {
          rollback_requested_ = true;
          rollback_why_ = absl::StrCat("slot ", SlotName(slot.id),
                                       " lost its trainer '", worker.name, "' (",
                                       WorkerState_Name(state), ": ", why, ")");
        }
      } else {
        absl::StrAppend(&slot.detail, "; waiting for a spare (RESTART_FROM_CENTER)");
      }
    }
  }
  PruneLocked();
  MarkDirtyLocked();  // written by the public method's WriteLock
  NotifyClaimableLocked();
}

std::optional<RegisterResponse> Membership::MaybeTakeOverLocked(Worker& spare, absl::Time now) {
  const bool restart_policy = EffectiveRecoveryPolicy(job_) == RESTART_FROM_CENTER;
  int index = -1;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].state == LOST && (restart_policy || slots_[i].fallback_restart)) {
      index = static_cast<int>(i);
      break;
    }
  }
  if (index < 0) return std::nullopt;
  Slot& slot = slots_[index];

  RecoveryStatus recovery;
  recovery.set_task_id(next_task_id_++);
  *recovery.mutable_slot() = slot.id;
  recovery.set_policy(RESTART_FROM_CENTER);
  recovery.set_failed_step(slot.step);
  recovery.set_steps_replayed(0);
  recovery.mutable_phases()->set_detection_ms(
      slot.detection_ms);
  recovery.mutable_phases()->set_takeover_ms(
      std::max<int64_t>(0, absl::ToInt64Milliseconds(now - slot.lost_at)));
  recovery.set_verified(false);
  recovery.set_outcome(RECOVERED);
  recovery.set_detail(absl::StrCat(
      slot.quarantined        ? "after a QUARANTINE: "
      : slot.fallback_restart ? "FALLBACK after a failed replay: "
                              : "",
      "spare '", spare.name,
      "' restarts the slot from the center at step ", slot.synced_step,
      " with fresh optimizer state; ", slot.step - slot.synced_step,
      " steps since the last sync are lost"));
  slot.fallback_restart = false;
  slot.quarantined = false;
  RegisterResponse takeover =
      HandOverLocked(index, spare, now,
                     absl::StrCat("restarted from the center by '", spare.name, "'"),
                     slot.synced_step, RESTART_FROM_CENTER);
  recovery.add_spares(takeover.incarnation());
  recoveries_.push_back(recovery);
  if (recoveries_.size() > kMaxRecoveries) recoveries_.erase(recoveries_.begin());
  return takeover;
}

void Membership::RestartSlotAtLocked(Slot& slot, int64_t step) {
  slot.steps_discarded += std::max<int64_t>(0, slot.step - step);
  slot.step = step;
  slot.step_at_account = step;
  slot.progress_at = clock_->Now();  // a new trainer: stalled only after stall_after_
}

RegisterResponse Membership::HandOverLocked(int index, Worker& spare, absl::Time now,
                                            const std::string& detail, int64_t start_step,
                                            RecoveryPolicy policy) {
  Slot& slot = slots_[index];
  ObserveRecoveryDuration(
      absl::Milliseconds(slot.detection_ms) + std::max(absl::ZeroDuration(), now - slot.lost_at),
      policy, &recovery_durations_[policy]);
  Worker trainer;
  trainer.incarnation = (epoch_ << 32) | next_counter_++;
  trainer.name = spare.name;
  trainer.role = TRAINER;
  trainer.peer_address = spare.peer_address;
  trainer.metrics_address = spare.metrics_address;
  trainer.registered = now;
  trainer.last_heartbeat = now;
  trainer.heard = now;
  trainer.slot_index = index;
  trainer.step = start_step;
  trainer.credential = spare.credential;

  slot.state = ACTIVE;
  slot.owner = trainer.incarnation;
  RestartSlotAtLocked(slot, start_step);
  slot.detail = detail;
  slot.task_id = 0;
  slot.failed_replays = 0;
  workers_.emplace(trainer.incarnation, trainer);
  Worker& replaced = spare;  // fenced below; the reference stays valid (std::map)
  replaced.state = REPLACED;
  replaced.state_reason =
      absl::StrCat("took over slot ", SlotName(slot.id), " as incarnation ", trainer.incarnation);
  MarkDirtyLocked();  // written by the public method's WriteLock

  RegisterResponse takeover;
  takeover.set_incarnation(trainer.incarnation);
  takeover.set_role(TRAINER);
  *takeover.mutable_slot() = slot.id;
  *takeover.mutable_job() = job_;
  takeover.set_start_step(slot.synced_step);
  for (Neighbour& n : NeighboursLocked(index)) *takeover.add_neighbours() = n;
  return takeover;
}

RecoveryStatus* Membership::FindRecoveryLocked(uint64_t task_id) {
  for (RecoveryStatus& r : recoveries_) {
    if (r.task_id() == task_id) return &r;
  }
  return nullptr;
}

void Membership::ReleaseTaskLocked(Slot& slot, RecoveryOutcome outcome, const std::string& why) {
  if (RecoveryStatus* r = FindRecoveryLocked(slot.task_id)) {
    r->set_outcome(outcome);
    r->set_detail(why);
  }
  LOG(WARNING) << "replay task " << slot.task_id << " of slot " << SlotName(slot.id)
               << " ended without a takeover: " << why;
  const uint64_t task_id = slot.task_id;
  slot.state = LOST;
  slot.task_id = 0;
  ++slot.failed_replays;
  // A bounded retry, then the fallback: a replay that fails the same way every time (a spare
  // that cannot rebuild this slot's optimizer, a step log that cannot be read) must not leave
  // the slot LOST while a spare could restart it from the center. A pipeline stage cannot be
  // restarted apart from its neighbours: it waits for a replay that succeeds.
  const int attempts = job_.fault_tolerance().max_replay_attempts();
  if (!slot.fallback_restart && EffectiveRecoveryPolicy(job_) == REPLAY &&
      job_.topology().stages() == 1 && slot.failed_replays >= attempts) {
    slot.fallback_restart = true;
    LOG(ERROR) << "slot " << SlotName(slot.id) << ": " << slot.failed_replays
               << " replays failed (fault_tolerance.max_replay_attempts = " << attempts
               << "); falling back to RESTART_FROM_CENTER for this slot";
  }
  slot.detail =
      slot.fallback_restart
          ? absl::StrCat("waiting for a spare to restart it from the center (FALLBACK after ",
                         slot.failed_replays, slot.failed_replays == 1 ? " failed replay" :
                                                                          " failed replays",
                         "); the last attempt: ", why)
          : absl::StrCat("waiting for a spare to replay it; the last attempt: ", why);
  if (observer_ != nullptr) observer_->OnRecoveryEnded(task_id);
  NotifyClaimableLocked();
}

void Membership::SetRecoveryObserver(RecoveryObserver* observer) {
  absl::MutexLock lock(&mu_);
  observer_ = observer;
  NotifyClaimableLocked();
}

absl::Status Membership::CheckSpare(uint64_t incarnation) const {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckAliveLocked(incarnation));
  const Worker& worker = workers_.at(incarnation);
  if (worker.role != SPARE) {
    return absl::FailedPreconditionError(absl::StrCat(
        "incarnation ", incarnation, " is a ", WorkerRole_Name(worker.role), ", not a spare"));
  }
  return absl::OkStatus();
}

int Membership::ClaimableSlotLocked(absl::Time now) {
  if (rollback_requested_) return -1;  // GLOBAL_CHECKPOINT: restores wait for the rollback
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].state == LOST && !slots_[i].fallback_restart &&
        FlushedLocked(static_cast<int>(i), now)) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

void Membership::NotifyClaimableLocked() {
  if (observer_ == nullptr) return;
  observer_->OnClaimableChanged(ClaimableSlotLocked(clock_->Now()) >= 0);
}

Membership::Slot* Membership::RecoveringSlotLocked(uint64_t task_id) {
  if (task_id == 0) return nullptr;
  for (Slot& slot : slots_) {
    if (slot.state == RECOVERING && slot.task_id == task_id) return &slot;
  }
  return nullptr;
}

std::optional<RecoveryStart> Membership::StartRecovery(uint64_t leader, int max_spares) {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  const int index = ClaimableSlotLocked(now);
  if (index < 0) {
    NotifyClaimableLocked();
    return std::nullopt;
  }
  Slot& slot = slots_[index];
  const RecoveryPolicy policy = EffectiveRecoveryPolicy(job_);
  slot.state = RECOVERING;
  slot.task_id = next_task_id_++;
  RecoveryStart start;
  start.task_id = slot.task_id;
  start.slot = slot.id;
  start.reached_step = slot.step;
  std::vector<uint64_t> members = {leader};
  // Helpers: other spares waiting right now, oldest first, none holding a task.
  if (observer_ != nullptr) {
    for (uint64_t other : observer_->IdleSpares()) {
      if (static_cast<int>(members.size()) >= max_spares) break;
      auto it = workers_.find(other);
      if (other == leader || it == workers_.end() || it->second.state != ALIVE ||
          it->second.role != SPARE) {
        continue;
      }
      members.push_back(other);
    }
  }
  std::string names;
  for (uint64_t member : members) {
    auto it = workers_.find(member);
    start.spares.push_back(
        TaskSpare{member, it == workers_.end() ? std::string() : it->second.peer_address});
    absl::StrAppend(&names, names.empty() ? "" : ", ", "'",
                    it == workers_.end() ? std::string() : it->second.name, "'");
  }
  slot.detail = absl::StrCat(policy == REPLAY ? "replayed by " : "restored by ", members.size(),
                             members.size() == 1 ? " spare " : " spares ", names, " (task ",
                             slot.task_id, ")");
  RecoveryStatus recovery;
  recovery.set_task_id(slot.task_id);
  *recovery.mutable_slot() = slot.id;
  recovery.set_policy(policy);
  recovery.set_failed_step(policy == REPLAY ? slot.step : slot.rolled_back_from);
  for (uint64_t member : members) recovery.add_spares(member);
  recovery.mutable_phases()->set_detection_ms(slot.detection_ms);
  recoveries_.push_back(recovery);
  if (recoveries_.size() > kMaxRecoveries) recoveries_.erase(recoveries_.begin());
  if (observer_ != nullptr) observer_->OnRecoveryStarted(start);
  NotifyClaimableLocked();
  return start;
}

void Membership::AbandonRecovery(uint64_t task_id, RecoveryOutcome outcome,
                                 const std::string& why) {
  absl::MutexLock lock(&mu_);
  if (Slot* slot = RecoveringSlotLocked(task_id)) ReleaseTaskLocked(*slot, outcome, why);
}

absl::StatusOr<std::optional<RegisterResponse>> Membership::FinishRecovery(
    uint64_t incarnation, const ReportRecoveryRequest& report, const ReplayEnd& end,
    std::optional<int64_t> replayed_from_step) {
  const absl::Time now = clock_->Now();
  WriteLock lock(this, "a takeover");
  RETURN_IF_ERROR(CheckAliveLocked(incarnation));
  Slot* recovering = RecoveringSlotLocked(report.task_id());
  if (recovering == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "incarnation ", incarnation, " leads no replay task ", report.task_id()));
  }
  Slot& slot = *recovering;
  const int index = static_cast<int>(&slot - slots_.data());
  RecoveryStatus* record = FindRecoveryLocked(report.task_id());
  if (record != nullptr) {
    record->set_steps_replayed(report.steps_replayed());
    record->set_verified(report.verified());
    const int64_t detection = record->phases().detection_ms();
    *record->mutable_phases() = report.phases();
    record->mutable_phases()->set_detection_ms(detection);
  }
  if (report.outcome() != RECOVERED) {
    slot.replay_ms_total += std::max<int64_t>(0, report.phases().replay_ms());
    // Before the release, which tells waiting claims whether a slot may be claimed: this one
    // may not once it falls back.
    if (end.fallback_restart) slot.fallback_restart = true;
    ReleaseTaskLocked(slot, end.outcome, end.why);
    return std::optional<RegisterResponse>();
  }
  Worker& spare = workers_.at(incarnation);
  // From the task's snapshot: a recovery group's oldest, which may precede the slot's own.
  const int64_t replayed_from = replayed_from_step.value_or(slot.synced_step);
  const uint64_t task_id = slot.task_id;
  const int64_t replayed_to = replayed_from + report.steps_replayed();
  slot.replay_ms_total += std::max<int64_t>(0, report.phases().replay_ms());
  RegisterResponse takeover = HandOverLocked(
      index, spare, now,
      absl::StrCat("rebuilt by replay of ", report.steps_replayed(), " steps by '", spare.name,
                   "'", report.verified() ? ", verified bit-identical" : ""),
      replayed_to, record != nullptr ? record->policy() : job_.fault_tolerance().policy());
  Worker& trainer = workers_.at(takeover.incarnation());
  trainer.step = replayed_to;
  trainer.takeover_task = report.task_id();
  trainer.handed_over = now;
  slot.step = replayed_to;
  takeover.set_start_step(replayed_to);
  if (observer_ != nullptr) observer_->OnRecoveryEnded(task_id);
  if (record != nullptr) {
    record->set_outcome(RECOVERED);
    if (record->policy() == GLOBAL_CHECKPOINT) {
      record->set_detail(absl::StrCat("restored from the global checkpoint of step ", replayed_to,
                                      "; ", std::max<int64_t>(0, slot.rolled_back_from - replayed_to),
                                      " steps of this slot are trained again"));
    } else {
      record->set_detail(absl::StrCat("rebuilt to step ", replayed_to,
                                      " from the snapshot at step ", replayed_from));
      if (absl::StartsWith(report.detail(), "replayed with its recovery group")) {
        absl::StrAppend(record->mutable_detail(), "; ", report.detail());
      }
    }
  }
  return std::optional<RegisterResponse>(takeover);
}

bool Membership::TakeRollbackRequest(std::string* why) {
  absl::MutexLock lock(&mu_);
  if (!rollback_requested_ || rollback_taken_) return false;
  rollback_taken_ = true;
  *why = rollback_why_;
  return true;
}

void Membership::RollBackAll(int64_t step, const std::string& why) {
  WriteLock lock(this, "a rollback");
  const std::string reason =
      absl::StrCat("rolled back to the global checkpoint of step ", step, ": ", why);
  // rollback_requested_ stays set until FinishRollback: StartRecovery hands out no restore while
  // the center and the books are still those of before the rollback.
  std::vector<int64_t> reached(slots_.size());
  for (size_t i = 0; i < slots_.size(); ++i) reached[i] = slots_[i].step;
  for (auto& [incarnation, worker] : workers_) {
    if (worker.state == ALIVE && worker.role == TRAINER) {
      worker.state = ROLLED_BACK;
      worker.state_reason = reason;
    }
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& slot = slots_[i];
    // A slot not restored since an earlier rollback keeps the step it had reached then.
    const bool restored = slot.state == ACTIVE || slot.state == FINISHED;
    slot.rolled_back_from = restored ? reached[i] : std::max(reached[i], slot.rolled_back_from);
    if (slot.state == RECOVERING) {
      ReleaseTaskLocked(slot, ABANDONED, reason);
    }
    slot.state = LOST;
    slot.owner = 0;
    slot.lost_at = clock_->Now();
    RestartSlotAtLocked(slot, step);
    slot.synced_step = step;
    slot.fallback_restart = false;
    slot.failed_replays = 0;
    slot.detail = absl::StrCat(reason, "; waiting for a spare to restore it");
  }
  MarkDirtyLocked();  // written by this method's WriteLock
  NotifyClaimableLocked();
}

void Membership::FinishRollback() {
  absl::MutexLock lock(&mu_);
  rollback_requested_ = false;
  rollback_taken_ = false;
  NotifyClaimableLocked();
}

std::vector<RecoveryStatus> Membership::Recoveries() const {
  absl::MutexLock lock(&mu_);
  return recoveries_;
}

absl::Status Membership::Persist(uint64_t seq) {
  if (!persist_ || seq == 0) return absl::OkStatus();
  absl::MutexLock persisting(&persist_mu_);
  // A write that began after this change (another caller's) holds it already.
  if (persisted_seq_ >= seq) return absl::OkStatus();
  ServerRecord server;
  std::vector<SlotRecord> slots;
  uint64_t snapshot_seq;
  {
    absl::MutexLock lock(&mu_);
    snapshot_seq = dirty_seq_;
    server.set_job_id(job_.job_id());
    server.set_incarnation_epoch(epoch_);
    server.set_next_incarnation_counter(next_counter_);
    for (const Slot& slot : slots_) {
      SlotRecord record;
      *record.mutable_slot() = slot.id;
      record.set_state(slot.state);
      record.set_owner_incarnation(slot.owner);
      record.set_step(slot.synced_step);
      if (slot.owner != 0) {
        const Worker& owner = workers_.at(slot.owner);
        record.set_owner_name(owner.name);
        record.set_owner_credential(owner.credential);
      }
      slots.push_back(std::move(record));
    }
  }
  // Without mu_: a replicated group's commit waits here for its in-sync standbys.
  absl::Status written = persist_(server, slots);
  if (written.ok()) persisted_seq_ = snapshot_seq;
  return written;
}

void Membership::PersistOrLog(uint64_t seq, const char* what) {
  absl::Status persisted = Persist(seq);
  if (!persisted.ok()) LOG(ERROR) << "cannot persist " << what << ": " << persisted;
}

Membership::WriteLock::WriteLock(Membership* membership, const char* what)
    : membership_(membership), what_(what) {
  membership_->mu_.Lock();
  start_seq_ = DirtySeq(*membership_);
}

Membership::WriteLock::~WriteLock() {
  const uint64_t now = DirtySeq(*membership_);
  membership_->mu_.Unlock();
  membership_->PersistOrLog(now != start_seq_ ? now : 0, what_);
}

uint64_t Membership::WriteLock::DirtySeq(const Membership& membership) {
  return membership.dirty_seq_;
}

absl::Status Membership::Restore(const ServerRecord& server, const std::vector<SlotRecord>& slots,
                                 absl::Duration grace, bool forget_owners) {
  if (server.job_id() != job_.job_id()) {
    return absl::InvalidArgumentError(absl::StrCat("the data directory holds job \"",
                                                   server.job_id(), "\", not \"", job_.job_id(),
                                                   "\""));
  }
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  for (const SlotRecord& record : slots) {
    const int index = SlotIndex(record.slot());
    if (index < 0) {
      return absl::InvalidArgumentError(absl::StrCat("the data directory holds slot ",
                                                     SlotName(record.slot()),
                                                     ", outside this job's topology"));
    }
  }
  if (forget_owners) {
    // epoch_ is this life's (the constructor's clock-based value); never the backup's.
    if (epoch_ == server.incarnation_epoch()) epoch_ = (epoch_ + 1) & 0xFFFFFFFFu;
    next_counter_ = 1;
  } else {
    epoch_ = server.incarnation_epoch();
    next_counter_ = std::max<uint64_t>(1, server.next_incarnation_counter());
  }
  first_counter_of_life_ = next_counter_;
  for (const SlotRecord& record : slots) {
    Slot& slot = slots_[SlotIndex(record.slot())];
    slot.state = record.state();
    slot.step = record.step();
    slot.synced_step = record.step();
    slot.lost_at = now;
    slot.owner = 0;
    if (!forget_owners && record.owner_incarnation() != 0 &&
        (record.state() == ACTIVE || record.state() == FINISHED)) {
      Worker worker;
      worker.incarnation = record.owner_incarnation();
      worker.name = record.owner_name();
      worker.credential = record.owner_credential();
      worker.role = TRAINER;
      worker.registered = now;
      worker.last_heartbeat = now + grace;
      worker.heard = now;  // the restore: it has not called this server yet
      worker.slot_index = SlotIndex(record.slot());
      worker.step = record.step();
      workers_[worker.incarnation] = worker;
      slot.owner = worker.incarnation;
    } else if (slot.state == ACTIVE) {
      slot.state = LOST;
    }
  }
  NotifyClaimableLocked();
  return absl::OkStatus();
}

int Membership::SlotIndex(const SlotId& slot) const {
  const int stages = job_.topology().stages();
  if (slot.replica() < 0 || slot.replica() >= job_.topology().replicas() || slot.stage() < 0 ||
      slot.stage() >= stages) {
    return -1;
  }
  return slot.replica() * stages + slot.stage();
}

absl::Status Membership::CheckOwner(uint64_t incarnation, const SlotId& slot) const {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckAliveLocked(incarnation));
  const int index = SlotIndex(slot);
  if (index < 0 || slots_[index].owner != incarnation) {
    return absl::FailedPreconditionError(absl::StrCat("incarnation ", incarnation,
                                                      " does not own slot ", SlotName(slot)));
  }
  return absl::OkStatus();
}

std::string Membership::NameOf(uint64_t incarnation) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(incarnation);
  return it == workers_.end() ? std::string() : it->second.name;
}

bool Membership::RecordProgress(const SlotId& slot, int64_t step, int64_t max_steps) {
  WriteLock lock(this, "a finished slot");
  const int index = SlotIndex(slot);
  if (index < 0) return false;
  Slot& s = slots_[index];
  s.step = std::max(s.step, step);
  s.synced_step = std::max(s.synced_step, step);
  if (step >= max_steps && s.state == ACTIVE) {
    s.state = FINISHED;
    s.detail = absl::StrCat("finished at step ", step);
    MarkDirtyLocked();  // written by this method's WriteLock
    return true;
  }
  return false;
}

bool Membership::AllFinished() const {
  absl::MutexLock lock(&mu_);
  for (const Slot& slot : slots_) {
    if (slot.state != FINISHED) return false;
  }
  return true;
}

void Membership::PruneLocked() {
  size_t fenced = 0;
  for (const auto& [incarnation, worker] : workers_) fenced += worker.state != ALIVE;
  // Incarnations increase, so iterating the map in order prunes the oldest records first.
  for (auto it = workers_.begin(); fenced > kMaxFencedRecords && it != workers_.end();) {
    if (it->second.state != ALIVE) {
      it = workers_.erase(it);
      --fenced;
    } else {
      ++it;
    }
  }
}

absl::Status Membership::Deregister(uint64_t incarnation, bool drained) {
  WriteLock lock(this, "a deregistration");
  absl::Status alive = CheckAliveLocked(incarnation);
  if (!alive.ok()) return alive;
  Worker& worker = workers_.at(incarnation);
  if (drained && worker.slot_index >= 0) {
    FenceLocked(worker, DRAINED,
                absl::StrCat("drained on request after its sync at step ",
                             slots_[worker.slot_index].synced_step));
  } else {
    FenceLocked(worker, DEPARTED, "deregistered");
  }
  return absl::OkStatus();
}

absl::Status Membership::Quarantine(uint64_t incarnation, const SlotId& slot,
                                    const std::string& why) {
  WriteLock lock(this, "a quarantine");
  RETURN_IF_ERROR(CheckAliveLocked(incarnation));
  const int index = SlotIndex(slot);
  if (index < 0 || slots_[index].owner != incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "incarnation ", incarnation, " no longer owns slot ", SlotName(slot)));
  }
  FenceLocked(workers_.at(incarnation), QUARANTINED, why);
  Slot& lost = slots_[index];
  if (lost.state == LOST) {
    lost.fallback_restart = true;
    lost.quarantined = true;
    lost.flush_deadline = absl::InfinitePast();
    lost.detail = absl::StrCat("owner incarnation ", incarnation, " quarantined: ", why,
                               "; waiting for a spare to restart it from the center (its "
                               "snapshots descend from the corrupted step)");
  }
  NotifyClaimableLocked();
  return absl::OkStatus();
}

bool Membership::AnySlotLost() const {
  absl::MutexLock lock(&mu_);
  for (const Slot& slot : slots_) {
    if (slot.state == LOST) return true;
  }
  return false;
}

absl::StatusOr<uint64_t> Membership::Drain(const SlotId& slot) {
  absl::MutexLock lock(&mu_);
  const int index = SlotIndex(slot);
  if (index < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("slot ", SlotName(slot), " is outside the job's topology"));
  }
  Slot& s = slots_[index];
  if (s.state != ACTIVE || s.owner == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "slot ", SlotName(slot), " is ", SlotState_Name(s.state), ": no trainer to drain"));
  }
  Worker& worker = workers_.at(s.owner);
  worker.draining = true;
  s.detail = absl::StrCat("draining '", worker.name, "': it leaves after its next sync");
  return s.owner;
}

absl::Status Membership::AttachSession(uint64_t incarnation, absl::Duration* back_after) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckAliveLocked(incarnation));
  Worker& worker = workers_.at(incarnation);
  if (worker.sessions >= kMaxSessionsPerWorker) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "incarnation ", incarnation, " already holds ", worker.sessions,
        " sessions (at most ", kMaxSessionsPerWorker, "); a worker needs one"));
  }
  const absl::Time now = clock_->Now();
  if (back_after != nullptr) {
    *back_after = worker.session_lost_at < now ? now - worker.session_lost_at
                                               : absl::ZeroDuration();
  }
  ++worker.sessions;
  worker.session_lost_at = absl::InfiniteFuture();
  worker.last_heartbeat = std::max(worker.last_heartbeat, now);
  worker.heard = now;
  return absl::OkStatus();
}

void Membership::DetachSession(uint64_t incarnation, bool lost) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(incarnation);
  if (it == workers_.end()) return;
  Worker& worker = it->second;
  worker.sessions = std::max(0, worker.sessions - 1);
  if (lost && worker.sessions == 0 && worker.state == ALIVE) {
    worker.session_lost_at = clock_->Now();
  }
}

std::vector<FailedWorker> Membership::DetectFailures() {
  const absl::Time now = clock_->Now();
  std::vector<FailedWorker> failed;
  WriteLock lock(this, "the fencing of a failed worker");
  for (auto& [incarnation, worker] : workers_) {
    if (worker.state != ALIVE) continue;
    // Against the deadline, which a restart's grace puts ahead of the last contact.
    const absl::Duration silent = now - worker.last_heartbeat;
    const bool crashed = crash_confirm_ > absl::ZeroDuration() && worker.sessions == 0 &&
                         now - worker.session_lost_at >= crash_confirm_;
    if (silent <= failure_timeout_ && !crashed) continue;
    FailedWorker f;
    f.incarnation = incarnation;
    f.name = worker.name;
    f.silent_for = now - worker.heard;  // never negative, also within a grace
    f.crashed = crashed && silent <= failure_timeout_;
    f.detected_after = f.crashed ? now - worker.session_lost_at : silent;
    if (worker.slot_index >= 0) {
      f.had_slot = true;
      f.slot = slots_[worker.slot_index].id;
    }
    failed.push_back(f);
  }
  for (const FailedWorker& f : failed) {
    workers_.at(f.incarnation).silent_ms_at_failure = Millis(f.silent_for);
    workers_.at(f.incarnation).detection_ms_at_failure = Millis(f.detected_after);
    FenceLocked(workers_.at(f.incarnation), FAILED,
                f.crashed
                    ? absl::StrFormat("its session ended %d ms ago without a Deregister and it "
                                      "did not attach again (crash_confirm %d ms): the process "
                                      "is gone",
                                      Millis(f.detected_after), Millis(crash_confirm_))
                    : absl::StrFormat("no heartbeat for %d ms (failure_timeout %d ms)",
                                      Millis(f.silent_for), Millis(failure_timeout_)));
  }
  // A lost slot's flush wait may have run out.
  NotifyClaimableLocked();
  return failed;
}

void Membership::ExcuseServerPause(absl::Duration paused) {
  if (paused <= absl::ZeroDuration()) return;
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  for (auto& [incarnation, worker] : workers_) {
    // A restored worker's heartbeat may lie ahead (reconnect grace): never moved back.
    if (worker.state != ALIVE) continue;
    // A lost session's confirmation window did not run either.
    if (worker.session_lost_at < now) {
      worker.session_lost_at = std::min(now, worker.session_lost_at + paused);
    }
    // Nor is the pause the worker's silence.
    worker.heard = std::min(now, worker.heard + paused);
    if (worker.last_heartbeat >= now) continue;
    worker.last_heartbeat = std::min(now, worker.last_heartbeat + paused);
  }
  if (observer_ != nullptr) observer_->OnServerPaused(paused);
}

bool Membership::SlotDown(const SlotId& slot) const {
  const int index = SlotIndex(slot);
  if (index < 0) return false;
  absl::MutexLock lock(&mu_);
  return slots_[index].state == LOST || slots_[index].state == RECOVERING;
}

std::vector<Membership::Worker*> Membership::NeighbourOwnersLocked(int slot_index) {
  // The stages whose logs a replay of the slot's recovery group reads: the group's live members
  // (stage 0's sample ids, the slot's neighbours' checksums are not needed but cost nothing) and
  // the stages just outside it, which logged the pairs they sent into it.
  std::vector<Worker*> owners;
  const int stages = job_.topology().stages();
  if (stages == 1) return owners;
  const int stage = slot_index % stages;
  const int first_of_replica = slot_index - stage;
  const auto [first, end] = RecoveryGroup(job_, stage);
  for (int s = std::max(0, first - 1); s <= std::min(stages - 1, end); ++s) {
    if (s == stage) continue;
    const Slot& slot = slots_[first_of_replica + s];
    auto it = workers_.find(slot.owner);
    if (slot.owner != 0 && it != workers_.end() && it->second.state == ALIVE) {
      owners.push_back(&it->second);
    }
  }
  return owners;
}

bool Membership::FlushedLocked(int slot_index, absl::Time now) {
  if (now >= slots_[slot_index].flush_deadline) return true;
  for (Worker* n : NeighbourOwnersLocked(slot_index)) {
    if (n->flushes_done < n->flushes_requested) return false;
  }
  return true;
}

std::vector<Neighbour> Membership::NeighboursLocked(int slot_index) const {
  std::vector<Neighbour> neighbours;
  const int stages = job_.topology().stages();
  const int stage = slot_index % stages;
  for (int other : {slot_index - 1, slot_index + 1}) {
    const int other_stage = stage + (other - slot_index);
    if (other_stage < 0 || other_stage >= stages) continue;
    const Slot& slot = slots_[other];
    Neighbour n;
    *n.mutable_slot() = slot.id;
    if (slot.owner != 0) {
      n.set_incarnation(slot.owner);
      n.set_peer_address(workers_.at(slot.owner).peer_address);
    }
    neighbours.push_back(n);
  }
  return neighbours;
}

namespace {

// A slot's goodput from its accounts (SlotGoodput's definitions, proto/rebound.proto).
SlotGoodput GoodputOf(absl::Duration active, absl::Duration lost, absl::Duration recovering,
                      absl::Duration blocked, int64_t active_steps, int64_t detection_ms,
                      int64_t replay_ms, int64_t steps_discarded) {
  SlotGoodput g;
  const double active_s = absl::ToDoubleSeconds(active);
  const double detect = std::min(active_s, detection_ms / 1000.0);
  const double step_s = active_steps > 0 ? active_s / static_cast<double>(active_steps) : 0.0;
  const double rollback = std::min(active_s - detect, step_s * static_cast<double>(steps_discarded));
  const double recovering_s = absl::ToDoubleSeconds(recovering);
  const double replay = std::min(recovering_s, replay_ms / 1000.0);
  g.set_goodput_seconds(active_s - detect - rollback);
  g.set_detect_seconds(detect);
  g.set_replay_seconds(replay);
  g.set_restore_seconds(recovering_s - replay);
  g.set_rollback_seconds(rollback);
  g.set_idle_seconds(absl::ToDoubleSeconds(lost + blocked));
  g.set_steps_discarded(steps_discarded);
  return g;
}

void AddGoodput(const SlotGoodput& g, SlotGoodput* sum) {
  sum->set_goodput_seconds(sum->goodput_seconds() + g.goodput_seconds());
  sum->set_detect_seconds(sum->detect_seconds() + g.detect_seconds());
  sum->set_replay_seconds(sum->replay_seconds() + g.replay_seconds());
  sum->set_restore_seconds(sum->restore_seconds() + g.restore_seconds());
  sum->set_rollback_seconds(sum->rollback_seconds() + g.rollback_seconds());
  sum->set_idle_seconds(sum->idle_seconds() + g.idle_seconds());
  sum->set_steps_discarded(sum->steps_discarded() + g.steps_discarded());
}

}  // namespace

void Membership::FillStatus(GetStatusResponse* response) const {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  for (const Slot& slot : slots_) {
    SlotStatus* out = response->add_slots();
    *out->mutable_slot() = slot.id;
    out->set_state(slot.state);
    out->set_owner_incarnation(slot.owner);
    out->set_step(slot.step);
    if (!slot.detail.empty()) out->set_detail(slot.detail);
    if (auto it = workers_.find(slot.owner); slot.state == ACTIVE && it != workers_.end() &&
                                             !it->second.blocked_reason.empty()) {
      // A pipeline trainer waiting past neighbour_timeout_ms on a neighbour (docs/design.md §5.3).
      out->set_state(BLOCKED);
      out->set_detail(it->second.blocked_reason);
    }
    *out->mutable_goodput() = GoodputOf(slot.active_time, slot.lost_time, slot.recovering_time,
                                        slot.blocked_time, slot.active_steps,
                                        slot.detection_ms_total, slot.replay_ms_total,
                                        slot.steps_discarded);
    AddGoodput(out->goodput(), response->mutable_goodput());
  }
  for (const auto& [policy, durations] : recovery_durations_) {
    *response->add_recovery_durations() = durations;
  }
  const SlotGoodput& job = response->goodput();
  const double lost = job.detect_seconds() + job.replay_seconds() + job.restore_seconds() +
                      job.rollback_seconds() + job.idle_seconds();
  if (job.goodput_seconds() + lost > 0) {
    response->set_ettr(job.goodput_seconds() / (job.goodput_seconds() + lost));
  } else {
    response->clear_goodput();
  }
  for (const auto& [incarnation, worker] : workers_) {
    WorkerStatus* out = response->add_workers();
    out->set_incarnation(incarnation);
    out->set_name(worker.name);
    out->set_role(worker.role);
    out->set_state(worker.state);
    if (worker.slot_index >= 0) *out->mutable_slot() = slots_[worker.slot_index].id;
    out->set_step(worker.step);
    out->set_loss(worker.loss);
    out->set_last_heartbeat_ms_ago(Millis(now - worker.heard));
    out->set_registered_ms_ago(Millis(now - worker.registered));
    out->set_peer_address(worker.peer_address);
    if (!worker.metrics_address.empty()) out->set_metrics_address(worker.metrics_address);
    if (!worker.state_reason.empty()) out->set_state_reason(worker.state_reason);
    if (worker.state == FAILED) out->set_silent_ms_at_failure(worker.silent_ms_at_failure);
  }
}

void Membership::AccountTime() {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  const absl::Duration dt =
      accounted_at_ == absl::Time() ? absl::ZeroDuration() : now - accounted_at_;
  accounted_at_ = now;
  if (dt <= absl::ZeroDuration()) return;
  for (Slot& slot : slots_) {
    const bool moved = slot.step > slot.step_at_account;
    if (moved) slot.progress_at = now;
    if (!slot.accounting) {
      slot.accounting = slot.state == ACTIVE && moved;
      slot.step_at_account = slot.step;
      continue;
    }
    switch (slot.state) {
      case ACTIVE: {
        auto it = workers_.find(slot.owner);
        const bool blocked = it != workers_.end() && !it->second.blocked_reason.empty();
        const bool stalled = now - slot.progress_at > stall_after_;
        (blocked || stalled ? slot.blocked_time : slot.active_time) += dt;
        slot.active_steps += std::max<int64_t>(0, slot.step - slot.step_at_account);
        break;
      }
      case LOST:
        slot.lost_time += dt;
        break;
      case RECOVERING:
        slot.recovering_time += dt;
        break;
      default:  // UNASSIGNED (not started) and FINISHED: not the job's time any more
        break;
    }
    slot.step_at_account = slot.step;
  }
}

int Membership::CountInState(WorkerState state) const {
  absl::MutexLock lock(&mu_);
  int count = 0;
  for (const auto& [incarnation, worker] : workers_) count += worker.state == state;
  return count;
}

}  // namespace rebound::server
