"""One version for the whole project (docs/upgrading.md): `python3 -m rebound --version` and
every binary's --version print the same "rebound <version> (commit <commit>)", the version being
the file VERSION at the repository root."""

import os
import re
import subprocess
import sys

import pytest

import rebound

LINE = re.compile(r"^rebound (\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?) \(commit ([0-9a-f]{12}(?:-dirty)?|unknown)\)$")

BINARIES = ["REBOUND_SERVER", "REBOUND_WORKER", "REBOUND_TRAIN", "REBOUNDCTL", "REBOUND_LAUNCH"]


def version_of(command):
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (command, done.returncode, done.stderr)
    lines = done.stdout.splitlines()
    assert len(lines) == 1, (command, done.stdout)
    match = LINE.match(lines[0])
    assert match, (command, lines[0])
    return match.group(1), match.group(2)


def python_version():
    return version_of([sys.executable, "-m", "rebound", "--version"])


def test_the_python_package_says_the_version_in_the_version_file():
    # python/rebound/__init__.py -> the repository root
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(rebound.__file__))))
    with open(os.path.join(root, "VERSION")) as f:
        expected = f.read().strip()
    assert python_version()[0] == expected
    assert rebound.__version__ == expected


@pytest.mark.parametrize("binary", BINARIES)
def test_every_binary_prints_the_python_packages_version(binary):
    version, commit = version_of([os.environ[binary], "--version"])
    assert version == python_version()[0]
    # A stamped binary (--config=release) names the commit it was built from; an unstamped one,
    # as the tests build, says so rather than guess.
    assert commit == "unknown" or re.match(r"^[0-9a-f]{12}", commit)


def test_the_rule_gives_the_golden_answers_the_cpp_code_gives_too():
    path = os.environ["VERSION_COMPATIBILITY"]
    cases = 0
    with open(path) as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            a, b, answer = line.split()
            b = "" if b == "-" else b
            assert rebound.compatible(a, b) == (answer == "yes"), line
            assert rebound.compatible(b, a) == (answer == "yes"), line
            cases += 1
    assert cases >= 10


def test_an_incompatible_server_is_named_with_both_versions(monkeypatch):
    monkeypatch.setattr(rebound, "__version__", "0.13.0")
    assert rebound.incompatible_server("0.14.1") is None
    assert rebound.incompatible_server("") is None  # a server before 0.13 counts as 0.12.0
    why = rebound.incompatible_server("1.0.0")
    assert "this worker is rebound 0.13.0, the server is rebound 1.0.0" in why
    monkeypatch.setattr(rebound, "__version__", "0.14.0")
    assert "the server is rebound 0.12.0 or older" in rebound.incompatible_server("")
    assert "malformed" in rebound.incompatible_server("14")


def test_version_ends_flag_parsing_before_other_flags_are_checked():
    # --version wins over a flag the binary would refuse (and needs no config).
    version, _ = version_of([os.environ["REBOUND_SERVER"], "--no_such_flag=1", "--version"])
    assert version == rebound.__version__


def test_the_commit_outside_a_git_checkout_is_unknown(tmp_path):
    # The package copied away from its checkout: no tools/workspace_status.sh, no git.
    copy = tmp_path / "root"
    (copy / "python").mkdir(parents=True)
    subprocess.run(["cp", "-r", os.path.dirname(os.path.abspath(rebound.__file__)),
                    str(copy / "python")], check=True)
    (copy / "VERSION").write_text("7.8.9\n")
    env = dict(os.environ, PYTHONPATH=str(copy / "python"))
    done = subprocess.run([sys.executable, "-m", "rebound", "--version"], capture_output=True,
                          text=True, timeout=60, env=env, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "rebound 7.8.9 (commit unknown)"


def test_a_package_without_its_version_file_does_not_import(tmp_path):
    copy = tmp_path / "root"
    (copy / "python").mkdir(parents=True)
    subprocess.run(["cp", "-r", os.path.dirname(os.path.abspath(rebound.__file__)),
                    str(copy / "python")], check=True)
    env = dict(os.environ, PYTHONPATH=str(copy / "python"))
    done = subprocess.run([sys.executable, "-c", "import rebound"], capture_output=True,
                          text=True, timeout=60, env=env, cwd=str(tmp_path))
    assert done.returncode != 0
    assert "cannot read the project version" in done.stderr
    assert str(copy / "VERSION") in done.stderr
