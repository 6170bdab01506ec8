#pragma once

// What rebound_launch --standbys prints about its replicated server group (docs/design.md §10.1),
// derived from successive GetStatus replies of whichever member leads (the launcher's channel
// lists every member; only the leader serves it): who leads at which epoch, each standby's state
// in the leader's view (catching up, in sync, dropped), and, once the launcher killed the
// leader (--kill_leader_at_step), the failover and the killed member's return:
//   * failover: from the kill to the first sync acknowledged by the new leader, that is, to the
//     first reply of a later epoch whose update count (summed over the slots) is above the one
//     of that leader's first reply (its store holds every sync acknowledged before the kill, so
//     a rise is a sync it acknowledged itself);
//   * back in sync: from the killed member's restart to the first reply of a leader that lists
//     it as an in-sync standby.
// Timings are as precise as the replies are frequent: the launcher polls every 50 ms meanwhile.
//
// Pure: it never talks to a server, so it is unit-tested with hand-built replies. Not
// thread-safe.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "proto/rebound.pb.h"

namespace rebound::launch {

// The update counts of every slot in `status`, summed.
int64_t SummedUpdates(const GetStatusResponse& status);

class GroupWatch {
 public:
  GroupWatch() = default;

  // Compares a reply received at `now` with the previous ones and returns what to print, in this
  // order: a new leader or epoch, the standbys whose state changed, the failover, the killed
  // member back in sync (each at most once). A reply of no group's leader (group.role not
  // LEADER) changes nothing.
  std::vector<std::string> Update(const GetStatusResponse& status, absl::Time now);

  // The launcher SIGKILLed `name`, which led at `epoch`, at `at`. At most once.
  void LeaderKilled(const std::string& name, int64_t epoch, absl::Time at);
  // The killed member was started again at `at` (after LeaderKilled).
  void Restarted(absl::Time at);

  // The latest leader's name and epoch (empty and 0 before the first leader's reply).
  const std::string& leader() const { return leader_; }
  int64_t epoch() const { return epoch_; }
  // How many standbys the latest leader's reply lists as in sync.
  int in_sync_standbys() const { return in_sync_standbys_; }

  bool leader_killed() const { return killed_at_.has_value(); }
  // A leader of a later epoch than the killed one's has answered.
  bool new_leader_answered() const { return new_leader_at_.has_value(); }
  // From the kill to the new leader's first acknowledged sync, once seen.
  std::optional<absl::Duration> failover() const;
  // From the restart to the restarted member in sync, once seen.
  std::optional<absl::Duration> back_in_sync() const;
  // Killed, and not yet both failed over and back in sync (when restarted).
  bool watching() const;

  // One line on the kill and what followed, for the end of the run; empty when no leader was
  // killed.
  std::string Summary() const;

 private:
  std::string leader_;
  int64_t epoch_ = 0;
  int in_sync_standbys_ = 0;
  std::map<std::string, std::string> standby_states_;  // the latest leader's view, by name

  std::string killed_;
  int64_t killed_epoch_ = 0;
  std::optional<absl::Time> killed_at_;
  std::optional<absl::Time> restarted_at_;
  std::string new_leader_;
  std::optional<absl::Time> new_leader_at_;
  int64_t new_leader_first_updates_ = 0;
  std::optional<absl::Time> first_sync_at_;
  std::optional<absl::Time> back_in_sync_at_;
};

}  // namespace rebound::launch
