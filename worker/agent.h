#pragma once

// WorkerAgent: a worker's membership in the job. It registers with the server, heartbeats every
// heartbeat_interval and keeps doing so across server unavailability under the worker's retry
// policy (worker/retry.h: capped exponential backoff, giving up after give_up_after_ms without
// contact). If the server no longer knows the incarnation (ABORTED: restarted without state) it
// registers again. If the incarnation is fenced (FAILED_PRECONDITION) it stops for good: a fenced
// worker never writes again. Registration retries UNAVAILABLE, DEADLINE_EXCEEDED, UNKNOWN and
// INTERNAL and takes any other error as a refusal; heartbeats take every error but
// FAILED_PRECONDITION, ABORTED, UNAUTHENTICATED and PERMISSION_DENIED for unavailability.
//
// Every RPC carries a deadline of rpc_deadline_ms. From its first registration until Run()
// returns (after the Deregister) the agent also holds the worker's session (SessionKeeper,
// docs/design.md §13): the server learns of the process's death within crash_confirm_ms.
//
// Thread-safety: Run() is called once, on one thread; every other method is thread-safe.
// Ownership: the agent shares the channel and the credential; the clock is borrowed. The flush
// hook is called on Run()'s thread and must stay callable until it is replaced or cleared.
// Results: Run() returns an AgentExit (not a status); exit_reason() says why.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "common/security.h"
#include "proto/config.pb.h"
#include "worker/center_client.h"
#include "worker/session_keeper.h"
#include "proto/rebound.grpc.pb.h"

namespace rebound::worker {

enum class AgentExit {
  kStopped,      // Stop() was called
  kFenced,       // the server fenced this incarnation
  kUnreachable,  // no contact with the server for give_up_after_ms
  kRejected,     // the server refused the registration (wrong job, no slot for a trainer, ...)
  kJobDone,      // the server said STOP: every slot of the job is finished
};

// A registration as seen by the worker.
struct Registration {
  uint64_t incarnation = 0;
  WorkerRole role = ROLE_UNSPECIFIED;
  bool has_slot = false;
  SlotId slot;
  JobConfig job;
  int64_t start_step = 0;  // steps the slot has done (> 0 when taking over a lost slot)
  // The center's client for the job's topology (worker/center_client.h): the server's, or a
  // sharded job's K groups' (RangeClient). Set by every registration.
  std::shared_ptr<const CenterClient> center;
};

class WorkerAgent {
 public:
  // `job_id` must match the server's job. `peer_address` is this worker's WorkerPeer endpoint,
  // `metrics_address` where it serves /metrics (empty: nowhere).
  // Each registration's credential is stored in `credential` (if not null), which the channel's
  // calls carry (common/security.h MakeChannel). `clock` (null: DefaultClock()) paces the
  // retries and must outlive the agent.
  WorkerAgent(const WorkerConfig& config, std::shared_ptr<grpc::Channel> channel,
              std::string job_id, std::string name, std::string peer_address,
              std::string metrics_address = "",
              std::shared_ptr<WorkerCredential> credential = nullptr,
              const Clock* clock = nullptr);

  WorkerAgent(const WorkerAgent&) = delete;
  WorkerAgent& operator=(const WorkerAgent&) = delete;

  // Registers and heartbeats until Stop(), fencing, rejection, give-up or the job's end. Call
  // once. `registered` (if not null) is notified after the first successful registration or
  // when Run() returns, whichever comes first. At the job's end (the server's STOP) `job_done`
  // (if set) is called on Run()'s thread, and the worker stays registered until Stop() (at most
  // 2 x rpc_deadline_ms), so that its work can finish what it owes the server (the step log's
  // last batches) before the deregistration fences it.
  AgentExit Run(absl::Notification* registered = nullptr,
                std::function<void()> job_done = nullptr);

  // Asks Run() to return (deregistering first, best effort). Thread-safe.
  void Stop();

  // The current registration (incarnation 0 before the first one). Thread-safe.
  Registration registration() const;

  // Waits up to `timeout` for a registration other than `incarnation` (the agent registers again
  // when a restarted server no longer knows it). True if there is one. Thread-safe.
  bool WaitForNewRegistration(uint64_t incarnation, absl::Duration timeout) const;

  // The last error message that ended Run(), for the exit log line.
  std::string exit_reason() const;

  // True once a heartbeat carried DRAIN: the trainer should leave after its next sync.
  bool drain_requested() const;
  // The trainer has synced and leaves on the DRAIN command: the agent's deregistration says so
  // (the server fences it as DRAINED).
  void MarkDrained();
  bool drained() const;

  // Progress reported in heartbeats. Thread-safe.
  void set_progress(int64_t step, double loss);

  // Adopts a registration the server granted outside Register (a spare that finished a replay
  // becomes the slot's trainer under a new incarnation). Thread-safe.
  void Adopt(const RegisterResponse& granted);

  // The job's start barrier (TopologyConfig.min_trainers): waits until the server no longer
  // holds this trainer's start (its registration and then its heartbeats say so), `stop` is
  // notified or the agent stops (false then), or `limit` passes (a WARNING; true). Returns at
  // once when nothing holds it. Thread-safe.
  bool WaitForStart(const absl::Notification& stop, absl::Duration limit);

  // Pipelines (docs/design.md §2). The neighbour of this trainer at `slot` as the server last described
  // it (registration, takeover or heartbeat): its incarnation (0 while the slot has no owner)
  // and WorkerPeer address; nullopt if `slot` is not a neighbour. Thread-safe.
  std::optional<Neighbour> neighbour(const SlotId& slot) const;
  // Sends a heartbeat now (e.g. to learn a neighbour's new incarnation at once).
  void RequestHeartbeat();
  // What the trainer is blocked on (heartbeats carry it; the server shows the slot BLOCKED);
  // empty: not blocked.
  void set_blocked(std::string reason);
  // The trainer's step log: FLUSH_LOG (a neighbour was lost) calls `hook` with a time bound and
  // reports the request done once it returns OK. Null: nothing buffered, done at once.
  void SetFlushHook(std::function<absl::Status(absl::Duration)> hook);

  // Audits (docs/recovery.md#audits). A spare calls BeginAudit when it starts replaying an audit
  // task and EndAudit when that replay is over. Between the two, a heartbeat's PREEMPT_AUDIT (a
  // slot lost its trainer and needs this spare) makes audit_preempted() true; outside them the
  // command is ignored. BeginAudit clears what an earlier audit's command left, so that a stale
  // PREEMPT_AUDIT never cancels the next audit. Thread-safe.
  void BeginAudit();
  void EndAudit();
  bool audit_preempted() const;

 private:
  // Registers with backoff. Returns false if Run() must end (see exit_).
  bool RegisterWithRetry();
  // Carries out FLUSH_LOG request `sequence` (see SetFlushHook).
  void Flush(int64_t sequence);
  // Sleeps `d` unless stopped first; returns false if stopped.
  bool SleepUnlessStopped(absl::Duration d);
  // Like SleepUnlessStopped, but also ends early (returning true) when Adopt asks for a heartbeat
  // at once: a spare that took a slot over tells the server right away.
  bool SleepUntilBeatDue(absl::Duration d);

  const WorkerConfig config_;
  std::unique_ptr<ParameterServer::Stub> stub_;
  const std::string job_id_;
  const std::string name_;
  const std::string peer_address_;
  const std::string metrics_address_;
  const std::shared_ptr<WorkerCredential> credential_;
  const Clock* const clock_;
  absl::Notification stop_;  // notified once, by Stop(), under mu_

  mutable absl::Mutex mu_;
  Registration registration_ ABSL_GUARDED_BY(mu_);
  std::string exit_reason_ ABSL_GUARDED_BY(mu_);
  AgentExit exit_ ABSL_GUARDED_BY(mu_) = AgentExit::kStopped;
  int64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  double loss_ ABSL_GUARDED_BY(mu_) = 0.0;
  bool beat_now_ ABSL_GUARDED_BY(mu_) = false;
  bool drain_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool start_held_ ABSL_GUARDED_BY(mu_) = false;  // the start barrier holds (WaitForStart)
  // How often a held trainer heartbeats, to learn the barrier's release soon.
  static constexpr absl::Duration kStartBarrierBeat = absl::Milliseconds(50);
  bool drained_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Neighbour> neighbours_ ABSL_GUARDED_BY(mu_);
  std::string blocked_reason_ ABSL_GUARDED_BY(mu_);
  std::function<absl::Status(absl::Duration)> flush_hook_ ABSL_GUARDED_BY(mu_);
  int64_t flushes_done_ ABSL_GUARDED_BY(mu_) = 0;
  bool auditing_ ABSL_GUARDED_BY(mu_) = false;        // between BeginAudit and EndAudit
  bool audit_preempted_ ABSL_GUARDED_BY(mu_) = false;  // PREEMPT_AUDIT while auditing_
  // The worker's session under its current incarnation; told of every new one (Reattach).
  // Last: destroyed (its thread joined) before the state its thread reads.
  const std::unique_ptr<SessionKeeper> session_;
};

const char* AgentExitName(AgentExit exit);

}  // namespace rebound::worker
