#include "coord/leader_election.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace rebound {
namespace {

// How often a waiting candidate looks at its stop notification and re-reads the key (the watch
// normally wakes it at once).
constexpr absl::Duration kWaitSlice = absl::Milliseconds(100);

}  // namespace

absl::StatusOr<std::unique_ptr<LeaderElection>> LeaderElection::Create(
    EtcdClient* client, LeaderElectionOptions options) {
  if (client == nullptr) return absl::InvalidArgumentError("LeaderElection: no etcd client");
  if (options.key.empty()) return absl::InvalidArgumentError("LeaderElection: empty key");
  if (options.value.empty()) return absl::InvalidArgumentError("LeaderElection: empty value");
  if (options.lease_ttl < absl::Seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "LeaderElection: lease_ttl must be >= 1 s (etcd's unit), got ",
        absl::FormatDuration(options.lease_ttl)));
  }
  const Clock* clock = options.clock != nullptr ? options.clock : DefaultClock();
  return std::unique_ptr<LeaderElection>(new LeaderElection(client, std::move(options), clock));
}

LeaderElection::~LeaderElection() {
  std::unique_ptr<LeaseKeeper> keeper;
  {
    absl::MutexLock lock(&mu_);
    keeper = std::move(keeper_);
  }
  if (keeper != nullptr) keeper->Stop();
}

absl::Status LeaderElection::Campaign(const absl::Notification* stop) {
  while (true) {
    if (stop != nullptr && stop->HasBeenNotified()) {
      return absl::CancelledError("the campaign was stopped");
    }
    ASSIGN_OR_RETURN(const std::optional<LeaderInfo> holder, TryCampaign());
    if (!holder.has_value()) return absl::OkStatus();
    WaitForVacancy(holder->read_revision, stop);
  }
}

absl::StatusOr<std::optional<LeaderInfo>> LeaderElection::TryCampaign() {
  // Still leading (a late renewal included: the lease may still be held): nothing to do. A lost
  // leadership is cleaned up before a new attempt (its lease is gone already, most likely).
  const absl::StatusCode leading = CheckLeadership().code();
  if (leading == absl::StatusCode::kOk || leading == absl::StatusCode::kUnavailable) {
    return std::optional<LeaderInfo>();
  }
  (void)DropLease();
  ASSIGN_OR_RETURN(const EtcdLease lease, client_->GrantLease(options_.lease_ttl));
  absl::StatusOr<std::unique_ptr<LeaseKeeper>> keeper = client_->KeepAlive(lease);
  if (!keeper.ok()) {
    (void)client_->RevokeLease(lease.id);
    return keeper.status();
  }
  absl::StatusOr<PutIfAbsentResult> put =
      client_->PutIfAbsent(options_.key, options_.value, lease.id);
  if (put.ok() && put->succeeded) {
    absl::MutexLock lock(&mu_);
    keeper_ = *std::move(keeper);
    lease_id_ = lease.id;
    epoch_ = put->revision;
    leading_ = true;
    fenced_ = false;
    return std::optional<LeaderInfo>();
  }
  // Someone else leads (or etcd failed): hold no lease while waiting.
  (*keeper)->Stop();
  (void)client_->RevokeLease(lease.id);
  if (!put.ok()) return put.status();
  LeaderInfo holder;
  // The key may have gone between the Txn's compare and now: then the holder is unknown, and
  // waiting from the Txn's revision notices the deletion.
  holder.read_revision = put->revision;
  if (put->existing.has_value()) {
    holder.address = put->existing->value;
    holder.epoch = put->existing->create_revision;
  }
  return std::optional<LeaderInfo>(holder);
}

void LeaderElection::WaitForVacancy(int64_t revision, const absl::Notification* stop) {
  absl::Notification vacant;
  WatchSpec spec;
  spec.key = options_.key;
  spec.start_revision = revision + 1;
  absl::StatusOr<std::unique_ptr<Watcher>> watcher =
      client_->Watch(spec, [&vacant](const EtcdEvent& event) {
        if (event.type == EtcdEvent::Type::kDelete && !vacant.HasBeenNotified()) vacant.Notify();
      });
  // Bounded: at most one lease TTL, then the caller tries again (a missed deletion costs one
  // TTL, never a hang).
  const absl::Time until = clock_->Now() + options_.lease_ttl;
  while (!vacant.HasBeenNotified() && clock_->Now() < until) {
    if (stop != nullptr && stop->HasBeenNotified()) break;
    clock_->WaitFor(kWaitSlice, &vacant);
  }
  if (watcher.ok()) (*watcher)->Cancel();
}

absl::Status LeaderElection::CheckLeadership() const {
  absl::MutexLock lock(&mu_);
  if (!leading_) {
    return absl::FailedPreconditionError(
        epoch_ == 0 ? "not the leader: this server has not won an election"
                    : absl::StrCat("not the leader: the leadership of epoch ", epoch_,
                                   " was given up"));
  }
  if (fenced_) {
    return absl::FailedPreconditionError(
        absl::StrCat("not the leader: the leadership of epoch ", epoch_, " was lost"));
  }
  const absl::Status renewing = keeper_->status();
  const absl::Duration since = clock_->Now() - keeper_->last_renewed();
  const absl::Duration ttl = keeper_->ttl();
  if (!renewing.ok() || since >= ttl) {
    fenced_ = true;
    return absl::FailedPreconditionError(absl::StrCat(
        "not the leader any more: the lease of epoch ", epoch_, " ",
        !renewing.ok() ? absl::StrCat("is lost (", renewing.message(), ")")
                       : absl::StrCat("was last renewed ", absl::FormatDuration(since),
                                      " ago, past its TTL = ", absl::FormatDuration(ttl),
                                      ": etcd may have expired it")));
  }
  if (since >= ttl / 2) {
    return absl::UnavailableError(absl::StrCat(
        "the lease of epoch ", epoch_, " was last renewed ", absl::FormatDuration(since),
        " ago, past TTL/2 = ", absl::FormatDuration(ttl / 2),
        ": nothing is acknowledged until it is renewed (lost at TTL = ",
        absl::FormatDuration(ttl), ")"));
  }
  return absl::OkStatus();
}

int64_t LeaderElection::epoch() const {
  absl::MutexLock lock(&mu_);
  return epoch_;
}

absl::Duration LeaderElection::granted_ttl() const {
  absl::MutexLock lock(&mu_);
  return keeper_ != nullptr ? keeper_->ttl() : absl::ZeroDuration();
}

absl::Status LeaderElection::Resign() { return DropLease(); }

absl::Status LeaderElection::DropLease() {
  std::unique_ptr<LeaseKeeper> keeper;
  int64_t lease = 0;
  {
    absl::MutexLock lock(&mu_);
    keeper = std::move(keeper_);
    lease = lease_id_;
    leading_ = false;
    lease_id_ = 0;
  }
  if (keeper != nullptr) keeper->Stop();
  if (lease == 0) return absl::OkStatus();
  absl::Status revoked = client_->RevokeLease(lease);
  // An expired lease is gone already: so is the key.
  if (revoked.code() == absl::StatusCode::kFailedPrecondition) return absl::OkStatus();
  return revoked;
}

absl::StatusOr<std::optional<LeaderInfo>> LeaderElection::Leader() const {
  ASSIGN_OR_RETURN(const std::optional<EtcdValue> value, client_->Get(options_.key));
  if (!value.has_value()) return std::optional<LeaderInfo>();
  return std::optional<LeaderInfo>(LeaderInfo{value->value, value->create_revision});
}

}  // namespace rebound
