"""Rebound's Python client: train your own PyTorch model on a Rebound server (docs/python.md).

The package is pure Python over Debian's python3-grpcio and python3-protobuf; the protobuf and
gRPC stubs are generated from proto/ into the sibling package ``rebound_pb`` by
``python/gen_stubs.sh`` (tools/setup.sh runs it). ``rebound.torch`` (over python3-torch) holds
what a training script uses: ``Spec``, ``run`` and the ``AdaHessian`` optimizer.

Exit codes of a process that ``rebound.torch.run`` ends, the same as ``rebound_worker``'s:
"""

import os as _os

__version__ = "0.12.0"

# gRPC's backup poller every 50 ms instead of 5 s (common/grpc_polling.h): a fail-fast call on a
# reconnecting channel otherwise leaves its handshake unread for up to 5 s. Set before grpc is
# imported (gRPC reads it once); an operator's value is kept.
_os.environ.setdefault("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "50")

EXIT_OK = 0          # the job finished, or the process was stopped (SIGTERM, max_seconds)
EXIT_FAILED = 1      # an error of the process itself (e.g. a non-finite loss)
EXIT_CONFIG = 2      # the spec or the options are wrong, or do not fit the server's job
EXIT_FENCED = 3      # the server fenced this worker (declared failed, replaced, drained)
EXIT_UNREACHABLE = 4  # no contact with the server for give_up_after_s
EXIT_REJECTED = 5    # the server refused this worker (registration refused, wrong token)
