#include "tests/chaos/chaos.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/file.h"
#include "common/security.h"
#include "common/status_macros.h"
#include "compute/cpu/cpu_backend.h"
#include "compute/model_layout.h"
#include "compute/shard_ranges.h"
#include "compute/step.h"
#include "compute/tensor_bundle.h"
#include "google/protobuf/text_format.h"
#include "grpcpp/grpcpp.h"
#include "proto/rebound.grpc.pb.h"
#include "proto/replication.grpc.pb.h"
#include "proto/sharding.grpc.pb.h"
#include "storage/durable_store.h"
#include "testing/cluster/cluster.h"
#include "testing/cluster/network.h"
#include "testing/cluster/processes.h"
#include "testing/etcd/etcd_process.h"
#include "worker/data/fashion_mnist.h"
#include "worker/slot_compute.h"

namespace rebound::chaos {
namespace {

// The harness's processes, partitions and log tails are the testing/cluster library's.
using ::rebound::testing::Cluster;
using ::rebound::testing::ClusterOptions;
using ::rebound::testing::LastLines;
using ::rebound::testing::NetworkLab;
using ::rebound::testing::ProcessFirewall;
using ::rebound::testing::ServerStart;
using ::rebound::testing::StartServerProcess;
using ::rebound::testing::WaitForPortFile;

constexpr absl::Duration kPoll = absl::Milliseconds(50);
constexpr absl::Duration kRpcDeadline = absl::Seconds(1);
constexpr absl::Duration kStartWait = absl::Seconds(90);   // every slot ACTIVE at the start
constexpr absl::Duration kPortWait = absl::Seconds(30);    // a (re)started server listening
constexpr absl::Duration kKillWait = absl::Seconds(10);    // a SIGKILLed process reaped
constexpr absl::Duration kTargetWait = absl::Seconds(20);  // a fault waiting for a target
constexpr absl::Duration kExitWait = absl::Seconds(30);    // workers after the job's end
constexpr absl::Duration kServerStopWait = absl::Seconds(20);
// Group mode: a group fault waits this long for the group to be whole again (a leader's restart,
// a standby's catch-up) before it is skipped.
constexpr absl::Duration kGroupTargetWait = absl::Seconds(60);
constexpr absl::Duration kGroupStartWait = absl::Seconds(60);  // a leader, its standbys in sync
constexpr absl::Duration kInSyncWait = absl::Seconds(60);      // the whole group at the end
constexpr absl::Duration kPeerPoll = absl::Milliseconds(250);  // every member's GetGroup
constexpr absl::Duration kAckCheckEvery = absl::Seconds(3);    // leader vs the trainers' answers
// A resumed leader fences itself within 50 ms, shuts its port (up to 5 s) and runs again.
constexpr absl::Duration kFenceCheckWait = absl::Seconds(15);
constexpr double kAccuracyTolerance = 0.01;  // 1 point
constexpr int kExitFenced = 3;
constexpr int kExitUnreachable = 4;
constexpr int kKilledBySigkill = 128 + SIGKILL;
constexpr char kJobId[] = "chaos";

// ---------------------------------------------------------------------------------------------
// Fault kinds and the schedule

struct KindInfo {
  FaultKind kind;
  const char* name;
  int weight;  // how often PlanFaults draws it, relative to the others
};

constexpr KindInfo kKinds[] = {
    {FaultKind::kKillTrainer, "kill_trainer", 4},
    {FaultKind::kStopTrainer, "stop_trainer", 3},
    {FaultKind::kKillSpare, "kill_spare", 1},
    {FaultKind::kStopSpare, "stop_spare", 1},
    {FaultKind::kKillEvaluator, "kill_evaluator", 1},
    {FaultKind::kStopEvaluator, "stop_evaluator", 1},
    {FaultKind::kKillServer, "kill_server", 2},
    {FaultKind::kStopServer, "stop_server", 1},
    {FaultKind::kPartition, "partition", 3},
    {FaultKind::kThrottle, "throttle", 1},
    {FaultKind::kDelay, "delay", 1},
    {FaultKind::kLoss, "loss", 1},
    {FaultKind::kByzantine, "byzantine", 1},
    {FaultKind::kKillLeader, "kill_leader", 2},
    {FaultKind::kLeaderDiskLoss, "leader_disk_loss", 1},
    {FaultKind::kStopLeader, "stop_leader", 1},
    {FaultKind::kKillEtcdMember, "kill_etcd_member", 1},
    {FaultKind::kKillAllEtcd, "kill_all_etcd", 1},
    {FaultKind::kRestartStandbyEmpty, "restart_standby_empty", 1},
    {FaultKind::kDieBetweenRanges, "die_between_ranges", 2},
    {FaultKind::kPartitionLeaderFromEtcd, "partition_leader_from_etcd", 2},
    {FaultKind::kPartitionStandby, "partition_standby", 2},
    {FaultKind::kSilentCorruption, "silent_corruption", 1},
};

const KindInfo& Info(FaultKind kind) {
  for (const KindInfo& info : kKinds) {
    if (info.kind == kind) return info;
  }
  return kKinds[0];
}

std::string Seconds(absl::Duration d) {
  return absl::StrFormat("%.1f s", absl::ToDoubleSeconds(d));
}

bool SameBytes(const TensorBundle& a, const TensorBundle& b) {
  if (a.tensors_size() != b.tensors_size()) return false;
  for (int i = 0; i < a.tensors_size(); ++i) {
    if (a.tensors(i).data() != b.tensors(i).data()) return false;
  }
  return true;
}

bool AllFinished(const GetStatusResponse& s) {
  for (const SlotStatus& slot : s.slots()) {
    if (slot.state() != FINISHED) return false;
  }
  return s.slots_size() > 0;
}

// A channel that notices a server come back quickly (the harness polls every 50 ms).
std::shared_ptr<grpc::Channel> FastChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 300);
  args.SetMaxReceiveMessageSize(-1);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

int64_t CenterVersion(const GetStatusResponse& status) {
  return status.centers_size() > 0 ? status.centers(0).version() : 0;
}

// The last `count` lines of the file at `path` that contain one of `words`, each indented.
std::string LinesMentioning(const std::string& path, const std::vector<std::string>& words,
                            size_t count) {
  std::vector<std::string> found;
  for (absl::string_view line : absl::StrSplit(ReadFileOrEmpty(path), '\n')) {
    for (const std::string& word : words) {
      if (absl::StrContains(line, word)) {
        found.push_back(absl::StrCat("    ", line, "\n"));
        break;
      }
    }
  }
  if (found.size() > count) found.erase(found.begin(), found.end() - count);
  return absl::StrJoin(found, "");
}

// The number after `prefix` in `line`, if there is one.
std::optional<int64_t> NumberAfter(absl::string_view line, absl::string_view prefix) {
  const size_t at = line.find(prefix);
  if (at == absl::string_view::npos) return std::nullopt;
  absl::string_view rest = line.substr(at + prefix.size());
  size_t end = 0;
  while (end < rest.size() && (std::isdigit(static_cast<unsigned char>(rest[end])) ||
                               (end == 0 && rest[end] == '-'))) {
    ++end;
  }
  int64_t value = 0;
  if (!absl::SimpleAtoi(rest.substr(0, end), &value)) return std::nullopt;
  return value;
}

// The test accuracy of `center` (chaos jobs have one stage), computed as the evaluator computes
// it (worker/evaluator.cc), with the trainer options every worker uses.
absl::StatusOr<double> TestAccuracy(const JobConfig& job, const TensorBundle& center) {
  ASSIGN_OR_RETURN(worker::FashionMnist data, worker::LoadFashionMnist(job.data()));
  ASSIGN_OR_RETURN(std::unique_ptr<compute::Backend> backend,
                   compute::CreateCpuBackend(job.compute().threads()));
  ASSIGN_OR_RETURN(std::unique_ptr<compute::LocalTrainer> model,
                   compute::LocalTrainer::Create(backend.get(),
                                                 worker::TrainerOptionsFor(job, SlotId())));
  const compute::StageLayout& layout = model->stage(0).layout();
  RETURN_IF_ERROR(compute::ValidateBundle(layout, center, "center"));
  RETURN_IF_ERROR(model->stage(0).SetParams(compute::PackedFromBundle(layout, center)));
  const std::vector<int32_t> labels(data.test.labels.begin(), data.test.labels.end());
  ASSIGN_OR_RETURN(compute::EvalResult result, model->Evaluate(data.test.images, labels));
  return result.accuracy;
}

// ---------------------------------------------------------------------------------------------
// One run

// The faults a trainer is started with (its testing-only flags, worker/main.cc).
struct TrainerFaults {
  int64_t poison_from_step = 0;  // byzantine: it poisons its syncs from this step
  int64_t flip_at_step = 0;      // silent_corruption: it flips a bit after this step
  int64_t flip_every = 0;        // ... and every this many steps after it
  int64_t die_at_step = 0;       // die_between_ranges: it dies in its sync of this step
  int die_ranges = 0;            // ... after syncing ranges [0, die_ranges)
};

// A worker process of the run. Its name is unique in the run and is what the server reports.
struct Worker {
  std::string name;
  std::string role;  // the --role it was started with: trainer, spare or evaluator
  std::unique_ptr<ChildProcess> process;
  int host = -1;             // its NetworkLab host, -1: the harness's namespace
  bool killed = false;       // SIGKILLed by the harness: exit 137 expected
  bool faulted = false;      // stopped or its link faulted right now: left alone by other faults
  bool was_faulted = false;  // ever stopped or its link cut (a fenced exit is then expected)
  TrainerFaults faults;  // the faults it was started with
  std::optional<int> exit_code;
};

class ChaosRun {
 public:
  ChaosRun(const ChaosJob& spec, const ChaosOptions& options)
      : spec_(spec),
        options_(options),
        job_(MakeChaosJob(spec)),
        rounds_(spec.max_steps / spec.sync_period) {}

  RunReport Execute(const RunReport* reference);

 private:
  enum class Fired { kDone, kNoTarget };

  void Log(const std::string& line) const {
    if (options_.log) {
      options_.log(
          absl::StrFormat("[%6.1f s] %s", absl::ToDoubleSeconds(absl::Now() - start_), line));
    }
  }
  void Violation(const std::string& what) {
    report_.violations.push_back(what);
    Log("VIOLATION: " + what);
  }
  void Error(const std::string& what) {
    report_.errors.push_back(what);
    Log("ERROR: " + what);
  }
  void Note(const std::string& what) {
    report_.notes.push_back(what);
    Log("note: " + what);
  }

  // Group mode: every server group is replicated (a leader and standbys, etcd).
  bool replicated() const { return options_.standbys > 0; }
  // Sharded mode: the center split across K server groups.
  bool sharded() const { return options_.shard_groups > 1; }
  // The servers are testing/cluster's Cluster's members (group or sharded mode), not the
  // harness's own single server.
  bool clustered() const { return replicated() || sharded(); }
  int shard_groups() const { return std::max(1, options_.shard_groups); }

  absl::Status Setup();
  absl::Status WriteConfigs();
  absl::Status StartServer();
  // Group or sharded mode: etcd (group mode) and the members (testing/cluster's Cluster), then
  // every group ready (group mode: a leader with every standby in sync).
  absl::Status StartCluster();
  absl::Status StartWorker(const std::string& name, const std::string& role,
                           const TrainerFaults& faults = {});
  absl::Status Replace(const Worker& gone);
  void Loop();
  void RunDuePending(bool all);
  void ReapWorkers();
  void ReapServer();
  void Observe(const GetStatusResponse& status);
  // Sharded mode: the range groups' GetStatus (their leaders'), every kPeerPoll.
  void PollRangeGroups();
  absl::StatusOr<Fired> Fire(const PlannedFault& fault, const GetStatusResponse& status);
  // Once the restarted server (life `life`) has waited reconnect_grace + failure_timeout: each
  // trainer that owned an ACTIVE slot at the kill, and was left alone since, must have come
  // back under its incarnation (Observe saw it heartbeat), unless its slot finished.
  // `epoch` (group mode): the leader's the trainers had to reconnect to; 0 for one server.
  void CheckReconnected(int life, int64_t epoch = 0);
  // The trainers a restarted group 0 (or its new leader) should find again: the owners of the
  // ACTIVE slots in `before`, its last status.
  void AwaitReconnect(const GetStatusResponse& before);
  void FinishAndCheck();
  void CheckRecoveries();
  // silent_corruption: the audits' verdicts in `status` (false reports are violations) and,
  // after the run, that every flip was reported or excused.
  void ObserveAudits(const GetStatusResponse& status);
  void CheckCorruptions();
  // Exactly once in the store of `data_dir` (opened once its server stopped), a server of group
  // g's (0 unless sharded); `whose` names it in violations. Returns its center (sharded: its
  // range), if it has one.
  std::optional<TensorBundle> CheckStore(const std::string& data_dir, const std::string& whose,
                                         int g);
  // Stops the server (SIGTERM) and checks its store.
  void StopServerAndCheckStore();
  // Stops every member (the standbys first, then the leaders) and checks each group's final
  // leader's store and the store of every member in sync in its group's `final_statuses` entry.
  void StopClusterAndCheckStores(const std::vector<GetStatusResponse>& final_statuses);
  // Sharded mode: the whole center gathered from the ranges (PullRange at each group's leader,
  // with the observer's credential) into report_.center; each range's answer is kept in
  // range_centers_. False (with an error) when a range cannot be read.
  bool GatherCenter(const RegisterResponse& observer);
  void Cleanup();

  // The status of the server, or of group 0's leader (the coordinator's).
  std::optional<GetStatusResponse> Status(absl::Duration deadline = kRpcDeadline);
  // The stub of the server, or of group 0's current leader.
  ParameterServer::Stub* ServerStub();

  // Group and sharded mode.
  absl::StatusOr<Fired> FireGroupFault(const PlannedFault& fault, const GetStatusResponse& status,
                                       const std::string& at);
  // Sharded mode without standbys: kill_server and stop_server on a drawn group's server.
  absl::StatusOr<Fired> FireShardServerFault(const PlannedFault& fault, const std::string& at);
  // The GetStatus of group g's leader: the member that answered last first, then the others;
  // answers of a deposed leader (an epoch below the highest seen) are passed over. Without
  // standbys, the group's one server.
  std::optional<GetStatusResponse> LeaderStatus(int g, absl::Duration deadline);
  std::optional<GetStatusResponse> MemberStatus(int member, absl::Duration deadline);
  // A member (by name) of group g reported LEADER in `epoch`: no other may have for that epoch.
  void NoteLeader(int g, int64_t epoch, const std::string& name, const std::string& how);
  // Member `member` answered as the leader of an epoch above every one its group saw before.
  void OnNewLeader(int member, const GetStatusResponse& status);
  // Every member's ServerPeer.GetGroup (its peer port re-read from its port file), every
  // kPeerPoll.
  void PollPeers();
  // Group g: a leader, every standby recorded in sync and connected, every member and etcd
  // member up, no group fault pending on it.
  bool GroupWhole(int g, const GetStatusResponse& status) const;
  // Every group whole (LeaderStatus of each).
  bool AllGroupsWhole();
  // Reads what the trainers' logs say was answered to them since the last call.
  void ReadAcknowledged();
  // The sum over slots of the syncs answered to their trainers: a lower bound of every range's
  // version (each range applied each of them once).
  int64_t AcknowledgedSyncs() const;
  // The leader `member` of its group (GetStatus after ReadAcknowledged) is at or past every
  // answer.
  void CheckAcknowledged(int member, const std::string& when);
  // A stopped leader resumed at log offset `offset`: it must have fenced itself.
  void CheckFenced(int member, int64_t offset, int64_t epoch, absl::Time deadline);
  // CheckFenced within kFenceCheckWait from now, as a pending action.
  void CheckFencedSoon(int member, int64_t offset, int64_t epoch);
  // The standby of `group` (led by `leader`) that `pick` draws.
  static int PickStandby(const std::vector<int>& members, int leader, uint32_t pick);
  // The last lines of the server's log, or of every member's.
  std::string ServerLogs(size_t lines) const;
  double Progress(const GetStatusResponse& status) const;
  Worker* FindByName(const std::string& name);
  // Targets of a worker fault, in name order.
  std::vector<Worker*> Trainers(const GetStatusResponse& status, bool networked);
  std::vector<Worker*> Spares(const GetStatusResponse& status);
  std::vector<Worker*> Evaluators();
  void AddPending(absl::Duration after, std::string what, std::function<void()> action);

  const ChaosJob& spec_;
  const ChaosOptions& options_;
  const JobConfig job_;
  const int64_t rounds_;
  RunReport report_;
  absl::Time start_;
  absl::Time deadline_;
  std::string dir_;
  std::string server_config_;  // the texts WriteConfigs wrote
  std::string worker_config_;
  std::unique_ptr<NetworkLab> lab_;

  std::string server_host_ = "127.0.0.1";
  int port_ = 0;
  std::string address_;
  std::unique_ptr<ChildProcess> server_;
  bool server_down_ = false;         // SIGKILLed, its restart pending
  bool server_stopped_ = false;      // SIGSTOPped
  bool server_faulted_ = false;      // ever stopped or killed
  absl::Duration last_server_stop_;  // how long the last SIGSTOP of the server lasted
  absl::Time last_server_resume_;    // and when it ended
  int server_life_ = 0;
  std::unique_ptr<ParameterServer::Stub> stub_;
  // The last status before a server kill: the restarted server must not be behind it.
  std::optional<GetStatusResponse> before_kill_;
  int before_kill_life_ = 0;
  // The trainers that owned an ACTIVE slot at the last server kill and have not been seen back
  // yet, by incarnation.
  struct Awaited {
    int replica = 0;
    std::string name;
    std::optional<int64_t> first_beat_ms;  // its last heartbeat as first seen, ms after start
  };
  std::map<uint64_t, Awaited> awaiting_reconnect_;

  // Group mode: the Cluster owns etcd and the members; the harness talks to each member itself.
  std::unique_ptr<Cluster> cluster_;
  // Where the run's kinds name a firewall kind and the machine permits it: every member runs in
  // a firewall group of its own (testing/cluster/firewall.h). Destroyed after cluster_.
  std::unique_ptr<ProcessFirewall> firewall_;
  struct Member {
    std::string name;
    int group = 0;        // its server group (sharded mode; 0 otherwise)
    std::string address;  // its workers' port (open only while it leads)
    std::unique_ptr<ParameterServer::Stub> stub;
    std::unique_ptr<CenterRange::Stub> range;  // sharded mode, on the same channel
    int peer_port = 0;
    std::unique_ptr<ServerPeer::Stub> peer;
    bool down = false;     // SIGKILLed, its restart pending
    bool stopped = false;  // SIGSTOPped
    GroupStatus::Role last_role = GroupStatus::ROLE_UNSPECIFIED;
  };
  std::vector<Member> members_;
  // A server group: its members (one without standbys) and who leads it.
  struct ServerGroup {
    std::vector<int> members;  // indices into members_
    int leader = -1;     // the member that answered as the leader last
    int64_t epoch = 0;   // the highest epoch a leader answered GetStatus in
    // The highest epoch any member named (as its own, leading, or as its leader's): a member
    // that answers as the leader of a lower one has been deposed, whatever it says.
    int64_t max_epoch_seen = 0;
    std::map<int64_t, std::string> leader_of_epoch;  // every member reported LEADER, by epoch
    bool fault_pending = false;  // a group fault's restart or resume is pending
    // A group fault that may move the leadership fired (a leader killed or stopped, etcd lost):
    // the next leader change is its effect, not news.
    bool leader_change_expected = false;
    std::optional<GetStatusResponse> last_leader_status;  // the latest, of the current epoch
    absl::Time last_ack_check;
    // Sharded mode without standbys, a range group's server killed: its status before the kill,
    // which its first answer after the restart must not be behind.
    std::optional<GetStatusResponse> before_kill;
  };
  std::vector<ServerGroup> groups_;  // by group index: one unless sharded
  std::vector<bool> etcd_down_;
  bool etcd_fault_pending_ = false;  // an etcd fault's restart is pending
  // One etcd member is down (kill_etcd_member): a leader change now breaks §10.1's promise.
  std::optional<std::string> etcd_member_fault_;
  absl::Time etcd_member_fault_until_;  // ... and for a lease after its restart
  absl::Time last_peer_poll_;
  absl::Time last_range_poll_;
  // Sharded mode: each range as PullRange answered it at the end, by group.
  std::vector<PullRangeResponse> range_centers_;
  // What the trainers' logs say was answered to them: per log, how far it was read and the slot
  // its worker trains; per slot, the last answered sync's step; the highest center version.
  struct AckLog {
    int64_t offset = 0;
    int replica = -1;
  };
  std::map<std::string, AckLog> ack_logs_;  // by log path
  std::map<int, int64_t> acked_step_;       // by replica
  int64_t acked_version_ = 0;               // unsharded: the highest center version answered
  std::set<std::string> reported_;  // violations found by polling, each reported once
  // An answered sync is gone from the leader: the job cannot end as the fault-free run does
  // (it may not end at all), so the run stops there.
  bool acknowledged_lost_ = false;
  // Cleanup runs what is pending at once: the checks among it did not get their time.
  bool cleaning_up_ = false;

  std::vector<std::unique_ptr<Worker>> workers_;
  std::set<int> byzantine_announced_;  // trainers whose byzantine fault has fired
  // silent_corruption: each corrupted trainer's flip, by name: its step, its slot (trainer-<i>
  // starts in slot i) and the server faults fired before it; whether it was reported.
  struct Flip {
    int64_t step = 0;
    int replica = 0;
    int server_faults_before = 0;
    bool reported = false;
    bool synced = false;  // the trainer synced past the flip: the corruption reached the job
  };
  std::map<std::string, Flip> flips_;
  int server_faults_ = 0;  // kill_server, stop_server and the group kinds fired so far
  std::set<std::pair<int, uint64_t>> audit_verdicts_;  // (server life, audit id) seen
  std::set<int> die_announced_;        // trainers whose die_between_ranges fault has fired
  int next_spare_ = 0;
  int next_evaluator_ = 0;
  int replacement_budget_ = 0;
  bool job_finished_ = false;

  struct Pending {
    absl::Time at;
    std::string what;
    std::function<void()> action;
  };
  std::vector<Pending> pending_;
  struct FaultState {
    bool done = false;                        // injected, skipped, or failed to inject
    std::optional<absl::Time> waiting_since;  // due, but its target was busy
  };
  std::vector<FaultState> fault_states_;  // one per planned fault
  // Every recovery seen, by (server life, task id): task ids restart with each server life.
  std::map<std::pair<int, uint64_t>, RecoveryStatus> recoveries_;
};

ParameterServer::Stub* ChaosRun::ServerStub() {
  if (!clustered()) return stub_.get();
  return groups_[0].leader >= 0 ? members_[groups_[0].leader].stub.get() : nullptr;
}

std::optional<GetStatusResponse> ChaosRun::Status(absl::Duration deadline) {
  if (clustered()) return LeaderStatus(0, deadline);
  if (stub_ == nullptr || server_down_ || server_stopped_) return std::nullopt;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  GetStatusResponse response;
  if (!stub_->GetStatus(&context, GetStatusRequest(), &response).ok()) return std::nullopt;
  return response;
}

double ChaosRun::Progress(const GetStatusResponse& status) const {
  if (status.slots_size() == 0) return 0;
  double sum = 0;
  for (const SlotStatus& slot : status.slots()) {
    sum += std::min<int64_t>(slot.step(), spec_.max_steps);
  }
  return sum / status.slots_size() / static_cast<double>(spec_.max_steps);
}

Worker* ChaosRun::FindByName(const std::string& name) {
  for (auto& w : workers_) {
    if (w->name == name) return w.get();
  }
  return nullptr;
}

std::vector<Worker*> ChaosRun::Trainers(const GetStatusResponse& status, bool networked) {
  std::vector<Worker*> out;
  for (const SlotStatus& slot : status.slots()) {
    if (slot.state() != ACTIVE || slot.owner_incarnation() == 0) continue;
    for (const WorkerStatus& w : status.workers()) {
      if (w.incarnation() != slot.owner_incarnation() || w.state() != ALIVE) continue;
      Worker* worker = FindByName(w.name());
      if (worker == nullptr || worker->exit_code.has_value() || worker->killed || worker->faulted ||
          (networked && worker->host < 0)) {
        continue;
      }
      out.push_back(worker);
    }
  }
  std::sort(out.begin(), out.end(), [](Worker* a, Worker* b) { return a->name < b->name; });
  return out;
}

std::vector<Worker*> ChaosRun::Spares(const GetStatusResponse& status) {
  std::set<std::string> names;
  for (const WorkerStatus& w : status.workers()) {
    if (w.role() == SPARE && w.state() == ALIVE) names.insert(w.name());
  }
  std::vector<Worker*> out;
  for (const std::string& name : names) {
    Worker* worker = FindByName(name);
    if (worker != nullptr && !worker->exit_code.has_value() && !worker->killed &&
        !worker->faulted && worker->role == "spare") {
      out.push_back(worker);
    }
  }
  return out;
}

std::vector<Worker*> ChaosRun::Evaluators() {
  std::vector<Worker*> out;
  for (auto& w : workers_) {
    if (w->role == "evaluator" && !w->exit_code.has_value() && !w->killed && !w->faulted) {
      out.push_back(w.get());
    }
  }
  return out;
}

void ChaosRun::AddPending(absl::Duration after, std::string what, std::function<void()> action) {
  pending_.push_back({absl::Now() + after, std::move(what), std::move(action)});
}

std::string ChaosRun::ServerLogs(size_t lines) const {
  if (!clustered()) return LastLines(dir_ + "/server.log", lines);
  std::string out;
  for (size_t i = 0; i < members_.size(); ++i) {
    absl::StrAppend(&out, "  --- ", members_[i].name, ".log\n",
                    LastLines(cluster_->member(static_cast<int>(i)).log_path(), lines));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Group mode: the members, who leads, and what the trainers were answered

void ChaosRun::NoteLeader(int g, int64_t epoch, const std::string& name,
                          const std::string& how) {
  ServerGroup& group = groups_[g];
  group.max_epoch_seen = std::max(group.max_epoch_seen, epoch);
  auto [it, inserted] = group.leader_of_epoch.emplace(epoch, name);
  if (inserted || it->second == name) return;
  if (reported_.insert(absl::StrCat("epoch ", epoch, " ", name)).second) {
    Violation(absl::StrCat(name, " reported LEADER in epoch ", epoch, " (", how, "), and so did ",
                           it->second, ": two leaders of one epoch"));
  }
}

std::optional<GetStatusResponse> ChaosRun::MemberStatus(int member, absl::Duration deadline) {
  Member& m = members_[member];
  if (m.down || m.stopped) return std::nullopt;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  GetStatusResponse response;
  if (!m.stub->GetStatus(&context, GetStatusRequest(), &response).ok()) return std::nullopt;
  if (!replicated()) return response;  // a group of one server: it is the group
  if (response.group().role() != GroupStatus::LEADER) return std::nullopt;
  NoteLeader(m.group, response.group().epoch(), response.group().name(), "GetStatus");
  if (response.group().name() != m.name) {
    Error(absl::StrCat("the workers' port of ", m.name, " (", m.address, ") is served by '",
                       response.group().name(), "'"));
    return std::nullopt;
  }
  return response;
}

std::optional<GetStatusResponse> ChaosRun::LeaderStatus(int g, absl::Duration deadline) {
  if (replicated() && absl::Now() - last_peer_poll_ >= kPeerPoll) PollPeers();
  ServerGroup& group = groups_[g];
  std::vector<int> order;
  if (group.leader >= 0) order.push_back(group.leader);
  for (int i : group.members) {
    if (i != group.leader) order.push_back(i);
  }
  for (int i : order) {
    std::optional<GetStatusResponse> status = MemberStatus(i, deadline);
    // A deposed leader may answer for a moment before it fences itself: not the group's state.
    if (!status.has_value() ||
        status->group().epoch() < std::max(group.epoch, group.max_epoch_seen)) {
      continue;
    }
    if (status->group().epoch() > group.epoch) OnNewLeader(i, *status);
    group.leader = i;
    group.last_leader_status = *status;
    if (absl::Now() - group.last_ack_check >= kAckCheckEvery) CheckAcknowledged(i, "");
    return status;
  }
  return std::nullopt;
}

void ChaosRun::OnNewLeader(int member, const GetStatusResponse& status) {
  const int g = members_[member].group;
  ServerGroup& group = groups_[g];
  const int64_t previous = group.epoch;
  group.epoch = status.group().epoch();
  const std::string& name = members_[member].name;
  const std::string of_group = sharded() ? absl::StrCat(" (group ", g, ")") : "";
  if (previous == 0) {
    Log(absl::StrCat(name, " leads", of_group, " in epoch ", group.epoch));
    group.leader = member;
    return;
  }
  ++report_.leader_changes;
  const int old_leader = group.leader;
  Log(absl::StrCat(name, " leads", of_group, " in epoch ", group.epoch, " (",
                   old_leader >= 0 ? members_[old_leader].name : std::string("?"), " led epoch ",
                   previous, "); center version ", CenterVersion(status), ", before ",
                   group.last_leader_status.has_value() ? CenterVersion(*group.last_leader_status)
                                                        : 0));
  if (etcd_member_fault_.has_value() && absl::Now() < etcd_member_fault_until_) {
    std::string evidence;
    if (old_leader >= 0 && old_leader != member) {
      evidence = LinesMentioning(cluster_->member(old_leader).log_path(),
                                 {"lease", "KeepAlive", "no longer acknowledging"}, 6);
    }
    // etcd's own account of its raft leadership (which member led, how long its election took).
    for (int i = 0; i < cluster_->etcd()->size(); ++i) {
      absl::StrAppend(&evidence, "  etcd member ", i, " (", cluster_->etcd()->client_endpoint(i),
                      "):\n",
                      LinesMentioning(cluster_->etcd()->log_path(i),
                                      {"elected leader", "lost leader", "became leader",
                                       "starting a new election", "became candidate"},
                                      4));
    }
    Violation(absl::StrCat("the leader", of_group, " changed (epoch ", previous, " -> ",
                           group.epoch, ", now ", name, ") while ", *etcd_member_fault_,
                           ": a group survives the loss of one etcd member of three (docs/design.md "
                           "§10.1); the deposed leader ",
                           old_leader >= 0 ? members_[old_leader].name : std::string("?"),
                           "'s log about its lease:\n", evidence));
  } else if (!group.leader_change_expected) {
    Note(absl::StrCat("the leader", of_group, " changed (epoch ", previous, " -> ", group.epoch,
                      ") with no fault against the leader or etcd"));
  }
  group.leader_change_expected = false;
  if (g == 0) {
    // The new leader loads its store as a restarted server does: the trainers that owned ACTIVE
    // slots under the old one must come back under their incarnations. (Workers talk to group
    // 0 only: a range group's new leader has no trainers to find again.)
    ++server_life_;
    awaiting_reconnect_.clear();
    if (group.last_leader_status.has_value()) AwaitReconnect(*group.last_leader_status);
    before_kill_life_ = server_life_ - 1;
    const int life = server_life_;
    const int64_t epoch = group.epoch;
    AddPending(absl::Milliseconds(spec_.reconnect_grace_ms + spec_.failure_timeout_ms + 1000),
               absl::StrCat("check that the trainers reconnected to ", name),
               [this, life, epoch] { CheckReconnected(life, epoch); });
  }
  group.last_leader_status.reset();
  CheckAcknowledged(member, absl::StrCat("as it took over in epoch ", group.epoch));
}

void ChaosRun::PollPeers() {
  last_peer_poll_ = absl::Now();
  for (size_t i = 0; i < members_.size(); ++i) {
    Member& m = members_[i];
    if (m.down || m.stopped) continue;
    const std::optional<int> port = ReadPortFile(absl::StrCat(dir_, "/peer-port-", i));
    if (!port.has_value()) continue;
    if (m.peer == nullptr || *port != m.peer_port) {
      m.peer_port = *port;
      m.peer = ServerPeer::NewStub(FastChannel(absl::StrCat(server_host_, ":", *port)));
    }
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(500)));
    rebound::GroupStatus view;
    if (!m.peer->GetGroup(&context, GetGroupRequest(), &view).ok()) continue;
    ServerGroup& group = groups_[m.group];
    group.max_epoch_seen = std::max(group.max_epoch_seen, view.epoch());
    if (view.role() == GroupStatus::LEADER) {
      NoteLeader(m.group, view.epoch(), view.name(), "ServerPeer.GetGroup");
    }
    // A member running again answers for a moment before it knows its role: not worth a line.
    if (view.role() != m.last_role && view.role() != GroupStatus::ROLE_UNSPECIFIED) {
      m.last_role = view.role();
      Log(absl::StrCat(m.name, " is ", GroupStatus::Role_Name(view.role()),
                       view.role() == GroupStatus::LEADER
                           ? absl::StrCat(" in epoch ", view.epoch())
                           : absl::StrCat(" (leader '", view.leader_name(), "', epoch ",
                                          view.epoch(), ")")));
    }
  }
}

bool ChaosRun::GroupWhole(int g, const GetStatusResponse& status) const {
  const ServerGroup& group = groups_[g];
  if (group.fault_pending || etcd_fault_pending_) return false;
  for (int i : group.members) {
    if (members_[i].down || members_[i].stopped) return false;
  }
  for (bool down : etcd_down_) {
    if (down) return false;
  }
  if (!replicated()) return true;
  const rebound::GroupStatus& view = status.group();
  if (view.role() != GroupStatus::LEADER ||
      view.in_sync_size() != static_cast<int>(group.members.size()) ||
      view.standbys_size() != options_.standbys) {
    return false;
  }
  for (const StandbyStatus& standby : view.standbys()) {
    if (!standby.in_sync()) return false;
  }
  return true;
}

bool ChaosRun::AllGroupsWhole() {
  for (int g = 0; g < shard_groups(); ++g) {
    const std::optional<GetStatusResponse> status = LeaderStatus(g, kRpcDeadline);
    if (!status.has_value() || !GroupWhole(g, *status)) return false;
  }
  return true;
}

void ChaosRun::ReadAcknowledged() {
  for (const auto& w : workers_) {
    if (w->role == "evaluator") continue;
    AckLog& log = ack_logs_[w->process->log_path()];
    std::ifstream in(w->process->log_path(), std::ios::binary);
    if (!in) continue;
    in.seekg(log.offset);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t complete = text.rfind('\n');
    if (complete == std::string::npos) continue;
    log.offset += static_cast<int64_t>(complete + 1);
    for (absl::string_view line : absl::StrSplit(absl::string_view(text).substr(0, complete), '\n')) {
      if (std::optional<int64_t> replica = NumberAfter(line, "] training slot (")) {
        log.replica = static_cast<int>(*replica);
        continue;
      }
      // "synced step T loss ... center version V", logged once the sync is acknowledged: a
      // sharded job's once group 0 committed the step (every range had applied it), with range
      // 0's version.
      const std::optional<int64_t> step = NumberAfter(line, "] synced step ");
      if (!step.has_value()) continue;
      const std::optional<int64_t> version = NumberAfter(line, " center version ");
      if (!version.has_value()) continue;
      if (!sharded()) acked_version_ = std::max(acked_version_, *version);
      ++report_.acknowledged_syncs;
      if (log.replica >= 0) {
        int64_t& acked = acked_step_[log.replica];
        acked = std::max(acked, *step);
      }
    }
  }
}

int64_t ChaosRun::AcknowledgedSyncs() const {
  int64_t syncs = 0;
  for (const auto& [replica, step] : acked_step_) syncs += step / spec_.sync_period;
  return syncs;
}

void ChaosRun::CheckAcknowledged(int member, const std::string& when) {
  // The answers first, then the leader's state: whatever was answered before the read is in it.
  const int g = members_[member].group;
  ServerGroup& group = groups_[g];
  ReadAcknowledged();
  group.last_ack_check = absl::Now();
  const std::optional<GetStatusResponse> status = MemberStatus(member, kRpcDeadline);
  if (!status.has_value() || status->group().epoch() < group.epoch) return;  // the next check
  // The center (unsharded) must be at or past the highest version answered; every range
  // (sharded) at or past the syncs answered, summed over slots; group 0's slots at or past
  // their answered steps.
  const int64_t version_floor = sharded() ? AcknowledgedSyncs() : acked_version_;
  bool behind = CenterVersion(*status) < version_floor;
  if (g == 0) {
    for (const auto& [replica, step] : acked_step_) {
      if (replica < 0 || replica >= status->slots_size()) continue;
      const SlotStatus& slot = status->slots(replica);
      behind = behind || slot.snapshot_step() < step ||
               slot.update_count() < step / spec_.sync_period;
    }
  }
  if (!behind) return;
  // Behind an answer: a violation only if it still led the group after that status (a deposed
  // leader may answer for a moment on resuming, with its old state).
  if (replicated()) {
    PollPeers();
    if (group.max_epoch_seen > status->group().epoch()) return;
  }
  const std::string leader =
      absl::StrCat(members_[member].name,
                   replicated() ? absl::StrCat(" (leader in epoch ", status->group().epoch(), ")")
                                : std::string(),
                   sharded() ? absl::StrCat(" (group ", g, ")") : std::string(),
                   when.empty() ? "" : " ", when);
  if (CenterVersion(*status) < version_floor &&
      reported_.insert(absl::StrCat("group ", g, " version ", version_floor)).second) {
    acknowledged_lost_ = true;
    Violation(sharded()
                  ? absl::StrCat(leader, " has its range at version ", CenterVersion(*status),
                                 ", but the trainers were answered ", version_floor,
                                 " syncs in all (every range applied each): an acknowledged "
                                 "sync is lost")
                  : absl::StrCat(leader, " has the center at version ", CenterVersion(*status),
                                 ", but a trainer was answered version ", version_floor,
                                 ": an acknowledged sync is lost"));
  }
  if (g != 0) return;
  for (const auto& [replica, step] : acked_step_) {
    if (replica < 0 || replica >= status->slots_size()) continue;
    const SlotStatus& slot = status->slots(replica);
    if ((slot.snapshot_step() < step || slot.update_count() < step / spec_.sync_period) &&
        reported_.insert(absl::StrCat("slot ", replica, " step ", step)).second) {
      acknowledged_lost_ = true;
      Violation(absl::StrCat(leader, ": slot ", replica, " last synced step ",
                             slot.snapshot_step(), " after ", slot.update_count(),
                             " syncs, but its trainer was answered the sync of step ", step,
                             " (", step / spec_.sync_period, " syncs): an acknowledged sync is lost"));
    }
  }
}

void ChaosRun::PollRangeGroups() {
  if (!sharded() || absl::Now() - last_range_poll_ < kPeerPoll) return;
  last_range_poll_ = absl::Now();
  for (int g = 1; g < shard_groups(); ++g) {
    const std::optional<GetStatusResponse> status = LeaderStatus(g, kRpcDeadline);
    ServerGroup& group = groups_[g];
    if (!status.has_value() || !group.before_kill.has_value()) continue;
    // The first answer of a range group's restarted server: nothing it had is gone, and it is at
    // or past every sync answered to the trainers.
    const int64_t before = CenterVersion(*group.before_kill);
    group.before_kill.reset();
    Log(absl::StrCat("group ", g, "'s restarted server answers: range version ",
                     CenterVersion(*status), " (before the kill: ", before, ")"));
    if (CenterVersion(*status) < before) {
      Violation(absl::StrCat("group ", g, "'s range was at version ", before,
                             " before its server was killed, and at ", CenterVersion(*status),
                             " after its restart"));
    }
    CheckAcknowledged(group.leader, "as it restarted");
  }
}

void ChaosRun::CheckFencedSoon(int member, int64_t offset, int64_t epoch) {
  const absl::Time deadline = absl::Now() + kFenceCheckWait;
  AddPending(kFenceCheckWait, absl::StrCat("check that ", members_[member].name, " fenced itself"),
             [this, member, offset, epoch, deadline] {
               CheckFenced(member, offset, epoch, deadline);
             });
}

int ChaosRun::PickStandby(const std::vector<int>& members, int leader, uint32_t pick) {
  std::vector<int> standbys;
  for (int i : members) {
    if (i != leader) standbys.push_back(i);
  }
  return standbys[pick % standbys.size()];
}

void ChaosRun::CheckFenced(int member, int64_t offset, int64_t epoch, absl::Time deadline) {
  if (cleaning_up_) return;  // a run stopped early: no time to wait for it
  const std::string& name = members_[member].name;
  const std::string path = cluster_->member(member).log_path();
  while (true) {
    const std::string log = ReadFileOrEmpty(path);
    const std::string since = offset < static_cast<int64_t>(log.size()) ? log.substr(offset) : "";
    const bool fenced = absl::StrContains(since, "no longer acknowledging");
    const bool again = absl::StrContains(since, "running again as a standby");
    if (fenced && again) {
      ++report_.fenced_leaders;
      Log(absl::StrCat(name, " (leader in epoch ", epoch,
                       " until stopped or cut from etcd) fenced itself and runs again as a "
                       "standby"));
      return;
    }
    if (absl::Now() >= deadline) {
      Violation(absl::StrCat(
          name, " led epoch ", epoch, ", was stopped or cut from etcd past its lease, and within ",
          Seconds(kFenceCheckWait), " its log did not say ",
          fenced ? "" : "'no longer acknowledging'", fenced || again ? "" : " nor ",
          again ? "" : "'running again as a standby'", ":\n", LastLines(path, 12)));
      return;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
}

absl::Status ChaosRun::WriteConfigs() {
  ServerConfig server;
  server.set_listen_address("127.0.0.1:0");  // --listen overrides it
  *server.mutable_job() = job_;
  server.mutable_durability()->set_data_dir(dir_ + "/data");
  server.set_max_wait_ms(500);
  if (sharded() && job_.has_audit()) {
    // Group 0 reads audited windows' starts from the range groups, which listen on the lab's
    // hosts: operator calls, so every group shares an operator token (docs/sharding.md#audits).
    const std::string token_file = dir_ + "/operator-token";
    if (absl::Status written = WriteFile(token_file, "chaos-operator\n"); !written.ok()) {
      return absl::InternalError(absl::StrCat("cannot write ", token_file, ": ",
                                              written.message()));
    }
    server.mutable_security()->set_operator_token_file(token_file);
  }
  google::protobuf::TextFormat::PrintToString(server, &server_config_);
  worker_config_ = absl::StrCat("job_id: \"", kJobId,
                                "\"\n"
                                "backoff_initial_ms: 20\n"
                                "backoff_max_ms: 300\n"
                                "give_up_after_ms: 60000\n"
                                "rpc_deadline_ms: 3000\n");
  absl::Status written = WriteFile(dir_ + "/server.pbtxt", server_config_);
  if (written.ok()) written = WriteFile(dir_ + "/worker.pbtxt", worker_config_);
  if (!written.ok()) {
    return absl::InternalError(absl::StrCat("cannot write the configs in ", dir_, ": ",
                                            written.message()));
  }
  return absl::OkStatus();
}

absl::Status ChaosRun::StartServer() {
  ++server_life_;
  std::ofstream(dir_ + "/server.log", std::ios::app)
      << "----- chaos: server life " << server_life_ << " -----\n";
  ServerStart start;
  start.binary = options_.server_binary;
  start.config = dir_ + "/server.pbtxt";
  start.listen = absl::StrCat(server_host_, ":", port_);
  start.port_file = dir_ + "/port";
  start.log = dir_ + "/server.log";
  start.wait = kPortWait;
  absl::StatusOr<int> listening = StartServerProcess(start, &server_);
  if (!listening.ok()) return listening.status();
  const int port = *listening;
  if (port_ != 0 && port != port_) {
    return absl::InternalError(
        absl::StrCat("the restarted server listens on port ", port, ", not ", port_));
  }
  port_ = port;
  address_ = absl::StrCat(server_host_, ":", port_);
  stub_ = ParameterServer::NewStub(FastChannel(address_));
  server_down_ = false;
  server_stopped_ = false;
  return absl::OkStatus();
}

absl::Status ChaosRun::StartCluster() {
  ClusterOptions options;
  options.server_binary = options_.server_binary;
  options.worker_binary = options_.worker_binary;
  options.dir = dir_;
  options.standbys = options_.standbys;
  options.etcd_members = options_.etcd_members;
  options.leader_lease_ms = spec_.leader_lease_ms;
  options.shard_groups = shard_groups();
  options.network = lab_.get();
  options.firewall = firewall_.get();
  options.fail_on_exit = false;  // the harness reaps the members itself
  options.start_wait = kPortWait;
  cluster_ = std::make_unique<Cluster>(options);
  RETURN_IF_ERROR(cluster_->StartServer(server_config_, worker_config_));
  address_ = cluster_->address();  // group 0's: the workers talk to it only
  groups_.assign(shard_groups(), ServerGroup());
  for (int g = 0; g < shard_groups(); ++g) {
    const std::string group_address = sharded() ? cluster_->group_address(g) : address_;
    const std::vector<std::string> addresses = absl::StrSplit(group_address, ',');
    if (static_cast<int>(addresses.size()) != cluster_->members_per_group()) {
      return absl::InternalError(absl::StrCat("group ", g, "'s address '", group_address,
                                              "' does not name ", cluster_->members_per_group(),
                                              " members"));
    }
    for (int index = 0; index < cluster_->members_per_group(); ++index) {
      const int i = g * cluster_->members_per_group() + index;
      Member m;
      m.name = cluster_->member_name(i);
      m.group = g;
      m.address = addresses[index];
      std::shared_ptr<grpc::Channel> channel = FastChannel(m.address);
      m.stub = ParameterServer::NewStub(channel);
      m.range = CenterRange::NewStub(channel);
      members_.push_back(std::move(m));
      groups_[g].members.push_back(i);
    }
    // A group of one server leads itself.
    if (!replicated()) groups_[g].leader = groups_[g].members.front();
  }
  if (static_cast<int>(members_.size()) != cluster_->members()) {
    return absl::InternalError(absl::StrCat("the cluster has ", cluster_->members(),
                                            " members, not ", members_.size()));
  }
  if (cluster_->etcd() != nullptr) etcd_down_.assign(cluster_->etcd()->size(), false);
  std::vector<std::string> names;
  for (int i = 0; i < cluster_->members(); ++i) {
    names.push_back(absl::StrCat(members_[i].name, " (", members_[i].address, ", data in ",
                                 cluster_->member_data_dir(i), ")"));
  }
  if (replicated()) {
    report_.group = absl::StrCat(
        sharded() ? absl::StrCat(shard_groups(), " server groups: ") : "server group: ",
        absl::StrJoin(names, ", "), "; leader lease ", spec_.leader_lease_ms,
        " ms, synchronous replication; etcd of ", cluster_->etcd()->size(), " members at ",
        absl::StrJoin(cluster_->etcd()->client_endpoints(), ","));
  } else {
    report_.group = absl::StrCat(shard_groups(), " server groups of one server each: ",
                                 absl::StrJoin(names, ", "));
  }
  if (sharded()) {
    absl::StrAppend(&report_.group, "; the center sharded in ", shard_groups(),
                    " ranges (group k holds range k; group 0 coordinates)");
  }
  Log(report_.group);
  // Training starts on whole groups: each a leader and every standby in sync.
  const absl::Time until = absl::Now() + kGroupStartWait;
  for (int g = 0; g < shard_groups(); ++g) {
    while (true) {
      std::optional<GetStatusResponse> s = LeaderStatus(g, kRpcDeadline);
      if (s.has_value() && GroupWhole(g, *s)) break;
      if (absl::Now() > until) {
        return absl::DeadlineExceededError(absl::StrCat(
            sharded() ? absl::StrCat("group ", g) : std::string("the group"),
            " was not ready (a leader, every standby in sync) within ", Seconds(kGroupStartWait),
            "; last: ",
            s.has_value() ? s->group().ShortDebugString() : std::string("no leader answers"), "\n",
            ServerLogs(10)));
      }
      absl::SleepFor(kPoll);
    }
  }
  Log(replicated() ? "every standby in sync" : "every group answers");
  return absl::OkStatus();
}

absl::Status ChaosRun::StartWorker(const std::string& name, const std::string& role,
                                   const TrainerFaults& faults) {
  auto worker = std::make_unique<Worker>();
  worker->name = name;
  worker->role = role;
  worker->faults = faults;
  std::vector<std::string> argv = {options_.worker_binary,
                                   "--config",
                                   dir_ + "/worker.pbtxt",
                                   "--server",
                                   address_,
                                   "--name",
                                   name,
                                   "--role",
                                   role};
  if (faults.poison_from_step > 0) {
    argv.push_back(absl::StrCat("--fault_poison_from_step=", faults.poison_from_step));
  }
  if (faults.flip_at_step > 0) {
    argv.push_back(absl::StrCat("--fault_flip_bit_at_step=", faults.flip_at_step));
    argv.push_back(absl::StrCat("--fault_flip_bit_repeat_every=", faults.flip_every));
  }
  if (faults.die_at_step > 0) {
    argv.push_back(absl::StrCat("--fault_die_in_sync_at_step=", faults.die_at_step));
    argv.push_back(absl::StrCat("--fault_die_in_sync_ranges=", faults.die_ranges));
  }
  // Group and sharded mode: every sync answered to a trainer is logged (ReadAcknowledged).
  if (clustered() && role != "evaluator") argv.push_back("--vmodule=easgd_trainer=1");
  int netns_fd = -1;
  if (lab_ != nullptr && role != "evaluator") {
    ASSIGN_OR_RETURN(NetworkLab::Host host, lab_->AddHost());
    worker->host = host.index;
    netns_fd = host.netns_fd;
    argv.push_back("--peer_listen");
    argv.push_back(host.address + ":0");
  }
  ChildProcessOptions child;
  child.netns_fd = netns_fd;
  ASSIGN_OR_RETURN(worker->process, ChildProcess::Start(argv, dir_ + "/" + name + ".log", child));
  workers_.push_back(std::move(worker));
  return absl::OkStatus();
}

absl::Status ChaosRun::Replace(const Worker& gone) {
  if (job_finished_) return absl::OkStatus();
  if (replacement_budget_-- <= 0) {
    return absl::ResourceExhaustedError("too many workers gone: no replacement left");
  }
  ++report_.replacements;
  const bool evaluator = gone.role == "evaluator";
  const std::string name = evaluator ? absl::StrCat("evaluator-", ++next_evaluator_)
                                     : absl::StrCat("spare-", next_spare_++);
  Log(absl::StrCat("start ", name, " (replaces ", gone.name, ")"));
  return StartWorker(name, evaluator ? "evaluator" : "spare");
}

absl::Status ChaosRun::Setup() {
  std::string dir_template = absl::StrCat(options_.work_dir, "/chaos-seed", options_.seed, "-",
                                          options_.faults == 0 ? "reference-" : "", "XXXXXX");
  if (mkdtemp(dir_template.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("cannot create a directory in ", options_.work_dir));
  }
  dir_ = dir_template;
  RETURN_IF_ERROR(WriteConfigs());

  // The kinds this machine permits.
  std::vector<FaultKind> allowed;
  bool wants_network = false;
  for (FaultKind kind : options_.kinds) wants_network = wants_network || IsNetworkFault(kind);
  if (options_.faults > 0 && options_.network && wants_network) {
    auto lab = NetworkLab::Create();
    if (lab.ok()) {
      lab_ = *std::move(lab);
      server_host_ = lab_->gateway();
      report_.network = lab_->Describe();
    } else {
      report_.network = absl::StrCat(
          "network faults SKIPPED (not counted): this machine does not permit network "
          "namespaces: ",
          lab.status().message(), "; every process on 127.0.0.1");
    }
  } else {
    report_.network = options_.faults == 0 ? "no faults: every process on 127.0.0.1"
                                           : "network faults off: every process on 127.0.0.1";
  }
  bool wants_firewall = false;
  for (FaultKind kind : options_.kinds) {
    wants_firewall = wants_firewall || (IsFirewallFault(kind) && KindFitsMode(kind, options_));
  }
  std::string firewall_note;
  if (options_.faults > 0 && wants_firewall) {
    auto firewall = ProcessFirewall::Create();
    if (firewall.ok()) {
      firewall_ = *std::move(firewall);
      firewall_note = firewall_->Describe();
    } else {
      firewall_note = absl::StrCat(
          "firewall faults SKIPPED (not counted): this machine does not permit a firewall "
          "between processes: ",
          firewall.status().message());
    }
    Log(firewall_note);
  }
  std::vector<std::string> left_out;
  std::vector<std::string> replaced;  // group mode: the single server's kinds
  bool byzantine_left_out = false;    // sharded mode
  for (FaultKind kind : options_.kinds) {
    if (!KindFitsMode(kind, options_)) {
      // One server has no group faults, an unsharded job no ranges (nothing to say); a group
      // replaces the server's kinds; a sharded job has no byzantine trainers (below).
      if (IsSingleServerFault(kind) && replicated()) replaced.push_back(FaultKindName(kind));
      if (kind == FaultKind::kByzantine) byzantine_left_out = true;
      continue;
    }
    if (kind == FaultKind::kSilentCorruption && !spec_.audit) {
      left_out.push_back(absl::StrCat(FaultKindName(kind), " (the job does not audit)"));
      continue;
    }
    if (IsFirewallFault(kind) && firewall_ == nullptr) continue;  // said above
    bool ok = !IsNetworkFault(kind) || lab_ != nullptr;
    if (ok && kind == FaultKind::kThrottle) ok = lab_->tbf();
    if (ok && (kind == FaultKind::kDelay || kind == FaultKind::kLoss)) ok = lab_->netem();
    if (ok) {
      allowed.push_back(kind);
    } else if (lab_ != nullptr || options_.network) {
      left_out.push_back(FaultKindName(kind));
    }
  }
  if (!left_out.empty()) {
    absl::StrAppend(&report_.network,
                    "; left out of the schedule: ", absl::StrJoin(left_out, ", "));
  }
  Log(report_.network);
  if (!replaced.empty() && options_.faults > 0) {
    Log(absl::StrCat("server group: ", absl::StrJoin(replaced, ", "),
                     " left out (the leader's kinds replace them)"));
  }
  if (byzantine_left_out && options_.faults > 0) {
    Log("sharded job: byzantine left out (a range group's own value checks are covered by "
        "sharding_test, not chaos-tested here)");
  }
  report_.schedule =
      PlanFaults(options_.seed, options_.faults, allowed, options_.must_include, spec_);
  report_.faults_planned = static_cast<int>(report_.schedule.size());
  for (const PlannedFault& f : report_.schedule) Log("planned: " + f.ToString());
  // A server stop can fence every worker at once.
  replacement_budget_ = (options_.faults + 1) * (spec_.replicas + options_.spares + 1) + 4;

  if (clustered()) {
    RETURN_IF_ERROR(StartCluster());
  } else {
    RETURN_IF_ERROR(StartServer());
    Log(absl::StrCat("rebound_server serving on ", address_, ", data in ", dir_, "/data"));
  }
  RETURN_IF_ERROR(StartWorker("evaluator", "evaluator"));
  for (int i = 0; i < options_.spares; ++i) {
    RETURN_IF_ERROR(StartWorker(absl::StrCat("spare-", next_spare_++), "spare"));
  }
  // A byzantine fault turns trainer (pick % replicas) byzantine from the first sync step at or
  // after its progress point; a die_between_ranges fault makes it die in its sync of that step,
  // after ranges [0, 1 + (pick / replicas) % K). A second one drawn for the same trainer changes
  // nothing (it is skipped when its turn comes).
  std::map<int, TrainerFaults> trainer_faults;
  for (const PlannedFault& f : report_.schedule) {
    if (f.kind != FaultKind::kByzantine && f.kind != FaultKind::kDieBetweenRanges) continue;
    const uint32_t replicas = static_cast<uint32_t>(spec_.replicas);
    const int trainer = static_cast<int>(f.pick % replicas);
    const int64_t tau = spec_.sync_period;
    const int64_t step = std::max<int64_t>(
        tau, static_cast<int64_t>(std::ceil(f.at_progress * spec_.max_steps / tau)) * tau);
    TrainerFaults& faults = trainer_faults[trainer];
    if (f.kind == FaultKind::kByzantine && faults.poison_from_step == 0) {
      faults.poison_from_step = step;
    }

    if (f.kind == FaultKind::kDieBetweenRanges && faults.die_at_step == 0) {
      faults.die_at_step = step;
      faults.die_ranges =
          1 + static_cast<int>((f.pick / replicas) % static_cast<uint32_t>(shard_groups()));
      Log(absl::StrCat("trainer-", trainer, " will die in its sync of step ", step,
                       " after ranges [0, ", faults.die_ranges, ") of ", shard_groups()));
    }
  }
  // A silent_corruption fault: trainer (pick % replicas), or the next one that has no other
  // fault (a byzantine trainer exits at its poisoned sync), flips a bit mid-window after its
  // progress point, and 4 windows before the end at the latest: its window closes, and is
  // audited, in time.
  for (const PlannedFault& f : report_.schedule) {
    if (f.kind != FaultKind::kSilentCorruption) continue;
    const int64_t tau = spec_.sync_period;
    const int64_t step = std::max<int64_t>(
        tau, static_cast<int64_t>(std::ceil(f.at_progress * spec_.max_steps / tau)) * tau);
    for (int k = 0; k < spec_.replicas; ++k) {
      const int trainer = static_cast<int>((f.pick + k) % static_cast<uint32_t>(spec_.replicas));
      TrainerFaults& faults = trainer_faults[trainer];
      if (faults.poison_from_step != 0 || faults.die_at_step != 0 || faults.flip_at_step != 0) {
        continue;
      }
      faults.flip_at_step = std::min<int64_t>(step, spec_.max_steps - 4 * tau) + tau / 2;
      // Once per window from there: a faulty machine. Audits keep at most 2 x max_concurrent
      // windows waiting and skip the rest, so a single flip's window may go unaudited when the
      // spares fall behind (fraction 1 on 2 cores); one of its windows is audited in time.
      faults.flip_every = tau;
      Log(absl::StrCat("trainer-", trainer, " will flip a bit after step ", faults.flip_at_step,
                       " and every ", tau, " steps after it"));
      break;
    }
  }
  for (int i = 0; i < spec_.replicas; ++i) {
    RETURN_IF_ERROR(StartWorker(absl::StrCat("trainer-", i), "trainer", trainer_faults[i]));
  }
  const absl::Time until = absl::Now() + kStartWait;
  while (true) {
    std::optional<GetStatusResponse> s = Status();
    if (s.has_value()) {
      bool active = s->slots_size() == spec_.replicas;
      for (const SlotStatus& slot : s->slots()) active = active && slot.state() == ACTIVE;
      if (active) break;
    }
    for (auto& w : workers_) {
      if (w->process->Poll().has_value()) {
        return absl::InternalError(absl::StrCat(w->name, " exited at start (code ",
                                                *w->process->Poll(), "):\n",
                                                LastLines(w->process->log_path(), 15)));
      }
    }
    if (absl::Now() > until) {
      return absl::DeadlineExceededError(
          absl::StrCat("the trainers did not all own a slot within ", Seconds(kStartWait)));
    }
    absl::SleepFor(kPoll);
  }
  Log(absl::StrCat("training: ", spec_.replicas, " trainers, ", options_.spares,
                   " spares and an evaluator"));
  return absl::OkStatus();
}

void ChaosRun::RunDuePending(bool all) {
  const absl::Time now = absl::Now();
  // Actions may add actions: take the due ones out first.
  std::vector<Pending> due;
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (all || it->at <= now) {
      due.push_back(std::move(*it));
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
  std::sort(due.begin(), due.end(), [](const Pending& a, const Pending& b) { return a.at < b.at; });
  for (Pending& p : due) {
    Log(p.what);
    p.action();
  }
}

void ChaosRun::ReapWorkers() {
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker& w = *workers_[i];
    if (w.exit_code.has_value()) continue;
    const std::optional<int> code = w.process->Poll();
    if (!code.has_value()) continue;
    w.exit_code = code;
    bool replace = false;
    if (w.killed && *code == kKilledBySigkill) {
      replace = true;
    } else if (w.faults.die_at_step > 0 && *code == kKilledBySigkill &&
               absl::StrContains(LastLines(w.process->log_path(), 30),
                                 "dying before the commit")) {
      // die_between_ranges: it killed itself in its sync, after some ranges. A fault was aimed
      // at it: CheckReconnected expects nothing of it.
      w.was_faulted = true;
      ++report_.died_between_ranges;
      Log(absl::StrCat(w.name, " died in its sync of step ", w.faults.die_at_step,
                       " after ranges [0, ", w.faults.die_ranges, ") of ", shard_groups(),
                       ", before the commit"));
      replace = true;
    } else if (w.faults.poison_from_step > 0 && *code == 1) {
      // A byzantine trainer must have been refused, and must have said so.
      const std::string tail = LastLines(w.process->log_path(), 30);
      if (absl::StrContains(tail, "the server refused this trainer's sync of step")) {
        ++report_.byzantine_refused;
        Log(absl::StrCat(w.name, " (byzantine) exited 1: its poisoned sync was refused"));
      } else {
        Violation(absl::StrCat(w.name, " (byzantine) exited 1 without a refused sync:\n", tail));
      }
      replace = true;
    } else if (*code == 0) {
      if (!job_finished_ && w.role != "evaluator") {
        // Exit 0 before the job's end is a trainer done with its slot, or one told the job is
        // over; any other is a worker that quit on its own while it still had work.
        const std::string log = ReadFileOrEmpty(w.process->log_path());
        if (absl::StrContains(log, "slot trained to max_steps") ||
            absl::StrContains(log, "the job is finished")) {
          Log(absl::StrCat(w.name, " exited 0 (its slot finished, or the job)"));
        } else {
          Violation(absl::StrCat(w.name, " (started as ", w.role,
                                 ") exited 0 before the job's end, its slot not finished and "
                                 "no one having stopped it:\n",
                                 LastLines(w.process->log_path(), 6)));
          replace = true;
        }
      }
    } else if (*code == kExitFenced || *code == kExitUnreachable) {
      Log(absl::StrCat(w.name, " exited ", *code,
                       *code == kExitFenced ? " (fenced)" : " (server unreachable)"));
      // A stop of the server shorter than the failure timeout may do it too: the silence the
      // detector measures is the stop plus up to a heartbeat interval.
      const bool after_server_stop =
          last_server_stop_ > absl::ZeroDuration() &&
          (server_stopped_ || absl::Now() - last_server_resume_ <
                                  absl::Milliseconds(spec_.failure_timeout_ms) + absl::Seconds(5));
      if (*code == kExitFenced && !w.was_faulted && after_server_stop) {
        // The server's failure detector counted its own stop as the workers' silence, which it
        // must not (Membership::ExcuseServerPause).
        ++report_.fenced_by_server_stop;
        Violation(absl::StrCat(w.name, " was fenced as the server resumed from a SIGSTOP:\n",
                               LastLines(w.process->log_path(), 4)));
      } else if (!w.was_faulted) {
        Note(absl::StrCat(w.name, " exited ", *code, " with no fault against it",
                          server_faulted_ ? " (the server was stopped or killed before)" : "",
                          " (a false failure detection on a loaded machine?):\n",
                          LastLines(w.process->log_path(), 4)));
      }
      replace = true;
    } else {
      Violation(absl::StrCat(w.name, " (started as ", w.role, ") exited with code ", *code, ":\n",
                             LastLines(w.process->log_path(), 12)));
      replace = true;
    }
    if (replace) {
      if (absl::Status s = Replace(w); !s.ok()) Error(std::string(s.message()));
    }
  }
}

void ChaosRun::ReapServer() {
  if (clustered()) {
    for (size_t i = 0; i < members_.size(); ++i) {
      Member& m = members_[i];
      if (m.down) continue;
      const std::optional<int> code = cluster_->member(static_cast<int>(i)).Poll();
      if (!code.has_value()) continue;
      Violation(absl::StrCat(m.name, " exited with code ", *code,
                             " without being killed by the harness:\n",
                             LastLines(cluster_->member(static_cast<int>(i)).log_path(), 15)));
      if (absl::Status s = cluster_->RestartMember(static_cast<int>(i), false); !s.ok()) {
        Error(absl::StrCat("cannot restart ", m.name, ": ", s.message()));
        m.down = true;
      }
    }
    return;
  }
  if (server_ == nullptr || server_down_) return;
  const std::optional<int> code = server_->Poll();
  if (!code.has_value()) return;
  Violation(absl::StrCat("rebound_server exited with code ", *code,
                         " without being killed by the harness:\n",
                         LastLines(dir_ + "/server.log", 15)));
  if (absl::Status s = StartServer(); !s.ok()) {
    Error(absl::StrCat("cannot restart the server: ", s.message()));
    server_down_ = true;
  }
}

void ChaosRun::ObserveAudits(const GetStatusResponse& status) {
  for (auto& [name, flip] : flips_) {
    for (const WorkerStatus& w : status.workers()) {
      if (w.name() != name || w.role() != TRAINER || !w.has_slot()) continue;
      for (const SlotStatus& slot : status.slots()) {
        if (slot.owner_incarnation() == w.incarnation() && slot.snapshot_step() > flip.step) {
          flip.synced = true;
        }
      }
    }
  }
  for (const AuditStatus& a : status.audits()) {
    if (!a.has_result()) continue;
    if (!audit_verdicts_.insert({server_life_, a.audit_id()}).second) continue;
    report_.audits_matched += a.result() == AUDIT_MATCHED;
    if (a.confirms() == 0 || !a.has_verdict()) {
      // A first replay's verdict comes with its second's (below); it has none of its own yet.
      continue;
    }
    const std::string what =
        absl::StrCat("audit ", a.audit_id(), " of ", a.worker(), " (slot ", a.slot().replica(),
                     ", steps (", a.from_step(), ", ", a.to_step(), "]): ",
                     AuditVerdict_Name(a.verdict()), ": ", a.detail());
    if (a.verdict() == AUDIT_CONFIRMED) {
      Worker* w = FindByName(a.worker());
      const int64_t step = a.mismatch().step();
      if (w == nullptr || w->faults.flip_at_step == 0 || step < w->faults.flip_at_step ||
          (step - w->faults.flip_at_step) % std::max<int64_t>(1, w->faults.flip_every) != 0) {
        Violation(absl::StrCat("a false report: ", what));
        continue;
      }
      Flip& flip = flips_[w->name];
      if (flip.step == 0) {  // confirmed before the schedule said it
        flip = Flip{w->faults.flip_at_step, a.slot().replica(), server_faults_};
        ++report_.corruptions;
      }
      if (!flip.reported) ++report_.corruptions_reported;
      flip.reported = true;
      Log(absl::StrCat("AUDIT_MISMATCH caught a flip of ", w->name, " (the first at step ",
                       flip.step, ", this one at ", step, "): ", what));
    } else if (a.verdict() == AUDIT_AUDITOR_FAULT) {
      Violation(absl::StrCat("an auditor convicted with no corrupt auditor in the run: ", what));
    } else {
      Note(what);
    }
  }
}

void ChaosRun::Observe(const GetStatusResponse& status) {
  for (const RecoveryStatus& r : status.recoveries()) {
    auto key = std::make_pair(server_life_, r.task_id());
    auto it = recoveries_.find(key);
    const std::string name =
        absl::StrCat("recovery ", r.task_id(),
                     server_life_ > 1 ? absl::StrCat(" (server life ", server_life_, ")") : "",
                     " of slot ", r.slot().replica());
    if (it == recoveries_.end()) {
      Log(absl::StrCat(name, " started (", RecoveryPolicy_Name(r.policy()), ")"));
    }
    if (r.has_outcome() && (it == recoveries_.end() || !it->second.has_outcome())) {
      Log(absl::StrCat(name, ": ", RecoveryOutcome_Name(r.outcome()), ", ", r.steps_replayed(),
                       " steps replayed", r.verified() ? ", verified" : "", " (", r.detail(), ")"));
    }
    recoveries_[key] = r;
  }
  ObserveAudits(status);
  if (status.has_last_eval()) report_.evaluator_accuracy = status.last_eval().test_accuracy();
  if (server_life_ > before_kill_life_) {
    // The restarted server restores a trainer with its last heartbeat set at the end of the
    // grace period (after its own start): until the trainer beats again, that moment stays put.
    // It is back once a heartbeat lies before it, or once the moment moves.
    for (auto it = awaiting_reconnect_.begin(); it != awaiting_reconnect_.end();) {
      bool back = false;
      for (const WorkerStatus& w : status.workers()) {
        if (w.incarnation() != it->first || w.state() != ALIVE) continue;
        const int64_t beat_ms = status.uptime_ms() - w.last_heartbeat_ms_ago();  // since start
        if (beat_ms < spec_.reconnect_grace_ms - 50) back = true;
        if (!it->second.first_beat_ms.has_value()) it->second.first_beat_ms = beat_ms;
        if (std::abs(beat_ms - *it->second.first_beat_ms) > 20) back = true;
      }
      if (back) {
        Log(absl::StrCat(it->second.name, " reconnected to the ",
                         replicated() ? "new leader" : "restarted server", " (slot ",
                         it->second.replica, ", incarnation ", it->first, ")"));
        ++report_.reconnected_trainers;
        it = awaiting_reconnect_.erase(it);
      } else {
        ++it;
      }
    }
  }
  if (before_kill_.has_value() && server_life_ > before_kill_life_) {
    // The first answer of the restarted server: nothing acknowledged before the kill is gone.
    const GetStatusResponse& before = *before_kill_;
    for (int i = 0; i < before.slots_size() && i < status.slots_size(); ++i) {
      if (status.slots(i).update_count() < before.slots(i).update_count()) {
        Violation(absl::StrCat("slot ", i, " applied ", before.slots(i).update_count(),
                               " syncs before the server was killed, and ",
                               status.slots(i).update_count(), " after its restart"));
      }
    }
    for (int i = 0; i < before.centers_size() && i < status.centers_size(); ++i) {
      if (status.centers(i).version() < before.centers(i).version()) {
        Violation(absl::StrCat("the center was at version ", before.centers(i).version(),
                               " before the server was killed, and at ",
                               status.centers(i).version(), " after its restart"));
      }
    }
    Log(absl::StrCat(
        "the restarted server answers: center version ",
        status.centers_size() > 0 ? status.centers(0).version() : 0,
        " (before the kill: ", before.centers_size() > 0 ? before.centers(0).version() : 0, ")"));
    before_kill_.reset();
  }
}

absl::StatusOr<ChaosRun::Fired> ChaosRun::Fire(const PlannedFault& fault,
                                               const GetStatusResponse& status) {
  const std::string kind = FaultKindName(fault.kind);
  auto pick = [&](const std::vector<Worker*>& candidates) -> Worker* {
    return candidates.empty() ? nullptr : candidates[fault.pick % candidates.size()];
  };
  auto slot_of = [&](const Worker& w) -> std::string {
    for (const WorkerStatus& s : status.workers()) {
      if (s.name() != w.name || s.state() != ALIVE || s.role() != TRAINER) continue;
      for (const SlotStatus& slot : status.slots()) {
        if (slot.owner_incarnation() == s.incarnation()) {
          return absl::StrCat(" (slot ", slot.slot().replica(), " at step ", slot.step(),
                              ", synced ", slot.snapshot_step(), ")");
        }
      }
    }
    return "";
  };
  const std::string at = absl::StrFormat("progress %.2f: ", Progress(status));
  if (IsGroupFault(fault.kind)) {
    if (!replicated()) return absl::InternalError("a group fault without a server group");
    ASSIGN_OR_RETURN(const Fired fired, FireGroupFault(fault, status, at));
    if (fired == Fired::kDone) {
      ++report_.faults[kind];
      ++server_faults_;
    }
    return fired;
  }
  if (IsSingleServerFault(fault.kind) && sharded()) {
    ASSIGN_OR_RETURN(const Fired fired, FireShardServerFault(fault, at));
    if (fired == Fired::kDone) ++report_.faults[kind];
    return fired;
  }

  switch (fault.kind) {
    case FaultKind::kDieBetweenRanges: {
      // Armed when the trainer started (its --fault_die_in_sync_at_step); counted once the
      // trainer has died so (ReapWorkers saw it), a target lacking until then. Another fault
      // that ended the trainer first leaves it without a target (skipped).
      const int trainer = static_cast<int>(fault.pick % static_cast<uint32_t>(spec_.replicas));
      Worker* w = FindByName(absl::StrCat("trainer-", trainer));
      if (w == nullptr || w->faults.die_at_step == 0 || w->killed ||
          w->exit_code != kKilledBySigkill || die_announced_.count(trainer) > 0) {
        return Fired::kNoTarget;
      }
      const std::string log = ReadFileOrEmpty(w->process->log_path());
      if (!absl::StrContains(log, "dying before the commit")) return Fired::kNoTarget;
      die_announced_.insert(trainer);
      Log(absl::StrCat(at, kind, ": ", w->name, " died in its sync of step ",
                       w->faults.die_at_step, " after ranges [0, ", w->faults.die_ranges, ")"));
      break;
    }
    case FaultKind::kSilentCorruption: {
      // Armed when the trainer started (its --fault_flip_bit_at_step): said once the trainer's
      // log shows the flip (it may not have reached that step yet, or have died before).
      Worker* w = nullptr;
      int trainer = 0;
      for (int k = 0; k < spec_.replicas && w == nullptr; ++k) {
        trainer = static_cast<int>((fault.pick + k) % static_cast<uint32_t>(spec_.replicas));
        Worker* candidate = FindByName(absl::StrCat("trainer-", trainer));
        if (candidate != nullptr && candidate->faults.flip_at_step != 0) w = candidate;
      }
      if (w == nullptr || flips_.count(w->name)) return Fired::kNoTarget;
      const std::string log = ReadFileOrEmpty(w->process->log_path());
      if (!absl::StrContains(log, "fault injection: flipped bit")) return Fired::kNoTarget;
      // The slot it owns now (trainer-K need not own slot K: the trainers register at once).
      int replica = trainer;
      for (const WorkerStatus& s : status.workers()) {
        if (s.name() != w->name || s.state() != ALIVE || s.role() != TRAINER) continue;
        for (const SlotStatus& slot : status.slots()) {
          if (slot.owner_incarnation() == s.incarnation()) replica = slot.slot().replica();
        }
      }
      flips_[w->name] = Flip{w->faults.flip_at_step, replica, server_faults_};
      ++report_.corruptions;
      Log(absl::StrCat(at, kind, ": ", w->name, slot_of(*w), " flipped a bit after step ",
                       w->faults.flip_at_step));
      break;
    }
    case FaultKind::kByzantine: {
      // Armed when the trainer started (its --fault_poison_from_step): now only said, unless
      // another fault ended that trainer first or an earlier byzantine fault already took it.
      const int trainer = static_cast<int>(fault.pick % static_cast<uint32_t>(spec_.replicas));
      Worker* w = FindByName(absl::StrCat("trainer-", trainer));
      if (w == nullptr || w->faults.poison_from_step == 0 || w->killed ||
          (w->exit_code.has_value() && *w->exit_code != 1) ||
          !byzantine_announced_.insert(trainer).second) {
        return Fired::kNoTarget;
      }
      Log(absl::StrCat(at, kind, ": ", w->name, slot_of(*w), " poisons its syncs from step ",
                       w->faults.poison_from_step));
      break;
    }
    case FaultKind::kKillTrainer:
    case FaultKind::kKillSpare:
    case FaultKind::kKillEvaluator: {
      Worker* w = pick(fault.kind == FaultKind::kKillTrainer ? Trainers(status, false)
                       : fault.kind == FaultKind::kKillSpare ? Spares(status)
                                                             : Evaluators());
      if (w == nullptr) return Fired::kNoTarget;
      Log(absl::StrCat(at, kind, ": SIGKILL ", w->name, slot_of(*w)));
      w->killed = true;
      w->process->Signal(SIGKILL);
      if (!w->process->WaitFor(kKillWait).has_value()) {
        return absl::InternalError(absl::StrCat(w->name, " survived SIGKILL"));
      }
      break;  // ReapWorkers replaces it
    }
    case FaultKind::kStopTrainer:
    case FaultKind::kStopSpare:
    case FaultKind::kStopEvaluator: {
      Worker* w = pick(fault.kind == FaultKind::kStopTrainer ? Trainers(status, false)
                       : fault.kind == FaultKind::kStopSpare ? Spares(status)
                                                             : Evaluators());
      if (w == nullptr) return Fired::kNoTarget;
      Log(absl::StrCat(at, kind, ": SIGSTOP ", w->name, slot_of(*w), " for ",
                       Seconds(fault.duration)));
      w->faulted = w->was_faulted = true;
      w->process->Signal(SIGSTOP);
      AddPending(fault.duration, absl::StrCat("SIGCONT ", w->name), [w] {
        w->process->Signal(SIGCONT);
        w->faulted = false;
      });
      break;
    }
    case FaultKind::kKillServer: {
      ++server_faults_;
      std::optional<GetStatusResponse> before = Status();
      before_kill_ = before.has_value() ? *before : status;
      before_kill_life_ = server_life_;
      Log(absl::StrCat(at, kind, ": SIGKILL rebound_server (center version ",
                       before_kill_->centers_size() > 0 ? before_kill_->centers(0).version() : 0,
                       "), restart in ", Seconds(fault.duration)));
      server_faulted_ = true;
      server_down_ = true;
      server_->Signal(SIGKILL);
      if (!server_->WaitFor(kKillWait).has_value()) {
        return absl::InternalError("rebound_server survived SIGKILL");
      }
      AwaitReconnect(*before_kill_);
      AddPending(
          fault.duration, "restart rebound_server on the same data directory and port", [this] {
            if (absl::Status s = StartServer(); !s.ok()) {
              Error(absl::StrCat("cannot restart the server: ", s.message()));
              return;
            }
            ++report_.server_restarts;
            const int life = server_life_;
            AddPending(
                absl::Milliseconds(spec_.reconnect_grace_ms + spec_.failure_timeout_ms + 1000),
                "check that the trainers reconnected", [this, life] { CheckReconnected(life); });
          });
      break;
    }
    case FaultKind::kStopServer: {
      ++server_faults_;
      Log(absl::StrCat(at, kind, ": SIGSTOP rebound_server for ", Seconds(fault.duration)));
      server_faulted_ = true;
      server_stopped_ = true;
      server_->Signal(SIGSTOP);
      AddPending(fault.duration, "SIGCONT rebound_server", [this, fault] {
        server_->Signal(SIGCONT);
        server_stopped_ = false;
        last_server_stop_ = fault.duration;
        last_server_resume_ = absl::Now();
      });
      break;
    }
    case FaultKind::kPartition:
    case FaultKind::kThrottle:
    case FaultKind::kDelay:
    case FaultKind::kLoss: {
      if (lab_ == nullptr) return absl::InternalError("a network fault without a network lab");
      Worker* w = pick(Trainers(status, true));
      if (w == nullptr) return Fired::kNoTarget;
      std::string what;
      absl::Status done;
      switch (fault.kind) {
        case FaultKind::kPartition:
          what = "link down";
          done = lab_->Partition(w->host);
          break;
        case FaultKind::kThrottle:
          what = absl::StrCat("tbf ", fault.rate_kbit, " kbit/s");
          done = lab_->Throttle(w->host, fault.rate_kbit);
          break;
        case FaultKind::kDelay:
          what = absl::StrCat("netem delay ", fault.delay_ms, " ms");
          done = lab_->Netem(w->host, fault.delay_ms, fault.delay_ms / 4, 0);
          break;
        default:
          what = absl::StrFormat("netem loss %.1f%%", fault.loss_percent);
          done = lab_->Netem(w->host, 0, 0, fault.loss_percent);
          break;
      }
      if (!done.ok()) return done;
      Log(absl::StrCat(at, kind, ": ", what, " on ", w->name, "'s link", slot_of(*w), " for ",
                       Seconds(fault.duration)));
      w->faulted = w->was_faulted = true;
      AddPending(fault.duration, absl::StrCat("heal ", w->name, "'s link"), [this, w] {
        if (absl::Status s = lab_->Heal(w->host); !s.ok()) {
          Error(absl::StrCat("cannot heal ", w->name, "'s link: ", s.message()));
        }
        w->faulted = false;
      });
      break;
    }
    default:
      return absl::InternalError(absl::StrCat("no way to inject ", kind));
  }
  ++report_.faults[kind];
  return Fired::kDone;
}

absl::StatusOr<ChaosRun::Fired> ChaosRun::FireGroupFault(const PlannedFault& fault,
                                                        const GetStatusResponse& status,
                                                        const std::string& at) {
  // Only while the group is whole: §10.1 promises nothing for a second fault on a degraded group.
  // A leader's or standby's fault acts on a drawn group (pick % K; the rest of the pick chooses
  // the standby), and needs that group whole; etcd is every group's, and an etcd fault needs
  // every group whole.
  const bool etcd_fault =
      fault.kind == FaultKind::kKillEtcdMember || fault.kind == FaultKind::kKillAllEtcd;
  const uint32_t k = static_cast<uint32_t>(shard_groups());
  const int g = etcd_fault ? 0 : static_cast<int>(fault.pick % k);
  const uint32_t pick = fault.pick / k;
  ServerGroup& group = groups_[g];
  std::optional<GetStatusResponse> group_status;
  if (g == 0) {
    group_status = status;
  } else {
    group_status = LeaderStatus(g, kRpcDeadline);
  }
  if (!group_status.has_value() || !GroupWhole(g, *group_status) || group.leader < 0) {
    return Fired::kNoTarget;
  }
  if (etcd_fault && !AllGroupsWhole()) return Fired::kNoTarget;
  const std::string kind = FaultKindName(fault.kind);
  const int leader = group.leader;
  std::string state = absl::StrCat(sharded() ? absl::StrCat("group ", g, ", ") : std::string(),
                                   "epoch ", group.epoch, ", center version ",
                                   CenterVersion(*group_status));
  if (etcd_fault && sharded()) {
    std::vector<std::string> epochs;
    for (int each = 0; each < shard_groups(); ++each) {
      epochs.push_back(absl::StrCat("group ", each, " in epoch ", groups_[each].epoch));
    }
    state = absl::StrJoin(epochs, ", ");
  }
  etcd_member_fault_.reset();
  server_faulted_ = true;
  if (fault.kind == FaultKind::kKillAllEtcd) {
    for (ServerGroup& each : groups_) each.leader_change_expected = true;
  } else {
    group.leader_change_expected = fault.kind == FaultKind::kKillLeader ||
                                   fault.kind == FaultKind::kLeaderDiskLoss ||
                                   fault.kind == FaultKind::kStopLeader ||
                                   fault.kind == FaultKind::kPartitionLeaderFromEtcd;
  }
  switch (fault.kind) {
    case FaultKind::kKillLeader:
    case FaultKind::kLeaderDiskLoss:
    case FaultKind::kRestartStandbyEmpty: {
      int target = leader;
      if (fault.kind == FaultKind::kRestartStandbyEmpty) {
        target = PickStandby(group.members, leader, pick);
      }
      const bool wipe = fault.kind != FaultKind::kKillLeader;
      Member& m = members_[target];
      Log(absl::StrCat(at, kind, ": SIGKILL ", m.name,
                       target == leader ? absl::StrCat(" (the leader: ", state, ")")
                                        : std::string(" (a standby in sync)"),
                       wipe ? " and delete its data directory" : "", "; restart in ",
                       Seconds(fault.duration),
                       wipe ? " with an empty data directory" : " on its data directory"));
      m.down = true;
      group.fault_pending = true;
      RETURN_IF_ERROR(cluster_->KillMember(target));
      if (wipe) {
        std::error_code failed;
        std::filesystem::remove_all(cluster_->member_data_dir(target), failed);
        if (failed) {
          return absl::InternalError(absl::StrCat("cannot delete ",
                                                  cluster_->member_data_dir(target), ": ",
                                                  failed.message()));
        }
      }
      AddPending(
          fault.duration,
          absl::StrCat("restart ", m.name,
                       wipe ? " with an empty data directory" : " on its data directory"),
          [this, target, wipe, g] {
            Member& m = members_[target];
            std::ofstream(cluster_->member(target).log_path(), std::ios::app)
                << "----- chaos: " << m.name << " restarted"
                << (wipe ? " with an empty data directory" : "") << " -----\n";
            if (absl::Status s = cluster_->RestartMember(target, wipe); !s.ok()) {
              Error(absl::StrCat("cannot restart ", m.name, ": ", s.message()));
              return;
            }
            m.down = false;
            m.last_role = GroupStatus::ROLE_UNSPECIFIED;
            groups_[g].fault_pending = false;
            ++report_.member_restarts;
          });
      break;
    }
    case FaultKind::kStopLeader: {
      Member& m = members_[leader];
      const int64_t offset = static_cast<int64_t>(
          ReadFileOrEmpty(cluster_->member(leader).log_path()).size());
      Log(absl::StrCat(at, kind, ": SIGSTOP ", m.name, " (the leader: ", state, ") for ",
                       Seconds(fault.duration), ", past its lease of ",
                       Seconds(absl::Milliseconds(spec_.leader_lease_ms))));
      m.stopped = true;
      group.fault_pending = true;
      cluster_->StopMember(leader);
      const int64_t epoch = group.epoch;
      AddPending(fault.duration, absl::StrCat("SIGCONT ", m.name),
                 [this, leader, offset, epoch, g] {
        cluster_->ResumeMember(leader);
        members_[leader].stopped = false;
        groups_[g].fault_pending = false;
        CheckFencedSoon(leader, offset, epoch);
      });
      break;
    }
    case FaultKind::kPartitionLeaderFromEtcd: {
      Member& m = members_[leader];
      const int64_t offset = static_cast<int64_t>(
          ReadFileOrEmpty(cluster_->member(leader).log_path()).size());
      Log(absl::StrCat(at, kind, ": cut ", m.name, " (the leader: ", state,
                       ") from etcd by a firewall for ", Seconds(fault.duration),
                       ", past its lease of ", Seconds(absl::Milliseconds(spec_.leader_lease_ms)),
                       "; its workers and standbys still reach it"));
      RETURN_IF_ERROR(firewall_->CutFromPorts(m.name, cluster_->etcd()->client_ports()));
      group.fault_pending = true;
      const int64_t epoch = group.epoch;
      AddPending(fault.duration, absl::StrCat("heal ", m.name, "'s links to etcd"),
                 [this, leader, offset, epoch, g] {
        if (absl::Status s = firewall_->Heal(members_[leader].name); !s.ok()) {
          Error(absl::StrCat("cannot heal ", members_[leader].name, ": ", s.message()));
        }
        groups_[g].fault_pending = false;
        CheckFencedSoon(leader, offset, epoch);
      });
      break;
    }
    case FaultKind::kPartitionStandby: {
      const int target = PickStandby(group.members, leader, pick);
      Member& m = members_[target];
      Log(absl::StrCat(at, kind, ": cut ", m.name, " (a standby in sync; ", state,
                       ") from everything by a firewall for ", Seconds(fault.duration)));
      RETURN_IF_ERROR(firewall_->Isolate(m.name));
      group.fault_pending = true;
      AddPending(fault.duration, absl::StrCat("heal ", m.name, "'s links"), [this, target, g] {
        if (absl::Status s = firewall_->Heal(members_[target].name); !s.ok()) {
          Error(absl::StrCat("cannot heal ", members_[target].name, ": ", s.message()));
        }
        groups_[g].fault_pending = false;
      });
      break;
    }
    case FaultKind::kKillEtcdMember: {
      testing::EtcdCluster& etcd = *cluster_->etcd();
      const int i = static_cast<int>(fault.pick % static_cast<uint32_t>(etcd.size()));
      Log(absl::StrCat(at, kind, ": SIGKILL etcd member ", i, " of ", etcd.size(), " (",
                       etcd.client_endpoint(i), "; ", state, "), restart in ",
                       Seconds(fault.duration)));
      etcd.Kill(i);
      etcd_down_[i] = true;
      etcd_fault_pending_ = true;
      etcd_member_fault_ = absl::StrCat("etcd member ", i, " of ", etcd.size(), " was down");
      etcd_member_fault_until_ = absl::InfiniteFuture();
      AddPending(fault.duration, absl::StrCat("restart etcd member ", i), [this, i] {
        if (absl::Status s = cluster_->etcd()->Restart(i); !s.ok()) {
          Error(absl::StrCat("cannot restart etcd member ", i, ": ", s.message()));
          return;
        }
        etcd_down_[i] = false;
        etcd_fault_pending_ = false;
        ++report_.etcd_restarts;
        // A leader that missed its renewals while the member was down fences within a lease.
        etcd_member_fault_until_ = absl::Now() + absl::Milliseconds(2 * spec_.leader_lease_ms);
      });
      break;
    }
    case FaultKind::kKillAllEtcd: {
      testing::EtcdCluster& etcd = *cluster_->etcd();
      Log(absl::StrCat(at, kind, ": SIGKILL every etcd member (", etcd.size(), "; ", state,
                       "), restart in ", Seconds(fault.duration)));
      for (int i = 0; i < etcd.size(); ++i) {
        etcd.Kill(i);
        etcd_down_[i] = true;
      }
      etcd_fault_pending_ = true;
      AddPending(fault.duration, "restart every etcd member", [this] {
        testing::EtcdCluster& etcd = *cluster_->etcd();
        for (int i = 0; i < etcd.size(); ++i) {
          if (absl::Status s = etcd.Restart(i); !s.ok()) {
            Error(absl::StrCat("cannot restart etcd member ", i, ": ", s.message()));
            return;
          }
          etcd_down_[i] = false;
          ++report_.etcd_restarts;
        }
        etcd_fault_pending_ = false;
      });
      break;
    }
    default:
      return absl::InternalError(absl::StrCat(kind, " is no group fault"));
  }
  return Fired::kDone;
}

absl::StatusOr<ChaosRun::Fired> ChaosRun::FireShardServerFault(const PlannedFault& fault,
                                                              const std::string& at) {
  const int g = static_cast<int>(fault.pick % static_cast<uint32_t>(shard_groups()));
  ServerGroup& group = groups_[g];
  const int target = group.members.front();
  Member& m = members_[target];
  if (m.down || m.stopped || group.fault_pending) return Fired::kNoTarget;
  const std::optional<GetStatusResponse> before = MemberStatus(target, kRpcDeadline);
  if (!before.has_value()) return Fired::kNoTarget;
  const std::string kind = FaultKindName(fault.kind);
  const std::string what =
      absl::StrCat(m.name, " (group ", g, g == 0 ? ", the coordinator" : "", "; range version ",
                   CenterVersion(*before), ")");
  server_faulted_ = true;
  group.fault_pending = true;
  if (fault.kind == FaultKind::kStopServer) {
    Log(absl::StrCat(at, kind, ": SIGSTOP ", what, " for ", Seconds(fault.duration)));
    m.stopped = true;
    if (g == 0) server_stopped_ = true;
    cluster_->StopMember(target);
    AddPending(fault.duration, absl::StrCat("SIGCONT ", m.name), [this, target, g, fault] {
      cluster_->ResumeMember(target);
      members_[target].stopped = false;
      groups_[g].fault_pending = false;
      if (g == 0) {
        // The coordinator's failure detector must not count its own stop as the workers'
        // silence (ReapWorkers).
        server_stopped_ = false;
        last_server_stop_ = fault.duration;
        last_server_resume_ = absl::Now();
      }
    });
    return Fired::kDone;
  }
  if (fault.kind != FaultKind::kKillServer) {
    return absl::InternalError(absl::StrCat(kind, " is no server fault"));
  }
  Log(absl::StrCat(at, kind, ": SIGKILL ", what, ", restart in ", Seconds(fault.duration)));
  m.down = true;
  if (g == 0) {
    // As a single server's kill: the restarted coordinator must not be behind, and its trainers
    // must come back under their incarnations.
    before_kill_ = *before;
    before_kill_life_ = server_life_;
    AwaitReconnect(*before);
  } else {
    group.before_kill = *before;
  }
  RETURN_IF_ERROR(cluster_->KillMember(target));
  AddPending(
      fault.duration, absl::StrCat("restart ", m.name, " on its data directory and port"),
      [this, target, g] {
        Member& m = members_[target];
        std::ofstream(cluster_->member(target).log_path(), std::ios::app)
            << "----- chaos: " << m.name << " restarted -----\n";
        if (absl::Status s = cluster_->RestartMember(target, false); !s.ok()) {
          Error(absl::StrCat("cannot restart ", m.name, ": ", s.message()));
          return;
        }
        // The cluster's port file of member i (testing/cluster/cluster.cc).
        absl::StatusOr<int> port = WaitForPortFile(absl::StrCat(dir_, "/port-", target),
                                                   cluster_->member(target), kPortWait);
        if (!port.ok()) {
          Error(absl::StrCat(m.name, " did not start again: ", port.status().message()));
          return;
        }
        m.down = false;
        groups_[g].fault_pending = false;
        ++report_.server_restarts;
        if (g != 0) return;  // PollRangeGroups checks its first answer
        ++server_life_;
        const int life = server_life_;
        AddPending(absl::Milliseconds(spec_.reconnect_grace_ms + spec_.failure_timeout_ms + 1000),
                   "check that the trainers reconnected", [this, life] { CheckReconnected(life); });
      });
  return Fired::kDone;
}

void ChaosRun::Loop() {
  fault_states_.assign(report_.schedule.size(), FaultState());
  while (true) {
    if (absl::Now() > deadline_) {
      std::optional<GetStatusResponse> s = Status();
      Violation(absl::StrCat("the job did not finish within the time limit (",
                             Seconds(options_.time_limit), "); last status:\n",
                             s.has_value() ? s->ShortDebugString() : "(the server does not answer)",
                             "\nserver log:\n", ServerLogs(15)));
      return;
    }
    if (acknowledged_lost_) {
      Note(absl::StrCat("the run stops: an answered sync was lost (above), so the job cannot "
                        "end with every sync applied once\n",
                        ServerLogs(6)));
      return;
    }
    RunDuePending(false);
    ReapWorkers();
    ReapServer();
    PollRangeGroups();
    std::optional<GetStatusResponse> status = Status();
    if (status.has_value()) {
      Observe(*status);
      if (AllFinished(*status)) {
        job_finished_ = true;
        Log("every slot FINISHED");
        return;
      }
      // The due faults in schedule order; one whose target is busy waits (up to kTargetWait)
      // without holding back the next ones. At most one fault per poll.
      const double progress = Progress(*status);
      for (size_t i = 0; i < report_.schedule.size(); ++i) {
        FaultState& state = fault_states_[i];
        const PlannedFault& fault = report_.schedule[i];
        if (state.done || progress < fault.at_progress) continue;
        absl::StatusOr<Fired> fired = Fire(fault, *status);
        if (!fired.ok()) {
          Error(absl::StrCat("cannot inject ", fault.ToString(), ": ", fired.status().message()));
          state.done = true;
        } else if (*fired == Fired::kDone) {
          state.done = true;
        } else if (!state.waiting_since.has_value()) {
          state.waiting_since = absl::Now();
          continue;
        } else if (absl::Now() - *state.waiting_since >
                   (IsGroupFault(fault.kind) ? kGroupTargetWait : kTargetWait)) {
          Note(absl::StrCat("skipped (no target for ",
                            Seconds(IsGroupFault(fault.kind) ? kGroupTargetWait : kTargetWait),
                            IsGroupFault(fault.kind) ? ": the group was not whole" : "",
                            "): ", fault.ToString()));
          ++report_.skipped_faults;
          state.done = true;
          continue;
        } else {
          continue;
        }
        break;
      }
    }
    absl::SleepFor(kPoll);
  }
}

void ChaosRun::AwaitReconnect(const GetStatusResponse& before) {
  awaiting_reconnect_.clear();
  for (const SlotStatus& slot : before.slots()) {
    if (slot.state() != ACTIVE) continue;
    for (const WorkerStatus& w : before.workers()) {
      if (w.incarnation() == slot.owner_incarnation()) {
        awaiting_reconnect_[w.incarnation()] = {slot.slot().replica(), w.name(), {}};
      }
    }
  }
}

void ChaosRun::CheckReconnected(int life, int64_t epoch) {
  // Killed again meanwhile, done, or a run stopped early (its trainers had no time).
  if (life != server_life_ || job_finished_ || cleaning_up_) return;
  std::optional<GetStatusResponse> status = Status(absl::Seconds(2));
  if (!status.has_value()) return;  // stopped meanwhile: the next restart checks again
  // A newer leader answers, not yet noted as such: its own takeover checks the trainers then.
  if (epoch != 0 && status->group().epoch() != epoch) return;
  Observe(*status);
  for (const auto& [incarnation, awaited] : awaiting_reconnect_) {
    const int replica = awaited.replica;
    const std::string& name = awaited.name;
    Worker* w = FindByName(name);
    if (w == nullptr || w->killed || w->was_faulted) continue;  // a fault explains it
    if (replica < status->slots_size() && status->slots(replica).state() == FINISHED) continue;
    const SlotStatus* slot = replica < status->slots_size() ? &status->slots(replica) : nullptr;
    Violation(absl::StrCat(
        name, " (incarnation ", incarnation, ") owned slot ", replica,
        replicated() ? " when the leader changed, was left alone, and did not come back to the new "
                  "leader"
                : " when the server was killed, was left alone, and did not come back to the "
                  "restarted server",
        " within reconnect_grace + failure_timeout: the slot is ",
        slot != nullptr ? SlotState_Name(slot->state()) : "?", " (",
        slot != nullptr ? slot->detail() : "", ")\n", LastLines(w->process->log_path(), 6)));
  }
  awaiting_reconnect_.clear();
}

void ChaosRun::CheckCorruptions() {
  // A flip the schedule did not get to say (its turn passed) counts too, from the trainer's log.
  for (auto& w : workers_) {
    if (w->faults.flip_at_step == 0 || flips_.count(w->name)) continue;
    const std::string log = ReadFileOrEmpty(w->process->log_path());
    if (!absl::StrContains(log, "fault injection: flipped bit")) continue;
    int replica = 0;
    absl::SimpleAtoi(absl::StripPrefix(w->name, "trainer-"), &replica);
    flips_[w->name] = Flip{w->faults.flip_at_step, replica, 0};
    ++report_.corruptions;
  }
  for (const auto& [trainer, flip] : flips_) {
    if (flip.reported) continue;
    if (!flip.synced) {
      ++report_.corruptions_excused;
      Note(absl::StrCat("the flip of ", trainer, " at step ", flip.step, " was not reported: the ",
                        "trainer never synced past it (fenced or killed first, its steps after it "
                        "lost): the corruption never reached the job: excused"));
      continue;
    }
    if (server_faults_ > flip.server_faults_before) {
      ++report_.corruptions_excused;
      Note(absl::StrCat("the flip of ", trainer, " at step ", flip.step, " was not reported; a "
                        "server fault after it may have taken its audit (the server keeps "
                        "waiting windows in memory): excused"));
      continue;
    }
    Violation(absl::StrCat("the flip of ", trainer, " at step ", flip.step,
                           " was never reported (no AUDIT_MISMATCH, no replay mismatch)"));
  }
}

void ChaosRun::CheckRecoveries() {
  for (const auto& [key, r] : recoveries_) {
    const std::string name = absl::StrCat("recovery ", r.task_id(), " (server life ", key.first,
                                          ") of slot ", r.slot().replica());
    if (!r.has_outcome()) {
      if (key.first < server_life_) {
        ++report_.interrupted_recoveries;  // its server was killed
      } else {
        Violation(absl::StrCat(name, " never ended: ", r.ShortDebugString()));
      }
      continue;
    }
    // A corrupted trainer's slot (silent_corruption), lost after its flip: a replay through the
    // flipped step must not verify (that is the corruption reported), and its fallback restarts
    // the slot from the center.
    // Lost after its flip: the server saw it reach the flip, or its replay differs at a flip
    // step (the server's step of a trainer lags its log: "DATA_LOSS: step S: replayed ...").
    int64_t mismatch_step = -1;
    if (r.outcome() == CHECKSUM_MISMATCH) {
      const size_t at = r.detail().find("step ");
      if (at != std::string::npos) {
        const std::string rest = r.detail().substr(at + 5);
        absl::SimpleAtoi(rest.substr(0, rest.find(':')), &mismatch_step);
      }
    }
    Flip* corrupted = nullptr;
    for (auto& [trainer, flip] : flips_) {
      if (flip.replica != r.slot().replica()) continue;
      const Worker* w = FindByName(trainer);
      const int64_t every = w != nullptr ? std::max<int64_t>(1, w->faults.flip_every) : 1;
      const bool at_flip = mismatch_step >= flip.step && (mismatch_step - flip.step) % every == 0;
      if (r.failed_step() >= flip.step || at_flip) corrupted = &flip;
    }
    if (corrupted != nullptr && r.has_outcome() && r.outcome() == CHECKSUM_MISMATCH) {
      if (!corrupted->reported) ++report_.corruptions_reported;
      corrupted->reported = true;
      Log(absl::StrCat(name, " ended CHECKSUM_MISMATCH: its replay caught the flip of step ",
                       corrupted->step));
      continue;
    }
    // The fallback of that replay, or the restart of a quarantine: from the center.
    bool caught_here = false;
    for (const auto& [trainer, flip] : flips_) {
      caught_here |= flip.replica == r.slot().replica() && flip.reported;
    }
    if ((corrupted != nullptr || caught_here) && r.has_outcome() && r.outcome() == RECOVERED &&
        r.policy() == RESTART_FROM_CENTER) {
      continue;
    }
    switch (r.outcome()) {
      case RECOVERED:
        if (r.policy() != REPLAY || !r.verified()) {
          Violation(absl::StrCat(
              name, " rebuilt the slot without a verified replay: ", r.ShortDebugString()));
        } else {
          ++report_.recoveries;
          report_.steps_replayed += r.steps_replayed();
        }
        break;
      case SPARE_FAILED:
      case ABANDONED:
        ++report_.interrupted_recoveries;
        break;
      default:
        Violation(absl::StrCat(name, " ended ", RecoveryOutcome_Name(r.outcome()), ": ",
                               r.ShortDebugString()));
    }
  }
}

std::optional<TensorBundle> ChaosRun::CheckStore(const std::string& data_dir,
                                                 const std::string& whose, int g) {
  storage::DurableStoreOptions options;
  options.data_dir = data_dir;
  auto store = storage::DurableStore::Open(options);
  if (!store.ok()) {
    Violation(absl::StrCat("cannot open ", whose, " after it stopped: ", store.status().message()));
    return std::nullopt;
  }
  auto state = (*store)->LoadAll();
  if (!state.ok()) {
    Violation(absl::StrCat("cannot read ", whose, " back: ", state.status().message()));
    return std::nullopt;
  }
  std::optional<TensorBundle> stored;
  auto center = state->centers.find(0);
  if (center == state->centers.end()) {
    Violation(absl::StrCat(whose, " holds no center"));
  } else {
    stored = center->second.params();
    if (center->second.version() != rounds_ * spec_.replicas) {
      Violation(absl::StrCat("the center in ", whose, " is at version ", center->second.version(),
                             ", not ", rounds_ * spec_.replicas, " (", spec_.replicas,
                             " slots x ", rounds_, " syncs)"));
    }
    const TensorBundle& served =
        sharded() && g < static_cast<int>(range_centers_.size()) ? range_centers_[g].center()
                                                                 : report_.center;
    if (!SameBytes(center->second.params(), served)) {
      Violation(absl::StrCat("the ", sharded() ? "range" : "center", " in ", whose,
                             " differs from the one the server served at the end"));
    }
  }
  if (sharded()) {
    // Each slot's last two range snapshots (copy = sync number mod 2): the syncs of
    // max_steps - tau and max_steps, each applied once.
    const std::set<int64_t> expected = {spec_.max_steps - spec_.sync_period, spec_.max_steps};
    for (int r = 0; r < spec_.replicas; ++r) {
      std::set<int64_t> steps;
      for (int copy = 0; copy < 2; ++copy) {
        auto kept = state->range_snapshots.find({{r, 0}, copy});
        if (kept != state->range_snapshots.end()) steps.insert(kept->second.step());
      }
      if (steps != expected) {
        Violation(absl::StrCat("slot ", r, " in ", whose, ": range snapshots at steps [",
                               absl::StrJoin(steps, ", "), "], expected [",
                               absl::StrJoin(expected, ", "), "]"));
      }
    }
    // The slots' books (weights, snapshot headers, states) are group 0's.
    if (g != 0) return stored;
  }
  for (int r = 0; r < spec_.replicas; ++r) {
    auto weight = state->weights.find({r, 0});
    auto snapshot = state->snapshots.find({r, 0});
    auto slot = state->slots.find({r, 0});
    if (weight == state->weights.end() || weight->second.update_count() != rounds_ ||
        weight->second.last_update_step() != spec_.max_steps) {
      Violation(absl::StrCat(
          "slot ", r, " in ", whose, ": ",
          weight == state->weights.end()
              ? std::string("no weight record")
              : absl::StrCat(weight->second.update_count(), " syncs applied, the last at step ",
                             weight->second.last_update_step()),
          "; expected ", rounds_, " syncs, the last at step ", spec_.max_steps));
    }
    if (snapshot == state->snapshots.end() || snapshot->second.step() != spec_.max_steps) {
      Violation(absl::StrCat("slot ", r, " in ", whose, ": snapshot at step ",
                             snapshot == state->snapshots.end() ? -1 : snapshot->second.step(),
                             ", expected ", spec_.max_steps));
    }
    if (slot == state->slots.end() || slot->second.state() != FINISHED) {
      Violation(absl::StrCat("slot ", r, " in ", whose, " is not FINISHED"));
    }
  }
  return stored;
}

void ChaosRun::FinishAndCheck() {
  // Every worker gets STOP with its next heartbeat and exits.
  const absl::Time until = absl::Now() + kExitWait;
  while (absl::Now() < until) {
    ReapWorkers();
    bool all_exited = true;
    for (auto& w : workers_) all_exited = all_exited && w->exit_code.has_value();
    if (all_exited) break;
    absl::SleepFor(kPoll);
  }
  int exited = 0;
  for (auto& w : workers_) exited += w->exit_code.has_value() ? 1 : 0;
  Log(absl::StrCat(exited, " of ", workers_.size(), " worker processes exited"));
  for (auto& w : workers_) {
    if (w->exit_code.has_value()) continue;
    Violation(absl::StrCat(w->name, " did not exit within ", Seconds(kExitWait),
                           " of the job's end:\n", LastLines(w->process->log_path(), 6)));
    w->exit_code = w->process->Stop(absl::Seconds(5));
  }

  std::vector<GetStatusResponse> final_statuses;  // group or sharded mode: each group's
  if (clustered()) {
    // Every member restarted during the run must be back in sync (it caught up, it rejoined),
    // every group's server answering.
    const absl::Time in_sync_by = absl::Now() + kInSyncWait;
    for (int g = 0; g < shard_groups(); ++g) {
      std::optional<GetStatusResponse> last;
      while (true) {
        RunDuePending(true);
        ReapServer();
        last = LeaderStatus(g, kRpcDeadline);
        if (last.has_value() && GroupWhole(g, *last)) break;
        if (absl::Now() > in_sync_by) {
          Violation(absl::StrCat(
              sharded() ? absl::StrCat("group ", g) : std::string("the group"),
              " was not whole again (a leader, every standby in sync) within ",
              Seconds(kInSyncWait), " of the job's end; last: ",
              last.has_value() ? last->group().ShortDebugString()
                               : std::string("no leader answers"),
              "\n", ServerLogs(8)));
          break;
        }
        absl::SleepFor(kPoll);
      }
    }
    for (int g = 0; g < shard_groups(); ++g) {
      std::optional<GetStatusResponse> last = LeaderStatus(g, absl::Seconds(5));
      if (!last.has_value()) {
        Error(absl::StrCat("no leader of ", sharded() ? absl::StrCat("group ", g) : "the group",
                           " answers after the job's end"));
        return;
      }
      final_statuses.push_back(*last);
    }
  }
  std::optional<GetStatusResponse> status = Status(absl::Seconds(5));
  if (!status.has_value()) {
    Error(clustered() ? "no leader answers after the job's end"
                      : "the server does not answer after the job's end");
    return;
  }
  Observe(*status);
  ParameterServer::Stub* stub = ServerStub();
  // The final center, pulled by an observer (a spare that never heartbeats).
  RegisterRequest request;
  request.set_job_id(kJobId);
  request.set_worker_name("chaos-observer");
  request.set_requested_role(SPARE);
  RegisterResponse registered;
  {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    const grpc::Status s = stub->Register(&context, request, &registered);
    if (!s.ok()) {
      Error(absl::StrCat("cannot register an observer: ", s.error_message()));
      return;
    }
  }
  if (sharded()) {
    if (!GatherCenter(registered)) return;
  } else {
    PullRequest pull;
    pull.set_incarnation(registered.incarnation());
    pull.set_stage(0);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    context.AddMetadata(kWorkerCredentialKey, registered.credential());
    PullResponse pulled;
    const grpc::Status s = stub->Pull(&context, pull, &pulled);
    if (!s.ok()) {
      Error(absl::StrCat("cannot pull the final center: ", s.error_message()));
      return;
    }
    report_.center = pulled.center();
    report_.center_version = pulled.center_version();
  }

  // Exactly once, as the server reports it (group 0's books in sharded mode).
  for (const SlotStatus& slot : status->slots()) {
    if (slot.update_count() != rounds_ || slot.snapshot_step() != spec_.max_steps) {
      Violation(absl::StrCat("slot ", slot.slot().replica(), " applied ", slot.update_count(),
                             " syncs (snapshot at step ", slot.snapshot_step(), "); expected ",
                             rounds_, " (snapshot at step ", spec_.max_steps, ")"));
    }
  }
  // Center integrity (issue R9): a finite center, and no sync refused but the byzantine ones.
  {
    int64_t non_finite = 0;
    for (const Tensor& tensor : report_.center.tensors()) {
      for (size_t i = 0; i + sizeof(float) <= tensor.data().size(); i += sizeof(float)) {
        float value;
        std::memcpy(&value, tensor.data().data() + i, sizeof(float));
        if (!std::isfinite(value)) ++non_finite;
      }
    }
    if (non_finite > 0) {
      Violation(absl::StrCat("the final center holds ", non_finite, " non-finite values"));
    }
    int64_t refused = 0;
    for (const SlotStatus& slot : status->slots()) refused += slot.refused_updates();
    if (refused > report_.byzantine_refused) {
      Violation(absl::StrCat("the server refused ", refused, " syncs (GetStatus), but only ",
                             report_.byzantine_refused, " came from byzantine trainers"));
    }
  }
  if (sharded()) {
    // Exactly once per range: every group's range moved once per sync of every slot, as its
    // GetStatus and its PullRange say.
    for (int g = 0; g < shard_groups(); ++g) {
      const int64_t reported = CenterVersion(final_statuses[g]);
      const int64_t pulled = range_centers_[g].center_version();
      report_.range_versions.push_back(pulled);
      if (reported != rounds_ * spec_.replicas || pulled != rounds_ * spec_.replicas) {
        Violation(absl::StrCat("range ", g, " moved ", reported, " times (GetStatus of group ", g,
                               "; PullRange: ", pulled, "), not ", rounds_ * spec_.replicas, " (",
                               spec_.replicas, " slots x ", rounds_, " syncs)"));
      }
    }
  } else if (report_.center_version != rounds_ * spec_.replicas) {
    Violation(absl::StrCat("the center moved ", report_.center_version, " times, not ",
                           rounds_ * spec_.replicas, " (", spec_.replicas, " slots x ", rounds_,
                           " syncs)"));
  }
  CheckRecoveries();
  CheckCorruptions();
  if (clustered()) {
    for (int g = 0; g < shard_groups(); ++g) {
      if (groups_[g].leader >= 0) CheckAcknowledged(groups_[g].leader, "at the job's end");
    }
    StopClusterAndCheckStores(final_statuses);
  } else {
    StopServerAndCheckStore();
  }

  absl::StatusOr<double> accuracy = TestAccuracy(job_, report_.center);
  if (accuracy.ok()) {
    report_.accuracy = *accuracy;
    Log(absl::StrFormat("final center: version %d, test accuracy %.4f", report_.center_version,
                        report_.accuracy));
  } else {
    Error(absl::StrCat("cannot evaluate the final center: ", accuracy.status().message()));
  }
}

bool ChaosRun::GatherCenter(const RegisterResponse& observer) {
  absl::StatusOr<compute::StageLayout> layout =
      compute::StageLayout::Create(job_.model(), 0, job_.model().layers_size());
  if (!layout.ok()) {
    Error(absl::StrCat("the job's layout: ", layout.status().message()));
    return false;
  }
  const std::vector<int64_t> begins = compute::RangeBegins(layout->packed_size(), shard_groups());
  std::vector<float> packed;
  packed.reserve(layout->packed_size());
  range_centers_.clear();
  for (int g = 0; g < shard_groups(); ++g) {
    const int leader = groups_[g].leader;
    if (leader < 0) {
      Error(absl::StrCat("group ", g, " has no leader to pull range ", g, " from"));
      return false;
    }
    PullRangeRequest pull;
    pull.set_incarnation(observer.incarnation());
    pull.set_stage(0);
    pull.set_range(g);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    context.AddMetadata(kWorkerCredentialKey, observer.credential());
    PullRangeResponse pulled;
    const grpc::Status s = members_[leader].range->PullRange(&context, pull, &pulled);
    if (!s.ok()) {
      Error(absl::StrCat("cannot pull range ", g, " from ", members_[leader].name, ": ",
                         s.error_message()));
      return false;
    }
    const int64_t expected = begins[g + 1] - begins[g];
    if (pulled.center().tensors_size() != 1 ||
        static_cast<int64_t>(pulled.center().tensors(0).data().size()) !=
            expected * static_cast<int64_t>(sizeof(float))) {
      Violation(absl::StrCat("range ", g, " as pulled from ", members_[leader].name, " is not ",
                             expected, " floats in one tensor: ",
                             pulled.center().ShortDebugString().substr(0, 200)));
      return false;
    }
    const std::string& bytes = pulled.center().tensors(0).data();
    const size_t at = packed.size();
    packed.resize(at + expected);
    std::memcpy(packed.data() + at, bytes.data(), bytes.size());
    range_centers_.push_back(std::move(pulled));
  }
  report_.center = compute::BundleFromPacked(*layout, packed);
  report_.center_version = range_centers_[0].center_version();
  return true;
}

void ChaosRun::StopServerAndCheckStore() {
  // The durable record, read back once the server has stopped.
  server_->Signal(SIGTERM);
  const std::optional<int> code = server_->WaitFor(kServerStopWait);
  if (code != 0) {
    Violation(
        absl::StrCat("rebound_server did not stop cleanly on SIGTERM (",
                     code.has_value() ? absl::StrCat("exit ", *code) : std::string("still running"),
                     "):\n", LastLines(dir_ + "/server.log", 10)));
    server_->Signal(SIGKILL);
    server_->WaitFor(kKillWait);
  }
  Log(absl::StrCat("rebound_server stopped (exit ", code.value_or(-1),
                   "); reading its store back"));
  CheckStore(dir_ + "/data", "the server's store", 0);
}

void ChaosRun::StopClusterAndCheckStores(const std::vector<GetStatusResponse>& final_statuses) {
  // Every group's standbys first, then the leaders: a leader stopped first would hand over to a
  // standby.
  std::vector<int> order;
  for (const ServerGroup& group : groups_) {
    for (int i : group.members) {
      if (i != group.leader) order.push_back(i);
    }
  }
  for (const ServerGroup& group : groups_) {
    if (group.leader >= 0) order.push_back(group.leader);
  }
  for (int i : order) {
    Member& m = members_[i];
    if (m.down) continue;
    const bool leader = i == groups_[m.group].leader;
    ChildProcess& process = cluster_->member(i);
    process.Signal(SIGCONT);
    process.Signal(SIGTERM);
    const std::optional<int> code = process.WaitFor(kServerStopWait);
    if (code != 0) {
      Violation(absl::StrCat(
          m.name, !replicated() ? "" : leader ? " (the leader)" : " (a standby)",
          " did not stop cleanly on SIGTERM (",
          code.has_value() ? absl::StrCat("exit ", *code) : std::string("still running"), "):\n",
          LastLines(process.log_path(), 10)));
      process.Signal(SIGKILL);
      process.WaitFor(kKillWait);
    }
    m.down = true;  // stopped for good
  }
  Log("every member stopped; reading their stores back");
  for (int g = 0; g < shard_groups(); ++g) {
    if (groups_[g].leader < 0) {
      Error(absl::StrCat("no leader of group ", g, " known at the end: no store compared"));
      return;
    }
  }
  // Each group's final leader's store, then every member the leader had in sync at the end: each
  // must hold every sync once and the center (range) the leader served.
  for (int g = 0; g < shard_groups(); ++g) {
    const ServerGroup& group = groups_[g];
    const int leader = group.leader;
    const std::string of_group = sharded() ? absl::StrCat(" of group ", g) : "";
    CheckStore(cluster_->member_data_dir(leader),
               absl::StrCat(members_[leader].name, "'s store",
                            replicated() ? absl::StrCat(" (the final leader", of_group, ")")
                                         : of_group),
               g);
    ++report_.members_compared;
    if (!replicated()) continue;
    const GetStatusResponse& final_status = final_statuses[g];
    std::set<std::string> in_sync(final_status.group().in_sync().begin(),
                                  final_status.group().in_sync().end());
    for (int i : group.members) {
      if (i == leader) continue;
      if (in_sync.count(members_[i].name) == 0) {
        Note(absl::StrCat(members_[i].name,
                          " was not in sync at the end: its store is not compared"));
        continue;
      }
      CheckStore(cluster_->member_data_dir(i),
                 absl::StrCat(members_[i].name, "'s store (in sync at the end", of_group, ")"), g);
      ++report_.members_compared;
    }
  }
}

void ChaosRun::Cleanup() {
  cleaning_up_ = true;
  RunDuePending(true);
  for (auto& w : workers_) {
    if (!w->exit_code.has_value()) w->exit_code = w->process->Stop(absl::Seconds(5));
  }
  if (server_ != nullptr && !server_->Poll().has_value()) server_->Stop(absl::Seconds(10));
  workers_.clear();
  server_.reset();
  members_.clear();
  cluster_.reset();  // its members, then etcd
  firewall_.reset();  // its rules and cgroups, once the members are gone
  lab_.reset();
}

RunReport ChaosRun::Execute(const RunReport* reference) {
  start_ = absl::Now();
  deadline_ = start_ + options_.time_limit;
  report_.seed = options_.seed;
  report_.shard_groups = shard_groups();
  if (options_.server_binary.empty() || options_.worker_binary.empty()) {
    Error("ChaosOptions: server_binary and worker_binary are required");
    return report_;
  }
  if (absl::Status s = Setup(); !s.ok()) {
    Error(absl::StrCat("setup: ", s.message()));
  } else {
    Loop();
    for (const FaultState& state : fault_states_) report_.unfired_faults += state.done ? 0 : 1;
    if (report_.unfired_faults > 0) {
      Note(absl::StrCat(report_.unfired_faults, " planned fault(s) not injected: the job ",
                        job_finished_ ? "finished" : "stopped", " before their turn"));
    }
    if (job_finished_) {
      report_.finished = true;
      RunDuePending(true);  // resume and heal whatever is still faulted
      FinishAndCheck();
    }
  }
  Cleanup();
  if (reference != nullptr && report_.accuracy >= 0 && reference->accuracy >= 0) {
    report_.reference_accuracy = reference->accuracy;
    report_.center_identical = SameBytes(report_.center, reference->center);
    if (std::abs(report_.accuracy - reference->accuracy) > kAccuracyTolerance) {
      Violation(
          absl::StrFormat("final test accuracy %.4f, the fault-free run's %.4f: more than "
                          "1 point apart",
                          report_.accuracy, reference->accuracy));
    }
    // A silent corruption the center absorbed (syncs before it was caught) changes it.
    if (spec_.deterministic && !spec_.dynamic_weights && !report_.center_identical &&
        report_.corruptions == 0) {
      Violation(
          "DETERMINISTIC scheduling with UNIFORM weights: the final center differs from "
          "the fault-free run's");
    }
  }
  report_.seconds = absl::ToDoubleSeconds(absl::Now() - start_);
  if (!dir_.empty()) {
    if (report_.ok() && !options_.keep_dir) {
      std::error_code ignored;
      std::filesystem::remove_all(dir_, ignored);
    } else {
      report_.dir = dir_;
    }
  }
  return report_;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Public functions

JobConfig MakeChaosJob(const ChaosJob& spec) {
  JobConfig job;
  job.set_job_id(kJobId);
  ModelSpec* model = job.mutable_model();
  model->add_layers()->set_width(spec.hidden);
  LayerSpec* out = model->add_layers();
  out->set_width(10);
  out->set_activation(IDENTITY);
  job.mutable_topology()->set_replicas(spec.replicas);
  DataConfig* data = job.mutable_data();
  data->set_batch_size(spec.batch_size);
  data->set_micro_batches(4);
  data->set_train_limit(spec.train_limit);
  data->set_test_limit(spec.test_limit);
  job.mutable_adahessian()->set_lr(0.01);
  job.mutable_easgd()->set_sync_period(spec.sync_period);
  job.mutable_weighting()->set_policy(spec.dynamic_weights ? DYNAMIC : UNIFORM);
  if (spec.dynamic_weights) job.mutable_weighting()->set_fault_half_life_s(spec.fault_half_life_s);
  job.set_scheduling(spec.deterministic ? DETERMINISTIC : ASYNC);
  FaultToleranceConfig* ft = job.mutable_fault_tolerance();
  ft->set_policy(REPLAY);
  ft->set_heartbeat_interval_ms(spec.heartbeat_interval_ms);
  ft->set_failure_timeout_ms(spec.failure_timeout_ms);
  ft->set_reconnect_grace_ms(spec.reconnect_grace_ms);
  ft->set_recovery_parallelism(spec.recovery_parallelism);
  ft->set_recovery_timeout_ms(30000);
  // A short linger, so that a replay has logged steps to rebuild within a round of a few
  // hundred milliseconds.
  job.mutable_step_log()->set_linger_ms(20);
  job.mutable_training()->set_max_steps(spec.max_steps);
  job.mutable_training()->set_eval_every_ms(spec.eval_every_ms);
  if (spec.audit) {
    AuditConfig* audit = job.mutable_audit();
    audit->set_fraction(1);
    audit->set_max_concurrent(16);
    audit->set_on_mismatch(AUDIT_REPORT);
  }
  return job;
}

const std::vector<FaultKind>& AllFaultKinds() {
  static const std::vector<FaultKind>* kAll = [] {
    auto* all = new std::vector<FaultKind>;
    for (const KindInfo& info : kKinds) {
      if (!IsFirewallFault(info.kind) && info.kind != FaultKind::kSilentCorruption) {
        all->push_back(info.kind);
      }
    }
    return all;
  }();
  return *kAll;
}

const std::vector<FaultKind>& NamedOnlyFaultKinds() {
  static const std::vector<FaultKind> kNamed = {FaultKind::kSilentCorruption};
  return kNamed;
}

const std::vector<FaultKind>& FirewallFaultKinds() {
  static const std::vector<FaultKind>* kFirewall = new std::vector<FaultKind>{
      FaultKind::kPartitionLeaderFromEtcd, FaultKind::kPartitionStandby};
  return *kFirewall;
}

bool IsFirewallFault(FaultKind kind) {
  return kind == FaultKind::kPartitionLeaderFromEtcd || kind == FaultKind::kPartitionStandby;
}

const char* FaultKindName(FaultKind kind) { return Info(kind).name; }

bool IsNetworkFault(FaultKind kind) {
  return kind == FaultKind::kPartition || kind == FaultKind::kThrottle ||
         kind == FaultKind::kDelay || kind == FaultKind::kLoss;
}

const std::vector<FaultKind>& GroupFaultKinds() {
  static const std::vector<FaultKind>* kGroup = [] {
    auto* kinds = new std::vector<FaultKind>;
    for (const KindInfo& info : kKinds) {
      if (IsGroupFault(info.kind) && !IsFirewallFault(info.kind)) kinds->push_back(info.kind);
    }
    return kinds;
  }();
  return *kGroup;
}

bool IsGroupFault(FaultKind kind) {
  switch (kind) {
    case FaultKind::kKillLeader:
    case FaultKind::kLeaderDiskLoss:
    case FaultKind::kStopLeader:
    case FaultKind::kKillEtcdMember:
    case FaultKind::kKillAllEtcd:
    case FaultKind::kRestartStandbyEmpty:
    case FaultKind::kPartitionLeaderFromEtcd:
    case FaultKind::kPartitionStandby:
      return true;
    default:
      return false;
  }
}

bool IsSingleServerFault(FaultKind kind) {
  return kind == FaultKind::kKillServer || kind == FaultKind::kStopServer;
}

bool IsShardedFault(FaultKind kind) { return kind == FaultKind::kDieBetweenRanges; }

bool KindFitsMode(FaultKind kind, const ChaosOptions& options) {
  const bool replicated = options.standbys > 0;
  const bool sharded = options.shard_groups > 1;
  if (IsGroupFault(kind)) return replicated;
  if (IsSingleServerFault(kind)) return !replicated;
  if (IsShardedFault(kind)) return sharded;
  // The trainer poisons only the unsharded Sync (worker/easgd_trainer.cc).
  if (kind == FaultKind::kByzantine) return !sharded;
  return true;
}

bool SameCenter(const RunReport& a, const RunReport& b) { return SameBytes(a.center, b.center); }

std::string PlannedFault::ToString() const {
  std::string out = absl::StrFormat("%s at progress %.2f", FaultKindName(kind), at_progress);
  switch (kind) {
    case FaultKind::kKillTrainer:
    case FaultKind::kKillSpare:
    case FaultKind::kKillEvaluator:
    case FaultKind::kByzantine:
    case FaultKind::kDieBetweenRanges:
    case FaultKind::kSilentCorruption:
      break;
    case FaultKind::kKillServer:
    case FaultKind::kKillLeader:
    case FaultKind::kKillEtcdMember:
    case FaultKind::kKillAllEtcd:
      absl::StrAppend(&out, ", restarted after ", Seconds(duration));
      break;
    case FaultKind::kLeaderDiskLoss:
    case FaultKind::kRestartStandbyEmpty:
      absl::StrAppend(&out, ", restarted empty after ", Seconds(duration));
      break;
    case FaultKind::kThrottle:
      absl::StrAppend(&out, ", ", rate_kbit, " kbit/s for ", Seconds(duration));
      break;
    case FaultKind::kDelay:
      absl::StrAppend(&out, ", ", delay_ms, " ms for ", Seconds(duration));
      break;
    case FaultKind::kLoss:
      absl::StrAppend(&out, absl::StrFormat(", %.1f%% for ", loss_percent), Seconds(duration));
      break;
    default:
      absl::StrAppend(&out, " for ", Seconds(duration));
  }
  return out;
}

std::vector<PlannedFault> PlanFaults(uint64_t seed, int count,
                                     const std::vector<FaultKind>& allowed,
                                     const std::vector<FaultKind>& must_include,
                                     const ChaosJob& job) {
  std::vector<PlannedFault> plan;
  if (count <= 0 || allowed.empty()) return plan;
  std::mt19937_64 random(seed);
  auto uniform = [&random](double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(random);
  };
  std::vector<FaultKind> kinds;
  for (FaultKind kind : must_include) {
    if (static_cast<int>(kinds.size()) < count &&
        std::find(allowed.begin(), allowed.end(), kind) != allowed.end() &&
        std::find(kinds.begin(), kinds.end(), kind) == kinds.end()) {
      kinds.push_back(kind);
    }
  }
  int total_weight = 0;
  for (FaultKind kind : allowed) total_weight += Info(kind).weight;
  while (static_cast<int>(kinds.size()) < count) {
    int draw = std::uniform_int_distribution<int>(0, total_weight - 1)(random);
    for (FaultKind kind : allowed) {
      draw -= Info(kind).weight;
      if (draw < 0) {
        kinds.push_back(kind);
        break;
      }
    }
  }
  std::shuffle(kinds.begin(), kinds.end(), random);
  std::vector<double> points;
  for (int i = 0; i < count; ++i) points.push_back(uniform(0.08, 0.8));
  std::sort(points.begin(), points.end());
  const double timeout_ms = job.failure_timeout_ms;
  for (int i = 0; i < count; ++i) {
    PlannedFault f;
    f.kind = kinds[i];
    f.at_progress = points[i];
    f.pick = static_cast<uint32_t>(random());
    switch (f.kind) {
      case FaultKind::kKillServer:
        f.duration = absl::Milliseconds(uniform(0, 1500));
        break;
      case FaultKind::kStopTrainer:
      case FaultKind::kStopSpare:
      case FaultKind::kStopEvaluator:
      case FaultKind::kStopServer:
      case FaultKind::kPartition:
        // From well below the failure timeout to well past it.
        f.duration = absl::Milliseconds(uniform(0.3, 2.5) * timeout_ms);
        break;
      case FaultKind::kThrottle:
      case FaultKind::kDelay:
      case FaultKind::kLoss:
        f.duration = absl::Milliseconds(uniform(1000, 4000));
        break;
      case FaultKind::kKillLeader:
      case FaultKind::kLeaderDiskLoss:
        // Shorter and longer than the lease the standby waits out before it takes over.
        f.duration = absl::Milliseconds(uniform(500, 4000));
        break;
      case FaultKind::kRestartStandbyEmpty:
        f.duration = absl::Milliseconds(uniform(0, 2000));
        break;
      case FaultKind::kStopLeader:
      case FaultKind::kPartitionLeaderFromEtcd:
        // Past the lease, so that a standby has taken over when it resumes (is healed).
        f.duration = absl::Milliseconds(uniform(1.6, 2.6) * job.leader_lease_ms);
        break;
      case FaultKind::kPartitionStandby:
        // Shorter and longer than the failure timeout after which the leader drops it.
        f.duration = absl::Milliseconds(uniform(0.5, 3.0) * job.failure_timeout_ms);
        break;
      case FaultKind::kKillEtcdMember:
        f.duration = absl::Milliseconds(uniform(1000, 5000));
        break;
      case FaultKind::kKillAllEtcd:
        // From about the leader's self-fencing (half a lease) to well past the lease.
        f.duration = absl::Milliseconds(uniform(0.5, 2.0) * job.leader_lease_ms);
        break;
      default:
        break;
    }
    f.rate_kbit = static_cast<int>(uniform(2000, 16000));
    f.delay_ms = static_cast<int>(uniform(20, 300));
    f.loss_percent = uniform(1, 15);
    plan.push_back(f);
  }
  return plan;
}

absl::Duration MaxFaultDuration(const ChaosJob& job) {
  return std::max({absl::Milliseconds(3.0 * job.failure_timeout_ms),
                   absl::Milliseconds(2.6 * job.leader_lease_ms), absl::Seconds(5)});
}

int RunReport::total_faults() const {
  int total = 0;
  for (const auto& [kind, n] : faults) total += n;
  return total;
}

std::string RunReport::FaultsByKind() const {
  std::vector<std::string> parts;
  for (const KindInfo& info : kKinds) {
    auto it = faults.find(info.name);
    if (it != faults.end() && it->second > 0) {
      parts.push_back(absl::StrCat(info.name, "=", it->second));
    }
  }
  return parts.empty() ? "none" : absl::StrJoin(parts, " ");
}

std::string RunReport::Summary() const {
  std::string out = absl::StrFormat(
      "seed %d: %s in %.1f s; faults injected %d of %d planned (%s)%s; recoveries %d "
      "(REPLAY, verified, %d steps replayed) + %d interrupted; server restarts %d (trainers "
      "reconnected %d); replacement workers %d\n",
      seed, finished ? "finished" : "NOT FINISHED", seconds, total_faults(), faults_planned,
      FaultsByKind(),
      absl::StrCat(skipped_faults > 0
                       ? absl::StrCat(", ", skipped_faults, " skipped for want of a target")
                       : "",
                   unfired_faults > 0
                       ? absl::StrCat(", ", unfired_faults, " not reached before the job's end")
                       : ""),
      recoveries, steps_replayed, interrupted_recoveries, server_restarts, reconnected_trainers,
      replacements);
  if (byzantine_refused > 0) {
    absl::StrAppend(&out, "  byzantine trainers refused and exited: ", byzantine_refused, "\n");
  }
  if (corruptions > 0 || audits_matched > 0) {
    absl::StrAppend(&out, "  silent corruptions: ", corruptions, " flipped, ", corruptions_reported,
                    " reported, ", corruptions_excused, " excused (never synced past, or a server fault after); ",
                    audits_matched, " audits matched\n");
  }
  if (fenced_by_server_stop > 0) {
    absl::StrAppend(&out, "  ", fenced_by_server_stop,
                    " worker(s) left alone were fenced as the server resumed from a SIGSTOP "
                    "(it counted its own stop as their silence: a violation)\n");
  }
  absl::StrAppend(&out, "  ", network, "\n");
  if (!group.empty()) {
    absl::StrAppend(&out, "  ", group, "\n");
    if (shard_groups > 1) {
      absl::StrAppend(
          &out,
          absl::StrFormat("  sharded: %d groups, range versions [%s]; trainers died between "
                          "ranges %d; server restarts %d; leader changes %d; members restarted "
                          "%d; etcd members restarted %d; stopped leaders fenced %d; syncs "
                          "answered to trainers %d (every group at or past them); stores read "
                          "back %d\n",
                          shard_groups, absl::StrJoin(range_versions, ", "), died_between_ranges,
                          server_restarts, leader_changes, member_restarts, etcd_restarts,
                          fenced_leaders, acknowledged_syncs, members_compared));
    } else {
      absl::StrAppend(
          &out,
          absl::StrFormat("  leader changes %d; members restarted %d; etcd members restarted %d; "
                          "stopped leaders fenced %d; syncs answered to trainers %d (every "
                          "leader at or past them); stores read back %d\n",
                          leader_changes, member_restarts, etcd_restarts, fenced_leaders,
                          acknowledged_syncs, members_compared));
    }
  }
  if (accuracy >= 0) {
    absl::StrAppend(&out, absl::StrFormat("  final center: version %d, test accuracy %.4f",
                                          center_version, accuracy));
    if (reference_accuracy >= 0) {
      absl::StrAppend(
          &out, absl::StrFormat(" (fault-free %.4f, %+.2f points; center %s)", reference_accuracy,
                                100 * (accuracy - reference_accuracy),
                                center_identical ? "bit-identical" : "not bit-identical"));
    }
    if (evaluator_accuracy >= 0) {
      absl::StrAppend(&out, absl::StrFormat("; evaluator's last report %.4f", evaluator_accuracy));
    }
    absl::StrAppend(&out, "\n");
  }
  absl::StrAppend(&out, "  violations: ", violations.size(), ", errors: ", errors.size(), "\n");
  for (const std::string& v : violations) absl::StrAppend(&out, "  VIOLATION: ", v, "\n");
  for (const std::string& e : errors) absl::StrAppend(&out, "  ERROR: ", e, "\n");
  if (!dir.empty()) absl::StrAppend(&out, "  logs kept in ", dir, "\n");
  return out;
}

RunReport RunChaos(const ChaosJob& job, const ChaosOptions& options, const RunReport* reference) {
  return ChaosRun(job, options).Execute(reference);
}

}  // namespace rebound::chaos
