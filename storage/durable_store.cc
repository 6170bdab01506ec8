#include "storage/durable_store.h"

#include <rocksdb/convenience.h>
#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/iterator.h>
#include <rocksdb/listener.h>
#include <rocksdb/options.h>
#include <rocksdb/slice.h>
#include <rocksdb/utilities/checkpoint.h>
#include <rocksdb/write_batch.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <functional>
#include <set>
#include <limits>
#include <system_error>

#include <glog/logging.h>

#include "absl/memory/memory.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "storage/envelope.h"
#include "storage/wal_tail.h"

namespace rebound::storage {
namespace {

// Path of the database inside its private in-memory Env.
constexpr char kInMemoryPath[] = "/rebound-in-memory";

// In enum order: handles_[i] belongs to ColumnFamily(i).
constexpr ColumnFamily kAllFamilies[kNumColumnFamilies] = {
    ColumnFamily::kCenter,  ColumnFamily::kCenterOpt, ColumnFamily::kSnapshot,
    ColumnFamily::kStepLog, ColumnFamily::kWeights,   ColumnFamily::kMeta,
};

absl::Status FromRocksDb(const rocksdb::Status& status, absl::string_view context) {
  if (status.ok()) return absl::OkStatus();
  const std::string message = absl::StrCat(context, ": ", status.ToString());
  if (status.IsCorruption()) return absl::DataLossError(message);
  if (status.IsNoSpace()) return absl::ResourceExhaustedError(message);
  if (status.IsIOError() || status.IsBusy() || status.IsTryAgain() || status.IsTimedOut() ||
      status.IsShutdownInProgress() || status.IsIncomplete()) {
    return absl::UnavailableError(message);
  }
  if (status.IsNotFound()) return absl::NotFoundError(message);
  if (status.IsInvalidArgument()) return absl::InvalidArgumentError(message);
  if (status.IsAborted()) return absl::AbortedError(message);
  return absl::InternalError(message);
}

rocksdb::CompressionType ToRocksDbCompression(Compression compression) {
  switch (compression) {
    case NO_COMPRESSION:
      return rocksdb::kNoCompression;
    case LZ4:
      return rocksdb::kLZ4Compression;
    case ZSTD:
    case COMPRESSION_UNSPECIFIED:
      break;
  }
  return rocksdb::kZSTD;
}

Compression ToConfigCompression(rocksdb::CompressionType type) {
  switch (type) {
    case rocksdb::kLZ4Compression:
      return LZ4;
    case rocksdb::kZSTD:
      return ZSTD;
    default:
      return NO_COMPRESSION;
  }
}

// The codec for `steplog`: the wanted one if RocksDB was built with it, else the other of
// ZSTD/LZ4, else none.
rocksdb::CompressionType ChooseStepLogCompression(Compression wanted) {
  const std::vector<rocksdb::CompressionType> supported = rocksdb::GetSupportedCompressions();
  auto is_supported = [&supported](rocksdb::CompressionType type) {
    return type == rocksdb::kNoCompression ||
           std::find(supported.begin(), supported.end(), type) != supported.end();
  };
  const rocksdb::CompressionType first = ToRocksDbCompression(wanted);
  if (is_supported(first)) return first;
  const rocksdb::CompressionType second =
      first == rocksdb::kZSTD ? rocksdb::kLZ4Compression : rocksdb::kZSTD;
  const rocksdb::CompressionType chosen = is_supported(second) ? second : rocksdb::kNoCompression;
  LOG(WARNING) << "RocksDB was built without " << Compression_Name(ToConfigCompression(first))
               << "; the steplog column family uses "
               << Compression_Name(ToConfigCompression(chosen)) << " instead";
  return chosen;
}


// RocksDB's info log, passed through, keeping the lines in which WAL recovery reports a damaged
// write-ahead log ("<dir>/000012.log: dropping 93 bytes; Corruption: checksum mismatch"):
// RocksDB's Open status does not name the file, these lines do.
class WalDropRecorder : public rocksdb::LoggerWrapper {
 public:
  explicit WalDropRecorder(std::shared_ptr<rocksdb::Logger> target)
      : rocksdb::LoggerWrapper(target.get()), target_(std::move(target)) {}

  using rocksdb::LoggerWrapper::Logv;
  void Logv(const rocksdb::InfoLogLevel level, const char* format, va_list ap) override {
    va_list copy;
    va_copy(copy, ap);
    char line[1024];
    std::vsnprintf(line, sizeof(line), format, copy);
    va_end(copy);
    const absl::string_view text(line);
    if (absl::StrContains(text, ": dropping ") && absl::StrContains(text, ".log")) {
      absl::MutexLock lock(&mu_);
      drops_.emplace_back(text);
    }
    rocksdb::LoggerWrapper::Logv(level, format, ap);
  }

  std::vector<std::string> TakeDrops() {
    absl::MutexLock lock(&mu_);
    return std::exchange(drops_, {});
  }

 private:
  std::shared_ptr<rocksdb::Logger> target_;  // keeps the wrapped logger alive
  absl::Mutex mu_;
  std::vector<std::string> drops_ ABSL_GUARDED_BY(mu_);
};

const char* BackgroundErrorReasonName(rocksdb::BackgroundErrorReason reason) {
  switch (reason) {
    case rocksdb::BackgroundErrorReason::kFlush:
    case rocksdb::BackgroundErrorReason::kFlushNoWAL:
      return "flush";
    case rocksdb::BackgroundErrorReason::kCompaction:
      return "compaction";
    case rocksdb::BackgroundErrorReason::kWriteCallback:
      return "write";
    case rocksdb::BackgroundErrorReason::kMemTable:
      return "memtable";
    case rocksdb::BackgroundErrorReason::kManifestWrite:
    case rocksdb::BackgroundErrorReason::kManifestWriteNoWAL:
      return "MANIFEST write";
  }
  return "background work";
}

// The write-ahead log files of a RocksDB directory (NNNNNN.log).
std::vector<std::filesystem::path> WalFiles(const std::string& dir) {
  std::vector<std::filesystem::path> files;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    if (entry.path().extension() == ".log" && entry.is_regular_file(error)) {
      files.push_back(entry.path());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string SlotText(int32_t replica, int32_t stage) {
  return absl::StrFormat("(r=%d, s=%d)", replica, stage);
}

// INVALID_ARGUMENT unless `slot` names a slot: both fields set and non-negative.
absl::Status ValidateSlot(absl::string_view what, bool has_slot, const SlotId& slot) {
  if (!has_slot || !slot.has_replica() || !slot.has_stage()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": slot.replica and slot.stage must be set"));
  }
  if (slot.replica() < 0 || slot.stage() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": slot must not be negative, got ",
                                                   SlotText(slot.replica(), slot.stage())));
  }
  return absl::OkStatus();
}

// INVALID_ARGUMENT if a slot to read from is negative (unset fields read as 0).
absl::Status ValidateReadSlot(absl::string_view what, const SlotId& slot) {
  if (slot.replica() < 0 || slot.stage() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": slot must not be negative, got ", SlotText(slot.replica(), slot.stage())));
  }
  return absl::OkStatus();
}

absl::Status ValidateStage(absl::string_view what, bool has_stage, int32_t stage) {
  if (!has_stage) return absl::InvalidArgumentError(absl::StrCat(what, ": stage must be set"));
  if (stage < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": stage must not be negative, got ", stage));
  }
  return absl::OkStatus();
}

// Decodes the envelope at `key` of `family` into `*record`; DATA_LOSS names the key.
absl::Status DecodeValue(ColumnFamily family, absl::string_view key, absl::string_view value,
                         google::protobuf::MessageLite* record) {
  absl::Status status = DecodeEnvelope(value, record);
  if (status.ok()) return status;
  return absl::DataLossError(absl::StrCat(DescribeKey(family, key), ": ", status.message()));
}

absl::Status RecordMismatch(ColumnFamily family, absl::string_view key,
                            absl::string_view record_says) {
  return absl::DataLossError(absl::StrCat(DescribeKey(family, key),
                                          ": the record does not belong to its key (record says ",
                                          record_says, ")"));
}

absl::Status CheckStage(ColumnFamily family, absl::string_view key, int32_t key_stage,
                        bool has_stage, int32_t stage) {
  if (has_stage && stage == key_stage) return absl::OkStatus();
  return RecordMismatch(family, key, has_stage ? absl::StrCat("s=", stage) : "no stage");
}

absl::Status CheckSlot(ColumnFamily family, absl::string_view key, const SlotKeyFields& key_slot,
                       bool has_slot, const SlotId& slot) {
  if (has_slot && slot.has_replica() && slot.has_stage() && slot.replica() == key_slot.replica &&
      slot.stage() == key_slot.stage) {
    return absl::OkStatus();
  }
  return RecordMismatch(family, key, has_slot ? SlotText(slot.replica(), slot.stage()) : "no slot");
}

absl::Status MalformedKey(ColumnFamily family, absl::string_view key) {
  return absl::DataLossError(DescribeKey(family, key));
}

// Releases a RocksDB snapshot when it goes out of scope.
class ScopedSnapshot {
 public:
  explicit ScopedSnapshot(rocksdb::DB* db) : db_(db), snapshot_(db->GetSnapshot()) {}
  ~ScopedSnapshot() { db_->ReleaseSnapshot(snapshot_); }
  ScopedSnapshot(const ScopedSnapshot&) = delete;
  ScopedSnapshot& operator=(const ScopedSnapshot&) = delete;
  const rocksdb::Snapshot* get() const { return snapshot_; }

 private:
  rocksdb::DB* db_;
  const rocksdb::Snapshot* snapshot_;
};

// Calls `visit(key, value)` for every entry of `handle` as of `snapshot`, stopping at the first
// error.
absl::Status ScanFamily(
    rocksdb::DB* db, rocksdb::ColumnFamilyHandle* handle, ColumnFamily family,
    const rocksdb::Snapshot* snapshot,
    const std::function<absl::Status(absl::string_view, absl::string_view)>& visit) {
  rocksdb::ReadOptions read_options;
  read_options.snapshot = snapshot;
  read_options.fill_cache = false;
  std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(read_options, handle));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    const rocksdb::Slice key = it->key();
    const rocksdb::Slice value = it->value();
    RETURN_IF_ERROR(visit(absl::string_view(key.data(), key.size()),
                          absl::string_view(value.data(), value.size())));
  }
  return FromRocksDb(it->status(),
                     absl::StrCat("reading column family ", ColumnFamilyName(family)));
}

// The tensors of a record with tensor files, in their stored order.
std::vector<const Tensor*> TensorsOf(const TensorBundle& bundle,
                                     std::vector<const Tensor*> out = {}) {
  for (const Tensor& tensor : bundle.tensors()) out.push_back(&tensor);
  return out;
}
std::vector<const Tensor*> TensorsOf(const CenterRecord& record) {
  return TensorsOf(record.params());
}
std::vector<const Tensor*> TensorsOf(const OptimizerState& state) {
  return TensorsOf(state.last_hdiag(), TensorsOf(state.v(), TensorsOf(state.m())));
}
std::vector<const Tensor*> TensorsOf(const CenterOptRecord& record) {
  return TensorsOf(record.state());
}
std::vector<const Tensor*> TensorsOf(const Snapshot& snapshot) {
  std::vector<const Tensor*> out = TensorsOf(snapshot.params());
  for (const Tensor* tensor : TensorsOf(snapshot.optimizer())) out.push_back(tensor);
  return out;
}

// The tensors of a record are changed only through these (their data), so the const_cast
// of a tensor reached from a non-const record is sound.
template <typename Record>
std::vector<Tensor*> MutableTensorsOf(Record* record) {
  std::vector<Tensor*> out;
  for (const Tensor* tensor : TensorsOf(*record)) out.push_back(const_cast<Tensor*>(tensor));
  return out;
}

// The serialized field `stored_tensors = 100` (length-delimited) of CenterRecord,
// CenterOptRecord and Snapshot. Appending it to a serialized record sets the field (protobuf
// merges concatenated messages).
std::string StoredTensorsField(const TensorBlob& blob) {
  const std::string bytes = blob.SerializeAsString();
  std::string out;
  uint64_t value = (uint64_t{100} << 3) | 2;  // field 100, wire type LEN
  for (int i = 0; i < 2; ++i) {
    do {
      const uint8_t low = value & 0x7f;
      value >>= 7;
      out.push_back(static_cast<char>(value != 0 ? low | 0x80 : low));
    } while (value != 0);
    value = bytes.size();
  }
  return out + bytes;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// DurableStoreOptions

DurableStoreOptions DurableStoreOptions::FromConfig(const DurabilityConfig& durability,
                                                    const StepLogConfig& step_log) {
  DurableStoreOptions options;
  options.data_dir = durability.data_dir();
  options.fsync = durability.fsync();
  options.steplog_compression = step_log.compression();
  return options;
}

// ---------------------------------------------------------------------------------------------
// WriteBatch

WriteBatch::WriteBatch() = default;
WriteBatch::~WriteBatch() = default;
WriteBatch::WriteBatch(WriteBatch&&) noexcept = default;
WriteBatch& WriteBatch::operator=(WriteBatch&&) noexcept = default;

void WriteBatch::Reject(absl::Status status) {
  if (status_.ok()) status_ = std::move(status);
}

void WriteBatch::Put(ColumnFamily family, std::string key,
                     const google::protobuf::MessageLite& record) {
  const size_t size = record.ByteSizeLong();
  if (size > kMaxEnvelopePayload) {
    Reject(absl::InvalidArgumentError(absl::StrFormat("%s: %s is %d bytes, over the 2 GiB limit",
                                                      DescribeKey(family, key),
                                                      record.GetTypeName(), size)));
    return;
  }
  Operation operation{family, /*delete_range=*/false, std::move(key), std::string(), std::string()};
  if (!record.SerializeToString(&operation.payload)) {
    Reject(absl::InvalidArgumentError(absl::StrFormat(
        "%s: %s does not serialize", DescribeKey(family, operation.key), record.GetTypeName())));
    return;
  }
  operation.header = EnvelopeHeader(operation.payload);
  bytes_ += operation.key.size() + operation.header.size() + operation.payload.size();
  operations_.push_back(std::move(operation));
}

void WriteBatch::PutWithTensors(ColumnFamily family, std::string key, std::string file_prefix,
                                const google::protobuf::MessageLite& header,
                                std::vector<absl::string_view> data,
                                std::unique_ptr<std::vector<std::string>> owned) {
  const size_t before = operations_.size();
  Put(family, std::move(key), header);
  if (operations_.size() == before || data.empty()) return;  // rejected, or nothing to put aside
  Operation& operation = operations_.back();
  operation.has_tensors = true;
  operation.file_prefix = std::move(file_prefix);
  for (absl::string_view part : data) bytes_ += part.size();
  operation.data = std::move(data);
  operation.owned = std::move(owned);
}

namespace {

// Moves the tensors' data out of `record` into `owned`, returning views of it.
template <typename Record>
std::vector<absl::string_view> TakeTensorData(Record* record, std::vector<std::string>* owned) {
  std::vector<Tensor*> tensors = MutableTensorsOf(record);
  owned->reserve(tensors.size());  // no reallocation below: the views stay valid
  std::vector<absl::string_view> data;
  for (Tensor* tensor : tensors) {
    owned->push_back(std::move(*tensor->mutable_data()));
    tensor->clear_data();
    data.push_back(owned->back());
  }
  return data;
}

// OK iff `data` holds one part per tensor of `header` and the header's tensors have no data.
template <typename Record>
absl::Status CheckTensorData(absl::string_view what, const Record& header,
                             const std::vector<absl::string_view>& data) {
  const std::vector<const Tensor*> tensors = TensorsOf(header);
  if (tensors.size() != data.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the header has %d tensors, got %d data parts", what, tensors.size(), data.size()));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i]->data().empty()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: header tensor %d carries data", what, i));
    }
  }
  return absl::OkStatus();
}

std::string StagePrefix(absl::string_view family, int32_t stage) {
  return absl::StrFormat("%s-s%d", family, stage);
}

std::string SlotPrefix(absl::string_view family, const SlotId& slot) {
  return absl::StrFormat("%s-r%d-s%d", family, slot.replica(), slot.stage());
}

}  // namespace

void WriteBatch::PutCenter(const CenterRecord& record) {
  if (!status_.ok()) return;
  absl::Status valid = ValidateStage("PutCenter", record.has_stage(), record.stage());
  if (!valid.ok()) return Reject(std::move(valid));
  CenterRecord header = record;
  auto owned = std::make_unique<std::vector<std::string>>();
  std::vector<absl::string_view> data = TakeTensorData(&header, owned.get());
  PutCenter(header, std::move(data));
  if (status_.ok()) operations_.back().owned = std::move(owned);
}

void WriteBatch::PutCenter(const CenterRecord& header, std::vector<absl::string_view> data) {
  if (!status_.ok()) return;
  absl::Status valid = ValidateStage("PutCenter", header.has_stage(), header.stage());
  if (valid.ok()) valid = CheckTensorData("PutCenter", header, data);
  if (!valid.ok()) return Reject(std::move(valid));
  PutWithTensors(ColumnFamily::kCenter, EncodeStageKey(header.stage()),
                 StagePrefix("center", header.stage()), header, std::move(data), nullptr);
}

void WriteBatch::PutCenterOpt(const CenterOptRecord& record) {
  if (!status_.ok()) return;
  absl::Status valid = ValidateStage("PutCenterOpt", record.has_stage(), record.stage());
  if (!valid.ok()) return Reject(std::move(valid));
  CenterOptRecord header = record;
  auto owned = std::make_unique<std::vector<std::string>>();
  std::vector<absl::string_view> data = TakeTensorData(&header, owned.get());
  PutCenterOpt(header, std::move(data));
  if (status_.ok()) operations_.back().owned = std::move(owned);
}

void WriteBatch::PutCenterOpt(const CenterOptRecord& header, std::vector<absl::string_view> data) {
  if (!status_.ok()) return;
  absl::Status valid = ValidateStage("PutCenterOpt", header.has_stage(), header.stage());
  if (valid.ok()) valid = CheckTensorData("PutCenterOpt", header, data);
  if (!valid.ok()) return Reject(std::move(valid));
  PutWithTensors(ColumnFamily::kCenterOpt, EncodeStageKey(header.stage()),
                 StagePrefix("center_opt", header.stage()), header, std::move(data), nullptr);
}

void WriteBatch::PutSnapshot(const Snapshot& snapshot) {
  if (!status_.ok()) return;
  absl::Status valid = ValidateSlot("PutSnapshot", snapshot.has_slot(), snapshot.slot());
  if (!valid.ok()) return Reject(std::move(valid));
  Snapshot header = snapshot;
  auto owned = std::make_unique<std::vector<std::string>>();
  std::vector<absl::string_view> data = TakeTensorData(&header, owned.get());
  PutSnapshot(header, std::move(data));
  if (status_.ok()) operations_.back().owned = std::move(owned);
}

void WriteBatch::PutSnapshot(const Snapshot& header, std::vector<absl::string_view> data) {
  if (!status_.ok()) return;
  absl::Status valid = ValidateSlot("PutSnapshot", header.has_slot(), header.slot());
  if (valid.ok()) valid = CheckTensorData("PutSnapshot", header, data);
  if (!valid.ok()) return Reject(std::move(valid));
  PutWithTensors(ColumnFamily::kSnapshot,
                 EncodeSlotKey(header.slot().replica(), header.slot().stage()),
                 SlotPrefix("snapshot", header.slot()), header, std::move(data), nullptr);
}

void WriteBatch::PutRangeSnapshot(const Snapshot& snapshot, int copy) {
  if (!status_.ok()) return;
  Snapshot header = snapshot;
  auto owned = std::make_unique<std::vector<std::string>>();
  std::vector<absl::string_view> data = TakeTensorData(&header, owned.get());
  PutRangeSnapshot(header, std::move(data), copy);
  if (status_.ok()) operations_.back().owned = std::move(owned);
}

void WriteBatch::PutRangeSnapshot(const Snapshot& header, std::vector<absl::string_view> data,
                                  int copy) {
  if (!status_.ok()) return;
  absl::Status valid = ValidateSlot("PutRangeSnapshot", header.has_slot(), header.slot());
  if (valid.ok() && copy != 0 && copy != 1) {
    valid = absl::InvalidArgumentError(absl::StrCat("PutRangeSnapshot: copy must be 0 or 1, got ",
                                                    copy));
  }
  if (valid.ok()) valid = CheckTensorData("PutRangeSnapshot", header, data);
  if (!valid.ok()) return Reject(std::move(valid));
  PutWithTensors(ColumnFamily::kSnapshot,
                 EncodeRangeSnapshotKey(header.slot().replica(), header.slot().stage(), copy),
                 absl::StrCat(SlotPrefix("range", header.slot()), "-c", copy), header,
                 std::move(data), nullptr);
}

void WriteBatch::PutWeight(const WeightRecord& record) {
  if (!status_.ok()) return;
  absl::Status valid = ValidateSlot("PutWeight", record.has_slot(), record.slot());
  if (!valid.ok()) return Reject(std::move(valid));
  Put(ColumnFamily::kWeights, EncodeSlotKey(record.slot().replica(), record.slot().stage()),
      record);
}

void WriteBatch::PutSlot(const SlotRecord& record) {
  if (!status_.ok()) return;
  absl::Status valid = ValidateSlot("PutSlot", record.has_slot(), record.slot());
  if (!valid.ok()) return Reject(std::move(valid));
  Put(ColumnFamily::kMeta, EncodeSlotMetaKey(record.slot().replica(), record.slot().stage()),
      record);
}

void WriteBatch::PutRangeBook(const WeightRecord& record) {
  if (!status_.ok()) return;
  absl::Status valid = ValidateSlot("PutRangeBook", record.has_slot(), record.slot());
  if (!valid.ok()) return Reject(std::move(valid));
  Put(ColumnFamily::kMeta, EncodeRangeMetaKey(record.slot().replica(), record.slot().stage()),
      record);
}

void WriteBatch::PutServer(const ServerRecord& record) {
  if (!status_.ok()) return;
  Put(ColumnFamily::kMeta, kServerMetaKey, record);
}

namespace {

// The key part of a step-log record: 0 for the slot's own records, else the direction of its
// boundary payload (a boundary record carries exactly one, from the neighbour that sent it).
int32_t LogPartOf(const LogRecord& record) {
  if (record.boundaries_size() == 0) return 0;
  const int direction = record.boundaries(0).direction();
  return direction == FORWARD || direction == BACKWARD ? direction : 0;
}

}  // namespace

void WriteBatch::PutLogRecord(const LogRecord& record) {
  if (!status_.ok()) return;
  absl::Status valid = ValidateSlot("PutLogRecord", record.has_slot(), record.slot());
  if (valid.ok() && (!record.has_step() || !record.has_micro_batch())) {
    valid = absl::InvalidArgumentError("PutLogRecord: step and micro_batch must be set");
  }
  if (valid.ok() && (record.step() < 0 || record.micro_batch() < -1)) {
    valid = absl::InvalidArgumentError(
        absl::StrFormat("PutLogRecord: need step >= 0 and micro_batch >= -1, got step=%d mb=%d",
                        record.step(), record.micro_batch()));
  }
  if (!valid.ok()) return Reject(std::move(valid));
  Put(ColumnFamily::kStepLog,
      EncodeLogKey(record.slot().replica(), record.slot().stage(),
                   static_cast<uint64_t>(record.step()), record.micro_batch(),
                   LogPartOf(record)),
      record);
}

void WriteBatch::DeleteLogRange(const SlotId& slot, int64_t from_step_inclusive,
                                int64_t to_step_exclusive) {
  if (!status_.ok()) return;
  absl::Status valid = ValidateSlot("DeleteLogRange", /*has_slot=*/true, slot);
  if (!valid.ok()) return Reject(std::move(valid));
  const int64_t from = std::max<int64_t>(from_step_inclusive, 0);
  if (to_step_exclusive <= from) return;
  Operation operation{
      ColumnFamily::kStepLog, /*delete_range=*/true,
      EncodeLogKey(slot.replica(), slot.stage(), static_cast<uint64_t>(from), -1), std::string(),
      EncodeLogKey(slot.replica(), slot.stage(), static_cast<uint64_t>(to_step_exclusive), -1)};
  bytes_ += operation.key.size() + operation.payload.size();
  operations_.push_back(std::move(operation));
}

void WriteBatch::Clear() {
  operations_.clear();
  bytes_ = 0;
  status_ = absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// DurableStore

DurableStore::DurableStore(const DurableStoreOptions& options)
    : options_(options), background_errors_(std::make_shared<BackgroundErrors>()) {}

DurableStore::~DurableStore() {
  if (db_ != nullptr) {
    for (rocksdb::ColumnFamilyHandle* handle : all_handles_) {
      db_->DestroyColumnFamilyHandle(handle).PermitUncheckedError();
    }
    const rocksdb::Status closed = db_->Close();
    if (!closed.ok()) {
      LOG(WARNING) << "closing RocksDB at "
                   << (in_memory() ? std::string("(in memory)") : options_.data_dir) << ": "
                   << closed.ToString();
    }
    db_.reset();
  }
  memory_env_.reset();
}

absl::StatusOr<std::unique_ptr<DurableStore>> DurableStore::Open(
    const DurableStoreOptions& options) {
  std::unique_ptr<DurableStore> store = absl::WrapUnique(new DurableStore(options));
  RETURN_IF_ERROR(store->OpenDb());
  RETURN_IF_ERROR(store->OpenTensorFiles());
  RETURN_IF_ERROR(store->OpenReplication());
  if (options.replication_sink) {
    absl::MutexLock lock(&store->replication_mu_);
    store->sink_ = options.replication_sink;
    store->capturing_.store(true, std::memory_order_release);
  }
  return store;
}

rocksdb::ColumnFamilyHandle* DurableStore::Handle(ColumnFamily family) const {
  return handles_[static_cast<int>(family)];
}

// Keeps RocksDB's background errors for DurableStore::BackgroundError and Health.
class DurableStore::ErrorListener : public rocksdb::EventListener {
 public:
  ErrorListener(std::shared_ptr<BackgroundErrors> errors, std::string where)
      : errors_(std::move(errors)), where_(std::move(where)) {}

  void OnBackgroundError(rocksdb::BackgroundErrorReason reason,
                         rocksdb::Status* bg_error) override {
    if (bg_error == nullptr || bg_error->ok()) return;
    const absl::Status error = FromRocksDb(
        *bg_error, absl::StrCat(where_, ": RocksDB ", BackgroundErrorReasonName(reason),
                                " failed, the store refuses writes"));
    LOG(ERROR) << error;
    absl::MutexLock lock(&errors_->mu);
    ++errors_->count;
    if (errors_->error.ok()) errors_->error = error;
  }

  void OnErrorRecoveryEnd(const rocksdb::BackgroundErrorRecoveryInfo& info) override {
    if (!info.new_bg_error.ok()) return;
    LOG(WARNING) << where_ << ": RocksDB recovered from its background error ("
                 << info.old_bg_error.ToString() << "); writes are accepted again";
    absl::MutexLock lock(&errors_->mu);
    errors_->error = absl::OkStatus();
  }

 private:
  const std::shared_ptr<BackgroundErrors> errors_;
  const std::string where_;
};

absl::Status DurableStore::BackgroundError() const {
  absl::MutexLock lock(&background_errors_->mu);
  return background_errors_->error;
}

int64_t DurableStore::background_errors() const {
  absl::MutexLock lock(&background_errors_->mu);
  return background_errors_->count;
}

absl::Status DurableStore::OpenDb() {
  const std::string where =
      in_memory() ? std::string("in-memory store") : absl::StrCat("data_dir ", options_.data_dir);
  std::string path = options_.data_dir;
  rocksdb::DBOptions db_options;
  db_options.create_if_missing = true;
  db_options.create_missing_column_families = true;
  db_options.keep_log_file_num = 5;
  // Bounds the write-ahead log: past this size RocksDB flushes the column families holding the
  // oldest entries, so overwritten centers and snapshots and garbage-collected log records stop
  // taking space (the default, 4x the memtables of 7 families, is several GiB). The step log
  // fills the WAL at a steady rate while the small families (centers, weights, snapshots'
  // bookkeeping) rarely fill a memtable and keep old WAL files alive until this bound
  // (//bench:soak: the data directory grew 7 MiB/min towards 256 MiB at the old bound); it also
  // bounds what a restart replays.
  db_options.max_total_wal_size = uint64_t{64} << 20;
  // Memtables of all families together; the step log's would otherwise take up to 2 x 64 MiB.
  db_options.db_write_buffer_size = uint64_t{64} << 20;
  if (in_memory()) {
    memory_env_.reset(rocksdb::NewMemEnv(rocksdb::Env::Default()));
    db_options.env = memory_env_.get();
    path = kInMemoryPath;
  } else {
    std::error_code error;
    std::filesystem::create_directories(path, error);
    if (error) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create ", where, ": ", error.message()));
    }
  }

  const rocksdb::CompressionType steplog_type =
      ChooseStepLogCompression(options_.steplog_compression);
  steplog_compression_ = ToConfigCompression(steplog_type);

  std::vector<rocksdb::ColumnFamilyDescriptor> descriptors;
  descriptors.emplace_back(rocksdb::kDefaultColumnFamilyName, rocksdb::ColumnFamilyOptions());
  for (ColumnFamily family : kAllFamilies) {
    rocksdb::ColumnFamilyOptions family_options;
    if (family == ColumnFamily::kStepLog) family_options.compression = steplog_type;
    if (family == ColumnFamily::kCenter || family == ColumnFamily::kCenterOpt ||
        family == ColumnFamily::kSnapshot) {
      // Whole parameter tensors, rewritten at every sync: float data barely compresses.
      family_options.compression = rocksdb::kNoCompression;
    }
    descriptors.emplace_back(ColumnFamilyName(family), family_options);
  }
  // RocksDB refuses to open a database without naming all of its families.
  std::vector<std::string> existing;
  if (rocksdb::DB::ListColumnFamilies(db_options, path, &existing).ok()) {
    for (const std::string& name : existing) {
      const bool known =
          std::any_of(descriptors.begin(), descriptors.end(),
                      [&name](const rocksdb::ColumnFamilyDescriptor& d) { return d.name == name; });
      if (!known) {
        LOG(WARNING) << where << " has an unknown column family '" << name
                     << "'; opening it with default options and not using it";
        descriptors.emplace_back(name, rocksdb::ColumnFamilyOptions());
      }
    }
  }

  db_options.listeners.push_back(std::make_shared<ErrorListener>(background_errors_, where));
  // Absolute consistency: any damage in the write-ahead log, even at its tail, fails the open.
  // RocksDB's default (point-in-time recovery) would stop replaying at the damage and open
  // without the writes after it, acknowledged ones included, and say so only in its LOG file.
  // kTolerateCorruptedTailRecords is no better: it drops a last record whose length byte is
  // damaged as silently as a torn one. The one damage let through is a write torn by a crash,
  // which ClassifyWalDamage proves (storage/wal_tail.h). See
  // docs/storage.md#a-damaged-write-ahead-log.
  db_options.wal_recovery_mode = rocksdb::WALRecoveryMode::kAbsoluteConsistency;
  std::shared_ptr<WalDropRecorder> recorder;
  if (!in_memory()) {
    std::shared_ptr<rocksdb::Logger> info_log;
    if (rocksdb::CreateLoggerFromOptions(path, db_options, &info_log).ok()) {
      recorder = std::make_shared<WalDropRecorder>(std::move(info_log));
      db_options.info_log = recorder;
    }
  }

  rocksdb::DB* db = nullptr;
  rocksdb::Status status = rocksdb::DB::Open(db_options, path, descriptors, &all_handles_, &db);
  std::vector<std::string> drops =
      recorder != nullptr ? recorder->TakeDrops() : std::vector<std::string>();
  // Recovers up to the first damage and drops the rest.
  const auto reopen_at_last_intact_write = [&] {
    for (rocksdb::ColumnFamilyHandle* handle : all_handles_) delete handle;
    all_handles_.clear();
    db_options.wal_recovery_mode = rocksdb::WALRecoveryMode::kPointInTimeRecovery;
    status = rocksdb::DB::Open(db_options, path, descriptors, &all_handles_, &db);
    drops = recorder->TakeDrops();
  };
  const bool wal_damaged = status.IsCorruption() && !drops.empty();
  const WalDamage damage = wal_damaged ? ClassifyWalDamage(drops, path) : WalDamage();
  if (damage.torn_write) {
    // The last write was cut short by a crash, so it was never acknowledged: dropping it loses
    // nothing the server promised.
    reopen_at_last_intact_write();
    if (status.ok()) {
      LOG(WARNING) << where << ": " << damage.file
                   << ": a write torn by a crash, never acknowledged: dropped "
                   << damage.dropped_bytes << " bytes (" << damage.reasons
                   << "); recovered up to sequence number " << db->GetLatestSequenceNumber();
      if (options_.accept_wal_loss) {
        LOG(WARNING) << "--accept_wal_loss: " << where
                     << ": no acknowledged write was dropped; do not keep the flag";
      }
    }
  } else if (wal_damaged) {
    const std::string damage_text = absl::StrCat(
        absl::StrJoin(drops, "; "), "; not a write torn by a crash: ", damage.why_not);
    if (!options_.accept_wal_loss) {
      return absl::DataLossError(absl::StrCat(
          where, ": the write-ahead log is damaged (", damage_text,
          "). Acknowledged writes may be in or after the damaged part, so the server refuses "
          "to start rather than lose them silently. To start from the last intact write, "
          "dropping the rest, restart once with --accept_wal_loss (docs/troubleshooting.md)"));
    }
    // The operator accepts the loss: keep a copy of the damaged log, recover to the last
    // intact write, and say loudly what was dropped.
    const std::string copy_dir =
        absl::StrCat(path, "/wal-damaged-", static_cast<int64_t>(std::time(nullptr)));
    std::error_code error;
    std::filesystem::create_directories(copy_dir, error);
    for (const std::filesystem::path& wal : WalFiles(path)) {
      if (!error) {
        std::filesystem::copy_file(wal, std::filesystem::path(copy_dir) / wal.filename(),
                                   std::filesystem::copy_options::overwrite_existing, error);
      }
    }
    if (error) {
      return absl::FailedPreconditionError(absl::StrCat(
          where, ": --accept_wal_loss: cannot keep a copy of the damaged write-ahead log in ",
          copy_dir, ": ", error.message()));
    }
    LOG(ERROR) << "--accept_wal_loss: " << where << ": the write-ahead log is damaged ("
               << damage_text << "); recovering to the last intact write and DROPPING "
               << "everything after it, acknowledged writes included. A copy of the log as "
               << "found is in " << copy_dir;
    reopen_at_last_intact_write();
    if (status.ok()) {
      LOG(ERROR) << "--accept_wal_loss: " << where << " recovered up to sequence number "
                 << db->GetLatestSequenceNumber() << "; dropped: " << absl::StrJoin(drops, "; ");
      wal_loss_accepted_ = true;
    }
  } else if (options_.accept_wal_loss && status.ok()) {
    LOG(WARNING) << "--accept_wal_loss: " << where
                 << ": the write-ahead log is intact, nothing was dropped; do not keep the flag";
  }
  if (!status.ok()) {
    if (status.IsIOError() && absl::StrContains(status.ToString(), "/LOCK")) {
      return absl::FailedPreconditionError(
          absl::StrCat(where,
                       " is in use: another process, or another open DurableStore in this process, "
                       "holds its RocksDB LOCK; stop it or use another data_dir (",
                       status.ToString(), ")"));
    }
    return FromRocksDb(status, absl::StrCat("cannot open RocksDB in ", where));
  }
  db_.reset(db);
  // DB::Open returns the handles in the order of `descriptors`: default first, then ours.
  for (int i = 0; i < kNumColumnFamilies; ++i) handles_[i] = all_handles_[i + 1];
  return absl::OkStatus();
}

absl::Status DurableStore::OpenTensorFiles() {
  const std::string dir = absl::StrCat(in_memory() ? kInMemoryPath : options_.data_dir, "/tensors");
  tensor_files_ = std::make_unique<TensorFiles>(
      in_memory() ? memory_env_.get() : rocksdb::Env::Default(), dir, options_.fsync);
  // Which file each record names. A record that does not decode keeps every file: removing
  // what might be its data would turn a repairable store into a lost one.
  std::set<std::string> referenced;
  bool complete = true;
  ScopedSnapshot snapshot(db_.get());
  for (ColumnFamily family :
       {ColumnFamily::kCenter, ColumnFamily::kCenterOpt, ColumnFamily::kSnapshot}) {
    RETURN_IF_ERROR(ScanFamily(
        db_.get(), Handle(family), family, snapshot.get(),
        [&](absl::string_view key, absl::string_view value) -> absl::Status {
          Snapshot snapshot_record;
          CenterRecord center_record;
          CenterOptRecord opt_record;
          google::protobuf::MessageLite* record = &opt_record;
          if (family == ColumnFamily::kSnapshot) record = &snapshot_record;
          if (family == ColumnFamily::kCenter) record = &center_record;
          if (!DecodeValue(family, key, value, record).ok()) {
            complete = false;
            return absl::OkStatus();
          }
          const TensorBlob& blob = family == ColumnFamily::kSnapshot
                                       ? snapshot_record.stored_tensors()
                                   : family == ColumnFamily::kCenter
                                       ? center_record.stored_tensors()
                                       : opt_record.stored_tensors();
          if (blob.file().empty()) return absl::OkStatus();
          referenced.insert(blob.file());
          absl::MutexLock lock(&files_mu_);
          current_files_[{family, std::string(key)}] = blob.file();
          return absl::OkStatus();
        }));
  }
  if (!complete) {
    LOG(WARNING) << "a center or snapshot record does not decode; keeping every tensor file";
  }
  return tensor_files_->Open(referenced, /*remove_unreferenced=*/complete);
}

absl::Status DurableStore::Commit(const WriteBatch& batch, Position* numbered) {
  RETURN_IF_ERROR(batch.status());
  if (batch.operations_.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(Prepared prepared, Prepare(batch));
  ASSIGN_OR_RETURN(const Position position, Write(prepared));
  if (numbered != nullptr && position.sequence != 0) *numbered = position;
  return AwaitReplicated(position);
}

DurableStore::Prepared::Prepared(const DurableStore* store, const WriteBatch* batch)
    : store_(store), batch_(batch) {}

DurableStore::Prepared::Prepared(Prepared&& other) noexcept
    : store_(other.store_),
      batch_(other.batch_),
      payloads_(std::move(other.payloads_)),
      headers_(std::move(other.headers_)),
      files_(std::move(other.files_)),
      any_tensors_(other.any_tensors_) {
  other.files_.clear();
}

DurableStore::Prepared::~Prepared() {
  if (store_ != nullptr) store_->RemovePreparedFiles(this);
}

void DurableStore::RemovePreparedFiles(Prepared* prepared) const {
  for (const std::string& file : prepared->files_) {
    if (!file.empty()) tensor_files_->Remove(file);
  }
  prepared->files_.clear();
}

absl::StatusOr<DurableStore::Prepared> DurableStore::Prepare(const WriteBatch& batch) {
  RETURN_IF_ERROR(batch.status());
  // A fenced store writes nothing, not even files no record would name.
  RETURN_IF_ERROR(Fenced());
  Prepared prepared(this, &batch);
  RETURN_IF_ERROR(WriteTensorFiles(&prepared));
  return prepared;
}

absl::StatusOr<DurableStore::Position> DurableStore::Write(Prepared& prepared) {
  const WriteBatch& batch = *prepared.batch_;
  if (batch.operations_.empty()) return Position{};
  if (!capturing_.load(std::memory_order_acquire)) {
    RETURN_IF_ERROR(WriteRecords(&prepared, nullptr));
    return Position{};
  }
  // Copied before taking the lock: the lock covers only numbering, the records' write and the
  // hand-off (the tensor files were written by Prepare, outside it).
  ReplicatedCommit commit;
  AppendReplicated(batch.operations_, &commit);
  absl::MutexLock lock(&replication_mu_);
  // Checked under the lock that numbers commits: nothing is numbered after a fence.
  if (fenced_.load(std::memory_order_acquire)) {
    RemovePreparedFiles(&prepared);
    return Fenced();
  }
  ReplicationRecord position;
  position.set_epoch(epoch_);
  position.set_sequence(last_.sequence + 1);
  RETURN_IF_ERROR(WriteRecords(&prepared, &position));
  commit.set_epoch(position.epoch());
  commit.set_sequence(position.sequence());
  commit.set_previous_epoch(last_.epoch);
  last_ = Position{position.epoch(), position.sequence()};
  sink_(std::move(commit));
  return last_;
}

absl::Status DurableStore::AwaitReplicated(const Position& committed) {
  // Concurrent commits wait here together: the barrier of one does not hold up the next's write.
  if (committed.sequence == 0 || !barrier_) return absl::OkStatus();
  absl::Status replicated = barrier_(committed);
  if (!replicated.ok()) {
    // Fenced before the caller hears of the failure, so no commit it computes from its
    // pre-commit state is ever written (StartCapturing's comment).
    absl::MutexLock lock(&fence_mu_);
    if (fence_.ok()) {
      fence_ = absl::UnavailableError(absl::StrCat(
          "the store is fenced: commit ", committed.sequence, " of epoch ", committed.epoch,
          " is written and handed to the standbys but its barrier failed (", replicated.message(),
          "); nothing is committed here any more"));
      fenced_.store(true, std::memory_order_release);
      LOG(ERROR) << fence_.message();
    }
  }
  return replicated;
}

absl::Status DurableStore::Fenced() const {
  if (!fenced_.load(std::memory_order_acquire)) return absl::OkStatus();
  absl::MutexLock lock(&fence_mu_);
  return fence_;
}

absl::Status DurableStore::StartCapturing(std::function<void(ReplicatedCommit)> sink,
                                          std::function<absl::Status(const Position&)> barrier,
                                          uint64_t epoch) {
  absl::MutexLock lock(&replication_mu_);
  if (capturing_.load(std::memory_order_relaxed)) {
    return absl::FailedPreconditionError("StartCapturing: the store captures its commits already");
  }
  if (epoch < epoch_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "StartCapturing(epoch ", epoch, "): the store's epoch is already ", epoch_,
        "; an epoch never shrinks"));
  }
  epoch_ = epoch;
  sink_ = std::move(sink);
  barrier_ = std::move(barrier);
  capturing_.store(true, std::memory_order_release);
  return absl::OkStatus();
}

DurableStore::Position DurableStore::LastApplied() const {
  absl::MutexLock lock(&replication_mu_);
  return last_;
}

absl::Status DurableStore::SetEpoch(uint64_t epoch) {
  absl::MutexLock lock(&replication_mu_);
  if (epoch < epoch_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SetEpoch(", epoch, "): the store's epoch is already ", epoch_, "; an epoch never shrinks"));
  }
  epoch_ = epoch;
  return absl::OkStatus();
}

absl::Status DurableStore::ApplyReplicated(const ReplicatedCommit& commit) {
  if (capturing_.load(std::memory_order_acquire)) {
    return absl::FailedPreconditionError(
        "ApplyReplicated on a store that captures its own commits (a leader)");
  }
  // The operations, checked and rebuilt before taking the lock; their tensor data stays in
  // `commit`.
  WriteBatch batch;
  for (int i = 0; i < commit.operations_size(); ++i) {
    const ReplicatedOperation& in = commit.operations(i);
    if (in.column_family() < 0 || in.column_family() >= kNumColumnFamilies) {
      return absl::InvalidArgumentError(absl::StrCat("replicated commit ", commit.sequence(),
                                                     ", operation ", i, ": unknown column family ",
                                                     in.column_family()));
    }
    const auto family = static_cast<ColumnFamily>(in.column_family());
    if (family == ColumnFamily::kMeta && in.key() == kReplicationMetaKey) {
      return absl::InvalidArgumentError(absl::StrCat("replicated commit ", commit.sequence(),
                                                     ", operation ", i, ": writes ",
                                                     DescribeKey(family, in.key())));
    }
    WriteBatch::Operation operation{family, in.delete_range(), in.key(), std::string(),
                                    std::string()};
    if (in.delete_range()) {
      operation.payload = in.delete_end();
    } else {
      operation.payload = in.value();
      operation.header = EnvelopeHeader(operation.payload);
      if (in.has_tensor_file_prefix()) {
        operation.has_tensors = true;
        operation.file_prefix = in.tensor_file_prefix();
        for (const std::string& part : in.tensor_data()) operation.data.emplace_back(part);
      }
    }
    batch.operations_.push_back(std::move(operation));
  }
  if (commit.sequence() == 0) {
    return absl::InvalidArgumentError("replicated commit with sequence 0 (sequences start at 1)");
  }
  absl::MutexLock lock(&replication_mu_);
  if (commit.epoch() < last_.epoch) {
    return absl::FailedPreconditionError(
        absl::StrCat("replicated commit ", commit.sequence(), " is of epoch ", commit.epoch(),
                     ", older than this standby's epoch ", last_.epoch));
  }
  if (commit.sequence() <= last_.sequence) {
    if (commit.epoch() == last_.epoch) return absl::OkStatus();  // a retried send: done already
    return absl::FailedPreconditionError(absl::StrCat(
        "replicated commit ", commit.sequence(), " of epoch ", commit.epoch(),
        ": this standby already applied up to ", last_.sequence, " in epoch ", last_.epoch,
        ", commits the new leader does not have; rebuild it from a checkpoint"));
  }
  if (commit.sequence() != last_.sequence + 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "replicated commit: expected sequence ", last_.sequence + 1, ", got ", commit.sequence(),
        " (a gap; catch up from a checkpoint)"));
  }
  if (commit.previous_epoch() != last_.epoch) {
    return absl::FailedPreconditionError(absl::StrCat(
        "replicated commit ", commit.sequence(), " of epoch ", commit.epoch(),
        " follows a commit of epoch ", commit.previous_epoch(), ", this standby's last is of epoch ",
        last_.epoch, " (diverged history; rebuild from a checkpoint)"));
  }
  ReplicationRecord position;
  position.set_epoch(commit.epoch());
  position.set_sequence(commit.sequence());
  RETURN_IF_ERROR(WriteOperations(batch, &position));
  last_ = Position{commit.epoch(), commit.sequence()};
  epoch_ = std::max(epoch_, commit.epoch());
  return absl::OkStatus();
}

absl::StatusOr<DurableStore::Position> DurableStore::Checkpoint(const std::string& dir) const {
  if (in_memory()) {
    return absl::FailedPreconditionError("Checkpoint: an in-memory store has no files to copy");
  }
  std::error_code error;
  if (std::filesystem::exists(dir, error)) {
    return absl::FailedPreconditionError(absl::StrCat("Checkpoint: ", dir, " exists"));
  }
  // No commit between the RocksDB checkpoint and the copies: a commit takes replication_mu_
  // (capturing) or files_mu_ exclusively (with tensors) around its RocksDB write, and a file
  // is overwritten only after a later commit made it a spare.
  absl::MutexLock lock(&replication_mu_);
  absl::ReaderMutexLock files_lock(&files_mu_);
  rocksdb::Checkpoint* raw_checkpoint = nullptr;
  RETURN_IF_ERROR(FromRocksDb(rocksdb::Checkpoint::Create(db_.get(), &raw_checkpoint),
                              absl::StrCat("Checkpoint of ", options_.data_dir)));
  std::unique_ptr<rocksdb::Checkpoint> checkpoint(raw_checkpoint);
  // No memtable flush (RocksDB's default flushes every column family first, stalling the
  // commits waiting on this lock behind disk writes): the write-ahead log, which every write
  // goes through, is copied into the checkpoint instead and replayed when it is opened.
  RETURN_IF_ERROR(FromRocksDb(
      checkpoint->CreateCheckpoint(dir, std::numeric_limits<uint64_t>::max()),
      absl::StrCat("Checkpoint of ", options_.data_dir, " to ", dir)));
  const std::filesystem::path tensors = std::filesystem::path(dir) / "tensors";
  std::filesystem::create_directories(tensors, error);
  for (const auto& [id, file] : current_files_) {
    if (error) break;
    std::filesystem::copy_file(std::filesystem::path(tensor_files_->dir()) / file, tensors / file,
                               error);
  }
  if (error) {
    const std::string message =
        absl::StrCat("Checkpoint: copying tensor files to ", tensors.string(), ": ",
                     error.message());
    return error == std::errc::no_space_on_device ? absl::ResourceExhaustedError(message)
                                                  : absl::UnavailableError(message);
  }
  return last_;
}

absl::Status DurableStore::OpenReplication() {
  rocksdb::PinnableSlice value;
  const rocksdb::Status status =
      db_->Get(rocksdb::ReadOptions(), Handle(ColumnFamily::kMeta), kReplicationMetaKey, &value);
  if (status.IsNotFound()) return absl::OkStatus();
  RETURN_IF_ERROR(FromRocksDb(
      status, absl::StrCat("reading ", DescribeKey(ColumnFamily::kMeta, kReplicationMetaKey))));
  ReplicationRecord record;
  RETURN_IF_ERROR(DecodeValue(ColumnFamily::kMeta, kReplicationMetaKey,
                              absl::string_view(value.data(), value.size()), &record));
  absl::MutexLock lock(&replication_mu_);
  last_ = Position{record.epoch(), record.sequence()};
  epoch_ = record.epoch();
  return absl::OkStatus();
}

void DurableStore::AppendReplicated(const std::vector<WriteBatch::Operation>& operations,
                                    ReplicatedCommit* commit) {
  for (const WriteBatch::Operation& operation : operations) {
    ReplicatedOperation* out = commit->add_operations();
    out->set_column_family(static_cast<int32_t>(operation.family));
    out->set_key(operation.key);
    if (operation.delete_range) {
      out->set_delete_range(true);
      out->set_delete_end(operation.payload);
      continue;
    }
    out->set_value(operation.payload);
    if (!operation.has_tensors) continue;
    out->set_tensor_file_prefix(operation.file_prefix);
    for (absl::string_view part : operation.data) out->add_tensor_data(std::string(part));
  }
}

absl::Status DurableStore::WriteOperations(const WriteBatch& batch,
                                           const ReplicationRecord* replication) {
  Prepared prepared(this, &batch);
  RETURN_IF_ERROR(WriteTensorFiles(&prepared));
  return WriteRecords(&prepared, replication);
}

absl::Status DurableStore::WriteTensorFiles(Prepared* prepared) {
  // Tensor files first: a record is committed only once its file is complete.
  const std::vector<WriteBatch::Operation>& operations = prepared->batch_->operations_;
  const size_t n = operations.size();
  prepared->payloads_.assign(n, std::string());
  prepared->headers_.assign(n, std::string());
  prepared->files_.assign(n, std::string());
  for (size_t i = 0; i < n; ++i) {
    const WriteBatch::Operation& operation = operations[i];
    if (!operation.has_tensors) continue;
    prepared->any_tensors_ = true;
    std::string reuse;
    {
      absl::MutexLock lock(&files_mu_);
      auto spare = spare_files_.find({operation.family, operation.key});
      if (spare != spare_files_.end()) {
        reuse = std::move(spare->second);
        spare_files_.erase(spare);
      }
    }
    absl::StatusOr<TensorBlob> blob =
        tensor_files_->Write(operation.file_prefix, operation.data, reuse);
    if (!blob.ok()) {
      RemovePreparedFiles(prepared);
      return absl::Status(blob.status().code(),
                          absl::StrCat(DescribeKey(operation.family, operation.key), ": ",
                                       blob.status().message()));
    }
    prepared->files_[i] = blob->file();
    prepared->payloads_[i] = operation.payload + StoredTensorsField(*blob);
    prepared->headers_[i] = EnvelopeHeader(prepared->payloads_[i]);
  }
  return absl::OkStatus();
}

absl::Status DurableStore::WriteRecords(Prepared* prepared, const ReplicationRecord* replication) {
  const std::vector<WriteBatch::Operation>& operations = prepared->batch_->operations_;
  const std::vector<std::string>& payloads = prepared->payloads_;
  const std::vector<std::string>& headers = prepared->headers_;
  const size_t n = operations.size();
  auto remove_new_files = [&]() { RemovePreparedFiles(prepared); };
  // Only what goes into RocksDB: the tensor bytes went to their files.
  size_t rocks_bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    const WriteBatch::Operation& operation = operations[i];
    rocks_bytes += 32 + operation.key.size() +
                   (operation.has_tensors ? headers[i].size() + payloads[i].size()
                                          : operation.header.size() + operation.payload.size());
  }
  rocksdb::WriteBatch rocks_batch(/*reserved_bytes=*/rocks_bytes);
  for (size_t i = 0; i < n; ++i) {
    const WriteBatch::Operation& operation = operations[i];
    rocksdb::ColumnFamilyHandle* handle = Handle(operation.family);
    rocksdb::Status status;
    if (operation.delete_range) {
      status = rocks_batch.DeleteRange(handle, operation.key, operation.payload);
    } else {
      const rocksdb::Slice key(operation.key);
      const bool moved = operation.has_tensors;
      const rocksdb::Slice parts[2] = {rocksdb::Slice(moved ? headers[i] : operation.header),
                                       rocksdb::Slice(moved ? payloads[i] : operation.payload)};
      status = rocks_batch.Put(handle, rocksdb::SliceParts(&key, 1), rocksdb::SliceParts(parts, 2));
    }
    if (!status.ok()) remove_new_files();
    RETURN_IF_ERROR(FromRocksDb(status, "building the write batch"));
  }
  if (replication != nullptr) {
    const std::string value = WrapInEnvelope(replication->SerializeAsString());
    const rocksdb::Status status =
        rocks_batch.Put(Handle(ColumnFamily::kMeta), kReplicationMetaKey, value);
    if (!status.ok()) remove_new_files();
    RETURN_IF_ERROR(FromRocksDb(status, "building the write batch"));
  }
  rocksdb::WriteOptions write_options;
  write_options.sync = options_.fsync;
  if (!prepared->any_tensors_) {
    return FromRocksDb(db_->Write(write_options, &rocks_batch), "committing a write batch");
  }
  absl::MutexLock lock(&files_mu_);
  absl::Status written =
      FromRocksDb(db_->Write(write_options, &rocks_batch), "committing a write batch");
  if (!written.ok()) {
    remove_new_files();
    return written;
  }
  // The records now name the new files: the ones they named before become spares.
  for (size_t i = 0; i < n; ++i) {
    const WriteBatch::Operation& operation = operations[i];
    if (!operation.has_tensors) continue;
    const std::pair<ColumnFamily, std::string> id{operation.family, operation.key};
    std::string& current = current_files_[id];
    if (!current.empty()) {
      std::string& spare = spare_files_[id];
      if (!spare.empty()) tensor_files_->Remove(spare);
      spare = std::move(current);
    }
    current = prepared->files_[i];
  }
  // Committed: the files are the records' now, not the Prepared batch's to remove.
  prepared->files_.clear();
  return absl::OkStatus();
}

template <typename Record>
absl::Status DurableStore::LoadTensors(ColumnFamily family, absl::string_view key,
                                       Record* record) const {
  if (!record->has_stored_tensors()) return absl::OkStatus();
  const TensorBlob& blob = record->stored_tensors();
  std::vector<Tensor*> tensors = MutableTensorsOf(record);
  if (static_cast<int>(tensors.size()) != blob.part_bytes_size()) {
    return absl::DataLossError(absl::StrCat(DescribeKey(family, key), ": the record has ",
                                            tensors.size(), " tensors, its tensor file ",
                                            blob.part_bytes_size()));
  }
  std::vector<std::string*> parts;
  for (Tensor* tensor : tensors) parts.push_back(tensor->mutable_data());
  RETURN_IF_ERROR(tensor_files_->Read(blob, parts, DescribeKey(family, key)));
  record->clear_stored_tensors();
  return absl::OkStatus();
}

absl::StatusOr<LoadedState> DurableStore::LoadAll() const {
  LoadedState state;

  auto load_center = [this, &state](absl::string_view key, absl::string_view value)
                       ABSL_SHARED_LOCKS_REQUIRED(files_mu_) -> absl::Status {
    const std::optional<int32_t> stage = ParseStageKey(key);
    if (!stage.has_value()) return MalformedKey(ColumnFamily::kCenter, key);
    CenterRecord record;
    RETURN_IF_ERROR(DecodeValue(ColumnFamily::kCenter, key, value, &record));
    RETURN_IF_ERROR(
        CheckStage(ColumnFamily::kCenter, key, *stage, record.has_stage(), record.stage()));
    RETURN_IF_ERROR(LoadTensors(ColumnFamily::kCenter, key, &record));
    state.centers.emplace(*stage, std::move(record));
    return absl::OkStatus();
  };
  auto load_center_opt = [this, &state](absl::string_view key, absl::string_view value)
                       ABSL_SHARED_LOCKS_REQUIRED(files_mu_) -> absl::Status {
    const std::optional<int32_t> stage = ParseStageKey(key);
    if (!stage.has_value()) return MalformedKey(ColumnFamily::kCenterOpt, key);
    CenterOptRecord record;
    RETURN_IF_ERROR(DecodeValue(ColumnFamily::kCenterOpt, key, value, &record));
    RETURN_IF_ERROR(
        CheckStage(ColumnFamily::kCenterOpt, key, *stage, record.has_stage(), record.stage()));
    RETURN_IF_ERROR(LoadTensors(ColumnFamily::kCenterOpt, key, &record));
    state.center_opts.emplace(*stage, std::move(record));
    return absl::OkStatus();
  };
  auto load_snapshot = [this, &state](absl::string_view key, absl::string_view value)
                       ABSL_SHARED_LOCKS_REQUIRED(files_mu_) -> absl::Status {
    if (key.size() == kRangeSnapshotKeySize) {
      // A range group's: the header only (the tensors are read when asked for).
      const std::optional<RangeSnapshotKeyFields> range = ParseRangeSnapshotKey(key);
      if (!range.has_value()) return MalformedKey(ColumnFamily::kSnapshot, key);
      Snapshot record;
      RETURN_IF_ERROR(DecodeValue(ColumnFamily::kSnapshot, key, value, &record));
      RETURN_IF_ERROR(CheckSlot(ColumnFamily::kSnapshot, key, range->slot, record.has_slot(),
                                record.slot()));
      state.range_snapshots.emplace(
          std::make_pair(ReplicaStage(range->slot.replica, range->slot.stage), range->copy),
          std::move(record));
      return absl::OkStatus();
    }
    const std::optional<SlotKeyFields> slot = ParseSlotKey(key);
    if (!slot.has_value()) return MalformedKey(ColumnFamily::kSnapshot, key);
    Snapshot record;
    RETURN_IF_ERROR(DecodeValue(ColumnFamily::kSnapshot, key, value, &record));
    RETURN_IF_ERROR(
        CheckSlot(ColumnFamily::kSnapshot, key, *slot, record.has_slot(), record.slot()));
    RETURN_IF_ERROR(LoadTensors(ColumnFamily::kSnapshot, key, &record));
    state.snapshots.emplace(ReplicaStage(slot->replica, slot->stage), std::move(record));
    return absl::OkStatus();
  };
  auto load_weight = [&state](absl::string_view key, absl::string_view value) -> absl::Status {
    const std::optional<SlotKeyFields> slot = ParseSlotKey(key);
    if (!slot.has_value()) return MalformedKey(ColumnFamily::kWeights, key);
    WeightRecord record;
    RETURN_IF_ERROR(DecodeValue(ColumnFamily::kWeights, key, value, &record));
    RETURN_IF_ERROR(
        CheckSlot(ColumnFamily::kWeights, key, *slot, record.has_slot(), record.slot()));
    state.weights.emplace(ReplicaStage(slot->replica, slot->stage), std::move(record));
    return absl::OkStatus();
  };
  auto load_meta = [&state](absl::string_view key, absl::string_view value) -> absl::Status {
    if (key == kServerMetaKey) {
      ServerRecord record;
      RETURN_IF_ERROR(DecodeValue(ColumnFamily::kMeta, key, value, &record));
      state.server = std::move(record);
      return absl::OkStatus();
    }
    if (absl::StartsWith(key, kSlotMetaKeyPrefix)) {
      const std::optional<SlotKeyFields> slot = ParseSlotMetaKey(key);
      if (!slot.has_value()) return MalformedKey(ColumnFamily::kMeta, key);
      SlotRecord record;
      RETURN_IF_ERROR(DecodeValue(ColumnFamily::kMeta, key, value, &record));
      RETURN_IF_ERROR(CheckSlot(ColumnFamily::kMeta, key, *slot, record.has_slot(), record.slot()));
      state.slots.emplace(ReplicaStage(slot->replica, slot->stage), std::move(record));
      return absl::OkStatus();
    }
    if (absl::StartsWith(key, kRangeMetaKeyPrefix)) {
      const std::optional<SlotKeyFields> slot = ParseRangeMetaKey(key);
      if (!slot.has_value()) return MalformedKey(ColumnFamily::kMeta, key);
      WeightRecord record;
      RETURN_IF_ERROR(DecodeValue(ColumnFamily::kMeta, key, value, &record));
      RETURN_IF_ERROR(CheckSlot(ColumnFamily::kMeta, key, *slot, record.has_slot(), record.slot()));
      state.range_books.emplace(ReplicaStage(slot->replica, slot->stage), std::move(record));
      return absl::OkStatus();
    }
    if (key == kReplicationMetaKey) return absl::OkStatus();  // LastApplied()
    LOG(WARNING) << "skipping unknown " << DescribeKey(ColumnFamily::kMeta, key);
    return absl::OkStatus();
  };

  // One RocksDB snapshot for all families: a consistent point in time even under writes.
  absl::ReaderMutexLock files_lock(&files_mu_);
  ScopedSnapshot snapshot(db_.get());
  const std::pair<ColumnFamily, std::function<absl::Status(absl::string_view, absl::string_view)>>
      scans[] = {
          {ColumnFamily::kCenter, load_center},     {ColumnFamily::kCenterOpt, load_center_opt},
          {ColumnFamily::kSnapshot, load_snapshot}, {ColumnFamily::kWeights, load_weight},
          {ColumnFamily::kMeta, load_meta},
      };
  for (const auto& [family, visit] : scans) {
    RETURN_IF_ERROR(ScanFamily(db_.get(), Handle(family), family, snapshot.get(), visit));
  }
  return state;
}

absl::StatusOr<std::vector<LogRecord>> DurableStore::ReadLog(const SlotId& slot,
                                                             int64_t from_step_exclusive,
                                                             int64_t to_step_inclusive) const {
  RETURN_IF_ERROR(ValidateReadSlot("ReadLog", slot));
  std::vector<LogRecord> records;
  // Steps [first, end) in unsigned arithmetic: end may be 2^63 when to_step_inclusive is the
  // largest int64.
  const uint64_t first =
      from_step_exclusive < 0 ? 0 : static_cast<uint64_t>(from_step_exclusive) + 1;
  if (to_step_inclusive < 0) return records;
  const uint64_t end = static_cast<uint64_t>(to_step_inclusive) + 1;
  if (first >= end) return records;

  const std::string begin_key = EncodeLogKey(slot.replica(), slot.stage(), first, -1);
  const std::string end_key = EncodeLogKey(slot.replica(), slot.stage(), end, -1);
  const rocksdb::Slice upper_bound(end_key);
  rocksdb::ReadOptions read_options;
  read_options.iterate_upper_bound = &upper_bound;
  std::unique_ptr<rocksdb::Iterator> it(
      db_->NewIterator(read_options, Handle(ColumnFamily::kStepLog)));
  for (it->Seek(begin_key); it->Valid(); it->Next()) {
    const absl::string_view key(it->key().data(), it->key().size());
    const absl::string_view value(it->value().data(), it->value().size());
    const std::optional<LogKeyFields> fields = ParseLogKey(key);
    if (!fields.has_value()) return MalformedKey(ColumnFamily::kStepLog, key);
    LogRecord record;
    RETURN_IF_ERROR(DecodeValue(ColumnFamily::kStepLog, key, value, &record));
    const bool matches = record.has_slot() && record.slot().has_replica() &&
                         record.slot().has_stage() && record.has_step() &&
                         record.has_micro_batch() &&
                         LogKeyFields{record.slot().replica(), record.slot().stage(), record.step(),
                                      record.micro_batch(), LogPartOf(record)} == *fields;
    if (!matches) {
      return RecordMismatch(
          ColumnFamily::kStepLog, key,
          absl::StrFormat("r=%d, s=%d, step=%d, mb=%d", record.slot().replica(),
                          record.slot().stage(), record.step(), record.micro_batch()));
    }
    records.push_back(std::move(record));
  }
  RETURN_IF_ERROR(FromRocksDb(it->status(), absl::StrCat("reading the step log of slot ",
                                                         SlotText(slot.replica(), slot.stage()))));
  return records;
}

absl::StatusOr<Snapshot> DurableStore::ReadSnapshot(const SlotId& slot) const {
  RETURN_IF_ERROR(ValidateReadSlot("ReadSnapshot", slot));
  return ReadSnapshotAt(EncodeSlotKey(slot.replica(), slot.stage()), slot,
                        absl::StrCat("no snapshot of slot ", SlotText(slot.replica(), slot.stage())));
}

absl::StatusOr<Snapshot> DurableStore::ReadRangeSnapshot(const SlotId& slot, int copy) const {
  RETURN_IF_ERROR(ValidateReadSlot("ReadRangeSnapshot", slot));
  if (copy != 0 && copy != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("ReadRangeSnapshot: copy must be 0 or 1, got ", copy));
  }
  return ReadSnapshotAt(EncodeRangeSnapshotKey(slot.replica(), slot.stage(), copy), slot,
                        absl::StrCat("no range snapshot of slot ",
                                     SlotText(slot.replica(), slot.stage()), " copy ", copy));
}

absl::StatusOr<Snapshot> DurableStore::ReadSnapshotAt(const std::string& key, const SlotId& slot,
                                                      const std::string& not_found) const {
  absl::ReaderMutexLock files_lock(&files_mu_);
  rocksdb::PinnableSlice value;
  const rocksdb::Status status =
      db_->Get(rocksdb::ReadOptions(), Handle(ColumnFamily::kSnapshot), key, &value);
  if (status.IsNotFound()) return absl::NotFoundError(not_found);
  RETURN_IF_ERROR(
      FromRocksDb(status, absl::StrCat("reading ", DescribeKey(ColumnFamily::kSnapshot, key))));
  Snapshot snapshot;
  RETURN_IF_ERROR(DecodeValue(ColumnFamily::kSnapshot, key,
                              absl::string_view(value.data(), value.size()), &snapshot));
  RETURN_IF_ERROR(CheckSlot(ColumnFamily::kSnapshot, key,
                            SlotKeyFields{slot.replica(), slot.stage()}, snapshot.has_slot(),
                            snapshot.slot()));
  RETURN_IF_ERROR(LoadTensors(ColumnFamily::kSnapshot, key, &snapshot));
  return snapshot;
}

absl::StatusOr<StoreStats> DurableStore::Stats() const {
  StoreStats stats;
  for (ColumnFamily family : kAllFamilies) {
    rocksdb::ColumnFamilyHandle* handle = Handle(family);
    ColumnFamilyStats family_stats;
    const std::pair<const std::string*, uint64_t*> properties[] = {
        {&rocksdb::DB::Properties::kTotalSstFilesSize, &family_stats.sst_bytes},
        {&rocksdb::DB::Properties::kCurSizeAllMemTables, &family_stats.memtable_bytes},
        {&rocksdb::DB::Properties::kEstimateLiveDataSize, &family_stats.live_data_bytes},
        {&rocksdb::DB::Properties::kEstimateNumKeys, &family_stats.keys_estimate},
    };
    for (const auto& [name, out] : properties) {
      if (!db_->GetIntProperty(handle, *name, out)) {
        return absl::InternalError(absl::StrCat("RocksDB property ", *name,
                                                " is unavailable for column family ",
                                                ColumnFamilyName(family)));
      }
    }
    stats.total_bytes += family_stats.approximate_bytes();
    stats.column_families.emplace(ColumnFamilyName(family), family_stats);
  }
  stats.steplog_keys_estimate =
      stats.column_families[ColumnFamilyName(ColumnFamily::kStepLog)].keys_estimate;
  ASSIGN_OR_RETURN(stats.tensor_file_bytes, tensor_files_->TotalBytes());
  stats.total_bytes += stats.tensor_file_bytes;
  return stats;
}

absl::Status DurableStore::CompactAll() {
  rocksdb::CompactRangeOptions compact_options;
  for (ColumnFamily family : kAllFamilies) {
    RETURN_IF_ERROR(FromRocksDb(db_->CompactRange(compact_options, Handle(family), nullptr, nullptr),
                                absl::StrCat("compacting ", ColumnFamilyName(family))));
  }
  return absl::OkStatus();
}

absl::Status DurableStore::Flush() {
  rocksdb::FlushOptions flush_options;
  flush_options.wait = true;
  std::vector<rocksdb::ColumnFamilyHandle*> handles(std::begin(handles_), std::end(handles_));
  return FromRocksDb(db_->Flush(flush_options, handles), "flushing RocksDB");
}

}  // namespace rebound::storage
