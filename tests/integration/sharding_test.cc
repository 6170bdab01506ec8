// The center sharded across K server groups (docs/design.md §10.2, docs/sharding.md), with real
// rebound_server groups and real rebound_worker trainers and spares on loopback
// (testing/cluster with shard_groups): every range applies every sync exactly once, a trainer
// killed between its ranges leaves nothing applied twice or lost, DETERMINISTIC runs end
// bit-identical to one group, and the range groups refuse what they must.

#include <catch2/catch.hpp>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "common/file.h"
#include "common/security.h"
#include "compute/shard_ranges.h"
#include "grpcpp/grpcpp.h"
#include "proto/rebound.grpc.pb.h"
#include "proto/sharding.grpc.pb.h"
#include "testing/cluster/cluster.h"
#include "testing/cluster/processes.h"
#include "testing/cluster/time_scale.h"

namespace rebound::testing {
namespace {

constexpr int kReplicas = 2;
constexpr int kSyncPeriod = 20;
constexpr int64_t kMaxSteps = 400;

// `policy`: the fault_tolerance block's policy and any other fields of it; `extra`: more
// top-level server fields.
std::string ServerConfigText(const std::string& policy = "REPLAY", int64_t max_steps = kMaxSteps,
                             int stages = 1, const std::string& mode = "EASGD",
                             const std::string& extra = "") {
  return absl::StrCat(
      "listen_address: \"127.0.0.1:0\"\n"
      "max_wait_ms: 2000\n", extra,
      "job {\n"
      "  job_id: \"shard\"\n"
      "  model { layers { width: 16 } layers { width: 10 activation: IDENTITY } }\n"
      "  topology { replicas: ", kReplicas, " stages: ", stages, " }\n"
      "  weighting { policy: UNIFORM }\n"
      "  scheduling: DETERMINISTIC\n"
      "  fault_tolerance { policy: ", policy, " heartbeat_interval_ms: 100 "
      "failure_timeout_ms: 1500 }\n"
      "  data { batch_size: 16 micro_batches: 2 train_limit: 2000 test_limit: 500 }\n"
      "  adahessian { lr: 0.01 }\n"
      "  step_log { linger_ms: 0 }\n"
      "  easgd { mode: ", mode, " sync_period: ", kSyncPeriod, " }\n"
      "  training { max_steps: ", max_steps, " }\n"
      "}\n");
}

const char kWorkerConfig[] =
    "job_id: \"shard\"\n"
    "backoff_initial_ms: 20\n"
    "backoff_max_ms: 200\n"
    "give_up_after_ms: 60000\n";

ClusterOptions ShardOptions(const std::string& name, int groups, int standbys = 0) {
  ClusterOptions options;
  options.standbys = standbys;
  options.server_binary = Runfile("server/rebound_server");
  options.worker_binary = Runfile("worker/rebound_worker");
  options.dir = MakeTempDir(name);
  options.shard_groups = groups;
  // Trainers exit 0 once the job is done; StopAll checks every exit code.
  options.fail_on_exit = false;
  return options;
}

bool Finished(const GetStatusResponse& s) {
  if (s.slots_size() < kReplicas) return false;
  for (const SlotStatus& slot : s.slots()) {
    if (slot.state() != FINISHED) return false;
  }
  return true;
}

GetStatusResponse WaitFor(Cluster& cluster,
                          const std::function<bool(const GetStatusResponse&)>& done,
                          const std::string& what, absl::Duration limit = absl::Seconds(120)) {
  absl::StatusOr<GetStatusResponse> status = cluster.WaitForStatus(done, limit, what);
  INFO(cluster.Logs(30, 10));
  REQUIRE(status.ok());
  return *status;
}

// A test client registered with group 0 as a spare: its credential reads the ranges.
struct Observer {
  RegisterResponse registration;
};

Observer Register(Cluster& cluster) {
  RegisterRequest request;
  request.set_worker_name("observer");
  request.set_requested_role(SPARE);
  Observer observer;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
  const grpc::Status status = cluster.stub().Register(&context, request, &observer.registration);
  INFO(status.error_message());
  REQUIRE(status.ok());
  return observer;
}

// A stub on group `group` (a replicated group's channel follows its leader).
std::unique_ptr<CenterRange::Stub> RangeStub(const Cluster& cluster, int group) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      MakeChannel(cluster.group_address(group), SecurityConfig(), grpc::ChannelArguments());
  REQUIRE(channel.ok());
  return CenterRange::NewStub(*channel);
}

// The whole center of stage 0, gathered range by range (as a worker does), with each range's
// version.
std::vector<float> GatherCenter(Cluster& cluster, const Observer& observer, int groups,
                                int stages, std::vector<int64_t>* versions) {
  std::vector<float> center;
  for (int i = 0; i < stages * groups; ++i) {
    const int g = i % groups;
    PullRangeRequest request;
    request.set_incarnation(observer.registration.incarnation());
    request.set_stage(i / groups);
    request.set_range(g);
    PullRangeResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
    context.AddMetadata(kWorkerCredentialKey, observer.registration.credential());
    const grpc::Status status = RangeStub(cluster, g)->PullRange(&context, request, &response);
    INFO("range " << g << ": " << status.error_message());
    REQUIRE(status.ok());
    REQUIRE(response.center().tensors_size() == 1);
    const std::string& bytes = response.center().tensors(0).data();
    const float* values = reinterpret_cast<const float*>(bytes.data());
    center.insert(center.end(), values, values + bytes.size() / sizeof(float));
    versions->push_back(response.center_version());
  }
  return center;
}

// The one-group center of the same job, pulled whole, stage after stage.
std::vector<float> PullCenter(Cluster& cluster, const Observer& observer, int stages) {
  std::vector<float> center;
  for (int stage = 0; stage < stages; ++stage) {
    PullRequest request;
    request.set_incarnation(observer.registration.incarnation());
    request.set_stage(stage);
    PullResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
    context.AddMetadata(kWorkerCredentialKey, observer.registration.credential());
    REQUIRE(cluster.stub().Pull(&context, request, &response).ok());
    for (const Tensor& tensor : response.center().tensors()) {
      const float* values = reinterpret_cast<const float*>(tensor.data().data());
      center.insert(center.end(), values, values + tensor.data().size() / sizeof(float));
    }
  }
  return center;
}

// ExportCenter at group 0 (an operator call: with `token`, or without one from this host).
grpc::Status Export(Cluster& cluster, const std::string& token, ExportCenterResponse* exported,
                    absl::Duration deadline = absl::Seconds(60)) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(deadline)));
  if (!token.empty()) context.AddMetadata(kOperatorTokenKey, token);
  return cluster.stub().ExportCenter(&context, ExportCenterRequest(), exported);
}

// The exported values, stage after stage, tensor after tensor: the packed center.
std::vector<float> ExportedValues(const ExportCenterResponse& exported) {
  std::vector<float> values;
  for (const ExportedStage& stage : exported.stages()) {
    for (const Tensor& tensor : stage.center().tensors()) {
      const float* data = reinterpret_cast<const float*>(tensor.data().data());
      values.insert(values.end(), data, data + tensor.data().size() / sizeof(float));
    }
  }
  return values;
}

// "stage <s> <name> [d0, d1, ...]" of every exported tensor, in order.
std::vector<std::string> ExportedTensors(const ExportCenterResponse& exported) {
  std::vector<std::string> tensors;
  for (const ExportedStage& stage : exported.stages()) {
    for (const Tensor& tensor : stage.center().tensors()) {
      tensors.push_back(absl::StrCat("stage ", stage.stage(), " ", tensor.name(), " [",
                                     absl::StrJoin(tensor.shape(), ", "), "]"));
    }
  }
  return tensors;
}

struct RunResult {
  std::vector<float> center;
  GetStatusResponse status;  // group 0's at the end
  ExportCenterResponse exported;  // ExportCenter at group 0 at the end
};

struct RunOptions {
  int64_t max_steps = kMaxSteps;
  // > 0: trainer 1 sends its sync of this step to range 0 only and dies; a spare rebuilds it.
  int64_t die_at = 0;
  std::string policy = "REPLAY";
  int standbys = 0;  // per group
  // >= 0: once slot 0 passes `kill_at`, the leader of this group is SIGKILLed (standbys > 0).
  int kill_leader_of = -1;
  int64_t kill_at = 0;
  int stages = 1;  // pipeline stages per replica
  // Mode ASYNC_ADAHESSIAN: every step is a push, applied once per range.
  bool async = false;
  // > 0: trainer 1 is SIGKILLed once its slot passes this step (a spare takes the slot over).
  int64_t kill_trainer_at = 0;
  std::string server_extra;  // top-level server config fields (ServerConfigText's `extra`)
  // The operator token the servers share (server_extra's security block), for ExportCenter.
  std::string operator_token;
  // ExportCenter once slot 0 passed a quarter of the job, while both trainers sync.
  bool export_while_training = false;
  // Under GLOBAL_CHECKPOINT a kill rolls every range back: each range's version is then above
  // the syncs of one clean run (the undone syncs and the restore count too).
  bool rolls_back = false;
  // Called once every slot finished, before the cluster stops.
  std::function<void(Cluster&, const Observer&)> after;
};

// Runs the job with `groups` groups and two trainers.
RunResult RunJob(int groups, const RunOptions& run = RunOptions()) {
  const int64_t die_at = run.die_at;
  const std::string& policy = run.policy;
  // The updates each slot makes: a sync every tau steps, or a push every step.
  const int64_t rounds = run.async ? run.max_steps : run.max_steps / kSyncPeriod;
  Cluster cluster(ShardOptions(absl::StrCat("shard", groups), groups, run.standbys));
  {
    absl::Status started =
        cluster.StartServer(ServerConfigText(policy, run.max_steps, run.stages,
                                             run.async ? "ASYNC_ADAHESSIAN" : "EASGD",
                                             run.server_extra),
                            kWorkerConfig);
    INFO(started << cluster.Logs(30, 8));
    REQUIRE(started.ok());
  }
  if (die_at > 0 || run.kill_trainer_at > 0) {
    // The spare first, so that it is waiting when the trainer dies.
    absl::Status spare = cluster.StartSpares(
        {"spare"}, /*until_polling=*/policy != "RESTART_FROM_CENTER" && !run.async);
    INFO(spare << cluster.Logs(30, 8));
    REQUIRE(spare.ok());
  }
  absl::Status trainers;
  if (run.stages == 1) {
    // One at a time, so that trainer i owns slot i (the fault goes to trainer 1's).
    trainers = cluster.StartTrainers(kReplicas, [&](int trainer) {
      std::vector<std::string> flags;
      if (die_at > 0 && trainer == 1) {
        flags = {absl::StrCat("--fault_die_in_sync_at_step=", die_at),
                 "--fault_die_in_sync_ranges=1"};
      }
      return flags;
    });
  } else {
    // A pipeline's slots are each a function of (replica, stage) only: who owns which is moot.
    for (int i = 0; i < kReplicas * run.stages && trainers.ok(); ++i) {
      trainers = cluster.StartWorker(absl::StrCat("trainer-", i), "trainer");
    }
  }
  INFO(trainers << cluster.Logs(30, 8));
  REQUIRE(trainers.ok());
  if (die_at > 0) cluster.ExpectExit("trainer-1");
  if (run.kill_trainer_at > 0) {
    WaitFor(cluster, [&](const GetStatusResponse& s) {
      return s.slots_size() > 1 && s.slots(1).step() >= run.kill_trainer_at;
    }, "slot 1 past the kill step");
    REQUIRE(cluster.KillWorker("trainer-1").ok());
  }
  if (run.kill_leader_of >= 0) {
    WaitFor(cluster, [&](const GetStatusResponse& s) {
      return s.slots_size() > 0 && s.slots(0).step() >= run.kill_at;
    }, "slot 0 past the kill step");
    // Only a whole group is promised to keep everything through its leader's loss: wait until
    // the leader reports every standby in sync (on a loaded machine a standby may lag).
    absl::StatusOr<GetStatusResponse> group;
    const absl::Time deadline = absl::Now() + Scaled(absl::Seconds(60));
    while (true) {
      group = cluster.GetGroupStatus(run.kill_leader_of);
      if (group.ok() && group->group().role() == GroupStatus::LEADER &&
          group->group().in_sync_size() == 1 + run.standbys) {
        break;
      }
      INFO((group.ok() ? group->group().DebugString() : group.status().ToString()));
      REQUIRE(absl::Now() < deadline);
      absl::SleepFor(absl::Milliseconds(50));
    }
    int leader = -1;
    for (int i = 0; i < cluster.members(); ++i) {
      if (cluster.member_name(i) == group->group().name()) leader = i;
    }
    REQUIRE(leader >= 0);
    REQUIRE(cluster.group_of(leader) == run.kill_leader_of);
    REQUIRE(cluster.KillMember(leader).ok());
  }
  if (run.export_while_training) {
    WaitFor(cluster, [&](const GetStatusResponse& s) {
      return s.slots_size() > 0 && s.slots(0).step() >= run.max_steps / 4;
    }, "slot 0 past a quarter of the job");
    // Trainers sync every range at once, so a read may meet a sync between the ranges: the
    // export answers a center whose ranges hold the same syncs (equal versions: no rollback).
    ExportCenterResponse exported;
    const grpc::Status status = Export(cluster, run.operator_token, &exported);
    INFO(status.error_message() << cluster.Logs(30, 8));
    REQUIRE(status.ok());
    REQUIRE(exported.stages_size() == run.stages);
    for (const ExportedStage& stage : exported.stages()) {
      INFO("stage " << stage.stage());
      REQUIRE(stage.range_versions_size() == groups);
      for (int64_t version : stage.range_versions()) CHECK(version == stage.center_version());
      CHECK(stage.center_version() <= rounds * kReplicas);
    }
  }
  RunResult result;
  result.status = WaitFor(cluster, Finished, "every slot FINISHED");
  const Observer observer = Register(cluster);
  REQUIRE(result.status.slots_size() == kReplicas * run.stages);
  std::vector<int64_t> versions;  // by stage, then range (sharded)
  if (groups == 1) {
    result.center = PullCenter(cluster, observer, run.stages);
    for (const CenterStatus& center : result.status.centers()) {
      CHECK(center.version() == rounds * kReplicas);
    }
  } else {
    result.center = GatherCenter(cluster, observer, groups, run.stages, &versions);
    // Every range of every stage applied every sync of every slot exactly once.
    for (size_t i = 0; i < versions.size(); ++i) {
      INFO("stage " << i / groups << " range " << i % groups);
      if (run.rolls_back) {
        CHECK(versions[i] > rounds * kReplicas);
      } else {
        CHECK(versions[i] == rounds * kReplicas);
      }
    }
    REQUIRE(result.status.has_sharding());
    CHECK(result.status.sharding().groups() == groups);
  }
  // ExportCenter answers the same center bit for bit (a sharded job's group 0 joins it from the
  // ranges), with every range's version.
  {
    const grpc::Status status = Export(cluster, run.operator_token, &result.exported);
    INFO(status.error_message() << cluster.Logs(30, 8));
    REQUIRE(status.ok());
    CHECK(result.exported.job_id() == "shard");
    REQUIRE(result.exported.stages_size() == run.stages);
    const std::vector<float> exported = ExportedValues(result.exported);
    REQUIRE(exported.size() == result.center.size());
    CHECK(std::memcmp(exported.data(), result.center.data(), exported.size() * 4) == 0);
    for (const ExportedStage& stage : result.exported.stages()) {
      INFO("stage " << stage.stage());
      if (groups == 1) {
        CHECK(stage.range_versions_size() == 0);
        CHECK(stage.center_version() == rounds * kReplicas);
        continue;
      }
      REQUIRE(stage.range_versions_size() == groups);
      for (int k = 0; k < groups; ++k) {
        CHECK(stage.range_versions(k) == versions[stage.stage() * groups + k]);
      }
      CHECK(stage.center_version() == stage.range_versions(0));
    }
  }
  for (const SlotStatus& slot : result.status.slots()) {
    INFO("slot " << slot.slot().replica());
    CHECK(slot.update_count() == rounds);
    if (!run.async) CHECK(slot.snapshot_step() == run.max_steps);
  }
  if (die_at > 0) {
    const ChildProcess* dead = cluster.FindWorker("trainer-1");
    REQUIRE(dead != nullptr);
    REQUIRE(result.status.recoveries_size() >= 1);
    INFO(result.status.recoveries(0).DebugString() << cluster.Logs(40, 20));
    CHECK(result.status.recoveries(0).outcome() == RECOVERED);
    CHECK(absl::StrContains(ReadFileOrEmpty(cluster.dir() + "/trainer-1.log"),
                            "dying before the commit"));
  }
  if (run.after) run.after(cluster, observer);
  cluster.StopAll(true, [](const ChildProcess&, int) {});
  return result;
}

// The default job on one group: the reference of the two cases below, run once per test binary
// (the DETERMINISTIC run is the same every time; R16 found it run twice).
const RunResult& OneGroupReference() {
  static const RunResult* const reference = new RunResult(RunJob(1));
  return *reference;
}

TEST_CASE("a center sharded across 2 and 3 groups trains to the end, each range applying every "
          "sync once, bit-identical to one group") {
  const RunResult& one = OneGroupReference();
  RunOptions exporting;
  exporting.export_while_training = true;
  const RunResult two = RunJob(2, exporting);
  const RunResult three = RunJob(3);
  // The sharded exports name and shape the tensors as the unsharded one: the MLP's layers.
  const std::vector<std::string> tensors = ExportedTensors(one.exported);
  REQUIRE(tensors.size() == 4);
  CHECK(absl::StartsWith(tensors[0], "stage 0 layer0.weight [16, "));
  CHECK(tensors[1] == "stage 0 layer0.bias [16]");
  CHECK(tensors[2] == "stage 0 layer1.weight [10, 16]");
  CHECK(tensors[3] == "stage 0 layer1.bias [10]");
  CHECK(ExportedTensors(two.exported) == tensors);
  CHECK(ExportedTensors(three.exported) == tensors);
  REQUIRE(one.center.size() == two.center.size());
  REQUIRE(one.center.size() == three.center.size());
  CHECK(std::memcmp(one.center.data(), two.center.data(), one.center.size() * 4) == 0);
  CHECK(std::memcmp(one.center.data(), three.center.data(), one.center.size() * 4) == 0);
  // The ranges are byte-balanced: their sizes differ by at most one element.
  const ShardingStatus& sharding = three.status.sharding();
  REQUIRE(sharding.stages_size() == 1);
  const auto& begins = sharding.stages(0).range_begin();
  REQUIRE(begins.size() == 3);
  const int64_t n = sharding.stages(0).parameters();
  CHECK(n == static_cast<int64_t>(one.center.size()));
  for (int k = 0; k < 3; ++k) {
    const int64_t end = k + 1 < 3 ? begins[k + 1] : n;
    CHECK(end - begins[k] >= n / 3);
    CHECK(end - begins[k] <= n / 3 + 1);
  }
}

TEST_CASE("a trainer killed between its sync to range 0 and range 1 is rebuilt by replay, every "
          "range applies the step once, and the run ends bit-identical to one group") {
  const RunResult& clean = OneGroupReference();
  RunOptions die;
  die.die_at = 10 * kSyncPeriod;
  const RunResult killed = RunJob(3, die);
  REQUIRE(clean.center.size() == killed.center.size());
  CHECK(std::memcmp(clean.center.data(), killed.center.data(), clean.center.size() * 4) == 0);
}

TEST_CASE("under RESTART_FROM_CENTER a trainer killed between its ranges is replaced and every "
          "range still applies each step once") {
  RunOptions die;
  die.die_at = 10 * kSyncPeriod;
  die.policy = "RESTART_FROM_CENTER";
  const RunResult restarted = RunJob(2, die);  // RunJob checks the counts and versions
  CHECK(restarted.status.recoveries(0).policy() == RESTART_FROM_CENTER);
}

// A call to range group `group` of `cluster` with the operator token `token` (none when empty).
template <typename Request, typename Response>
grpc::Status OperatorCall(const Cluster& cluster, int group, const std::string& token,
                          grpc::Status (CenterRange::Stub::*method)(grpc::ClientContext*,
                                                                   const Request&, Response*),
                          const Request& request, Response* response) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(30))));
  if (!token.empty()) context.AddMetadata(kOperatorTokenKey, token);
  return (RangeStub(cluster, group).get()->*method)(&context, request, response);
}

TEST_CASE("under GLOBAL_CHECKPOINT a killed trainer rolls every range of a sharded center back to "
          "the last cut, and the DETERMINISTIC run ends bit-identical to one group's clean run") {
  const std::string policy = "GLOBAL_CHECKPOINT checkpoint_every_steps: 100";
  RunOptions clean_run;
  clean_run.policy = policy;
  const RunResult clean = RunJob(1, clean_run);
  CHECK(clean.status.checkpoint().rollbacks() == 0);
  CHECK(clean.status.checkpoint().count() == kMaxSteps / 100);

  // Group 0's calls to the range groups carry the operator token every group shares.
  const std::string token = "sharded-checkpoint-operator";
  const std::string token_file = MakeTempDir("shard-ck-token") + "/operator-token";
  REQUIRE(WriteFile(token_file, token + "\n").ok());
  RunOptions killed;
  killed.policy = policy;
  // Trainer 1 dies in its sync of step 220 (after range 0, before the commit): a crash at a
  // fixed step. A SIGKILL once a status poll saw step 220 raced the 400-step job's end (the
  // trainer had finished at 400 when the kill landed: no rollback, seen once under load).
  killed.die_at = 11 * kSyncPeriod;
  killed.rolls_back = true;
  // Durable: each group keeps its range checkpoints in its data directory (the cluster gives
  // every member its own).
  killed.server_extra = absl::StrCat("security { operator_token_file: \"", token_file,
                                     "\" }\ndurability { data_dir: \"data\" }\n");
  killed.operator_token = token;
  killed.after = [&](Cluster& cluster, const Observer& observer) {
    // Range 1's group keeps its part of the last cut and of the one before (group 0 keeps the
    // older until the newer is everywhere); older ones are gone.
    const std::string dir = cluster.member_data_dir(1) + "/range_checkpoints";
    CHECK(std::filesystem::exists(absl::StrCat(dir, "/range-1-", kMaxSteps, ".pb")));
    CHECK(std::filesystem::exists(absl::StrCat(dir, "/range-1-", kMaxSteps - 100, ".pb")));
    CHECK_FALSE(std::filesystem::exists(absl::StrCat(dir, "/range-1-", kMaxSteps - 200, ".pb")));
    std::vector<int64_t> before;
    const std::vector<float> center = GatherCenter(cluster, observer, 2, 1, &before);
    // Only group 0 may ask for a rollback: without the operator token, none.
    RollbackRangeRequest rollback;
    rollback.set_step(kMaxSteps);
    rollback.set_range(1);
    rollback.set_rollback_id(0x5eed);
    RollbackRangeResponse rolled_back;
    CHECK(OperatorCall(cluster, 1, "", &CenterRange::Stub::RollbackRange, rollback, &rolled_back)
              .error_code() == grpc::StatusCode::UNAUTHENTICATED);
    // With it, range 1 goes back to the last cut (the job's end: the same values, a new
    // version); the same rollback again changes nothing.
    for (int call = 0; call < 2; ++call) {
      grpc::Status done =
          OperatorCall(cluster, 1, token, &CenterRange::Stub::RollbackRange, rollback, &rolled_back);
      INFO("call " << call << ": " << done.error_message());
      REQUIRE(done.ok());
      REQUIRE(rolled_back.center_versions_size() == 1);
      CHECK(rolled_back.center_versions(0) == before[1] + 1);
    }
    // Group 0's read of a slot's range snapshot (an audited window's start, incarnation 0) is
    // an operator call too: refused without the token; with it, the range's part of the slot's
    // snapshot at a step the range holds (the cut's), NOT_FOUND at another.
    {
      ReadRangeSnapshotRequest read;
      read.mutable_slot()->set_replica(0);
      read.set_step(kMaxSteps);
      read.set_range(1);
      Snapshot part;
      CHECK(OperatorCall(cluster, 1, "", &CenterRange::Stub::ReadRangeSnapshot, read, &part)
                .error_code() == grpc::StatusCode::UNAUTHENTICATED);
      const grpc::Status held =
          OperatorCall(cluster, 1, token, &CenterRange::Stub::ReadRangeSnapshot, read, &part);
      INFO(held.error_message());
      REQUIRE(held.ok());
      CHECK(part.step() == kMaxSteps);
      REQUIRE(part.params().tensors_size() == 1);
      CHECK(part.params().tensors(0).shape(0) ==
            static_cast<int64_t>(center.size() - center.size() / 2));
      CHECK(part.optimizer().m().tensors_size() == 1);
      read.set_step(kMaxSteps - 3 * kSyncPeriod);
      CHECK(OperatorCall(cluster, 1, token, &CenterRange::Stub::ReadRangeSnapshot, read, &part)
                .error_code() == grpc::StatusCode::NOT_FOUND);
    }
    // A step the range holds no checkpoint of: NOT_FOUND; a cut the slots are not at:
    // FAILED_PRECONDITION; another group's range: INVALID_ARGUMENT.
    rollback.set_step(kMaxSteps - 50);
    rollback.set_rollback_id(0x5eee);
    CHECK(OperatorCall(cluster, 1, token, &CenterRange::Stub::RollbackRange, rollback, &rolled_back)
              .error_code() == grpc::StatusCode::NOT_FOUND);
    CheckpointRangeRequest take;
    take.set_step(kMaxSteps - 50);
    take.set_range(1);
    CheckpointRangeResponse taken;
    CHECK(OperatorCall(cluster, 1, token, &CenterRange::Stub::CheckpointRange, take, &taken)
              .error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    take.set_range(0);
    CHECK(OperatorCall(cluster, 1, token, &CenterRange::Stub::CheckpointRange, take, &taken)
              .error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    // None of it moved a range or removed a checkpoint.
    std::vector<int64_t> after;
    CHECK(GatherCenter(cluster, observer, 2, 1, &after) == center);
    REQUIRE(after.size() == 2);
    CHECK(after[0] == before[0]);
    CHECK(after[1] == before[1] + 1);
    CHECK(std::filesystem::exists(absl::StrCat(dir, "/range-1-", kMaxSteps - 100, ".pb")));
    // The ranges now hold the same syncs at different versions (range 1's restore counted):
    // ExportCenter answers them, with each range's version; without the token it refuses.
    ExportCenterResponse exported;
    CHECK(Export(cluster, "", &exported).error_code() == grpc::StatusCode::UNAUTHENTICATED);
    const grpc::Status status = Export(cluster, token, &exported);
    INFO(status.error_message());
    REQUIRE(status.ok());
    CHECK(ExportedValues(exported) == center);
    REQUIRE(exported.stages_size() == 1);
    REQUIRE(exported.stages(0).range_versions_size() == 2);
    CHECK(exported.stages(0).range_versions(0) == after[0]);
    CHECK(exported.stages(0).range_versions(1) == after[1]);
    CHECK(exported.stages(0).center_version() == after[0]);
  };
  const RunResult rolled = RunJob(2, killed);
  const GetStatusResponse& done = rolled.status;
  INFO(done.DebugString());
  CHECK(done.recovery_policy() == GLOBAL_CHECKPOINT);
  CHECK(done.checkpoint().rollbacks() == 1);
  CHECK(done.checkpoint().step() == kMaxSteps);
  // Both slots were restored from the same cut, each by a spare (the live trainer was rolled
  // back and came back as one).
  REQUIRE(done.recoveries_size() == 2);
  std::string restored_from;
  for (const RecoveryStatus& r : done.recoveries()) {
    CHECK(r.policy() == GLOBAL_CHECKPOINT);
    CHECK(r.outcome() == RECOVERED);
    CHECK(r.steps_replayed() == 0);
    CHECK(absl::StartsWith(r.detail(), "restored from the global checkpoint of step "));
    if (restored_from.empty()) restored_from = r.detail().substr(0, r.detail().find(';'));
    CHECK(absl::StartsWith(r.detail(), restored_from));
  }
  REQUIRE(clean.center.size() == rolled.center.size());
  CHECK(std::memcmp(clean.center.data(), rolled.center.data(), clean.center.size() * 4) == 0);
}

TEST_CASE("a range group's leader SIGKILLed mid-training (R13 standbys) loses no sync and applies "
          "none twice, and the run ends bit-identical to one group") {
  RunOptions options;
  options.max_steps = 3000;
  const RunResult clean = RunJob(1, options);
  options.standbys = 1;
  options.kill_leader_of = 1;
  options.kill_at = 1000;
  const RunResult failed_over = RunJob(2, options);
  REQUIRE(clean.center.size() == failed_over.center.size());
  CHECK(std::memcmp(clean.center.data(), failed_over.center.data(), clean.center.size() * 4) == 0);
}

// A test client on a sharded cluster: its own registrations' credentials on every call.
class Client {
 public:
  explicit Client(Cluster& cluster) : cluster_(cluster) {}

  RegisterResponse Register(const std::string& name, WorkerRole role) {
    RegisterRequest request;
    request.set_worker_name(name);
    request.set_requested_role(role);
    RegisterResponse response;
    grpc::ClientContext context;
    Deadline(&context);
    const grpc::Status status = cluster_.stub().Register(&context, request, &response);
    INFO(status.error_message());
    REQUIRE(status.ok());
    return response;
  }

  grpc::Status SyncRange(int group, const SyncRangeRequest& request, const std::string& credential,
                         SyncRangeResponse* response) {
    grpc::ClientContext context;
    Deadline(&context);
    if (!credential.empty()) context.AddMetadata(kWorkerCredentialKey, credential);
    return RangeStub(cluster_, group)->SyncRange(&context, request, response);
  }

  grpc::Status Commit(const CommitSyncRequest& request, const std::string& credential,
                      CommitSyncResponse* response) {
    grpc::ClientContext context;
    Deadline(&context);
    context.AddMetadata(kWorkerCredentialKey, credential);
    return cluster_.stub().CommitSync(&context, request, response);
  }

  PullRangeResponse Pull(int group, const RegisterResponse& who) {
    PullRangeRequest request;
    request.set_incarnation(who.incarnation());
    request.set_stage(0);
    request.set_range(group);
    PullRangeResponse response;
    grpc::ClientContext context;
    Deadline(&context);
    context.AddMetadata(kWorkerCredentialKey, who.credential());
    const grpc::Status status = RangeStub(cluster_, group)->PullRange(&context, request, &response);
    INFO(status.error_message());
    REQUIRE(status.ok());
    return response;
  }

 private:
  static void Deadline(grpc::ClientContext* context) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
  }
  Cluster& cluster_;
};

// A sync of range `group` at `step` whose x is the range's center shifted by `shift`, with a
// zero optimizer state.
SyncRangeRequest MakeSyncRange(const RegisterResponse& trainer, int group, int64_t step,
                               const TensorBundle& center, float shift) {
  SyncRangeRequest request;
  request.set_incarnation(trainer.incarnation());
  *request.mutable_slot() = trainer.slot();
  request.set_step(step);
  request.set_range(group);
  TensorBundle x = center;
  std::string& bytes = *x.mutable_tensors(0)->mutable_data();
  float* values = reinterpret_cast<float*>(bytes.data());
  for (size_t i = 0; i < bytes.size() / sizeof(float); ++i) values[i] += shift;
  *request.mutable_params() = x;
  TensorBundle zero = center;
  std::fill(zero.mutable_tensors(0)->mutable_data()->begin(),
            zero.mutable_tensors(0)->mutable_data()->end(), '\0');
  *request.mutable_optimizer()->mutable_m() = zero;
  *request.mutable_optimizer()->mutable_v() = zero;
  *request.mutable_optimizer()->mutable_last_hdiag() = zero;
  return request;
}

TEST_CASE("ASYNC_ADAHESSIAN pushes are applied once per range and sequence, also across a "
          "trainer killed mid-run") {
  RunOptions options;
  options.async = true;
  options.max_steps = 300;
  options.kill_trainer_at = 150;
  const RunResult pushed = RunJob(3, options);  // RunJob checks every range's version
  REQUIRE(pushed.status.recoveries_size() >= 1);
  CHECK(pushed.status.recoveries(0).policy() == RESTART_FROM_CENTER);
  CHECK(std::all_of(pushed.center.begin(), pushed.center.end(),
                    [](float value) { return std::isfinite(value); }));
}

TEST_CASE("a two-stage pipeline sharded across 2 groups trains bit-identical to one group") {
  RunOptions options;
  options.stages = 2;
  const RunResult one = RunJob(1, options);
  const RunResult two = RunJob(2, options);
  REQUIRE(one.center.size() == two.center.size());
  CHECK(std::memcmp(one.center.data(), two.center.data(), one.center.size() * 4) == 0);
  REQUIRE(two.status.sharding().stages_size() == 2);
  CHECK(ExportedTensors(two.exported) == ExportedTensors(one.exported));
  CHECK(absl::StartsWith(ExportedTensors(one.exported).back(), "stage 1 "));
}

// A declared model of `n` parameters in two tensors, values 0.5, 1.0, 1.5, ...
TensorBundle DeclaredModel(int n) {
  TensorBundle model;
  const int sizes[2] = {n - n / 3, n / 3};
  float value = 0.0f;
  for (int i = 0; i < 2; ++i) {
    Tensor* tensor = model.add_tensors();
    tensor->set_id(i);
    tensor->set_name(i == 0 ? "layer.weight" : "layer.bias");
    tensor->set_dtype(FLOAT32);
    tensor->add_shape(sizes[i]);
    std::vector<float> values(sizes[i]);
    for (float& v : values) v = (value += 0.5f);
    tensor->set_data(std::string(reinterpret_cast<const char*>(values.data()),
                                 values.size() * sizeof(float)));
  }
  return model;
}

TEST_CASE("a declared model is sharded: a range group learns it from group 0, serves its slice "
          "and keeps it across a restart") {
  Cluster cluster(ShardOptions("shard-declared", 2));
  std::string text = ServerConfigText("REPLAY", kMaxSteps, 1, "EASGD",
                                      "durability { data_dir: \"data\" }\n");
  text = absl::StrReplaceAll(
      text, {{"model { layers { width: 16 } layers { width: 10 activation: IDENTITY } }",
              "model { declared_by_worker: true }"}});
  {
    absl::Status started = cluster.StartServer(text, kWorkerConfig);
    INFO(started << cluster.Logs(30, 8));
    REQUIRE(started.ok());
  }
  constexpr int kParameters = 301;
  const TensorBundle model = DeclaredModel(kParameters);
  Client client(cluster);
  RegisterRequest request;
  request.set_worker_name("t0");
  request.set_requested_role(TRAINER);
  *request.mutable_model() = model;
  RegisterResponse trainer;
  {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
    const grpc::Status status = cluster.stub().Register(&context, request, &trainer);
    INFO(status.error_message());
    REQUIRE(status.ok());
  }
  REQUIRE(trainer.range_addresses_size() == 2);
  // Range 1 holds elements [150, 301) of the declared values; range 0 the rest.
  std::vector<float> declared;
  for (const Tensor& tensor : model.tensors()) {
    const float* values = reinterpret_cast<const float*>(tensor.data().data());
    declared.insert(declared.end(), values, values + tensor.data().size() / sizeof(float));
  }
  auto values_of = [](const PullRangeResponse& pulled) {
    REQUIRE(pulled.center().tensors_size() == 1);
    const std::string& bytes = pulled.center().tensors(0).data();
    const float* values = reinterpret_cast<const float*>(bytes.data());
    return std::vector<float>(values, values + bytes.size() / sizeof(float));
  };
  const std::vector<float> range0(declared.begin(), declared.begin() + kParameters / 2);
  const std::vector<float> range1(declared.begin() + kParameters / 2, declared.end());
  // Group 1 does not know the model yet (no worker call reached it): the export takes its
  // range from group 0's declaration, and names and shapes the declared tensors.
  auto check_export = [&](const char* when) {
    INFO(when);
    ExportCenterResponse exported;
    const grpc::Status status = Export(cluster, "", &exported);
    INFO(status.error_message());
    REQUIRE(status.ok());
    CHECK(ExportedValues(exported) == declared);
    CHECK(ExportedTensors(exported) ==
          std::vector<std::string>{absl::StrCat("stage 0 layer.weight [", kParameters - 100, "]"),
                                   "stage 0 layer.bias [100]"});
    REQUIRE(exported.stages_size() == 1);
    CHECK(exported.stages(0).range_versions_size() == 2);
    CHECK(exported.stages(0).center_version() == 0);
  };
  check_export("before group 1 learned the model");
  CHECK(values_of(client.Pull(0, trainer)) == range0);
  CHECK(values_of(client.Pull(1, trainer)) == range1);  // group 1 learns the model here
  check_export("after group 1 learned the model");
  {
    absl::StatusOr<GetStatusResponse> group1 = cluster.GetGroupStatus(1);
    REQUIRE(group1.ok());
    REQUIRE(group1->sharding().stages_size() == 1);
    CHECK(group1->sharding().stages(0).parameters() == kParameters);
    CHECK(group1->sharding().stages(0).range_begin(1) == kParameters / 2);
  }
  // Restarted, group 1 declares the model from its own store before anyone calls it.
  REQUIRE(cluster.KillMember(1).ok());
  REQUIRE(cluster.RestartMember(1, /*wipe_data=*/false).ok());
  GetStatusResponse restarted;
  const absl::Time deadline = absl::Now() + Scaled(absl::Seconds(30));
  while (true) {
    absl::StatusOr<GetStatusResponse> status = cluster.GetGroupStatus(1);
    if (status.ok() && status->has_sharding()) {
      restarted = *status;
      break;
    }
    REQUIRE(absl::Now() < deadline);
    absl::SleepFor(absl::Milliseconds(50));
  }
  REQUIRE(restarted.sharding().stages_size() == 1);
  CHECK(restarted.sharding().stages(0).parameters() == kParameters);
  // Read by a worker registered now (this test's t0 sends no heartbeats: a slow restart may
  // outlast its failure timeout).
  RegisterRequest reader_request = request;
  reader_request.set_worker_name("reader");
  reader_request.set_requested_role(SPARE);
  RegisterResponse reader;
  {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
    const grpc::Status status = cluster.stub().Register(&context, reader_request, &reader);
    INFO(status.error_message());
    REQUIRE(status.ok());
  }
  CHECK(values_of(client.Pull(1, reader)) == range1);
  // A second worker's declaration is checked against the whole model at group 0.
  RegisterRequest differs = request;
  differs.set_worker_name("t1");
  differs.mutable_model()->mutable_tensors(1)->set_shape(0, kParameters / 3 + 1);
  RegisterResponse refused;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
  CHECK(cluster.stub().Register(&context, differs, &refused).error_code() ==
        grpc::StatusCode::FAILED_PRECONDITION);
  cluster.StopAll(true, [](const ChildProcess&, int) {});
}

TEST_CASE("range groups and group 0 refuse hostile and malformed calls precisely and change "
          "nothing") {
  Cluster cluster(ShardOptions("shard-bad", 2));
  {
    absl::Status started = cluster.StartServer(ServerConfigText(), kWorkerConfig);
    INFO(started << cluster.Logs(30, 8));
    REQUIRE(started.ok());
  }
  Client client(cluster);
  const RegisterResponse trainer = client.Register("t0", TRAINER);
  const RegisterResponse other = client.Register("t1", TRAINER);
  const RegisterResponse spare = client.Register("s0", SPARE);
  REQUIRE(trainer.range_addresses_size() == 2);
  CHECK(trainer.range_addresses(1) == cluster.group_address(1));
  const TensorBundle center1 = client.Pull(1, trainer).center();
  auto version1 = [&] { return client.Pull(1, spare).center_version(); };
  REQUIRE(version1() == 0);
  SyncRangeResponse reply;

  // Identity: no credential, another worker's credential, a spare that owns no slot.
  const SyncRangeRequest good = MakeSyncRange(trainer, 1, kSyncPeriod, center1, 0.5f);
  CHECK(client.SyncRange(1, good, "", &reply).error_code() == grpc::StatusCode::UNAUTHENTICATED);
  CHECK(client.SyncRange(1, good, other.credential(), &reply).error_code() ==
        grpc::StatusCode::UNAUTHENTICATED);
  SyncRangeRequest by_spare = good;
  by_spare.set_incarnation(spare.incarnation());
  CHECK(client.SyncRange(1, by_spare, spare.credential(), &reply).error_code() ==
        grpc::StatusCode::FAILED_PRECONDITION);
  // Malformed: another group's range, a step that is no sync point or skips one, a range of the
  // wrong size, a non-finite value, an extreme finite value (weighting.max_abs_value).
  SyncRangeRequest wrong_range = good;
  wrong_range.set_range(0);
  grpc::Status status = client.SyncRange(1, wrong_range, trainer.credential(), &reply);
  CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(absl::StrContains(status.error_message(), "holds range 1"));
  SyncRangeRequest skips = MakeSyncRange(trainer, 1, 2 * kSyncPeriod, center1, 0.5f);
  CHECK(client.SyncRange(1, skips, trainer.credential(), &reply).error_code() ==
        grpc::StatusCode::INVALID_ARGUMENT);
  SyncRangeRequest short_range = good;
  short_range.mutable_params()->mutable_tensors(0)->mutable_data()->resize(4);
  CHECK(client.SyncRange(1, short_range, trainer.credential(), &reply).error_code() ==
        grpc::StatusCode::INVALID_ARGUMENT);
  SyncRangeRequest nan = good;
  float* x = reinterpret_cast<float*>(nan.mutable_params()->mutable_tensors(0)->mutable_data()->data());
  x[3] = std::nanf("");
  CHECK(client.SyncRange(1, nan, trainer.credential(), &reply).error_code() ==
        grpc::StatusCode::INVALID_ARGUMENT);
  SyncRangeRequest extreme = good;
  x = reinterpret_cast<float*>(extreme.mutable_params()->mutable_tensors(0)->mutable_data()->data());
  x[0] = 3.0e38f;
  status = client.SyncRange(1, extreme, trainer.credential(), &reply);
  CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(absl::StrContains(status.error_message(), "max_abs_value"));
  CHECK(version1() == 0);
  // The three refused values (short, non-finite, extreme) were the trainer's fault: group 0
  // charged its slot for each, as for an unsharded Sync; nobody else was charged.
  {
    const GetStatusResponse charged = *cluster.GetStatus();
    REQUIRE(charged.slots_size() == 2);
    CHECK(charged.slots(0).refused_updates() == 3);
    CHECK(charged.slots(1).refused_updates() == 0);
  }
  // A worker cannot charge another's slot: RANGE_FAULT names the caller's own update only.
  {
    AuthorizeRangeRequest blame;
    blame.set_incarnation(other.incarnation());
    blame.set_access(RANGE_FAULT);
    *blame.mutable_slot() = trainer.slot();
    blame.set_range(1);
    blame.set_reason(std::string(1 << 20, 'x'));
    AuthorizeRangeResponse answer;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
    context.AddMetadata(kWorkerCredentialKey, other.credential());
    CHECK(cluster.stub().AuthorizeRange(&context, blame, &answer).error_code() ==
          grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(cluster.GetStatus()->slots(0).refused_updates() == 3);
  }

  // The sync itself, then the same again (a lost reply): answered from the kept snapshot.
  status = client.SyncRange(1, good, trainer.credential(), &reply);
  INFO(status.error_message());
  REQUIRE(status.ok());
  CHECK(reply.has_center_before());
  CHECK(reply.center_version() == 1);
  CHECK(reply.partial_sq_norm() > 0.0);
  SyncRangeResponse again;
  REQUIRE(client.SyncRange(1, good, trainer.credential(), &again).ok());
  CHECK(again.has_worker_params_after());
  CHECK(version1() == 1);
  // Group 0 has not committed step 20: the next step is refused by group 0's step rule.
  const SyncRangeRequest next = MakeSyncRange(trainer, 1, 2 * kSyncPeriod, center1, 0.5f);
  CHECK(client.SyncRange(1, next, trainer.credential(), &reply).error_code() ==
        grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(version1() == 1);
  // Range 1 holds the trainer's sync that range 0 has not got yet: no consistent center to
  // export. The export reads again until its deadline and says which slot and ranges differ.
  {
    ExportCenterResponse exported;
    grpc::Status status;
    std::atomic<bool> exported_done{false};
    std::thread exporter([&] {
      status = Export(cluster, "", &exported, absl::Seconds(3));
      exported_done = true;
    });
    // This test's workers send no heartbeats of their own: keep them alive meanwhile.
    while (!exported_done) {
      for (const RegisterResponse* worker : {&trainer, &other, &spare}) {
        HeartbeatRequest beat;
        beat.set_incarnation(worker->incarnation());
        HeartbeatResponse answer;
        grpc::ClientContext context;
        context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(2))));
        context.AddMetadata(kWorkerCredentialKey, worker->credential());
        cluster.stub().Heartbeat(&context, beat, &answer);
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    exporter.join();
    INFO(status.error_message());
    CHECK(status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
    CHECK(absl::StrContains(status.error_message(), "different updates of slot"));
    CHECK(absl::StrContains(status.error_message(), "range 1 its sync of step 20"));
  }

  // The commit: one result per range, each well-formed.
  CommitSyncRequest commit;
  commit.set_incarnation(trainer.incarnation());
  *commit.mutable_slot() = trainer.slot();
  commit.set_step(kSyncPeriod);
  for (int k = 0; k < 2; ++k) {
    RangeSyncResult* range = commit.add_ranges();
    range->set_range(k);
    range->set_center_version(1);
    range->set_partial_sq_norm(1.0);
  }
  CommitSyncResponse committed;
  // Range 0 has not applied step 20: group 0 refuses to commit it, whatever the trainer claims.
  status = client.Commit(commit, trainer.credential(), &committed);
  CHECK(status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(absl::StrContains(status.error_message(), "range 0 has not applied"));
  const TensorBundle center0 = client.Pull(0, trainer).center();
  REQUIRE(client.SyncRange(0, MakeSyncRange(trainer, 0, kSyncPeriod, center0, 0.5f),
                           trainer.credential(), &reply)
              .ok());
  CommitSyncRequest one_range = commit;
  one_range.mutable_ranges()->RemoveLast();
  CHECK(client.Commit(one_range, trainer.credential(), &committed).error_code() ==
        grpc::StatusCode::INVALID_ARGUMENT);
  CommitSyncRequest negative = commit;
  negative.mutable_ranges(1)->set_partial_sq_norm(-1.0);
  CHECK(client.Commit(negative, trainer.credential(), &committed).error_code() ==
        grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(client.Commit(commit, other.credential(), &committed).error_code() ==
        grpc::StatusCode::UNAUTHENTICATED);
  REQUIRE(client.Commit(commit, trainer.credential(), &committed).ok());
  CHECK_FALSE(committed.duplicate());
  REQUIRE(client.Commit(commit, trainer.credential(), &committed).ok());
  CHECK(committed.duplicate());
  const GetStatusResponse after = *cluster.GetStatus();
  CHECK(after.slots(0).update_count() == 1);
  CHECK(after.slots(0).snapshot_step() == kSyncPeriod);

  // Calls that belong elsewhere: Register at a range group, Sync and Pull at group 0.
  {
    std::unique_ptr<ParameterServer::Stub> range_group = ParameterServer::NewStub(
        grpc::CreateChannel(cluster.group_address(1), grpc::InsecureChannelCredentials()));
    RegisterRequest request;
    request.set_worker_name("lost");
    RegisterResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
    status = range_group->Register(&context, request, &response);
    CHECK(status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(absl::StrContains(status.error_message(), cluster.group_address(0)));
  }
  {
    SyncRequest request;
    request.set_incarnation(trainer.incarnation());
    *request.mutable_slot() = trainer.slot();
    request.set_step(2 * kSyncPeriod);
    SyncResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
    context.AddMetadata(kWorkerCredentialKey, trainer.credential());
    status = cluster.stub().Sync(&context, request, &response);
    CHECK(status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(absl::StrContains(status.error_message(), "sharded"));
  }
  // A snapshot the group does not hold.
  {
    ReadRangeSnapshotRequest request;
    request.set_incarnation(spare.incarnation());
    *request.mutable_slot() = trainer.slot();
    request.set_step(3 * kSyncPeriod);
    request.set_range(1);
    Snapshot response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
    context.AddMetadata(kWorkerCredentialKey, spare.credential());
    CHECK(RangeStub(cluster, 1)->ReadRangeSnapshot(&context, request, &response).error_code() ==
          grpc::StatusCode::NOT_FOUND);
  }
  // A fenced worker never writes again.
  {
    DeregisterRequest leave;
    leave.set_incarnation(trainer.incarnation());
    DeregisterResponse left;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
    context.AddMetadata(kWorkerCredentialKey, trainer.credential());
    REQUIRE(cluster.stub().Deregister(&context, leave, &left).ok());
  }
  CHECK(client.SyncRange(1, next, trainer.credential(), &reply).error_code() ==
        grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(version1() == 1);
  // ExportRange is group 0's call for its own range of a stage; ExportCenter is group 0's.
  {
    ExportRangeRequest request;
    request.set_stage(0);
    request.set_range(0);
    ExportRangeResponse response;
    CHECK(OperatorCall(cluster, 1, "", &CenterRange::Stub::ExportRange, request, &response)
              .error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    request.set_range(1);
    request.set_stage(1);
    CHECK(OperatorCall(cluster, 1, "", &CenterRange::Stub::ExportRange, request, &response)
              .error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    request.set_stage(0);
    REQUIRE(OperatorCall(cluster, 1, "", &CenterRange::Stub::ExportRange, request, &response)
                .ok());
    CHECK(response.center_version() == 1);
    REQUIRE(response.applied_steps_size() == kReplicas);
    CHECK(response.applied_steps(trainer.slot().replica()) == kSyncPeriod);
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        MakeChannel(cluster.group_address(1), SecurityConfig(), grpc::ChannelArguments());
    REQUIRE(channel.ok());
    ExportCenterResponse exported;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + Scaled(absl::Seconds(10))));
    const grpc::Status status =
        ParameterServer::NewStub(*channel)->ExportCenter(&context, ExportCenterRequest(), &exported);
    CHECK(status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(absl::StrContains(status.error_message(), "group 0"));
  }
  cluster.StopAll(true, [](const ChildProcess&, int) {});
}

}  // namespace
}  // namespace rebound::testing
