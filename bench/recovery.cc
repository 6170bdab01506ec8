// Parallel replay benchmark (docs/design.md §9: "recovery of one slot, k = 2 spares | k = 1 |
// >= 1.6x faster").
//
// Runs a real local cluster on loopback: one rebound_server (inline job, in-memory state), k
// rebound_worker spares started first (each waits until it is registered and in its WaitForTask
// long poll), then one trainer (topology.replicas 1), no evaluator. The trainer trains until its
// slot has a snapshot (its first sync, at step tau) and the store holds --steps logged steps past
// it, then the benchmark SIGKILLs it. The server declares it failed after failure_timeout_ms;
// the k spares replay the logged steps from the snapshot (fault_tolerance.recovery_parallelism
// = k: each spare a tree-aligned block of the M micro-batches, partial sums to the leader over
// WorkerPeer, the step's sum back, the same AdaHessian step on every spare); the leader checks
// every step's checksum and takes the slot over. A run is good only when the recovery's outcome
// is RECOVERED, verified (every replayed step matched its logged checksum) and used k spares.
//
// The timed quantity is the rebuild: the recovery's phases snapshot_transfer_ms (the leader's
// task received -> snapshot loaded and log read) + replay_ms + takeover_ms (the leader's report
// -> the new trainer's first heartbeat), as GetStatus reports them. detection_ms (how long the
// dead trainer had been silent when declared failed) is the failure detector's, the same for
// any k: it is printed, with the total including it and that total's ratio, but is not part of
// the rebuild. The benchmark also times, from its own clock, the kill -> the slot ACTIVE again
// under a new owner and the kill -> the new trainer's first heartbeat (polling GetStatus every
// 20 ms), and prints what the phases leave out of that wall time (the claim, the server's
// snapshot read, up to one heartbeat interval before the kill, the polling).
//
// k = 1 and k = --k runs alternate over --reps repetitions (k = 1 first in even repetitions,
// second in odd ones), a fresh cluster per run; medians over the repetitions. The number of
// replayed steps varies by a few between runs (the kill lands on a 20 ms poll), so replay time
// per step is printed beside the totals.
//
// The job: configs/job.pbtxt's model (784-256-128-10, 235k parameters) and optimizer, with a step
// that is heavy in compute for the model's size, so that the per-step exchange (about 2 x 4 B x
// 235k = 1.9 MB each way: gradient and Hz sums) is small beside the compute: data.batch_size
// --batch_size (2048) in data.micro_batches --micro_batches (8), i.e. micro-batches of 256. The
// exchange's size does not depend on the batch, the compute grows with it: on the 2-core
// development machine a step of batch 512 (~15 ms) gains nothing from a second spare (the two
// sequential 1.9 MB transfers and their copies cost about what half the step's compute saves),
// 2048 gains ~1.5x, 4096 ~1.45x (docs/benchmarks.md). compute.threads 1 for every run, k = 1
// included (bit-exact replay fixes the thread count per job; the k = 1 baseline gets the same
// single thread per spare, it does not get both cores). easgd.sync_period --sync_period (default
// 2 x --steps: the log must hold --steps steps past the snapshot before the next sync collects
// it), step_log.linger_ms --linger_ms (20), fault_tolerance.heartbeat_interval_ms --heartbeat_ms
// (100), failure_timeout_ms --failure_timeout_ms (500), policy REPLAY, recovery_parallelism k;
// topology.replicas 1, stages 1, evaluator false; training.max_steps 10^9; job_id
// "bench-recovery".
//
// The machine has 2 cores: the 2 spares of a k = 2 replay fill them. Each run prints the CPU the
// spares, the server and everything else on the machine used from the kill to the takeover, the
// hypervisor's steal time and the load average, and says DISTURBED when others took more than
// 0.15 cores, so that a disturbed run can be told apart; do not judge on a busy machine. Even on
// a quiet one the same replay varies by +-15% between runs (the VM's cores are not always as
// fast), hence 5 repetitions.
// The summary also gives each spare's CPU per replayed step beside the wall time per step: with
// k = 2 the gap is the time a spare waits for the other's sums, and the CPU above half of k = 1's
// is the work every spare repeats (AdaHessian apply, checksum, Hutchinson vector, batch upload)
// and the exchange's own (serialising, copying, loopback TCP).
//
// Last line:
//   RESULT recovery: k1_ms=<x> k2_ms=<y> ratio=<x/y>
// with x and y the median rebuild times of k = 1 and k = --k. Exit code 0 when every run
// completed (whatever the verdict), 1 when a run failed, 2 on bad flags.
//
// Flags (--name=value or --name value): --reps=N (5) --k=K (2) --steps=N (60) --sync_period=T
// (2 x --steps) --batch_size=B (2048) --micro_batches=M (8) --linger_ms=MS (20) --heartbeat_ms=MS
// (100) --failure_timeout_ms=MS (500) --job=PATH (configs/job.pbtxt from the runfiles)
// --server_binary=PATH --worker_binary=PATH --keep_logs (keep every run's directory; failed
// runs are always kept).

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/figures.h"
#include "bench/flags.h"
#include "bench/local_cluster.h"
#include "bench/throughput_window.h"
#include "bench/load_average.h"
#include "common/config.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"

namespace rebound::bench {
namespace {

constexpr char kJobId[] = "bench-recovery";
constexpr char kTrainer[] = "trainer-0";
constexpr absl::Duration kPoll = absl::Milliseconds(20);
constexpr absl::Duration kLogFillWait = absl::Seconds(180);
constexpr absl::Duration kRecoveryWait = absl::Seconds(120);
// The target of docs/design.md §9.
constexpr double kTargetRatio = 1.6;
// Other processes' CPU and steal time during a run above which its line says it was disturbed:
// a k = 2 replay needs both cores.
constexpr double kDisturbedCores = 0.15;

// CPU accounting: ProcessCpuTicks and ReadMachineCpu (bench/throughput_window.h), in clock
// ticks (sysconf(_SC_CLK_TCK) per second).

// ---------------------------------------------------------------------------------------------
// Flags

struct Flags {
  int reps = 5;
  int k = 2;
  int steps = 60;
  int sync_period = 0;  // 0: 2 x steps
  int batch_size = 2048;
  int micro_batches = 8;
  int linger_ms = 20;
  int heartbeat_ms = 100;
  int failure_timeout_ms = 500;
  ClusterFlags cluster;  // --job, --server_binary, --worker_binary, --keep_logs
};

constexpr char kUsage[] =
    "usage: recovery [--reps=N] [--k=K] [--steps=N] [--sync_period=T] [--batch_size=B] "
    "[--micro_batches=M] [--linger_ms=MS] [--heartbeat_ms=MS] [--failure_timeout_ms=MS] "
    "[--job=PATH] [--server_binary=PATH] [--worker_binary=PATH] [--keep_logs]";

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  CommandLine command_line(kUsage);
  command_line.AddInt("reps", &flags.reps);
  command_line.AddInt("k", &flags.k);
  command_line.AddInt("steps", &flags.steps);
  command_line.AddInt("sync_period", &flags.sync_period);
  command_line.AddInt("batch_size", &flags.batch_size);
  command_line.AddInt("micro_batches", &flags.micro_batches);
  command_line.AddInt("linger_ms", &flags.linger_ms);
  command_line.AddInt("heartbeat_ms", &flags.heartbeat_ms);
  command_line.AddInt("failure_timeout_ms", &flags.failure_timeout_ms);
  flags.cluster.AddTo(&command_line);
  command_line.Parse(argc, argv);
  if (flags.reps < 1) command_line.Usage("--reps must be >= 1");
  if (flags.k < 2) command_line.Usage("--k must be >= 2 (k = 1 is the baseline every run pairs)");
  if (flags.steps < 1) command_line.Usage("--steps must be >= 1");
  if (flags.sync_period == 0) flags.sync_period = 2 * flags.steps;
  if (flags.sync_period <= flags.steps) {
    command_line.Usage("--sync_period must exceed --steps: the log must hold --steps steps past "
                       "the snapshot before the next sync collects them");
  }
  return flags;
}

// The benchmark's job for k spares. Validation of the job with the largest k happens at start,
// so that a bad --batch_size / --micro_batches / --k combination is a flag error.
JobConfig MakeJob(const Flags& flags, const JobConfig& base, int k) {
  JobConfig job = base;
  job.set_job_id(kJobId);
  job.mutable_topology()->set_replicas(1);
  job.mutable_topology()->set_stages(1);
  job.mutable_topology()->clear_stage_boundaries();
  job.mutable_topology()->set_spares(k);
  job.mutable_topology()->set_evaluator(false);
  job.mutable_data()->set_batch_size(flags.batch_size);
  job.mutable_data()->set_micro_batches(flags.micro_batches);
  job.mutable_compute()->set_threads(1);
  job.mutable_easgd()->set_sync_period(flags.sync_period);
  job.mutable_step_log()->set_enabled(true);
  job.mutable_step_log()->set_linger_ms(flags.linger_ms);
  FaultToleranceConfig* ft = job.mutable_fault_tolerance();
  ft->set_policy(REPLAY);
  ft->set_heartbeat_interval_ms(flags.heartbeat_ms);
  ft->set_failure_timeout_ms(flags.failure_timeout_ms);
  ft->set_recovery_parallelism(k);
  job.mutable_training()->set_max_steps(1000000000);
  return job;
}

// ---------------------------------------------------------------------------------------------
// One run

struct RunSpec {
  int k;
  int rep;  // in [0, --reps)
};

struct RunResult {
  bool ok = false;
  std::string error;
  int64_t snapshot_step = 0;
  int64_t reached_step = 0;  // the last step the killed trainer reported
  int64_t logged_steps = 0;  // shipped past the snapshot when the trainer was killed
  int64_t steps_replayed = 0;
  double detection_ms = 0;
  double transfer_ms = 0;
  double replay_ms = 0;
  double takeover_ms = 0;
  double rebuild_ms = 0;  // transfer + replay + takeover
  double total_ms = 0;    // detection + rebuild
  double replay_ms_per_step = 0;
  double wall_active_ms = 0;     // kill -> slot ACTIVE under a new owner (benchmark's clock)
  double wall_heartbeat_ms = 0;  // kill -> the new trainer's first heartbeat seen
  double trainer_ms_per_step = 0;  // the trainer's pace before the kill (shipped steps)
  // CPU from the kill to the first heartbeat seen, in cores (CPU seconds / wall seconds).
  std::vector<double> spare_cores;  // by rank: leader first
  std::vector<double> spare_cpu_ms_per_step;  // by rank: the window's CPU / steps replayed
  double server_cores = 0;
  double other_cores = 0;  // the machine's busy CPU less the cluster's and the benchmark's
  double steal_cores = 0;  // taken from this VM by its hypervisor
  double load = 0;
};

// CPU readings of the cluster at one moment.
struct CpuProbe {
  absl::Time at;
  std::map<std::string, int64_t> workers;  // by name
  int64_t server = 0;
  int64_t self = 0;
  MachineCpu machine;
};

class Run {
 public:
  Run(const Flags& flags, const JobConfig& base_job, const std::string& dir, const RunSpec& spec)
      : flags_(flags), base_job_(base_job), spec_(spec), cluster_(flags.cluster, dir) {}

  RunResult Execute() {
    RunResult result;
    const absl::Status status = Measure(&result);
    cluster_.StopAll(result.ok, [&result](const ChildProcess& worker, int code) {
      // 137: the trainer the benchmark killed.
      if (code != 0 && code != 137 && result.ok) {
        std::fprintf(stderr, "note: %s exited with code %d after SIGTERM\n",
                     worker.log_path().c_str(), code);
      }
    });
    if (!status.ok()) {
      result.ok = false;
      result.error = std::string(status.message());
    }
    return result;
  }

 private:
  std::vector<std::string> SpareNames() const {
    std::vector<std::string> names;
    for (int i = 0; i < spec_.k; ++i) names.push_back(absl::StrCat("spare-", i));
    return names;
  }

  CpuProbe TakeCpuProbe() const {
    CpuProbe probe;
    probe.at = absl::Now();
    for (const std::string& name : SpareNames()) {
      probe.workers[name] = ProcessCpuTicks(cluster_.FindWorker(name)->pid());
    }
    probe.server = ProcessCpuTicks(cluster_.server().pid());
    probe.self = ProcessCpuTicks(getpid());
    probe.machine = ReadMachineCpu();
    return probe;
  }

  // Logged steps the trainer has shipped: each step is M micro-batch records and a checksum
  // record, committed (records_written) or dropped because a snapshot already covered them.
  int64_t ShippedSteps(const GetStatusResponse& status) const {
    const StepLogStatus& log = status.step_log();
    return (log.records_written() + log.below_snapshot_dropped()) / (flags_.micro_batches + 1);
  }

  static bool AllWaiting(const GetStatusResponse& status, const std::vector<std::string>& names) {
    for (const std::string& name : names) {
      bool waiting = false;
      for (const WorkerStatus& w : status.workers()) {
        waiting = waiting || (w.name() == name && w.state() == ALIVE && w.role() == SPARE &&
                              w.waiting_for_task());
      }
      if (!waiting) return false;
    }
    return true;
  }

  static std::string NameOf(const GetStatusResponse& status, uint64_t incarnation) {
    for (const WorkerStatus& w : status.workers()) {
      if (w.incarnation() == incarnation) return w.name();
    }
    return "";
  }

  absl::Status Measure(RunResult* result) {
    if (absl::Status s = cluster_.StartServer(MakeJob(flags_, base_job_, spec_.k)); !s.ok()) {
      return s;
    }
    // Spares first, each loaded and waiting, so that none competes with the trainer for CPU
    // while it loads its data and none is missing when the task's helpers are picked.
    const std::vector<std::string> spares = SpareNames();
    if (absl::Status s = cluster_.StartSpares(spares); !s.ok()) return s;
    if (absl::Status s = cluster_.StartTrainers(1); !s.ok()) return s;

    // Until the slot has a snapshot and --steps logged steps past it, with every spare waiting.
    std::optional<std::pair<absl::Time, int64_t>> first_seen;  // pace: time and shipped steps
    auto filled = cluster_.WaitForStatus(
        [&](const GetStatusResponse& s) {
          if (s.slots_size() != 1 || s.slots(0).state() != ACTIVE) return false;
          const int64_t snapshot = s.slots(0).snapshot_step();
          if (snapshot < flags_.sync_period) return false;
          const int64_t shipped = ShippedSteps(s);
          if (!first_seen.has_value()) first_seen = std::make_pair(absl::Now(), shipped);
          return shipped - snapshot >= flags_.steps && AllWaiting(s, spares);
        },
        kLogFillWait, absl::StrCat("a snapshot and ", flags_.steps, " logged steps past it"),
        kPoll);
    if (!filled.ok()) return filled.status();
    const SlotStatus& before = filled->slots(0);
    result->snapshot_step = before.snapshot_step();
    result->logged_steps = ShippedSteps(*filled) - before.snapshot_step();
    if (result->logged_steps >= flags_.sync_period) {
      return absl::InternalError("the trainer ran past its next sync before the kill");
    }
    const uint64_t old_owner = before.owner_incarnation();
    const double paced = absl::ToDoubleMilliseconds(absl::Now() - first_seen->first);
    const int64_t paced_steps = ShippedSteps(*filled) - first_seen->second;
    result->trainer_ms_per_step = paced_steps > 0 ? paced / paced_steps : NAN;

    const CpuProbe start = TakeCpuProbe();
    if (absl::Status s = cluster_.KillWorker(kTrainer); !s.ok()) return s;
    const absl::Time killed = absl::Now();

    LoadAverageMeter load;
    absl::Time next_load_sample = killed;
    std::optional<absl::Time> active_at;
    const RecoveryStatus* recovery = nullptr;
    auto recovered = cluster_.WaitForStatus(
        [&](const GetStatusResponse& s) {
          const absl::Time now = absl::Now();
          if (now >= next_load_sample) {
            load.Sample();
            next_load_sample += absl::Seconds(1);
          }
          if (!active_at.has_value() && s.slots_size() == 1 && s.slots(0).state() == ACTIVE &&
              s.slots(0).owner_incarnation() != old_owner) {
            active_at = now;
          }
          for (const RecoveryStatus& r : s.recoveries()) {
            // Done: an outcome other than RECOVERED, or the new trainer's first heartbeat.
            if (r.has_outcome() && (r.outcome() != RECOVERED || r.phases().has_takeover_ms())) {
              return true;
            }
          }
          return false;
        },
        kRecoveryWait, "the recovery to finish and the new trainer's first heartbeat", kPoll);
    if (!recovered.ok()) return recovered.status();
    const absl::Time done = absl::Now();
    const CpuProbe end = TakeCpuProbe();
    recovery = &recovered->recoveries(recovered->recoveries_size() - 1);
    for (const RecoveryStatus& r : recovered->recoveries()) {
      if (r.has_outcome()) recovery = &r;
    }
    if (recovered->recoveries_size() != 1) {
      return absl::InternalError(
          absl::StrCat(recovered->recoveries_size(), " recoveries ran, expected one"));
    }
    if (recovery->outcome() != RECOVERED || !recovery->verified()) {
      return absl::InternalError(absl::StrCat(
          "recovery ", RecoveryOutcome_Name(recovery->outcome()),
          recovery->verified() ? "" : " (not verified)", ": ", recovery->detail()));
    }
    if (recovery->policy() != REPLAY) {
      return absl::InternalError(
          absl::StrCat("the recovery ran as ", RecoveryPolicy_Name(recovery->policy())));
    }
    if (recovery->spares_size() != spec_.k) {
      return absl::InternalError(absl::StrCat(
          "the replay used ", recovery->spares_size(), " spare(s), not ", spec_.k,
          " (helpers are the spares in WaitForTask when the task is created)"));
    }
    if (!active_at.has_value()) active_at = done;

    const RecoveryPhases& phases = recovery->phases();
    result->reached_step = recovery->failed_step();
    result->steps_replayed = recovery->steps_replayed();
    result->detection_ms = phases.detection_ms();
    result->transfer_ms = phases.snapshot_transfer_ms();
    result->replay_ms = phases.replay_ms();
    result->takeover_ms = phases.takeover_ms();
    result->rebuild_ms = result->transfer_ms + result->replay_ms + result->takeover_ms;
    result->total_ms = result->detection_ms + result->rebuild_ms;
    result->replay_ms_per_step =
        result->steps_replayed > 0 ? result->replay_ms / result->steps_replayed : NAN;
    result->wall_active_ms = absl::ToDoubleMilliseconds(*active_at - killed);
    result->wall_heartbeat_ms = absl::ToDoubleMilliseconds(done - killed);
    if (result->steps_replayed < 1) {
      return absl::InternalError("the recovery replayed no step");
    }

    const double tick_s = 1.0 / static_cast<double>(sysconf(_SC_CLK_TCK));
    const double seconds = absl::ToDoubleSeconds(end.at - start.at);
    int64_t ours = 0;
    for (uint64_t incarnation : recovery->spares()) {
      const std::string name = NameOf(*recovered, incarnation);
      auto s = start.workers.find(name);
      auto e = end.workers.find(name);
      if (s == start.workers.end() || e == end.workers.end() || s->second < 0 || e->second < 0) {
        return absl::InternalError(absl::StrCat("cannot read the CPU time of spare ", name));
      }
      result->spare_cores.push_back((e->second - s->second) * tick_s / seconds);
      result->spare_cpu_ms_per_step.push_back(1000.0 * (e->second - s->second) * tick_s /
                                              result->steps_replayed);
    }
    for (const auto& [name, ticks] : end.workers) ours += ticks - start.workers.at(name);
    ours += (end.server - start.server) + (end.self - start.self);
    result->server_cores = (end.server - start.server) * tick_s / seconds;
    const bool machine_ok = start.machine.ok && end.machine.ok;
    result->other_cores =
        machine_ok
            ? std::max<int64_t>(0, (end.machine.busy - start.machine.busy) - ours) * tick_s / seconds
            : NAN;
    result->steal_cores =
        machine_ok ? (end.machine.steal - start.machine.steal) * tick_s / seconds : NAN;
    load.Sample();
    result->load = load.Mean();
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

double Share(double part, double whole) { return whole > 0 ? 100.0 * part / whole : NAN; }

int Main(int argc, char** argv) {
  Flags flags = ParseFlags(argc, argv);
  absl::StatusOr<JobConfig> base_job = ResolveClusterFlags(&flags.cluster);
  if (!base_job.ok()) ExitWithUsage(std::string(base_job.status().message()), kUsage);
  for (int k : {1, flags.k}) {
    if (absl::Status valid = ValidateJobConfig(MakeJob(flags, *base_job, k)); !valid.ok()) {
      ExitWithUsage(absl::StrCat("the benchmark's job with k = ", k, " is invalid: ",
                                 valid.message()),
                    kUsage);
    }
  }
  absl::StatusOr<RunDirectories> dirs = RunDirectories::Create("recovery", flags.cluster.keep_logs);
  if (!dirs.ok()) {
    std::fprintf(stderr, "%s\n", std::string(dirs.status().message()).c_str());
    return 1;
  }

  std::vector<RunSpec> specs;
  for (int rep = 0; rep < flags.reps; ++rep) {
    // k = 1 first in even repetitions, k = --k first in odd ones: a drift in load hits both.
    const bool baseline_first = rep % 2 == 0;
    specs.push_back({baseline_first ? 1 : flags.k, rep});
    specs.push_back({baseline_first ? flags.k : 1, rep});
  }

  const JobConfig job = MakeJob(flags, *base_job, flags.k);
  int64_t parameters = 0;
  int64_t in = job.model().input_dim();
  for (const LayerSpec& layer : job.model().layers()) {
    parameters += in * layer.width() + layer.width();
    in = layer.width();
  }
  std::printf("recovery benchmark: REPLAY recovery of one slot with k = 1 vs k = %d spares "
              "(fault_tolerance.recovery_parallelism), same job, same run\n",
              flags.k);
  std::printf("job: %s's model, MLP %d", flags.cluster.job.c_str(), job.model().input_dim());
  for (const LayerSpec& layer : job.model().layers()) std::printf("-%d", layer.width());
  std::printf(" (%lld parameters; per replayed step each helper sends ~%.2f MB of sums and gets "
              "as much back), batch %d in %d micro-batches, %s backend x 1 thread per worker for "
              "every k (k = 1 included), tau %d, linger %d ms, heartbeat %d ms, failure timeout "
              "%d ms; 1 trainer, k spares, no evaluator, in-memory server\n",
              static_cast<long long>(parameters), 2.0 * 4.0 * parameters / 1e6,
              job.data().batch_size(), job.data().micro_batches(),
              BackendKind_Name(job.compute().backend()).c_str(), job.easgd().sync_period(),
              flags.linger_ms, flags.heartbeat_ms, flags.failure_timeout_ms);
  std::printf("%zu runs (%d repetitions of k = 1 / k = %d, order alternating), each a fresh "
              "cluster; the trainer is SIGKILLed once its slot has a snapshot (step %d) and %d "
              "logged steps past it; %d cores online, load %.2f; logs in %s\n\n",
              specs.size(), flags.reps, flags.k, flags.sync_period, flags.steps,
              static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)), LoadAverage(),
              dirs->path().c_str());
  std::fflush(stdout);

  const absl::Time study_start = absl::Now();
  std::map<int, std::map<int, RunResult>> results;  // k -> rep -> result
  for (const RunSpec& spec : specs) {
    const std::string dir = dirs->StartRun(absl::StrCat("rep", spec.rep, "-k", spec.k));
    const absl::Time run_start = absl::Now();
    RunResult r = Run(flags, *base_job, dir, spec).Execute();
    const double run_seconds = absl::ToDoubleSeconds(absl::Now() - run_start);
    dirs->FinishRun(dir, r.ok);
    if (!r.ok) {
      std::printf("rep %d k=%d: FAILED after %.0f s: %s\n  (logs in %s)\n", spec.rep, spec.k,
                  run_seconds, r.error.c_str(), dir.c_str());
      std::fflush(stdout);
      continue;
    }
    std::printf("rep %d k=%d: %lld steps replayed (snapshot at %lld, %lld logged past it at the "
                "kill, trainer had reported step %lld; trainer %.1f ms/step)\n",
                spec.rep, spec.k, static_cast<long long>(r.steps_replayed),
                static_cast<long long>(r.snapshot_step), static_cast<long long>(r.logged_steps),
                static_cast<long long>(r.reached_step), r.trainer_ms_per_step);
    std::printf("  detection %5.0f ms (%4.1f%%) | transfer %4.0f ms (%4.1f%%) | replay %6.0f ms "
                "(%4.1f%%, %.1f ms/step) | takeover %4.0f ms (%4.1f%%)\n",
                r.detection_ms, Share(r.detection_ms, r.total_ms), r.transfer_ms,
                Share(r.transfer_ms, r.total_ms), r.replay_ms, Share(r.replay_ms, r.total_ms),
                r.replay_ms_per_step, r.takeover_ms, Share(r.takeover_ms, r.total_ms));
    std::printf("  rebuild %.0f ms, total with detection %.0f ms; wall from the kill: slot ACTIVE "
                "again %.0f ms, new trainer's first heartbeat %.0f ms (%.0f ms outside the "
                "phases)\n",
                r.rebuild_ms, r.total_ms, r.wall_active_ms, r.wall_heartbeat_ms,
                r.wall_heartbeat_ms - r.total_ms);
    std::printf("  CPU kill -> takeover, cores: spares %s (leader first), server %.2f, rest of "
                "the machine %.2f, steal %.2f%s; load %.2f; run %.0f s\n",
                JoinFigures(r.spare_cores, 2).c_str(), r.server_cores, r.other_cores,
                r.steal_cores,
                r.other_cores + r.steal_cores > kDisturbedCores
                    ? " (DISTURBED: other work took CPU)"
                    : "",
                r.load, run_seconds);
    std::fflush(stdout);
    results[spec.k][spec.rep] = std::move(r);
  }
  const double study_minutes = absl::ToDoubleMinutes(absl::Now() - study_start);

  auto collect = [&](int k, double RunResult::*field) {
    std::vector<double> values;
    for (const auto& [rep, r] : results[k]) values.push_back(r.*field);
    return values;
  };
  auto median = [&](int k, double RunResult::*field) { return Median(collect(k, field)); };

  std::printf("\nmedians over the repetitions (study took %.1f min):\n", study_minutes);
  std::printf("  %-24s %12s %12s %8s\n", "", "k = 1", absl::StrCat("k = ", flags.k).c_str(),
              "ratio");
  struct Row {
    const char* name;
    double RunResult::*field;
  };
  const Row rows[] = {
      {"steps replayed", nullptr},
      {"detection ms", &RunResult::detection_ms},
      {"snapshot transfer ms", &RunResult::transfer_ms},
      {"replay ms", &RunResult::replay_ms},
      {"replay ms per step", &RunResult::replay_ms_per_step},
      {"takeover ms", &RunResult::takeover_ms},
      {"rebuild ms", &RunResult::rebuild_ms},
      {"total with detection ms", &RunResult::total_ms},
      {"wall kill -> ACTIVE ms", &RunResult::wall_active_ms},
      {"wall kill -> heartbeat ms", &RunResult::wall_heartbeat_ms},
      {"trainer ms per step", &RunResult::trainer_ms_per_step},
  };
  for (const Row& row : rows) {
    double a, b;
    if (row.field == nullptr) {
      std::vector<double> sa, sb;
      for (const auto& [rep, r] : results[1]) sa.push_back(r.steps_replayed);
      for (const auto& [rep, r] : results[flags.k]) sb.push_back(r.steps_replayed);
      a = Median(sa);
      b = Median(sb);
    } else {
      a = median(1, row.field);
      b = median(flags.k, row.field);
    }
    std::printf("  %-24s %12.1f %12.1f %8.3f\n", row.name, a, b, a / b);
  }
  std::printf("  per run, rebuild ms: k = 1 %s; k = %d %s\n",
              JoinFigures(collect(1, &RunResult::rebuild_ms), 0).c_str(), flags.k,
              JoinFigures(collect(flags.k, &RunResult::rebuild_ms), 0).c_str());
  int disturbed = 0;
  for (const auto& [k, runs] : results) {
    for (const auto& [rep, r] : runs) {
      disturbed += r.other_cores + r.steal_cores > kDisturbedCores ? 1 : 0;
    }
  }
  if (disturbed > 0) {
    std::printf("  %d run(s) DISTURBED (other processes or the hypervisor took more than %.2f "
                "cores): judge on a quiet machine\n",
                disturbed, kDisturbedCores);
  }

  const double k1 = median(1, &RunResult::rebuild_ms);
  const double kk = median(flags.k, &RunResult::rebuild_ms);
  const double ratio = k1 / kk;
  const double step1 = median(1, &RunResult::replay_ms_per_step);
  const double stepk = median(flags.k, &RunResult::replay_ms_per_step);
  std::printf("\nreplay per step: k = 1 %.2f ms, k = %d %.2f ms; a perfect split of all the "
              "step's work would give %.2f ms, so %.2f ms per step (%.0f%% of k = %d's) is the "
              "exchange of sums and the work every spare repeats (AdaHessian apply, checksum, "
              "batch assembly)\n",
              step1, flags.k, stepk, step1 / flags.k, stepk - step1 / flags.k,
              Share(stepk - step1 / flags.k, stepk), flags.k);
  // CPU per replayed step per spare (the window from the kill to the first heartbeat: the spares
  // idle while the failure is detected), against the wall time per step: the difference is time
  // a spare waited for the other's sums.
  auto cpu_per_step = [&](int k, int rank) {
    std::vector<double> values;
    for (const auto& [rep, r] : results[k]) {
      if (rank < static_cast<int>(r.spare_cpu_ms_per_step.size())) {
        values.push_back(r.spare_cpu_ms_per_step[rank]);
      }
    }
    return Median(values);
  };
  double together = 0;
  std::printf("CPU per replayed step (median): k = 1 %.2f ms; k = %d", cpu_per_step(1, 0), flags.k);
  for (int rank = 0; rank < flags.k; ++rank) {
    together += cpu_per_step(flags.k, rank);
    std::printf(" %s %.2f ms", rank == 0 ? "leader" : "helper", cpu_per_step(flags.k, rank));
  }
  std::printf(" (together %.2f ms, %.2fx k = 1's), against %.2f ms of wall time per step\n",
              together, together / cpu_per_step(1, 0), stepk);
  std::printf("total with detection: k = 1 %.0f ms, k = %d %.0f ms, ratio %.3f (detection is "
              "the failure detector's, %d ms timeout, the same for any k)\n",
              median(1, &RunResult::total_ms), flags.k, median(flags.k, &RunResult::total_ms),
              median(1, &RunResult::total_ms) / median(flags.k, &RunResult::total_ms),
              flags.failure_timeout_ms);
  std::printf("\nverdict against docs/design.md §9 (recovery of one slot with k = 2 spares >= %.1fx "
              "faster than k = 1; rebuild = transfer + replay + takeover): ratio %.3f %s\n",
              kTargetRatio, ratio,
              flags.k != 2 ? "(k != 2: no target)" : ratio >= kTargetRatio ? "MET" : "MISSED");
  dirs->Finish();
  std::printf("RESULT recovery: k1_ms=%.0f k%d_ms=%.0f ratio=%.3f\n", k1, flags.k, kk, ratio);
  return dirs->all_ok() ? 0 : 1;
}

}  // namespace
}  // namespace rebound::bench

int main(int argc, char** argv) {
  return rebound::bench::Main(argc, argv);
}
