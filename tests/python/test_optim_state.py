"""rebound.torch.optim_state: every torch.optim optimizer's state survives the snapshot's
OptimizerState (step, m, v, last_hdiag) exactly: a fresh optimizer restored from a trainer's
export goes on bit for bit as the trainer's own, as a spare's replay needs; a state that has no
exact place says so (Unreplayable) instead of replaying wrongly."""

import pytest
import torch

from rebound.torch import optim_state

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    "rmsprop-centered-momentum": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5,
                                                               centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, initial_accumulator_value=0.1),
    "adadelta": lambda p: torch.optim.Adadelta(p),
    "adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "nadam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "radam": lambda p: torch.optim.RAdam(p, lr=0.01),
    "asgd": lambda p: torch.optim.ASGD(p, lr=0.05, t0=3),
    "rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
}


def model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))


def train(net, optimizer, steps, first):
    for t in range(first, first + steps):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(8, 5, generator=g)
        y = torch.randn(8, 2, generator=g)
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()


def bits(net):
    return [p.detach().clone().view(torch.int32) for p in net.parameters()]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_restored_optimizer_goes_on_bit_for_bit(name):
    trainer = model()
    trainer_opt = OPTIMIZERS[name](list(trainer.parameters()))
    train(trainer, trainer_opt, 6, 1)
    params = list(trainer.parameters())
    names = [n for n, _ in trainer.named_parameters()]
    message, why = optim_state.export(trainer_opt, params, names, 6)
    assert why is None
    # What the spare does: a fresh model and optimizer, the snapshot's values, the state.
    spare = model()
    spare_opt = OPTIMIZERS[name](list(spare.parameters()))
    with torch.no_grad():
        for p, q in zip(spare.parameters(), params):
            p.copy_(q)
    optim_state.restore(spare_opt, list(spare.parameters()), names,
                        message.FromString(message.SerializeToString()), 6)
    train(trainer, trainer_opt, 5, 7)
    train(spare, spare_opt, 5, 7)
    for a, b in zip(bits(trainer), bits(spare)):
        assert torch.equal(a, b), name
    # The replay really depended on the state: a spare without it ends elsewhere (plain SGD has
    # no state, so there nothing can differ).
    if name != "sgd":
        blank = model()
        blank_opt = OPTIMIZERS[name](list(blank.parameters()))
        with torch.no_grad():
            for p, q in zip(blank.parameters(), params):
                p.copy_(q)
        train(blank, blank_opt, 5, 7)
        assert any(not torch.equal(a, b) for a, b in zip(bits(trainer), bits(blank))), name


def test_adam_and_sgd_keep_their_snapshot_layout():
    """Snapshots written before the generic rule: Adam's m, v are exp_avg, exp_avg_sq and its
    step the optimizer's; SGD's m is the momentum buffer and its step the training step."""
    net = model()
    adam = torch.optim.Adam(list(net.parameters()), lr=0.01)
    train(net, adam, 3, 1)
    params = list(net.parameters())
    message, _ = optim_state.export(adam, params, ["a", "b", "c", "d"], 40)
    assert message.step == 3
    assert bytes(message.m.tensors[0].data) == (
        adam.state[params[0]]["exp_avg"].numpy().astype("<f4").tobytes())
    assert bytes(message.v.tensors[2].data) == (
        adam.state[params[2]]["exp_avg_sq"].numpy().astype("<f4").tobytes())
    assert len(message.last_hdiag.tensors) == 0
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    train(net, sgd, 2, 1)
    message, _ = optim_state.export(sgd, params, ["a", "b", "c", "d"], 40)
    assert message.step == 40
    assert bytes(message.m.tensors[1].data) == (
        sgd.state[params[1]]["momentum_buffer"].numpy().astype("<f4").tobytes())
    assert len(message.v.tensors) == 0


def test_a_declared_tensor_the_optimizer_does_not_hold_gets_zeros():
    net = model()
    params = list(net.parameters())
    buffer = torch.ones(3)
    opt = torch.optim.RMSprop(params, lr=0.01)
    train(net, opt, 2, 1)
    message, why = optim_state.export(opt, params + [buffer], ["a", "b", "c", "d", "buf"], 2)
    assert why is None
    assert len(message.m.tensors) == 5
    assert bytes(message.m.tensors[4].data) == bytes(12)


class Scaled(torch.optim.SGD):
    """An optimizer whose state holds a Python float: no exact place in the snapshot."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["scale"] = 0.5


def test_a_state_without_an_exact_place_is_unreplayable_and_says_what():
    net = model()
    params = list(net.parameters())
    opt = Scaled(params, lr=0.1)
    train(net, opt, 2, 1)
    message, why = optim_state.export(opt, params, ["0.weight", "0.bias", "2.weight", "2.bias"],
                                      2)
    assert "'0.weight'" in why and "'scale' is a float" in why
    assert len(message.m.tensors) == 0 and message.step == 2
    fresh = Scaled(list(model().parameters()), lr=0.1)
    with pytest.raises(optim_state.Unreplayable, match="Scaled.*'scale' is a float"):
        optim_state.restore(fresh, list(fresh.param_groups[0]["params"]), ["a"] * 4, message, 2)


def test_a_parameter_left_without_a_gradient_makes_the_state_unreplayable():
    net = model()
    params = list(net.parameters())
    opt = torch.optim.Adam(params, lr=0.01)
    x = torch.randn(4, 5)
    net[0](x).sum().backward()  # only the first layer gets gradients
    opt.step()
    message, why = optim_state.export(opt, params, ["a", "b", "c", "d"], 1)
    assert "different state entries" in why
    fresh_net = model()
    fresh = torch.optim.Adam(list(fresh_net.parameters()), lr=0.01)
    with pytest.raises(optim_state.Unreplayable, match="keeps 2 state tensors"):
        optim_state.restore(fresh, list(fresh_net.parameters()), ["a"] * 4, message, 1)


# ---------------------------------------------------------------------------------------------
# Learning-rate schedulers through the runner's own step and seek (a spare's and a restarted
# trainer's way to the schedule's position).

SCHEDULERS = {
    "steplr-epoch": (lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
                     "epoch"),
    "steplr-step": (lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.7),
                    "step"),
    "lambdalr": (lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1.0 / (1 + 0.3 * k)),
                 "step"),
    "onecycle": (lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=40),
                 "step"),
    "cosine": (lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=17), "step"),
    "cosine-restarts-epoch": (
        lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=2), "epoch"),
    "exponential-epoch": (lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.9), "epoch"),
}


class Points:
    """64 samples of a regression task: 8 steps of 8 make an epoch."""

    def __init__(self):
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(64, 5, generator=g)
        self.y = torch.randn(64, 2, generator=g)

    def __len__(self):
        return 64

    def batch(self, ids):
        return self.x[ids], self.y[ids]


def runner_worker(scheduler, interval, optimizer="sgd-momentum"):
    from rebound.torch import runner
    spec = runner.Spec(model=lambda: torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(),
                                                         torch.nn.Linear(7, 2)),
                       optimizer=OPTIMIZERS[optimizer], loss=torch.nn.functional.mse_loss,
                       train_set=Points(), scheduler=scheduler, scheduler_interval=interval)
    from rebound_pb import config_pb2
    job = config_pb2.JobConfig()
    job.data.batch_size = 8
    job.topology.replicas = 1
    return runner, runner._Worker(spec, None, None, None, None, None), job


def run_steps(runner, worker, job, first, last, lrs):
    shard = runner.shard_ids(64, 1, 0)
    for t in range(first, last + 1):
        lrs[t] = worker.optimizer.param_groups[0]["lr"]
        ids = runner.batch_ids(shard, 0, 0, t, 8)[0]
        worker.step(job, 0, t, ids, runner.step_seed(0, 0, t))


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_a_scheduler_sought_to_the_snapshot_goes_on_bit_for_bit(name):
    factory, interval = SCHEDULERS[name]
    runner, trainer, job = runner_worker(factory, interval, "adam")
    trainer.build(job, 0)
    trainer_lrs, spare_lrs = {}, {}
    run_steps(runner, trainer, job, 1, 13, trainer_lrs)
    snapshot, _ = runner._export_optimizer(trainer.optimizer, trainer.params, trainer.names, 13)
    values = [p.detach().clone() for p in trainer.params]
    run_steps(runner, trainer, job, 14, 30, trainer_lrs)
    # The spare: fresh model, optimizer and scheduler; the snapshot; the schedule sought.
    _, spare, _ = runner_worker(factory, interval, "adam")
    spare.build(job, 0)
    spare.set_params(values)
    runner._import_optimizer(spare.optimizer, spare.params, spare.names, snapshot, 13)
    spare.seek_scheduler(13)
    run_steps(runner, spare, job, 14, 30, spare_lrs)
    assert {t: trainer_lrs[t] for t in spare_lrs} == spare_lrs
    assert len(set(spare_lrs.values())) > 1, "the schedule must change the lr in the range"
    for a, b in zip(trainer.params, spare.params):
        assert torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32)), name


def test_without_the_seek_the_schedule_would_restart():
    """The counter-case: a spare that does not seek starts the schedule again."""
    factory, interval = SCHEDULERS["steplr-epoch"]
    runner, trainer, job = runner_worker(factory, interval)
    trainer.build(job, 0)
    lrs = {}
    run_steps(runner, trainer, job, 1, 20, lrs)
    _, fresh, _ = runner_worker(factory, interval)
    fresh.build(job, 0)
    assert fresh.optimizer.param_groups[0]["lr"] != lrs[20]
    fresh.seek_scheduler(19)
    assert fresh.optimizer.param_groups[0]["lr"] == lrs[20]


# ---------------------------------------------------------------------------------------------
# Models the examples do not use, through the same replay path (the runner's step, a snapshot
# of the declared tensors and the optimizer, the torch seed of each step).

class Sequences:
    """64 samples of a sequence task: x [6, 4] (or an image [1, 6, 6]), class y in 0..2."""

    def __init__(self, image=False):
        g = torch.Generator().manual_seed(9)
        self.x = torch.randn(64, 1, 6, 6, generator=g) if image else torch.randn(64, 6, 4,
                                                                                 generator=g)
        self.y = torch.randint(0, 3, (64,), generator=g)

    def __len__(self):
        return 64

    def batch(self, ids):
        return self.x[ids], self.y[ids]


class Gru(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = torch.nn.GRU(4, 8, num_layers=2, dropout=0.2, batch_first=True)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.gru(x)[0][:, -1])


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(4, 2, dim_feedforward=16, dropout=0.2,
                                                 batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2)
        self.out = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.out(self.encoder(x).mean(dim=1))


MODELS = {
    "gru-dropout": (Gru, False),
    "transformer-dropout": (Encoder, False),
    "cnn-batchnorm-dropout": (lambda: torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.Dropout(0.3), torch.nn.Flatten(), torch.nn.Linear(64, 3)), True),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_model_with_dropout_and_buffers_replays_bit_for_bit(name):
    from rebound.torch import runner
    from rebound_pb import config_pb2
    factory, image = MODELS[name]
    data = Sequences(image)
    job = config_pb2.JobConfig()
    job.data.batch_size = 8
    job.topology.replicas = 1

    def worker():
        spec = runner.Spec(model=factory, optimizer=OPTIMIZERS["adamw"],
                           loss=torch.nn.functional.cross_entropy, train_set=data,
                           scheduler=SCHEDULERS["onecycle"][0])
        w = runner._Worker(spec, None, None, None, None, None)
        w.build(job, 0)
        return w

    def steps(w, first, last):
        for t in range(first, last + 1):
            w.step(job, 0, t, runner.batch_ids(runner.shard_ids(64, 1, 0), 0, 0, t, 8)[0],
                   runner.step_seed(0, 0, t))

    trainer = worker()
    steps(trainer, 1, 10)
    snapshot, _ = runner._export_optimizer(trainer.optimizer, trainer.tensors, trainer.names, 10)
    values = [t.detach().clone() for t in trainer.tensors]
    steps(trainer, 11, 16)
    spare = worker()
    spare.set_params(values)
    runner._import_optimizer(spare.optimizer, spare.tensors, spare.names, snapshot, 10)
    spare.seek_scheduler(10)
    runner.set_batches_tracked(spare.model, 10)
    steps(spare, 11, 16)
    assert runner._params_checksums(spare.tensors) == runner._params_checksums(trainer.tensors)
    if image:  # the BatchNorm's running statistics are declared, hence compared
        assert "1.running_var" in spare.names
