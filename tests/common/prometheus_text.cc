#include "tests/common/prometheus_text.h"

#include <cmath>
#include <cstdlib>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace rebound::testing {
namespace {

bool ValidName(const std::string& name, bool allow_colon) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                       (allow_colon && c == ':');
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

bool ParseValue(const std::string& text, double* value) {
  if (text == "+Inf") *value = INFINITY;
  else if (text == "-Inf") *value = -INFINITY;
  else if (text == "NaN") *value = NAN;
  else {
    char* end = nullptr;
    *value = std::strtod(text.c_str(), &end);
    if (text.empty() || end != text.c_str() + text.size()) return false;
  }
  return true;
}

// The family a sample name belongs to (histogram series carry suffixes).
std::string FamilyOf(const std::string& name, const std::map<std::string, std::string>& types) {
  if (types.count(name) > 0) return name;
  for (const char* suffix : {"_bucket", "_sum", "_count"}) {
    if (absl::EndsWith(name, suffix)) {
      const std::string base = name.substr(0, name.size() - std::string(suffix).size());
      if (types.count(base) > 0) return base;
    }
  }
  return "";
}

}  // namespace

absl::StatusOr<Exposition> ParseExposition(const std::string& text) {
  Exposition out;
  // Per histogram series (labels without le): the last cumulative count and the +Inf count.
  std::map<std::string, double> last_bucket;
  std::map<std::string, double> inf_bucket;
  int line_number = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line_number;
    const std::string line(raw);
    auto fail = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_number, ": ", why, ": ", line));
    };
    if (line.empty()) continue;
    if (line[0] == '#') {
      std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits(' ', 3));
      if (parts.size() < 3 || (parts[1] != "HELP" && parts[1] != "TYPE")) continue;  // comment
      if (!ValidName(parts[2], true)) return fail("bad family name");
      auto& table = parts[1] == "TYPE" ? out.types : out.helps;
      if (table.count(parts[2]) > 0) return fail(absl::StrCat(parts[1], " repeated"));
      table[parts[2]] = parts.size() > 3 ? parts[3] : "";
      if (parts[1] == "TYPE") {
        const std::string& type = table[parts[2]];
        if (type != "counter" && type != "gauge" && type != "histogram" && type != "summary" &&
            type != "untyped") {
          return fail("unknown type");
        }
      }
      continue;
    }
    // name{labels} value
    size_t name_end = line.find_first_of("{ ");
    if (name_end == std::string::npos) return fail("no value");
    const std::string name = line.substr(0, name_end);
    if (!ValidName(name, true)) return fail("bad metric name");
    std::string labels_text;
    std::string le;
    std::string labels_without_le;
    size_t value_start = name_end;
    if (line[name_end] == '{') {
      size_t i = name_end + 1;
      std::vector<std::string> pairs;
      while (i < line.size() && line[i] != '}') {
        const size_t eq = line.find('=', i);
        if (eq == std::string::npos || eq + 1 >= line.size() || line[eq + 1] != '"') {
          return fail("bad label");
        }
        const std::string label = line.substr(i, eq - i);
        if (!ValidName(label, false)) return fail("bad label name");
        std::string value;
        size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\') {
            if (j + 1 >= line.size()) return fail("bad escape");
            const char e = line[++j];
            if (e == 'n') value += '\n';
            else if (e == '\\' || e == '"') value += e;
            else return fail("bad escape");
          } else {
            value += line[j];
          }
        }
        if (j >= line.size()) return fail("unterminated label value");
        if (label == "le") le = value;
        else pairs.push_back(line.substr(i, j + 1 - i));
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      if (i >= line.size()) return fail("unterminated labels");
      labels_text = line.substr(name_end, i + 1 - name_end);
      for (const std::string& p : pairs) absl::StrAppend(&labels_without_le, p, ",");
      value_start = i + 1;
    }
    if (value_start >= line.size() || line[value_start] != ' ') return fail("no value");
    std::vector<std::string> rest = absl::StrSplit(line.substr(value_start + 1), ' ');
    double value = 0;
    if (rest.empty() || !ParseValue(rest[0], &value)) return fail("bad value");
    const std::string family = FamilyOf(name, out.types);
    if (family.empty()) return fail("no # TYPE for this metric");
    const std::string key = name + labels_text;
    if (out.samples.count(key) > 0) return fail("series repeated");
    out.samples[key] = value;
    if (out.types[family] == "histogram") {
      const std::string series = family + "|" + labels_without_le;
      if (name == family + "_bucket") {
        if (le.empty()) return fail("bucket without le");
        if (value < last_bucket[series]) return fail("buckets not cumulative");
        last_bucket[series] = value;
        if (le == "+Inf") inf_bucket[series] = value;
      } else if (name == family + "_count") {
        if (inf_bucket.count(series) == 0) return fail("no le=\"+Inf\" bucket before _count");
        if (inf_bucket[series] != value) return fail("_count differs from the +Inf bucket");
      }
    }
  }
  return out;
}

}  // namespace rebound::testing
