#!/usr/bin/python3
"""The training script of deploy/k8s-python's workers: replace this file with yours.

Every worker pod runs it from the ConfigMap rebound-script (mounted at /opt/rebound/script) in the
image of deploy/Dockerfile.python, as

    /usr/bin/python3 /opt/rebound/script/train.py --config=/etc/rebound/worker.pbtxt
        --server=rebound-server:7070 --name=POD [--role=spare|evaluator]

Yours takes these flags, builds a rebound.torch.Spec and ends with
`sys.exit(rebound.torch.run(spec, server=..., name=..., role=..., config=...))` (docs/python.md):
the exit code tells Kubernetes whether to restart it. Its batch size and tau are the job's
(config/job.pbtxt: data.batch_size, easgd.sync_period).

This one runs the image's example, examples/torch/fashion_mnist_cnn.py (a two-convolution CNN on
Fashion-MNIST, Adam, batch 64, tau 8), with the flags it was given.
"""

import runpy
import sys

EXAMPLE = "/opt/rebound/examples/torch/fashion_mnist_cnn.py"

if __name__ == "__main__":
    sys.argv[0] = EXAMPLE
    runpy.run_path(EXAMPLE, run_name="__main__")   # it ends with sys.exit(its exit code)
