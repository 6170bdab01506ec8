#pragma once

// The launcher's command line, the workers it starts for a job, and the config files it writes
// into its work dir. Pure functions: nothing here touches processes or the network, so every rule
// is unit-tested (tests/launch/options_test.cc).

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/config.pb.h"

namespace rebound::launch {

// The usage text printed for --help and after a flag error.
extern const char kUsage[];

// A slot (r, s) of the R x S grid.
struct SlotCoord {
  int replica = 0;
  int stage = 0;

  bool operator==(const SlotCoord& other) const {
    return replica == other.replica && stage == other.stage;
  }
  bool operator!=(const SlotCoord& other) const { return !(*this == other); }
};

struct LaunchOptions {
  std::string job_file;       // --job, required
  std::string data_dir;       // --data_dir: the server's RocksDB directory; empty = in memory
  int port = 0;               // --port: the server's port on 127.0.0.1; 0 = any free port
  std::string workdir;        // --workdir: empty = a fresh directory under /tmp
  // --kill_trainer_at_step: SIGKILL the trainer of kill_slot once its step reaches this.
  std::optional<int64_t> kill_trainer_at_step;
  SlotCoord kill_slot;        // --kill_slot R,S (default 0,0)
  std::string progress_csv;   // --progress_csv: append progress rows here; empty = none
  // --export: when every slot is FINISHED, the trained model (safetensors) is written here.
  std::string export_path;
  int timeout_s = 0;          // --timeout_s: give up after this long (exit 1); 0 = never
  std::string server_binary;  // --server_binary: empty = found next to the launcher
  std::string worker_binary;  // --worker_binary: empty = found next to the launcher
  // --worker_command: run this command (split at spaces, no quoting) instead of rebound_worker,
  // with --server, --name and --role appended; e.g. a Python worker (docs/python.md).
  std::string worker_command;
  // --standbys N: a replicated server group of 1 + N members instead of one server (docs/design.md
  // §10.1); 0 = one server, as without the flag.
  int standbys = 0;
  // --etcd_members M: the etcd members the launcher starts for a group (--standbys > 0).
  int etcd_members = 3;
  // --kill_leader_at_step: SIGKILL the group's leader once the mean trainer step reaches this,
  // and start it again a few seconds later as a standby (--standbys > 0).
  std::optional<int64_t> kill_leader_at_step;
  // --shard_groups K: the center sharded across K server groups (docs/design.md §10.2), each one
  // server or, with --standbys, a replicated group; unset = the job's sharding.groups (1 unless
  // the job shards). See ShardGroups().
  std::optional<int> shard_groups;
  // --corrupt_trainer_at_step N: the trainer of corrupt_slot flips one bit of one parameter after
  // step N and every corrupt_every steps after it (rebound_worker --fault_flip_bit_at_step,
  // a machine that silently computes wrong); the job is audited (docs/recovery.md#audits).
  std::optional<int64_t> corrupt_trainer_at_step;
  SlotCoord corrupt_slot;     // --corrupt_slot R,S (default 0,0)
  int64_t corrupt_every = 50;  // --corrupt_every K (0: once)
  bool help = false;          // --help
};

// Parses the arguments after argv[0]. Flags are "--name value" or "--name=value"; a repeated
// flag keeps its last value. INVALID_ARGUMENT names the offending flag for an unknown flag, a
// missing or malformed value, a positional argument, a missing --job (unless --help), or a flag
// that needs another: --kill_slot without --kill_trainer_at_step; --etcd_members or
// --kill_leader_at_step without --standbys; --port N when the servers' ports N..N+M-1 go past
// 65535 (M = shard groups x (1 + standbys) servers, each on its own port).
absl::StatusOr<LaunchOptions> ParseLaunchArgs(const std::vector<std::string>& args);

// Parses "R,S" (two non-negative integers, optional spaces around them).
absl::StatusOr<SlotCoord> ParseSlot(const std::string& text);

// Checks the options that depend on the job: --kill_slot must lie inside the R x S grid;
// --kill_leader_at_step must come before training.max_steps; --shard_groups K must equal the
// job's sharding.groups when the job shards (K > 1 there), and a job that does not shard must
// pass the job validation with sharding.groups = K (a model spec, a policy that shards,
// every stage at least K parameters).
absl::Status CheckOptionsAgainstJob(const LaunchOptions& options, const JobConfig& job);

// The number of shard groups the launcher starts: --shard_groups when given, else the job's
// sharding.groups. REQUIRES: CheckOptionsAgainstJob(options, job) is OK.
int ShardGroups(const LaunchOptions& options, const JobConfig& job);

// The job the launcher's servers run: `job` with sharding.groups = `groups` and, where the job
// leaves topology.min_trainers 0, the start barrier over every trainer slot (replicas x stages):
// the launcher starts every trainer, one registration after the other, and they train together
// once all are there (docs/operations.md#the-start-barrier). `corrupt` (--corrupt_trainer_at_step):
// a job without audits gets audit { fraction 0.25, on_mismatch AUDIT_QUARANTINE (AUDIT_REPORT
// for a pipeline) } and one spare more (the quarantined slot's, beside the auditor). `changes`
// (if not null) gets what differs from `job`, for the launcher's line and the copy's comment;
// empty when nothing does.
JobConfig LaunchedJob(const JobConfig& job, int groups, std::string* changes,
                      bool corrupt = false);

// `launched` printed as protobuf text under a comment naming `source` and `changes`.
std::string LaunchedJobText(const JobConfig& launched, const std::string& source,
                            const std::string& changes);

enum class LaunchRole { kTrainer, kSpare, kEvaluator };

// The value of rebound_worker's --role flag for `role`.
const char* RoleFlag(LaunchRole role);

// One worker the launcher starts.
struct WorkerPlan {
  std::string name;
  LaunchRole role = LaunchRole::kTrainer;
  std::optional<SlotCoord> slot;  // trainers: the slot it is expected to own
};

// The workers of a job in start order: R x S trainers in slot order (replica-major, the order in
// which the server hands out slots), named trainer-r<r>s<s>; then topology.spares spares named
// spare-<i>; then one evaluator named "evaluator" if topology.evaluator. REQUIRES: a valid job.
std::vector<WorkerPlan> PlanWorkers(const JobConfig& job);

// server.pbtxt for the launcher's server: listens on 127.0.0.1:<port>, names the job by
// `job_file` (must be absolute: the config lives in the work dir) and, when `data_dir` is not
// empty, keeps durable state there (absolute as well).
std::string ServerConfigText(const std::string& job_file, int port, const std::string& data_dir);

// worker.pbtxt for the launcher's workers: joins only `job_id`, 10 s RPC deadline, retry backoff
// from 100 ms to 2000 ms.
std::string WorkerConfigText(const std::string& job_id);

// A member of the launcher's replicated server group, or a server of one of its shard groups.
struct GroupMemberPlan {
  // Its name in the group, its config, log and data dir: "server-<i>" (one replicated group),
  // "g<g>-server" (a shard group of one server), "g<g>-server-<i>" (a replicated shard group).
  std::string name;
  int port = 0;           // its workers' port on 127.0.0.1 (served only while it leads)
  std::string data_dir;   // absolute; empty: state in memory only (a shard group of one server
                          // without --data_dir, as one server without it)
  int shard_group = 0;    // the shard group it belongs to (0 when the center is not sharded)
};

// The members of a group of 1 + `standbys` on `ports` (one per member, in order): member i is
// server-<i>, with its data under <data_parent>/server-<i>. REQUIRES: ports.size() == 1 +
// standbys.
std::vector<GroupMemberPlan> PlanGroup(int standbys, const std::vector<int>& ports,
                                       const std::string& data_parent);

// server-<i>.pbtxt of a group member: ServerConfigText's config (durable, in `member.data_dir`)
// plus the replication block: every etcd endpoint, `standbys`, the member's name, its peer port
// any free one on 127.0.0.1, a 2 s leader lease, synchronous replication.
std::string GroupMemberConfigText(const std::string& job_file, const GroupMemberPlan& member,
                                  int standbys, const std::vector<std::string>& etcd_endpoints);

// The servers of `groups` shard groups of 1 + `standbys` members each, on `ports` (one per
// server, group by group: server i of group g on ports[g * (1 + standbys) + i]), named as
// GroupMemberPlan says, each with its data in <data_parent>/<name> (none when `data_parent` is
// empty). groups = 1 is PlanGroup's group. REQUIRES: ports.size() == groups * (1 + standbys).
std::vector<GroupMemberPlan> PlanShardGroups(int groups, int standbys,
                                             const std::vector<int>& ports,
                                             const std::string& data_parent);

// Each shard group's address as shard.group_addresses holds it: its members' 127.0.0.1:<port>,
// comma-separated, group by group. REQUIRES: every member's shard_group in [0, groups).
std::vector<std::string> ShardAddressLists(const std::vector<GroupMemberPlan>& members,
                                           int groups);

// The config of a server of a sharded job: ServerConfigText's config (in `member.data_dir`, or in
// memory when it is empty), the replication block of GroupMemberConfigText when `etcd_endpoints`
// is not empty (with group "<shard_group>": each shard group its own etcd keys), and the shard
// block: the member's shard group and every group's address (`shard_addresses`, group by
// group). REQUIRES: shard_addresses.size() >= 2.
std::string ShardMemberConfigText(const std::string& job_file, const GroupMemberPlan& member,
                                  int standbys, const std::vector<std::string>& etcd_endpoints,
                                  const std::vector<std::string>& shard_addresses);

// worker.pbtxt for the workers of a group: WorkerConfigText's, with the retry backoff capped at
// 250 ms (docs/operations.md, "High availability"), so that a worker finds a new leader within
// a quarter of a second of its taking over.
std::string GroupWorkerConfigText(const std::string& job_id);

// The workers' --server for a group: every member's 127.0.0.1:<port>, comma-separated.
std::string GroupAddressList(const std::vector<GroupMemberPlan>& members);

// `path` made absolute against the current directory (lexically; the file need not exist).
std::string AbsolutePath(const std::string& path);

}  // namespace rebound::launch
