#include "server/server_life.h"

#include <glog/logging.h>

#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "common/config.h"
#include "common/grpc_handoff.h"
#include "common/metrics.h"
#include "common/metrics_http.h"
#include "common/process.h"
#include "common/security.h"
#include "common/slot.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "server/center_export.h"
#include "server/center_table.h"
#include "server/failure_detector.h"
#include "server/group/peer_keepalive.h"
#include "server/group/peer_service.h"
#include "server/group/replication_leader.h"
#include "server/group/role_cycle.h"
#include "server/group/server_group.h"
#include "server/group/standby.h"
#include "server/membership.h"
#include "server/parse_status.h"
#include "server/periodic_export.h"
#include "server/reliability.h"
#include "server/server_metrics.h"
#include "server/service.h"
#include "server/worker_sessions.h"
#include "server/shard/range_check.h"
#include "server/shard/range_checkpoints.h"
#include "server/shard/range_reader.h"
#include "server/shard/range_service.h"
#include "server/shard/remote_authorizer.h"
#include "storage/backup.h"
#include "storage/durable_store.h"
#include "storage/format_version.h"

namespace rebound::server {
namespace {


// Wakes the signal thread of a life that ended without a signal (common/process.h: above 64).
constexpr int kLifeOver = 200;

// The replicated side of a server (docs/design.md §10.1), when the config has `replication`.
struct GroupMember {
  std::unique_ptr<PeerService> peer_service;
  std::unique_ptr<grpc::Server> peer_server;
  std::unique_ptr<ServerGroup> group;
  std::atomic<ServerGroup*> group_for_status{nullptr};  // the peers' GetGroup reads it
  std::unique_ptr<Standby> standby;  // until the leadership takes its store
  MemberAddress self;
  std::unique_ptr<ReplicationLeader> leader;

  // In order: the peers' calls, then the leader's waits.
  void Shutdown() {
    if (leader != nullptr) leader->Stop();
    if (peer_server != nullptr) {
      peer_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
      peer_server->Wait();
    }
  }
};

// Lets keepalive pings of clients that follow a group's leader through (common/server_addresses.h:
// every second, also without calls): never a GOAWAY "too_many_pings" for them.
void AllowClientKeepalive(grpc::ServerBuilder* builder) {
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
}

std::string HostOf(const std::string& host_port) {
  return host_port.substr(0, host_port.rfind(':'));
}
std::string PortOf(const std::string& host_port) {
  return host_port.substr(host_port.rfind(':') + 1);
}

// The host others reach this server at: replication.advertise_host, else the listen host, else
// (a wildcard listen host) the machine's name.
std::string AdvertisedHost(const ServerConfig& config) {
  if (!config.replication().advertise_host().empty()) return config.replication().advertise_host();
  const std::string host = HostOf(config.listen_address());
  if (host != "0.0.0.0" && host != "[::]" && host != "::" && !host.empty()) return host;
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return name;
}

// A replicated group's member: serves ServerPeer on its peer port, opens its store as a standby
// and joins the group (server/group/server_group.h); its RoleCycle then campaigns. Sets
// member->group, member->standby and member->self; false (logged) when it cannot.
bool JoinGroup(const ServerConfig& config, const LifeOptions& options,
               const storage::DurableStoreOptions& store_options,
               const std::shared_ptr<grpc::ServerCredentials>& credentials,
               GroupMember* member) {
  const ReplicationConfig& replication = config.replication();
  const std::string host = AdvertisedHost(config);
  MemberAddress self;
  self.name = !options.name.empty() ? options.name
              : !replication.name().empty()
                  ? replication.name()
                  : absl::StrCat(host, "-", PortOf(config.listen_address()));
  self.serve_address = absl::StrCat(host, ":", PortOf(config.listen_address()));
  const std::string peer_listen =
      options.peer_listen.empty() ? replication.peer_listen_address() : options.peer_listen;

  // The group's status as this member sees it; the leader adds its standbys (PeerService).
  ServerGroup* group = nullptr;
  std::string name = self.name;
  member->peer_service = std::make_unique<PeerService>([member, name](GroupStatus* status) {
    if (ServerGroup* group = member->group_for_status.load(); group != nullptr) {
      group->FillStatus(status);
    } else {
      status->set_name(name);
    }
  });
  grpc::ServerBuilder builder;
  int peer_port = 0;
  builder.AddListeningPort(peer_listen, credentials, &peer_port);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(config.max_message_bytes());
  builder.SetMaxSendMessageSize(config.max_message_bytes());
  AllowClientKeepalive(&builder);
  AddPeerKeepalive(&builder);  // a silent standby's stream ends in <= 1.5 s
  builder.RegisterService(member->peer_service.get());
  member->peer_server = builder.BuildAndStart();
  if (member->peer_server == nullptr || peer_port == 0) {
    LOG(ERROR) << "cannot listen for the group's peers on " << peer_listen << ": "
               << WhyCannotListen(peer_listen);
    return false;
  }
  member->peer_server->GetHealthCheckService()->SetServingStatus(false);
  self.peer_address = absl::StrCat(host, ":", peer_port);
  if (!options.peer_port_file.empty()) {
    if (absl::Status written = WriteFileAtomically(options.peer_port_file, absl::StrCat(peer_port, "\n"));
        !written.ok()) {
      LOG(ERROR) << written;
      return false;
    }
  }

  StandbyOptions standby_options;
  standby_options.name = self.name;
  standby_options.peer_address = self.peer_address;
  standby_options.store_options = store_options;
  standby_options.security = config.security();
  standby_options.max_message_bytes = config.max_message_bytes();
  auto standby = Standby::Open(standby_options);
  if (!standby.ok()) {
    LOG(ERROR) << "cannot open the data directory: " << standby.status();
    return false;
  }
  member->standby = *std::move(standby);
  ServerGroupOptions group_options;
  group_options.job_id = config.job().job_id();
  group_options.group = replication.group();
  group_options.self = self;
  group_options.etcd_endpoints.assign(replication.etcd_endpoints().begin(),
                                      replication.etcd_endpoints().end());
  group_options.lease = absl::Milliseconds(replication.leader_lease_ms());
  group_options.standbys = replication.standbys();
  auto created = ServerGroup::Create(group_options);
  if (!created.ok()) {
    LOG(ERROR) << "cannot join the server group: " << created.status();
    return false;
  }
  member->group = *std::move(created);
  group = member->group.get();
  member->group_for_status.store(group);
  LOG(INFO) << VersionLine() << " member '" << self.name << "' of group '" << replication.group()
            << "' (peers at " << self.peer_address << ", workers at " << self.serve_address
            << " while leading), etcd " << absl::StrJoin(replication.etcd_endpoints(), ",");
  member->self = self;
  return true;
}


// The leader's side once this member won the election: the standby's store, capturing every
// commit for the standbys (ReplicationLeader). Null (logged) when it cannot take it up.
std::unique_ptr<storage::DurableStore> TakeLeadership(
    const ServerConfig& config, const storage::DurableStoreOptions& store_options,
    GroupMember* member) {
  const ReplicationConfig& replication = config.replication();
  ServerGroup* group = member->group.get();
  const MemberAddress& self = member->self;
  std::unique_ptr<storage::DurableStore> store = member->standby->TakeStore();
  const uint64_t epoch = static_cast<uint64_t>(group->epoch());
  ReplicationLeaderOptions leader_options;
  leader_options.name = self.name;
  leader_options.epoch = epoch;
  leader_options.sync = replication.sync();
  leader_options.max_buffered_bytes = replication.max_buffered_bytes();
  leader_options.standby_timeout =
      absl::Milliseconds(config.job().fault_tolerance().failure_timeout_ms());
  leader_options.max_wait = absl::Milliseconds(config.max_wait_ms());
  leader_options.record_in_sync = [group](const std::vector<std::string>& names,
                                          uint64_t floor) {
    return group->RecordInSync(names, floor);
  };
  leader_options.check_leadership = [group] { return group->CheckLeadership(); };
  leader_options.store = store.get();
  leader_options.checkpoint_dir = store_options.data_dir + "/replication-checkpoints";
  member->leader = std::make_unique<ReplicationLeader>(leader_options, store->LastApplied());
  ReplicationLeader* leader = member->leader.get();
  absl::Status capturing = store->StartCapturing(
      [leader](ReplicatedCommit commit) { leader->Append(std::move(commit)); },
      [leader](const storage::DurableStore::Position& position) {
        return leader->WaitReplicated(position);
      },
      epoch);
  if (capturing.ok()) capturing = leader->Start();
  if (!capturing.ok()) {
    LOG(ERROR) << "cannot take up the leadership of epoch " << epoch << ": " << capturing;
    return nullptr;
  }
  member->peer_service->SetLeader(leader);
  member->peer_server->GetHealthCheckService()->SetServingStatus(true);
  LOG(INFO) << "leading group '" << replication.group() << "' in epoch " << epoch
            << " from sequence " << store->LastApplied().sequence;
  return store;
}

// How often the failure detector returns tcmalloc's free pages above kKeepFreeHeapBytes to the
// system (common/process.h): a few syncs' buffers stay for reuse, a burst's do not.
constexpr absl::Duration kReleaseFreeHeapEvery = absl::Seconds(5);
constexpr size_t kKeepFreeHeapBytes = size_t{32} << 20;

// Restores centers, weights, bookkeeping and membership from a previous server life.
// A sharded job's range group (`ranges`, null otherwise) gets its kept range snapshots.
absl::Status LoadState(const JobConfig& job, storage::DurableStore* store, Membership* membership,
                       CenterTable* centers, ReliabilityTracker* tracker,
                       ParameterServerService* service, RangeService* ranges,
                       bool restored_from_backup) {
  auto state = store->LoadAll();
  if (!state.ok()) return state.status();
  // A range group (group > 0) registers no worker, so its store has no server record: its
  // centers and range snapshots are its whole state.
  if (!state->server.has_value() && state->centers.empty()) {
    LOG(INFO) << "fresh data directory: starting from the model's initialisation";
    return absl::OkStatus();
  }
  // A declared model (docs/design.md §11) has its one stage once its stored center declares it; a
  // sharded job's declaration is a record of its own, declared first.
  const int stages = job.model().declared_by_worker() ? 1 : centers->num_stages();
  if (auto declared = state->centers.find(CenterTable::kDeclarationStage);
      declared != state->centers.end()) {
    if (!job.model().declared_by_worker() || job.sharding().groups() <= 1) {
      return absl::DataLossError("a stored model declaration in a job whose model is not a "
                                 "sharded declared one");
    }
    if (absl::Status ok = centers->Declare(declared->second.params()); !ok.ok()) {
      return absl::DataLossError(
          absl::StrCat("the stored declaration of the model: ", ok.message()));
    }
  }
  for (const auto& [stage, center] : state->centers) {
    if (stage == CenterTable::kDeclarationStage) continue;
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
  if (ranges != nullptr) ranges->Restore(*state);
  if (!state->server.has_value()) {
    LOG(INFO) << "restored " << state->centers.size() << " range centers and "
              << state->range_snapshots.size() << " range snapshots";
    return absl::OkStatus();
  }
  // Fault scores follow the workers' names (docs/design.md §4.5): each slot's owner in the stored
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
  // Restored from a backup: the trainers went on past it, so none keeps its slot (Membership).
  RETURN_IF_ERROR(membership->Restore(*state->server, slots, grace, restored_from_backup));
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

}  // namespace

int RunServerLife(const ServerConfig& config, const LifeOptions& options) {
  RealClock clock;
  const JobConfig& job = config.job();
  storage::DurableStoreOptions store_options =
      storage::DurableStoreOptions::FromConfig(config.durability(), job.step_log());
  store_options.accept_wal_loss = options.accept_wal_loss;
  auto credentials = MakeServerCredentials(config.security());
  if (!credentials.ok()) {
    LOG(ERROR) << credentials.status();
    return 2;
  }
  // A replicated group's member is a standby until it wins the leadership (or a signal ends it);
  // a single server opens its store at once.
  const bool replicated = config.has_replication();
  GroupMember member;
  absl::StatusOr<std::unique_ptr<storage::DurableStore>> store;
  if (replicated && !options.restore_from.empty()) {
    LOG(ERROR) << "--restore_from: restoring a member of a replicated group is not supported yet "
                  "(docs/operations.md#backup-and-restore)";
    return 2;
  }
  // This life's roles (server/group/role_cycle.h): a group's member is a standby until it
  // wins the leadership; a single server leads from the start. A signal ends any role.
  std::unique_ptr<Election> election = SoleServer();
  if (replicated) {
    grpc::EnableDefaultHealthCheckService(true);
    if (!JoinGroup(config, options, store_options, *credentials, &member)) return 1;
    election = std::make_unique<GroupElection>(member.group.get(), member.standby.get());
  }
  RoleCycle cycle(election.get());
  std::thread signals([&cycle] {
    const int code = WaitForTerminationSignal();
    if (code != kLifeOver) LOG(INFO) << "signal " << code << ": shutting down";
    cycle.Stop();
  });
  // Every return below releases the signal thread.
  absl::Cleanup join_signals = [&signals] {
    NotifyMainThread(kLifeOver);
    signals.join();
  };
  if (!cycle.AwaitLeadership()) {
    member.Shutdown();
    return 0;
  }
  if (replicated) {
    std::unique_ptr<storage::DurableStore> led = TakeLeadership(config, store_options, &member);
    if (led == nullptr) {
      cycle.HandOver();
      member.Shutdown();
      return kRunAgain;
    }
    store = std::move(led);
  } else {
    if (!options.restore_from.empty()) {
      if (store_options.data_dir.empty()) {
        LOG(ERROR) << "--restore_from needs a data directory (durability.data_dir or --data_dir)";
        return 2;
      }
      auto restored = storage::RestoreBackup(options.restore_from, store_options.data_dir);
      if (!restored.ok()) {
        LOG(ERROR) << "cannot restore the backup: " << restored.status();
        return 1;
      }
      LOG(WARNING) << "restored the backup " << options.restore_from << " (made by "
                   << restored->server_version << "; " << restored->files << " files, "
                   << restored->bytes << " bytes) into " << store_options.data_dir
                   << ": starting from its commit (epoch " << restored->epoch << ", sequence "
                   << restored->sequence << ")";
    }
    store = storage::OpenDataDir(store_options);
  }
  if (!store.ok()) {
    LOG(ERROR) << "cannot open the data directory: " << store.status();
    return 1;
  }
  // A sharded job (docs/design.md §10.2): this group holds its range of every stage.
  const bool sharded = job.sharding().groups() > 1;
  auto centers = CenterTable::Create(job, sharded ? config.shard().group() : 0);
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
                                 *std::move(token), operator_token);

  // A sharded job's range service; group 0 authorizes in process, the others ask group 0.
  std::unique_ptr<RemoteAuthorizer> remote_authorizer;
  std::unique_ptr<RangeService> range_service;
  std::unique_ptr<RangeCheck> range_check;
  std::unique_ptr<RangeReader> range_reader;
  if (sharded) {
    RangeService::Authorizer authorize;
    if (config.shard().group() == 0) {
      authorize = [&service](const grpc::ServerContext* context,
                             const AuthorizeRangeRequest& request) {
        return service.Authorize(context, request);
      };
    } else {
      auto made = RemoteAuthorizer::Create(config);
      if (!made.ok()) {
        LOG(ERROR) << "shard.group_addresses[0]: " << made.status();
        return 2;
      }
      remote_authorizer = *std::move(made);
      authorize = [authorizer = remote_authorizer.get()](const grpc::ServerContext* context,
                                                         const AuthorizeRangeRequest& request) {
        return authorizer->Authorize(context, request);
      };
    }
    range_service = std::make_unique<RangeService>(
        config, centers->get(), db, std::move(authorize),
        [&service](const grpc::ServerContext* context) { return service.CheckServing(context); },
        service.admission().inflight_bytes);
    service.SetShardingStatus(
        [ranges = range_service.get()](ShardingStatus* status) { ranges->FillStatus(status); });
    if (config.shard().group() == 0) {
      auto check = RangeCheck::Create(config, range_service.get());
      if (!check.ok()) {
        LOG(ERROR) << "shard.group_addresses: " << check.status();
        return 2;
      }
      range_check = *std::move(check);
      service.SetRangeCheck([check = range_check.get()](const SlotId& slot, int64_t step) {
        return check->Check(slot, step);
      });
      service.SetPushCheck([check = range_check.get()](const SlotId& slot, uint64_t sequence) {
        return check->CheckPushed(slot, sequence);
      });
      // ExportCenter gathers every range (docs/sharding.md#exporting-the-center).
      auto exporter = RangeReader::Create(config, range_service.get(), operator_token);
      if (!exporter.ok()) {
        LOG(ERROR) << "shard.group_addresses: " << exporter.status();
        return 2;
      }
      range_reader = *std::move(exporter);
      service.SetShardedExport([&job, table = centers->get(), ranges = range_reader.get(),
                                &clock](absl::Time deadline) {
        return ReadShardedCenterExport(
            job, *table,
            [ranges](int stage, absl::Time by) { return ranges->ReadStage(stage, by); },
            deadline, clock, VersionLine());
      });
      // An audited window's start is the ranges' (docs/recovery.md#audits): read while its
      // trainer waits for the commit's answer, bounded well inside the trainer's own deadline.
      service.SetRangeSnapshotFill([&job, table = centers->get(), ranges = range_reader.get(),
                                    &clock](Snapshot* header) -> absl::Status {
        constexpr absl::Duration kReadLimit = absl::Seconds(5);
        ASSIGN_OR_RETURN(const compute::StageLayout layout,
                         WholeStageLayout(job, *table, header->slot().stage()));
        return ranges->FillSnapshot(layout, header, clock.Now() + kReadLimit);
      });
    }
    // Group 0's ExportRange calls (and GLOBAL_CHECKPOINT's) are operator calls.
    range_service->SetOperatorCheck(
        [&service](const grpc::ServerContext* context) { return service.CheckOperator(context); });
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(config.listen_address(), *credentials, &port);
  // gRPC sets SO_REUSEPORT by default, and a second server on this port would then share it
  // with the first (clients alternating between two servers that both hand out slot 0).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  AllowClientKeepalive(&builder);
  // gRPC's buffers of received requests and its threads are bounded (server/call_gate.h); the
  // service bounds the parked long polls and the bytes of requests it handles.
  grpc::ResourceQuota quota("rebound_server");
  quota.Resize(static_cast<size_t>(service.admission().inflight_bytes));
  quota.SetMaxThreads(service.admission().threads);
  builder.SetResourceQuota(quota);
  builder.SetMaxReceiveMessageSize(config.max_message_bytes());
  builder.SetMaxSendMessageSize(config.max_message_bytes());
  builder.RegisterService(&service);
  if (range_service != nullptr) builder.RegisterService(range_service.get());
  // Crash detection (docs/design.md §13): the workers' sessions, checked as their calls are.
  WorkerSessions sessions(
      &membership,
      [&service](const grpc::ServerContextBase* context, uint64_t incarnation) {
        return service.CheckWorkerCall(context, incarnation);
      },
      &clock);
  builder.RegisterService(&sessions);
  // Metrics (docs/operations.md#metrics): every RPC counted and timed, the status at each scrape.
  MetricsRegistry metrics;
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(NewParseStatusFactory());
  if (config.metrics().enabled()) creators.push_back(NewRpcMetricsFactory(&metrics, &clock));
  builder.experimental().SetInterceptorCreators(std::move(creators));
  MarkHandOffToGrpc();  // what the callback API's threads read (common/grpc_handoff.h)
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    LOG(ERROR) << "cannot listen on " << config.listen_address() << ": "
               << WhyCannotListen(config.listen_address());
    return 1;
  }
  // Health says NOT_SERVING (and the service UNAVAILABLE) until the durable state is loaded.
  server->GetHealthCheckService()->SetServingStatus(false);
  absl::Status loaded_state = LoadState(job, db, &membership, centers->get(), &tracker, &service,
                                        range_service.get(), !options.restore_from.empty());
  if (!loaded_state.ok()) {
    LOG(ERROR) << "cannot load the durable state from '" << config.durability().data_dir()
               << "': " << loaded_state;
    server->Shutdown();
    return 1;
  }
  std::unique_ptr<RangeCheckpoints> range_checkpoints;
  if (EffectiveRecoveryPolicy(job) == GLOBAL_CHECKPOINT) {
    const std::string& data_dir = config.durability().data_dir();
    RangeCheckpointCalls ranges;
    if (sharded) {
      // Every group keeps its range of each cut (docs/sharding.md#global-checkpoint).
      const std::string range_dir =
          data_dir.empty() ? std::string() : data_dir + "/range_checkpoints";
      absl::Status enabled = range_service->EnableGlobalCheckpoint(
          range_dir, [&service](const grpc::ServerContext* context) {
            return service.CheckOperator(context);
          });
      if (!enabled.ok()) {
        LOG(ERROR) << "cannot keep range checkpoints in '" << range_dir << "': " << enabled;
        server->Shutdown();
        return 1;
      }
      if (config.shard().group() == 0) {
        auto made = RangeCheckpoints::Create(config, range_service.get(), operator_token);
        if (!made.ok()) {
          LOG(ERROR) << "shard.group_addresses: " << made.status();
          server->Shutdown();
          return 2;
        }
        range_checkpoints = *std::move(made);
        ranges.take = [calls = range_checkpoints.get()](int64_t step, int64_t keep_from) {
          return calls->Take(step, keep_from);
        };
        ranges.roll_back = [calls = range_checkpoints.get()](int64_t step, uint64_t id) {
          return calls->RollBack(step, id);
        };
      }
    }
    // The barrier, the rollback and the slots' checkpoints are group 0's (or the one server's).
    if (!sharded || config.shard().group() == 0) {
      const std::string dir = data_dir.empty() ? std::string() : data_dir + "/checkpoints";
      if (absl::Status enabled = service.EnableGlobalCheckpoint(dir, std::move(ranges));
          !enabled.ok()) {
        LOG(ERROR) << "cannot load the global checkpoint from '" << dir << "': " << enabled;
        server->Shutdown();
        return 1;
      }
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
  if (replicated) {
    ServerGroup* group = member.group.get();
    ReplicationLeader* leader = member.leader.get();
    service.SetGroupStatus([group, leader](GroupStatus* status) {
      group->FillStatus(status);
      leader->FillStatus(status);
    });
  }
  MarkHandOffToGrpc();  // and what was set up since, before the first call is served
  service.MarkReady();
  server->GetHealthCheckService()->SetServingStatus(true);
  LOG(INFO) << "admission bounds: " << service.admission().parked_calls
            << " parked long polls, " << service.admission().inflight_bytes
            << " request bytes in flight, " << service.admission().threads << " threads";
  LOG(INFO) << VersionLine() << " serving job '" << config.job().job_id() << "' on port " << port
            << " (" << config.job().topology().replicas() << " x "
            << config.job().topology().stages() << " slots)"
            << (ServesTls(config.security())
                    ? (config.security().tls().require_client_cert() ? ", mutual TLS" : ", TLS")
                    : ", plaintext")
            << (config.security().token_file().empty() ? "" : ", bearer token required");
  if (!options.port_file.empty()) {
    absl::Status written = WriteFileAtomically(options.port_file, absl::StrCat(port, "\n"));
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
    // A failed replication barrier fenced the store (storage/durable_store.h): hand over.
    if (health.ok()) health = db->Fenced();
    return health;
  };
  // The in-memory state is ahead of the durable one, or the store refuses writes: stop serving
  // so the supervisor (or the operator) restarts the server, which reloads what was acknowledged.
  hooks.on_unhealthy = [&server, &cycle](const absl::Status& why) {
    server->GetHealthCheckService()->SetServingStatus(false);
    // A group's leader hands over to an in-sync standby instead of waiting for an operator.
    cycle.Unhealthy(why);
  };
  hooks.after_pass = [&] {
    // tcmalloc keeps what a burst of large requests freed until later frees; give it back.
    if (clock.Now() - last_release >= kReleaseFreeHeapEvery) {
      last_release = clock.Now();
      ReleaseFreeHeapAbove(kKeepFreeHeapBytes);
    }
    service.MaybeRollBack();
    sessions.EndAged();
  };
  FailureDetector detector(job, &membership, &tracker, &clock, std::move(hooks));
  absl::Notification stop;
  std::thread detector_thread([&] { detector.Run(&stop); });

  // Exports while training (job config `export`, server/periodic_export.h): the leader's.
  std::unique_ptr<PeriodicExporter> exporter;
  std::thread export_thread;
  if (job.has_export_()) {
    const std::string export_dir = !job.export_().dir().empty()
                                       ? job.export_().dir()
                                       : absl::StrCat(store_options.data_dir, "/exports");
    ExportSource source;
    source.read = [&job, &centers] { return ReadCenterExport(job, **centers, VersionLine()); };
    source.job_step = [&service] { return service.NewestAppliedStep(); };
    exporter = std::make_unique<PeriodicExporter>(job.export_(), export_dir, &clock, source);
    if (absl::Status ready = exporter->Init(); !ready.ok()) {
      LOG(ERROR) << ready << "; training goes on without exports";
      exporter.reset();
    } else {
      LOG(INFO) << "exporting the center to " << export_dir;
      export_thread = std::thread([&] { exporter->Run(&stop); });
    }
  }

  // A group's leader watches its leadership (RoleCycle::AwaitEnd, every 50 ms). A lease renewal
  // late by TTL/2 holds every acknowledgement (ReplicationLeader::WaitReplicated) until it
  // comes; a lease lost (not renewed within TTL) makes the leader come back as a standby.
  const bool run_again = cycle.AwaitEnd() == RoleCycle::End::kRunAgain;
  if (run_again) {
    if (absl::Status fenced = db->Fenced(); !fenced.ok()) {
      // A failed barrier (often the lost lease, seen by a commit before the watch).
      LOG(WARNING) << fenced.message() << ": no longer acknowledging; starting again as a standby";
    } else {
      LOG(WARNING) << cycle.why() << ": no longer acknowledging; handing the leadership over; "
                   << "starting again as a standby";
    }
  }
  server->GetHealthCheckService()->SetServingStatus(false);
  // No call is answered from here on: the barrier fails every waiting commit. (Not waiting for
  // the monitor here: it may be in an etcd call that etcd's absence makes last seconds.)
  if (member.leader != nullptr) member.leader->BeginStop();
  stop.Notify();
  detector_thread.join();
  if (export_thread.joinable()) export_thread.join();
  // An orderly stop writes the final center (a fenced or unhealthy leader is no longer the one
  // whose center counts).
  if (exporter != nullptr && !run_again) {
    if (auto written = exporter->ExportIfMoved(); !written.ok()) {
      LOG(WARNING) << "the final export failed: " << written.status();
    }
  }
  // Nothing left for the shutdown to wait out: the sessions end now (not as losses).
  sessions.EndAll();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();
  // A standby takes over at once instead of after the lease.
  cycle.HandOver();
  member.Shutdown();
  LOG(INFO) << "stopped";
  return run_again ? kRunAgain : 0;
}

}  // namespace rebound::server
