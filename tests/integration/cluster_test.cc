// Starts the real rebound_server and rebound_worker binaries on loopback (port 0), and kills,
// stops and restarts them for real.

#include <catch2/catch.hpp>
#include <signal.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>

#include <poll.h>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "proto/rebound.grpc.pb.h"
#include "testing/cluster/processes.h"
#include "testing/cluster/time_scale.h"

namespace rebound::testing {
namespace {

int CountOccurrences(const std::string& text, const std::string& what) {
  int count = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) {
    ++count;
  }
  return count;
}

// The job's timing, stretched under TSan like every integration test's
// (testing/cluster/time_scale.h): a worker slowed 5-15x needs longer than 200 ms to attach again.
const int kHeartbeatMs = static_cast<int>(ScaledMs(200));
const int kFailureTimeoutMs = static_cast<int>(ScaledMs(1000));
const int kCrashConfirmMs = static_cast<int>(ScaledMs(200));  // the default's 200, stretched

// `crash_confirm_ms` < 0: crash detection on with kCrashConfirmMs (docs/design.md §13).
std::string ServerConfigText(int crash_confirm_ms) {
  return absl::StrCat(
      "listen_address: \"127.0.0.1:0\"\n"
      "job {\n"
      "  job_id: \"it\"\n"
      "  model { layers { width: 16 } layers { width: 10 activation: IDENTITY } }\n"
      "  topology { replicas: 2 }\n"
      "  fault_tolerance { heartbeat_interval_ms: ",
      kHeartbeatMs, " failure_timeout_ms: ", kFailureTimeoutMs,
      " crash_confirm_ms: ", crash_confirm_ms >= 0 ? crash_confirm_ms : kCrashConfirmMs,
      " }\n"
      // A slice of the data and more steps than any test waits for: the trainers keep training.
      "  data { batch_size: 32 train_limit: 1000 test_limit: 100 }\n"
      "  adahessian { lr: 0.01 }\n"
      "  training { max_steps: 100000000 }\n"
      "}\n");
}

const char kWorkerConfig[] =
    "rpc_deadline_ms: 2000\n"
    "backoff_initial_ms: 50\n"
    "backoff_max_ms: 400\n"
    "give_up_after_ms: 60000\n";

// One server on an ephemeral port plus helpers to start workers against it.
class Cluster {
 public:
  explicit Cluster(int crash_confirm_ms = -1) : dir_(MakeTempDir("cluster")) {
    WriteFileOrDie(dir_ + "/server.pbtxt", ServerConfigText(crash_confirm_ms));
    WriteFileOrDie(dir_ + "/worker.pbtxt", kWorkerConfig);
  }

  void StartServer(const std::string& listen = "127.0.0.1:0") {
    ServerStart start;
    start.binary = Runfile("server/rebound_server");
    start.config = dir_ + "/server.pbtxt";
    start.listen = listen;
    start.port_file = dir_ + "/port";
    start.log = dir_ + "/server.log";
    const absl::StatusOr<int> port = StartServerProcess(start, &server_);
    INFO(port.status());
    REQUIRE(port.ok());
    port_ = *port;
    channel_ = grpc::CreateChannel(address(), grpc::InsecureChannelCredentials());
    stub_ = ParameterServer::NewStub(channel_);
  }

  std::unique_ptr<Subprocess> StartWorker(const std::string& name, const std::string& server) {
    auto worker = Subprocess::Start({Runfile("worker/rebound_worker"), "--config",
                                     dir_ + "/worker.pbtxt", "--server", server, "--name", name},
                                    dir_ + "/" + name + ".log");
    REQUIRE(worker.ok());
    return *std::move(worker);
  }

  std::unique_ptr<Subprocess> StartWorker(const std::string& name) {
    return StartWorker(name, address());
  }

  GetStatusResponse Status() {
    GetStatusResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    const grpc::Status status = stub_->GetStatus(&context, GetStatusRequest(), &response);
    REQUIRE(status.ok());
    return response;
  }

  // Polls GetStatus until `predicate` holds; fails after 30 s (a bound, not a performance check).
  GetStatusResponse WaitForStatus(const std::function<bool(const GetStatusResponse&)>& predicate) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    GetStatusResponse status = Status();
    while (!predicate(status)) {
      if (absl::Now() > deadline) {
        FAIL("status never reached the expected state; last:\n" << status.DebugString()
                                                                 << "server log:\n"
                                                                 << ReadFileOrEmpty(dir_ + "/server.log"));
      }
      absl::SleepFor(absl::Milliseconds(50));
      status = Status();
    }
    return status;
  }

  ParameterServer::Stub& stub() { return *stub_; }
  Subprocess& server() { return *server_; }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  int port() const { return port_; }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::unique_ptr<Subprocess> server_;
  int port_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<ParameterServer::Stub> stub_;
};

const WorkerStatus* FindWorker(const GetStatusResponse& status, const std::string& name) {
  const WorkerStatus* found = nullptr;
  for (const WorkerStatus& w : status.workers()) {
    if (w.name() == name) found = &w;  // the newest incarnation of that name
  }
  return found;
}

bool IsAliveTrainer(const GetStatusResponse& status, const std::string& name) {
  const WorkerStatus* w = FindWorker(status, name);
  return w != nullptr && w->state() == ALIVE && w->role() == TRAINER;
}

TEST_CASE("two workers register and heartbeat; a SIGKILLed one is declared failed and fenced") {
  Cluster cluster;
  cluster.StartServer();
  auto alpha = cluster.StartWorker("alpha");
  auto beta = cluster.StartWorker("beta");

  GetStatusResponse status = cluster.WaitForStatus([](const GetStatusResponse& s) {
    return IsAliveTrainer(s, "alpha") && IsAliveTrainer(s, "beta");
  });
  CHECK(status.job_id() == "it");
  CHECK(status.slots_size() == 2);
  for (const SlotStatus& slot : status.slots()) CHECK(slot.state() == ACTIVE);
  // Heartbeats keep arriving: after a few intervals the last one is still recent.
  absl::SleepFor(absl::Milliseconds(3 * kHeartbeatMs));
  status = cluster.Status();
  CHECK(FindWorker(status, "alpha")->last_heartbeat_ms_ago() < kFailureTimeoutMs);
  CHECK(FindWorker(status, "beta")->last_heartbeat_ms_ago() < kFailureTimeoutMs);

  // reboundctl sees the same.
  std::string output;
  CHECK(RunCommand({Runfile("tools/reboundctl"), "--server", cluster.address(), "health"},
                   &output, absl::Seconds(30)) == 0);
  CHECK(output == "SERVING\n");
  CHECK(RunCommand({Runfile("tools/reboundctl"), "--server", cluster.address(), "status"},
                   &output, absl::Seconds(30)) == 0);
  CHECK(absl::StrContains(output, "alpha"));
  CHECK(absl::StrContains(output, "beta"));
  CHECK(absl::StrContains(output, "TRAINER"));

  const uint64_t dead = FindWorker(status, "alpha")->incarnation();
  const SlotId dead_slot = FindWorker(status, "alpha")->slot();
  alpha->Signal(SIGKILL);
  REQUIRE(alpha->WaitFor(absl::Seconds(10)) == 128 + SIGKILL);

  status = cluster.WaitForStatus([](const GetStatusResponse& s) {
    return FindWorker(s, "alpha")->state() == FAILED;
  });
  const WorkerStatus* failed = FindWorker(status, "alpha");
  // Declared as a crash (docs/design.md §13): the process is gone, the kernel closed its
  // connection, its session ended without a Deregister and it did not attach again within
  // crash_confirm_ms, before failure_timeout of silence (the heartbeat timeout's declaration
  // says "no heartbeat for"; the test below has crash detection off).
  INFO(failed->DebugString());
  CHECK(absl::StartsWith(failed->state_reason(), "its session ended "));
  CHECK(absl::StrContains(failed->state_reason(),
                          absl::StrCat("(crash_confirm ", kCrashConfirmMs, " ms)")));
  CHECK(failed->silent_ms_at_failure() <= kFailureTimeoutMs);
  for (const SlotStatus& slot : status.slots()) {
    if (slot.slot().replica() == dead_slot.replica()) {
      CHECK(slot.state() == LOST);
    } else {
      CHECK(slot.state() == ACTIVE);
    }
  }
  CHECK(FindWorker(status, "beta")->state() == ALIVE);

  // The dead incarnation is fenced: its heartbeat is refused with FAILED_PRECONDITION.
  HeartbeatRequest beat;
  beat.set_incarnation(dead);
  HeartbeatResponse reply;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  const grpc::Status refused = cluster.stub().Heartbeat(&context, beat, &reply);
  CHECK(refused.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(absl::StrContains(refused.error_message(), "is fenced: FAILED"));

  // A clean stop: the worker deregisters and exits 0; the server exits 0 on SIGTERM.
  beta->Signal(SIGTERM);
  CHECK(beta->WaitFor(absl::Seconds(20)) == 0);
  status = cluster.Status();
  CHECK(FindWorker(status, "beta")->state() == DEPARTED);
  cluster.server().Signal(SIGTERM);
  CHECK(cluster.server().WaitFor(absl::Seconds(20)) == 0);
  CHECK(RunCommand({Runfile("tools/reboundctl"), "--server", cluster.address(), "--timeout_ms",
                    "1000", "health"},
                   &output, absl::Seconds(30)) == 2);
  CHECK(absl::StrContains(output, "cannot reach the server"));
}

TEST_CASE("with crash detection off, a SIGKILLed worker is declared failed after failure_timeout") {
  Cluster cluster(/*crash_confirm_ms=*/0);
  cluster.StartServer();
  auto alpha = cluster.StartWorker("alpha");
  cluster.WaitForStatus([](const GetStatusResponse& s) { return IsAliveTrainer(s, "alpha"); });
  alpha->Signal(SIGKILL);
  REQUIRE(alpha->WaitFor(absl::Seconds(10)) == 128 + SIGKILL);
  const GetStatusResponse status = cluster.WaitForStatus([](const GetStatusResponse& s) {
    return FindWorker(s, "alpha")->state() == FAILED;
  });
  const WorkerStatus* failed = FindWorker(status, "alpha");
  INFO(failed->DebugString());
  CHECK(absl::StartsWith(failed->state_reason(), "no heartbeat for "));
  // Declared by the server's own clock: after failure_timeout of silence, and soon after. The
  // server declares on silence strictly longer than failure_timeout but reports whole
  // milliseconds, rounded down, so 1000.4 ms reads 1000. Its detector checks every 50 ms here;
  // the upper bound leaves a loaded machine a second of scheduling delay on top.
  CHECK(failed->silent_ms_at_failure() >= kFailureTimeoutMs);
  CHECK(failed->silent_ms_at_failure() <= kFailureTimeoutMs + kHeartbeatMs + 1000);
}

TEST_CASE("a worker that was fenced while stopped exits with code 3 and says why") {
  Cluster cluster;
  cluster.StartServer();
  auto gamma = cluster.StartWorker("gamma");
  cluster.WaitForStatus([](const GetStatusResponse& s) { return IsAliveTrainer(s, "gamma"); });

  gamma->Signal(SIGSTOP);
  const GetStatusResponse failed = cluster.WaitForStatus([](const GetStatusResponse& s) {
    return FindWorker(s, "gamma")->state() == FAILED;
  });
  // A stopped process keeps its connections open: its session does not end, and the heartbeat
  // timeout (not crash detection) declares it.
  CHECK(absl::StartsWith(FindWorker(failed, "gamma")->state_reason(), "no heartbeat for "));
  CHECK(FindWorker(failed, "gamma")->silent_ms_at_failure() >= kFailureTimeoutMs);
  gamma->Signal(SIGCONT);
  CHECK(gamma->WaitFor(absl::Seconds(20)) == 3);
  CHECK(absl::StrContains(ReadFileOrEmpty(gamma->log_path()), "fenced by the server"));
}

TEST_CASE("a server stopped for longer than the failure timeout fences nobody when it resumes") {
  Cluster cluster;
  cluster.StartServer();
  auto a = cluster.StartWorker("a");
  auto b = cluster.StartWorker("b");
  const GetStatusResponse before = cluster.WaitForStatus([](const GetStatusResponse& s) {
    return IsAliveTrainer(s, "a") && IsAliveTrainer(s, "b") && s.slots(0).step() > 0 &&
           s.slots(1).step() > 0;
  });

  // No heartbeat can arrive while the server is stopped: that is not the workers' silence.
  cluster.server().Signal(SIGSTOP);
  absl::SleepFor(absl::Milliseconds(3 * kFailureTimeoutMs));
  cluster.server().Signal(SIGCONT);

  const int64_t step0 = before.slots(0).step();
  const int64_t step1 = before.slots(1).step();
  const GetStatusResponse after = cluster.WaitForStatus([&](const GetStatusResponse& s) {
    return s.slots(0).step() > step0 + 10 && s.slots(1).step() > step1 + 10;
  });
  INFO(after.DebugString());
  for (const char* name : {"a", "b"}) {
    INFO(name);
    CHECK(IsAliveTrainer(after, name));
    CHECK(FindWorker(after, name)->incarnation() == FindWorker(before, name)->incarnation());
  }
  CHECK(after.slots(0).state() == ACTIVE);
  CHECK(after.slots(1).state() == ACTIVE);
  CHECK(absl::StrContains(ReadFileOrEmpty(cluster.dir() + "/server.log"), "did not run for"));
  CHECK_FALSE(a->WaitFor(absl::ZeroDuration()).has_value());
  CHECK_FALSE(b->WaitFor(absl::ZeroDuration()).has_value());
}

// A TCP proxy on loopback in front of the server whose ResetAll() resets every connection through
// it (RST to both ends, as a middlebox or a peer's restarted network stack does) and goes on
// accepting: a brief network reset, with both processes alive.
class ResettingProxy {
 public:
  explicit ResettingProxy(int server_port) : server_port_(server_port) {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
    REQUIRE(listen(listener_, 16) == 0);
    socklen_t len = sizeof(addr);
    getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    acceptor_ = std::thread([this] { Accept(); });
  }

  ~ResettingProxy() {
    stopping_ = true;
    ResetAll();
    acceptor_.join();
    for (std::thread& pump : pumps_) pump.join();
    close(listener_);
  }

  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

  // Every connection open now is reset (within the pumps' 10 ms poll); returns how many.
  int ResetAll() {
    absl::MutexLock lock(&mu_);
    ++generation_;
    const int open = open_;
    return open;
  }

 private:
  void Accept() {
    while (!stopping_) {
      pollfd p{listener_, POLLIN, 0};
      if (poll(&p, 1, 10) <= 0) continue;
      const int client = accept(listener_, nullptr, nullptr);
      if (client < 0) continue;
      const int upstream = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      addr.sin_port = htons(server_port_);
      if (connect(upstream, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
        close(upstream);
        close(client);
        continue;
      }
      int generation;
      {
        absl::MutexLock lock(&mu_);
        generation = generation_;
        ++open_;
      }
      pumps_.emplace_back([this, client, upstream, generation] {
        Pump(client, upstream, generation);
      });
    }
  }

  // Copies both ways until either end closes or a reset is asked; then closes both, with RST.
  void Pump(int a, int b, int generation) {
    char buffer[65536];
    bool open = true;
    while (open) {
      {
        absl::MutexLock lock(&mu_);
        if (generation_ != generation) break;
      }
      pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
      if (poll(fds, 2, 10) <= 0) continue;
      for (int i = 0; i < 2 && open; ++i) {
        if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
        const ssize_t n = read(fds[i].fd, buffer, sizeof(buffer));
        if (n <= 0) {
          open = false;
          break;
        }
        const int to = i == 0 ? b : a;
        for (ssize_t sent = 0; sent < n;) {
          const ssize_t w = write(to, buffer + sent, static_cast<size_t>(n - sent));
          if (w <= 0) {
            open = false;
            break;
          }
          sent += w;
        }
      }
    }
    const linger reset{1, 0};  // close() then sends RST, not FIN
    setsockopt(a, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
    setsockopt(b, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
    close(a);
    close(b);
    absl::MutexLock lock(&mu_);
    --open_;
  }

  const int server_port_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  std::vector<std::thread> pumps_;  // the acceptor's alone until it is joined
  absl::Mutex mu_;
  int generation_ ABSL_GUARDED_BY(mu_) = 0;
  int open_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST_CASE("connections reset under a live worker: it attaches again at once and is never declared "
          "failed") {
  Cluster cluster;
  cluster.StartServer();
  ResettingProxy proxy(cluster.port());
  auto alpha = cluster.StartWorker("alpha", proxy.address());
  const GetStatusResponse before = cluster.WaitForStatus([](const GetStatusResponse& s) {
    return IsAliveTrainer(s, "alpha") && s.slots(0).step() > 0;
  });
  const uint64_t incarnation = FindWorker(before, "alpha")->incarnation();
  // Five resets, each cutting the worker's session (and any call in flight) with both ends alive.
  int reset = 0;
  for (int i = 0; i < 5; ++i) {
    reset += proxy.ResetAll();
    absl::SleepFor(absl::Milliseconds(400));
  }
  CHECK(reset >= 5);
  // Longer than failure_timeout after the last reset: any declaration would have come.
  absl::SleepFor(absl::Milliseconds(kFailureTimeoutMs + 500));
  const GetStatusResponse after = cluster.Status();
  INFO(after.DebugString() << ReadFileOrEmpty(cluster.dir() + "/server.log"));
  CHECK(IsAliveTrainer(after, "alpha"));
  CHECK(FindWorker(after, "alpha")->incarnation() == incarnation);
  CHECK(after.slots(0).step() > before.slots(0).step());
  // Each reset ended a session the server then saw come back (not only calls that failed).
  CHECK(CountOccurrences(ReadFileOrEmpty(cluster.dir() + "/server.log"),
                         "attached again ") >= 1);
  CHECK_FALSE(alpha->WaitFor(absl::ZeroDuration()).has_value());
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

TEST_CASE("a worker started before the server retries until it can register") {
  Cluster cluster;
  const int port = FreePort();
  auto early = cluster.StartWorker("early", absl::StrCat("127.0.0.1:", port));
  absl::SleepFor(absl::Milliseconds(800));  // several failed attempts
  CHECK_FALSE(early->WaitFor(absl::ZeroDuration()).has_value());
  cluster.StartServer(absl::StrCat("127.0.0.1:", port));
  cluster.WaitForStatus([](const GetStatusResponse& s) { return IsAliveTrainer(s, "early"); });
  CHECK(absl::StrContains(ReadFileOrEmpty(early->log_path()), "register failed"));
}

TEST_CASE("a worker re-registers when a restarted server no longer knows it") {
  Cluster cluster;
  cluster.StartServer();
  const int port = cluster.port();
  auto delta = cluster.StartWorker("delta");
  GetStatusResponse before =
      cluster.WaitForStatus([](const GetStatusResponse& s) { return IsAliveTrainer(s, "delta"); });
  const uint64_t first = FindWorker(before, "delta")->incarnation();

  cluster.server().Signal(SIGKILL);
  REQUIRE(cluster.server().WaitFor(absl::Seconds(10)).has_value());
  absl::SleepFor(absl::Seconds(1));  // the incarnation epoch is in seconds
  cluster.StartServer(absl::StrCat("127.0.0.1:", port));
  GetStatusResponse after =
      cluster.WaitForStatus([](const GetStatusResponse& s) { return IsAliveTrainer(s, "delta"); });
  CHECK(FindWorker(after, "delta")->incarnation() != first);
  CHECK_FALSE(delta->WaitFor(absl::ZeroDuration()).has_value());
}

// ---- exit codes 4 and 5 (docs/operations.md#worker-exit-codes) -------------------------------

TEST_CASE("a worker exits 4 when no server answers for give_up_after_ms, and 5 when its "
          "registration is refused") {
  const std::string dir = MakeTempDir("exit-codes");
  // A port nobody listens on: bound, then closed.
  int probe = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(probe >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  socklen_t length = sizeof(addr);
  REQUIRE(getsockname(probe, reinterpret_cast<sockaddr*>(&addr), &length) == 0);
  const int dead_port = ntohs(addr.sin_port);
  close(probe);
  WriteFileOrDie(dir + "/give_up.pbtxt",
                 "give_up_after_ms: 1000\nbackoff_initial_ms: 50\nbackoff_max_ms: 200\n"
                 "rpc_deadline_ms: 500\n");
  std::string output;
  const int unreachable =
      RunCommand({Runfile("worker/rebound_worker"), "--config", dir + "/give_up.pbtxt",
                  "--server", absl::StrCat("127.0.0.1:", dead_port)},
                 &output, absl::Seconds(60));
  {
    INFO(output);
    CHECK(unreachable == 4);
  }

  // Registration refused: the worker asks for another job than the server runs.
  Cluster cluster;
  cluster.StartServer();
  WriteFileOrDie(dir + "/other_job.pbtxt", "job_id: \"another-job\"\nrpc_deadline_ms: 2000\n");
  const int refused =
      RunCommand({Runfile("worker/rebound_worker"), "--config", dir + "/other_job.pbtxt",
                  "--server", cluster.address()},
                 &output, absl::Seconds(60));
  INFO(output);
  CHECK(refused == 5);
  CHECK_THAT(output, Catch::Matchers::Contains("another-job"));
}

// ---- one line per host (R19): no server config, no worker config ---------------------------

TEST_CASE("a server started with --job alone and workers with --server alone train a job to the "
          "end; a trainer logs progress lines") {
  const std::string dir = MakeTempDir("one-line");
  WriteFileOrDie(dir + "/job.pbtxt",
                 "job_id: \"one-line\"\n"
                 "model { layers { width: 64 } layers { width: 10 activation: IDENTITY } }\n"
                 "topology { replicas: 2 }\n"
                 "data { batch_size: 32 train_limit: 1000 test_limit: 100 }\n"
                 "adahessian { lr: 0.01 }\n"
                 "training { max_steps: 1500 }\n");
  // The second trainer's config sets the progress line's interval only (the default is 10 s).
  WriteFileOrDie(dir + "/progress.pbtxt", "progress_interval_s: 1\n");
  const std::string port_file = dir + "/port";
  auto server = Subprocess::Start(
      {Runfile("server/rebound_server"), "--job", dir + "/job.pbtxt", "--listen", "127.0.0.1:0",
       "--data_dir", dir + "/data", "--port_file", port_file},
      dir + "/server.log");
  REQUIRE(server.ok());
  auto port = WaitForPortFile(port_file, **server, absl::Seconds(30));
  INFO(ReadFileOrEmpty(dir + "/server.log"));
  REQUIRE(port.ok());
  const std::string address = absl::StrCat("127.0.0.1:", *port);
  auto plain = Subprocess::Start({Runfile("worker/rebound_worker"), "--server", address},
                                 dir + "/plain.log");
  REQUIRE(plain.ok());
  auto logged = Subprocess::Start({Runfile("worker/rebound_worker"), "--server", address,
                                   "--config", dir + "/progress.pbtxt", "--name", "logged"},
                                  dir + "/logged.log");
  REQUIRE(logged.ok());
  const std::optional<int> plain_exit = (*plain)->WaitFor(absl::Seconds(120));
  const std::optional<int> logged_exit = (*logged)->WaitFor(absl::Seconds(120));
  const std::string plain_log = ReadFileOrEmpty(dir + "/plain.log");
  const std::string logged_log = ReadFileOrEmpty(dir + "/logged.log");
  INFO(plain_log << "\n" << logged_log);
  CHECK(plain_exit == 0);
  CHECK(logged_exit == 0);
  // Without --name: <hostname>-<pid>; both trained a slot to the end.
  CHECK_THAT(plain_log, Catch::Matchers::Contains("registered as TRAINER"));
  CHECK_THAT(plain_log, Catch::Matchers::Contains("finished 1500 steps"));
  // The default interval is 10 s, the other worker's 1 s: over the same job (about 3 s here,
  // 40 s under TSan) the first logs at most a tenth as many progress lines, plus one.
  const int plain_lines = CountOccurrences(plain_log, "progress: slot (");
  const int logged_lines = CountOccurrences(logged_log, "progress: slot (");
  INFO("progress lines: default interval " << plain_lines << ", 1 s interval " << logged_lines);
  CHECK(logged_lines >= 1);
  CHECK(plain_lines <= logged_lines / 4 + 1);
  CHECK_THAT(logged_log, Catch::Matchers::Contains("finished 1500 steps"));
  CHECK_THAT(logged_log, Catch::Matchers::Contains("progress: slot ("));
  CHECK_THAT(logged_log, Catch::Matchers::Contains("/1500, loss "));
  CHECK_THAT(logged_log, Catch::Matchers::Contains(" samples/s"));
  (*server)->Signal(SIGTERM);
  CHECK((*server)->WaitFor(absl::Seconds(30)) == 0);
  // The server kept its state in --data_dir.
  CHECK(!ReadFileOrEmpty(dir + "/data/FORMAT").empty());
}

TEST_CASE("rebound_server refuses --job with --config, and a --job file that does not parse") {
  const std::string dir = MakeTempDir("one-line-bad");
  WriteFileOrDie(dir + "/job.pbtxt", "topology { replicas: 0 }\n");
  WriteFileOrDie(dir + "/server.pbtxt", "job_file: \"job.pbtxt\"\n");
  std::string output;
  CHECK(RunCommand({Runfile("server/rebound_server"), "--job", dir + "/job.pbtxt", "--config",
                    dir + "/server.pbtxt"},
                   &output, absl::Seconds(30)) == 2);
  CHECK_THAT(output, Catch::Matchers::Contains("--config FILE"));
  CHECK_THAT(output, Catch::Matchers::Contains("not both"));
  CHECK(RunCommand({Runfile("server/rebound_server"), "--job", dir + "/job.pbtxt"}, &output,
                   absl::Seconds(30)) == 2);
  CHECK_THAT(output, Catch::Matchers::Contains("job.pbtxt:1: topology.replicas"));
}

}  // namespace
}  // namespace rebound::testing
