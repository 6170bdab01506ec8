#!/usr/bin/env bash
# Encodes the seed inputs of the protobuf-input fuzz targets, kept readable in
# fuzz/seeds/<target>/<name>.txtpb (protobuf text format), into fuzz/corpus/<target>/<name> (binary,
# what the fuzzers read). Run from anywhere after editing a seed; needs only the system protoc.
# config_fuzzer's corpus is text already and lives in fuzz/corpus/config_fuzzer directly.
set -euo pipefail
cd "$(dirname "$0")/.."

message_of() {
  case "$1" in
    service_fuzzer) echo "fuzz/sessions.proto rebound.fuzz.ServerSession" ;;
    worker_peer_fuzzer) echo "fuzz/sessions.proto rebound.fuzz.PeerSession" ;;
    tensor_codec_fuzzer) echo "proto/tensor.proto rebound.Tensor" ;;
    *) echo "make_corpus.sh: no message type for $1" >&2; return 1 ;;
  esac
}

for dir in fuzz/seeds/*/; do
  target=$(basename "$dir")
  read -r proto message < <(message_of "$target")
  mkdir -p "fuzz/corpus/$target"
  for seed in "$dir"*.txtpb; do
    out="fuzz/corpus/$target/$(basename "$seed" .txtpb)"
    protoc -I. --encode="$message" "$proto" < "$seed" > "$out"
    echo "$out ($(wc -c < "$out") bytes)"
  done
done
