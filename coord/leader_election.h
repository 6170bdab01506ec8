#pragma once

// LeaderElection: one server of a replicated group campaigns for the group's leadership in etcd
// and keeps it, with self-fencing (docs/design.md §10.1).
//
// The election. The leader key (e.g. /rebound/<job>/<group>/leader) is created in a Txn if
// absent (EtcdClient::PutIfAbsent), bound to a lease of TTL `lease_ttl` that a LeaseKeeper
// renews every TTL/6; its value is the candidate's address. The winner's epoch is the revision at
// which it created the key: epochs of successive leaders strictly increase, so a standby can
// refuse anything of an older epoch. A candidate that finds the key held watches it and tries
// again once it is deleted (the holder resigned or its lease expired).
//
// Self-fencing. A leader acknowledges only while its lease was renewed less than TTL/2 ago
// (etcd may expire it at last renewal + TTL at the earliest): from TTL/2 on, CheckLeadership()
// says UNAVAILABLE and the caller must hold every acknowledgement. A renewal that succeeds before
// TTL proves the lease (and with it the leader key) never went, so no other candidate can have
// won in between: CheckLeadership is OK again, in the same epoch. This is what one lost etcd
// member costs when it led etcd's raft (an etcd election of about one election timeout, during
// which no lease can be renewed): a pause, not a failover. Once the last renewal is TTL old, or
// etcd says the lease is gone, the leadership is lost: CheckLeadership says FAILED_PRECONDITION
// and never succeeds again for this epoch (a renewal that arrives later does not restore it);
// the caller campaigns anew.
//
// Thread-safety: thread-safe; Campaign blocks its caller, CheckLeadership may be called from any
// thread at any rate (it reads the keeper's state). Ownership: borrows the client and the clock,
// which must outlive it. Status codes: Campaign: OK (won; epoch()), CANCELLED (stopped),
// UNAVAILABLE (etcd unreachable within the client's retry policy: retry later); CheckLeadership:
// OK, UNAVAILABLE (the renewal is late: hold acknowledgements, it may come back) or
// FAILED_PRECONDITION naming why (never won, resigned, lease lost or not renewed within TTL);
// Resign: the client's errors.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "coord/etcd_client.h"

namespace rebound {

struct LeaderElectionOptions {
  std::string key;     // the group's leader key; not empty
  std::string value;   // this candidate's address, stored as the key's value; not empty
  absl::Duration lease_ttl = absl::Seconds(2);  // leader_lease_ms; >= 1 s (etcd's unit)
  const Clock* clock = nullptr;                 // borrowed; nullptr: DefaultClock()
};

// Who leads, as read from etcd.
struct LeaderInfo {
  std::string address;  // the leader key's value
  int64_t epoch = 0;    // its create revision
  int64_t read_revision = 0;  // the store revision it was read at (TryCampaign), to watch from
};

class LeaderElection {
 public:
  // INVALID_ARGUMENT for an empty key or value or a TTL below 1 s. `client` is borrowed.
  static absl::StatusOr<std::unique_ptr<LeaderElection>> Create(EtcdClient* client,
                                                                LeaderElectionOptions options);
  ~LeaderElection();  // stops renewing; the lease expires after its TTL (Resign revokes it now)
  LeaderElection(const LeaderElection&) = delete;
  LeaderElection& operator=(const LeaderElection&) = delete;

  // Blocks until this candidate leads (OK) or `stop` is notified (CANCELLED). A campaign after
  // a lost leadership starts a new lease and wins a new, higher epoch.
  absl::Status Campaign(const absl::Notification* stop);

  // One attempt, without waiting: OK with nullopt when this candidate now leads (epoch()), or
  // with the current holder when another does (the key held at the attempt; its value and
  // epoch). Errors as Campaign's, without CANCELLED. A caller that must check a condition of
  // its own right before each attempt (a standby in the in-sync set, docs/design.md §10.1) loops on
  // this instead of calling Campaign.
  absl::StatusOr<std::optional<LeaderInfo>> TryCampaign();

  // OK iff this candidate won and its lease was renewed within the last TTL/2; UNAVAILABLE
  // while the renewal is late but the lease may still be held; FAILED_PRECONDITION once lost
  // (see above).
  absl::Status CheckLeadership() const;
  // The epoch of the current (or last) leadership; 0 before the first win.
  int64_t epoch() const;
  // The lease TTL etcd granted the current leadership (it may raise lease_ttl to its minimum);
  // zero when not leading.
  absl::Duration granted_ttl() const;

  // Gives up the leadership now: stops renewing and revokes the lease (the key goes with it).
  absl::Status Resign();

  // The current leader as etcd has it (nullopt: none).
  absl::StatusOr<std::optional<LeaderInfo>> Leader() const;

 private:
  LeaderElection(EtcdClient* client, LeaderElectionOptions options, const Clock* clock)
      : client_(client), options_(std::move(options)), clock_(clock) {}
  // Stops renewing and revokes the lease, if any (an expired one counts as revoked); the
  // leadership is given up.
  absl::Status DropLease();
  // Waits until the key is absent (deleted after `revision`), `stop` or a bounded time passes.
  void WaitForVacancy(int64_t revision, const absl::Notification* stop);

  EtcdClient* const client_;
  const LeaderElectionOptions options_;
  const Clock* const clock_;
  mutable absl::Mutex mu_;
  std::unique_ptr<LeaseKeeper> keeper_ ABSL_GUARDED_BY(mu_);
  int64_t lease_id_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  bool leading_ ABSL_GUARDED_BY(mu_) = false;
  // Set once CheckLeadership found the leadership lost: it stays lost for this epoch.
  mutable bool fenced_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace rebound
