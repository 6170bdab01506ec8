#pragma once

// UpdateRules: every rule an update of a slot must pass before the server applies it, written
// once for every call that applies one (R20): an unsharded job's Sync and Push, a sharded job's
// SyncRange and PushRange (a range group) and group 0's AuthorizeRange, CommitSync and
// CommitPush. The handlers hold the state the rules are checked against (the slot's books, a
// range's kept snapshots); the rules say what an update is against it:
//   * its step (or push sequence) within the job: 1 <= step <= training.max_steps;
//   * a sync's step against the slot's last applied one: the next sync point (apply it), the
//     last applied step again (a retry whose answer was lost: answer it again, change nothing),
//     an older one (stale), or anything else (refused);
//   * a push's sequence against the slot's last applied one: the next (apply), at or below it
//     (a retry: answer it again), beyond the next (refused: it skips ahead);
//   * the optimizer state a sync carries, which becomes the slot's snapshot;
//   * center integrity: an update's distance from the center over the median of its stage's
//     other live trainers' (weighting.max_divergence_ratio);
//   * the slot's book once the update is applied.
// A verdict is a value (Verdict), not a status: a duplicate is an answer, not an error.
//
// Thread-safety: immutable after construction; every method is const or static and may be
// called from any thread, under any lock (nothing here takes one or does I/O).
// Ownership: copies what it needs from the job config.
// Status codes: INVALID_ARGUMENT for what no state of the slot makes valid (a step outside the
// job, a step that is not the slot's next sync point, a malformed optimizer state, a divergence
// beyond the bound: the sender's fault); FAILED_PRECONDITION for what the slot's state refuses
// now (a stale sync, a push that skips ahead).

#include <cstdint>
#include <functional>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "server/slot_books.h"

namespace rebound::server::apply {

// What the server does with an update that passed validation, judged against what the slot has
// applied.
enum class Verdict {
  kApply,      // the slot's next update
  kDuplicate,  // the last applied one again (or, for a push, any at or below it): answer again
  kStale,      // a sync older than the last applied one
};

// Which parts of OptimizerState (m, v, last_hdiag) a sync may carry.
enum class StateParts {
  // Unsharded Sync: each part or not (the slot's snapshot keeps what was sent; an optimizer
  // without a second moment sends no v).
  kAnySubset,
  // SyncRange: all three or none, so that every range snapshot is whole (the Python client
  // sends zeros for a part its optimizer lacks; docs/python.md).
  kAllOrNone,
};

// Checks one tensor bundle of a slot's stage (its layout, finite values); `name` names it in the
// message. CenterTable::ValidateBundle bound to the stage.
using BundleCheck = std::function<absl::Status(const TensorBundle& bundle, const char* name)>;

class UpdateRules {
 public:
  explicit UpdateRules(const JobConfig& job);

  // A sync's step: INVALID_ARGUMENT "step must be >= 1, got s" or "step must be <=
  // training.max_steps = N, got s" (a larger step would finish the slot early and make every
  // later, valid update of it stale).
  absl::Status CheckSyncStep(int64_t step) const;
  // A push's sequence and step: INVALID_ARGUMENT "sequence and step must be >= 1", or the step
  // beyond max_steps as for a sync.
  absl::Status CheckPushStep(uint64_t sequence, int64_t step) const;

  // A sync of `slot` at `step` (CheckSyncStep passed) against the slot's last applied step
  // `last`: kApply when `step` is its next sync point (a multiple of easgd.sync_period, or
  // training.max_steps, at most last + sync_period: trainers sync one sync point at a time, and
  // a jump would finish the slot without its training), kDuplicate when it is `last`, kStale
  // below. INVALID_ARGUMENT for any other step above `last`. `where` follows the slot's name in
  // messages (" in range 2" on a range group).
  absl::StatusOr<Verdict> DecideSync(const SlotId& slot, int64_t last, int64_t step,
                                     absl::string_view where = "") const;
  // FAILED_PRECONDITION "stale sync: slot (r, s) already synced step `last`, got step `step`".
  static absl::Status StaleSync(const SlotId& slot, int64_t last, int64_t step,
                                absl::string_view where = "");

  // A push of `slot` with `sequence` against its last applied sequence `applied`: kApply for
  // applied + 1, kDuplicate at or below `applied`; FAILED_PRECONDITION when it skips ahead.
  static absl::StatusOr<Verdict> DecidePush(const SlotId& slot, uint64_t applied,
                                            uint64_t sequence, absl::string_view where = "");

  // The optimizer state a sync carries, each part it carries checked by `check` (the first
  // failure is returned as is); with kAllOrNone, INVALID_ARGUMENT (from `check`: an empty
  // bundle does not match the layout) when some parts are sent and others not.
  static absl::Status CheckOptimizerState(const OptimizerState& state, StateParts parts,
                                          const BundleCheck& check);
  // True when the state carries none of m, v, last_hdiag.
  static bool CarriesNoState(const OptimizerState& state);

  // Center integrity (R9): `norm` (||x - c|| of a sync, ||g|| of a push: `what`) over `median`,
  // the median of the stage's other live trainers' latest ones (none measured yet: 0, nothing to
  // compare with). INVALID_ARGUMENT, naming the figures and the bound, when the ratio exceeds
  // weighting.max_divergence_ratio (> 0), or is not a number.
  absl::StatusOr<double> DivergenceRatio(const SlotId& slot, double norm,
                                         std::optional<double> median, const char* what) const;

  // A sharded job's commit (CommitSync, CommitPush): the K ranges' results, range k in order,
  // each with a version >= 0 and a finite partial sum of squares >= 0; their sum (||x - c||^2 or
  // ||g||^2 over the whole center). INVALID_ARGUMENT otherwise.
  absl::StatusOr<double> SumOfRangeSquares(
      const google::protobuf::RepeatedPtrField<RangeSyncResult>& ranges) const;

  // The slot's book once it applied a sync of `step`, or a push of `sequence` at `step`.
  static SlotBook AfterSync(SlotBook book, int64_t step);
  static SlotBook AfterPush(SlotBook book, uint64_t sequence, int64_t step);

 private:
  const int64_t sync_period_;
  const int64_t max_steps_;
  const double max_divergence_ratio_;
  const int groups_;
};

}  // namespace rebound::server::apply
