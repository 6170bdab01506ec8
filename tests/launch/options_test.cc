// The launcher's command line, its worker plan and the configs it writes into its work dir.

#include "tools/launch/options.h"

#include <catch2/catch.hpp>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/config.h"

namespace rebound::launch {
namespace {

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  REQUIRE(out.good());
}

std::string ParseError(const std::vector<std::string>& args) {
  absl::StatusOr<LaunchOptions> options = ParseLaunchArgs(args);
  REQUIRE_FALSE(options.ok());
  CHECK(options.status().code() == absl::StatusCode::kInvalidArgument);
  return std::string(options.status().message());
}

JobConfig Job(int replicas, int stages, int spares, bool evaluator) {
  JobConfig job;
  job.set_job_id("plan");
  job.mutable_topology()->set_replicas(replicas);
  job.mutable_topology()->set_stages(stages);
  job.mutable_topology()->set_spares(spares);
  job.mutable_topology()->set_evaluator(evaluator);
  return job;
}

TEST_CASE("only --job is required; everything else has a documented default") {
  absl::StatusOr<LaunchOptions> options = ParseLaunchArgs({"--job", "job.pbtxt"});
  REQUIRE(options.ok());
  CHECK(options->job_file == "job.pbtxt");
  CHECK(options->data_dir.empty());
  CHECK(options->port == 0);
  CHECK(options->workdir.empty());
  CHECK_FALSE(options->kill_trainer_at_step.has_value());
  CHECK(options->kill_slot == SlotCoord{0, 0});
  CHECK(options->progress_csv.empty());
  CHECK(options->timeout_s == 0);
  CHECK(options->server_binary.empty());
  CHECK(options->worker_binary.empty());
  CHECK(options->standbys == 0);
  CHECK(options->etcd_members == 3);
  CHECK_FALSE(options->kill_leader_at_step.has_value());
  CHECK_FALSE(options->shard_groups.has_value());
  CHECK_FALSE(options->help);
}

TEST_CASE("every flag is accepted as --name value and as --name=value") {
  absl::StatusOr<LaunchOptions> options = ParseLaunchArgs(
      {"--job=j.pbtxt", "--data_dir", "/data", "--port=7071", "--workdir", "wd",
       "--kill_trainer_at_step", "40", "--kill_slot=1,2", "--progress_csv", "p.csv",
       "--timeout_s=90", "--server_binary", "/bin/s", "--worker_binary=/bin/w",
       "--worker_command", "/usr/bin/python3 x.py  --flag", "--standbys=2", "--etcd_members",
       "5", "--kill_leader_at_step=300", "--shard_groups=3"});
  REQUIRE(options.ok());
  CHECK(options->job_file == "j.pbtxt");
  CHECK(options->data_dir == "/data");
  CHECK(options->port == 7071);
  CHECK(options->workdir == "wd");
  REQUIRE(options->kill_trainer_at_step.has_value());
  CHECK(*options->kill_trainer_at_step == 40);
  CHECK(options->kill_slot == SlotCoord{1, 2});
  CHECK(options->progress_csv == "p.csv");
  CHECK(options->timeout_s == 90);
  CHECK(options->server_binary == "/bin/s");
  CHECK(options->worker_binary == "/bin/w");
  CHECK(options->worker_command == "/usr/bin/python3 x.py  --flag");
  CHECK(options->standbys == 2);
  CHECK(options->etcd_members == 5);
  REQUIRE(options->kill_leader_at_step.has_value());
  CHECK(*options->kill_leader_at_step == 300);
  CHECK(options->shard_groups == 3);
}

TEST_CASE("a repeated flag keeps its last value") {
  absl::StatusOr<LaunchOptions> options =
      ParseLaunchArgs({"--job", "a.pbtxt", "--port", "1", "--job", "b.pbtxt", "--port=2"});
  REQUIRE(options.ok());
  CHECK(options->job_file == "b.pbtxt");
  CHECK(options->port == 2);
}

TEST_CASE("--help needs no other flag") {
  absl::StatusOr<LaunchOptions> options = ParseLaunchArgs({"--help"});
  REQUIRE(options.ok());
  CHECK(options->help);
  CHECK(absl::StrContains(kUsage, "--kill_trainer_at_step N"));
  CHECK(absl::StrContains(kUsage, "143 SIGTERM"));
  CHECK(absl::StrContains(kUsage, "--standbys N"));
  CHECK(absl::StrContains(kUsage, "--etcd_members M"));
  CHECK(absl::StrContains(kUsage, "--kill_leader_at_step S"));
  CHECK(absl::StrContains(kUsage, "--shard_groups K"));
}

TEST_CASE("a flag error names the flag and what was wrong") {
  CHECK(ParseError({}) == "--job is required");
  CHECK(ParseError({"--port", "80"}) == "--job is required");
  CHECK(ParseError({"--job", "j", "--jobs", "2"}) == "unknown flag --jobs");
  CHECK(ParseError({"--job", "j", "extra"}) == "unexpected argument 'extra'");
  CHECK(ParseError({"--job", "j", "-port", "1"}) == "unexpected argument '-port'");
  CHECK(ParseError({"--job"}) == "flag --job needs a value");
  CHECK(ParseError({"--job", "j", "--timeout_s"}) == "flag --timeout_s needs a value");
  CHECK(ParseError({"--job="}) == "--job: must not be empty");
  CHECK(ParseError({"--job", "j", "--port", "65536"}) == "--port: must be in [0, 65535], got 65536");
  CHECK(ParseError({"--job", "j", "--port", "http"}) == "--port: expected an integer, got 'http'");
  CHECK(ParseError({"--job", "j", "--timeout_s", "-1"}) ==
        "--timeout_s: must be in [0, 2147483647], got -1");
  CHECK(absl::StartsWith(ParseError({"--job", "j", "--kill_trainer_at_step", "-5"}),
                         "--kill_trainer_at_step: must be in [0, "));
  CHECK(ParseError({"--job", "j", "--kill_trainer_at_step", "1", "--kill_slot", "1"}) ==
        "--kill_slot: expected R,S (e.g. 0,0), got '1'");
  CHECK(ParseError({"--job", "j", "--kill_slot", "1,0"}) ==
        "--kill_slot needs --kill_trainer_at_step");
}

TEST_CASE("the group's flags are checked: ranges, odd etcd sizes, and what needs --standbys") {
  CHECK(ParseError({"--job", "j", "--standbys", "-1"}) == "--standbys: must be in [0, 16], got -1");
  CHECK(ParseError({"--job", "j", "--standbys", "17"}) == "--standbys: must be in [0, 16], got 17");
  CHECK(ParseError({"--job", "j", "--standbys", "one"}) ==
        "--standbys: expected an integer, got 'one'");
  CHECK(ParseError({"--job", "j", "--standbys", "1", "--etcd_members", "0"}) ==
        "--etcd_members: must be in [1, 7], got 0");
  CHECK(ParseError({"--job", "j", "--standbys", "1", "--etcd_members", "9"}) ==
        "--etcd_members: must be in [1, 7], got 9");
  CHECK(ParseError({"--job", "j", "--standbys", "1", "--etcd_members", "2"}) ==
        "--etcd_members: must be odd (an even count tolerates no more failures than one member "
        "fewer), got 2");
  CHECK(absl::StartsWith(ParseError({"--job", "j", "--standbys", "1", "--kill_leader_at_step",
                                     "-1"}),
                         "--kill_leader_at_step: must be in [0, "));
  CHECK(ParseError({"--job", "j", "--etcd_members", "3"}) ==
        "--etcd_members needs --standbys >= 1 (one server needs no etcd)");
  CHECK(ParseError({"--job", "j", "--standbys", "0", "--kill_leader_at_step", "10"}) ==
        "--kill_leader_at_step needs --standbys >= 1 (one server has no standby to take over)");
  CHECK(ParseError({"--job", "j", "--standbys", "2", "--port", "65534"}) ==
        "--port 65534 with --standbys 2: the members listen on ports 65534 to 65536, above 65535");

  absl::StatusOr<LaunchOptions> options =
      ParseLaunchArgs({"--job", "j", "--standbys", "2", "--port", "65533"});
  REQUIRE(options.ok());
  CHECK(options->standbys == 2);
  CHECK(options->port == 65533);
  options = ParseLaunchArgs({"--job", "j", "--standbys", "1", "--etcd_members", "1",
                             "--kill_leader_at_step", "0", "--kill_trainer_at_step", "5"});
  REQUIRE(options.ok());
  CHECK(options->etcd_members == 1);
  CHECK(*options->kill_leader_at_step == 0);
  CHECK(*options->kill_trainer_at_step == 5);
}

TEST_CASE("--export names the model file, also with --shard_groups") {
  absl::StatusOr<LaunchOptions> options =
      ParseLaunchArgs({"--job", "j.pbtxt", "--export", "out/model.safetensors"});
  REQUIRE(options.ok());
  CHECK(options->export_path == "out/model.safetensors");
  CHECK(ParseLaunchArgs({"--job", "j.pbtxt"})->export_path.empty());
  // Group 0 gathers a sharded center from its groups (docs/sharding.md#exporting-the-center).
  absl::StatusOr<LaunchOptions> sharded =
      ParseLaunchArgs({"--job", "j.pbtxt", "--export", "m", "--shard_groups", "2"});
  REQUIRE(sharded.ok());
  CHECK(sharded->export_path == "m");
  CHECK(*sharded->shard_groups == 2);
  CHECK(absl::StrContains(kUsage, "--export FILE"));
}

TEST_CASE("--shard_groups is 1 to 64, and --port must leave room for every server's port") {
  CHECK(ParseError({"--job", "j", "--shard_groups", "0"}) ==
        "--shard_groups: must be in [1, 64], got 0");
  CHECK(ParseError({"--job", "j", "--shard_groups", "65"}) ==
        "--shard_groups: must be in [1, 64], got 65");
  CHECK(ParseError({"--job", "j", "--shard_groups", "two"}) ==
        "--shard_groups: expected an integer, got 'two'");
  CHECK(ParseError({"--job", "j", "--shard_groups="}) ==
        "--shard_groups: expected an integer, got ''");
  // K groups of 1 + S servers each listen on --port, --port + 1, ...
  CHECK(ParseError({"--job", "j", "--shard_groups", "3", "--port", "65534"}) ==
        "--port 65534 with --shard_groups 3: the 3 servers listen on ports 65534 to 65536, above "
        "65535");
  CHECK(ParseError({"--job", "j", "--shard_groups", "2", "--standbys", "1", "--port", "65533"}) ==
        "--port 65533 with --shard_groups 2 and --standbys 1: the 4 servers listen on ports 65533 "
        "to 65536, above 65535");
  absl::StatusOr<LaunchOptions> options =
      ParseLaunchArgs({"--job", "j", "--shard_groups", "2", "--standbys", "1", "--port", "65532"});
  REQUIRE(options.ok());
  CHECK(options->shard_groups == 2);
  // Group 0's leader is the one --kill_leader_at_step kills; it needs standbys as ever.
  options = ParseLaunchArgs({"--job", "j", "--shard_groups", "2", "--standbys", "1",
                             "--kill_leader_at_step", "50"});
  REQUIRE(options.ok());
  CHECK(ParseError({"--job", "j", "--shard_groups", "2", "--kill_leader_at_step", "50"}) ==
        "--kill_leader_at_step needs --standbys >= 1 (one server has no standby to take over)");
}

// A job that --shard_groups can shard: EASGD (the default), a model spec, REPLAY (the default).
JobConfig ShardableJob() {
  JobConfig job = Job(2, 1, 1, false);
  job.mutable_model()->add_layers()->set_width(16);
  LayerSpec* output = job.mutable_model()->add_layers();
  output->set_width(10);
  output->set_activation(IDENTITY);
  return job;
}

TEST_CASE("--shard_groups shards a job that does not, and must agree with one that does") {
  LaunchOptions options;
  JobConfig job = ShardableJob();
  REQUIRE(ValidateJobConfig(job).ok());
  // Without the flag: the job's sharding.groups.
  CHECK(CheckOptionsAgainstJob(options, job).ok());
  CHECK(ShardGroups(options, job) == 1);
  options.shard_groups = 3;
  CHECK(CheckOptionsAgainstJob(options, job).ok());
  CHECK(ShardGroups(options, job) == 3);

  job.mutable_sharding()->set_groups(2);
  options.shard_groups.reset();
  CHECK(ShardGroups(options, job) == 2);
  options.shard_groups = 2;
  CHECK(CheckOptionsAgainstJob(options, job).ok());
  for (int groups : {1, 3}) {
    options.shard_groups = groups;
    absl::Status disagrees = CheckOptionsAgainstJob(options, job);
    CHECK(disagrees.code() == absl::StatusCode::kInvalidArgument);
    CHECK(disagrees.message() ==
          absl::StrCat("--shard_groups ", groups,
                       " disagrees with the job's sharding.groups 2: leave the flag out or give 2"));
  }
}

TEST_CASE("--shard_groups on a job that cannot be sharded says why, in the job's own words") {
  LaunchOptions options;
  options.shard_groups = 2;
  JobConfig job = ShardableJob();
  job.mutable_model()->Clear();
  job.mutable_model()->set_declared_by_worker(true);
  job.mutable_fault_tolerance()->set_policy(GLOBAL_CHECKPOINT);
  absl::Status refused = CheckOptionsAgainstJob(options, job);
  CHECK(refused.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StartsWith(refused.message(), "--shard_groups 2: the job cannot be sharded: "));
  CHECK(absl::StrContains(refused.message(), "sharding.groups"));
  CHECK(absl::StrContains(refused.message(), "GLOBAL_CHECKPOINT shards a model spec with layers "
                                             "only"));
  // GLOBAL_CHECKPOINT of a model spec, and a declared model under REPLAY, shard (R14).
  JobConfig checkpointed = ShardableJob();
  checkpointed.mutable_fault_tolerance()->set_policy(GLOBAL_CHECKPOINT);
  options.shard_groups = 2;
  CHECK(CheckOptionsAgainstJob(options, checkpointed).ok());
  JobConfig declared = ShardableJob();
  declared.mutable_model()->Clear();
  declared.mutable_model()->set_declared_by_worker(true);
  CHECK(CheckOptionsAgainstJob(options, declared).ok());
  // One group is always fine.
  options.shard_groups = 1;
  CHECK(CheckOptionsAgainstJob(options, job).ok());
}

TEST_CASE("the launched copy of a job is the job with sharding.groups = K and the start barrier "
          "over every slot, and nothing else") {
  JobConfig job = ShardableJob();
  job.set_job_id("copy-me");
  job.mutable_topology()->set_replicas(3);
  std::string changes;
  const JobConfig launched = LaunchedJob(job, 4, &changes);
  CHECK(changes == "sharding.groups = 4, topology.min_trainers = 3 (every slot)");
  const std::string text = LaunchedJobText(launched, "/jobs/j.pbtxt", changes);
  CHECK(absl::StartsWith(text, "# Written by rebound_launch: /jobs/j.pbtxt with sharding.groups "
                               "= 4, topology.min_trainers = 3 (every slot).\n"));
  absl::StatusOr<JobConfig> parsed = ParseJobConfig(text, "copy.pbtxt");
  INFO(text << "\n" << parsed.status().message());
  REQUIRE(parsed.ok());
  CHECK(parsed->sharding().groups() == 4);
  CHECK(parsed->topology().min_trainers() == 3);
  parsed->clear_sharding();
  parsed->mutable_topology()->clear_min_trainers();
  CHECK(parsed->SerializeAsString() == job.SerializeAsString());

  // A job that sets its own barrier and sharding is run as it is.
  job.mutable_topology()->set_min_trainers(2);
  job.mutable_sharding()->set_groups(4);
  const JobConfig same = LaunchedJob(job, 4, &changes);
  CHECK(changes.empty());
  CHECK(same.SerializeAsString() == job.SerializeAsString());
}

TEST_CASE("--corrupt_trainer_at_step: its slot and period, and an audited launched job") {
  absl::StatusOr<LaunchOptions> options = ParseLaunchArgs(
      {"--job", "j", "--corrupt_trainer_at_step", "600", "--corrupt_slot", "2,0",
       "--corrupt_every", "0"});
  REQUIRE(options.ok());
  CHECK(*options->corrupt_trainer_at_step == 600);
  CHECK(options->corrupt_slot == SlotCoord{2, 0});
  CHECK(options->corrupt_every == 0);
  CHECK(ParseLaunchArgs({"--job", "j", "--corrupt_trainer_at_step", "5"})->corrupt_every == 50);
  CHECK(ParseError({"--job", "j", "--corrupt_slot", "1,0"}) ==
        "--corrupt_slot needs --corrupt_trainer_at_step");
  CHECK(ParseError({"--job", "j", "--corrupt_trainer_at_step", "0"}) ==
        "--corrupt_trainer_at_step: must be in [1, 9223372036854775807], got 0");
  CHECK(absl::StrContains(ParseError({"--job", "j", "--corrupt_trainer_at_step", "5",
                                      "--worker_command", "python3 x.py"}),
                          "needs rebound_worker"));
  JobConfig job = ShardableJob();
  job.mutable_topology()->set_replicas(2);
  job.mutable_topology()->set_min_trainers(2);
  job.mutable_topology()->set_spares(1);
  options->corrupt_slot = SlotCoord{2, 0};
  CHECK(absl::StrContains(CheckOptionsAgainstJob(*options, job).message(),
                          "--corrupt_slot 2,0 is outside the job's 2 x 1 slots"));
  std::string changes;
  const JobConfig launched = LaunchedJob(job, 1, &changes, /*corrupt=*/true);
  CHECK(changes == "audit { fraction: 0.25 on_mismatch: AUDIT_QUARANTINE } and topology.spares "
                   "= 2 (--corrupt_trainer_at_step)");
  CHECK(launched.audit().fraction() == 0.25);
  CHECK(launched.topology().spares() == 2);
  absl::StatusOr<JobConfig> parsed =
      ParseJobConfig(LaunchedJobText(launched, "/j.pbtxt", changes), "copy.pbtxt");
  INFO(parsed.status().message());
  CHECK(parsed.ok());
  // A job that audits already is run with its own audits.
  job.mutable_audit()->set_fraction(0.05);
  const JobConfig own = LaunchedJob(job, 1, &changes, /*corrupt=*/true);
  CHECK(changes.empty());
  CHECK(own.SerializeAsString() == job.SerializeAsString());
}

TEST_CASE("shard groups are planned group by group on consecutive ports, named by group") {
  // One server per group: g<g>-server.
  std::vector<GroupMemberPlan> servers = PlanShardGroups(3, 0, {7000, 7001, 7002}, "/d");
  REQUIRE(servers.size() == 3);
  for (int g = 0; g < 3; ++g) {
    INFO(g);
    CHECK(servers[g].name == absl::StrCat("g", g, "-server"));
    CHECK(servers[g].port == 7000 + g);
    CHECK(servers[g].shard_group == g);
    CHECK(servers[g].data_dir == absl::StrCat("/d/g", g, "-server"));
  }
  CHECK(ShardAddressLists(servers, 3) ==
        std::vector<std::string>{"127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"});
  // Without a data parent, in memory.
  for (const GroupMemberPlan& server : PlanShardGroups(2, 0, {1, 2}, "")) {
    CHECK(server.data_dir.empty());
  }
  // Replicated groups: g<g>-server-<i>, member i of group g on port g * (1 + S) + i.
  std::vector<GroupMemberPlan> members = PlanShardGroups(2, 1, {10, 11, 20, 21}, "/d");
  REQUIRE(members.size() == 4);
  CHECK(members[0].name == "g0-server-0");
  CHECK(members[1].name == "g0-server-1");
  CHECK(members[2].name == "g1-server-0");
  CHECK(members[3].name == "g1-server-1");
  CHECK(members[3].port == 21);
  CHECK(members[3].shard_group == 1);
  CHECK(members[3].data_dir == "/d/g1-server-1");
  CHECK(ShardAddressLists(members, 2) ==
        std::vector<std::string>{"127.0.0.1:10,127.0.0.1:11", "127.0.0.1:20,127.0.0.1:21"});
  // One group is the replicated group of PlanGroup, named as ever.
  const std::vector<GroupMemberPlan> one = PlanShardGroups(1, 1, {5, 6}, "/d");
  REQUIRE(one.size() == 2);
  CHECK(one[1].name == "server-1");
  CHECK(one[1].shard_group == 0);
}

TEST_CASE("a shard group's server config loads with its shard block, replicated or not") {
  const std::string dir = absl::StrCat(TempDir(), "/shard config");
  REQUIRE(system(absl::StrCat("mkdir -p '", dir, "'").c_str()) == 0);
  const std::string job_file = dir + "/job.pbtxt";
  std::string changes;
  WriteFile(job_file, LaunchedJobText(LaunchedJob(ShardableJob(), 2, &changes), "test", changes));

  // A group of one server, in memory.
  std::vector<GroupMemberPlan> servers = PlanShardGroups(2, 0, {7401, 7402}, "");
  const std::vector<std::string> addresses = ShardAddressLists(servers, 2);
  const std::string config_file = dir + "/g1-server.pbtxt";
  WriteFile(config_file, ShardMemberConfigText(job_file, servers[1], 0, {}, addresses));
  absl::StatusOr<ServerConfig> config = LoadServerConfig(config_file);
  INFO(config.status().message());
  REQUIRE(config.ok());
  CHECK(config->listen_address() == "127.0.0.1:7402");
  CHECK_FALSE(config->has_durability());
  CHECK_FALSE(config->has_replication());
  CHECK(config->job().sharding().groups() == 2);
  CHECK(config->shard().group() == 1);
  CHECK(std::vector<std::string>(config->shard().group_addresses().begin(),
                                 config->shard().group_addresses().end()) == addresses);

  // A replicated group: its own replication.group, so that each group elects its own leader.
  std::vector<GroupMemberPlan> members = PlanShardGroups(2, 1, {7501, 7502, 7503, 7504}, dir);
  const std::vector<std::string> lists = ShardAddressLists(members, 2);
  for (const GroupMemberPlan& member : members) {
    INFO(member.name);
    const std::string file = absl::StrCat(dir, "/", member.name, ".pbtxt");
    WriteFile(file, ShardMemberConfigText(job_file, member, 1, {"127.0.0.1:2379"}, lists));
    absl::StatusOr<ServerConfig> loaded = LoadServerConfig(file);
    INFO(loaded.status().message());
    REQUIRE(loaded.ok());
    CHECK(loaded->durability().data_dir() == absl::StrCat(dir, "/", member.name));
    CHECK(loaded->replication().group() == absl::StrCat(member.shard_group));
    CHECK(loaded->replication().name() == member.name);
    CHECK(loaded->replication().standbys() == 1);
    CHECK(loaded->shard().group() == member.shard_group);
    REQUIRE(loaded->shard().group_addresses_size() == 2);
    CHECK(loaded->shard().group_addresses(1) == "127.0.0.1:7503,127.0.0.1:7504");
  }
  // The unsharded group's config is unchanged: no group line, no shard block.
  const std::string plain = GroupMemberConfigText(job_file, members[0], 1, {"127.0.0.1:2379"});
  CHECK_FALSE(absl::StrContains(plain, "  group: "));
  CHECK_FALSE(absl::StrContains(plain, "shard {"));
}

TEST_CASE("--kill_leader_at_step must come before the job's last step") {
  LaunchOptions options;
  options.standbys = 1;
  JobConfig job = Job(2, 1, 0, false);
  job.mutable_training()->set_max_steps(400);
  options.kill_leader_at_step = 399;
  CHECK(CheckOptionsAgainstJob(options, job).ok());
  options.kill_leader_at_step = 400;
  absl::Status late = CheckOptionsAgainstJob(options, job);
  CHECK(late.code() == absl::StatusCode::kInvalidArgument);
  CHECK(late.message() ==
        "--kill_leader_at_step 400 is not below the job's training.max_steps 400: the trainers "
        "would finish before the leader is killed");
}

TEST_CASE("a slot is two non-negative integers R,S") {
  absl::StatusOr<SlotCoord> slot = ParseSlot("1,0");
  REQUIRE(slot.ok());
  CHECK(*slot == SlotCoord{1, 0});
  slot = ParseSlot(" 12 , 3 ");
  REQUIRE(slot.ok());
  CHECK(*slot == SlotCoord{12, 3});
  for (const char* bad : {"", "1", "1,", ",1", "1,2,3", "a,b", "1.5,0", "-1,0", "0,-1"}) {
    INFO("'" << bad << "'");
    CHECK_FALSE(ParseSlot(bad).ok());
  }
  CHECK(ParseSlot("-1,0").status().message() == "replica and stage must be >= 0, got '-1,0'");
}

TEST_CASE("--kill_slot must name a slot of the job") {
  LaunchOptions options;
  options.kill_trainer_at_step = 10;
  options.kill_slot = {1, 0};
  CHECK(CheckOptionsAgainstJob(options, Job(2, 1, 0, false)).ok());
  options.kill_slot = {2, 0};
  absl::Status outside = CheckOptionsAgainstJob(options, Job(2, 1, 0, false));
  CHECK(outside.code() == absl::StatusCode::kInvalidArgument);
  CHECK(outside.message() == "--kill_slot 2,0 is outside the job's 2 x 1 slots");
  options.kill_slot = {0, 1};
  CHECK_FALSE(CheckOptionsAgainstJob(options, Job(2, 1, 0, false)).ok());
  CHECK(CheckOptionsAgainstJob(options, Job(2, 2, 0, false)).ok());
  // Without a kill, the slot is not used and not checked.
  options.kill_trainer_at_step.reset();
  options.kill_slot = {9, 9};
  CHECK(CheckOptionsAgainstJob(options, Job(2, 1, 0, false)).ok());
}

TEST_CASE("the plan starts trainers in slot order, then spares, then the evaluator") {
  const std::vector<WorkerPlan> plan = PlanWorkers(Job(2, 2, 2, true));
  REQUIRE(plan.size() == 7);
  const std::vector<std::string> names = {"trainer-r0s0", "trainer-r0s1", "trainer-r1s0",
                                          "trainer-r1s1", "spare-0",      "spare-1",
                                          "evaluator"};
  for (size_t i = 0; i < plan.size(); ++i) CHECK(plan[i].name == names[i]);
  CHECK(plan[0].slot == SlotCoord{0, 0});
  CHECK(plan[1].slot == SlotCoord{0, 1});
  CHECK(plan[2].slot == SlotCoord{1, 0});
  CHECK(plan[3].slot == SlotCoord{1, 1});
  for (int i = 0; i < 4; ++i) CHECK(plan[i].role == LaunchRole::kTrainer);
  CHECK(plan[4].role == LaunchRole::kSpare);
  CHECK_FALSE(plan[4].slot.has_value());
  CHECK(plan[6].role == LaunchRole::kEvaluator);
  CHECK(std::string(RoleFlag(LaunchRole::kTrainer)) == "trainer");
  CHECK(std::string(RoleFlag(LaunchRole::kSpare)) == "spare");
  CHECK(std::string(RoleFlag(LaunchRole::kEvaluator)) == "evaluator");

  const std::vector<WorkerPlan> alone = PlanWorkers(Job(1, 1, 0, false));
  REQUIRE(alone.size() == 1);
  CHECK(alone[0].name == "trainer-r0s0");
}

TEST_CASE("the generated server config loads and names the job by its absolute path") {
  const std::string dir = absl::StrCat(TempDir(), "/server config \"quoted\"");
  REQUIRE(system(absl::StrCat("mkdir -p '", dir, "'").c_str()) == 0);
  const std::string job_file = dir + "/job.pbtxt";
  WriteFile(job_file,
            "job_id: \"launched\"\n"
            "model { layers { width: 10 activation: IDENTITY } }\n"
            "topology { replicas: 2 spares: 1 }\n");
  const std::string data_dir = dir + "/data";

  const std::string text = ServerConfigText(job_file, 0, data_dir);
  const std::string config_file = dir + "/server.pbtxt";
  WriteFile(config_file, text);
  absl::StatusOr<ServerConfig> config = LoadServerConfig(config_file);
  REQUIRE(config.ok());
  CHECK(config->listen_address() == "127.0.0.1:0");
  CHECK(config->job().job_id() == "launched");
  CHECK(config->job().topology().replicas() == 2);
  CHECK(config->durability().data_dir() == data_dir);
  CHECK(absl::StrContains(text, "job_file: "));

  // A fixed port, and no durability section without --data_dir.
  WriteFile(config_file, ServerConfigText(job_file, 7075, ""));
  config = LoadServerConfig(config_file);
  REQUIRE(config.ok());
  CHECK(config->listen_address() == "127.0.0.1:7075");
  CHECK_FALSE(config->has_durability());
  CHECK(config->job().job_id() == "launched");
}

TEST_CASE("the generated worker config joins only the job, with the launcher's deadlines") {
  const std::string file = TempDir() + "/worker.pbtxt";
  WriteFile(file, WorkerConfigText("launched"));
  absl::StatusOr<WorkerConfig> config = LoadWorkerConfig(file);
  REQUIRE(config.ok());
  CHECK(config->job_id() == "launched");
  CHECK(config->rpc_deadline_ms() == 10000);
  CHECK(config->backoff_initial_ms() == 100);
  CHECK(config->backoff_max_ms() == 2000);
}

TEST_CASE("a group's members are server-<i> on their ports, with their data under one parent") {
  const std::vector<GroupMemberPlan> members = PlanGroup(2, {7101, 7205, 7309}, "/w");
  REQUIRE(members.size() == 3);
  for (int i = 0; i < 3; ++i) {
    INFO(i);
    CHECK(members[i].name == absl::StrCat("server-", i));
    CHECK(members[i].data_dir == absl::StrCat("/w/server-", i));
  }
  CHECK(members[0].port == 7101);
  CHECK(members[2].port == 7309);
  CHECK(GroupAddressList(members) == "127.0.0.1:7101,127.0.0.1:7205,127.0.0.1:7309");
  CHECK(PlanGroup(0, {7000}, "/w").size() == 1);
}

TEST_CASE("a group member's config loads with the replication block the server requires") {
  const std::string dir = absl::StrCat(TempDir(), "/group config");
  REQUIRE(system(absl::StrCat("mkdir -p '", dir, "'").c_str()) == 0);
  const std::string job_file = dir + "/job.pbtxt";
  WriteFile(job_file,
            "job_id: \"grouped\"\n"
            "model { layers { width: 10 activation: IDENTITY } }\n"
            "topology { replicas: 2 }\n");
  const std::vector<GroupMemberPlan> members = PlanGroup(1, {7301, 7302}, dir);
  const std::string config_file = dir + "/server-1.pbtxt";
  WriteFile(config_file, GroupMemberConfigText(job_file, members[1], 1,
                                               {"127.0.0.1:2379", "127.0.0.1:2381"}));
  absl::StatusOr<ServerConfig> config = LoadServerConfig(config_file);
  INFO(config.status().message());
  REQUIRE(config.ok());
  CHECK(config->listen_address() == "127.0.0.1:7302");
  CHECK(config->job().job_id() == "grouped");
  CHECK(config->durability().data_dir() == dir + "/server-1");
  REQUIRE(config->has_replication());
  const ReplicationConfig& replication = config->replication();
  REQUIRE(replication.etcd_endpoints_size() == 2);
  CHECK(replication.etcd_endpoints(0) == "127.0.0.1:2379");
  CHECK(replication.etcd_endpoints(1) == "127.0.0.1:2381");
  CHECK(replication.standbys() == 1);
  CHECK(replication.leader_lease_ms() == 2000);
  CHECK(replication.name() == "server-1");
  CHECK(replication.peer_listen_address() == "127.0.0.1:0");
  CHECK(replication.sync());
}

TEST_CASE("a group's workers cap their retry backoff at 250 ms, the rest as for one server") {
  const std::string file = TempDir() + "/group-worker.pbtxt";
  WriteFile(file, GroupWorkerConfigText("launched"));
  absl::StatusOr<WorkerConfig> config = LoadWorkerConfig(file);
  REQUIRE(config.ok());
  CHECK(config->job_id() == "launched");
  CHECK(config->rpc_deadline_ms() == 10000);
  CHECK(config->backoff_initial_ms() == 100);
  CHECK(config->backoff_max_ms() == 250);
  // One server's is unchanged, byte for byte.
  CHECK(WorkerConfigText("launched") ==
        "# Written by rebound_launch.\n"
        "job_id: \"launched\"\n"
        "rpc_deadline_ms: 10000\n"
        "backoff_initial_ms: 100\n"
        "backoff_max_ms: 2000\n");
}

TEST_CASE("relative paths are made absolute against the current directory") {
  char cwd[4096];
  REQUIRE(getcwd(cwd, sizeof(cwd)) != nullptr);
  CHECK(AbsolutePath("a/b.pbtxt") == absl::StrCat(cwd, "/a/b.pbtxt"));
  CHECK(AbsolutePath("./a/../c") == absl::StrCat(cwd, "/c"));
  CHECK(AbsolutePath("/x/y") == "/x/y");
}

}  // namespace
}  // namespace rebound::launch
