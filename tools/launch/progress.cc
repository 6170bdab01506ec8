#include "tools/launch/progress.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

namespace rebound::launch {

const char kCsvHeader[] = "elapsed_s,slot,step,loss,weight,test_accuracy,event";

namespace {

SlotCoord Coord(const SlotId& id) { return SlotCoord{id.replica(), id.stage()}; }

std::string Fixed(const std::optional<double>& value, int digits) {
  if (!value.has_value()) return "-";
  return absl::StrFormat("%.*f", digits, *value);
}

std::string CsvNumber(const std::optional<double>& value) {
  if (!value.has_value()) return "";
  return absl::StrFormat("%.6g", *value);
}

const WorkerStatus* FindWorkerByIncarnation(const GetStatusResponse& status,
                                            uint64_t incarnation) {
  if (incarnation == 0) return nullptr;
  for (const WorkerStatus& w : status.workers()) {
    if (w.incarnation() == incarnation) return &w;
  }
  return nullptr;
}

}  // namespace

std::string FormatSlot(const SlotCoord& slot) {
  return absl::StrCat("(", slot.replica, ",", slot.stage, ")");
}

std::string CsvSlot(const SlotCoord& slot) {
  return absl::StrCat("r", slot.replica, "s", slot.stage);
}

std::string CsvField(const std::string& field) {
  if (field.find_first_of(",\"\r\n") == std::string::npos) return field;
  return absl::StrCat("\"", absl::StrReplaceAll(field, {{"\"", "\"\""}}), "\"");
}

std::vector<ProgressEvent> ProgressTracker::Update(const GetStatusResponse& status) {
  std::vector<ProgressEvent> events;
  auto name_of = [this](uint64_t incarnation) {
    auto it = workers_.find(incarnation);
    return it != workers_.end() ? it->second.name : absl::StrCat(incarnation);
  };

  for (const WorkerStatus& w : status.workers()) {
    std::optional<SlotCoord> slot;
    if (w.has_slot()) slot = Coord(w.slot());
    const std::string where = slot.has_value() ? absl::StrCat(" of slot ", FormatSlot(*slot)) : "";
    const std::string reason = w.state_reason().empty() ? "" : absl::StrCat(": ", w.state_reason());
    auto known = workers_.find(w.incarnation());
    if (known == workers_.end()) {
      std::string text = absl::StrCat("worker ", w.name(), " registered: ",
                                      WorkerRole_Name(w.role()), where, ", incarnation ",
                                      w.incarnation());
      if (w.state() != ALIVE) absl::StrAppend(&text, ", now ", WorkerState_Name(w.state()), reason);
      events.push_back({slot, std::move(text)});
      workers_[w.incarnation()] = KnownWorker{w.name(), w.role(), w.state(), slot};
      continue;
    }
    KnownWorker& before = known->second;
    const std::string who = absl::StrCat("worker ", w.name(), " (incarnation ", w.incarnation(), ")");
    if (before.state != w.state()) {
      events.push_back({slot, absl::StrCat(who, ": ", WorkerState_Name(before.state), " -> ",
                                           WorkerState_Name(w.state()), reason)});
    }
    if (before.role != w.role() || before.slot != slot) {
      events.push_back({slot, absl::StrCat(who, ": now ", WorkerRole_Name(w.role()), where)});
    }
    before = KnownWorker{w.name(), w.role(), w.state(), slot};
  }

  std::vector<SlotProgress> slots;
  for (const SlotStatus& s : status.slots()) {
    SlotProgress now;
    now.slot = Coord(s.slot());
    now.state = s.state();
    now.step = s.step();
    now.owner = s.owner_incarnation();
    if (s.has_weight() && s.weight().has_weight()) now.weight = s.weight().weight();
    const auto key = std::make_pair(now.slot.replica, now.slot.stage);
    // A worker reports a loss only once it has taken a step; before that its 0 means nothing.
    // Only a pipeline's last stage has a loss: the others' 0 means nothing either ("-").
    const WorkerStatus* owner = FindWorkerByIncarnation(status, now.owner);
    const bool has_loss = status.stages() <= 1 || now.slot.stage == status.stages() - 1;
    if (owner != nullptr && owner->step() > 0 && has_loss) last_loss_[key] = owner->loss();
    if (auto it = last_loss_.find(key); it != last_loss_.end()) now.loss = it->second;

    const SlotProgress* before = FindSlot(now.slot);
    const SlotState before_state = before != nullptr ? before->state : UNASSIGNED;
    const uint64_t before_owner = before != nullptr ? before->owner : 0;
    if (before_state != now.state || before_owner != now.owner) {
      std::string text = absl::StrCat("slot ", FormatSlot(now.slot), ": ",
                                      SlotState_Name(before_state), " -> ",
                                      SlotState_Name(now.state));
      if (now.owner != 0) {
        absl::StrAppend(&text, " (incarnation ", now.owner, ", ", name_of(now.owner), ")");
      }
      if (now.state == FINISHED) absl::StrAppend(&text, " at step ", now.step);
      if (now.state != ACTIVE && now.state != FINISHED && !s.detail().empty()) {
        absl::StrAppend(&text, ": ", s.detail());
      }
      events.push_back({now.slot, std::move(text)});
    }
    slots.push_back(now);
  }
  slots_ = std::move(slots);

  for (const RecoveryStatus& r : status.recoveries()) {
    const RecoveryOutcome outcome = r.has_outcome() ? r.outcome() : RECOVERY_OUTCOME_UNSPECIFIED;
    auto known = recovery_outcomes_.find(r.task_id());
    if (known != recovery_outcomes_.end() && known->second == outcome) continue;
    recovery_outcomes_[r.task_id()] = outcome;

    std::vector<std::string> spares;
    for (uint64_t spare : r.spares()) spares.push_back(name_of(spare));
    std::string text = absl::StrCat(
        "recovery ", r.task_id(), " of slot ", FormatSlot(Coord(r.slot())), ": ",
        outcome == RECOVERY_OUTCOME_UNSPECIFIED ? "RUNNING" : RecoveryOutcome_Name(outcome),
        ", policy ", RecoveryPolicy_Name(r.policy()), ", failed at step ", r.failed_step(), ", ",
        r.steps_replayed(), " steps replayed by [", absl::StrJoin(spares, ", "), "]");
    if (r.has_phases()) {
      const RecoveryPhases& p = r.phases();
      absl::StrAppend(&text, ", phases: detection ", p.detection_ms(), " ms, snapshot transfer ",
                      p.snapshot_transfer_ms(), " ms, replay ", p.replay_ms(), " ms, takeover ",
                      p.takeover_ms(), " ms");
    }
    absl::StrAppend(&text, ", verified ", r.verified() ? "yes" : "no");
    if (!r.detail().empty()) absl::StrAppend(&text, ": ", r.detail());
    events.push_back({Coord(r.slot()), std::move(text)});
  }
  recoveries_ = status.recoveries_size();

  // Audits (docs/recovery.md#audits): each decided second replay once.
  for (const AuditStatus& a : status.audits()) {
    if (a.confirms() == 0 || !a.has_verdict() || !audit_verdicts_.insert(a.audit_id()).second) {
      continue;
    }
    std::string where = a.has_mismatch() ? absl::StrCat(" step ", a.mismatch().step()) : "";
    if (a.has_mismatch() && !a.mismatch().tensor_name().empty()) {
      absl::StrAppend(&where, " tensor ", a.mismatch().tensor_name());
    }
    const char* what = a.verdict() == AUDIT_CONFIRMED       ? "AUDIT_MISMATCH"
                       : a.verdict() == AUDIT_AUDITOR_FAULT ? "audit disagreement"
                                                            : "audit inconclusive";
    events.push_back({Coord(a.slot()),
                      absl::StrCat(what, " of slot ", FormatSlot(Coord(a.slot())), ": worker ",
                                   a.worker(), where, ", window (", a.from_step(), ", ",
                                   a.to_step(), "]: ", a.detail())});
  }

  if (status.has_last_eval()) {
    if (status.last_eval().has_test_accuracy()) test_accuracy_ = status.last_eval().test_accuracy();
    if (status.last_eval().has_test_loss()) test_loss_ = status.last_eval().test_loss();
    if (status.last_eval().has_center_version()) {
      evaluated_version_ = status.last_eval().center_version();
    }
  }
  for (const CenterStatus& center : status.centers()) {
    if (center.stage() == 0) center_version_ = center.version();
  }
  latest_ = status;
  return events;
}

const SlotProgress* ProgressTracker::FindSlot(const SlotCoord& slot) const {
  for (const SlotProgress& s : slots_) {
    if (s.slot == slot) return &s;
  }
  return nullptr;
}

std::optional<std::string> ProgressTracker::OwnerName(const SlotCoord& slot) const {
  const SlotProgress* s = FindSlot(slot);
  if (s == nullptr) return std::nullopt;
  const WorkerStatus* owner = FindWorkerByIncarnation(latest_, s->owner);
  if (owner == nullptr) return std::nullopt;
  return owner->name();
}

const WorkerStatus* ProgressTracker::FindAliveWorker(const std::string& name) const {
  const WorkerStatus* found = nullptr;
  for (const WorkerStatus& w : latest_.workers()) {
    if (w.name() == name && w.state() == ALIVE &&
        (found == nullptr || w.incarnation() > found->incarnation())) {
      found = &w;
    }
  }
  return found;
}

bool ProgressTracker::AllFinished() const {
  if (slots_.empty()) return false;
  for (const SlotProgress& s : slots_) {
    if (s.state != FINISHED) return false;
  }
  return true;
}

std::string ProgressTracker::ProgressLine() const {
  std::vector<std::string> parts;
  for (const SlotProgress& s : slots_) {
    std::string part = absl::StrCat(s.slot.replica, ",", s.slot.stage, ":", s.step, "/",
                                    Fixed(s.loss, 4), "/w=", Fixed(s.weight, 3));
    if (s.state != ACTIVE) absl::StrAppend(&part, "(", SlotState_Name(s.state), ")");
    parts.push_back(std::move(part));
  }
  parts.push_back(absl::StrCat("acc=", Fixed(test_accuracy_, 4)));
  parts.push_back(absl::StrCat("recoveries=", recoveries_));
  return absl::StrJoin(parts, " ");
}

std::vector<std::string> ProgressTracker::CsvRows(double elapsed_s) const {
  std::vector<std::string> rows;
  for (const SlotProgress& s : slots_) {
    rows.push_back(absl::StrFormat("%.1f,%s,%d,%s,%s,%s,", elapsed_s, CsvSlot(s.slot), s.step,
                                   CsvNumber(s.loss), CsvNumber(s.weight),
                                   CsvNumber(test_accuracy_)));
  }
  return rows;
}

std::string ProgressTracker::CsvEventRow(double elapsed_s, const ProgressEvent& event) const {
  const SlotProgress* s = event.slot.has_value() ? FindSlot(*event.slot) : nullptr;
  if (s == nullptr) {
    return absl::StrFormat("%.1f,%s,,,,,%s", elapsed_s,
                           event.slot.has_value() ? CsvSlot(*event.slot) : "",
                           CsvField(event.text));
  }
  return absl::StrFormat("%.1f,%s,%d,%s,%s,,%s", elapsed_s, CsvSlot(s->slot), s->step,
                         CsvNumber(s->loss), CsvNumber(s->weight), CsvField(event.text));
}

}  // namespace rebound::launch
