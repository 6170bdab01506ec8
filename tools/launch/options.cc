#include "tools/launch/options.h"

#include <climits>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/config.h"
#include "google/protobuf/text_format.h"

namespace rebound::launch {

const char kUsage[] =
    "usage: rebound_launch --job FILE [--data_dir DIR] [--port N] [--workdir DIR]\n"
    "                      [--kill_trainer_at_step N] [--kill_slot R,S] [--progress_csv PATH]\n"
    "                      [--timeout_s N] [--server_binary PATH] [--worker_binary PATH]\n"
    "                      [--worker_command CMD] [--export FILE]\n"
    "                      [--corrupt_trainer_at_step N [--corrupt_slot R,S] [--corrupt_every K]]\n"
    "                      [--standbys N [--etcd_members M] [--kill_leader_at_step S]]\n"
    "                      [--shard_groups K]\n"
    "       rebound_launch --version   (prints \"rebound <version> (commit <commit>)\")\n"
    "\n"
    "Starts a rebound_server and the job's workers on this machine (127.0.0.1): R x S trainers\n"
    "one after another in slot order (trainer-r<r>s<s>), topology.spares spares (spare-<i>) and\n"
    "an evaluator if topology.evaluator; prints progress every second until every slot is\n"
    "FINISHED, then stops them all.\n"
    "\n"
    "  --job FILE               the job config (.pbtxt); required\n"
    "  --data_dir DIR           the server's RocksDB directory (default: state in memory only)\n"
    "  --port N                 the server's port on 127.0.0.1 (default 0: any free port)\n"
    "  --workdir DIR            configs and one log per process (default: a new /tmp dir, kept)\n"
    "  --kill_trainer_at_step N SIGKILL the trainer of --kill_slot once, when its step >= N\n"
    "  --kill_slot R,S          the slot for --kill_trainer_at_step (default 0,0)\n"
    "  --progress_csv PATH      append rows: elapsed_s,slot,step,loss,weight,test_accuracy,event\n"
    "  --timeout_s N            stop everything and exit 1 after N seconds (default 0: never)\n"
    "  --server_binary PATH     rebound_server to run (default: found next to this binary)\n"
    "  --worker_binary PATH     rebound_worker to run (default: found next to this binary)\n"
    "  --worker_command CMD     run CMD (split at spaces) as every worker instead, with --server,\n"
    "                           --name and --role appended: a Python worker (docs/python.md)\n"
    "  --corrupt_trainer_at_step N  the trainer of --corrupt_slot flips one bit of one\n"
    "                           parameter after step N and every --corrupt_every steps (default\n"
    "                           50; 0 = once): silent corruption that audits catch; a job without\n"
    "                           audits gets audit.fraction 0.25 (AUDIT_QUARANTINE) and a spare\n"
    "                           more (docs/recovery.md#audits)\n"
    "  --corrupt_slot R,S       the slot for --corrupt_trainer_at_step (default 0,0)\n"
    "  --export FILE            when the job finishes, write the trained model to FILE\n"
    "                           (safetensors, as `reboundctl export`; a sharded center is\n"
    "                           gathered from its groups by group 0)\n"
    "\n"
    "A replicated server group (docs/operations.md, \"High availability\"):\n"
    "  --standbys N             run 1 + N rebound_server members (server-<i>, leader and\n"
    "                           standbys) coordinated by etcd instead of one server; each has a\n"
    "                           fixed port (--port N: N + i) and its data in --data_dir/server-<i>\n"
    "                           (kept) or else in the work dir's server-<i> (emptied first);\n"
    "                           workers get every member's address (default 0: one server)\n"
    "  --etcd_members M         the etcd members started for the group (/usr/bin/etcd; default 3)\n"
    "  --kill_leader_at_step S  SIGKILL the leader once, when the mean trainer step >= S, start it\n"
    "                           again as a standby a few seconds later, and print the failover\n"
    "\n"
    "The center sharded across server groups (docs/operations.md, \"Sharding\"):\n"
    "  --shard_groups K         K server groups (1 to 64; default: the job's sharding.groups), each\n"
    "                           holding one range of every stage's center: one server each\n"
    "                           (g<g>-server), or with --standbys N a replicated group each\n"
    "                           (g<g>-server-<i>, one etcd for all, group 0's leader the one\n"
    "                           --kill_leader_at_step kills); fixed ports (--port N: group by\n"
    "                           group from N); a job that does not shard gets sharding.groups K in\n"
    "                           a copy in the work dir; workers get group 0's address\n"
    "\n"
    "Exit codes: 0 every slot FINISHED; 1 timeout, the server exited, or the cluster could not\n"
    "start; 2 bad flags or job; 128+N stopped by signal N (130 SIGINT, 143 SIGTERM).\n";

namespace {

absl::Status FlagError(const std::string& flag, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", what));
}

absl::Status ParseInt(const std::string& flag, const std::string& value, int64_t min,
                      int64_t max, int64_t* out) {
  int64_t parsed = 0;
  if (!absl::SimpleAtoi(value, &parsed)) {
    return FlagError(flag, absl::StrCat("expected an integer, got '", value, "'"));
  }
  if (parsed < min || parsed > max) {
    return FlagError(flag, absl::StrCat("must be in [", min, ", ", max, "], got ", parsed));
  }
  *out = parsed;
  return absl::OkStatus();
}

// The bounds of replication.standbys (docs/config.md) and a sane etcd cluster on one machine.
constexpr int64_t kMaxStandbys = 16;
constexpr int64_t kMaxEtcdMembers = 7;
constexpr int64_t kMaxPort = 65535;

absl::Status NonEmpty(const std::string& flag, const std::string& value) {
  if (value.empty()) return FlagError(flag, "must not be empty");
  return absl::OkStatus();
}

std::string WorkerConfigWithBackoff(const std::string& job_id, int backoff_max_ms) {
  return absl::StrCat(
      "# Written by rebound_launch.\n"
      "job_id: \"",
      absl::CEscape(job_id),
      "\"\n"
      "rpc_deadline_ms: 10000\n"
      "backoff_initial_ms: 100\n"
      "backoff_max_ms: ",
      backoff_max_ms, "\n");
}

// The replication block of a group member; `group` names its group (replication.group) when set.
std::string ReplicationBlock(const GroupMemberPlan& member, int standbys,
                             const std::vector<std::string>& etcd_endpoints,
                             std::optional<int> group) {
  std::string text = "replication {\n";
  for (const std::string& endpoint : etcd_endpoints) {
    absl::StrAppend(&text, "  etcd_endpoints: \"", absl::CEscape(endpoint), "\"\n");
  }
  absl::StrAppend(&text, "  standbys: ", standbys,
                  "\n"
                  "  leader_lease_ms: 2000\n");
  if (group.has_value()) absl::StrAppend(&text, "  group: \"", *group, "\"\n");
  absl::StrAppend(&text,
                  "  name: \"", absl::CEscape(member.name),
                  "\"\n"
                  "  peer_listen_address: \"127.0.0.1:0\"\n"
                  "  sync: true\n"
                  "}\n");
  return text;
}

}  // namespace

absl::StatusOr<SlotCoord> ParseSlot(const std::string& text) {
  const std::vector<std::string> parts = absl::StrSplit(text, ',');
  int replica = 0;
  int stage = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(parts[0]), &replica) ||
      !absl::SimpleAtoi(absl::StripAsciiWhitespace(parts[1]), &stage)) {
    return absl::InvalidArgumentError(absl::StrCat("expected R,S (e.g. 0,0), got '", text, "'"));
  }
  if (replica < 0 || stage < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica and stage must be >= 0, got '", text, "'"));
  }
  return SlotCoord{replica, stage};
}

absl::StatusOr<LaunchOptions> ParseLaunchArgs(const std::vector<std::string>& args) {
  LaunchOptions options;
  bool kill_slot_given = false;
  bool corrupt_slot_given = false;
  bool etcd_members_given = false;
  using Setter = std::function<absl::Status(const std::string&, const std::string&)>;
  auto text = [](std::string* field) -> Setter {
    return [field](const std::string& flag, const std::string& value) {
      if (absl::Status s = NonEmpty(flag, value); !s.ok()) return s;
      *field = value;
      return absl::OkStatus();
    };
  };
  const std::map<std::string, Setter> setters = {
      {"job", text(&options.job_file)},
      {"data_dir", text(&options.data_dir)},
      {"workdir", text(&options.workdir)},
      {"progress_csv", text(&options.progress_csv)},
      {"export", text(&options.export_path)},
      {"server_binary", text(&options.server_binary)},
      {"worker_binary", text(&options.worker_binary)},
      {"worker_command", text(&options.worker_command)},
      {"port",
       [&](const std::string& flag, const std::string& value) {
         int64_t port = 0;
         if (absl::Status s = ParseInt(flag, value, 0, 65535, &port); !s.ok()) return s;
         options.port = static_cast<int>(port);
         return absl::OkStatus();
       }},
      {"timeout_s",
       [&](const std::string& flag, const std::string& value) {
         int64_t seconds = 0;
         if (absl::Status s = ParseInt(flag, value, 0, INT_MAX, &seconds); !s.ok()) return s;
         options.timeout_s = static_cast<int>(seconds);
         return absl::OkStatus();
       }},
      {"kill_trainer_at_step",
       [&](const std::string& flag, const std::string& value) {
         int64_t step = 0;
         if (absl::Status s = ParseInt(flag, value, 0, INT64_MAX, &step); !s.ok()) return s;
         options.kill_trainer_at_step = step;
         return absl::OkStatus();
       }},
      {"standbys",
       [&](const std::string& flag, const std::string& value) {
         int64_t standbys = 0;
         if (absl::Status s = ParseInt(flag, value, 0, kMaxStandbys, &standbys); !s.ok()) {
           return s;
         }
         options.standbys = static_cast<int>(standbys);
         return absl::OkStatus();
       }},
      {"etcd_members",
       [&](const std::string& flag, const std::string& value) {
         int64_t members = 0;
         if (absl::Status s = ParseInt(flag, value, 1, kMaxEtcdMembers, &members); !s.ok()) {
           return s;
         }
         if (members % 2 == 0) {
           return FlagError(flag, absl::StrCat("must be odd (an even count tolerates no more "
                                               "failures than one member fewer), got ",
                                               members));
         }
         options.etcd_members = static_cast<int>(members);
         etcd_members_given = true;
         return absl::OkStatus();
       }},
      {"kill_leader_at_step",
       [&](const std::string& flag, const std::string& value) {
         int64_t step = 0;
         if (absl::Status s = ParseInt(flag, value, 0, INT64_MAX, &step); !s.ok()) return s;
         options.kill_leader_at_step = step;
         return absl::OkStatus();
       }},
      {"shard_groups",
       [&](const std::string& flag, const std::string& value) {
         int64_t groups = 0;
         if (absl::Status s = ParseInt(flag, value, 1, kMaxShardGroups, &groups); !s.ok()) {
           return s;
         }
         options.shard_groups = static_cast<int>(groups);
         return absl::OkStatus();
       }},
      {"corrupt_trainer_at_step",
       [&](const std::string& flag, const std::string& value) {
         int64_t step = 0;
         if (absl::Status s = ParseInt(flag, value, 1, INT64_MAX, &step); !s.ok()) return s;
         options.corrupt_trainer_at_step = step;
         return absl::OkStatus();
       }},
      {"corrupt_every",
       [&](const std::string& flag, const std::string& value) {
         return ParseInt(flag, value, 0, INT64_MAX, &options.corrupt_every);
       }},
      {"corrupt_slot",
       [&](const std::string& flag, const std::string& value) {
         absl::StatusOr<SlotCoord> slot = ParseSlot(value);
         if (!slot.ok()) return FlagError(flag, std::string(slot.status().message()));
         options.corrupt_slot = *slot;
         corrupt_slot_given = true;
         return absl::OkStatus();
       }},
      {"kill_slot",
       [&](const std::string& flag, const std::string& value) {
         absl::StatusOr<SlotCoord> slot = ParseSlot(value);
         if (!slot.ok()) return FlagError(flag, std::string(slot.status().message()));
         options.kill_slot = *slot;
         kill_slot_given = true;
         return absl::OkStatus();
       }},
  };

  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--help" || arg == "-h" || arg == "-help") {
      options.help = true;
      continue;
    }
    if (!absl::StartsWith(arg, "--") || arg.size() == 2) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    }
    std::string name = arg.substr(2);
    std::optional<std::string> value;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
    }
    auto setter = setters.find(name);
    if (setter == setters.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
    if (!value.has_value()) {
      if (i + 1 >= args.size()) {
        // The words of every other binary's usage errors (common/usage.h).
        return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
      }
      value = args[++i];
    }
    if (absl::Status s = setter->second(name, *value); !s.ok()) return s;
  }
  if (options.help) return options;
  if (options.job_file.empty()) return absl::InvalidArgumentError("--job is required");
  if (kill_slot_given && !options.kill_trainer_at_step.has_value()) {
    return absl::InvalidArgumentError("--kill_slot needs --kill_trainer_at_step");
  }
  if (corrupt_slot_given && !options.corrupt_trainer_at_step.has_value()) {
    return absl::InvalidArgumentError("--corrupt_slot needs --corrupt_trainer_at_step");
  }
  if (options.corrupt_trainer_at_step.has_value() && !options.worker_command.empty()) {
    return absl::InvalidArgumentError(
        "--corrupt_trainer_at_step needs rebound_worker (its --fault_flip_bit_at_step), not "
        "--worker_command");
  }
  if (options.standbys == 0) {
    if (etcd_members_given) {
      return absl::InvalidArgumentError(
          "--etcd_members needs --standbys >= 1 (one server needs no etcd)");
    }
    if (options.kill_leader_at_step.has_value()) {
      return absl::InvalidArgumentError(
          "--kill_leader_at_step needs --standbys >= 1 (one server has no standby to take over)");
    }
  }
  const int groups = options.shard_groups.value_or(1);
  const int64_t last_port =
      static_cast<int64_t>(options.port) + int64_t{groups} * (1 + options.standbys) - 1;
  if (options.port != 0 && last_port > kMaxPort) {
    if (groups == 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--port ", options.port, " with --standbys ", options.standbys,
                       ": the members listen on ports ", options.port, " to ", last_port,
                       ", above 65535"));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "--port ", options.port, " with --shard_groups ", groups,
        options.standbys > 0 ? absl::StrCat(" and --standbys ", options.standbys) : "",
        ": the ", groups * (1 + options.standbys), " servers listen on ports ", options.port,
        " to ", last_port, ", above 65535"));
  }
  return options;
}

absl::Status CheckOptionsAgainstJob(const LaunchOptions& options, const JobConfig& job) {
  const int replicas = job.topology().replicas();
  const int stages = job.topology().stages();
  if (options.kill_trainer_at_step.has_value() &&
      (options.kill_slot.replica >= replicas || options.kill_slot.stage >= stages)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kill_slot ", options.kill_slot.replica, ",", options.kill_slot.stage,
                     " is outside the job's ", replicas, " x ", stages, " slots"));
  }
  if (options.corrupt_trainer_at_step.has_value() &&
      (options.corrupt_slot.replica >= replicas || options.corrupt_slot.stage >= stages)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--corrupt_slot ", options.corrupt_slot.replica, ",",
                     options.corrupt_slot.stage, " is outside the job's ", replicas, " x ",
                     stages, " slots"));
  }
  if (options.kill_leader_at_step.has_value() &&
      *options.kill_leader_at_step >= job.training().max_steps()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kill_leader_at_step ", *options.kill_leader_at_step,
                     " is not below the job's training.max_steps ", job.training().max_steps(),
                     ": the trainers would finish before the leader is killed"));
  }
  if (!options.shard_groups.has_value()) return absl::OkStatus();
  const int groups = *options.shard_groups;
  const int job_groups = job.sharding().groups();
  if (job_groups > 1 && groups != job_groups) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shard_groups ", groups, " disagrees with the job's sharding.groups ", job_groups,
        ": leave the flag out or give ", job_groups));
  }
  if (groups > 1 && job_groups == 1) {
    JobConfig sharded = job;
    sharded.mutable_sharding()->set_groups(groups);
    if (absl::Status valid = ValidateJobConfig(sharded); !valid.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--shard_groups ", groups, ": the job cannot be sharded: ", valid.message()));
    }
  }
  return absl::OkStatus();
}

int ShardGroups(const LaunchOptions& options, const JobConfig& job) {
  return options.shard_groups.value_or(job.sharding().groups());
}

JobConfig LaunchedJob(const JobConfig& job, int groups, std::string* changes, bool corrupt) {
  JobConfig launched = job;
  std::vector<std::string> changed;
  if (corrupt && !(job.audit().fraction() > 0)) {
    AuditConfig* audit = launched.mutable_audit();
    audit->set_fraction(0.25);
    audit->set_on_mismatch(job.topology().stages() == 1 ? AUDIT_QUARANTINE : AUDIT_REPORT);
    launched.mutable_topology()->set_spares(job.topology().spares() + 1);
    changed.push_back(absl::StrCat("audit { fraction: 0.25 on_mismatch: ",
                                   AuditAction_Name(audit->on_mismatch()),
                                   " } and topology.spares = ", job.topology().spares() + 1,
                                   " (--corrupt_trainer_at_step)"));
  }
  if (job.sharding().groups() != groups) {
    launched.mutable_sharding()->set_groups(groups);
    changed.push_back(absl::StrCat("sharding.groups = ", groups));
  }
  if (job.topology().min_trainers() == 0) {
    const int slots = job.topology().replicas() * job.topology().stages();
    launched.mutable_topology()->set_min_trainers(slots);
    changed.push_back(absl::StrCat("topology.min_trainers = ", slots, " (every slot)"));
  }
  if (changes != nullptr) *changes = absl::StrJoin(changed, ", ");
  return launched;
}

std::string LaunchedJobText(const JobConfig& launched, const std::string& source,
                            const std::string& changes) {
  std::string text;
  google::protobuf::TextFormat::PrintToString(launched, &text);
  return absl::StrCat("# Written by rebound_launch: ", source, " with ", changes, ".\n", text);
}

const char* RoleFlag(LaunchRole role) {
  switch (role) {
    case LaunchRole::kTrainer:
      return "trainer";
    case LaunchRole::kSpare:
      return "spare";
    case LaunchRole::kEvaluator:
      return "evaluator";
  }
  return "auto";
}

std::vector<WorkerPlan> PlanWorkers(const JobConfig& job) {
  std::vector<WorkerPlan> plan;
  for (int r = 0; r < job.topology().replicas(); ++r) {
    for (int s = 0; s < job.topology().stages(); ++s) {
      plan.push_back({absl::StrCat("trainer-r", r, "s", s), LaunchRole::kTrainer,
                      SlotCoord{r, s}});
    }
  }
  for (int i = 0; i < job.topology().spares(); ++i) {
    plan.push_back({absl::StrCat("spare-", i), LaunchRole::kSpare, std::nullopt});
  }
  if (job.topology().evaluator()) {
    plan.push_back({"evaluator", LaunchRole::kEvaluator, std::nullopt});
  }
  return plan;
}

std::string ServerConfigText(const std::string& job_file, int port, const std::string& data_dir) {
  std::string text = absl::StrCat(
      "# Written by rebound_launch.\n"
      "listen_address: \"127.0.0.1:",
      port, "\"\njob_file: \"", absl::CEscape(job_file), "\"\n");
  if (!data_dir.empty()) {
    absl::StrAppend(&text, "durability { data_dir: \"", absl::CEscape(data_dir), "\" }\n");
  }
  return text;
}

std::string WorkerConfigText(const std::string& job_id) {
  return WorkerConfigWithBackoff(job_id, /*backoff_max_ms=*/2000);
}

std::vector<GroupMemberPlan> PlanGroup(int standbys, const std::vector<int>& ports,
                                       const std::string& data_parent) {
  return PlanShardGroups(/*groups=*/1, standbys, ports, data_parent);
}

std::string GroupMemberConfigText(const std::string& job_file, const GroupMemberPlan& member,
                                  int standbys, const std::vector<std::string>& etcd_endpoints) {
  return ServerConfigText(job_file, member.port, member.data_dir) +
         ReplicationBlock(member, standbys, etcd_endpoints, /*group=*/std::nullopt);
}

std::vector<GroupMemberPlan> PlanShardGroups(int groups, int standbys,
                                             const std::vector<int>& ports,
                                             const std::string& data_parent) {
  std::vector<GroupMemberPlan> members;
  for (int g = 0; g < groups; ++g) {
    for (int i = 0; i <= standbys; ++i) {
      GroupMemberPlan member;
      if (groups == 1) {
        member.name = absl::StrCat("server-", i);
      } else {
        member.name = standbys == 0 ? absl::StrCat("g", g, "-server")
                                    : absl::StrCat("g", g, "-server-", i);
      }
      member.port = ports.at(g * (1 + standbys) + i);
      if (!data_parent.empty()) member.data_dir = absl::StrCat(data_parent, "/", member.name);
      member.shard_group = g;
      members.push_back(std::move(member));
    }
  }
  return members;
}

std::vector<std::string> ShardAddressLists(const std::vector<GroupMemberPlan>& members,
                                           int groups) {
  std::vector<std::vector<GroupMemberPlan>> by_group(groups);
  for (const GroupMemberPlan& member : members) by_group.at(member.shard_group).push_back(member);
  std::vector<std::string> lists;
  for (const std::vector<GroupMemberPlan>& group : by_group) {
    lists.push_back(GroupAddressList(group));
  }
  return lists;
}

std::string ShardMemberConfigText(const std::string& job_file, const GroupMemberPlan& member,
                                  int standbys, const std::vector<std::string>& etcd_endpoints,
                                  const std::vector<std::string>& shard_addresses) {
  std::string text = ServerConfigText(job_file, member.port, member.data_dir);
  if (!etcd_endpoints.empty()) {
    // Each shard group elects its own leader under its own etcd keys, /rebound/<job>/<g>/.
    absl::StrAppend(&text, ReplicationBlock(member, standbys, etcd_endpoints, member.shard_group));
  }
  absl::StrAppend(&text, "shard {\n  group: ", member.shard_group, "\n");
  for (const std::string& address : shard_addresses) {
    absl::StrAppend(&text, "  group_addresses: \"", absl::CEscape(address), "\"\n");
  }
  absl::StrAppend(&text, "}\n");
  return text;
}

std::string GroupWorkerConfigText(const std::string& job_id) {
  return WorkerConfigWithBackoff(job_id, /*backoff_max_ms=*/250);
}

std::string GroupAddressList(const std::vector<GroupMemberPlan>& members) {
  std::vector<std::string> addresses;
  for (const GroupMemberPlan& member : members) {
    addresses.push_back(absl::StrCat("127.0.0.1:", member.port));
  }
  return absl::StrJoin(addresses, ",");
}

std::string AbsolutePath(const std::string& path) {
  std::error_code error;
  std::filesystem::path absolute = std::filesystem::absolute(path, error);
  if (error) return path;
  return absolute.lexically_normal().string();
}

}  // namespace rebound::launch
