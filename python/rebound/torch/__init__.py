"""rebound.torch: train your own PyTorch model with Rebound (docs/python.md, docs/design.md §11).

    import rebound.torch as rt
    spec = rt.Spec(model=make_model, optimizer=lambda params: rt.AdaHessian(params, lr=0.01),
                   loss=torch.nn.functional.cross_entropy, train_set=train, test_set=test,
                   batch_size=64, tau=8)
    result = rt.run(spec, server="127.0.0.1:7070")
    torch.save(result.model.state_dict(), "model.pt")   # the job's final center
    sys.exit(result)                                     # rebound_worker's exit codes

The same script runs as trainer, spare or evaluator: the role comes from the server. ``run``
returns when the work is over: a ``RunResult``, an int (the exit code, rebound.EXIT_*) with the
spec's model holding the job's final center (``result.model``, ``result.center_version``; None
with ``result.reason`` when the job did not finish). ``exit=True`` ends the process with the code
instead; a fenced worker ends it at once either way.

The trained model at any time: ``load_center(server, model)`` copies the server's center into a
model; ``export_center`` returns it as a state_dict; ``load_safetensors`` reads the file
``reboundctl export`` writes (rebound.torch.export).
"""

from rebound.torch.adahessian import AdaHessian
from rebound.torch.export import export_center, load_center, load_safetensors
from rebound.torch.kernels import AdaHessianConfig
from rebound.torch.runner import RunResult, Spec, run

__all__ = ["AdaHessian", "AdaHessianConfig", "RunResult", "Spec", "export_center",
           "load_center", "load_safetensors", "run"]
