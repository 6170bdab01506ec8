// RoleCycle (server/group/role_cycle.h): a server's life as explicit states, driven by a fake
// election without processes, etcd or gRPC: elected, fenced by a lost lease or by ill health,
// stopped in each state; a campaign won as the stop came is resigned.

#include <catch2/catch.hpp>

#include <atomic>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/group/role_cycle.h"

namespace rebound::server {
namespace {

// An election the test decides: Elect() ends the campaign with the leadership, Lose(status)
// makes CheckLeadership fail.
class FakeElection final : public Election {
 public:
  absl::Status RunUntilLeader(const absl::Notification* stop) override {
    campaigns_.fetch_add(1);
    while (!stop->WaitForNotificationWithTimeout(absl::Milliseconds(5))) {
      if (elected_.HasBeenNotified()) return absl::OkStatus();
    }
    // The stop came; a campaign may have been won in the same instant.
    return elected_.HasBeenNotified() && win_on_stop_ ? absl::OkStatus()
                                                      : absl::CancelledError("stopped");
  }
  absl::Status CheckLeadership() const override {
    absl::MutexLock lock(&mu_);
    checks_ += 1;
    return leadership_;
  }
  absl::Status Resign() override {
    resigns_.fetch_add(1);
    return absl::OkStatus();
  }
  bool HandsOver() const override { return true; }

  void Elect(bool win_on_stop = false) {
    win_on_stop_ = win_on_stop;
    elected_.Notify();
  }
  void SetLeadership(absl::Status status) {
    absl::MutexLock lock(&mu_);
    leadership_ = std::move(status);
  }
  int checks() const {
    absl::MutexLock lock(&mu_);
    return checks_;
  }
  int resigns() const { return resigns_.load(); }
  int campaigns() const { return campaigns_.load(); }

 private:
  absl::Notification elected_;
  std::atomic<bool> win_on_stop_{false};
  mutable absl::Mutex mu_;
  absl::Status leadership_ ABSL_GUARDED_BY(mu_);
  mutable int checks_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int> resigns_{0};
  std::atomic<int> campaigns_{0};
};

// Runs `fn` on a thread after `delay`.
std::thread After(absl::Duration delay, std::function<void()> fn) {
  return std::thread([delay, fn = std::move(fn)] {
    absl::SleepFor(delay);
    fn();
  });
}

TEST_CASE("a standby leads once elected, and a lost lease fences it: it runs again") {
  FakeElection election;
  RoleCycle cycle(&election, absl::Milliseconds(5));
  CHECK(cycle.state() == RoleCycle::State::kStandby);
  std::thread elect = After(absl::Milliseconds(30), [&] { election.Elect(); });
  REQUIRE(cycle.AwaitLeadership());
  elect.join();
  CHECK(cycle.state() == RoleCycle::State::kLeading);
  CHECK(election.campaigns() == 1);

  // etcd out of reach (UNAVAILABLE) does not fence: the lease may still hold.
  election.SetLeadership(absl::UnavailableError("etcd unreachable"));
  std::thread lose = After(absl::Milliseconds(60), [&] {
    election.SetLeadership(absl::FailedPreconditionError("the leader key is gone"));
  });
  CHECK(cycle.AwaitEnd() == RoleCycle::End::kRunAgain);
  lose.join();
  CHECK(cycle.state() == RoleCycle::State::kFenced);
  CHECK(cycle.why() == "the leader key is gone");
  CHECK(election.checks() >= 3);  // it was watched while etcd was unreachable, and kept leading
  CHECK(election.resigns() == 0);
  cycle.HandOver();
  CHECK(election.resigns() == 1);
}

TEST_CASE("an unhealthy group leader is fenced; a single server stays up until stopped") {
  FakeElection election;
  RoleCycle group(&election, absl::Milliseconds(5));
  election.Elect();
  REQUIRE(group.AwaitLeadership());
  group.Unhealthy(absl::DataLossError("a background error of the store"));
  CHECK(group.AwaitEnd() == RoleCycle::End::kRunAgain);
  CHECK(group.why() == "a background error of the store");

  std::unique_ptr<Election> sole = SoleServer();
  RoleCycle single(sole.get(), absl::Milliseconds(5));
  REQUIRE(single.AwaitLeadership());
  single.Unhealthy(absl::DataLossError("a background error of the store"));
  CHECK(single.state() == RoleCycle::State::kLeading);
  std::thread stop = After(absl::Milliseconds(50), [&] { single.Stop(); });
  CHECK(single.AwaitEnd() == RoleCycle::End::kStopped);
  stop.join();
  CHECK(single.state() == RoleCycle::State::kStopped);
  CHECK(single.why().empty());
}

TEST_CASE("a stop ends a standby's campaign, and a campaign won as it came is resigned") {
  {
    FakeElection election;
    RoleCycle cycle(&election, absl::Milliseconds(5));
    std::thread stop = After(absl::Milliseconds(30), [&] { cycle.Stop(); });
    CHECK_FALSE(cycle.AwaitLeadership());
    stop.join();
    CHECK(cycle.state() == RoleCycle::State::kStopped);
    CHECK(election.resigns() == 0);
  }
  {
    FakeElection election;
    RoleCycle cycle(&election, absl::Milliseconds(5));
    cycle.Stop();  // before the campaign: it still ends it, and the win is handed on
    election.Elect(/*win_on_stop=*/true);
    CHECK_FALSE(cycle.AwaitLeadership());
    CHECK(cycle.state() == RoleCycle::State::kStopped);
    CHECK(election.resigns() == 1);
  }
}

TEST_CASE("a stop ends a leader's life, also a fenced one's") {
  FakeElection election;
  RoleCycle cycle(&election, absl::Milliseconds(5));
  election.Elect();
  REQUIRE(cycle.AwaitLeadership());
  cycle.Unhealthy(absl::InternalError("the center's version is ahead of the store's"));
  cycle.Stop();
  CHECK(cycle.AwaitEnd() == RoleCycle::End::kStopped);
  CHECK(cycle.state() == RoleCycle::State::kStopped);
}

}  // namespace
}  // namespace rebound::server
