#include "worker/agent.h"

#include <glog/logging.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/retry.h"
#include "common/slot.h"
#include "common/version.h"
#include "worker/range_client.h"
#include "worker/retry.h"

namespace rebound::worker {
namespace {

// The codes a registration is tried again after: the retry policy's (UNAVAILABLE,
// DEADLINE_EXCEEDED) and UNKNOWN and INTERNAL, which a server that crashed during the call
// answers. (RESOURCE_EXHAUSTED, no slot free, is a refusal.)
bool RegistrationRetryable(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED ||
         code == grpc::StatusCode::UNKNOWN || code == grpc::StatusCode::INTERNAL;
}

void SetDeadline(grpc::ClientContext* context, int deadline_ms) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
}

std::string Describe(const grpc::Status& status) {
  return absl::StrCat(status.error_code(), " ", status.error_message());
}

}  // namespace

const char* AgentExitName(AgentExit exit) {
  switch (exit) {
    case AgentExit::kStopped:
      return "stopped";
    case AgentExit::kFenced:
      return "fenced";
    case AgentExit::kUnreachable:
      return "unreachable";
    case AgentExit::kRejected:
      return "rejected";
    case AgentExit::kJobDone:
      return "job done";
  }
  return "?";
}

WorkerAgent::WorkerAgent(const WorkerConfig& config, std::shared_ptr<grpc::Channel> channel,
                         std::string job_id, std::string name, std::string peer_address,
                         std::string metrics_address,
                         std::shared_ptr<WorkerCredential> credential, const Clock* clock)
    : config_(config),
      stub_(ParameterServer::NewStub(channel)),
      job_id_(std::move(job_id)),
      name_(std::move(name)),
      peer_address_(std::move(peer_address)),
      metrics_address_(std::move(metrics_address)),
      credential_(std::move(credential)),
      clock_(clock != nullptr ? clock : DefaultClock()),
      session_(std::make_unique<SessionKeeper>(
          channel, [this] { return registration().incarnation; },
          absl::Milliseconds(std::min(config.backoff_max_ms(), 1000)))) {
  // Never null: until a registration says otherwise, the center is the server's.
  registration_.center = UnshardedCenter(config_, clock_);
}

Registration WorkerAgent::registration() const {
  absl::MutexLock lock(&mu_);
  return registration_;
}

bool WorkerAgent::WaitForNewRegistration(uint64_t incarnation, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto changed = [this, incarnation]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return registration_.incarnation != incarnation;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&changed), timeout);
}

std::string WorkerAgent::exit_reason() const {
  absl::MutexLock lock(&mu_);
  return exit_reason_;
}

void WorkerAgent::set_progress(int64_t step, double loss) {
  absl::MutexLock lock(&mu_);
  step_ = step;
  loss_ = loss;
}

void WorkerAgent::Adopt(const RegisterResponse& granted) {
  absl::MutexLock lock(&mu_);
  registration_.incarnation = granted.incarnation();
  registration_.role = granted.role();
  registration_.has_slot = granted.has_slot();
  registration_.slot = granted.slot();
  if (granted.has_job()) registration_.job = granted.job();
  registration_.start_step = granted.start_step();
  neighbours_.assign(granted.neighbours().begin(), granted.neighbours().end());
  step_ = granted.start_step();
  start_held_ = false;  // a slot taken over belongs to a job that has started
  beat_now_ = true;
  session_->Reattach();
}

std::optional<Neighbour> WorkerAgent::neighbour(const SlotId& slot) const {
  absl::MutexLock lock(&mu_);
  for (const Neighbour& n : neighbours_) {
    if (n.slot().replica() == slot.replica() && n.slot().stage() == slot.stage()) return n;
  }
  return std::nullopt;
}

void WorkerAgent::RequestHeartbeat() {
  absl::MutexLock lock(&mu_);
  beat_now_ = true;
}

void WorkerAgent::set_blocked(std::string reason) {
  absl::MutexLock lock(&mu_);
  if (reason == blocked_reason_) return;
  blocked_reason_ = std::move(reason);
  beat_now_ = true;
}

void WorkerAgent::SetFlushHook(std::function<absl::Status(absl::Duration)> hook) {
  absl::MutexLock lock(&mu_);
  flush_hook_ = std::move(hook);
}

void WorkerAgent::BeginAudit() {
  absl::MutexLock lock(&mu_);
  auditing_ = true;
  audit_preempted_ = false;
}

void WorkerAgent::EndAudit() {
  absl::MutexLock lock(&mu_);
  auditing_ = false;
  audit_preempted_ = false;
}

bool WorkerAgent::audit_preempted() const {
  absl::MutexLock lock(&mu_);
  return audit_preempted_;
}

bool WorkerAgent::drain_requested() const {
  absl::MutexLock lock(&mu_);
  return drain_requested_;
}

void WorkerAgent::MarkDrained() {
  absl::MutexLock lock(&mu_);
  drained_ = true;
}

bool WorkerAgent::drained() const {
  absl::MutexLock lock(&mu_);
  return drained_;
}

void WorkerAgent::Stop() {
  // Under the lock: Stop() may be called by several threads at once (a signal's and the main
  // one), and a Notification must be notified once.
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  stopping_ = true;
  stop_.Notify();
}

void WorkerAgent::Flush(int64_t sequence) {
  std::function<absl::Status(absl::Duration)> hook;
  {
    absl::MutexLock lock(&mu_);
    if (sequence <= flushes_done_) return;
    hook = flush_hook_;
  }
  // Bounded well below failure_timeout: heartbeats wait meanwhile.
  const absl::Duration bound = absl::Milliseconds(std::min(config_.rpc_deadline_ms(), 1000));
  if (hook) {
    absl::Status flushed = hook(bound);
    if (!flushed.ok()) {
      LOG(WARNING) << "FLUSH_LOG " << sequence << ": " << flushed << " (the next heartbeat asks again)";
      return;
    }
  }
  LOG(INFO) << "flushed the step log for a lost neighbour (request " << sequence << ")";
  absl::MutexLock lock(&mu_);
  flushes_done_ = std::max(flushes_done_, sequence);
  beat_now_ = true;
}

bool WorkerAgent::WaitForStart(const absl::Notification& stop, absl::Duration limit) {
  const absl::Time deadline = clock_->Now() + limit;
  bool logged = false;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (!start_held_ || stopping_) return !stopping_;
    }
    if (stop.HasBeenNotified()) return false;
    if (clock_->Now() >= deadline) {
      LOG(WARNING) << "the start barrier still holds after " << absl::FormatDuration(limit)
                   << "; training anyway";
      return true;
    }
    if (!logged) {
      LOG(INFO) << "waiting for the job's other trainers (the start barrier, "
                   "topology.min_trainers)";
      logged = true;
    }
    clock_->WaitFor(absl::Milliseconds(10), &stop);
  }
}

bool WorkerAgent::SleepUntilBeatDue(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return beat_now_ || stopping_; };
  mu_.AwaitWithTimeout(absl::Condition(&woken), d);
  beat_now_ = false;
  return !stopping_;
}

bool WorkerAgent::SleepUnlessStopped(absl::Duration d) {
  return !clock_->WaitFor(d, &stop_);
}

bool WorkerAgent::RegisterWithRetry() {
  RetryLoop retry(WorkerRetryPolicy(config_), clock_, &stop_, "register");
  uint64_t previous = 0;
  {
    absl::MutexLock lock(&mu_);
    previous = registration_.incarnation;
  }
  while (!stop_.HasBeenNotified()) {
    RegisterRequest request;
    request.set_job_id(job_id_);
    request.set_worker_name(name_);
    // Registering again (the server lost this worker's registration, or rolled its slot back
    // under GLOBAL_CHECKPOINT): a trainer takes whatever role the server gives, a free slot or
    // a spare's, rather than insist on a slot that may be someone else's now.
    request.set_requested_role(previous != 0 && config_.role() == TRAINER ? ROLE_UNSPECIFIED
                                                                           : config_.role());
    request.set_peer_address(peer_address_);
    if (!metrics_address_.empty()) request.set_metrics_address(metrics_address_);
    request.set_backend(config_.compute().backend());
    request.set_previous_incarnation(previous);
    request.set_version(ProjectVersion());
    // This worker's spare loop serves audit tasks (worker/replay.h).
    request.set_audits(true);
    RegisterResponse response;
    grpc::ClientContext context;
    SetDeadline(&context, config_.rpc_deadline_ms());
    const grpc::Status status = stub_->Register(&context, request, &response);
    if (status.ok()) {
      // The server applies the rule too; this catches a server from before it did (0.12).
      if (absl::Status compatible = CheckPeerVersion(
              absl::StrCat("this worker '", name_, "'"), response.server_version(), "the server");
          !compatible.ok()) {
        absl::MutexLock lock(&mu_);
        exit_ = AgentExit::kRejected;
        exit_reason_ = absl::StrCat("registration refused: ", compatible.message());
        return false;
      }
      // Before the registration is published: every call that names it must carry it.
      if (credential_ != nullptr) credential_->Set(response.credential());
      std::shared_ptr<const CenterClient> center = UnshardedCenter(config_, clock_);
      if (response.range_addresses_size() > 0) {
        auto made = RangeClient::Create(
            config_, response.job(),
            std::vector<std::string>(response.range_addresses().begin(),
                                     response.range_addresses().end()),
            credential_, clock_);
        if (!made.ok()) {
          absl::MutexLock lock(&mu_);
          exit_ = AgentExit::kRejected;
          exit_reason_ = absl::StrCat("cannot reach the job's range groups: ",
                                      made.status().message());
          return false;
        }
        center = *std::move(made);
      }
      absl::MutexLock lock(&mu_);
      registration_.center = std::move(center);
      registration_.incarnation = response.incarnation();
      registration_.role = response.role();
      registration_.has_slot = response.has_slot();
      registration_.slot = response.slot();
      registration_.job = response.job();
      registration_.start_step = response.start_step();
      neighbours_.assign(response.neighbours().begin(), response.neighbours().end());
      start_held_ = response.hold_start();
      session_->Reattach();
      LOG(INFO) << "registered as " << WorkerRole_Name(response.role()) << " incarnation "
                << response.incarnation()
                << (response.has_slot() ? absl::StrCat(" slot ", SlotName(response.slot()))
                                        : std::string())
                << " in job '" << response.job().job_id() << "'";
      return true;
    }
    if (!RegistrationRetryable(status.error_code())) {
      absl::MutexLock lock(&mu_);
      exit_ = AgentExit::kRejected;
      exit_reason_ = absl::StrCat("registration refused: ", Describe(status));
      return false;
    }
    absl::Status retried = absl::UnavailableError(Describe(status));
    if (retry.ShouldRetry(&retried)) continue;
    if (retried.code() == absl::StatusCode::kCancelled) break;
    absl::MutexLock lock(&mu_);
    exit_ = AgentExit::kUnreachable;
    exit_reason_ = absl::StrCat("server unreachable for ", config_.give_up_after_ms(),
                                " ms: ", Describe(status));
    return false;
  }
  absl::MutexLock lock(&mu_);
  exit_ = AgentExit::kStopped;
  return false;
}

AgentExit WorkerAgent::Run(absl::Notification* registered, std::function<void()> job_done_out) {
  struct NotifyOnExit {
    absl::Notification* n;
    ~NotifyOnExit() {
      if (n != nullptr && !n->HasBeenNotified()) n->Notify();
    }
  } notify_on_exit{registered};
  if (!RegisterWithRetry()) {
    absl::MutexLock lock(&mu_);
    return exit_;
  }
  if (registered != nullptr) registered->Notify();
  // The session lasts until Run() returns: after the Deregister on a clean exit, so that its end
  // is not taken for a crash.
  session_->Start();
  struct StopSession {
    SessionKeeper* session;
    ~StopSession() { session->Stop(); }
  } stop_session{session_.get()};
  // Contact with the server: a heartbeat acknowledged starts the backoff and the give-up time
  // over; failed ones wait the backoff until give_up_after_ms pass without contact.
  RetryLoop contact(WorkerRetryPolicy(config_), clock_, &stop_, "heartbeat");
  bool job_done = false;
  while (true) {
    const Registration current = registration();
    const absl::Duration interval =
        absl::Milliseconds(current.job.fault_tolerance().heartbeat_interval_ms());
    HeartbeatRequest request;
    request.set_incarnation(current.incarnation);
    {
      absl::MutexLock lock(&mu_);
      request.set_step(step_);
      request.set_loss(loss_);
      if (!blocked_reason_.empty()) request.set_blocked_reason(blocked_reason_);
      request.set_flushes_done(flushes_done_);
    }
    HeartbeatResponse response;
    grpc::ClientContext context;
    SetDeadline(&context, config_.rpc_deadline_ms());
    const grpc::Status status = stub_->Heartbeat(&context, request, &response);
    if (status.ok()) {
      contact.Reset();
      if (response.has_takeover()) {
        const RegisterResponse& takeover = response.takeover();
        LOG(WARNING) << "taking over slot " << SlotName(takeover.slot()) << " as incarnation "
                     << takeover.incarnation()
                     << " from step " << takeover.start_step();
        absl::MutexLock lock(&mu_);
        registration_.incarnation = takeover.incarnation();
        registration_.role = takeover.role();
        registration_.has_slot = true;
        registration_.slot = takeover.slot();
        registration_.job = takeover.job();
        registration_.start_step = takeover.start_step();
        neighbours_.assign(takeover.neighbours().begin(), takeover.neighbours().end());
        step_ = takeover.start_step();
        session_->Reattach();
      }
      if (current.role == TRAINER && !response.has_takeover()) {
        absl::MutexLock lock(&mu_);
        if (registration_.incarnation == current.incarnation) {
          neighbours_.assign(response.neighbours().begin(), response.neighbours().end());
          start_held_ = response.hold_start();
        }
      }
      for (int command : response.commands()) {
        if (command == DRAIN) {
          absl::MutexLock lock(&mu_);
          if (!drain_requested_) LOG(WARNING) << "the server asks this trainer to drain";
          drain_requested_ = true;
        }
        if (command == STOP) {
          job_done = true;
          break;
        }
        if (command == FLUSH_LOG) Flush(response.flush_sequence());
        if (command == PREEMPT_AUDIT) {
          absl::MutexLock lock(&mu_);
          if (auditing_ && !audit_preempted_) {
            LOG(WARNING) << "the server needs this spare for a recovery: stopping the audit";
            audit_preempted_ = true;
          }
        }
      }
    } else if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION &&
               registration().incarnation != current.incarnation) {
      // This heartbeat named an incarnation the worker has just left (a spare that took a slot
      // over after a replay): not a fencing of the worker, go on under the new one.
      continue;
    } else if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION &&
               current.role == SPARE &&
               WaitForNewRegistration(current.incarnation, absl::Seconds(2))) {
      // A spare that has just taken a slot over is fenced (REPLACED) by the server the moment it
      // reports, before it adopts its trainer incarnation here: a heartbeat answered in between
      // is not a fencing of the worker.
      continue;
    } else if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
      absl::MutexLock lock(&mu_);
      exit_ = AgentExit::kFenced;
      exit_reason_ = status.error_message();
      return exit_;
    } else if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
               status.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
      // The server does not take this worker for itself (wrong bearer token, or a credential it
      // does not know): retrying the same call cannot help.
      absl::MutexLock lock(&mu_);
      exit_ = AgentExit::kRejected;
      exit_reason_ = absl::StrCat("the server refuses this worker's heartbeat: ", Describe(status));
      return exit_;
    } else if (status.error_code() == grpc::StatusCode::ABORTED) {
      LOG(WARNING) << "server lost this registration (" << status.error_message()
                   << "); registering again";
      if (!RegisterWithRetry()) {
        absl::MutexLock lock(&mu_);
        return exit_;
      }
      contact.Reset();
      continue;
    } else {
      // Every other error is taken for unavailability: waited out, up to give_up_after_ms.
      absl::Status retried = absl::UnavailableError(Describe(status));
      if (contact.ShouldRetry(&retried)) continue;
      if (retried.code() == absl::StatusCode::kCancelled) break;  // stopped
      absl::MutexLock lock(&mu_);
      exit_ = AgentExit::kUnreachable;
      exit_reason_ = absl::StrCat("no heartbeat acknowledged for ", config_.give_up_after_ms(),
                                  " ms: ", Describe(status));
      return exit_;
    }
    // While the start barrier holds, beat often: the trainers start within one such beat of
    // its release.
    bool held;
    {
      absl::MutexLock lock(&mu_);
      held = start_held_;
    }
    if (job_done ||
        !SleepUntilBeatDue(held ? std::min(interval, kStartBarrierBeat) : interval)) {
      break;
    }
  }
  if (job_done && job_done_out != nullptr) {
    job_done_out();
    // Bounded: a worker whose work hangs still leaves.
    SleepUnlessStopped(absl::Milliseconds(2 * config_.rpc_deadline_ms()));
  }

  // Stopped or done: leave cleanly so the server does not wait for failure_timeout.
  DeregisterRequest request;
  request.set_incarnation(registration().incarnation);
  request.set_drained(drained());
  DeregisterResponse response;
  grpc::ClientContext context;
  SetDeadline(&context, std::min(config_.rpc_deadline_ms(), 2000));
  const grpc::Status status = stub_->Deregister(&context, request, &response);
  if (!status.ok()) LOG(WARNING) << "deregister failed: " << Describe(status);
  absl::MutexLock lock(&mu_);
  exit_ = job_done ? AgentExit::kJobDone : AgentExit::kStopped;
  if (job_done) exit_reason_ = "the job is finished";
  return exit_;
}

}  // namespace rebound::worker
