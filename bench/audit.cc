// Audit replay benchmark (R22, docs/design.md §14, docs/recovery.md#audits): how soon audits catch
// a machine that silently computes wrong, and what they cost a job that has no such machine.
//
// A real local cluster on loopback: one rebound_server, 2 rebound_worker trainers of the shipped
// job (configs/job.pbtxt) and ONE spare, the only auditor (so a mismatch is confirmed by the
// same spare again, after the server's 2 s grace for another).
//
//  * Detection, one run per --fractions value: trainer-1 flips one bit of one parameter after
//    step --first_flip and every --flip_every steps after it (--fault_flip_bit_at_step and
//    --fault_flip_bit_repeat_every: a faulty machine; each flip is an independent corruption of
//    one sync window); trainer-0 is healthy. Audits AUDIT_REPORT with audit.fraction = f. The
//    run lasts until trainer-1 reaches --steps; the flips at steps <= --steps - --horizon count
//    as injected (each has --horizon steps to be caught). GetStatus is polled every 50 ms: a
//    confirmed mismatch (AUDIT_CONFIRMED) names the step that differs, which is a flip's step;
//    its detection latency is trainer-1's step when the verdict is first seen minus that step.
//    A false report is any confirmed mismatch of trainer-0, or at a step that is not a flip, or
//    any auditor fault.
//  * Cost, --throughput_reps pairs: the same job without a flip, trainers' steps per second from
//    both slots' step 2 x sync_period to the job's end (--steps), audits off (fraction 0: the
//    spare idles) and on (fraction --cost_fraction), interleaved; the ratio of the medians.
//
// Per fraction, a line:
//   RESULT audit: fraction=<f> injected=<n> detected=<d> median_detect_steps=<m>
//     p_detect_1000=<p> false_reports=<x> throughput_ratio=<r>
// p_detect_1000 is measured: the share of injected flips followed, within 1,000 steps, by a
// confirmed mismatch of trainer-1 (this flip's or a later one's): the chance that a machine
// that flips a bit every --flip_every steps is caught within 1,000 steps of one of its flips.
// throughput_ratio is the cost pair's (the same on every line). The bar (R22) reads the 5% line:
// every injected flip in an audited window reported, 0 false reports, throughput_ratio >= 0.97.
// Exit code 0 when every run completed, 1 otherwise, 2 on bad flags.
//
// Flags: --fractions=0.01,0.05,0.2 --steps=N (4000) --horizon=N (1000) --first_flip=N (105)
// --flip_every=N (50) --throughput_reps=N (2) --cost_fraction=F (0.05) --spare_nice=N (0: the
// cost runs' spare at this nice, every thread: a spare sharing a host with trainers should
// audit only with what they leave idle) --job=PATH
// --server_binary=PATH --worker_binary=PATH --keep_logs.

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/figures.h"
#include "bench/flags.h"
#include "bench/load_average.h"
#include "bench/local_cluster.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"

namespace rebound::bench {
namespace {

constexpr int kTrainers = 2;
constexpr int kCorrupt = 1;  // trainer-1's slot
constexpr absl::Duration kPoll = absl::Milliseconds(50);

struct Flags {
  std::string fractions = "0.01,0.05,0.2";
  int steps = 4000;
  int horizon = 1000;
  int first_flip = 105;
  int flip_every = 50;
  int throughput_reps = 2;
  double cost_fraction = 0.05;
  int spare_nice = 0;
  ClusterFlags cluster;
};

constexpr char kUsage[] =
    "usage: audit [--fractions=F,F,...] [--steps=N] [--horizon=N] [--first_flip=N] "
    "[--flip_every=N] [--throughput_reps=N] [--cost_fraction=F] [--spare_nice=N] [--job=PATH] "
    "[--server_binary=PATH] [--worker_binary=PATH] [--keep_logs]";

struct Parsed {
  Flags flags;
  std::vector<double> fractions;
};

Parsed ParseFlags(int argc, char** argv) {
  Parsed parsed;
  Flags& flags = parsed.flags;
  CommandLine command_line(kUsage);
  command_line.AddText("fractions", &flags.fractions);
  command_line.AddInt("steps", &flags.steps);
  command_line.AddInt("horizon", &flags.horizon);
  command_line.AddInt("first_flip", &flags.first_flip);
  command_line.AddInt("flip_every", &flags.flip_every);
  command_line.AddInt("throughput_reps", &flags.throughput_reps);
  command_line.AddInt("spare_nice", &flags.spare_nice);
  command_line.AddCustom("cost_fraction", [&](const std::string& value) {
    if (!absl::SimpleAtod(value, &flags.cost_fraction)) {
      ExitWithUsage("--cost_fraction: not a number", kUsage);
    }
  });
  flags.cluster.AddTo(&command_line);
  command_line.Parse(argc, argv);
  for (absl::string_view part : absl::StrSplit(flags.fractions, ',', absl::SkipEmpty())) {
    double f = 0;
    if (!absl::SimpleAtod(part, &f) || !(f > 0 && f <= 1)) {
      command_line.Usage("--fractions: each in (0, 1]");
    }
    parsed.fractions.push_back(f);
  }
  if (parsed.fractions.empty()) command_line.Usage("--fractions: at least one");
  if (flags.horizon < 1 || flags.steps < flags.first_flip + flags.horizon) {
    command_line.Usage("--steps must be >= --first_flip + --horizon, --horizon >= 1");
  }
  if (flags.first_flip < 1 || flags.flip_every < 1) {
    command_line.Usage("--first_flip and --flip_every must be >= 1");
  }
  if (flags.throughput_reps < 0) command_line.Usage("--throughput_reps must be >= 0");
  if (flags.spare_nice < 0 || flags.spare_nice > 19) {
    command_line.Usage("--spare_nice must be in [0, 19]");
  }
  if (!(flags.cost_fraction > 0 && flags.cost_fraction <= 1)) {
    command_line.Usage("--cost_fraction must be in (0, 1]");
  }
  return parsed;
}

JobConfig Job(const JobConfig& base, double fraction, int steps) {
  JobConfig job = base;
  job.set_job_id("bench-audit");
  job.mutable_topology()->set_replicas(kTrainers);
  job.mutable_topology()->set_spares(0);
  job.mutable_topology()->set_evaluator(false);
  job.mutable_training()->set_max_steps(steps);
  if (fraction > 0) {
    job.mutable_audit()->set_fraction(fraction);
    job.mutable_audit()->set_max_concurrent(1);
    job.mutable_audit()->set_on_mismatch(AUDIT_REPORT);
  }
  return job;
}

struct Detection {
  int injected = 0;
  int detected = 0;         // injected flips whose own mismatch was confirmed
  std::vector<double> latency_steps;
  int caught_within_horizon = 0;  // injected flips followed by any confirmation within 1,000
  int false_reports = 0;
  int64_t steps_audited = 0;
};

absl::StatusOr<Detection> RunDetection(const Parsed& parsed, const JobConfig& base,
                                       double fraction, RunDirectories& dirs) {
  const Flags& flags = parsed.flags;
  // Runs past --steps so that the last flips' audits still find a spare.
  const JobConfig job = Job(base, fraction, flags.steps + 1000000);
  const std::string dir = dirs.StartRun(absl::StrCat("detect-", fraction));
  LocalCluster cluster(flags.cluster, dir);
  std::set<int64_t> flips;
  for (int64_t t = flags.first_flip; t <= flags.steps - flags.horizon; t += flags.flip_every) {
    flips.insert(t);
  }
  absl::Status status = cluster.StartServer(job);
  if (status.ok()) {
    status = cluster.StartTrainers(kTrainers, [&](int trainer) {
      if (trainer != kCorrupt) return std::vector<std::string>{};
      return std::vector<std::string>{
          absl::StrCat("--fault_flip_bit_at_step=", flags.first_flip),
          absl::StrCat("--fault_flip_bit_repeat_every=", flags.flip_every)};
    });
  }
  if (status.ok()) status = cluster.WaitForFirstSyncs(kTrainers);
  if (status.ok()) status = cluster.StartSpares({"spare-0"});
  Detection d;
  d.injected = static_cast<int>(flips.size());
  // Confirmed mismatches: the step that differs, trainer-1's step when first seen.
  std::map<int64_t, int64_t> confirmed;
  std::set<uint64_t> seen;
  const absl::Time limit = absl::Now() + absl::Minutes(30);
  int64_t step = 0;
  GetStatusResponse last;
  while (status.ok() && step < flags.steps) {
    absl::StatusOr<GetStatusResponse> s = cluster.GetStatus();
    if (!s.ok()) {
      status = s.status();
      break;
    }
    last = *s;
    step = s->slots(kCorrupt).step();
    for (const AuditStatus& a : s->audits()) {
      if (a.confirms() == 0 || !a.has_verdict() || !seen.insert(a.audit_id()).second) continue;
      if (a.verdict() == AUDIT_AUDITOR_FAULT) ++d.false_reports;
      if (a.verdict() != AUDIT_CONFIRMED) continue;
      if (a.slot().replica() != kCorrupt || a.worker() != "trainer-1" ||
          (a.mismatch().step() - flags.first_flip) % flags.flip_every != 0) {
        ++d.false_reports;
        std::printf("  FALSE report: %s\n", a.ShortDebugString().c_str());
        continue;
      }
      confirmed[a.mismatch().step()] = step;
      std::printf("  caught the flip of step %lld at trainer-1's step %lld (%lld steps later)\n",
                  static_cast<long long>(a.mismatch().step()), static_cast<long long>(step),
                  static_cast<long long>(step - a.mismatch().step()));
      std::fflush(stdout);
    }
    if (absl::Now() > limit) status = absl::DeadlineExceededError("30 minutes");
    absl::SleepFor(kPoll);
  }
  d.steps_audited = last.audit_counts().steps_audited();
  for (int64_t flip : flips) {
    auto own = confirmed.find(flip);
    if (own != confirmed.end()) {
      ++d.detected;
      d.latency_steps.push_back(static_cast<double>(own->second - flip));
    }
    for (const auto& [at, seen_step] : confirmed) {
      if (at >= flip && seen_step <= flip + flags.horizon) {
        ++d.caught_within_horizon;
        break;
      }
    }
  }
  cluster.StopAll(status.ok(), [](const ChildProcess&, int) {});
  dirs.FinishRun(dir, status.ok());
  if (!status.ok()) return status;
  return d;
}

// Every thread of process `pid` at nice `nice` (Linux keeps a nice value per thread).
void Renice(pid_t pid, int nice) {
  std::error_code error;
  for (const auto& task :
       std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/task"), error)) {
    int tid = 0;
    if (absl::SimpleAtoi(task.path().filename().string(), &tid)) {
      setpriority(PRIO_PROCESS, static_cast<id_t>(tid), nice);
    }
  }
}

// Both trainers' steps per second over the job, from both slots' step 2 x sync_period.
absl::StatusOr<double> RunThroughput(const Parsed& parsed, const JobConfig& base, double fraction,
                                     int rep, RunDirectories& dirs) {
  const Flags& flags = parsed.flags;
  const JobConfig job = Job(base, fraction, flags.steps);
  const std::string dir = dirs.StartRun(absl::StrCat("cost-", fraction, "-", rep));
  LocalCluster cluster(flags.cluster, dir);
  absl::Status status = cluster.StartServer(job);
  if (status.ok()) status = cluster.StartTrainers(kTrainers);
  if (status.ok()) status = cluster.StartSpares({"spare-0"});
  // A trainer leaves when its slot is FINISHED, the spare when every slot is.
  for (int i = 0; i < kTrainers; ++i) cluster.ExpectExit(absl::StrCat("trainer-", i));
  cluster.ExpectExit("spare-0");
  if (status.ok() && flags.spare_nice > 0) {
    if (ChildProcess* spare = cluster.FindWorker("spare-0")) Renice(spare->pid(), flags.spare_nice);
  }
  const int64_t from = 2 * job.easgd().sync_period();
  absl::StatusOr<GetStatusResponse> start =
      status.ok() ? cluster.WaitForStatus(
                        [&](const GetStatusResponse& s) {
                          for (const SlotStatus& slot : s.slots()) {
                            if (slot.step() < from) return false;
                          }
                          return s.slots_size() == kTrainers;
                        },
                        absl::Seconds(300), "both slots past their second sync", absl::Milliseconds(5))
                  : absl::StatusOr<GetStatusResponse>(status);
  const absl::Time t0 = absl::Now();
  absl::StatusOr<GetStatusResponse> end =
      start.ok() ? cluster.WaitForStatus(
                       [](const GetStatusResponse& s) {
                         for (const SlotStatus& slot : s.slots()) {
                           if (slot.state() != FINISHED) return false;
                         }
                         return true;
                       },
                       absl::Seconds(1200), "every slot FINISHED", absl::Milliseconds(5))
                 : start;
  const absl::Time t1 = absl::Now();
  status = end.status();
  double rate = 0;
  if (status.ok()) {
    int64_t steps = 0;
    for (const SlotStatus& slot : start->slots()) steps += flags.steps - slot.step();
    rate = static_cast<double>(steps) / absl::ToDoubleSeconds(t1 - t0);
    std::printf("  cost run %d, audits %s: %.1f steps/s (load %.2f)%s\n", rep + 1,
                fraction > 0 ? absl::StrCat("at ", fraction).c_str() : "off", rate, LoadAverage(),
                fraction > 0 ? absl::StrCat("; ", end->audit_counts().steps_audited(),
                                            " steps audited").c_str()
                             : "");
    std::fflush(stdout);
  }
  cluster.StopAll(status.ok(), [](const ChildProcess&, int) {});
  dirs.FinishRun(dir, status.ok());
  if (!status.ok()) return status;
  return rate;
}

int Main(int argc, char** argv) {
  Parsed parsed = ParseFlags(argc, argv);
  Flags& flags = parsed.flags;
  absl::StatusOr<JobConfig> base = ResolveClusterFlags(&flags.cluster);
  if (!base.ok()) ExitWithUsage(std::string(base.status().message()), kUsage);
  absl::StatusOr<RunDirectories> dirs = RunDirectories::Create("audit", flags.cluster.keep_logs);
  if (!dirs.ok()) {
    std::fprintf(stderr, "%s\n", std::string(dirs.status().message()).c_str());
    return 1;
  }
  std::printf("audit benchmark: %d trainers and 1 spare of %s (sync_period %d); trainer-1 flips a "
              "bit after step %d and every %d steps; detection runs to step %d (flips up to "
              "step %d count), cost runs of %d steps; %d cores online, load %.2f; logs in %s\n\n",
              kTrainers, flags.cluster.job.c_str(), base->easgd().sync_period(), flags.first_flip,
              flags.flip_every, flags.steps, flags.steps - flags.horizon, flags.steps,
              static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)), LoadAverage(),
              dirs->path().c_str());
  std::fflush(stdout);
  bool ok = true;

  std::vector<double> off;
  std::vector<double> on;
  for (int rep = 0; rep < flags.throughput_reps && ok; ++rep) {
    absl::StatusOr<double> a = RunThroughput(parsed, *base, 0, rep, *dirs);
    absl::StatusOr<double> b =
        a.ok() ? RunThroughput(parsed, *base, flags.cost_fraction, rep, *dirs) : a;
    if (!b.ok()) {
      std::printf("FAILED: %s\n", std::string(b.status().message()).c_str());
      ok = false;
      break;
    }
    off.push_back(*a);
    on.push_back(*b);
  }
  const double ratio = off.empty() ? 0 : Median(on) / Median(off);
  if (!off.empty()) {
    std::printf("cost: audits off %s steps/s, on (%.2f) %s steps/s: ratio %.3f (the spare at "
                "nice %d)\n\n",
                JoinFigures(off, 1).c_str(), flags.cost_fraction, JoinFigures(on, 1).c_str(),
                ratio, flags.spare_nice);
  }

  std::vector<std::string> results;
  for (double fraction : parsed.fractions) {
    if (!ok) break;
    std::printf("detection at fraction %.2f:\n", fraction);
    std::fflush(stdout);
    absl::StatusOr<Detection> d = RunDetection(parsed, *base, fraction, *dirs);
    if (!d.ok()) {
      std::printf("FAILED: %s\n", std::string(d.status().message()).c_str());
      ok = false;
      break;
    }
    const double median = d->latency_steps.empty() ? -1 : Median(d->latency_steps);
    const double p = d->injected == 0 ? 0 : static_cast<double>(d->caught_within_horizon) /
                                                d->injected;
    std::printf("  %d of %d flips caught (%.0f%%; expected about %.0f%%: one window in %.0f is "
                "audited), median %.0f steps after the flip; %lld steps audited\n\n",
                d->detected, d->injected, 100.0 * d->detected / std::max(1, d->injected),
                100 * fraction, 1 / fraction, median,
                static_cast<long long>(d->steps_audited));
    results.push_back(absl::StrFormat(
        "RESULT audit: fraction=%.2f injected=%d detected=%d median_detect_steps=%.0f "
        "p_detect_1000=%.2f false_reports=%d throughput_ratio=%.3f",
        fraction, d->injected, d->detected, median, p, d->false_reports, ratio));
  }
  dirs->Finish();
  // The bar's line (fraction 0.05, when run) last: tools/bench.sh reads the last RESULT line.
  std::stable_partition(results.begin(), results.end(), [](const std::string& line) {
    return line.find("fraction=0.05 ") == std::string::npos;
  });
  for (const std::string& line : results) std::printf("%s\n", line.c_str());
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace rebound::bench

int main(int argc, char** argv) { return rebound::bench::Main(argc, argv); }
