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
//  * What the center absorbs (--drift_horizons, each H a pair of runs): the same job made
//    reproducible bit for bit (scheduling DETERMINISTIC, weighting UNIFORM, no spare, no audit),
//    run to step --first_flip + H three times: clean, clean again (the control: its center must
//    be the first's, bit for bit, or the run fails), and with trainer-1 flipping one bit once
//    after step --first_flip. The final centers (ExportCenter) differ only by what the flip caused, in
//    the center, through H steps of the corrupted trainer's syncs: the flipped parameter's
//    difference against the flip's own size, and every parameter's. A confirmed audit ends the
//    corrupted trainer's syncs about median_detect_steps after a flip (AUDIT_QUARANTINE), so the
//    horizon near that figure is what the center absorbs before a quarantine. A line per H:
//   RESULT audit_drift: horizon=<H> flip_delta=<d> flipped_center_delta=<x> absorbed=<x/d>
//     max_abs_center_delta=<m> rel_l2_center_delta=<r> accuracy_delta=<flipped - clean>
//    (test accuracy of the two centers, as the evaluator computes it).
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
// audit only with what they leave idle) --shared_cores (the cost runs' processes placed by the
// kernel on every core; by default, with 2 cores or more, the trainers are pinned to every core
// but the last and the server and the spare to the last, the spare at nice 19: the spare audits
// on a core of its own, as it would on its own machine, rather than with the trainers' cycles;
// the same pinning in both arms) --cost_only (no detection runs, no RESULT line)
// --drift_horizons=H,H,... (50,200,1000; empty: none) --job=PATH
// --server_binary=PATH --worker_binary=PATH --keep_logs.

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/figures.h"
#include "common/file.h"
#include "common/status_macros.h"
#include "compute/backend_factory.h"
#include "compute/step.h"
#include "grpcpp/grpcpp.h"
#include "proto/rebound.grpc.pb.h"
#include "bench/flags.h"
#include "bench/load_average.h"
#include "bench/local_cluster.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "worker/data/fashion_mnist.h"
#include "worker/slot_compute.h"

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
  bool shared_cores = false;
  bool isolate_spare = true;  // unless --shared_cores or a single core
  bool cost_only = false;
  std::string drift_horizons = "50,200,1000";
  ClusterFlags cluster;
};

constexpr char kUsage[] =
    "usage: audit [--fractions=F,F,...] [--steps=N] [--horizon=N] [--first_flip=N] "
    "[--flip_every=N] [--throughput_reps=N] [--cost_fraction=F] [--spare_nice=N] "
    "[--shared_cores] [--cost_only] [--drift_horizons=H,...] [--job=PATH] "
    "[--server_binary=PATH] [--worker_binary=PATH] [--keep_logs]";

struct Parsed {
  Flags flags;
  std::vector<double> fractions;
  std::vector<int> horizons;
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
  command_line.AddSwitch("shared_cores", &flags.shared_cores);
  command_line.AddSwitch("cost_only", &flags.cost_only);
  command_line.AddText("drift_horizons", &flags.drift_horizons);
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
  for (absl::string_view part : absl::StrSplit(flags.drift_horizons, ',', absl::SkipEmpty())) {
    int h = 0;
    if (!absl::SimpleAtoi(part, &h) || h < 1) command_line.Usage("--drift_horizons: each >= 1");
    parsed.horizons.push_back(h);
  }
  if (parsed.fractions.empty() && parsed.horizons.empty() && flags.throughput_reps == 0) {
    command_line.Usage("nothing to run: --fractions, --drift_horizons and --throughput_reps are "
                       "all empty");
  }
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
  flags.isolate_spare = !flags.shared_cores && sysconf(_SC_NPROCESSORS_ONLN) >= 2;
  if (flags.isolate_spare && flags.spare_nice == 0) flags.spare_nice = 19;
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

// A drift run's outcome: the final center, packed (the tensors in id order), and the flip the
// corrupted trainer logged (its parameter, the value before and after), when it flipped.
struct DriftRun {
  std::vector<float> center;
  int64_t parameter = -1;
  double before = 0;
  double after = 0;
};

// The value pair of trainer-1's log line "flipped bit 12 of parameter I (...) after step T: A -> B".
bool ParseFlip(const std::string& log_path, int64_t step, DriftRun* run) {
  absl::StatusOr<std::string> log = ReadFile(log_path, kNoFileSizeLimit);
  if (!log.ok()) return false;
  const std::string mark = "flipped bit 12 of parameter ";
  const size_t at = log->find(mark);
  if (at == std::string::npos) return false;
  const std::string line = log->substr(at, log->find('\n', at) - at);
  long long parameter = -1;
  long long when = -1;
  double before = 0;
  double after = 0;
  const size_t step_at = line.find(") after step ");
  if (step_at == std::string::npos ||
      std::sscanf(line.c_str() + mark.size(), "%lld", &parameter) != 1 ||
      std::sscanf(line.c_str() + step_at, ") after step %lld: %lf -> %lf", &when, &before,
                  &after) != 3 ||
      when != step) {
    return false;
  }
  run->parameter = parameter;
  run->before = before;
  run->after = after;
  return true;
}

// Test loss and accuracy of a packed center of the job's (one stage) model, as the evaluator
// computes them.
absl::StatusOr<compute::EvalResult> Evaluate(const JobConfig& job,
                                             const std::vector<float>& center) {
  ASSIGN_OR_RETURN(worker::FashionMnist data, worker::LoadFashionMnist(job.data()));
  ASSIGN_OR_RETURN(std::unique_ptr<compute::Backend> backend, compute::CreateBackend(job.compute()));
  ASSIGN_OR_RETURN(std::unique_ptr<compute::LocalTrainer> model,
                   compute::LocalTrainer::Create(
                       backend.get(), worker::TrainerOptionsFor(job, SlotId(), 0, 1)));
  RETURN_IF_ERROR(model->stage(0).SetParams(center));
  const std::vector<int32_t> labels(data.test.labels.begin(), data.test.labels.end());
  return model->Evaluate(data.test.images, labels);
}

absl::StatusOr<DriftRun> RunDrift(const Parsed& parsed, const JobConfig& base, int horizon,
                                  bool flip, RunDirectories& dirs) {
  const Flags& flags = parsed.flags;
  JobConfig job = Job(base, 0, flags.first_flip + horizon);
  job.set_scheduling(DETERMINISTIC);
  job.mutable_weighting()->set_policy(UNIFORM);
  // The shipped job's learning-rate schedule, though the run stops early.
  if (job.adahessian().decay_steps() == 0) {
    job.mutable_adahessian()->set_decay_steps(base.training().max_steps());
  }
  const std::string dir =
      dirs.StartRun(absl::StrCat("drift-", horizon, flip ? "-flipped" : "-clean"));
  LocalCluster cluster(flags.cluster, dir);
  absl::Status status = cluster.StartServer(job);
  if (status.ok()) {
    status = cluster.StartTrainers(kTrainers, [&](int trainer) {
      if (!flip || trainer != kCorrupt) return std::vector<std::string>{};
      return std::vector<std::string>{absl::StrCat("--fault_flip_bit_at_step=", flags.first_flip)};
    });
  }
  for (int i = 0; i < kTrainers; ++i) cluster.ExpectExit(absl::StrCat("trainer-", i));
  if (status.ok()) {
    status = cluster
                 .WaitForStatus(
                     [](const GetStatusResponse& s) {
                       for (const SlotStatus& slot : s.slots()) {
                         if (slot.state() != FINISHED) return false;
                       }
                       return s.slots_size() == kTrainers;
                     },
                     absl::Seconds(600), "every slot FINISHED", absl::Milliseconds(20))
                 .status();
  }
  DriftRun run;
  if (status.ok()) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    ExportCenterResponse exported;
    const grpc::Status call = cluster.stub().ExportCenter(&context, ExportCenterRequest(), &exported);
    if (!call.ok()) {
      status = absl::UnavailableError(absl::StrCat("ExportCenter: ", call.error_message()));
    } else if (exported.stages_size() != 1) {
      status = absl::InternalError("ExportCenter: not one stage");
    } else {
      for (const Tensor& t : exported.stages(0).center().tensors()) {
        const size_t n = t.data().size() / sizeof(float);
        const size_t at = run.center.size();
        run.center.resize(at + n);
        std::memcpy(run.center.data() + at, t.data().data(), n * sizeof(float));
      }
    }
  }
  if (status.ok() && flip) {
    const ChildProcess* corrupt = cluster.FindWorker(absl::StrCat("trainer-", kCorrupt));
    if (corrupt == nullptr || !ParseFlip(corrupt->log_path(), flags.first_flip, &run)) {
      status = absl::InternalError("trainer-1 logged no flip at --first_flip");
    }
  }
  cluster.StopAll(status.ok(), [](const ChildProcess&, int) {});
  dirs.FinishRun(dir, status.ok());
  if (!status.ok()) return status;
  return run;
}

// Calls `apply` with the id of every thread of process `pid` (Linux keeps a nice value and a CPU
// affinity per thread; threads started later inherit their starter's).
void ForEachThread(pid_t pid, const std::function<void(pid_t)>& apply) {
  std::error_code error;
  for (const auto& task :
       std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/task"), error)) {
    int tid = 0;
    if (absl::SimpleAtoi(task.path().filename().string(), &tid)) apply(tid);
  }
}

// Every thread of process `pid` at nice `nice`.
void Renice(pid_t pid, int nice) {
  ForEachThread(pid, [nice](pid_t tid) { setpriority(PRIO_PROCESS, static_cast<id_t>(tid), nice); });
}

// Every thread of process `pid` on the cores [first, last].
void Pin(pid_t pid, int first, int last) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int cpu = first; cpu <= last; ++cpu) CPU_SET(cpu, &set);
  ForEachThread(pid, [&set](pid_t tid) { sched_setaffinity(tid, sizeof(set), &set); });
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
  if (status.ok() && flags.isolate_spare) {
    const int last = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)) - 1;
    for (int i = 0; i < kTrainers; ++i) {
      if (ChildProcess* t = cluster.FindWorker(absl::StrCat("trainer-", i))) Pin(t->pid(), 0, last - 1);
    }
    // Every server process (a sharded job's K groups too) with the spare.
    for (int m = 0; m < cluster.members(); ++m) Pin(cluster.member(m).pid(), last, last);
    if (ChildProcess* spare = cluster.FindWorker("spare-0")) Pin(spare->pid(), last, last);
  }
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
                "nice %d%s)\n\n",
                JoinFigures(off, 1).c_str(), flags.cost_fraction, JoinFigures(on, 1).c_str(),
                ratio, flags.spare_nice,
                flags.isolate_spare ? ", on the last core with the server; the trainers on the "
                                      "others"
                                    : "");
  }

  std::vector<std::string> results;
  for (int horizon : parsed.horizons) {
    if (!ok || flags.cost_only) break;
    std::printf("drift: %d steps after one flip, against the same run without it:\n", horizon);
    std::fflush(stdout);
    absl::StatusOr<DriftRun> clean = RunDrift(parsed, *base, horizon, false, *dirs);
    // The control: the clean run again must end with the same center, bit for bit, or the
    // difference below is not the flip's.
    absl::StatusOr<DriftRun> again =
        clean.ok() ? RunDrift(parsed, *base, horizon, false, *dirs) : clean;
    absl::StatusOr<DriftRun> flipped =
        again.ok() ? RunDrift(parsed, *base, horizon, true, *dirs) : again;
    if (flipped.ok() && again->center != clean->center) {
      size_t differ = 0;
      for (size_t i = 0; i < clean->center.size() && i < again->center.size(); ++i) {
        differ += clean->center[i] != again->center[i];
      }
      std::printf("FAILED: two clean runs end with different centers (%zu values differ): the "
                  "job is not reproducible, the drift cannot be told from its noise\n",
                  differ);
      ok = false;
      break;
    }
    if (!flipped.ok() || clean->center.size() != flipped->center.size() ||
        flipped->parameter >= static_cast<int64_t>(clean->center.size())) {
      std::printf("FAILED: %s\n", flipped.ok() ? "the centers differ in size"
                                                : std::string(flipped.status().message()).c_str());
      ok = false;
      break;
    }
    double max_abs = 0;
    double diff2 = 0;
    double norm2 = 0;
    for (size_t i = 0; i < clean->center.size(); ++i) {
      const double d = static_cast<double>(flipped->center[i]) - clean->center[i];
      max_abs = std::max(max_abs, std::abs(d));
      diff2 += d * d;
      norm2 += static_cast<double>(clean->center[i]) * clean->center[i];
    }
    const double flip_delta = flipped->after - flipped->before;
    const double at_flip = static_cast<double>(flipped->center[flipped->parameter]) -
                           clean->center[flipped->parameter];
    const double rel = norm2 > 0 ? std::sqrt(diff2 / norm2) : 0;
    // What the difference does to the model: both centers' test accuracy.
    absl::StatusOr<compute::EvalResult> clean_eval = Evaluate(*base, clean->center);
    absl::StatusOr<compute::EvalResult> flipped_eval =
        clean_eval.ok() ? Evaluate(*base, flipped->center) : clean_eval;
    if (!flipped_eval.ok()) {
      std::printf("FAILED: evaluating the centers: %s\n",
                  std::string(flipped_eval.status().message()).c_str());
      ok = false;
      break;
    }
    std::printf("  test accuracy: clean %.2f%%, flipped %.2f%% (loss %.4f, %.4f)\n",
                100 * clean_eval->accuracy, 100 * flipped_eval->accuracy, clean_eval->loss,
                flipped_eval->loss);
    std::printf("  parameter %lld flipped from %.9g to %.9g (by %.3g); the center's value there "
                "differs by %.3g (%.3f of the flip), the largest difference %.3g, the whole "
                "center by %.3g of its norm\n\n",
                static_cast<long long>(flipped->parameter), flipped->before, flipped->after,
                flip_delta, at_flip, flip_delta != 0 ? at_flip / flip_delta : 0, max_abs, rel);
    results.push_back(absl::StrFormat(
        "RESULT audit_drift: horizon=%d flip_delta=%.3g flipped_center_delta=%.3g absorbed=%.3f "
        "max_abs_center_delta=%.3g rel_l2_center_delta=%.3g accuracy_delta=%.4f",
        horizon, flip_delta, at_flip, flip_delta != 0 ? at_flip / flip_delta : 0, max_abs, rel,
        flipped_eval->accuracy - clean_eval->accuracy));
  }
  for (double fraction : parsed.fractions) {
    if (!ok || flags.cost_only) break;
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
