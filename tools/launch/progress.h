#pragma once

// What the launcher prints while a job runs, derived from successive GetStatus replies: events
// (a worker registered or changed state, a slot changed state or owner, a recovery appeared or
// ended) and one compact progress line per second, plus the matching CSV rows.
//
// Pure: it never talks to the server, so it is unit-tested with hand-built replies.
// Not thread-safe.

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "proto/rebound.pb.h"
#include "tools/launch/options.h"

namespace rebound::launch {

// The header row of --progress_csv.
extern const char kCsvHeader[];

// "(r,s)", as events print a slot.
std::string FormatSlot(const SlotCoord& slot);

// "r<r>s<s>", as the CSV's slot column prints a slot.
std::string CsvSlot(const SlotCoord& slot);

// A field quoted for CSV when it holds a comma, a quote or a line break.
std::string CsvField(const std::string& field);

struct ProgressEvent {
  std::optional<SlotCoord> slot;  // the slot it concerns, if any
  std::string text;               // e.g. "slot (1,0): ACTIVE -> LOST: ..."
};

// One slot as of the latest reply.
struct SlotProgress {
  SlotCoord slot;
  SlotState state = UNASSIGNED;
  int64_t step = 0;
  std::optional<double> loss;    // the owner's last training loss (kept while the slot is LOST)
  std::optional<double> weight;  // the slot's reliability weight, once the server reports one
  uint64_t owner = 0;            // owner incarnation, 0 = none
};

class ProgressTracker {
 public:
  ProgressTracker() = default;

  // Compares `status` with the previous reply (initially: every slot UNASSIGNED, no workers, no
  // recoveries) and returns what changed, in this order: workers (registered, state, role or slot
  // changed), slots (state or owner changed), recoveries (new, or outcome changed).
  std::vector<ProgressEvent> Update(const GetStatusResponse& status);

  // Slots of the latest reply, in the server's order (replica-major).
  const std::vector<SlotProgress>& slots() const { return slots_; }
  const SlotProgress* FindSlot(const SlotCoord& slot) const;

  // The name of the worker that owns `slot` now, if the slot has a known owner.
  std::optional<std::string> OwnerName(const SlotCoord& slot) const;

  // The newest ALIVE worker with this name, if any.
  const WorkerStatus* FindAliveWorker(const std::string& name) const;

  std::optional<double> test_accuracy() const { return test_accuracy_; }
  std::optional<double> test_loss() const { return test_loss_; }
  // The center version the last evaluation was of, and stage 0's center version now.
  std::optional<int64_t> evaluated_version() const { return evaluated_version_; }
  std::optional<int64_t> center_version() const { return center_version_; }
  int recoveries() const { return recoveries_; }

  // True once the latest reply has at least one slot and every slot is FINISHED.
  bool AllFinished() const;

  // "0,0:152/0.4312/w=0.91 1,0:148/-/w=-(LOST) acc=0.8123 recoveries=1", the per-second line
  // (without the elapsed time, which the launcher prefixes).
  std::string ProgressLine() const;

  // One CSV row per slot: elapsed_s,slot,step,loss,weight,test_accuracy with an empty event.
  std::vector<std::string> CsvRows(double elapsed_s) const;

  // The CSV row of an event: the slot's columns when it concerns a slot, the event text last.
  std::string CsvEventRow(double elapsed_s, const ProgressEvent& event) const;

 private:
  struct KnownWorker {
    std::string name;
    WorkerRole role = ROLE_UNSPECIFIED;
    WorkerState state = WORKER_STATE_UNSPECIFIED;
    std::optional<SlotCoord> slot;
  };

  GetStatusResponse latest_;
  std::vector<SlotProgress> slots_;
  std::map<uint64_t, KnownWorker> workers_;        // by incarnation
  std::map<uint64_t, RecoveryOutcome> recovery_outcomes_;  // by task id
  std::map<std::pair<int, int>, double> last_loss_;  // by slot, survives a lost owner
  std::optional<double> test_accuracy_;
  std::optional<double> test_loss_;
  std::optional<int64_t> evaluated_version_;
  std::optional<int64_t> center_version_;
  int recoveries_ = 0;
  std::set<uint64_t> audit_verdicts_;  // audits whose verdict was reported
};

}  // namespace rebound::launch
