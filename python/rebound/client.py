"""The transport of the Python client: one gRPC channel to the server (and, for a center sharded
across K server groups, one to each group: ``RangeGroups``), every call with a deadline and the
worker's credential, retried by the shared backoff rule (docs/protocol.md).

Retry rule (common/retry.h, common/backoff.h): UNAVAILABLE and DEADLINE_EXCEEDED are retried
with capped exponential backoff (initial, 2x, ... up to max, each delay drawn uniformly from
[delay/2, delay]) until ``give_up_after_s`` pass without success, then ``Unreachable`` is raised.
Every other status is raised at once as ``CallError`` with its gRPC code, for the caller to map:
FAILED_PRECONDITION = fenced or refused for good, ABORTED = register again, INVALID_ARGUMENT =
malformed input, UNAUTHENTICATED / PERMISSION_DENIED = not this worker's call.

Thread-safety: a ``Connection`` is shared by the heartbeat, step-log and work threads; the
credential is set once at registration (under a lock) and read by every call.
"""

import random
import socket
import sys
import threading
import time
from concurrent import futures

import grpc

from rebound_pb import rebound_pb2_grpc, sharding_pb2_grpc

CREDENTIAL_KEY = "rebound-worker-credential"
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# The server's default max_message_bytes (ServerConfig): models up to ~60 M float32 parameters.
MAX_MESSAGE_BYTES = 268435456


# What a channel to a replicated server group needs (common/server_addresses.h, docs/design.md §10.1):
# the first member that accepts, in the list's order (only the leader listens); reconnects within
# a second; a connect timeout of 1 s (a member that accepts TCP but hangs costs ~1 s); keepalive
# pings every second, also without calls, so a hung leader's connection is dropped in ~2 s.
FAILOVER_OPTIONS = (
    ("grpc.lb_policy_name", "pick_first"),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.min_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)


def parse_server_addresses(server):
    """The entries of ``server``: one host:port, or the members of a replicated group separated
    by commas (white space around each removed). ValueError naming the entry for an empty entry,
    one that is not host:port with a port in [1, 65535], a gRPC target URI (only alone) or an
    entry given twice, as common/server_addresses.h."""
    if "," not in server:
        if not server or ":" not in server:
            raise ValueError("server must be host:port, got %r" % (server,))
        return [server.strip()]
    entries = []
    for number, raw in enumerate(server.split(","), start=1):
        entry = raw.strip()
        which = "server entry %d of %r" % (number, server)
        if not entry:
            raise ValueError("%s is empty; expected host:port addresses separated by commas"
                             % which)
        host, _, port = entry.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError("%s must be host:port with a port in [1, 65535] (a member of the "
                             "group), got %r" % (which, entry))
        bracketed = (host.startswith("[") and host.endswith("]") and len(host) > 2
                     and not any(c in host[1:-1] for c in "[]/"))
        if not bracketed and any(c in host for c in ":/[]"):
            raise ValueError("%s must be host:port with one host (an IPv6 address in brackets, "
                             "[::1]:7070; a gRPC target URI such as dns:///name:7070 only as the "
                             "single address), got %r" % (which, entry))
        if entry in entries:
            raise ValueError("%s repeats entry %d, %r" % (which, entries.index(entry) + 1, entry))
        entries.append(entry)
    return entries


def channel_target(server):
    """The gRPC target for ``server``: one address unchanged; a list with every host resolved
    now (once: a member that moves to another IP is not followed; a DNS name for the whole group
    can be given alone instead, gRPC re-resolves it) into "ipv4:A:P,B:P" when every host has an
    IPv4 address (IPv4 taken where a host has both), else "ipv6:[A]:P,..." (IPv4-only hosts as
    IPv4-mapped addresses). ValueError for a bad list, Unreachable naming a host that does not
    resolve."""
    if "," not in server:
        return server
    members = []
    for entry in parse_server_addresses(server):
        host, _, port = entry.rpartition(":")
        name = host[1:-1] if host.startswith("[") else host
        try:
            found = socket.getaddrinfo(name, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
        except socket.gaierror as error:
            raise Unreachable("cannot resolve the host %r of the server address %r: %s"
                              % (name, entry, error.strerror)) from None
        v4, v6 = [], []
        for family, _, _, _, address in found:
            into = v4 if family == socket.AF_INET else v6 if family == socket.AF_INET6 else None
            if into is not None and address[0] not in into:
                into.append(address[0])
        if not v4 and not v6:
            raise Unreachable("the host %r of the server address %r resolves to no IPv4 or IPv6 "
                              "address" % (name, entry))
        members.append((v4, v6, port))
    every_v4 = all(v4 for v4, _, _ in members)
    targets = []
    for v4, v6, port in members:
        if every_v4:
            listed = ["%s:%s" % (a, port) for a in v4]
        elif v4:
            listed = ["[::ffff:%s]:%s" % (a, port) for a in v4]
        else:
            listed = ["[%s]:%s" % (a.split("%")[0], port) for a in v6]
        targets.extend(t for t in listed if t not in targets)
    return ("ipv4:" if every_v4 else "ipv6:") + ",".join(targets)


def open_channel(server, options=()):
    """An insecure channel to ``server`` (one address or a group's list, as channel_target) with
    ``options``. For a list, FAILOVER_OPTIONS replace the options of the same keys (gRPC would
    use the first value given) and the first member's host:port is the calls' authority.
    ValueError for a bad list; Unreachable naming a member that does not resolve."""
    options = list(options)
    if "," in server:
        failover = dict(FAILOVER_OPTIONS)
        options = [option for option in options if option[0] not in failover]
        options += list(FAILOVER_OPTIONS)
        options.append(("grpc.default_authority", parse_server_addresses(server)[0]))
    return grpc.insecure_channel(channel_target(server), options=options)


def log(message):
    """One line of the client's log, on stderr."""
    sys.stderr.write("rebound-torch: %s\n" % message)
    sys.stderr.flush()


class WorkerExit(Exception):
    """Ends the worker with exit code ``code`` (rebound.EXIT_*) and the reason."""

    def __init__(self, code, reason):
        super().__init__(reason)
        self.code = code


class CallError(Exception):
    """A call the server answered with a status that is not retried; ``code`` is its gRPC code."""

    def __init__(self, method, code, details):
        super().__init__("%s: %s: %s" % (method, code.name, details))
        self.method = method
        self.code = code
        self.details = details


class Unreachable(Exception):
    """No call succeeded for give_up_after_s."""


class Backoff:
    """Capped exponential backoff with jitter, as common/backoff.h. Not thread-safe."""

    def __init__(self, initial_s, max_s, seed=None):
        self._initial = initial_s
        self._max = max_s
        self._current = initial_s
        self._rng = random.Random(seed)

    def next(self):
        base = self._current
        self._current = min(self._max, self._current * 2)
        return base * self._rng.uniform(0.5, 1.0)

    def reset(self):
        self._current = self._initial


class Options:
    """How a worker talks to the server (the fields of WorkerConfig that apply to Python).
    ``server``: host:port, or the members of a replicated group separated by commas
    (parse_server_addresses); the Connection then follows the group's leader (open_channel)."""

    def __init__(self, server="127.0.0.1:7070", token="", rpc_deadline_s=10.0,
                 backoff_initial_s=0.1, backoff_max_s=5.0, give_up_after_s=120.0):
        parse_server_addresses(server)
        for name, value in (("rpc_deadline_s", rpc_deadline_s),
                            ("backoff_initial_s", backoff_initial_s),
                            ("backoff_max_s", backoff_max_s)):
            if not value > 0:
                raise ValueError("%s must be > 0, got %r" % (name, value))
        if backoff_max_s < backoff_initial_s:
            raise ValueError("backoff_max_s must be >= backoff_initial_s")
        if not give_up_after_s >= 0:
            raise ValueError("give_up_after_s must be >= 0, got %r" % (give_up_after_s,))
        self.server = server
        self.token = token
        self.rpc_deadline_s = float(rpc_deadline_s)
        self.backoff_initial_s = float(backoff_initial_s)
        self.backoff_max_s = float(backoff_max_s)
        self.give_up_after_s = float(give_up_after_s)


class Connection:
    """A channel, a stub and the worker's credential."""

    def __init__(self, options):
        self.options = options
        self._channel = open_channel(options.server, options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ])
        self.stub = rebound_pb2_grpc.ParameterServerStub(self._channel)
        self._lock = threading.Lock()
        self._credential = ""

    @property
    def channel(self):
        return self._channel

    def close(self):
        self._channel.close()

    def set_credential(self, credential):
        with self._lock:
            self._credential = credential

    def metadata(self):
        with self._lock:
            credential = self._credential
        md = []
        if credential:
            md.append((CREDENTIAL_KEY, credential))
        if self.options.token:
            md.append(("authorization", self.options.token))
        return md

    def call(self, method, request, deadline_s=None, retry=True, stop=None):
        """Calls the unary ``method`` (a name of ParameterServer) with a deadline; retries
        UNAVAILABLE and DEADLINE_EXCEEDED (when ``retry``) until give_up_after_s. Raises
        CallError, Unreachable, or ``Stopped`` when the ``stop`` event is set while waiting."""
        return call_with_retry(self, getattr(self.stub, method), method, request,
                               deadline_s=deadline_s, retry=retry, stop=stop)

    def stream(self, method, request, deadline_s=None):
        """A server-streaming call (ReadLog): the list of its messages. Not retried here (the
        caller retries the whole read). Raises CallError."""
        fn = getattr(self.stub, method)
        deadline_s = self.options.rpc_deadline_s if deadline_s is None else deadline_s
        try:
            return list(fn(request, timeout=deadline_s, metadata=self.metadata()))
        except grpc.RpcError as error:
            raise CallError(method, error.code(), error.details()) from None

    def bidi_once(self, method, request, deadline_s=None):
        """One request on a bidirectional stream (AppendLog) and its first reply. Raises
        CallError."""
        fn = getattr(self.stub, method)
        deadline_s = self.options.rpc_deadline_s if deadline_s is None else deadline_s
        try:
            replies = fn(iter([request]), timeout=deadline_s, metadata=self.metadata())
            for reply in replies:
                replies.cancel()
                return reply
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED:
                raise CallError(method, grpc.StatusCode.UNAVAILABLE, "cancelled") from None
            raise CallError(method, error.code(), error.details()) from None
        raise CallError(method, grpc.StatusCode.UNAVAILABLE, "the stream ended without a reply")


class Stopped(Exception):
    """The worker was asked to stop while a call waited."""


def call_with_retry(conn, fn, what, request, deadline_s=None, retry=True, stop=None):
    """Connection.call's rule for the unary stub method ``fn`` of any channel: every attempt
    under ``conn``'s deadline, credential and token; ``what`` names the call in errors."""
    options = conn.options
    deadline_s = options.rpc_deadline_s if deadline_s is None else deadline_s
    backoff = Backoff(options.backoff_initial_s, options.backoff_max_s)
    give_up = time.monotonic() + options.give_up_after_s
    while True:
        try:
            return fn(request, timeout=deadline_s, metadata=conn.metadata())
        except grpc.RpcError as error:
            code = error.code()
            if not retry or code not in RETRYABLE:
                raise CallError(what, code, error.details()) from None
            if time.monotonic() >= give_up:
                raise Unreachable("%s failed for %.0f s: %s: %s" % (
                    what, options.give_up_after_s, code.name, error.details())) from None
            delay = backoff.next()
            if stop is not None:
                if stop.wait(delay):
                    raise Stopped("stopped while retrying %s" % what) from None
            else:
                time.sleep(delay)


class RangeGroups:
    """The K server groups of a sharded job (docs/sharding.md), for the CenterRange calls of a
    worker registered through ``conn`` (group 0): one channel per group (a replicated group's
    entry lists its members, open_channel follows its leader), every call with ``conn``'s
    credential, token, deadline and retry rule (call_with_retry), the K groups called at once on
    K threads of a pool this object owns (``close`` ends them).

    ``addresses``: RegisterResponse.range_addresses, group k's at index k; ValueError for fewer
    than two or a bad entry. Thread-safety: thread-safe (gRPC stubs, a pool)."""

    def __init__(self, conn, addresses):
        if len(addresses) < 2:
            raise ValueError("a sharded center has at least 2 range groups, the server named %d"
                             % len(addresses))
        for address in addresses:
            parse_server_addresses(address)
        self._conn = conn
        self.addresses = list(addresses)
        self._channels = [open_channel(address, options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]) for address in self.addresses]
        self._stubs = [sharding_pb2_grpc.CenterRangeStub(c) for c in self._channels]
        self._pool = futures.ThreadPoolExecutor(max_workers=len(self.addresses),
                                                thread_name_prefix="rebound-range")

    @property
    def groups(self):
        return len(self._stubs)

    def call(self, k, method, request, stop=None):
        """CenterRange ``method`` at group k, as Connection.call; errors name the range."""
        return call_with_retry(self._conn, getattr(self._stubs[k], method),
                               "%s of range %d" % (method, k), request, stop=stop)

    def each(self, fn):
        """[fn(0), ..., fn(K - 1)], run at once on the pool. Once every call has returned,
        raises the exception of the lowest range that raised one."""
        running = [self._pool.submit(fn, k) for k in range(self.groups)]
        futures.wait(running)
        return [f.result() for f in running]

    def close(self):
        self._pool.shutdown(wait=True)
        for channel in self._channels:
            channel.close()
