#pragma once

// Auditor: audit replay (docs/design.md §14, docs/recovery.md#audits). Idle spares re-execute
// windows of live trainers' logged steps and compare every step's checksum with the trainer's, so
// that a machine that silently computes something else (a flipped bit in memory or in a GEMM) is
// caught while the job trains.
//
//   * Choosing. At each sync of a slot (LogRetention::ForSync, under the stage lock) the auditor
//     decides whether to audit the slot's sync window: the steps (t0, t1] between its previous
//     sync t0 and this one t1, both made by the same incarnation (after a takeover or a server
//     restart the first window is not audited: its start was another trainer's or is unknown; in
//     a sharded job neither is the second, whose start is the new owner's first sync: a range
//     that had applied that step from the trainer before answers it from its kept snapshot, whose
//     optimizer state the new owner never adopts, so the stored start is not the owner's state).
//     Drawn with probability audit.fraction from a generator seeded by the job id; skipped
//     (counted) when steps_per_hour would be exceeded. When 2 x max_concurrent audits already
//     hold windows (the spares fall behind), the new window replaces the oldest first-replay
//     window of the trainer with the most windows waiting (that one is AUDIT_SKIPPED, counted as
//     skipped): what is audited stays recent, and every trainer keeps its newest window (one
//     that stopped syncing is not crowded out). A chosen window keeps its snapshot t0 (in memory, here) and its log (the sync's
//     GC stops at t0, and later syncs' GC stops there too while the audit holds the window:
//     KeepLogFrom).
//   * Handing out. A spare that registered with `audits` and asks for work (WaitForTask) while no
//     slot is LOST gets a waiting audit whose log is complete through t1, as a RecoveryTask with
//     `audit` set (rank 0 of 1): at most max_concurrent run at once. Second replays go first,
//     then the trainers take turns: the oldest window of the trainer whose last window was
//     handed out longest ago. A second
//     replay (below) prefers another spare: the first auditor gets it only kConfirmGrace after
//     it waited, or at once when no other auditing spare is alive, and in either case only once
//     it has matched another window since its mismatch (it computes this job's steps right now):
//     a spare whose fault is persistent mismatches everything and so never confirms its own
//     accusation, which then waits for another spare and expires INCONCLUSIVE.
//   * Preemption. While a slot is LOST, the heartbeat of a spare running an audit carries
//     PREEMPT_AUDIT (CommandsFor): it stops at its next step, reports AUDIT_PREEMPTED and asks for
//     work, where the recovery waits for it. A preempted audit waits again (at most kMaxAttempts
//     replays of one window).
//   * Verdicts. A matching replay clears the window (AUDIT_CLEAN). A mismatch is not charged
//     until a second, independent replay of the same window has run:
//       - it differs at the same step with the same checksum: AUDIT_CONFIRMED. The trainer's
//         machine (its registered name) is charged a fault (ReliabilityTracker::OnFault), the
//         AUDIT_MISMATCH is logged and counted, and under AUDIT_QUARANTINE the trainer is fenced
//         QUARANTINED and its slot restarts from the center (Membership::Quarantine);
//       - it matches the log: the trainer and the second auditor agree against the first
//         auditor, whose machine is charged instead (AUDIT_AUDITOR_FAULT);
//       - it differs otherwise (the two replays disagree with each other and with the log), or
//         no second replay ran to the end: AUDIT_INCONCLUSIVE, nobody is charged.
//   * Expiry. A window waits at most audit.max_wait_ms for a spare (its log is held meanwhile:
//     that bounds the log a slot keeps) and a replay runs at most recovery_timeout_ms: a window
//     that waited too long is AUDIT_SKIPPED (a second replay: AUDIT_INCONCLUSIVE) and released;
//     a replay that ran too long waits again (at most kMaxAttempts replays).
//
// Thread-safety: thread-safe. The auditor's mutex is a leaf of the server's lock order (see
// server/recovery_coordinator.h): it is held while calling no other unit; Membership,
// ReliabilityTracker and StepLogService are called without it. ForSync-time calls (Choose,
// KeepLogFrom) may come with the stage lock held.
// Ownership: every pointer given to the constructor is borrowed and must outlive the auditor.
// Status codes: Claim: the errors of Membership::CheckSpare. Finish: INVALID_ARGUMENT for a
// report without a result or a mismatch without its step; FAILED_PRECONDITION for an audit this
// spare is not running (over, preempted and handed to another, or never its). AuditSlot:
// FAILED_PRECONDITION unless `incarnation` runs audit `audit_id`.

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "server/membership.h"
#include "server/reliability.h"
#include "server/step_log.h"

namespace rebound::server {

class Auditor {
 public:
  // Audit ids have this bit set: disjoint from the recovery tasks' ids, which ReadLog shares.
  static constexpr uint64_t kAuditIdBit = uint64_t{1} << 62;
  static constexpr int kMaxRecords = 64;    // audits kept for status (mismatches the longest)
  static constexpr int kMaxAttempts = 3;    // replays of one window (first or second) at most
  static constexpr absl::Duration kConfirmGrace = absl::Seconds(2);
  static constexpr size_t kMaxTrainersRemembered = 1024;  // last_handed_'s bound

  // REQUIRES: `job` is validated; the pointers outlive the auditor.
  Auditor(const JobConfig& job, Membership* membership, ReliabilityTracker* tracker,
          const StepLogService* step_log, const Clock* clock);

  Auditor(const Auditor&) = delete;
  Auditor& operator=(const Auditor&) = delete;

  // audit.fraction > 0.
  bool enabled() const { return enabled_; }

  // A spare that can run audits registered (RegisterRequest.audits).
  void AddAuditor(uint64_t incarnation) ABSL_LOCKS_EXCLUDED(mu_);

  // The sync of `slot` at `step` by `owner` (its previous sync was at `previous_step`): true if
  // its window (previous_step, step] is to be audited; the caller then keeps the window's log
  // and snapshot and, once the sync is decided, calls Hold. Records the sync either way.
  bool Choose(const SlotId& slot, uint64_t owner, int64_t previous_step, int64_t step)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The window Choose chose, with its starting snapshot (step previous_step), read off the stage
  // lock before its sync's batch is written (LogRetention::HoldAudit): it waits for a spare.
  void Hold(const SlotId& slot, uint64_t owner, Snapshot snapshot, int64_t to_step)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A window Choose chose whose starting snapshot could not be read: dropped, counted.
  void Unread() ABSL_LOCKS_EXCLUDED(mu_);
  // The lowest step whose log a held window of `slot` still needs (its snapshot step), or
  // nothing: a sync's GC must stop there.
  std::optional<int64_t> KeepLogFrom(const SlotId& slot) const ABSL_LOCKS_EXCLUDED(mu_);

  // WaitForTask from spare `incarnation`: an audit to run now, or nothing.
  absl::StatusOr<std::optional<RecoveryTask>> Claim(uint64_t incarnation)
      ABSL_LOCKS_EXCLUDED(mu_);
  // ReadLog: the slot of audit `audit_id` that `incarnation` runs.
  absl::StatusOr<SlotId> AuditSlot(uint64_t audit_id, uint64_t incarnation) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // ReportAudit from the spare that ran it.
  absl::Status Finish(const ReportAuditRequest& report) ABSL_LOCKS_EXCLUDED(mu_);
  // Heartbeat of `incarnation`: PREEMPT_AUDIT while it runs an audit and a slot is LOST.
  std::vector<Command> CommandsFor(uint64_t incarnation) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether the job's end (every slot FINISHED: Membership's STOP) should wait for auditing
  // spare `incarnation`: while a mismatch awaits its second replay (waiting or running, at most
  // audit.max_wait_ms from its first) or the spare runs an audit. A mismatch found is decided
  // before the spares leave; windows never replayed are not waited for.
  bool HoldsAtJobEnd(uint64_t incarnation) ABSL_LOCKS_EXCLUDED(mu_);

  // The audits and their counts, for status (nothing when audits are off).
  void FillStatus(GetStatusResponse* response) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // One replay of a window, waiting or running.
  struct Audit {
    uint64_t id = 0;
    SlotId slot;
    uint64_t trainer = 0;  // the audited incarnation
    std::string trainer_name;
    Snapshot snapshot;     // at step from_step
    int64_t to_step = 0;
    int attempt = 1;
    // A second replay: the first one's id, auditor and mismatch.
    uint64_t confirms = 0;
    uint64_t first_auditor = 0;
    std::string first_auditor_name;
    ReplayMismatch first_mismatch;
    uint64_t accused = 0;  // the sequence number of the first auditor's mismatch report
    absl::Time queued;
    // Running: the spare and since when.
    uint64_t auditor = 0;
    std::string auditor_name;
    absl::Time started;
  };
  // A slot's last sync, to tell whether its next window starts with the same trainer.
  struct LastSync {
    uint64_t owner = 0;
    int64_t step = 0;
    bool owners_first = false;  // the first sync of `owner` on the slot this server saw
  };
  static std::pair<int, int> Key(const SlotId& slot) { return {slot.replica(), slot.stage()}; }

  // Moves expired waiting and running audits to the records (AUDIT_SKIPPED / INCONCLUSIVE).
  void ExpireLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A record of `audit` ending now with `result` (unset: it did not run) and `verdict`.
  AuditStatus& RecordLocked(const Audit& audit, AuditResult result, AuditVerdict verdict,
                            const std::string& detail, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets the verdict of the (recorded) audit `id`, if it is still recorded.
  void SetVerdictLocked(uint64_t id, AuditVerdict verdict) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `audit` waits again (a preempted or expired replay) unless it had kMaxAttempts: then false.
  bool RequeueLocked(Audit audit, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t StepsInLastHourLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const JobConfig job_;
  const bool enabled_;
  const int max_concurrent_;
  const absl::Duration timeout_;   // a running replay's bound: recovery_timeout_ms
  const absl::Duration max_wait_;  // a waiting window's: audit.max_wait_ms
  Membership* const membership_;
  ReliabilityTracker* const tracker_;
  const StepLogService* const step_log_;
  const Clock* const clock_;

  mutable absl::Mutex mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::set<uint64_t> auditors_ ABSL_GUARDED_BY(mu_);  // spares that run audits
  std::map<std::pair<int, int>, LastSync> last_sync_ ABSL_GUARDED_BY(mu_);
  std::deque<Audit> waiting_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Audit> running_ ABSL_GUARDED_BY(mu_);  // by id
  std::set<uint64_t> preempt_ ABSL_GUARDED_BY(mu_);  // running audits told to stop
  // When each trainer's (incarnation's) last window was handed out: the trainers take turns.
  std::map<uint64_t, absl::Time> last_handed_ ABSL_GUARDED_BY(mu_);
  // Reports are numbered in the order they end; each auditor's last matching replay's number:
  // a spare confirms its own mismatch only after a match numbered above it.
  uint64_t reports_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, uint64_t> last_matched_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<absl::Time, int64_t>> chosen_steps_ ABSL_GUARDED_BY(mu_);  // last hour
  std::deque<AuditStatus> records_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, absl::Time> ended_at_ ABSL_GUARDED_BY(mu_);  // records' end times
  AuditCounts counts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rebound::server
