#!/usr/bin/env bash
# Prints a Markdown table of every test's wall time from the logs Bazel left after a run
# (docs/testing.md#per-target-wall-times):
#
#   tools/test_times.sh [--newer FILE] [--write PAGE] [TESTLOGS_DIR...]
#
# Reads each TESTLOGS_DIR/**/test.xml (the JUnit XML Bazel writes for every test it ran) and the
# test.log beside it. Default TESTLOGS_DIRs: every bazel-out/*/testlogs (and bazel-tsan-out/*/testlogs,
# tools/test.sh's TSan output base) of this checkout (one per
# configuration: k8-fastbuild is the gcc build, k8-fastbuild-tsan ThreadSanitizer, ...), else
# bazel-testlogs. One row per target and configuration: target, config, wall seconds, slowest
# first; a target run for one test case only (tools/test.sh's TSan cases: Catch2 prints
# "Filters: ...", pytest "N deselected") says so. Above the table: the date, the machine (`nproc`,
# CPU model, memory) and the span of the runs; below it, the sum per configuration.
#
#   --newer FILE  only the logs written after FILE was (touch a file before the run)
#   --write PAGE  instead of printing, replace what lies between the lines
#                 <!-- test_times:begin --> and <!-- test_times:end --> of PAGE (docs/testing.md)
#
# The time of a test is its XML's: <testsuites time>, else the sum of <testsuite time>, else the
# sum of <testcase time> (or duration; Bazel's own XML has whole seconds there). Shards of one run
# add up; of several runs (--runs_per_test) the slowest is kept. A cached result keeps the XML of
# the run that made it. An XML that does not parse (a test's output can hold bytes XML forbids)
# is read with a regular expression instead; one without any time is listed on stderr and
# skipped. Python 3's standard library only (Debian's /usr/bin/python3).
# Exit status: 0, 1 if no test.xml was found, 2 on a usage error or a PAGE without the markers.
set -euo pipefail

usage() { sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; }

newer=""
write=""
dirs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --newer) [ $# -ge 2 ] || { usage >&2; exit 2; }; newer=$2; shift 2 ;;
    --newer=*) newer=${1#*=}; shift ;;
    --write) [ $# -ge 2 ] || { usage >&2; exit 2; }; write=$2; shift 2 ;;
    --write=*) write=${1#*=}; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "test_times.sh: unknown flag $1" >&2; usage >&2; exit 2 ;;
    *) dirs+=("$1"); shift ;;
  esac
done
if [ -n "$newer" ] && [ ! -e "$newer" ]; then
  echo "test_times.sh: --newer $newer: no such file" >&2
  exit 2
fi
if [ -n "$write" ] && [ ! -f "$write" ]; then
  echo "test_times.sh: --write $write: no such file" >&2
  exit 2
fi
if [ ${#dirs[@]} -eq 0 ]; then
  # bazel-tsan-out: tools/test.sh's TSan build, in an output base of its own.
  for d in bazel-out/*/testlogs bazel-tsan-out/*/testlogs; do
    [ -d "$d" ] && dirs+=("$d")
  done
  if [ ${#dirs[@]} -eq 0 ] && [ -d bazel-testlogs ]; then dirs+=(bazel-testlogs); fi
fi
if [ ${#dirs[@]} -eq 0 ]; then
  echo "test_times.sh: no bazel-out/*/testlogs or bazel-testlogs here ($(pwd)); run the tests" \
    "first, or name a testlogs directory" >&2
  exit 1
fi

exec /usr/bin/python3 - "$newer" "$write" "${dirs[@]}" <<'PYTHON'
import datetime
import os
import re
import sys
import xml.etree.ElementTree as ElementTree

newer, write, dirs = sys.argv[1], sys.argv[2], sys.argv[3:]
newer_than = os.stat(newer).st_mtime if newer else None

BEGIN = "<!-- test_times:begin -->"
END = "<!-- test_times:end -->"


def config_of(testlogs):
    """The configuration a testlogs directory belongs to, from its bazel-out/<dir> name."""
    name = os.path.basename(os.path.dirname(os.path.realpath(testlogs).rstrip("/")))
    known = {
        "k8-fastbuild": "gcc",
        "k8-fastbuild-tsan": "tsan",
        "k8-fastbuild-tsa": "tsa",
        "k8-fastbuild-fuzz": "fuzz",
        "k8-opt": "gcc -c opt",
        "k8-dbg": "gcc -c dbg",
    }
    return known.get(name, name or "?")


def number(text):
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if value >= 0 else None


def seconds_from_tree(root):
    if root.tag == "testsuites" and number(root.get("time")) is not None:
        return number(root.get("time"))
    suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
    times = [number(s.get("time")) for s in suites]
    if times and all(t is not None for t in times):
        return sum(times)
    cases = []
    for case in root.iter("testcase"):
        t = number(case.get("time"))
        if t is None:
            t = number(case.get("duration"))
        if t is not None:
            cases.append(t)
    return sum(cases) if cases else None


def seconds_from_text(text):
    """The same order of preference, by regular expression, for an XML that does not parse."""
    m = re.search(r"<testsuites\b[^>]*?\btime=\"([0-9.eE+-]+)\"", text)
    if m and number(m.group(1)) is not None:
        return number(m.group(1))
    suites = re.findall(r"<testsuite\b[^>]*?\btime=\"([0-9.eE+-]+)\"", text)
    if suites and all(number(t) is not None for t in suites):
        return sum(number(t) for t in suites)
    cases = []
    for tag in re.findall(r"<testcase\b[^>]*>", text):
        m = re.search(r"\btime=\"([0-9.eE+-]+)\"", tag) or \
            re.search(r"\bduration=\"([0-9.eE+-]+)\"", tag)
        if m and number(m.group(1)) is not None:
            cases.append(number(m.group(1)))
    return sum(cases) if cases else None


def seconds_of(path):
    with open(path, "rb") as f:
        data = f.read()
    try:
        return seconds_from_tree(ElementTree.fromstring(data))
    except ElementTree.ParseError:
        return seconds_from_text(data.decode("utf-8", "replace"))


def selection_of(log_path):
    """'case: NAME' when the log shows one Catch2 test case or a pytest selection, else ''."""
    try:
        with open(log_path, "rb") as f:
            text = f.read(4 << 20).decode("utf-8", "replace")
    except OSError:
        return ""
    m = re.search(r"^Filters: (.+)$", text, re.M)
    if m:
        return "case: " + m.group(1).strip().replace("\\", "")
    m = re.search(r"\b(\d+) deselected\b", text)
    if m:
        return "pytest, %s deselected" % m.group(1)
    return ""


RUN_DIR = re.compile(r"^(shard_\d+_of_\d+)?_?(run_\d+_of_\d+)?$")

# (label, config) -> {"runs": {run: seconds}, "note": str, "mtimes": [...]}
rows = {}
skipped = []
seen_dirs = set()
for testlogs in dirs:
    real = os.path.realpath(testlogs)
    if real in seen_dirs or not os.path.isdir(real):
        continue
    seen_dirs.add(real)
    config = config_of(testlogs)
    for parent, subdirs, files in os.walk(real):
        subdirs[:] = [d for d in subdirs if d != "test_attempts"]
        if "test.xml" not in files:
            continue
        xml_path = os.path.join(parent, "test.xml")
        mtime = os.stat(xml_path).st_mtime
        if newer_than is not None and mtime <= newer_than:
            continue
        rel = os.path.relpath(parent, real).split(os.sep)
        run = ""
        if len(rel) > 1 and rel[-1] and RUN_DIR.match(rel[-1]):
            m = RUN_DIR.match(rel[-1])
            run = m.group(2) or ""
            rel = rel[:-1]
        package, name = "/".join(rel[:-1]), rel[-1]
        label = "//%s:%s" % (package, name)
        seconds = seconds_of(xml_path)
        if seconds is None:
            skipped.append(xml_path)
            continue
        row = rows.setdefault((label, config), {"runs": {}, "note": "", "mtimes": []})
        row["runs"][run] = row["runs"].get(run, 0.0) + seconds
        row["mtimes"].append(mtime)
        note = selection_of(os.path.join(parent, "test.log"))
        if note:
            row["note"] = note

for path in skipped:
    print("test_times.sh: no time in %s; skipped" % path, file=sys.stderr)
if not rows:
    print("test_times.sh: no test.xml with a time under %s%s" % (
        ", ".join(dirs), " newer than " + newer if newer else ""), file=sys.stderr)
    sys.exit(1)


def machine():
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    model = "unknown CPU"
    memory = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = " ".join(line.split(":", 1)[1].split())
                    break
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    memory = ", %.0f GiB memory" % (int(line.split()[1]) / (1 << 20))
                    break
    except OSError:
        pass
    return "%d cores (`nproc`), %s%s" % (cores, model, memory)


def when(t):
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def cell(text):
    return text.replace("|", "\\|")


table = []
for (label, config), row in rows.items():
    table.append((max(row["runs"].values()), label, config, row["note"]))
table.sort(key=lambda r: (-r[0], r[1], r[2]))
mtimes = [t for row in rows.values() for t in row["mtimes"]]
now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

out = []
out.append("Generated by `tools/test_times.sh` on %s from %d test results (runs from %s to %s); "
           "machine: %s." % (now, len(table), when(min(mtimes)), when(max(mtimes)), machine()))
out.append("")
out.append("| target | config | wall s |")
out.append("|---|---|---:|")
for seconds, label, config, note in table:
    target = "`%s`" % label + (" (%s)" % cell(note) if note else "")
    out.append("| %s | %s | %.1f |" % (target, cell(config), seconds))
out.append("")
totals = {}
for seconds, _, config, _ in table:
    totals[config] = totals.get(config, 0.0) + seconds
out.append("Sum of the wall times per configuration (tests that ran two at a time overlap): " +
           ", ".join("%s %.0f s (%.1f min)" % (c, s, s / 60) for c, s in sorted(totals.items())) +
           ".")
text = "\n".join(out) + "\n"

if not write:
    sys.stdout.write(text)
    sys.exit(0)

with open(write, encoding="utf-8") as f:
    page = f.read()
begin, end = page.find(BEGIN), page.find(END)
if begin < 0 or end < begin:
    print("test_times.sh: %s lacks the lines %s and %s (in that order)" % (write, BEGIN, END),
          file=sys.stderr)
    sys.exit(2)
page = page[:begin + len(BEGIN)] + "\n" + text + page[end:]
temporary = write + ".tmp"
with open(temporary, "w", encoding="utf-8") as f:
    f.write(page)
os.replace(temporary, write)
print("test_times.sh: wrote %d rows into %s" % (len(table), write), file=sys.stderr)
PYTHON
