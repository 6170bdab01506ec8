"""rebound.torch.center's ShardedCenter against fake range groups: real gRPC servers on loopback
(port 0) that serve CenterRange (and, for group 0, ParameterServer's CommitSync and CommitPush)
and record what they receive. What each range gets (its slice of the packed model, the
credential and token, in parallel, retried), what the worker makes of the answers (bit for bit
the unsharded arithmetic), the commit at group 0, and the refusals. The real servers'
side: test_sharded.py. Every wait bounded; every server started here is stopped.
"""

import struct
import threading

import grpc
import numpy as np
import pytest
import torch
from concurrent import futures

import rebound
from rebound import client as rclient
from rebound.torch import center as rcenter
from rebound.torch import kernels
from rebound.torch import wire
from rebound_pb import rebound_pb2, rebound_pb2_grpc, sharding_pb2, sharding_pb2_grpc

GROUPS = 3
TOKEN = "Bearer operator-token"
CREDENTIAL = "secret-of-incarnation-7"
SLOT = rebound_pb2.SlotId(replica=1, stage=0)
BOUND_S = 10.0


class RangeGroup(sharding_pb2_grpc.CenterRangeServicer, rebound_pb2_grpc.ParameterServerServicer):
    """Group k of the fake job: answers each CenterRange call with ``answer(method, request)``
    (a message, or a grpc.StatusCode to refuse with) and records (method, request, metadata)."""

    def __init__(self, k, answer):
        self.k = k
        self.answer = answer
        self.calls = []
        self.lock = threading.Lock()

    def _serve(self, method, request, context):
        with self.lock:
            self.calls.append((method, request, dict(context.invocation_metadata())))
        answer = self.answer(method, request)
        if isinstance(answer, grpc.StatusCode):
            context.abort(answer, "%s refused by range %d" % (method, self.k))
        return answer

    def SyncRange(self, request, context):
        return self._serve("SyncRange", request, context)

    def PushRange(self, request, context):
        return self._serve("PushRange", request, context)

    def PullRange(self, request, context):
        return self._serve("PullRange", request, context)

    def ReadRangeSnapshot(self, request, context):
        return self._serve("ReadRangeSnapshot", request, context)

    def CommitSync(self, request, context):
        return self._serve("CommitSync", request, context)

    def CommitPush(self, request, context):
        return self._serve("CommitPush", request, context)

    def methods(self):
        with self.lock:
            return [method for method, _, _ in self.calls]

    def requests(self, method):
        with self.lock:
            return [request for m, request, _ in self.calls if m == method]


class Job:
    """K fake groups, a Connection to group 0 with a credential and a token, a ShardedCenter."""

    def __init__(self, answer, groups=GROUPS):
        self.groups = [RangeGroup(k, answer) for k in range(groups)]
        self.servers = []
        addresses = []
        for group in self.groups:
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            sharding_pb2_grpc.add_CenterRangeServicer_to_server(group, server)
            rebound_pb2_grpc.add_ParameterServerServicer_to_server(group, server)
            port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            self.servers.append(server)
            addresses.append("127.0.0.1:%d" % port)
        self.conn = rclient.Connection(rclient.Options(
            server=addresses[0], token=TOKEN, rpc_deadline_s=BOUND_S, backoff_initial_s=0.01,
            backoff_max_s=0.05, give_up_after_s=BOUND_S))
        self.conn.set_credential(CREDENTIAL)
        registration = rebound_pb2.RegisterResponse(range_addresses=addresses)
        registration.job.sharding.groups = groups
        self.stop = threading.Event()
        self.center = rcenter.center_for(self.conn, registration, self.stop)

    def close(self):
        self.center.close()
        self.conn.close()
        for server in self.servers:
            server.stop(grace=None)


@pytest.fixture
def make_job():
    jobs = []

    def make(answer, groups=GROUPS):
        jobs.append(Job(answer, groups))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


def model(seed=3):
    """A model of 4 tensors, 2 * 5 + 5 + 3 * 5 + 3 = 33 parameters (ranges of 11)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in ((2, 5), (5,), (3, 5), (3,))]


def bounds(n, groups=GROUPS):
    return [wire.range_begin(n, groups, k) for k in range(groups + 1)]


def values_of(bundle):
    assert len(bundle.tensors) == 1
    return np.frombuffer(bundle.tensors[0].data, "<f4")


def test_ranges_are_the_servers_integer_split():
    # compute/shard_ranges.h: floor(k n / K), so sizes are floor(n/K) or ceil(n/K).
    assert bounds(10) == [0, 3, 6, 10]
    assert bounds(33) == [0, 11, 22, 33]
    assert bounds(7, 2) == [0, 3, 7]
    n = 1_000_003
    sizes = np.diff(bounds(n, 7))
    assert set(sizes) == {n // 7, n // 7 + 1} and sizes.sum() == n
    # Integer arithmetic, exact where floating point would round.
    assert wire.range_begin(10 ** 17 + 1, 3, 2) == 66666666666666667
    assert int((10 ** 17 + 1) * 2 / 3) == 66666666666666664


def test_a_registration_without_range_groups_gets_the_one_group_center():
    conn = rclient.Connection(rclient.Options(server="127.0.0.1:1"))
    try:
        none = rebound_pb2.RegisterResponse()
        assert isinstance(rcenter.center_for(conn, none, threading.Event()), rcenter.GroupCenter)
        one = rebound_pb2.RegisterResponse(range_addresses=["127.0.0.1:1"])
        one.job.sharding.groups = 1
        assert isinstance(rcenter.center_for(conn, one, threading.Event()), rcenter.GroupCenter)
        wrong = rebound_pb2.RegisterResponse(range_addresses=["127.0.0.1:1", "127.0.0.1:2"])
        wrong.job.sharding.groups = 3
        with pytest.raises(ValueError, match="named 2 range groups for a job sharded across "
                                             "sharding.groups = 3"):
            rcenter.center_for(conn, wrong, threading.Event())
    finally:
        conn.close()


def test_a_sync_sends_each_range_its_slice_at_once_and_commits_in_range_order(make_job):
    x = model()
    n = sum(t.numel() for t in x)
    begins = bounds(n)
    packed = wire.packed(x)
    center = np.arange(n, dtype=np.float32) * np.float32(0.01)
    applied_before = 1  # range 1 had applied the step: it answers with its stored range
    stored = np.full(begins[2] - begins[1], 7.5, dtype=np.float32)
    # Every SyncRange waits until all K arrived: the ranges are called at once, not in turn.
    together = threading.Barrier(GROUPS, timeout=BOUND_S)

    def answer(method, request):
        if method == "CommitSync":
            return rebound_pb2.CommitSyncResponse(weight=1.0, next_weight=1.0)
        together.wait()
        k = request.range
        b, e = begins[k], begins[k + 1]
        if k == applied_before:
            return sharding_pb2.SyncRangeResponse(
                worker_params_after=wire.range_bundle(stored, 0, k), center_version=40,
                moving_rate=0.45)
        return sharding_pb2.SyncRangeResponse(
            center_before=wire.range_bundle(center[b:e], 0, k), center_version=40 + k,
            weight=1.0, moving_rate=0.45, partial_sq_norm=0.25 * (k + 1))

    job = make_job(answer)
    m, v, d = model(4), model(5), model(6)
    optimizer = rebound_pb2.OptimizerState(step=20, m=wire.bundle_of(m), v=wire.bundle_of(v),
                                           last_hdiag=wire.bundle_of(d))
    after = job.center.sync(7, SLOT, 20, x, optimizer, 0.75, (2, 96))

    for k, group in enumerate(job.groups):
        b, e = begins[k], begins[k + 1]
        (request,) = group.requests("SyncRange")
        assert (request.incarnation, request.step, request.range) == (7, 20, k)
        assert (request.slot.replica, request.slot.stage) == (1, 0)
        tensor = request.params.tensors[0]
        assert (tensor.id, tensor.name, list(tensor.shape)) == (0, "stage0.range%d" % k, [e - b])
        assert values_of(request.params).tobytes() == packed[b:e].tobytes()
        assert request.optimizer.step == 20
        for part, values in (("m", m), ("v", v), ("last_hdiag", d)):
            got = values_of(getattr(request.optimizer, part))
            assert got.tobytes() == wire.packed(values)[b:e].tobytes(), part
        metadata = group.calls[0][2]
        assert metadata[rclient.CREDENTIAL_KEY] == CREDENTIAL
        assert metadata["authorization"] == TOKEN

    (commit,) = job.groups[0].requests("CommitSync")
    assert job.groups[0].methods()[-1] == "CommitSync"
    assert (commit.incarnation, commit.step, commit.loss) == (7, 20, 0.75)
    assert (commit.data_epoch, commit.data_offset) == (2, 96)
    assert [(r.range, r.center_version, r.partial_sq_norm) for r in commit.ranges] == [
        (0, 40, 0.25), (1, 40, 0.0), (2, 42, 0.75)]
    assert all(not g.requests("CommitSync") for g in job.groups[1:])

    # The fresh ranges moved by the unsharded kernel on the whole model, bit for bit; the
    # applied range is its stored values.
    whole = [kernels.elastic_pull_worker(t, c, 0.45)
             for t, c in zip(x, wire.unpacked(center, x))]
    expected = wire.packed(whole)
    expected[begins[1]:begins[2]] = stored
    assert [list(t.shape) for t in after] == [list(t.shape) for t in x]
    assert wire.packed(after).tobytes() == expected.tobytes()
    assert not np.array_equal(wire.packed(after), packed)  # the move is not the identity


def test_an_optimizer_state_is_sent_whole_or_not_at_all(make_job):
    x = model()
    n = sum(t.numel() for t in x)
    begins = bounds(n)

    def answer(method, request):
        if method == "CommitSync":
            return rebound_pb2.CommitSyncResponse()
        b, e = begins[request.range], begins[request.range + 1]
        return sharding_pb2.SyncRangeResponse(
            center_before=wire.range_bundle(np.zeros(e - b, np.float32), 0, request.range))

    job = make_job(answer)
    # SGD with momentum: m only; v and last_hdiag travel as zeros (importing SGD ignores them).
    momentum = model(8)
    job.center.sync(7, SLOT, 10, x, rebound_pb2.OptimizerState(
        step=10, m=wire.bundle_of(momentum)), float("nan"), (0, 32))
    # No state at all (SGD without momentum, an optimizer that exports none): no tensors.
    job.center.sync(7, SLOT, 20, x, rebound_pb2.OptimizerState(step=20), float("nan"), (0, 64))
    job.center.sync(7, SLOT, 30, x, rebound_pb2.OptimizerState(), float("nan"), (0, 96))
    for k, group in enumerate(job.groups):
        b, e = begins[k], begins[k + 1]
        partial, stateless, empty = group.requests("SyncRange")
        assert values_of(partial.optimizer.m).tobytes() == wire.packed(momentum)[b:e].tobytes()
        for part in ("v", "last_hdiag"):
            assert values_of(getattr(partial.optimizer, part)).tobytes() == bytes(4 * (e - b))
        for request in (stateless, empty):
            assert not request.optimizer.m.tensors and not request.optimizer.v.tensors
            assert not request.optimizer.last_hdiag.tensors
        assert stateless.optimizer.step == 20 and not empty.HasField("optimizer")
    # A non-finite loss is not sent.
    assert not any(c.HasField("loss") for c in job.groups[0].requests("CommitSync"))


def test_the_lowest_failing_range_is_raised_and_nothing_is_committed(make_job):
    def answer(method, request):
        if method == "CommitSync":
            return rebound_pb2.CommitSyncResponse()
        if request.range == 2:
            return grpc.StatusCode.FAILED_PRECONDITION
        if request.range == 1:
            return grpc.StatusCode.INVALID_ARGUMENT
        return sharding_pb2.SyncRangeResponse(
            center_before=wire.range_bundle(np.zeros(11, np.float32), 0, 0))

    job = make_job(answer)
    with pytest.raises(rclient.CallError) as error:
        job.center.sync(7, SLOT, 10, model(), rebound_pb2.OptimizerState(), 1.0, (0, 0))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(error.value).startswith("SyncRange of range 1: INVALID_ARGUMENT")
    # Every range was asked (all at once); none was committed.
    assert [len(g.requests("SyncRange")) for g in job.groups] == [1, 1, 1]
    assert not job.groups[0].requests("CommitSync")


def test_an_unavailable_range_is_retried_and_a_misfit_answer_is_refused(make_job):
    refusals = {"left": 2}
    lock = threading.Lock()

    def answer(method, request):
        if method == "CommitSync":
            return rebound_pb2.CommitSyncResponse()
        size = 11
        if request.range == 2:
            with lock:
                if refusals["left"] > 0:
                    refusals["left"] -= 1
                    return grpc.StatusCode.UNAVAILABLE
            if request.step == 20:
                size = 12  # one value too many
        return sharding_pb2.SyncRangeResponse(
            center_before=wire.range_bundle(np.zeros(size, np.float32), 0, request.range))

    job = make_job(answer)
    job.center.sync(7, SLOT, 10, model(), rebound_pb2.OptimizerState(), 1.0, (0, 0))
    assert len(job.groups[2].requests("SyncRange")) == 3  # two refusals, then the answer
    assert len(job.groups[0].requests("CommitSync")) == 1
    with pytest.raises(rclient.WorkerExit) as misfit:
        job.center.sync(7, SLOT, 20, model(), rebound_pb2.OptimizerState(), 1.0, (0, 0))
    assert misfit.value.code == rebound.EXIT_FAILED
    assert "center_before of range 2" in str(misfit.value) and "shape [12]" in str(misfit.value)
    assert len(job.groups[0].requests("CommitSync")) == 1


def test_a_pull_gathers_every_range_and_reports_range_zeros_version(make_job):
    x = model()
    n = sum(t.numel() for t in x)
    begins = bounds(n)
    center = (np.arange(n, dtype=np.float32) - 5) / np.float32(3)

    def answer(method, request):
        assert method == "PullRange" and request.stage == 0 and request.incarnation == 9
        b, e = begins[request.range], begins[request.range + 1]
        return sharding_pb2.PullRangeResponse(
            center=wire.range_bundle(center[b:e], 0, request.range),
            center_version=100 + request.range)

    job = make_job(answer)
    tensors, version = job.center.pull(9, x)
    assert version == 100
    assert [list(t.shape) for t in tensors] == [[2, 5], [5], [3, 5], [3]]
    assert wire.packed(tensors).tobytes() == center.tobytes()
    assert [len(g.requests("PullRange")) for g in job.groups] == [1, 1, 1]


def test_a_push_sends_every_range_its_part_then_commits(make_job):
    g, d = model(11), model(12)
    n = sum(t.numel() for t in g)
    begins = bounds(n)

    def answer(method, request):
        if method == "CommitPush":
            return rebound_pb2.CommitPushResponse(applied=False, applied_sequence=6, weight=0.5)
        return sharding_pb2.PushRangeResponse(applied=True, applied_sequence=5,
                                              center_version=10 * (request.range + 1),
                                              partial_sq_norm=float(request.range))

    job = make_job(answer)
    pushed = job.center.push(9, SLOT, 5, 5, g, d, 1.25)
    assert (pushed.applied, pushed.applied_sequence, pushed.weight, pushed.center_version) == (
        False, 6, 0.5, 10)
    for k, group in enumerate(job.groups):
        (request,) = group.requests("PushRange")
        b, e = begins[k], begins[k + 1]
        assert (request.sequence, request.step, request.range) == (5, 5, k)
        assert values_of(request.gradient).tobytes() == wire.packed(g)[b:e].tobytes()
        assert values_of(request.hessian_diag).tobytes() == wire.packed(d)[b:e].tobytes()
    (commit,) = job.groups[0].requests("CommitPush")
    assert (commit.sequence, commit.step, commit.loss) == (5, 5, 1.25)
    assert [(r.range, r.center_version, r.partial_sq_norm) for r in commit.ranges] == [
        (0, 10, 0.0), (1, 20, 1.0), (2, 30, 2.0)]


def snapshot_job(make_job, parts_of_range):
    """A job whose ranges answer ReadRangeSnapshot of step 40 from the packed vectors in
    ``parts_of_range(k)`` ({"params": ..., "m": ...})."""
    def answer(method, request):
        assert method == "ReadRangeSnapshot" and request.step == 40 and request.incarnation == 9
        k = request.range
        parts = parts_of_range(k)
        snapshot = rebound_pb2.Snapshot(slot=request.slot, step=40)
        snapshot.params.CopyFrom(wire.range_bundle(parts["params"], 0, k))
        snapshot.optimizer.step = 39
        for name in ("m", "v", "last_hdiag"):
            if name in parts:
                getattr(snapshot.optimizer, name).CopyFrom(wire.range_bundle(parts[name], 0, k))
        return snapshot

    return make_job(answer)


def test_a_snapshot_header_is_filled_from_every_range(make_job):
    like = model()
    n = sum(t.numel() for t in like)
    begins = bounds(n)
    whole = {name: np.arange(n, dtype=np.float32) + np.float32(100 * i)
             for i, name in enumerate(("params", "m", "v", "last_hdiag"))}
    job = snapshot_job(make_job, lambda k: {name: values[begins[k]:begins[k + 1]]
                                            for name, values in whole.items()})
    header = rebound_pb2.Snapshot(slot=SLOT, step=40, data_epoch=1, data_offset=64)
    job.center.fill_snapshot(9, header, like)
    assert [list(t.shape) for t in header.params.tensors] == [[2, 5], [5], [3, 5], [3]]
    assert wire.packed_bundle(header.params).tobytes() == whole["params"].tobytes()
    for name in ("m", "v", "last_hdiag"):
        assert wire.packed_bundle(getattr(header.optimizer, name)).tobytes() == \
            whole[name].tobytes()
    assert header.optimizer.step == 39  # the trainer's, as the ranges stored it
    assert (header.data_epoch, header.data_offset) == (1, 64)
    # Step 0 is the model's initialisation, and a filled snapshot stays as it is: no calls.
    calls = sum(len(g.calls) for g in job.groups)
    job.center.fill_snapshot(9, rebound_pb2.Snapshot(slot=SLOT, step=0), like)
    job.center.fill_snapshot(9, header, like)
    assert sum(len(g.calls) for g in job.groups) == calls


def test_a_snapshot_without_optimizer_state_stays_without_and_a_partial_one_is_refused(make_job):
    like = model()
    n = sum(t.numel() for t in like)
    begins = bounds(n)
    params = np.arange(n, dtype=np.float32)

    def stateless(k):
        return {"params": params[begins[k]:begins[k + 1]]}

    job = snapshot_job(make_job, stateless)
    header = rebound_pb2.Snapshot(slot=SLOT, step=40)
    job.center.fill_snapshot(9, header, like)
    assert wire.packed_bundle(header.params).tobytes() == params.tobytes()
    assert not header.optimizer.m.tensors and not header.optimizer.last_hdiag.tensors

    def range_one_only(k):
        parts = stateless(k)
        if k == 1:
            parts["m"] = parts["params"]
        return parts

    job = snapshot_job(make_job, range_one_only)
    with pytest.raises(rclient.WorkerExit, match=r"optimizer.m in ranges \[1\] only"):
        job.center.fill_snapshot(9, rebound_pb2.Snapshot(slot=SLOT, step=40), like)


def test_a_model_smaller_than_the_groups_is_refused(make_job):
    job = make_job(lambda method, request: pytest.fail("no call expected"), groups=3)
    with pytest.raises(rclient.WorkerExit) as error:
        job.center.pull(9, [torch.zeros(2)])
    assert error.value.code == rebound.EXIT_CONFIG
    assert "2 parameters, fewer than sharding.groups = 3" in str(error.value)


def test_packing_keeps_the_bytes_of_every_value():
    x = model()
    x[1][2] = float("nan")
    x[3][0] = -0.0
    packed = wire.packed(x)
    assert packed.tobytes() == b"".join(t.data for t in wire.bundle_of(x).tensors)
    assert wire.packed_bundle(wire.bundle_of(x)).tobytes() == packed.tobytes()
    back = wire.unpacked(packed, x)
    assert b"".join(t.numpy().tobytes() for t in back) == packed.tobytes()
    assert struct.unpack("<f", back[3].numpy()[:1].tobytes())[0] == 0.0
    assert np.signbit(back[3].numpy()[0])
