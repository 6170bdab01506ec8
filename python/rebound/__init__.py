"""Rebound's Python client: train your own PyTorch model on a Rebound server (docs/python.md).

The package is pure Python over Debian's python3-grpcio and python3-protobuf; the protobuf and
gRPC stubs are generated from proto/ into the sibling package ``rebound_pb`` by
``python/gen_stubs.sh`` (tools/setup.sh runs it). ``rebound.torch`` (over python3-torch) holds
what a training script uses: ``Spec``, ``run`` and the ``AdaHessian`` optimizer.

Exit codes that ``rebound.torch.run`` returns (or, with exit=True, ends the process with), the
same as ``rebound_worker``'s:
"""

import os as _os
import re as _re
import subprocess as _subprocess

# The project's one version (docs/upgrading.md): the file VERSION at the repository root, which
# Bazel bakes into the binaries too. The package is used in place (python/install.sh's .pth, or a
# Bazel test's runfiles), so the file is two directories up.
_ROOT = _os.path.normpath(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "..", ".."))


def _read_version():
    path = _os.path.join(_ROOT, "VERSION")
    try:
        with open(path) as f:
            version = f.read().strip()
    except OSError as error:
        raise ImportError("rebound: cannot read the project version from %s (%s); the package "
                          "runs from a Rebound checkout (python/install.sh)" % (path, error))
    if not version:
        raise ImportError("rebound: %s is empty" % path)
    return version


__version__ = _read_version()


def build_commit():
    """The checkout's git commit as the stamped binaries say it (tools/workspace_status.sh runs
    for both): 12 hex digits, with "-dirty" when tracked files changed; "unknown" outside a git
    checkout."""
    script = _os.path.join(_ROOT, "tools", "workspace_status.sh")
    try:
        out = _subprocess.run([script], capture_output=True, text=True, timeout=10).stdout
    except (OSError, _subprocess.SubprocessError):
        return "unknown"
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key == "STABLE_REBOUND_COMMIT" and value:
            return value
    return "unknown"


def version_line():
    """"rebound <version> (commit <commit>)", as every binary's --version prints it."""
    return "rebound %s (commit %s)" % (__version__, build_commit())


# The compatibility rule of common/version.h (docs/upgrading.md#compatibility); both are checked
# against tests/common/testdata/version_compatibility.txt.
VERSION_BEFORE_EXCHANGE = "0.12.0"  # what a peer that sends no version is taken to be
_VERSION = _re.compile(r"^([0-9]{1,9})\.([0-9]{1,9})\.([0-9]{1,9})(?:-([0-9A-Za-z.-]+))?\Z")


def parse_version(text):
    """(major, minor, patch) of "MAJOR.MINOR.PATCH[-label]"; ValueError otherwise."""
    match = _VERSION.match(text)
    if not match:
        raise ValueError('version "%s" is not MAJOR.MINOR.PATCH[-label] (e.g. "0.13.0")' % text)
    return tuple(int(match.group(i)) for i in (1, 2, 3))


def compatible(a, b):
    """Same major, minors at most one apart; a version "" is VERSION_BEFORE_EXCHANGE."""
    a = parse_version(a or VERSION_BEFORE_EXCHANGE)
    b = parse_version(b or VERSION_BEFORE_EXCHANGE)
    return a[0] == b[0] and abs(a[1] - b[1]) <= 1


def incompatible_server(server_version):
    """None when this package works with a server of `server_version` (RegisterResponse's; ""
    from a server before 0.13), else why not."""
    try:
        if compatible(__version__, server_version):
            return None
    except ValueError as error:
        return "the server sent a malformed version: %s" % error
    return ("incompatible versions: this worker is rebound %s, the server is rebound %s; "
            "versions work together when they have the same major version and their minor "
            "versions differ by at most 1 (docs/upgrading.md)"
            % (__version__, server_version or VERSION_BEFORE_EXCHANGE + " or older"))

# gRPC's backup poller every 50 ms instead of 5 s (common/grpc_polling.h): a fail-fast call on a
# reconnecting channel otherwise leaves its handshake unread for up to 5 s. Set before grpc is
# imported (gRPC reads it once); an operator's value is kept.
_os.environ.setdefault("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "50")

EXIT_OK = 0          # the job finished, or the process was stopped (SIGTERM, max_seconds)
EXIT_FAILED = 1      # an error of the process itself (e.g. a non-finite loss)
EXIT_CONFIG = 2      # the spec or the options are wrong, or do not fit the server's job
EXIT_FENCED = 3      # the server fenced this worker (declared failed, replaced, drained)
EXIT_UNREACHABLE = 4  # no contact with the server for give_up_after_s
EXIT_REJECTED = 5    # the server refused this worker (registration refused, wrong token)
