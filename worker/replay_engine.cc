#include "worker/replay_engine.h"

#include <glog/logging.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/grpc_status.h"
#include "common/slot.h"
#include "common/status_macros.h"
#include "compute/reduction_tree.h"
#include "compute/tensor_bundle.h"
#include "worker/partial_sum_exchange.h"
#include "worker/pipeline.h"
#include "worker/worker_metrics.h"

namespace rebound::worker {
namespace {

// The logged inputs of one step: its batch's sample ids (micro-batches in order), the checksum
// of the parameters after it (and each tensor's, when the trainer logged them: a job with
// audits) and, for a pipeline stage, the boundary pairs it received per micro-batch (forward
// from stage s-1, backward from stage s+1; compute/mlp.h layout).
struct LoggedStep {
  std::vector<int64_t> ids;
  uint64_t checksum = 0;
  std::vector<uint64_t> tensor_checksums;  // id order; empty when not logged
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
        step.tensor_checksums.assign(r.tensor_checksums().begin(), r.tensor_checksums().end());
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

// The rows of one micro-batch of a logged step.
template <typename Task>
size_t RowsPerMicroBatch(const Task& r, const LoggedStep& step) {
  return step.ids.size() / static_cast<size_t>(r.micro_batches);
}

// The sample ids of this spare's block of a logged step.
template <typename Task>
absl::Span<const int64_t> BlockIds(const Task& r, const LoggedStep& step) {
  const size_t rows = RowsPerMicroBatch(r, step);
  return absl::MakeConstSpan(step.ids).subspan(r.mine.begin * rows, r.mine.size() * rows);
}

// The first tensor (index in id order, name) whose replayed checksum differs from the one
// `logged` holds; {-1, ""} when the log holds none (a job without audits), they do not fit the
// stage's tensors, or they cannot be computed (a mismatch is reported without the tensor then).
std::pair<int, std::string> FirstDifferingTensor(const compute::MlpStage& stage,
                                                 const LoggedStep& logged) {
  const std::vector<compute::TensorInfo>& tensors = stage.layout().tensors();
  if (logged.tensor_checksums.empty() || logged.tensor_checksums.size() != tensors.size()) {
    return {-1, ""};
  }
  absl::StatusOr<std::vector<uint64_t>> replayed = stage.TensorChecksums();
  if (!replayed.ok()) {
    LOG(WARNING) << "the replayed tensors' checksums: " << replayed.status();
    return {-1, ""};
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if ((*replayed)[i] != logged.tensor_checksums[i]) return {static_cast<int>(i), tensors[i].name};
  }
  return {-1, ""};
}

}  // namespace

ReplayEngine::ReplayEngine(const WorkerConfig& config, ParameterServer::Stub* stub,
                           ReplayMailbox* mailbox, const absl::Notification& stop,
                           const Clock* clock)
    : config_(config), stub_(stub), mailbox_(mailbox), stop_(stop), clock_(clock) {}

// One task's replay: what Prepare sets up and the steps share.
struct ReplayEngine::TaskReplay {
  TaskReplay(const JobConfig& job, const RecoveryTask& task, uint64_t incarnation)
      : job(job), task(task), incarnation(incarnation) {}

  const JobConfig& job;
  const RecoveryTask& task;
  const uint64_t incarnation;
  absl::Time started;
  absl::Time transferred;  // snapshot and log read
  int k = 1;               // spares of the task
  int rank = 0;
  int micro_batches = 0;
  std::vector<compute::TreeNode> blocks;  // by rank
  compute::TreeNode root;
  compute::TreeNode mine;
  // The replayed stages [first, end): the slot alone, or its recovery group (docs/design.md §5.2).
  bool grouped = false;
  int first = 0;
  int end = 0;
  int lost = 0;  // the lost stage's index in the replayed segment
  std::unique_ptr<SlotCompute> compute;
  int64_t t0 = 0;
  std::vector<LoggedStep> steps;
  // k >= 2: every spare combines the k blocks of each step itself (an all-gather: one exchange
  // per step, not a gather to the leader and a broadcast back).
  std::unique_ptr<PartialSumExchange> exchange;
  std::vector<std::unique_ptr<compute::TreeAccumulator>> accumulators;  // by stage
  std::vector<float> scratch;
  std::vector<int64_t> active;  // by stage: the step's active sums length
  bool batch_ready = false;     // the host batch of the next step is assembled (prefetched)
};

absl::StatusOr<std::unique_ptr<ReplayEngine::TaskReplay>> ReplayEngine::Prepare(
    const JobConfig& job, const RecoveryTask& task, uint64_t incarnation,
    FashionMnist* preloaded) {
  auto r = std::make_unique<TaskReplay>(job, task, incarnation);
  r->started = clock_->Now();
  const SlotId& slot = task.slot();
  r->k = std::max(1, task.spares_size());
  r->rank = task.rank();
  r->micro_batches = job.data().micro_batches();
  ASSIGN_OR_RETURN(r->blocks, compute::TreeAlignedBlocks(r->micro_batches, r->k));
  if (r->rank < 0 || r->rank >= static_cast<int>(r->blocks.size()) ||
      r->blocks[r->rank].begin != task.first_micro_batch() ||
      r->blocks[r->rank].size() != task.micro_batch_count()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "replay task ", task.task_id(), ": rank ", r->rank, " of ", r->k, " with micro-batches [",
        task.first_micro_batch(), ", +", task.micro_batch_count(),
        ") is not a tree-aligned block of ", r->micro_batches));
  }
  r->root = compute::TreeNode{0, r->micro_batches};
  r->mine = r->blocks[r->rank];
  // A stage in a recovery group of several is replayed with the whole group (docs/design.md §5.2).
  r->grouped = task.group_snapshots_size() > 0;
  r->first = r->grouped ? task.group_first_stage() : slot.stage();
  r->end = r->grouped ? r->first + task.group_snapshots_size() : slot.stage() + 1;
  r->lost = slot.stage() - r->first;
  if (r->first < 0 || r->lost < 0 || r->end <= slot.stage() ||
      r->end > job.topology().stages()) {
    return absl::InvalidArgumentError(absl::StrCat("replay task ", task.task_id(),
                                                   ": a recovery group [", r->first, ", ", r->end,
                                                   ") without slot ", SlotName(slot)));
  }
  ASSIGN_OR_RETURN(r->compute, SlotCompute::Create(config_, job, slot, std::move(*preloaded),
                                                   r->first, r->end));
  if (r->grouped) {
    for (int i = 0; i < task.group_snapshots_size(); ++i) {
      if (task.group_snapshots(i).step() != task.snapshot().step()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "replay task ", task.task_id(), ": the group's snapshots are of steps ",
            task.group_snapshots(i).step(), " and ", task.snapshot().step()));
      }
      RETURN_IF_ERROR(LoadSnapshot(task.group_snapshots(i), r->compute.get(), i));
    }
  } else {
    RETURN_IF_ERROR(LoadSnapshot(task.snapshot(), r->compute.get()));
  }
  r->t0 = task.snapshot().step();
  ASSIGN_OR_RETURN(r->steps, ReadSteps(config_, task, incarnation, job, r->first, r->end, stub_));
  r->transferred = clock_->Now();

  compute::LocalTrainer& trainer = *r->compute->trainer;
  const int num_stages = trainer.num_stages();
  r->active.resize(num_stages);
  if (r->k > 1) {
    int64_t max_floats = 0;
    for (int s = 0; s < num_stages; ++s) max_floats += trainer.stage(s).layout().sums_size();
    r->exchange = std::make_unique<PartialSumExchange>(config_, task, mailbox_, stop_, clock_,
                                                       max_floats);
    for (int s = 0; s < num_stages; ++s) {
      ASSIGN_OR_RETURN(auto acc, compute::TreeAccumulator::Create(
                                     r->compute->backend.get(),
                                     trainer.stage(s).layout().sums_size()));
      r->accumulators.push_back(std::move(acc));
    }
  }
  return r;
}

absl::Status ReplayEngine::LoadStep(TaskReplay& r, size_t i) {
  const LoggedStep& logged = r.steps[i];
  SlotCompute& compute = *r.compute;
  compute::LocalTrainer& trainer = *compute.trainer;
  // A pipeline stage past the first takes no images (its input is the logged forward pair).
  const bool images = trainer.starts_at_input();
  if (r.k == 1) {
    RETURN_IF_ERROR(compute.LoadBatch(logged.ids, {}));
    RETURN_IF_ERROR(trainer.LoadBatch(
        images ? absl::Span<const float>(compute.images) : absl::Span<const float>(),
        compute.labels));
  } else {
    // k >= 2: only this spare's block of the batch.
    if (!r.batch_ready) RETURN_IF_ERROR(compute.LoadRows(BlockIds(r, logged)));
    const size_t n = r.mine.size() * RowsPerMicroBatch(r, logged);
    const size_t features = compute.images.size() / compute.labels.size();
    RETURN_IF_ERROR(trainer.LoadBlock(
        r.mine,
        images ? absl::MakeConstSpan(compute.images).subspan(0, n * features)
               : absl::Span<const float>(),
        absl::MakeConstSpan(compute.labels).subspan(0, n)));
  }
  const compute::TreeNode computed = r.k == 1 ? r.root : r.mine;
  for (int mb = computed.begin; mb < computed.end; ++mb) {
    if (!logged.forward.empty()) RETURN_IF_ERROR(trainer.SetForwardInput(mb, logged.forward[mb]));
    if (!logged.backward.empty()) RETURN_IF_ERROR(trainer.SetBackwardInput(mb, logged.backward[mb]));
  }
  r.batch_ready = false;
  return absl::OkStatus();
}

absl::Status ReplayEngine::ExchangeSums(TaskReplay& r, size_t i, int64_t t, bool first,
                                        std::vector<compute::ConstDSpan>* sums) {
  compute::Backend* backend = r.compute->backend.get();
  const int num_stages = r.compute->trainer->num_stages();
  PartialSum message;
  message.set_task_id(r.task.task_id());
  message.set_step(t);
  message.set_rank(r.rank);
  message.set_first_micro_batch(r.mine.begin);
  message.set_micro_batch_count(r.mine.size());
  message.set_sender_incarnation(r.incarnation);
  RETURN_IF_ERROR(r.exchange->Publish(backend, *sums, r.active, first, &message));
  // The sends run on the engine's sender thread while this one assembles the next step's batch
  // (the device copy of this one is taken, so the host buffers are free) and waits for the
  // others' sums.
  sender_.Start([&] { return r.exchange->SendToOthers(message, first); });
  absl::Status prefetched = absl::OkStatus();
  if (i + 1 < r.steps.size()) {
    prefetched = r.compute->LoadRows(BlockIds(r, r.steps[i + 1]));
    r.batch_ready = prefetched.ok();
  }
  absl::StatusOr<std::vector<PartialSum>> gathered = r.exchange->GatherOthers(t, first);
  RETURN_IF_ERROR(sender_.Wait());
  RETURN_IF_ERROR(prefetched);
  ASSIGN_OR_RETURN(std::vector<PartialSum> partials, std::move(gathered));
  // This spare's block and the others', combined along the top of the reduction tree.
  for (int s = 0; s < num_stages; ++s) {
    RETURN_IF_ERROR(r.accumulators[s]->Start(r.micro_batches, r.root, r.active[s]));
    RETURN_IF_ERROR(r.accumulators[s]->CommitCopy(r.mine, (*sums)[s]));
  }
  for (const PartialSum& partial : partials) {
    const int other = partial.rank();
    if (other < 0 || other >= r.k || other == r.rank ||
        partial.first_micro_batch() != r.blocks[other].begin ||
        partial.micro_batch_count() != r.blocks[other].size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("a spare sent rank ", other, " with the sums of micro-batches [",
                       partial.first_micro_batch(), ", +", partial.micro_batch_count(),
                       "), not that rank's block"));
    }
    const compute::TreeNode block = r.blocks[other];
    if (partial.has_sums()) {
      RETURN_IF_ERROR(
          CheckSums(partial.sums(), r.active, absl::StrCat("spare ", other, "'s sums")));
      for (int s = 0; s < num_stages; ++s) {
        ASSIGN_OR_RETURN(compute::DSpan buffer, r.accumulators[s]->BufferFor(block));
        RETURN_IF_ERROR(UnpackSums(backend, partial.sums().tensors(s), &r.scratch, buffer));
        RETURN_IF_ERROR(r.accumulators[s]->Commit(block));
      }
    } else {
      ASSIGN_OR_RETURN(std::vector<absl::Span<const float>> shared,
                       r.exchange->RegionSums(partial, r.active));
      for (int s = 0; s < num_stages; ++s) {
        ASSIGN_OR_RETURN(compute::DSpan buffer, r.accumulators[s]->BufferFor(block));
        RETURN_IF_ERROR(backend->CopyToDevice(shared[s], buffer.sub(0, r.active[s])));
        RETURN_IF_ERROR(r.accumulators[s]->Commit(block));
      }
    }
  }
  sums->clear();
  for (int s = 0; s < num_stages; ++s) {
    ASSIGN_OR_RETURN(compute::ConstDSpan total, r.accumulators[s]->Result());
    sums->push_back(total);
  }
  return absl::OkStatus();
}

absl::Status ReplayEngine::ReplayStep(TaskReplay& r, size_t i, int64_t replayed,
                                      ReportRecoveryRequest* report) {
  const LoggedStep& logged = r.steps[i];
  const int64_t t = r.t0 + 1 + replayed;
  const bool first = replayed == 0;
  compute::LocalTrainer& trainer = *r.compute->trainer;
  RETURN_IF_ERROR(LoadStep(r, i));
  for (int s = 0; s < trainer.num_stages(); ++s) r.active[s] = trainer.ActiveSumsLength(s, t);
  ASSIGN_OR_RETURN(std::vector<compute::ConstDSpan> sums,
                   trainer.ComputeBlock(t, r.k == 1 ? r.root : r.mine));
  if (r.k > 1) RETURN_IF_ERROR(ExchangeSums(r, i, t, first, &sums));
  RETURN_IF_ERROR(trainer.Apply(t, sums));
  Metrics().replayed_steps->Increment();
  ASSIGN_OR_RETURN(const uint64_t checksum, trainer.stage(r.lost).ParamsChecksum());
  report->set_final_checksum(checksum);
  if (checksum != logged.checksum) {
    report->set_outcome(CHECKSUM_MISMATCH);
    report->set_steps_replayed(replayed);
    ReplayMismatch* mismatch = report->mutable_mismatch();
    mismatch->set_step(t);
    mismatch->set_logged_checksum(logged.checksum);
    mismatch->set_replayed_checksum(checksum);
    mismatch->set_tensor_index(-1);
    std::string detail = absl::StrFormat(
        "step %d: replayed parameters hash to %016x, the log says %016x", t, checksum,
        logged.checksum);
    const auto [index, name] = FirstDifferingTensor(trainer.stage(r.lost), logged);
    if (index >= 0) {
      mismatch->set_tensor_index(index);
      mismatch->set_tensor_name(name);
      absl::StrAppend(&detail, "; the first tensor that differs is ", index, " (", name, ")");
    }
    report->set_detail(detail);
    return absl::DataLossError(report->detail());
  }
  return absl::OkStatus();
}

absl::Status ReplayEngine::KeepLostStage(TaskReplay& r, ReportRecoveryRequest* report) {
  // The lost stage alone goes on as the slot's trainer; the group's other members are alive.
  compute::LocalTrainer& trainer = *r.compute->trainer;
  const compute::StageLayout& layout = trainer.stage(r.lost).layout();
  std::vector<float> params(layout.packed_size()), m(layout.packed_size()),
      v(layout.packed_size()), d(layout.packed_size());
  RETURN_IF_ERROR(trainer.stage(r.lost).GetParams(absl::MakeSpan(params)));
  RETURN_IF_ERROR(trainer.optimizer(r.lost).GetState(absl::MakeSpan(m), absl::MakeSpan(v),
                                                     absl::MakeSpan(d)));
  FashionMnist data = std::move(r.compute->data);
  r.accumulators.clear();  // they hold buffers of the group's backend, which goes now
  ASSIGN_OR_RETURN(r.compute,
                   SlotCompute::Create(config_, r.job, r.task.slot(), std::move(data)));
  RETURN_IF_ERROR(r.compute->trainer->stage(0).SetParams(params));
  RETURN_IF_ERROR(r.compute->trainer->optimizer(0).SetState(m, v, d));
  report->set_detail(absl::StrCat("replayed with its recovery group, stages [", r.first, ", ",
                                  r.end, ")"));
  return absl::OkStatus();
}

absl::Status ReplayEngine::ReplaySteps(TaskReplay& r, const ReplayControl& control,
                                       ReportRecoveryRequest* report, int64_t* replayed) {
  for (size_t i = 0; i < r.steps.size(); ++i) {
    ScopedLatency timed(Metrics().replay_step_seconds);
    if (stop_.HasBeenNotified()) return absl::CancelledError("stopped");
    if (control.preempted && control.preempted()) {
      return absl::CancelledError(absl::StrCat("preempted after ", *replayed, " of ",
                                               r.steps.size(), " steps"));
    }
    RETURN_IF_ERROR(ReplayStep(r, i, *replayed, report));
    ++*replayed;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SlotCompute>> ReplayEngine::Replay(const JobConfig& job,
                                                                  const RecoveryTask& task,
                                                                  uint64_t incarnation,
                                                                  FashionMnist* preloaded,
                                                                  ReportRecoveryRequest* report,
                                                                  const ReplayControl& control) {
  ASSIGN_OR_RETURN(std::unique_ptr<TaskReplay> r, Prepare(job, task, incarnation, preloaded));
  int64_t replayed = 0;
  if (absl::Status steps = ReplaySteps(*r, control, report, &replayed); !steps.ok()) {
    // The data set goes back to the caller: a preempted audit's spare is wanted for a recovery
    // at once, and loading the set again would be on that recovery's critical path.
    *preloaded = std::move(r->compute->data);
    if (control.data_returned != nullptr) *control.data_returned = true;
    return steps;
  }
  if (r->grouped) RETURN_IF_ERROR(KeepLostStage(*r, report));
  RETURN_IF_ERROR(r->compute->SeekAfter(task.failed_step()));
  report->set_outcome(RECOVERED);
  report->set_steps_replayed(replayed);
  // Verified bit-identical: every replayed step matched its logged checksum. A GLOBAL_CHECKPOINT
  // restore replays nothing and claims nothing.
  report->set_verified(task.policy() == REPLAY);
  report->mutable_phases()->set_snapshot_transfer_ms(
      absl::ToInt64Milliseconds(r->transferred - r->started));
  report->mutable_phases()->set_replay_ms(
      absl::ToInt64Milliseconds(clock_->Now() - r->transferred));
  const SlotId& slot = task.slot();
  if (task.policy() != REPLAY) {
    LOG(WARNING) << "restored slot " << SlotName(slot) << " from the global checkpoint of step "
                 << r->t0;
    return std::move(r->compute);
  }
  if (task.audit()) {
    LOG(INFO) << "audit " << task.task_id() << ": replayed slot " << SlotName(slot) << " steps "
              << r->t0 + 1 << ".." << task.failed_step() << ": " << replayed
              << " steps, every checksum equal to the log";
    return std::move(r->compute);
  }
  LOG(WARNING) << "replayed slot " << SlotName(slot) << " steps " << r->t0 + 1 << ".."
               << task.failed_step() << " as spare " << r->rank + 1 << " of " << r->k
               << " (micro-batches [" << r->mine.begin << ", " << r->mine.end << ") of "
               << r->micro_batches << "): " << replayed
               << " steps, every checksum equal to the log";
  return std::move(r->compute);
}

}  // namespace rebound::worker
