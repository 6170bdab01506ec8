// Server capacity benchmark (R14): how many workers one server group serves.
//
// R synthetic trainers (bench/synthetic_trainers.h: no compute; each syncs the same precomputed
// parameters and AdaHessian state as fast as the servers answer, through the product's
// protocol: K = 1 ParameterServer.Sync; K = 2 SyncRange of both ranges in parallel, then
// CommitSync at group 0) run in this process against real rebound_server processes on loopback
// (testing/cluster; data on disk, fsync off, as shipped), for every R of --trainers (1, 4, 16,
// 64), every center of --centers (1, 16, 64 MiB: MLPs 784-300-80-10, 784-2048-1256-10 and
// 784-4096-3300-10) and every K of --groups (1, 2). Every sync sends params, m, v and last_hdiag
// (4 x the range) and gets c_before back (1 x).
//
// The baseline beside each (center, R): the transport benchmark's bare gRPC echo
// (bench/echo.proto; a server built as rebound_server's gRPC server is, in a process of its own:
// this binary with --echo_server) called by R clients in the same closed loop, each call
// carrying exactly the bytes of a K = 1 sync's request and reply: the most syncs per second this
// machine's gRPC could carry with no server work at all, the echo limit.
//
// Each point is a closed loop (RunClosedLoop) with a measured window: it opens once every
// client has completed a call and --warmup_seconds have passed, and closes --seconds later, or
// later still until --min_syncs have completed in it (calls still in flight are then cancelled
// and not counted): syncs/s = syncs completed in the window / its length. Printed per point:
// syncs/s (each of the K groups answers one range of every sync: its range syncs/s are the
// same), request + reply MiB/s per group, the echo limit and the ratio, the CPU the servers and
// this process used in the window, the servers' peak RSS, and the bytes the servers wrote per
// byte of the center synced. Points whose servers would hold
// more than --max_server_gib (R x center x 12: kept snapshots, requests in flight and their
// parsed copies, a rough bound; the peak RSS measured has stayed below it) are skipped and say
// so, with their echo.
//
// Last line (K = 1, R = 64, 16 MiB, against the echo at R = 64, 16 MiB):
//   RESULT server_capacity: r64_16mib_syncs_s=<x> echo_limit_syncs_s=<y> ratio=<x/y>
//     bytes_written_per_synced_byte=<w>
// (w: what the servers passed to write(2) in the window, per byte of the center its syncs moved;
// R20's target w <= 2).
// Target (R14): ratio >= 0.7. Exit code 0 when every point ran or was skipped (whatever the
// verdict), 1 when one failed, 2 on bad flags. The servers' data directories (up to GBs for a
// point) are removed after each point, with --keep_logs too; the logs and configs stay.
//
// Flags: --trainers=1,4,16,64 --centers=1,16,64 --groups=1,2 --seconds=S (6) --min_syncs=N (20)
// --warmup_seconds=S (2) --max_server_gib=G (12) --job=PATH --server_binary=PATH
// --worker_binary=PATH --keep_logs.
// (--echo_server --port_file=PATH: the echo server's own mode.)

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "bench/echo.grpc.pb.h"
#include "bench/figures.h"
#include "bench/flags.h"
#include "bench/load_average.h"
#include "bench/local_cluster.h"
#include "bench/synthetic_trainers.h"
#include "bench/throughput_window.h"
#include "common/file.h"
#include "common/process.h"
#include "common/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/text_format.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "proto/config.pb.h"
#include "testing/cluster/cluster.h"
#include "testing/cluster/processes.h"

namespace rebound::bench {
namespace {

constexpr char kJobId[] = "bench-server-capacity";
constexpr char kEchoMethod[] = "/rebound.bench.Echo/Echo";
// The R14 issue's target, and the point it is read at.
constexpr double kTargetRatio = 0.7;
constexpr int kResultTrainers = 64;
constexpr int kResultCenterMiB = 16;
// Rough server memory per trainer and center byte (see the header).
constexpr double kServerBytesPerCenterByte = 12.0;
// Per point besides warm-up and window (start, registration, stop): for the estimate only.
constexpr double kOverheadSecondsEstimate = 8.0;

struct Flags {
  std::vector<int> trainers = {1, 4, 16, 64};
  std::vector<int> centers = {1, 16, 64};
  std::vector<int> groups = {1, 2};
  int seconds = 6;
  int min_syncs = 20;
  int warmup_seconds = 2;
  int max_server_gib = 12;
  bool echo_server = false;
  std::string port_file;
  ClusterFlags cluster;
};

constexpr char kUsage[] =
    "usage: server_capacity [--trainers=1,4,16,64] [--centers=1,16,64] [--groups=1,2] "
    "[--seconds=S] [--min_syncs=N] [--warmup_seconds=S] [--max_server_gib=G] [--job=PATH] "
    "[--server_binary=PATH] "
    "[--worker_binary=PATH] [--keep_logs]";

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  CommandLine command_line(kUsage);
  auto list = [&command_line](const char* name, std::vector<int>* out,
                              const std::vector<int>& allowed) {
    command_line.AddCustom(name, [&command_line, name, out, allowed](const std::string& value) {
      out->clear();
      for (absl::string_view item : absl::StrSplit(value, ',')) {
        int n = 0;
        if (!absl::SimpleAtoi(item, &n) || n < 1 ||
            (!allowed.empty() && std::find(allowed.begin(), allowed.end(), n) == allowed.end())) {
          command_line.Usage(absl::StrCat("--", name, ": bad entry '", item, "'"));
        }
        out->push_back(n);
      }
    });
  };
  list("trainers", &flags.trainers, {});
  list("centers", &flags.centers, {1, 16, 64});
  list("groups", &flags.groups, {1, 2});
  command_line.AddInt("seconds", &flags.seconds);
  command_line.AddInt("min_syncs", &flags.min_syncs);
  command_line.AddInt("warmup_seconds", &flags.warmup_seconds);
  command_line.AddInt("max_server_gib", &flags.max_server_gib);
  command_line.AddSwitch("echo_server", &flags.echo_server);
  command_line.AddText("port_file", &flags.port_file);
  flags.cluster.AddTo(&command_line);
  command_line.Parse(argc, argv);
  if (flags.echo_server) {
    if (flags.port_file.empty()) command_line.Usage("--echo_server needs --port_file");
    return flags;
  }
  if (flags.seconds < 1) command_line.Usage("--seconds must be >= 1");
  if (flags.min_syncs < 0) command_line.Usage("--min_syncs must be >= 0");
  if (flags.warmup_seconds < 0) command_line.Usage("--warmup_seconds must be >= 0");
  if (flags.max_server_gib < 1) command_line.Usage("--max_server_gib must be >= 1");
  for (int r : flags.trainers) {
    if (r > 1000) command_line.Usage("--trainers: at most 1000 each");
  }
  return flags;
}

// ---- the echo server (--echo_server) ---------------------------------------------------------

// The transport benchmark's echo: the reply is the first reply_payload_bytes bytes of the
// request's payload (zero-padded if it asks for more than it sent).
class EchoService final : public Echo::Service {
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

// Serves until SIGTERM; its port goes to `port_file`. Message limits: rebound_server's default
// max_message_bytes, as transport's echo has them.
int ServeEcho(const std::string& port_file) {
  TuneAllocatorForLargeBuffers();  // as rebound_server does
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);  // before gRPC's threads start
  const int max_message_bytes = ServerConfig().max_message_bytes();
  EchoService service;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(max_message_bytes);
  builder.SetMaxSendMessageSize(max_message_bytes);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "echo server: cannot listen on 127.0.0.1:0\n");
    return 1;
  }
  if (absl::Status written = WriteFile(port_file, absl::StrCat(port, "\n")); !written.ok()) {
    std::fprintf(stderr, "echo server: %s\n", std::string(written.message()).c_str());
    return 1;
  }
  int signal = 0;
  sigwait(&signals, &signal);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return 0;
}

// ---- the points --------------------------------------------------------------------------------

struct Point {
  int center_mib = 0;
  int trainers = 0;
  int groups = 0;  // 0: the echo
};

struct PointResult {
  bool ok = false;
  bool skipped = false;
  std::string error;
  double syncs_s = 0.0;       // per second, whole syncs (echo: calls)
  double group_mib_s = 0.0;   // request + reply bytes per group per second
  int64_t request_bytes = 0;  // of one whole sync (all groups)
  int64_t reply_bytes = 0;
  int64_t window_syncs = 0;
  double window_seconds = 0.0;
  double server_cores = 0.0;  // the servers' CPU in the window / its length
  double client_cores = 0.0;  // this process's
  double machine_cores = 0.0;
  double server_peak_gib = 0.0;  // the servers' peak RSS, summed
  // Bytes the servers passed to write(2) in the window (tensor files, RocksDB's WAL and
  // tables: /proc/PID/io wchar; gRPC's sends are sendmsg, not counted) per byte of the center
  // the window's syncs moved (their replies, c_before): R20's bytes_written_per_synced_byte.
  double written_per_synced_byte = 0.0;
  double load = 0.0;
  int64_t retries = 0;
};

ModelSpec ModelFor(int center_mib) {
  std::vector<int> widths;
  switch (center_mib) {
    case 1:
      widths = {300, 80, 10};
      break;
    case 16:
      widths = {2048, 1256, 10};
      break;
    default:
      widths = {4096, 3300, 10};
      break;
  }
  ModelSpec model;
  model.set_input_dim(784);
  for (size_t i = 0; i < widths.size(); ++i) {
    LayerSpec* layer = model.add_layers();
    layer->set_width(widths[i]);
    layer->set_activation(i + 1 < widths.size() ? RELU : IDENTITY);
  }
  return model;
}

double Cores(int64_t ticks, absl::Duration time) {
  return static_cast<double>(ticks) / static_cast<double>(sysconf(_SC_CLK_TCK)) /
         absl::ToDoubleSeconds(time);
}

// Peak resident set (VmHWM) of `pid`, in bytes; 0 when it cannot be read.
int64_t PeakRss(pid_t pid) {
  const std::string status = ReadFileOrEmpty(absl::StrCat("/proc/", pid, "/status"));
  for (absl::string_view line : absl::StrSplit(status, '\n')) {
    if (!absl::ConsumePrefix(&line, "VmHWM:")) continue;
    int64_t kib = 0;
    std::vector<absl::string_view> fields = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (!fields.empty() && absl::SimpleAtoi(fields[0], &kib)) return kib * 1024;
  }
  return 0;
}

// The bytes `pid` passed to write(2) and pwrite(2) so far (/proc/PID/io wchar); 0 when it cannot
// be read.
int64_t WrittenBytes(pid_t pid) {
  const std::string io = ReadFileOrEmpty(absl::StrCat("/proc/", pid, "/io"));
  for (absl::string_view line : absl::StrSplit(io, '\n')) {
    if (!absl::ConsumePrefix(&line, "wchar:")) continue;
    int64_t bytes = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &bytes)) return bytes;
  }
  return 0;
}

// CPU (and bytes written) of some processes and of the machine over a measured window.
class WindowCpu {
 public:
  explicit WindowCpu(std::function<std::vector<pid_t>()> servers) : servers_(std::move(servers)) {}
  void Open() { Read(&open_); }
  void Close() { Read(&close_); }
  void Fill(PointResult* result) const {
    const absl::Duration time = close_.at - open_.at;
    result->server_cores = Cores(close_.servers - open_.servers, time);
    result->client_cores = Cores(close_.self - open_.self, time);
    result->machine_cores = Cores(close_.machine - open_.machine, time);
  }
  // The servers' bytes written in the window.
  int64_t ServerWritten() const { return close_.written - open_.written; }

 private:
  struct Probe {
    absl::Time at;
    int64_t servers = 0, self = 0, machine = 0, written = 0;
  };
  void Read(Probe* probe) {
    probe->at = absl::Now();
    probe->servers = 0;
    probe->written = 0;
    for (pid_t pid : servers_()) {
      probe->servers += ProcessCpuTicks(pid);
      probe->written += WrittenBytes(pid);
    }
    probe->self = ProcessCpuTicks(getpid());
    probe->machine = ReadMachineCpu().busy;
  }
  std::function<std::vector<pid_t>()> servers_;
  Probe open_, close_;
};

LoopLimits WindowLimits(const Flags& flags, WindowCpu* cpu) {
  LoopLimits limits;
  limits.warmup = absl::Seconds(flags.warmup_seconds);
  limits.window = absl::Seconds(flags.seconds);
  limits.window_total_calls = flags.min_syncs;
  limits.at_open = [cpu] { cpu->Open(); };
  limits.at_close = [cpu] { cpu->Close(); };
  return limits;
}

absl::Status RunSyncs(const Flags& flags, const JobConfig& base, const std::string& dir,
                      const Point& point, PointResult* result) {
  testing::ClusterOptions options;
  options.server_binary = flags.cluster.server_binary;
  options.worker_binary = flags.cluster.worker_binary;
  options.dir = dir;
  options.shard_groups = point.groups;
  options.start_wait = absl::Seconds(60);
  options.stop_grace = absl::Seconds(30);
  testing::Cluster cluster(options);
  JobConfig job = base;
  job.set_job_id(kJobId);
  *job.mutable_model() = ModelFor(point.center_mib);
  job.mutable_topology()->set_replicas(point.trainers);
  job.mutable_topology()->set_stages(1);
  job.mutable_topology()->set_spares(0);
  job.mutable_topology()->set_evaluator(false);
  job.mutable_training()->set_max_steps(1000000000);
  // One thread heartbeats for every trainer while they saturate the machine: no failure is
  // what this benchmark measures.
  job.mutable_fault_tolerance()->set_failure_timeout_ms(60000);
  if (point.groups > 1) job.mutable_sharding()->set_groups(point.groups);
  ServerConfig config;
  config.set_listen_address("127.0.0.1:0");
  *config.mutable_job() = job;
  config.mutable_durability()->set_data_dir(dir + "/data");
  std::string text;
  google::protobuf::TextFormat::PrintToString(config, &text);
  RETURN_IF_ERROR(cluster.StartServer(text, absl::StrCat("job_id: \"", kJobId, "\"\n")));
  SyntheticOptions synthetic;
  synthetic.job = job;
  synthetic.coordinator = cluster.group_address(0);
  synthetic.trainers = point.trainers;
  ASSIGN_OR_RETURN(std::unique_ptr<SyntheticTrainers> trainers,
                   SyntheticTrainers::Start(synthetic));
  auto servers = [&cluster] {
    std::vector<pid_t> pids;
    for (int i = 0; i < cluster.members(); ++i) pids.push_back(cluster.member(i).pid());
    return pids;
  };
  WindowCpu cpu(servers);
  LoadAverageMeter load;
  load.Sample();
  ASSIGN_OR_RETURN(const LoopRun run, trainers->Run(WindowLimits(flags, &cpu)));
  load.Sample();
  if (run.window_close == absl::InfiniteFuture()) {
    return absl::InternalError("the window did not close");
  }
  cpu.Fill(result);
  result->window_syncs = run.CallsBetween(run.window_open, run.window_close);
  result->window_seconds = absl::ToDoubleSeconds(run.window_close - run.window_open);
  result->syncs_s = run.WindowRate();
  for (int g = 0; g < trainers->groups(); ++g) {
    result->request_bytes += trainers->request_bytes(g);
    result->reply_bytes += trainers->reply_bytes(g);
  }
  result->group_mib_s = result->syncs_s *
                        static_cast<double>(result->request_bytes + result->reply_bytes) /
                        point.groups / (1 << 20);
  if (result->window_syncs > 0 && result->reply_bytes > 0) {
    result->written_per_synced_byte =
        static_cast<double>(cpu.ServerWritten()) /
        (static_cast<double>(result->window_syncs) * static_cast<double>(result->reply_bytes));
  }
  for (pid_t pid : servers()) {
    result->server_peak_gib += static_cast<double>(PeakRss(pid)) / (int64_t{1} << 30);
  }
  result->load = load.Mean();
  result->retries = trainers->retries();
  trainers.reset();  // deregisters
  cluster.StopAll(/*report=*/true, [](const ChildProcess&, int) {});
  result->ok = true;
  return absl::OkStatus();
}

// The largest payload whose bytes field (tag 1), with `other` bytes of other fields, serializes
// to at most `target` bytes.
size_t PayloadFor(size_t target, size_t other) {
  auto field = [](size_t n) {
    return 1 + google::protobuf::io::CodedOutputStream::VarintSize64(n) + n;
  };
  size_t n = target > other + 11 ? target - other - 11 : 0;
  while (field(n + 1) + other <= target) ++n;
  return n;
}

// The echo at the size of a K = 1 sync: `request_bytes` out, `reply_bytes` back per call.
absl::Status RunEcho(const Flags& flags, const std::string& dir, const Point& point,
                     int64_t request_bytes, int64_t reply_bytes, PointResult* result) {
  const std::string port_file = dir + "/echo-port";
  ASSIGN_OR_RETURN(
      std::unique_ptr<ChildProcess> server,
      ChildProcess::Start({"/proc/self/exe", "--echo_server", "--port_file", port_file},
                          dir + "/echo.log"));
  ASSIGN_OR_RETURN(const int port, testing::WaitForPortFile(port_file, *server, absl::Seconds(30)));
  // Request: a header with reply_payload_bytes, then the payload field, shared by every call,
  // sized so that the whole request has the sync request's bytes; reply: the sync reply's.
  EchoRequest header;
  header.set_reply_payload_bytes(PayloadFor(static_cast<size_t>(reply_bytes), 0));
  const std::string head = header.SerializeAsString();
  EchoRequest body_message;
  body_message.set_payload(
      std::string(PayloadFor(static_cast<size_t>(request_bytes), head.size()), 'x'));
  const std::string body = body_message.SerializeAsString();

  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  for (int i = 0; i < point.trainers; ++i) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    stubs.push_back(std::make_unique<grpc::GenericStub>(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials(), args)));
  }
  std::atomic<int64_t> measured_reply{0};
  auto echo = [&](int client, CallsInFlight* in_flight) -> absl::Status {
    grpc::Slice slices[2] = {grpc::Slice(head),
                             grpc::Slice(body.data(), body.size(), grpc::Slice::STATIC_SLICE)};
    grpc::ByteBuffer request(slices, 2);
    grpc::ByteBuffer reply;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
    in_flight->Add(&context);
    absl::Notification done;
    grpc::Status status;
    stubs[client]->UnaryCall(&context, kEchoMethod, grpc::StubOptions(), &request, &reply,
                             [&](grpc::Status s) {
                               status = std::move(s);
                               done.Notify();
                             });
    done.WaitForNotification();
    in_flight->Remove(&context);
    if (!status.ok()) return absl::UnavailableError(absl::StrCat("echo: ", status.error_message()));
    measured_reply.store(static_cast<int64_t>(reply.Length()));
    return absl::OkStatus();
  };
  WindowCpu cpu([&server] { return std::vector<pid_t>{server->pid()}; });
  LoadAverageMeter load;
  load.Sample();
  ASSIGN_OR_RETURN(const LoopRun run,
                   RunClosedLoop(point.trainers, WindowLimits(flags, &cpu), echo));
  load.Sample();
  if (run.window_close == absl::InfiniteFuture()) {
    return absl::InternalError("the window did not close");
  }
  cpu.Fill(result);
  result->window_syncs = run.CallsBetween(run.window_open, run.window_close);
  result->window_seconds = absl::ToDoubleSeconds(run.window_close - run.window_open);
  result->syncs_s = run.WindowRate();
  result->request_bytes = static_cast<int64_t>(head.size() + body.size());
  result->reply_bytes = measured_reply.load();
  result->group_mib_s = result->syncs_s *
                        static_cast<double>(result->request_bytes + result->reply_bytes) /
                        (1 << 20);
  result->server_peak_gib = static_cast<double>(PeakRss(server->pid())) / (int64_t{1} << 30);
  result->load = load.Mean();
  stubs.clear();
  server->Stop(absl::Seconds(10));
  result->ok = true;
  return absl::OkStatus();
}

std::string PointName(const Point& point) {
  return point.groups == 0
             ? absl::StrCat(point.center_mib, "mib-r", point.trainers, "-echo")
             : absl::StrCat(point.center_mib, "mib-r", point.trainers, "-k", point.groups);
}

int Main(int argc, char** argv) {
  Flags flags = ParseFlags(argc, argv);
  if (flags.echo_server) return ServeEcho(flags.port_file);
  absl::StatusOr<JobConfig> base = ResolveClusterFlags(&flags.cluster);
  if (!base.ok()) ExitWithUsage(std::string(base.status().message()), kUsage);
  absl::StatusOr<RunDirectories> dirs =
      RunDirectories::Create("server-capacity", flags.cluster.keep_logs);
  if (!dirs.ok()) {
    std::fprintf(stderr, "%s\n", std::string(dirs.status().message()).c_str());
    return 1;
  }
  // Per (center, R): K = 1 first (the echo needs its sizes), the echo, then the other Ks.
  std::vector<Point> points;
  for (int center : flags.centers) {
    for (int r : flags.trainers) {
      std::vector<int> groups = flags.groups;
      std::stable_sort(groups.begin(), groups.end());
      for (int k : groups) {
        points.push_back({center, r, k});
        if (k == 1) points.push_back({center, r, 0});
      }
    }
  }
  // The echo's server holds as many requests as the sync's: it goes with K = 1.
  auto too_big = [&flags](const Point& point) {
    return point.trainers * point.center_mib * kServerBytesPerCenterByte / 1024.0 >
           flags.max_server_gib;
  };
  int runs = 0;
  for (const Point& point : points) runs += too_big(point) ? 0 : 1;
  std::printf(
      "server_capacity benchmark: synthetic trainers (no compute) syncing as fast as "
      "rebound_server answers, on loopback, against a bare gRPC echo of the same bytes "
      "(the transport benchmark's) with as many clients\n");
  std::printf(
      "trainers R: %s; centers: %s MiB; groups K: %s; each point %d s warm-up (at "
      "least every client's first call) + a window of %d s (at least %d syncs); %d points, "
      "about %.1f min; %d cores online, load %.2f; logs in %s\n\n",
      absl::StrJoin(flags.trainers, ",").c_str(), absl::StrJoin(flags.centers, ",").c_str(),
      absl::StrJoin(flags.groups, ",").c_str(), flags.warmup_seconds, flags.seconds,
      flags.min_syncs, runs,
      runs * (flags.warmup_seconds + flags.seconds + kOverheadSecondsEstimate) / 60.0,
      static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)), LoadAverage(), dirs->path().c_str());
  std::map<std::tuple<int, int, int>, PointResult> results;  // (center, R, K or 0: the echo)
  auto result_of = [&results](int center, int r, int k) -> const PointResult& {
    return results[std::make_tuple(center, r, k)];
  };
  auto what = [](const Point& point) {
    return absl::StrFormat("%4d MiB %4d %-4s", point.center_mib, point.trainers,
                           point.groups == 0 ? "echo" : absl::StrCat(point.groups));
  };
  for (const Point& point : points) {
    PointResult& result = results[std::make_tuple(point.center_mib, point.trainers, point.groups)];
    if (too_big(point)) {
      result.skipped = true;
      std::printf("%s: skipped (about %.0f GiB of server memory > --max_server_gib=%d)\n",
                  what(point).c_str(),
                  point.trainers * point.center_mib * kServerBytesPerCenterByte / 1024.0,
                  flags.max_server_gib);
      std::fflush(stdout);
      continue;
    }
    const std::string dir = dirs->StartRun(PointName(point));
    const absl::Time started = absl::Now();
    absl::Status status;
    if (point.groups > 0) {
      status = RunSyncs(flags, *base, dir, point, &result);
    } else {
      const PointResult& k1 = result_of(point.center_mib, point.trainers, 1);
      status = k1.ok
                   ? RunEcho(flags, dir, point, k1.request_bytes, k1.reply_bytes, &result)
                   : absl::FailedPreconditionError("no K = 1 sync sizes (that point did not run)");
    }
    RemoveDataDirectories(dir);
    dirs->FinishRun(dir, status.ok());
    const double seconds = absl::ToDoubleSeconds(absl::Now() - started);
    if (!status.ok()) {
      result.ok = false;
      result.error = std::string(status.message());
      std::printf("%s: FAILED after %.0f s: %s (logs in %s)\n", what(point).c_str(), seconds,
                  result.error.c_str(), dir.c_str());
    } else {
      std::printf(
          "%s: %9.2f %s/s (%lld in %.1f s), %lld + %lld bytes each, %lld retries; "
          "%.0f s\n",
          what(point).c_str(), result.syncs_s, point.groups == 0 ? "calls" : "syncs",
          static_cast<long long>(result.window_syncs), result.window_seconds,
          static_cast<long long>(result.request_bytes), static_cast<long long>(result.reply_bytes),
          static_cast<long long>(result.retries), seconds);
    }
    std::fflush(stdout);
  }

  std::printf(
      "\nper point: syncs/s (echo: calls/s), request + reply MiB/s per group, the echo "
      "limit at the same center and R and the ratio, the CPU (cores) the servers and this "
      "process (the clients) used in the window, the servers' peak RSS, the load, the bytes the "
      "servers wrote per byte of the center synced:\n");
  std::printf("%-8s %4s %-4s %10s %10s %10s %7s %8s %8s %8s %6s %7s\n", "center", "R", "K",
              "syncs/s", "MiB/s/grp", "echo/s", "ratio", "srv cpu", "cli cpu", "srv GiB", "load",
              "wr/byte");
  for (const Point& point : points) {
    const PointResult& result = result_of(point.center_mib, point.trainers, point.groups);
    if (!result.ok) {
      std::printf("%s %s\n", what(point).c_str(), result.skipped ? "skipped" : "FAILED");
      continue;
    }
    const PointResult& echo = result_of(point.center_mib, point.trainers, 0);
    std::printf(
        "%s %10.2f %10.1f %10s %7s %8.2f %8.2f %8.2f %6.2f %7s\n", what(point).c_str(),
        result.syncs_s,
        result.group_mib_s, echo.ok ? absl::StrFormat("%.2f", echo.syncs_s).c_str() : "-",
        point.groups > 0 && echo.ok ? absl::StrFormat("%.3f", result.syncs_s / echo.syncs_s).c_str()
                                    : "-",
        result.server_cores, result.client_cores, result.server_peak_gib, result.load,
        point.groups > 0 ? absl::StrFormat("%.2f", result.written_per_synced_byte).c_str() : "-");
  }

  // The curve: syncs/s against R, per center, for each K and the echo.
  std::printf("\nthe curve (syncs/s; ratio to the echo in parentheses):\n");
  std::printf("%-8s %-8s", "center", "");
  for (int r : flags.trainers) std::printf(" %18s", absl::StrCat("R = ", r).c_str());
  std::printf("\n");
  for (int center : flags.centers) {
    std::vector<int> rows = flags.groups;
    rows.push_back(0);
    for (int k : rows) {
      std::printf("%4d MiB %-8s", center, k == 0 ? "echo" : absl::StrCat("K = ", k).c_str());
      for (int r : flags.trainers) {
        const PointResult& point = result_of(center, r, k);
        const PointResult& echo = result_of(center, r, 0);
        std::string cell = point.skipped ? "skipped"
                           : point.ok    ? absl::StrFormat("%.2f", point.syncs_s)
                                         : "-";
        if (k > 0 && point.ok && echo.ok) {
          absl::StrAppend(&cell, absl::StrFormat(" (%.2f)", point.syncs_s / echo.syncs_s));
        }
        std::printf(" %18s", cell.c_str());
      }
      std::printf("\n");
    }
  }

  const PointResult& k1 = result_of(kResultCenterMiB, kResultTrainers, 1);
  const PointResult& echo = result_of(kResultCenterMiB, kResultTrainers, 0);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double syncs_s = k1.ok ? k1.syncs_s : nan;
  const double echo_s = echo.ok ? echo.syncs_s : nan;
  const double ratio = syncs_s / echo_s;
  const double written = k1.ok ? k1.written_per_synced_byte : nan;
  std::printf(
      "\nverdict against R14 (R = %d trainers, %d MiB center, K = 1: >= %.1fx the echo "
      "limit): %.2f syncs/s, echo %.2f calls/s, ratio %.3f %s\n",
      kResultTrainers, kResultCenterMiB, kTargetRatio, syncs_s, echo_s, ratio,
      ratio >= kTargetRatio ? "MET" : "MISSED");
  dirs->Finish();
  std::printf(
      "RESULT server_capacity: r64_16mib_syncs_s=%.2f echo_limit_syncs_s=%.2f "
      "ratio=%.3f bytes_written_per_synced_byte=%.2f\n",
      syncs_s, echo_s, ratio, written);
  return dirs->all_ok() ? 0 : 1;
}

}  // namespace
}  // namespace rebound::bench

int main(int argc, char** argv) { return rebound::bench::Main(argc, argv); }
