"""A local Rebound cluster on loopback for tests, benchmarks and demos of the Python client: the
real ``rebound_server`` binary on port 0 and Python worker processes, every process started in
its own session and killed (process group) on ``close()``.

    with LocalServer(server_binary, job_text) as server:
        worker = server.start_worker([sys.executable, "train.py", "--server", server.address])
        ...

A job whose center is sharded across K server groups (docs/sharding.md) runs on
``LocalShardedServers(server_binary, job_text, K)``: K servers, each with the job plus
``sharding { groups: K }`` and its own ``shard`` block; workers are pointed at group 0.
A replicated server group (docs/design.md §10.1) runs on ``LocalServerGroup(server_binary,
job_text, members)``: one etcd member and the servers, workers given every member's address.

Bounded: ``LocalServer`` waits at most ``start_timeout_s`` for the server's port file; every
``wait`` takes a timeout; ``close()`` sends SIGTERM, waits ``grace_s``, then SIGKILL.
"""

import os
import signal
import socket
import subprocess
import tempfile
import time

import grpc

from rebound_pb import rebound_pb2, rebound_pb2_grpc


class _LocalProcesses:
    """What LocalServer and LocalServerGroup share: the workers they start (in ``self.dir``),
    waits on their ``status()``, and cleanup (``close()``, then the directory) as a context."""

    def wait_for(self, predicate, timeout_s, poll_s=0.2, what="condition"):
        """Polls status() until predicate(status) is true; the status. TimeoutError after
        timeout_s."""
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            try:
                last = self.status()
                if predicate(last):
                    return last
            except grpc.RpcError:
                pass
            time.sleep(poll_s)
        raise TimeoutError("%s not reached within %.0f s; last status:\n%s" % (
            what, timeout_s, last))

    def start_worker(self, argv, log_path=None, env=None):
        log_path = log_path or os.path.join(self.dir, "worker-%d.log" % len(self.workers))
        log = open(log_path, "ab")
        worker = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True, env=env)
        log.close()
        worker.log_path = log_path
        self.workers.append(worker)
        return worker

    def cleanup(self):
        self.close()
        self._tmp.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cleanup()


class LocalServer(_LocalProcesses):
    """One rebound_server. ``port``: 0 for any (the server reports it), else the port to listen
    on (a sharded job's groups must know each other's addresses before they start)."""

    def __init__(self, binary, job_text, data_dir=None, start_timeout_s=30.0, extra_server="",
                 log_path=None, port=0):
        self._tmp = tempfile.TemporaryDirectory(prefix="rebound-py-")
        self.dir = self._tmp.name
        self.data_dir = data_dir or os.path.join(self.dir, "data")
        self.binary = binary
        self.job_text = job_text
        self.extra_server = extra_server
        self.start_timeout_s = start_timeout_s
        self.log_path = log_path or os.path.join(self.dir, "server.log")
        self.workers = []
        self.server = None
        # More command-line flags for the server's next start (e.g. ["--restore_from", DIR]).
        self.server_args = []
        self.address = "127.0.0.1:%d" % port if port else None
        self.start()

    def start(self):
        config = os.path.join(self.dir, "server.pbtxt")
        with open(config, "w") as f:
            # A restart keeps the port, so that running workers find the server again (a fixed
            # port is kept from the start).
            port = self.address.rsplit(":", 1)[1] if self.address else "0"
            f.write('listen_address: "127.0.0.1:%s"\n' % port)
            f.write('durability { data_dir: "%s" }\n' % self.data_dir)
            f.write("metrics { enabled: false }\n")
            f.write(self.extra_server + "\n")
            f.write("job {\n%s\n}\n" % self.job_text)
        port_file = os.path.join(self.dir, "port")
        if os.path.exists(port_file):
            os.unlink(port_file)
        log = open(self.log_path, "ab")
        self.server = subprocess.Popen(
            [self.binary, "--config", config, "--port_file", port_file, "--logtostderr",
             *self.server_args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise RuntimeError("rebound_server exited with %d; its log: %s\n%s" % (
                    self.server.returncode, self.log_path, self.server_log()[-3000:]))
            if os.path.exists(port_file):
                with open(port_file) as f:
                    port = f.read().strip()
                if port:
                    self.address = "127.0.0.1:%s" % port
                    self._wait_serving(deadline)
                    return
            time.sleep(0.05)
        self.close()
        raise RuntimeError("rebound_server did not report its port within %.0f s" %
                           self.start_timeout_s)

    def _wait_serving(self, deadline):
        channel = grpc.insecure_channel(self.address)
        stub = rebound_pb2_grpc.ParameterServerStub(channel)
        try:
            while time.monotonic() < deadline:
                try:
                    stub.GetStatus(rebound_pb2.GetStatusRequest(), timeout=2.0)
                    return
                except grpc.RpcError:
                    time.sleep(0.05)
        finally:
            channel.close()

    def server_log(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def status(self, timeout_s=5.0):
        channel = grpc.insecure_channel(self.address)
        try:
            return rebound_pb2_grpc.ParameterServerStub(channel).GetStatus(
                rebound_pb2.GetStatusRequest(), timeout=timeout_s)
        finally:
            channel.close()

    def kill_server(self):
        _kill(self.server, signal.SIGKILL, 0)

    def close(self, grace_s=5.0):
        for worker in self.workers:
            _kill(worker, signal.SIGTERM, grace_s)
        if self.server is not None:
            _kill(self.server, signal.SIGTERM, grace_s)


def free_port():
    """A loopback port that was free a moment ago (bound to port 0 and closed). Another process
    may take it before it is used: for tests on a machine of their own."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalShardedServers:
    """The K server groups of one sharded job (one rebound_server each) on loopback ports chosen
    in advance (free_port): group k's config has ``job_text`` plus ``sharding { groups: K }`` and
    ``shard { group: k group_addresses: <group 0> ... <group K - 1> }``. ``groups[k]`` is group
    k's LocalServer; ``address``, ``status``, ``wait_for`` and ``start_worker`` are group 0's
    (the coordinator workers register with). ``close()`` stops the workers, then every group."""

    def __init__(self, binary, job_text, groups, start_timeout_s=30.0, extra_server=""):
        if groups < 2:
            raise ValueError("a sharded job has at least 2 groups, got %d" % groups)
        ports = []
        while len(ports) < groups:
            port = free_port()
            if port not in ports:
                ports.append(port)
        self.addresses = ["127.0.0.1:%d" % port for port in ports]
        sharded_job = "%s\nsharding { groups: %d }" % (job_text, groups)
        self.groups = []
        try:
            for k, port in enumerate(ports):
                shard = "shard {\n  group: %d\n%s}" % (k, "".join(
                    '  group_addresses: "%s"\n' % address for address in self.addresses))
                self.groups.append(LocalServer(
                    binary, sharded_job, start_timeout_s=start_timeout_s, port=port,
                    extra_server="%s\n%s" % (extra_server, shard)))
        except BaseException:
            self.cleanup()
            raise
        self.coordinator = self.groups[0]
        self.address = self.coordinator.address

    @property
    def workers(self):
        return self.coordinator.workers

    def status(self, timeout_s=5.0):
        return self.coordinator.status(timeout_s)

    def wait_for(self, predicate, timeout_s, poll_s=0.2, what="condition"):
        return self.coordinator.wait_for(predicate, timeout_s, poll_s, what)

    def start_worker(self, argv, log_path=None, env=None):
        return self.coordinator.start_worker(argv, log_path, env)

    def server_logs(self, tail=3000):
        """Every group's log, its last ``tail`` characters each, for a failing test's message."""
        return "\n".join("--- group %d (%s) ---\n%s" % (k, group.log_path,
                                                         group.server_log()[-tail:])
                         for k, group in enumerate(self.groups))

    def close(self, grace_s=5.0):
        # Group 0 first with the workers (its close stops them), then the range groups.
        for group in self.groups:
            group.close(grace_s)

    def cleanup(self):
        for group in self.groups:
            group.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cleanup()


class LocalServerGroup(_LocalProcesses):
    """A replicated server group (docs/design.md §10.1) on loopback: one etcd member
    (``etcd_binary``) and ``members`` rebound_server processes, each on a port chosen in advance
    with its own data directory, ``replication`` with ``members - 1`` standbys. Only the leader
    listens for workers: ``address`` lists every member (the workers' --server), ``status`` and
    ``wait_for`` ask whoever leads. ``kill_leader`` SIGKILLs the leading member, ``start_member``
    starts a member again on its data directory (it rejoins as a standby). ``close()`` stops
    the workers, the members, then etcd; ``cleanup()`` also removes the directory.

    Bounded: etcd must serve within ``start_timeout_s``, a member must lead within it."""

    def __init__(self, binary, job_text, members=2, etcd_binary="/usr/bin/etcd",
                 start_timeout_s=30.0, lease_ms=2000, extra_server=""):
        if members < 2:
            raise ValueError("a replicated group has at least 2 members, got %d" % members)
        if not os.access(etcd_binary, os.X_OK):
            raise RuntimeError("%s is missing: install etcd-server (tools/setup.sh)" % etcd_binary)
        self._tmp = tempfile.TemporaryDirectory(prefix="rebound-py-group-")
        self.dir = self._tmp.name
        self.binary = binary
        self.workers = []
        self.start_timeout_s = start_timeout_s
        ports = []
        while len(ports) < members + 2:
            port = free_port()
            if port not in ports:
                ports.append(port)
        client_url = "http://127.0.0.1:%d" % ports[0]
        peer_url = "http://127.0.0.1:%d" % ports[1]
        self._etcd_log = os.path.join(self.dir, "etcd.log")
        with open(self._etcd_log, "ab") as log:
            self.etcd = subprocess.Popen(
                [etcd_binary, "--name", "m0", "--data-dir", os.path.join(self.dir, "etcd"),
                 "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                 "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                 "--initial-cluster", "m0=" + peer_url, "--initial-cluster-state", "new",
                 "--heartbeat-interval", "50", "--election-timeout", "500",
                 "--log-level", "warn", "--logger", "zap"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.addresses = ["127.0.0.1:%d" % port for port in ports[2:]]
        self.address = ",".join(self.addresses)
        self.names = ["server-%d" % i for i in range(members)]
        self.servers = [None] * members
        self.log_paths = [os.path.join(self.dir, name + ".log") for name in self.names]
        self._configs = []
        for i, name in enumerate(self.names):
            config = os.path.join(self.dir, name + ".pbtxt")
            with open(config, "w") as f:
                f.write('listen_address: "%s"\n' % self.addresses[i])
                f.write('durability { data_dir: "%s" }\n' % os.path.join(self.dir, name))
                f.write("metrics { enabled: false }\n")
                f.write('replication {\n  etcd_endpoints: "127.0.0.1:%d"\n  standbys: %d\n'
                        '  leader_lease_ms: %d\n  name: "%s"\n'
                        '  peer_listen_address: "127.0.0.1:0"\n}\n'
                        % (ports[0], members - 1, lease_ms, name))
                f.write(extra_server + "\n")
                f.write("job {\n%s\n}\n" % job_text)
            self._configs.append(config)
        try:
            self._wait_etcd(time.monotonic() + start_timeout_s, ports[0])
            for i in range(members):
                self.start_member(i)
            self.wait_for(lambda s: s.group.role == rebound_pb2.GroupStatus.LEADER,
                          start_timeout_s, what="a member leading")
        except BaseException:
            self.cleanup()
            raise

    def _wait_etcd(self, deadline, port):
        while time.monotonic() < deadline:
            if self.etcd.poll() is not None:
                raise RuntimeError("etcd exited with %d; its log: %s" % (
                    self.etcd.returncode, self._etcd_log))
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("etcd did not listen within the start timeout")

    def start_member(self, i):
        """Starts member ``i`` on its data directory (again, after a kill)."""
        with open(self.log_paths[i], "ab") as log:
            self.servers[i] = subprocess.Popen(
                [self.binary, "--config", self._configs[i], "--peer_port_file",
                 os.path.join(self.dir, "peer-port-%d" % i), "--logtostderr"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def leader(self, timeout_s=2.0):
        """The index of the member that answers GetStatus as LEADER, or None."""
        for i, address in enumerate(self.addresses):
            if self.servers[i] is None or self.servers[i].poll() is not None:
                continue
            channel = grpc.insecure_channel(address)
            try:
                status = rebound_pb2_grpc.ParameterServerStub(channel).GetStatus(
                    rebound_pb2.GetStatusRequest(), timeout=timeout_s)
                if status.group.role == rebound_pb2.GroupStatus.LEADER:
                    return i
            except grpc.RpcError:
                pass
            finally:
                channel.close()
        return None

    def status(self, timeout_s=5.0):
        """GetStatus from the leading member; grpc.RpcError (UNAVAILABLE) when none leads."""
        last = None
        for address in self.addresses:
            channel = grpc.insecure_channel(address)
            try:
                status = rebound_pb2_grpc.ParameterServerStub(channel).GetStatus(
                    rebound_pb2.GetStatusRequest(), timeout=timeout_s)
                if status.group.role == rebound_pb2.GroupStatus.LEADER:
                    return status
            except grpc.RpcError as error:
                last = error
            finally:
                channel.close()
        if last is not None:
            raise last
        raise _NoLeader()

    def kill_leader(self):
        """SIGKILLs the leading member: its index. RuntimeError when none leads."""
        i = self.leader()
        if i is None:
            raise RuntimeError("no member leads")
        _kill(self.servers[i], signal.SIGKILL, 0)
        return i

    def server_logs(self, tail=3000):
        """Every member's log, its last ``tail`` characters each, for a failing test's message."""
        out = []
        for name, path in zip(self.names, self.log_paths):
            try:
                with open(path, errors="replace") as f:
                    text = f.read()[-tail:]
            except OSError:
                text = ""
            out.append("--- %s (%s) ---\n%s" % (name, path, text))
        return "\n".join(out)

    def close(self, grace_s=5.0):
        for worker in self.workers:
            _kill(worker, signal.SIGTERM, grace_s)
        for server in self.servers:
            _kill(server, signal.SIGTERM, grace_s)
        _kill(self.etcd, signal.SIGTERM, grace_s)


class _NoLeader(grpc.RpcError):
    """No member of a LocalServerGroup answered as its leader."""


def _kill(process, sig, grace_s):
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=grace_s if grace_s > 0 else 5)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=5)


def read_log(process):
    with open(process.log_path, errors="replace") as f:
        return f.read()
