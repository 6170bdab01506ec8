#pragma once

// RoleCycle: one life of a server as explicit states (docs/design.md §10.1), instead of a state
// machine driven by made-up signal numbers inside main():
//
//   kStandby --elected--> kLeading --leadership lost / unhealthy--> kFenced   (ends: kRunAgain)
//      |                     |
//      +-------stop----------+-----------------------------------> kStopped  (ends: kStopped)
//
// A replicated group's member starts as a standby and campaigns (Election::RunUntilLeader, on a
// thread of the cycle's own); a single server is elected at once (SoleServer). While it leads,
// the cycle checks the leadership every `check_every`: a lease lost (any error but UNAVAILABLE,
// which is etcd out of reach while the lease may still hold) fences it; so does Unhealthy() in
// a group (a standby in sync takes over rather than waiting for an operator), while a single
// server stays up, not serving, for its supervisor. Stop() (a termination signal) ends any
// state. The life's end says what main does next: exit, or run again as a standby.
// A campaign won as the stop came is handed on at once (Resign); a life that led ends with
// HandOver once the server stopped answering, so that a standby takes over at once instead of
// after the lease.
//
// Thread-safety: thread-safe. AwaitLeadership and AwaitEnd are called by one thread (main's),
// in that order; Stop and Unhealthy from any thread, also before or after them.
// Ownership: `election` is borrowed and must outlive the cycle. Time is real (absl): the
// checks are a watch's pace, not a measured duration.
// Status codes: none; the election's are logged and decide the transitions.

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace rebound::server {

// Who leads: a replicated group's election through etcd (server/group/server_group.h), or the
// sole server's (always).
class Election {
 public:
  virtual ~Election() = default;
  // Blocks while this server does not lead: OK once it does, CANCELLED when `stop` is notified.
  virtual absl::Status RunUntilLeader(const absl::Notification* stop) = 0;
  // OK while this server leads; UNAVAILABLE when that cannot be told now; any other error once
  // its leadership is lost.
  virtual absl::Status CheckLeadership() const = 0;
  // Ends a RunUntilLeader blocked in work of its own (a standby following its leader): called
  // once its `stop` is notified. Thread-safe.
  virtual void CancelCampaign() {}
  // Gives the leadership up (or a campaign won too late).
  virtual absl::Status Resign() = 0;
  // Whether losing health hands the leadership over (a group) or not (a single server).
  virtual bool HandsOver() const = 0;
};

// The election of a server without a group: it leads from the start, for good.
std::unique_ptr<Election> SoleServer();

class RoleCycle {
 public:
  enum class State { kStandby, kLeading, kFenced, kStopped };
  enum class End { kStopped, kRunAgain };

  explicit RoleCycle(Election* election, absl::Duration check_every = absl::Milliseconds(50));
  ~RoleCycle();

  RoleCycle(const RoleCycle&) = delete;
  RoleCycle& operator=(const RoleCycle&) = delete;

  // Campaigns until this server leads (true: kLeading) or the cycle is stopped (false:
  // kStopped; a campaign won meanwhile is resigned).
  bool AwaitLeadership() ABSL_LOCKS_EXCLUDED(mu_);
  // REQUIRES: AwaitLeadership returned true. Watches the leadership until it ends: kRunAgain
  // after kFenced (lost, or unhealthy in a group), kStopped after Stop().
  End AwaitEnd() ABSL_LOCKS_EXCLUDED(mu_);
  // After AwaitEnd, once the server answers no more calls: gives a group's leadership up (a
  // single server has none to give). Failures are logged.
  void HandOver();

  // A termination signal: ends the cycle in any state.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  // The failure detector found the state or the store unhealthy (`why`).
  void Unhealthy(const absl::Status& why) ABSL_LOCKS_EXCLUDED(mu_);

  State state() const ABSL_LOCKS_EXCLUDED(mu_);
  // Why the cycle left kLeading (empty before).
  std::string why() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Fence(const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Election* const election_;
  const absl::Duration check_every_;
  absl::Notification stop_campaign_;  // notified once by AwaitLeadership

  mutable absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kStandby;
  bool stop_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool elected_ ABSL_GUARDED_BY(mu_) = false;
  bool campaign_ended_ ABSL_GUARDED_BY(mu_) = false;
  std::string why_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rebound::server
