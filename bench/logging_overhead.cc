// Step-log overhead benchmark (docs/design.md §9: "failure-free throughput, logging on | logging off |
// >= 0.95x").
//
// Runs the shipped job (configs/job.pbtxt) on a real local cluster on loopback: one
// rebound_server (inline job, in-memory state) and 4 rebound_worker trainers started one after the
// other (so trainer i owns slot i), no spare, no evaluator, nothing killed. The job is run with
// step_log.enabled true (ON) and false (OFF); everything else is the same. Each run:
//   1. starts the cluster and waits until every slot has synced once (data loaded, first sync);
//   2. trains on for --warmup_seconds (not measured);
//   3. reads GetStatus (sum of the slots' steps, step_log counters), trains for --seconds, reads
//      GetStatus again: throughput = (sum of steps at end - at start) x batch_size / elapsed time.
// The slots' steps are what the trainers last reported (heartbeat every heartbeat_interval_ms
// and every sync), so each end of the window is early by less than one sync period per slot.
//
// ON and OFF runs alternate over --reps repetitions, ON first in even repetitions and OFF first
// in odd ones, so that a drift of the machine's load hits both alike. The verdict is the median
// of the per-repetition ratios ON/OFF: the two runs of a repetition follow each other, so a
// change of load between repetitions (other builds on a shared machine) cancels within each
// ratio, which it does not in the ratio of the two medians (also printed). Shorter windows and
// more repetitions (the defaults: 4 x 20 s) serve that better than a few long ones. The machine
// is shared: each run also prints the CPU the cluster used (from /proc/PID/stat of every
// child), the CPU everything else on the machine used in the window (busy time in /proc/stat
// minus the cluster's), steal time and the load average, so that a disturbed run can be told
// apart, and the throughput per CPU-second the cluster got (samples/s / cluster cores), which
// other load does not move as long as the cluster is CPU-bound (4 single-threaded trainers and
// the server on 2 cores are), with its ON/OFF ratio as a second, load-independent reading.
//
// Besides throughput the benchmark prints, to show where logging's time goes: the trainers' CPU
// per training step (split into their main threads, which run the training loop, and the other
// threads: step logger, gRPC, heartbeats) and the server's, in ON and OFF runs, the step log's
// records and bytes committed per second (GetStatus.step_log), and an in-process timing of the
// per-step parameter checksum (xxHash64 over the parameters where they are, as
// MlpStage::ParamsChecksum does on the CPU backend).
//
// Overrides of the shipped job: job_id "bench-logging-overhead"; topology.replicas 4, spares 0,
// evaluator false; training.max_steps 10^9 (runs are bounded by wall time); fault_tolerance.policy
// REPLAY; step_log.enabled per run. Everything else (model, batch, micro-batches, tau, compute
// threads, step_log.buffer_bytes and compression) is the shipped job's.
//
// Last line:
//   RESULT logging_overhead: on_samples_s=<x> off_samples_s=<y> ratio=<r>
// with x and y the medians over the repetitions and r the median of the paired ratios (above).
// Exit code 0 when every run completed (whatever the verdict), 1 when a run failed, 2 on bad
// flags.
//
// Flags (--name=value or --name value): --reps=N (4) --seconds=S (20, the measured window)
// --warmup_seconds=S (5) --job=PATH (configs/job.pbtxt from the runfiles) --server_binary=PATH
// --worker_binary=PATH --keep_logs (keep every run's directory; failed runs are always kept).

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
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
#include "bench/load_average.h"
#include "bench/throughput_window.h"
#include "common/status_macros.h"
#include "common/checksum.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"

namespace rebound::bench {
namespace {

constexpr int kTrainers = 4;
constexpr char kJobId[] = "bench-logging-overhead";
// Per-run cost besides --warmup_seconds and --seconds (start, data loading, first syncs, stop),
// measured on 2 shared cores; only used for the time estimate printed at the start.
constexpr double kOverheadSecondsEstimate = 8.0;
// The target of docs/design.md §9.
constexpr double kTargetRatio = 0.95;

// ---------------------------------------------------------------------------------------------
// Flags

struct Flags {
  int reps = 4;
  int seconds = 20;
  int warmup_seconds = 5;
  ClusterFlags cluster;  // --job, --server_binary, --worker_binary, --keep_logs
};

constexpr char kUsage[] =
    "usage: logging_overhead [--reps=N] [--seconds=S] [--warmup_seconds=S] [--job=PATH] "
    "[--server_binary=PATH] [--worker_binary=PATH] [--keep_logs]";

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  CommandLine command_line(kUsage);
  command_line.AddInt("reps", &flags.reps);
  command_line.AddInt("seconds", &flags.seconds);
  command_line.AddInt("warmup_seconds", &flags.warmup_seconds);
  flags.cluster.AddTo(&command_line);
  command_line.Parse(argc, argv);
  if (flags.reps < 1) command_line.Usage("--reps must be >= 1");
  if (flags.seconds < 1) command_line.Usage("--seconds must be >= 1");
  if (flags.warmup_seconds < 0) command_line.Usage("--warmup_seconds must be >= 0");
  return flags;
}

// ---------------------------------------------------------------------------------------------
// One run

struct RunSpec {
  bool logging;
  int rep;  // in [0, --reps)
};

const char* ModeName(bool logging) { return logging ? "ON" : "OFF"; }

// A measured window (bench/throughput_window.h) and the step log's figures in it.
struct RunResult : WindowResult {
  double records_per_second = 0.0;  // step_log.records_written in the window
  double bytes_per_second = 0.0;    // step_log.bytes_written in the window
  int64_t records_total = 0;        // step_log.records_written at the window's end
};

// Every slot must be ACTIVE (trained by its first trainer, not finished) with no recovery.
absl::Status CheckFailureFree(const GetStatusResponse& status) {
  if (status.slots_size() != kTrainers) {
    return absl::InternalError(absl::StrCat("GetStatus lists ", status.slots_size(), " slots"));
  }
  for (const SlotStatus& slot : status.slots()) {
    if (slot.state() != ACTIVE) {
      return absl::InternalError(absl::StrCat("slot ", slot.slot().replica(), " is ",
                                              SlotState_Name(slot.state()), ": ", slot.detail()));
    }
  }
  if (status.recoveries_size() > 0) {
    return absl::InternalError("a recovery ran: the run was not failure-free");
  }
  return absl::OkStatus();
}

class Run {
 public:
  Run(const Flags& flags, const JobConfig& base_job, const std::string& dir, const RunSpec& spec)
      : flags_(flags), base_job_(base_job), spec_(spec), cluster_(flags.cluster, dir) {}

  RunResult Execute() {
    RunResult result;
    const absl::Status status = Train(&result);
    // SIGTERM (SIGKILL after a bound) to the trainers, then the server.
    cluster_.StopAll(result.ok, [&result](const ChildProcess& trainer, int code) {
      if (code != 0 && result.ok) {
        std::fprintf(stderr, "note: %s exited with code %d after SIGTERM\n",
                     trainer.log_path().c_str(), code);
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
    job.set_job_id(kJobId);
    job.mutable_topology()->set_replicas(kTrainers);
    job.mutable_topology()->set_spares(0);
    job.mutable_topology()->set_evaluator(false);
    job.mutable_training()->set_max_steps(1000000000);
    job.mutable_fault_tolerance()->set_policy(REPLAY);
    job.mutable_step_log()->set_enabled(spec_.logging);
    return job;
  }

  absl::Status Train(RunResult* result) {
    const absl::Time started = absl::Now();
    if (absl::Status s = cluster_.StartServer(Job()); !s.ok()) return s;
    // One trainer at a time, so that trainer i owns slot i (the server hands out the lowest free
    // slot): every run trains the same shards in the same processes' order.
    if (absl::Status s = cluster_.StartTrainers(kTrainers); !s.ok()) return s;
    WindowOptions window;
    window.trainers = kTrainers;
    window.batch_size = base_job_.data().batch_size();
    window.warmup = absl::Seconds(flags_.warmup_seconds);
    window.window = absl::Seconds(flags_.seconds);
    window.check = CheckFailureFree;
    RETURN_IF_ERROR(MeasureWindow(cluster_, window, started, result));

    const double seconds = result->window_seconds;
    const StepLogStatus& log_start = result->start_status.step_log();
    const StepLogStatus& log_end = result->end_status.step_log();
    result->records_total = log_end.records_written();
    result->records_per_second = (log_end.records_written() - log_start.records_written()) / seconds;
    result->bytes_per_second = (log_end.bytes_written() - log_start.bytes_written()) / seconds;
    if (spec_.logging && result->records_per_second <= 0.0) {
      return absl::InternalError("step_log.enabled is true but no record was written");
    }
    if (!spec_.logging && log_end.records_written() != 0) {
      return absl::InternalError(absl::StrCat("step_log.enabled is false but ",
                                              log_end.records_written(),
                                              " records were written"));
    }
    return absl::OkStatus();
  }

  const Flags& flags_;
  const JobConfig& base_job_;
  const RunSpec spec_;
  LocalCluster cluster_;
};

// ---------------------------------------------------------------------------------------------
// The per-step checksum, timed in process

struct ChecksumCost {
  int64_t parameters = 0;
  double hash_us = 0.0;  // xxHash64 over the parameters, in place
};

// Weights and biases of the model, i.e. the floats of the packed layout.
int64_t ParameterCount(const ModelSpec& model) {
  int64_t count = 0;
  int64_t in = model.input_dim();
  for (const LayerSpec& layer : model.layers()) {
    count += in * layer.width() + layer.width();
    in = layer.width();
  }
  return count;
}

ChecksumCost TimeChecksum(const ModelSpec& model) {
  ChecksumCost cost;
  cost.parameters = ParameterCount(model);
  std::vector<float> params(cost.parameters);
  for (int64_t i = 0; i < cost.parameters; ++i) params[i] = 1e-3f * static_cast<float>(i % 977);
  constexpr int kWarmup = 20;
  constexpr int kRounds = 200;
  uint64_t sink = 0;
  for (int i = 0; i < kWarmup; ++i) sink ^= ChecksumFloats(params);
  // The best of a few batches: the figure is the cost on an unloaded core.
  double best_hash = INFINITY;
  for (int batch = 0; batch < 5; ++batch) {
    const absl::Time t = absl::Now();
    for (int i = 0; i < kRounds; ++i) {
      params[i % params.size()] += 1e-7f;
      sink ^= ChecksumFloats(params);
    }
    best_hash = std::min(best_hash, absl::ToDoubleMicroseconds(absl::Now() - t) / kRounds);
  }
  if (sink == 0x5eed) std::printf(" ");  // keeps the work observable
  cost.hash_us = best_hash;
  return cost;
}

// ---------------------------------------------------------------------------------------------
// Summary

int Main(int argc, char** argv) {
  Flags flags = ParseFlags(argc, argv);
  absl::StatusOr<JobConfig> base_job = ResolveClusterFlags(&flags.cluster);
  if (!base_job.ok()) ExitWithUsage(std::string(base_job.status().message()), kUsage);
  absl::StatusOr<RunDirectories> dirs = RunDirectories::Create("logging-overhead",
                                                                flags.cluster.keep_logs);
  if (!dirs.ok()) {
    std::fprintf(stderr, "%s\n", std::string(dirs.status().message()).c_str());
    return 1;
  }
  const std::string& workdir = dirs->path();

  std::vector<RunSpec> specs;
  for (int rep = 0; rep < flags.reps; ++rep) {
    // ON first in even repetitions, OFF first in odd ones: a drift in load hits both.
    const bool first = rep % 2 == 0;
    specs.push_back({first, rep});
    specs.push_back({!first, rep});
  }

  const JobConfig& job = *base_job;
  const int batch = job.data().batch_size();
  std::printf("logging_overhead benchmark: failure-free training throughput with the step log ON "
              "(step_log.enabled true) vs OFF, same job, same run\n");
  std::printf("job: %s (%s), MLP %d", flags.cluster.job.c_str(), job.job_id().c_str(),
              job.model().input_dim());
  for (const LayerSpec& layer : job.model().layers()) std::printf("-%d", layer.width());
  std::printf(" (%lld parameters), batch %d in %d micro-batches, tau %d, %s backend x %d "
              "thread(s); %d trainers, no spare, no evaluator, policy REPLAY, in-memory server, "
              "step_log buffer %lld B, %s\n",
              static_cast<long long>(ParameterCount(job.model())), batch,
              job.data().micro_batches(), job.easgd().sync_period(),
              BackendKind_Name(job.compute().backend()).c_str(), job.compute().threads(),
              kTrainers, static_cast<long long>(job.step_log().buffer_bytes()),
              Compression_Name(job.step_log().compression()).c_str());
  std::printf("%zu runs (%d repetitions of ON/OFF, order alternating): %d s warm-up after every "
              "slot's first sync, then a %d s window; about %.1f min; %d cores online, load "
              "%.2f; logs in %s\n",
              specs.size(), flags.reps, flags.warmup_seconds, flags.seconds,
              specs.size() * (flags.warmup_seconds + flags.seconds + kOverheadSecondsEstimate) /
                  60.0,
              static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)), LoadAverage(), workdir.c_str());
  std::fflush(stdout);

  const ChecksumCost checksum = TimeChecksum(job.model());
  std::printf("per-step checksum, in process: xxHash64 of %lld floats in place %.1f us\n\n",
              static_cast<long long>(checksum.parameters), checksum.hash_us);
  std::fflush(stdout);

  const absl::Time study_start = absl::Now();
  std::map<bool, std::map<int, RunResult>> results;  // logging -> rep -> result
  for (const RunSpec& spec : specs) {
    const std::string dir =
        dirs->StartRun(absl::StrCat("rep", spec.rep, "-", ModeName(spec.logging)));
    const absl::Time run_start = absl::Now();
    RunResult result = Run(flags, job, dir, spec).Execute();
    const double run_seconds = absl::ToDoubleSeconds(absl::Now() - run_start);
    dirs->FinishRun(dir, result.ok);
    if (!result.ok) {
      std::printf("rep %d %-3s: FAILED after %.0f s: %s\n  (logs in %s)\n", spec.rep,
                  ModeName(spec.logging), run_seconds, result.error.c_str(), dir.c_str());
      std::fflush(stdout);
      continue;
    }
    std::printf("rep %d %-3s: %8.1f samples/s (%lld steps in %.2f s, per slot %s); log %7.1f "
                "records/s %9.0f B/s; CPU ms/step trainers %.3f (loop %.3f) server %.3f; cores: cluster "
                "%.2f other %.2f steal %.2f (%.0f samples per cluster CPU-s); load %.2f; %.0f s "
                "(%.1f s to first syncs)\n",
                spec.rep, ModeName(spec.logging), result.samples_per_second,
                static_cast<long long>(result.steps), result.window_seconds,
                absl::StrJoin(result.slot_steps, "/").c_str(), result.records_per_second,
                result.bytes_per_second, result.trainer_cpu_ms_per_step,
                result.trainer_loop_cpu_ms_per_step,
                result.server_cpu_ms_per_step, result.cluster_cores, result.other_cores,
                result.steal_cores, result.samples_per_cpu_second, result.load, run_seconds, result.seconds_to_first_sync);
    std::fflush(stdout);
    results[spec.logging][spec.rep] = std::move(result);
  }
  const double study_minutes = absl::ToDoubleMinutes(absl::Now() - study_start);

  auto collect = [&](bool logging, double RunResult::*field) {
    std::vector<double> values;
    for (const auto& [rep, r] : results[logging]) values.push_back(r.*field);
    return values;
  };
  std::map<int, WindowResult> on_runs, off_runs;
  for (const auto& [rep, r] : results[true]) on_runs[rep] = r;
  for (const auto& [rep, r] : results[false]) off_runs[rep] = r;
  const PairedComparison compared = ComparePaired(on_runs, off_runs);
  const std::vector<double>& on = compared.a;
  const std::vector<double>& off = compared.b;
  const double on_median = compared.a_median;
  const double off_median = compared.b_median;
  const double ratio = compared.ratio;

  std::printf("\nthroughput over %d s windows (samples/s = trainer steps x batch %d; study took "
              "%.1f min)\n",
              flags.seconds, batch, study_minutes);
  std::printf("  ON  (logging):    %-30s median %8.1f  (range %.1f%% of the median)\n",
              JoinFigures(on, 1).c_str(), on_median, 100.0 * Spread(on));
  std::printf("  OFF (no logging): %-30s median %8.1f  (range %.1f%% of the median)\n",
              JoinFigures(off, 1).c_str(), off_median, 100.0 * Spread(off));
  std::printf("  ratio ON/OFF of the medians %.4f; paired per repetition %s (median %.4f: the "
              "verdict)\n",
              on_median / off_median, JoinFigures(compared.paired, 4).c_str(), ratio);

  // The same comparison per core the cluster got (see WindowResult::samples_per_cpu_second).
  const std::vector<double> on_cpu = collect(true, &RunResult::samples_per_cpu_second);
  const std::vector<double> off_cpu = collect(false, &RunResult::samples_per_cpu_second);
  std::printf("  per cluster CPU-second (load-independent while CPU-bound): ON %s median %.1f, "
              "OFF %s median %.1f, ratio %.4f\n",
              JoinFigures(on_cpu, 1).c_str(), compared.a_per_cpu_median,
              JoinFigures(off_cpu, 1).c_str(), compared.b_per_cpu_median,
              compared.a_per_cpu_median / compared.b_per_cpu_median);

  const double records_s = Median(collect(true, &RunResult::records_per_second));
  const double bytes_s = Median(collect(true, &RunResult::bytes_per_second));
  const double on_steps_s = on_median / batch;
  std::printf("\nstep log in the ON runs (GetStatus.step_log, median): %.1f records_written/s, "
              "%.0f bytes_written/s (%.1f B/record); expected %.1f records/s = steps/s %.1f x "
              "(%d micro-batches + 1 checksum)\n",
              records_s, bytes_s, records_s > 0 ? bytes_s / records_s : 0.0,
              on_steps_s * (job.data().micro_batches() + 1), on_steps_s,
              job.data().micro_batches());

  const double trainer_on = Median(collect(true, &RunResult::trainer_cpu_ms_per_step));
  const double trainer_off = Median(collect(false, &RunResult::trainer_cpu_ms_per_step));
  const double loop_on = Median(collect(true, &RunResult::trainer_loop_cpu_ms_per_step));
  const double loop_off = Median(collect(false, &RunResult::trainer_loop_cpu_ms_per_step));
  const double server_on = Median(collect(true, &RunResult::server_cpu_ms_per_step));
  const double server_off = Median(collect(false, &RunResult::server_cpu_ms_per_step));
  const double checksum_ms = checksum.hash_us / 1000.0;
  std::printf("\nwhere the time goes (CPU per training step, medians; the cluster is CPU-bound, "
              "so CPU per step sets throughput):\n");
  std::printf("  trainers: ON %.3f ms, OFF %.3f ms, +%.3f ms (%+.1f%%), of which the checksum "
              "(xxHash64 in place, timed in process) ~%.3f ms (%.1f%% of OFF)\n",
              trainer_on, trainer_off, trainer_on - trainer_off,
              100.0 * (trainer_on - trainer_off) / trainer_off, checksum_ms,
              100.0 * checksum_ms / trainer_off);
  std::printf("    training loop (main threads): ON %.3f ms, OFF %.3f ms, +%.3f ms (Append of "
              "%d records + xxHash64 of the parameters); other threads (step logger, "
              "gRPC, heartbeats): ON %.3f ms, OFF %.3f ms, +%.3f ms\n",
              loop_on, loop_off, loop_on - loop_off, job.data().micro_batches() + 1,
              trainer_on - loop_on, trainer_off - loop_off,
              (trainer_on - loop_on) - (trainer_off - loop_off));
  std::printf("  server:   ON %.3f ms, OFF %.3f ms, +%.3f ms (AppendLog streams, validation, "
              "RocksDB commits, acks)\n",
              server_on, server_off, server_on - server_off);
  std::printf("  cluster:  ON %.3f ms, OFF %.3f ms per step: CPU-bound throughput ratio "
              "expected %.4f\n",
              trainer_on + server_on, trainer_off + server_off,
              (trainer_off + server_off) / (trainer_on + server_on));
  std::printf("  machine:  other processes' CPU in the windows, median cores ON %.2f OFF %.2f; "
              "steal ON %.2f OFF %.2f\n",
              Median(collect(true, &RunResult::other_cores)),
              Median(collect(false, &RunResult::other_cores)),
              Median(collect(true, &RunResult::steal_cores)),
              Median(collect(false, &RunResult::steal_cores)));

  std::printf("\nverdict against docs/design.md §9 (failure-free throughput with logging >= %.2fx "
              "without): ratio %.4f %s\n",
              kTargetRatio, ratio, ratio >= kTargetRatio ? "MET" : "MISSED");
  dirs->Finish();
  std::printf("RESULT logging_overhead: on_samples_s=%.1f off_samples_s=%.1f ratio=%.4f\n",
              on_median, off_median, ratio);
  return dirs->all_ok() ? 0 : 1;
}

}  // namespace
}  // namespace rebound::bench

int main(int argc, char** argv) {
  return rebound::bench::Main(argc, argv);
}
