#!/usr/bin/env bash
# Builds devicelet, the benchmark runner (`devicelet-bench`, its own crate in bench/) and the
# benchmark guests in release mode and runs the benchmarks on this machine: prints the table and
# writes BENCHMARKS.md. Not part of the test run. Needs root (or CAP_MKNOD) for the fixture's
# device nodes. Extra arguments go to `devicelet-bench` (e.g. --only allocate,isolation, or
# --quick for a smoke run, or --dra-peer PATH to run the DRA benchmark beside the reference Go
# driver built by bench/peer/build-dra-example-driver.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
rustup target add wasm32-wasip2
# Benchmark 12 pulls from a real registry (Debian's CNCF distribution registry).
if ! command -v docker-registry >/dev/null; then
  apt-get install -y -q docker-registry >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q docker-registry >/dev/null; }
fi
cargo build --release --target wasm32-wasip2 -p generic-dev -p misbehaving -p nvidia-gpu -p amd-gpu
# The agent last and on its own, as the Dockerfile builds it: a build of several packages
# resolves features over all of them and would leave other binaries (other symbol names, so
# without runtime/startup-order.txt's layout) than the image's.
cargo build --release -p devicelet-bench -p fake-nvml
cargo build --release -p devicelet
target="${CARGO_TARGET_DIR:-target}"
export DEVICELET_BENCH_SCRIPT="./scripts/bench.sh${*:+ $*}"
"$target/release/devicelet-bench" --devicelet "$target/release/devicelet-node" \
  --module-dir "$target/wasm32-wasip2/release" --fake-nvml "$target/release/libfake_nvml.so" \
  --out BENCHMARKS.md "$@"
