#include "tools/shard_table.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "google/protobuf/util/json_util.h"

namespace rebound::tools {
namespace {

// A JSON string literal of `text`.
std::string JsonString(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += absl::StrFormat("\\u%04x", static_cast<unsigned char>(c));
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

}  // namespace

Range RangeOf(const ShardingStatus::StageRanges& stage, int group) {
  Range range;
  range.begin = stage.range_begin(group);
  range.end = group + 1 < stage.range_begin_size() ? stage.range_begin(group + 1)
                                                   : stage.parameters();
  return range;
}

std::string FormatRanges(const ShardingStatus& sharding, std::optional<int> highlight) {
  std::string text;
  for (const ShardingStatus::StageRanges& stage : sharding.stages()) {
    absl::StrAppend(&text, "stage ", stage.stage(), ": ", stage.parameters(), " parameters:");
    for (int g = 0; g < stage.range_begin_size(); ++g) {
      const Range range = RangeOf(stage, g);
      absl::StrAppend(&text, g == 0 ? " " : "  ", "g", g, " [", range.begin, ", ", range.end, ")",
                      highlight == g ? "*" : "");
    }
    absl::StrAppend(&text, "\n");
  }
  return text;
}

std::string DescribeRole(const GetStatusResponse& status) {
  if (!status.has_group()) return "single server";
  const GroupStatus& group = status.group();
  std::string text = absl::StrCat(group.name(), " ", GroupStatus::Role_Name(group.role()));
  if (group.role() == GroupStatus::LEADER) {
    int in_sync = 0;
    for (const StandbyStatus& standby : group.standbys()) in_sync += standby.in_sync() ? 1 : 0;
    absl::StrAppend(&text, " (epoch ", group.epoch(), ", ", in_sync, "/",
                    group.standbys_configured(), " standbys in sync)");
  }
  return text;
}

std::string DescribeCenters(const GetStatusResponse& status) {
  std::vector<std::string> parts;
  for (const CenterStatus& center : status.centers()) {
    parts.push_back(absl::StrCat("s", center.stage(), ":v", center.version()));
  }
  return parts.empty() ? "-" : absl::StrJoin(parts, " ");
}

std::string DescribeMismatch(const ShardGroupView& view, int groups) {
  if (!view.status.has_value()) return "";
  const GetStatusResponse& status = *view.status;
  std::vector<std::string> problems;
  if (!status.has_sharding()) {
    problems.push_back("reports no sharding (not a server of a sharded job)");
  } else {
    if (status.sharding().group() != view.group) {
      problems.push_back(absl::StrCat("answers as group ", status.sharding().group()));
    }
    if (status.sharding().groups() != groups) {
      problems.push_back(absl::StrCat("knows ", status.sharding().groups(), " groups, not ",
                                      groups));
    }
  }
  if (status.has_storage_error()) {
    problems.push_back(absl::StrCat("storage error: ", status.storage_error()));
  }
  return absl::StrJoin(problems, "; ");
}

std::string FormatShardTable(const std::vector<ShardGroupView>& views) {
  const int groups = static_cast<int>(views.size());
  // Cells first, then each column as wide as its widest cell.
  std::vector<std::vector<std::string>> rows = {
      {"GROUP", "ADDRESS", "REACHABLE", "ROLE", "CENTERS", "DETAIL"}};
  std::vector<std::string> degraded;
  for (const ShardGroupView& view : views) {
    const bool reachable = view.status.has_value();
    const std::string mismatch = DescribeMismatch(view, groups);
    rows.push_back({absl::StrCat(view.group), view.address, reachable ? "yes" : "NO",
                    reachable ? DescribeRole(*view.status) : "-",
                    reachable ? DescribeCenters(*view.status) : "-",
                    reachable ? mismatch : view.error});
    if (!reachable) {
      degraded.push_back(absl::StrCat("DEGRADED: group ", view.group, " (", view.address,
                                      ") does not answer: ", view.error,
                                      "; every trainer's sync waits for its range"));
    } else if (!mismatch.empty()) {
      degraded.push_back(absl::StrCat("DEGRADED: group ", view.group, " (", view.address, ") ",
                                      mismatch));
    }
  }
  std::vector<size_t> widths(rows.front().size(), 0);
  for (const std::vector<std::string>& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
  }
  std::string text;
  for (const std::vector<std::string>& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      absl::StrAppend(&line, c == 0 ? "" : "  ", row[c]);
      if (c + 1 < row.size()) line.append(widths[c] - row[c].size(), ' ');
    }
    absl::StrAppend(&text, absl::StripTrailingAsciiWhitespace(line), "\n");
  }
  if (degraded.empty()) {
    absl::StrAppend(&text, "all ", groups, " groups answer\n");
  } else {
    absl::StrAppend(&text, absl::StrJoin(degraded, "\n"), "\n");
  }
  return text;
}

bool Degraded(const std::vector<ShardGroupView>& views) {
  for (const ShardGroupView& view : views) {
    if (!view.status.has_value()) return true;
    if (!DescribeMismatch(view, static_cast<int>(views.size())).empty()) return true;
  }
  return false;
}

std::string ShardTableJson(const std::vector<ShardGroupView>& views) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  std::vector<std::string> rows;
  for (const ShardGroupView& view : views) {
    std::string row = absl::StrCat("{\"group\":", view.group,
                                   ",\"address\":", JsonString(view.address),
                                   ",\"reachable\":", view.status.has_value() ? "true" : "false");
    if (view.status.has_value()) {
      const std::string mismatch = DescribeMismatch(view, static_cast<int>(views.size()));
      if (!mismatch.empty()) absl::StrAppend(&row, ",\"mismatch\":", JsonString(mismatch));
      std::string status;
      google::protobuf::util::MessageToJsonString(*view.status, &status, options);
      absl::StrAppend(&row, ",\"status\":", status);
    } else {
      absl::StrAppend(&row, ",\"error\":", JsonString(view.error));
    }
    rows.push_back(row + "}");
  }
  return absl::StrCat("{\"groups\":", views.size(),
                      ",\"degraded\":", Degraded(views) ? "true" : "false", ",\"shards\":[",
                      absl::StrJoin(rows, ","), "]}");
}

}  // namespace rebound::tools
