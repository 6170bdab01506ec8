// Soak run (issue R7): does the server's memory or its RocksDB directory grow while a job runs
// for a long time, with trainers failing and being rebuilt on the way?
//
// Runs the shipped job (configs/job.pbtxt) on a real local cluster on loopback: rebound_server
// with a durable data directory (RocksDB, fsync off as shipped), the job's trainers, one spare
// and the evaluator. training.max_steps is raised to 10^9, so the run is bounded by --minutes.
// Every --kill_every_s seconds (0: never) the trainer owning the next slot in turn is SIGKILLed
// and a fresh spare started in its place (a replacement machine), so the recovery paths (step
// log, replay tasks, recovery records, fenced incarnations) are soaked too.
//
// Every --sample_s seconds it records the server's resident memory (VmRSS in
// /proc/<pid>/status) and the size of its data directory (every file, recursively: SST files,
// WAL, MANIFEST, checkpoints). After a warm-up (the first --warmup_s seconds: memtables filling,
// the first compactions, the allocator reaching its working set), it fits a least-squares line
// to each series against time and prints both slopes in MiB per minute and as the growth they
// would give over an hour relative to the mean: a leak shows as a steady positive slope. It also
// scrapes the server's /metrics for malloc's bytes in use (rebound_process_heap_bytes), the
// measure of a leak: RSS also holds what malloc keeps free (common/process.cc raises its trim
// threshold for the large sync buffers), so RSS steps up to the peak working set and stays.
//
// Not part of CI (it is meant to run for a long time). Last line:
//   RESULT soak: minutes=<m> samples=<n> kills=<k> recoveries=<r> heap_mib=<mean>
//       heap_slope_mib_per_min=<h> rss_mib=<mean> rss_slope_mib_per_min=<x> store_mib=<mean>
//       store_slope_mib_per_min=<y> flat=yes|no
// flat: the heap's and the data directory's lines each grow by less than 10% of their mean (or
// 8 MiB) per hour. Exit code 0 when the run completed flat, 3 when it completed but grew, 1 when
// it failed, 2 on bad flags.
//
// Flags (--name=value or --name value): --minutes=M (10) --sample_s=S (10) --warmup_s=S (60)
// --kill_every_s=S (120) --job=PATH --server_binary=PATH --worker_binary=PATH --keep_logs.

#include <httplib.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/flags.h"
#include "bench/local_cluster.h"
#include "bench/load_average.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"

namespace rebound::bench {
namespace {

constexpr char kUsage[] =
    "usage: soak [--minutes=M] [--sample_s=S] [--warmup_s=S] [--kill_every_s=S] [--job=PATH] "
    "[--server_binary=PATH] [--worker_binary=PATH] [--keep_logs]";
constexpr double kMiB = 1024.0 * 1024.0;

struct Flags {
  int minutes = 10;
  int sample_s = 10;
  int warmup_s = 60;
  int kill_every_s = 120;
  ClusterFlags cluster;
};

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  CommandLine command_line(kUsage);
  command_line.AddInt("minutes", &flags.minutes);
  command_line.AddInt("sample_s", &flags.sample_s);
  command_line.AddInt("warmup_s", &flags.warmup_s);
  command_line.AddInt("kill_every_s", &flags.kill_every_s);
  flags.cluster.AddTo(&command_line);
  command_line.Parse(argc, argv);
  if (flags.minutes < 1) command_line.Usage("--minutes must be >= 1");
  if (flags.sample_s < 1) command_line.Usage("--sample_s must be >= 1");
  if (flags.warmup_s < 0 || flags.warmup_s >= flags.minutes * 60) {
    command_line.Usage("--warmup_s must be in [0, --minutes * 60)");
  }
  if (flags.kill_every_s < 0) command_line.Usage("--kill_every_s must be >= 0");
  return flags;
}

// VmRSS of `pid` in bytes; -1 when it cannot be read.
int64_t ResidentBytes(pid_t pid) {
  for (absl::string_view line :
       absl::StrSplit(ReadFileOrEmpty(absl::StrCat("/proc/", pid, "/status")), '\n')) {
    if (!absl::ConsumePrefix(&line, "VmRSS:")) continue;
    line = absl::StripAsciiWhitespace(line);
    absl::ConsumeSuffix(&line, " kB");
    int64_t kb = 0;
    if (absl::SimpleAtoi(line, &kb)) return kb * 1024;
  }
  return -1;
}

int64_t DirectoryBytes(const std::string& dir) {
  int64_t total = 0;
  std::error_code error;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, error);
       !error && it != std::filesystem::recursive_directory_iterator(); it.increment(error)) {
    std::error_code size_error;
    if (it->is_regular_file(size_error)) {
      const auto size = it->file_size(size_error);
      if (!size_error) total += static_cast<int64_t>(size);
    }
  }
  return total;
}

struct Line {
  double mean = 0;
  double slope = 0;  // per minute
};

struct Sample {
  double minutes = 0;  // since the first sync of every slot
  double rss_mib = 0;
  double heap_mib = 0;  // malloc's bytes in use, from the server's /metrics
  double store_mib = 0;
};

// The server's rebound_process_heap_bytes{state="in_use"} (common/metrics.h), scraped from its
// /metrics at `address` (host:port); -1 when it cannot be had.
double HeapInUseBytes(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port)) return -1;
  httplib::Client client(address.substr(0, colon), port);
  client.set_connection_timeout(5, 0);
  client.set_read_timeout(5, 0);
  const httplib::Result response = client.Get("/metrics");
  if (!response || response->status != 200) return -1;
  constexpr absl::string_view kSeries = "rebound_process_heap_bytes{state=\"in_use\"} ";
  for (absl::string_view line : absl::StrSplit(response->body, '\n')) {
    double value = 0;
    if (absl::ConsumePrefix(&line, kSeries) && absl::SimpleAtod(line, &value)) return value;
  }
  return -1;
}

// Flat: the fitted line grows by less than 10% of the mean per hour (or 8 MiB, for small means).
bool IsFlat(const Line& line) { return line.slope * 60 < std::max(0.1 * line.mean, 8.0); }

// Least-squares fit of y against x.
Line Fit(const std::vector<double>& x, const std::vector<double>& y) {
  const double n = static_cast<double>(x.size());
  double mx = 0, my = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    mx += x[i];
    my += y[i];
  }
  mx /= n;
  my /= n;
  double sxy = 0, sxx = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxy += (x[i] - mx) * (y[i] - my);
    sxx += (x[i] - mx) * (x[i] - mx);
  }
  return {my, sxx > 0 ? sxy / sxx : 0.0};
}

int Main(int argc, char** argv) {
  // A run lasts hours and is usually sent to a file: every line as it is printed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  Flags flags = ParseFlags(argc, argv);
  absl::StatusOr<JobConfig> base_job = ResolveClusterFlags(&flags.cluster);
  if (!base_job.ok()) ExitWithUsage(std::string(base_job.status().message()), kUsage);
  absl::StatusOr<RunDirectories> dirs = RunDirectories::Create("soak", flags.cluster.keep_logs);
  if (!dirs.ok()) {
    std::fprintf(stderr, "%s\n", std::string(dirs.status().message()).c_str());
    return 1;
  }
  JobConfig job = *base_job;
  job.set_job_id("bench-soak");
  job.mutable_training()->set_max_steps(1000000000);
  const int trainers = job.topology().replicas();
  const std::string dir = dirs->StartRun("soak");
  const std::string data_dir = dir + "/data";
  std::printf("soak: the shipped job (%d trainers, a spare, the evaluator, tau %d) on a durable "
              "server for %d min; a trainer SIGKILLed and replaced every %d s%s; server RSS and "
              "data directory sampled every %d s, slopes fitted after a %d s warm-up; logs in %s\n",
              trainers, job.easgd().sync_period(), flags.minutes, flags.kill_every_s,
              flags.kill_every_s == 0 ? " (never)" : "", flags.sample_s, flags.warmup_s,
              dir.c_str());
  std::fflush(stdout);

  LocalCluster cluster(flags.cluster, dir);
  auto fail = [&](const absl::Status& status) {
    std::printf("soak FAILED: %s\n  (logs in %s)\n", status.ToString().c_str(), dir.c_str());
    cluster.StopAll(/*report=*/true, [](const ChildProcess&, int) {});
    dirs->FinishRun(dir, false);
    dirs->Finish();
    return 1;
  };
  if (absl::Status s = cluster.StartServer(job, data_dir); !s.ok()) return fail(s);
  if (absl::Status s = cluster.StartTrainers(trainers); !s.ok()) return fail(s);
  if (absl::Status s = cluster.StartSpares({"spare-0"}); !s.ok()) return fail(s);
  if (absl::Status s = cluster.StartEvaluator(); !s.ok()) return fail(s);
  if (absl::Status s = cluster.WaitForFirstSyncs(trainers); !s.ok()) return fail(s);
  absl::StatusOr<GetStatusResponse> first = cluster.GetStatus();
  if (!first.ok()) return fail(first.status());
  if (first->metrics_address().empty()) {
    return fail(absl::FailedPreconditionError("the server serves no /metrics (metrics.enabled)"));
  }
  const std::string metrics_address = first->metrics_address();

  const absl::Time start = absl::Now();
  const absl::Time end = start + absl::Minutes(flags.minutes);
  absl::Time next_sample = start;
  absl::Time next_kill =
      flags.kill_every_s > 0 ? start + absl::Seconds(flags.kill_every_s) : absl::InfiniteFuture();
  std::vector<Sample> samples;
  int kills = 0;
  int victim_slot = 0;
  absl::Status problem = absl::OkStatus();
  absl::Status watched = cluster.Watch(end, absl::Milliseconds(200), [&](absl::Time now) {
    if (!problem.ok()) return;
    if (now >= next_sample) {
      next_sample += absl::Seconds(flags.sample_s);
      Sample sample;
      sample.minutes = absl::ToDoubleMinutes(now - start);
      sample.rss_mib = ResidentBytes(cluster.server().pid()) / kMiB;
      sample.heap_mib = HeapInUseBytes(metrics_address) / kMiB;
      sample.store_mib = DirectoryBytes(data_dir) / kMiB;
      if (sample.heap_mib < 0) {
        problem = absl::UnavailableError(absl::StrCat("cannot scrape http://", metrics_address,
                                                      "/metrics for the server's heap"));
        return;
      }
      samples.push_back(sample);
      std::printf("  %6.2f min: server RSS %8.1f MiB, heap in use %8.1f MiB, data dir %8.1f MiB\n",
                  sample.minutes, sample.rss_mib, sample.heap_mib, sample.store_mib);
      std::fflush(stdout);
    }
    if (now >= next_kill) {
      next_kill += absl::Seconds(flags.kill_every_s);
      // The trainer that owns the victim slot now (a rebuilt slot has another owner).
      absl::StatusOr<GetStatusResponse> status = cluster.GetStatus();
      if (!status.ok()) {
        problem = status.status();
        return;
      }
      std::string name;
      for (const WorkerStatus& w : status->workers()) {
        if (w.role() == TRAINER && w.state() == ALIVE && w.slot().replica() == victim_slot) {
          name = w.name();
        }
      }
      if (name.empty()) return;  // the slot is still being rebuilt: next time
      if (absl::Status s = cluster.KillWorker(name); !s.ok()) {
        problem = s;
        return;
      }
      ++kills;
      victim_slot = (victim_slot + 1) % trainers;
      if (absl::Status s = cluster.StartSpares({absl::StrCat("spare-", kills)}, false); !s.ok()) {
        problem = s;
        return;
      }
      std::printf("  %6.2f min: killed %s (slot %d), started spare-%d\n",
                  absl::ToDoubleMinutes(now - start), name.c_str(), victim_slot == 0
                                                                        ? trainers - 1
                                                                        : victim_slot - 1,
                  kills);
      std::fflush(stdout);
    }
  });
  if (!watched.ok()) return fail(watched);
  if (!problem.ok()) return fail(problem);
  absl::StatusOr<GetStatusResponse> last = cluster.GetStatus();
  if (!last.ok()) return fail(last.status());
  int recoveries = 0;
  int verified = 0;
  for (const RecoveryStatus& r : last->recoveries()) {
    recoveries += r.outcome() == RECOVERED;
    verified += r.outcome() == RECOVERED && r.verified();
  }
  cluster.StopAll(/*report=*/true, [](const ChildProcess&, int) {});
  dirs->FinishRun(dir, true);
  dirs->Finish();

  std::vector<double> t, rss, heap, store;
  for (const Sample& s : samples) {
    if (s.minutes * 60 < flags.warmup_s) continue;
    t.push_back(s.minutes);
    rss.push_back(s.rss_mib);
    heap.push_back(s.heap_mib);
    store.push_back(s.store_mib);
  }
  if (t.size() < 3) {
    std::printf("soak FAILED: only %zu samples after the warm-up; run longer\n", t.size());
    return 1;
  }
  const Line rss_line = Fit(t, rss);
  const Line heap_line = Fit(t, heap);
  const Line store_line = Fit(t, store);
  std::printf("\nafter the warm-up, %zu samples over %.1f min; %d kills, %d recoveries (%d "
              "verified bit-identical); last test accuracy %.4f (center version %lld)\n",
              t.size(), t.back() - t.front(), kills, recoveries, verified,
              last->last_eval().test_accuracy(),
              static_cast<long long>(last->last_eval().center_version()));
  auto report = [](const char* what, const Line& line) {
    std::printf("%-17s mean %7.1f MiB, slope %+.3f MiB/min (%+.1f%% of the mean per hour): %s\n",
                what, line.mean, line.slope,
                line.mean > 0 ? 100 * line.slope * 60 / line.mean : 0.0,
                IsFlat(line) ? "flat" : "GROWS");
  };
  report("server heap:", heap_line);
  report("server RSS:", rss_line);
  report("data directory:", store_line);
  std::printf("(flat: less than 10%% of the mean, or 8 MiB, per hour. The verdict is the heap's and "
              "the data directory's: RSS also holds what malloc keeps free, up to its trim "
              "threshold, so it steps up to the peak working set and stays there)\n");
  const bool flat = IsFlat(heap_line) && IsFlat(store_line);
  std::printf("RESULT soak: minutes=%d samples=%zu kills=%d recoveries=%d heap_mib=%.1f "
              "heap_slope_mib_per_min=%.4f rss_mib=%.1f rss_slope_mib_per_min=%.4f store_mib=%.1f "
              "store_slope_mib_per_min=%.4f flat=%s\n",
              flags.minutes, t.size(), kills, recoveries, heap_line.mean, heap_line.slope,
              rss_line.mean, rss_line.slope, store_line.mean, store_line.slope,
              flat ? "yes" : "no");
  return flat ? 0 : 3;
}

}  // namespace
}  // namespace rebound::bench

int main(int argc, char** argv) { return rebound::bench::Main(argc, argv); }
