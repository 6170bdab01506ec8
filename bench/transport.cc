// Sync-transport benchmark (docs/design.md §9: "sync round trip of a 16 MiB shard >= 0.8x the
// throughput of a bare gRPC echo of the same bytes").
//
// Measures, in one run, on loopback:
//   * Sync: the real ParameterServerService, started in this process on 127.0.0.1:0 and wired as
//     server/main.cc wires it (Membership persisting to the store, ReliabilityTracker,
//     CenterTable, a DurableStore on disk as with durability.data_dir set and fsync off (the
//     shipped configs/server.pbtxt; --data_dir= runs it in memory), the default health service
//     and the
//     failure detector). A client registers as TRAINER over gRPC, heartbeats
//     like a worker, and calls Sync with a new step each time (steps 8, 16, ...: sync_period 8).
//     Every call goes the product's whole path: parse, validation (ids, shapes, finite values of
//     params and of the optimizer state), weighting, the elastic move, the RocksDB write batch
//     (center, snapshot, weight record, step-log GC), and the reply c_before after the commit.
//   * Echo: a trivial gRPC service (bench/echo.proto) on a second server built with the same
//     settings, called on the same kind of channel (rebound_worker's: CreateCustomChannel with
//     the receive limit lifted; servers with max_message_bytes as send and receive limits). Its
//     request serializes to exactly the SyncRequest's size (the payload is the SyncRequest's own
//     bytes) and its reply to exactly the SyncResponse's size (bytes taken from the request).
//
// The model's one stage is MLP 784-2048-1256-10: 4,193,794 float32 = 16,775,176 bytes
// (16 MiB - 2,040 bytes). params = the initial center + 1e-3 (new step each call). By default
// the request also carries the optimizer state (m, v, last_hdiag of the same shapes), as
// rebound_worker sends it (worker/training.cc): 4 x 16 MiB out, 16 MiB back. --optimizer=0
// sends params only (16 MiB out, 16 MiB back).
//
// Throughput counts request + reply bytes (serialized protobuf sizes) per call, over the time of
// the calls as the client sees them (stub call to reply parsed) plus, after each round, the wait
// until the process is idle again (so RocksDB's background flushes and compactions count for
// Sync and do not slow down the echo round after it). Sync and echo run in alternating rounds
// of --calls calls each (which goes first alternates too) after --warmup calls of each; each
// figure is the median over --rounds rounds. The last line is
//   RESULT transport: sync_mib_s=<x> echo_mib_s=<y> ratio=<x/y>
//
// Flags: --calls=N (per round, 4), --rounds=R (5), --warmup=W (2), --optimizer=0|1 (1),
//   --data_dir=DIR: where the store goes (a fresh subdirectory of DIR, removed at the end;
//     default $TEST_TMPDIR, else /tmp); an empty DIR keeps it in memory (RocksDB's MemEnv, as
//     with an empty durability.data_dir);
//   --breakdown=1: afterwards, the server's steps of one Sync timed one by one in this thread
//     (parse, validation, unbundle, ElasticSync, WriteBatch, DurableStore::Commit, reply),
//     on a second CenterTable and DurableStore of the same kind, as service.cc runs them.

#include <glog/logging.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <time.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "bench/echo.grpc.pb.h"
#include "bench/figures.h"
#include "bench/flags.h"
#include "common/clock.h"
#include "common/config.h"
#include "common/process.h"
#include "common/security.h"
#include "google/protobuf/io/coded_stream.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "proto/rebound.grpc.pb.h"
#include "server/center_table.h"
#include "server/sync_batch.h"
#include "server/membership.h"
#include "server/reliability.h"
#include "server/service.h"
#include "storage/durable_store.h"

namespace rebound {
namespace bench {
namespace {

struct Flags {
  int calls = 4;
  int rounds = 5;
  int warmup = 2;
  bool optimizer = true;
  bool breakdown = false;
  // Empty: in memory.
  std::string data_dir = std::getenv("TEST_TMPDIR") != nullptr ? std::getenv("TEST_TMPDIR") : "/tmp";
};

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (ParseIntFlag(a, "--calls", &flags.calls) || ParseIntFlag(a, "--rounds", &flags.rounds) ||
        ParseIntFlag(a, "--warmup", &flags.warmup) ||
        ParseBoolFlag(a, "--optimizer", &flags.optimizer) ||
        ParseBoolFlag(a, "--breakdown", &flags.breakdown) ||
        ParseTextFlag(a, "--data_dir", &flags.data_dir)) {
      continue;
    }
    ExitUnknownFlag(a);
  }
  if (flags.calls < 1 || flags.rounds < 1 || flags.warmup < 0) {
    ExitBadFlags("--calls and --rounds must be >= 1, --warmup >= 0");
  }
  return flags;
}

// The server's config, parsed and validated like a file (the job inline). Durability: the
// --data_dir subdirectory (set in Run), fsync off as shipped. 4 replicas as in the shipped job; one of them syncs here.
constexpr char kServerConfig[] = R"pb(
  listen_address: "127.0.0.1:0"
  job {
    job_id: "bench-transport"
    model {
      input_dim: 784
      layers { width: 2048 activation: RELU }
      layers { width: 1256 activation: RELU }
      layers { width: 10 activation: IDENTITY }
      init_seed: 1
    }
    topology { replicas: 4 stages: 1 }
    easgd { mode: EASGD sync_period: 8 }
    weighting { policy: DYNAMIC }
    scheduling: ASYNC
    training { max_steps: 1000000000 }
  }
)pb";
constexpr char kModelName[] = "784-2048-1256-10";
constexpr int kSyncPeriod = 8;

// A trivial echo: the reply is the first reply_payload_bytes bytes of the request (zero-padded
// if it asks for more than it sent).
class EchoServer final : public Echo::Service {
 public:
  grpc::Status Echo(grpc::ServerContext*, const EchoRequest* request, EchoReply* reply) override {
    const std::string& in = request->payload();
    const size_t n = request->reply_payload_bytes();
    std::string* out = reply->mutable_payload();
    out->assign(in, 0, std::min(n, in.size()));
    out->resize(n);
    return grpc::Status::OK;
  }
};

std::unique_ptr<grpc::Server> StartServer(grpc::Service* service, int max_message_bytes,
                                          int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port);
  builder.SetMaxReceiveMessageSize(max_message_bytes);
  builder.SetMaxSendMessageSize(max_message_bytes);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) return nullptr;
  return server;
}

// rebound_worker's channel (worker/main.cc).
std::shared_ptr<grpc::Channel> WorkerChannel(int port) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  return grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                   grpc::InsecureChannelCredentials(), args);
}

void Deadline(grpc::ClientContext* context, int seconds) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
}

// `bundle` with every value replaced by f(value).
template <typename F>
TensorBundle Mapped(const TensorBundle& bundle, F f) {
  TensorBundle out;
  for (const Tensor& t : bundle.tensors()) {
    std::vector<float> values(t.data().size() / sizeof(float));
    std::memcpy(values.data(), t.data().data(), t.data().size());
    for (float& v : values) v = f(v);
    Tensor* copy = out.add_tensors();
    *copy = t;
    copy->set_data(values.data(), values.size() * sizeof(float));
  }
  return out;
}

size_t VarintSize(uint64_t n) { return google::protobuf::io::CodedOutputStream::VarintSize64(n); }

// Serialized size of a `bytes` field with tag 1 and length n (omitted when empty).
size_t BytesFieldSize(size_t n) { return n == 0 ? 0 : 1 + VarintSize(n) + n; }

// The largest payload length whose field, with `other` bytes of other fields, serializes to at
// most `target` bytes.
size_t PayloadFor(size_t target, size_t other) {
  size_t n = target > other + 11 ? target - other - 11 : 0;
  while (BytesFieldSize(n + 1) + other <= target) ++n;
  return n;
}

double Ms(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// The server's steps of one Sync, timed one by one, in the order and with the calls of
// ParameterServerService::Sync (server/service.cc), on a table and a store of their own. Prints
// the median of each over `iterations` syncs; returns false on an error.
bool Breakdown(const ServerConfig& config, const std::string& request_wire, int iterations) {
  const JobConfig& job = config.job();
  storage::DurableStoreOptions options =
      storage::DurableStoreOptions::FromConfig(config.durability(), job.step_log());
  if (!options.data_dir.empty()) options.data_dir += "-breakdown";
  auto store = storage::DurableStore::Open(options);
  auto table = server::CenterTable::Create(job);
  if (!store.ok() || !table.ok()) return false;
  const double alpha = EffectiveMovingRate(job);
  enum { kParse, kValidate, kUnbundle, kElastic, kBatch, kCommit, kReply, kTotal, kPhases };
  const char* names[kPhases] = {
      "parse SyncRequest (protobuf, in gRPC)",
      "ValidateBundle: params + optimizer (finite)",
      "Unbundle params (copy to packed)",
      "ElasticSync without its commit",
      "commit: headers, checksum, WriteBatch",
      "commit: DurableStore::Commit (files + RocksDB)",
      "reply: Bundle(c_before), serialize (in gRPC)",
      "sum"};
  std::vector<double> ms[kPhases];
  for (int i = 0; i < iterations; ++i) {
    using Clock = std::chrono::steady_clock;
    const auto t0 = Clock::now();
    SyncRequest request;
    if (!request.ParseFromString(request_wire)) return false;
    request.set_step(8 * (i + 1));
    const auto t1 = Clock::now();
    const int stage = 0;
    if (!(*table)->ValidateBundle(stage, request.params(), "params").ok()) return false;
    const OptimizerState& optimizer = request.optimizer();
    for (const TensorBundle* b : {&optimizer.m(), &optimizer.v(), &optimizer.last_hdiag()}) {
      if (b->tensors_size() > 0 && !(*table)->ValidateBundle(stage, *b, "opt").ok()) return false;
    }
    const auto t2 = Clock::now();
    const std::vector<float> x = (*table)->Unbundle(stage, request.params());
    const auto t3 = Clock::now();
    double batch_ms = 0, commit_ms = 0, bundle_ms = 0;
    SyncResponse response;
    SlotId slot;
    slot.set_replica(request.slot().replica());
    slot.set_stage(request.slot().stage());
    const compute::StageLayout& layout = (*table)->layout(stage);
    auto commit = [&](int64_t version, absl::Span<const float> center,
                      absl::Span<const float> worker_after, absl::Span<const float> before) {
      const auto c0 = Clock::now();
      storage::WriteBatch batch;
      WeightRecord weight;
      *weight.mutable_slot() = slot;
      weight.set_last_update_step(request.step());
      weight.set_update_count(i + 1);
      server::AddSyncToBatch(layout, slot, request, version, center, worker_after, weight,
                             &batch);
      const auto c1 = Clock::now();
      absl::Status committed = (*store)->Commit(batch);
      const auto c2 = Clock::now();
      *response.mutable_center_before() = (*table)->Bundle(stage, before);
      const auto c3 = Clock::now();
      batch_ms = Ms(c0, c1);
      commit_ms = Ms(c1, c2);
      bundle_ms = Ms(c2, c3);
      return committed;
    };
    auto one = [](int64_t, double) -> absl::StatusOr<double> { return 1.0; };
    const size_t n = x.size();
    std::unique_ptr<float[]> worker_after(new float[n]);
    auto result = (*table)->ElasticSync(stage, x, alpha, one, commit,
                                        absl::MakeSpan(worker_after.get(), n));
    if (!result.ok()) return false;
    const auto t4 = Clock::now();
    response.set_center_version(result->version);
    response.set_weight(1.0);
    response.set_moving_rate(alpha);
    std::string wire;
    if (!response.SerializeToString(&wire)) return false;
    const auto t5 = Clock::now();
    ms[kParse].push_back(Ms(t0, t1));
    ms[kValidate].push_back(Ms(t1, t2));
    ms[kUnbundle].push_back(Ms(t2, t3));
    ms[kElastic].push_back(Ms(t3, t4) - batch_ms - commit_ms - bundle_ms);
    ms[kBatch].push_back(batch_ms);
    ms[kCommit].push_back(commit_ms);
    ms[kReply].push_back(bundle_ms + Ms(t4, t5));
    ms[kTotal].push_back(Ms(t0, t5));
  }
  std::printf("breakdown of the server's work per Sync (one thread, median of %d syncs on a second"
              " table and %s store):\n",
              iterations, options.data_dir.empty() ? "in-memory" : "on-disk");
  const double total = Median(ms[kTotal]);
  for (int p = 0; p < kPhases; ++p) {
    const double m = Median(ms[p]);
    std::printf("  %-46s %8.1f ms  %5.1f%%\n", names[p], m, 100.0 * m / total);
  }
  return true;
}

struct RoundStats {
  std::vector<double> mib_s;        // per round
  std::vector<double> ms_per_call;  // per round, the calls alone
  std::vector<double> drain_ms;     // per round, waiting for the process to go idle afterwards
};

double ProcessCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// Waits until this process has used less than 10% of a core over a 10 ms window (RocksDB's
// background flushes and compactions done), at most 20 s. Returns the seconds waited beyond the
// first window (0 when the process was idle at once).
double WaitForIdle() {
  constexpr double kWindow = 0.010;
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - start < std::chrono::seconds(20)) {
    const double cpu0 = ProcessCpuSeconds();
    std::this_thread::sleep_for(std::chrono::duration<double>(kWindow));
    if (ProcessCpuSeconds() - cpu0 < 0.1 * kWindow) break;
  }
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return std::max(0.0, waited - kWindow);
}

int Run(const Flags& flags) {
  // ---- the server, wired as server/main.cc does -------------------------------------------
  auto parsed = ParseServerConfig(kServerConfig, "bench-server.pbtxt", "/");
  if (!parsed.ok()) {
    std::fprintf(stderr, "server config: %s\n", parsed.status().ToString().c_str());
    return 1;
  }
  ServerConfig config = *std::move(parsed);
  if (!flags.data_dir.empty()) config.mutable_durability()->set_data_dir(flags.data_dir);
  const JobConfig& job = config.job();
  RealClock clock;
  auto store = storage::DurableStore::Open(
      storage::DurableStoreOptions::FromConfig(config.durability(), job.step_log()));
  if (!store.ok()) {
    std::fprintf(stderr, "store: %s\n", store.status().ToString().c_str());
    return 1;
  }
  auto centers = server::CenterTable::Create(job);
  if (!centers.ok()) {
    std::fprintf(stderr, "centers: %s\n", centers.status().ToString().c_str());
    return 1;
  }
  server::ReliabilityTracker tracker(job.weighting(), job.topology().replicas());
  storage::DurableStore* db = store->get();
  server::Membership membership(
      job, &clock, [db](const ServerRecord& record, const std::vector<SlotRecord>& slots) {
        storage::WriteBatch batch;
        batch.PutServer(record);
        for (const SlotRecord& slot : slots) batch.PutSlot(slot);
        return db->Commit(batch);
      });
  server::ParameterServerService service(config, &membership, centers->get(), &tracker, db,
                                         &clock);
  grpc::EnableDefaultHealthCheckService(true);
  int sync_port = 0;
  std::unique_ptr<grpc::Server> sync_server =
      StartServer(&service, config.max_message_bytes(), &sync_port);
  if (sync_server == nullptr) {
    std::fprintf(stderr, "cannot listen on 127.0.0.1:0\n");
    return 1;
  }
  // The baseline's server: the same builder settings.
  EchoServer echo_service;
  int echo_port = 0;
  std::unique_ptr<grpc::Server> echo_server =
      StartServer(&echo_service, config.max_message_bytes(), &echo_port);
  if (echo_server == nullptr) {
    std::fprintf(stderr, "cannot listen on 127.0.0.1:0 (echo)\n");
    return 1;
  }

  sync_server->GetHealthCheckService()->SetServingStatus(false);
  {
    // A fresh store: LoadAll finds nothing, and main.cc's LoadState would start from the
    // model's initialisation.
    auto state = db->LoadAll();
    if (!state.ok() || state->server.has_value()) {
      std::fprintf(stderr, "unexpected durable state\n");
      return 1;
    }
  }
  service.MarkReady();
  sync_server->GetHealthCheckService()->SetServingStatus(true);

  // The failure detector of main.cc (the client heartbeats, so it never fires here).
  const absl::Duration period = absl::Milliseconds(
      std::max(10, std::min(100, job.fault_tolerance().heartbeat_interval_ms() / 4)));
  absl::Notification stop;
  std::atomic<int> failures{0};
  std::thread detector([&] {
    while (!stop.WaitForNotificationWithTimeout(period)) {
      for (const server::FailedWorker& failed : membership.DetectFailures()) {
        tracker.OnFault(failed.name, clock.Now());  // the worker's fault, by name
        if (failed.had_slot) tracker.SetLive(failed.slot, false);
        ++failures;
      }
    }
  });

  auto finish = [&](int rc) {
    if (!stop.HasBeenNotified()) stop.Notify();
    detector.join();
    echo_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    sync_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    echo_server->Wait();
    sync_server->Wait();
    return rc;
  };

  // ---- the trainer client -------------------------------------------------------------------
  // The trainer's channel carries its worker credential, as rebound_worker's does.
  auto credential = std::make_shared<WorkerCredential>();
  grpc::ChannelArguments worker_args;
  worker_args.SetMaxReceiveMessageSize(-1);
  auto worker_channel = MakeChannel(absl::StrCat("127.0.0.1:", sync_port), SecurityConfig(),
                                    worker_args, credential);
  if (!worker_channel.ok()) {
    std::fprintf(stderr, "channel: %s\n", worker_channel.status().ToString().c_str());
    return finish(1);
  }
  std::unique_ptr<ParameterServer::Stub> stub = ParameterServer::NewStub(*worker_channel);
  std::unique_ptr<Echo::Stub> echo_stub = Echo::NewStub(WorkerChannel(echo_port));

  RegisterRequest reg;
  reg.set_job_id(job.job_id());
  reg.set_worker_name("bench-trainer");
  reg.set_requested_role(TRAINER);
  RegisterResponse trainer;
  {
    grpc::ClientContext context;
    Deadline(&context, 10);
    const grpc::Status s = stub->Register(&context, reg, &trainer);
    if (!s.ok() || trainer.role() != TRAINER) {
      std::fprintf(stderr, "register: %s\n", s.error_message().c_str());
      return finish(1);
    }
    credential->Set(trainer.credential());
  }
  std::atomic<int64_t> last_step{0};
  std::atomic<int> heartbeat_errors{0};
  std::thread heartbeats([&] {
    const absl::Duration interval =
        absl::Milliseconds(job.fault_tolerance().heartbeat_interval_ms());
    while (!stop.WaitForNotificationWithTimeout(interval)) {
      HeartbeatRequest hb;
      hb.set_incarnation(trainer.incarnation());
      hb.set_step(last_step.load());
      hb.set_loss(1.0);
      HeartbeatResponse reply;
      grpc::ClientContext context;
      Deadline(&context, 10);
      if (!stub->Heartbeat(&context, hb, &reply).ok()) ++heartbeat_errors;
    }
  });
  auto finish_client = [&](int rc) {
    if (!stop.HasBeenNotified()) stop.Notify();
    heartbeats.join();
    return finish(rc);
  };

  PullRequest pull;
  pull.set_incarnation(trainer.incarnation());
  pull.set_stage(0);
  PullResponse start;
  {
    grpc::ClientContext context;
    Deadline(&context, 30);
    const grpc::Status s = stub->Pull(&context, pull, &start);
    if (!s.ok()) {
      std::fprintf(stderr, "pull: %s\n", s.error_message().c_str());
      return finish_client(1);
    }
  }
  size_t shard_bytes = 0;
  for (const Tensor& t : start.center().tensors()) shard_bytes += t.data().size();

  SyncRequest request;
  request.set_incarnation(trainer.incarnation());
  *request.mutable_slot() = trainer.slot();
  request.set_step(kSyncPeriod);
  *request.mutable_params() = Mapped(start.center(), [](float c) { return c + 1e-3f; });
  if (flags.optimizer) {
    OptimizerState* opt = request.mutable_optimizer();
    opt->set_step(kSyncPeriod);
    *opt->mutable_m() = Mapped(start.center(), [](float c) { return 1e-4f * c; });
    *opt->mutable_v() = Mapped(start.center(), [](float c) { return 1e-8f + 1e-4f * c * c; });
    *opt->mutable_last_hdiag() = Mapped(start.center(), [](float c) { return 1e-3f * c; });
  }
  request.set_loss(0.5);
  request.set_data_epoch(0);
  request.set_data_offset(0);
  const std::string request_wire = request.SerializeAsString();

  int64_t step = 0;
  int64_t syncs_done = 0;
  // One Sync; returns the request + reply bytes, or -1 on error. `seconds` gets the call's time.
  auto sync_once = [&](double* seconds) -> int64_t {
    step += kSyncPeriod;
    request.set_step(step);
    if (request.has_optimizer()) request.mutable_optimizer()->set_step(step);
    SyncResponse response;
    grpc::ClientContext context;
    Deadline(&context, 120);
    const auto t0 = std::chrono::steady_clock::now();
    const grpc::Status s = stub->Sync(&context, request, &response);
    const auto t1 = std::chrono::steady_clock::now();
    *seconds = std::chrono::duration<double>(t1 - t0).count();
    if (!s.ok() || !response.has_center_before() ||
        response.center_version() != syncs_done + 1) {
      std::fprintf(stderr, "sync of step %lld: %s (version %lld)\n", static_cast<long long>(step),
                   s.ok() ? "no center_before or unexpected version" : s.error_message().c_str(),
                   static_cast<long long>(response.center_version()));
      return -1;
    }
    ++syncs_done;
    last_step.store(step);
    return static_cast<int64_t>(request.ByteSizeLong() + response.ByteSizeLong());
  };

  // The first Sync gives the reply size the echo must match.
  double first_seconds = 0;
  const int64_t first_bytes = sync_once(&first_seconds);
  if (first_bytes < 0) return finish_client(1);
  const size_t sync_request_bytes = request.ByteSizeLong();
  const size_t sync_reply_bytes = static_cast<size_t>(first_bytes) - sync_request_bytes;

  EchoRequest echo_request;
  const size_t reply_payload = PayloadFor(sync_reply_bytes, 0);
  const size_t other = 1 + VarintSize(reply_payload);
  echo_request.set_reply_payload_bytes(reply_payload);
  echo_request.set_payload(request_wire.substr(0, PayloadFor(sync_request_bytes, other)));
  auto echo_once = [&](double* seconds) -> int64_t {
    EchoReply reply;
    grpc::ClientContext context;
    Deadline(&context, 120);
    const auto t0 = std::chrono::steady_clock::now();
    const grpc::Status s = echo_stub->Echo(&context, echo_request, &reply);
    const auto t1 = std::chrono::steady_clock::now();
    *seconds = std::chrono::duration<double>(t1 - t0).count();
    if (!s.ok() || reply.payload().size() != reply_payload) {
      std::fprintf(stderr, "echo: %s\n", s.error_message().c_str());
      return -1;
    }
    return static_cast<int64_t>(echo_request.ByteSizeLong() + reply.ByteSizeLong());
  };
  double ignored = 0;
  for (int i = 0; i < flags.warmup; ++i) {
    if (sync_once(&ignored) < 0 || echo_once(&ignored) < 0) return finish_client(1);
  }

  RoundStats sync_stats, echo_stats;
  // A round: --calls calls back to back, then the wait until the process is idle again, which
  // counts in the round's time. Sync leaves RocksDB work behind (memtable flushes, compactions)
  // that would otherwise run during, and slow down, the next echo round.
  auto run_round = [&](const std::function<int64_t(double*)>& call, RoundStats* stats) -> bool {
    double seconds = 0;
    int64_t bytes = 0;
    for (int i = 0; i < flags.calls; ++i) {
      double s = 0;
      const int64_t b = call(&s);
      if (b < 0) return false;
      seconds += s;
      bytes += b;
    }
    const double drain = WaitForIdle();
    stats->mib_s.push_back(static_cast<double>(bytes) / (1 << 20) / (seconds + drain));
    stats->ms_per_call.push_back(seconds * 1e3 / flags.calls);
    stats->drain_ms.push_back(drain * 1e3);
    return true;
  };
  WaitForIdle();
  const std::function<int64_t(double*)> sync_fn = sync_once, echo_fn = echo_once;
  for (int round = 0; round < flags.rounds; ++round) {
    const bool ok = round % 2 == 0
                        ? run_round(sync_fn, &sync_stats) && run_round(echo_fn, &echo_stats)
                        : run_round(echo_fn, &echo_stats) && run_round(sync_fn, &sync_stats);
    if (!ok) return finish_client(1);
  }

  // The server applied every sync exactly once.
  GetStatusResponse status;
  {
    grpc::ClientContext context;
    Deadline(&context, 10);
    if (!stub->GetStatus(&context, GetStatusRequest(), &status).ok()) return finish_client(1);
  }
  int64_t applied = 0;
  for (const SlotStatus& slot : status.slots()) {
    if (slot.owner_incarnation() == trainer.incarnation()) applied = slot.update_count();
  }
  auto stats = db->Stats();

  bool breakdown_ok = true;
  const double sync_mib_s = Median(sync_stats.mib_s);
  const double echo_mib_s = Median(echo_stats.mib_s);
  const auto [sync_min, sync_max] =
      std::minmax_element(sync_stats.mib_s.begin(), sync_stats.mib_s.end());
  const auto [echo_min, echo_max] =
      std::minmax_element(echo_stats.mib_s.begin(), echo_stats.mib_s.end());
  const size_t floats = shard_bytes / sizeof(float);
  std::printf("transport benchmark: Sync of one stage of MLP %s on 127.0.0.1, in one process\n",
              kModelName);
  std::printf("shard: %zu float32 = %zu bytes (%.4f MiB) in %d tensors\n", floats, shard_bytes,
              shard_bytes / 1048576.0, start.center().tensors_size());
  std::printf("request: params%s; SyncRequest %zu bytes, SyncResponse %zu bytes (center_before)\n",
              flags.optimizer ? " + optimizer m, v, last_hdiag (as rebound_worker sends it)"
                              : " only (--optimizer=0)",
              sync_request_bytes, sync_reply_bytes);
  std::printf("server: ParameterServerService, DurableStore %s (fsync off), reply after the "
              "commit\n",
              flags.data_dir.empty() ? "in memory (RocksDB MemEnv)"
                                     : ("on disk in " + flags.data_dir).c_str());
  std::printf("echo:   EchoRequest %zu bytes (the SyncRequest's bytes), EchoReply %zu bytes\n",
              echo_request.ByteSizeLong(), BytesFieldSize(reply_payload));
  std::printf("%d rounds of %d calls each after %d warm-up calls; median (min..max) over rounds\n",
              flags.rounds, flags.calls, flags.warmup);
  std::printf("(a round's time: its calls, then the wait until the process is idle again)\n");
  std::printf("Sync (validate, elastic move, RocksDB batch, reply): %7.1f ms/call + %6.1f ms idle"
              " wait/round  %7.1f MiB/s  (%.1f..%.1f)\n",
              Median(sync_stats.ms_per_call), Median(sync_stats.drain_ms), sync_mib_s, *sync_min,
              *sync_max);
  std::printf("bare gRPC echo of the same bytes:                    %7.1f ms/call + %6.1f ms idle"
              " wait/round  %7.1f MiB/s  (%.1f..%.1f)\n",
              Median(echo_stats.ms_per_call), Median(echo_stats.drain_ms), echo_mib_s, *echo_min,
              *echo_max);
  std::printf("server check: %lld syncs applied to the slot (%lld sent), center version %lld, "
              "store %.0f MiB, %d failures declared, %d heartbeat errors\n",
              static_cast<long long>(applied), static_cast<long long>(syncs_done),
              static_cast<long long>(centers->get()->version(0)),
              stats.ok() ? stats->total_bytes / 1048576.0 : -1.0, failures.load(),
              heartbeat_errors.load());
  if (flags.breakdown) {
    breakdown_ok = Breakdown(config, request_wire, std::max(3, flags.calls));
    if (!breakdown_ok) std::printf("breakdown failed\n");
  }
  std::printf("ratio sync / echo: %.3f   (target >= 0.8)\n", sync_mib_s / echo_mib_s);
  std::printf("RESULT transport: sync_mib_s=%.1f echo_mib_s=%.1f ratio=%.3f\n", sync_mib_s,
              echo_mib_s, sync_mib_s / echo_mib_s);
  const bool consistent = applied == syncs_done && failures.load() == 0 && breakdown_ok;
  return finish_client(consistent ? 0 : 1);
}

}  // namespace
}  // namespace bench
}  // namespace rebound

int main(int argc, char** argv) {
  rebound::TuneAllocatorForLargeBuffers();  // as rebound_server does
  rebound::bench::Flags flags = rebound::bench::ParseFlags(argc, argv);
  rebound::InitLogging(argv[0]);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::string created;
  if (!flags.data_dir.empty()) {
    created = absl::StrCat(flags.data_dir, "/rebound-bench-transport-", getpid());
    flags.data_dir = created;
  }
  const int rc = rebound::bench::Run(flags);
  if (!created.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(created, ignored);
    std::filesystem::remove_all(created + "-breakdown", ignored);
  }
  return rc;
}
