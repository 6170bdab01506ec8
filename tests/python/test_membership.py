"""rebound.membership.Session's side of audits (docs/recovery.md#audits) against a fake server:
a real gRPC server on loopback (port 0) that answers Register and Heartbeat and records what it
gets. A session made for audits registers with `audits`; a heartbeat's PREEMPT_AUDIT stops an
audit in progress only, and one left from an earlier audit never stops the next. Every wait
bounded; the server and the session's threads are stopped.
"""

import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

import rebound
from rebound import client as rclient
from rebound import membership
from rebound.torch import wire
from rebound_pb import config_pb2, rebound_pb2, rebound_pb2_grpc

BOUND_S = 10.0


class FakeServer(rebound_pb2_grpc.ParameterServerServicer):
    """Registers every worker as a SPARE (incarnation 7, heartbeats every 20 ms) and answers
    each heartbeat with PREEMPT_AUDIT while ``preempting`` is set."""

    def __init__(self):
        self.lock = threading.Lock()
        self.registrations = []
        self.beats = 0
        self.preempting = False

    def Register(self, request, context):
        with self.lock:
            self.registrations.append(request)
        job = config_pb2.JobConfig(job_id="fake")
        job.fault_tolerance.heartbeat_interval_ms = 20
        return rebound_pb2.RegisterResponse(
            incarnation=7, role=config_pb2.SPARE, job=job, credential="c",
            server_version=rebound.__version__)

    def Heartbeat(self, request, context):
        with self.lock:
            self.beats += 1
            commands = [rebound_pb2.PREEMPT_AUDIT] if self.preempting else []
        return rebound_pb2.HeartbeatResponse(commands=commands)

    def set_preempting(self, value):
        with self.lock:
            self.preempting = value

    def beats_after(self, n):
        """Waits until n more heartbeats were answered."""
        with self.lock:
            target = self.beats + n
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            with self.lock:
                if self.beats >= target:
                    return
            time.sleep(0.005)
        raise AssertionError("fewer than %d heartbeats within %.0f s" % (n, BOUND_S))


@pytest.fixture
def fake():
    servicer = FakeServer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    rebound_pb2_grpc.add_ParameterServerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.address = "127.0.0.1:%d" % port
    yield servicer
    server.stop(grace=None)


def session_of(fake, audits):
    options = rclient.Options(server=fake.address, rpc_deadline_s=2.0, give_up_after_s=10)
    conn = rclient.Connection(options)
    model = wire.bundle_of([torch.zeros(2)], ["w"])
    session = membership.Session(conn, options, model, "spare", config_pb2.SPARE, "fake",
                                 exit_at_once=False, audits=audits)
    session.register()
    return session, conn


def test_a_session_made_for_audits_says_so_when_it_registers(fake):
    for audits in (True, False):
        _, conn = session_of(fake, audits)
        conn.close()
    assert [r.audits for r in fake.registrations] == [True, False]


def test_preempt_audit_stops_the_audit_in_progress_only(fake):
    session, conn = session_of(fake, True)
    session.start()
    try:
        # Outside an audit the command is ignored.
        fake.set_preempting(True)
        fake.beats_after(3)
        assert not session.audit_preempted()
        # During one it stops it, at the next heartbeat.
        session.begin_audit()
        deadline = time.monotonic() + BOUND_S
        while not session.audit_preempted():
            assert time.monotonic() < deadline, "PREEMPT_AUDIT not seen within %.0f s" % BOUND_S
            time.sleep(0.005)
        # The audit is over: what its command left does not stop the next one.
        session.end_audit()
        assert not session.audit_preempted()
        fake.set_preempting(False)
        fake.beats_after(2)  # no PREEMPT_AUDIT in flight any more
        session.begin_audit()
        fake.beats_after(3)
        assert not session.audit_preempted()
        session.end_audit()
    finally:
        session.stop.set()
        session.join(timeout=BOUND_S)
        conn.close()
