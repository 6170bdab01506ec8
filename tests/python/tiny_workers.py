"""What the tests that run tests/python/tiny_spec.py against a real rebound_server share:
starting its workers (TINY_SPEC names the script), waiting for their exit, and registering by
hand with (a variant of) its model's declaration. ``server`` is a rebound.cluster LocalServer or
LocalShardedServers (group 0 then)."""

import os
import struct
import sys

import torch

from rebound import client as rclient
from rebound.cluster import read_log
from rebound.torch import wire
from rebound_pb import config_pb2, rebound_pb2

SPEC = os.environ["TINY_SPEC"]


def worker(server, *args):
    """tiny_spec.py with ``args`` as a worker of ``server``: its process."""
    return server.start_worker([sys.executable, SPEC, "--server", server.address] + list(args))


def wait_exit(process, timeout_s):
    """The exit code of ``process``; AssertionError with its log if it runs past timeout_s."""
    try:
        return process.wait(timeout=timeout_s)
    except Exception:
        raise AssertionError("worker still running after %.0f s; its log:\n%s" % (
            timeout_s, read_log(process)[-3000:]))


def tiny_model_bundle(hidden=32, nan=False):
    """tiny_spec's model declaration (hidden = 32) as its workers send it; another width, or a
    NaN in tensor 1, for the refusals."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.Tanh(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(hidden, 4))
    bundle = wire.bundle_of(list(model.parameters()),
                            [n for n, _ in model.named_parameters()])
    if nan:
        data = bytearray(bundle.tensors[1].data)
        data[0:4] = struct.pack("<f", float("nan"))
        bundle.tensors[1].data = bytes(data)
    return bundle


def register(server, name, model=None, role=config_pb2.ROLE_UNSPECIFIED):
    """Registers ``name`` with job "tiny" at ``server``: (a Connection holding its credential,
    the RegisterResponse)."""
    conn = rclient.Connection(rclient.Options(server=server.address, give_up_after_s=10))
    request = rebound_pb2.RegisterRequest(job_id="tiny", worker_name=name, requested_role=role)
    if model is not None:
        request.model.CopyFrom(model)
    response = conn.call("Register", request)
    conn.set_credential(response.credential)
    return conn, response
