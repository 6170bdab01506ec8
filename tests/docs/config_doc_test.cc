// docs/config.md is the configuration reference: every field a user can write in a job, server or
// worker config appears in it by its full path in backticks (`model.layers.width`), every value
// of every enum those fields use is named, and every field path its reference tables name (the
// tables whose first column is "path") is a real field, so a renamed field is caught both ways.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "google/protobuf/descriptor.h"
#include "proto/config.pb.h"

namespace rebound {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::EnumDescriptor;
using google::protobuf::FieldDescriptor;

// The messages at the top of a config file. A field of one of these types inside another
// (ServerConfig.job) is one entry that points at that message's own table.
std::vector<const Descriptor*> Roots() {
  return {JobConfig::descriptor(), ServerConfig::descriptor(), WorkerConfig::descriptor()};
}

bool IsRoot(const Descriptor* message) {
  const std::vector<const Descriptor*> roots = Roots();
  return std::find(roots.begin(), roots.end(), message) != roots.end();
}

// Adds the full path of every leaf field under `message` to `leaves` and every enum a leaf uses
// to `enums`. A message-typed field is a leaf when its type is a root or already open on the
// current path (a recursion cycle); otherwise its fields are walked with the path as prefix.
void CollectLeaves(const Descriptor* message, const std::string& prefix,
                   std::vector<const Descriptor*>* open, std::set<std::string>* leaves,
                   std::set<const EnumDescriptor*>* enums) {
  for (int i = 0; i < message->field_count(); ++i) {
    const FieldDescriptor* field = message->field(i);
    const std::string path = prefix + field->name();
    const Descriptor* type = field->message_type();
    const bool walk = type != nullptr && !IsRoot(type) &&
                      std::find(open->begin(), open->end(), type) == open->end();
    if (!walk) {
      leaves->insert(path);
      if (field->enum_type() != nullptr) enums->insert(field->enum_type());
      continue;
    }
    open->push_back(type);
    CollectLeaves(type, path + ".", open, leaves, enums);
    open->pop_back();
  }
}

struct Schema {
  std::set<std::string> leaves;  // every root's leaves, by path from that root
  std::set<const EnumDescriptor*> enums;
};

Schema ReadSchema() {
  Schema schema;
  for (const Descriptor* root : Roots()) {
    std::vector<const Descriptor*> open = {root};
    CollectLeaves(root, "", &open, &schema.leaves, &schema.enums);
  }
  return schema;
}

// True iff `path` ("a.b.c", indices like "layers[2]" allowed) names a field, of any kind, from
// one of the roots.
bool Resolves(const std::string& path) {
  const std::string plain = std::regex_replace(path, std::regex(R"(\[[^\]]*\])"), "");
  for (const Descriptor* root : Roots()) {
    const Descriptor* message = root;
    std::stringstream parts(plain);
    std::string part;
    bool ok = true;
    while (std::getline(parts, part, '.')) {
      const FieldDescriptor* field = message == nullptr ? nullptr : message->FindFieldByName(part);
      if (field == nullptr) {
        ok = false;
        break;
      }
      message = field->message_type();
    }
    if (ok) return true;
  }
  return false;
}

// The text of every `code span` in `text`.
std::vector<std::string> CodeSpans(const std::string& text) {
  std::vector<std::string> spans;
  const std::regex span("`([^`\n]+)`");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), span);
       it != std::sregex_iterator(); ++it) {
    spans.push_back((*it)[1].str());
  }
  return spans;
}

// Leaf paths that appear nowhere in `doc` as a code span.
std::vector<std::string> Undocumented(const Schema& schema, const std::string& doc) {
  const std::vector<std::string> spans = CodeSpans(doc);
  const std::set<std::string> documented(spans.begin(), spans.end());
  std::vector<std::string> missing;
  for (const std::string& path : schema.leaves) {
    if (documented.count(path) == 0) missing.push_back(path);
  }
  return missing;
}

// Enum values ("Activation.GELU") that appear nowhere in `doc` as a code span.
std::vector<std::string> UndocumentedEnumValues(const Schema& schema, const std::string& doc) {
  const std::vector<std::string> spans = CodeSpans(doc);
  const std::set<std::string> documented(spans.begin(), spans.end());
  std::vector<std::string> missing;
  for (const EnumDescriptor* type : schema.enums) {
    for (int i = 0; i < type->value_count(); ++i) {
      if (documented.count(type->value(i)->name()) == 0) {
        missing.push_back(type->name() + "." + type->value(i)->name());
      }
    }
  }
  return missing;
}

// The rows (without header and separator) of every table whose header's first cell is "path".
std::vector<std::string> ReferenceRows(const std::string& doc) {
  std::vector<std::string> rows;
  std::stringstream lines(doc);
  std::string line;
  bool in_table = false;
  bool reference = false;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] != '|') {
      in_table = false;
      continue;
    }
    if (!in_table) {
      in_table = true;
      reference = std::regex_search(line, std::regex(R"(^\|\s*path\s*\|)"));
      continue;
    }
    if (reference && !std::regex_search(line, std::regex(R"(^\|\s*-+\s*\|)"))) {
      rows.push_back(line);
    }
  }
  return rows;
}

// The first cell of a table row ("| a | b |" -> " a "); an escaped "\|" does not end a cell.
std::string FirstCell(const std::string& row) {
  for (size_t i = 1; i < row.size(); ++i) {
    if (row[i] == '|' && row[i - 1] != '\\') return row.substr(1, i - 1);
  }
  return row.substr(1);
}

// Paths in the reference tables that name no field: every code span of a row's first cell, and
// every code span elsewhere in a row that looks like a dotted field path ("a.b", "a[0].b").
std::vector<std::string> UnknownPaths(const std::string& doc) {
  const std::regex dotted(R"(^[a-z_][a-z0-9_]*(\[[^\]]*\])?(\.[a-z_][a-z0-9_]*(\[[^\]]*\])?)+$)");
  std::vector<std::string> unknown;
  for (const std::string& row : ReferenceRows(doc)) {
    const std::vector<std::string> named = CodeSpans(FirstCell(row));
    if (named.empty()) unknown.push_back("(a row that names no field) " + row);
    for (const std::string& path : named) {
      if (!Resolves(path)) unknown.push_back(path);
    }
    for (const std::string& span : CodeSpans(row)) {
      if (std::regex_match(span, dotted) && !Resolves(span)) unknown.push_back(span);
    }
  }
  std::sort(unknown.begin(), unknown.end());
  unknown.erase(std::unique(unknown.begin(), unknown.end()), unknown.end());
  return unknown;
}

std::string Lines(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& item : items) out += "  " + item + "\n";
  return out;
}

std::string ReadReference() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  const std::string path =
      srcdir == nullptr
          ? "docs/config.md"
          : std::string(srcdir) + "/" + (workspace != nullptr ? workspace : "rebound") +
                "/docs/config.md";
  std::ifstream in(path);
  INFO("reading " << path);
  REQUIRE(in.good());
  std::stringstream text;
  text << in.rdbuf();
  REQUIRE_FALSE(text.str().empty());
  return text.str();
}

// What `after` lists that `before` does not: the checks below hold whatever else the real
// reference lacks, so only the test that owns a gap reports it.
std::vector<std::string> Added(const std::vector<std::string>& before,
                               const std::vector<std::string>& after) {
  std::vector<std::string> added;
  for (const std::string& item : after) {
    if (std::find(before.begin(), before.end(), item) == before.end()) added.push_back(item);
  }
  return added;
}

// `doc` without its lines that contain `needle`.
std::string WithoutLinesContaining(const std::string& doc, const std::string& needle) {
  std::stringstream lines(doc);
  std::string line;
  std::string out;
  while (std::getline(lines, line)) {
    if (line.find(needle) == std::string::npos) out += line + "\n";
  }
  return out;
}

TEST_CASE("the walk reaches nested, repeated and shared fields and stops at a nested top-level "
          "config") {
  const Schema schema = ReadSchema();
  for (const char* path :
       {"job_id", "model.layers.width", "model.layers.activation", "topology.stage_boundaries",
        "fault_tolerance.checkpoint_every_steps", "security.tls.require_client_cert",
        "metrics.port", "compute.cuda_device", "job", "job_file", "give_up_after_ms"}) {
    INFO(path);
    CHECK(schema.leaves.count(path) == 1);
  }
  // ServerConfig.job is a JobConfig: its fields are documented once, without the prefix.
  CHECK(schema.leaves.count("job.job_id") == 0);
  CHECK(schema.leaves.count("model") == 0);
  CHECK(schema.enums.count(RecoveryPolicy_descriptor()) == 1);
  CHECK(schema.enums.count(WorkerRole_descriptor()) == 1);
}

TEST_CASE("every field of JobConfig, ServerConfig and WorkerConfig is documented by its full "
          "path") {
  const std::vector<std::string> missing = Undocumented(ReadSchema(), ReadReference());
  INFO("fields missing from docs/config.md (add a row with the path in backticks):\n"
       << Lines(missing));
  CHECK(missing.empty());
}

TEST_CASE("every value of every enum the configs use is documented") {
  const std::vector<std::string> missing = UndocumentedEnumValues(ReadSchema(), ReadReference());
  INFO("enum values missing from docs/config.md (name each in backticks):\n" << Lines(missing));
  CHECK(missing.empty());
}

TEST_CASE("every field path in the reference tables is a real field") {
  const std::string doc = ReadReference();
  CHECK(ReferenceRows(doc).size() >= ReadSchema().leaves.size());
  const std::vector<std::string> unknown = UnknownPaths(doc);
  INFO("paths in docs/config.md that name no field of proto/config.proto:\n" << Lines(unknown));
  CHECK(unknown.empty());
}

TEST_CASE("a reference without a field's row is caught, naming the field") {
  const Schema schema = ReadSchema();
  const std::string reference = ReadReference();
  const std::string doc = WithoutLinesContaining(reference, "| `metrics.port` |");
  CHECK(Added(Undocumented(schema, reference), Undocumented(schema, doc)) ==
        std::vector<std::string>{"metrics.port"});
}

TEST_CASE("a renamed field in the reference is caught both ways") {
  const Schema schema = ReadSchema();
  const std::string reference = ReadReference();
  std::string doc = reference;
  const std::string old_name = "`max_wait_ms`";
  REQUIRE(doc.find("| " + old_name + " |") != std::string::npos);
  for (size_t at = doc.find(old_name); at != std::string::npos; at = doc.find(old_name, at)) {
    doc.replace(at, old_name.size(), "`max_wait_millis`");
  }
  CHECK(Added(Undocumented(schema, reference), Undocumented(schema, doc)) ==
        std::vector<std::string>{"max_wait_ms"});
  CHECK(Added(UnknownPaths(reference), UnknownPaths(doc)) ==
        std::vector<std::string>{"max_wait_millis"});
  CHECK(UnknownPaths("| path | what |\n|---|---|\n| `easgd.sync_periods` | x |\n") ==
        std::vector<std::string>{"easgd.sync_periods"});
}

}  // namespace
}  // namespace rebound
