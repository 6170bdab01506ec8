#pragma once

// Faults a trainer can inject into itself, for the weighting benchmark and chaos tests only
// (docs/operations.md): they model a machine that computes on corrupted data, a naive
// supervisor that restarts a trainer from scratch, and a byzantine trainer (issue R9).
//
// Thread-safety: InjectedFaults is a value; the functions touch only their arguments.
// Ownership: nothing is kept. Status codes: MaybeResetFromScratch returns the compute layer's
// errors (INVALID_ARGUMENT for a layout mismatch), OK otherwise.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
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
};

// From step faults.poison_from_step on, `values` become +value, -value, +value, ...; returns
// whether it did.
bool MaybePoison(const InjectedFaults& faults, int64_t t, std::vector<float>* values);

// The labels a trainer sees: perm[y] for a fixed random permutation of the classes under
// label_permutation_seed; empty (labels unchanged) without it.
std::vector<int32_t> InjectedLabelMap(const InjectedFaults& faults);

// A naive supervisor's restart before step t (when one is due): fresh random parameters (the
// `resets`-th draw of this replica), zero optimizer state.
absl::Status MaybeResetFromScratch(const InjectedFaults& faults, int64_t t, const JobConfig& job,
                                   const SlotId& slot, int64_t* resets,
                                   compute::LocalTrainer* trainer);

}  // namespace rebound::worker
