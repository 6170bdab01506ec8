#pragma once

// ServerGroup: a server's membership in its replicated group, through etcd (docs/design.md §10.1,
// docs/coordination.md "The group's keys and roles").
//
// Keys, under /rebound/<job_id>/<group>/:
//   leader    the leader key (coord/leader_election.h): "name=.. serve=.. peer=.." of the
//             leader, bound to its lease; its create revision is the leader's epoch.
//   in_sync   the in-sync set, "<name>,<name>,... floor=<sequence>" (the leader's name first;
//             every member of the set has made durable every commit up to the floor); written
//             only by the leader, each write guarded by its leader key (PutIfCreatedAt): once
//             the leader key is gone, the set is final for that epoch.
//
// Roles. RunUntilLeader keeps this server a standby: while a leader holds the key it follows
// it (Standby::Follow), stopping as soon as the key goes (a watch); while the key is vacant it
// campaigns, but only when the recorded in-sync set names it and its store holds the set's
// floor (or no set was ever recorded: a new group), reading the set right before each attempt.
// A member named in the set whose disk was lost (an empty store, behind the floor) waits for
// another to lead and copies it. So a standby that lacks a commit some
// worker was answered for never leads. A key that names this server but that another process
// holds (this server's earlier life, whose lease has not expired) is waited out.
//
// Status codes: Create: INVALID_ARGUMENT for bad options, the etcd client's errors.
// RunUntilLeader: OK (this server leads: epoch()), CANCELLED (stop). RecordInSync: OK,
// FAILED_PRECONDITION when this server's leader key is gone (it does not lead any more), the
// client's UNAVAILABLE.
//
// Thread-safety: RunUntilLeader from one thread; everything else from any.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "coord/etcd_client.h"
#include "coord/leader_election.h"
#include "proto/rebound.pb.h"
#include "server/group/role_cycle.h"
#include "server/group/standby.h"

namespace rebound::server {

struct ServerGroupOptions {
  std::string job_id;
  std::string group;
  MemberAddress self;
  std::vector<std::string> etcd_endpoints;
  absl::Duration lease = absl::Seconds(2);
  int standbys = 1;  // replication.standbys, for the status
  const Clock* clock = nullptr;  // borrowed; nullptr: DefaultClock()
};

class ServerGroup {
 public:
  static absl::StatusOr<std::unique_ptr<ServerGroup>> Create(ServerGroupOptions options);
  ServerGroup(const ServerGroup&) = delete;
  ServerGroup& operator=(const ServerGroup&) = delete;

  // See the header comment. `standby` is followed while another server leads.
  absl::Status RunUntilLeader(Standby* standby, const absl::Notification* stop);

  // The leader's side.
  absl::Status CheckLeadership() const { return election_->CheckLeadership(); }
  int64_t epoch() const { return election_->epoch(); }
  absl::Status RecordInSync(const std::vector<std::string>& names, uint64_t floor);
  absl::Status Resign() { return election_->Resign(); }

  // The role, the leader as last seen and why this server waits, into `status`.
  void FillStatus(GroupStatus* status) const;
  // The leader this server follows (empty name when none).
  MemberAddress leader() const;

  const std::string& leader_key() const { return leader_key_; }
  const std::string& in_sync_key() const { return in_sync_key_; }

 private:
  ServerGroup(ServerGroupOptions options, const Clock* clock);
  // Whether the recorded in-sync set lets this server campaign, and the set read.
  absl::StatusOr<bool> MayCampaign(uint64_t local_sequence, std::string* recorded);
  // Logs the detail when it changed, unless `quiet`.
  void SetState(GroupStatus::Role role, const MemberAddress& leader, int64_t epoch,
                std::string detail, bool quiet = false);

  const ServerGroupOptions options_;
  const Clock* const clock_;
  const std::string leader_key_;
  const std::string in_sync_key_;
  std::unique_ptr<EtcdClient> etcd_;
  std::unique_ptr<LeaderElection> election_;

  mutable absl::Mutex mu_;
  GroupStatus::Role role_ ABSL_GUARDED_BY(mu_) = GroupStatus::CANDIDATE;
  std::atomic<bool> role_leader_{false};  // role_ == LEADER, read without mu_
  MemberAddress leader_ ABSL_GUARDED_BY(mu_);
  int64_t leader_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::string detail_ ABSL_GUARDED_BY(mu_);
};

// A group's election as a server's RoleCycle sees it (server/group/role_cycle.h): campaigns
// through `group`, following the leader into `standby` meanwhile. REQUIRES: both outlive it.
class GroupElection final : public Election {
 public:
  GroupElection(ServerGroup* group, Standby* standby) : group_(group), standby_(standby) {}
  absl::Status RunUntilLeader(const absl::Notification* stop) override {
    return group_->RunUntilLeader(standby_, stop);
  }
  void CancelCampaign() override { standby_->Cancel(); }
  absl::Status CheckLeadership() const override { return group_->CheckLeadership(); }
  absl::Status Resign() override { return group_->Resign(); }
  bool HandsOver() const override { return true; }

 private:
  ServerGroup* const group_;
  Standby* const standby_;
};

}  // namespace rebound::server
