"""Python workers against a replicated server group (docs/design.md §10.1) with crash detection
(docs/protocol.md#crash-detection), real processes on loopback (rebound.cluster.LocalServerGroup:
one etcd member, two rebound_server members): the leader SIGKILLed under Python trainers fences
none of them (the new leader starts with no sessions and gives the restart grace, and each
trainer's session thread attaches to it); then a Python trainer SIGKILLed on the new leader is
declared as a crash by its session's end, before the heartbeat timeout, and a Python spare that
joined the new leader rebuilds its slot by verified replay; every slot's syncs count once.

Needs REBOUND_SERVER (the rebound_server binary), TINY_SPEC (tests/python/tiny_spec.py) and
/usr/bin/etcd.
"""

import os
import re
import signal

from rebound.cluster import LocalServerGroup, read_log
from rebound_pb import config_pb2, rebound_pb2
from tiny_workers import wait_exit, worker

SERVER = os.environ["REBOUND_SERVER"]

TAU = 8
STEPS = 800
FAILURE_TIMEOUT_MS = 1500

JOB = """
job_id: "tiny"
model { declared_by_worker: true }
topology { replicas: 2 spares: 1 }
data { batch_size: 32 micro_batches: 2 }
easgd { sync_period: %d }
fault_tolerance { heartbeat_interval_ms: 200 failure_timeout_ms: %d }
training { max_steps: %d }
""" % (TAU, FAILURE_TIMEOUT_MS, STEPS)


def failed_workers(status):
    return [(w.name, w.state_reason) for w in status.workers if w.state == rebound_pb2.FAILED]


def standby_in_sync(status):
    return (status.group.role == rebound_pb2.GroupStatus.LEADER and
            len(status.group.standbys) == 1 and status.group.standbys[0].in_sync)


def test_python_workers_ride_out_a_failover_and_a_crash_is_declared_on_the_new_leader():
    with LocalServerGroup(SERVER, JOB, members=2) as group:
        trainers = [worker(group, "--name", "t%d" % i, "--slow-ms", "15") for i in range(2)]
        before = group.wait_for(
            lambda s: standby_in_sync(s) and all(x.step >= 3 * TAU for x in s.slots), 120,
            what="the standby in sync and 3 sync periods trained")
        old = group.kill_leader()

        # The standby takes over; the trainers follow it and go on, each as the incarnation it
        # registered with: the failover declared nobody failed.
        after = group.wait_for(
            lambda s: all(x.update_count > y.update_count
                          for x, y in zip(s.slots, before.slots)), 60,
            what="a sync of every slot applied by the new leader")
        assert group.leader() != old
        assert not failed_workers(after), failed_workers(after)
        for name in ("t0", "t1"):
            was = [w.incarnation for w in before.workers if w.name == name]
            now = [w.incarnation for w in after.workers
                   if w.name == name and w.state == rebound_pb2.ALIVE]
            assert now == was, (name, was, now)
        group.start_member(old)  # back as a standby
        # The spare joins the new leader. (A Python spare registered with the old one is unknown
        # to it, ABORTED, and exits 4 for its supervisor to start it again: docs/python.md.)
        spare = worker(group, "--name", "spare", "--role", "spare")
        group.wait_for(lambda s: any(w.name == "spare" and w.role == config_pb2.SPARE and
                                     w.state == rebound_pb2.ALIVE for w in s.workers), 60,
                       what="the spare registered with the new leader")

        # A Python trainer killed on the new leader: its session ends with the process.
        os.killpg(trainers[0].pid, signal.SIGKILL)
        declared = group.wait_for(lambda s: failed_workers(s), 30,
                                  what="the killed trainer declared failed")
        dead = [w for w in declared.workers if w.state == rebound_pb2.FAILED]
        assert [w.name for w in dead] == ["t0"], dead
        # Declared from its session's end, before the heartbeat timeout would have; its silence
        # is counted from its last contact, never negative (a new leader's grace lies ahead).
        ended = re.match(r"its session ended (\d+) ms ago ", dead[0].state_reason)
        assert ended is not None, dead[0]
        assert int(ended.group(1)) < FAILURE_TIMEOUT_MS, dead[0]
        assert 0 <= dead[0].silent_ms_at_failure, dead[0]

        try:
            done = group.wait_for(
                lambda s: all(x.state == rebound_pb2.FINISHED for x in s.slots), 240,
                what="every slot finished")
        except TimeoutError as error:
            raise AssertionError("%s\n--- spare's log:\n%s\n%s" % (
                error, read_log(spare)[-3000:], group.server_logs())) from None
        assert len(done.recoveries) == 1, done.recoveries
        assert done.recoveries[0].outcome == rebound_pb2.RECOVERED, done.recoveries[0]
        assert done.recoveries[0].verified, done.recoveries[0]
        assert [x.update_count for x in done.slots] == [STEPS // TAU] * 2, group.server_logs()
        assert [name for name, _ in failed_workers(done)] == ["t0"]
        assert wait_exit(spare, 60) == 0, read_log(spare)[-2000:]
        assert wait_exit(trainers[1], 60) == 0, read_log(trainers[1])[-2000:]
