#!/usr/bin/env bash
# Installs every build, test and run dependency of Rebound from Debian's packages.
# Idempotent: packages already installed are skipped, so a second run costs seconds.
#   tools/setup.sh          what the build, the tests and the demo need
#   tools/setup.sh --fuzz   and clang, libFuzzer, ASan and lld for --config=fuzz (docs/fuzzing.md)
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
  dataset-fashion-mnist
  # Tests.
  catch2 openssl python3 procps
  # tests/deploy: the Kubernetes manifests are YAML.
  python3-yaml
  # The demo's plot (tools/plot_progress.sh): gnuplot without X, and a font for its PNGs.
  gnuplot-nox fonts-dejavu-core
)
if [ "${1:-}" = "--fuzz" ]; then
  # Fuzzing (--config=fuzz, docs/fuzzing.md): clang, libFuzzer and ASan, lld, llvm-symbolizer.
  PACKAGES+=(clang lld libclang-rt-14-dev llvm)
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
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "setup: done"
