// rebound_worker: a Rebound worker (trainer, spare or evaluator; the server assigns the role).
//
//   rebound_worker --config worker.pbtxt [--server HOST:PORT] [--name NAME]
//                  [--role auto|trainer|spare|evaluator]
//
// A trainer trains its slot to max_steps and leaves; an evaluator reports test accuracy until
// the job ends; a spare waits. Exit codes (docs/operations.md#worker-exit-codes): 0 done or
// stopped by SIGTERM/SIGINT; 2 bad config or flags, or a configuration that does not fit (the
// model and the data set, compute.backend CUDA in a build without CUDA, the job's model and the
// server's): restarting cannot help; 3 fenced by the server (only then: supervisors restart on
// it); 4 server unreachable for give_up_after_ms; 5 registration refused; 1 other errors (e.g.
// the data set cannot be read).

#include <gflags/gflags.h>
#include <glog/logging.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/grpc_polling.h"
#include "common/process.h"
#include "common/security.h"
#include "common/server_addresses.h"
#include "grpcpp/grpcpp.h"
#include "proto/rebound.grpc.pb.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "worker/agent.h"
#include "common/metrics.h"
#include "common/metrics_http.h"
#include "common/clock.h"
#include "common/usage.h"
#include "common/version.h"
#include "worker/evaluator.h"
#include "worker/peer_service.h"
#include "worker/replay.h"
#include "worker/replay_mailbox.h"
#include "worker/shared_sums.h"
#include "worker/slot_compute.h"
#include "worker/training.h"
#include "worker/worker_metrics.h"

DEFINE_string(config, "", "worker config file (.pbtxt); default: every field's default");
DEFINE_string(server, "",
              "server host:port, or a replicated group's members as host:port,host:port,...; "
              "overrides server_address");
DEFINE_string(name, "", "worker name; overrides name (default <hostname>-<pid>)");
DEFINE_string(role, "", "auto|trainer|spare|evaluator; overrides role");
DEFINE_string(peer_listen, "", "WorkerPeer host:port to listen on; overrides peer_listen_address");
DEFINE_string(advertise_host, "",
              "the host other workers reach this one at (e.g. a pod IP); default: the host of "
              "peer_listen_address, or the hostname when that is 0.0.0.0 or [::]");
// Fault injection, for benchmarks and chaos tests only (docs/operations.md).
DEFINE_uint64(fault_label_permutation_seed, 0,
              "testing only: permute this trainer's labels with a permutation from this seed");
DEFINE_int64(fault_reset_every_steps, 0,
             "testing only: restart this trainer from fresh random parameters every N steps");
DEFINE_int64(fault_poison_from_step, 0,
             "testing only: a byzantine trainer; its syncs (pushes) from this step on carry "
             "+-fault_poison_value in every element");
DEFINE_double(fault_poison_value, 3.4e38, "testing only: see fault_poison_from_step");
DEFINE_int64(fault_die_in_sync_at_step, 0,
             "testing only: a sharded job's trainer sends its sync of this step to ranges "
             "[0, fault_die_in_sync_ranges) only and then dies (SIGKILL), before the commit");
DEFINE_int32(fault_die_in_sync_ranges, 1, "testing only: see fault_die_in_sync_at_step");
DEFINE_int64(fault_die_after_logged_step, 0,
             "testing only: a trainer dies (SIGKILL) once the server acknowledged the log of "
             "this step");
DEFINE_int64(fault_flip_bit_at_step, 0,
             "testing only: silent data corruption; right after this step's update, before its "
             "checksum is logged, one mantissa bit of one parameter of the trainer flips "
             "(0 = never)");
DEFINE_int64(fault_flip_bit_repeat_every, 0,
             "testing only: the flip of fault_flip_bit_at_step repeats every this many steps "
             "after it (0 = once)");

namespace rebound::worker {
namespace {

bool ParseRole(const std::string& text, WorkerRole* role) {
  if (text == "auto") *role = ROLE_UNSPECIFIED;
  else if (text == "trainer") *role = TRAINER;
  else if (text == "spare") *role = SPARE;
  else if (text == "evaluator") *role = EVALUATOR;
  else return false;
  return true;
}

// The stop of the worker's work, notified by whichever thread comes first.
struct StopSignal {
  absl::Notification stop;
  absl::Mutex mu;

  void Notify() {
    absl::MutexLock lock(&mu);
    if (!stop.HasBeenNotified()) stop.Notify();
  }
};

std::string DefaultName() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return absl::StrCat(host, "-", getpid());
}

int Run() {
  // Without --config every field has its default (docs/config.md), e.g. on each host of a cluster
  //   rebound_worker --server 10.0.0.1:7070
  auto loaded = !FLAGS_config.empty()
                    ? LoadWorkerConfig(FLAGS_config)
                    : ParseWorkerConfig("", "(no --config: the defaults)", ".");
  if (!loaded.ok()) {
    LOG(ERROR) << "invalid config:\n" << loaded.status().message();
    return 2;
  }
  WorkerConfig config = *std::move(loaded);
  if (!FLAGS_server.empty()) {
    auto valid = ParseServerAddresses(FLAGS_server, "--server");
    if (!valid.ok()) {
      LOG(ERROR) << valid.status().message();
      return 2;
    }
    config.set_server_address(FLAGS_server);
  }
  if (!FLAGS_name.empty()) config.set_name(FLAGS_name);
  if (config.name().empty()) config.set_name(DefaultName());
  if (config.has_compute() && config.compute().has_threads()) {
    LOG(WARNING) << "compute.threads = " << config.compute().threads()
                 << " overrides the job's thread count on this worker: a replay is bit-identical "
                    "only between workers computing with the same count (docs/design.md §5.6)";
  }
  if (!FLAGS_peer_listen.empty()) {
    absl::Status valid = ValidateHostPort(FLAGS_peer_listen, "--peer_listen");
    if (!valid.ok()) {
      LOG(ERROR) << valid.message();
      return 2;
    }
    config.set_peer_listen_address(FLAGS_peer_listen);
  }
  if (FLAGS_advertise_host.find_first_of(" :/") != std::string::npos &&
      !(FLAGS_advertise_host.front() == '[' && FLAGS_advertise_host.back() == ']')) {
    LOG(ERROR) << "--advertise_host must be a host name or address (an IPv6 one in brackets), "
               << "got '" << FLAGS_advertise_host << "'";
    return 2;
  }
  if (FLAGS_fault_flip_bit_at_step < 0 || FLAGS_fault_flip_bit_repeat_every < 0) {
    LOG(ERROR) << "--fault_flip_bit_at_step and --fault_flip_bit_repeat_every must be >= 0";
    return 2;
  }
  if (!FLAGS_role.empty()) {
    WorkerRole role;
    if (!ParseRole(FLAGS_role, &role)) {
      LOG(ERROR) << "--role must be auto, trainer, spare or evaluator, got '" << FLAGS_role << "'";
      return 2;
    }
    config.set_role(role);
  }

  // Shared-memory regions of replays whose worker was killed before its peers had mapped them.
  if (const int swept = SweepStaleRegions(); swept > 0) {
    LOG(INFO) << "removed " << swept << " stale replay regions from /dev/shm";
  }
  // Replay messages held at most: a few steps' sums of every other spare of a task.
  ReplayMailbox mailbox(/*max_bytes=*/int64_t{1} << 30);
  // Pipeline boundary tensors for this worker's stage, while it trains one (S > 1).
  PipelinePort pipeline_port;
  WorkerPeerService peer_service(&mailbox, &pipeline_port);
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(kMaxPeerMessageBytes);
  // A replay's ~2 MB sums arrive in one go rather than 64 KiB flow-control windows at a time.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kPeerWindowBytes);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kPeerFrameBytes);
  builder.AddChannelArgument(GRPC_ARG_TCP_READ_CHUNK_SIZE, kPeerReadChunkBytes);
  int peer_port = 0;
  auto peer_credentials = MakeServerCredentials(config.security());
  auto token = TokenChecker::FromConfig(config.security());
  if (!peer_credentials.ok() || !token.ok()) {
    LOG(ERROR) << (peer_credentials.ok() ? token.status() : peer_credentials.status());
    return 2;
  }
  peer_service.SetTokenChecker(*token);
  builder.AddListeningPort(config.peer_listen_address(), *peer_credentials,
                           &peer_port);
  // No SO_REUSEPORT (gRPC's default): two workers on one fixed peer port would share it.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(&peer_service);
  std::unique_ptr<grpc::Server> peer_server = builder.BuildAndStart();
  if (peer_server == nullptr || peer_port == 0) {
    LOG(ERROR) << "cannot listen on " << config.peer_listen_address() << ": "
               << WhyCannotListen(config.peer_listen_address());
    return 1;
  }
  std::string host = config.peer_listen_address().substr(0, config.peer_listen_address().rfind(':'));
  if (!FLAGS_advertise_host.empty()) {
    host = FLAGS_advertise_host;
  } else if (host == "0.0.0.0" || host == "[::]") {
    char name[256] = {0};
    gethostname(name, sizeof(name) - 1);
    host = name;
  }
  const std::string peer_address = absl::StrCat(host, ":", peer_port);

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  // Reconnect after a server restart on the worker's own backoff schedule, not gRPC's default
  // (which grows to 120 s between attempts).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, config.backoff_initial_ms());
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, config.backoff_initial_ms());
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, config.backoff_max_ms());
  // The registration's secret, carried by every call of the channel (docs/operations.md#security).
  auto credential = std::make_shared<WorkerCredential>();
  auto made = MakeChannel(config.server_address(), config.security(), args, credential);
  if (!made.ok()) {
    LOG(ERROR) << made.status();
    return 2;
  }
  std::shared_ptr<grpc::Channel> channel = *std::move(made);
  // Metrics (docs/operations.md#metrics), announced to the server at registration.
  std::unique_ptr<MetricsHttpServer> metrics_http;
  if (config.metrics().enabled()) {
    Metrics();  // registers every series, so the first scrape lists them all
    AddProcessMetrics(&WorkerRegistry());
    auto started = MetricsHttpServer::Start(
        absl::StrCat(config.metrics().bind_address(), ":", config.metrics().port()),
        &WorkerRegistry());
    if (!started.ok()) {
      LOG(ERROR) << started.status();
      return 1;
    }
    metrics_http = *std::move(started);
    LOG(INFO) << "metrics at http://" << metrics_http->address() << "/metrics";
  }
  // What others use to scrape it: a wildcard bind is reached at the advertised host.
  std::string metrics_address;
  if (metrics_http != nullptr) {
    const std::string& bind = config.metrics().bind_address();
    metrics_address = absl::StrCat(bind == "0.0.0.0" || bind == "[::]" || bind == "::" ? host : bind,
                                   ":", metrics_http->port());
  }
  // The agent and the stop are shared with the signal thread, which waits for a signal that may
  // never come and so is detached: it must hold nothing of this frame.
  auto agent = std::make_shared<WorkerAgent>(config, channel, config.job_id(), config.name(),
                                             peer_address, metrics_address, credential);
  LOG(INFO) << "worker '" << config.name() << "' (peer " << peer_address << ") joining "
            << config.server_address();

  // `stop` ends the role's work: a signal, the job's end, or the agent's end (fenced,
  // unreachable). Those come from two threads; a Notification must be notified once.
  auto stop_signal = std::make_shared<StopSignal>();
  const absl::Notification& stop = stop_signal->stop;
  auto signalled = std::make_shared<std::atomic<bool>>(false);
  std::thread([agent, stop_signal, signalled] {
    const int signal_number = WaitForTerminationSignal();
    LOG(INFO) << "signal " << signal_number << ": stopping";
    signalled->store(true);
    stop_signal->Notify();
    agent->Stop();
  }).detach();

  // What the roles of this process share: the clock and the data set one role leaves the next.
  const Clock* const clock = DefaultClock();
  DataSetCache data_sets;
  absl::Notification registered;
  AgentExit exit = AgentExit::kStopped;  // read after agent_ended only
  absl::Notification agent_ended;
  std::atomic<bool> job_done{false};  // the server said every slot is finished
  std::thread membership([&] {
    exit = agent->Run(&registered, [stop_signal, &job_done] {
      job_done.store(true);
      stop_signal->Notify();
    });
    agent_ended.Notify();
    stop_signal->Notify();
  });
  registered.WaitForNotification();
  absl::Status work = absl::OkStatus();
  while (!stop.HasBeenNotified()) {
    const Registration registration = agent->registration();
    if (registration.incarnation == 0) break;
    if (registration.role == TRAINER) {
      // The job's start barrier: the server says when its trainers are there (bounded by its
      // start_barrier_ms; this bound covers a server that stops answering meanwhile).
      const JobConfig& job = registration.job;
      if (!agent->WaitForStart(
              stop, absl::Milliseconds(job.topology().start_barrier_ms()) +
                        2 * absl::Milliseconds(job.fault_tolerance().heartbeat_interval_ms()) +
                        absl::Milliseconds(config.rpc_deadline_ms()))) {
        break;
      }
      InjectedFaults faults;
      faults.label_permutation_seed = FLAGS_fault_label_permutation_seed;
      faults.reset_every_steps = FLAGS_fault_reset_every_steps;
      faults.poison_from_step = FLAGS_fault_poison_from_step;
      faults.poison_value = static_cast<float>(FLAGS_fault_poison_value);
      faults.die_in_sync_at_step = FLAGS_fault_die_in_sync_at_step;
      faults.die_in_sync_ranges = FLAGS_fault_die_in_sync_ranges;
      faults.die_after_logged_step = FLAGS_fault_die_after_logged_step;
      faults.flip_bit_at_step = FLAGS_fault_flip_bit_at_step;
      faults.flip_bit_repeat_every = FLAGS_fault_flip_bit_repeat_every;
      work = RunTrainer(config, registration, channel, agent.get(), stop, clock, &data_sets,
                        faults, nullptr, &pipeline_port);
      if (work.ok() && !agent->drained()) LOG(INFO) << "slot trained to max_steps; leaving";
    } else if (registration.role == EVALUATOR) {
      work = RunEvaluator(config, registration, channel, stop, clock, &job_done);
    } else {
      // A spare: it replays lost slots (REPLAY) or is handed one by a heartbeat
      // (RESTART_FROM_CENTER); either way it comes back here as a trainer.
      auto rebuilt =
          RunSpare(config, registration, channel, agent.get(), &mailbox, stop, clock, &data_sets);
      if (rebuilt.ok()) {
        InjectedFaults none;
        work = RunTrainer(config, agent->registration(), channel, agent.get(), stop, clock,
                          &data_sets, none, *std::move(rebuilt), &pipeline_port);
        if (work.ok() && !agent->drained()) LOG(INFO) << "slot trained to max_steps; leaving";
      } else if (rebuilt.status().code() == absl::StatusCode::kNotFound) {
        continue;  // a new registration: loop with it
      } else {
        work = rebuilt.status();
      }
    }
    // A restarted server that lost its state (ABORTED) makes the agent register again, maybe
    // for another slot: start the role's work over under the new registration.
    if (work.code() != absl::StatusCode::kAborted) break;
    LOG(WARNING) << "the server no longer knows this registration (" << work
                 << "); waiting for the new one";
    while (!stop.HasBeenNotified() &&
           !agent->WaitForNewRegistration(registration.incarnation, absl::Milliseconds(200))) {
    }
    work = absl::OkStatus();
  }
  // FAILED_PRECONDITION is both the server's fencing and a configuration that does not fit (the
  // model and the data set, a CUDA backend in a CPU build, the server's model): only the first
  // may be restarted. The agent is the judge of a fence: the server answers its next heartbeat
  // FAILED_PRECONDITION too, so give it a heartbeat (and a spare's takeover grace) to say so.
  // A mismatch of this process's own configuration (IsConfigMismatch) needs no such wait.
  if (work.code() == absl::StatusCode::kFailedPrecondition && !IsConfigMismatch(work) &&
      !signalled->load()) {
    const absl::Duration heartbeat = absl::Milliseconds(
        agent->registration().job.fault_tolerance().heartbeat_interval_ms());
    agent_ended.WaitForNotificationWithTimeout(2 * heartbeat + absl::Seconds(3));
  }
  agent->Stop();
  membership.join();
  peer_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (!work.ok() && signalled->load()) {
    // Stopping deregisters this worker while its work may still be talking to the server; the
    // errors that follow (FAILED_PRECONDITION: departed) are the stop's, not a failure.
    LOG(INFO) << "work ended by the stop: " << work;
    work = absl::OkStatus();
  }
  if (!work.ok() && work.code() != absl::StatusCode::kCancelled &&
      exit != AgentExit::kFenced) {
    LOG(ERROR) << "work failed: " << work;
    // FAILED_PRECONDITION here is not a fence (the agent would have said so): a mismatch.
    return work.code() == absl::StatusCode::kFailedPrecondition ? 2
           : work.code() == absl::StatusCode::kUnavailable      ? 4
                                                                : 1;
  }
  switch (exit) {
    case AgentExit::kJobDone:
      LOG(INFO) << "the job is finished";
      return 0;
    case AgentExit::kStopped:
      LOG(INFO) << "stopped";
      return 0;
    case AgentExit::kFenced:
      LOG(ERROR) << "fenced by the server, exiting: " << agent->exit_reason();
      return 3;
    case AgentExit::kUnreachable:
      LOG(ERROR) << "giving up: " << agent->exit_reason();
      return 4;
    case AgentExit::kRejected:
      LOG(ERROR) << agent->exit_reason();
      return 5;
  }
  return 1;
}

}  // namespace
}  // namespace rebound::worker

constexpr char kUsageHeader[] =
    "usage: rebound_worker [--config FILE] [--server HOST:PORT[,HOST:PORT...]] [--name NAME]\n"
    "                      [--role auto|trainer|spare|evaluator] [--peer_listen HOST:PORT]\n"
    "                      [--advertise_host HOST]\n"
    "\n"
    "A Rebound worker: it registers with the server, which gives it a role. A trainer trains its\n"
    "slot to max_steps and leaves, an evaluator reports test accuracy until the job ends, a spare\n"
    "waits to replay a lost slot. The config is a WorkerConfig (docs/config.md); without\n"
    "--config every field has its default. A trainer logs a progress line every\n"
    "progress_interval_s (10 s).\n";

constexpr char kUsageFooter[] =
    "Exit codes (docs/operations.md#worker-exit-codes): 0 done, or stopped by SIGTERM/SIGINT;\n"
    "1 the role's work failed (e.g. the data set cannot be read); 2 bad config or flags, or a\n"
    "configuration that does not fit (model and data set, compute.backend): do not restart;\n"
    "3 fenced by the server: restart it; 4 no contact with the server for give_up_after_ms;\n"
    "5 registration or heartbeat refused.\n";

int main(int argc, char** argv) {
  rebound::ExitIfVersionFlag(argc, argv);
  rebound::ExitIfHelpFlag(argc, argv,
                          rebound::UsageText(kUsageHeader, __FILE__, kUsageFooter));
  if (const absl::Status flags = rebound::CheckCommandLineFlags(argc, argv); !flags.ok()) {
    std::fprintf(stderr, "%s: %s (--help: the flags)\n", "rebound_worker",
                 std::string(flags.message()).c_str());
    return 2;  // bad flags, as documented (gflags would exit 1)
  }
  rebound::ShortenGrpcBackupPolling();
  rebound::InstallTerminationHandlers();
  gflags::SetUsageMessage("rebound_worker [--config FILE] (--help: the flags)");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  rebound::InitLogging(argv[0]);
  return rebound::worker::Run();
}
