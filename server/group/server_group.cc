#include "server/group/server_group.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "glog/logging.h"

namespace rebound::server {
namespace {

// How long the loop waits before looking again after a failure or while it may not campaign.
constexpr absl::Duration kRetry = absl::Milliseconds(200);

bool ValidName(const std::string& name) {
  if (name.empty()) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '_' || c == '.' || c == '-';
  });
}

}  // namespace

ServerGroup::ServerGroup(ServerGroupOptions options, const Clock* clock)
    : options_(std::move(options)),
      clock_(clock),
      leader_key_(absl::StrCat("/rebound/", options_.job_id, "/", options_.group, "/leader")),
      in_sync_key_(absl::StrCat("/rebound/", options_.job_id, "/", options_.group, "/in_sync")) {}

absl::StatusOr<std::unique_ptr<ServerGroup>> ServerGroup::Create(ServerGroupOptions options) {
  if (!ValidName(options.self.name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a group member's name must be [A-Za-z0-9_.-]+, got \"", options.self.name,
                     "\""));
  }
  if (!ValidName(options.group) || options.job_id.empty()) {
    return absl::InvalidArgumentError("a server group needs a job id and a valid group name");
  }
  const Clock* clock = options.clock != nullptr ? options.clock : DefaultClock();
  std::unique_ptr<ServerGroup> group(new ServerGroup(std::move(options), clock));
  EtcdClientOptions etcd;
  etcd.endpoints = group->options_.etcd_endpoints;
  etcd.clock = clock;
  ASSIGN_OR_RETURN(group->etcd_, EtcdClient::Create(std::move(etcd)));
  LeaderElectionOptions election;
  election.key = group->leader_key_;
  election.value = group->options_.self.Encode();
  election.lease_ttl = group->options_.lease;
  election.clock = clock;
  ASSIGN_OR_RETURN(group->election_, LeaderElection::Create(group->etcd_.get(), election));
  return group;
}

void ServerGroup::SetState(GroupStatus::Role role, const MemberAddress& leader, int64_t epoch,
                           std::string detail, bool quiet) {
  absl::MutexLock lock(&mu_);
  if (!quiet && detail != detail_ && !detail.empty()) LOG(INFO) << "group: " << detail;
  role_ = role;
  role_leader_.store(role == GroupStatus::LEADER);
  leader_ = leader;
  leader_epoch_ = epoch;
  detail_ = std::move(detail);
}

absl::StatusOr<bool> ServerGroup::MayCampaign(uint64_t local_sequence, std::string* recorded) {
  ASSIGN_OR_RETURN(const std::optional<EtcdValue> in_sync, etcd_->Get(in_sync_key_));
  if (!in_sync.has_value()) {
    recorded->clear();
    return true;  // a new group: nobody was answered yet
  }
  *recorded = in_sync->value;
  const std::vector<std::string> parts = absl::StrSplit(in_sync->value, ' ', absl::SkipEmpty());
  if (parts.empty()) return false;
  uint64_t floor = 0;
  for (size_t i = 1; i < parts.size(); ++i) {
    if (absl::StartsWith(parts[i], "floor=") &&
        !absl::SimpleAtoi(absl::string_view(parts[i]).substr(6), &floor)) {
      return false;  // unreadable: do not lead on a guess
    }
  }
  const std::vector<std::string> names = absl::StrSplit(parts[0], ',', absl::SkipEmpty());
  if (std::find(names.begin(), names.end(), options_.self.name) == names.end()) return false;
  return local_sequence >= floor;
}

absl::Status ServerGroup::RunUntilLeader(Standby* standby, const absl::Notification* stop) {
  // The epoch of a leader that could not be followed: tried again every kRetry until its key
  // goes (e.g. its lease has not expired yet after it died), logged once.
  int64_t failed_epoch = 0;
  while (!stop->HasBeenNotified()) {
    absl::StatusOr<std::optional<LeaderInfo>> leader = election_->Leader();
    if (!leader.ok()) {
      SetState(GroupStatus::CANDIDATE, {}, 0,
               absl::StrCat("etcd unreachable: ", leader.status().message()));
      clock_->WaitFor(kRetry, stop);
      continue;
    }
    if (leader->has_value()) {
      const LeaderInfo info = **leader;
      absl::StatusOr<MemberAddress> address = MemberAddress::Decode(info.address);
      if (!address.ok()) {
        SetState(GroupStatus::CANDIDATE, {}, info.epoch,
                 absl::StrCat("the leader key holds no address: ", address.status().message()));
        clock_->WaitFor(kRetry, stop);
        continue;
      }
      if (address->name == options_.self.name) {
        SetState(GroupStatus::CANDIDATE, *address, info.epoch,
                 "the leader key names this server from an earlier life: waiting for its lease "
                 "to expire");
        clock_->WaitFor(kRetry, stop);
        continue;
      }
      SetState(GroupStatus::STANDBY, *address, info.epoch,
               absl::StrCat("following '", address->name, "' (epoch ", info.epoch, ")"),
               /*quiet=*/failed_epoch == info.epoch);
      // The stream ends as soon as the key is deleted or re-created (another epoch).
      standby->Reset();
      WatchSpec spec;
      spec.key = leader_key_;
      spec.start_revision = info.epoch + 1;
      absl::StatusOr<std::unique_ptr<Watcher>> watcher =
          etcd_->Watch(spec, [standby](const EtcdEvent&) { standby->Cancel(); });
      if (!watcher.ok()) {
        clock_->WaitFor(kRetry, stop);
        continue;
      }
      absl::Notification followed;
      // `stop` also ends the stream: a watcher of it would need a thread; poll it instead.
      std::thread stopper([&] {
        while (!followed.HasBeenNotified()) {
          if (stop->HasBeenNotified()) {
            standby->Cancel();
            break;
          }
          followed.WaitForNotificationWithTimeout(absl::Milliseconds(100));
        }
      });
      const absl::Status followed_status = standby->Follow(*address, info.epoch);
      followed.Notify();
      stopper.join();
      (*watcher)->Cancel();
      if (!followed_status.ok() && followed_status.code() != absl::StatusCode::kCancelled) {
        SetState(GroupStatus::STANDBY, *address, info.epoch,
                 absl::StrCat("following '", address->name, "' failed: ",
                              followed_status.message()),
                 /*quiet=*/failed_epoch == info.epoch);
        failed_epoch = info.epoch;
        clock_->WaitFor(kRetry, stop);
      }
      continue;
    }
    // No leader: campaign if the recorded in-sync set allows it.
    std::string recorded;
    const uint64_t local = standby->store() != nullptr ? standby->store()->LastApplied().sequence : 0;
    absl::StatusOr<bool> may = MayCampaign(local, &recorded);
    if (!may.ok()) {
      SetState(GroupStatus::CANDIDATE, {}, 0,
               absl::StrCat("etcd unreachable: ", may.status().message()));
      clock_->WaitFor(kRetry, stop);
      continue;
    }
    if (!*may) {
      SetState(GroupStatus::CANDIDATE, {}, 0,
               absl::StrCat("no leader, and the in-sync record \"", recorded,
                            "\" does not name this server or its floor is past this server's "
                            "last commit ", local, ": waiting for a member that has it"));
      clock_->WaitFor(kRetry, stop);
      continue;
    }
    SetState(GroupStatus::CANDIDATE, {}, 0, "no leader: campaigning");
    absl::StatusOr<std::optional<LeaderInfo>> holder = election_->TryCampaign();
    if (!holder.ok()) {
      SetState(GroupStatus::CANDIDATE, {}, 0,
               absl::StrCat("campaign failed: ", holder.status().message()));
      clock_->WaitFor(kRetry, stop);
      continue;
    }
    if (!holder->has_value()) {
      SetState(GroupStatus::LEADER, options_.self, election_->epoch(),
               absl::StrCat("leading (epoch ", election_->epoch(), ")"));
      return absl::OkStatus();
    }
  }
  return absl::CancelledError("stopped");
}

absl::Status ServerGroup::RecordInSync(const std::vector<std::string>& names, uint64_t floor) {
  const int64_t epoch = election_->epoch();
  if (epoch <= 0) return absl::FailedPreconditionError("RecordInSync: this server never led");
  ASSIGN_OR_RETURN(const CompareAndPutResult put,
                   etcd_->PutIfCreatedAt(leader_key_, epoch, in_sync_key_,
                                         absl::StrCat(absl::StrJoin(names, ","), " floor=", floor)));
  if (!put.succeeded) {
    return absl::FailedPreconditionError(absl::StrCat(
        "RecordInSync: the leader key of epoch ", epoch, " is gone: this server does not lead"));
  }
  return absl::OkStatus();
}

void ServerGroup::FillStatus(GroupStatus* status) const {
  // A leader whose lease is lost is about to run again as a standby: it must not claim to lead.
  // One whose renewal is only late (UNAVAILABLE) still leads, and says why it holds answers.
  const absl::Status leading = role_leader_.load() ? election_->CheckLeadership() : absl::OkStatus();
  const bool lost = !leading.ok() && leading.code() != absl::StatusCode::kUnavailable;
  absl::MutexLock lock(&mu_);
  status->set_group(options_.group);
  status->set_name(options_.self.name);
  status->set_role(!lost ? role_ : GroupStatus::CANDIDATE);
  if (lost) {
    status->set_detail(std::string(leading.message()));
    status->set_epoch(leader_epoch_);
    return;
  }
  status->set_epoch(leader_epoch_);
  status->set_leader_name(leader_.name);
  status->set_leader_address(leader_.serve_address);
  status->set_leader_peer_address(leader_.peer_address);
  status->set_standbys_configured(options_.standbys);
  status->set_detail(leading.ok() ? detail_ : std::string(leading.message()));
}

MemberAddress ServerGroup::leader() const {
  absl::MutexLock lock(&mu_);
  return leader_;
}

}  // namespace rebound::server
