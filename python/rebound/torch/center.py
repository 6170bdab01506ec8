"""The center a Python worker syncs with, pushes to, pulls and reads snapshots from
(docs/python.md, docs/design.md §10.2):

* ``GroupCenter``: the job's one server group, through ParameterServer (Sync, Push, Pull).
* ``ShardedCenter``: a center sharded across K server groups (docs/sharding.md), as the C++
  worker's RangeClient (worker/range_client.cc): range k of the packed model (rebound.torch.wire)
  at group k (CenterRange), the K groups called at once (rebound.client.RangeGroups); a sync or
  a push is committed at group 0 (CommitSync, CommitPush) once every range answered.

``center_for`` picks one from the registration (RegisterResponse.range_addresses). Both have the
same methods; ``params``, ``like``, ``g`` and ``d`` are the model's tensors in declaration order
(float32, CPU) and tensors returned are new ones of their shapes. The sharded arithmetic is the
unsharded one element by element (kernels.elastic_pull_worker is elementwise), so the two end
bit-identical where the server's are (DETERMINISTIC scheduling, UNIFORM weights).

Errors: rebound.client's CallError, Unreachable and Stopped as Connection.call raises them (a
sharded call's is the lowest failing range's, naming it: "SyncRange of range 1: ..."), and
WorkerExit(EXIT_FAILED) for an answer that does not fit the model. Thread-safety: one work thread
calls a center; ShardedCenter uses its RangeGroups' threads inside a call.
"""

import math

import numpy as np
import torch

import rebound
from rebound import client as rclient
from rebound.torch import kernels
from rebound.torch import wire
from rebound_pb import rebound_pb2, sharding_pb2

# The optimizer state's parts, as OptimizerState names them.
_OPTIMIZER_PARTS = ("m", "v", "last_hdiag")


def center_for(conn, registration, stop):
    """The center of the job ``registration`` (a RegisterResponse from ``conn``'s server)
    belongs to; calls wait on the ``stop`` event. ValueError when the server's range groups do
    not fit the job."""
    addresses = list(registration.range_addresses)
    if len(addresses) <= 1:
        return GroupCenter(conn, stop)
    groups = registration.job.sharding.groups
    if len(addresses) != groups:
        raise ValueError("the server named %d range groups for a job sharded across "
                         "sharding.groups = %d" % (len(addresses), groups))
    return ShardedCenter(conn, rclient.RangeGroups(conn, addresses), stop)


class GroupCenter:
    """The center at the job's one server group (ParameterServer through ``conn``)."""

    def __init__(self, conn, stop):
        self._conn = conn
        self._stop = stop
        self.last_weight = None  # of the last sync's answer (the trainer's progress line)

    def sync(self, incarnation, slot, t, params, optimizer, loss, cursor):
        """The sync of step t (docs/protocol.md): ``optimizer`` (an OptimizerState) goes into
        the slot's snapshot, ``cursor`` is the data cursor (epoch, offset) after step t, a
        non-finite ``loss`` is not sent. The parameters after the sync."""
        request = rebound_pb2.SyncRequest(
            incarnation=incarnation, slot=slot, step=t, params=wire.bundle_of(params),
            optimizer=optimizer, data_epoch=cursor[0], data_offset=cursor[1])
        if math.isfinite(loss):
            request.loss = loss
        response = self._conn.call("Sync", request, stop=self._stop)
        self.last_weight = response.weight
        if response.HasField("worker_params_after"):
            return wire.tensors_of(response.worker_params_after, params, "worker_params_after")
        c_before = wire.tensors_of(response.center_before, params, "center_before")
        return [kernels.elastic_pull_worker(p.detach(), c, response.moving_rate)
                for p, c in zip(params, c_before)]

    def push(self, incarnation, slot, sequence, t, g, d, loss):
        """Mode ASYNC_ADAHESSIAN: the push of (g, D) with ``sequence`` at step t; the
        PushResponse."""
        return self._conn.call("Push", rebound_pb2.PushRequest(
            incarnation=incarnation, slot=slot, sequence=sequence, step=t,
            gradient=wire.bundle_of(g), hessian_diag=wire.bundle_of(d), loss=loss),
            stop=self._stop)

    def pull(self, incarnation, like):
        """The center of stage 0: (its tensors, its version)."""
        pulled = self._conn.call("Pull", rebound_pb2.PullRequest(incarnation=incarnation,
                                                                 stage=0), stop=self._stop)
        return wire.tensors_of(pulled.center, like, "center"), pulled.center_version

    def fill_snapshot(self, incarnation, snapshot, like):
        """A recovery task's snapshot comes whole from the one group: nothing to fill."""

    def close(self):
        pass


class ShardedCenter:
    """The center across ``ranges`` (a RangeGroups of K groups), group 0 through ``conn``."""

    def __init__(self, conn, ranges, stop):
        self._conn = conn
        self._ranges = ranges
        self._stop = stop
        self.last_weight = None  # of the last commit's answer (the trainer's progress line)

    @property
    def groups(self):
        return self._ranges.groups

    def _begins(self, n):
        """The K + 1 range boundaries of a packed vector of n elements."""
        groups = self.groups
        if n < groups:
            raise rclient.WorkerExit(rebound.EXIT_CONFIG, "the model has %d parameters, fewer "
                                     "than sharding.groups = %d: a range would be empty" % (
                                         n, groups))
        return [wire.range_begin(n, groups, k) for k in range(groups + 1)]

    def sync(self, incarnation, slot, t, params, optimizer, loss, cursor):
        """As GroupCenter.sync: SyncRange of every range at once, each range moved by its
        answer (the stored range when the group had applied step t already), then CommitSync.

        The optimizer state goes to the ranges' snapshots sliced like the parameters. A part
        that the optimizer lacks while it has another (Adam's last_hdiag, SGD momentum's v and
        last_hdiag) travels as zeros, so that every range snapshot is whole; importing it
        ignores that part. An optimizer with no state sends none."""
        x = wire.packed(params)
        begins = self._begins(len(x))
        state = _optimizer_parts(optimizer, len(x))

        def sync_range(k):
            begin, end = begins[k], begins[k + 1]
            request = sharding_pb2.SyncRangeRequest(
                incarnation=incarnation, slot=slot, step=t, range=k,
                params=wire.range_bundle(x[begin:end], slot.stage, k))
            if optimizer.HasField("step"):
                request.optimizer.step = optimizer.step
            for name, values in state.items():
                getattr(request.optimizer, name).CopyFrom(
                    wire.range_bundle(values[begin:end], slot.stage, k))
            response = self._ranges.call(k, "SyncRange", request, stop=self._stop)
            if response.HasField("worker_params_after"):
                after = wire.range_values(response.worker_params_after, end - begin,
                                          "worker_params_after of range %d" % k)
            else:
                c_before = wire.range_values(response.center_before, end - begin,
                                             "center_before of range %d" % k)
                after = kernels.elastic_pull_worker(
                    torch.from_numpy(x[begin:end]), torch.from_numpy(c_before),
                    response.moving_rate).numpy()
            return after, rebound_pb2.RangeSyncResult(
                range=k, center_version=response.center_version,
                partial_sq_norm=response.partial_sq_norm)

        answers = self._ranges.each(sync_range)
        commit = rebound_pb2.CommitSyncRequest(
            incarnation=incarnation, slot=slot, step=t, data_epoch=cursor[0],
            data_offset=cursor[1], ranges=[result for _, result in answers])
        if math.isfinite(loss):
            commit.loss = loss
        committed = self._conn.call("CommitSync", commit, stop=self._stop)
        self.last_weight = committed.weight
        return wire.unpacked(np.concatenate([after for after, _ in answers]), params)

    def push(self, incarnation, slot, sequence, t, g, d, loss):
        """As GroupCenter.push: PushRange of every range at once, then CommitPush; the commit's
        answer as a PushResponse (center_version: range 0's)."""
        g = wire.packed(g)
        d = wire.packed(d)
        begins = self._begins(len(g))

        def push_range(k):
            begin, end = begins[k], begins[k + 1]
            response = self._ranges.call(k, "PushRange", sharding_pb2.PushRangeRequest(
                incarnation=incarnation, slot=slot, sequence=sequence, step=t, range=k,
                gradient=wire.range_bundle(g[begin:end], slot.stage, k),
                hessian_diag=wire.range_bundle(d[begin:end], slot.stage, k)), stop=self._stop)
            return rebound_pb2.RangeSyncResult(range=k, center_version=response.center_version,
                                               partial_sq_norm=response.partial_sq_norm)

        results = self._ranges.each(push_range)
        commit = rebound_pb2.CommitPushRequest(incarnation=incarnation, slot=slot,
                                               sequence=sequence, step=t, ranges=results)
        if math.isfinite(loss):
            commit.loss = loss
        committed = self._conn.call("CommitPush", commit, stop=self._stop)
        return rebound_pb2.PushResponse(
            applied=committed.applied, applied_sequence=committed.applied_sequence,
            weight=committed.weight, center_version=results[0].center_version)

    def pull(self, incarnation, like):
        """As GroupCenter.pull: every range of stage 0 gathered (the version: range 0's)."""
        n = sum(t.numel() for t in like)
        begins = self._begins(n)

        def pull_range(k):
            pulled = self._ranges.call(k, "PullRange", sharding_pb2.PullRangeRequest(
                incarnation=incarnation, stage=0, range=k), stop=self._stop)
            return (wire.range_values(pulled.center, begins[k + 1] - begins[k],
                                      "center of range %d" % k), pulled.center_version)

        answers = self._ranges.each(pull_range)
        return (wire.unpacked(np.concatenate([values for values, _ in answers]), like),
                answers[0][1])

    def fill_snapshot(self, incarnation, snapshot, like):
        """Fills a recovery task's snapshot (a Snapshot message; group 0 sends its header, the
        step and data cursor, without tensors) with every range's snapshot at its step
        (ReadRangeSnapshot): params, and the optimizer's m, v and last_hdiag where the ranges
        hold them (all or none). Step 0 (the model's initialisation) and a snapshot that has
        its tensors already are left as they are."""
        if snapshot.step == 0 or len(snapshot.params.tensors) > 0:
            return
        n = sum(t.numel() for t in like)
        begins = self._begins(n)

        def read_range(k):
            part = self._ranges.call(k, "ReadRangeSnapshot", sharding_pb2.ReadRangeSnapshotRequest(
                incarnation=incarnation, slot=snapshot.slot, step=snapshot.step, range=k),
                stop=self._stop)
            if part.step != snapshot.step:
                raise rclient.WorkerExit(rebound.EXIT_FAILED, "range %d's snapshot is of step %d, "
                                         "not %d" % (k, part.step, snapshot.step))
            size = begins[k + 1] - begins[k]
            values = {"params": wire.range_values(part.params, size,
                                                  "snapshot params of range %d" % k)}
            for name in _OPTIMIZER_PARTS:
                bundle = getattr(part.optimizer, name)
                if len(bundle.tensors) > 0:
                    values[name] = wire.range_values(
                        bundle, size, "snapshot optimizer.%s of range %d" % (name, k))
            return values, part.optimizer

        answers = self._ranges.each(read_range)
        snapshot.params.CopyFrom(wire.bundle_of(wire.unpacked(
            np.concatenate([values["params"] for values, _ in answers]), like)))
        for name in _OPTIMIZER_PARTS:
            held = [name in values for values, _ in answers]
            if not any(held):
                continue
            if not all(held):
                raise rclient.WorkerExit(rebound.EXIT_FAILED, "the snapshot of step %d has "
                                         "optimizer.%s in ranges %s only" % (
                                             snapshot.step, name,
                                             [k for k, h in enumerate(held) if h]))
            getattr(snapshot.optimizer, name).CopyFrom(wire.bundle_of(wire.unpacked(
                np.concatenate([values[name] for values, _ in answers]), like)))
        first = answers[0][1]
        if first.HasField("step"):
            snapshot.optimizer.step = first.step

    def close(self):
        self._ranges.close()


def _optimizer_parts(optimizer, n):
    """{part: packed vector} of the OptimizerState ``optimizer``'s tensors for a model of n
    parameters: none when it has none, else every part, the missing ones zeros."""
    state = {name: wire.packed_bundle(getattr(optimizer, name)) for name in _OPTIMIZER_PARTS
             if len(getattr(optimizer, name).tensors) > 0}
    if not state:
        return state
    for name in _OPTIMIZER_PARTS:
        values = state.setdefault(name, np.zeros(n, dtype="<f4"))
        if len(values) != n:
            raise rclient.WorkerExit(rebound.EXIT_FAILED, "optimizer.%s holds %d values, the "
                                     "model %d" % (name, len(values), n))
    return state
