"""A small deterministic training script for the client's tests: an MLP on a synthetic data set
(a fixed random teacher labels Gaussian inputs), run as

    python3 tiny_spec.py --server HOST:PORT [--name N] [--role R] [--optimizer adahessian|sgd|adam|rmsprop|adagrad|unfit]
        [--max-seconds S] [--slow-ms MS] [--nondeterministic] [--start-gate PATH]
        [--scheduler onecycle|steplr-epoch] [--lr-trace PATH] [--model mlp|bn]
        [--task classes|regression]

--slow-ms sleeps after every batch fetch (a test kills the trainer mid-run); --nondeterministic
makes every process's model add its own noise, so a replay cannot match (the fallback test);
--start-gate makes the first batch fetch (a trainer's comes after it pulled the center) create
PATH.<pid> and wait until PATH exists (at most 120 s), so that a test starts every trainer's
training at once, each from the center as the job began. --scheduler adds one of SCHEDULERS to
the spec; --lr-trace makes every training step (replayed ones too) append "step lr" to
PATH.<pid> (with --optimizer adam, whose state counts the steps).
"""

import argparse
import os
import sys
import time

import torch

import rebound.torch as rt

FEATURES = 16
CLASSES = 4


class Synthetic:
    def __init__(self, n, seed, slow_ms=0, start_gate=None):
        g = torch.Generator().manual_seed(seed)
        teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(7))
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = (self.x @ teacher).argmax(dim=1)
        self.slow_ms = slow_ms
        self.start_gate = start_gate

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def batch(self, ids):
        if self.start_gate:
            gate, self.start_gate = self.start_gate, None
            open("%s.%d" % (gate, os.getpid()), "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(gate):
                if time.monotonic() > deadline:
                    raise TimeoutError("the start gate %s did not open within 120 s" % gate)
                time.sleep(0.01)
        if self.slow_ms:
            time.sleep(self.slow_ms / 1000.0)
        return self.x.index_select(0, ids), self.y.index_select(0, ids)


class Regression:
    """--task regression: 4 float targets per sample (half the teacher's outputs), served one
    sample at a time as a list of floats (no batch method: the runner batches them)."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(7))
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = (self.x @ teacher) * 0.5

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i].tolist()


class Unfit(torch.optim.SGD):
    """--optimizer unfit: SGD with momentum whose state also holds a Python float, which the
    snapshot has no exact place for (rebound.torch.optim_state): its replays fall back."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["scale"] = 0.5


class Noisy(torch.nn.Module):
    """Adds process-dependent noise: not a deterministic function of the step's inputs."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.noise = torch.Generator().manual_seed(os.getpid())

    def forward(self, x):
        return self.inner(x) + 1e-3 * torch.randn(CLASSES, generator=self.noise)


class Shifted(torch.nn.Module):
    """x * 3 + 2: inputs far from BatchNorm's initial statistics (mean 0, variance 1)."""

    def forward(self, x):
        return x * 3 + 2


def batchnorm_model():
    """--model bn: BatchNorm (running statistics: buffers) and Dropout."""
    return torch.nn.Sequential(Shifted(), torch.nn.Linear(FEATURES, 32),
                               torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(32, CLASSES))


# --scheduler: name -> (factory of the optimizer, interval); max_steps 200 (test_training_loops).
SCHEDULERS = {
    "onecycle": (lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.02, total_steps=200),
                 "step"),
    "steplr-epoch": (lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
                     "epoch"),
}


def make_spec(args):
    made = {}

    def model():
        if getattr(args, "model", None) == "bn":
            return batchnorm_model()
        net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(),
                                  torch.nn.Dropout(0.1), torch.nn.Linear(32, CLASSES))
        return Noisy(net) if args.nondeterministic else net

    def optimizer(params):
        made["optimizer"] = make_optimizer(params)
        return made["optimizer"]

    def loss(output, target):
        trace = getattr(args, "lr_trace", None)
        if trace and torch.is_grad_enabled():
            # A training step's lr, before the step (Adam's state holds the steps done).
            opt = made["optimizer"]
            state = opt.state.get(opt.param_groups[0]["params"][0], {})
            with open("%s.%d" % (trace, os.getpid()), "a") as f:
                f.write("%d %s\n" % (int(state.get("step", 0)) + 1,
                                     float(opt.param_groups[0]["lr"]).hex()))
        return torch.nn.functional.cross_entropy(output, target)

    def make_optimizer(params):
        if args.optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        if args.optimizer == "adam":
            return torch.optim.Adam(params, lr=0.01)
        if args.optimizer == "rmsprop":
            return torch.optim.RMSprop(params, lr=0.005, momentum=0.5, centered=True)
        if args.optimizer == "adagrad":
            return torch.optim.Adagrad(params, lr=0.05)
        if args.optimizer == "unfit":
            return Unfit(params, lr=0.1, momentum=0.9)
        return rt.AdaHessian(params, lr=0.05, hessian_every=2)

    scheduler, interval = SCHEDULERS.get(getattr(args, "scheduler", None), (None, "step"))
    if getattr(args, "task", None) == "regression":
        return rt.Spec(model=model, optimizer=optimizer, loss=torch.nn.functional.mse_loss,
                       train_set=Regression(2048, 1), test_set=Regression(512, 2),
                       batch_size=32, scheduler=scheduler, scheduler_interval=interval)
    return rt.Spec(model=model, optimizer=optimizer, loss=loss,
                   train_set=Synthetic(2048, 1, args.slow_ms, getattr(args, "start_gate", None)),
                   test_set=Synthetic(512, 2),
                   batch_size=32, scheduler=scheduler, scheduler_interval=interval)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--name")
    parser.add_argument("--role")
    parser.add_argument("--optimizer", default="adahessian")
    parser.add_argument("--max-seconds", type=float)
    parser.add_argument("--slow-ms", type=float, default=0)
    parser.add_argument("--nondeterministic", action="store_true")
    parser.add_argument("--start-gate")
    parser.add_argument("--scheduler", choices=sorted(SCHEDULERS))
    parser.add_argument("--model", choices=["mlp", "bn"], default="mlp")
    parser.add_argument("--task", choices=["classes", "regression"], default="classes")
    parser.add_argument("--lr-trace")
    args = parser.parse_args()
    # run() returns a RunResult, the exit code as an int: the test reads it as the exit status.
    return rt.run(make_spec(args), server=args.server, name=args.name, role=args.role,
                  max_seconds=args.max_seconds, give_up_after_s=30)


if __name__ == "__main__":
    sys.exit(main())
