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

}  // namespace

ReplayEngine::ReplayEngine(const WorkerConfig& config, ParameterServer::Stub* stub,
                           ReplayMailbox* mailbox, const absl::Notification& stop,
                           const Clock* clock)
    : config_(config), stub_(stub), mailbox_(mailbox), stop_(stop), clock_(clock) {}

absl::StatusOr<std::unique_ptr<SlotCompute>> ReplayEngine::Replay(const JobConfig& job,
                                                                  const RecoveryTask& task,
                                                                  uint64_t incarnation,
                                                                  FashionMnist* preloaded,
                                                                  ReportRecoveryRequest* report) {
  const absl::Time started = clock_->Now();
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
                   SlotCompute::Create(config_, job, slot, std::move(*preloaded), first, end));
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
                   ReadSteps(config_, task, incarnation, job, first, end, stub_));
  const absl::Time transferred = clock_->Now();

  compute::LocalTrainer& trainer = *compute->trainer;
  compute::Backend* backend = compute->backend.get();
  const int num_stages = trainer.num_stages();
  const compute::TreeNode root{0, micro_batches};
  const compute::TreeNode mine = blocks[rank];
  // k >= 2: every spare combines the k blocks of each step itself (an all-gather: one exchange
  // per step, not a gather to the leader and a broadcast back).
  std::vector<std::unique_ptr<compute::TreeAccumulator>> accumulators;
  std::vector<float> scratch;
  std::unique_ptr<PartialSumExchange> exchange;
  if (k > 1) {
    int64_t max_floats = 0;
    for (int s = 0; s < num_stages; ++s) max_floats += trainer.stage(s).layout().sums_size();
    exchange = std::make_unique<PartialSumExchange>(config_, task, mailbox_, stop_, clock_, max_floats);
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
    if (stop_.HasBeenNotified()) return absl::CancelledError("stopped");
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
      // The sends run on the engine's sender thread while this one assembles the next step's
      // batch (the device copy of this one is taken, so the host buffers are free) and waits for
      // the others' sums.
      sender_.Start([&] { return exchange->SendToOthers(message, first); });
      absl::Status prefetched = absl::OkStatus();
      if (i + 1 < steps.size()) {
        prefetched = compute->LoadRows(block_ids(steps[i + 1]));
        batch_ready = prefetched.ok();
      }
      absl::StatusOr<std::vector<PartialSum>> gathered = exchange->GatherOthers(t, first);
      RETURN_IF_ERROR(sender_.Wait());
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
    ASSIGN_OR_RETURN(compute, SlotCompute::Create(config_, job, slot, std::move(data)));
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
  report->mutable_phases()->set_replay_ms(absl::ToInt64Milliseconds(clock_->Now() - transferred));
  if (task.policy() != REPLAY) {
    LOG(WARNING) << "restored slot " << SlotName(slot) << " from the global checkpoint of step "
                 << t0;
    return compute;
  }
  LOG(WARNING) << "replayed slot " << SlotName(slot) << " steps "
               << t0 + 1 << ".." << task.failed_step() << " as spare " << rank + 1 << " of " << k
               << " (micro-batches [" << mine.begin << ", " << mine.end << ") of "
               << micro_batches << "): " << replayed
               << " steps, every checksum equal to the log";
  return compute;
}

}  // namespace rebound::worker
