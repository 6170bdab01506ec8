#include "server/worker_sessions.h"

#include <glog/logging.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/grpc_handoff.h"
#include "common/grpc_status.h"

namespace rebound::server {

// One Attach call: the first event, then nothing until its peer or the server ends it. Deletes
// itself when gRPC is done with it (OnDone).
class WorkerSessions::Session final : public grpc::ServerWriteReactor<SessionEvent> {
 public:
  Session(WorkerSessions* owner, uint64_t incarnation, absl::Time opened)
      : owner_(owner), incarnation_(incarnation), opened_(opened) {}

  uint64_t incarnation() const { return incarnation_; }
  absl::Time opened() const { return opened_; }

  // The call was refused: it ends at once and was never attached.
  void Refuse(const absl::Status& why) {
    MarkEnded();
    MarkHandOffToGrpc();
    Finish(ToGrpcStatus(why));
  }

  // Attached: the first event tells the worker so.
  void Open(absl::Time now) {
    event_.set_attached(true);
    event_.set_server_time_ms(absl::ToUnixMillis(now));
    MarkHandOffToGrpc();
    StartWrite(&event_);
  }

  // The server ends the session (not a loss). REQUIRES: the owner's mu_ is held (EndAll and
  // EndAged hold it while they walk the sessions; not annotated: the analysis cannot tell that
  // owner_ is the walker).
  void EndByServer() {
    if (!MarkEnded()) return;
    owner_->membership_->DetachSession(incarnation_, /*lost=*/false);
    MarkHandOffToGrpc();
    Finish(grpc::Status::OK);
  }

  void OnWriteDone(bool /*ok*/) override { MarkTakenFromGrpc(); }  // a failed one: OnCancel

  void OnCancel() override {
    MarkTakenFromGrpc();
    if (!MarkEnded()) return;  // the server ended it first
    {
      absl::MutexLock lock(&owner_->mu_);
      const bool lost = !owner_->stopping_;
      if (lost) {
        ++owner_->lost_;
        VLOG(1) << "session of incarnation " << incarnation_ << " ended by its peer";
      }
      owner_->membership_->DetachSession(incarnation_, lost);
    }
    MarkHandOffToGrpc();
    Finish(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    MarkTakenFromGrpc();
    owner_->Forget(this);
    delete this;
  }

 private:
  // True for the first caller only: a session ends once.
  bool MarkEnded() {
    absl::MutexLock lock(&mu_);
    if (ended_) return false;
    ended_ = true;
    return true;
  }

  WorkerSessions* const owner_;
  const uint64_t incarnation_;
  const absl::Time opened_;
  SessionEvent event_;
  absl::Mutex mu_;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

WorkerSessions::WorkerSessions(Membership* membership, CheckFn check, const Clock* clock)
    : membership_(membership), check_(std::move(check)), clock_(clock) {}

grpc::ServerWriteReactor<SessionEvent>* WorkerSessions::Attach(
    grpc::CallbackServerContext* context, const AttachRequest* request) {
  MarkTakenFromGrpc();
  const absl::Time now = clock_->Now();
  auto* session = new Session(this, request->incarnation(), now);
  absl::Status admitted = check_(context, request->incarnation());
  if (admitted.ok()) {
    // Under mu_, with the insertion: EndAll ends every session it lets in.
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      admitted = absl::UnavailableError("the server is stopping");
    } else if (sessions_.size() >= static_cast<size_t>(kMaxSessions)) {
      admitted = absl::ResourceExhaustedError(
          absl::StrCat("the server holds ", sessions_.size(), " sessions, its most"));
    } else {
      absl::Duration back_after;
      admitted = membership_->AttachSession(request->incarnation(), &back_after);
      if (admitted.ok() && back_after > absl::ZeroDuration()) {
        LOG(INFO) << "incarnation " << request->incarnation() << " attached again "
                  << absl::ToInt64Milliseconds(back_after) << " ms after its session was lost";
      }
    }
    if (admitted.ok()) sessions_.insert(session);
  }
  if (!admitted.ok()) {
    session->Refuse(admitted);
    return session;
  }
  session->Open(now);
  return session;
}

void WorkerSessions::EndAll() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  // Each stays in the set until gRPC is done with it (OnDone waits for mu_ meanwhile).
  for (Session* session : sessions_) session->EndByServer();
}

void WorkerSessions::EndAged() {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  for (Session* session : sessions_) {
    if (now - session->opened() > kMaxSessionAge) session->EndByServer();
  }
}

void WorkerSessions::Forget(Session* session) {
  absl::MutexLock lock(&mu_);
  sessions_.erase(session);
}

int WorkerSessions::open() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(sessions_.size());
}

int64_t WorkerSessions::lost() const {
  absl::MutexLock lock(&mu_);
  return lost_;
}

}  // namespace rebound::server
