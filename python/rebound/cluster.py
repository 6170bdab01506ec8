"""A local Rebound cluster on loopback for tests, benchmarks and demos of the Python client: the
real ``rebound_server`` binary on port 0 and Python worker processes, every process started in
its own session and killed (process group) on ``close()``.

    with LocalServer(server_binary, job_text) as server:
        worker = server.start_worker([sys.executable, "train.py", "--server", server.address])
        ...

Bounded: ``LocalServer`` waits at most ``start_timeout_s`` for the server's port file; every
``wait`` takes a timeout; ``close()`` sends SIGTERM, waits ``grace_s``, then SIGKILL.
"""

import os
import signal
import subprocess
import tempfile
import time

import grpc

from rebound_pb import rebound_pb2, rebound_pb2_grpc


class LocalServer:

    def __init__(self, binary, job_text, data_dir=None, start_timeout_s=30.0, extra_server="",
                 log_path=None):
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
        self.address = None
        self.start()

    def start(self):
        config = os.path.join(self.dir, "server.pbtxt")
        with open(config, "w") as f:
            # A restart keeps the port, so that running workers find the server again.
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
            [self.binary, "--config", config, "--port_file", port_file, "--logtostderr"],
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

    def wait_for(self, predicate, timeout_s, poll_s=0.2, what="condition"):
        """Polls GetStatus until predicate(status) is true; the status. TimeoutError after
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

    def kill_server(self):
        _kill(self.server, signal.SIGKILL, 0)

    def close(self, grace_s=5.0):
        for worker in self.workers:
            _kill(worker, signal.SIGTERM, grace_s)
        if self.server is not None:
            _kill(self.server, signal.SIGTERM, grace_s)

    def cleanup(self):
        self.close()
        self._tmp.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cleanup()


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
