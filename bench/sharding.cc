// Sharding benchmark (R14, docs/design.md §10.2, docs/sharding.md): what splitting the center across
// K server groups buys when each group's network link is the bottleneck, and what it costs a
// small job that no link limits.
//
// 1. Sync throughput of a 64 MiB center with K = 1, 2 and 4 server groups. Every group (one
//    rebound_server, its data on disk with fsync off as shipped) runs in a network namespace of
//    its own (testing/cluster with groups_in_hosts) behind a link that tbf limits to --rate_mbit
//    in both directions, as the chaos harness throttles a link (NetworkLab::Throttle); every
//    group gets the same rate. 4 synthetic trainers (bench/synthetic_trainers.h: no compute;
//    each syncs the same precomputed parameters and AdaHessian state as fast as the groups
//    answer, through the product's protocol: K = 1 ParameterServer.Sync; K > 1 SyncRange of
//    every range in parallel, then CommitSync at group 0) run in the benchmark's own namespace,
//    so that all of a group's traffic crosses its shaped link. The model is the MLP
//    784-4096-3300-10: 16,768,470 float32 = 63.97 MiB (its K = 1 SyncRequest just fits the
//    server's default max_message_bytes of 256 MiB). Every sync sends params, m, v and last_hdiag
//    (4 x the center, as rebound_worker does) and gets c_before back (1 x). For each K the
//    trainers sync in a closed loop (RunClosedLoop): once every trainer's first sync completed
//    (warm-up: connections, TCP and HTTP/2 windows, and the trainers, which start together,
//    fall out of step), a window opens; it closes after --seconds once every trainer has
//    completed --window_syncs syncs in it. The sync rate is each trainer's own, from its syncs in
//    the window ((n - 1) / (its last's time - its first's): whole cycles of its loop), summed
//    over the trainers: it does not depend on where the window's ends fall between two syncs,
//    which matters at K = 1, where a trainer completes one about every 30 s. Throughput = that rate
//    x a sync's request + reply bytes (serialized messages), in MiB/s. Printed beside it: syncs/s,
//    the links' upload utilization (request bytes / time / (K x rate)) and the CPU the servers, the
//    trainers and the whole machine used in the window, which say whether the links bounded the
//    run, as the target assumes (the physical limit is K times the K = 1 figure).
//    --reps repetitions of the three runs; the figures are medians.
// 2. The shipped job (configs/job.pbtxt, 4 rebound_worker trainers, no spare, no evaluator,
//    data on disk) on plain loopback with K = 2 vs K = 1 groups: samples/s in a measured window
//    (bench/throughput_window.h: every slot's first sync, --small_warmup_seconds, then
//    --small_seconds); --small_reps repetitions, the order alternating; small_job_ratio is the
//    median of the paired ratios K = 2 / K = 1.
//
// Last line:
//   RESULT sharding: k1_mib_s=<x> k2_mib_s=<y> k4_mib_s=<z> k2_ratio=<y/x> k4_ratio=<z/x>
//     small_job_ratio=<r>
// Targets (R14): k2_ratio >= 1.7, k4_ratio >= 3, small_job_ratio >= 0.9. Exit code 0 when every
// run completed (whatever the verdict), 1 when a run failed (or part 1 could not run: network
// namespaces need root), 2 on bad flags. The servers' data directories (GBs for the 64 MiB
// center) are removed after each run, with --keep_logs too; the logs and configs stay.
//
// Flags: --rate_mbit=N (400) --seconds=S (20) --window_syncs=N (3) --reps=N (1) --small_reps=N (3)
// --small_seconds=S (10) --small_warmup_seconds=S (5) --skip_links (part 1) --skip_small (part 2)
// --job=PATH --server_binary=PATH
// --worker_binary=PATH --keep_logs.

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
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
#include "bench/synthetic_trainers.h"
#include "bench/throughput_window.h"
#include "common/status_macros.h"
#include "google/protobuf/text_format.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "testing/cluster/cluster.h"
#include "testing/cluster/network.h"

namespace rebound::bench {
namespace {

constexpr int kTrainers = 4;
constexpr int kGroups[] = {1, 2, 4};
constexpr char kJobId[] = "bench-sharding";
constexpr char kSmallJobId[] = "bench-sharding-small";
// The targets of the R14 issue.
constexpr double kTargetK2 = 1.7;
constexpr double kTargetK4 = 3.0;
constexpr double kTargetSmall = 0.9;
// Per-run cost besides the transfers and windows (start, registration, stop): only for the
// estimate printed at the start.
constexpr double kOverheadSecondsEstimate = 8.0;
constexpr double kCenterMiB = 63.97;

struct Flags {
  int rate_mbit = 400;
  int seconds = 20;
  int window_syncs = 3;
  int reps = 1;
  int small_reps = 3;
  int small_seconds = 10;
  int small_warmup_seconds = 5;
  bool skip_links = false;
  bool skip_small = false;
  ClusterFlags cluster;
};

constexpr char kUsage[] =
    "usage: sharding [--rate_mbit=N] [--seconds=S] [--window_syncs=N] [--reps=N] [--small_reps=N] "
    "[--small_seconds=S] "
    "[--small_warmup_seconds=S] [--skip_links] [--skip_small] [--job=PATH] [--server_binary=PATH] "
    "[--worker_binary=PATH] [--keep_logs]";

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  CommandLine command_line(kUsage);
  command_line.AddInt("rate_mbit", &flags.rate_mbit);
  command_line.AddInt("seconds", &flags.seconds);
  command_line.AddInt("window_syncs", &flags.window_syncs);
  command_line.AddInt("reps", &flags.reps);
  command_line.AddInt("small_reps", &flags.small_reps);
  command_line.AddInt("small_seconds", &flags.small_seconds);
  command_line.AddInt("small_warmup_seconds", &flags.small_warmup_seconds);
  command_line.AddSwitch("skip_links", &flags.skip_links);
  command_line.AddSwitch("skip_small", &flags.skip_small);
  flags.cluster.AddTo(&command_line);
  command_line.Parse(argc, argv);
  if (flags.rate_mbit < 1 || flags.rate_mbit > 100000) {
    command_line.Usage("--rate_mbit must be in [1, 100000]");
  }
  if (flags.seconds < 1) command_line.Usage("--seconds must be >= 1");
  if (flags.window_syncs < 2) command_line.Usage("--window_syncs must be >= 2");
  if (flags.reps < 1 || flags.small_reps < 1) {
    command_line.Usage("--reps and --small_reps must be >= 1");
  }
  if (flags.small_seconds < 1) command_line.Usage("--small_seconds must be >= 1");
  if (flags.small_warmup_seconds < 0) command_line.Usage("--small_warmup_seconds must be >= 0");
  return flags;
}

// ---- 1. the 64 MiB center behind shaped links -------------------------------------------------

// The shipped job with the big model, 4 trainers and nothing else, sharded across `groups`.
JobConfig BigJob(const JobConfig& base, int groups) {
  JobConfig job = base;
  job.set_job_id(kJobId);
  ModelSpec* model = job.mutable_model();
  model->clear_layers();
  model->set_input_dim(784);
  for (const auto& [width, activation] :
       {std::pair<int, Activation>{4096, RELU}, {3300, RELU}, {10, IDENTITY}}) {
    LayerSpec* layer = model->add_layers();
    layer->set_width(width);
    layer->set_activation(activation);
  }
  job.mutable_topology()->set_replicas(kTrainers);
  job.mutable_topology()->set_stages(1);
  job.mutable_topology()->set_spares(0);
  job.mutable_topology()->set_evaluator(false);
  job.mutable_training()->set_max_steps(1000000000);
  // A heartbeat shares a trainer's connection to group 0 with its syncs, behind a slow link:
  // it may wait seconds behind their bytes. Nothing fails in this benchmark.
  job.mutable_fault_tolerance()->set_failure_timeout_ms(120000);
  if (groups > 1) job.mutable_sharding()->set_groups(groups);
  return job;
}

struct LinkRun {
  bool ok = false;
  std::string error;
  int groups = 0;
  double seconds = 0.0;
  int64_t syncs = 0;
  double mib_s = 0.0;  // request + reply bytes per second
  double syncs_s = 0.0;
  double upload_utilization = 0.0;  // request bytes per second / (K x rate)
  double server_cores = 0.0;        // CPU used / time, summed over the groups' servers
  double trainer_cores = 0.0;       // this process (the trainers)
  double machine_cores = 0.0;       // the whole machine's busy CPU
  double load = 0.0;
  int64_t heartbeat_errors = 0;
  int64_t retries = 0;
};

double Cores(int64_t ticks, double seconds) {
  return static_cast<double>(ticks) / static_cast<double>(sysconf(_SC_CLK_TCK)) / seconds;
}

absl::Status RunLinks(const Flags& flags, const JobConfig& base, const std::string& dir, int groups,
                      LinkRun* result) {
  result->groups = groups;
  ASSIGN_OR_RETURN(std::unique_ptr<testing::NetworkLab> lab, testing::NetworkLab::Create());
  if (!lab->tbf()) {
    return absl::FailedPreconditionError(
        absl::StrCat("this kernel has no tbf qdisc: ", lab->tbf_problem()));
  }
  testing::ClusterOptions options;
  options.server_binary = flags.cluster.server_binary;
  options.worker_binary = flags.cluster.worker_binary;
  options.dir = dir;
  options.network = lab.get();
  options.groups_in_hosts = true;
  options.shard_groups = groups;
  options.start_wait = absl::Seconds(60);
  options.stop_grace = absl::Seconds(30);
  testing::Cluster cluster(options);
  const JobConfig job = BigJob(base, groups);
  ServerConfig config;
  config.set_listen_address("127.0.0.1:0");  // the cluster puts each group in its host
  *config.mutable_job() = job;
  config.mutable_durability()->set_data_dir(dir + "/data");
  std::string text;
  google::protobuf::TextFormat::PrintToString(config, &text);
  RETURN_IF_ERROR(cluster.StartServer(text, absl::StrCat("job_id: \"", kJobId, "\"\n")));
  for (int g = 0; g < groups; ++g) {
    ASSIGN_OR_RETURN(const int host, cluster.GroupHost(g));
    RETURN_IF_ERROR(lab->Throttle(host, flags.rate_mbit * 1000));
  }
  SyntheticOptions synthetic;
  synthetic.job = job;
  synthetic.coordinator = cluster.group_address(0);
  synthetic.trainers = kTrainers;
  ASSIGN_OR_RETURN(std::unique_ptr<SyntheticTrainers> trainers,
                   SyntheticTrainers::Start(synthetic));
  auto server_ticks = [&cluster] {
    int64_t ticks = 0;
    for (int i = 0; i < cluster.members(); ++i) ticks += ProcessCpuTicks(cluster.member(i).pid());
    return ticks;
  };
  struct Probe {
    absl::Time at;
    int64_t servers = 0, self = 0, machine = 0;
  };
  auto probe = [&server_ticks](Probe* p) {
    p->at = absl::Now();
    p->servers = server_ticks();
    p->self = ProcessCpuTicks(getpid());
    p->machine = ReadMachineCpu().busy;
  };
  Probe open, close;
  LoopLimits limits;
  limits.window = absl::Seconds(flags.seconds);
  limits.window_calls = flags.window_syncs;
  limits.at_open = [&] { probe(&open); };
  limits.at_close = [&] { probe(&close); };
  LoadAverageMeter load;
  load.Sample();
  ASSIGN_OR_RETURN(const LoopRun run, trainers->Run(limits));
  load.Sample();
  const int64_t syncs = run.CallsBetween(run.window_open, run.window_close);
  const double seconds = absl::ToDoubleSeconds(close.at - open.at);

  int64_t request_bytes = 0;
  for (int g = 0; g < groups; ++g) request_bytes += trainers->request_bytes(g);
  result->seconds = seconds;
  result->syncs = syncs;
  result->syncs_s = run.PerClientRate();
  result->mib_s = result->syncs_s * static_cast<double>(trainers->sync_bytes()) / (1 << 20);
  result->upload_utilization =
      result->syncs_s * static_cast<double>(request_bytes) / (groups * flags.rate_mbit * 1e6 / 8.0);
  result->server_cores = Cores(close.servers - open.servers, seconds);
  result->trainer_cores = Cores(close.self - open.self, seconds);
  result->machine_cores = Cores(close.machine - open.machine, seconds);
  result->load = load.Mean();
  result->heartbeat_errors = trainers->heartbeat_errors();
  result->retries = trainers->retries();
  trainers.reset();  // deregisters
  cluster.StopAll(/*report=*/true, [](const ChildProcess&, int) {});
  result->ok = true;
  return absl::OkStatus();
}

// ---- 2. the shipped job on loopback ---------------------------------------------------------

absl::Status CheckSmallRun(const GetStatusResponse& status) {
  if (status.slots_size() != kTrainers) {
    return absl::InternalError(absl::StrCat("GetStatus lists ", status.slots_size(), " slots"));
  }
  for (const SlotStatus& slot : status.slots()) {
    if (slot.state() != ACTIVE) {
      return absl::InternalError(
          absl::StrCat("slot ", slot.slot().replica(), " is ", SlotState_Name(slot.state())));
    }
  }
  if (status.recoveries_size() > 0) return absl::InternalError("a recovery ran");
  return absl::OkStatus();
}

WindowResult RunSmall(const Flags& flags, const JobConfig& base, const std::string& dir,
                      int groups) {
  WindowResult result;
  // LocalCluster runs as many groups as the job's sharding.groups names.
  LocalCluster cluster(flags.cluster, dir);
  JobConfig job = base;
  job.set_job_id(kSmallJobId);
  job.mutable_topology()->set_replicas(kTrainers);
  job.mutable_topology()->set_spares(0);
  job.mutable_topology()->set_evaluator(false);
  job.mutable_training()->set_max_steps(1000000000);
  if (groups > 1) job.mutable_sharding()->set_groups(groups);
  const absl::Time started = absl::Now();
  absl::Status status = cluster.StartServer(job, dir + "/data");
  if (status.ok() && cluster.shard_groups() != groups) {
    status = absl::InternalError(
        absl::StrCat("the cluster runs ", cluster.shard_groups(), " groups, not ", groups));
  }
  if (status.ok()) status = cluster.StartTrainers(kTrainers);
  if (status.ok()) {
    WindowOptions window;
    window.trainers = kTrainers;
    window.batch_size = base.data().batch_size();
    window.warmup = absl::Seconds(flags.small_warmup_seconds);
    window.window = absl::Seconds(flags.small_seconds);
    window.check = CheckSmallRun;
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
  absl::StatusOr<RunDirectories> dirs = RunDirectories::Create("sharding", flags.cluster.keep_logs);
  if (!dirs.ok()) {
    std::fprintf(stderr, "%s\n", std::string(dirs.status().message()).c_str());
    return 1;
  }
  const double rate_mib_s = flags.rate_mbit * 1e6 / 8.0 / (1 << 20);
  double estimate = 0.0;
  for (int groups : kGroups) {
    if (flags.skip_links) break;
    // The first round (4 syncs through K links), then the window: --window_syncs rounds.
    estimate += flags.reps *
                ((1 + flags.window_syncs) * kTrainers * 4 * kCenterMiB / (groups * rate_mib_s) +
                 kOverheadSecondsEstimate);
  }
  if (!flags.skip_small) {
    estimate += 2 * flags.small_reps *
                (flags.small_seconds + flags.small_warmup_seconds + kOverheadSecondsEstimate);
  }
  std::printf(
      "sharding benchmark: sync throughput of a %.2f MiB center with K = 1, 2, 4 server "
      "groups, each in a network namespace of its own behind a link tbf limits to %d "
      "Mbit/s (%.1f MiB/s) each way; %d synthetic trainers (no compute) in the "
      "benchmark's namespace; then the shipped job on loopback, K = 2 vs K = 1\n",
      kCenterMiB, flags.rate_mbit, rate_mib_s, kTrainers);
  std::printf(
      "per K: every trainer's first sync (warm-up), then a window of at least %d s and "
      "%d syncs per trainer; %d repetition(s); small job: %d repetition(s) of %d s warm-up + %d s "
      "window per K; "
      "about %.1f min; %d cores online, load %.2f; logs in %s\n\n",
      flags.seconds, flags.window_syncs, flags.reps, flags.skip_small ? 0 : flags.small_reps,
      flags.small_warmup_seconds, flags.small_seconds, estimate / 60.0,
      static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)), LoadAverage(), dirs->path().c_str());
  std::fflush(stdout);

  // ---- 1.
  std::map<int, std::vector<LinkRun>> links;
  for (int rep = 0; rep < (flags.skip_links ? 0 : flags.reps); ++rep) {
    for (int groups : kGroups) {
      const std::string dir = dirs->StartRun(absl::StrCat("rep", rep, "-links-k", groups));
      LinkRun run;
      const absl::Time run_start = absl::Now();
      const absl::Status status = RunLinks(flags, *base, dir, groups, &run);
      const double run_seconds = absl::ToDoubleSeconds(absl::Now() - run_start);
      RemoveDataDirectories(dir);
      dirs->FinishRun(dir, status.ok());
      if (!status.ok()) {
        std::printf("rep %d K = %d: FAILED after %.0f s: %s\n  (logs in %s)\n", rep, groups,
                    run_seconds, std::string(status.message()).c_str(), dir.c_str());
        std::fflush(stdout);
        continue;
      }
      std::printf(
          "rep %d K = %d: %8.1f MiB/s  %.3f syncs/s (%lld syncs in the %.1f s window)  links' "
          "upload %.0f%% of %d x %d Mbit/s  cores: servers %.2f trainers %.2f machine "
          "%.2f; load %.2f; %lld retries, %lld heartbeat errors; %.0f s\n",
          rep, groups, run.mib_s, run.syncs_s, static_cast<long long>(run.syncs), run.seconds,
          100.0 * run.upload_utilization, groups, flags.rate_mbit, run.server_cores,
          run.trainer_cores, run.machine_cores, run.load, static_cast<long long>(run.retries),
          static_cast<long long>(run.heartbeat_errors), run_seconds);
      std::fflush(stdout);
      links[groups].push_back(run);
    }
  }
  std::map<int, double> mib_s;
  for (int groups : kGroups) {
    std::vector<double> figures;
    for (const LinkRun& run : links[groups]) figures.push_back(run.mib_s);
    mib_s[groups] = Median(figures);  // NaN when every run failed
  }
  const double k2_ratio = mib_s[2] / mib_s[1];
  const double k4_ratio = mib_s[4] / mib_s[1];
  if (!flags.skip_links) {
    std::printf(
        "\nsync throughput behind %d Mbit/s links (request + reply bytes, MiB/s; "
        "medians):\n",
        flags.rate_mbit);
    std::printf(
        "  K = 1: %8.1f\n  K = 2: %8.1f  x%.3f (target >= %.1f, physical limit 2)\n"
        "  K = 4: %8.1f  x%.3f (target >= %.1f, physical limit 4)\n",
        mib_s[1], mib_s[2], k2_ratio, kTargetK2, mib_s[4], k4_ratio, kTargetK4);
    std::fflush(stdout);
  }

  // ---- 2.
  double small_ratio = std::numeric_limits<double>::quiet_NaN();
  if (!flags.skip_small) {
    std::map<bool, std::map<int, WindowResult>> small;  // sharded (K = 2)?
    for (int rep = 0; rep < flags.small_reps; ++rep) {
      const bool sharded_first = rep % 2 == 0;
      for (const bool sharded : {sharded_first, !sharded_first}) {
        const int groups = sharded ? 2 : 1;
        const std::string dir = dirs->StartRun(absl::StrCat("rep", rep, "-small-k", groups));
        const absl::Time run_start = absl::Now();
        WindowResult result = RunSmall(flags, *base, dir, groups);
        const double run_seconds = absl::ToDoubleSeconds(absl::Now() - run_start);
        RemoveDataDirectories(dir);
        dirs->FinishRun(dir, result.ok);
        if (!result.ok) {
          std::printf("small job rep %d K = %d: FAILED after %.0f s: %s\n  (logs in %s)\n", rep,
                      groups, run_seconds, result.error.c_str(), dir.c_str());
          std::fflush(stdout);
          continue;
        }
        std::printf(
            "small job rep %d K = %d: %8.1f samples/s (%lld steps in %.2f s, per slot "
            "%s); CPU ms/step trainers %.3f servers %.3f; cores: cluster %.2f other %.2f; "
            "load %.2f; %.0f s\n",
            rep, groups, result.samples_per_second, static_cast<long long>(result.steps),
            result.window_seconds, absl::StrJoin(result.slot_steps, "/").c_str(),
            result.trainer_cpu_ms_per_step, result.server_cpu_ms_per_step, result.cluster_cores,
            result.other_cores, result.load, run_seconds);
        std::fflush(stdout);
        small[sharded][rep] = std::move(result);
      }
    }
    const PairedComparison compared = ComparePaired(small[true], small[false]);
    small_ratio = compared.ratio;
    std::printf("\nthe shipped job on loopback (samples/s):\n");
    std::printf("  K = 2: %-24s median %8.1f\n  K = 1: %-24s median %8.1f\n",
                JoinFigures(compared.a, 1).c_str(), compared.a_median,
                JoinFigures(compared.b, 1).c_str(), compared.b_median);
    std::printf("  paired ratios K = 2 / K = 1: %s (median %.4f: small_job_ratio)\n",
                JoinFigures(compared.paired, 4).c_str(), compared.ratio);
    std::printf(
        "  per cluster CPU-second (what other load on the machine does not move while "
        "the cluster is CPU-bound): K = 2 %.1f, K = 1 %.1f, ratio %.4f\n",
        compared.a_per_cpu_median, compared.b_per_cpu_median,
        compared.a_per_cpu_median / compared.b_per_cpu_median);
  }

  auto verdict = [](bool skipped, double ratio, double target) {
    return skipped ? "not run" : ratio >= target ? "MET" : "MISSED";
  };
  std::printf(
      "\nverdict against R14: K = 2 x%.3f (>= %.1f) %s; K = 4 x%.3f (>= %.1f) %s; small "
      "job K = 2 / K = 1 %.4f (>= %.1f) %s\n",
      k2_ratio, kTargetK2, verdict(flags.skip_links, k2_ratio, kTargetK2), k4_ratio, kTargetK4,
      verdict(flags.skip_links, k4_ratio, kTargetK4), small_ratio, kTargetSmall,
      verdict(flags.skip_small, small_ratio, kTargetSmall));
  dirs->Finish();
  std::printf(
      "RESULT sharding: k1_mib_s=%.1f k2_mib_s=%.1f k4_mib_s=%.1f k2_ratio=%.3f "
      "k4_ratio=%.3f small_job_ratio=%.4f\n",
      mib_s[1], mib_s[2], mib_s[4], k2_ratio, k4_ratio, small_ratio);
  return dirs->all_ok() ? 0 : 1;
}

}  // namespace
}  // namespace rebound::bench

int main(int argc, char** argv) { return rebound::bench::Main(argc, argv); }
