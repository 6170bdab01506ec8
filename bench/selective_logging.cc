// Selective logging benchmark (docs/design.md §5.2, docs/selective_logging.md): log storage against
// recovery time for every choice of logged stage boundaries, and the choice that
// `reboundctl plan-logging` makes from measured per-stage step times.
//
// The model is an MLP 784-512-512-256-256-10 (relu, softmax cross-entropy) split into S = 4
// stages at layers 1, 2, 3 (stage 3 holds the last two layers), batch 64 in M = 4 micro-batches
// of 16, tau = --tau, the CPU backend with one OpenBLAS thread (compute.threads 1). Inputs are
// random pixels in [0, 1) and random labels: the work of a step does not depend on the values.
// Everything runs in this one process, on the real kernels (compute/mlp.h, compute/step.h):
//
//   1. One pipelined step of the whole model captures, per micro-batch, the forward pair
//      [h; R{h}] entering every stage b >= 1 and the backward pair [R{e}; e] that stage b sends
//      back to stage b-1: what a sender ships across boundary b, and what a replay reads from
//      the log.
//   2. Log bytes of boundary b per step: for each micro-batch, the serialized size of the
//      LogRecord the sender of each pair would append (rebound.proto): a FORWARD record for slot
//      (0, b) carrying (h, R{h}) and a BACKWARD record for slot (0, b-1) carrying (e, R{e}), both
//      FLOAT32 Tensors of 16 x width and the micro-batch's 16 sample ids. Stored bytes = x tau.
//   3. Replay of a recovery group [a, b) (stages a..b-1): steps of its stages chained in memory,
//      each step M micro-batches of forward and backward with the R-op (the first stage reads
//      the stored forward pair of boundary a, or the images; the last the stored backward pair
//      of boundary b, or the labels), the fixed-tree reduction of the sums (reduction_tree.h),
//      the Hutchinson draw and the AdaHessian apply of every stage. The per-stage step time is
//      the replay of the one-stage group [s, s+1): median over --reps of --stage_steps steps.
//      The recovery time of a group is its replay of tau/2 steps (the expected number of steps
//      since the last snapshot), median over --reps; each of the S(S+1)/2 possible groups is
//      timed on its own, and its time serves every choice that has the group.
//   4. For each of the 2^(S-1) choices of logged boundaries: bytes per step, stored bytes, and
//      the recovery time of a failure, whose stage is uniform over 0..S-1: the mean over s of
//      the replay time of the group containing s, and the worst case.
//   5. PlanLogging (common/logging_plan.h) with the measured stage times and boundary bytes
//      and a budget of --budget_bytes (default: half of the all-logged stored bytes), and the
//      plan's bytes and recovery time against the all-logged choice (the baseline: what the
//      system logs by default) and the none-logged one; beside it, what the same rule picks
//      with stage times from multiply-adds, and the best choice within the budget.
//
// Not measured: fetching the snapshot and the log, and the per-step sample-id and checksum
// records that every slot logs whatever the choice.
//
// Timings run round-robin over the stages (then over the groups), --reps times, each timed replay
// after --warmup untimed steps of the same group, so that load drift hits all of them alike.
//
// Flags: --reps=N (15) repetitions of every timing, --warmup=N (1) untimed steps before each,
// --stage_steps=N (8) steps per per-stage timing, --tau=N (8, even), --budget_bytes=N.
// Last line:
//   RESULT selective_logging: all_logged_bytes_per_step=<bytes> all_logged_recovery_ms=<ms>
//     none_logged_recovery_ms=<ms> plan=[<boundaries>] plan_bytes_ratio=<plan/all>
//     plan_recovery_ratio=<plan/all>
// (one line). Exit code 0 on success, 1 if a computation fails, 2 on bad flags.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/figures.h"
#include "bench/flags.h"
#include "common/config.h"
#include "common/logging_plan.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "compute/backend.h"
#include "compute/backend_factory.h"
#include "compute/mlp.h"
#include "compute/reduction_tree.h"
#include "compute/step.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"

namespace rebound::bench {
namespace {

constexpr int kBatch = 64;
constexpr int kMicroBatches = 4;
constexpr int kRows = kBatch / kMicroBatches;
constexpr int kInputDim = 784;
constexpr int kClasses = 10;
constexpr uint64_t kSeed = 42;
// A step far into training and a sender's record counter there, so that the varints of the
// records have their usual length.
constexpr int64_t kLoggedStep = 12345;
constexpr uint64_t kSenderIncarnation = 7;

constexpr char kUsage[] =
    "usage: selective_logging [--reps=N] [--warmup=N] [--stage_steps=N] [--tau=N] "
    "[--budget_bytes=N]";

struct Flags {
  int reps = 15;
  int warmup = 1;
  int stage_steps = 8;
  int tau = 8;
  int64_t budget_bytes = -1;  // -1: half of the all-logged stored bytes
};

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  CommandLine command_line(kUsage);
  command_line.AddInt("reps", &flags.reps);
  command_line.AddInt("warmup", &flags.warmup);
  command_line.AddInt("stage_steps", &flags.stage_steps);
  command_line.AddInt("tau", &flags.tau);
  command_line.AddCustom("budget_bytes", [&](const std::string& value) {
    if (!absl::SimpleAtoi(value, &flags.budget_bytes) || flags.budget_bytes < 0) {
      command_line.Usage(
          absl::StrCat("--budget_bytes must be a number of bytes >= 0, got '", value, "'"));
    }
  });
  command_line.Parse(argc, argv);
  if (flags.reps < 1) command_line.Usage("--reps must be >= 1");
  if (flags.warmup < 0) command_line.Usage("--warmup must be >= 0");
  if (flags.stage_steps < 1) command_line.Usage("--stage_steps must be >= 1");
  if (flags.tau < 2 || flags.tau % 2 != 0) command_line.Usage("--tau must be even and >= 2");
  return flags;
}

// The job the benchmark measures, as reboundctl plan-logging would read it.
JobConfig BenchJob(int tau) {
  JobConfig job;
  job.set_job_id("selective-logging-bench");
  ModelSpec* model = job.mutable_model();
  model->set_input_dim(kInputDim);
  for (int width : {512, 512, 256, 256}) {
    LayerSpec* layer = model->add_layers();
    layer->set_width(width);
    layer->set_activation(RELU);
  }
  LayerSpec* out = model->add_layers();
  out->set_width(kClasses);
  out->set_activation(IDENTITY);
  job.mutable_topology()->set_replicas(1);
  job.mutable_topology()->set_stages(4);
  for (int first_layer : {1, 2, 3}) job.mutable_topology()->add_stage_boundaries(first_layer);
  job.mutable_data()->set_batch_size(kBatch);
  job.mutable_data()->set_micro_batches(kMicroBatches);
  job.mutable_easgd()->set_sync_period(tau);
  job.mutable_compute()->set_backend(CPU);
  job.mutable_compute()->set_threads(1);
  // Random pixels with Adam-like steps of the default lr 0.15 overshoot over many steps; a small
  // lr keeps the numbers tame and does not change the work (as in //bench:compute).
  job.mutable_adahessian()->set_lr(0.001);
  return job;
}

double MsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// The S stages of the model on one backend, each with its optimizer, workspace and tree
// accumulator, and the boundary pairs of one captured step.
class Pipeline {
 public:
  static absl::StatusOr<std::unique_ptr<Pipeline>> Create(compute::Backend* backend,
                                                          const JobConfig& job) {
    auto pipeline = std::unique_ptr<Pipeline>(new Pipeline(backend));
    RETURN_IF_ERROR(pipeline->Init(job));
    return pipeline;
  }

  int num_stages() const { return static_cast<int>(stages_.size()); }
  // Width of boundary b (features of the forward pair entering stage b).
  int width(int b) const { return stages_[b]->layout().input_dim(); }

  // Runs one step of the whole model and keeps every boundary's pairs (step 1 of the run).
  absl::Status Capture() {
    const int s_count = num_stages();
    RETURN_IF_ERROR(StartStep(0, s_count, next_step_));
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      compute::ConstDSpan x = Images(mb);
      for (int s = 0; s < s_count; ++s) {
        ASSIGN_OR_RETURN(x, stages_[s]->Forward(x, kRows, true, workspaces_[s].get()));
        if (s + 1 < s_count) RETURN_IF_ERROR(Keep(x, &forward_[s + 1][mb]));
      }
      compute::ConstDSpan grad;
      for (int s = s_count - 1; s >= 0; --s) {
        ASSIGN_OR_RETURN(grad, BackwardOne(s, mb, grad));
        if (s > 0) RETURN_IF_ERROR(Keep(grad, &backward_[s][mb]));
      }
      for (int s = 0; s < s_count; ++s) {
        RETURN_IF_ERROR(accumulators_[s]->Commit(compute::TreeNode{mb, mb + 1}));
      }
    }
    RETURN_IF_ERROR(FinishStep(0, s_count, next_step_++));
    return backend_->Synchronize();
  }

  // Replays `steps` steps of the recovery group [a, b) from the captured pairs (see the file
  // comment) and returns the wall time in ms.
  absl::StatusOr<double> ReplayGroup(int a, int b, int steps) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) {
      const int64_t t = next_step_++;
      RETURN_IF_ERROR(StartStep(a, b, t));
      for (int mb = 0; mb < kMicroBatches; ++mb) {
        compute::ConstDSpan x = a == 0 ? Images(mb) : compute::ConstDSpan(forward_[a][mb].span());
        for (int s = a; s < b; ++s) {
          ASSIGN_OR_RETURN(x, stages_[s]->Forward(x, kRows, true, workspaces_[s].get()));
        }
        compute::ConstDSpan grad;
        if (b < num_stages()) grad = backward_[b][mb].span();
        for (int s = b - 1; s >= a; --s) {
          ASSIGN_OR_RETURN(grad, BackwardOne(s, mb, grad));
        }
        for (int s = a; s < b; ++s) {
          RETURN_IF_ERROR(accumulators_[s]->Commit(compute::TreeNode{mb, mb + 1}));
        }
      }
      RETURN_IF_ERROR(FinishStep(a, b, t));
    }
    RETURN_IF_ERROR(backend_->Synchronize());
    return MsSince(start);
  }

  // The LogRecords that logging boundary b ships for one step: per micro-batch, the FORWARD
  // record for slot (0, b) and the BACKWARD record for slot (0, b-1).
  absl::StatusOr<std::vector<LogRecord>> BoundaryRecords(int b) const {
    const int w = width(b);
    const int64_t half = static_cast<int64_t>(kRows) * w;
    std::vector<LogRecord> records;
    std::vector<float> pair(2 * half);
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      for (const BoundaryDirection direction : {FORWARD, BACKWARD}) {
        const bool forward = direction == FORWARD;
        RETURN_IF_ERROR(backend_->CopyToHost(
            forward ? forward_[b][mb].span() : backward_[b][mb].span(), absl::MakeSpan(pair)));
        LogRecord record;
        record.mutable_slot()->set_replica(0);
        record.mutable_slot()->set_stage(forward ? b : b - 1);
        record.set_step(kLoggedStep);
        record.set_micro_batch(mb);
        record.mutable_sample_ids()->Add(sample_ids_.begin() + mb * kRows,
                                         sample_ids_.begin() + (mb + 1) * kRows);
        BoundaryPayload* payload = record.add_boundaries();
        payload->set_direction(direction);
        // Forward pair [h; R{h}]; backward pair [R{e}; e] (compute/mlp.h).
        const absl::Span<const float> first = absl::MakeConstSpan(pair).subspan(0, half);
        const absl::Span<const float> second = absl::MakeConstSpan(pair).subspan(half, half);
        // As the sender builds it (worker/pipeline.cc): value h or e, r_value R{h} or R{e}.
        *payload->mutable_value() = MakeFloatTensor(0, "value", {kRows, w}, forward ? first : second);
        *payload->mutable_r_value() =
            MakeFloatTensor(1, "r_value", {kRows, w}, forward ? second : first);
        record.set_sender_incarnation(kSenderIncarnation);
        record.set_record_id(static_cast<uint64_t>(kLoggedStep) * (kMicroBatches + 1) + mb + 1);
        records.push_back(std::move(record));
      }
    }
    return records;
  }

 private:
  explicit Pipeline(compute::Backend* backend) : backend_(backend) {}

  absl::Status Init(const JobConfig& job) {
    const std::vector<int> starts = StageLayerStarts(job);
    const int s_count = static_cast<int>(starts.size()) - 1;
    optimizer_config_ = job.adahessian();
    for (int s = 0; s < s_count; ++s) {
      ASSIGN_OR_RETURN(std::unique_ptr<compute::MlpStage> stage,
                       compute::MlpStage::Create(backend_, job.model(), starts[s], starts[s + 1]));
      RETURN_IF_ERROR(stage->InitParams());
      ASSIGN_OR_RETURN(
          std::unique_ptr<compute::StageOptimizer> optimizer,
          compute::StageOptimizer::Create(backend_, stage->layout(), optimizer_config_));
      ASSIGN_OR_RETURN(std::unique_ptr<compute::StageWorkspace> ws, stage->NewWorkspace(kRows));
      ASSIGN_OR_RETURN(std::unique_ptr<compute::TreeAccumulator> acc,
                       compute::TreeAccumulator::Create(backend_, stage->layout().sums_size()));
      stages_.push_back(std::move(stage));
      optimizers_.push_back(std::move(optimizer));
      workspaces_.push_back(std::move(ws));
      accumulators_.push_back(std::move(acc));
    }
    forward_.resize(s_count);
    backward_.resize(s_count);
    for (int b = 1; b < s_count; ++b) {
      for (int mb = 0; mb < kMicroBatches; ++mb) {
        ASSIGN_OR_RETURN(compute::DeviceBuffer f, backend_->Allocate(2 * kRows * width(b)));
        ASSIGN_OR_RETURN(compute::DeviceBuffer g, backend_->Allocate(2 * kRows * width(b)));
        forward_[b].push_back(std::move(f));
        backward_[b].push_back(std::move(g));
      }
    }
    std::mt19937 gen(1);
    std::uniform_real_distribution<float> pixel(0.0f, 1.0f);
    std::uniform_int_distribution<int> label(0, kClasses - 1);
    std::vector<float> images(static_cast<size_t>(kBatch) * kInputDim);
    std::vector<int32_t> labels(kBatch);
    for (float& x : images) x = pixel(gen);
    for (int32_t& y : labels) y = label(gen);
    // Sample ids as a shuffled Fashion-MNIST training set (60,000 samples) hands them out.
    std::uniform_int_distribution<int64_t> id(0, 59999);
    for (int i = 0; i < kBatch; ++i) sample_ids_.push_back(id(gen));
    ASSIGN_OR_RETURN(images_, backend_->Allocate(static_cast<int64_t>(images.size())));
    ASSIGN_OR_RETURN(labels_, backend_->Allocate(kBatch, compute::DType::kInt32));
    RETURN_IF_ERROR(backend_->CopyToDevice(images, images_.span()));
    RETURN_IF_ERROR(backend_->CopyToDevice(labels, labels_.int_span()));
    return absl::OkStatus();
  }

  compute::ConstDSpan Images(int mb) const {
    return images_.span().sub(static_cast<int64_t>(mb) * kRows * kInputDim, kRows * kInputDim);
  }

  absl::Status Keep(compute::ConstDSpan pair, compute::DeviceBuffer* into) {
    return backend_->Copy(pair, into->span());
  }

  // Draws z of step t for stages [a, b) and starts their reductions.
  absl::Status StartStep(int a, int b, int64_t t) {
    compute::HutchinsonKey key;
    key.seed = kSeed;
    key.step = static_cast<uint64_t>(t);
    for (int s = a; s < b; ++s) {
      RETURN_IF_ERROR(stages_[s]->DrawDirection(key));
      RETURN_IF_ERROR(accumulators_[s]->Start(kMicroBatches, compute::TreeNode{0, kMicroBatches},
                                              stages_[s]->layout().sums_size()));
    }
    return absl::OkStatus();
  }

  // Backward of stage s for micro-batch mb into its leaf buffer: from the labels if s is the
  // model's last stage, else from `grad`, the backward pair of boundary s+1.
  absl::StatusOr<compute::ConstDSpan> BackwardOne(int s, int mb, compute::ConstDSpan grad) {
    ASSIGN_OR_RETURN(compute::DSpan sums, accumulators_[s]->LeafBuffer(mb));
    if (s == num_stages() - 1) {
      return stages_[s]->BackwardFromLabels(
          compute::ConstDIntSpan(labels_.int_span()).sub(mb * kRows, kRows), kRows,
          static_cast<float>(1.0 / kBatch), true, workspaces_[s].get(), sums);
    }
    return stages_[s]->Backward(grad, kRows, true, workspaces_[s].get(), sums);
  }

  // The reduced sums of stages [a, b) and their AdaHessian apply of step t.
  absl::Status FinishStep(int a, int b, int64_t t) {
    for (int s = a; s < b; ++s) {
      ASSIGN_OR_RETURN(compute::ConstDSpan sum, accumulators_[s]->Result());
      RETURN_IF_ERROR(
          optimizers_[s]->Apply(t, true, sum, stages_[s]->direction(), stages_[s]->params()));
    }
    return absl::OkStatus();
  }

  compute::Backend* backend_;
  AdaHessianConfig optimizer_config_;
  std::vector<std::unique_ptr<compute::MlpStage>> stages_;
  std::vector<std::unique_ptr<compute::StageOptimizer>> optimizers_;
  std::vector<std::unique_ptr<compute::StageWorkspace>> workspaces_;
  std::vector<std::unique_ptr<compute::TreeAccumulator>> accumulators_;
  compute::DeviceBuffer images_;
  compute::DeviceBuffer labels_;
  std::vector<int64_t> sample_ids_;
  // forward_[b][mb], backward_[b][mb]: the pairs of boundary b (1 <= b < S) for micro-batch mb.
  std::vector<std::vector<compute::DeviceBuffer>> forward_;
  std::vector<std::vector<compute::DeviceBuffer>> backward_;
  int64_t next_step_ = 1;
};

// A replay to time: `steps` steps of group [a, b).
struct Timing {
  int a = 0;
  int b = 0;
  int steps = 0;
  std::vector<double> ms;  // one per repetition
};

// Times every entry of `timings` --reps times, round-robin (so that a drift of the machine's load
// hits all alike), each timed replay after --warmup untimed steps of the same group.
absl::Status TimeRoundRobin(Pipeline& pipeline, const Flags& flags, std::vector<Timing>* timings) {
  for (int rep = 0; rep < flags.reps; ++rep) {
    for (Timing& timing : *timings) {
      if (flags.warmup > 0) {
        RETURN_IF_ERROR(pipeline.ReplayGroup(timing.a, timing.b, flags.warmup).status());
      }
      ASSIGN_OR_RETURN(const double ms, pipeline.ReplayGroup(timing.a, timing.b, timing.steps));
      timing.ms.push_back(ms);
    }
  }
  return absl::OkStatus();
}

// One choice of logged boundaries and what it costs.
struct Choice {
  std::vector<int> logged;  // ascending
  int64_t bytes_per_step = 0;
  int64_t stored_bytes = 0;
  double mean_recovery_ms = 0.0;
  double worst_recovery_ms = 0.0;
};

std::string BoundaryList(const std::vector<int>& logged, const char* separator) {
  return absl::StrCat("[", absl::StrJoin(logged, separator), "]");
}

int Run(const Flags& flags) {
  const JobConfig job = BenchJob(flags.tau);
  if (absl::Status valid = ValidateJobConfig(job); !valid.ok()) {
    std::fprintf(stderr, "job: %s\n", valid.ToString().c_str());
    return 1;
  }
  auto backend_or = compute::CreateBackend(job.compute());
  if (!backend_or.ok()) {
    std::fprintf(stderr, "backend: %s\n", backend_or.status().ToString().c_str());
    return 1;
  }
  compute::Backend& backend = **backend_or;
  auto pipeline_or = Pipeline::Create(&backend, job);
  if (!pipeline_or.ok()) {
    std::fprintf(stderr, "pipeline: %s\n", pipeline_or.status().ToString().c_str());
    return 1;
  }
  Pipeline& pipeline = **pipeline_or;
  const int stages = pipeline.num_stages();
  const auto study_start = std::chrono::steady_clock::now();
  auto fail = [](const char* what, const absl::Status& status) {
    std::fprintf(stderr, "%s: %s\n", what, status.ToString().c_str());
    return 1;
  };
  if (absl::Status captured = pipeline.Capture(); !captured.ok()) return fail("capture", captured);

  std::printf("selective logging benchmark: MLP %d", kInputDim);
  for (const LayerSpec& layer : job.model().layers()) std::printf("-%d", layer.width());
  std::printf(" in %d stages (first layers %s), batch %d in %d micro-batches, tau %d\n", stages,
              absl::StrJoin(job.topology().stage_boundaries(), ", ").c_str(), kBatch, kMicroBatches,
              flags.tau);
  std::printf(
      "backend: %s; every timing the median of %d round-robin repetitions, each after %d "
      "warm-up step(s)\n\n",
      backend.name().c_str(), flags.reps, flags.warmup);

  // Per-stage step time: the one-stage group [s, s+1).
  std::vector<Timing> stage_timings;
  for (int s = 0; s < stages; ++s) stage_timings.push_back({s, s + 1, flags.stage_steps, {}});
  if (absl::Status timed = TimeRoundRobin(pipeline, flags, &stage_timings); !timed.ok()) {
    return fail("stage timing", timed);
  }
  std::vector<double> stage_ms(stages);
  for (int s = 0; s < stages; ++s) stage_ms[s] = Median(stage_timings[s].ms) / flags.stage_steps;
  double model_step_ms = 0.0;
  for (double ms : stage_ms) model_step_ms += ms;
  std::printf(
      "step time per stage (fwd + bwd with the R-op of %d micro-batches, tree, "
      "AdaHessian), ms:",
      kMicroBatches);
  for (int s = 0; s < stages; ++s) std::printf(" s%d %.3f", s, stage_ms[s]);
  std::printf("  (sum %.3f)\n", model_step_ms);

  // Log bytes per boundary.
  std::vector<int64_t> boundary_bytes(stages, 0);  // [b], b >= 1
  for (int b = 1; b < stages; ++b) {
    auto records = pipeline.BoundaryRecords(b);
    if (!records.ok()) return fail("log records", records.status());
    for (const LogRecord& record : *records) {
      boundary_bytes[b] += static_cast<int64_t>(record.ByteSizeLong());
    }
    const int64_t payload = int64_t{4} * kBatch * pipeline.width(b) * 4;
    std::printf(
        "boundary %d (width %d): %zu LogRecords, %lld bytes per step (tensor data %lld, "
        "overhead %.2f%%)\n",
        b, pipeline.width(b), records->size(), static_cast<long long>(boundary_bytes[b]),
        static_cast<long long>(payload),
        100.0 * static_cast<double>(boundary_bytes[b] - payload) / payload);
  }

  // Replay of every possible recovery group [a, b), tau/2 steps.
  const int replay_steps = flags.tau / 2;
  std::vector<Timing> group_timings;
  for (int a = 0; a < stages; ++a) {
    for (int b = a + 1; b <= stages; ++b) group_timings.push_back({a, b, replay_steps, {}});
  }
  if (absl::Status timed = TimeRoundRobin(pipeline, flags, &group_timings); !timed.ok()) {
    return fail("group replay", timed);
  }
  std::vector<std::vector<double>> group_ms(stages, std::vector<double>(stages + 1, 0.0));
  std::printf(
      "\nreplay of %d steps (tau/2) per recovery group, ms (median; min..max over the "
      "repetitions):\n",
      replay_steps);
  for (const Timing& timing : group_timings) {
    const double ms = Median(timing.ms);
    group_ms[timing.a][timing.b] = ms;
    double sum = 0.0;
    for (int s = timing.a; s < timing.b; ++s) sum += stage_ms[s];
    std::printf(
        "  stages %d..%d: %8.2f  (%.2f..%.2f; the model, sum of the stage times x %d: "
        "%.2f)\n",
        timing.a, timing.b - 1, ms, *std::min_element(timing.ms.begin(), timing.ms.end()),
        *std::max_element(timing.ms.begin(), timing.ms.end()), replay_steps, sum * replay_steps);
  }

  // Every choice of logged boundaries, all logged first.
  std::vector<Choice> choices;
  for (int mask = (1 << (stages - 1)) - 1; mask >= 0; --mask) {
    Choice c;
    for (int b = 1; b < stages; ++b) {
      if (mask & (1 << (b - 1))) c.logged.push_back(b);
    }
    for (int b : c.logged) c.bytes_per_step += boundary_bytes[b];
    c.stored_bytes = c.bytes_per_step * flags.tau;
    std::vector<int> cuts = {0};
    cuts.insert(cuts.end(), c.logged.begin(), c.logged.end());
    cuts.push_back(stages);
    for (size_t g = 0; g + 1 < cuts.size(); ++g) {
      const double ms = group_ms[cuts[g]][cuts[g + 1]];
      c.mean_recovery_ms += ms * (cuts[g + 1] - cuts[g]) / stages;
      c.worst_recovery_ms = std::max(c.worst_recovery_ms, ms);
    }
    choices.push_back(c);
  }
  const Choice& all = choices.front();
  const Choice& none = choices.back();
  std::printf("\n%-17s | %12s | %12s | %17s | %18s\n", "boundaries logged", "bytes/step",
              "stored bytes", "mean recovery ms", "worst recovery ms");
  std::printf("%s\n", std::string(88, '-').c_str());
  for (const Choice& c : choices) {
    std::printf("%-17s | %12lld | %12lld | %17.2f | %18.2f\n", BoundaryList(c.logged, ", ").c_str(),
                static_cast<long long>(c.bytes_per_step), static_cast<long long>(c.stored_bytes),
                c.mean_recovery_ms, c.worst_recovery_ms);
  }

  // The plan from the measured costs.
  const int64_t budget = flags.budget_bytes >= 0 ? flags.budget_bytes : all.stored_bytes / 2;
  MeasuredCosts measured;
  measured.stage_ms = stage_ms;
  measured.boundary_bytes_per_step.assign(boundary_bytes.begin() + 1, boundary_bytes.end());
  auto plan = PlanLogging(job, budget, measured);
  if (!plan.ok()) return fail("plan", plan.status());
  std::printf(
      "\nPlanLogging with the measured stage times and boundary bytes, budget %lld "
      "bytes%s:\n%s",
      static_cast<long long>(budget), flags.budget_bytes >= 0 ? "" : " (half of all-logged)",
      FormatLoggingPlan(job, budget, *plan).c_str());
  const Choice* chosen = nullptr;
  for (const Choice& c : choices) {
    if (c.logged == plan->logged) chosen = &c;
  }
  if (chosen == nullptr) return fail("plan", absl::InternalError("the plan is no choice"));
  // The cheapest choice within the budget, by measured mean recovery, to judge the greedy rule.
  const Choice* best = nullptr;
  for (const Choice& c : choices) {
    if (c.stored_bytes <= budget &&
        (best == nullptr || c.mean_recovery_ms < best->mean_recovery_ms)) {
      best = &c;
    }
  }
  std::printf(
      "\nplan %s: %lld bytes/step, stored %lld, measured mean recovery %.2f ms (the "
      "model predicted %.2f), worst %.2f ms\n",
      BoundaryList(chosen->logged, ", ").c_str(), static_cast<long long>(chosen->bytes_per_step),
      static_cast<long long>(chosen->stored_bytes), chosen->mean_recovery_ms,
      plan->expected_recovery_ms_plan, chosen->worst_recovery_ms);
  // The same rule without the measured times (stage times from multiply-adds, same bytes).
  MeasuredCosts bytes_only;
  bytes_only.boundary_bytes_per_step = measured.boundary_bytes_per_step;
  auto by_macs = PlanLogging(job, budget, bytes_only);
  if (!by_macs.ok()) return fail("plan by multiply-adds", by_macs.status());
  for (const Choice& c : choices) {
    if (c.logged == by_macs->logged) {
      std::printf(
          "the same rule with stage times from multiply-adds picks %s: measured mean "
          "recovery %.2f ms\n",
          BoundaryList(c.logged, ", ").c_str(), c.mean_recovery_ms);
    }
  }
  std::printf("best choice within the budget by measured mean recovery: %s (%.2f ms)%s\n",
              BoundaryList(best->logged, ", ").c_str(), best->mean_recovery_ms,
              best->logged == chosen->logged ? ": the plan" : "");
  const double bytes_ratio =
      static_cast<double>(chosen->bytes_per_step) / static_cast<double>(all.bytes_per_step);
  const double recovery_ratio = chosen->mean_recovery_ms / all.mean_recovery_ms;
  std::printf(
      "vs all logged (baseline, %lld bytes/step, %.2f ms): bytes x%.3f, mean recovery "
      "x%.3f, worst recovery x%.3f\n",
      static_cast<long long>(all.bytes_per_step), all.mean_recovery_ms, bytes_ratio, recovery_ratio,
      chosen->worst_recovery_ms / all.worst_recovery_ms);
  std::printf(
      "vs none logged (0 bytes/step, %.2f ms): %lld more bytes/step, mean recovery "
      "x%.3f, worst recovery x%.3f\n",
      none.mean_recovery_ms, static_cast<long long>(chosen->bytes_per_step),
      chosen->mean_recovery_ms / none.mean_recovery_ms,
      chosen->worst_recovery_ms / none.worst_recovery_ms);
  std::printf("(study took %.1f s)\n", MsSince(study_start) / 1000.0);
  std::printf(
      "RESULT selective_logging: all_logged_bytes_per_step=%lld all_logged_recovery_ms=%.2f "
      "none_logged_recovery_ms=%.2f plan=%s plan_bytes_ratio=%.3f "
      "plan_recovery_ratio=%.3f\n",
      static_cast<long long>(all.bytes_per_step), all.mean_recovery_ms, none.mean_recovery_ms,
      BoundaryList(chosen->logged, ",").c_str(), bytes_ratio, recovery_ratio);
  return 0;
}

}  // namespace
}  // namespace rebound::bench

int main(int argc, char** argv) {
  return rebound::bench::Run(rebound::bench::ParseFlags(argc, argv));
}
