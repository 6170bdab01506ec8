"""Training loops beyond the examples' (issue R18) against a real rebound_server: optimizers
other than AdaHessian, Adam, AdamW and SGD replayed bit for bit after a SIGKILL. Real processes,
really killed; every wait bounded; LocalServer kills what it started.

Needs REBOUND_SERVER (the rebound_server binary) and TINY_SPEC (tests/python/tiny_spec.py).
"""

import os
import re
import signal
import sys
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


@pytest.mark.parametrize("optimizer,model", [("rmsprop", "mlp"), ("adagrad", "bn")])
def test_a_kill_under_another_torch_optimizer_is_replayed_and_verified(optimizer, model):
    """RMSprop (centered, with momentum: three state tensors) and Adagrad (its state made in
    the constructor; on the BatchNorm model, whose running statistics are in the snapshot and
    the checksums): the spare restores the state from the snapshot, every replayed step
    matches the trainer's checksum, and the spare finishes the job as the slot's trainer."""
    with LocalServer(SERVER, job()) as server:
        args = ["--optimizer", optimizer, "--model", model]
        trainer = worker(server, "--name", "t0", "--slow-ms", "15", *args)
        spare = worker(server, "--name", "spare", "--role", "spare", *args)
        recovery = kill_past_a_snapshot(server, trainer)
        assert recovery.outcome == rebound_pb2.RECOVERED, recovery
        assert recovery.verified
        assert recovery.steps_replayed >= 4
        server.wait_for(lambda s: s.slots[0].state == rebound_pb2.FINISHED, 60,
                        what="the slot finished")
        assert wait_exit(spare, 30) == 0
        assert "verified" in read_log(spare)


def test_a_state_the_snapshot_cannot_hold_is_reported_and_falls_back():
    """An optimizer whose state has no exact place in the snapshot (a Python float): the spare
    does not exit (the slot would stay LOST), it reports the replay as failed with the reason,
    the server falls back to RESTART_FROM_CENTER, and the spare finishes the slot."""
    with LocalServer(SERVER, job()) as server:
        trainer = worker(server, "--name", "t0", "--slow-ms", "15", "--optimizer", "unfit")
        spare = worker(server, "--name", "spare", "--role", "spare", "--optimizer", "unfit")
        recovery = kill_past_a_snapshot(server, trainer, logged=1)
        # Reported as what it is: no replay could verify, nothing differed (not DATA_LOSS).
        assert recovery.outcome == rebound_pb2.UNREPLAYABLE, recovery
        assert re.search(r"step [1-9]\d*: cannot replay exactly: the optimizer Unfit: "
                         r"parameter 0: its state 'scale' is a float", recovery.detail), recovery
        server.wait_for(lambda s: s.slots[0].state == rebound_pb2.FINISHED, 60,
                        what="the slot finished after the fallback")
        assert wait_exit(spare, 30) == 0
        assert "taking over slot (0, 0)" in read_log(spare)
        assert "cannot be snapshotted exactly" in read_log(trainer)


def test_sigterm_and_sigint_deregister_and_exit_0_without_half_a_step():
    """A trainer's SIGTERM: it finishes the step in progress, ships its log, deregisters
    (DEPARTED, not FAILED) and exits 0 within a few seconds; a spare then replays its slot to the
    last step it logged, verified bit for bit: no step was left half-applied. An evaluator's
    SIGINT (Ctrl-C): the same clean exit, no KeyboardInterrupt."""
    with LocalServer(SERVER, job(steps=400)) as server:
        trainer = worker(server, "--name", "t0", "--slow-ms", "15")
        evaluator = worker(server, "--name", "eval", "--role", "evaluator")
        spare = worker(server, "--name", "spare", "--role", "spare")
        server.wait_for(lambda s: s.slots[0].snapshot_step >= 20 and s.HasField("last_eval")
                        and any(w.name == "spare" for w in s.workers), 60,
                        what="a snapshot, an evaluation and the spare")
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
        server.wait_for(lambda s: s.slots[0].state == rebound_pb2.FINISHED, 60,
                        what="the slot finished")
        assert wait_exit(spare, 30) == 0
        # The trainer's log reached its last step: the replay ends where it stopped.
        stopped_at = int(re.search(r"trained (\d+) samples", read_log(trainer)).group(1)) // 32
        took_over = re.search(r"took over slot \(0, 0\) as incarnation \d+ at step (\d+)",
                              read_log(spare))
        assert took_over and int(took_over.group(1)) == stopped_at, (read_log(spare)[-800:],
                                                                     stopped_at)


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


def accuracy(model, data):
    model.eval()
    with torch.no_grad():
        return float((model(data.x).argmax(dim=1) == data.y).sum()) / len(data)


def test_a_batchnorm_models_evaluator_accuracy_is_its_centers_with_recomputed_statistics():
    """BatchNorm's running statistics are declared with the parameters and averaged into the
    center: the evaluator's last accuracy (of the final center) is the final center's own, with
    the center's statistics, and within 1 point of the same parameters evaluated with statistics
    recomputed over the training set; with fresh statistics (what the evaluator used before the
    buffers were in the center) it is far lower."""
    import argparse
    import rebound.torch as rt
    import tiny_spec
    with LocalServer(SERVER, job(replicas=2)) as server:
        # OneCycleLR anneals the lr to ~0 by the last step, as real training ends: the
        # statistics, exponential averages over recent batches, then describe the final
        # parameters rather than lag behind them.
        args = ["--model", "bn", "--optimizer", "adam", "--scheduler", "onecycle"]
        trainers = [worker(server, "--name", "t%d" % i, *args) for i in range(2)]
        evaluator = worker(server, "--name", "eval", "--role", "evaluator", *args)
        for process in trainers + [evaluator]:
            assert wait_exit(process, 90) == 0, read_log(process)[-2000:]
        last = server.status().last_eval
        state, versions = rt.export_center(server.address)
    assert last.center_version == versions[0]  # the last evaluation is the final center's
    assert "2.running_mean" in state and "2.running_var" in state
    spec = tiny_spec.make_spec(argparse.Namespace(optimizer="adam", slow_ms=0, model="bn",
                                                  nondeterministic=False))
    model = tiny_spec.batchnorm_model()
    # Every float tensor of the state_dict is in the center; the integer counter is not.
    assert set(state) == set(model.state_dict()) - {"2.num_batches_tracked"}
    model.load_state_dict(state, strict=False)
    assert accuracy(model, spec.test_set) == pytest.approx(last.test_accuracy, abs=1e-12)
    # The same parameters, statistics recomputed as plain PyTorch would: a pass over the
    # training set in training mode with a cumulative average.
    bn = model[2]
    bn.reset_running_stats()
    bn.momentum = None
    model.train()
    with torch.no_grad():
        for begin in range(0, len(spec.train_set), 32):
            model(spec.train_set.x[begin:begin + 32])
    recomputed = accuracy(model, spec.test_set)
    assert abs(last.test_accuracy - recomputed) <= 0.01, (last.test_accuracy, recomputed)
    bn.reset_running_stats()
    fresh = accuracy(model, spec.test_set)
    assert fresh < recomputed - 0.1, (fresh, recomputed)


def test_a_regression_models_loss_is_the_centers_on_float_targets():
    """Float vector targets served one sample at a time (lists of floats), MSE loss: the
    runner batches them as floats (not truncated to integers), the model learns (the final test
    loss far below the initial model's), the evaluator's last loss is the final center's on the
    float targets, and it reports no accuracy for a regression."""
    import argparse
    import rebound.torch as rt
    import tiny_spec
    with LocalServer(SERVER, job()) as server:
        args = ["--task", "regression", "--optimizer", "adam"]
        trainer = worker(server, "--name", "t0", *args)
        evaluator = worker(server, "--name", "eval", "--role", "evaluator", *args)
        for process in (trainer, evaluator):
            assert wait_exit(process, 90) == 0, read_log(process)[-2000:]
        last = server.status().last_eval
        state, versions = rt.export_center(server.address)
        evaluations = read_log(evaluator)
    assert last.center_version == versions[0]
    # No accuracy reported, and the server's status has none (not a 0).
    assert not last.HasField("test_accuracy"), last
    assert last.HasField("test_loss"), last
    assert re.search(r"evaluated center version %d: test loss [0-9.]+\n" % last.center_version,
                     evaluations), evaluations[-500:]
    spec = tiny_spec.make_spec(argparse.Namespace(optimizer="adam", slow_ms=0, task="regression",
                                                  nondeterministic=False))
    test = spec.test_set
    assert not torch.equal(test.y, test.y.round())  # the targets are not integers
    torch.manual_seed(1)
    model = spec.model()
    with torch.no_grad():
        initial = float(torch.nn.functional.mse_loss(model(test.x), test.y))
        model.load_state_dict(state)
        final = float(torch.nn.functional.mse_loss(model.eval()(test.x), test.y))
    assert last.test_loss == pytest.approx(final, rel=1e-5)
    assert final < initial / 4, (final, initial)


SCRIPT_AFTER_RUN = """
import argparse, sys
import rebound.torch as rt
import tiny_spec
spec = tiny_spec.make_spec(argparse.Namespace(optimizer="adam", slow_ms=15,
                                              nondeterministic=False))
result = rt.run(spec, server=sys.argv[1], name="t0", rpc_deadline_s=1, give_up_after_s=2)
print("after run: code %d, model %s, reason: %s" % (result.exit_code, result.model,
                                                   result.reason), flush=True)
sys.exit(7)
"""


def test_a_lost_server_ends_run_with_code_4_and_the_script_goes_on():
    """run() without exit: the heartbeat thread that gives up on the server (stopped with
    SIGSTOP for longer than give_up_after_s) no longer ends the process with os._exit: the
    session stops, run returns 4 with the reason, and the script's code after run() runs."""
    # No sync in the run (tau > max_steps): the work thread calls the server only at the end, so
    # the heartbeat thread is the one that gives up.
    with LocalServer(SERVER, job(tau=1000, steps=900)) as server:
        script = server.start_worker(
            [sys.executable, "-c", SCRIPT_AFTER_RUN, server.address],
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        server.wait_for(lambda s: s.slots[0].step >= 20, 60, what="20 steps trained")
        os.kill(server.server.pid, signal.SIGSTOP)
        try:
            assert wait_exit(script, 30) == 7, read_log(script)[-2000:]
        finally:
            os.kill(server.server.pid, signal.SIGCONT)
        out = read_log(script)
        assert "no heartbeat acknowledged for 2 s" in out
        assert re.search(r"after run: code 4, model None, reason: no heartbeat acknowledged "
                         r"for 2 s", out), out[-1500:]
