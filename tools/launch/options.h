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
  int timeout_s = 0;          // --timeout_s: give up after this long (exit 1); 0 = never
  std::string server_binary;  // --server_binary: empty = found next to the launcher
  std::string worker_binary;  // --worker_binary: empty = found next to the launcher
  // --worker_command: run this command (split at spaces, no quoting) instead of rebound_worker,
  // with --server, --name and --role appended; e.g. a Python worker (docs/python.md).
  std::string worker_command;
  // --standbys N: a replicated server group of 1 + N members instead of one server (DESIGN.md
  // §10.1); 0 = one server, as without the flag.
  int standbys = 0;
  // --etcd_members M: the etcd members the launcher starts for a group (--standbys > 0).
  int etcd_members = 3;
  // --kill_leader_at_step: SIGKILL the group's leader once the mean trainer step reaches this,
  // and start it again a few seconds later as a standby (--standbys > 0).
  std::optional<int64_t> kill_leader_at_step;
  bool help = false;          // --help
};

// Parses the arguments after argv[0]. Flags are "--name value" or "--name=value"; a repeated
// flag keeps its last value. INVALID_ARGUMENT names the offending flag for an unknown flag, a
// missing or malformed value, a positional argument, a missing --job (unless --help), or a flag
// that needs another: --kill_slot without --kill_trainer_at_step; --etcd_members or
// --kill_leader_at_step without --standbys; --port N with --standbys S when N + S > 65535 (the
// members listen on N..N+S).
absl::StatusOr<LaunchOptions> ParseLaunchArgs(const std::vector<std::string>& args);

// Parses "R,S" (two non-negative integers, optional spaces around them).
absl::StatusOr<SlotCoord> ParseSlot(const std::string& text);

// Checks the options that depend on the job: --kill_slot must lie inside the R x S grid.
absl::Status CheckOptionsAgainstJob(const LaunchOptions& options, const JobConfig& job);

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

// A member of the launcher's replicated server group.
struct GroupMemberPlan {
  std::string name;       // "server-<i>": its name in the group, its config, log and data dir
  int port = 0;           // its workers' port on 127.0.0.1 (served only while it leads)
  std::string data_dir;   // absolute
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

// worker.pbtxt for the workers of a group: WorkerConfigText's, with the retry backoff capped at
// 250 ms (docs/operations.md, "High availability"), so that a worker finds a new leader within
// a quarter of a second of its taking over.
std::string GroupWorkerConfigText(const std::string& job_id);

// The workers' --server for a group: every member's 127.0.0.1:<port>, comma-separated.
std::string GroupAddressList(const std::vector<GroupMemberPlan>& members);

// `path` made absolute against the current directory (lexically; the file need not exist).
std::string AbsolutePath(const std::string& path);

}  // namespace rebound::launch
