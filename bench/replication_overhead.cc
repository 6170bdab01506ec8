// Replication overhead benchmark (R13, docs/design.md §10.1): failure-free training throughput of the
// shipped job with a replicated server group (a leader and 1 standby, synchronous: every sync is
// answered only once the standby has it durably) vs a single server, both durable.
//
// Runs the shipped job (configs/job.pbtxt) on a real local cluster on loopback: 4 rebound_worker
// trainers started one after the other (trainer i owns slot i), no spare, no evaluator, nothing
// killed, against either
//   GROUP:  2 rebound_server members (testing/cluster with standbys = 1), each with its own data
//           directory, and 3 etcd members; the workers get both members' addresses;
//   SINGLE: 1 rebound_server with a data directory;
// both with the shipped durability (fsync false: every commit is in RocksDB's write-ahead log
// before it is answered, not synced; in GROUP also in the standby's). Each run measures one window
// (bench/throughput_window.h): every slot's first sync, --warmup_seconds, then --seconds between
// two GetStatus calls: samples/s = summed slot steps x batch size / time. GROUP and SINGLE runs
// alternate over --reps repetitions (GROUP first in even ones), and the verdict is the median of
// the paired ratios GROUP/SINGLE, which cancels a change of the shared machine's load between
// repetitions. Each run also prints the CPU per step of the trainers and of the server processes
// (GROUP: both members), the rest of the machine's CPU and the load.
//
// Overrides of the shipped job: job_id "bench-replication-overhead"; replicas 4, spares 0,
// evaluator false; max_steps 10^9 (runs are bounded by wall time). Everything else is the
// shipped job's.
//
// Last line:
//   RESULT replication_overhead: replicated_samples_s=<x> single_samples_s=<y> ratio=<r>
// (medians over the repetitions; r the median of the paired ratios). Exit code 0 when every run
// completed (whatever the verdict), 1 when a run failed, 2 on bad flags.
//
// Flags: --reps=N (3) --seconds=S (20) --warmup_seconds=S (5) --job=PATH --server_binary=PATH
// --worker_binary=PATH --keep_logs.

#include <unistd.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "bench/figures.h"
#include "bench/flags.h"
#include "bench/load_average.h"
#include "bench/local_cluster.h"
#include "bench/throughput_window.h"
#include "common/status_macros.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"

namespace rebound::bench {
namespace {

constexpr int kTrainers = 4;
constexpr char kJobId[] = "bench-replication-overhead";
// The target of the R13 issue.
constexpr double kTargetRatio = 0.85;
// Per-run cost besides the warm-up and the window (etcd, start, data loading, stop): only for
// the estimate printed at the start.
constexpr double kOverheadSecondsEstimate = 12.0;

struct Flags {
  int reps = 3;
  int seconds = 20;
  int warmup_seconds = 5;
  ClusterFlags cluster;
};

constexpr char kUsage[] =
    "usage: replication_overhead [--reps=N] [--seconds=S] [--warmup_seconds=S] [--job=PATH] "
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

struct RunSpec {
  bool replicated;
  int rep;
};

const char* ModeName(bool replicated) { return replicated ? "GROUP" : "SINGLE"; }

// Every slot ACTIVE, no recovery; in GROUP the standby in sync the whole window (a dropped
// standby would make the run a single server's).
absl::Status CheckRun(const GetStatusResponse& status, bool replicated) {
  if (status.slots_size() != kTrainers) {
    return absl::InternalError(absl::StrCat("GetStatus lists ", status.slots_size(), " slots"));
  }
  for (const SlotStatus& slot : status.slots()) {
    if (slot.state() != ACTIVE) {
      return absl::InternalError(absl::StrCat("slot ", slot.slot().replica(), " is ",
                                              SlotState_Name(slot.state())));
    }
  }
  if (status.recoveries_size() > 0) return absl::InternalError("a recovery ran");
  if (replicated) {
    const GroupStatus& group = status.group();
    if (group.role() != GroupStatus::LEADER || group.standbys_size() != 1 ||
        !group.standbys(0).in_sync()) {
      return absl::InternalError(
          absl::StrCat("the standby is not in sync: ", group.ShortDebugString()));
    }
  }
  return absl::OkStatus();
}

WindowResult Execute(const Flags& flags, const JobConfig& base, const std::string& dir,
                     const RunSpec& spec) {
  WindowResult result;
  LocalCluster cluster(flags.cluster, dir, spec.replicated ? 1 : 0);
  JobConfig job = base;
  job.set_job_id(kJobId);
  job.mutable_topology()->set_replicas(kTrainers);
  job.mutable_topology()->set_spares(0);
  job.mutable_topology()->set_evaluator(false);
  job.mutable_training()->set_max_steps(1000000000);
  const absl::Time started = absl::Now();
  absl::Status status = cluster.StartServer(job, dir + "/data");
  if (status.ok() && spec.replicated) {
    // The standby in sync before the trainers start: the window measures the replicated path.
    status = cluster
                 .WaitForStatus(
                     [](const GetStatusResponse& s) {
                       return s.group().standbys_size() == 1 && s.group().standbys(0).in_sync();
                     },
                     absl::Seconds(60), "the standby in sync")
                 .status();
  }
  if (status.ok()) status = cluster.StartTrainers(kTrainers);
  if (status.ok()) {
    WindowOptions window;
    window.trainers = kTrainers;
    window.batch_size = base.data().batch_size();
    window.warmup = absl::Seconds(flags.warmup_seconds);
    window.window = absl::Seconds(flags.seconds);
    const bool replicated = spec.replicated;
    window.check = [replicated](const GetStatusResponse& s) { return CheckRun(s, replicated); };
    status = MeasureWindow(cluster, window, started, &result);
  }
  cluster.StopAll(status.ok(), [](const ChildProcess&, int) {});
  if (!status.ok()) {
    result.ok = false;
    result.error = std::string(status.message());
  }
  return result;
}

int Main(int argc, char** argv) {
  Flags flags = ParseFlags(argc, argv);
  absl::StatusOr<JobConfig> base = ResolveClusterFlags(&flags.cluster);
  if (!base.ok()) ExitWithUsage(std::string(base.status().message()), kUsage);
  absl::StatusOr<RunDirectories> dirs =
      RunDirectories::Create("replication-overhead", flags.cluster.keep_logs);
  if (!dirs.ok()) {
    std::fprintf(stderr, "%s\n", std::string(dirs.status().message()).c_str());
    return 1;
  }
  std::vector<RunSpec> specs;
  for (int rep = 0; rep < flags.reps; ++rep) {
    const bool first = rep % 2 == 0;
    specs.push_back({first, rep});
    specs.push_back({!first, rep});
  }
  const JobConfig& job = *base;
  std::printf("replication_overhead benchmark: failure-free throughput with a replicated server "
              "group (leader + 1 standby, sync, 3 etcd members) vs a single server, both durable "
              "(durability.fsync false, as shipped)\n");
  std::printf("job: %s, batch %d, tau %d; %d trainers, no spare, no evaluator; %zu runs (%d "
              "repetitions, order alternating): %d s warm-up, %d s window; about %.1f min; %d "
              "cores online, load %.2f; logs in %s\n\n",
              flags.cluster.job.c_str(), job.data().batch_size(), job.easgd().sync_period(),
              kTrainers, specs.size(), flags.reps, flags.warmup_seconds, flags.seconds,
              specs.size() * (flags.warmup_seconds + flags.seconds + kOverheadSecondsEstimate) /
                  60.0,
              static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)), LoadAverage(),
              dirs->path().c_str());
  std::fflush(stdout);

  std::map<bool, std::map<int, WindowResult>> results;
  for (const RunSpec& spec : specs) {
    const std::string dir =
        dirs->StartRun(absl::StrCat("rep", spec.rep, "-", ModeName(spec.replicated)));
    const absl::Time run_start = absl::Now();
    WindowResult result = Execute(flags, job, dir, spec);
    const double run_seconds = absl::ToDoubleSeconds(absl::Now() - run_start);
    dirs->FinishRun(dir, result.ok);
    if (!result.ok) {
      std::printf("rep %d %-6s: FAILED after %.0f s: %s\n  (logs in %s)\n", spec.rep,
                  ModeName(spec.replicated), run_seconds, result.error.c_str(), dir.c_str());
      std::fflush(stdout);
      continue;
    }
    std::printf("rep %d %-6s: %8.1f samples/s (%lld steps in %.2f s, per slot %s); CPU ms/step "
                "trainers %.3f server(s) %.3f; cores: cluster %.2f other %.2f steal %.2f; load "
                "%.2f; %.0f s\n",
                spec.rep, ModeName(spec.replicated), result.samples_per_second,
                static_cast<long long>(result.steps), result.window_seconds,
                absl::StrJoin(result.slot_steps, "/").c_str(), result.trainer_cpu_ms_per_step,
                result.server_cpu_ms_per_step, result.cluster_cores, result.other_cores,
                result.steal_cores, result.load, run_seconds);
    std::fflush(stdout);
    results[spec.replicated][spec.rep] = std::move(result);
  }
  const PairedComparison compared = ComparePaired(results[true], results[false]);
  std::printf("\nthroughput (samples/s):\n");
  std::printf("  GROUP  (leader + standby): %-30s median %8.1f  (range %.1f%%)\n",
              JoinFigures(compared.a, 1).c_str(), compared.a_median, 100.0 * Spread(compared.a));
  std::printf("  SINGLE (one server):       %-30s median %8.1f  (range %.1f%%)\n",
              JoinFigures(compared.b, 1).c_str(), compared.b_median, 100.0 * Spread(compared.b));
  std::printf("  ratio of the medians %.4f; paired per repetition %s (median %.4f: the verdict)\n",
              compared.a_median / compared.b_median, JoinFigures(compared.paired, 4).c_str(),
              compared.ratio);
  std::printf("  per cluster CPU-second: GROUP %.1f, SINGLE %.1f, ratio %.4f\n",
              compared.a_per_cpu_median, compared.b_per_cpu_median,
              compared.a_per_cpu_median / compared.b_per_cpu_median);
  std::printf("  server CPU per step (medians): GROUP %.3f ms (both members), SINGLE %.3f ms\n",
              MedianOf(results[true], &WindowResult::server_cpu_ms_per_step),
              MedianOf(results[false], &WindowResult::server_cpu_ms_per_step));
  std::printf("\nverdict against R13 (replicated >= %.2fx single, failure-free): ratio %.4f %s\n",
              kTargetRatio, compared.ratio, compared.ratio >= kTargetRatio ? "MET" : "MISSED");
  dirs->Finish();
  std::printf("RESULT replication_overhead: replicated_samples_s=%.1f single_samples_s=%.1f "
              "ratio=%.4f\n",
              compared.a_median, compared.b_median, compared.ratio);
  return dirs->all_ok() ? 0 : 1;
}

}  // namespace
}  // namespace rebound::bench

int main(int argc, char** argv) { return rebound::bench::Main(argc, argv); }
