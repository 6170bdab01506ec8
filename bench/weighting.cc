// Reliability-weighting benchmark (docs/design.md §9: "test accuracy with one faulty trainer (stale,
// corrupted data, restarted from scratch) against UNIFORM weights: never worse; >= 0.5 pt better
// for corrupted and restarted").
//
// Runs the shipped job (configs/job.pbtxt) on a real local cluster on loopback: one
// rebound_server (inline job, in-memory state), 4 rebound_worker trainers started one after the
// other (so trainer i owns slot i) and one evaluator. Trainer 3 is faulty in one of three ways:
//   a  straggler: frozen with SIGSTOP for --stall_ms every --stall_period_ms (below
//      failure_timeout_ms), then resumed with SIGCONT, so it returns stale;
//   b  corrupted data: --fault_label_permutation_seed (its labels are permuted);
//   c  restarted from scratch: --fault_reset_every_steps=--reset_every_steps;
// plus "none", the fault-free reference. Each (scenario, policy, seed) run trains for the same wall
// time, --seconds, counted from the moment every slot has synced once. At that moment every
// trainer is frozen with SIGSTOP, so the center stops moving, and the accuracy reported is the
// evaluator's test accuracy (full Fashion-MNIST test set) of exactly that center version. DYNAMIC
// and UNIFORM run back to back for each scenario and seed (their order alternating with the seed)
// so that a change in machine load hits both alike; the center version reached at T and the load
// average are printed per run to show it.
//
// Overrides of the shipped job: job_id "bench-weighting"; topology.replicas 4, spares 0 (the
// benchmark starts the evaluator itself); training.max_steps 10^9 (the runs are bounded by wall
// time, not steps); training.eval_every_ms --eval_every_ms; weighting.policy per run; seed k of
// --seeds adds k to data.seed and model.init_seed. Everything else is the shipped job.
//
// Prints a line per run, a table scenario x policy (mean test accuracy, min..max over seeds,
// DYNAMIC - UNIFORM in points, paired per seed), the weighting inputs the server measured for
// the faulty slot, the verdict against the targets, and last
//   RESULT weighting: scenario_b_dynamic=<x> scenario_b_uniform=<y> ratio=<x/y>
// Exit code 0 when every run completed (whatever the verdict), 1 when a run failed, 2 on bad flags.
//
// Flags (--name=value or --name value): --seconds=S (40) --seeds=N (3) --scenarios=LIST
// (none,a,b,c) --stall_ms (1500) --stall_period_ms (4000) --reset_every_steps (400)
// --eval_every_ms (1000) --job=PATH (configs/job.pbtxt from the runfiles) --server_binary=PATH
// --worker_binary=PATH --keep_logs (keep every run's directory; failed runs are always kept).

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/flags.h"
#include "bench/local_cluster.h"
#include "bench/load_average.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"

namespace rebound::bench {
namespace {

constexpr int kTrainers = 4;
constexpr int kFaultyTrainer = 3;
constexpr absl::Duration kSettleTime = absl::Milliseconds(300);
constexpr absl::Duration kFinalEvalWait = absl::Seconds(60);
constexpr absl::Duration kSamplePeriod = absl::Seconds(1);
constexpr absl::Duration kTick = absl::Milliseconds(20);
// Per-run cost besides --seconds (start, data loading, first syncs, final eval, stop), measured
// on 2 shared cores; only used for the time estimate printed at the start.
constexpr double kOverheadSecondsEstimate = 7.0;

// ---------------------------------------------------------------------------------------------
// Flags

enum class Scenario { kNone, kStraggler, kCorrupted, kRestarted };

const char* ScenarioKey(Scenario s) {
  switch (s) {
    case Scenario::kNone: return "none";
    case Scenario::kStraggler: return "a";
    case Scenario::kCorrupted: return "b";
    case Scenario::kRestarted: return "c";
  }
  return "?";
}

const char* ScenarioName(Scenario s) {
  switch (s) {
    case Scenario::kNone: return "fault-free";
    case Scenario::kStraggler: return "a straggler";
    case Scenario::kCorrupted: return "b corrupted labels";
    case Scenario::kRestarted: return "c restarted from scratch";
  }
  return "?";
}

struct Flags {
  int seconds = 40;
  int seeds = 3;
  std::vector<Scenario> scenarios = {Scenario::kNone, Scenario::kStraggler, Scenario::kCorrupted,
                                     Scenario::kRestarted};
  int stall_ms = 1500;
  int stall_period_ms = 4000;
  int reset_every_steps = 400;
  int eval_every_ms = 1000;
  ClusterFlags cluster;  // --job, --server_binary, --worker_binary, --keep_logs
};

constexpr char kUsage[] =
    "usage: weighting [--seconds=S] [--seeds=N] [--scenarios=none,a,b,c] [--stall_ms=MS] "
    "[--stall_period_ms=MS] [--reset_every_steps=N] [--eval_every_ms=MS] [--job=PATH] "
    "[--server_binary=PATH] [--worker_binary=PATH] [--keep_logs]";

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  CommandLine command_line(kUsage);
  command_line.AddInt("seconds", &flags.seconds);
  command_line.AddInt("seeds", &flags.seeds);
  command_line.AddInt("stall_ms", &flags.stall_ms);
  command_line.AddInt("stall_period_ms", &flags.stall_period_ms);
  command_line.AddInt("reset_every_steps", &flags.reset_every_steps);
  command_line.AddInt("eval_every_ms", &flags.eval_every_ms);
  flags.cluster.AddTo(&command_line);
  command_line.AddCustom("scenarios", [&](const std::string& value) {
    flags.scenarios.clear();
    for (absl::string_view key : absl::StrSplit(value, ',', absl::SkipEmpty())) {
      Scenario scenario;
      if (key == "none") scenario = Scenario::kNone;
      else if (key == "a") scenario = Scenario::kStraggler;
      else if (key == "b") scenario = Scenario::kCorrupted;
      else if (key == "c") scenario = Scenario::kRestarted;
      else command_line.Usage(
          absl::StrCat("--scenarios: unknown scenario '", key, "' (none, a, b, c)"));
      flags.scenarios.push_back(scenario);
    }
  });
  command_line.Parse(argc, argv);
  if (flags.seconds < 1) command_line.Usage("--seconds must be >= 1");
  if (flags.seeds < 1) command_line.Usage("--seeds must be >= 1");
  if (flags.scenarios.empty()) command_line.Usage("--scenarios is empty");
  if (flags.stall_ms < 1 || flags.stall_period_ms <= flags.stall_ms) {
    command_line.Usage("need 0 < --stall_ms < --stall_period_ms");
  }
  if (flags.reset_every_steps < 1) command_line.Usage("--reset_every_steps must be >= 1");
  if (flags.eval_every_ms < 100) command_line.Usage("--eval_every_ms must be >= 100");
  return flags;
}

// ---------------------------------------------------------------------------------------------
// One run

struct RunSpec {
  Scenario scenario;
  WeightingPolicy policy;
  int seed;  // index in [0, --seeds)
};

struct RunResult {
  bool ok = false;
  std::string error;
  double accuracy = 0.0;       // of the center at T, in [0, 1]
  int64_t center_version = 0;  // at T
  int64_t eval_version = 0;    // the version the accuracy was measured on
  std::vector<int64_t> steps;  // per slot, at T
  double seconds_to_first_sync = 0.0;
  double load = 0.0;  // mean 1-minute load average during the run
  // Means over the status samples of the run (one a second) of the faulty slot's weight inputs,
  // and of the other slots' weights.
  WeightInputs faulty;  // means
  double faulty_fault_max = 0.0;
  double healthy_weight = 0.0;
  int samples = 0;
};

class Run {
 public:
  Run(const Flags& flags, const JobConfig& base_job, const std::string& dir, const RunSpec& spec)
      : flags_(flags), base_job_(base_job), spec_(spec), cluster_(flags.cluster, dir) {}

  RunResult Execute() {
    RunResult result;
    const absl::Status status = Train(&result);
    // SIGTERM (SIGKILL after a bound) to the trainers and the evaluator, then the server. Frozen
    // trainers may have been fenced meanwhile and exit 3; that is expected.
    cluster_.StopAll(result.ok, [&result](const ChildProcess& worker, int code) {
      if (code != 0 && code != 3 && result.ok) {
        std::fprintf(stderr, "note: %s exited with code %d\n", worker.log_path().c_str(), code);
      }
    });
    if (!status.ok()) {
      result.ok = false;
      result.error = std::string(status.message());
    }
    return result;
  }

 private:
  JobConfig Job() const {
    JobConfig job = base_job_;
    job.set_job_id("bench-weighting");
    job.mutable_topology()->set_replicas(kTrainers);
    job.mutable_topology()->set_spares(0);
    job.mutable_topology()->set_evaluator(true);
    job.mutable_training()->set_max_steps(1000000000);
    job.mutable_training()->set_eval_every_ms(flags_.eval_every_ms);
    job.mutable_weighting()->set_policy(spec_.policy);
    job.mutable_data()->set_seed(base_job_.data().seed() + spec_.seed);
    job.mutable_model()->set_init_seed(base_job_.model().init_seed() + spec_.seed);
    return job;
  }

  std::vector<std::string> FaultFlags() const {
    switch (spec_.scenario) {
      case Scenario::kCorrupted:
        return {absl::StrCat("--fault_label_permutation_seed=", 1 + spec_.seed)};
      case Scenario::kRestarted:
        return {absl::StrCat("--fault_reset_every_steps=", flags_.reset_every_steps)};
      case Scenario::kNone:
      case Scenario::kStraggler:
        return {};
    }
    return {};
  }

  absl::Status Train(RunResult* result) {
    const absl::Time started = absl::Now();
    if (absl::Status s = cluster_.StartServer(Job()); !s.ok()) return s;
    // One trainer at a time, so that trainer i owns slot i (the server hands out the lowest free
    // slot): the faulty trainer 3 trains the same data shard under both policies.
    auto extra_flags = [this](int trainer) {
      return trainer == kFaultyTrainer ? FaultFlags() : std::vector<std::string>{};
    };
    if (absl::Status s = cluster_.StartTrainers(kTrainers, extra_flags); !s.ok()) return s;
    if (absl::Status s = cluster_.StartEvaluator(); !s.ok()) return s;
    if (absl::Status s = cluster_.WaitForFirstSyncs(kTrainers); !s.ok()) return s;

    // The measured window: --seconds of training from now.
    const absl::Time t0 = absl::Now();
    result->seconds_to_first_sync = absl::ToDoubleSeconds(t0 - started);
    const absl::Time end = t0 + absl::Seconds(flags_.seconds);
    const absl::Duration stall = absl::Milliseconds(flags_.stall_ms);
    const absl::Duration period = absl::Milliseconds(flags_.stall_period_ms);
    const ChildProcess& faulty = *cluster_.trainers()[kFaultyTrainer];
    bool frozen = false;
    absl::Time next_sample = t0 + kSamplePeriod;
    LoadAverageMeter load;
    double sums[5] = {0, 0, 0, 0, 0};  // w, s, l, d of the faulty slot; healthy w
    const absl::Status watched = cluster_.Watch(end, kTick, [&](absl::Time now) {
      if (spec_.scenario == Scenario::kStraggler) {
        // Runs for period - stall, then frozen for stall, over and over.
        const absl::Duration phase = (now - t0) % period;
        const bool freeze = phase >= period - stall;
        if (freeze != frozen) {
          faulty.Signal(freeze ? SIGSTOP : SIGCONT);
          frozen = freeze;
        }
      }
      if (now >= next_sample) {
        next_sample += kSamplePeriod;
        load.Sample();
        absl::StatusOr<GetStatusResponse> status = cluster_.GetStatus();
        if (status.ok() && status->slots_size() == kTrainers) {
          const WeightInputs& in = status->slots(kFaultyTrainer).weight();
          sums[0] += in.weight();
          sums[1] += in.staleness();
          sums[2] += in.lateness();
          sums[3] += in.divergence();
          result->faulty_fault_max = std::max(result->faulty_fault_max, in.fault_score());
          double healthy = 0.0;
          for (int r = 0; r < kTrainers; ++r) {
            if (r != kFaultyTrainer) healthy += status->slots(r).weight().weight();
          }
          sums[4] += healthy / (kTrainers - 1);
          ++result->samples;
        }
      }
    });
    if (!watched.ok()) return watched;

    // T: freeze every trainer, so the center stops moving, and let syncs already in flight land.
    for (const auto& trainer : cluster_.trainers()) trainer->Signal(SIGSTOP);
    absl::SleepFor(kSettleTime);
    absl::StatusOr<GetStatusResponse> at_t = cluster_.GetStatus();
    if (!at_t.ok()) return at_t.status();
    result->center_version = at_t->centers(0).version();
    for (const SlotStatus& slot : at_t->slots()) result->steps.push_back(slot.step());
    if (result->samples > 0) {
      result->faulty.set_weight(sums[0] / result->samples);
      result->faulty.set_staleness(sums[1] / result->samples);
      result->faulty.set_lateness(sums[2] / result->samples);
      result->faulty.set_divergence(sums[3] / result->samples);
      result->healthy_weight = sums[4] / result->samples;
    }
    result->load = load.Mean();

    // The evaluator's report on exactly this center. The trainers stay frozen past
    // failure_timeout_ms if the evaluation takes that long; the server then fences them, which
    // changes nothing in the center.
    const int64_t version = result->center_version;
    auto evaluated = cluster_.WaitForStatus(
        [version](const GetStatusResponse& s) {
          return s.has_last_eval() && s.last_eval().center_version() >= version;
        },
        kFinalEvalWait, absl::StrCat("the evaluator to report center version ", version));
    if (!evaluated.ok()) return evaluated.status();
    result->eval_version = evaluated->last_eval().center_version();
    result->accuracy = evaluated->last_eval().test_accuracy();
    result->ok = true;
    return absl::OkStatus();
  }

  const Flags& flags_;
  const JobConfig& base_job_;
  const RunSpec spec_;
  LocalCluster cluster_;
};

// ---------------------------------------------------------------------------------------------
// Summary

struct Stats {
  double mean = 0.0;
  double min = 0.0;
  double max = 0.0;
  int n = 0;
};

Stats Summarize(const std::vector<double>& values) {
  Stats stats;
  if (values.empty()) return stats;
  stats.n = static_cast<int>(values.size());
  stats.min = *std::min_element(values.begin(), values.end());
  stats.max = *std::max_element(values.begin(), values.end());
  for (double v : values) stats.mean += v;
  stats.mean /= stats.n;
  return stats;
}

const char* PolicyName(WeightingPolicy policy) {
  return policy == DYNAMIC ? "DYNAMIC" : "UNIFORM";
}

int Main(int argc, char** argv) {
  Flags flags = ParseFlags(argc, argv);
  absl::StatusOr<JobConfig> base_job = ResolveClusterFlags(&flags.cluster);
  if (!base_job.ok()) ExitWithUsage(std::string(base_job.status().message()), kUsage);
  absl::StatusOr<RunDirectories> dirs =
      RunDirectories::Create("weighting", flags.cluster.keep_logs);
  if (!dirs.ok()) {
    std::fprintf(stderr, "%s\n", std::string(dirs.status().message()).c_str());
    return 1;
  }
  const std::string& workdir = dirs->path();

  std::vector<RunSpec> specs;
  for (int seed = 0; seed < flags.seeds; ++seed) {
    for (Scenario scenario : flags.scenarios) {
      // DYNAMIC first on even seeds, UNIFORM first on odd ones: a drift in load hits both.
      const WeightingPolicy first = seed % 2 == 0 ? DYNAMIC : UNIFORM;
      const WeightingPolicy second = first == DYNAMIC ? UNIFORM : DYNAMIC;
      specs.push_back({scenario, first, seed});
      specs.push_back({scenario, second, seed});
    }
  }

  const JobConfig& job = *base_job;
  std::printf("weighting benchmark: DYNAMIC vs UNIFORM reliability weights, test accuracy of the "
              "EASGD center after the same wall time\n");
  std::printf("job: %s (%s), MLP %d", flags.cluster.job.c_str(), job.job_id().c_str(),
              job.model().input_dim());
  for (const LayerSpec& layer : job.model().layers()) std::printf("-%d", layer.width());
  std::printf(", batch %d, tau %d, lr %g, failure_timeout %d ms, %d trainers + 1 evaluator "
              "(eval every %d ms) on loopback\n",
              job.data().batch_size(), job.easgd().sync_period(), job.adahessian().lr(),
              job.fault_tolerance().failure_timeout_ms(), kTrainers, flags.eval_every_ms);
  std::printf("faulty trainer %d: a SIGSTOP %d ms every %d ms; b labels permuted; c restarted "
              "from scratch every %d steps\n",
              kFaultyTrainer, flags.stall_ms, flags.stall_period_ms, flags.reset_every_steps);
  std::printf("%zu runs of %d s after every slot's first sync, seeds 0..%d (data.seed %llu+k, "
              "init_seed %llu+k); about %.0f min; %d cores online, load %.2f; logs in %s\n\n",
              specs.size(), flags.seconds, flags.seeds - 1,
              static_cast<unsigned long long>(job.data().seed()),
              static_cast<unsigned long long>(job.model().init_seed()),
              specs.size() * (flags.seconds + kOverheadSecondsEstimate) / 60.0,
              static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)), LoadAverage(), workdir.c_str());
  std::fflush(stdout);

  const absl::Time study_start = absl::Now();
  std::map<std::pair<Scenario, WeightingPolicy>, std::map<int, RunResult>> results;
  for (const RunSpec& spec : specs) {
    const std::string dir = dirs->StartRun(absl::StrCat(
        ScenarioKey(spec.scenario), "-", PolicyName(spec.policy), "-seed", spec.seed));
    const absl::Time run_start = absl::Now();
    RunResult result = Run(flags, job, dir, spec).Execute();
    const double run_seconds = absl::ToDoubleSeconds(absl::Now() - run_start);
    dirs->FinishRun(dir, result.ok);
    if (!result.ok) {
      std::printf("%-4s %-7s seed %d: FAILED after %.0f s: %s\n  (logs in %s)\n",
                  ScenarioKey(spec.scenario), PolicyName(spec.policy), spec.seed, run_seconds,
                  result.error.c_str(), dir.c_str());
      std::fflush(stdout);
      continue;
    }
    std::printf("%-4s %-7s seed %d: accuracy %.4f (center v%lld at T, evaluated v%lld); steps "
                "%s; faulty slot: w %.3f s %.2f l %.2f d %.2f f<=%.2f, others' w %.3f; "
                "load %.2f; %.0f s (%.0f s to first syncs)\n",
                ScenarioKey(spec.scenario), PolicyName(spec.policy), spec.seed, result.accuracy,
                static_cast<long long>(result.center_version),
                static_cast<long long>(result.eval_version), absl::StrJoin(result.steps, "/").c_str(),
                result.faulty.weight(), result.faulty.staleness(), result.faulty.lateness(),
                result.faulty.divergence(), result.faulty_fault_max, result.healthy_weight,
                result.load, run_seconds, result.seconds_to_first_sync);
    std::fflush(stdout);
    results[{spec.scenario, spec.policy}][spec.seed] = std::move(result);
  }
  const double study_minutes = absl::ToDoubleMinutes(absl::Now() - study_start);

  // The table.
  std::printf("\ntest accuracy of the center after %d s (mean over seeds, min..max), %d seed(s); "
              "study took %.1f min\n",
              flags.seconds, flags.seeds, study_minutes);
  std::printf("%-26s %-8s %8s  %-15s %8s  %-24s %s\n", "scenario", "policy", "mean", "min..max",
              "D-U pts", "paired D-U per seed, pts", "slot 3: mean w / s / l / d, f max");
  double b_dynamic = NAN, b_uniform = NAN;
  std::vector<std::string> verdicts;
  double none_mean = NAN;
  for (Scenario scenario : flags.scenarios) {
    std::map<WeightingPolicy, Stats> stats;
    for (WeightingPolicy policy : {DYNAMIC, UNIFORM}) {
      std::vector<double> values;
      for (const auto& [seed, r] : results[{scenario, policy}]) values.push_back(r.accuracy);
      stats[policy] = Summarize(values);
    }
    // Paired differences over the seeds where both runs completed.
    std::vector<double> paired;
    for (const auto& [seed, d] : results[{scenario, DYNAMIC}]) {
      auto u = results[{scenario, UNIFORM}].find(seed);
      if (u != results[{scenario, UNIFORM}].end()) {
        paired.push_back(100.0 * (d.accuracy - u->second.accuracy));
      }
    }
    const bool both = stats[DYNAMIC].n > 0 && stats[UNIFORM].n > 0;
    const double diff = both ? 100.0 * (stats[DYNAMIC].mean - stats[UNIFORM].mean) : NAN;
    for (WeightingPolicy policy : {DYNAMIC, UNIFORM}) {
      const Stats& s = stats[policy];
      WeightInputs mean_inputs;
      double fault_max = 0.0;
      for (const auto& [seed, r] : results[{scenario, policy}]) {
        mean_inputs.set_weight(mean_inputs.weight() + r.faulty.weight() / s.n);
        mean_inputs.set_staleness(mean_inputs.staleness() + r.faulty.staleness() / s.n);
        mean_inputs.set_lateness(mean_inputs.lateness() + r.faulty.lateness() / s.n);
        mean_inputs.set_divergence(mean_inputs.divergence() + r.faulty.divergence() / s.n);
        fault_max = std::max(fault_max, r.faulty_fault_max);
      }
      const bool first_row = policy == DYNAMIC;
      const std::string paired_text =
          first_row ? absl::StrJoin(paired, " ", [](std::string* out, double v) {
            absl::StrAppend(out, absl::StrFormat("%+.2f", v));
          })
                    : "";
      if (s.n == 0) {
        std::printf("%-26s %-8s %8s\n", first_row ? ScenarioName(scenario) : "",
                    PolicyName(policy), "no runs");
        continue;
      }
      std::printf("%-26s %-8s %8.4f  %.4f..%.4f  %8s  %-24s %.3f / %.2f / %.2f / %.2f, %.2f\n",
                  first_row ? ScenarioName(scenario) : "", PolicyName(policy), s.mean, s.min,
                  s.max, first_row && both ? absl::StrFormat("%+.2f", diff).c_str() : "",
                  paired_text.c_str(), mean_inputs.weight(), mean_inputs.staleness(),
                  mean_inputs.lateness(), mean_inputs.divergence(), fault_max);
    }
    if (scenario == Scenario::kNone && both) {
      none_mean = (stats[DYNAMIC].mean + stats[UNIFORM].mean) / 2;
    }
    if (scenario == Scenario::kCorrupted) {
      if (stats[DYNAMIC].n > 0) b_dynamic = stats[DYNAMIC].mean;
      if (stats[UNIFORM].n > 0) b_uniform = stats[UNIFORM].mean;
    }
    if (!both) continue;
    // Target: never worse, read as "DYNAMIC's mean is not below UNIFORM's by more than the
    // seeds' spread (the larger min..max range of the two policies)"; >= +0.5 pt for b and c.
    const double spread =
        100.0 * std::max(stats[DYNAMIC].max - stats[DYNAMIC].min,
                         stats[UNIFORM].max - stats[UNIFORM].min);
    const bool never_worse = diff >= -spread;
    std::string verdict = absl::StrFormat(
        "%-26s D-U %+.2f pts (spread %.2f pts): never worse %s", ScenarioName(scenario), diff,
        spread, never_worse ? "MET" : "MISSED");
    if (scenario == Scenario::kCorrupted || scenario == Scenario::kRestarted) {
      absl::StrAppend(&verdict, absl::StrFormat("; >= +0.5 pt better %s",
                                                diff >= 0.5 ? "MET" : "MISSED"));
    } else if (scenario == Scenario::kNone) {
      verdict = absl::StrFormat("%-26s D-U %+.2f pts (spread %.2f pts): reference, no target",
                                ScenarioName(scenario), diff, spread);
    }
    verdicts.push_back(verdict);
  }
  if (!std::isnan(none_mean)) {
    std::printf("fault-free reference (both policies): %.4f\n", none_mean);
  }
  std::printf("(slot 3 is the faulty trainer's, healthy in the fault-free runs; its weight inputs "
              "as GetStatus showed them once a second: w applied (1 under UNIFORM), s staleness, "
              "l lateness, d divergence, f fault score)\n");
  std::printf("\nverdict against docs/design.md §9 (DYNAMIC never worse than UNIFORM within the seeds' "
              "spread; >= 0.5 pt better for b and c):\n");
  for (const std::string& verdict : verdicts) std::printf("  %s\n", verdict.c_str());
  dirs->Finish();
  std::printf("RESULT weighting: scenario_b_dynamic=%.4f scenario_b_uniform=%.4f ratio=%.4f\n",
              b_dynamic, b_uniform, b_dynamic / b_uniform);
  return dirs->all_ok() ? 0 : 1;
}

}  // namespace
}  // namespace rebound::bench

int main(int argc, char** argv) {
  return rebound::bench::Main(argc, argv);
}
