#include "worker/session_keeper.h"

#include <glog/logging.h>

#include <algorithm>
#include <chrono>
#include <utility>

namespace rebound::worker {

SessionKeeper::SessionKeeper(std::shared_ptr<grpc::Channel> channel,
                             std::function<uint64_t()> incarnation, absl::Duration max_retry)
    : stub_(WorkerSession::NewStub(std::move(channel))),
      incarnation_(std::move(incarnation)),
      max_retry_(std::max(max_retry, kFirstRetry)) {}

SessionKeeper::~SessionKeeper() { Stop(); }

void SessionKeeper::Start() {
  absl::MutexLock lock(&mu_);
  if (started_ || stopping_) return;
  started_ = true;
  thread_ = std::thread([this] { Run(); });
}

void SessionKeeper::Reattach() {
  absl::MutexLock lock(&mu_);
  reattach_ = true;
  if (call_ != nullptr) call_->TryCancel();
}

void SessionKeeper::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (call_ != nullptr) call_->TryCancel();
  }
  if (thread_.joinable()) thread_.join();
}

int64_t SessionKeeper::attaches() const {
  absl::MutexLock lock(&mu_);
  return attaches_;
}

void SessionKeeper::Run() {
  absl::Duration backoff = kFirstRetry;
  uint64_t logged_refusal = 0;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      reattach_ = false;
    }
    const uint64_t incarnation = incarnation_();
    bool attached = false;
    grpc::Status status;
    if (incarnation != 0) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() +
                           absl::ToChronoMilliseconds(kSessionDeadline));
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return;
        if (reattach_) continue;  // the incarnation changed since it was read
        call_ = &context;
      }
      AttachRequest request;
      request.set_incarnation(incarnation);
      std::unique_ptr<grpc::ClientReader<SessionEvent>> reader = stub_->Attach(&context, request);
      SessionEvent event;
      attached = reader->Read(&event) && event.attached();
      if (attached) {
        {
          absl::MutexLock lock(&mu_);
          ++attaches_;
        }
        backoff = kFirstRetry;
        logged_refusal = 0;
        while (reader->Read(&event)) {
        }
      }
      status = reader->Finish();
      absl::MutexLock lock(&mu_);
      call_ = nullptr;
      if (stopping_) return;
    }
    // Attached and ended (by the server, a reset, a Reattach): attach again at once, within
    // the server's crash_confirm_ms. Refused or unreachable: after the backoff.
    if (attached) continue;
    if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
      LOG(WARNING) << "the server has no worker sessions (an older server, before 0.13): its "
                      "failure detection is the heartbeat timeout alone";
      return;
    }
    if (incarnation != 0 && status.error_code() != grpc::StatusCode::UNAVAILABLE &&
        status.error_code() != grpc::StatusCode::CANCELLED && logged_refusal != incarnation) {
      // Fenced, unknown or refused: the agent's heartbeat learns it and acts; this only waits.
      LOG(INFO) << "session of incarnation " << incarnation << " refused: "
                << status.error_code() << " " << status.error_message();
      logged_refusal = incarnation;
    }
    absl::MutexLock lock(&mu_);
    auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || reattach_; };
    mu_.AwaitWithTimeout(absl::Condition(&woken), backoff);
    backoff = std::min(2 * backoff, max_retry_);
  }
}

}  // namespace rebound::worker
