#pragma once

// One way for the benchmarks that compare failure-free training throughput in two modes
// (logging_overhead: step log on | off; replication_overhead: a replicated group | a single
// server) to measure a run and to compare the two: a measured window on a started cluster
// (MeasureWindow) with the CPU every process of the cluster used, read from /proc, and the
// paired comparison of two modes over repetitions (ComparePaired).
//
// A window: every slot's first sync, then `warmup` (not measured), then GetStatus at both ends
// of `seconds`: throughput = (sum of the slots' steps at the end - at the start) x batch size /
// elapsed time. The slots' steps are what the trainers last reported (heartbeat and every sync),
// so each end is early by less than one sync period per slot. Each end also reads the CPU time of
// the trainers (their main threads apart: the training loop), of the server processes, of the
// benchmark itself and of the whole machine (/proc/stat), so that a run disturbed by other load
// on a shared machine can be told apart, and the throughput per CPU-second the cluster got,
// which other load does not move while the cluster is CPU-bound.
//
// Thread-safety: one thread (the benchmark's main thread, which owns the cluster).

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "bench/local_cluster.h"
#include "proto/rebound.pb.h"

namespace rebound::bench {

// utime + stime of every thread of `pid`, exited ones included, in clock ticks; -1 when
// /proc cannot be read.
int64_t ProcessCpuTicks(pid_t pid);
// The same for the process's main thread only (a trainer's training loop runs there).
int64_t MainThreadCpuTicks(pid_t pid);

// The machine's CPU time from the "cpu" line of /proc/stat, in clock ticks.
struct MachineCpu {
  int64_t busy = 0;   // user + nice + system + irq + softirq (guest time is inside user)
  int64_t steal = 0;  // taken by the hypervisor for other guests
  bool ok = false;
};
MachineCpu ReadMachineCpu();

struct WindowOptions {
  int trainers = 4;
  int batch_size = 1;
  absl::Duration warmup = absl::Seconds(5);
  absl::Duration window = absl::Seconds(20);
  // Checked at both ends of the window (e.g. every slot ACTIVE, no recovery): its error fails
  // the run.
  std::function<absl::Status(const GetStatusResponse&)> check;
};

struct WindowResult {
  bool ok = false;
  std::string error;
  double window_seconds = 0.0;
  int64_t steps = 0;                // every slot's steps in the window, summed
  std::vector<int64_t> slot_steps;  // per slot, in the window
  double samples_per_second = 0.0;
  double trainer_cpu_ms_per_step = 0.0;       // the trainers' CPU in the window / steps
  double trainer_loop_cpu_ms_per_step = 0.0;  // of which their main threads' (training loop)
  double server_cpu_ms_per_step = 0.0;
  double cluster_cores = 0.0;  // the cluster's CPU in the window / window time
  // samples_per_second / cluster_cores: throughput per core the cluster got.
  double samples_per_cpu_second = 0.0;
  double other_cores = 0.0;  // the rest of the machine's busy CPU in the window / window time
  double steal_cores = 0.0;
  double load = 0.0;         // mean 1-minute load average in the window
  double seconds_to_first_sync = 0.0;  // from `started`
  GetStatusResponse start_status;  // at the window's ends
  GetStatusResponse end_status;
};

// On `cluster`, whose server runs and whose trainers have been started (StartTrainers): waits
// for every slot's first sync, warms up, measures the window into `*result` (ok set when it
// completed). `started` is when the run began (for seconds_to_first_sync). An error (a child
// exited, GetStatus failed, `check` refused a status, no step in the window) is returned and
// also left in result->error.
absl::Status MeasureWindow(LocalCluster& cluster, const WindowOptions& options, absl::Time started,
                           WindowResult* result);

// The comparison of mode A with mode B over repetitions.
struct PairedComparison {
  std::vector<double> a, b;  // samples/s of each completed run, by repetition
  double a_median = 0.0, b_median = 0.0;
  std::vector<double> paired;  // A / B of the repetitions with both runs
  // The verdict: the median of the paired ratios (the two runs of a repetition follow each
  // other, so a change of the machine's load between repetitions cancels within each ratio,
  // which it does not in the ratio of the two medians); the ratio of the medians when no
  // repetition has both.
  double ratio = 0.0;
  double a_per_cpu_median = 0.0, b_per_cpu_median = 0.0;  // samples per cluster CPU-second
};

// `a` and `b` map a repetition to its completed run.
PairedComparison ComparePaired(const std::map<int, WindowResult>& a,
                               const std::map<int, WindowResult>& b);

// (max - min) / median of `values`; 0 for fewer than two.
double Spread(const std::vector<double>& values);

// The median over `runs` of one field.
double MedianOf(const std::map<int, WindowResult>& runs, double WindowResult::*field);

}  // namespace rebound::bench
