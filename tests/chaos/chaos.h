#pragma once

// Seeded chaos runs (issue R7): a real Rebound job on this machine (rebound_server and
// rebound_worker processes; the server durable, in a data directory of the run) under a seeded
// random schedule of faults, then checked against what Rebound promises (docs/design.md §5).
//
// What a run injects (FaultKind), each at a point of the job's progress drawn from the seed:
//   * SIGKILL of a trainer, a spare or the evaluator; SIGSTOP of one, SIGCONT after a drawn
//     time (shorter or longer than the failure timeout: a trainer stopped longer is declared
//     failed, fenced, and exits 3 when it resumes);
//   * SIGKILL of the server, restarted after a drawn outage on the same data directory, address
//     and port (workers reconnect: trainers keep their slots, others register again); SIGSTOP
//     of the server, SIGCONT after a drawn time;
//   * where the machine permits network namespaces (testing/cluster/network.h), every trainer and
//     spare runs in a namespace of its own and a trainer's link can be cut (partition) or
//     slowed (tbf throttle; netem delay and loss where the kernel has netem). Where not, the
//     run says so and leaves those kinds out of the schedule.
//   * in group mode (ChaosOptions::standbys > 0: a replicated server group of docs/design.md §10.1,
//     started by testing/cluster's Cluster: members server-0, server-1, ... with fixed ports and
//     data directories of their own, etcd of ChaosOptions::etcd_members real members), the
//     server kinds are the group's instead (kill_server and stop_server are left out):
//     SIGKILL of the leader, restarted on its data directory after a drawn outage (kill_leader)
//     or with its data directory deleted (leader_disk_loss: it catches up from a checkpoint);
//     SIGSTOP of the leader for longer than its lease, then SIGCONT (stop_leader: it must fence
//     itself and run again as a standby); SIGKILL of one etcd member, or of all, restarted after
//     a drawn outage (kill_etcd_member, kill_all_etcd); SIGKILL of a standby, its data directory
//     deleted, restarted (restart_standby_empty). Where ChaosOptions::kinds names them and the
//     machine permits a firewall between processes (testing/cluster/firewall.h), partitions
//     that leave the processes running: the leader cut from etcd only, past its lease
//     (partition_leader_from_etcd: it must fence itself while its workers and its standby
//     still reach it, and run again as a standby once healed), and a standby cut from
//     everything (partition_standby: the leader must drop it and keep answering). A group fault fires only while the group is
//     whole (a leader, every standby in sync, every etcd member up, no group fault pending), so
//     that no schedule asks for more than §10.1 promises (a disk lost while the group was already
//     degraded is the loss window the product states, not a bug). Workers get every member's
//     address and follow the leader.
//   * in sharded mode (ChaosOptions::shard_groups = K > 1: the center split across K server
//     groups, docs/design.md §10.2, docs/sharding.md; testing/cluster's Cluster starts them, member
//     g * (1 + standbys) + i named g<g>-server-<i>), composable with group mode: kill_server and
//     stop_server act on a drawn group's server (standbys = 0), the group kinds on a drawn
//     group's leader or standby (standbys > 0; etcd, shared by the groups, is lost for all of
//     them, and such a fault waits until every group is whole); besides, die_between_ranges: a
//     trainer started with --fault_die_in_sync_at_step sends its sync of a drawn step to ranges
//     [0, j) only (j drawn in [1, K]) and SIGKILLs itself before the commit, the case the
//     exactly-once rule of docs/sharding.md is about. Byzantine trainers are left out (their
//     poisoned range syncs are refused by each range group's checks, covered by sharding_test;
//     the chaos schedule has not been run with them).
// A worker that is killed, or that exits fenced (3) or unreachable (4), is replaced by a fresh
// spare (a replacement machine), a killed evaluator by a new evaluator, so the job can finish.
// Every schedule has a bounded number of faults, every fault a bounded duration, every wait a
// deadline and the whole run a time limit; every process and namespace started is gone when
// RunChaos returns, also when the run fails.
//
// What a run checks (RunReport::violations; none is allowed):
//   * the job finished: every slot FINISHED within the time limit, and every worker exited;
//     no process crashed or exited with an unexpected code, and none exited 0 before the job's
//     end without having finished its slot;
//   * every recovery the server reported (GetStatus, polled through every server life) that
//     rebuilt a slot was a REPLAY verified against the logged checksums (bit-identical); none
//     ended in CHECKSUM_MISMATCH or fell back to another policy;
//   * exactly once: from the server's durable record, every slot applied max_steps / tau syncs
//     and its last at max_steps, and the center moved once per sync (GetStatus at the end, and
//     the RocksDB store read back through storage::DurableStore after the server stopped, whose
//     center must be the one the server served); across a server restart no slot's update count
//     and no center version went back, and every trainer left alone kept its slot (reconnected
//     under its incarnation within the grace period);
//   * center integrity (issue R9): the final center is finite; a byzantine trainer exits 1
//     only because the server refused a poisoned sync (its log says so), and no more syncs were
//     refused than byzantine trainers sent (an honest sync is never refused);
//   * in group mode, besides: exactly once from the durable record of the FINAL leader's store,
//     and every member (each must be back in sync at the end) holds the same records and the
//     center the leader served (its store read back after every member stopped); nothing
//     ACKNOWLEDGED is ever gone: each trainer logs every sync answered to it (glog
//     --vmodule=easgd_trainer=1: "synced step t ... center version v"), and every leader, first
//     when it takes over and then every few seconds, must be at or past every such answer (each
//     slot's last synced step and update count, the center's version). What the leader's
//     GetStatus shows is not used as "acknowledged": a sync the leader applied but had not yet
//     answered may be lost with it, and the trainer then sends it again; only the trainers'
//     answers are certainly acknowledged; once one is found lost the run stops (its job cannot
//     end as the fault-free one). No two members ever reported LEADER for one epoch
//     (GetStatus and every member's ServerPeer.GetGroup, polled); a leader SIGSTOPped past its
//     lease said "no longer acknowledging" and ran again as a standby once resumed; one etcd
//     member of 3 lost never changed the leader; trainers left alone kept their slots across
//     each leader change (as across a server restart);
//   * against a fault-free run of the same job (RunReport* reference): the final center's test
//     accuracy (computed as the evaluator does) within 1 point; with DETERMINISTIC scheduling
//     and UNIFORM weights (the default) the final center bit-identical (docs/design.md §5.6).
//   * in sharded mode, besides (each per group, read as "the leader of the moment" of group g
//     with standbys): exactly once per range: every group's center version (its GetStatus, its
//     PullRange, and its store read back after it stopped) is slots x syncs, and each store holds
//     the range the group served and each slot's last two range snapshots at max_steps - tau and
//     max_steps; group 0's slots each applied max_steps / tau syncs. Nothing acknowledged lost:
//     the trainers log each committed sync ("synced step t ... center version v"), and group 0 (each
//     slot's committed step and update count) and every group (its range's version, at least
//     the sum over slots of the syncs answered) must be at or past them, every few seconds and
//     when a group's server comes back. The whole center, gathered from the K ranges, is what
//     the accuracy and the bit-for-bit comparison use (a sharded job ends bit-identical to the
//     same job unsharded: sharding.md).

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "proto/config.pb.h"
#include "proto/tensor.pb.h"

namespace rebound::chaos {

// The job of a chaos run: small enough to finish in tens of seconds on 2 cores.
struct ChaosJob {
  int replicas = 3;
  int hidden = 64;  // 784 -> hidden -> 10
  int batch_size = 32;
  int train_limit = 6000;
  int test_limit = 2000;
  int sync_period = 100;
  int64_t max_steps = 2400;
  // DETERMINISTIC scheduling (syncs of a round applied in slot order), or ASYNC (in arrival
  // order, the shipped job's choice).
  bool deterministic = true;
  // DYNAMIC reliability weights (the shipped job's choice) instead of UNIFORM. A fault raises a
  // slot's fault score, which lowers its weight and so how far its syncs move the center; the
  // score decays with this half-life (the shipped 60 s is for jobs of many minutes, this one
  // lasts seconds).
  bool dynamic_weights = false;
  double fault_half_life_s = 3.0;
  int heartbeat_interval_ms = 100;
  int failure_timeout_ms = 1500;
  int reconnect_grace_ms = 3000;
  int recovery_parallelism = 1;
  int eval_every_ms = 1000;
  // The leader's lease (replication.leader_lease_ms) in group mode; stop_leader draws its stops
  // longer than this.
  int leader_lease_ms = 2000;
  // Audits (docs/recovery.md#audits): every sync window chosen (fraction 1, 16 replays at once
  // and as many waiting, AUDIT_REPORT); what kSilentCorruption needs.
  bool audit = false;
};

// The JobConfig of `job` (job id "chaos", policy REPLAY, step-log linger 20 ms).
JobConfig MakeChaosJob(const ChaosJob& job);

enum class FaultKind {
  kKillTrainer,
  kStopTrainer,
  kKillSpare,
  kStopSpare,
  kKillEvaluator,
  kStopEvaluator,
  kKillServer,
  kStopServer,
  kPartition,  // network: a trainer's link down
  kThrottle,   // network: tbf rate limit on a trainer's link
  kDelay,      // network: netem delay
  kLoss,       // network: netem loss
  // A byzantine trainer (issue R9): one of the job's trainers is started with
  // --fault_poison_from_step, so that from the first sync at or after the fault's progress
  // point every sync it sends carries +-3.4e38; the server must refuse it (INVALID_ARGUMENT),
  // the trainer exits 1 saying so, and a spare replays its slot from the last accepted sync.
  kByzantine,
  // Group mode only (ChaosOptions::standbys > 0), each while the group is whole:
  kKillLeader,           // SIGKILL the leader; restarted on its data directory after `duration`
  kLeaderDiskLoss,       // SIGKILL the leader and delete its data directory; restarted empty
  kStopLeader,           // SIGSTOP the leader for `duration` (longer than its lease), SIGCONT
  kKillEtcdMember,       // SIGKILL one etcd member; restarted after `duration`
  kKillAllEtcd,          // SIGKILL every etcd member; restarted after `duration`
  kRestartStandbyEmpty,  // SIGKILL a standby, delete its data directory, restart after `duration`
  // Group mode, firewall kinds (testing/cluster/firewall.h: root, iptables; drawn only when
  // ChaosOptions::kinds names them, so the default schedules stay as they were):
  kPartitionLeaderFromEtcd,  // the leader's links to etcd cut for `duration` (past its lease):
                             // its workers and standby still reach it; it must fence itself,
                             // a standby take over, and it run again as a standby once healed
  kPartitionStandby,         // a standby's every link cut for `duration` (around the failure
                             // timeout): the leader drops it and answers on; healed, it rejoins
  // Sharded mode only (ChaosOptions::shard_groups > 1): trainer (pick % replicas) is started with
  // --fault_die_in_sync_at_step=S (S: the first sync step at or after the fault's progress point)
  // and --fault_die_in_sync_ranges=j (j = 1 + (pick / replicas) % K): it syncs step S to ranges
  // [0, j) only and SIGKILLs itself before the commit; a spare replays the slot and syncs S
  // again, which each range must apply exactly once.
  kDieBetweenRanges,
  // Audit replay (docs/recovery.md#audits), drawn only when named and the job audits
  // (ChaosJob::audit): trainer (pick % replicas) is started with --fault_flip_bit_at_step=S (S in
  // the middle of a sync window at or after the fault's progress point, at least 4 windows
  // before the job's end) and --fault_flip_bit_repeat_every=tau: from step S it flips one bit of
  // one parameter once per window (no crash, no NaN): a faulty machine. The run must report it:
  // a confirmed AUDIT_MISMATCH of that trainer at one of its flip steps, or a recovery's replay
  // of its slot ending CHECKSUM_MISMATCH (it died after a flip and before the window closed);
  // only a server fault after the first flip excuses a corruption never reported.
  // Any other confirmed mismatch or auditor fault is a false report (a violation).
  kSilentCorruption,
};

// Every kind a schedule draws by default, in the order above: all but the firewall kinds.
const std::vector<FaultKind>& AllFaultKinds();
// The firewall kinds (kPartitionLeaderFromEtcd, kPartitionStandby): drawn only when named.
const std::vector<FaultKind>& FirewallFaultKinds();
// The kinds drawn only when named that are not firewall kinds: kSilentCorruption.
const std::vector<FaultKind>& NamedOnlyFaultKinds();
bool IsFirewallFault(FaultKind kind);
// The kinds that act on the server group (kKillLeader ... kRestartStandbyEmpty; the firewall
// kinds are group kinds too, but listed by FirewallFaultKinds): group mode only.
const std::vector<FaultKind>& GroupFaultKinds();
// "kill_trainer", "stop_trainer", ..., "partition", "throttle", "delay", "loss", "byzantine",
// "kill_leader", "leader_disk_loss", "stop_leader", "kill_etcd_member", "kill_all_etcd",
// "restart_standby_empty", "die_between_ranges", "partition_leader_from_etcd",
// "partition_standby", "silent_corruption".
const char* FaultKindName(FaultKind kind);
bool IsNetworkFault(FaultKind kind);
bool IsGroupFault(FaultKind kind);
// The kinds of single-server mode only (kKillServer, kStopServer): a group has its own. In
// sharded mode without standbys they act on a drawn group's server.
bool IsSingleServerFault(FaultKind kind);
// The kinds of sharded mode only (kDieBetweenRanges).
bool IsShardedFault(FaultKind kind);

struct PlannedFault {
  FaultKind kind = FaultKind::kKillTrainer;
  // Fires once the slots' mean step reaches this fraction of max_steps.
  double at_progress = 0;
  // How long a stop, a link fault, a server, member or etcd outage lasts (not used by worker
  // kills).
  absl::Duration duration;
  // Picks the target among the candidates at that moment (in name order): pick % count.
  uint32_t pick = 0;
  int rate_kbit = 0;        // kThrottle
  int delay_ms = 0;         // kDelay (and its jitter, a quarter of it)
  double loss_percent = 0;  // kLoss

  std::string ToString() const;
};

// The seeded schedule: `count` faults of the `allowed` kinds (weighted: trainer kills and
// stops, server kills and partitions are drawn more often), each `must_include` kind at least
// once (when allowed and count permits), at progress points in [0.08, 0.8] in increasing order.
// Durations are drawn around `job`'s failure timeout, so some stops and partitions end before
// the server notices and some after; a leader's stop lasts 1.6 to 2.6 leases, an etcd outage
// 0.5 to 2 leases, a member's outage up to 4 s. Every duration is at most MaxFaultDuration.
// The same arguments give the same schedule.
std::vector<PlannedFault> PlanFaults(uint64_t seed, int count,
                                     const std::vector<FaultKind>& allowed,
                                     const std::vector<FaultKind>& must_include,
                                     const ChaosJob& job);

// The longest duration PlanFaults draws for any kind under `job`.
absl::Duration MaxFaultDuration(const ChaosJob& job);

struct ChaosOptions {
  uint64_t seed = 1;
  int faults = 4;                                  // 0: a fault-free run (the reference)
  std::vector<FaultKind> kinds = AllFaultKinds();  // the kinds the schedule may use
  std::vector<FaultKind> must_include;             // ... and must use
  int spares = 2;
  // Group mode: a replicated server group of 1 + `standbys` members coordinated by etcd of
  // `etcd_members` members (see the top of this file). 0: one server, no etcd.
  int standbys = 0;
  int etcd_members = 3;
  // Sharded mode: the center split across `shard_groups` server groups (each one server, or a
  // replicated group with `standbys`), see the top of this file. 1: one group.
  int shard_groups = 1;
  bool network = true;  // try network namespaces (needs root); the run says what it found
  absl::Duration time_limit = absl::Minutes(4);  // for the whole run, start to checks
  std::string server_binary;                     // absolute paths
  std::string worker_binary;
  std::string work_dir = "/tmp";  // a directory of the run is made in it
  bool keep_dir = false;          // keep it when the run passed (a failed run's is always kept)
  // Progress lines (the schedule, each fault, the checks); null: none.
  std::function<void(const std::string&)> log;
};

// Whether `kind` can be injected into a run of `options` (its mode, before what the machine
// permits): group kinds need standbys, server kinds none, kDieBetweenRanges shard groups, and
// kByzantine an unsharded job.
bool KindFitsMode(FaultKind kind, const ChaosOptions& options);

struct RunReport {
  uint64_t seed = 0;
  int faults_planned = 0;
  std::string network;  // the network faults' setting on this machine, or why they are off
  std::string group;    // group mode: the members and etcd; empty for one server
  int shard_groups = 1;  // sharded mode: K
  std::vector<PlannedFault> schedule;
  std::map<std::string, int> faults;  // injected, by FaultKindName
  int skipped_faults = 0;             // planned, no target in time (never counted as injected)
  int unfired_faults = 0;             // planned, the job ended before their turn
  int recoveries = 0;                 // slots rebuilt (REPLAY, verified)
  int interrupted_recoveries = 0;     // ended by a fault on their spares or on the server
  int64_t steps_replayed = 0;         // by those recoveries
  int server_restarts = 0;       // a server (sharded: a group's one server) restarted after
                                 // kill_server
  int leader_changes = 0;        // group mode: a new leader (a higher epoch) took over
  int member_restarts = 0;       // group mode: members restarted after a kill
  int etcd_restarts = 0;         // group mode: etcd members restarted after a kill
  int fenced_leaders = 0;        // group mode: stopped leaders that fenced themselves on resuming
  // Group or sharded mode: syncs answered to trainers (their logs), and the stores read back and
  // compared at the end (each group's final leader's and every in-sync member's).
  int64_t acknowledged_syncs = 0;
  int members_compared = 0;
  int died_between_ranges = 0;   // sharded mode: trainers that died after syncing some ranges
  std::vector<int64_t> range_versions;  // sharded mode: each group's final range version
  int reconnected_trainers = 0;  // trainers that kept their slot across a server restart or
                                 // a leader change
  int replacements = 0;          // fresh spares and evaluators started for workers gone
  int byzantine_refused = 0;     // byzantine trainers that exited after a refused sync
  // silent_corruption: flips fired, reported (an AUDIT_MISMATCH or a replay's
  // CHECKSUM_MISMATCH), excused (a server fault after the flip), and audits that ran.
  int corruptions = 0;
  int corruptions_reported = 0;
  int corruptions_excused = 0;
  int audits_matched = 0;
  // Workers no fault was aimed at that the server fenced as soon as it resumed from a SIGSTOP
  // (its failure detector counts its own stop as their silence).
  int fenced_by_server_stop = 0;
  bool finished = false;
  double seconds = 0;
  std::vector<std::string> violations;  // broken promises of the product
  std::vector<std::string> errors;      // the harness could not do its part
  std::vector<std::string> notes;       // worth knowing, not a failure
  TensorBundle center;                  // the final center (sharded: gathered from the ranges)
  int64_t center_version = 0;
  double accuracy = -1;            // the final center's test accuracy
  double reference_accuracy = -1;  // the fault-free run's, when compared
  bool center_identical = false;   // with the reference's, when compared
  double evaluator_accuracy = -1;  // the evaluator's last report seen
  std::string dir;                 // the run's directory, when kept

  int total_faults() const;
  bool ok() const { return violations.empty() && errors.empty(); }
  // Faults by kind, "kill_trainer=2 kill_server=1 ..." (kinds with none left out).
  std::string FaultsByKind() const;
  // Several lines: what was injected, the recoveries, each check, violations and errors.
  std::string Summary() const;
};

// Whether two runs ended on the same center, byte for byte (each tensor's data).
bool SameCenter(const RunReport& a, const RunReport& b);

// Runs `job` once under `options` and checks it (see the top of this file). `reference`, a
// fault-free RunReport of the same job, adds the comparisons with it.
RunReport RunChaos(const ChaosJob& job, const ChaosOptions& options,
                   const RunReport* reference = nullptr);

}  // namespace rebound::chaos
