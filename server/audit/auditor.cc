#include "server/audit/auditor.h"

#include <glog/logging.h>

#include <algorithm>
#include <functional>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/slot.h"

namespace rebound::server {

namespace {

int64_t Millis(absl::Duration d) { return absl::ToInt64Milliseconds(d); }

std::string Hex(uint64_t value) { return absl::StrFormat("%016x", value); }

// Where a mismatch is, for humans: the step and, when the log names it, the tensor.
std::string Where(const ReplayMismatch& m) {
  std::string where = absl::StrCat("step ", m.step());
  if (!m.tensor_name().empty()) {
    absl::StrAppend(&where, " tensor '", m.tensor_name(), "' (", m.tensor_index(), ")");
  } else if (m.tensor_index() >= 0 && m.has_tensor_index()) {
    absl::StrAppend(&where, " tensor ", m.tensor_index());
  }
  return where;
}

}  // namespace

Auditor::Auditor(const JobConfig& job, Membership* membership, ReliabilityTracker* tracker,
                 const StepLogService* step_log, const Clock* clock)
    : job_(job),
      enabled_(job.audit().fraction() > 0),
      max_concurrent_(std::max(1, job.audit().max_concurrent())),
      timeout_(absl::Milliseconds(job.fault_tolerance().recovery_timeout_ms())),
      max_wait_(absl::Milliseconds(job.audit().max_wait_ms())),
      membership_(membership),
      tracker_(tracker),
      step_log_(step_log),
      clock_(clock),
      rng_(std::hash<std::string>()(job.job_id()) ^ 0x61756469745f6a6fULL) {}

void Auditor::AddAuditor(uint64_t incarnation) {
  if (!enabled_) return;
  absl::MutexLock lock(&mu_);
  auditors_.insert(incarnation);
}

bool Auditor::Choose(const SlotId& slot, uint64_t owner, int64_t previous_step, int64_t step) {
  if (!enabled_) return false;
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  LastSync& last = last_sync_[Key(slot)];
  // Only a window both of whose ends are this trainer's: after a takeover or a restart of the
  // server its start is another trainer's state, or unknown.
  const bool same_trainer = last.owner == owner && last.step == previous_step;
  // A sharded job: the start is the owner's first sync, which a range may have answered from
  // the snapshot its predecessor left there (docs/sharding.md#audits): not a start to trust.
  const bool start_trusted = !(last.owners_first && job_.sharding().groups() > 1);
  last.owners_first = !same_trainer;
  last.owner = owner;
  last.step = step;
  if (!same_trainer || !start_trusted || step <= previous_step) return false;
  std::uniform_real_distribution<double> draw(0.0, 1.0);
  if (!(draw(rng_) < job_.audit().fraction())) return false;
  const int64_t steps = step - previous_step;
  const int64_t per_hour = job_.audit().steps_per_hour();
  if (per_hour > 0 && StepsInLastHourLocked(now) + steps > per_hour) {
    counts_.set_windows_skipped(counts_.windows_skipped() + 1);
    return false;
  }
  if (static_cast<int>(waiting_.size() + running_.size()) >= 2 * max_concurrent_) {
    // The spares fall behind: the newest window takes the place of an older one waiting for a
    // first replay, so that what is audited stays recent (a corruption is found while it is
    // fresh) rather than the room holding ever older windows. The place is taken from the
    // trainer with the most windows in the room (this one's counted), its oldest: every trainer
    // keeps its newest window, so a machine that stops syncing (it died, or was partitioned)
    // after corrupting its windows is not crowded out by the others' newer ones. Second replays
    // keep their place.
    std::map<uint64_t, int> windows;  // first replays waiting, by trainer
    windows[owner] += 1;
    for (const Audit& a : waiting_) {
      if (a.confirms == 0) windows[a.trainer] += 1;
    }
    auto oldest = waiting_.end();
    for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
      if (it->confirms != 0) continue;
      if (oldest == waiting_.end() || windows[it->trainer] > windows[oldest->trainer] ||
          (windows[it->trainer] == windows[oldest->trainer] && it->queued < oldest->queued)) {
        oldest = it;
      }
    }
    counts_.set_windows_skipped(counts_.windows_skipped() + 1);
    if (oldest == waiting_.end()) return false;
    RecordLocked(*oldest, AUDIT_RESULT_UNSPECIFIED, AUDIT_SKIPPED,
                 "replaced by a newer window: the spares fell behind", now);
    waiting_.erase(oldest);
  }
  chosen_steps_.emplace_back(now, steps);
  return true;
}

void Auditor::Hold(const SlotId& slot, uint64_t owner, Snapshot snapshot, int64_t to_step) {
  const std::string name = membership_->NameOf(owner);
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  Audit audit;
  audit.id = kAuditIdBit | next_id_++;
  audit.slot = slot;
  audit.trainer = owner;
  audit.trainer_name = name;
  audit.snapshot = std::move(snapshot);
  audit.to_step = to_step;
  audit.queued = now;
  counts_.set_windows_chosen(counts_.windows_chosen() + 1);
  VLOG(1) << "audit " << (audit.id & ~kAuditIdBit) << ": window (" << audit.snapshot.step()
          << ", " << to_step << "] of slot " << SlotName(slot) << " ('" << name << "') waits";
  waiting_.push_back(std::move(audit));
}

void Auditor::Unread() {
  absl::MutexLock lock(&mu_);
  counts_.set_windows_unread(counts_.windows_unread() + 1);
}

std::optional<int64_t> Auditor::KeepLogFrom(const SlotId& slot) const {
  if (!enabled_) return std::nullopt;
  absl::MutexLock lock(&mu_);
  std::optional<int64_t> keep;
  auto consider = [&](const Audit& a) {
    if (a.slot.replica() != slot.replica() || a.slot.stage() != slot.stage()) return;
    keep = std::min(keep.value_or(a.snapshot.step()), a.snapshot.step());
  };
  for (const Audit& a : waiting_) consider(a);
  for (const auto& [id, a] : running_) consider(a);
  return keep;
}

absl::StatusOr<std::optional<RecoveryTask>> Auditor::Claim(uint64_t incarnation) {
  if (!enabled_) return std::optional<RecoveryTask>();
  const absl::Time now = clock_->Now();
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(now);
    if (waiting_.empty() || !auditors_.count(incarnation) ||
        static_cast<int>(running_.size()) >= max_concurrent_) {
      return std::optional<RecoveryTask>();
    }
  }
  if (absl::Status spare = membership_->CheckSpare(incarnation); !spare.ok()) return spare;
  // A recovery comes first: no audit starts while a slot waits for a spare.
  if (membership_->AnySlotLost()) return std::optional<RecoveryTask>();
  // Whether another spare could run a second replay: the auditors still alive as spares (the
  // others, fenced or turned trainers, are forgotten).
  std::vector<uint64_t> auditors;
  {
    absl::MutexLock lock(&mu_);
    auditors.assign(auditors_.begin(), auditors_.end());
  }
  bool others = false;
  std::vector<uint64_t> gone;
  for (uint64_t a : auditors) {
    if (a == incarnation) continue;
    if (membership_->CheckSpare(a).ok()) {
      others = true;
    } else {
      gone.push_back(a);
    }
  }
  if (!gone.empty()) {
    absl::MutexLock lock(&mu_);
    for (uint64_t a : gone) {
      auditors_.erase(a);
      last_matched_.erase(a);
    }
  }
  // Which waiting windows' logs are complete (read without the lock: the step log's own).
  struct Candidate {
    uint64_t id;
    SlotId slot;
    int64_t from;
    int64_t to;
    bool second;            // a second replay: first
    absl::Time trainer_last;  // when its trainer's last window was handed out: longest ago first
  };
  std::vector<Candidate> candidates;
  {
    absl::MutexLock lock(&mu_);
    for (const Audit& a : waiting_) {
      // A second replay goes to another spare first; the first auditor gets it after the grace,
      // or at once when no other spare could, and only once it has matched another window since
      // its mismatch: its fault, if persistent, would otherwise confirm its own accusation.
      if (a.confirms != 0 && a.first_auditor == incarnation) {
        if (others && now - a.queued < kConfirmGrace) continue;
        auto matched = last_matched_.find(incarnation);
        if (matched == last_matched_.end() || matched->second <= a.accused) continue;
      }
      auto handed = last_handed_.find(a.trainer);
      candidates.push_back({a.id, a.slot, a.snapshot.step(), a.to_step, a.confirms != 0,
                            handed == last_handed_.end() ? absl::InfinitePast() : handed->second});
    }
  }
  // The trainers in turn: second replays first, then the oldest window of the trainer audited
  // longest ago. Handing out the oldest window overall would let one trainer's backlog (one that
  // died with many windows waiting) hold every spare while the others' windows give their places
  // to newer ones, unaudited.
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) {
                     if (a.second != b.second) return a.second;
                     return a.trainer_last < b.trainer_last;
                   });
  std::set<uint64_t> complete;
  for (const Candidate& c : candidates) {
    absl::StatusOr<int64_t> last = step_log_->LastCompleteStep(c.slot, c.from, c.to);
    if (last.ok() && *last >= c.to) complete.insert(c.id);
    // The first complete window in that order is the one handed out: no need to read the rest.
    if (!complete.empty()) break;
  }
  const std::string name = membership_->NameOf(incarnation);
  absl::MutexLock lock(&mu_);
  if (static_cast<int>(running_.size()) >= max_concurrent_) return std::optional<RecoveryTask>();
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if (!complete.count(it->id)) continue;
    Audit audit = std::move(*it);
    waiting_.erase(it);
    audit.auditor = incarnation;
    audit.auditor_name = name;
    audit.started = now;
    last_handed_[audit.trainer] = now;
    if (last_handed_.size() > kMaxTrainersRemembered) {
      // Forget the trainers with no window waiting or running (they left, or were replaced).
      std::set<uint64_t> open = {audit.trainer};
      for (const Audit& a : waiting_) open.insert(a.trainer);
      for (const auto& [id, a] : running_) open.insert(a.trainer);
      for (auto t = last_handed_.begin(); t != last_handed_.end();) {
        t = open.count(t->first) ? std::next(t) : last_handed_.erase(t);
      }
    }
    RecoveryTask task;
    task.set_task_id(audit.id);
    *task.mutable_slot() = audit.slot;
    task.set_policy(REPLAY);
    task.set_failed_step(audit.to_step);
    *task.mutable_snapshot() = audit.snapshot;
    task.add_spares()->set_incarnation(incarnation);
    task.set_rank(0);
    task.set_first_micro_batch(0);
    task.set_micro_batch_count(job_.data().micro_batches());
    task.set_audit(true);
    task.set_audited_worker(audit.trainer_name);
    LOG(INFO) << "audit " << (audit.id & ~kAuditIdBit) << ": spare '" << name << "' replays steps ("
              << audit.snapshot.step() << ", " << audit.to_step << "] of slot "
              << SlotName(audit.slot) << " ('" << audit.trainer_name << "')"
              << (audit.confirms != 0 ? " to confirm a mismatch" : "");
    running_.emplace(audit.id, std::move(audit));
    return std::optional<RecoveryTask>(std::move(task));
  }
  return std::optional<RecoveryTask>();
}

absl::StatusOr<SlotId> Auditor::AuditSlot(uint64_t audit_id, uint64_t incarnation) const {
  absl::MutexLock lock(&mu_);
  auto it = running_.find(audit_id);
  if (it == running_.end() || it->second.auditor != incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "incarnation ", incarnation, " runs no audit ", audit_id & ~kAuditIdBit));
  }
  return it->second.slot;
}

absl::Status Auditor::Finish(const ReportAuditRequest& report) {
  if (report.result() == AUDIT_RESULT_UNSPECIFIED) {
    return absl::InvalidArgumentError("result is unset");
  }
  if (report.result() == AUDIT_MISMATCHED && (!report.has_mismatch() || report.mismatch().step() < 1)) {
    return absl::InvalidArgumentError("an AUDIT_MISMATCHED report must say where (mismatch.step >= 1)");
  }
  if (report.steps_replayed() < 0) {
    return absl::InvalidArgumentError("steps_replayed must be >= 0");
  }
  const absl::Time now = clock_->Now();
  Audit audit;
  {
    absl::MutexLock lock(&mu_);
    auto it = running_.find(report.audit_id());
    if (it == running_.end() || it->second.auditor != report.incarnation()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "incarnation ", report.incarnation(), " runs no audit ",
          report.audit_id() & ~kAuditIdBit, " (it ended, or was handed to another spare)"));
    }
    audit = std::move(it->second);
    running_.erase(it);
    preempt_.erase(audit.id);
    ++reports_;
  }
  if (report.result() == AUDIT_MISMATCHED &&
      (report.mismatch().step() <= audit.snapshot.step() ||
       report.mismatch().step() > audit.to_step)) {
    absl::MutexLock lock(&mu_);
    RecordLocked(audit, AUDIT_INCOMPLETE, AUDIT_VERDICT_UNSPECIFIED,
                 absl::StrCat("refused: a mismatch at step ", report.mismatch().step(),
                              " outside the window"),
                 now);
    return absl::InvalidArgumentError(absl::StrCat(
        "mismatch.step ", report.mismatch().step(), " is outside the audited window (",
        audit.snapshot.step(), ", ", audit.to_step, "]"));
  }

  // What to do outside the lock: charge a machine, quarantine a trainer.
  std::string charge;
  bool quarantine = false;
  std::string event;
  {
    absl::MutexLock lock(&mu_);
    switch (report.result()) {
      case AUDIT_MATCHED:
        last_matched_[audit.auditor] = reports_;
        counts_.set_matched(counts_.matched() + 1);
        counts_.set_steps_audited(counts_.steps_audited() + report.steps_replayed());
        break;
      case AUDIT_MISMATCHED:
        counts_.set_mismatched(counts_.mismatched() + 1);
        counts_.set_steps_audited(counts_.steps_audited() + report.steps_replayed());
        break;
      case AUDIT_INCOMPLETE:
        counts_.set_incomplete(counts_.incomplete() + 1);
        break;
      default:
        counts_.set_preempted(counts_.preempted() + 1);
        break;
    }
    const bool second = audit.confirms != 0;
    if (report.result() == AUDIT_PREEMPTED) {
      RecordLocked(audit, AUDIT_PREEMPTED, AUDIT_VERDICT_UNSPECIFIED,
                   "preempted by a recovery; the window waits for a spare again", now);
      if (!RequeueLocked(audit, now) && second) {
        counts_.set_inconclusive(counts_.inconclusive() + 1);
        SetVerdictLocked(audit.confirms, AUDIT_INCONCLUSIVE);
      }
      return absl::OkStatus();
    }
    if (report.result() == AUDIT_INCOMPLETE) {
      RecordLocked(audit, AUDIT_INCOMPLETE, second ? AUDIT_INCONCLUSIVE : AUDIT_VERDICT_UNSPECIFIED,
                   report.detail(), now);
      if (second) {
        counts_.set_inconclusive(counts_.inconclusive() + 1);
        SetVerdictLocked(audit.confirms, AUDIT_INCONCLUSIVE);
      }
      return absl::OkStatus();
    }
    if (!second) {
      if (report.result() == AUDIT_MATCHED) {
        RecordLocked(audit, AUDIT_MATCHED, AUDIT_CLEAN, "", now);
        return absl::OkStatus();
      }
      // A mismatch: nobody is charged before a second replay of the same window.
      AuditStatus& record = RecordLocked(
          audit, AUDIT_MISMATCHED, AUDIT_VERDICT_UNSPECIFIED,
          absl::StrCat("replayed ", Hex(report.mismatch().replayed_checksum()), " at ",
                       Where(report.mismatch()), ", the log says ",
                       Hex(report.mismatch().logged_checksum()), "; a second replay confirms"),
          now);
      *record.mutable_mismatch() = report.mismatch();
      LOG(WARNING) << "audit " << (audit.id & ~kAuditIdBit) << ": slot " << SlotName(audit.slot)
                   << " ('" << audit.trainer_name << "'): spare '" << audit.auditor_name
                   << "' replayed " << Where(report.mismatch()) << " differently ("
                   << Hex(report.mismatch().replayed_checksum()) << ", the log says "
                   << Hex(report.mismatch().logged_checksum())
                   << "); a second replay of the window decides";
      Audit confirm;
      confirm.id = kAuditIdBit | next_id_++;
      confirm.slot = audit.slot;
      confirm.trainer = audit.trainer;
      confirm.trainer_name = audit.trainer_name;
      confirm.snapshot = std::move(audit.snapshot);
      confirm.to_step = audit.to_step;
      confirm.confirms = audit.id;
      confirm.first_auditor = audit.auditor;
      confirm.first_auditor_name = audit.auditor_name;
      confirm.first_mismatch = report.mismatch();
      confirm.accused = reports_;
      confirm.queued = now;
      waiting_.push_front(std::move(confirm));
      return absl::OkStatus();
    }
    // A second replay: the verdict.
    const ReplayMismatch& first = audit.first_mismatch;
    if (report.result() == AUDIT_MATCHED) {
      // The trainer's log and this replay agree against the first auditor.
      counts_.set_auditor_faults(counts_.auditor_faults() + 1);
      (*counts_.mutable_auditor_faults_by_worker())[audit.first_auditor_name] += 1;
      RecordLocked(audit, AUDIT_MATCHED, AUDIT_AUDITOR_FAULT,
                   absl::StrCat("the log is right: the first auditor '", audit.first_auditor_name,
                                "' computed ", Where(first), " wrong"),
                   now);
      SetVerdictLocked(audit.confirms, AUDIT_AUDITOR_FAULT);
      charge = audit.first_auditor_name;
      event = absl::StrCat("AUDIT_DISAGREEMENT: spare '", audit.first_auditor_name,
                           "' replayed ", Where(first), " of slot ", SlotName(audit.slot),
                           " differently; spare '", audit.auditor_name,
                           "' and the trainer agree: the first auditor is charged");
    } else {
      const ReplayMismatch& again = report.mismatch();
      const bool agree = again.step() == first.step() &&
                         again.replayed_checksum() == first.replayed_checksum();
      if (agree) {
        counts_.set_confirmed(counts_.confirmed() + 1);
        (*counts_.mutable_confirmed_by_worker())[audit.trainer_name] += 1;
        AuditStatus& record = RecordLocked(
            audit, AUDIT_MISMATCHED, AUDIT_CONFIRMED,
            absl::StrCat("confirmed: two replays give ", Hex(again.replayed_checksum()), " at ",
                         Where(again), ", the trainer logged ", Hex(again.logged_checksum())),
            now);
        *record.mutable_mismatch() = again;
        SetVerdictLocked(audit.confirms, AUDIT_CONFIRMED);
        charge = audit.trainer_name;
        quarantine = job_.audit().on_mismatch() == AUDIT_QUARANTINE;
        event = absl::StrCat(
            "AUDIT_MISMATCH: worker '", audit.trainer_name, "' (incarnation ", audit.trainer,
            ") slot ", SlotName(audit.slot), " ", Where(again), ": it logged ",
            Hex(again.logged_checksum()), ", spares '", audit.first_auditor_name, "' and '",
            audit.auditor_name, "' both replay ", Hex(again.replayed_checksum()),
            " (silent data corruption)");
      } else {
        counts_.set_inconclusive(counts_.inconclusive() + 1);
        AuditStatus& record = RecordLocked(
            audit, AUDIT_MISMATCHED, AUDIT_INCONCLUSIVE,
            absl::StrCat("the replays disagree: ", Hex(first.replayed_checksum()), " at ",
                         Where(first), " and ", Hex(again.replayed_checksum()), " at ",
                         Where(again), "; nobody is charged"),
            now);
        *record.mutable_mismatch() = again;
        SetVerdictLocked(audit.confirms, AUDIT_INCONCLUSIVE);
        event = absl::StrCat("audit of slot ", SlotName(audit.slot), ": the two replays disagree ",
                             "with each other and with the log at ", Where(again),
                             "; inconclusive, nobody charged");
      }
    }
  }
  LOG(ERROR) << event;
  if (!charge.empty()) tracker_->OnFault(charge, now);
  if (quarantine) {
    const absl::Status fenced = membership_->Quarantine(
        audit.trainer, audit.slot,
        absl::StrCat("audit: ", Where(audit.first_mismatch),
                     " does not replay to what it logged (confirmed by two spares)"));
    absl::MutexLock lock(&mu_);
    if (fenced.ok()) {
      counts_.set_quarantined(counts_.quarantined() + 1);
      LOG(ERROR) << "QUARANTINED worker '" << audit.trainer_name << "' (incarnation "
                 << audit.trainer << "): slot " << SlotName(audit.slot)
                 << " restarts from the center";
    } else {
      LOG(WARNING) << "not quarantined: " << fenced.message();
    }
  }
  return absl::OkStatus();
}

std::vector<Command> Auditor::CommandsFor(uint64_t incarnation) {
  if (!enabled_) return {};
  uint64_t running = 0;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, a] : running_) {
      if (a.auditor == incarnation) running = id;
    }
  }
  if (running == 0 || !membership_->AnySlotLost()) return {};
  absl::MutexLock lock(&mu_);
  if (running_.count(running) && preempt_.insert(running).second) {
    LOG(WARNING) << "audit " << (running & ~kAuditIdBit) << ": preempted (a slot is LOST)";
  }
  return {PREEMPT_AUDIT};
}

bool Auditor::HoldsAtJobEnd(uint64_t incarnation) {
  if (!enabled_) return false;
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  if (!auditors_.count(incarnation)) return false;
  ExpireLocked(now);
  for (const auto& [id, a] : running_) {
    if (a.auditor == incarnation || a.confirms != 0) return true;
  }
  for (const Audit& a : waiting_) {
    if (a.confirms != 0) return true;
  }
  return false;
}

void Auditor::FillStatus(GetStatusResponse* response) const {
  if (!enabled_) return;
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  for (const AuditStatus& record : records_) {
    AuditStatus* out = response->add_audits();
    *out = record;
    auto ended = ended_at_.find(record.audit_id());
    if (ended != ended_at_.end()) out->set_ended_ms_ago(Millis(now - ended->second));
  }
  auto add_open = [&](const Audit& a) {
    AuditStatus* out = response->add_audits();
    out->set_audit_id(a.id & ~kAuditIdBit);
    *out->mutable_slot() = a.slot;
    out->set_worker(a.trainer_name);
    out->set_worker_incarnation(a.trainer);
    out->set_from_step(a.snapshot.step());
    out->set_to_step(a.to_step);
    if (a.auditor != 0) {
      out->set_auditor(a.auditor);
      out->set_auditor_name(a.auditor_name);
    }
    if (a.confirms != 0) out->set_confirms(a.confirms & ~kAuditIdBit);
  };
  for (const Audit& a : waiting_) add_open(a);
  for (const auto& [id, a] : running_) add_open(a);
  *response->mutable_audit_counts() = counts_;
}

void Auditor::ExpireLocked(absl::Time now) {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (now - it->queued <= max_wait_) {
      ++it;
      continue;
    }
    counts_.set_expired(counts_.expired() + 1);
    const bool second = it->confirms != 0;
    RecordLocked(*it, AUDIT_RESULT_UNSPECIFIED, second ? AUDIT_INCONCLUSIVE : AUDIT_SKIPPED,
                 absl::StrCat("no spare replayed it within audit.max_wait_ms (",
                              Millis(max_wait_), " ms)"),
                 now);
    if (second) {
      counts_.set_inconclusive(counts_.inconclusive() + 1);
      SetVerdictLocked(it->confirms, AUDIT_INCONCLUSIVE);
    }
    it = waiting_.erase(it);
  }
  for (auto it = running_.begin(); it != running_.end();) {
    if (now - it->second.started <= timeout_) {
      ++it;
      continue;
    }
    Audit audit = std::move(it->second);
    it = running_.erase(it);
    preempt_.erase(audit.id);
    RecordLocked(audit, AUDIT_INCOMPLETE, AUDIT_VERDICT_UNSPECIFIED,
                 absl::StrCat("spare '", audit.auditor_name,
                              "' did not report within recovery_timeout"),
                 now);
    counts_.set_incomplete(counts_.incomplete() + 1);
    if (!RequeueLocked(std::move(audit), now)) {
      counts_.set_expired(counts_.expired() + 1);
    }
  }
}

AuditStatus& Auditor::RecordLocked(const Audit& audit, AuditResult result, AuditVerdict verdict,
                                   const std::string& detail, absl::Time now) {
  AuditStatus record;
  record.set_audit_id(audit.id & ~kAuditIdBit);
  *record.mutable_slot() = audit.slot;
  record.set_worker(audit.trainer_name);
  record.set_worker_incarnation(audit.trainer);
  record.set_from_step(audit.snapshot.step());
  record.set_to_step(audit.to_step);
  if (audit.auditor != 0) {
    record.set_auditor(audit.auditor);
    record.set_auditor_name(audit.auditor_name);
  }
  if (result != AUDIT_RESULT_UNSPECIFIED) record.set_result(result);
  if (audit.confirms != 0) record.set_confirms(audit.confirms & ~kAuditIdBit);
  if (verdict != AUDIT_VERDICT_UNSPECIFIED) record.set_verdict(verdict);
  if (!detail.empty()) record.set_detail(detail);
  records_.push_back(std::move(record));
  ended_at_[audit.id & ~kAuditIdBit] = now;
  while (static_cast<int>(records_.size()) > kMaxRecords) {
    // The oldest routine record goes first (a clean, skipped or preempted window): a mismatch
    // and its verdict stay on record while windows skipped by the dozen come and go.
    auto drop = std::find_if(records_.begin(), std::prev(records_.end()),
                             [](const AuditStatus& r) {
                               return !r.has_mismatch() && r.verdict() != AUDIT_CONFIRMED &&
                                      r.verdict() != AUDIT_AUDITOR_FAULT &&
                                      r.verdict() != AUDIT_INCONCLUSIVE;
                             });
    if (drop == std::prev(records_.end())) drop = records_.begin();
    ended_at_.erase(drop->audit_id());
    records_.erase(drop);
  }
  return records_.back();
}

void Auditor::SetVerdictLocked(uint64_t id, AuditVerdict verdict) {
  for (AuditStatus& record : records_) {
    if (record.audit_id() == (id & ~kAuditIdBit)) record.set_verdict(verdict);
  }
}

bool Auditor::RequeueLocked(Audit audit, absl::Time now) {
  if (audit.attempt >= kMaxAttempts) return false;
  audit.id = kAuditIdBit | next_id_++;
  ++audit.attempt;
  audit.auditor = 0;
  audit.auditor_name.clear();
  audit.queued = now;
  waiting_.push_front(std::move(audit));
  return true;
}

int64_t Auditor::StepsInLastHourLocked(absl::Time now) {
  while (!chosen_steps_.empty() && now - chosen_steps_.front().first > absl::Hours(1)) {
    chosen_steps_.pop_front();
  }
  int64_t steps = 0;
  for (const auto& [when, n] : chosen_steps_) steps += n;
  return steps;
}

}  // namespace rebound::server
