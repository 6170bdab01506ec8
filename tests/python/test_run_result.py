"""rebound.torch.run returns (R17): real Python training scripts against a real rebound_server
call ``result = rt.run(spec)`` without ``exit``, reach the code after it, torch.save the model it
returns and exit with ``sys.exit(result)``. The saved models are checked against the server's
center read independently (GetStatus for the version, ExportCenter for the values, bit for bit),
the trainers' and a spare's that never trained alike; a script stopped by max_seconds before the
job's end gets no model and a reason.

Needs REBOUND_SERVER (the rebound_server binary) and TINY_SPEC (tests/python/tiny_spec.py).
"""

import os
import sys
import time

import torch

from rebound.cluster import LocalServer, read_log
from rebound.torch import export
from rebound_pb import rebound_pb2
from tiny_workers import SPEC, wait_exit

SERVER = os.environ["REBOUND_SERVER"]

JOB = """
job_id: "tiny"
model { declared_by_worker: true }
topology { replicas: %(replicas)d spares: 1 }
data { batch_size: 32 micro_batches: 2 }
easgd { sync_period: 4 }
fault_tolerance { heartbeat_interval_ms: 200 failure_timeout_ms: 3000 }
training { max_steps: %(steps)d }
"""

# A user's script: tiny_spec's spec, run() without exit, then what a script does with the model.
SCRIPT = """
import sys, runpy
import torch
import rebound.torch as rt
mod = runpy.run_path(%(spec)r, run_name="not_main")
class A: optimizer = "adahessian"; slow_ms = %(slow_ms)d; nondeterministic = False
result = rt.run(mod["make_spec"](A), server=%(server)r, name=%(name)r, role=%(role)r,
                max_seconds=%(max_seconds)r, give_up_after_s=30)
torch.save({"state": None if result.model is None else result.model.state_dict(),
            "exit_code": result.exit_code, "center_version": result.center_version,
            "job_finished": result.job_finished, "reason": result.reason, "role": result.role,
            "deterministic": torch.are_deterministic_algorithms_enabled()}, %(out)r)
print("after run:", result, flush=True)
sys.exit(result)
"""


def start_script(server, tmp_path, name, role, slow_ms=0, max_seconds=None):
    out = str(tmp_path / ("%s.pt" % name))
    process = server.start_worker([sys.executable, "-c", SCRIPT % dict(
        spec=SPEC, slow_ms=slow_ms, server=server.address, name=name, role=role,
        max_seconds=max_seconds, out=out)])
    return process, out


def test_run_returns_the_final_center_in_the_model_to_trainers_and_a_spare(tmp_path):
    with LocalServer(SERVER, JOB % dict(replicas=2, steps=40)) as server:
        # The spare first, so that it holds the spare's role before the trainers register.
        spare = start_script(server, tmp_path, "spare", "spare")
        server.wait_for(lambda s: any(w.name == "spare" for w in s.workers), 60,
                        what="the spare registered")
        # t1 is slower: t0 finishes its slot first and must wait for t1's syncs.
        runs = {"spare": spare,
                "t0": start_script(server, tmp_path, "t0", "trainer"),
                "t1": start_script(server, tmp_path, "t1", "trainer", slow_ms=30)}
        for name, (process, _) in runs.items():
            assert wait_exit(process, 60) == 0, "%s:\n%s" % (name, read_log(process)[-3000:])
            assert "after run: RunResult(exit_code=0" in read_log(process), name

        # The server's final center, read independently of the scripts.
        status = server.status()
        assert all(s.state == rebound_pb2.FINISHED for s in status.slots)
        final_version = status.centers[0].version
        assert final_version == 2 * 40 // 4  # every sync of both slots, once
        exported, versions = export.export_center(server.address)
        assert versions == [final_version]

        for name, (_, out) in runs.items():
            saved = torch.load(out)
            assert saved["exit_code"] == 0 and saved["reason"] == "", (name, saved["reason"])
            assert saved["job_finished"], name
            assert saved["role"] == ("spare" if name == "spare" else "trainer")
            assert saved["center_version"] == final_version, name
            assert not saved["deterministic"], name  # torch's switch restored for the script
            state = saved["state"]
            assert list(state) == list(exported), name
            for tensor_name, values in exported.items():
                # Bit for bit: the same float32 bytes, not merely close.
                assert state[tensor_name].dtype == torch.float32
                assert state[tensor_name].numpy().tobytes() == values.numpy().tobytes(), (
                    name, tensor_name)
        # The center moved from its declared start: the saved model is the trained one.
        torch.manual_seed(1)
        initial = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                      torch.nn.Dropout(0.1), torch.nn.Linear(32, 4))
        assert not torch.equal(initial[0].weight, exported["0.weight"])


def test_a_script_stopped_before_the_job_ends_gets_no_model_and_says_why(tmp_path):
    with LocalServer(SERVER, JOB % dict(replicas=1, steps=100000)) as server:
        process, out = start_script(server, tmp_path, "t0", "trainer", slow_ms=20,
                                    max_seconds=2.0)
        assert wait_exit(process, 60) == 0, read_log(process)[-3000:]
        saved = torch.load(out)
        assert saved["state"] is None and saved["center_version"] is None
        assert not saved["job_finished"]
        assert "max_seconds passed before the job finished" in saved["reason"]
        assert server.status().slots[0].state != rebound_pb2.FINISHED


def test_the_start_barrier_holds_the_first_trainer_until_the_second_registers(tmp_path):
    """topology.min_trainers = 2: a Python trainer registered alone waits (heartbeating) without
    a step; once the second registers both train, and the job ends with every sync applied."""
    job = (JOB % dict(replicas=2, steps=20)).replace("spares: 1", "spares: 1 min_trainers: 2")
    with LocalServer(SERVER, job) as server:
        t0, _ = start_script(server, tmp_path, "t0", "trainer")
        server.wait_for(lambda s: any(w.name == "t0" for w in s.workers), 60,
                        what="t0 registered")
        # Held: for a while its slot makes no step and the center does not move (t0 alone
        # would have finished its 20 steps well within this window).
        for _ in range(15):
            status = server.status()
            assert all(s.step == 0 for s in status.slots), status
            assert status.centers[0].version == 0
            time.sleep(0.1)
        assert t0.poll() is None
        t1, _ = start_script(server, tmp_path, "t1", "trainer")
        for name, process in (("t0", t0), ("t1", t1)):
            assert wait_exit(process, 60) == 0, "%s:\n%s" % (name, read_log(process)[-3000:])
        assert "waiting for the job's other trainers" in read_log(t0)
        status = server.status()
        assert all(s.state == rebound_pb2.FINISHED for s in status.slots)
        assert status.centers[0].version == 2 * 20 // 4
        assert "start barrier: 2 of 2 slots have a trainer" in server.server_log()
