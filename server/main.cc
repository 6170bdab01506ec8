// rebound_server: the Rebound parameter-server daemon.
//
//   rebound_server --config server.pbtxt [--listen HOST:PORT] [--port_file PATH]
//
// Serves ParameterServer, grpc.health.v1 and server reflection. With durability.data_dir set it
// keeps its state in RocksDB and reloads it at start (health NOT_SERVING meanwhile). Exits 0
// after SIGTERM/SIGINT (graceful shutdown, in-flight calls get up to 5 s), 2 on a bad config,
// 1 if it cannot listen or its data directory cannot be opened or read.

#include <gflags/gflags.h>
#include <glog/logging.h>

#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "common/config.h"
#include "common/metrics.h"
#include "common/metrics_http.h"
#include "common/process.h"
#include "common/security.h"
#include "common/slot.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "common/status_macros.h"
#include "server/center_table.h"
#include "server/failure_detector.h"
#include "server/membership.h"
#include "server/parse_status.h"
#include "server/reliability.h"
#include "server/server_metrics.h"
#include "server/service.h"
#include "storage/durable_store.h"

DEFINE_string(config, "", "server config file (.pbtxt); required");
DEFINE_string(listen, "", "host:port to listen on; overrides listen_address (port 0 = any)");
DEFINE_string(port_file, "", "write the bound port to this file once serving");
DEFINE_string(data_dir, "", "durable state directory; overrides durability.data_dir");
DEFINE_bool(accept_wal_loss, false,
            "start even if RocksDB's write-ahead log is damaged, dropping every write after the "
            "damage (acknowledged ones included) and logging what was dropped; for the operator, "
            "once, after reading docs/troubleshooting.md");

namespace rebound::server {
namespace {

// How often the failure detector returns tcmalloc's free pages above kKeepFreeHeapBytes to the
// system (common/process.h): a few syncs' buffers stay for reuse, a burst's do not.
constexpr absl::Duration kReleaseFreeHeapEvery = absl::Seconds(5);
constexpr size_t kKeepFreeHeapBytes = size_t{32} << 20;

// Restores centers, weights, bookkeeping and membership from a previous server life.
absl::Status LoadState(const JobConfig& job, storage::DurableStore* store, Membership* membership,
                       CenterTable* centers, ReliabilityTracker* tracker,
                       ParameterServerService* service) {
  auto state = store->LoadAll();
  if (!state.ok()) return state.status();
  if (!state->server.has_value()) {
    LOG(INFO) << "fresh data directory: starting from the model's initialisation";
    return absl::OkStatus();
  }
  // A declared model (DESIGN.md §11) has its one stage once its stored center declares it.
  const int stages = job.model().declared_by_worker() ? 1 : centers->num_stages();
  for (const auto& [stage, center] : state->centers) {
    auto opt = state->center_opts.find(stage);
    if (stage < 0 || stage >= stages) {
      return absl::DataLossError(absl::StrCat("stored center of stage ", stage,
                                              " does not fit the job's ", stages, " stages"));
    }
    absl::Status restored =
        centers->Restore(center, opt == state->center_opts.end() ? nullptr : &opt->second);
    if (!restored.ok()) {
      return absl::DataLossError(absl::StrCat("stored center of stage ", stage,
                                              " does not fit the job's model: ",
                                              restored.message()));
    }
  }
  // Fault scores follow the workers' names (DESIGN §4.5): each slot's owner in the stored
  // membership first, so that a weight record of the old form (a fault score per slot) gives its
  // score to that owner (docs/weighting.md#migration).
  for (const auto& [key, record] : state->slots) {
    if (record.owner_incarnation() != 0) tracker->SetOwner(record.slot(), record.owner_name());
  }
  std::vector<WeightRecord> weights;
  for (const auto& [key, record] : state->weights) {
    const std::string migrated = tracker->Import(record);
    if (!migrated.empty()) LOG(WARNING) << migrated;
    weights.push_back(record);
  }
  service->RestoreBookkeeping(weights);
  std::vector<SlotRecord> slots;
  for (const auto& [key, record] : state->slots) slots.push_back(record);
  const absl::Duration grace = absl::Milliseconds(job.fault_tolerance().reconnect_grace_ms());
  RETURN_IF_ERROR(membership->Restore(*state->server, slots, grace));
  // The weight records hold each slot's last applied sync exactly.
  for (const WeightRecord& record : weights) {
    membership->RecordProgress(record.slot(), record.last_update_step(),
                               job.training().max_steps());
  }
  LOG(INFO) << "restored " << state->centers.size() << " centers, " << weights.size()
            << " weight records and " << slots.size() << " slots; known trainers have "
            << job.fault_tolerance().reconnect_grace_ms() << " ms of grace to reconnect";
  return absl::OkStatus();
}

int Run() {
  if (FLAGS_config.empty()) {
    LOG(ERROR) << "--config is required";
    return 2;
  }
  auto loaded = LoadServerConfig(FLAGS_config);
  if (!loaded.ok()) {
    LOG(ERROR) << "invalid config:\n" << loaded.status().message();
    return 2;
  }
  ServerConfig config = *std::move(loaded);
  if (!FLAGS_listen.empty()) {
    absl::Status valid = ValidateHostPort(FLAGS_listen, "--listen");
    if (!valid.ok()) {
      LOG(ERROR) << valid.message();
      return 2;
    }
    config.set_listen_address(FLAGS_listen);
  }
  if (!FLAGS_data_dir.empty()) config.mutable_durability()->set_data_dir(FLAGS_data_dir);

  RealClock clock;
  const JobConfig& job = config.job();
  storage::DurableStoreOptions store_options =
      storage::DurableStoreOptions::FromConfig(config.durability(), job.step_log());
  store_options.accept_wal_loss = FLAGS_accept_wal_loss;
  auto store = storage::DurableStore::Open(store_options);
  if (!store.ok()) {
    LOG(ERROR) << "cannot open the data directory: " << store.status();
    return 1;
  }
  auto centers = CenterTable::Create(job);
  if (!centers.ok()) {
    LOG(ERROR) << centers.status();
    return 2;
  }
  ReliabilityTracker tracker(job.weighting(), job.topology().replicas());
  storage::DurableStore* db = store->get();
  Membership membership(job, &clock,
                        [db](const ServerRecord& server, const std::vector<SlotRecord>& slots) {
                          storage::WriteBatch batch;
                          batch.PutServer(server);
                          for (const SlotRecord& slot : slots) batch.PutSlot(slot);
                          return db->Commit(batch);
                        });
  auto token = TokenChecker::FromConfig(config.security());
  if (!token.ok()) {
    LOG(ERROR) << token.status();
    return 2;
  }
  auto credentials = MakeServerCredentials(config.security());
  if (!credentials.ok()) {
    LOG(ERROR) << credentials.status();
    return 2;
  }
  std::string operator_token;
  if (!config.security().operator_token_file().empty()) {
    auto read = ReadBearerToken(config.security().operator_token_file());
    if (!read.ok()) {
      LOG(ERROR) << "security.operator_token_file: " << read.status();
      return 2;
    }
    operator_token = *std::move(read);
  }
  ParameterServerService service(config, &membership, centers->get(), &tracker, db, &clock,
                                 *std::move(token), std::move(operator_token));

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(config.listen_address(), *credentials, &port);
  // gRPC sets SO_REUSEPORT by default, and a second server on this port would then share it
  // with the first (clients alternating between two servers that both hand out slot 0).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // gRPC's buffers of received requests and its threads are bounded (server/call_gate.h); the
  // service bounds the parked long polls and the bytes of requests it handles.
  grpc::ResourceQuota quota("rebound_server");
  quota.Resize(static_cast<size_t>(service.admission().inflight_bytes));
  quota.SetMaxThreads(service.admission().threads);
  builder.SetResourceQuota(quota);
  builder.SetMaxReceiveMessageSize(config.max_message_bytes());
  builder.SetMaxSendMessageSize(config.max_message_bytes());
  builder.RegisterService(&service);
  // Metrics (docs/operations.md#metrics): every RPC counted and timed, the status at each scrape.
  MetricsRegistry metrics;
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(NewParseStatusFactory());
  if (config.metrics().enabled()) creators.push_back(NewRpcMetricsFactory(&metrics, &clock));
  builder.experimental().SetInterceptorCreators(std::move(creators));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    LOG(ERROR) << "cannot listen on " << config.listen_address() << ": "
               << WhyCannotListen(config.listen_address());
    return 1;
  }
  // Health says NOT_SERVING (and the service UNAVAILABLE) until the durable state is loaded.
  server->GetHealthCheckService()->SetServingStatus(false);
  absl::Status loaded_state = LoadState(job, db, &membership, centers->get(), &tracker, &service);
  if (!loaded_state.ok()) {
    LOG(ERROR) << "cannot load the durable state from '" << config.durability().data_dir()
               << "': " << loaded_state;
    server->Shutdown();
    return 1;
  }
  if (EffectiveRecoveryPolicy(job) == GLOBAL_CHECKPOINT) {
    const std::string dir = config.durability().data_dir().empty()
                                ? std::string()
                                : config.durability().data_dir() + "/checkpoints";
    if (absl::Status enabled = service.EnableGlobalCheckpoint(dir); !enabled.ok()) {
      LOG(ERROR) << "cannot load the global checkpoint from '" << dir << "': " << enabled;
      server->Shutdown();
      return 1;
    }
  }
  std::unique_ptr<MetricsHttpServer> metrics_http;
  if (config.metrics().enabled()) {
    AddStatusMetrics(
        &metrics,
        [&service] {
          GetStatusResponse status;
          service.GetStatus(nullptr, nullptr, &status);
          return status;
        },
        db);
    AddProcessMetrics(&metrics);
    auto started = MetricsHttpServer::Start(
        absl::StrCat(config.metrics().bind_address(), ":", config.metrics().port()), &metrics);
    if (!started.ok()) {
      LOG(ERROR) << started.status();
      server->Shutdown();
      return 1;
    }
    metrics_http = *std::move(started);
    service.SetMetricsAddress(metrics_http->address());
    LOG(INFO) << "metrics at http://" << metrics_http->address() << "/metrics";
  }
  service.MarkReady();
  server->GetHealthCheckService()->SetServingStatus(true);
  LOG(INFO) << "admission bounds: " << service.admission().parked_calls
            << " parked long polls, " << service.admission().inflight_bytes
            << " request bytes in flight, " << service.admission().threads << " threads";
  LOG(INFO) << kServerVersion << " serving job '" << config.job().job_id() << "' on port " << port
            << " (" << config.job().topology().replicas() << " x "
            << config.job().topology().stages() << " slots)"
            << (ServesTls(config.security())
                    ? (config.security().tls().require_client_cert() ? ", mutual TLS" : ", TLS")
                    : ", plaintext")
            << (config.security().token_file().empty() ? "" : ", bearer token required");
  if (!FLAGS_port_file.empty()) {
    absl::Status written = WriteFileAtomically(FLAGS_port_file, absl::StrCat(port, "\n"));
    if (!written.ok()) {
      LOG(ERROR) << written;
      server->Shutdown();
      return 1;
    }
  }

  // The failure detector (server/failure_detector.h) on a thread of its own; it also returns
  // tcmalloc's free pages and runs the GLOBAL_CHECKPOINT rollback after each pass.
  absl::Time last_release = clock.Now();
  FailureDetector::Hooks hooks;
  hooks.health = [&centers, db] {
    absl::Status health = (*centers)->Health();
    // A RocksDB background error: every write fails until the operator repairs the store.
    if (health.ok()) health = db->BackgroundError();
    return health;
  };
  // The in-memory state is ahead of the durable one, or the store refuses writes: stop serving
  // so the supervisor (or the operator) restarts the server, which reloads what was acknowledged.
  hooks.on_unhealthy = [&server](const absl::Status&) {
    server->GetHealthCheckService()->SetServingStatus(false);
  };
  hooks.after_pass = [&] {
    // tcmalloc keeps what a burst of large requests freed until later frees; give it back.
    if (clock.Now() - last_release >= kReleaseFreeHeapEvery) {
      last_release = clock.Now();
      ReleaseFreeHeapAbove(kKeepFreeHeapBytes);
    }
    service.MaybeRollBack();
  };
  FailureDetector detector(job, &membership, &tracker, &clock, std::move(hooks));
  absl::Notification stop;
  std::thread detector_thread([&] { detector.Run(&stop); });

  const int signal_number = WaitForTerminationSignal();
  LOG(INFO) << "signal " << signal_number << ": shutting down";
  server->GetHealthCheckService()->SetServingStatus(false);
  stop.Notify();
  detector_thread.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();
  LOG(INFO) << "stopped";
  return 0;
}

}  // namespace
}  // namespace rebound::server

int main(int argc, char** argv) {
  rebound::InstallTerminationHandlers();
  // Every sync allocates and frees buffers of the center's size.
  rebound::TuneAllocatorForLargeBuffers();
  gflags::SetUsageMessage("rebound_server --config FILE [--listen HOST:PORT] [--port_file PATH]");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  rebound::InitLogging(argv[0]);
  return rebound::server::Run();
}
