#pragma once

// A real rebound_server and real rebound_worker processes on loopback, for the integration
// tests: testing/cluster/cluster.h's Cluster (which owns the processes) with this suite's
// conventions and Catch2 checks. Each process has its own log under one temp directory, the
// server on 127.0.0.1:0 (its port read from --port_file), workers started by name; the test's
// own calls carry the worker credentials of its registrations. Workers are destroyed first
// (SIGKILLed and reaped, stopped or not), then the server. Failures are Catch2 REQUIREs that
// carry the tail of every log. Not thread-safe: the test's main thread uses it.
//
// Time: every limit and deadline below (WaitFor's, ExitCode's, Call's, wait_limit) is in the
// normal build's time and multiplied by testing/cluster/time_scale.h's TimeScale() when applied,
// as are the job's and the workers' timing fields (the Cluster writes them scaled); job() is the
// job as the test wrote it, unscaled.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "testing/cluster/cluster.h"
#include "testing/cluster/processes.h"
#include "testing/cluster/time_scale.h"
#include "tests/integration/worker_credentials.h"

namespace rebound::testing {

struct LocalClusterOptions {
  std::string name = "cluster";  // prefix of the temp directory
  int max_wait_ms = 500;         // the server's max_wait_ms
  bool durable = false;          // durability.data_dir = data_dir() (else in memory)
  absl::Duration wait_limit = absl::Seconds(60);  // WaitFor's default limit
  // Appended to the server's and the workers' configs (protobuf text), e.g. a security block.
  std::string server_config_extra;
  std::string worker_config_extra;
  // How this test reaches the server (Status, Register, Pull, ...).
  SecurityConfig client_security;
};

class LocalCluster {
 public:
  // Starts the server on `job_text` (the inside of a JobConfig, protobuf text) and waits until
  // it listens. Workers use backoff 20..200 ms.
  LocalCluster(const std::string& job_text, const LocalClusterOptions& options);

  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  // The job as the server runs it (parsed from the text given).
  const JobConfig& job() const { return job_; }

  // Starts worker `name` with --role trainer, spare or evaluator and waits until the server lists it ALIVE
  // in that role (so trainers started one after the other own slots 0, 1, ... in order).
  // `config_extra` is appended to this worker's config only; `extra_args` to its command line.
  Subprocess& StartWorker(const std::string& name, WorkerRole role,
                          const std::string& config_extra = "",
                          const std::vector<std::string>& extra_args = {});

  Subprocess& worker(const std::string& name);
  void Signal(const std::string& name, int signal_number) { worker(name).Signal(signal_number); }

  // SIGKILLs a worker and checks that the signal, not a clean exit, ended it: a worker that
  // finished before the kill would make the test prove nothing.
  void Kill(const std::string& name);

  // The worker's exit code once it exits (bounded), -1 if it does not.
  int ExitCode(const std::string& name, absl::Duration limit = absl::Seconds(30));

  // SIGTERM: the server stops cleanly (exit 0) and releases its data directory.
  void StopServer();
  // SIGKILL: the server dies without flushing anything (its RocksDB WAL ends mid-stream).
  void KillServer();

  GetStatusResponse Status();

  // Calls `method` on the server as a test client, with a deadline. A request that names an
  // incarnation this test registered carries that incarnation's worker credential, as the
  // worker's own calls do (proto/rebound.proto, Identity).
  template <typename Request, typename Response>
  grpc::Status Call(grpc::Status (ParameterServer::Stub::*method)(grpc::ClientContext*,
                                                                   const Request&, Response*),
                    const Request& request, Response* response,
                    absl::Duration deadline = absl::Seconds(10)) {
    return CallWithCredential(credentials_.For(request), method, request, response, deadline);
  }

  // Call, with `credential` as the worker credential (none if empty): to act as another worker.
  template <typename Request, typename Response>
  grpc::Status CallWithCredential(
      const std::string& credential,
      grpc::Status (ParameterServer::Stub::*method)(grpc::ClientContext*, const Request&,
                                                    Response*),
      const Request& request, Response* response, absl::Duration deadline = absl::Seconds(10)) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(absl::ToInt64Milliseconds(Scaled(deadline))));
    WorkerCredentials::AddTo(&context, credential);
    return (cluster_.stub().*method)(&context, request, response);
  }

  // The worker credentials of this test's registrations.
  WorkerCredentials& credentials() { return credentials_; }

  // Registers this test as a worker (a test client, not a process).
  RegisterResponse Register(const std::string& name, WorkerRole role);

  // Registers this test as a spare named `name`: an alive incarnation that may Pull, and that
  // never takes a slot over (it never heartbeats).
  uint64_t RegisterObserver(const std::string& name = "observer") {
    return Register(name, SPARE).incarnation();
  }

  PullResponse Pull(uint64_t incarnation);

  // Polls GetStatus until `done` holds; after `limit` (zero: options.wait_limit), fails with the
  // last status and the tail of every log.
  GetStatusResponse WaitFor(const std::string& what,
                            const std::function<bool(const GetStatusResponse&)>& done,
                            absl::Duration limit = absl::ZeroDuration(),
                            absl::Duration poll = absl::Milliseconds(10));

  // The last lines of every process's log, for failure messages.
  std::string Logs() const;

  std::string WorkerLog(const std::string& name) {
    return ReadFileOrEmpty(worker(name).log_path());
  }

  std::string data_dir() const { return dir_ + "/data"; }
  // The server's host:port.
  const std::string& address() const { return cluster_.address(); }
  // `name` may exit on its own (e.g. a fault injection kills it): not a failure of WaitFor.
  void ExpectExit(const std::string& name) { cluster_.ExpectExit(name); }
  // The server process (e.g. to read its /proc/<pid>/status).
  pid_t server_pid() const { return cluster_.server().pid(); }

 private:
  const std::string dir_;
  const absl::Duration wait_limit_;
  JobConfig job_;
  WorkerCredentials credentials_;
  Cluster cluster_;  // declared last: its processes go first
};

}  // namespace rebound::testing
