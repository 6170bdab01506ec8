#include "server/step_log.h"

#include "common/request_fields.h"

#include <glog/logging.h>

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/config.h"
#include "common/grpc_status.h"
#include "common/security.h"
#include "common/slot.h"
#include "common/tensor_codec.h"
#include "compute/model_layout.h"
#include "server/membership.h"
#include "storage/durable_store.h"

namespace rebound::server {
namespace {

std::string DescribeRecord(const LogRecord& record, int index) {
  return absl::StrFormat("record %d of the batch (record_id %d, slot %s, step %d, micro_batch %d)",
                         index, record.record_id(), SlotName(record.slot()), record.step(),
                         record.micro_batch());
}

// Reader locks on several slots, taken in ascending index order and released in reverse.
class SlotReaderLocks {
 public:
  explicit SlotReaderLocks(std::vector<absl::Mutex*> mutexes) ABSL_NO_THREAD_SAFETY_ANALYSIS
      : mutexes_(std::move(mutexes)) {
    for (absl::Mutex* mu : mutexes_) mu->ReaderLock();
  }
  ~SlotReaderLocks() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (auto it = mutexes_.rbegin(); it != mutexes_.rend(); ++it) (*it)->ReaderUnlock();
  }
  SlotReaderLocks(const SlotReaderLocks&) = delete;
  SlotReaderLocks& operator=(const SlotReaderLocks&) = delete;

 private:
  const std::vector<absl::Mutex*> mutexes_;
};

}  // namespace

StepLogService::StepLogService(const JobConfig& job, Membership* membership,
                               storage::DurableStore* store, SnapshotStepFn snapshot_step,
                               SnapshotStepFn sync_step)
    : job_(job),
      membership_(membership),
      store_(store),
      snapshot_step_(std::move(snapshot_step)),
      sync_step_(sync_step ? std::move(sync_step) : snapshot_step_),
      replicas_(job_.topology().replicas()),
      stages_(job_.topology().stages()),
      micro_batches_(std::max(1, job_.data().micro_batches())),
      samples_per_micro_batch_(job_.data().batch_size() / micro_batches_),
      max_batch_bytes_(job_.step_log().buffer_bytes()),
      logged_(LoggedBoundaries(job_)),
      slots_(new SlotGuard[static_cast<size_t>(replicas_) * stages_]) {}

int StepLogService::SlotIndex(const SlotId& slot) const {
  return slot.replica() * stages_ + slot.stage();
}

absl::Status StepLogService::ValidateSlot(const SlotId& slot) const {
  if (slot.replica() < 0 || slot.replica() >= replicas_ || slot.stage() < 0 ||
      slot.stage() >= stages_) {
    return absl::InvalidArgumentError(absl::StrCat("slot ", SlotName(slot), " is outside the ",
                                                   replicas_, " x ", stages_, " topology"));
  }
  return absl::OkStatus();
}

absl::Status StepLogService::ValidateRecord(uint64_t incarnation, const LogRecord& record,
                                            int index) const {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(DescribeRecord(record, index), ": ", why));
  };
  if (!record.has_slot() || !record.slot().has_replica() || !record.slot().has_stage()) {
    return bad("slot.replica and slot.stage must be set");
  }
  if (absl::Status slot = ValidateSlot(record.slot()); !slot.ok()) {
    return bad(std::string(slot.message()));
  }
  if (!record.has_step() || record.step() < 1) return bad("step must be >= 1");
  if (record.step() > job_.training().max_steps()) {
    return bad(absl::StrCat("step must be <= training.max_steps = ", job_.training().max_steps(),
                            ", got ", record.step()));
  }
  // A log serves the replay from the slot's snapshot to its next sync: a record more than two
  // sync periods past the snapshot can never be replayed (docs/bad_input.md).
  if (sync_step_) {
    const int64_t limit = sync_step_(record.slot()) + 2 * int64_t{job_.easgd().sync_period()};
    if (record.step() > limit) {
      return bad(absl::StrCat("step must be <= the slot's snapshot step + 2 x easgd.sync_period = ",
                              limit, ", got ", record.step()));
    }
  }
  if (!record.has_micro_batch() || record.micro_batch() < -1 ||
      record.micro_batch() >= micro_batches_) {
    return bad(absl::StrCat("micro_batch must be in [-1, ", micro_batches_, ")"));
  }
  if (record.record_id() < 1) return bad("record_id must be >= 1");
  if (record.has_sender_incarnation() && record.sender_incarnation() != incarnation) {
    return bad(absl::StrCat("sender_incarnation ", record.sender_incarnation(),
                            " differs from the batch's incarnation ", incarnation));
  }
  if (record.micro_batch() == -1) {
    if (!record.has_params_checksum()) return bad("a per-step record needs params_checksum");
    if (record.tensor_checksums_size() > compute::kMaxDeclaredTensors) {
      return bad(absl::StrCat("at most ", compute::kMaxDeclaredTensors, " tensor_checksums, got ",
                              record.tensor_checksums_size()));
    }
    if (record.sample_ids_size() > 0 || record.boundaries_size() > 0) {
      return bad("a per-step record carries only params_checksum");
    }
    return absl::OkStatus();
  }
  if (record.has_params_checksum() || record.has_rng_seed() || record.tensor_checksums_size() > 0) {
    return bad(
        "params_checksum, rng_seed and tensor_checksums belong in the per-step record "
        "(micro_batch -1)");
  }
  if (record.sample_ids_size() != samples_per_micro_batch_) {
    return bad(absl::StrCat("needs batch_size / M = ", samples_per_micro_batch_,
                            " sample ids, got ", record.sample_ids_size()));
  }
  for (int i = 0; i < record.sample_ids_size(); ++i) {
    if (record.sample_ids(i) < 0) {
      return bad(absl::StrCat("sample_ids[", i, "] is negative: ", record.sample_ids(i)));
    }
    // Sample ids index the training set: the first data.train_limit samples, or (limit 0) at
    // most 2^31 - 1 (an IDX file's count; the server does not read the data set itself).
    const int64_t samples = job_.data().train_limit() > 0 ? job_.data().train_limit()
                                                          : int64_t{0x7fffffff};
    if (record.sample_ids(i) >= samples) {
      return bad(absl::StrCat("sample_ids[", i, "] must be < ",
                              job_.data().train_limit() > 0 ? "data.train_limit = "
                                                            : "2^31 - 1 = ",
                              samples, ", got ", record.sample_ids(i)));
    }
  }
  if (record.boundaries_size() > 1) {
    return bad("a micro-batch record carries at most one boundary payload (one per sender)");
  }
  for (int i = 0; i < record.boundaries_size(); ++i) {
    const BoundaryPayload& boundary = record.boundaries(i);
    const std::string what = absl::StrCat("boundaries[", i, "]");
    const BoundaryDirection direction = boundary.direction();
    if (direction == FORWARD && record.slot().stage() == 0) {
      return bad(absl::StrCat(what, ": stage 0 receives no FORWARD boundary"));
    }
    if (direction == BACKWARD && record.slot().stage() == stages_ - 1) {
      return bad(absl::StrCat(what, ": the last stage receives no BACKWARD boundary"));
    }
    if (direction != FORWARD && direction != BACKWARD) {
      return bad(absl::StrCat(what, ": direction must be FORWARD or BACKWARD"));
    }
    // Boundary b lies between stages b-1 and b.
    const int b = direction == FORWARD ? record.slot().stage() : record.slot().stage() + 1;
    if (!logged_[b]) {
      return bad(absl::StrCat(what, ": boundary ", b,
                              " is not in step_log.logged_boundaries; nothing is logged there"));
    }
    for (const auto& [tensor, name] :
         {std::pair<const Tensor*, const char*>{&boundary.value(), "value"},
          {&boundary.r_value(), "r_value"}}) {
      if (absl::Status valid = ValidateFloatTensor(*tensor, absl::StrCat(what, ".", name));
          !valid.ok()) {
        return bad(std::string(valid.message()));
      }
    }
  }
  return absl::OkStatus();
}

SlotId StepLogService::WriterOf(const LogRecord& record) {
  SlotId writer = Normalized(record.slot());
  if (record.boundaries_size() > 0) {
    // Sender-side logging (docs/design.md §5.2): a boundary record is written by the stage that sent it.
    writer.set_stage(record.boundaries(0).direction() == FORWARD ? writer.stage() - 1
                                                                 : writer.stage() + 1);
  }
  return writer;
}

std::shared_ptr<StepLogService::Sender> StepLogService::FindOrAddSender(uint64_t incarnation) {
  absl::MutexLock lock(&senders_mu_);
  auto it = senders_.find(incarnation);
  if (it != senders_.end()) return it->second;
  while (senders_.size() >= kMaxSenders) senders_.erase(senders_.begin());
  return senders_.emplace(incarnation, std::make_shared<Sender>()).first->second;
}

void StepLogService::ForgetSender(uint64_t incarnation) {
  absl::MutexLock lock(&senders_mu_);
  senders_.erase(incarnation);
}

void StepLogService::AddStats(const StepLogStats& delta) {
  absl::MutexLock lock(&stats_mu_);
  stats_.batches_committed += delta.batches_committed;
  stats_.records_written += delta.records_written;
  stats_.bytes_written += delta.bytes_written;
  stats_.duplicates_dropped += delta.duplicates_dropped;
  stats_.below_snapshot_dropped += delta.below_snapshot_dropped;
}

void StepLogService::CountRejected() {
  absl::MutexLock lock(&stats_mu_);
  ++stats_.batches_rejected;
}

StepLogStats StepLogService::stats() const {
  absl::MutexLock lock(&stats_mu_);
  return stats_;
}

StepLogService::BatchResult StepLogService::ProcessBatch(AppendLogRequest* mutable_request) {
  const AppendLogRequest& request = *mutable_request;
  const uint64_t incarnation = request.incarnation();
  // A fenced store (this leader is handing over): UNAVAILABLE before the bounds below, which
  // read books that may lag what the group acknowledged (storage/durable_store.h).
  if (absl::Status fenced = store_->Fenced(); !fenced.ok()) return {fenced};
  if (absl::Status alive = membership_->CheckAlive(incarnation); !alive.ok()) {
    if (alive.code() == absl::StatusCode::kFailedPrecondition) ForgetSender(incarnation);
    return {alive};
  }
  if (request.records_size() > kMaxRecordsPerBatch) {
    return {absl::InvalidArgumentError(
        absl::StrCat("a batch holds at most ", kMaxRecordsPerBatch, " records, got ",
                     request.records_size(), "; the first over the limit is ",
                     DescribeRecord(request.records(kMaxRecordsPerBatch), kMaxRecordsPerBatch)))};
  }
  int64_t batch_bytes = 0;
  for (int i = 0; i < request.records_size(); ++i) {
    batch_bytes += static_cast<int64_t>(request.records(i).ByteSizeLong());
    if (batch_bytes > max_batch_bytes_) {
      return {absl::InvalidArgumentError(
          absl::StrCat(DescribeRecord(request.records(i), i), ": the batch reaches ", batch_bytes,
                       " bytes here, over step_log.buffer_bytes = ", max_batch_bytes_))};
    }
  }
  std::set<int> owned;    // slot indexes the batch writes records of
  std::set<int> checked;  // slot indexes whose ownership by the sender is checked
  uint64_t previous_id = 0;
  for (int i = 0; i < request.records_size(); ++i) {
    const LogRecord& record = request.records(i);
    if (absl::Status valid = ValidateRecord(incarnation, record, i); !valid.ok()) return {valid};
    if (record.record_id() <= previous_id) {
      return {absl::InvalidArgumentError(
          absl::StrCat(DescribeRecord(record, i), ": record_id must be above the previous one (",
                       previous_id, ")"))};
    }
    previous_id = record.record_id();
    owned.insert(SlotIndex(record.slot()));
    const SlotId writer = WriterOf(record);
    const int writer_index = SlotIndex(writer);
    if (checked.count(writer_index) > 0) continue;
    if (absl::Status owner = membership_->CheckOwner(incarnation, writer); !owner.ok()) {
      // Fenced in the meantime: that, not the record, ends the stream.
      if (absl::Status alive = membership_->CheckAlive(incarnation); !alive.ok()) {
        if (alive.code() == absl::StatusCode::kFailedPrecondition) ForgetSender(incarnation);
        return {alive};
      }
      return {absl::InvalidArgumentError(
          absl::StrCat(DescribeRecord(record, i), ": ", owner.message()))};
    }
    checked.insert(writer_index);
  }

  std::shared_ptr<Sender> sender = FindOrAddSender(incarnation);
  absl::MutexLock sender_lock(&sender->mu);
  std::vector<absl::Mutex*> mutexes;
  for (int index : owned) mutexes.push_back(&slots_[index].mu);  // std::set: ascending
  StepLogStats delta;
  storage::WriteBatch batch;
  {
    SlotReaderLocks slot_locks(std::move(mutexes));
    std::map<int, int64_t> floors;
    for (int index : owned) {
      SlotId slot;
      slot.set_replica(index / stages_);
      slot.set_stage(index % stages_);
      slots_[index].mu.AssertReaderHeld();  // by slot_locks; tells the analysis so
      int64_t floor = slots_[index].floor;
      if (snapshot_step_) floor = std::max(floor, snapshot_step_(slot));
      floors[index] = floor;
    }
    for (LogRecord& record : *mutable_request->mutable_records()) {
      if (record.record_id() <= sender->acked_through) {
        ++delta.duplicates_dropped;
        continue;
      }
      if (record.step() <= floors[SlotIndex(record.slot())]) {
        ++delta.below_snapshot_dropped;
        continue;
      }
      // Stored as received, with the slot normalized and the sender named: no copy.
      *record.mutable_slot() = Normalized(record.slot());
      record.set_sender_incarnation(incarnation);
      batch.PutLogRecord(record);
      ++delta.records_written;
    }
    if (batch.Count() > 0) {
      if (absl::Status committed = store_->Commit(batch); !committed.ok()) {
        LOG(WARNING) << "AppendLog of incarnation " << incarnation << ": commit of "
                     << batch.Count() << " records failed: " << committed;
        return {committed};
      }
      for (const LogRecord& record : request.records()) {
        if (record.micro_batch() >= 0) continue;
        std::atomic<int64_t>& logged = slots_[SlotIndex(record.slot())].logged_step;
        int64_t seen = logged.load();
        while (record.step() > seen && !logged.compare_exchange_weak(seen, record.step())) {
        }
      }
    }
  }
  delta.bytes_written = static_cast<int64_t>(batch.ApproximateBytes());
  delta.batches_committed = 1;
  sender->acked_through = std::max(sender->acked_through, previous_id);
  AddStats(delta);
  return {absl::OkStatus(), sender->acked_through};
}

grpc::Status StepLogService::HandleAppendLog(
    grpc::ServerContext* context,
    grpc::ServerReaderWriterInterface<AppendLogAck, AppendLogRequest>* stream) {
  AppendLogRequest request;
  bool first = true;
  uint64_t stream_incarnation = 0;
  while (stream->Read(&request)) {
    if (first) {
      stream_incarnation = request.incarnation();
      first = false;
      if (context != nullptr) {
        absl::Status authentic = membership_->Authenticate(
            stream_incarnation, MetadataValue(context, kWorkerCredentialKey));
        if (!authentic.ok()) {
          CountRejected();
          return ToGrpcStatus(authentic);
        }
      }
    } else if (request.incarnation() != stream_incarnation) {
      CountRejected();
      return ToGrpcStatus(absl::InvalidArgumentError(
          absl::StrCat("this AppendLog stream belongs to incarnation ", stream_incarnation,
                       ", got a batch of incarnation ", request.incarnation())));
    }
    if (absl::Status enums = CheckEnumValues(request); !enums.ok()) {
      CountRejected();
      return ToGrpcStatus(enums);
    }
    BatchResult result = ProcessBatch(&request);
    if (!result.status.ok()) {
      if (result.status.code() == absl::StatusCode::kInvalidArgument) {
        CountRejected();
        LOG(WARNING) << "AppendLog of incarnation " << request.incarnation()
                     << " rejected: " << result.status;
      }
      return ToGrpcStatus(result.status);
    }
    AppendLogAck ack;
    ack.set_acked_through(result.acked_through);
    if (!stream->Write(ack)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "the AppendLog client went away");
    }
  }
  if (context != nullptr && context->IsCancelled()) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "the AppendLog call was cancelled");
  }
  return grpc::Status::OK;
}

grpc::Status StepLogService::HandleReadLog(grpc::ServerContext* context,
                                           const ReadLogRequest& request, const SlotId& slot,
                                           grpc::ServerWriterInterface<LogRecord>* writer) {
  if (absl::Status alive = membership_->CheckAlive(request.incarnation()); !alive.ok()) {
    return ToGrpcStatus(alive);
  }
  if (absl::Status valid = ValidateSlot(slot); !valid.ok()) return ToGrpcStatus(valid);
  if (request.from_step() < 0 || request.from_step() >= request.to_step()) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("ReadLog needs 0 <= from_step < to_step, got from_step ", request.from_step(),
                     " and to_step ", request.to_step())));
  }
  absl::StatusOr<std::vector<LogRecord>> records =
      store_->ReadLog(Normalized(slot), request.from_step(), request.to_step());
  if (!records.ok()) {
    LOG(ERROR) << "ReadLog of slot " << SlotName(slot) << " (" << request.from_step() << ", "
               << request.to_step() << "]: " << records.status();
    return ToGrpcStatus(records.status());
  }
  for (const LogRecord& record : *records) {
    if (context != nullptr && context->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "the ReadLog call was cancelled");
    }
    if (!writer->Write(record)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "the ReadLog client went away");
    }
  }
  return grpc::Status::OK;
}

absl::StatusOr<int64_t> StepLogService::LastCompleteStep(const SlotId& slot, int64_t after_step,
                                                         int64_t until_step) const {
  if (absl::Status valid = ValidateSlot(slot); !valid.ok()) return valid;
  if (after_step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("after_step must not be negative, got ", after_step));
  }
  // What a replay of the slot's recovery group [first, end) reads (a single stage when the
  // boundaries around it are logged): the slot's own per-step checksums; per micro-batch the
  // sample ids stage 0 logged itself (first = 0) or the forward pair stage first-1 logged for
  // stage first; and the backward pair stage end logged for stage end-1 (end < S).
  // Not a structured binding: the lambda below captures them (C++20 only for bindings; clang
  // refuses it under -std=c++17).
  const std::pair<int, int> group = RecoveryGroup(job_, slot.stage());
  const int first = group.first;
  const int end = group.second;
  struct StepParts {
    bool checksum = false;
    std::vector<int> parts;  // per micro-batch, bit p: part p present
  };
  std::map<int64_t, StepParts> steps;
  auto read = [&](int stage) -> absl::Status {
    SlotId member = Normalized(slot);
    member.set_stage(stage);
    absl::StatusOr<std::vector<LogRecord>> records =
        store_->ReadLog(member, after_step, until_step);
    if (!records.ok()) return records.status();
    for (const LogRecord& record : *records) {
      StepParts& step = steps[record.step()];
      if (step.parts.empty()) step.parts.assign(micro_batches_, 0);
      if (record.micro_batch() == -1) {
        if (stage == slot.stage() && record.has_params_checksum()) step.checksum = true;
      } else if (record.micro_batch() >= 0 && record.micro_batch() < micro_batches_) {
        const int part = record.boundaries_size() == 0 ? 0 : record.boundaries(0).direction();
        // Bits 0, 1: stage `first`'s ids or forward pair; bit 2: stage end-1's backward pair.
        if (stage == first && part == (first == 0 ? 0 : FORWARD)) {
          step.parts[record.micro_batch()] |= 1;
        }
        if (stage == end - 1 && part == BACKWARD) step.parts[record.micro_batch()] |= 4;
      }
    }
    return absl::OkStatus();
  };
  std::set<int> stages = {slot.stage(), first, end - 1};
  for (int stage : stages) {
    if (absl::Status status = read(stage); !status.ok()) return status;
  }
  const int need = 1 | (end < stages_ ? 4 : 0);
  int64_t complete = after_step;
  for (const auto& [step, parts] : steps) {
    if (step != complete + 1 || !parts.checksum) break;
    bool all = true;
    for (int mb = 0; mb < micro_batches_ && all; ++mb) all = (parts.parts[mb] & need) == need;
    if (!all) break;
    complete = step;
  }
  return complete;
}

int64_t StepLogService::LoggedStep(const SlotId& slot) const {
  if (!ValidateSlot(slot).ok()) return 0;
  return slots_[SlotIndex(slot)].logged_step.load();
}

absl::Status StepLogService::CommitSnapshot(const SlotId& slot, int64_t snapshot_step,
                                            const std::function<absl::Status()>& commit) {
  if (absl::Status valid = ValidateSlot(slot); !valid.ok()) return valid;
  SlotGuard& guard = slots_[SlotIndex(slot)];
  absl::WriterMutexLock lock(&guard.mu);
  absl::Status committed = commit();
  if (committed.ok()) guard.floor = std::max(guard.floor, snapshot_step);
  return committed;
}

}  // namespace rebound::server
