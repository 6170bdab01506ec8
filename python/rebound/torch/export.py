"""The trained model in the user's hands (docs/design.md §12, docs/python.md#the-trained-model).

    import rebound.torch as rt
    versions = rt.load_center("127.0.0.1:7070", model)      # the server's center, into model
    state, versions = rt.export_center("127.0.0.1:7070")    # {name: tensor}, as committed
    state = rt.load_safetensors("model.safetensors")        # what `reboundctl export` wrote

All three read the server's ExportCenter, an operator call: from the server's own host it needs
nothing; a server with ``security.operator_token_file`` wants that token
(``operator_token_file``), and one with a bearer token that too (``token_file``). A replicated
group's members, comma-separated, reach its leader. A declared model's tensors carry the names of
``model.named_parameters()`` and of its float32 buffers (as ``rebound.torch.run`` declared
them); the built-in MLP's are ``layer<l>.weight`` (out x in) and ``layer<l>.bias``.
"""

import collections
import json
import struct

import numpy as np
import torch

from rebound import client as rclient
from rebound_pb import rebound_pb2

OPERATOR_TOKEN_KEY = "rebound-operator-token"  # common/security.h kOperatorTokenKey


def _read_token(path):
    if not path:
        return ""
    with open(path) as f:
        return f.readline().strip()


def export_center(server, operator_token_file=None, token_file=None, deadline_s=60.0):
    """Every stage's center as the server committed it: an OrderedDict name -> float32 tensor
    (stages in order) and the list of each stage's center version. Raises rebound.client's
    CallError (e.g. UNAUTHENTICATED without the operator token) or Unreachable."""
    options = rclient.Options(server=server, token=_read_token(token_file),
                              rpc_deadline_s=deadline_s, give_up_after_s=deadline_s)
    conn = rclient.Connection(options)
    operator = _read_token(operator_token_file)
    operator_metadata = conn.metadata() + ([(OPERATOR_TOKEN_KEY, operator)] if operator else [])

    def export(request, timeout, metadata=None):
        # call_with_retry passes the worker's metadata; an operator call carries its own.
        return conn.stub.ExportCenter(request, timeout=timeout, metadata=operator_metadata)

    try:
        reply = rclient.call_with_retry(conn, export, "ExportCenter",
                                        rebound_pb2.ExportCenterRequest(), deadline_s=deadline_s)
    finally:
        conn.close()
    state = collections.OrderedDict()
    versions = []
    for stage in reply.stages:
        versions.append(stage.center_version)
        for t in stage.center.tensors:
            values = np.frombuffer(t.data, dtype="<f4").reshape(tuple(t.shape))
            state[t.name] = torch.from_numpy(values.copy())
    return state, versions


def load_center(server, model, operator_token_file=None, token_file=None, deadline_s=60.0):
    """Copies the server's current center into ``model``'s declared tensors, by name: its
    parameters and float32 buffers (BatchNorm's running statistics, which the center holds as
    ``rebound.torch.run`` declares them); returns each stage's center version. Raises ValueError
    when the center's tensors and the model's differ in names or shapes."""
    from rebound.torch.runner import declared_tensors
    state, versions = export_center(server, operator_token_file, token_file, deadline_s)
    params = dict(zip(*declared_tensors(model)))
    missing = [name for name in params if name not in state]
    extra = [name for name in state if name not in params]
    if missing or extra:
        raise ValueError("the server's center does not fit the model: the model's %s are not "
                         "in it; its %s are not the model's" % (missing, extra))
    for name, p in params.items():
        if tuple(p.shape) != tuple(state[name].shape):
            raise ValueError("tensor '%s': the model's shape is %s, the center's %s"
                             % (name, tuple(p.shape), tuple(state[name].shape)))
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name])
    return versions


def load_safetensors(path):
    """{name: float32 tensor} of a safetensors file (as `reboundctl export` writes; F32 only),
    read with the format's definition: an 8-byte little-endian header length, the JSON header,
    the data. ``model.load_state_dict(load_safetensors(path))`` for a declared model."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    header.pop("__metadata__", None)
    data = memoryview(raw)[8 + n:]
    state = collections.OrderedDict()
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        if entry["dtype"] != "F32":
            raise ValueError("%s: tensor '%s' is %s; only F32 is read" % (path, name,
                                                                        entry["dtype"]))
        begin, end = entry["data_offsets"]
        values = np.frombuffer(data[begin:end], dtype="<f4").reshape(tuple(entry["shape"]))
        state[name] = torch.from_numpy(values.copy())
    return state


def safetensors_bytes(state, metadata=None):
    """A safetensors file of {name: float32 tensor}, in order (common/safetensors.h's layout:
    the JSON header padded with spaces to 8 bytes)."""
    header = collections.OrderedDict()
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    chunks = []
    offset = 0
    for name, tensor in state.items():
        values = tensor.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False)
        data = values.tobytes()
        header[name] = {"dtype": "F32", "shape": list(values.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)
