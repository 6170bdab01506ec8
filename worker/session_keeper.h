#pragma once

// SessionKeeper: a worker's session with the server (docs/design.md §13, crash detection), held
// on a thread of its own. It keeps one WorkerSession.Attach call open under the worker's current
// incarnation: when the process dies the kernel closes the connection, the call ends without a
// Deregister, and the server declares the worker failed within crash_confirm_ms instead of after
// failure_timeout_ms of missed heartbeats.
//
// A live worker must never look crashed: whenever its session ends while the keeper runs (the
// server ended it, a connection reset, a leader change) it attaches again at once, within the
// server's crash_confirm_ms; a refused or failed attach is tried again after a backoff that starts
// at kFirstRetry and doubles up to `max_retry` (the heartbeat interval is a good cap: a server
// that restarts gives its workers a restart grace, docs/design.md §5.5). The keeper stops only on
// Stop(): the agent stops it after its Deregister, so that a clean exit's session end is not a
// crash. An incarnation change (a takeover, a registration again) is followed by Reattach(). A
// server without the service (UNIMPLEMENTED: an older server, before 0.13) ends the keeper's thread.
//
// Every Attach call carries a deadline of kSessionDeadline, longer than the server lets a session
// live (WorkerSessions::kMaxSessionAge): the server ends sessions before any deadline passes.
//
// Time: the backoff waits on the keeper's lock (real time: they must end at once on Stop or
// Reattach); the deadlines are gRPC's.
// Thread-safety: thread-safe. Ownership: shares the channel; `incarnation` is copied and called
// on the keeper's thread (never under its lock).

#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/rebound.grpc.pb.h"

namespace rebound::worker {

class SessionKeeper {
 public:
  static constexpr absl::Duration kFirstRetry = absl::Milliseconds(10);
  static constexpr absl::Duration kSessionDeadline = absl::Minutes(30);

  // `incarnation` returns the worker's current incarnation (0: not registered yet).
  SessionKeeper(std::shared_ptr<grpc::Channel> channel, std::function<uint64_t()> incarnation,
                absl::Duration max_retry);
  ~SessionKeeper();  // Stop()

  SessionKeeper(const SessionKeeper&) = delete;
  SessionKeeper& operator=(const SessionKeeper&) = delete;

  // Starts the keeper's thread (once; later calls do nothing).
  void Start() ABSL_LOCKS_EXCLUDED(mu_);
  // The incarnation changed: ends the current session and attaches under the new one.
  void Reattach() ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the session and joins the thread. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  // Sessions the server accepted so far (attached).
  int64_t attaches() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run();

  const std::unique_ptr<WorkerSession::Stub> stub_;
  const std::function<uint64_t()> incarnation_;
  const absl::Duration max_retry_;

  mutable absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool reattach_ ABSL_GUARDED_BY(mu_) = false;  // Reattach() asked: no backoff before the next
  grpc::ClientContext* call_ ABSL_GUARDED_BY(mu_) = nullptr;  // the open Attach call, if any
  int64_t attaches_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace rebound::worker
