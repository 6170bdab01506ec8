#!/usr/bin/env bash
# Installs every build, test and run dependency of Rebound from Debian's packages.
# Idempotent: packages already installed are skipped, so a second run costs seconds.
#   tools/setup.sh          what the build, the tests, the demos, the Python client (its
#                           stubs and `import rebound.torch`: python/install.sh), the tsa/tsan checks of
#                           tools/test.sh and --config=fuzz need
#   tools/setup.sh --fuzz   the same (kept for docs/fuzzing.md's older instructions)
set -euo pipefail

PACKAGES=(
  # Build: offline Bazel and its rule repositories.
  bazel-bootstrap bazel-rules-java bazel-platforms
  build-essential pkg-config
  # gRPC, protobuf, Abseil, RocksDB.
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev librocksdb-dev
  # The server's allocator: gperftools' tcmalloc (docs/operations.md#memory).
  libgoogle-perftools-dev
  # Compute, logging, metrics, checksums, compression, data.
  libopenblas-dev libgoogle-glog-dev libgflags-dev libcpp-httplib-dev
  libxxhash-dev libzstd-dev zlib1g-dev
  # Exports' safetensors header (JSON; R17, common/safetensors.h): header-only.
  nlohmann-json3-dev
  dataset-fashion-mnist
  # Tests.
  catch2 openssl python3 procps
  # tests/deploy: the Kubernetes manifests are YAML; debootstrap builds the images' Debian roots
  # (image_chroot_test, tools/test.sh --full).
  python3-yaml debootstrap
  # The demo's plot (tools/plot_progress.sh): gnuplot without X, and a font for its PNGs.
  gnuplot-nox fonts-dejavu-core
  # The Python client (python/, docs/python.md): gRPC and protobuf for Python, PyTorch (CPU),
  # numpy, xxHash, pytest for its tests; its stubs come from protoc and grpc_python_plugin
  # (protobuf-compiler-grpc, above).
  python3-grpcio python3-protobuf python3-torch python3-numpy python3-xxhash python3-pytest
  # etcd (R13: a server group's coordination; the tests start their own members on loopback).
  etcd-server etcd-client
  # iptables (R15: partitions of single processes in the tests and chaos runs,
  # testing/cluster/firewall.h).
  iptables
  # prometheus (R19: promtool checks and unit-tests deploy/prometheus/alerts.yml; a real server
  # scrapes a local cluster in //tests/observability).
  prometheus
  # clang for --config=tsa (-Wthread-safety), --config=tsan and --config=fuzz; the TSan, ASan and
  # libFuzzer runtimes; lld (those configs link with it); llvm-symbolizer for their reports
  # (docs/thread_safety.md, docs/fuzzing.md).
  clang lld libclang-rt-14-dev llvm
)
if [ "${1:-}" = "--fuzz" ]; then
  :  # everything --config=fuzz needs is in the default list now
elif [ $# -gt 0 ]; then
  echo "setup: unknown argument $1 (only --fuzz)" >&2
  exit 2
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages present"
else
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
  echo "setup: packages installed"
fi

# The Python client: stubs generated from proto/ and `import rebound.torch` for
# /usr/bin/python3 (python/install.sh; docs/python.md#install).
"$(dirname "$0")/../python/install.sh"

