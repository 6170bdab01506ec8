#!/usr/bin/python3
"""torch_loops: PyTorch training loops as users write them (R18), through Rebound with a trainer
SIGKILLed mid-run, against the same model, optimizer and loss in a plain PyTorch loop.

    bench/torch_loops.py [--models transformer,cnn_bn,gru] [--train-limit 6000]
        [--test-limit 2000] [--epochs 2] [--rebound-server bazel-bin/server/rebound_server]
        [--timeout-s 300] [--keep] [--no-kill]

Three tiny models on Fashion-MNIST (the first --train-limit training and --test-limit test
samples of rebound.torch.data.FashionMnist), each trained with Adam (lr 1e-3), cross-entropy,
batches of 32, one torch thread per process:
  * transformer: each 28x28 image as 28 tokens of 28 features, Linear to d_model 32, one
    nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.1,
    batch_first=True), mean over the tokens, Linear to 10;
  * cnn_bn: two 3x3 convolutions (8 and 16 channels) each with BatchNorm2d, ReLU and 2x2 max
    pooling, Dropout(0.25), Linear to 10;
  * gru: a two-layer nn.GRU over the 28 image rows (hidden 32, dropout 0.1 between the layers),
    Linear from the last step's output to 10.

What each side does (also printed before the figures):
  * Rebound: a rebound_server on 127.0.0.1 port 0 started by rebound.cluster.LocalServer with a
    job written here (job_text(): the model declared by the worker, 2 replicas, 1 spare,
    min_trainers 2, batch 32 in 2 micro-batches, EASGD with sync_period 8, policy REPLAY with
    the step log, heartbeats every 200 ms and a 1000 ms failure timeout, max_steps N per slot).
    The worker script (written into the temp dir: the models and the spec, then
    rebound.torch.run) runs as the spare first (started and listed by the server before the
    trainers), then as trainers t0 and t1 (the start barrier starts them together). Once
    GetStatus shows t1's slot at step N / 3 or later with logged steps past its last snapshot
    (its last sync), t1 is SIGKILLed; the spare replays the logged steps from the snapshot (each
    verified against the step log) and trains the slot to the end. Once every slot is
    FINISHED the final center is read with rebound.torch.load_center (ExportCenter) into a
    fresh model and evaluated here with model.eval() (BatchNorm with the center's running
    statistics) on the test set. Its wall
    time runs from the trainers' start (processes started: imports, data loading,
    registration, the start barrier included) to the status poll that sees every slot FINISHED
    (the 1 s failure detection and the replay included); the line under it shows the start-up
    (to the first step the server shows) and each worker's own training-loop time (the
    `rebound-torch: trained N samples in S s` it prints). The server binary is copied into the
    temp dir at the start, so that a rebuild of bazel-bin during the run changes nothing.
  * Plain: the same model factory after the same torch.manual_seed(1) (the spec's init_seed,
    so the same initial weights as the center's), the same optimizer and loss, in a plain
    single-process loop in this process (model.train(), zero_grad, forward, loss, backward,
    step) over 2 N batches of 32 from a seeded shuffle of the training samples, epoch after
    epoch: as many samples as Rebound's two replicas trained together (2 x N x 32). Its wall
    time is the loop's; its accuracy is the final model's with model.eval() on the same test set.

--no-kill runs the Rebound side without the SIGKILL (the control: what the kill and the replay
cost in accuracy) and prints no RESULT line.

N = ceil(epochs x train_limit / (2 x 32)): 188 for the defaults (2 x 188 x 32 = 12032 samples
per side, about 2 epochs of 6000). Prints one line per model (`model=... rebound_acc=...
plain_acc=... delta_pts=... rebound_wall_s=... plain_wall_s=... recovery=... replayed=...
verified=...`) and `RESULT torch_loops: <model>_delta_pts=... ...` (delta: Rebound's final
center minus plain PyTorch, in accuracy points). No target: the issue asks for the figures.
Exit codes: 0 measured (whatever the recovery's outcome, which the lines show), 1 a side failed
(a worker's or the server's output is printed), 2 bad arguments. Everything started here is
killed at the end (process groups), also on errors, SIGTERM and Ctrl-C; every wait is bounded
by --timeout-s per model.
"""

import argparse
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "python"))
sys.path.insert(1, os.path.join(REPO, "python", "_gen"))  # the stubs (python/install.sh)

from rebound.cluster import LocalServer, read_log  # noqa: E402

MODELS = ["transformer", "cnn_bn", "gru"]
BATCH = 32
TAU = 8
INIT_SEED = 1       # rebound.torch.Spec's default init_seed
PLAIN_SEED = 1234   # the plain loop's shuffle
TRAINED_RE = re.compile(r"^rebound-torch: trained (\d+) samples in ([0-9.eE+-]+) s\s*$", re.M)
AFTER_RUN_RE = re.compile(r"^after run: code (\d+) center_version (\S+) role (\S+)", re.M)

# The models and the spec: exec'd here for the plain side and written, verbatim, at the top of
# the worker script, so that both sides build the same modules.
MODELS_SOURCE = '''
import torch
import torch.nn as nn
import rebound.torch as rt
from rebound.torch.data import FashionMnist


class Transformer(nn.Module):
    """Each 28x28 image as 28 tokens of 28 features."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(28, 32)
        self.encoder = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64,
                                                  dropout=0.1, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        tokens = self.embed(x.reshape(x.shape[0], 28, 28))
        return self.head(self.encoder(tokens).mean(dim=1))


class CnnBn(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.25), nn.Linear(16 * 7 * 7, 10))

    def forward(self, x):
        return self.head(self.features(x))


class Gru(nn.Module):
    """A two-layer GRU over the image rows (28 steps of 28 features)."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(28, 32, num_layers=2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        out, _ = self.gru(x.reshape(x.shape[0], 28, 28))
        return self.head(out[:, -1])


FACTORIES = {"transformer": Transformer, "cnn_bn": CnnBn, "gru": Gru}


def make_optimizer(params):
    return torch.optim.Adam(params, lr=1e-3)


def make_spec(kind, train_limit, test_limit):
    return rt.Spec(model=FACTORIES[kind], optimizer=make_optimizer,
                   loss=torch.nn.functional.cross_entropy,
                   train_set=FashionMnist("train", limit=train_limit),
                   test_set=FashionMnist("test", limit=test_limit),
                   batch_size=%(batch)d, tau=%(tau)d, init_seed=%(init_seed)d)
''' % dict(batch=BATCH, tau=TAU, init_seed=INIT_SEED)

WORKER_MAIN = '''

def main():
    import sys
    kind, server, name, role, train_limit, test_limit = sys.argv[1:7]
    torch.set_num_threads(1)
    result = rt.run(make_spec(kind, int(train_limit), int(test_limit)), server=server,
                    name=name, role=role, give_up_after_s=60)
    print("after run: code %d center_version %s role %s reason %s" % (
        result.exit_code, result.center_version, result.role, result.reason or "-"), flush=True)
    return result.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
'''


class Failed(Exception):
    """A side that did not run to its end: the message says why, with the logs."""


def job_text(kind, steps):
    """The Rebound side's job (docs/config.md), inline in the server config LocalServer
    writes."""
    return f"""
  job_id: "torch-loops-{kind}"
  model {{ declared_by_worker: true }}
  topology {{ replicas: 2 stages: 1 spares: 1 min_trainers: 2 evaluator: false }}
  data {{ batch_size: {BATCH} micro_batches: 2 seed: 42 }}
  compute {{ backend: CPU threads: 1 }}
  easgd {{ mode: EASGD sync_period: {TAU} }}
  fault_tolerance {{ policy: REPLAY heartbeat_interval_ms: 200 failure_timeout_ms: 1000 }}
  step_log {{ enabled: true }}
  training {{ max_steps: {steps} }}
"""


def accuracy(model, data):
    """Test accuracy of ``model`` in eval mode over ``data`` (batches of 1000)."""
    model.eval()
    right = 0
    with torch.no_grad():
        for begin in range(0, len(data), 1000):
            x, y = data.batch(torch.arange(begin, min(begin + 1000, len(data))))
            right += int((model(x).argmax(dim=1) == y).sum())
    return right / len(data)


def outcome_name(value):
    from rebound_pb import rebound_pb2
    return rebound_pb2.RecoveryOutcome.Name(value)


def run_rebound(args, models, kind, steps, test_set, tmp):
    """Trains ``kind`` through a fresh rebound_server, t1 SIGKILLed past step steps / 3 (not
    with --no-kill); returns a dict of the figures. Failed on any error, with the logs."""
    from rebound_pb import config_pb2, rebound_pb2
    deadline = time.monotonic() + args.timeout_s

    def left():
        return max(1.0, deadline - time.monotonic())

    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "python"),
                                           os.path.join(REPO, "python", "_gen")]))
    script = os.path.join(tmp, "worker.py")

    try:
        server = LocalServer(args.server_copy, job_text(kind, steps),
                             log_path=os.path.join(tmp, f"server-{kind}.log"))
    except (OSError, RuntimeError) as error:
        raise Failed(f"{kind}: the rebound_server did not start: {error}") from None
    with server:
        def start(name, role):
            return server.start_worker(
                ["/usr/bin/python3", script, kind, server.address, name, role,
                 str(args.train_limit), str(args.test_limit)],
                log_path=os.path.join(tmp, f"{kind}-{name}.log"), env=env)

        def logs():
            text = "".join(f"\n--- {w.log_path} (exit {w.poll()}) ---\n{read_log(w)[-2500:]}"
                           for w in server.workers)
            return text + f"\n--- server log {server.log_path} ---\n{server.server_log()[-3000:]}"

        def running(*processes):
            """Fails the run at once when a worker exited with an error (not after the wait's
            whole timeout); an exit 0 is a worker done with the job."""
            for process in processes:
                if process.poll() not in (None, 0):
                    raise Failed(f"{os.path.basename(process.log_path)[:-4]} exited with "
                                 f"{process.returncode}")
            return True

        try:
            spare = start("spare", "spare")
            server.wait_for(lambda s: running(spare) and any(
                w.name == "spare" and w.role == config_pb2.SPARE for w in s.workers), left(),
                what="the spare registered")
            began = time.monotonic()
            t0 = start("t0", "trainer")
            t1 = start("t1", "trainer")
            kill_at = max(1, steps // 3)
            # The start-up's end: the status poll that first shows a step trained (logged, or
            # reported by a heartbeat or a sync).
            server.wait_for(lambda s: running(spare, t0, t1) and any(
                x.logged_step > 0 or x.step > 0 for x in s.slots), left(), poll_s=0.05,
                what="a first step trained")
            startup = time.monotonic() - began

            def t1_slot(s):
                for w in s.workers:
                    if w.name == "t1" and w.HasField("slot") and w.role == config_pb2.TRAINER:
                        return w.slot.replica
                return None

            def kill_due(s):
                # Past step N / 3 and with logged steps past the slot's last snapshot (its last
                # sync), so that the spare has steps to replay: the slot's step moves with the
                # heartbeats and syncs, the logged step every linger_ms.
                if not running(spare, t0, t1) or t1_slot(s) is None:
                    return False
                slot = s.slots[t1_slot(s)]
                if slot.state == rebound_pb2.FINISHED or slot.snapshot_step >= steps:
                    raise Failed(f"t1's slot finished before the kill could land (no poll saw "
                                 f"logged steps past a snapshot at step {kill_at} or later): "
                                 f"train longer (--epochs, --train-limit)")
                return slot.step >= kill_at and slot.logged_step > slot.snapshot_step

            at_kill = None
            if not args.no_kill:
                status = server.wait_for(kill_due, left(), poll_s=0.02,
                                         what=f"t1's slot at step {kill_at} with logged steps "
                                         "past its snapshot")
                replica = t1_slot(status)
                os.killpg(t1.pid, signal.SIGKILL)
                at_kill = (replica, status.slots[replica].step,
                           status.slots[replica].snapshot_step, status.slots[replica].logged_step)
                t1.wait(timeout=10)
            survivors = {"t0": t0, "spare": spare} if at_kill else {"t0": t0, "t1": t1}
            status = server.wait_for(
                lambda s: (running(*survivors.values()) and len(s.slots) == 2 and
                           all(x.state == rebound_pb2.FINISHED for x in s.slots)),
                left(), poll_s=0.1, what="every slot FINISHED")
            wall = time.monotonic() - began
            if at_kill:
                status = server.wait_for(
                    lambda s: any(r.HasField("outcome") for r in s.recoveries), left(),
                    what="the recovery's outcome")
            recoveries = list(status.recoveries)
            for name, process in list(survivors.items()) + [("spare", spare)]:
                try:
                    code = process.wait(timeout=min(60.0, left()))
                except subprocess.TimeoutExpired:
                    raise Failed(f"{name} still running 60 s after the job finished") from None
                if code != 0:
                    raise Failed(f"{name} exited with {code}")
            model = models["FACTORIES"][kind]()
            versions = models["rt"].load_center(server.address, model)
            acc = accuracy(model, test_set)
            logs_of = {name: read_log(p) for name, p in dict(survivors, spare=spare).items()}
            for name, text in logs_of.items():
                m = AFTER_RUN_RE.search(text)
                if not m or m.group(2) != str(versions[0]):
                    raise Failed(f"{name}'s run() did not return the final center (version "
                                 f"{versions[0]}): {m.group(0) if m else 'no after-run line'}")
        except Exception as error:  # a timeout, a worker's exit, an RPC error: with the logs
            raise Failed(f"{kind}: {type(error).__name__}: {error}{logs()}") from None
    trained = {name: TRAINED_RE.search(text) for name, text in logs_of.items()}
    result = {
        "acc": acc, "wall": wall, "startup": startup,
        "at_kill": at_kill, "recoveries": len(recoveries), "version": versions[0],
        "training_s": {name: float(m.group(2)) if m else float("nan")
                       for name, m in trained.items()},
        "outcome": "none", "replayed": 0, "verified": False, "detail": "", "failed_step": 0,
    }
    if recoveries:
        recovery = recoveries[0]
        result.update(outcome=outcome_name(recovery.outcome), replayed=recovery.steps_replayed,
                      verified=recovery.verified, detail=recovery.detail,
                      failed_step=recovery.failed_step)
    return result


def run_plain(models, kind, steps, train_set, test_set):
    """The same model, optimizer and loss in a plain loop over ``steps`` batches of a seeded
    shuffle, epoch after epoch; (test accuracy, seconds of the loop)."""
    torch.manual_seed(INIT_SEED)
    model = models["FACTORIES"][kind]()
    optimizer = models["make_optimizer"](model.parameters())
    loss_fn = torch.nn.functional.cross_entropy
    n = len(train_set)
    generator = torch.Generator().manual_seed(PLAIN_SEED)
    order = torch.cat([torch.randperm(n, generator=generator)
                       for _ in range(math.ceil(steps * BATCH / n))])
    torch.manual_seed(PLAIN_SEED)  # dropout's draws
    model.train()
    began = time.perf_counter()
    for step in range(steps):
        x, y = train_set.batch(order[step * BATCH:(step + 1) * BATCH])
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
    elapsed = time.perf_counter() - began
    return accuracy(model, test_set), elapsed


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS),
                   help="comma-separated, of " + ", ".join(MODELS))
    p.add_argument("--train-limit", type=int, default=6000, help="training samples used")
    p.add_argument("--test-limit", type=int, default=2000, help="test samples evaluated")
    p.add_argument("--epochs", type=float, default=2.0,
                   help="passes over the training samples, both replicas together")
    p.add_argument("--rebound-server",
                   default=os.path.join(REPO, "bazel-bin/server/rebound_server"))
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="bound on each model's Rebound run")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, worker script)")
    p.add_argument("--no-kill", action="store_true",
                   help="the control: the same Rebound jobs without the SIGKILL")
    args = p.parse_args()
    kinds = [k for k in args.models.split(",") if k]
    bad = [k for k in kinds if k not in MODELS]
    if not kinds or bad:
        p.error(f"--models: unknown {bad}; choose from {','.join(MODELS)}")
    if not 1 <= args.train_limit <= 60000 or not 1 <= args.test_limit <= 10000:
        p.error("--train-limit in [1, 60000], --test-limit in [1, 10000]")
    if args.epochs <= 0 or args.timeout_s <= 0:
        p.error("--epochs > 0, --timeout-s > 0")
    if not os.access(args.rebound_server, os.X_OK):
        p.error(f"{args.rebound_server} is not an executable: build it with "
                f"`bazel build -c opt //server:rebound_server` or pass --rebound-server")
    signal.signal(signal.SIGTERM, _terminate)
    torch.set_num_threads(1)
    models = {}
    exec(compile(MODELS_SOURCE, "torch_loops models", "exec"), models)
    train_set = models["FashionMnist"]("train", limit=args.train_limit)
    test_set = models["FashionMnist"]("test", limit=args.test_limit)
    steps = math.ceil(args.epochs * args.train_limit / (2 * BATCH))
    samples = 2 * steps * BATCH

    print(f"torch_loops: {', '.join(kinds)} on Fashion-MNIST ({args.train_limit} training, "
          f"{args.test_limit} test samples), Adam lr 1e-3, cross-entropy, batch {BATCH}, one "
          f"torch thread per process")
    kill = ("--no-kill: no failure" if args.no_kill else
            f"t1 SIGKILLed past its slot's step {max(1, steps // 3)} with logged steps past a "
            f"snapshot")
    print(f"  rebound: 2 replicas x {steps} steps x {BATCH} = {samples} samples, tau {TAU}, "
          f"1 spare, min_trainers 2, REPLAY; {kill}; the final center evaluated here")
    print(f"  plain:   {2 * steps} steps x {BATCH} = {samples} samples "
          f"({samples / args.train_limit:.2f} epochs) in one process, same init (seed "
          f"{INIT_SEED}), optimizer and loss", flush=True)
    results = {}
    tmp = tempfile.mkdtemp(prefix="torch_loops.")
    try:
        with open(os.path.join(tmp, "worker.py"), "w") as f:
            f.write(MODELS_SOURCE + WORKER_MAIN)
        # A copy: a rebuild of bazel-bin during the run does not swap the binary between models.
        args.server_copy = os.path.join(tmp, "rebound_server")
        try:
            shutil.copy2(args.rebound_server, args.server_copy)
        except OSError as e:
            print(f"torch_loops: cannot copy the server binary: {e}", file=sys.stderr)
            return 1
        for kind in kinds:
            try:
                r = run_rebound(args, models, kind, steps, test_set, tmp)
            except Failed as e:
                print(f"torch_loops: rebound side: {e}", file=sys.stderr)
                return 1
            r["plain_acc"], r["plain_wall"] = run_plain(models, kind, steps, train_set,
                                                        test_set)
            r["delta"] = 100.0 * (r["acc"] - r["plain_acc"])
            results[kind] = r
            print(f"model={kind} rebound_acc={r['acc']:.4f} plain_acc={r['plain_acc']:.4f} "
                  f"delta_pts={r['delta']:+.2f} rebound_wall_s={r['wall']:.1f} "
                  f"plain_wall_s={r['plain_wall']:.1f} recovery={r['outcome']} "
                  f"replayed={r['replayed']} verified={'yes' if r['verified'] else 'no'}",
                  flush=True)
            if r["at_kill"]:
                replica, step, snapshot, logged = r["at_kill"]
                killed = (f"t1 SIGKILLed on slot ({replica}, 0) at step {step} (snapshot "
                          f"{snapshot}, logged to {logged}); failed_step {r['failed_step']}; "
                          f"{r['recoveries']} recovery")
            else:
                killed = "--no-kill: no failure"
            print(f"  ({killed}; final center version {r['version']}; start-up (processes "
                  f"started to the first step) {r['startup']:.1f} s; training loops "
                  + ", ".join(f"{name} {t:.1f} s" for name, t in r["training_s"].items())
                  + (f"; detail: {r['detail']}" if r["detail"] else "") + ")", flush=True)
    except KeyboardInterrupt as e:
        print(f"torch_loops: interrupted ({e or 'Ctrl-C'}); every process started is killed",
              file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"torch_loops: kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    fields = " ".join(f"{k}_delta_pts={results[k]['delta']:+.2f}" for k in kinds)
    fields += " " + " ".join(f"{k}_rebound_acc={results[k]['acc']:.4f} "
                             f"{k}_plain_acc={results[k]['plain_acc']:.4f}" for k in kinds)
    recovered = sum(r["outcome"] == "RECOVERED" and r["verified"] for r in results.values())
    if args.no_kill:
        print(f"torch_loops: --no-kill: {fields} (no kill: no RESULT)")
        return 0
    print(f"RESULT torch_loops: {fields} "
          f"min_delta_pts={min(r['delta'] for r in results.values()):+.2f} "
          f"recovered_verified={recovered}/{len(results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
