// Crash detection benchmark (R21, docs/design.md §13): the time from a trainer's SIGKILL to the
// server's FAILED, over --kills kills, and from a trainer's SIGSTOP (a hang: its connections stay
// open) to FAILED, which only the heartbeat timeout can tell.
//
// A real local cluster on loopback: one rebound_server (or, with --standbys, a replicated group),
// 2 rebound_worker trainers of the shipped job (configs/job.pbtxt, max_steps 10^9, its
// heartbeat_interval_ms, failure_timeout_ms and crash_confirm_ms unless --crash_confirm_ms is
// given) and one spare. Each kill:
//   1. waits until both slots are ACTIVE and a spare waits for work;
//   2. SIGKILLs the trainer of slot k % 2 (t0);
//   3. polls GetStatus every 2 ms until the server lists that incarnation FAILED (t1): t1 - t0 is
//      the figure (at most a poll late); the server's own account (its state reason: "its
//      session ended N ms ago") is printed beside it;
//   4. starts a new spare: the killed slot's replay takes the waiting one.
// Then one trainer is SIGSTOPped (t0) and the same poll gives its detection time, which should be
// failure_timeout_ms and a check period, as before crash detection; it is then SIGKILLed.
//
// Last line:
//   RESULT detection: kills=<n> median_ms=<m> max_ms=<x> sigstop_ms=<s> failure_timeout_ms=<f>
//     crash_confirm_ms=<c>
// The target (R21): median <= 300 ms, max <= 1000 ms. Exit code 0 when every kill completed
// (whatever the verdict), 1 otherwise, 2 on bad flags.
//
// Flags: --kills=N (20) --crash_confirm_ms=MS (-1: the job's) --standbys=N (0) --job=PATH
// --server_binary=PATH --worker_binary=PATH --keep_logs.

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
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
constexpr char kJobId[] = "bench-detection";
constexpr absl::Duration kPoll = absl::Milliseconds(2);
constexpr absl::Duration kDetectLimit = absl::Seconds(60);

struct Flags {
  int kills = 20;
  int crash_confirm_ms = -1;
  int standbys = 0;
  ClusterFlags cluster;
};

constexpr char kUsage[] =
    "usage: detection [--kills=N] [--crash_confirm_ms=MS] [--standbys=N] [--job=PATH] "
    "[--server_binary=PATH] [--worker_binary=PATH] [--keep_logs]";

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  CommandLine command_line(kUsage);
  command_line.AddInt("kills", &flags.kills);
  command_line.AddInt("crash_confirm_ms", &flags.crash_confirm_ms);
  command_line.AddInt("standbys", &flags.standbys);
  flags.cluster.AddTo(&command_line);
  command_line.Parse(argc, argv);
  if (flags.kills < 1) command_line.Usage("--kills must be >= 1");
  if (flags.crash_confirm_ms > 60000) command_line.Usage("--crash_confirm_ms must be <= 60000");
  if (flags.standbys < 0 || flags.standbys > 2) command_line.Usage("--standbys must be in [0, 2]");
  return flags;
}

const WorkerStatus* FindIncarnation(const GetStatusResponse& s, uint64_t incarnation) {
  for (const WorkerStatus& w : s.workers()) {
    if (w.incarnation() == incarnation) return &w;
  }
  return nullptr;
}

// Both slots trained by a live trainer and a spare waiting for work.
bool Ready(const GetStatusResponse& s) {
  if (s.slots_size() != kTrainers) return false;
  for (const SlotStatus& slot : s.slots()) {
    if (slot.state() != ACTIVE) return false;
  }
  for (const WorkerStatus& w : s.workers()) {
    if (w.role() == SPARE && w.state() == ALIVE && w.waiting_for_task()) return true;
  }
  return false;
}

// The "N" of "its session ended N ms ago ..." (the server's own account), -1 when the reason is
// another (the heartbeat timeout's).
int64_t ServerMs(const std::string& reason) {
  constexpr absl::string_view kPrefix = "its session ended ";
  if (!absl::StartsWith(reason, kPrefix)) return -1;
  const std::string rest = reason.substr(kPrefix.size());
  int64_t ms = -1;
  if (!absl::SimpleAtoi(rest.substr(0, rest.find(' ')), &ms)) return -1;
  return ms;
}

struct Detection {
  double ms = 0;           // t0 to the first status that lists the incarnation FAILED
  std::string reason;      // the server's
};

absl::StatusOr<Detection> WaitForFailed(LocalCluster& cluster, uint64_t incarnation,
                                        absl::Time t0) {
  const absl::Time limit = t0 + kDetectLimit;
  while (absl::Now() < limit) {
    absl::StatusOr<GetStatusResponse> status = cluster.GetStatus();
    if (status.ok()) {
      const WorkerStatus* w = FindIncarnation(*status, incarnation);
      if (w != nullptr && w->state() == FAILED) {
        return Detection{absl::ToDoubleMilliseconds(absl::Now() - t0), w->state_reason()};
      }
    }
    absl::SleepFor(kPoll);
  }
  return absl::DeadlineExceededError(absl::StrCat("incarnation ", incarnation, " not FAILED ",
                                                  absl::FormatDuration(kDetectLimit),
                                                  " after its kill"));
}

// The trainer of `slot` now: its name and incarnation.
absl::StatusOr<std::pair<std::string, uint64_t>> Owner(const GetStatusResponse& s, int slot) {
  const uint64_t owner = s.slots(slot).owner_incarnation();
  const WorkerStatus* w = FindIncarnation(s, owner);
  if (w == nullptr) return absl::NotFoundError(absl::StrCat("slot ", slot, " has no owner"));
  return std::make_pair(w->name(), owner);
}

int Main(int argc, char** argv) {
  Flags flags = ParseFlags(argc, argv);
  absl::StatusOr<JobConfig> base = ResolveClusterFlags(&flags.cluster);
  if (!base.ok()) ExitWithUsage(std::string(base.status().message()), kUsage);
  absl::StatusOr<RunDirectories> dirs =
      RunDirectories::Create("detection", flags.cluster.keep_logs);
  if (!dirs.ok()) {
    std::fprintf(stderr, "%s\n", std::string(dirs.status().message()).c_str());
    return 1;
  }
  JobConfig job = *base;
  job.set_job_id(kJobId);
  job.mutable_topology()->set_replicas(kTrainers);
  job.mutable_topology()->set_spares(0);
  job.mutable_topology()->set_evaluator(false);
  job.mutable_training()->set_max_steps(1000000000);
  if (flags.crash_confirm_ms >= 0) {
    job.mutable_fault_tolerance()->set_crash_confirm_ms(flags.crash_confirm_ms);
  }
  const FaultToleranceConfig& ft = job.fault_tolerance();
  std::printf("detection benchmark: SIGKILL of a trainer to the server's FAILED (%d kills) and "
              "SIGSTOP to FAILED; %s, %d trainers and a spare of %s; heartbeat %d ms, "
              "failure_timeout %d ms, crash_confirm %d ms; %d cores online, load %.2f; logs in "
              "%s\n\n",
              flags.kills,
              flags.standbys > 0 ? absl::StrCat("a group of 1 + ", flags.standbys).c_str()
                                 : "one server",
              kTrainers, flags.cluster.job.c_str(), ft.heartbeat_interval_ms(),
              ft.failure_timeout_ms(), ft.crash_confirm_ms(),
              static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)), LoadAverage(),
              dirs->path().c_str());
  std::fflush(stdout);

  const std::string dir = dirs->StartRun("detection");
  LocalCluster cluster(flags.cluster, dir, flags.standbys);
  std::vector<double> kills;
  double sigstop_ms = -1;
  absl::Status status = cluster.StartServer(
      job, flags.standbys > 0 ? dir + "/data" : "",
      "backoff_initial_ms: 20\nbackoff_max_ms: 250\ngive_up_after_ms: 120000\n");
  if (status.ok()) status = cluster.StartTrainers(kTrainers);
  if (status.ok()) status = cluster.WaitForFirstSyncs(kTrainers);
  if (status.ok()) status = cluster.StartSpares({"spare-0"});
  for (int k = 0; status.ok() && k < flags.kills; ++k) {
    absl::StatusOr<GetStatusResponse> ready =
        cluster.WaitForStatus(Ready, absl::Seconds(120), "both slots trained and a spare ready");
    if (!ready.ok()) {
      status = ready.status();
      break;
    }
    auto owner = Owner(*ready, k % kTrainers);
    if (!owner.ok()) {
      status = owner.status();
      break;
    }
    const absl::Time t0 = absl::Now();
    if (status = cluster.KillWorker(owner->first); !status.ok()) break;
    absl::StatusOr<Detection> detected = WaitForFailed(cluster, owner->second, t0);
    if (!detected.ok()) {
      status = detected.status();
      break;
    }
    std::printf("kill %2d: %-10s FAILED after %5.0f ms (server: session ended %4lld ms before "
                "it declared); load %.2f\n",
                k + 1, owner->first.c_str(), detected->ms,
                static_cast<long long>(ServerMs(detected->reason)), LoadAverage());
    std::fflush(stdout);
    if (ServerMs(detected->reason) < 0) {
      std::printf("  (not as a crash: %s)\n", detected->reason.c_str());
    }
    kills.push_back(detected->ms);
    status = cluster.StartSpares({absl::StrCat("spare-", k + 1)});
  }
  if (status.ok()) {
    // A hang: the process lives, its connections stay open.
    absl::StatusOr<GetStatusResponse> ready =
        cluster.WaitForStatus(Ready, absl::Seconds(120), "both slots trained and a spare ready");
    auto owner = ready.ok() ? Owner(*ready, 0) : absl::StatusOr<std::pair<std::string, uint64_t>>(
                                                     ready.status());
    if (!owner.ok()) {
      status = owner.status();
    } else {
      const absl::Time t0 = absl::Now();
      status = cluster.StopWorker(owner->first);
      absl::StatusOr<Detection> detected =
          status.ok() ? WaitForFailed(cluster, owner->second, t0)
                      : absl::StatusOr<Detection>(status);
      if (detected.ok()) {
        sigstop_ms = detected->ms;
        std::printf("sigstop: %-10s FAILED after %5.0f ms (%s)\n", owner->first.c_str(),
                    detected->ms, detected->reason.c_str());
        status = cluster.KillWorker(owner->first);
      } else {
        status = detected.status();
      }
    }
  }
  cluster.StopAll(status.ok(), [](const ChildProcess&, int) {});
  dirs->FinishRun(dir, status.ok());
  if (!status.ok()) {
    std::printf("FAILED: %s\n  (logs in %s)\n", std::string(status.message()).c_str(),
                dir.c_str());
  }
  if (kills.empty()) {
    dirs->Finish();
    return 1;
  }
  const double median = Median(kills);
  const double max = *std::max_element(kills.begin(), kills.end());
  std::printf("\nSIGKILL to FAILED: %s ms (median %.0f, max %.0f)\n",
              JoinFigures(kills, 0).c_str(), median, max);
  std::printf("verdict against R21 (median <= 300 ms, max <= 1000 ms): %s\n",
              median <= 300 && max <= 1000 ? "MET"
              : median <= 300              ? "MET at the median, MISSED at the max"
                                           : "MISSED");
  dirs->Finish();
  std::printf("RESULT detection: kills=%zu median_ms=%.0f max_ms=%.0f sigstop_ms=%.0f "
              "failure_timeout_ms=%d crash_confirm_ms=%d\n",
              kills.size(), median, max, sigstop_ms, ft.failure_timeout_ms(),
              ft.crash_confirm_ms());
  return status.ok() ? 0 : 1;
}

}  // namespace
}  // namespace rebound::bench

int main(int argc, char** argv) { return rebound::bench::Main(argc, argv); }
