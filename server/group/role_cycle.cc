#include "server/group/role_cycle.h"

#include <glog/logging.h>

#include <thread>

namespace rebound::server {

namespace {

class Sole final : public Election {
 public:
  absl::Status RunUntilLeader(const absl::Notification* /*stop*/) override {
    return absl::OkStatus();
  }
  absl::Status CheckLeadership() const override { return absl::OkStatus(); }
  absl::Status Resign() override { return absl::OkStatus(); }
  bool HandsOver() const override { return false; }
};

}  // namespace

std::unique_ptr<Election> SoleServer() { return std::make_unique<Sole>(); }

RoleCycle::RoleCycle(Election* election, absl::Duration check_every)
    : election_(election), check_every_(check_every) {}

RoleCycle::~RoleCycle() = default;

bool RoleCycle::AwaitLeadership() {
  std::thread campaign([this] {
    const absl::Status led = election_->RunUntilLeader(&stop_campaign_);
    if (!led.ok() && led.code() != absl::StatusCode::kCancelled) {
      LOG(ERROR) << "the campaign for the leadership ended: " << led;
    }
    absl::MutexLock lock(&mu_);
    elected_ = led.ok();
    campaign_ended_ = true;
  });
  bool stopped = false;
  {
    absl::MutexLock lock(&mu_);
    // A campaign that ended without the leadership leaves a standby that only a stop ends (as
    // before: nothing else would change its course).
    auto decided = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return elected_ || stop_requested_;
    };
    mu_.Await(absl::Condition(&decided));
    stopped = stop_requested_;
  }
  if (!stop_campaign_.HasBeenNotified()) stop_campaign_.Notify();
  if (stopped) election_->CancelCampaign();
  campaign.join();
  absl::MutexLock lock(&mu_);
  if (stopped) {
    state_ = State::kStopped;
    // A campaign won as the stop came: hand it on at once.
    if (elected_) {
      if (absl::Status resigned = election_->Resign(); !resigned.ok()) {
        LOG(WARNING) << "resigning a leadership won as the server stopped: " << resigned;
      }
    }
    return false;
  }
  state_ = State::kLeading;
  return true;
}

void RoleCycle::Fence(const std::string& why) {
  if (state_ != State::kLeading) return;
  state_ = State::kFenced;
  why_ = why;
}

RoleCycle::End RoleCycle::AwaitEnd() {
  absl::MutexLock lock(&mu_);
  auto ended = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_requested_ || state_ == State::kFenced;
  };
  while (!mu_.AwaitWithTimeout(absl::Condition(&ended), check_every_)) {
    mu_.Unlock();
    const absl::Status leading = election_->CheckLeadership();
    mu_.Lock();
    // UNAVAILABLE: etcd out of reach, the lease may still hold (acknowledgements wait for it).
    if (!leading.ok() && leading.code() != absl::StatusCode::kUnavailable) {
      Fence(std::string(leading.message()));
    }
  }
  // A stop ends the life even of a fenced leader: the operator asked for the process's end.
  if (!stop_requested_) return End::kRunAgain;
  state_ = State::kStopped;
  return End::kStopped;
}

void RoleCycle::HandOver() {
  if (!election_->HandsOver()) return;
  if (absl::Status resigned = election_->Resign(); !resigned.ok()) {
    LOG(WARNING) << "resigning: " << resigned;
  }
}

void RoleCycle::Stop() {
  absl::MutexLock lock(&mu_);
  stop_requested_ = true;
}

void RoleCycle::Unhealthy(const absl::Status& why) {
  if (!election_->HandsOver()) return;
  absl::MutexLock lock(&mu_);
  Fence(std::string(why.message()));
}

RoleCycle::State RoleCycle::state() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

std::string RoleCycle::why() const {
  absl::MutexLock lock(&mu_);
  return why_;
}

}  // namespace rebound::server
