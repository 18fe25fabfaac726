#!/usr/bin/env bash
# Sets everything up on a fresh machine (only the Rust toolchain needed) and runs devicelet's main
# job on its embedded default: the agent with the generic-dev reference module, against the
# built-in kubelet simulator and a fixture device tree, through the device plugin, then DRA, then
# pulled as a signed OCI artifact from a local registry. Needs root (or CAP_MKNOD) for the
# fixture's device nodes, and to install Debian's docker-registry when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
rustup target add wasm32-wasip2
# The demo's OCI part runs Debian's docker-registry on a loopback port.
if ! command -v docker-registry >/dev/null; then
  echo "installing Debian's docker-registry for the demo's OCI part" >&2
  apt-get install -y -q docker-registry >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q docker-registry >/dev/null; }
fi
cargo build --release --target wasm32-wasip2 -p generic-dev
target="${CARGO_TARGET_DIR:-target}"
# The demo prints its own story; the agent's and the simulator's logs show only warnings unless
# -v is given.
log=warn
if [ "${1:-}" = "-v" ]; then log=info; fi
cargo run -q -p devicelet -- --log "$log" demo --module-dir "$target/wasm32-wasip2/release"
