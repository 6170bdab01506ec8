#pragma once

// DurableStore: the parameter server's durable state in RocksDB (docs/design.md §5.2, §5.5, §6).
//
// What it holds, one column family each (key layout: storage/keys.h):
//
// | family       | key (big-endian)              | value                                       |
// |--------------|-------------------------------|---------------------------------------------|
// | `center`     | stage                         | CenterRecord: center parameters, version    |
// | `center_opt` | stage                         | CenterOptRecord: the center's AdaHessian    |
// |              |                               | moments (mode ASYNC_ADAHESSIAN)             |
// | `snapshot`   | replica, stage                | Snapshot: a slot's state at its last sync   |
// | `steplog`    | replica, stage, step,         | LogRecord: one (step, micro-batch) record,  |
// |              | micro_batch + 1               | or a step's checksum (micro_batch = -1)     |
// | `weights`    | replica, stage                | WeightRecord: reliability tracker inputs    |
// | `meta`       | "server"                      | ServerRecord: job id, incarnation counters  |
// | `meta`       | "slot/", replica, stage       | SlotRecord: owner, step, applied sequence   |
// | `meta`       | "replication"                 | ReplicationRecord: last (epoch, sequence)   |
//
// Tensor files. The tensors of `center`, `center_opt` and `snapshot` records (whole parameter
// and optimizer-state vectors, rewritten at every sync) do not go through the LSM tree: their
// bytes are written to a file of their own in `<data_dir>/tensors/` (storage/tensor_files.h)
// and the RocksDB record keeps the tensors' metadata plus a TensorBlob naming the file, its
// length, its XXH3 checksum and each tensor's byte count. Commit writes the files first and the
// RocksDB batch after; a record's previous file is kept, unused, and overwritten by the key's
// next write (so a key holds two files, and a sync allocates no new disk space); Open removes
// files no record names. Readers get records with their tensors' data
// filled in, as if it had been stored inline.
//
// RocksDB's `default` family exists (RocksDB requires it) and stays empty. Families missing on
// disk are created at Open; families found on disk that this version does not know are opened
// with default options and left alone (so a newer layout can be opened by an older binary).
//
// Every integer in a key is fixed-width big-endian, so a slot's step log sorts by (replica,
// stage, step, micro_batch) and the per-step record (micro_batch = -1) comes first in its step.
// Every value is a protobuf record inside a checksummed envelope (storage/envelope.h:
// [u32 version = 1][u32 payload length][u64 xxHash64(payload)][payload], integers
// little-endian).
//
// `steplog` is compressed as configured (ZSTD by default, or LZ4, or none); if the linked
// RocksDB lacks the codec, Open logs a warning and uses the other of ZSTD/LZ4, else none.
// The other families use RocksDB's default compression (Snappy when available).
//
// Error codes (absl::StatusCode), by the retry rule of docs/design.md §5.1:
//   INVALID_ARGUMENT     a record lacks a key field or has a negative one (rejected at the
//                        WriteBatch, so nothing of that batch is written); a negative slot in
//                        ReadLog / ReadSnapshot.
//   DATA_LOSS            a stored value or key is corrupt: truncated, wrong length, bad
//                        checksum, unknown envelope version, unparsable protobuf, a record whose
//                        own key fields disagree with its key, or RocksDB reporting corruption.
//                        The message names the column family and the key, e.g.
//                        "steplog key (r=0, s=1, step=17, mb=3): checksum mismatch (...)".
//                        Also a tensor file that is missing, has the wrong length, or fails its
//                        checksum ("... tensor file <path>: checksum mismatch").
//   FAILED_PRECONDITION  Open: data_dir is locked by another process or another open store
//                        ("data_dir /x is in use: ..."), or cannot be created. SetEpoch: a
//                        smaller epoch. ApplyReplicated: an older epoch, a gap, a diverged
//                        history, or a store that captures.
//   NOT_FOUND            ReadSnapshot: the slot has no snapshot.
//   RESOURCE_EXHAUSTED   the disk is full (RocksDB NoSpace).
//   UNAVAILABLE          other RocksDB I/O errors, busy / try-again / shutting down; the
//                        message carries RocksDB's.
//   INTERNAL             anything else RocksDB reports.
//
// A damaged write-ahead log (a flipped byte, a damaged record length) fails Open with DATA_LOSS
// naming the WAL file: RocksDB runs in absolute-consistency recovery, never dropping a write
// silently; DurableStoreOptions::accept_wal_loss is the operator's way past it. The one damage
// Open recovers past by itself, logging a WARNING, is a write torn by a crash at the end of the
// newest WAL file, which was never acknowledged (storage/wal_tail.h, docs/storage.md).
//
// Durability: Commit returns OK only after RocksDB has applied the batch and written it to its
// write-ahead log; with `fsync` the WAL and the batch's tensor files are also synced (fdatasync)
// before Commit returns, so the batch survives power loss; without it, it survives a process
// crash (docs/design.md §5.5).
//
// Replicated commits (docs/design.md §10.1, docs/storage.md "Replicated commits"). With
// DurableStoreOptions::replication_sink set (a leader), Commit numbers every non-empty batch:
// under one mutex it takes the next sequence (1, 2, ... gap-free, continuing after a restart),
// writes the batch plus the `meta` "replication" record (epoch, sequence) in the same RocksDB
// batch, and hands the sink a ReplicatedCommit, so the sink sees commits in exactly RocksDB's
// order. ApplyReplicated redoes such a commit on a standby, in order and exactly once (a
// duplicate is OK and writes nothing; a gap, an older epoch or a diverged history is
// FAILED_PRECONDITION); Checkpoint copies the store at a cut for a standby to catch up from.
// Without the sink Commit is exactly as before: no lock, no meta record.
// A standby must not Commit batches of its own (they would not be numbered).
//
// Thread safety: a DurableStore may be used from any number of threads at once without
// external locking (RocksDB's DB is thread-safe; after Open the store keeps no mutable state of
// its own besides the tensor files' bookkeeping and the replication position, which locks
// guard). Each Commit is atomic; concurrent Commits are applied in some serial order, so a
// caller that needs an order between two batches (e.g. per stage) must serialize them itself.
// Reads see a consistent point in time per call. A WriteBatch is a plain value: one thread at a
// time.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "proto/storage.pb.h"
#include "storage/keys.h"
#include "storage/tensor_files.h"

namespace google::protobuf {
class MessageLite;
}  // namespace google::protobuf

namespace rocksdb {
class ColumnFamilyHandle;
class DB;
class Env;
}  // namespace rocksdb

namespace rebound::storage {

struct DurableStoreOptions {
  // RocksDB directory, created (with its parents) if missing. Empty = in memory: a private
  // rocksdb::NewMemEnv, nothing touches the file system and everything is lost at destruction
  // (tests and the stateless mode).
  std::string data_dir;
  // true: every Commit syncs RocksDB's write-ahead log before returning (power-loss safe).
  bool fsync = false;
  // Damage in RocksDB's write-ahead log (other than a write torn by a crash) fails Open with
  // DATA_LOSS naming the WAL file, since acknowledged writes may be in the damaged part
  // (docs/storage.md). true (the server's
  // --accept_wal_loss, for an operator who accepts the loss): Open keeps a copy of the WAL files
  // in <data_dir>/wal-damaged-<unix time>/, recovers to the last intact write, logs (ERROR) what
  // it dropped, and succeeds. No effect on an intact log.
  bool accept_wal_loss = false;
  // Compression of the `steplog` family. COMPRESSION_UNSPECIFIED means ZSTD.
  Compression steplog_compression = ZSTD;
  // Set (a replication leader): every successful non-empty Commit is numbered and handed to
  // this function as a ReplicatedCommit, called under the store's replication mutex in commit
  // order, after RocksDB applied the batch. It must be quick (enqueue) and must not call back
  // into this store's Commit, SetEpoch or ApplyReplicated. Unset: Commit is as without
  // replication (no lock, no `meta` "replication" record).
  std::function<void(ReplicatedCommit)> replication_sink;

  // From the server's `durability` and the job's `step_log` configuration.
  static DurableStoreOptions FromConfig(const DurabilityConfig& durability,
                                        const StepLogConfig& step_log);
};

// (replica, stage).
using ReplicaStage = std::pair<int32_t, int32_t>;

// Everything LoadAll returns: the server's state after a restart (docs/design.md §5.5).
struct LoadedState {
  std::map<int32_t, CenterRecord> centers;         // by stage
  std::map<int32_t, CenterOptRecord> center_opts;  // by stage
  std::map<ReplicaStage, Snapshot> snapshots;
  // A range group's (sharded job): the headers of each slot's range snapshots (copies 0 and 1;
  // their tensors stay on disk: ReadRangeSnapshot), keyed by (replica, stage) and copy.
  std::map<std::pair<ReplicaStage, int>, Snapshot> range_snapshots;
  // A range group's push books (sharded ASYNC_ADAHESSIAN): each slot's applied sequence.
  std::map<ReplicaStage, WeightRecord> range_books;
  std::map<ReplicaStage, WeightRecord> weights;
  std::map<ReplicaStage, SlotRecord> slots;
  std::optional<ServerRecord> server;  // absent in a store that never had one written
};

// RocksDB's own estimates for one column family.
struct ColumnFamilyStats {
  uint64_t sst_bytes = 0;        // rocksdb.total-sst-files-size
  uint64_t memtable_bytes = 0;   // rocksdb.cur-size-all-mem-tables
  uint64_t live_data_bytes = 0;  // rocksdb.estimate-live-data-size (SST data still live)
  uint64_t keys_estimate = 0;    // rocksdb.estimate-num-keys (ignores range deletions
                                 // until compaction, so it lags after a log GC)
  uint64_t approximate_bytes() const { return sst_bytes + memtable_bytes; }
};

struct StoreStats {
  // By column family name: exactly "center", "center_opt", "snapshot", "steplog", "weights",
  // "meta".
  std::map<std::string, ColumnFamilyStats> column_families;
  uint64_t steplog_keys_estimate = 0;  // = column_families["steplog"].keys_estimate
  uint64_t tensor_file_bytes = 0;      // the tensor files (outside RocksDB)
  uint64_t total_bytes = 0;  // sum of approximate_bytes() over the families + tensor files
};

// An atomic group of writes for DurableStore::Commit. Each Put serializes its record at once
// (the caller may reuse or change the record afterwards). Writes apply in the order added, so a
// later Put of the same key wins.
//
// The first invalid record (a key field missing or negative; a record over 2 GiB) poisons the
// batch: later operations are ignored, status() returns the INVALID_ARGUMENT error, and Commit
// returns it without writing anything. Required key fields:
//   PutCenter, PutCenterOpt: stage.   PutSnapshot, PutWeight, PutSlot: slot.replica, slot.stage.
//   PutLogRecord: slot.replica, slot.stage, step, micro_batch (>= -1; -1 = per-step record).
//   PutServer: none.
class WriteBatch {
 public:
  WriteBatch();
  ~WriteBatch();

  WriteBatch(WriteBatch&&) noexcept;
  WriteBatch& operator=(WriteBatch&&) noexcept;
  WriteBatch(const WriteBatch&) = delete;
  WriteBatch& operator=(const WriteBatch&) = delete;

  void PutCenter(const CenterRecord& record);
  void PutCenterOpt(const CenterOptRecord& record);
  void PutSnapshot(const Snapshot& snapshot);

  // The same without copying the tensors: `header` holds every tensor's metadata with empty
  // `data`, and `data[i]` is the data of the record's i-th tensor (in the order params, then
  // optimizer m, v, last_hdiag for a snapshot; state m, v, last_hdiag for a center_opt). The
  // batch refers to `data`, which must stay valid and unchanged until the last Commit of this
  // batch returns. A count that does not match, or a header tensor with data, poisons the batch.
  void PutCenter(const CenterRecord& header, std::vector<absl::string_view> data);
  void PutCenterOpt(const CenterOptRecord& header, std::vector<absl::string_view> data);
  void PutSnapshot(const Snapshot& header, std::vector<absl::string_view> data);
  // A range group's snapshot of a slot's range (sharded job, storage/keys.h), copy 0 or 1: a
  // copying put and one that references `data` as the other zero-copy puts do.
  void PutRangeSnapshot(const Snapshot& snapshot, int copy);
  void PutRangeSnapshot(const Snapshot& header, std::vector<absl::string_view> data, int copy);
  void PutWeight(const WeightRecord& record);
  void PutSlot(const SlotRecord& record);
  // A range group's push book of a slot (sharded ASYNC_ADAHESSIAN, storage/keys.h).
  void PutRangeBook(const WeightRecord& record);
  void PutServer(const ServerRecord& record);
  void PutLogRecord(const LogRecord& record);

  // Deletes every step-log record of `slot` with from_step_inclusive <= step <
  // to_step_exclusive, all micro-batches and the per-step record (one RocksDB DeleteRange).
  // A negative `from_step_inclusive` counts as 0; an empty range adds nothing.
  // REQUIRES: slot.replica and slot.stage set and >= 0 (else the batch is poisoned).
  void DeleteLogRange(const SlotId& slot, int64_t from_step_inclusive, int64_t to_step_exclusive);

  // OK, or the INVALID_ARGUMENT of the first rejected operation.
  const absl::Status& status() const { return status_; }
  // Number of operations added (rejected ones excluded).
  size_t Count() const { return operations_.size(); }
  // Bytes of keys and values added.
  size_t ApproximateBytes() const { return bytes_; }
  // Removes every operation and clears a poisoned status.
  void Clear();

 private:
  friend class DurableStore;

  struct Operation {
    ColumnFamily family;
    bool delete_range;
    std::string key;
    std::string header;   // put: envelope header; delete_range: unused
    std::string payload;  // put: serialized record; delete_range: the exclusive end key
    // A record with tensors: `payload` is the record without their data, which goes to a
    // tensor file named after `file_prefix` at Commit; `data` are the tensors' bytes, in
    // `owned` (copying Puts) or the caller's memory.
    bool has_tensors = false;
    std::string file_prefix;
    std::vector<absl::string_view> data;
    std::unique_ptr<std::vector<std::string>> owned;
  };

  void Put(ColumnFamily family, std::string key, const google::protobuf::MessageLite& record);
  // `header`'s tensors have no data; `data` (and `owned`, if it holds them) are their bytes.
  void PutWithTensors(ColumnFamily family, std::string key, std::string file_prefix,
                      const google::protobuf::MessageLite& header,
                      std::vector<absl::string_view> data,
                      std::unique_ptr<std::vector<std::string>> owned);
  void Reject(absl::Status status);

  std::vector<Operation> operations_;
  size_t bytes_ = 0;
  absl::Status status_;
};

class DurableStore {
 public:
  // Opens (creating if missing) the store described by `options`.
  // Errors: FAILED_PRECONDITION when data_dir is locked by another process or another open
  // DurableStore, or cannot be created; DATA_LOSS when RocksDB finds its files corrupt;
  // otherwise as in the table above. The message always names data_dir.
  static absl::StatusOr<std::unique_ptr<DurableStore>> Open(const DurableStoreOptions& options);

  // Closes RocksDB (waiting for its background work) and releases the directory lock.
  ~DurableStore();

  DurableStore(const DurableStore&) = delete;
  DurableStore& operator=(const DurableStore&) = delete;

  // A replicated commit's place: (epoch, sequence).
  struct Position {
    uint64_t epoch = 0;
    uint64_t sequence = 0;
    bool operator==(const Position& other) const {
      return epoch == other.epoch && sequence == other.sequence;
    }
  };

  // Writes `batch` as one atomic RocksDB write batch: after a crash either all of it or none of
  // it is visible. OK only after RocksDB has committed it (and synced the WAL if `fsync`). An
  // empty batch is OK and writes nothing. A poisoned batch returns its INVALID_ARGUMENT. The
  // batch is not changed and may be committed again. On a capturing store, `*numbered` (if
  // given) receives the (epoch, sequence) the commit got, e.g. to wait for the standbys'
  // acknowledgements of it; it is left unchanged for an empty batch, an error or a store that
  // does not capture.
  absl::Status Commit(const WriteBatch& batch, Position* numbered = nullptr);

  // Commit in three parts, for a caller that orders its commits itself and must not hold its
  // own lock while the bytes are written (server/center_table.h's staged sync):
  //   Prepare writes the batch's tensor files: any number at once, in any order, outside every
  //     lock of the store; nothing is visible yet (a crash leaves files that no record names,
  //     which Open removes).
  //   Write commits the records in one RocksDB batch (numbered and handed to the sink on a
  //     capturing store) in the order the caller calls it; the batch is then as durable as
  //     after a Commit of a store without replication. Returns the position to await: (0, 0)
  //     when there is nothing to await (a store that does not capture).
  //   AwaitReplicated waits for the barrier of that position (the standbys' acknowledgements)
  //     and, when it fails, fences the store as Commit does. OK at once for (0, 0) or a store
  //     without a barrier.
  // Commit(batch) is the three in a row. Errors as Commit's. A Prepared batch refers to its
  // WriteBatch (and through it to the WriteBatch's data), which must outlive it; it is written
  // at most once, and one destroyed without a successful Write removes its files.
  class Prepared {
   public:
    Prepared(Prepared&& other) noexcept;
    Prepared& operator=(Prepared&&) = delete;
    Prepared(const Prepared&) = delete;
    ~Prepared();

   private:
    friend class DurableStore;
    Prepared(const DurableStore* store, const WriteBatch* batch);

    const DurableStore* store_;
    const WriteBatch* batch_;
    std::vector<std::string> payloads_, headers_, files_;
    bool any_tensors_ = false;
  };
  absl::StatusOr<Prepared> Prepare(const WriteBatch& batch);
  absl::StatusOr<Position> Write(Prepared& prepared);
  absl::Status AwaitReplicated(const Position& position);

  // Replication (see the header comment). The (epoch, sequence) of the last commit this store
  // numbered (capturing) or applied (standby), as persisted in `meta`; (0, 0) for a store that
  // never had one.
  Position LastApplied() const;

  // The epoch of the commits this store numbers from now on (a leader, after winning the
  // election). An epoch never shrinks: FAILED_PRECONDITION for one smaller than the current
  // epoch (after Open, the epoch of the last persisted commit). The sequence is not reset: a
  // new epoch continues the store's numbering. Not persisted by itself; the next commit
  // persists it.
  absl::Status SetEpoch(uint64_t epoch);

  // Turns a standby's store into a leader's (a won election, docs/design.md §10.1): from now on
  // every non-empty Commit is numbered in `epoch` and handed to `sink` as with
  // DurableStoreOptions::replication_sink; then, outside the store's locks, Commit calls
  // `barrier` with the commit's position and returns its status instead of OK (a leader waits
  // there until its in-sync standbys have the commit; an error means it must not be
  // acknowledged, though it is written here). `barrier` may be empty. FAILED_PRECONDITION if
  // the store captures already, or for an epoch smaller than the store's.
  // REQUIRES: no Commit or ApplyReplicated in flight (the store is between roles).
  //
  // A failed barrier fences the store, for good (docs/coordination.md "A failed barrier"): the
  // commit is written here and handed to the sink, so a standby may hold it and lead with it,
  // while the caller, told it failed, keeps its in-memory state from before the commit. A
  // later commit computed from that state would be numbered after it and overwrite it on the
  // standbys (acknowledged updates lost). So before the barrier's error is returned the store
  // turns fenced, and from then on every Commit fails with UNAVAILABLE before writing anything
  // (Fenced() says why); the process must stop acknowledging and start again as a standby,
  // which reloads what the group really holds.
  absl::Status StartCapturing(std::function<void(ReplicatedCommit)> sink,
                              std::function<absl::Status(const Position&)> barrier,
                              uint64_t epoch);

  // OK until a barrier failed on this capturing store; then UNAVAILABLE naming the commit and
  // the barrier's error, for good. Thread-safe.
  absl::Status Fenced() const;

  // Redoes a leader's commit on this standby as one atomic RocksDB write (tensor files first,
  // as Commit), together with the `meta` "replication" record (commit.epoch, commit.sequence).
  // With `last` = LastApplied():
  //   commit.epoch < last.epoch                        FAILED_PRECONDITION naming both epochs;
  //   commit.sequence <= last.sequence, same epoch     OK, writes nothing (a retried send);
  //   commit.sequence <= last.sequence, newer epoch    FAILED_PRECONDITION (this store holds
  //                                                    commits the new leader never had);
  //   commit.sequence > last.sequence + 1              FAILED_PRECONDITION naming expected and
  //                                                    got (a gap: catch up from a checkpoint);
  //   commit.sequence == last.sequence + 1 and commit.previous_epoch != last.epoch
  //                                                    FAILED_PRECONDITION (diverged history);
  //   otherwise applied. A new epoch thus starts at last + 1: a new leader was an in-sync
  // standby and continues its own numbering. INVALID_ARGUMENT for a malformed operation (an
  // unknown column family, a write of the "replication" meta key, a sequence of 0); nothing is
  // written then. FAILED_PRECONDITION on a capturing store. Write errors as Commit's.
  absl::Status ApplyReplicated(const ReplicatedCommit& commit);

  // Writes a copy of the store to `dir` (which must not exist), openable as a DurableStore:
  // a RocksDB checkpoint (SST files hard-linked) plus a copy of every tensor file a record
  // names, all at one point in time, and returns that point's LastApplied(). For catching up a
  // standby: open the copy there and send it every commit after the returned sequence (it
  // answers OK to any it already has). Commits wait while it runs (it holds the replication
  // mutex, so on a capturing store the sink has been handed exactly the commits up to the
  // returned sequence). FAILED_PRECONDITION in memory or if `dir` exists; UNAVAILABLE /
  // RESOURCE_EXHAUSTED for I/O errors, naming the file.
  absl::StatusOr<Position> Checkpoint(const std::string& dir) const;

  // Every center, center_opt, snapshot, weight, slot and server record, read at one consistent
  // point in time, each value validated. DATA_LOSS (naming the key) at the first bad one.
  // Unknown keys in `meta` are skipped with a warning. Step logs are not loaded (ReadLog).
  absl::StatusOr<LoadedState> LoadAll() const;

  // Reads take slot.replica() and slot.stage() as they are (an unset field reads as 0);
  // INVALID_ARGUMENT if either is negative.
  //
  // The step-log records of `slot` with from_step_exclusive < step <= to_step_inclusive, in
  // (step, micro_batch) order (a step's per-step record first). An empty range returns an empty
  // vector. DATA_LOSS (naming the key) if any record in the range is corrupt; no partial result.
  absl::StatusOr<std::vector<LogRecord>> ReadLog(const SlotId& slot, int64_t from_step_exclusive,
                                                 int64_t to_step_inclusive) const;

  // The snapshot of `slot`; NOT_FOUND if it has none, DATA_LOSS if it is corrupt.
  absl::StatusOr<Snapshot> ReadSnapshot(const SlotId& slot) const;
  // A range group's range snapshot of `slot`, copy 0 or 1, with its tensors; NOT_FOUND if none.
  absl::StatusOr<Snapshot> ReadRangeSnapshot(const SlotId& slot, int copy) const;

  // Size estimates for metrics; cheap (RocksDB properties, no scan).
  absl::StatusOr<StoreStats> Stats() const;

  // Flushes every family's memtable to SST files and waits. Not needed for durability (the WAL
  // provides it); for operations and tests.
  absl::Status Flush();

  // Compacts every family's SST files (all keys) and waits. For operations and tests: reading
  // every SST, it turns a corrupt one into an error here and a background error.
  absl::Status CompactAll();

  // OK while RocksDB accepts writes. After a background error (a flush or compaction that met a
  // corrupt SST or an I/O error, a failed write-ahead-log write) RocksDB refuses every write
  // until it recovers (it retries some I/O errors itself; corruption needs the operator): that
  // error, coded as in the table above (DATA_LOSS for corruption, RESOURCE_EXHAUSTED, else
  // UNAVAILABLE), its message naming data_dir, what failed and RocksDB's reason. OK again once
  // RocksDB reports a successful recovery. Thread-safe.
  absl::Status BackgroundError() const;
  // Background errors RocksDB reported since Open.
  int64_t background_errors() const;
  // Open found a damaged write-ahead log and accept_wal_loss let it drop the damaged part.
  bool wal_loss_accepted() const { return wal_loss_accepted_; }

  // The directory given at Open; empty in memory.
  const std::string& data_dir() const { return options_.data_dir; }
  bool in_memory() const { return options_.data_dir.empty(); }
  // The compression `steplog` actually uses (after any fallback): NO_COMPRESSION, LZ4 or ZSTD.
  Compression steplog_compression() const { return steplog_compression_; }

 private:
  explicit DurableStore(const DurableStoreOptions& options);

  absl::Status OpenDb();
  // Reads the `meta` "replication" record into the replication position.
  absl::Status OpenReplication();
  // Commit's work: tensor files, then one RocksDB batch of `operations` plus, if set, the
  // `meta` "replication" record `replication`.
  absl::Status WriteOperations(const WriteBatch& batch, const ReplicationRecord* replication);
  // The two halves of WriteOperations: the tensor files into `prepared`, then the records. On
  // an error WriteRecords removes the prepared files.
  absl::Status WriteTensorFiles(Prepared* prepared);
  absl::Status WriteRecords(Prepared* prepared, const ReplicationRecord* replication);
  // Removes the files a Prepared batch wrote and forgets them.
  void RemovePreparedFiles(Prepared* prepared) const;
  // `operations` as shipped to a standby (storage.proto ReplicatedOperation), appended.
  static void AppendReplicated(const std::vector<WriteBatch::Operation>& operations,
                               ReplicatedCommit* commit);
  // Opens the tensor files, removing those no record names.
  absl::Status OpenTensorFiles();
  // The snapshot record under `key` of the snapshot family, with its tensors; NOT_FOUND with
  // `not_found` when there is none. REQUIRES: `slot` validated.
  absl::StatusOr<Snapshot> ReadSnapshotAt(const std::string& key, const SlotId& slot,
                                          const std::string& not_found) const
      ABSL_LOCKS_EXCLUDED(files_mu_);
  rocksdb::ColumnFamilyHandle* Handle(ColumnFamily family) const;
  // Fills in the data of a decoded record's tensors from its tensor file (no-op for a record
  // stored inline). DATA_LOSS naming the key. Holding files_mu_ (shared) keeps the file from
  // being replaced and removed while it is read.
  template <typename Record>
  absl::Status LoadTensors(ColumnFamily family, absl::string_view key, Record* record) const
      ABSL_SHARED_LOCKS_REQUIRED(files_mu_);

  class ErrorListener;
  struct BackgroundErrors {
    absl::Mutex mu;
    absl::Status error ABSL_GUARDED_BY(mu);
    int64_t count ABSL_GUARDED_BY(mu) = 0;
  };

  const DurableStoreOptions options_;
  // Shared with the listener RocksDB holds, which may outlive neither but is owned by RocksDB.
  const std::shared_ptr<BackgroundErrors> background_errors_;
  bool wal_loss_accepted_ = false;
  Compression steplog_compression_ = NO_COMPRESSION;
  // Declared before db_: RocksDB must close before its Env goes away.
  std::unique_ptr<rocksdb::Env> memory_env_;  // in-memory mode only
  std::unique_ptr<rocksdb::DB> db_;
  // Every handle RocksDB opened (default, ours, unknown families), destroyed before db_ closes.
  std::vector<rocksdb::ColumnFamilyHandle*> all_handles_;
  // Ours, indexed by ColumnFamily.
  rocksdb::ColumnFamilyHandle* handles_[kNumColumnFamilies] = {};
  std::unique_ptr<TensorFiles> tensor_files_;
  // Replication: held by a capturing Commit from numbering to the sink's return, and by
  // ApplyReplicated from its checks to its write. Taken before files_mu_.
  mutable absl::Mutex replication_mu_ ABSL_ACQUIRED_BEFORE(files_mu_);
  // Set at Open from options_.replication_sink, or by StartCapturing; read without the lock by
  // Commit to skip it on a store that does not capture.
  std::atomic<bool> capturing_{false};
  std::function<void(ReplicatedCommit)> sink_ ABSL_GUARDED_BY(replication_mu_);
  // Set only by StartCapturing (before any Commit of the new role), then read-only.
  std::function<absl::Status(const Position&)> barrier_;
  // Set once, by the first failed barrier (see StartCapturing); never cleared.
  std::atomic<bool> fenced_{false};
  mutable absl::Mutex fence_mu_;
  absl::Status fence_ ABSL_GUARDED_BY(fence_mu_);
  uint64_t epoch_ ABSL_GUARDED_BY(replication_mu_) = 0;  // the epoch new commits get
  Position last_ ABSL_GUARDED_BY(replication_mu_);        // the last numbered / applied commit
  // Shared by readers from their RocksDB read to the end of their tensor-file reads; exclusive
  // for a Commit with tensors from its RocksDB write to the removal of the replaced files, so a
  // reader never finds its file removed and replaced files are removed in commit order.
  mutable absl::Mutex files_mu_;
  // The committed tensor file of each record with tensors, by family and key.
  std::map<std::pair<ColumnFamily, std::string>, std::string> current_files_
      ABSL_GUARDED_BY(files_mu_);
  // The file each key's record named before its current one: no record names it any more,
  // and the key's next write overwrites it in place (TensorFiles::Write's `reuse`).
  std::map<std::pair<ColumnFamily, std::string>, std::string> spare_files_
      ABSL_GUARDED_BY(files_mu_);
};

}  // namespace rebound::storage
