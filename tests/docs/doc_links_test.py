"""The documentation's references hold (R19): every relative link of README.md, CHANGELOG.md and
docs/*.md (and deploy/README.md) names a file of the repository, and a #fragment into a Markdown
file one of its headings; nothing refers to a file outside the repository (the design document
is docs/design.md, and every "docs/design.md §N" names one of its sections); every flag a doc
writes after a binary's name is one that binary's --help lists (docs/cli.md, which
//tests/docs:cli_doc_test checks against the binaries).

Reads the source tree the runfiles point into (so that every file of the repository is seen,
not only the declared ones); tagged "external" in BUILD: never cached.
"""

import os
import re
import sys
import unittest

ROOT = os.path.dirname(os.path.realpath("README.md"))
DOCS = ["README.md", "CHANGELOG.md", os.path.join("deploy", "README.md")] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
SKIP_DIRS = {".git", "__pycache__", "_gen"}
SOURCE_SUFFIXES = (".md", ".h", ".cc", ".cu", ".py", ".proto", ".sh", ".bzl", ".yaml", ".yml",
                   ".pbtxt", ".txt", ".json")
BINARIES = ["rebound_server", "rebound_worker", "rebound_train", "reboundctl", "rebound_launch"]

LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*```")


def read(relative):
    with open(os.path.join(ROOT, relative), encoding="utf-8") as f:
        return f.read()


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"`|\*\*|\*|<[^>]*>", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text, flags=re.UNICODE)
    return text.replace(" ", "-")


def anchors(relative):
    found, counts, in_code = set(), {}, False
    for line in read(relative).splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        m = None if in_code else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = counts.get(base, 0)
            found.add(base if n == 0 else "%s-%d" % (base, n))
            counts[base] = n + 1
    return found


def prose_lines(relative):
    """(number, line) of a Markdown file outside fenced code blocks."""
    in_code = False
    for number, line in enumerate(read(relative).splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
            continue
        if not in_code:
            yield number, line


def repository_files():
    for directory, subdirs, files in os.walk(ROOT):
        subdirs[:] = [d for d in subdirs if d not in SKIP_DIRS and not d.startswith("bazel-")]
        for f in files:
            if f.endswith(SOURCE_SUFFIXES) or f in ("BUILD", "WORKSPACE", "Dockerfile"):
                yield os.path.relpath(os.path.join(directory, f), ROOT)


def cli_flags():
    """Each binary's flags, from its docs/cli.md section (its --help text)."""
    flags, current = {}, None
    for line in read(os.path.join("docs", "cli.md")).splitlines():
        m = re.match(r"^## (\S+)\s*$", line)
        if m:
            current = m.group(1)
            flags[current] = set()
        elif current:
            flags[current].update(re.findall(r"--[a-z][a-z0-9_]*", line))
    return flags


class DocLinksTest(unittest.TestCase):
    def test_every_relative_link_names_a_file_and_a_heading_of_the_repository(self):
        bad, checked = [], 0
        for doc in DOCS:
            for number, line in prose_lines(doc):
                for m in LINK.finditer(line):
                    target = m.group(1) or m.group(2)
                    if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                        continue
                    path, _, fragment = target.partition("#")
                    resolved = os.path.normpath(
                        os.path.join(os.path.dirname(doc), path)) if path else doc
                    where = "%s:%d: %s" % (doc, number, target)
                    checked += 1
                    if resolved.startswith(".."):
                        bad.append(where + " (outside the repository)")
                    elif not os.path.exists(os.path.join(ROOT, resolved)):
                        bad.append(where + " (no such file)")
                    elif fragment and resolved.endswith(".md") and fragment not in anchors(resolved):
                        bad.append(where + " (no such heading in %s)" % resolved)
        self.assertGreater(checked, 200)
        self.assertEqual(bad, [], "\n".join(bad))

    def test_nothing_refers_to_a_design_file_outside_the_repository(self):
        bad = []
        for f in repository_files():
            if f == os.path.join("tests", "docs", "doc_links_test.py"):
                continue
            try:
                text = read(f)
            except UnicodeDecodeError:
                continue
            for number, line in enumerate(text.splitlines(), 1):
                if "DESIGN.md" in line or "../shared" in line:
                    bad.append("%s:%d: %s" % (f, number, line.strip()))
        self.assertEqual(bad, [], "\n".join(bad[:50]))

    def test_every_design_section_cited_exists(self):
        sections = set()
        for line in read(os.path.join("docs", "design.md")).splitlines():
            m = re.match(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", line)
            if m:
                sections.add(m.group(1))
        self.assertIn("5.3", sections)
        bad, cited = [], 0
        for f in repository_files():
            try:
                text = read(f)
            except UnicodeDecodeError:
                continue
            for m in re.finditer(r"design\.md §§?\s?(\d+(?:\.\d+)?)((?:\s?(?:,|and|-|–)\s?§?\d+(?:\.\d+)?)*)",
                                 text):
                numbers = [m.group(1)] + re.findall(r"\d+(?:\.\d+)?", m.group(2))
                for n in numbers:
                    cited += 1
                    if n not in sections:
                        bad.append("%s: design.md §%s" % (f, n))
        self.assertGreater(cited, 20)
        self.assertEqual(bad, [], "\n".join(bad))

    def test_every_flag_written_after_a_binary_is_one_it_has(self):
        flags = cli_flags()
        for binary in BINARIES:
            self.assertIn(binary, flags, "docs/cli.md has no section for " + binary)
            self.assertIn("--version", flags[binary])
        bad, checked = [], 0
        for doc in DOCS:
            for number, line in enumerate(read(doc).splitlines(), 1):
                # A command line: a binary's name, then its arguments up to the end of the code
                # span, a comment, a pipe or the next binary.
                for m in re.finditer(r"\b(%s)\b((?:[^`#|;&)]|\|\|)*)" % "|".join(BINARIES), line):
                    binary, rest = m.group(1), m.group(2)
                    rest = re.split(r"\b(?:%s)\b" % "|".join(BINARIES), rest)[0]
                    for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9_]*", rest):
                        checked += 1
                        if flag not in flags[binary] and flag not in ("--help", "--helpfull"):
                            bad.append("%s:%d: %s %s" % (doc, number, binary, flag))
        self.assertGreater(checked, 30)
        self.assertEqual(bad, [], "\n".join(bad))


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
