"""Audit replay with Python workers (docs/recovery.md#audits) against a real rebound_server on
loopback: idle Python spares replay live Python trainers' sync windows and compare every step's
checksum with the log. One trainer flips bit 12 of one parameter right after step 50, before that
step's checksum is logged (REBOUND_FAULT_FLIP_BIT_AT_STEP, rebound.torch.injected_faults): no
crash, no NaN. Every window is audited (fraction 1). What is checked, from the server's status:
the mismatch found at that step and in that tensor, confirmed by a second replay on the other
spare and charged to that trainer alone; the fault-free trainer's audits all match; so with the
center sharded across two server groups (a window's start read from both ranges). A second case
kills a trainer while the spare audits: the audit is preempted and the slot replayed.

Needs REBOUND_SERVER (the rebound_server binary) and TINY_SPEC (tests/python/tiny_spec.py).
"""

import os
import re
import signal
import sys
import time

import pytest

from rebound.cluster import LocalServer, LocalShardedServers, read_log
from rebound.torch import injected_faults
from rebound_pb import config_pb2, rebound_pb2
from tiny_workers import SPEC, tiny_model_bundle

SERVER = os.environ["REBOUND_SERVER"]

SYNC_PERIOD = 20
CORRUPT_STEP = 50  # in the trainer's third sync window, (40, 60]

# Long enough that the audits run while the job trains (a spare stops when the job is
# finished); the test ends once it has the verdict.
JOB = """
job_id: "tiny"
model { declared_by_worker: true }
topology { replicas: 2 }
data { batch_size: 32 micro_batches: 2 }
easgd { sync_period: %d }
fault_tolerance { policy: REPLAY heartbeat_interval_ms: 200 failure_timeout_ms: 3000 }
step_log { linger_ms: 20 }
training { max_steps: 1000000 }
audit { fraction: 1 max_concurrent: 4 on_mismatch: AUDIT_REPORT }
""" % SYNC_PERIOD


def confirmed_audit(status):
    """The second replay of a window that carries the verdict AUDIT_CONFIRMED, or None."""
    for a in status.audits:
        if a.confirms != 0 and a.verdict == rebound_pb2.AUDIT_CONFIRMED:
            return a
    return None


# groups 2: the center sharded across two server groups, whose window starts group 0 reads from
# both ranges (docs/recovery.md#audits); a start read wrong would differ at the window's first
# step, for the fault-free trainer too.
@pytest.mark.parametrize("groups", [1, 2])
def test_a_python_trainer_that_flips_a_bit_is_caught_by_python_spares_and_confirmed(groups):
    # Which parameter the flip corrupts: the C++ worker's rule over the declared parameters.
    declared = tiny_model_bundle().tensors
    which, index = injected_faults.flip_target(
        CORRUPT_STEP, [len(t.data) // 4 for t in declared])
    flipped_tensor = declared[which].name

    cluster = (LocalServer(SERVER, JOB) if groups == 1
               else LocalShardedServers(SERVER, JOB, groups))
    with cluster as server:
        def start(name, *args, env=None):
            return server.start_worker(
                [sys.executable, SPEC, "--server", server.address, "--name", name] + list(args),
                env=env)

        # Both spares wait before the first window is chosen: a second replay goes to the
        # spare that did not make the first only if it asks within 2 s (else to the same one).
        spares = [start("spare-%d" % i, "--role", "spare") for i in (1, 2)]
        server.wait_for(lambda s: sum(w.role == config_pb2.SPARE for w in s.workers) == 2, 60,
                        what="both spares registered")
        # The trainers sleep 5 ms per batch: the spares (which do not) keep up with some of
        # their windows on a 2-core machine.
        good = start("good", "--slow-ms", "5")
        bad = start("bad", "--slow-ms", "5", env=dict(
            os.environ, **{injected_faults.AT_STEP_VARIABLE: str(CORRUPT_STEP)}))

        status = server.wait_for(
            lambda s: confirmed_audit(s) is not None and any(
                a.worker == "good" and a.result == rebound_pb2.AUDIT_MATCHED and a.from_step > 0
                for a in s.audits), 120,
            what="a confirmed mismatch and a matching audit of the fault-free trainer from a "
                 "synced start")
        assert bad.poll() is None and good.poll() is None  # AUDIT_REPORT: both train on

        bad_log = read_log(bad)
        assert ("fault injection: flipped bit 12 of parameter %d of tensor %s after step %d" % (
            index, flipped_tensor, CORRUPT_STEP)) in bad_log, bad_log[-3000:]

        confirmed = confirmed_audit(status)
        assert confirmed.worker == "bad", status
        assert confirmed.result == rebound_pb2.AUDIT_MISMATCHED, confirmed
        # The window that holds the flipped step, replayed from its (uncorrupted) snapshot,
        # first differs at that step, in that tensor.
        assert confirmed.from_step == (CORRUPT_STEP // SYNC_PERIOD) * SYNC_PERIOD, confirmed
        assert confirmed.to_step == confirmed.from_step + SYNC_PERIOD, confirmed
        mismatch = confirmed.mismatch
        assert mismatch.step == CORRUPT_STEP, confirmed
        assert mismatch.logged_checksum != mismatch.replayed_checksum, confirmed
        assert (mismatch.tensor_index, mismatch.tensor_name) == (which, flipped_tensor), confirmed
        # Confirmed by the other spare: the first replay's record names the first auditor, at
        # the same step with the same replayed checksum.
        first = [a for a in status.audits if a.audit_id == confirmed.confirms]
        assert len(first) == 1, status
        first = first[0]
        assert first.verdict == rebound_pb2.AUDIT_CONFIRMED, first
        assert first.result == rebound_pb2.AUDIT_MISMATCHED, first
        assert first.mismatch.step == CORRUPT_STEP, first
        assert first.mismatch.replayed_checksum == mismatch.replayed_checksum, first
        assert first.mismatch.tensor_name == flipped_tensor, first
        assert {first.auditor_name, confirmed.auditor_name} == {"spare-1", "spare-2"}, status

        counts = status.audit_counts
        assert counts.confirmed == 1, counts
        assert counts.auditor_faults == 0, counts
        assert counts.inconclusive == 0, counts
        assert dict(counts.confirmed_by_worker) == {"bad": 1}, counts
        assert counts.steps_audited >= 2 * SYNC_PERIOD, counts

        # The fault-free trainer: every one of its windows a spare replayed matched the log.
        for a in status.audits:
            if a.worker != "good" or not a.HasField("result"):
                continue  # waiting or running
            assert a.result == rebound_pb2.AUDIT_MATCHED, a
            assert a.verdict == rebound_pb2.AUDIT_CLEAN, a
        # Of the bad trainer's windows, only the one with the flip, (40, 60], differed.
        for a in status.audits:
            if a.worker == "bad" and a.result == rebound_pb2.AUDIT_MISMATCHED:
                assert (a.from_step, a.mismatch.step) == (40, CORRUPT_STEP), a

        # The machine is charged (its fault score follows its name), the other one is not.
        scores = {w.name: w.fault_score for w in status.workers if w.role == config_pb2.TRAINER}
        assert scores["bad"] > 0 and scores["good"] == 0, status.workers

        # The spares said what they found, and took nothing over.
        spare_logs = [read_log(p) for p in spares]
        assert all(p.poll() is None for p in spares)
        assert any(re.search(r"audit \d+ of trainer 'bad': AUDIT_MISMATCHED: step %d: tensor "
                             r"%d '%s' differs" % (CORRUPT_STEP, which, re.escape(flipped_tensor)),
                             log) for log in spare_logs), spare_logs[0][-2000:]
        assert not any("took over" in log for log in spare_logs)


# Full tier (tools/test.sh --full: audit_test_full): the server's side of preemption is
# tests/integration/audit_test's, the spare's flag membership_test's.
@pytest.mark.full
def test_an_audit_gives_its_python_spare_back_when_a_trainer_dies():
    """PREEMPT_AUDIT: a spare replaying an audit when a slot loses its trainer stops before its
    next step, reports AUDIT_PREEMPTED, and rebuilds the slot by verified replay."""
    with LocalServer(SERVER, JOB) as server:
        def start(name, *args):
            return server.start_worker(
                [sys.executable, SPEC, "--server", server.address, "--name", name] + list(args))

        # The spare sleeps 100 ms per batch: an audit of a 20-step window takes 2 s, far longer
        # than the trainer's crash detection (crash_confirm_ms) and a heartbeat interval.
        spare = start("spare", "--role", "spare", "--slow-ms", "100")
        server.wait_for(lambda s: any(w.role == config_pb2.SPARE for w in s.workers), 60,
                        what="the spare registered")
        trainers = {name: start(name, "--slow-ms", "5") for name in ("a", "b")}
        server.wait_for(lambda s: s.audit_counts.matched >= 1, 90, what="an audit matched")

        def running(status):
            return {a.audit_id for a in status.audits
                    if a.auditor_name == "spare" and not a.HasField("result")}

        # Kill a trainer just after the spare started an audit: most of it is still ahead.
        before = running(server.status())
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "the spare started no other audit in 60 s"
            now = running(server.status())
            if now - before:
                break
            before = now
            time.sleep(0.02)
        os.killpg(trainers["b"].pid, signal.SIGKILL)

        status = server.wait_for(
            lambda s: any(r.HasField("outcome") for r in s.recoveries), 60,
            what="the recovery's outcome")
        recovery = status.recoveries[0]
        assert recovery.outcome == rebound_pb2.RECOVERED and recovery.verified, recovery
        preempted = [a for a in status.audits if a.result == rebound_pb2.AUDIT_PREEMPTED]
        assert len(preempted) == 1 and preempted[0].auditor_name == "spare", status
        counts = status.audit_counts
        assert counts.preempted == 1, counts
        assert counts.mismatched == 0 and counts.incomplete == 0, counts
        log = read_log(spare)
        assert "the server needs this spare for a recovery: stopping the audit" in log, log[-3000:]
        assert re.search(r"AUDIT_PREEMPTED: preempted after \d+ of 20 steps", log), log[-3000:]
        assert "verified" in log, log[-3000:]
