"""What deploy/Dockerfile and deploy/Dockerfile.python build, read from the files themselves, so
that the image tests check the lists the images install and nothing hand-kept beside them.

A Dockerfile is read as its stages (FROM ... [AS name]), each with the packages of its
`apt-get install` and its COPY and ENV lines. Only the instructions these Dockerfiles use are
understood; anything else in a stage fails loudly rather than being skipped.
"""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVER_IMAGE = "deploy/Dockerfile"
PYTHON_IMAGE = "deploy/Dockerfile.python"
KNOWN = {"FROM", "RUN", "COPY", "ENV", "USER", "WORKDIR", "EXPOSE"}


class Stage:
    def __init__(self, base, name):
        self.base = base          # "debian:12"
        self.name = name          # the AS name, or None
        self.packages = []        # the apt-get install arguments, in order
        self.copies = []          # (source, destination, from_stage or None)
        self.env = {}             # ENV NAME=VALUE
        self.runs = []            # every RUN's command, continuation lines joined
        self.user = None          # USER
        self.workdir = None       # WORKDIR


def logical_lines(text):
    """The instructions: comments dropped, continuation lines joined."""
    lines, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    assert not current, "a continuation line ends the file"
    return lines


def read_dockerfile(path):
    """[Stage] of the Dockerfile at `path` (relative to the repository)."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    stages = []
    for line in logical_lines(text):
        word, _, rest = line.strip().partition(" ")
        assert word in KNOWN, f"{path}: instruction {word} is not understood by tests/deploy"
        rest = rest.strip()
        if word == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            stages.append(Stage(m.group(1), m.group(2)))
            continue
        stage = stages[-1]
        if word == "RUN":
            stage.runs.append(rest)
            for install in re.findall(r"apt-get install ([^&]*)", rest):
                stage.packages += [a for a in install.split() if not a.startswith("-")]
        elif word == "COPY":
            args = rest.split()
            source_stage = None
            if args[0].startswith("--from="):
                source_stage = args.pop(0)[len("--from="):]
            assert len(args) == 2, f"{path}: COPY with {len(args)} paths: {line}"
            stage.copies.append((args[0], args[1], source_stage))
        elif word == "ENV":
            name, _, value = rest.partition("=")
            stage.env[name] = value
        elif word == "USER":
            stage.user = rest
        elif word == "WORKDIR":
            stage.workdir = rest
    return stages


def final_stage(path):
    return read_dockerfile(path)[-1]


def installed_packages():
    """{package: (status, depends, pre-depends, provides)} of this machine's dpkg database."""
    out = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Package}\t${db:Status-Status}\t${Depends}\t"
         "${Pre-Depends}\t${Provides}\n"], capture_output=True, text=True, check=True).stdout
    packages = {}
    for line in out.splitlines():
        name, status, depends, pre, provides = line.split("\t")
        packages[name] = (status, depends, pre, provides)
    return packages


def relation_names(field):
    """'libc6 (>= 2.34), libx | liby:any' -> [["libc6"], ["libx", "liby"]]."""
    groups = []
    for group in field.split(","):
        names = [re.sub(r"\(.*?\)|\[.*?\]|<.*?>", "", alt).strip().split(":")[0]
                 for alt in group.split("|")]
        names = [n for n in names if n]
        if names:
            groups.append(names)
    return groups


def dependency_closure(roots, packages):
    """The packages apt installs for `roots` (Depends and Pre-Depends, no Recommends), read from
    this machine's dpkg database: each package of the list needs to be installed here (the -dev
    packages of tools/setup.sh pull in the runtime ones). Of alternatives, the first one that is
    installed (or provided by an installed package) counts, as apt picks the first one it can."""
    providers = {}
    for name, (status, _, _, provides) in packages.items():
        if status == "installed":
            providers.setdefault(name, name)
            for group in relation_names(provides):
                providers.setdefault(group[0], name)
    closure, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        _, depends, pre, _ = packages[name]
        for group in relation_names(depends) + relation_names(pre):
            chosen = next((providers[n] for n in group if n in providers), None)
            assert chosen is not None, f"{name} depends on {group}: none installed here"
            todo.append(chosen)
    return closure


def _merged_usr_twins(path):
    """`path`, its real path and their merged-/usr twins: /lib/x and /usr/lib/x are one file on
    Debian 12, but dpkg knows each file by the name its package ships it under."""
    candidates = [path, os.path.realpath(path)]
    for p in list(candidates):
        for a, b in (("/lib/", "/usr/lib/"), ("/lib64/", "/usr/lib64/"), ("/bin/", "/usr/bin/")):
            if p.startswith(a):
                candidates.append(b + p[len(a):])
            elif p.startswith(b):
                candidates.append(a + p[len(b):])
    return list(dict.fromkeys(candidates))


def owning_packages(paths):
    """{path: the package that holds it (dpkg -S), or None}, trying each path's merged-/usr
    twins. One dpkg -S for all of them: each call reads the whole dpkg database."""
    twins = {path: _merged_usr_twins(path) for path in paths}
    everything = sorted({c for cs in twins.values() for c in cs})
    # Exit status 1 when some candidate is in no package: expected, the twins are guesses.
    out = subprocess.run(["dpkg", "-S"] + everything, capture_output=True, text=True).stdout
    owner = {}
    for line in out.splitlines():
        if line.startswith("diversion by"):
            continue
        owners, _, owned = line.partition(": ")
        owner.setdefault(owned, owners.split(",")[0].strip().split(":")[0])
    return {path: next((owner[c] for c in cs if c in owner), None) for path, cs in twins.items()}


def owning_package(path):
    return owning_packages([path])[path]


def linked_libraries(binary):
    """{soname: resolved path} of `ldd binary`: every shared library the loader maps, the
    loader itself included; a library that is not found fails."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    libraries = {}
    for line in out.splitlines():
        line = line.strip()
        m = re.match(r"(\S+) => (\S+) \(0x", line)
        if m:
            libraries[m.group(1)] = m.group(2)
            continue
        assert "not found" not in line, f"{binary}: {line}"
        m = re.match(r"(/\S+) \(0x", line)
        if m:
            libraries[os.path.basename(m.group(1))] = m.group(1)
        # linux-vdso.so.1 is the kernel's: no file.
    return libraries
