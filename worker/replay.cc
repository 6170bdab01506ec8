#include "worker/replay.h"

#include <glog/logging.h>

#include <chrono>
#include <algorithm>
#include <map>
#include <set>
#include <memory>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/backoff.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "compute/reduction_tree.h"
#include "compute/tensor_bundle.h"
#include "grpcpp/grpcpp.h"
#include "common/security.h"
#include "common/slot.h"
#include "worker/retry.h"
#include "worker/pipeline.h"
#include "worker/shared_sums.h"
#include "worker/worker_metrics.h"

namespace rebound::worker {
namespace {

// The logged inputs of one step: its batch's sample ids (micro-batches in order), the checksum
// of the parameters after it and, for a pipeline stage, the boundary pairs it received per
// micro-batch (forward from stage s-1, backward from stage s+1; compute/mlp.h layout).
struct LoggedStep {
  std::vector<int64_t> ids;
  uint64_t checksum = 0;
  std::vector<std::vector<float>> forward;
  std::vector<std::vector<float>> backward;
};

// Reads the log range (t0, tf] of the task's slot and groups it by step. DATA_LOSS if a step is
// incomplete, or its records disagree on a micro-batch's samples.
absl::StatusOr<std::vector<LoggedStep>> ReadSteps(const WorkerConfig& config,
                                                  const RecoveryTask& task, uint64_t incarnation,
                                                  const JobConfig& job, int first, int end,
                                                  ParameterServer::Stub* stub) {
  const int micro_batches = job.data().micro_batches();
  const int stage = task.slot().stage();
  // The replayed stages [first, end) (the slot alone, or its recovery group) take the forward
  // pairs logged for stage `first` and the backward pairs logged for stage end-1.
  const bool needs_forward = first > 0;
  const bool needs_backward = end < job.topology().stages();
  const int64_t t0 = task.snapshot().step();
  const int64_t tf = task.failed_step();
  std::vector<LoggedStep> steps;
  if (tf <= t0) return steps;
  std::vector<LogRecord> records;
  for (int member : std::set<int>{stage, first, end - 1}) {
    ReadLogRequest request;
    request.set_incarnation(incarnation);
    request.set_task_id(task.task_id());
    request.set_from_step(t0);
    request.set_to_step(tf);
    if (member != stage) {
      *request.mutable_slot() = task.slot();
      request.mutable_slot()->set_stage(member);
    }
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(config.rpc_deadline_ms()) * 6);
    auto reader = stub->ReadLog(&context, request);
    LogRecord record;
    while (reader->Read(&record)) {
      const int part = record.boundaries_size() == 0 ? 0 : record.boundaries(0).direction();
      const bool wanted = (member == stage && record.micro_batch() == -1) ||
                          (member == first && record.micro_batch() >= 0 &&
                           part == (first == 0 ? 0 : FORWARD)) ||
                          (member == end - 1 && record.micro_batch() >= 0 && part == BACKWARD);
      if (wanted) records.push_back(std::move(record));
    }
    RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
  }
  std::stable_sort(records.begin(), records.end(), [](const LogRecord& a, const LogRecord& b) {
    return a.step() < b.step();
  });

  size_t next = 0;
  for (int64_t t = t0 + 1; t <= tf; ++t) {
    LoggedStep step;
    bool has_checksum = false;
    std::vector<std::vector<int64_t>> ids(micro_batches);
    step.forward.resize(needs_forward ? micro_batches : 0);
    step.backward.resize(needs_backward ? micro_batches : 0);
    for (; next < records.size() && records[next].step() == t; ++next) {
      const LogRecord& r = records[next];
      if (r.micro_batch() < 0) {
        step.checksum = r.params_checksum();
        has_checksum = true;
        continue;
      }
      if (r.micro_batch() >= micro_batches) {
        return absl::DataLossError(
            absl::StrCat("step ", t, ": micro-batch ", r.micro_batch(), " in the log"));
      }
      std::vector<int64_t>& mb_ids = ids[r.micro_batch()];
      const std::vector<int64_t> these(r.sample_ids().begin(), r.sample_ids().end());
      if (!mb_ids.empty() && mb_ids != these) {
        return absl::DataLossError(absl::StrCat("step ", t, ", micro-batch ", r.micro_batch(),
                                                ": the log's records name different samples"));
      }
      mb_ids = these;
      if (r.boundaries_size() == 0) continue;
      const BoundaryPayload& payload = r.boundaries(0);
      std::vector<std::vector<float>>& pairs =
          payload.direction() == FORWARD ? step.forward : step.backward;
      if (pairs.empty()) continue;  // not an input of this stage
      RETURN_IF_ERROR(PairFromPayload(payload, &pairs[r.micro_batch()]));
    }
    bool complete = has_checksum;
    for (int mb = 0; mb < micro_batches && complete; ++mb) {
      complete = !ids[mb].empty() && (!needs_forward || !step.forward[mb].empty()) &&
                 (!needs_backward || !step.backward[mb].empty());
      step.ids.insert(step.ids.end(), ids[mb].begin(), ids[mb].end());
    }
    if (!complete) {
      return absl::DataLossError(absl::StrCat("step ", t, " is incomplete in the log"));
    }
    steps.push_back(std::move(step));
  }
  return steps;
}

// Loads the task's snapshot into `compute` (nothing to do if the slot never synced: its state
// at step 0 is the model's initialisation).
absl::Status LoadSnapshot(const Snapshot& snapshot, SlotCompute* compute, int index = 0) {
  if (snapshot.params().tensors_size() == 0) return absl::OkStatus();
  compute::MlpStage& stage = compute->trainer->stage(index);
  const compute::StageLayout& layout = stage.layout();
  RETURN_IF_ERROR(compute::ValidateBundle(layout, snapshot.params(), "snapshot.params"));
  RETURN_IF_ERROR(stage.SetParams(compute::PackedFromBundle(layout, snapshot.params())));
  const OptimizerState& opt = snapshot.optimizer();
  RETURN_IF_ERROR(compute::ValidateBundle(layout, opt.m(), "snapshot.optimizer.m"));
  RETURN_IF_ERROR(compute::ValidateBundle(layout, opt.v(), "snapshot.optimizer.v"));
  RETURN_IF_ERROR(compute::ValidateBundle(layout, opt.last_hdiag(), "snapshot.optimizer.last_hdiag"));
  return compute->trainer->optimizer(index).SetState(compute::PackedFromBundle(layout, opt.m()),
                                                 compute::PackedFromBundle(layout, opt.v()),
                                                 compute::PackedFromBundle(layout, opt.last_hdiag()));
}

// Per stage, the first `active[s]` floats of `sums[s]` as FLOAT32 tensors (id = stage).
absl::Status PackSums(compute::Backend* backend, absl::Span<const compute::ConstDSpan> sums,
                      absl::Span<const int64_t> active, TensorBundle* out) {
  out->Clear();
  for (size_t s = 0; s < sums.size(); ++s) {
    Tensor* tensor = out->add_tensors();
    tensor->set_id(static_cast<uint32_t>(s));
    tensor->set_name(absl::StrCat("stage", s, ".sums"));
    tensor->set_dtype(FLOAT32);
    tensor->add_shape(active[s]);
    std::string* data = tensor->mutable_data();
    data->resize(static_cast<size_t>(active[s]) * sizeof(float));
    // operator new's storage is aligned for float.
    RETURN_IF_ERROR(backend->CopyToHost(
        sums[s].sub(0, active[s]),
        absl::MakeSpan(reinterpret_cast<float*>(data->data()), static_cast<size_t>(active[s]))));
  }
  return absl::OkStatus();
}

// INVALID_ARGUMENT unless `sums` holds one tensor per stage of the expected active lengths.
absl::Status CheckSums(const TensorBundle& sums, absl::Span<const int64_t> active,
                       const std::string& what) {
  if (sums.tensors_size() != static_cast<int>(active.size())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", sums.tensors_size(),
                                                   " tensors for ", active.size(), " stages"));
  }
  for (size_t s = 0; s < active.size(); ++s) {
    const Tensor& tensor = sums.tensors(static_cast<int>(s));
    if (tensor.dtype() != FLOAT32 ||
        tensor.data().size() != static_cast<size_t>(active[s]) * sizeof(float)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": stage ", s, " has ",
                                                     tensor.data().size(), " bytes, expected ",
                                                     active[s] * sizeof(float)));
    }
  }
  return absl::OkStatus();
}

// Copies a stage's received sums (raw little-endian floats) to the device.
absl::Status UnpackSums(compute::Backend* backend, const Tensor& tensor,
                        std::vector<float>* scratch, compute::DSpan dst) {
  const size_t n = tensor.data().size() / sizeof(float);
  const void* bytes = tensor.data().data();
  if (reinterpret_cast<uintptr_t>(bytes) % alignof(float) == 0) {
    // Aligned (as the heap gives large strings): straight from the message.
    return backend->CopyToDevice(absl::MakeConstSpan(static_cast<const float*>(bytes), n),
                                 dst.sub(0, static_cast<int64_t>(n)));
  }
  scratch->resize(n);
  std::memcpy(scratch->data(), tensor.data().data(), scratch->size() * sizeof(float));
  return backend->CopyToDevice(*scratch, dst.sub(0, static_cast<int64_t>(scratch->size())));
}

// Sends one message to a peer, retrying UNAVAILABLE (the peer has not opened the task yet, or a
// connection hiccup) with a short capped backoff until `deadline`.
template <typename Call>
absl::Status SendToPeer(const char* what, absl::Time deadline, const absl::Notification& stop,
                        grpc::Channel* channel, Call call) {
  Backoff backoff(absl::Milliseconds(2), absl::Milliseconds(100), absl::ToUnixNanos(absl::Now()));
  while (true) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    const absl::Status status = FromGrpcStatus(call(&context));
    if (status.ok() || status.code() != absl::StatusCode::kUnavailable) return status;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": ", status.message()));
    }
    // UNAVAILABLE from a peer that answers means "not ready yet"; from one that refuses
    // connections, that it is gone.
    if (channel->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_TRANSIENT_FAILURE) {
      return absl::UnavailableError(absl::StrCat(what, ": it cannot be reached any more (",
                                                 status.message(), ")"));
    }
    if (stop.WaitForNotificationWithTimeout(backoff.Next())) {
      return absl::CancelledError("stopped");
    }
  }
}

// The per-step exchange of a parallel replay, from one spare's side.
class Exchange {
 public:
  // `max_floats`: the most floats one step's sums of all stages take.
  Exchange(const WorkerConfig& config, const RecoveryTask& task, ReplayMailbox* mailbox,
           const absl::Notification& stop, int64_t max_floats)
      : config_(config), task_(task), mailbox_(mailbox), stop_(stop) {
    if (config.replay_shared_memory()) {
      auto region = SharedSumsWriter::Create(task.task_id(), task.rank(), max_floats);
      if (region.ok()) {
        region_ = *std::move(region);
      } else {
        LOG(WARNING) << "partial sums go inline to every spare: " << region.status();
      }
    }
    by_reference_.assign(task.spares_size(), false);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(kMaxPeerMessageBytes);
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kPeerWindowBytes);
    args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kPeerFrameBytes);
    args.SetInt(GRPC_ARG_TCP_READ_CHUNK_SIZE, kPeerReadChunkBytes);
    for (int r = 0; r < task.spares_size(); ++r) {
      const bool needed = r != task.rank();
      std::shared_ptr<grpc::Channel> channel;
      if (needed) {
        // The same credentials and token as the job's other workers (common/security.h);
        // MakeChannel reads files the config loader has checked.
        auto made = MakeChannel(task.spares(r).peer_address(), config.security(), args);
        if (!made.ok()) LOG(ERROR) << "cannot set up the channel to a spare: " << made.status();
        channel = made.ok() ? *std::move(made)
                            : grpc::CreateCustomChannel(task.spares(r).peer_address(),
                                                        grpc::InsecureChannelCredentials(), args);
      }
      channels_.push_back(channel);
      stubs_.push_back(needed ? WorkerPeer::NewStub(channels_.back()) : nullptr);
    }
  }

  // How long one exchange may wait for a peer.
  absl::Duration Bound(bool first) const {
    return absl::Milliseconds(config_.rpc_deadline_ms()) * (first ? 2 : 1);
  }

  // Waits for a message with `take(slice)` until `bound`, checking between slices that peer `r`
  // is still reachable: a peer process that died refuses connections at once, and the task ends
  // then rather than at the bound.
  template <typename Message, typename Take>
  absl::StatusOr<Message> Await(int r, absl::Duration bound, Take take) {
    const absl::Time deadline = absl::Now() + bound;
    while (true) {
      const absl::Duration slice = std::min(kProbePeriod, deadline - absl::Now());
      absl::StatusOr<Message> message = take(std::max(slice, absl::ZeroDuration()));
      if (message.ok() || message.status().code() != absl::StatusCode::kDeadlineExceeded ||
          absl::Now() >= deadline) {
        return message;
      }
      if (stop_.HasBeenNotified()) return absl::CancelledError("stopped");
      if (channels_[r]->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_TRANSIENT_FAILURE) {
        return absl::UnavailableError("it cannot be reached any more");
      }
    }
  }

  // Writes this spare's sums of step t (per stage, its first active[s] floats) where its peers
  // will read them: the shared-memory slot (if there is a region) and, for the peers that take
  // them inline, `partial`'s sums; on the first step `partial` also offers the region. `partial`
  // holds the step's other fields.
  absl::Status Publish(compute::Backend* backend, absl::Span<const compute::ConstDSpan> sums,
                       absl::Span<const int64_t> active, bool first, PartialSum* partial) {
    if (region_ != nullptr) {
      int64_t floats = 0;
      for (const int64_t n : active) floats += n;
      absl::Span<float> slot = region_->Begin(partial->step(), floats);
      if (static_cast<int64_t>(slot.size()) != floats) {
        return absl::InternalError(absl::StrCat("step ", partial->step(), "'s sums take ", floats,
                                                " floats, the region's slots ", slot.size()));
      }
      for (size_t s = 0; s < sums.size(); ++s) {
        RETURN_IF_ERROR(
            backend->CopyToHost(sums[s].sub(0, active[s]), slot.subspan(0, active[s])));
        slot.remove_prefix(active[s]);
      }
      if (first) {
        partial->set_shm_name(region_->name());
        partial->set_shm_offset(region_->SlotOffset(partial->step()));
      }
    }
    bool inline_needed = false;
    for (int r = 0; r < task_.spares_size(); ++r) {
      inline_needed |= r != task_.rank() && !by_reference_[r];
    }
    if (inline_needed) RETURN_IF_ERROR(PackSums(backend, sums, active, partial->mutable_sums()));
    return absl::OkStatus();
  }

  // Sends this spare's partial sum of a step (as Publish left it) to every other spare of the
  // task: a reference to the peers that mapped the region, the sums inline to the others.
  absl::Status SendToOthers(const PartialSum& partial, bool first) {
    const absl::Time deadline = absl::Now() + Bound(first);
    PartialSum reference;  // the step's fields and where its sums are, without them
    reference.set_task_id(partial.task_id());
    reference.set_step(partial.step());
    reference.set_rank(partial.rank());
    reference.set_first_micro_batch(partial.first_micro_batch());
    reference.set_micro_batch_count(partial.micro_batch_count());
    reference.set_sender_incarnation(partial.sender_incarnation());
    if (region_ != nullptr) {
      reference.set_shm_name(region_->name());
      reference.set_shm_offset(region_->SlotOffset(partial.step()));
    }
    for (int r = 0; r < task_.spares_size(); ++r) {
      if (r == task_.rank()) continue;
      const PartialSum& message = by_reference_[r] ? reference : partial;
      if (!message.has_sums() && !message.has_shm_name()) {
        return absl::InternalError("the step's sums were not packed for an inline peer");
      }
      PartialSumAck ack;
      absl::Status sent = SendToPeer("send the partial sum", deadline, stop_, channels_[r].get(),
                                     [&](grpc::ClientContext* context) {
                                       return stubs_[r]->SendPartialSum(context, message, &ack);
                                     });
      if (!sent.ok()) return Name(r, sent);
      if (first && ack.shm_mapped() && partial.has_shm_name()) {
        by_reference_[r] = true;
        LOG(INFO) << "replay task " << task_.task_id() << ": partial sums to spare " << r
                  << " go through shared memory " << partial.shm_name();
      }
    }
    // Every peer has answered the offer; those that mapped the region keep it.
    if (first && region_ != nullptr) region_->Unlink();
    return absl::OkStatus();
  }

  // Per stage, the active[s] floats of a reference-only `partial`, read from the sender's region,
  // which this spare mapped when the sender offered it.
  absl::StatusOr<std::vector<absl::Span<const float>>> RegionSums(
      const PartialSum& partial, absl::Span<const int64_t> active) {
    const int r = partial.rank();
    std::shared_ptr<const SharedSumsReader> region = mailbox_->Region(r);
    if (region == nullptr || region->name() != partial.shm_name()) {
      return Name(r, absl::FailedPreconditionError(
                         "sent a shared-memory reference to a region this spare has not mapped"));
    }
    int64_t floats = 0;
    for (const int64_t n : active) floats += n;
    ASSIGN_OR_RETURN(absl::Span<const float> all, region->Read(partial.shm_offset(),
                                                               task_.task_id(), partial.step(),
                                                               r, floats));
    regions_in_use_[r] = region;  // the mapping outlives the mailbox's next Open or Close
    std::vector<absl::Span<const float>> out;
    for (const int64_t n : active) {
      out.push_back(all.subspan(0, n));
      all.remove_prefix(n);
    }
    return out;
  }

  // Every other spare's partial sum of step t, in rank order (this spare's rank skipped).
  absl::StatusOr<std::vector<PartialSum>> GatherOthers(int64_t t, bool first) {
    std::vector<PartialSum> partials;
    for (int r = 0; r < task_.spares_size(); ++r) {
      if (r == task_.rank()) continue;
      absl::StatusOr<PartialSum> partial = Await<PartialSum>(
          r, Bound(first), [&](absl::Duration d) { return mailbox_->TakePartial(t, r, d); });
      if (!partial.ok()) return Name(r, partial.status());
      partials.push_back(*std::move(partial));
    }
    return partials;
  }

 private:
  // `status` with the spare it concerns named.
  absl::Status Name(int r, const absl::Status& status) const {
    return absl::Status(status.code(),
                        absl::StrCat("spare ", r, " (incarnation ", task_.spares(r).incarnation(),
                                     ", ", task_.spares(r).peer_address(),
                                     "): ", status.message()));
  }

  const WorkerConfig& config_;
  const RecoveryTask& task_;
  ReplayMailbox* const mailbox_;
  const absl::Notification& stop_;
  static constexpr absl::Duration kProbePeriod = absl::Milliseconds(100);

  std::vector<std::shared_ptr<grpc::Channel>> channels_;  // by rank; null where not needed
  std::vector<std::unique_ptr<WorkerPeer::Stub>> stubs_;
  std::unique_ptr<SharedSumsWriter> region_;  // null: inline to everyone
  std::vector<bool> by_reference_;             // by rank: the peer reads our region
  std::map<int, std::shared_ptr<const SharedSumsReader>> regions_in_use_;
};

// Rebuilds the task's slot: its snapshot, then every logged step, alone (k = 1) or as spare
// task.rank() of k (see replay.h); every step's checksum is compared with the log.
absl::StatusOr<std::unique_ptr<SlotCompute>> Replay(const WorkerConfig& config,
                                                    const JobConfig& job, const RecoveryTask& task,
                                                    uint64_t incarnation,
                                                    ParameterServer::Stub* stub,
                                                    ReplayMailbox* mailbox,
                                                    const absl::Notification& stop,
                                                    FashionMnist* preloaded,
                                                    ReportRecoveryRequest* report) {
  const absl::Time started = absl::Now();
  const SlotId& slot = task.slot();
  const int k = std::max(1, task.spares_size());
  const int rank = task.rank();
  const int micro_batches = job.data().micro_batches();
  ASSIGN_OR_RETURN(std::vector<compute::TreeNode> blocks,
                   compute::TreeAlignedBlocks(micro_batches, k));
  if (rank < 0 || rank >= static_cast<int>(blocks.size()) ||
      blocks[rank].begin != task.first_micro_batch() ||
      blocks[rank].size() != task.micro_batch_count()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replay task ", task.task_id(), ": rank ", rank, " of ", k, " with micro-batches [",
        task.first_micro_batch(), ", +", task.micro_batch_count(),
        ") is not a tree-aligned block of ", micro_batches));
  }
  // A stage in a recovery group of several is replayed with the whole group (DESIGN §5.2).
  const bool grouped = task.group_snapshots_size() > 0;
  const int first = grouped ? task.group_first_stage() : slot.stage();
  const int end = grouped ? first + task.group_snapshots_size() : slot.stage() + 1;
  const int lost = slot.stage() - first;  // the lost stage's index in the replayed segment
  if (first < 0 || lost < 0 || end <= slot.stage() || end > job.topology().stages()) {
    return absl::InvalidArgumentError(absl::StrCat("replay task ", task.task_id(),
                                                   ": a recovery group [", first, ", ", end,
                                                   ") without slot ", SlotName(slot)));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<SlotCompute> compute,
                   SlotCompute::Create(config, job, slot, preloaded, first, end));
  if (grouped) {
    for (int i = 0; i < task.group_snapshots_size(); ++i) {
      if (task.group_snapshots(i).step() != task.snapshot().step()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "replay task ", task.task_id(), ": the group's snapshots are of steps ",
            task.group_snapshots(i).step(), " and ", task.snapshot().step()));
      }
      RETURN_IF_ERROR(LoadSnapshot(task.group_snapshots(i), compute.get(), i));
    }
  } else {
    RETURN_IF_ERROR(LoadSnapshot(task.snapshot(), compute.get()));
  }
  const int64_t t0 = task.snapshot().step();
  ASSIGN_OR_RETURN(std::vector<LoggedStep> steps,
                   ReadSteps(config, task, incarnation, job, first, end, stub));
  const absl::Time transferred = absl::Now();

  compute::LocalTrainer& trainer = *compute->trainer;
  compute::Backend* backend = compute->backend.get();
  const int num_stages = trainer.num_stages();
  const compute::TreeNode root{0, micro_batches};
  const compute::TreeNode mine = blocks[rank];
  // k >= 2: every spare combines the k blocks of each step itself (an all-gather: one exchange
  // per step, not a gather to the leader and a broadcast back).
  std::vector<std::unique_ptr<compute::TreeAccumulator>> accumulators;
  std::vector<float> scratch;
  std::unique_ptr<Exchange> exchange;
  if (k > 1) {
    int64_t max_floats = 0;
    for (int s = 0; s < num_stages; ++s) max_floats += trainer.stage(s).layout().sums_size();
    exchange = std::make_unique<Exchange>(config, task, mailbox, stop, max_floats);
    for (int s = 0; s < num_stages; ++s) {
      ASSIGN_OR_RETURN(auto acc, compute::TreeAccumulator::Create(
                                     backend, trainer.stage(s).layout().sums_size()));
      accumulators.push_back(std::move(acc));
    }
  }

  int64_t replayed = 0;
  std::vector<int64_t> active(num_stages);
  bool batch_ready = false;  // the host batch of the next step is assembled (prefetched)
  for (size_t i = 0; i < steps.size(); ++i) {
    const LoggedStep& logged = steps[i];
    const int64_t t = t0 + 1 + replayed;
    const bool first = replayed == 0;
    ScopedLatency timed(Metrics().replay_step_seconds);
    if (stop.HasBeenNotified()) return absl::CancelledError("stopped");
    // k = 1: the whole batch; k >= 2: only this spare's block of it.
    const size_t rows_per_mb = logged.ids.size() / static_cast<size_t>(micro_batches);
    auto block_ids = [&](const LoggedStep& step) {
      return absl::MakeConstSpan(step.ids).subspan(mine.begin * rows_per_mb,
                                                   mine.size() * rows_per_mb);
    };
    // A pipeline stage past the first takes no images (its input is the logged forward pair).
    const bool images = trainer.starts_at_input();
    if (k == 1) {
      RETURN_IF_ERROR(compute->LoadBatch(logged.ids, {}));
      RETURN_IF_ERROR(trainer.LoadBatch(
          images ? absl::Span<const float>(compute->images) : absl::Span<const float>(),
          compute->labels));
    } else {
      if (!batch_ready) RETURN_IF_ERROR(compute->LoadRows(block_ids(logged)));
      const size_t n = mine.size() * rows_per_mb;
      const size_t features = compute->images.size() / compute->labels.size();
      RETURN_IF_ERROR(trainer.LoadBlock(
          mine,
          images ? absl::MakeConstSpan(compute->images).subspan(0, n * features)
                 : absl::Span<const float>(),
          absl::MakeConstSpan(compute->labels).subspan(0, n)));
    }
    const compute::TreeNode computed = k == 1 ? root : mine;
    for (int mb = computed.begin; mb < computed.end; ++mb) {
      if (!logged.forward.empty()) RETURN_IF_ERROR(trainer.SetForwardInput(mb, logged.forward[mb]));
      if (!logged.backward.empty()) {
        RETURN_IF_ERROR(trainer.SetBackwardInput(mb, logged.backward[mb]));
      }
    }
    batch_ready = false;
    for (int s = 0; s < num_stages; ++s) active[s] = trainer.ActiveSumsLength(s, t);
    ASSIGN_OR_RETURN(std::vector<compute::ConstDSpan> sums,
                     trainer.ComputeBlock(t, k == 1 ? root : mine));
    if (k > 1) {
      PartialSum message;
      message.set_task_id(task.task_id());
      message.set_step(t);
      message.set_rank(rank);
      message.set_first_micro_batch(mine.begin);
      message.set_micro_batch_count(mine.size());
      message.set_sender_incarnation(incarnation);
      RETURN_IF_ERROR(exchange->Publish(backend, sums, active, first, &message));
      // The sends run on their own thread while this one assembles the next step's batch (the
      // device copy of this one is taken, so the host buffers are free) and waits for the others'
      // sums.
      absl::Status sent;
      std::thread sender([&] { sent = exchange->SendToOthers(message, first); });
      absl::Status prefetched = absl::OkStatus();
      if (i + 1 < steps.size()) {
        prefetched = compute->LoadRows(block_ids(steps[i + 1]));
        batch_ready = prefetched.ok();
      }
      absl::StatusOr<std::vector<PartialSum>> gathered = exchange->GatherOthers(t, first);
      sender.join();
      RETURN_IF_ERROR(sent);
      RETURN_IF_ERROR(prefetched);
      ASSIGN_OR_RETURN(std::vector<PartialSum> partials, std::move(gathered));
      for (int s = 0; s < num_stages; ++s) {
        RETURN_IF_ERROR(accumulators[s]->Start(micro_batches, root, active[s]));
        RETURN_IF_ERROR(accumulators[s]->CommitCopy(mine, sums[s]));
      }
      for (const PartialSum& partial : partials) {
        const int r = partial.rank();
        if (r < 0 || r >= k || r == rank || partial.first_micro_batch() != blocks[r].begin ||
            partial.micro_batch_count() != blocks[r].size()) {
          return absl::InvalidArgumentError(
              absl::StrCat("a spare sent rank ", r, " with the sums of micro-batches [",
                           partial.first_micro_batch(), ", +", partial.micro_batch_count(),
                           "), not that rank's block"));
        }
        if (partial.has_sums()) {
          RETURN_IF_ERROR(
              CheckSums(partial.sums(), active, absl::StrCat("spare ", r, "'s sums")));
          for (int s = 0; s < num_stages; ++s) {
            ASSIGN_OR_RETURN(compute::DSpan buffer, accumulators[s]->BufferFor(blocks[r]));
            RETURN_IF_ERROR(UnpackSums(backend, partial.sums().tensors(s), &scratch, buffer));
            RETURN_IF_ERROR(accumulators[s]->Commit(blocks[r]));
          }
        } else {
          ASSIGN_OR_RETURN(std::vector<absl::Span<const float>> shared,
                           exchange->RegionSums(partial, active));
          for (int s = 0; s < num_stages; ++s) {
            ASSIGN_OR_RETURN(compute::DSpan buffer, accumulators[s]->BufferFor(blocks[r]));
            RETURN_IF_ERROR(backend->CopyToDevice(shared[s], buffer.sub(0, active[s])));
            RETURN_IF_ERROR(accumulators[s]->Commit(blocks[r]));
          }
        }
      }
      sums.clear();
      for (int s = 0; s < num_stages; ++s) {
        ASSIGN_OR_RETURN(compute::ConstDSpan total, accumulators[s]->Result());
        sums.push_back(total);
      }
    }
    RETURN_IF_ERROR(trainer.Apply(t, sums));
    Metrics().replayed_steps->Increment();
    ASSIGN_OR_RETURN(const uint64_t checksum, trainer.stage(lost).ParamsChecksum());
    report->set_final_checksum(checksum);
    if (checksum != logged.checksum) {
      report->set_outcome(CHECKSUM_MISMATCH);
      report->set_steps_replayed(replayed);
      report->set_detail(absl::StrFormat(
          "step %d: replayed parameters hash to %016x, the log says %016x", t, checksum,
          logged.checksum));
      return absl::DataLossError(report->detail());
    }
    ++replayed;
  }
  if (grouped) {
    // The lost stage alone goes on as the slot's trainer; the group's other members are alive.
    const compute::StageLayout& layout = trainer.stage(lost).layout();
    std::vector<float> params(layout.packed_size()), m(layout.packed_size()),
        v(layout.packed_size()), d(layout.packed_size());
    RETURN_IF_ERROR(trainer.stage(lost).GetParams(absl::MakeSpan(params)));
    RETURN_IF_ERROR(trainer.optimizer(lost).GetState(absl::MakeSpan(m), absl::MakeSpan(v),
                                                     absl::MakeSpan(d)));
    FashionMnist data = std::move(compute->data);
    accumulators.clear();  // they hold buffers of the group's backend, which goes now
    ASSIGN_OR_RETURN(compute, SlotCompute::Create(config, job, slot, &data));
    RETURN_IF_ERROR(compute->trainer->stage(0).SetParams(params));
    RETURN_IF_ERROR(compute->trainer->optimizer(0).SetState(m, v, d));
    report->set_detail(absl::StrCat("replayed with its recovery group, stages [", first, ", ",
                                    end, ")"));
  }
  RETURN_IF_ERROR(compute->SeekAfter(task.failed_step()));
  report->set_outcome(RECOVERED);
  report->set_steps_replayed(replayed);
  // Verified bit-identical: every replayed step matched its logged checksum. A GLOBAL_CHECKPOINT
  // restore replays nothing and claims nothing.
  report->set_verified(task.policy() == REPLAY);
  report->mutable_phases()->set_snapshot_transfer_ms(
      absl::ToInt64Milliseconds(transferred - started));
  report->mutable_phases()->set_replay_ms(absl::ToInt64Milliseconds(absl::Now() - transferred));
  if (task.policy() != REPLAY) {
    LOG(WARNING) << "restored slot (" << slot.replica() << ", " << slot.stage()
                 << ") from the global checkpoint of step " << t0;
    return compute;
  }
  LOG(WARNING) << "replayed slot (" << slot.replica() << ", " << slot.stage() << ") steps "
               << t0 + 1 << ".." << task.failed_step() << " as spare " << rank + 1 << " of " << k
               << " (micro-batches [" << mine.begin << ", " << mine.end << ") of "
               << micro_batches << "): " << replayed
               << " steps, every checksum equal to the log";
  return compute;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SlotCompute>> RunSpare(const WorkerConfig& config,
                                                      const Registration& registration,
                                                      const std::shared_ptr<grpc::Channel>& channel,
                                                      WorkerAgent* agent, ReplayMailbox* mailbox,
                                                      const absl::Notification& stop) {
  auto stub = ParameterServer::NewStub(channel);
  // Load the data set now, not when a trainer has died: it is on the recovery's critical path.
  ASSIGN_OR_RETURN(FashionMnist data, LoadDataSet(registration.job.data()));
  bool data_loaded = true;
  // A role that ends here leaves the data set to the next one.
  struct StashOnExit {
    const DataConfig& config;
    FashionMnist& data;
    bool& loaded;
    ~StashOnExit() {
      if (loaded) StashDataSet(config, std::move(data));
    }
  } stash_on_exit{registration.job.data(), data, data_loaded};
  while (!stop.HasBeenNotified()) {
    if (agent->registration().incarnation != registration.incarnation) {
      return absl::NotFoundError("the registration changed");
    }
    WaitForTaskRequest request;
    request.set_incarnation(registration.incarnation);
    request.set_wait_ms(1000);
    WaitForTaskResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(config.rpc_deadline_ms() + 1000));
    const absl::Status status = FromGrpcStatus(stub->WaitForTask(&context, request, &response));
    if (!status.ok()) {
      if (status.code() == absl::StatusCode::kFailedPrecondition ||
          status.code() == absl::StatusCode::kAborted) {
        // Fenced, replaced by a takeover, or unknown: the agent's registration tells what next.
        if (!agent->WaitForNewRegistration(registration.incarnation, absl::Seconds(2))) {
          return status;
        }
        return absl::NotFoundError("the registration changed");
      }
      stop.WaitForNotificationWithTimeout(absl::Milliseconds(config.backoff_max_ms()));
      continue;
    }
    if (!response.has_task()) continue;
    const RecoveryTask& task = response.task();
    const bool leader = task.rank() == 0;
    LOG(WARNING) << "replay task " << task.task_id() << ": rebuilding slot ("
                 << task.slot().replica() << ", " << task.slot().stage() << ") from step "
                 << task.snapshot().step() << " to " << task.failed_step() << " as spare "
                 << task.rank() + 1 << " of " << task.spares_size();
    ReportRecoveryRequest report;
    report.set_incarnation(registration.incarnation);
    report.set_task_id(task.task_id());
    if (!data_loaded) {
      ASSIGN_OR_RETURN(data, LoadDataSet(registration.job.data()));
      data_loaded = true;
    }
    data_loaded = false;  // moved into the replay's state
    Metrics().recoveries->Increment();
    mailbox->Open(task.task_id());
    auto rebuilt = Replay(config, registration.job, task, registration.incarnation, stub.get(),
                          mailbox, stop, &data, &report);
    mailbox->Close();
    if (!rebuilt.ok()) {
      if (report.outcome() != CHECKSUM_MISMATCH) {
        report.set_outcome(ABANDONED);
        report.set_detail(std::string(rebuilt.status().message()));
      }
      LOG(ERROR) << "replay task " << task.task_id() << " failed: " << rebuilt.status();
    }
    if (!leader) {
      // A helper's part ends here; the leader reports the task. Back to the pool.
      if (rebuilt.ok()) {
        data = std::move((*rebuilt)->data);
        data_loaded = true;
      }
      continue;
    }
    const absl::Time reporting = absl::Now();
    ReportRecoveryResponse granted;
    absl::Status reported = CallWithRetry(config, stop, "report recovery",
                                          [&](grpc::ClientContext* context) {
                                            granted.Clear();
                                            return stub->ReportRecovery(context, report, &granted);
                                          });
    if (!reported.ok() && reported.code() != absl::StatusCode::kFailedPrecondition) {
      return reported;
    }
    if (!reported.ok()) {
      // The task is over without us (a rollback, or our report came too late); whether this
      // spare is still in the job, the next WaitForTask tells.
      LOG(WARNING) << "replay task " << task.task_id() << ": report refused: " << reported;
    }
    if (!reported.ok() || !rebuilt.ok() || granted.incarnation() == 0) {
      if (rebuilt.ok()) {
        data = std::move((*rebuilt)->data);
        data_loaded = true;
      }
      continue;
    }
    RegisterResponse adopted;
    adopted.set_incarnation(granted.incarnation());
    adopted.set_role(TRAINER);
    *adopted.mutable_slot() = granted.slot();
    adopted.set_start_step(task.failed_step());
    *adopted.mutable_neighbours() = granted.neighbours();
    agent->Adopt(adopted);
    LOG(WARNING) << "took over slot (" << granted.slot().replica() << ", "
                 << granted.slot().stage() << ") as incarnation " << granted.incarnation()
                 << " at step " << task.failed_step() << " ("
                 << absl::ToInt64Milliseconds(absl::Now() - reporting) << " ms)";
    return rebuilt;
  }
  return absl::CancelledError("stopped");
}

}  // namespace rebound::worker
