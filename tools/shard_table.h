#pragma once

// What the operator's tools print about a sharded center (docs/design.md §10.2): the ranges of each
// stage and which group holds which (reboundctl status, rebound_launch --shard_groups), and one
// row per shard group with its state (reboundctl shards).
//
// Pure: the callers make the GetStatus calls and hand over the replies (or why there was none),
// so every line is unit-tested from hand-built replies (tests/tools/shard_table_test.cc).

#include <optional>
#include <string>
#include <vector>

#include "proto/rebound.pb.h"

namespace rebound::tools {

// The range of group `group` in `stage`: [begin, end). REQUIRES: 0 <= group < groups, and
// stage.range_begin_size() == groups (the server fills K entries).
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
};
Range RangeOf(const ShardingStatus::StageRanges& stage, int group);

// The ranges, one line per stage, each group's range in order; `highlight` (a group index, or
// nullopt) marks that group's range with a '*'. For example:
//   stage 0: 235146 parameters: g0 [0, 117573)*  g1 [117573, 235146)
std::string FormatRanges(const ShardingStatus& sharding, std::optional<int> highlight);

// One shard group as seen by `reboundctl shards`: its index and address (from
// sharding.group_addresses) and its GetStatus reply, or why there is none.
struct ShardGroupView {
  int group = 0;
  std::string address;
  std::optional<GetStatusResponse> status;  // unset: it did not answer
  std::string error;                        // why not (when status is unset)
};

// The role of a group's answering server: "single server" without a replication block, else
// "<name> LEADER (epoch E, I/N standbys in sync)" for a leader, "<name> STANDBY" etc. otherwise.
std::string DescribeRole(const GetStatusResponse& status);

// The center version of each stage a group's reply lists, "s0:v12 s1:v9"; "-" when none.
std::string DescribeCenters(const GetStatusResponse& status);

// What is wrong with a reply, "" when nothing: it says it is another group than the one it was
// asked as, it knows another number of groups, or it reports a storage error.
std::string DescribeMismatch(const ShardGroupView& view, int groups);

// The table of `reboundctl shards`: a header, one row per group (GROUP, ADDRESS, REACHABLE,
// ROLE, CENTERS, DETAIL; each column as wide as its widest cell), then either "all K groups answer" or one "DEGRADED: ..." line per
// group that did not answer (a trainer's syncs wait for every range: training stalls until it
// is back) or that answered wrongly.
std::string FormatShardTable(const std::vector<ShardGroupView>& views);

// True when some group did not answer or answered wrongly (DescribeMismatch).
bool Degraded(const std::vector<ShardGroupView>& views);

// The same as JSON: {"groups": K, "degraded": bool, "shards": [{"group", "address",
// "reachable", "error"?, "mismatch"?, "status"?: the GetStatusResponse as JSON}]}.
std::string ShardTableJson(const std::vector<ShardGroupView>& views);

}  // namespace rebound::tools
