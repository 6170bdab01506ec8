"""reboundctl export (R17, docs/operations.md#export) against the real binaries: C++ trainers
train the built-in MLP on Fashion-MNIST with an evaluator; the operator exports the center to
safetensors; the file, read here with Python's own struct and json (no Rebound code reads it),
loads into the equivalent torch nn.Sequential, whose test accuracy is the one the evaluator
reported for the exported center version (within 0.05 pt: 5 of the 10,000 test images, for
float32 sums taken in another order)."""

import argparse
import json
import shutil
import os
import struct
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import torch

from rebound.cluster import LocalServer
from rebound_pb import rebound_pb2, rebound_pb2_grpc
from rebound.torch.data import FashionMnist

SERVER = os.environ["REBOUND_SERVER"]
WORKER = os.environ["REBOUND_WORKER"]
REBOUNDCTL = os.environ["REBOUNDCTL"]
TINY_SPEC = os.environ["TINY_SPEC"]

HIDDEN = 64
JOB = """
job_id: "export"
model { input_dim: 784 layers { width: %d activation: RELU }
        layers { width: 10 activation: IDENTITY } init_seed: 7 }
topology { replicas: 2 stages: 1 evaluator: true }
data { batch_size: 32 micro_batches: 2 train_limit: 4000 test_limit: 0 }
adahessian { lr: 0.05 }
easgd { sync_period: 10 }
training { max_steps: 200 eval_every_ms: 100 }
""" % HIDDEN
TOKEN = "export-operator-token"


def read_safetensors(path):
    """{name: float32 array} and the metadata, from the format's definition."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    end_of_data = 0
    for name, entry in header.items():
        assert entry["dtype"] == "F32", (name, entry)
        begin, end = entry["data_offsets"]
        values = np.frombuffer(data[begin:end], dtype="<f4").reshape(entry["shape"])
        tensors[name] = values
        end_of_data = max(end_of_data, end)
    assert end_of_data == len(data), "bytes after the last tensor"
    return tensors, metadata


def start(server, name, role, config):
    return server.start_worker([WORKER, "--config", config, "--role", role, "--name", name])


@pytest.fixture
def trained(tmp_path):
    token_file = tmp_path / "operator-token"
    token_file.write_text(TOKEN + "\n")
    with LocalServer(SERVER, JOB,
                     extra_server='security { operator_token_file: "%s" }' % token_file) as server:
        config = tmp_path / "worker.pbtxt"
        config.write_text('server_address: "%s"\npeer_listen_address: "127.0.0.1:0"\n'
                          'rpc_deadline_ms: 10000\n' % server.address)
        start(server, "evaluator", "evaluator", str(config))
        for i in range(2):
            start(server, "trainer-%d" % i, "trainer", str(config))
        status = server.wait_for(
            lambda s: len(s.slots) == 2 and all(x.state == 6 for x in s.slots), 120,
            what="every slot FINISHED")
        final = status.centers[0].version
        assert final == 2 * 200 // 10  # every sync of both trainers, once
        status = server.wait_for(lambda s: s.last_eval.center_version == final, 60,
                                 what="the evaluator's report of the final center")
        yield server, status, str(token_file)


def export(server, path, *extra):
    return subprocess.run([REBOUNDCTL, "--server", server.address, *extra, "export", "-o", path],
                          capture_output=True, text=True, timeout=60)


def test_the_exported_model_loads_into_pytorch_with_the_evaluators_accuracy(trained, tmp_path):
    server, status, token_file = trained
    path = str(tmp_path / "model.safetensors")
    done = export(server, path, "--operator_token_file", token_file)
    assert done.returncode == 0, done.stderr
    assert "center version %d" % status.centers[0].version in done.stdout

    tensors, metadata = read_safetensors(path)
    assert metadata["format"] == "pt"
    assert metadata["rebound.job_id"] == "export"
    assert metadata["rebound.center_versions"] == str(status.centers[0].version)
    assert {name: t.shape for name, t in tensors.items()} == {
        "layer0.weight": (HIDDEN, 784), "layer0.bias": (HIDDEN,),
        "layer1.weight": (10, HIDDEN), "layer1.bias": (10,)}

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, HIDDEN),
                                torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10))
    model.load_state_dict({
        "1.weight": torch.from_numpy(tensors["layer0.weight"].copy()),
        "1.bias": torch.from_numpy(tensors["layer0.bias"].copy()),
        "3.weight": torch.from_numpy(tensors["layer1.weight"].copy()),
        "3.bias": torch.from_numpy(tensors["layer1.bias"].copy())})
    test = FashionMnist("test")
    with torch.no_grad():
        accuracy = (model(test.images).argmax(dim=1) == test.labels).double().mean().item()
    reported = status.last_eval.test_accuracy
    assert reported > 0.5  # it trained
    assert abs(accuracy - reported) <= 5 / 10000, (accuracy, reported)


def test_an_export_or_a_backup_without_the_operator_token_is_refused_and_writes_nothing(
        trained, tmp_path):
    server, _, token_file = trained
    path = str(tmp_path / "refused.safetensors")
    done = export(server, path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "UNAUTHENTICATED" in done.stderr or "operator token" in done.stderr, done.stderr
    assert not os.path.exists(path)
    backup = str(tmp_path / "refused-backup")
    done = subprocess.run([REBOUNDCTL, "--server", server.address, "backup", backup],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "operator token" in done.stderr, done.stderr
    assert not os.path.exists(backup)
    operator = [REBOUNDCTL, "--server", server.address, "--operator_token_file", token_file]
    # A negative pace is a usage error, and the server refuses one too.
    done = subprocess.run(operator + ["--backup_max_mb_s", "-1", "backup", backup],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 64, done.stdout + done.stderr
    assert "--backup_max_mb_s must be >= 0" in done.stderr, done.stderr
    assert not os.path.exists(backup)
    channel = grpc.insecure_channel(server.address)
    try:
        stub = rebound_pb2_grpc.ParameterServerStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Backup(rebound_pb2.BackupRequest(max_bytes_per_second=-5), timeout=30,
                             metadata=[("rebound-operator-token", TOKEN)]))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        assert "max_bytes_per_second must be >= 0" in refused.value.details()
    finally:
        channel.close()
    # With the token the same backup is made, its manifest beside it, paced: the server sends a
    # chunk only when the bytes before it are within the rate, so the whole backup cannot take
    # less than (all bytes - the last chunk, at most 1 MiB) / rate.
    rate_mb_s = 0.25
    started = time.monotonic()
    done = subprocess.run(operator + ["--backup_max_mb_s", str(rate_mb_s), "backup", backup],
                          capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    with open(os.path.join(backup, "MANIFEST.json")) as f:
        files = json.load(f)["files"]
    total = sum(entry["bytes"] for entry in files)
    largest_chunk = min(1 << 20, max(entry["bytes"] for entry in files))
    floor_s = (total - largest_chunk) / (rate_mb_s * 1e6)
    assert floor_s > 0.5, (total, largest_chunk)  # the pace is what the test sees
    assert elapsed >= floor_s, (elapsed, floor_s, total)


def test_python_m_rebound_export_writes_a_pt_state_dict_equal_to_the_safetensors(trained,
                                                                                   tmp_path):
    server, status, token_file = trained
    st_path = str(tmp_path / "model.safetensors")
    pt_path = str(tmp_path / "model.pt")
    assert export(server, st_path, "--operator_token_file", token_file).returncode == 0
    done = subprocess.run([sys.executable, "-m", "rebound", "export", "--server", server.address,
                           "--operator_token_file", token_file, "-o", pt_path],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "center version %d" % status.centers[0].version in done.stdout
    from_pt = torch.load(pt_path)
    from_st, _ = read_safetensors(st_path)
    assert list(from_pt) == list(from_st)
    for name, values in from_st.items():
        assert torch.equal(from_pt[name], torch.from_numpy(values.copy())), name
    # And the Python writer's safetensors reads back the same, by this file's own reader.
    py_st = str(tmp_path / "python.safetensors")
    assert subprocess.run([sys.executable, "-m", "rebound", "export", "--server", server.address,
                           "--operator_token_file", token_file, "-o", py_st],
                          capture_output=True, text=True, timeout=120).returncode == 0
    again, metadata = read_safetensors(py_st)
    assert metadata["rebound.center_versions"] == str(status.centers[0].version)
    for name, values in from_st.items():
        assert np.array_equal(again[name], values), name


TINY_JOB = """
job_id: "tiny-export"
model { declared_by_worker: true }
topology { replicas: 2 }
data { batch_size: 32 micro_batches: 2 }
easgd { sync_period: 4 }
training { max_steps: 120 }
"""


def test_a_declared_models_center_loads_into_the_users_model_by_its_own_names(tmp_path):
    sys.path.insert(0, os.path.dirname(TINY_SPEC))
    import tiny_spec
    import rebound.torch as rt
    with LocalServer(SERVER, TINY_JOB) as server:
        for i in range(2):
            server.start_worker([sys.executable, TINY_SPEC, "--server", server.address,
                                 "--name", "t%d" % i, "--role", "trainer"])
        status = server.wait_for(
            lambda s: len(s.slots) == 2 and all(x.state == 6 for x in s.slots), 120,
            what="every slot FINISHED")
        path = str(tmp_path / "tiny.safetensors")
        assert export(server, path).returncode == 0  # from this host: no token configured
        model = tiny_spec.make_spec(argparse.Namespace(
            nondeterministic=False, optimizer="adahessian", slow_ms=0)).model()
        versions = rt.load_center(server.address, model)
        # A model the center does not fit is refused, naming the difference.
        with pytest.raises(ValueError, match="does not fit"):
            rt.load_center(server.address, torch.nn.Linear(3, 3))
    assert versions == [status.centers[0].version] == [2 * 120 // 4]
    from_file = rt.load_safetensors(path)
    assert list(from_file) == [name for name, _ in model.named_parameters()]
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), from_file[name]), name


BACKUP_JOB = """
job_id: "backup"
model { input_dim: 784 layers { width: 32 activation: RELU }
        layers { width: 10 activation: IDENTITY } init_seed: 3 }
topology { replicas: 2 stages: 1 }
data { batch_size: 32 micro_batches: 2 train_limit: 4000 test_limit: 500 }
fault_tolerance { heartbeat_interval_ms: 200 failure_timeout_ms: 3000 }
adahessian { lr: 0.05 }
easgd { sync_period: 10 }
training { max_steps: %d }
"""
BACKUP_STEPS = 3000


def test_a_backup_taken_while_training_restores_and_the_job_finishes_consistently(tmp_path):
    """The trainers go on past the backup; the restored server knows none of them (their later
    syncs are gone), so they register again, as spares (role auto: no slot is free), and each
    rebuilds a LOST slot from its snapshot and the log the backup holds, then trains it on."""
    backup = str(tmp_path / "backup")
    with LocalServer(SERVER, BACKUP_JOB % BACKUP_STEPS) as server:
        config = tmp_path / "worker.pbtxt"
        config.write_text('server_address: "%s"\npeer_listen_address: "127.0.0.1:0"\n'
                          'rpc_deadline_ms: 10000\n' % server.address)
        for i in range(2):
            start(server, "trainer-%d" % i, "auto", str(config))
        before = server.wait_for(lambda s: s.centers and s.centers[0].version >= 20, 120,
                                 what="20 syncs").centers[0].version
        done = subprocess.run([REBOUNDCTL, "--server", server.address, "backup", backup],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "backed up job 'backup' at commit" in done.stdout, done.stdout
        after = server.status().centers[0].version
        # Training goes on past the backup; then the server and its data are lost.
        server.wait_for(lambda s: s.centers[0].version >= after + 20, 120,
                        what="20 syncs past the backup")
        server.kill_server()
        shutil.rmtree(server.data_dir)
        server.server_args = ["--restore_from", backup]
        server.start()
        assert "restored the backup" in server.server_log()
        restored = server.status().centers[0].version
        assert before <= restored <= after, (before, restored, after)
        final = server.wait_for(
            lambda s: len(s.slots) == 2 and all(x.state == 6 for x in s.slots), 240,
            what="every slot FINISHED after the restore")
        # Both slots were rebuilt by the old trainers, registered again.
        assert len(final.recoveries) == 2, final.recoveries
        assert all(r.outcome == rebound_pb2.RECOVERED for r in final.recoveries), final.recoveries
    # Consistent: the center moved once per sync the slots' books hold, and every slot ended at
    # max_steps with its last sync applied.
    assert final.centers[0].version == sum(slot.update_count for slot in final.slots), final
    for slot in final.slots:
        assert slot.snapshot_step == BACKUP_STEPS, slot
