#include "tests/chaos/chaos.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
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
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/file.h"
#include "common/security.h"
#include "common/status_macros.h"
#include "compute/cpu/cpu_backend.h"
#include "compute/step.h"
#include "compute/tensor_bundle.h"
#include "google/protobuf/text_format.h"
#include "grpcpp/grpcpp.h"
#include "proto/rebound.grpc.pb.h"
#include "storage/durable_store.h"
#include "testing/cluster/network.h"
#include "testing/cluster/processes.h"
#include "worker/data/fashion_mnist.h"
#include "worker/slot_compute.h"

namespace rebound::chaos {
namespace {

// The harness's processes, partitions and log tails are the testing/cluster library's.
using ::rebound::testing::LastLines;
using ::rebound::testing::NetworkLab;
using ::rebound::testing::WaitForPortFile;

constexpr absl::Duration kPoll = absl::Milliseconds(50);
constexpr absl::Duration kRpcDeadline = absl::Seconds(1);
constexpr absl::Duration kStartWait = absl::Seconds(90);   // every slot ACTIVE at the start
constexpr absl::Duration kPortWait = absl::Seconds(30);    // a (re)started server listening
constexpr absl::Duration kKillWait = absl::Seconds(10);    // a SIGKILLed process reaped
constexpr absl::Duration kTargetWait = absl::Seconds(20);  // a fault waiting for a target
constexpr absl::Duration kExitWait = absl::Seconds(30);    // workers after the job's end
constexpr absl::Duration kServerStopWait = absl::Seconds(20);
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

// A worker process of the run. Its name is unique in the run and is what the server reports.
struct Worker {
  std::string name;
  std::string role;  // the --role it was started with: trainer, spare or evaluator
  std::unique_ptr<ChildProcess> process;
  int host = -1;             // its NetworkLab host, -1: the harness's namespace
  bool killed = false;       // SIGKILLed by the harness: exit 137 expected
  bool faulted = false;      // stopped or its link faulted right now: left alone by other faults
  bool was_faulted = false;  // ever stopped or its link cut (a fenced exit is then expected)
  int64_t poison_from_step = 0;  // a byzantine trainer: it poisons its syncs from this step
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

  absl::Status Setup();
  absl::Status WriteConfigs();
  absl::Status StartServer();
  absl::Status StartWorker(const std::string& name, const std::string& role,
                           int64_t poison_from_step = 0);
  absl::Status Replace(const Worker& gone);
  void Loop();
  void RunDuePending(bool all);
  void ReapWorkers();
  void ReapServer();
  void Observe(const GetStatusResponse& status);
  absl::StatusOr<Fired> Fire(const PlannedFault& fault, const GetStatusResponse& status);
  // Once the restarted server (life `life`) has waited reconnect_grace + failure_timeout: each
  // trainer that owned an ACTIVE slot at the kill, and was left alone since, must have come
  // back under its incarnation (Observe saw it heartbeat), unless its slot finished.
  void CheckReconnected(int life);
  void FinishAndCheck();
  void CheckRecoveries();
  void CheckStore();
  void Cleanup();

  std::optional<GetStatusResponse> Status(absl::Duration deadline = kRpcDeadline);
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

  std::vector<std::unique_ptr<Worker>> workers_;
  std::set<int> byzantine_announced_;  // trainers whose byzantine fault has fired
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

std::optional<GetStatusResponse> ChaosRun::Status(absl::Duration deadline) {
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

absl::Status ChaosRun::WriteConfigs() {
  ServerConfig server;
  server.set_listen_address("127.0.0.1:0");  // --listen overrides it
  *server.mutable_job() = job_;
  server.mutable_durability()->set_data_dir(dir_ + "/data");
  server.set_max_wait_ms(500);
  std::string text;
  google::protobuf::TextFormat::PrintToString(server, &text);
  absl::Status written = WriteFile(dir_ + "/server.pbtxt", text);
  if (written.ok()) {
    written = WriteFile(dir_ + "/worker.pbtxt", absl::StrCat("job_id: \"", kJobId,
                                                             "\"\n"
                                                             "backoff_initial_ms: 20\n"
                                                             "backoff_max_ms: 300\n"
                                                             "give_up_after_ms: 60000\n"
                                                             "rpc_deadline_ms: 3000\n"));
  }
  if (!written.ok()) {
    return absl::InternalError(absl::StrCat("cannot write the configs in ", dir_, ": ",
                                            written.message()));
  }
  return absl::OkStatus();
}

absl::Status ChaosRun::StartServer() {
  const std::string port_file = dir_ + "/port";
  unlink(port_file.c_str());
  ++server_life_;
  std::ofstream(dir_ + "/server.log", std::ios::app)
      << "----- chaos: server life " << server_life_ << " -----\n";
  ASSIGN_OR_RETURN(
      server_,
      ChildProcess::Start({options_.server_binary, "--config", dir_ + "/server.pbtxt", "--listen",
                           absl::StrCat(server_host_, ":", port_), "--port_file", port_file},
                          dir_ + "/server.log"));
  absl::StatusOr<int> listening = WaitForPortFile(port_file, *server_, kPortWait);
  if (!listening.ok()) {
    return absl::Status(
        listening.status().code(),
        absl::StrCat("rebound_server did not start: ", listening.status().message()));
  }
  const int port = *listening;
  if (port_ != 0 && port != port_) {
    return absl::InternalError(
        absl::StrCat("the restarted server listens on port ", port, ", not ", port_));
  }
  port_ = port;
  address_ = absl::StrCat(server_host_, ":", port_);
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 300);
  args.SetMaxReceiveMessageSize(-1);
  stub_ = ParameterServer::NewStub(
      grpc::CreateCustomChannel(address_, grpc::InsecureChannelCredentials(), args));
  server_down_ = false;
  server_stopped_ = false;
  return absl::OkStatus();
}

absl::Status ChaosRun::StartWorker(const std::string& name, const std::string& role,
                                   int64_t poison_from_step) {
  auto worker = std::make_unique<Worker>();
  worker->name = name;
  worker->role = role;
  worker->poison_from_step = poison_from_step;
  std::vector<std::string> argv = {options_.worker_binary,
                                   "--config",
                                   dir_ + "/worker.pbtxt",
                                   "--server",
                                   address_,
                                   "--name",
                                   name,
                                   "--role",
                                   role};
  if (poison_from_step > 0) {
    argv.push_back(absl::StrCat("--fault_poison_from_step=", poison_from_step));
  }
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
  std::vector<std::string> left_out;
  for (FaultKind kind : options_.kinds) {
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
  report_.schedule =
      PlanFaults(options_.seed, options_.faults, allowed, options_.must_include, spec_);
  report_.faults_planned = static_cast<int>(report_.schedule.size());
  for (const PlannedFault& f : report_.schedule) Log("planned: " + f.ToString());
  // A server stop can fence every worker at once.
  replacement_budget_ = (options_.faults + 1) * (spec_.replicas + options_.spares + 1) + 4;

  RETURN_IF_ERROR(StartServer());
  Log(absl::StrCat("rebound_server serving on ", address_, ", data in ", dir_, "/data"));
  RETURN_IF_ERROR(StartWorker("evaluator", "evaluator"));
  for (int i = 0; i < options_.spares; ++i) {
    RETURN_IF_ERROR(StartWorker(absl::StrCat("spare-", next_spare_++), "spare"));
  }
  // A byzantine fault turns trainer (pick % replicas) byzantine from the first sync step at or
  // after its progress point; a second one drawn for the same trainer changes nothing (it is
  // skipped when its turn comes).
  std::map<int, int64_t> poison_from;
  for (const PlannedFault& f : report_.schedule) {
    if (f.kind != FaultKind::kByzantine) continue;
    const int trainer = static_cast<int>(f.pick % static_cast<uint32_t>(spec_.replicas));
    const int64_t tau = spec_.sync_period;
    const int64_t step = std::max<int64_t>(
        tau, static_cast<int64_t>(std::ceil(f.at_progress * spec_.max_steps / tau)) * tau);
    poison_from.emplace(trainer, step);
  }
  for (int i = 0; i < spec_.replicas; ++i) {
    auto poison = poison_from.find(i);
    RETURN_IF_ERROR(StartWorker(absl::StrCat("trainer-", i), "trainer",
                                poison != poison_from.end() ? poison->second : 0));
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
    } else if (w.poison_from_step > 0 && *code == 1) {
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
        Log(absl::StrCat(w.name, " exited 0 (its slot finished, or the job)"));
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
        Log(absl::StrCat(it->second.name, " reconnected to the restarted server (slot ",
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

  switch (fault.kind) {
    case FaultKind::kByzantine: {
      // Armed when the trainer started (its --fault_poison_from_step): now only said, unless
      // another fault ended that trainer first or an earlier byzantine fault already took it.
      const int trainer = static_cast<int>(fault.pick % static_cast<uint32_t>(spec_.replicas));
      Worker* w = FindByName(absl::StrCat("trainer-", trainer));
      if (w == nullptr || w->poison_from_step == 0 || w->killed ||
          (w->exit_code.has_value() && *w->exit_code != 1) ||
          !byzantine_announced_.insert(trainer).second) {
        return Fired::kNoTarget;
      }
      Log(absl::StrCat(at, kind, ": ", w->name, slot_of(*w), " poisons its syncs from step ",
                       w->poison_from_step));
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
      // The trainers the restarted server should find again: the owners of ACTIVE slots.
      awaiting_reconnect_.clear();
      for (const SlotStatus& slot : before_kill_->slots()) {
        if (slot.state() != ACTIVE) continue;
        for (const WorkerStatus& w : before_kill_->workers()) {
          if (w.incarnation() == slot.owner_incarnation()) {
            awaiting_reconnect_[w.incarnation()] = {slot.slot().replica(), w.name(), {}};
          }
        }
      }
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
  }
  ++report_.faults[kind];
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
                             "\nserver log:\n", LastLines(dir_ + "/server.log", 15)));
      return;
    }
    RunDuePending(false);
    ReapWorkers();
    ReapServer();
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
        } else if (absl::Now() - *state.waiting_since > kTargetWait) {
          Note(absl::StrCat("skipped (no target for ", Seconds(kTargetWait),
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

void ChaosRun::CheckReconnected(int life) {
  if (life != server_life_ || job_finished_) return;  // killed again meanwhile, or done
  std::optional<GetStatusResponse> status = Status(absl::Seconds(2));
  if (!status.has_value()) return;  // stopped meanwhile: the next restart checks again
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
        " when the server was killed, was left alone, and did not come back to the restarted "
        "server within reconnect_grace + failure_timeout: the slot is ",
        slot != nullptr ? SlotState_Name(slot->state()) : "?", " (",
        slot != nullptr ? slot->detail() : "", ")\n", LastLines(w->process->log_path(), 6)));
  }
  awaiting_reconnect_.clear();
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

void ChaosRun::CheckStore() {
  storage::DurableStoreOptions options;
  options.data_dir = dir_ + "/data";
  auto store = storage::DurableStore::Open(options);
  if (!store.ok()) {
    Violation(absl::StrCat("cannot open the server's store after it stopped: ",
                           store.status().message()));
    return;
  }
  auto state = (*store)->LoadAll();
  if (!state.ok()) {
    Violation(absl::StrCat("cannot read the server's store back: ", state.status().message()));
    return;
  }
  auto center = state->centers.find(0);
  if (center == state->centers.end()) {
    Violation("the store holds no center");
  } else {
    if (center->second.version() != rounds_ * spec_.replicas) {
      Violation(absl::StrCat("the stored center is at version ", center->second.version(), ", not ",
                             rounds_ * spec_.replicas, " (", spec_.replicas, " slots x ", rounds_,
                             " syncs)"));
    }
    if (!SameBytes(center->second.params(), report_.center)) {
      Violation("the stored center differs from the one the server served at the end");
    }
  }
  for (int r = 0; r < spec_.replicas; ++r) {
    auto weight = state->weights.find({r, 0});
    auto snapshot = state->snapshots.find({r, 0});
    auto slot = state->slots.find({r, 0});
    if (weight == state->weights.end() || weight->second.update_count() != rounds_ ||
        weight->second.last_update_step() != spec_.max_steps) {
      Violation(absl::StrCat(
          "stored slot ", r, ": ",
          weight == state->weights.end()
              ? std::string("no weight record")
              : absl::StrCat(weight->second.update_count(), " syncs applied, the last at step ",
                             weight->second.last_update_step()),
          "; expected ", rounds_, " syncs, the last at step ", spec_.max_steps));
    }
    if (snapshot == state->snapshots.end() || snapshot->second.step() != spec_.max_steps) {
      Violation(absl::StrCat("stored slot ", r, ": snapshot at step ",
                             snapshot == state->snapshots.end() ? -1 : snapshot->second.step(),
                             ", expected ", spec_.max_steps));
    }
    if (slot == state->slots.end() || slot->second.state() != FINISHED) {
      Violation(absl::StrCat("stored slot ", r, " is not FINISHED"));
    }
  }
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

  std::optional<GetStatusResponse> status = Status(absl::Seconds(5));
  if (!status.has_value()) {
    Error("the server does not answer after the job's end");
    return;
  }
  Observe(*status);
  // The final center, pulled by an observer (a spare that never heartbeats).
  RegisterRequest request;
  request.set_job_id(kJobId);
  request.set_worker_name("chaos-observer");
  request.set_requested_role(SPARE);
  RegisterResponse registered;
  PullResponse pulled;
  {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    const grpc::Status s = stub_->Register(&context, request, &registered);
    if (!s.ok()) {
      Error(absl::StrCat("cannot register an observer: ", s.error_message()));
      return;
    }
  }
  {
    PullRequest pull;
    pull.set_incarnation(registered.incarnation());
    pull.set_stage(0);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    context.AddMetadata(kWorkerCredentialKey, registered.credential());
    const grpc::Status s = stub_->Pull(&context, pull, &pulled);
    if (!s.ok()) {
      Error(absl::StrCat("cannot pull the final center: ", s.error_message()));
      return;
    }
  }
  report_.center = pulled.center();
  report_.center_version = pulled.center_version();

  // Exactly once, as the server reports it.
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
  if (report_.center_version != rounds_ * spec_.replicas) {
    Violation(absl::StrCat("the center moved ", report_.center_version, " times, not ",
                           rounds_ * spec_.replicas, " (", spec_.replicas, " slots x ", rounds_,
                           " syncs)"));
  }
  CheckRecoveries();

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
  CheckStore();

  absl::StatusOr<double> accuracy = TestAccuracy(job_, report_.center);
  if (accuracy.ok()) {
    report_.accuracy = *accuracy;
    Log(absl::StrFormat("final center: version %d, test accuracy %.4f", report_.center_version,
                        report_.accuracy));
  } else {
    Error(absl::StrCat("cannot evaluate the final center: ", accuracy.status().message()));
  }
}

void ChaosRun::Cleanup() {
  RunDuePending(true);
  for (auto& w : workers_) {
    if (!w->exit_code.has_value()) w->exit_code = w->process->Stop(absl::Seconds(5));
  }
  if (server_ != nullptr && !server_->Poll().has_value()) server_->Stop(absl::Seconds(10));
  workers_.clear();
  server_.reset();
  lab_.reset();
}

RunReport ChaosRun::Execute(const RunReport* reference) {
  start_ = absl::Now();
  deadline_ = start_ + options_.time_limit;
  report_.seed = options_.seed;
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
    if (spec_.deterministic && !spec_.dynamic_weights && !report_.center_identical) {
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
  return job;
}

const std::vector<FaultKind>& AllFaultKinds() {
  static const std::vector<FaultKind>* kAll = [] {
    auto* all = new std::vector<FaultKind>;
    for (const KindInfo& info : kKinds) all->push_back(info.kind);
    return all;
  }();
  return *kAll;
}

const char* FaultKindName(FaultKind kind) { return Info(kind).name; }

bool IsNetworkFault(FaultKind kind) {
  return kind == FaultKind::kPartition || kind == FaultKind::kThrottle ||
         kind == FaultKind::kDelay || kind == FaultKind::kLoss;
}

std::string PlannedFault::ToString() const {
  std::string out = absl::StrFormat("%s at progress %.2f", FaultKindName(kind), at_progress);
  switch (kind) {
    case FaultKind::kKillTrainer:
    case FaultKind::kKillSpare:
    case FaultKind::kKillEvaluator:
    case FaultKind::kByzantine:
      break;
    case FaultKind::kKillServer:
      absl::StrAppend(&out, ", restarted after ", Seconds(duration));
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
  if (fenced_by_server_stop > 0) {
    absl::StrAppend(&out, "  ", fenced_by_server_stop,
                    " worker(s) left alone were fenced as the server resumed from a SIGSTOP "
                    "(it counted its own stop as their silence: a violation)\n");
  }
  absl::StrAppend(&out, "  ", network, "\n");
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
