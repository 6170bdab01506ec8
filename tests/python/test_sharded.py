"""Python trainers of a center sharded across K server groups (docs/sharding.md, docs/python.md)
against real rebound_server groups on loopback and real Python processes (tiny_spec.py): a
declared-model job with DETERMINISTIC scheduling, UNIFORM weights and REPLAY ends, with K = 2,
with every range's center bit for bit the one-group center of the same job, each range having
applied every sync once; so it does when a trainer is SIGKILLed mid-run and a spare rebuilds its
slot by verified replay from the range groups' snapshots. In mode ASYNC_ADAHESSIAN every range
applies every push once, a killed trainer's successor included. Every wait bounded; the clusters
stop every process they started.

Needs REBOUND_SERVER (the rebound_server binary) and TINY_SPEC (tests/python/tiny_spec.py).
"""

import dataclasses
import os
import re
import signal
import time

import grpc
import pytest

from rebound import client as rclient
from rebound.cluster import LocalServer, LocalShardedServers, read_log
from rebound_pb import config_pb2, rebound_pb2, sharding_pb2, sharding_pb2_grpc
from tiny_workers import register, tiny_model_bundle, wait_exit, worker

SERVER = os.environ["REBOUND_SERVER"]
REPLICAS = 2
TAU = 20
STEPS = 300
SYNCS_PER_SLOT = STEPS // TAU

JOB = """
job_id: "tiny"
model { declared_by_worker: true }
topology { replicas: %d spares: 1 }
weighting { policy: UNIFORM }
scheduling: DETERMINISTIC
data { batch_size: 32 micro_batches: 2 }
easgd { sync_period: %d }
fault_tolerance { policy: REPLAY heartbeat_interval_ms: 200 failure_timeout_ms: 3000 }
training { max_steps: %d eval_every_ms: 500 }
""" % (REPLICAS, TAU, STEPS)
# A DETERMINISTIC sync waits for its turn at most this long, then is retried (UNAVAILABLE).
SERVER_EXTRA = "max_wait_ms: 2000"


@dataclasses.dataclass
class Run:
    center: bytes    # the final center of stage 0, its packed float32 values
    versions: list   # each range's center version at the end (one entry for one group)
    status: object   # group 0's GetStatusResponse at the end
    logs: dict       # worker name -> its log
    recovery: object = None  # the kill's RecoveryStatus once it had an outcome


def finished(status):
    return len(status.slots) == REPLICAS and all(
        x.state == rebound_pb2.FINISHED for x in status.slots)


def wait_for_files(paths, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError("%s not within %.0f s" % (what, timeout_s))
        time.sleep(0.05)


def final_center(cluster, groups):
    """The center of stage 0 gathered as an observer (a spare registered with group 0 now, so
    that its credential reads the ranges): (packed bytes, each range's version)."""
    conn, observer = register(cluster, "observer", tiny_model_bundle(),
                              role=config_pb2.SPARE)
    try:
        if groups == 1:
            assert len(observer.range_addresses) == 0
            pulled = conn.call("Pull", rebound_pb2.PullRequest(
                incarnation=observer.incarnation, stage=0))
            return b"".join(t.data for t in pulled.center.tensors), [pulled.center_version]
        # Group 0 names every group, in group order.
        assert list(observer.range_addresses) == cluster.addresses
        center, versions = b"", []
        for k, address in enumerate(cluster.addresses):
            channel = grpc.insecure_channel(address)
            try:
                pulled = sharding_pb2_grpc.CenterRangeStub(channel).PullRange(
                    sharding_pb2.PullRangeRequest(incarnation=observer.incarnation, stage=0,
                                                  range=k),
                    timeout=10, metadata=[(rclient.CREDENTIAL_KEY, observer.credential)])
            finally:
                channel.close()
            assert len(pulled.center.tensors) == 1
            center += pulled.center.tensors[0].data
            versions.append(pulled.center_version)
        return center, versions
    finally:
        conn.close()


def run_job(groups, gate_dir, optimizer="adahessian", kill=False, evaluate=False):
    """The job with ``groups`` server groups and two trainers started together (each from the
    center as the job began) with tiny_spec's ``optimizer``; ``kill``: a spare waits, and the
    trainer of a slot that has logged steps past its snapshot is SIGKILLed; ``evaluate``: an
    evaluator runs alongside."""
    cluster = (LocalServer(SERVER, JOB, extra_server=SERVER_EXTRA) if groups == 1 else
               LocalShardedServers(SERVER, JOB, groups, extra_server=SERVER_EXTRA))
    with cluster:
        processes = {}
        try:
            if kill:
                processes["spare"] = worker(cluster, "--name", "spare", "--role", "spare",
                                            "--optimizer", optimizer)
                cluster.wait_for(lambda s: any(w.name == "spare" and w.waiting_for_task
                                               for w in s.workers), 90,
                                 what="the spare waiting for a task")
            if evaluate:
                processes["eval"] = worker(cluster, "--name", "eval", "--role", "evaluator")
            gate = os.path.join(gate_dir, "gate-%d%s" % (groups, "-kill" if kill else ""))
            for i in range(REPLICAS):
                processes["t%d" % i] = worker(cluster, "--name", "t%d" % i, "--slow-ms", "15",
                                              "--optimizer", optimizer, "--start-gate", gate)
            # Both trainers have pulled the center and wait at their first batch: go.
            wait_for_files(["%s.%d" % (gate, processes["t%d" % i].pid) for i in range(REPLICAS)],
                           90, "both trainers at the start gate")
            open(gate, "w").close()
            recovery = None
            if kill:
                def past_snapshot(x):
                    return x.snapshot_step >= TAU and x.logged_step - x.snapshot_step >= 6
                status = cluster.wait_for(lambda s: any(past_snapshot(x) for x in s.slots), 90,
                                          poll_s=0.05, what="a slot logged 6 steps past a sync")
                slot = next(x for x in status.slots if past_snapshot(x))
                owner = next(w for w in status.workers if w.incarnation == slot.owner_incarnation)
                os.killpg(processes[owner.name].pid, signal.SIGKILL)
                status = cluster.wait_for(
                    lambda s: any(r.HasField("outcome") for r in s.recoveries), 90,
                    what="the recovery's outcome")
                recovery = status.recoveries[0]
                assert (recovery.slot.replica, recovery.slot.stage) == (slot.slot.replica, 0)
                processes.pop(owner.name)
            status = cluster.wait_for(finished, 240, what="every slot finished")
            center, versions = final_center(cluster, groups)
            for name, process in processes.items():
                assert wait_exit(process, 60) == 0, "%s:\n%s" % (name, read_log(process)[-3000:])
            logs = {name: read_log(process) for name, process in processes.items()}
            return Run(center=center, versions=versions, status=status, logs=logs,
                       recovery=recovery)
        except BaseException:
            # What the failure report shows (pytest prints a failing test's stdout).
            servers = cluster.groups if groups > 1 else [cluster]
            for k, server in enumerate(servers):
                print("--- server group %d ---\n%s" % (k, server.server_log()[-4000:]))
            for name, process in processes.items():
                print("--- %s ---\n%s" % (name, read_log(process)[-3000:]))
            raise


@pytest.fixture(scope="module")
def one_group(tmp_path_factory):
    """one_group(optimizer): the clean run of the job with one server group, run once per
    optimizer: the center every sharded run must end with, bit for bit."""
    runs = {}

    def of(optimizer):
        if optimizer not in runs:
            run = run_job(1, str(tmp_path_factory.mktemp("one-group")), optimizer)
            assert run.versions == [REPLICAS * SYNCS_PER_SLOT]
            assert [x.update_count for x in run.status.slots] == [SYNCS_PER_SLOT] * REPLICAS
            assert not run.status.HasField("sharding")
            # The job moved the center: a comparison with it is not one of initial values.
            initial = b"".join(t.data for t in tiny_model_bundle().tensors)
            assert len(run.center) == len(initial) and run.center != initial
            runs[optimizer] = run
        return runs[optimizer]

    return of


def check_every_range_applied_every_sync_once(run, groups):
    assert run.status.sharding.groups == groups
    assert run.versions == [REPLICAS * SYNCS_PER_SLOT] * groups
    for x in run.status.slots:
        assert (x.update_count, x.snapshot_step) == (SYNCS_PER_SLOT, STEPS), x


def test_two_groups_end_with_the_one_group_center_bit_for_bit(one_group, tmp_path):
    run = run_job(2, str(tmp_path), evaluate=True)
    check_every_range_applied_every_sync_once(run, 2)
    assert run.center == one_group("adahessian").center
    # The evaluator pulled the sharded center (range 0's version) while it moved.
    versions = [int(v) for v in re.findall(r"evaluated center version (\d+)", run.logs["eval"])]
    assert versions and max(versions) > 0, run.logs["eval"][-2000:]
    assert run.status.HasField("last_eval")
    assert 0.0 <= run.status.last_eval.test_accuracy <= 1.0


# Adam has no D: its range snapshots carry zeros there (rebound.torch.center), and still replay.
@pytest.mark.parametrize("optimizer", ["adahessian", "adam"])
def test_a_killed_trainer_is_replayed_from_the_ranges_and_the_center_is_unchanged(
        one_group, tmp_path, optimizer):
    run = run_job(2, str(tmp_path), optimizer, kill=True)
    recovery = run.recovery
    assert recovery.outcome == rebound_pb2.RECOVERED, recovery
    assert recovery.verified and recovery.steps_replayed >= 6, recovery
    assert "verified" in run.logs["spare"]
    check_every_range_applied_every_sync_once(run, 2)
    assert run.center == one_group(optimizer).center


ASYNC_JOB = """
job_id: "tiny"
model { declared_by_worker: true }
topology { replicas: %d spares: 1 }
data { batch_size: 32 micro_batches: 2 }
easgd { sync_period: 4 mode: ASYNC_ADAHESSIAN }
adahessian { lr: 0.02 }
fault_tolerance { policy: RESTART_FROM_CENTER heartbeat_interval_ms: 200 failure_timeout_ms: 3000 }
training { max_steps: 200 eval_every_ms: 500 }
""" % REPLICAS


def test_async_adahessian_pushes_are_applied_once_per_range_also_across_a_kill():
    """Mode ASYNC_ADAHESSIAN: every step's (g, D) goes to every range (PushRange) and is
    committed at group 0 (CommitPush); a trainer killed mid-run is replaced from the center by
    the spare, and each range's version still counts every push of every slot once."""
    steps = 200
    with LocalShardedServers(SERVER, ASYNC_JOB, 2, extra_server=SERVER_EXTRA) as cluster:
        trainers = [worker(cluster, "--name", "t%d" % i, "--slow-ms", "10")
                    for i in range(REPLICAS)]
        spare = worker(cluster, "--name", "spare", "--role", "spare")
        status = cluster.wait_for(lambda s: any(x.step >= 60 for x in s.slots), 90,
                                  what="60 steps pushed")
        victim = next(w for w in status.workers if w.name in ("t0", "t1") and
                      w.incarnation == status.slots[0].owner_incarnation)
        os.killpg(trainers[int(victim.name[1:])].pid, signal.SIGKILL)
        status = cluster.wait_for(finished, 180, what="every slot finished")
        _, versions = final_center(cluster, 2)
        assert versions == [REPLICAS * steps] * 2
        assert [x.update_count for x in status.slots] == [steps] * REPLICAS
        assert wait_exit(spare, 60) == 0
        assert "taking over slot (0, 0)" in read_log(spare)
        assert "pushing g and D every step" in read_log(spare)
