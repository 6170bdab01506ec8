// What the launcher prints about a replicated server group and its failover, from hand-built
// GetStatus replies (tools/launch/group_watch.h).

#include "tools/launch/group_watch.h"

#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/time.h"

namespace rebound::launch {
namespace {

const absl::Time kStart = absl::FromUnixSeconds(1000000);

absl::Time At(double seconds) { return kStart + absl::Seconds(seconds); }

struct Standby {
  std::string name;
  bool in_sync = false;
  std::string state;
  uint64_t lag = 0;
};

// A leader's reply: `updates` split over two slots.
GetStatusResponse LeaderReply(const std::string& leader, int64_t epoch, int64_t updates,
                              const std::vector<Standby>& standbys) {
  GetStatusResponse status;
  GroupStatus* group = status.mutable_group();
  group->set_name(leader);
  group->set_role(GroupStatus::LEADER);
  group->set_epoch(epoch);
  for (const Standby& s : standbys) {
    StandbyStatus* out = group->add_standbys();
    out->set_name(s.name);
    out->set_in_sync(s.in_sync);
    out->set_state(s.state);
    out->set_lag_commits(s.lag);
  }
  status.add_slots()->set_update_count(updates / 2);
  status.add_slots()->set_update_count(updates - updates / 2);
  return status;
}

std::string Joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& line : lines) out += line + "\n";
  return out;
}

TEST_CASE("the summed update count adds every slot's") {
  CHECK(SummedUpdates(LeaderReply("a", 1, 7, {})) == 7);
  CHECK(SummedUpdates(GetStatusResponse()) == 0);
}

TEST_CASE("the leader and each standby's state are printed when they change, not before") {
  GroupWatch watch;
  CHECK(watch.leader().empty());
  std::vector<std::string> events =
      watch.Update(LeaderReply("server-0", 7, 0, {{"server-1", false, "catching up", 40}}), At(0));
  REQUIRE(events.size() == 2);
  CHECK(events[0] == "group: server-0 leads (epoch 7)");
  CHECK(events[1] == "group: standby server-1 of server-0: catching up (40 commits behind)");
  CHECK(watch.leader() == "server-0");
  CHECK(watch.epoch() == 7);
  CHECK(watch.in_sync_standbys() == 0);

  // Nothing new: nothing printed (the lag alone is no event).
  CHECK(watch.Update(LeaderReply("server-0", 7, 5, {{"server-1", false, "catching up", 3}}),
                     At(1))
            .empty());
  events = watch.Update(LeaderReply("server-0", 7, 9, {{"server-1", true, "in sync", 0}}), At(2));
  REQUIRE(events.size() == 1);
  CHECK(events[0] == "group: standby server-1 of server-0: in sync (0 commits behind)");
  CHECK(watch.in_sync_standbys() == 1);
  CHECK_FALSE(watch.leader_killed());
  CHECK_FALSE(watch.watching());
  CHECK(watch.Summary().empty());
}

TEST_CASE("a reply from no leader (a single server, a standby) changes nothing") {
  GroupWatch watch;
  GetStatusResponse single;
  single.add_slots()->set_update_count(3);
  CHECK(watch.Update(single, At(0)).empty());
  GetStatusResponse standby = LeaderReply("server-1", 7, 3, {});
  standby.mutable_group()->set_role(GroupStatus::STANDBY);
  CHECK(watch.Update(standby, At(0)).empty());
  CHECK(watch.leader().empty());
}

TEST_CASE("the failover is timed from the kill to the new leader's first acknowledged sync") {
  GroupWatch watch;
  watch.Update(LeaderReply("server-0", 7, 100, {{"server-1", true, "in sync", 0}}), At(0));
  watch.LeaderKilled("server-0", 7, At(10));
  CHECK(watch.leader_killed());
  CHECK(watch.watching());
  CHECK_FALSE(watch.new_leader_answered());

  // The new leader's first answer holds every sync acknowledged before the kill (and perhaps
  // more than the launcher saw): not yet a sync of its own.
  std::vector<std::string> events = watch.Update(LeaderReply("server-1", 12, 104, {}), At(12.5));
  REQUIRE(events.size() == 1);
  CHECK(events[0] == "group: server-1 leads (epoch 12), answering 2.50 s after server-0 was killed");
  CHECK(watch.new_leader_answered());
  CHECK_FALSE(watch.failover().has_value());
  CHECK(watch.Update(LeaderReply("server-1", 12, 104, {}), At(12.6)).empty());

  events = watch.Update(LeaderReply("server-1", 12, 105, {}), At(12.75));
  REQUIRE(events.size() == 1);
  CHECK(events[0] ==
        "failover: server-1 acknowledged its first sync 2.75 s after the leader server-0 was "
        "killed (updates summed over the slots: 104 -> 105)");
  REQUIRE(watch.failover().has_value());
  CHECK(*watch.failover() == absl::Milliseconds(2750));
  // Once.
  CHECK(watch.Update(LeaderReply("server-1", 12, 110, {}), At(13)).empty());
  // Not restarted yet: still watched, for the return.
  CHECK(watch.watching());
  CHECK(watch.Summary() ==
        "failover summary: the leader server-0 (epoch 7) was SIGKILLed; server-1 led after "
        "2.50 s and acknowledged its first sync 2.75 s after the kill");
}

TEST_CASE("the restarted member is back once the new leader lists it as in sync") {
  GroupWatch watch;
  watch.Update(LeaderReply("server-0", 7, 100, {{"server-1", true, "in sync", 0}}), At(0));
  watch.LeaderKilled("server-0", 7, At(10));
  watch.Update(LeaderReply("server-1", 12, 100, {}), At(12));
  watch.Update(LeaderReply("server-1", 12, 101, {}), At(12.2));
  watch.Restarted(At(17));
  std::vector<std::string> events = watch.Update(
      LeaderReply("server-1", 12, 130, {{"server-0", false, "catching up", 30}}), At(18));
  REQUIRE(events.size() == 1);
  CHECK(events[0] == "group: standby server-0 of server-1: catching up (30 commits behind)");
  CHECK_FALSE(watch.back_in_sync().has_value());
  CHECK(watch.watching());

  events = watch.Update(LeaderReply("server-1", 12, 140, {{"server-0", true, "in sync", 0}}),
                        At(19.5));
  const std::string text = Joined(events);
  CHECK(absl::StrContains(text, "group: standby server-0 of server-1: in sync (0 commits behind)"));
  CHECK(absl::StrContains(text,
                          "group: server-0 is back in sync, a standby of server-1, 2.50 s after "
                          "its restart"));
  REQUIRE(watch.back_in_sync().has_value());
  CHECK(*watch.back_in_sync() == absl::Milliseconds(2500));
  CHECK_FALSE(watch.watching());
  CHECK(watch.Summary() ==
        "failover summary: the leader server-0 (epoch 7) was SIGKILLed; server-1 led after "
        "2.00 s and acknowledged its first sync 2.20 s after the kill; server-0, started again "
        "7.00 s after the kill, was back in sync 2.50 s after its restart");
}

TEST_CASE("a reply of the killed leader's epoch never counts as the failover") {
  GroupWatch watch;
  watch.Update(LeaderReply("server-0", 7, 100, {}), At(0));
  watch.LeaderKilled("server-0", 7, At(1));
  // A reply already in flight when the leader was killed.
  CHECK(watch.Update(LeaderReply("server-0", 7, 101, {}), At(1.1)).empty());
  CHECK_FALSE(watch.new_leader_answered());
  CHECK_FALSE(watch.failover().has_value());
  CHECK(watch.Summary() ==
        "failover summary: the leader server-0 (epoch 7) was SIGKILLed; no new leader answered "
        "before the end");

  // The same member back as leader (it won again, after its restart): a later epoch counts.
  watch.Restarted(At(31));
  watch.Update(LeaderReply("server-0", 15, 101, {}), At(33));
  watch.Update(LeaderReply("server-0", 15, 102, {}), At(34));
  REQUIRE(watch.failover().has_value());
  CHECK(*watch.failover() == absl::Seconds(33));
  CHECK(absl::StrContains(watch.Summary(), "was not back in sync by the end"));
}

TEST_CASE("a new leader that acknowledges nothing is reported as such") {
  GroupWatch watch;
  watch.Update(LeaderReply("server-0", 7, 100, {}), At(0));
  watch.LeaderKilled("server-0", 7, At(1));
  watch.LeaderKilled("server-1", 9, At(2));  // at most once: ignored
  watch.Update(LeaderReply("server-1", 12, 100, {}), At(3));
  CHECK(watch.Summary() ==
        "failover summary: the leader server-0 (epoch 7) was SIGKILLed; server-1 led after "
        "2.00 s but acknowledged no sync before the end");
}

}  // namespace
}  // namespace rebound::launch
