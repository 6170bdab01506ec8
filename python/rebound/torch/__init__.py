"""rebound.torch: train your own PyTorch model with Rebound (docs/python.md, DESIGN.md §11).

    import rebound.torch as rt
    spec = rt.Spec(model=make_model, optimizer=lambda params: rt.AdaHessian(params, lr=0.01),
                   loss=torch.nn.functional.cross_entropy, train_set=train, test_set=test,
                   batch_size=64, tau=8)
    rt.run(spec, server="127.0.0.1:7070")

The same script runs as trainer, spare or evaluator: the role comes from the server. ``run``
returns only when the work is over and exits the process with rebound_worker's exit codes
(rebound.EXIT_*) when ``exit=True`` (the default).

The trained model: ``load_center(server, model)`` copies the server's center into a model at any
time; ``export_center`` returns it as a state_dict; ``load_safetensors`` reads the file
``reboundctl export`` writes (rebound.torch.export).
"""

from rebound.torch.adahessian import AdaHessian
from rebound.torch.export import export_center, load_center, load_safetensors
from rebound.torch.kernels import AdaHessianConfig
from rebound.torch.runner import Spec, run

__all__ = ["AdaHessian", "AdaHessianConfig", "Spec", "export_center", "load_center",
           "load_safetensors", "run"]
