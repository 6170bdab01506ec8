// Goodput benchmark (R21, docs/design.md §13): the effective training time ratio (ETTR =
// failure-free time to the target accuracy / time to it with failures) of the policies users
// pick, side by side on the same job and the same failures, at several failure rates.
//
// Each run is bench/failures' (bench/time_to_target.h: the shipped job configs/job.pbtxt, 4
// trainers, an evaluator every 500 ms, on a real local cluster; t0 at the first sync). Failures:
// for each --mtbf_s rate m, kill times after t0 drawn once from a Poisson process of mean gap m
// (std::mt19937_64 seeded with --seed and m: the same times for every policy at that rate); kill
// k SIGKILLs the trainer of slot k % 4. Replacement machines: a warm pool of spares started
// before t0 (bench/time_to_target.h), one per kill expected within three failure-free times (at
// most 6), and a fresh spare at each kill past those. The policies:
//   replay               REPLAY (a spare waits from the start; verified replay)
//   global_checkpoint    GLOBAL_CHECKPOINT every --checkpoint_every_steps (64: the interval
//                        bench/failures' CheckFreq calibration chose on this machine)
//   restart_from_center  RESTART_FROM_CENTER with a spare waiting
//   drop                 torchft's answer, in Rebound's terms: RESTART_FROM_CENTER with no
//                        warm pool: the job goes on with R - 1 trainers (the dead slot's samples
//                        are not trained meanwhile) and the killed trainer's replacement, started
//                        at the kill, rejoins from the center once it has loaded its data (its
//                        start-up takes this 2-core machine's CPU from the trainers meanwhile,
//                        which a cluster's replacement machine would not: drop pays a little
//                        more here than it would there)
// A run's figures: time to target, ETTR against the failure-free run of the same repetition, the
// kills, the steps discarded, and the lost time by cause from the server's goodput accounts
// (GetStatus.goodput, docs/metrics.md#goodput): detect (failure to declaration), idle (LOST:
// deciding, waiting for a spare), restore (transfer, takeover), replay, rollback (steps thrown
// away, at the slot's step time).
//
// Last lines, one per rate:
//   RESULT goodput: mtbf_s=<m> ettr_replay=<..> ettr_checkpoint=<..> ettr_restart=<..>
//     ettr_drop=<..> server_ettr_replay=<..> ... server_ettr_drop=<..> kills=<n>
// server_ettr_*: the server's own ETTR of the run (GetStatus.ettr: productive slot time over all
// slot time, docs/metrics.md#goodput), which the machine's noise moves far less than the time to
// target; 1 for a run without a loss.
// (medians over --reps; a policy left out prints nan; a run that does not reach the target
// counts as ETTR 0). Exit code 0 when every run completed, 1 when one failed, 2 on bad flags.
//
// Flags: --mtbf_s=LIST (20,10,5) --policies=LIST (replay,global_checkpoint,restart_from_center,
// drop) --reps=N (1) --seed=N (1) --target=ACC (0.87) --checkpoint_every_steps=K (64)
// --eval_every_ms=MS (500) --max_seconds=S (180) --job=PATH --server_binary=PATH
// --worker_binary=PATH --keep_logs.

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/figures.h"
#include "bench/flags.h"
#include "bench/load_average.h"
#include "bench/local_cluster.h"
#include "bench/time_to_target.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"

namespace rebound::bench {
namespace {

constexpr char kJobId[] = "bench-goodput";
constexpr int kMaxPool = 6;

struct Policy {
  const char* key;
  const char* result_key;
  RecoveryPolicy policy;
  bool standing_spare;  // a warm pool of spares (false: the drop baseline, none)
};
constexpr Policy kPolicies[] = {
    {"replay", "replay", REPLAY, true},
    {"global_checkpoint", "checkpoint", GLOBAL_CHECKPOINT, true},
    {"restart_from_center", "restart", RESTART_FROM_CENTER, true},
    {"drop", "drop", RESTART_FROM_CENTER, false},
};

struct Flags {
  std::vector<double> mtbf_s = {20, 10, 5};
  std::vector<const Policy*> policies = {&kPolicies[0], &kPolicies[1], &kPolicies[2],
                                         &kPolicies[3]};
  int reps = 1;
  int seed = 1;
  double target = 0.87;
  int checkpoint_every_steps = 64;
  int eval_every_ms = 500;
  int max_seconds = 180;
  ClusterFlags cluster;
};

constexpr char kUsage[] =
    "usage: goodput [--mtbf_s=20,10,5] [--policies=replay,global_checkpoint,restart_from_center,"
    "drop] [--reps=N] [--seed=N] [--target=ACC] [--checkpoint_every_steps=K] "
    "[--eval_every_ms=MS] [--max_seconds=S] [--job=PATH] [--server_binary=PATH] "
    "[--worker_binary=PATH] [--keep_logs]";

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  CommandLine command_line(kUsage);
  command_line.AddCustom("mtbf_s", [&](const std::string& value) {
    flags.mtbf_s.clear();
    for (absl::string_view part : absl::StrSplit(value, ',', absl::SkipEmpty())) {
      double m = 0;
      if (!absl::SimpleAtod(part, &m) || !(m >= 1)) {
        command_line.Usage(absl::StrCat("--mtbf_s: '", part, "' is not a number >= 1"));
      }
      flags.mtbf_s.push_back(m);
    }
  });
  command_line.AddCustom("policies", [&](const std::string& value) {
    flags.policies.clear();
    for (absl::string_view key : absl::StrSplit(value, ',', absl::SkipEmpty())) {
      const Policy* found = nullptr;
      for (const Policy& p : kPolicies) {
        if (key == p.key) found = &p;
      }
      if (found == nullptr) {
        command_line.Usage(absl::StrCat("--policies: unknown policy '", key,
                                        "' (replay, global_checkpoint, restart_from_center, "
                                        "drop)"));
      }
      flags.policies.push_back(found);
    }
  });
  command_line.AddInt("reps", &flags.reps);
  command_line.AddInt("seed", &flags.seed);
  command_line.AddCustom("target", [&](const std::string& value) {
    if (!absl::SimpleAtod(value, &flags.target)) command_line.Usage("--target: not a number");
  });
  command_line.AddInt("checkpoint_every_steps", &flags.checkpoint_every_steps);
  command_line.AddInt("eval_every_ms", &flags.eval_every_ms);
  command_line.AddInt("max_seconds", &flags.max_seconds);
  flags.cluster.AddTo(&command_line);
  command_line.Parse(argc, argv);
  if (flags.mtbf_s.empty()) command_line.Usage("--mtbf_s is empty");
  if (flags.policies.empty()) command_line.Usage("--policies is empty");
  if (flags.reps < 1) command_line.Usage("--reps must be >= 1");
  if (!(flags.target > 0.0 && flags.target < 1.0)) command_line.Usage("--target must be in (0, 1)");
  if (flags.checkpoint_every_steps < 1) command_line.Usage("--checkpoint_every_steps must be >= 1");
  if (flags.eval_every_ms < 100) command_line.Usage("--eval_every_ms must be >= 100");
  if (flags.max_seconds < 1) command_line.Usage("--max_seconds must be >= 1");
  return flags;
}

// Kill times after t0 (seconds) of a Poisson process with mean gap `mtbf_s`, up to `horizon_s`.
std::vector<double> KillTimes(double mtbf_s, int seed, int rep, double horizon_s) {
  std::mt19937_64 rng(static_cast<uint64_t>(seed) * 1000003u +
                      static_cast<uint64_t>(std::llround(mtbf_s * 1000)) * 7919u +
                      static_cast<uint64_t>(rep));
  std::exponential_distribution<double> gap(1.0 / mtbf_s);
  std::vector<double> times;
  for (double t = gap(rng); t < horizon_s; t += gap(rng)) times.push_back(t);
  return times;
}

std::string Lost(const GetStatusResponse& s) {
  const SlotGoodput& g = s.goodput();
  return absl::StrFormat(
      "lost: detect %.2f s, idle %.2f s, restore %.2f s, replay %.2f s, rollback %.2f s (%lld "
      "steps discarded); server's ETTR %.3f",
      g.detect_seconds(), g.idle_seconds(), g.restore_seconds(), g.replay_seconds(),
      g.rollback_seconds(), static_cast<long long>(g.steps_discarded()), s.ettr());
}

int Main(int argc, char** argv) {
  Flags flags = ParseFlags(argc, argv);
  absl::StatusOr<JobConfig> base_job = ResolveClusterFlags(&flags.cluster);
  if (!base_job.ok()) ExitWithUsage(std::string(base_job.status().message()), kUsage);
  const JobConfig& base = *base_job;
  if (flags.checkpoint_every_steps % base.easgd().sync_period() != 0) {
    ExitWithUsage(absl::StrCat("--checkpoint_every_steps must be a multiple of the job's "
                               "easgd.sync_period, ",
                               base.easgd().sync_period()),
                  kUsage);
  }
  absl::StatusOr<RunDirectories> dirs = RunDirectories::Create("goodput", flags.cluster.keep_logs);
  if (!dirs.ok()) {
    std::fprintf(stderr, "%s\n", std::string(dirs.status().message()).c_str());
    return 1;
  }
  TimeToTargetOptions options;
  options.job_id = kJobId;
  options.target = flags.target;
  options.eval_every_ms = flags.eval_every_ms;
  options.max_seconds = flags.max_seconds;
  options.cluster = flags.cluster;
  std::printf("goodput benchmark: time to %.2f test accuracy of %s (%d trainers, tau %d, "
              "heartbeat %d ms, failure_timeout %d ms, crash_confirm %d ms), failure-free and "
              "with trainers SIGKILLed at a mean time between failures of %s s (seed %d); "
              "GLOBAL_CHECKPOINT every %d steps; %d repetition(s); %d cores online, load %.2f; "
              "logs in %s\n\n",
              flags.target, flags.cluster.job.c_str(), base.topology().replicas(),
              base.easgd().sync_period(), base.fault_tolerance().heartbeat_interval_ms(),
              base.fault_tolerance().failure_timeout_ms(),
              base.fault_tolerance().crash_confirm_ms(), JoinFigures(flags.mtbf_s, 0).c_str(),
              flags.seed, flags.checkpoint_every_steps, flags.reps,
              static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)), LoadAverage(),
              dirs->path().c_str());
  std::fflush(stdout);

  bool all_ok = true;
  // ettr[mtbf][policy key] over the repetitions (time to target), and the server's (its goodput
  // accounts: slot time, which the machine's noise moves far less); kills per rate.
  std::map<double, std::map<std::string, std::vector<double>>> ettr, server_ettr;
  std::map<double, int> kills;
  for (int rep = 0; rep < flags.reps && all_ok; ++rep) {
    RunSpec ff{RunKind::kFailureFree, REPLAY, rep};
    const std::string ff_dir = dirs->StartRun(absl::StrCat("rep", rep, "-failure-free"));
    const RunResult free = ExecuteRun(options, base, ff_dir, ff);
    dirs->FinishRun(ff_dir, free.ok);
    if (!free.ok || !free.reached) {
      std::printf("rep %d FAILURE-FREE: %s\n", rep,
                  free.ok ? "the target was not reached" : free.error.c_str());
      all_ok = false;
      break;
    }
    std::printf("rep %d FAILURE-FREE: %s; %s\n", rep, Seconds(free.seconds).c_str(),
                Lost(free.final_status).c_str());
    std::fflush(stdout);
    for (double mtbf : flags.mtbf_s) {
      const std::vector<double> times = KillTimes(mtbf, flags.seed, rep, flags.max_seconds);
      for (const Policy* policy : flags.policies) {
        // The warm pool: the job's spare and a replacement for each kill expected within three
        // failure-free times (at most kMaxPool); later kills start their replacement at once.
        const int expected = static_cast<int>(
            std::count_if(times.begin(), times.end(),
                          [&](double t) { return t < 3 * free.seconds; }));
        RunSpec spec{RunKind::kWithFailures, policy->policy, rep,
                     policy->policy == GLOBAL_CHECKPOINT ? flags.checkpoint_every_steps : 0,
                     times, policy->standing_spare ? 1 + std::min(expected, kMaxPool) : 0};
        const std::string dir =
            dirs->StartRun(absl::StrCat("rep", rep, "-mtbf", mtbf, "-", policy->key));
        const RunResult r = ExecuteRun(options, base, dir, spec);
        dirs->FinishRun(dir, r.ok);
        if (!r.ok) {
          std::printf("rep %d mtbf %.0f s %-20s FAILED: %s\n", rep, mtbf, policy->key,
                      r.error.c_str());
          all_ok = false;
          continue;
        }
        const double e = r.reached ? free.seconds / r.seconds : 0.0;
        ettr[mtbf][policy->result_key].push_back(e);
        server_ettr[mtbf][policy->result_key].push_back(
            r.final_status.has_ettr() ? r.final_status.ettr() : 1.0);
        kills[mtbf] = std::max(kills[mtbf], static_cast<int>(r.kills.size()));
        std::printf("rep %d mtbf %3.0f s %-20s %s: ETTR %.3f; %zu kills (%s); %s; load %.2f\n",
                    rep, mtbf, policy->key, Seconds(r.seconds).c_str(), e, r.kills.size(),
                    DescribeKills(r.kills).c_str(), Lost(r.final_status).c_str(), r.load);
        std::printf("    recoveries: %s\n", DescribeRecoveries(r.final_status).c_str());
        std::fflush(stdout);
      }
    }
  }
  dirs->Finish();
  std::printf("\nETTR by mean time between failures (median over %d repetition(s)):\n",
              flags.reps);
  for (double mtbf : flags.mtbf_s) {
    std::string line = absl::StrFormat("RESULT goodput: mtbf_s=%.0f", mtbf);
    for (const Policy& p : kPolicies) {
      const auto it = ettr[mtbf].find(p.result_key);
      absl::StrAppendFormat(&line, " ettr_%s=%.3f", p.result_key,
                            it == ettr[mtbf].end() ? NAN : Median(it->second));
    }
    for (const Policy& p : kPolicies) {
      const auto it = server_ettr[mtbf].find(p.result_key);
      absl::StrAppendFormat(&line, " server_ettr_%s=%.3f", p.result_key,
                            it == server_ettr[mtbf].end() ? NAN : Median(it->second));
    }
    absl::StrAppendFormat(&line, " kills=%d", kills[mtbf]);
    std::printf("%s\n", line.c_str());
  }
  return all_ok ? 0 : 1;
}

}  // namespace
}  // namespace rebound::bench

int main(int argc, char** argv) { return rebound::bench::Main(argc, argv); }
