#pragma once

// WorkerSessions: the WorkerSession service (docs/design.md §13, crash detection). Each worker
// holds one Attach call open for as long as it is registered; a process that dies closes its
// connections at once, so the call's end, without the worker's Deregister, says the worker is
// gone long before its heartbeats would be missed. This unit only tells Membership when a
// session opens and ends (AttachSession / DetachSession); the failure detector declares the
// worker failed if it does not attach again within crash_confirm_ms.
//
// A session's end is a loss when the server did not end it: the peer went away, reset the
// connection or cancelled. The server ends sessions itself, with OK and no loss, when it stops
// (EndAll, before its gRPC server's Shutdown: nothing is left for the shutdown to wait out) and
// once a session is older than kMaxSessionAge (EndAged, called by the failure detector's
// passes), so that no session reaches its client's deadline; the worker attaches again at once.
// A server that is not the job's serving leader answers Attach as it answers Heartbeat
// (UNAVAILABLE while loading or after its store was fenced), so a worker of a replicated group
// attaches to the new leader, which starts with no sessions: a leader change or server restart
// is no worker's crash (the restart grace of docs/design.md §5.5 applies).
//
// Reactors are gRPC's callback API: an open session holds no thread.
//
// Thread-safety: thread-safe. gRPC calls Attach and the reactions on its own threads; EndAll and
// EndAged may be called from any thread. mu_ is held while calling Membership (lock order:
// server/recovery_coordinator.h) and gRPC's Finish, never while gRPC calls OnDone (it is not
// inlined for a write reactor: OnDone takes mu_ to forget the session).
// Ownership: `membership` and `clock` are borrowed and must outlive the service (and the gRPC
// server it is registered with); the check is copied.
// Status codes: Attach answers the check's errors (UNAUTHENTICATED, ABORTED, FAILED_PRECONDITION,
// UNAVAILABLE), Membership::AttachSession's (RESOURCE_EXHAUSTED beyond its sessions per worker),
// RESOURCE_EXHAUSTED beyond kMaxSessions in all, and UNAVAILABLE once the server is stopping.

#include <cstdint>
#include <functional>
#include <set>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "grpcpp/grpcpp.h"
#include "proto/rebound.grpc.pb.h"
#include "server/membership.h"

namespace rebound::server {

class WorkerSessions final : public WorkerSession::CallbackService {
 public:
  // Whether a call naming `incarnation` may act as that worker (the token, readiness and the
  // worker's credential: ParameterServerService::CheckWorkerCall).
  using CheckFn = std::function<absl::Status(const grpc::ServerContextBase*, uint64_t)>;

  static constexpr int kMaxSessions = 65536;
  static constexpr absl::Duration kMaxSessionAge = absl::Minutes(10);

  // REQUIRES: `membership` and `clock` outlive this object.
  WorkerSessions(Membership* membership, CheckFn check, const Clock* clock);

  WorkerSessions(const WorkerSessions&) = delete;
  WorkerSessions& operator=(const WorkerSessions&) = delete;

  grpc::ServerWriteReactor<SessionEvent>* Attach(grpc::CallbackServerContext* context,
                                                 const AttachRequest* request) override;

  // The server stops: ends every open session (OK, not a loss) and refuses new ones.
  void EndAll() ABSL_LOCKS_EXCLUDED(mu_);
  // Ends (OK, not a loss) the sessions opened more than kMaxSessionAge ago.
  void EndAged() ABSL_LOCKS_EXCLUDED(mu_);

  // Sessions open now, and sessions lost since the start (ended by their peer).
  int open() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t lost() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class Session;
  // A session's reactor is done (OnDone): forgets it.
  void Forget(Session* session) ABSL_LOCKS_EXCLUDED(mu_);

  Membership* const membership_;
  const CheckFn check_;
  const Clock* const clock_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::set<Session*> sessions_ ABSL_GUARDED_BY(mu_);
  int64_t lost_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rebound::server
