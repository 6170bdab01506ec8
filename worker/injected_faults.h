#pragma once

// Faults a trainer can inject into itself, for the weighting benchmark and chaos tests only
// (docs/operations.md): they model a machine that computes on corrupted data, a naive
// supervisor that restarts a trainer from scratch, a byzantine trainer (issue R9), and silent
// data corruption in memory or arithmetic that audits catch (issue R22).
//
// Thread-safety: InjectedFaults is a value; the functions touch only their arguments.
// Ownership: nothing is kept. Status codes: MaybeResetFromScratch and MaybeFlipBit return the
// compute layer's errors (INVALID_ARGUMENT for a layout mismatch), OK otherwise.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "compute/mlp.h"
#include "compute/step.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"

namespace rebound::worker {

struct InjectedFaults {
  // Non-zero: every label y of the trainer's batches becomes perm[y], perm a fixed random
  // permutation of the classes drawn from this seed (silent data corruption).
  uint64_t label_permutation_seed = 0;
  // Non-zero: every this many steps the trainer drops its parameters and optimizer state and
  // starts again from fresh random parameters.
  int64_t reset_every_steps = 0;
  // Non-zero: a byzantine trainer (issue R9). Every sync (push) from this step on carries
  // `poison_value` with alternating signs (+, -, +, ...) in place of every parameter (of every
  // g and D element); the server must refuse it, and the trainer then exits.
  int64_t poison_from_step = 0;
  float poison_value = 3.4e38f;
  // Non-zero, a sharded job (docs/design.md §10.2): the sync of this step goes to ranges
  // [0, die_in_sync_ranges) only, then the trainer kills itself (SIGKILL) before it commits:
  // a trainer that died between its ranges.
  int64_t die_in_sync_at_step = 0;
  int die_in_sync_ranges = 1;
  // Non-zero: once this step is logged and the server acknowledged its log, the trainer kills
  // itself (SIGKILL): a crash with a known number of logged steps past its last snapshot, for
  // tests that replay them (a kill from outside races the next sync on a fast machine).
  int64_t die_after_logged_step = 0;
  // Non-zero: silent data corruption (issue R22). Right after this step's update, before its
  // checksum is taken and logged, one bit of one parameter of the trainer's (first) stage flips
  // (MaybeFlipBit): the log then holds the corrupted state's checksum, as it would after a bad
  // memory cell or GEMM, and only a replay of the step (an audit) can tell.
  int64_t flip_bit_at_step = 0;
  // Non-zero: the flip repeats every this many steps after flip_bit_at_step (a machine that
  // keeps corrupting); 0: once.
  int64_t flip_bit_repeat_every = 0;
};

// The mantissa bit MaybeFlipBit flips: bit 12 of float32's 23, a relative change of about 2^-11
// that leaves a finite value finite (the exponent is untouched: no NaN, no infinity).
inline constexpr uint32_t kFlippedBitMask = uint32_t{1} << 12;

// From step faults.poison_from_step on, `values` become +value, -value, +value, ...; returns
// whether it did.
bool MaybePoison(const InjectedFaults& faults, int64_t t, std::vector<float>* values);

// The labels a trainer sees: perm[y] for a fixed random permutation of the classes under
// label_permutation_seed; empty (labels unchanged) without it.
std::vector<int32_t> InjectedLabelMap(const InjectedFaults& faults);

// Whether step t is one of the steps flip_bit_at_step and flip_bit_repeat_every name.
bool FlipsBitAt(const InjectedFaults& faults, int64_t t);

// The parameter (packed index) step t's flip corrupts among `count` >= 1:
// (t * 2654435761) mod count, in uint64 arithmetic (Knuth's multiplicative hash: successive
// flips land far apart).
int64_t FlippedParameter(int64_t t, int64_t count);

// At a step FlipsBitAt names: flips kFlippedBitMask of parameter FlippedParameter(t, packed
// size) of `stage` (through a host copy of its parameters: the cost falls on that step only),
// logs it at ERROR ("fault injection: flipped bit 12 of parameter <i> (tensor <name>) after step
// t") and returns true; false, touching nothing, at any other step.
absl::StatusOr<bool> MaybeFlipBit(const InjectedFaults& faults, int64_t t,
                                  compute::MlpStage* stage);

// A naive supervisor's restart before step t (when one is due): fresh random parameters (the
// `resets`-th draw of this replica), zero optimizer state.
absl::Status MaybeResetFromScratch(const InjectedFaults& faults, int64_t t, const JobConfig& job,
                                   const SlotId& slot, int64_t* resets,
                                   compute::LocalTrainer* trainer);

}  // namespace rebound::worker
