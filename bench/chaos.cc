// Seeded chaos runs (issue R7; docs/chaos.md): N runs of a small job on the real rebound_server
// and rebound_worker binaries, each under the seeded fault schedule of tests/chaos/chaos.h (seeds
// S, S+1, ..., S+N-1), each checked against a fault-free run of the same job made first: the job
// finishes, every rebuilt slot is a verified REPLAY, every sync is applied exactly once (status
// and the RocksDB store read back), no acknowledged sync is lost across a server restart, trainers
// reconnect to a restarted server, and the final test accuracy is within 1 point of the
// fault-free run's (bit-identical center under DETERMINISTIC scheduling, the default).
//
// What it compares is a run with faults against the fault-free run of the same job: each run's
// line gives both accuracies and their difference. Prints each run's schedule and events as they
// happen, a summary per run, the totals (faults injected by kind, recoveries, violations) and
// last
//   RESULT chaos: runs=N faults=F recoveries=R violations=V
// Exit code 0 when every run passed (no violation, no harness error), 1 otherwise, 2 on bad flags.
//
// Flags (--name=value or --name value):
//   --runs=N (3)  --seed=S (1)  --faults=F (6 per run)
//   --kinds=LIST  the fault kinds the schedules may use (default all: kill_trainer, stop_trainer,
//                 kill_spare, stop_spare, kill_evaluator, stop_evaluator, kill_server,
//                 stop_server, partition, throttle, delay, loss, byzantine, and with --standbys
//                 the group's kill_leader, leader_disk_loss, stop_leader, kill_etcd_member,
//                 kill_all_etcd, restart_standby_empty, and with --shard_groups
//                 die_between_ranges), e.g. --kinds=stop_server; besides, named only:
//                 partition_leader_from_etcd and partition_standby (with --standbys; root and
//                 iptables: testing/cluster/firewall.h), and silent_corruption (the
//                 job then audits every sync window, the fault-free run too, which must report
//                 nothing; docs/recovery.md#audits); each schedule holds a
//                 kill_trainer, a kill_server (with --standbys a kill_leader), a partition, a
//                 byzantine trainer (unsharded) and a die_between_ranges (sharded) when allowed
//   --standbys=K (0)  group mode: a replicated server group of 1 + K members and etcd of 3
//                 members (docs/design.md §10.1; tests/chaos/chaos.h): kill_server and stop_server
//                 are replaced by the group's kinds, and each run is checked besides for every
//                 member's store, the syncs answered to trainers and the fenced leaders
//   --shard_groups=K (1)  sharded mode: the center split across K server groups (docs/design.md
//                 §10.2; tests/chaos/chaos.h), each a single server or, with --standbys, a
//                 replicated group; kill_server and stop_server act on a drawn group's server,
//                 the group kinds on a drawn group's leader or standby; die_between_ranges is
//                 added and byzantine left out. Each run is checked per range (versions, stores,
//                 answered syncs) and its center gathered from the ranges; besides, a fault-free
//                 run of the same job unsharded must end on the sharded fault-free run's center
//                 bit for bit
//   --spares=K (2)  --steps=T (6000: each trainer's max_steps, a multiple of the sync period 100)
//   --async       ASYNC scheduling (the shipped job's choice) instead of DETERMINISTIC
//   --dynamic     DYNAMIC weights (the shipped job's choice) instead of UNIFORM; with --async
//                 or --dynamic the center is not expected bit-identical
//   --fault_half_life_s=H (3: the weights' fault half-life under --dynamic; the shipped job's
//                 60 s is meant for jobs of many minutes)
//   --no_network  no network namespaces: process faults only
//   --time_limit_s=T (300 per run)  --quiet (no event lines)
//   --server_binary=PATH --worker_binary=PATH (default: from the runfiles)
//   --keep_logs   keep every run's directory under /tmp (a failed run's is always kept)
//
// About 20-40 s per run with -c opt on 2 cores, plus the fault-free run.

#include "tests/chaos/chaos.h"

#include <glog/logging.h>

#include <cstdio>
#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/flags.h"
#include "bench/load_average.h"
#include "common/process.h"
#include "testing/cluster/processes.h"

namespace rebound::bench {
namespace {

using ::rebound::testing::FindRunfile;
using ::rebound::testing::IsExecutableFile;

constexpr char kUsage[] =
    "usage: chaos [--runs=N] [--seed=S] [--faults=F] [--kinds=LIST] [--spares=K] [--steps=T] "
    "[--standbys=K] [--shard_groups=K] [--async] "
    "[--dynamic] [--fault_half_life_s=H] [--no_network] "
    "[--time_limit_s=T] [--quiet] [--server_binary=PATH] [--worker_binary=PATH] [--keep_logs]";

struct Flags {
  int runs = 3;
  int seed = 1;
  int faults = 6;
  int spares = 2;
  int standbys = 0;
  int shard_groups = 1;
  int steps = 6000;
  bool async = false;
  bool dynamic = false;
  double fault_half_life_s = 3.0;
  std::vector<chaos::FaultKind> kinds = chaos::AllFaultKinds();
  bool no_network = false;
  int time_limit_s = 300;
  bool quiet = false;
  std::string server_binary;
  std::string worker_binary;
  bool keep_logs = false;
};

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  CommandLine command_line(kUsage);
  command_line.AddInt("runs", &flags.runs);
  command_line.AddInt("seed", &flags.seed);
  command_line.AddInt("faults", &flags.faults);
  command_line.AddInt("spares", &flags.spares);
  command_line.AddInt("standbys", &flags.standbys);
  command_line.AddInt("shard_groups", &flags.shard_groups);
  command_line.AddInt("steps", &flags.steps);
  command_line.AddSwitch("async", &flags.async);
  command_line.AddSwitch("dynamic", &flags.dynamic);
  command_line.AddCustom("fault_half_life_s", [&](const std::string& value) {
    if (!absl::SimpleAtod(value, &flags.fault_half_life_s) || !(flags.fault_half_life_s > 0)) {
      command_line.Usage("--fault_half_life_s must be a number > 0");
    }
  });
  command_line.AddCustom("kinds", [&](const std::string& value) {
    flags.kinds.clear();
    for (absl::string_view name : absl::StrSplit(value, ',', absl::SkipEmpty())) {
      bool known = false;
      std::vector<chaos::FaultKind> every = chaos::AllFaultKinds();
      for (chaos::FaultKind kind : chaos::FirewallFaultKinds()) every.push_back(kind);
      for (chaos::FaultKind kind : chaos::NamedOnlyFaultKinds()) every.push_back(kind);
      for (chaos::FaultKind kind : every) {
        if (name == chaos::FaultKindName(kind)) {
          flags.kinds.push_back(kind);
          known = true;
        }
      }
      if (!known) command_line.Usage(absl::StrCat("--kinds: unknown fault kind '", name, "'"));
    }
  });
  command_line.AddSwitch("no_network", &flags.no_network);
  command_line.AddInt("time_limit_s", &flags.time_limit_s);
  command_line.AddSwitch("quiet", &flags.quiet);
  command_line.AddText("server_binary", &flags.server_binary);
  command_line.AddText("worker_binary", &flags.worker_binary);
  command_line.AddSwitch("keep_logs", &flags.keep_logs);
  command_line.Parse(argc, argv);
  if (flags.runs < 1) command_line.Usage("--runs must be >= 1");
  if (flags.kinds.empty()) command_line.Usage("--kinds is empty");
  if (flags.seed < 0) command_line.Usage("--seed must be >= 0");
  if (flags.faults < 0 || flags.faults > 32) command_line.Usage("--faults must be in [0, 32]");
  if (flags.spares < 1 || flags.spares > 8) command_line.Usage("--spares must be in [1, 8]");
  if (flags.standbys < 0 || flags.standbys > 4) command_line.Usage("--standbys must be in [0, 4]");
  if (flags.shard_groups < 1 || flags.shard_groups > 4) {
    command_line.Usage("--shard_groups must be in [1, 4]");
  }
  if (flags.steps < 400 || flags.steps % 100 != 0) {
    command_line.Usage("--steps must be a multiple of 100 (the sync period), at least 400");
  }
  if (flags.time_limit_s < 30) command_line.Usage("--time_limit_s must be >= 30");
  if (flags.server_binary.empty()) {
    flags.server_binary = FindRunfile("server/rebound_server", IsExecutableFile);
  }
  if (flags.worker_binary.empty()) {
    flags.worker_binary = FindRunfile("worker/rebound_worker", IsExecutableFile);
  }
  if (!IsExecutableFile(flags.server_binary) || !IsExecutableFile(flags.worker_binary)) {
    command_line.Usage(
        "cannot find rebound_server / rebound_worker; pass --server_binary and --worker_binary");
  }
  return flags;
}

chaos::ChaosOptions Options(const Flags& flags, uint64_t seed, int faults) {
  chaos::ChaosOptions options;
  options.seed = seed;
  options.faults = faults;
  options.kinds = flags.kinds;
  // Every run kills a trainer and the server and cuts a link, where --kinds and the machine
  // allow; the rest of the schedule is drawn.
  options.must_include = {chaos::FaultKind::kKillTrainer,
                          flags.standbys > 0 ? chaos::FaultKind::kKillLeader
                                             : chaos::FaultKind::kKillServer,
                          chaos::FaultKind::kPartition, chaos::FaultKind::kByzantine,
                          chaos::FaultKind::kDieBetweenRanges,
                          chaos::FaultKind::kSilentCorruption};
  options.spares = flags.spares;
  options.standbys = flags.standbys;
  options.shard_groups = flags.shard_groups;
  options.network = !flags.no_network;
  options.time_limit = absl::Seconds(flags.time_limit_s);
  options.server_binary = flags.server_binary;
  options.worker_binary = flags.worker_binary;
  options.keep_dir = flags.keep_logs;
  if (!flags.quiet) {
    options.log = [](const std::string& line) {
      std::printf("  %s\n", line.c_str());
      std::fflush(stdout);
    };
  }
  return options;
}

int Main(int argc, char** argv) {
  const Flags flags = ParseFlags(argc, argv);
  // The store read back after each run logs its housekeeping at INFO: warnings and up only.
  InitLogging(argv[0]);
  FLAGS_minloglevel = google::WARNING;
  chaos::ChaosJob job;
  job.deterministic = !flags.async;
  job.dynamic_weights = flags.dynamic;
  job.fault_half_life_s = flags.fault_half_life_s;
  job.max_steps = flags.steps;
  // silent_corruption needs audits; the fault-free run audits too (and must report nothing).
  for (chaos::FaultKind kind : flags.kinds) {
    if (kind == chaos::FaultKind::kSilentCorruption) job.audit = true;
  }
  std::printf(
      "chaos benchmark: %d seeded run(s) (seeds %d..%d), %d faults each, against a "
      "fault-free run of the same job\n",
      flags.runs, flags.seed, flags.seed + flags.runs - 1, flags.faults);
  std::printf(
      "job: MLP 784-%d-10, %d trainers + %d spares + evaluator, batch %d, tau %d, %lld "
      "steps, %s, heartbeat %d ms, failure timeout %d ms, reconnect grace %d ms, "
      "%s%s; %ld cores online, load %.2f\n\n",
      job.hidden, job.replicas, flags.spares, job.batch_size, job.sync_period,
      static_cast<long long>(job.max_steps),
      absl::StrCat(job.deterministic ? "DETERMINISTIC" : "ASYNC", " scheduling, ",
                   job.dynamic_weights ? absl::StrCat("DYNAMIC weights (fault half-life ",
                                                      job.fault_half_life_s, " s)")
                                       : "UNIFORM weights")
          .c_str(),
      job.heartbeat_interval_ms, job.failure_timeout_ms, job.reconnect_grace_ms,
      flags.standbys > 0
          ? absl::StrCat("a replicated server group (a leader and ", flags.standbys,
                         " standby(s), leader lease ", job.leader_lease_ms,
                         " ms, etcd of 3 members)")
                .c_str()
          : "durable server",
      flags.shard_groups > 1
          ? absl::StrCat(", the center sharded across ", flags.shard_groups,
                         " server groups (each as above)")
                .c_str()
          : "",
      sysconf(_SC_NPROCESSORS_ONLN), LoadAverage());
  std::fflush(stdout);

  const absl::Time started = absl::Now();
  std::printf("fault-free run:\n");
  const chaos::RunReport reference = chaos::RunChaos(job, Options(flags, flags.seed, 0));
  std::printf("%s\n", reference.Summary().c_str());
  int violations = static_cast<int>(reference.violations.size());
  int errors = static_cast<int>(reference.errors.size());
  if (!reference.ok() || !reference.finished || reference.accuracy < 0) {
    std::printf("the fault-free run failed: no run with faults\n");
    std::printf("RESULT chaos: runs=0 faults=0 recoveries=0 violations=%d\n", violations);
    return 1;
  }
  if (flags.shard_groups > 1) {
    // Sharding itself must not change the result (docs/sharding.md): the same job on one
    // group of the same kind, fault-free, ends on the same center byte for byte under
    // DETERMINISTIC scheduling with UNIFORM weights.
    Flags one_group = flags;
    one_group.shard_groups = 1;
    std::printf("fault-free run of the same job unsharded:\n");
    const chaos::RunReport unsharded =
        chaos::RunChaos(job, Options(one_group, flags.seed, 0), &reference);
    std::printf("%s\n", unsharded.Summary().c_str());
    violations += static_cast<int>(unsharded.violations.size());
    errors += static_cast<int>(unsharded.errors.size());
    const bool identical = chaos::SameCenter(reference, unsharded);
    std::printf("sharded (%d groups) vs unsharded fault-free runs: accuracy %.4f vs %.4f, center "
                "%s\n\n",
                flags.shard_groups, reference.accuracy, unsharded.accuracy,
                identical ? "bit-identical" : "NOT bit-identical");
    if (!unsharded.ok() || !unsharded.finished) {
      std::printf("the unsharded fault-free run failed\n");
    }
  }

  int faults = 0;
  int recoveries = 0;
  int interrupted = 0;
  int restarts = 0;
  int leader_changes = 0;
  int member_restarts = 0;
  int etcd_restarts = 0;
  int fenced_leaders = 0;
  int64_t acknowledged = 0;
  int stores = 0;
  int fenced_by_server_stop = 0;
  int byzantine_refused = 0;
  int corruptions = 0;
  int corruptions_reported = 0;
  int corruptions_excused = 0;
  int died_between_ranges = 0;
  int64_t steps_replayed = 0;
  int runs_passed = 0;
  std::map<std::string, int> by_kind;
  std::vector<std::string> network_notes;
  for (int i = 0; i < flags.runs; ++i) {
    const uint64_t seed = static_cast<uint64_t>(flags.seed) + i;
    std::printf("run %d of %d, seed %llu:\n", i + 1, flags.runs,
                static_cast<unsigned long long>(seed));
    std::fflush(stdout);
    const chaos::RunReport r = chaos::RunChaos(job, Options(flags, seed, flags.faults), &reference);
    std::printf("%s\n", r.Summary().c_str());
    std::fflush(stdout);
    faults += r.total_faults();
    recoveries += r.recoveries;
    interrupted += r.interrupted_recoveries;
    restarts += r.server_restarts;
    leader_changes += r.leader_changes;
    member_restarts += r.member_restarts;
    etcd_restarts += r.etcd_restarts;
    fenced_leaders += r.fenced_leaders;
    acknowledged += r.acknowledged_syncs;
    stores += r.members_compared;
    fenced_by_server_stop += r.fenced_by_server_stop;
    byzantine_refused += r.byzantine_refused;
    corruptions += r.corruptions;
    corruptions_reported += r.corruptions_reported;
    corruptions_excused += r.corruptions_excused;
    died_between_ranges += r.died_between_ranges;
    steps_replayed += r.steps_replayed;
    violations += static_cast<int>(r.violations.size());
    errors += static_cast<int>(r.errors.size());
    runs_passed += r.ok() && r.finished ? 1 : 0;
    for (const auto& [kind, n] : r.faults) by_kind[kind] += n;
    if (i == 0) network_notes.push_back(r.network);
  }

  std::vector<std::string> kinds;
  const chaos::ChaosOptions mode = Options(flags, flags.seed, flags.faults);
  std::vector<chaos::FaultKind> every = chaos::AllFaultKinds();
  for (chaos::FaultKind kind : chaos::FirewallFaultKinds()) every.push_back(kind);
  for (chaos::FaultKind kind : chaos::NamedOnlyFaultKinds()) every.push_back(kind);
  for (chaos::FaultKind kind : every) {
    // The kinds of the mode run: a group's replace the single server's, and so on.
    if (!chaos::KindFitsMode(kind, mode)) continue;
    if ((chaos::IsFirewallFault(kind) || kind == chaos::FaultKind::kSilentCorruption) &&
        by_kind[chaos::FaultKindName(kind)] == 0) {
      continue;
    }
    const char* name = chaos::FaultKindName(kind);
    kinds.push_back(absl::StrCat(name, "=", by_kind[name]));
  }
  std::printf(
      "totals over %d run(s) in %.1f min: %d passed; faults injected %d (%s); recoveries "
      "%d (REPLAY, verified, %lld steps replayed) + %d interrupted by a fault; server "
      "restarts %d; workers fenced by a server stop %d; byzantine trainers refused and "
      "exited %d; violations %d; harness errors %d\n",
      flags.runs, absl::ToDoubleMinutes(absl::Now() - started), runs_passed, faults,
      absl::StrJoin(kinds, " ").c_str(), recoveries, static_cast<long long>(steps_replayed),
      interrupted, restarts, fenced_by_server_stop, byzantine_refused, violations, errors);
  if (flags.shard_groups > 1) {
    std::printf(
        "sharded: %d groups; trainers died between ranges %d; syncs answered to trainers %lld "
        "(every group at or past them); stores read back %d\n",
        flags.shard_groups, died_between_ranges, static_cast<long long>(acknowledged), stores);
  }
  if (flags.standbys > 0) {
    std::printf(
        "group: leader changes %d; members restarted %d; etcd members restarted %d; stopped "
        "leaders fenced %d; syncs answered to trainers %lld (every leader at or past them); "
        "stores read back %d\n",
        leader_changes, member_restarts, etcd_restarts, fenced_leaders,
        static_cast<long long>(acknowledged), stores);
  }
  if (job.audit) {
    std::printf("audits: silent corruptions %d flipped, %d reported, %d excused (the trainer "
                "never synced past its flip, or a server fault after it), %d never reported "
                "(violations)\n",
                corruptions, corruptions_reported, corruptions_excused,
                corruptions - corruptions_reported - corruptions_excused);
  }
  for (const std::string& note : network_notes) std::printf("%s\n", note.c_str());
  std::printf("RESULT chaos: runs=%d faults=%d recoveries=%d violations=%d\n", flags.runs, faults,
              recoveries, violations);
  return violations == 0 && errors == 0 && runs_passed == flags.runs ? 0 : 1;
}

}  // namespace
}  // namespace rebound::bench

int main(int argc, char** argv) { return rebound::bench::Main(argc, argv); }
