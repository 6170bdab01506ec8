#include "bench/throughput_window.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/figures.h"
#include "bench/load_average.h"
#include "common/file.h"

namespace rebound::bench {
namespace {

constexpr absl::Duration kSamplePeriod = absl::Seconds(1);
constexpr absl::Duration kTick = absl::Milliseconds(50);

// utime + stime from a /proc stat file, or -1 when it cannot be read.
int64_t StatCpuTicks(const std::string& path) {
  const std::string text = ReadFileOrEmpty(path);
  // The command name (field 2) may hold spaces; the fields after its closing parenthesis are
  // state (3), ..., utime (14), stime (15).
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return -1;
  std::vector<std::string> fields =
      absl::StrSplit(text.substr(close + 1), ' ', absl::SkipWhitespace());
  int64_t utime = 0, stime = 0;
  if (fields.size() < 13 || !absl::SimpleAtoi(fields[11], &utime) ||
      !absl::SimpleAtoi(fields[12], &stime)) {
    return -1;
  }
  return utime + stime;
}

// Everything read at one end of the measured window.
struct Probe {
  absl::Time at;  // the middle of the GetStatus call
  GetStatusResponse status;
  std::vector<int64_t> trainer_ticks;
  std::vector<int64_t> trainer_loop_ticks;  // main threads
  int64_t server_ticks = 0;                 // -1 when one could not be read
  int64_t self_ticks = 0;
  MachineCpu machine;
};

absl::StatusOr<Probe> TakeProbe(LocalCluster& cluster, const WindowOptions& options) {
  Probe probe;
  // CPU first, then the status: the status is the figure that defines the window.
  probe.machine = ReadMachineCpu();
  for (const auto& trainer : cluster.trainers()) {
    probe.trainer_ticks.push_back(ProcessCpuTicks(trainer->pid()));
    probe.trainer_loop_ticks.push_back(MainThreadCpuTicks(trainer->pid()));
  }
  // The server's CPU: every member of the cluster (a single server is member 0; a replicated or
  // sharded cluster's groups are all its members).
  std::vector<pid_t> servers;
  for (int i = 0; i < cluster.members(); ++i) servers.push_back(cluster.member(i).pid());
  for (pid_t pid : servers) {
    const int64_t ticks = ProcessCpuTicks(pid);
    if (ticks < 0 || probe.server_ticks < 0) {
      probe.server_ticks = -1;
    } else {
      probe.server_ticks += ticks;
    }
  }
  probe.self_ticks = ProcessCpuTicks(getpid());
  const absl::Time before = absl::Now();
  absl::StatusOr<GetStatusResponse> status = cluster.GetStatus();
  const absl::Time after = absl::Now();
  if (!status.ok()) return status.status();
  if (options.check) {
    if (absl::Status ok = options.check(*status); !ok.ok()) return ok;
  }
  probe.at = before + (after - before) / 2;
  probe.status = *std::move(status);
  return probe;
}

// Sleeps for `duration` while watching the children; samples the load average once a second
// into *load when it is given.
absl::Status Watch(LocalCluster& cluster, absl::Duration duration, LoadAverageMeter* load) {
  const absl::Time start = absl::Now();
  absl::Time next_sample = start + kSamplePeriod;
  return cluster.Watch(start + duration, kTick, [&](absl::Time now) {
    if (load != nullptr && now >= next_sample) {
      next_sample += kSamplePeriod;
      load->Sample();
    }
  });
}

absl::Status Measure(LocalCluster& cluster, const WindowOptions& options, absl::Time started,
                     WindowResult* result) {
  if (absl::Status s = cluster.WaitForFirstSyncs(options.trainers); !s.ok()) return s;
  result->seconds_to_first_sync = absl::ToDoubleSeconds(absl::Now() - started);
  if (absl::Status s = Watch(cluster, options.warmup, nullptr); !s.ok()) return s;

  absl::StatusOr<Probe> start = TakeProbe(cluster, options);
  if (!start.ok()) return start.status();
  LoadAverageMeter load;
  if (absl::Status s = Watch(cluster, options.window - (absl::Now() - start->at), &load); !s.ok()) {
    return s;
  }
  absl::StatusOr<Probe> end = TakeProbe(cluster, options);
  if (!end.ok()) return end.status();

  const double seconds = absl::ToDoubleSeconds(end->at - start->at);
  result->window_seconds = seconds;
  const int slots = std::min(start->status.slots_size(), end->status.slots_size());
  for (int r = 0; r < slots; ++r) {
    const int64_t steps = end->status.slots(r).step() - start->status.slots(r).step();
    result->slot_steps.push_back(steps);
    result->steps += steps;
  }
  if (result->steps <= 0) return absl::InternalError("no training step in the window");
  result->samples_per_second =
      static_cast<double>(result->steps) * options.batch_size / seconds;

  const double tick_ms = 1000.0 / static_cast<double>(sysconf(_SC_CLK_TCK));
  int64_t trainer_ticks = 0;
  int64_t trainer_loop_ticks = 0;
  for (size_t r = 0; r < start->trainer_ticks.size(); ++r) {
    if (start->trainer_ticks[r] < 0 || end->trainer_ticks[r] < 0 ||
        start->trainer_loop_ticks[r] < 0 || end->trainer_loop_ticks[r] < 0) {
      return absl::InternalError("cannot read a trainer's CPU time from /proc");
    }
    trainer_ticks += end->trainer_ticks[r] - start->trainer_ticks[r];
    trainer_loop_ticks += end->trainer_loop_ticks[r] - start->trainer_loop_ticks[r];
  }
  if (start->server_ticks < 0 || end->server_ticks < 0) {
    return absl::InternalError("cannot read the server's CPU time from /proc");
  }
  const int64_t server_ticks = end->server_ticks - start->server_ticks;
  const int64_t self_ticks = end->self_ticks - start->self_ticks;
  result->trainer_cpu_ms_per_step = trainer_ticks * tick_ms / result->steps;
  result->trainer_loop_cpu_ms_per_step = trainer_loop_ticks * tick_ms / result->steps;
  result->server_cpu_ms_per_step = server_ticks * tick_ms / result->steps;
  const double ours_ms = (trainer_ticks + server_ticks + self_ticks) * tick_ms;
  result->cluster_cores = ours_ms / 1000.0 / seconds;
  result->samples_per_cpu_second =
      result->cluster_cores > 0.0 ? result->samples_per_second / result->cluster_cores : NAN;
  if (start->machine.ok && end->machine.ok) {
    const double busy_ms = (end->machine.busy - start->machine.busy) * tick_ms;
    result->other_cores = std::max(0.0, busy_ms - ours_ms) / 1000.0 / seconds;
    result->steal_cores = (end->machine.steal - start->machine.steal) * tick_ms / 1000.0 / seconds;
  } else {
    result->other_cores = NAN;
    result->steal_cores = NAN;
  }
  result->load = load.Mean();
  result->start_status = std::move(start->status);
  result->end_status = std::move(end->status);
  return absl::OkStatus();
}

}  // namespace

int64_t ProcessCpuTicks(pid_t pid) { return StatCpuTicks(absl::StrCat("/proc/", pid, "/stat")); }

int64_t MainThreadCpuTicks(pid_t pid) {
  return StatCpuTicks(absl::StrCat("/proc/", pid, "/task/", pid, "/stat"));
}

MachineCpu ReadMachineCpu() {
  MachineCpu cpu;
  const std::string text = ReadFileOrEmpty("/proc/stat");
  const std::string first = text.substr(0, text.find('\n'));
  std::vector<std::string> fields = absl::StrSplit(first, ' ', absl::SkipWhitespace());
  // cpu user nice system idle iowait irq softirq steal ...
  std::vector<int64_t> v;
  for (size_t i = 1; i < fields.size() && i <= 8; ++i) {
    int64_t value = 0;
    if (!absl::SimpleAtoi(fields[i], &value)) return cpu;
    v.push_back(value);
  }
  if (fields.empty() || fields[0] != "cpu" || v.size() < 8) return cpu;
  cpu.busy = v[0] + v[1] + v[2] + v[5] + v[6];
  cpu.steal = v[7];
  cpu.ok = true;
  return cpu;
}

absl::Status MeasureWindow(LocalCluster& cluster, const WindowOptions& options, absl::Time started,
                           WindowResult* result) {
  absl::Status status = Measure(cluster, options, started, result);
  result->ok = status.ok();
  if (!status.ok()) result->error = std::string(status.message());
  return status;
}

PairedComparison ComparePaired(const std::map<int, WindowResult>& a,
                               const std::map<int, WindowResult>& b) {
  PairedComparison out;
  for (const auto& [rep, run] : a) out.a.push_back(run.samples_per_second);
  for (const auto& [rep, run] : b) out.b.push_back(run.samples_per_second);
  out.a_median = Median(out.a);
  out.b_median = Median(out.b);
  for (const auto& [rep, run] : a) {
    auto other = b.find(rep);
    if (other != b.end()) out.paired.push_back(run.samples_per_second / other->second.samples_per_second);
  }
  out.ratio = out.paired.empty() ? out.a_median / out.b_median : Median(out.paired);
  out.a_per_cpu_median = MedianOf(a, &WindowResult::samples_per_cpu_second);
  out.b_per_cpu_median = MedianOf(b, &WindowResult::samples_per_cpu_second);
  return out;
}

double Spread(const std::vector<double>& values) {
  if (values.size() < 2) return 0.0;
  const auto [lo, hi] = std::minmax_element(values.begin(), values.end());
  return (*hi - *lo) / Median(values);
}

double MedianOf(const std::map<int, WindowResult>& runs, double WindowResult::*field) {
  std::vector<double> values;
  for (const auto& [rep, run] : runs) values.push_back(run.*field);
  return Median(values);
}

}  // namespace rebound::bench
