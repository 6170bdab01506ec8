// Convergence study (issue R8, part 2): the Xu & Carr experiment on Fashion-MNIST, as an
// in-process, deterministic discrete-event simulation built from the product's own parts.
//
// What is real: R trainers, each a compute::LocalTrainer (CPU backend, compute.threads 1) running
// real AdaHessian steps (§4.3, Hutchinson D every step) on its own worker::ShardSampler shard of
// Fashion-MNIST; the EASGD center is a server::CenterTable updated by its ElasticSync (the server's
// code: c <- c + alpha w (x - c), the worker's x <- x - alpha (x - c_before)), alpha =
// EffectiveMovingRate = 0.9 / R; the weights come from a server::ReliabilityTracker (docs/design.md §4.5)
// fed exactly as the server feeds it (OnSync inside the weight function; trainer r is the worker
// named WorkerName(r), its slot's owner (SetOwner); OnFault(name) + SetLive(false) on a failure;
// SetOwner + SetLive(true) and no charge when it comes back, re-registered under the same name,
// which carries its score, docs/design.md §4.5), with the simulated clock; test accuracy is
// LocalTrainer::Evaluate of the center on the Fashion-MNIST test set.
// What is simulated: time. A step costs --step_ms (nominal) times a per-step jitter in
// [0.9, 1.1] drawn from (seed, trainer, step), times --straggler_factor for the straggler; a sync
// costs --sync_ms. Events (step completions, syncs, failures, returns) are processed in
// simulated-time order (ties: lower trainer first), so a run is deterministic and the event
// timeline of UNIFORM and DYNAMIC is identical (only the numbers differ): the two are paired.
//
// Grid: R in --replicas, tau in --taus, schedule in --schedules, policy in --policies, seed in
// [0, --seeds). Schedules (the faulty trainer is the last one, R-1):
//   none       every trainer healthy;
//   straggler  trainer R-1's steps cost --straggler_factor (4) times more;
//   kill       trainer R-1 is killed after every --kill_every of its own steps (a sync due at that
//              step is lost), stays down --down_steps x --step_ms of simulated time and comes back
//              with fresh state (--restart=scratch: new random parameters, as the worker's fault
//              injection --fault_reset_every_steps does; =center: the current center, as policy
//              RESTART_FROM_CENTER does), zero AdaHessian state, at its step count.
// Policies:
//   UNIFORM    asynchronous EASGD, w = 1 (the tracker's UNIFORM policy);
//   DYNAMIC    asynchronous EASGD, w from the tracker's DYNAMIC policy;
//   SYNC       plain synchronous averaging: rounds of tau steps by every trainer, then
//              c = mean(x_i) and every x_i <- c (optimizer state stays local). A round ends when
//              its slowest trainer is done, plus one --sync_ms. A kill inside a round costs the
//              round the lost steps and the down time; the trainer restarts the round from c with
//              zero optimizer state (BSP's natural recovery: c is everyone's last common state).
// Every run ends at the same simulated time T = --steps x --step_ms (the time a healthy trainer
// needs for --steps steps without syncs). The center is evaluated at T k / --eval_points,
// k = 0..--eval_points, on the first --test_samples test samples (10000 = the full test set).
//
// Output: per run a CSV in --out/runs/ (sim_s, mean steps per trainer, center version, test loss,
// test accuracy, every trainer's weight as the tracker's Current() gives it then); --out/runs.csv
// (one line per run); a summary table per (R, tau, schedule): final accuracy per policy (mean
// over seeds), DYNAMIC - UNIFORM and SYNC - UNIFORM in points (paired per seed), DYNAMIC - UNIFORM
// of the mean accuracy over [T/2, T], time and steps to --target accuracy; printed and written to
// --out/summary.md. Plots: tools/plot_convergence.sh --out.
// A study, not a benchmark of the product (it lives in study/, not bench/): tools/bench.sh runs it
// as its `convergence` row.
// Last line:
//   RESULT convergence: kill_d_minus_u_pts=<x> straggler_d_minus_u_pts=<y> none_d_minus_u_pts=<z>
//       kill_late_d_minus_u_pts=<x'> straggler_late_d_minus_u_pts=<y'> sync_minus_uniform_pts=<s>
//       runs=<n> minutes=<m>
// (means over the cells; "late": the mean accuracy over the second half [T/2, T] of each run).
// Exit code 0 when every run completed, 1 when one failed (data, I/O), 2 on bad flags.

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/flags.h"
#include "common/config.h"
#include "common/file.h"
#include "common/status_macros.h"
#include "compute/backend.h"
#include "compute/backend_factory.h"
#include "compute/model_layout.h"
#include "compute/step.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "server/center_table.h"
#include "server/reliability.h"
#include "worker/data/dataset.h"
#include "worker/data/fashion_mnist.h"
#include "worker/data/shard_sampler.h"

namespace rebound::study {
namespace {

using ::rebound::bench::CommandLine;

// ---------------------------------------------------------------------------------------------
// Flags

enum class Schedule { kNone, kStraggler, kKill };
enum class Policy { kUniform, kDynamic, kSync };

const char* ScheduleName(Schedule s) {
  switch (s) {
    case Schedule::kNone:
      return "none";
    case Schedule::kStraggler:
      return "straggler";
    case Schedule::kKill:
      return "kill";
  }
  return "?";
}

const char* PolicyName(Policy p) {
  switch (p) {
    case Policy::kUniform:
      return "UNIFORM";
    case Policy::kDynamic:
      return "DYNAMIC";
    case Policy::kSync:
      return "SYNC";
  }
  return "?";
}

struct Flags {
  std::vector<int> replicas = {2, 4, 8};
  std::vector<int> taus = {1, 4, 16};
  std::vector<Schedule> schedules = {Schedule::kNone, Schedule::kStraggler, Schedule::kKill};
  std::vector<Policy> policies = {Policy::kUniform, Policy::kDynamic, Policy::kSync};
  int steps = 3000;  // per healthy trainer; T = steps x step_ms
  int seeds = 1;
  bool quick = false;
  int hidden = 64;  // 784-hidden-10
  int batch = 64;
  int micro_batches = 4;
  std::string lr = "0.01";
  int step_ms = 10;  // nominal simulated cost of one step
  int sync_ms = 5;   // nominal simulated cost of one sync (or one SYNC round's exchange)
  int straggler_factor = 4;
  int kill_every = 0;  // 0: steps / 5
  int down_steps = 0;  // 0: kill_every / 4
  std::string restart = "scratch";
  std::string fault_half_life_s = "60";
  int eval_points = 40;
  int test_samples = 10000;
  std::string target = "0.80";
  std::string out = "/tmp/rebound-convergence";
  std::string dataset_dir = "/usr/share/datasets/fashion-mnist";
  // Parsed from the text flags.
  double lr_value = 0.01;
  double half_life_value = 60.0;
  double target_value = 0.80;
};

constexpr char kUsage[] =
    "usage: convergence [--quick] [--replicas=2,4,8] [--taus=1,4,16] "
    "[--schedules=none,straggler,kill] [--policies=UNIFORM,DYNAMIC,SYNC] [--steps=N] [--seeds=N] "
    "[--hidden=H] [--batch=B] [--micro_batches=M] [--lr=X] [--step_ms=MS] [--sync_ms=MS] "
    "[--straggler_factor=K] [--kill_every=N] [--down_steps=N] [--restart=scratch|center] "
    "[--fault_half_life_s=S] [--eval_points=N] [--test_samples=N] [--target=ACC] [--out=DIR] "
    "[--dataset_dir=DIR]";

std::vector<int> ParseIntList(const CommandLine& cl, const std::string& name,
                              const std::string& value) {
  std::vector<int> out;
  for (absl::string_view item : absl::StrSplit(value, ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(item, &v) || v < 1) {
      cl.Usage(absl::StrCat("--", name, ": '", item, "' is not a positive integer"));
    }
    out.push_back(v);
  }
  if (out.empty()) cl.Usage(absl::StrCat("--", name, " is empty"));
  return out;
}

double ParseDouble(const CommandLine& cl, const std::string& name, const std::string& value) {
  double v = 0;
  if (!absl::SimpleAtod(value, &v) || !std::isfinite(v)) {
    cl.Usage(absl::StrCat("--", name, ": '", value, "' is not a number"));
  }
  return v;
}

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  // --quick first, so that explicit flags given with it still win.
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--quick") {
      flags.quick = true;
      flags.replicas = {4};
      flags.taus = {4};
      flags.steps = 1000;
    }
  }
  CommandLine cl(kUsage);
  bool quick_seen = false;
  cl.AddSwitch("quick", &quick_seen);
  cl.AddCustom("replicas",
               [&](const std::string& v) { flags.replicas = ParseIntList(cl, "replicas", v); });
  cl.AddCustom("taus", [&](const std::string& v) { flags.taus = ParseIntList(cl, "taus", v); });
  cl.AddCustom("schedules", [&](const std::string& v) {
    flags.schedules.clear();
    for (absl::string_view key : absl::StrSplit(v, ',', absl::SkipEmpty())) {
      if (key == "none")
        flags.schedules.push_back(Schedule::kNone);
      else if (key == "straggler")
        flags.schedules.push_back(Schedule::kStraggler);
      else if (key == "kill")
        flags.schedules.push_back(Schedule::kKill);
      else
        cl.Usage(absl::StrCat("--schedules: unknown schedule '", key, "' (none, straggler, kill)"));
    }
    if (flags.schedules.empty()) cl.Usage("--schedules is empty");
  });
  cl.AddCustom("policies", [&](const std::string& v) {
    flags.policies.clear();
    for (absl::string_view key : absl::StrSplit(v, ',', absl::SkipEmpty())) {
      if (key == "UNIFORM")
        flags.policies.push_back(Policy::kUniform);
      else if (key == "DYNAMIC")
        flags.policies.push_back(Policy::kDynamic);
      else if (key == "SYNC")
        flags.policies.push_back(Policy::kSync);
      else
        cl.Usage(absl::StrCat("--policies: unknown policy '", key, "' (UNIFORM, DYNAMIC, SYNC)"));
    }
    if (flags.policies.empty()) cl.Usage("--policies is empty");
  });
  cl.AddInt("steps", &flags.steps);
  cl.AddInt("seeds", &flags.seeds);
  cl.AddInt("hidden", &flags.hidden);
  cl.AddInt("batch", &flags.batch);
  cl.AddInt("micro_batches", &flags.micro_batches);
  cl.AddText("lr", &flags.lr);
  cl.AddInt("step_ms", &flags.step_ms);
  cl.AddInt("sync_ms", &flags.sync_ms);
  cl.AddInt("straggler_factor", &flags.straggler_factor);
  cl.AddInt("kill_every", &flags.kill_every);
  cl.AddInt("down_steps", &flags.down_steps);
  cl.AddText("restart", &flags.restart);
  cl.AddText("fault_half_life_s", &flags.fault_half_life_s);
  cl.AddInt("eval_points", &flags.eval_points);
  cl.AddInt("test_samples", &flags.test_samples);
  cl.AddText("target", &flags.target);
  cl.AddText("out", &flags.out);
  cl.AddText("dataset_dir", &flags.dataset_dir);
  cl.Parse(argc, argv);

  flags.lr_value = ParseDouble(cl, "lr", flags.lr);
  flags.half_life_value = ParseDouble(cl, "fault_half_life_s", flags.fault_half_life_s);
  flags.target_value = ParseDouble(cl, "target", flags.target);
  if (flags.steps < 1) cl.Usage("--steps must be >= 1");
  if (flags.seeds < 1) cl.Usage("--seeds must be >= 1");
  if (flags.hidden < 1) cl.Usage("--hidden must be >= 1");
  if (flags.micro_batches < 1 || flags.batch < flags.micro_batches ||
      flags.batch % flags.micro_batches != 0) {
    cl.Usage("--batch must be a positive multiple of --micro_batches");
  }
  if (!(flags.lr_value > 0)) cl.Usage("--lr must be > 0");
  if (flags.step_ms < 1) cl.Usage("--step_ms must be >= 1");
  if (flags.sync_ms < 0) cl.Usage("--sync_ms must be >= 0");
  if (flags.straggler_factor < 1) cl.Usage("--straggler_factor must be >= 1");
  if (flags.kill_every < 0 || flags.down_steps < 0) {
    cl.Usage("--kill_every and --down_steps must be >= 0");
  }
  if (flags.kill_every == 0) flags.kill_every = std::max(1, flags.steps / 5);
  if (flags.down_steps == 0) flags.down_steps = std::max(1, flags.kill_every / 4);
  if (flags.restart != "scratch" && flags.restart != "center") {
    cl.Usage("--restart must be scratch or center");
  }
  if (!(flags.half_life_value > 0)) cl.Usage("--fault_half_life_s must be > 0");
  if (flags.eval_points < 1) cl.Usage("--eval_points must be >= 1");
  if (flags.test_samples < 1 || flags.test_samples > 10000) {
    cl.Usage("--test_samples must be in [1, 10000]");
  }
  if (!(flags.target_value > 0 && flags.target_value <= 1)) cl.Usage("--target must be in (0, 1]");
  for (int r : flags.replicas) {
    if (r < 2) cl.Usage("--replicas: every R must be >= 2 (one trainer is the faulty one)");
  }
  return flags;
}

// ---------------------------------------------------------------------------------------------
// Shared state of all runs: data, backend, the evaluator.

struct Data {
  worker::FashionMnist mnist;
  std::vector<float> test_images;  // the first --test_samples
  std::vector<int32_t> test_labels;
};

struct Env {
  const Flags* flags = nullptr;
  Data data;
  std::unique_ptr<compute::Backend> backend;
  std::unique_ptr<compute::LocalTrainer> evaluator;
  double real_step_seconds = 0.0;  // summed over all runs, with real_steps
  int64_t real_steps = 0;
  double real_eval_seconds = 0.0;
  int64_t real_evals = 0;
};

JobConfig MakeJob(const Flags& flags, int replicas, int seed) {
  JobConfig job;
  job.set_job_id("bench-convergence");
  ModelSpec* model = job.mutable_model();
  model->set_input_dim(784);
  LayerSpec* hidden = model->add_layers();
  hidden->set_width(flags.hidden);
  hidden->set_activation(RELU);
  LayerSpec* out = model->add_layers();
  out->set_width(10);
  out->set_activation(IDENTITY);
  model->set_init_seed(1 + seed);
  job.mutable_topology()->set_replicas(replicas);
  job.mutable_topology()->set_stages(1);
  DataConfig* data = job.mutable_data();
  data->set_dataset_dir(flags.dataset_dir);
  data->set_batch_size(flags.batch);
  data->set_micro_batches(flags.micro_batches);
  data->set_seed(42 + seed);
  data->set_shard_overlap(0.0);
  job.mutable_compute()->set_backend(CPU);
  job.mutable_compute()->set_threads(1);
  AdaHessianConfig* opt = job.mutable_adahessian();
  opt->set_lr(flags.lr_value);
  opt->set_hessian_every(1);
  job.mutable_easgd()->set_mode(EASGD);
  job.mutable_weighting()->set_fault_half_life_s(flags.half_life_value);
  return job;
}

// ---------------------------------------------------------------------------------------------
// One run

struct EvalPoint {
  double sim_s = 0;
  double mean_steps = 0;
  int64_t center_version = 0;
  double loss = 0;
  double accuracy = 0;
  std::vector<double> weights;
};

struct RunSpec {
  int replicas;
  int tau;
  Schedule schedule;
  Policy policy;
  int seed;
};

struct RunResult {
  bool ok = false;
  std::string error;
  std::vector<EvalPoint> points;
  double final_accuracy = 0;
  // Mean accuracy over the evaluation points in the second half of the run [T/2, T]: less
  // sensitive than the final point to where T falls in a kill cycle.
  double late_accuracy = 0;
  double time_to_target = NAN;   // simulated s, NaN: never reached
  double steps_to_target = NAN;  // mean steps per trainer then
  int64_t syncs = 0;
  int64_t kills = 0;
  // Mean weight applied to the faulty trainer's syncs and to the others' (async policies).
  double faulty_weight = NAN;
  double healthy_weight = NAN;
  // Center integrity (issue R9): the largest ||x - c|| of a sync over the median of the other
  // live trainers' latest (what weighting.max_divergence_ratio bounds), for the faulty trainer
  // and for the others; and the largest |value| of the center and snapshots (what
  // weighting.max_abs_value bounds).
  double max_ratio_faulty = 0;
  double max_ratio_healthy = 0;
  double max_abs = 0;
  double real_seconds = 0;
};

class Trainer {
 public:
  std::unique_ptr<compute::LocalTrainer> model;
  std::unique_ptr<worker::ShardSampler> sampler;
  std::mt19937_64 jitter;
  int64_t t = 0;    // local steps done (its step counter; continues after a restart)
  double next = 0;  // simulated time of its next event
  bool down = false;
  int64_t resets = 0;
};

class Run {
 public:
  Run(Env* env, const RunSpec& spec)
      : env_(env),
        flags_(*env->flags),
        spec_(spec),
        job_(MakeJob(flags_, spec.replicas, spec.seed)) {}

  absl::Status Execute(RunResult* result) {
    const absl::Time start = absl::Now();
    RETURN_IF_ERROR(Setup());
    if (spec_.policy == Policy::kSync) {
      RETURN_IF_ERROR(RunSync(result));
    } else {
      RETURN_IF_ERROR(RunAsync(result));
    }
    result->real_seconds = absl::ToDoubleSeconds(absl::Now() - start);
    result->final_accuracy = result->points.back().accuracy;
    int late = 0;
    for (const EvalPoint& p : result->points) {
      if (p.sim_s >= end_time() / 2) {
        result->late_accuracy += p.accuracy;
        ++late;
      }
    }
    result->late_accuracy /= std::max(1, late);
    for (const EvalPoint& p : result->points) {
      if (p.accuracy >= flags_.target_value) {
        result->time_to_target = p.sim_s;
        result->steps_to_target = p.mean_steps;
        break;
      }
    }
    result->syncs = syncs_;
    result->kills = kills_;
    if (faulty_syncs_ > 0) result->faulty_weight = faulty_weight_sum_ / faulty_syncs_;
    if (healthy_syncs_ > 0) result->healthy_weight = healthy_weight_sum_ / healthy_syncs_;
    result->max_ratio_faulty = max_ratio_faulty_;
    result->max_ratio_healthy = max_ratio_healthy_;
    if (centers_ != nullptr) result->max_abs = centers_->max_abs_seen(0);
    result->ok = true;
    return absl::OkStatus();
  }

 private:
  int faulty() const { return spec_.replicas - 1; }
  // The registered name of trainer r's worker: fault scores follow it.
  static std::string WorkerName(int r) { return absl::StrCat("trainer-", r); }
  double end_time() const { return flags_.steps * flags_.step_ms / 1000.0; }
  double sync_seconds() const { return flags_.sync_ms / 1000.0; }
  double down_seconds() const { return flags_.down_steps * flags_.step_ms / 1000.0; }

  absl::Status Setup() {
    ASSIGN_OR_RETURN(centers_, server::CenterTable::Create(job_));
    alpha_ = EffectiveMovingRate(job_);
    WeightingConfig weighting = job_.weighting();
    weighting.set_policy(spec_.policy == Policy::kDynamic ? DYNAMIC : UNIFORM);
    tracker_ = std::make_unique<server::ReliabilityTracker>(weighting, spec_.replicas);
    const int64_t n_train = env_->data.mnist.train.count;
    for (int r = 0; r < spec_.replicas; ++r) {
      auto trainer = std::make_unique<Trainer>();
      compute::TrainerOptions options;
      options.model = job_.model();
      options.optimizer = job_.adahessian();
      options.batch_size = flags_.batch;
      options.micro_batches = flags_.micro_batches;
      options.seed = job_.data().seed();
      options.replica = r;
      ASSIGN_OR_RETURN(trainer->model, compute::LocalTrainer::Create(env_->backend.get(), options));
      RETURN_IF_ERROR(trainer->model->InitParams());
      ASSIGN_OR_RETURN(worker::ShardSampler sampler,
                       worker::ShardSampler::Create(job_.data(), n_train, spec_.replicas, r));
      trainer->sampler = std::make_unique<worker::ShardSampler>(std::move(sampler));
      // The step-time jitter depends on (seed, trainer) only: every policy sees the same.
      trainer->jitter.seed(0x9E3779B97F4A7C15ull * (spec_.seed + 1) + 1000003ull * r);
      slots_.emplace_back();
      slots_.back().set_replica(r);
      slots_.back().set_stage(0);
      tracker_->SetOwner(slots_.back(), WorkerName(r));
      trainers_.push_back(std::move(trainer));
    }
    images_.resize(static_cast<size_t>(flags_.batch) * 784);
    labels_.resize(flags_.batch);
    return absl::OkStatus();
  }

  absl::Time SimTime(double s) const {
    return absl::FromUnixSeconds(1700000000) + absl::Seconds(s);
  }

  // The simulated cost of trainer r's next step.
  double StepSeconds(int r) {
    Trainer& tr = *trainers_[r];
    std::uniform_real_distribution<double> u(0.9, 1.1);
    double s = flags_.step_ms / 1000.0 * u(tr.jitter);
    if (spec_.schedule == Schedule::kStraggler && r == faulty()) s *= flags_.straggler_factor;
    return s;
  }

  bool KillDue(int r, int64_t t) const {
    return spec_.schedule == Schedule::kKill && r == faulty() && t % flags_.kill_every == 0;
  }

  // One real AdaHessian step of trainer r on its next batch.
  absl::Status DoStep(int r) {
    Trainer& tr = *trainers_[r];
    const std::vector<int64_t> ids = tr.sampler->NextBatch();
    RETURN_IF_ERROR(worker::AssembleBatch(env_->data.mnist.train, ids, absl::MakeSpan(images_),
                                          absl::MakeSpan(labels_)));
    ++tr.t;
    const absl::Time start = absl::Now();
    ASSIGN_OR_RETURN(const float loss, tr.model->Step(tr.t, images_, labels_));
    env_->real_step_seconds += absl::ToDoubleSeconds(absl::Now() - start);
    ++env_->real_steps;
    if (!std::isfinite(loss)) {
      return absl::InternalError(
          absl::StrCat("trainer ", r, ": the loss of step ", tr.t, " is not finite"));
    }
    return absl::OkStatus();
  }

  // Fresh state after a failure: parameters per --restart (from `center` for "center"), zero
  // AdaHessian state (m, v, last D). The step counter continues, as in the worker.
  absl::Status Restart(int r, absl::Span<const float> center) {
    Trainer& tr = *trainers_[r];
    compute::MlpStage& stage = tr.model->stage(0);
    const compute::StageLayout& layout = stage.layout();
    std::vector<float> packed(layout.packed_size());
    if (flags_.restart == "scratch" && spec_.policy != Policy::kSync) {
      // As worker/training.cc MaybeResetFromScratch: the `resets`-th fresh draw of this replica.
      ModelSpec fresh = job_.model();
      fresh.set_init_seed(job_.model().init_seed() + 7919 * (++tr.resets) + 104729 * r);
      std::vector<float> padded(layout.padded_size());
      RETURN_IF_ERROR(compute::InitParams(fresh, layout, absl::MakeSpan(padded)));
      RETURN_IF_ERROR(layout.Pack(padded, absl::MakeSpan(packed)));
    } else {
      std::copy(center.begin(), center.end(), packed.begin());
    }
    RETURN_IF_ERROR(stage.SetParams(packed));
    std::fill(packed.begin(), packed.end(), 0.0f);
    return tr.model->optimizer(0).SetState(packed, packed, packed);
  }

  absl::Status Evaluate(double sim_s, absl::Span<const float> center, int64_t version,
                        RunResult* result) {
    const absl::Time start = absl::Now();
    RETURN_IF_ERROR(env_->evaluator->stage(0).SetParams(center));
    ASSIGN_OR_RETURN(compute::EvalResult eval,
                     env_->evaluator->Evaluate(env_->data.test_images, env_->data.test_labels));
    env_->real_eval_seconds += absl::ToDoubleSeconds(absl::Now() - start);
    ++env_->real_evals;
    EvalPoint point;
    point.sim_s = sim_s;
    int64_t total = 0;
    for (const auto& tr : trainers_) total += tr->t;
    point.mean_steps = static_cast<double>(total) / spec_.replicas;
    point.center_version = version;
    point.loss = eval.loss;
    point.accuracy = eval.accuracy;
    for (const SlotId& slot : slots_) {
      point.weights.push_back(
          spec_.policy == Policy::kSync ? 1.0 : tracker_->Current(slot, SimTime(sim_s)).weight());
    }
    result->points.push_back(std::move(point));
    return absl::OkStatus();
  }

  absl::Status EvaluateCenterAt(double sim_s, RunResult* result) {
    ASSIGN_OR_RETURN(auto center, centers_->Read(0));
    return Evaluate(sim_s, center.first, center.second, result);
  }

  double EvalTime(int k) const { return end_time() * k / flags_.eval_points; }

  // Asynchronous EASGD: every trainer on its own clock, syncs in simulated-time order.
  absl::Status RunAsync(RunResult* result) {
    const int R = spec_.replicas;
    for (int r = 0; r < R; ++r) trainers_[r]->next = StepSeconds(r);
    const compute::StageLayout& layout = centers_->layout(0);
    std::vector<float> x(layout.packed_size()), after(layout.packed_size());
    int next_eval = 0;
    while (true) {
      int r = 0;
      for (int i = 1; i < R; ++i) {
        if (trainers_[i]->next < trainers_[r]->next) r = i;
      }
      const double now = trainers_[r]->next;
      while (next_eval <= flags_.eval_points && EvalTime(next_eval) < now) {
        RETURN_IF_ERROR(EvaluateCenterAt(EvalTime(next_eval), result));
        ++next_eval;
      }
      if (now > end_time()) break;
      Trainer& tr = *trainers_[r];
      if (tr.down) {
        // Back from the failure: the same worker registers again and restarts from the center
        // (server Heartbeat): a new owner of the slot under the same name, which carries its
        // score; the restart itself charges nobody (docs/weighting.md).
        ASSIGN_OR_RETURN(auto center, centers_->Read(0));
        RETURN_IF_ERROR(Restart(r, center.first));
        tracker_->SetOwner(slots_[r], WorkerName(r));
        tracker_->SetLive(slots_[r], true);
        tr.down = false;
        tr.next = now + StepSeconds(r);
        continue;
      }
      RETURN_IF_ERROR(DoStep(r));
      if (KillDue(r, tr.t)) {
        // Declared failed (server failure detector): a fault of the worker, and its slot out of
        // the medians until back.
        tracker_->OnFault(WorkerName(r), SimTime(now));
        tracker_->SetLive(slots_[r], false);
        tr.down = true;
        ++kills_;
        tr.next = now + down_seconds();
        continue;
      }
      double next = now;
      if (tr.t % spec_.tau == 0) {
        RETURN_IF_ERROR(tr.model->stage(0).GetParams(absl::MakeSpan(x)));
        double applied = 1.0;
        auto weight = [&](int64_t version, double norm) -> absl::StatusOr<double> {
          if (const auto median = tracker_->PeerDivergenceMedian(slots_[r]); median.has_value()) {
            double& max_ratio = r == faulty() ? max_ratio_faulty_ : max_ratio_healthy_;
            max_ratio = std::max(max_ratio, norm / *median);
          }
          const WeightInputs inputs = tracker_->OnSync(slots_[r], SimTime(now), version, norm);
          applied = inputs.weight();
          return applied;
        };
        auto commit = [](int64_t, absl::Span<const float>, absl::Span<const float>,
                         absl::Span<const float>) { return absl::OkStatus(); };
        RETURN_IF_ERROR(
            centers_->ElasticSync(0, x, alpha_, weight, commit, absl::MakeSpan(after)).status());
        RETURN_IF_ERROR(tr.model->stage(0).SetParams(after));
        ++syncs_;
        if (r == faulty()) {
          faulty_weight_sum_ += applied;
          ++faulty_syncs_;
        } else {
          healthy_weight_sum_ += applied;
          ++healthy_syncs_;
        }
        next += sync_seconds();
      }
      tr.next = next + StepSeconds(r);
    }
    while (next_eval <= flags_.eval_points) {
      RETURN_IF_ERROR(EvaluateCenterAt(EvalTime(next_eval), result));
      ++next_eval;
    }
    return absl::OkStatus();
  }

  // Plain synchronous averaging: rounds of tau steps, then everyone takes the mean.
  absl::Status RunSync(RunResult* result) {
    const int R = spec_.replicas;
    const compute::StageLayout& layout = centers_->layout(0);
    const size_t n = layout.packed_size();
    ASSIGN_OR_RETURN(auto initial, centers_->Read(0));
    std::vector<float> center = std::move(initial.first);
    std::vector<float> x(n);
    std::vector<double> sum(n);
    int64_t version = 0;
    double now = 0;
    int next_eval = 0;
    while (true) {
      // The round's duration: its slowest trainer, including lost work and down time of a kill.
      double longest = 0;
      std::vector<double> cost(R, 0.0);
      std::vector<int> kill_at(R, 0);  // 1-based index of the killing step within the round
      for (int r = 0; r < R; ++r) {
        for (int k = 1; k <= spec_.tau; ++k) {
          cost[r] += StepSeconds(r);
          if (kill_at[r] == 0 && KillDue(r, trainers_[r]->t + k)) kill_at[r] = k;
        }
        if (kill_at[r] > 0) {
          // The steps up to the kill are lost and redone after the down time (same cost
          // again, approximated by their share of the round's cost).
          cost[r] += down_seconds() + cost[r] * kill_at[r] / spec_.tau;
        }
        longest = std::max(longest, cost[r]);
      }
      const double round_end = now + longest + sync_seconds();
      while (next_eval <= flags_.eval_points && EvalTime(next_eval) < round_end) {
        RETURN_IF_ERROR(Evaluate(EvalTime(next_eval), center, version, result));
        ++next_eval;
      }
      if (round_end > end_time()) break;
      std::fill(sum.begin(), sum.end(), 0.0);
      for (int r = 0; r < R; ++r) {
        Trainer& tr = *trainers_[r];
        if (kill_at[r] > 0) {
          // Its work of this round up to the kill is lost: redo the round from c, fresh
          // optimizer state. The lost steps are not recomputed (their result is discarded).
          ++kills_;
          tracker_->OnFault(WorkerName(r), SimTime(now));
          RETURN_IF_ERROR(Restart(r, center));
        }
        for (int k = 0; k < spec_.tau; ++k) RETURN_IF_ERROR(DoStep(r));
        RETURN_IF_ERROR(tr.model->stage(0).GetParams(absl::MakeSpan(x)));
        for (size_t i = 0; i < n; ++i) sum[i] += x[i];
      }
      for (size_t i = 0; i < n; ++i) center[i] = static_cast<float>(sum[i] / R);
      for (int r = 0; r < R; ++r) RETURN_IF_ERROR(trainers_[r]->model->stage(0).SetParams(center));
      ++version;
      syncs_ += R;
      now = round_end;
    }
    while (next_eval <= flags_.eval_points) {
      RETURN_IF_ERROR(Evaluate(EvalTime(next_eval), center, version, result));
      ++next_eval;
    }
    return absl::OkStatus();
  }

  Env* env_;
  const Flags& flags_;
  const RunSpec spec_;
  const JobConfig job_;
  std::unique_ptr<server::CenterTable> centers_;
  std::unique_ptr<server::ReliabilityTracker> tracker_;
  double alpha_ = 0;
  std::vector<std::unique_ptr<Trainer>> trainers_;
  std::vector<SlotId> slots_;
  std::vector<float> images_;
  std::vector<int32_t> labels_;
  int64_t syncs_ = 0;
  int64_t kills_ = 0;
  double faulty_weight_sum_ = 0, healthy_weight_sum_ = 0;
  double max_ratio_faulty_ = 0, max_ratio_healthy_ = 0;
  int64_t faulty_syncs_ = 0, healthy_syncs_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Output

absl::Status MakeDirs(const std::string& path) {
  std::string partial;
  for (absl::string_view part : absl::StrSplit(path, '/')) {
    absl::StrAppend(&partial, part, "/");
    if (part.empty()) continue;
    if (mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::InternalError(
          absl::StrCat("cannot create directory ", partial, ": ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

std::string RunName(const RunSpec& s) {
  return absl::StrFormat("R%d_tau%d_%s_%s_seed%d", s.replicas, s.tau, ScheduleName(s.schedule),
                         PolicyName(s.policy), s.seed);
}

std::string RunCsv(const RunSpec& spec, const RunResult& result) {
  std::string csv = "sim_s,mean_steps,center_version,test_loss,test_accuracy";
  for (int r = 0; r < spec.replicas; ++r) absl::StrAppend(&csv, ",w", r);
  csv += "\n";
  for (const EvalPoint& p : result.points) {
    absl::StrAppendFormat(&csv, "%.4f,%.2f,%d,%.5f,%.5f", p.sim_s, p.mean_steps, p.center_version,
                          p.loss, p.accuracy);
    for (double w : p.weights) absl::StrAppendFormat(&csv, ",%.4f", w);
    csv += "\n";
  }
  return csv;
}

std::string Maybe(double v, const absl::FormatSpec<double>& format) {
  return std::isnan(v) ? std::string("-") : absl::StrFormat(format, v);
}

struct CellKey {
  int replicas;
  int tau;
  Schedule schedule;
  bool operator<(const CellKey& o) const {
    return std::tie(replicas, tau, schedule) < std::tie(o.replicas, o.tau, o.schedule);
  }
};

double Mean(const std::vector<double>& v) {
  if (v.empty()) return NAN;
  double s = 0;
  for (double x : v) s += x;
  return s / v.size();
}

// Mean over seeds that reached the target; "-" if none did, "x (k/n)" if only some did.
std::string MeanReached(const std::vector<double>& v, const absl::FormatSpec<double>& format) {
  std::vector<double> reached;
  for (double x : v) {
    if (!std::isnan(x)) reached.push_back(x);
  }
  if (reached.empty()) return "-";
  std::string s = absl::StrFormat(format, Mean(reached));
  if (reached.size() < v.size()) absl::StrAppendFormat(&s, " (%d/%d)", reached.size(), v.size());
  return s;
}

int Main(int argc, char** argv) {
  const Flags flags = ParseFlags(argc, argv);
  Env env;
  env.flags = &flags;
  const absl::Time study_start = absl::Now();

  DataConfig data_config;
  data_config.set_dataset_dir(flags.dataset_dir);
  absl::StatusOr<worker::FashionMnist> mnist = worker::LoadFashionMnist(data_config);
  if (!mnist.ok()) {
    std::fprintf(stderr, "convergence: cannot load Fashion-MNIST from %s: %s\n",
                 flags.dataset_dir.c_str(), std::string(mnist.status().message()).c_str());
    return 1;
  }
  env.data.mnist = *std::move(mnist);
  const worker::Dataset& test = env.data.mnist.test;
  const int64_t n_test = std::min<int64_t>(flags.test_samples, test.count);
  env.data.test_images.assign(test.images.begin(), test.images.begin() + n_test * test.features);
  env.data.test_labels.assign(test.labels.begin(), test.labels.begin() + n_test);

  ComputeConfig compute_config;
  compute_config.set_backend(CPU);
  compute_config.set_threads(1);
  absl::StatusOr<std::unique_ptr<compute::Backend>> backend =
      compute::CreateBackend(compute_config);
  if (!backend.ok()) {
    std::fprintf(stderr, "convergence: %s\n", std::string(backend.status().message()).c_str());
    return 1;
  }
  env.backend = *std::move(backend);
  {
    compute::TrainerOptions options;
    options.model = MakeJob(flags, 2, 0).model();
    options.optimizer = MakeJob(flags, 2, 0).adahessian();
    options.batch_size = flags.batch;
    options.micro_batches = flags.micro_batches;
    absl::StatusOr<std::unique_ptr<compute::LocalTrainer>> evaluator =
        compute::LocalTrainer::Create(env.backend.get(), options);
    if (!evaluator.ok()) {
      std::fprintf(stderr, "convergence: %s\n", std::string(evaluator.status().message()).c_str());
      return 1;
    }
    env.evaluator = *std::move(evaluator);
  }
  const std::string runs_dir = flags.out + "/runs";
  if (absl::Status made = MakeDirs(runs_dir); !made.ok()) {
    std::fprintf(stderr, "convergence: %s\n", std::string(made.message()).c_str());
    return 1;
  }

  std::vector<RunSpec> specs;
  for (int seed = 0; seed < flags.seeds; ++seed) {
    for (int replicas : flags.replicas) {
      for (int tau : flags.taus) {
        for (Schedule schedule : flags.schedules) {
          for (Policy policy : flags.policies)
            specs.push_back({replicas, tau, schedule, policy, seed});
        }
      }
    }
  }

  const double end_s = flags.steps * flags.step_ms / 1000.0;
  std::printf(
      "convergence study: async EASGD (UNIFORM vs DYNAMIC reliability weights) and plain "
      "synchronous averaging (SYNC), Fashion-MNIST, simulated time%s\n",
      flags.quick ? " (--quick)" : "");
  std::printf(
      "model 784-%d-10 RELU, AdaHessian lr %g (D every step), batch %d in %d "
      "micro-batches, alpha 0.9/R, CPU backend 1 thread; test set: first %lld of %lld\n",
      flags.hidden, flags.lr_value, flags.batch, flags.micro_batches,
      static_cast<long long>(n_test), static_cast<long long>(test.count));
  std::printf(
      "simulated costs: step %d ms (x U[0.9,1.1] jitter), sync %d ms; horizon T = %d steps "
      "x %d ms = %.1f s; eval every %.2f s\n",
      flags.step_ms, flags.sync_ms, flags.steps, flags.step_ms, end_s, end_s / flags.eval_points);
  std::printf(
      "faulty trainer R-1: straggler x%d; kill every %d of its steps, down %d steps "
      "(%.2f s), back with %s, zero optimizer state; fault half-life %g s; "
      "target accuracy %.3f\n",
      flags.straggler_factor, flags.kill_every, flags.down_steps,
      flags.down_steps * flags.step_ms / 1000.0,
      flags.restart == "scratch" ? "fresh random parameters (SYNC: the last average)"
                                 : "the center",
      flags.half_life_value, flags.target_value);
  std::printf("%zu runs; CSVs in %s\n\n", specs.size(), runs_dir.c_str());
  std::fflush(stdout);

  std::map<CellKey, std::map<Policy, std::map<int, RunResult>>> results;
  std::string runs_csv =
      "replicas,tau,schedule,policy,seed,final_accuracy,late_accuracy,time_to_target_s,steps_to_"
      "target,syncs,"
      "kills,faulty_weight,healthy_weight,real_s\n";
  bool all_ok = true;
  for (const RunSpec& spec : specs) {
    RunResult result;
    absl::Status status = Run(&env, spec).Execute(&result);
    if (status.ok()) {
      status = WriteFile(absl::StrCat(runs_dir, "/", RunName(spec), ".csv"), RunCsv(spec, result));
    }
    if (!status.ok()) {
      all_ok = false;
      std::printf("%-32s FAILED: %s\n", RunName(spec).c_str(),
                  std::string(status.message()).c_str());
      std::fflush(stdout);
      continue;
    }
    std::printf(
        "%-34s final acc %.4f (2nd half %.4f)  to %.2f: %s s, %s steps  syncs %lld kills %lld  w "
        "faulty "
        "%s others %s  max ratio faulty %.2f others %.2f max |c| %.3g  (%.1f s real)\n",
        RunName(spec).c_str(), result.final_accuracy, result.late_accuracy, flags.target_value,
        Maybe(result.time_to_target, "%.2f").c_str(), Maybe(result.steps_to_target, "%.0f").c_str(),
        static_cast<long long>(result.syncs), static_cast<long long>(result.kills),
        Maybe(result.faulty_weight, "%.3f").c_str(), Maybe(result.healthy_weight, "%.3f").c_str(),
        result.max_ratio_faulty, result.max_ratio_healthy, result.max_abs, result.real_seconds);
    std::fflush(stdout);
    absl::StrAppendFormat(&runs_csv, "%d,%d,%s,%s,%d,%.5f,%.5f,%s,%s,%d,%d,%s,%s,%.2f\n",
                          spec.replicas, spec.tau, ScheduleName(spec.schedule),
                          PolicyName(spec.policy), spec.seed, result.final_accuracy,
                          result.late_accuracy, Maybe(result.time_to_target, "%.4f"),
                          Maybe(result.steps_to_target, "%.2f"), result.syncs, result.kills,
                          Maybe(result.faulty_weight, "%.4f"), Maybe(result.healthy_weight, "%.4f"),
                          result.real_seconds);
    results[{spec.replicas, spec.tau, spec.schedule}][spec.policy][spec.seed] = std::move(result);
  }
  const double minutes = absl::ToDoubleMinutes(absl::Now() - study_start);

  // The summary table.
  const std::string target_text = absl::StrFormat("%.0f%%", 100 * flags.target_value);
  std::string md = absl::StrFormat(
      "| R | tau | schedule | UNIFORM | DYNAMIC | SYNC | D-U pts | SYNC-U pts | 2nd-half D-U pts | "
      "time to %s U / D / S (s) | steps to %s U / D / S |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n",
      target_text, target_text);
  std::map<Schedule, std::vector<double>> d_minus_u, late_d_minus_u;
  std::vector<double> sync_minus_u;
  for (const auto& [cell, by_policy] : results) {
    std::map<Policy, std::string> final_text, time_text, steps_text;
    std::map<Policy, std::map<int, double>> finals, lates;
    for (Policy policy : {Policy::kUniform, Policy::kDynamic, Policy::kSync}) {
      auto it = by_policy.find(policy);
      if (it == by_policy.end()) {
        final_text[policy] = time_text[policy] = steps_text[policy] = "n/a";
        continue;
      }
      std::vector<double> acc, times, steps;
      for (const auto& [seed, r] : it->second) {
        acc.push_back(r.final_accuracy);
        finals[policy][seed] = r.final_accuracy;
        lates[policy][seed] = r.late_accuracy;
        times.push_back(r.time_to_target);
        steps.push_back(r.steps_to_target);
      }
      final_text[policy] = absl::StrFormat("%.4f", Mean(acc));
      time_text[policy] = MeanReached(times, "%.2f");
      steps_text[policy] = MeanReached(steps, "%.0f");
    }
    auto paired = [](std::map<Policy, std::map<int, double>>& by, Policy a, Policy b) {
      std::vector<double> diffs;
      for (const auto& [seed, acc] : by[a]) {
        auto other = by[b].find(seed);
        if (other != by[b].end()) diffs.push_back(100 * (acc - other->second));
      }
      return Mean(diffs);
    };
    const double du = paired(finals, Policy::kDynamic, Policy::kUniform);
    const double su = paired(finals, Policy::kSync, Policy::kUniform);
    const double late_du = paired(lates, Policy::kDynamic, Policy::kUniform);
    if (!std::isnan(du)) d_minus_u[cell.schedule].push_back(du);
    if (!std::isnan(late_du)) late_d_minus_u[cell.schedule].push_back(late_du);
    if (!std::isnan(su)) sync_minus_u.push_back(su);
    absl::StrAppendFormat(
        &md, "| %d | %d | %s | %s | %s | %s | %s | %s | %s | %s / %s / %s | %s / %s / %s |\n",
        cell.replicas, cell.tau, ScheduleName(cell.schedule), final_text[Policy::kUniform],
        final_text[Policy::kDynamic], final_text[Policy::kSync], Maybe(du, "%+.2f"),
        Maybe(su, "%+.2f"), Maybe(late_du, "%+.2f"), time_text[Policy::kUniform],
        time_text[Policy::kDynamic], time_text[Policy::kSync], steps_text[Policy::kUniform],
        steps_text[Policy::kDynamic], steps_text[Policy::kSync]);
  }
  std::string means = "\nMean DYNAMIC - UNIFORM over the cells, in points of test accuracy:";
  for (Schedule s : {Schedule::kNone, Schedule::kStraggler, Schedule::kKill}) {
    auto it = d_minus_u.find(s);
    if (it == d_minus_u.end()) continue;
    const auto [lo, hi] = std::minmax_element(it->second.begin(), it->second.end());
    absl::StrAppendFormat(&means, " %s %+.2f (%+.2f..%+.2f, %d cells);", ScheduleName(s),
                          Mean(it->second), *lo, *hi, it->second.size());
  }
  absl::StrAppend(&means,
                  "\nThe same over the second half of each run (mean of its evaluations in "
                  "[T/2, T]):");
  for (Schedule s : {Schedule::kNone, Schedule::kStraggler, Schedule::kKill}) {
    auto it = late_d_minus_u.find(s);
    if (it == late_d_minus_u.end()) continue;
    const auto [lo, hi] = std::minmax_element(it->second.begin(), it->second.end());
    absl::StrAppendFormat(&means, " %s %+.2f (%+.2f..%+.2f);", ScheduleName(s), Mean(it->second),
                          *lo, *hi);
  }
  if (!sync_minus_u.empty()) {
    absl::StrAppendFormat(&means, " SYNC - UNIFORM over all cells %+.2f.", Mean(sync_minus_u));
  }
  const double real_step_ms =
      env.real_steps > 0 ? 1000 * env.real_step_seconds / env.real_steps : NAN;
  const double real_eval_ms =
      env.real_evals > 0 ? 1000 * env.real_eval_seconds / env.real_evals : NAN;
  const std::string footer = absl::StrFormat(
      "Final accuracy: center's test accuracy at T = %.1f s simulated (mean over %d seed(s)); D-U "
      "and SYNC-U paired per seed; 2nd-half D-U: the same for the mean accuracy over [T/2, T]. "
      "Time/steps to %s: first evaluation point (every %.2f s) at or "
      "above it; steps = mean local steps per trainer; '-' = not reached by T.\n"
      "Measured: %lld real steps, %.2f ms each (the simulation charges %d ms); %lld evaluations, "
      "%.1f ms each; %zu runs in %.1f min.\n",
      end_s, flags.seeds, target_text, end_s / flags.eval_points,
      static_cast<long long>(env.real_steps), real_step_ms, flags.step_ms,
      static_cast<long long>(env.real_evals), real_eval_ms, specs.size(), minutes);
  std::printf("\n%s%s\n\n%s", md.c_str(), means.c_str(), footer.c_str());

  absl::Status written = WriteFile(flags.out + "/summary.md", md + means + "\n\n" + footer);
  if (written.ok()) written = WriteFile(flags.out + "/runs.csv", runs_csv);
  if (!written.ok()) {
    std::fprintf(stderr, "convergence: %s\n", std::string(written.message()).c_str());
    all_ok = false;
  }
  std::printf("wrote %s/summary.md, %s/runs.csv and %zu run CSVs in %s\n", flags.out.c_str(),
              flags.out.c_str(), specs.size(), runs_dir.c_str());
  auto headline = [&](Schedule s, bool late = false) {
    const auto& by = late ? late_d_minus_u : d_minus_u;
    auto it = by.find(s);
    return it == by.end() ? std::string("nan") : absl::StrFormat("%+.2f", Mean(it->second));
  };
  const std::string sync_text =
      sync_minus_u.empty() ? "nan" : absl::StrFormat("%+.2f", Mean(sync_minus_u));
  std::printf(
      "RESULT convergence: kill_d_minus_u_pts=%s straggler_d_minus_u_pts=%s "
      "none_d_minus_u_pts=%s kill_late_d_minus_u_pts=%s straggler_late_d_minus_u_pts=%s "
      "sync_minus_uniform_pts=%s runs=%zu minutes=%.1f\n",
      headline(Schedule::kKill).c_str(), headline(Schedule::kStraggler).c_str(),
      headline(Schedule::kNone).c_str(), headline(Schedule::kKill, true).c_str(),
      headline(Schedule::kStraggler, true).c_str(), sync_text.c_str(), specs.size(), minutes);
  return all_ok ? 0 : 1;
}

}  // namespace
}  // namespace rebound::study

int main(int argc, char** argv) { return rebound::study::Main(argc, argv); }
