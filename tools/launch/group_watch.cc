#include "tools/launch/group_watch.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace rebound::launch {
namespace {

std::string Seconds(absl::Duration d) {
  return absl::StrFormat("%.2f s", absl::ToDoubleSeconds(d));
}

}  // namespace

int64_t SummedUpdates(const GetStatusResponse& status) {
  int64_t sum = 0;
  for (const SlotStatus& slot : status.slots()) sum += slot.update_count();
  return sum;
}

std::vector<std::string> GroupWatch::Update(const GetStatusResponse& status, absl::Time now) {
  std::vector<std::string> events;
  if (!status.has_group() || status.group().role() != GroupStatus::LEADER) return events;
  const GroupStatus& group = status.group();
  const int64_t updates = SummedUpdates(status);

  if (group.name() != leader_ || group.epoch() != epoch_) {
    std::string text = absl::StrCat("group: ", group.name(), " leads (epoch ", group.epoch(), ")");
    if (killed_at_.has_value() && !new_leader_at_.has_value() && group.epoch() > killed_epoch_) {
      new_leader_ = group.name();
      new_leader_at_ = now;
      new_leader_first_updates_ = updates;
      absl::StrAppend(&text, ", answering ", Seconds(now - *killed_at_), " after ", killed_,
                      " was killed");
    }
    events.push_back(std::move(text));
    leader_ = group.name();
    epoch_ = group.epoch();
    standby_states_.clear();  // another leader's view
  }

  in_sync_standbys_ = 0;
  for (const StandbyStatus& standby : group.standbys()) {
    if (standby.in_sync()) ++in_sync_standbys_;
    auto known = standby_states_.find(standby.name());
    if (known != standby_states_.end() && known->second == standby.state()) continue;
    standby_states_[standby.name()] = standby.state();
    events.push_back(absl::StrCat("group: standby ", standby.name(), " of ", group.name(), ": ",
                                  standby.state(), " (", standby.lag_commits(),
                                  " commits behind)"));
  }

  if (new_leader_at_.has_value() && !first_sync_at_.has_value() &&
      group.epoch() > killed_epoch_ && updates > new_leader_first_updates_) {
    first_sync_at_ = now;
    events.push_back(absl::StrCat("failover: ", group.name(), " acknowledged its first sync ",
                                  Seconds(now - *killed_at_), " after the leader ", killed_,
                                  " was killed (updates summed over the slots: ",
                                  new_leader_first_updates_, " -> ", updates, ")"));
  }

  if (restarted_at_.has_value() && !back_in_sync_at_.has_value()) {
    for (const StandbyStatus& standby : group.standbys()) {
      if (standby.name() != killed_ || !standby.in_sync()) continue;
      back_in_sync_at_ = now;
      events.push_back(absl::StrCat("group: ", killed_, " is back in sync, a standby of ",
                                    group.name(), ", ", Seconds(now - *restarted_at_),
                                    " after its restart"));
    }
  }
  return events;
}

void GroupWatch::LeaderKilled(const std::string& name, int64_t epoch, absl::Time at) {
  if (killed_at_.has_value()) return;
  killed_ = name;
  killed_epoch_ = epoch;
  killed_at_ = at;
}

void GroupWatch::Restarted(absl::Time at) {
  if (killed_at_.has_value()) restarted_at_ = at;
}

std::optional<absl::Duration> GroupWatch::failover() const {
  if (!first_sync_at_.has_value()) return std::nullopt;
  return *first_sync_at_ - *killed_at_;
}

std::optional<absl::Duration> GroupWatch::back_in_sync() const {
  if (!back_in_sync_at_.has_value()) return std::nullopt;
  return *back_in_sync_at_ - *restarted_at_;
}

bool GroupWatch::watching() const {
  return killed_at_.has_value() &&
         (!first_sync_at_.has_value() || !restarted_at_.has_value() ||
          !back_in_sync_at_.has_value());
}

std::string GroupWatch::Summary() const {
  if (!killed_at_.has_value()) return "";
  std::string text = absl::StrCat("failover summary: the leader ", killed_, " (epoch ",
                                   killed_epoch_, ") was SIGKILLed; ");
  if (first_sync_at_.has_value()) {
    absl::StrAppend(&text, new_leader_, " led after ", Seconds(*new_leader_at_ - *killed_at_),
                    " and acknowledged its first sync ", Seconds(*first_sync_at_ - *killed_at_),
                    " after the kill");
  } else if (new_leader_at_.has_value()) {
    absl::StrAppend(&text, new_leader_, " led after ", Seconds(*new_leader_at_ - *killed_at_),
                    " but acknowledged no sync before the end");
  } else {
    absl::StrAppend(&text, "no new leader answered before the end");
  }
  if (restarted_at_.has_value()) {
    absl::StrAppend(&text, "; ", killed_, ", started again ",
                    Seconds(*restarted_at_ - *killed_at_), " after the kill, ");
    if (back_in_sync_at_.has_value()) {
      absl::StrAppend(&text, "was back in sync ", Seconds(*back_in_sync_at_ - *restarted_at_),
                      " after its restart");
    } else {
      absl::StrAppend(&text, "was not back in sync by the end");
    }
  }
  return text;
}

}  // namespace rebound::launch
