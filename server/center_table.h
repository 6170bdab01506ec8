#pragma once

// CenterTable: the EASGD center variables of every stage (docs/design.md §4.4, §4.6), with their
// versions and, in mode ASYNC_ADAHESSIAN, the center's AdaHessian state.
//
// Each stage has its own lock. ElasticSync and ApplyAdaHessian make an update and the durable
// commit of its result under that lock, in that order; ElasticSyncStaged decides the update
// under the lock and writes it after, in the stage's version order. Either way the durable
// record of a stage always matches the order of its in-memory updates, and an update is
// acknowledged only once durable. If a commit fails the caller gets its error: ElasticSync's
// move is rolled back; an AdaHessian apply or a staged sync leaves the stage refusing work
// until Restore. Readers (Read, version, WaitForVersion) see only durable versions.
//
// Integrity (issue R9). Every value an update would produce is checked before anything is
// committed or swapped in: the new center and the worker's post-sync snapshot (ElasticSync), and
// the new center with its m and v (ApplyAdaHessian). A value that is not finite, or (center and
// snapshot) whose magnitude exceeds the job's weighting.max_abs_value, makes the call return
// INVALID_ARGUMENT naming the tensor, the element and the value, with the stage exactly as it
// was (center, version, m, v; the commit is not called).
//
// Parameters travel as TensorBundles with one FLOAT32 tensor per model tensor, in ascending
// global tensor id order (compute/model_layout.h), exactly the shapes of the stage's layout.
//
// Thread-safety: thread-safe; one lock per stage. The weight and commit functions are called
// under the stage's lock and may take the locks to its right in the server's lock order
// (server/recovery_coordinator.h) but never a stage lock. Ownership: owns the centers; the
// functions passed to an update are borrowed for the call. Status codes: INVALID_ARGUMENT
// (malformed input, integrity), the weight or commit function's own error, UNAVAILABLE from a
// stage that refuses work after a failed commit; Restore also DATA_LOSS.

#include <atomic>
#include <cstdint>
#include <string>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "compute/model_layout.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "proto/storage.pb.h"

namespace rebound::server {

class CenterTable {
 public:
  // The centers start from the model's deterministic initialisation (the same values every
  // trainer starts from). A job whose model is declared by its workers
  // (model.declared_by_worker, docs/design.md §11) has no stage until Declare. INVALID_ARGUMENT for
  // an invalid job.
  //
  // A sharded job (sharding.groups = K > 1, docs/design.md §10.2): the table holds range `range` of
  // every stage (compute/shard_ranges.h), each a one-tensor stage of its own, starting from the
  // same slice of the initialisation; INVALID_ARGUMENT if `range` is not in [0, K) or a range
  // would be empty. `range` is ignored for K = 1.
  static absl::StatusOr<std::unique_ptr<CenterTable>> Create(const JobConfig& job, int range = 0);

  CenterTable(const CenterTable&) = delete;
  CenterTable& operator=(const CenterTable&) = delete;

  // 0 until a declared model is declared; every other function's `stage` must be below it.
  int num_stages() const { return num_stages_.load(std::memory_order_acquire); }
  const compute::StageLayout& layout(int stage) const { return stages_[stage]->layout; }

  // A declared-model job: fixes the model's layout and the center's values from `model`
  // (RegisterRequest.model: every tensor with its initial values), at version 0. Called once,
  // after the caller made the declaration durable. INVALID_ARGUMENT for a malformed model
  // (compute::StageLayout::FromDeclared; data that does not match the shapes or is not finite),
  // FAILED_PRECONDITION if the job's model is an MLP spec or already declared. A sharded job's
  // table holds its range of the declared stage, from the same slice of the declared values.
  absl::Status Declare(const TensorBundle& model);

  // A sharded declared-model job keeps its declaration (the whole model with its initial
  // values, CenterRecord.params) under this stage key of the center column family: its stage 0
  // record holds the group's range, from which the model cannot be declared again.
  static constexpr int kDeclarationStage = 0x7fffffff;

  // The declared model as Declare received it; FAILED_PRECONDITION before Declare (or for an
  // MLP job).
  absl::StatusOr<TensorBundle> Declaration() const;
  // The number of parameters of the whole stage `stage` (all ranges of a sharded job);
  // REQUIRES: stage < num_stages().
  int64_t StageParameters(int stage) const;

  // OK iff `model` (RegisterRequest.model) declares exactly the job's tensors: ids, names,
  // dtypes and shapes of every stage's tensors in order (its data is not compared). Otherwise
  // FAILED_PRECONDITION naming the first differing tensor and `fixed_by` (who fixed the
  // layout, for the message). REQUIRES: num_stages() > 0.
  absl::Status CheckModel(const TensorBundle& model, const std::string& fixed_by) const;

  // Restores a stage from its durable records (after a server restart); an unsharded
  // declared-model job's first restored record declares the model (a sharded one's declaration
  // is its kDeclarationStage record, which the caller Declares first). INVALID_ARGUMENT /
  // DATA_LOSS if the record does not fit the stage's layout.
  absl::Status Restore(const CenterRecord& center, const CenterOptRecord* opt);

  // Checks that `bundle` holds exactly the stage's tensors (ids, shapes, FLOAT32, byte lengths)
  // and only finite values. INVALID_ARGUMENT naming the tensor otherwise. `what` prefixes the
  // message (e.g. "params").
  absl::Status ValidateBundle(int stage, const TensorBundle& bundle, const std::string& what) const;

  // Packs a validated bundle into the packed layout.
  std::vector<float> Unbundle(int stage, const TensorBundle& bundle) const;
  // The inverse: one tensor per model tensor.
  TensorBundle Bundle(int stage, absl::Span<const float> packed) const;

  // What an update's weight step decides under the stage lock, from the center version before
  // the update and ||x - c|| (EASGD) or ||g|| (ASYNC_ADAHESSIAN): apply the update with a
  // weight, or decline it (the caller recognised it as already applied: a retry whose reply was
  // lost), in which case nothing changes and the update returns a declined Update. An error
  // refuses the update, with nothing changed, and is the update's error.
  class WeightDecision {
   public:
    // Apply with this weight.
    WeightDecision(double weight) : weight_(weight) {}  // NOLINT(runtime/explicit)
    static WeightDecision Decline() {
      WeightDecision decision(0.0);
      decision.declined_ = true;
      return decision;
    }
    bool declined() const { return declined_; }
    double weight() const { return weight_; }

   private:
    double weight_;
    bool declined_ = false;
  };
  using WeightFn =
      std::function<absl::StatusOr<WeightDecision>(int64_t version_before, double norm)>;

  // What an update that did not fail did.
  struct Update {
    // The weight step declined it: nothing changed (no commit, no new version).
    bool declined = false;
    // The stage's new version (applied), or its version when the update was declined.
    int64_t version = 0;
  };
  // Writes the stage's new center (packed) with its new version and the worker's post-sync
  // parameters (packed) durably; called under the stage lock. `center_before` is the center
  // before the move, for the reply. The spans are valid only during the call.
  using CommitFn = std::function<absl::Status(
      int64_t version, absl::Span<const float> center, absl::Span<const float> worker_after,
      absl::Span<const float> center_before)>;

  // §4.4: c <- c + alpha w (x - c). Writes the worker's post-sync parameters
  // x - alpha (x - c_before) to `worker_after` (its snapshot; a caller-owned buffer of the
  // stage's packed size), checks the results (see Integrity above), commits, and returns the
  // new version (or a declined Update). On a weight, integrity or commit error the center is
  // unchanged.
  // REQUIRES: x validated for `stage`.
  absl::StatusOr<Update> ElasticSync(int stage, absl::Span<const float> x, double alpha,
                                     const WeightFn& weight, const CommitFn& commit,
                                     absl::Span<float> worker_after);

  // The staged form of ElasticSync (the unsharded Sync's: docs/storage.md "Staged syncs"):
  // only the move and the decisions that need the update's order happen under the stage's
  // lock; the bytes are written after it is released, beside the stage's next syncs.
  //   1. Under the lock: `weight`, the move and the integrity checks as in ElasticSync, then
  //      `decide` with the new version, the new center, the worker's post-sync parameters and
  //      c_before (the caller's in-memory bookkeeping, and the write it will need). An error
  //      from either leaves everything as it was. Then the new center is the stage's: the next
  //      sync moves from it.
  //   2. Outside the lock: StagedWrite::prepare (the tensor files, the reply), then, in the
  //      stage's version order, StagedWrite::write (the records), then StagedWrite::await (the
  //      standbys). The spans given to `decide` stay valid until the call returns.
  // The call returns the new version once all three succeeded: the update is durable (and
  // replicated). A declined decision returns at once, with nothing decided or written. If one
  // of the three fails, the call returns its error and the stage refuses every later call
  // (UNAVAILABLE, as after a failed ApplyAdaHessian commit) until Restore: the decided center
  // holds an update that is not durable, so every sync decided after it fails at its turn
  // without writing. Read, version and WaitForVersion see only durable versions.
  struct StagedWrite {
    std::function<absl::Status()> prepare;
    std::function<absl::Status()> write;
    std::function<absl::Status()> await;
  };
  using DecideFn = std::function<absl::StatusOr<StagedWrite>(
      int64_t version, absl::Span<const float> center, absl::Span<const float> worker_after,
      absl::Span<const float> center_before)>;
  absl::StatusOr<Update> ElasticSyncStaged(int stage, absl::Span<const float> x, double alpha,
                                           const WeightFn& weight, const DecideFn& decide,
                                           absl::Span<float> worker_after);

  // Blocks until every staged sync of `stage` decided so far is durable (or the stage lost).
  void AwaitWrites(int stage) const;

  // §4.6: the weighted AdaHessian apply of (g, D) on the center; returns the new version. The
  // results are computed into spare buffers and checked (see Integrity above) before they are
  // committed and swapped in, so a refused push changes nothing. If `commit` fails, the call
  // returns the commit's error and the stage refuses every later call (UNAVAILABLE, "...
  // refuses work until the server restarts ...") until Restore: a failing commit means a
  // failing store, which needs the operator. REQUIRES: validated inputs.
  using OptCommitFn = std::function<absl::Status(
      int64_t version, absl::Span<const float> center, int64_t opt_step,
      absl::Span<const float> m, absl::Span<const float> v)>;
  absl::StatusOr<Update> ApplyAdaHessian(int stage, absl::Span<const float> g,
                                         absl::Span<const float> d, const AdaHessianConfig& config,
                                         const WeightFn& weight, const OptCommitFn& commit);

  // The center of `stage` and its version, the last durable one; the stage's UNAVAILABLE if it
  // was lost.
  absl::StatusOr<std::pair<std::vector<float>, int64_t>> Read(int stage) const;
  int64_t version(int stage) const;

  // The largest |value| of the center and snapshots that the stage's accepted updates produced
  // (0 before the first), to compare with weighting.max_abs_value.
  float max_abs_seen(int stage) const;
  // The bound the integrity check applies to center and snapshot values (FLT_MAX when
  // weighting.max_abs_value is 0: finite only).
  float max_abs_value() const { return max_abs_value_; }

  // OK, or the status of the first stage that refuses work after a failed commit (the server
  // then reports NOT_SERVING so that its supervisor restarts it).
  absl::Status Health() const;

  // Blocks until the stage's durable version reaches `min_version` or `timeout` passes;
  // returns the durable version then.
  int64_t WaitForVersion(int stage, int64_t min_version, absl::Duration timeout) const;

 private:
  struct Stage {
    explicit Stage(compute::StageLayout l) : layout(std::move(l)) {}
    // The decided center is durable: nothing staged in flight (Create, Declare, Restore and
    // the updates that commit under the lock).
    void PublishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
    bool NoWritesInFlight() const ABSL_SHARED_LOCKS_REQUIRED(mu);
    // The spare buffer, of n floats, owned by the stage alone (a new one if a staged sync or
    // a reader still holds the old).
    std::vector<float>& WritableSpareLocked(size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

    // Freed center buffers, for the next spares (no page faults per sync): a buffer returns
    // here when its last holder lets go. Shared with the buffers' deleters.
    struct BufferPool {
      absl::Mutex mu;
      std::vector<std::unique_ptr<std::vector<float>>> free ABSL_GUARDED_BY(mu);
    };
    std::shared_ptr<std::vector<float>> AcquireBuffer(size_t n);

    const compute::StageLayout layout;
    const std::shared_ptr<BufferPool> pool = std::make_shared<BufferPool>();
    mutable absl::Mutex mu;
    // Staged syncs between their decision and their end (see kMaxStagedInFlight).
    int staged_in_flight ABSL_GUARDED_BY(mu) = 0;
    // The decided center (packed layout) and its version: every update moves from it.
    // Buffers are shared and never written once published (a staged sync's write, a reader's
    // copy may still hold one).
    std::shared_ptr<std::vector<float>> center ABSL_GUARDED_BY(mu) =
        std::make_shared<std::vector<float>>();
    // Where an update writes the moved center before swapping it in (no copy of c_before, no
    // rollback).
    std::shared_ptr<std::vector<float>> spare ABSL_GUARDED_BY(mu);
    int64_t version ABSL_GUARDED_BY(mu) = 0;
    // The last version whose records are written (staged syncs write in version order), and
    // the last durable (written and replicated) version with its center: what readers see.
    int64_t written ABSL_GUARDED_BY(mu) = 0;
    int64_t durable_version ABSL_GUARDED_BY(mu) = 0;
    std::shared_ptr<const std::vector<float>> durable_center ABSL_GUARDED_BY(mu);
    // Center AdaHessian state (mode ASYNC_ADAHESSIAN), packed layout; empty until first push.
    std::vector<float> m ABSL_GUARDED_BY(mu);
    std::vector<float> v ABSL_GUARDED_BY(mu);
    // Where ApplyAdaHessian writes the new m and v (the new center goes to `spare`), so that
    // they are checked before they are swapped in; allocated at the first push.
    std::vector<float> spare_m ABSL_GUARDED_BY(mu);
    std::vector<float> spare_v ABSL_GUARDED_BY(mu);
    float max_abs_seen ABSL_GUARDED_BY(mu) = 0.0f;
    int64_t opt_step ABSL_GUARDED_BY(mu) = 0;
    // Not OK once an update could not be committed (ApplyAdaHessian, a staged sync): the
    // stage refuses all work with this status until Restore.
    absl::Status lost ABSL_GUARDED_BY(mu);
  };

  CenterTable() = default;

  // At most this many staged syncs of a stage are decided and not yet done; the next waits
  // before its move. It bounds the center buffers and the files written at once (64 syncs
  // writing at once on 2 cores spent their time in page faults and the page cache:
  // docs/benchmarks.md, "Staged syncs").
  static constexpr int kMaxStagedInFlight = 2;
  // Freed buffers a stage keeps for reuse.
  static constexpr size_t kPooledBuffers = kMaxStagedInFlight + 2;

  // What ElasticSync and ElasticSyncStaged do first, under the stage's lock: the stage's
  // health, the sizes, the weight step and, unless it declined, the move into the stage's
  // spare buffer with the integrity checks (`*max_abs` the largest value seen, for the caller
  // to keep once the update is its).
  absl::StatusOr<WeightDecision> MoveLocked(Stage& s, int stage, absl::Span<const float> x,
                                            double alpha, const WeightFn& weight,
                                            absl::Span<float> worker_after, float* max_abs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // The move itself (MoveLocked's last step).
  absl::Status MoveIntoSpare(Stage& s, int stage, absl::Span<const float> x, double alpha,
                             double w, absl::Span<float> worker_after, float* max_abs)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // A staged sync's write failed: the stage is lost (see ElasticSyncStaged); returns `error`.
  static absl::Status LoseLocked(Stage& s, int stage, int64_t version, const absl::Status& error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);

  float max_abs_value_ = 0.0f;
  bool declared_model_ = false;  // model.declared_by_worker
  int groups_ = 1;               // sharding.groups
  int range_ = 0;                // the range this table holds when groups_ > 1
  // A declared model: the declaration and its whole layout, set by Declare before it publishes
  // num_stages_ (as stages_).
  TensorBundle declaration_;
  std::unique_ptr<compute::StageLayout> declared_layout_;
  // An MLP job: each whole stage's parameter count.
  std::vector<int64_t> stage_parameters_;
  // Serializes Declare.
  absl::Mutex declare_mu_;
  // Every stage of an MLP job, from Create on. A declared-model job: one entry, null until
  // Declare fills it and then publishes num_stages_ (release), so a reader that checks
  // num_stages() first (acquire) sees the whole stage; never changed afterwards.
  std::vector<std::unique_ptr<Stage>> stages_;
  std::atomic<int> num_stages_{0};
};

// ||a - b||, summed in a fixed order (float lanes per block of 1024 elements, blocks in double),
// so the result is deterministic; relative error about 1e-6. REQUIRES: equal sizes.
double Distance(absl::Span<const float> a, absl::Span<const float> b);
// ||a|| in double, likewise.
double Norm(absl::Span<const float> a);

}  // namespace rebound::server
