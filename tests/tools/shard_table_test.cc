// What reboundctl and rebound_launch print about a sharded center (tools/shard_table.h), from
// hand-built GetStatus replies: the ranges, the per-group rows, DEGRADED, the JSON.

#include "tools/shard_table.h"

#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"

namespace rebound::tools {
namespace {

// Two stages of 10 and 7 parameters over K = 3 groups (k n / K, as compute/shard_ranges.h).
ShardingStatus Sharding(int group) {
  ShardingStatus sharding;
  sharding.set_groups(3);
  sharding.set_group(group);
  for (const char* address : {"10.0.0.1:7070", "10.0.0.2:7070,10.0.0.3:7070", "10.0.0.4:7070"}) {
    sharding.add_group_addresses(address);
  }
  ShardingStatus::StageRanges* stage = sharding.add_stages();
  stage->set_stage(0);
  stage->set_parameters(10);
  for (int64_t begin : {0, 3, 6}) stage->add_range_begin(begin);
  stage = sharding.add_stages();
  stage->set_stage(1);
  stage->set_parameters(7);
  for (int64_t begin : {0, 2, 4}) stage->add_range_begin(begin);
  return sharding;
}

// A group's reply: its sharding and one center version per stage.
GetStatusResponse Reply(int group, int64_t version) {
  GetStatusResponse status;
  *status.mutable_sharding() = Sharding(group);
  for (int s = 0; s < 2; ++s) {
    CenterStatus* center = status.add_centers();
    center->set_stage(s);
    center->set_version(version + s);
  }
  return status;
}

std::vector<ShardGroupView> Views() {
  std::vector<ShardGroupView> views;
  const ShardingStatus sharding = Sharding(0);
  for (int g = 0; g < 3; ++g) {
    ShardGroupView view;
    view.group = g;
    view.address = sharding.group_addresses(g);
    view.status = Reply(g, 40 + 10 * g);
    views.push_back(std::move(view));
  }
  return views;
}

std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

TEST_CASE("a range ends where the next group's begins, the last at the stage's size") {
  const ShardingStatus sharding = Sharding(0);
  CHECK(RangeOf(sharding.stages(0), 0).begin == 0);
  CHECK(RangeOf(sharding.stages(0), 0).end == 3);
  CHECK(RangeOf(sharding.stages(0), 1).end == 6);
  CHECK(RangeOf(sharding.stages(0), 2).begin == 6);
  CHECK(RangeOf(sharding.stages(0), 2).end == 10);
  CHECK(RangeOf(sharding.stages(1), 2).end == 7);
}

TEST_CASE("the ranges print one line per stage, the asked-for group's marked") {
  CHECK(FormatRanges(Sharding(1), 1) ==
        "stage 0: 10 parameters: g0 [0, 3)  g1 [3, 6)*  g2 [6, 10)\n"
        "stage 1: 7 parameters: g0 [0, 2)  g1 [2, 4)*  g2 [4, 7)\n");
  CHECK(FormatRanges(Sharding(1), std::nullopt) ==
        "stage 0: 10 parameters: g0 [0, 3)  g1 [3, 6)  g2 [6, 10)\n"
        "stage 1: 7 parameters: g0 [0, 2)  g1 [2, 4)  g2 [4, 7)\n");
}

TEST_CASE("a group's role is a single server, or its leader with the in-sync standbys") {
  GetStatusResponse status = Reply(1, 5);
  CHECK(DescribeRole(status) == "single server");
  GroupStatus* group = status.mutable_group();
  group->set_name("g1-b");
  group->set_role(GroupStatus::LEADER);
  group->set_epoch(17);
  group->set_standbys_configured(2);
  group->add_standbys()->set_in_sync(true);
  group->add_standbys()->set_in_sync(false);
  CHECK(DescribeRole(status) == "g1-b LEADER (epoch 17, 1/2 standbys in sync)");
  group->set_role(GroupStatus::STANDBY);
  CHECK(DescribeRole(status) == "g1-b STANDBY");
}

TEST_CASE("a group's centers are its version of each stage") {
  CHECK(DescribeCenters(Reply(2, 60)) == "s0:v60 s1:v61");
  CHECK(DescribeCenters(GetStatusResponse()) == "-");
}

TEST_CASE("every group answering: one row each, columns aligned, no DEGRADED line") {
  const std::vector<ShardGroupView> views = Views();
  CHECK_FALSE(Degraded(views));
  CHECK(FormatShardTable(views) ==
        "GROUP  ADDRESS                      REACHABLE  ROLE           CENTERS        DETAIL\n"
        "0      10.0.0.1:7070                yes        single server  s0:v40 s1:v41\n"
        "1      10.0.0.2:7070,10.0.0.3:7070  yes        single server  s0:v50 s1:v51\n"
        "2      10.0.0.4:7070                yes        single server  s0:v60 s1:v61\n"
        "all 3 groups answer\n");
}

TEST_CASE("a group that does not answer is DEGRADED, with its address and why") {
  std::vector<ShardGroupView> views = Views();
  views[1].status.reset();
  views[1].error = "Deadline Exceeded";
  CHECK(Degraded(views));
  const std::vector<std::string> lines = Lines(FormatShardTable(views));
  REQUIRE(lines.size() == 5);
  CHECK(absl::StartsWith(lines[2], "1      10.0.0.2:7070,10.0.0.3:7070  NO "));
  CHECK(absl::StrContains(lines[2], "Deadline Exceeded"));
  CHECK(lines[4] ==
        "DEGRADED: group 1 (10.0.0.2:7070,10.0.0.3:7070) does not answer: Deadline Exceeded; "
        "every trainer's sync waits for its range");
}

TEST_CASE("a group that answers as another group, or knows another K, is DEGRADED too") {
  std::vector<ShardGroupView> views = Views();
  views[2].status = Reply(1, 9);  // group 1's reply at group 2's address
  views[2].status->mutable_sharding()->set_groups(2);
  CHECK(DescribeMismatch(views[2], 3) == "answers as group 1; knows 2 groups, not 3");
  CHECK(DescribeMismatch(views[0], 3).empty());
  CHECK(Degraded(views));
  const std::string table = FormatShardTable(views);
  CHECK(absl::StrContains(table, "DEGRADED: group 2 (10.0.0.4:7070) answers as group 1; knows "
                                 "2 groups, not 3\n"));
  CHECK_FALSE(absl::StrContains(table, "all 3 groups answer"));

  views = Views();
  views[0].status->set_storage_error("/data: IO error");
  CHECK(DescribeMismatch(views[0], 3) == "storage error: /data: IO error");
  views[0].status->clear_storage_error();
  views[0].status->clear_sharding();
  CHECK(DescribeMismatch(views[0], 3) == "reports no sharding (not a server of a sharded job)");
}

TEST_CASE("the JSON names each group, whether it answered, and its reply or error") {
  std::vector<ShardGroupView> views = Views();
  views[2].status.reset();
  views[2].error = "connect: \"refused\"\n";
  const std::string json = ShardTableJson(views);
  CHECK(absl::StartsWith(json, "{\"groups\":3,\"degraded\":true,\"shards\":[{\"group\":0,"
                               "\"address\":\"10.0.0.1:7070\",\"reachable\":true,\"status\":{"));
  CHECK(absl::StrContains(json, "\"centers\":[{\"stage\":0,\"version\":\"50\"}"));
  CHECK(absl::StrContains(json, "{\"group\":2,\"address\":\"10.0.0.4:7070\",\"reachable\":false,"
                                "\"error\":\"connect: \\\"refused\\\"\\n\"}]}"));
  CHECK(absl::StrContains(ShardTableJson(Views()), "\"degraded\":false"));
}

}  // namespace
}  // namespace rebound::tools
