"""Tensors on the wire (proto/tensor.proto): a model's parameters as a TensorBundle, and the
packed vector and ranges of a center sharded across K server groups (docs/sharding.md).

A model travels as one FLOAT32 tensor per parameter, ids 0.. in declaration order, its data the
little-endian float32 values. Its packed vector is those values flattened and concatenated in
declaration order (n elements: the bundle's data, one tensor after another). Range k of K is
elements [range_begin(n, K, k), range_begin(n, K, k + 1)) with range_begin = floor(k n / K)
(compute/shard_ranges.h), carried as a bundle of one tensor: id 0, name "stage<s>.range<k>",
shape [n_k].

An answer that does not fit what is expected raises WorkerExit(EXIT_FAILED) naming ``what``.
"""

import numpy as np
import torch

import rebound
from rebound.client import WorkerExit
from rebound_pb import tensor_pb2


def bundle_of(tensors, names=None, with_data=True):
    """The bundle of ``tensors`` (float32 CPU tensors), ids in order, ``names`` if given."""
    bundle = tensor_pb2.TensorBundle()
    for i, t in enumerate(tensors):
        t = t.detach()
        out = bundle.tensors.add()
        out.id = i
        if names is not None:
            out.name = names[i]
        out.dtype = tensor_pb2.FLOAT32
        out.shape.extend(int(d) for d in t.shape)
        if with_data:
            out.data = t.contiguous().numpy().astype("<f4", copy=False).tobytes()
    return bundle


def tensors_of(bundle, like, what):
    """New tensors from ``bundle``, which must hold one FLOAT32 tensor of each shape of
    ``like``, in order."""
    if len(bundle.tensors) != len(like):
        raise WorkerExit(rebound.EXIT_FAILED, "%s holds %d tensors, the model has %d" % (
            what, len(bundle.tensors), len(like)))
    out = []
    for t, ref in zip(bundle.tensors, like):
        if list(t.shape) != list(ref.shape) or t.dtype != tensor_pb2.FLOAT32:
            raise WorkerExit(rebound.EXIT_FAILED, "%s: tensor %d '%s' has shape %s, the model's "
                             "%s" % (what, t.id, t.name, list(t.shape), list(ref.shape)))
        values = np.frombuffer(t.data, dtype="<f4")
        if values.size != ref.numel():
            raise WorkerExit(rebound.EXIT_FAILED, "%s: tensor %d holds %d values, expected %d" % (
                what, t.id, values.size, ref.numel()))
        out.append(torch.from_numpy(values.copy()).reshape(ref.shape))
    return out


# ---------------------------------------------------------------------------------------------
# The packed vector and its ranges.

def range_begin(n, groups, k):
    """compute::RangeBegin: the first element of range k of ``groups`` (k = groups: n)."""
    return n * k // groups


def packed(tensors):
    """The packed vector of ``tensors``: a new float32 array of their values in order."""
    return np.concatenate([t.detach().contiguous().numpy().astype("<f4", copy=False).reshape(-1)
                           for t in tensors])


def packed_bundle(bundle):
    """The packed vector of a bundle's tensors (their data one after another), a new array."""
    return np.frombuffer(b"".join(t.data for t in bundle.tensors), dtype="<f4").copy()


def unpacked(values, like):
    """``values`` (a packed vector) as new tensors of the shapes of ``like``, in order."""
    out = []
    at = 0
    for ref in like:
        count = ref.numel()
        out.append(torch.from_numpy(np.array(values[at:at + count], dtype="<f4"))
                   .reshape(ref.shape))
        at += count
    if at != len(values):
        raise WorkerExit(rebound.EXIT_FAILED, "a packed vector of %d values for a model of %d" % (
            len(values), at))
    return out


def range_bundle(values, stage, k):
    """Range k of stage ``stage`` (its values, a float32 array) as a one-tensor bundle."""
    bundle = tensor_pb2.TensorBundle()
    tensor = bundle.tensors.add()
    tensor.id = 0
    tensor.name = "stage%d.range%d" % (stage, k)
    tensor.dtype = tensor_pb2.FLOAT32
    tensor.shape.append(len(values))
    tensor.data = np.asarray(values, dtype="<f4").tobytes()
    return bundle


def range_values(bundle, size, what):
    """The values of a range bundle, which must be one FLOAT32 tensor of id 0 and shape
    [size]: a new float32 array."""
    if len(bundle.tensors) != 1:
        raise WorkerExit(rebound.EXIT_FAILED, "%s holds %d tensors, a range has 1" % (
            what, len(bundle.tensors)))
    t = bundle.tensors[0]
    if t.id != 0 or t.dtype != tensor_pb2.FLOAT32 or list(t.shape) != [size]:
        raise WorkerExit(rebound.EXIT_FAILED, "%s: tensor %d '%s' of dtype %d and shape %s, the "
                         "range is tensor 0 of FLOAT32 (%d) and shape [%d]" % (
                             what, t.id, t.name, t.dtype, list(t.shape), tensor_pb2.FLOAT32,
                             size))
    if len(t.data) != 4 * size:
        raise WorkerExit(rebound.EXIT_FAILED, "%s holds %d bytes, the range's %d values take %d" %
                         (what, len(t.data), size, 4 * size))
    return np.frombuffer(t.data, dtype="<f4").copy()
