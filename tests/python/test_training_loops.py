"""Training loops beyond the examples' (issue R18) against a real rebound_server: optimizers
other than AdaHessian, Adam, AdamW and SGD replayed bit for bit after a SIGKILL. Real processes,
really killed; every wait bounded; LocalServer kills what it started.

Needs REBOUND_SERVER (the rebound_server binary) and TINY_SPEC (tests/python/tiny_spec.py).
"""

import os
import re
import signal
import time

import pytest
import torch

from rebound.cluster import LocalServer, read_log
from rebound_pb import rebound_pb2
from tiny_workers import wait_exit, worker

SERVER = os.environ["REBOUND_SERVER"]

JOB = """
job_id: "tiny"
model { declared_by_worker: true }
topology { replicas: %(replicas)d spares: 1 }
data { batch_size: 32 micro_batches: 2 }
easgd { sync_period: %(tau)d }
fault_tolerance { heartbeat_interval_ms: 200 failure_timeout_ms: 1000 }
training { max_steps: %(steps)d eval_every_ms: 300 }
"""


def job(replicas=1, tau=20, steps=200):
    return JOB % dict(replicas=replicas, tau=tau, steps=steps)


def kill_past_a_snapshot(server, trainer, logged=4, snapshot=20):
    """SIGKILLs the one trainer once its log runs ``logged`` steps past a snapshot at step
    ``snapshot`` or later; the recovery's status once it has an outcome."""
    server.wait_for(lambda s: s.slots[0].snapshot_step >= snapshot and
                    s.slots[0].logged_step - s.slots[0].snapshot_step >= logged, 60,
                    what="%d logged steps past a snapshot" % logged)
    os.killpg(trainer.pid, signal.SIGKILL)
    status = server.wait_for(lambda s: any(r.HasField("outcome") for r in s.recoveries), 60,
                             what="the recovery's outcome")
    return status.recoveries[0]


@pytest.mark.parametrize("optimizer", ["rmsprop", "adagrad"])
def test_a_kill_under_another_torch_optimizer_is_replayed_and_verified(optimizer):
    """RMSprop (centered, with momentum: three state tensors) and Adagrad (its state made in
    the constructor): the spare restores the state from the snapshot, every replayed step
    matches the trainer's checksum, and the spare finishes the job as the slot's trainer."""
    with LocalServer(SERVER, job()) as server:
        trainer = worker(server, "--name", "t0", "--slow-ms", "15", "--optimizer", optimizer)
        spare = worker(server, "--name", "spare", "--role", "spare", "--optimizer", optimizer)
        recovery = kill_past_a_snapshot(server, trainer)
        assert recovery.outcome == rebound_pb2.RECOVERED, recovery
        assert recovery.verified
        assert recovery.steps_replayed >= 4
        server.wait_for(lambda s: s.slots[0].state == rebound_pb2.FINISHED, 60,
                        what="the slot finished")
        assert wait_exit(spare, 30) == 0
        assert "verified" in read_log(spare)


def test_sigterm_and_sigint_deregister_and_exit_0_without_half_a_step():
    """A trainer's SIGTERM: it finishes the step in progress, ships its log, deregisters
    (DEPARTED, not FAILED) and exits 0 within a few seconds; a spare then replays its slot to the
    last step it logged, verified bit for bit: no step was left half-applied. An evaluator's
    SIGINT (Ctrl-C): the same clean exit, no KeyboardInterrupt."""
    with LocalServer(SERVER, job(steps=600)) as server:
        trainer = worker(server, "--name", "t0", "--slow-ms", "15")
        evaluator = worker(server, "--name", "eval", "--role", "evaluator")
        server.wait_for(lambda s: s.slots[0].snapshot_step >= 20 and
                        s.HasField("last_eval"), 60, what="a snapshot and an evaluation")
        spare = worker(server, "--name", "spare", "--role", "spare")
        server.wait_for(lambda s: any(w.name == "spare" for w in s.workers), 30,
                        what="the spare registered")
        os.killpg(evaluator.pid, signal.SIGINT)
        os.killpg(trainer.pid, signal.SIGTERM)
        signalled = time.monotonic()
        assert wait_exit(trainer, 10) == 0, read_log(trainer)
        assert wait_exit(evaluator, 10) == 0
        assert time.monotonic() - signalled < 10
        assert "SIGTERM: stopping after the current step" in read_log(trainer)
        assert "SIGINT: stopping after the current step" in read_log(evaluator)
        assert "Traceback" not in read_log(evaluator) + read_log(trainer)
        states = {w.name: w.state for w in server.status().workers}
        assert states["t0"] == rebound_pb2.DEPARTED and states["eval"] == rebound_pb2.DEPARTED
        status = server.wait_for(lambda s: any(r.HasField("outcome") for r in s.recoveries), 60,
                                 what="the recovery's outcome")
        recovery = status.recoveries[0]
        assert recovery.outcome == rebound_pb2.RECOVERED, recovery
        assert recovery.verified
        # The trainer's log reached its last step: the replay ends where it stopped.
        stopped_at = int(re.search(r"trained (\d+) samples", read_log(trainer)).group(1)) // 32
        assert recovery.failed_step == stopped_at, (recovery, stopped_at)
        server.wait_for(lambda s: s.slots[0].state == rebound_pb2.FINISHED, 60,
                        what="the slot finished")
        assert wait_exit(spare, 30) == 0


def expected_lrs(scheduler, steps):
    """{t: the lr of step t} of the schedule without a failure: tiny_spec's Adam and scheduler
    stepped as plain PyTorch would, every step or every epoch (64 steps: 2048 samples, one
    replica, batches of 32)."""
    import argparse
    import warnings
    import tiny_spec
    factory, interval = tiny_spec.SCHEDULERS[scheduler]
    spec = tiny_spec.make_spec(argparse.Namespace(optimizer="adam", slow_ms=0,
                                                  nondeterministic=False))
    optimizer = spec.optimizer([torch.zeros(1, requires_grad=True)])
    schedule = factory(optimizer)
    lrs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in range(1, steps + 1):
            lrs[t] = optimizer.param_groups[0]["lr"]
            if interval == "step" or t % 64 == 0:
                schedule.step()
    return lrs


@pytest.mark.parametrize("scheduler", ["onecycle", "steplr-epoch"])
def test_a_scheduler_keeps_its_schedule_across_a_kill(scheduler, tmp_path):
    """OneCycleLR stepped every step, StepLR every epoch: a trainer killed mid-run, its slot
    replayed and verified, and the lr of every step, the trainer's, the replayed ones and the
    spare's after it, is the failure-free schedule's, bit for bit."""
    trace = str(tmp_path / "lr")
    with LocalServer(SERVER, job()) as server:
        args = ["--optimizer", "adam", "--scheduler", scheduler, "--lr-trace", trace]
        trainer = worker(server, "--name", "t0", "--slow-ms", "15", *args)
        spare = worker(server, "--name", "spare", "--role", "spare", *args)
        # Past the first epoch (64 steps): the epoch-wise schedule has moved by then.
        recovery = kill_past_a_snapshot(server, trainer, snapshot=80)
        assert recovery.outcome == rebound_pb2.RECOVERED, recovery
        assert recovery.verified
        server.wait_for(lambda s: s.slots[0].state == rebound_pb2.FINISHED, 60,
                        what="the slot finished")
        assert wait_exit(spare, 30) == 0
    expected = expected_lrs(scheduler, 200)
    seen = {}
    for name in os.listdir(tmp_path):
        pid = int(name.split(".")[1])
        for line in open(tmp_path / name):
            t, lr = line.split()
            seen.setdefault(pid, {})[int(t)] = float.fromhex(lr)
    after = seen[spare.pid]
    # The spare's first step is the replay's, right after a snapshot (tau = 20).
    assert min(after) > 80 and (min(after) - 1) % 20 == 0, sorted(after)[:3]
    assert max(after) == 200 and len(after) == 200 - min(after) + 1
    assert set(seen[trainer.pid]) | set(after) == set(range(1, 201))
    for pid, lrs in seen.items():
        wrong = {t: (lr, expected[t]) for t, lr in lrs.items() if lr != expected[t]}
        assert not wrong, (pid == spare.pid, sorted(wrong.items())[:5])
    assert len(set(after.values())) > 2  # the schedule moves after the recovery
