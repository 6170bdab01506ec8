"""The Python client against a real rebound_server on loopback (port 0): registration and the
declared layout, refusals, fencing, the sync arithmetic against the server's C++ kernel, a
killed Python trainer rebuilt by verified replay, the fallback when a replay cannot match, and
bad input. Real processes, really killed; every wait bounded; LocalServer kills what it started.

Needs REBOUND_SERVER (the rebound_server binary) and TINY_SPEC (tests/python/tiny_spec.py).
"""

import os
import re
import signal
import sys
import time

import grpc
import numpy as np
import pytest
import torch

from rebound import client as rclient
from rebound.cluster import LocalServer, read_log
from rebound.torch import kernels
from rebound.torch import wire
from rebound_pb import config_pb2, rebound_pb2, tensor_pb2
from tiny_workers import SPEC, register, tiny_model_bundle, wait_exit, worker

SERVER = os.environ["REBOUND_SERVER"]

JOB = """
job_id: "tiny"
model { declared_by_worker: true }
topology { replicas: %(replicas)d spares: 1 }
data { batch_size: 32 micro_batches: 2 }
easgd { sync_period: %(tau)d %(easgd)s }
fault_tolerance { heartbeat_interval_ms: 200 failure_timeout_ms: 1500 %(ft)s }
training { max_steps: %(steps)d eval_every_ms: 500 }
"""


def job(replicas=2, tau=4, steps=1000, ft="", easgd=""):
    return JOB % dict(replicas=replicas, tau=tau, steps=steps, ft=ft, easgd=easgd)


def code_of(call):
    with pytest.raises(rclient.CallError) as error:
        call()
    return error.value


@pytest.fixture
def server():
    with LocalServer(SERVER, job()) as s:
        yield s


def test_first_registration_fixes_the_layout_and_others_must_match(server):
    conn, first = register(server, "a", tiny_model_bundle())
    assert first.role == config_pb2.TRAINER
    # The center starts from the declared values.
    pulled = conn.call("Pull", rebound_pb2.PullRequest(incarnation=first.incarnation, stage=0))
    declared = tiny_model_bundle()
    assert [t.name for t in pulled.center.tensors] == ["0.weight", "0.bias", "3.weight",
                                                       "3.bias"]
    assert [list(t.shape) for t in pulled.center.tensors] == [[32, 16], [32], [4, 32], [4]]
    assert [t.data for t in pulled.center.tensors] == [t.data for t in declared.tensors]
    # The same layout with other values is accepted.
    other = tiny_model_bundle()
    other.tensors[0].data = bytes(len(other.tensors[0].data))
    register(server, "b", other)
    # A different layout: FAILED_PRECONDITION naming the first differing tensor.
    error = code_of(lambda: register(server, "c", tiny_model_bundle(hidden=33)))
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "at tensor 0" in error.details and "'0.weight' of shape [33, 16]" in error.details
    assert "[32, 16]" in error.details and "of 'a'" in error.details
    # No declaration at all (what rebound_worker sends): refused, saying why.
    error = code_of(lambda: register(server, "d"))
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "declared_by_worker" in error.details


def test_the_declared_layout_survives_a_server_restart(server):
    register(server, "a", tiny_model_bundle())
    server.close()
    server.start()
    error = code_of(lambda: register(server, "b", tiny_model_bundle(hidden=8)))
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "stored in the data directory" in error.details
    _, ok = register(server, "c", tiny_model_bundle())
    assert ok.incarnation != 0


def test_a_malformed_declaration_is_refused_and_fixes_nothing(server):
    error = code_of(lambda: register(server, "nan", tiny_model_bundle(nan=True)))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "not finite" in error.details or "nan" in error.details.lower()
    bad = tiny_model_bundle()
    bad.tensors[2].dtype = tensor_pb2.INT32
    error = code_of(lambda: register(server, "int", bad))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "FLOAT32" in error.details
    short = tiny_model_bundle()
    short.tensors[3].data = short.tensors[3].data[:8]
    assert code_of(lambda: register(server, "short", short)).code == \
        grpc.StatusCode.INVALID_ARGUMENT
    # Nothing was fixed: a good declaration of another width is still accepted first.
    _, ok = register(server, "good", tiny_model_bundle(hidden=8))
    assert ok.role == config_pb2.TRAINER


def test_sync_math_is_the_servers_kernel_bit_for_bit(server):
    """A trainer's post-sync parameters (Python float32 kernel) equal the snapshot the server
    computed with its C++ kernel, which a spare receives in its recovery task."""
    conn, reg = register(server, "a", tiny_model_bundle(), role=config_pb2.TRAINER)
    center = [torch.from_numpy(np.frombuffer(t.data, "<f4").copy()).reshape(tuple(t.shape))
              for t in tiny_model_bundle().tensors]
    rng = np.random.default_rng(5)
    x = [c + torch.from_numpy(rng.standard_normal(tuple(c.shape)).astype(np.float32) * 0.37)
         for c in center]
    response = conn.call("Sync", rebound_pb2.SyncRequest(
        incarnation=reg.incarnation, slot=reg.slot, step=4, params=wire.bundle_of(x)))
    c_before = wire.tensors_of(response.center_before, x, "center_before")
    mine = [kernels.elastic_pull_worker(xi, ci, response.moving_rate)
            for xi, ci in zip(x, c_before)]
    assert response.moving_rate == pytest.approx(0.45)  # 0.9 / R
    # The trainer leaves: a spare's task carries the server's snapshot of the slot.
    conn.stub.Deregister(rebound_pb2.DeregisterRequest(incarnation=reg.incarnation),
                         timeout=5, metadata=conn.metadata())
    spare, sreg = register(server, "spare", tiny_model_bundle(), role=config_pb2.SPARE)
    deadline = time.monotonic() + 20
    task = None
    while task is None and time.monotonic() < deadline:
        got = spare.call("WaitForTask", rebound_pb2.WaitForTaskRequest(
            incarnation=sreg.incarnation, wait_ms=1000), deadline_s=5)
        if got.HasField("task"):
            task = got.task
    assert task is not None, "no recovery task within 20 s"
    assert task.snapshot.step == 4
    snapshot = wire.tensors_of(task.snapshot.params, x, "snapshot")
    for a, b in zip(mine, snapshot):
        assert a.numpy().tobytes() == b.numpy().tobytes()
    # And the move is not the identity: a wrong alpha would not match.
    wrong = kernels.elastic_pull_worker(x[0], c_before[0], 0.4)
    assert wrong.numpy().tobytes() != snapshot[0].numpy().tobytes()


def test_bad_updates_get_invalid_argument(server):
    conn, reg = register(server, "a", tiny_model_bundle(), role=config_pb2.TRAINER)
    wrong_shape = tiny_model_bundle(hidden=8)
    error = code_of(lambda: conn.call("Sync", rebound_pb2.SyncRequest(
        incarnation=reg.incarnation, slot=reg.slot, step=4, params=wrong_shape)))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "0.weight" in error.details
    error = code_of(lambda: conn.call("Sync", rebound_pb2.SyncRequest(
        incarnation=reg.incarnation, slot=reg.slot, step=4,
        params=tiny_model_bundle(nan=True))))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    # Another worker's identity: the credential does not match.
    other, _ = register(server, "b", tiny_model_bundle())
    with pytest.raises(rclient.CallError) as impostor:
        other.call("Sync", rebound_pb2.SyncRequest(
            incarnation=reg.incarnation, slot=reg.slot, step=4, params=tiny_model_bundle()))
    assert impostor.value.code == grpc.StatusCode.UNAUTHENTICATED
    # A micro-batch record carrying a per-step field is malformed.
    record = rebound_pb2.LogRecord(slot=reg.slot, step=1, micro_batch=0, sample_ids=list(
        range(16)), rng_seed=5, record_id=1)
    error = code_of(lambda: conn.bidi_once("AppendLog", rebound_pb2.AppendLogRequest(
        incarnation=reg.incarnation, records=[record])))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "rng_seed" in error.details
    status = server.status()
    assert sum(s.refused_updates for s in status.slots) == 2


def test_a_fenced_trainer_exits_3_and_writes_no_more(server):
    trainer = worker(server, "--name", "t0", "--slow-ms", "20")
    server.wait_for(lambda s: any(x.step > 20 for x in s.slots), 60, what="training")
    os.killpg(trainer.pid, signal.SIGSTOP)  # silent past failure_timeout_ms: declared failed
    status = server.wait_for(
        lambda s: any(w.name == "t0" and w.state == rebound_pb2.FAILED for w in s.workers), 30,
        what="t0 declared failed")
    # A stopped process keeps its session open: the heartbeat timeout declared it, not a crash.
    t0 = next(w for w in status.workers if w.name == "t0")
    assert t0.state_reason.startswith("no heartbeat for "), t0
    updates = {(x.slot.replica): x.update_count for x in status.slots}
    os.killpg(trainer.pid, signal.SIGCONT)
    assert wait_exit(trainer, 30) == 3
    assert "fenced by the server" in read_log(trainer)
    after = {(x.slot.replica): x.update_count for x in server.status().slots}
    assert after == updates  # nothing it sent after the fencing was applied


# SGD's case is marked full (tools/test.sh --full: client_test_full): stateless, it adds nothing
# to the replay that adam's, whose state the replay must rebuild too, does not check.
@pytest.mark.parametrize("optimizer",
                         ["adahessian", pytest.param("sgd", marks=pytest.mark.full), "adam"])
def test_a_killed_trainer_is_rebuilt_by_verified_replay(optimizer):
    with LocalServer(SERVER, job(replicas=2, tau=40, steps=400)) as server:
        trainers = [worker(server, "--name", "t%d" % i, "--slow-ms", "15", "--optimizer",
                           optimizer) for i in range(2)]
        spare = worker(server, "--name", "spare", "--role", "spare", "--optimizer", optimizer)
        victim_slot = server.wait_for(
            lambda s: any(x.logged_step - x.snapshot_step >= 6 and x.snapshot_step >= 40
                          for x in s.slots), 90, what="a slot logged 6 steps past a snapshot")
        slot = next(x for x in victim_slot.slots
                    if x.logged_step - x.snapshot_step >= 6 and x.snapshot_step >= 40)
        owner = next(w for w in victim_slot.workers if w.incarnation == slot.owner_incarnation)
        victim = trainers[int(owner.name[1:])]
        os.killpg(victim.pid, signal.SIGKILL)
        # Its session ended with the process: declared as a crash (docs/design.md §13), not
        # after failure_timeout_ms of silence.
        failed = server.wait_for(
            lambda s: any(w.name == owner.name and w.state == rebound_pb2.FAILED
                          for w in s.workers), 30, what="the victim declared failed")
        dead = next(w for w in failed.workers if w.name == owner.name
                    and w.state == rebound_pb2.FAILED)
        assert dead.state_reason.startswith("its session ended "), dead
        assert dead.silent_ms_at_failure < 1500, dead
        status = server.wait_for(lambda s: any(r.HasField("outcome") for r in s.recoveries), 60,
                                 what="the recovery's outcome")
        recovery = status.recoveries[0]
        assert recovery.outcome == rebound_pb2.RECOVERED, recovery
        assert recovery.verified
        assert recovery.steps_replayed >= 6
        server.wait_for(lambda s: all(x.state == rebound_pb2.FINISHED for x in s.slots), 180,
                        what="every slot finished")
        assert wait_exit(spare, 30) == 0
        assert "verified" in read_log(spare)
        survivor = trainers[1 - int(owner.name[1:])]
        assert wait_exit(survivor, 30) == 0


def test_a_replay_that_cannot_match_says_where_and_falls_back():
    with LocalServer(SERVER, job(replicas=1, tau=40, steps=300)) as server:
        trainer = worker(server, "--name", "t0", "--slow-ms", "15", "--nondeterministic")
        spare = worker(server, "--name", "spare", "--role", "spare", "--nondeterministic")
        server.wait_for(lambda s: s.slots[0].logged_step - s.slots[0].snapshot_step >= 4 and
                        s.slots[0].snapshot_step >= 40, 90, what="logged steps past a snapshot")
        os.killpg(trainer.pid, signal.SIGKILL)
        status = server.wait_for(lambda s: any(r.HasField("outcome") for r in s.recoveries), 60,
                                 what="the recovery's outcome")
        recovery = status.recoveries[0]
        assert recovery.outcome == rebound_pb2.CHECKSUM_MISMATCH, recovery
        # The noise is in every forward, so the first replayed step (the one after a snapshot,
        # which is taken every tau = 40 steps) already differs, from the first tensor on; the
        # detail names both.
        match = re.search(r"step (\d+): tensor (\d+) '([^']+)' differs", recovery.detail)
        assert match, recovery.detail
        step = int(match.group(1))
        assert step > 40 and step % 40 == 1, recovery.detail
        assert (match.group(2), match.group(3)) == ("0", "inner.0.weight"), recovery.detail
        # The fallback: the spare restarts the slot from the center and finishes the job.
        server.wait_for(lambda s: s.slots[0].state == rebound_pb2.FINISHED, 120,
                        what="the slot finished after the fallback")
        assert wait_exit(spare, 30) == 0
        assert "taking over slot (0, 0)" in read_log(spare)


def test_an_evaluator_reports_accuracy_and_everyone_leaves_at_the_end(server):
    trainers = [worker(server, "--name", "t%d" % i) for i in range(2)]
    evaluator = worker(server, "--name", "eval", "--role", "evaluator")
    status = server.wait_for(lambda s: s.HasField("last_eval") and
                             s.last_eval.center_version > 50, 120, what="an evaluation")
    assert 0.0 <= status.last_eval.test_accuracy <= 1.0
    server.wait_for(lambda s: all(x.state == rebound_pb2.FINISHED for x in s.slots), 180,
                    what="every slot finished")
    for t in trainers:
        assert wait_exit(t, 30) == 0
    assert wait_exit(evaluator, 30) == 0
    # The synthetic task is learnable: the last evaluation beats chance (0.25) by far.
    assert server.status().last_eval.test_accuracy > 0.8


def test_a_spec_that_does_not_fit_the_job_exits_2(server):
    process = server.start_worker([sys.executable, "-c", """
import sys, runpy
sys.argv = ["tiny_spec.py", "--server", "%s"]
import rebound.torch as rt
mod = runpy.run_path("%s", run_name="not_main")
class A: optimizer = "sgd"; slow_ms = 0; nondeterministic = False
spec = mod["make_spec"](A)
spec.tau = 5
sys.exit(rt.run(spec, server="%s"))
""" % (server.address, SPEC, server.address)])
    assert wait_exit(process, 60) == 2
    assert "tau 5 differs from the job's easgd.sync_period 4" in read_log(process)


def test_a_worker_config_file_is_read_and_its_errors_name_file_and_line(server, tmp_path):
    good = tmp_path / "worker.pbtxt"
    good.write_text('server_address: "%s"\nname: "from-config"\nrole: EVALUATOR\n'
                    'rpc_deadline_ms: 5000\n' % server.address)
    bad_value = tmp_path / "bad_value.pbtxt"
    bad_value.write_text('server_address: "%s"\nrpc_deadline_ms: 5\n' % server.address)
    bad_syntax = tmp_path / "bad_syntax.pbtxt"
    bad_syntax.write_text('server_address: "%s"\nno_such_field: 1\n' % server.address)
    script = """
import runpy, sys
import rebound.torch as rt
mod = runpy.run_path("%s", run_name="not_main")
class A: optimizer = "sgd"; slow_ms = 0; nondeterministic = False
sys.exit(rt.run(mod["make_spec"](A), config=sys.argv[1], max_seconds=2))
""" % SPEC
    runs = {}
    for path in (good, bad_value, bad_syntax):
        runs[path] = server.start_worker([sys.executable, "-c", script, str(path)])
    assert wait_exit(runs[bad_value], 60) == 2
    assert "bad_value.pbtxt: rpc_deadline_ms must be >= 10, got 5" in read_log(runs[bad_value])
    assert wait_exit(runs[bad_syntax], 60) == 2
    assert "bad_syntax.pbtxt:2:" in read_log(runs[bad_syntax])
    assert "no_such_field" in read_log(runs[bad_syntax])
    assert wait_exit(runs[good], 60) == 0
    assert "registered 'from-config' as EVALUATOR" in read_log(runs[good])


def test_async_adahessian_pushes_every_step_once_also_across_a_kill():
    """Mode ASYNC_ADAHESSIAN: each step's g and D pushed with sequence = step; the center's
    version counts every push applied exactly once, the killed trainer's successor (a spare,
    from the center) included."""
    with LocalServer(SERVER, job(replicas=2, tau=4, steps=300, ft="policy: RESTART_FROM_CENTER",
                                 easgd="mode: ASYNC_ADAHESSIAN") +
                     "adahessian { lr: 0.02 }\n") as server:
        trainers = [worker(server, "--name", "t%d" % i, "--slow-ms", "10") for i in range(2)]
        spare = worker(server, "--name", "spare", "--role", "spare")
        evaluator = worker(server, "--name", "eval", "--role", "evaluator")
        status = server.wait_for(lambda s: any(x.step >= 60 for x in s.slots), 90,
                                 what="60 steps pushed")
        victim = next(w for w in status.workers if w.name in ("t0", "t1") and
                      w.incarnation == status.slots[0].owner_incarnation)
        os.killpg(trainers[int(victim.name[1:])].pid, signal.SIGKILL)
        status = server.wait_for(lambda s: all(x.state == rebound_pb2.FINISHED for x in s.slots),
                                 180, what="every slot finished")
        assert status.centers[0].version == 2 * 300
        assert [x.update_count for x in status.slots] == [300, 300]
        assert wait_exit(spare, 30) == 0
        assert "taking over slot (0, 0)" in read_log(spare)
        assert "pushing g and D every step" in read_log(spare)
        assert wait_exit(evaluator, 30) == 0
        assert server.status().last_eval.test_accuracy > 0.6


def test_python_trainers_ride_out_a_server_restart():
    """The server SIGKILLed mid-training and restarted on its data directory: the trainers'
    calls are retried (UNAVAILABLE, bounded backoff), their registrations are known again, the
    job finishes, and every slot's syncs count once (update_count = max_steps / tau)."""
    with LocalServer(SERVER, job(replicas=2, tau=4, steps=400)) as server:
        trainers = [worker(server, "--name", "t%d" % i, "--slow-ms", "15") for i in range(2)]
        server.wait_for(lambda s: all(x.step >= 80 for x in s.slots), 90, what="80 steps each")
        server.kill_server()
        time.sleep(1.0)
        server.start()  # the same data directory and port
        status = server.wait_for(
            lambda s: all(x.state == rebound_pb2.FINISHED for x in s.slots), 240,
            what="every slot finished after the restart")
        assert [x.update_count for x in status.slots] == [100, 100]
        # The restart ended every session: no live trainer was taken for crashed.
        assert not [w for w in status.workers if w.state == rebound_pb2.FAILED], status.workers
        for t in trainers:
            assert wait_exit(t, 30) == 0, read_log(t)[-2000:]
