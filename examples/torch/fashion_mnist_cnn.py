#!/usr/bin/python3
"""A small CNN on Fashion-MNIST trained through Rebound (rebound.torch), or in a plain loop.

Through Rebound (the role, trainer, spare or evaluator, comes from the server):

    python3 examples/torch/fashion_mnist_cnn.py --server HOST:PORT [--name NAME] [--role ROLE]
        [--config FILE] [--max-seconds S] [--save FILE]

Without Rebound, the same spec in a plain PyTorch loop that prints the test accuracy per epoch:

    python3 examples/torch/fashion_mnist_cnn.py --plain-epochs N

The spec (make_spec): the model Net (conv 1->16 3x3 padding 1, ReLU, max-pool 2; conv 16->32 3x3
padding 1, ReLU, max-pool 2; linear 1568->10: 20,490 parameters), the optimizer (--optimizer:
adam by default, sgd with momentum 0.9, or rebound.torch.AdaHessian), cross-entropy, Debian's Fashion-MNIST
(rebound.torch.data.FashionMnist, normalised like the C++ worker), --batch-size, --tau. Every
process runs with --threads torch threads (1 by default: replay needs a fixed thread count).

Keyword arguments handed to rebound.torch.run(spec, ...):
    server       --server HOST:PORT (required unless --plain-epochs)
    name         --name NAME (omitted when not given: run() picks its own)
    role         --role trainer|spare|evaluator (omitted when not given: the server decides)
    config       --config FILE, a client config for run() (omitted when not given)
    max_seconds  --max-seconds S: train for S seconds then exit, printing
                 "rebound-torch: trained N samples in S s" (bench/python_overhead.py reads it)

--save FILE: once the job finished, torch.save the model run() returns (the final center) to FILE
(docs/python.md#the-trained-model); give it to one process, e.g. the evaluator.

Exit codes: those of rebound.torch.run (3 when fenced, as the C++ worker); 2 for bad arguments.
Importable: make_spec(args), spec_fields(args), parse_args(argv), Net, plain_train(fields, ...).
"""

import argparse
import os
import sys
import time
import types
import warnings

import torch
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
_PYTHON = os.path.join(_HERE, "..", "..", "python")
if os.path.isdir(_PYTHON) and _PYTHON not in sys.path:
    sys.path.insert(0, _PYTHON)  # run from a checkout without installing the package

from rebound.torch.data import FashionMnist  # noqa: E402

# Learning rates per optimizer, from --plain-epochs runs at batch 64, one thread (R12): adam 0.002
# reached 89.9% test accuracy after 2 epochs and 91.0% after 5; sgd 0.02 89.9% after 5.
# adahessian 0.05 was tried on the 5x5 variant of Net only (88.3% after 3 epochs).
DEFAULT_LR = {"adam": 0.002, "sgd": 0.02, "adahessian": 0.05}


class Net(torch.nn.Module):
    """conv(1->16, 3x3, pad 1) ReLU maxpool(2), conv(16->32, 3x3, pad 1) ReLU maxpool(2),
    linear(32 * 7 * 7 -> 10). No batch norm or dropout: parameters only, no buffers or RNG."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc = torch.nn.Linear(32 * 7 * 7, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", help="HOST:PORT of the rebound_server")
    p.add_argument("--name", help="this worker's name (run() picks one when omitted)")
    p.add_argument("--role", choices=["trainer", "spare", "evaluator"],
                   help="ask for a role (the server decides when omitted)")
    p.add_argument("--config", help="client config file handed to rebound.torch.run")
    p.add_argument("--max-seconds", type=float, help="train this long, then exit")
    p.add_argument("--save", help="torch.save the final model's state_dict to this file")
    p.add_argument("--plain-epochs", type=int, default=0,
                   help="train N epochs in a plain PyTorch loop without Rebound")
    p.add_argument("--optimizer", choices=sorted(DEFAULT_LR), default="adam")
    p.add_argument("--lr", type=float, help="learning rate (default: per optimizer)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--tau", type=int, default=8, help="EASGD sync period in steps")
    p.add_argument("--train-limit", type=int, default=0, help="first N training samples (0 = all)")
    p.add_argument("--test-limit", type=int, default=0, help="first N test samples (0 = all)")
    p.add_argument("--dataset-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--threads", type=int, default=1, help="torch threads (fixed for replay)")
    p.add_argument("--seed", type=int, default=1, help="shuffling seed of --plain-epochs")
    args = p.parse_args(argv)
    if args.plain_epochs < 0 or args.batch_size < 1 or args.tau < 1 or args.threads < 1:
        p.error("--plain-epochs must be >= 0, --batch-size, --tau and --threads >= 1")
    if not args.plain_epochs and not args.server:
        p.error("--server HOST:PORT is required (or --plain-epochs N to train without Rebound)")
    return args


def _optimizer_factory(name, lr):
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)

    def adahessian(params):
        import rebound.torch as rt  # the lead's package: only this optimizer needs it
        return rt.AdaHessian(params, lr=lr)
    return adahessian


def spec_fields(args):
    """The spec's fields as a dict (the arguments of rebound.torch.Spec)."""
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    return dict(
        model=Net,
        optimizer=_optimizer_factory(args.optimizer, lr),
        loss=F.cross_entropy,
        train_set=FashionMnist("train", root=args.dataset_dir, limit=args.train_limit),
        test_set=FashionMnist("test", root=args.dataset_dir, limit=args.test_limit),
        batch_size=args.batch_size,
        tau=args.tau,
    )


def make_spec(args):
    """The rebound.torch.Spec of this example."""
    import rebound.torch as rt
    return rt.Spec(**spec_fields(args))


def run_kwargs(args):
    """The keyword arguments of rebound.torch.run (see the module docstring)."""
    kwargs = {"server": args.server}
    for key in ("name", "role", "config", "max_seconds"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    return kwargs


def evaluate(model, data, batch=1000):
    """Test accuracy of `model` on `data` (a FashionMnist)."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(data), batch):
            x, y = data.batch(range(start, min(start + batch, len(data))))
            correct += int((model(x).argmax(1) == y).sum())
    model.train()
    return correct / len(data)


def plain_step(model, optimizer, loss_fn, x, y, create_graph=False):
    """One plain training step; create_graph for optimizers that need a double backward."""
    optimizer.zero_grad(set_to_none=True)  # also breaks the grad <-> graph cycle of create_graph
    loss = loss_fn(model(x), y)
    loss.backward(create_graph=create_graph)
    optimizer.step()
    return loss.detach()


def plain_train(spec, epochs=0, seconds=0.0, seed=1, log=print):
    """Trains `spec` (an object with the Spec's fields) in a plain PyTorch loop, no Rebound.

    Runs `epochs` epochs (a seeded shuffle per epoch, last partial batch dropped) or, with
    seconds > 0, as many steps as fit in `seconds`. Returns (model, samples trained, seconds)."""
    torch.manual_seed(0)
    model = spec.model()
    optimizer = spec.optimizer(model.parameters())
    create_graph = type(optimizer).__name__ == "AdaHessian"
    # torch warns of the grad <-> graph cycle of backward(create_graph=True); plain_step breaks it.
    warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")
    gen = torch.Generator().manual_seed(seed)
    n, b = len(spec.train_set), spec.batch_size
    samples, start, epoch = 0, time.perf_counter(), 0
    while True:
        epoch += 1
        if epochs and epoch > epochs:
            break
        order = torch.randperm(n, generator=gen)
        epoch_start, loss_sum = time.perf_counter(), 0.0
        for i in range(n // b):
            x, y = spec.train_set.batch(order[i * b:(i + 1) * b])
            loss_sum += float(plain_step(model, optimizer, spec.loss, x, y, create_graph))
            samples += b
            if seconds and time.perf_counter() - start >= seconds:
                return model, samples, time.perf_counter() - start
        elapsed = time.perf_counter() - epoch_start
        log(f"epoch {epoch:2d}  train_loss {loss_sum / (n // b):.4f}  test_accuracy "
            f"{100 * evaluate(model, spec.test_set):.2f}%  {(n // b) * b / elapsed:.0f} samples/s  "
            f"{elapsed:.1f} s", flush=True)
    return model, samples, time.perf_counter() - start


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.plain_epochs:
        fields = spec_fields(args)
        print(f"plain PyTorch: {args.optimizer} lr {args.lr or DEFAULT_LR[args.optimizer]}, batch "
              f"{args.batch_size}, {len(fields['train_set'])} train / {len(fields['test_set'])} "
              f"test samples, {args.threads} thread(s)", flush=True)
        plain_train(types.SimpleNamespace(**fields), epochs=args.plain_epochs, seed=args.seed)
        return 0
    import rebound.torch as rt
    result = rt.run(make_spec(args), **run_kwargs(args))
    if args.save:
        if result.model is None:
            print(f"--save: nothing saved: {result.reason}", file=sys.stderr, flush=True)
        else:
            torch.save(result.model.state_dict(), args.save)
            print(f"saved the final center (version {result.center_version}) to {args.save}",
                  flush=True)
    return result  # an int, the exit code: sys.exit(main()) exits with it


if __name__ == "__main__":
    sys.exit(main())
