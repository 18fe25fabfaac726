#!/usr/bin/env bash
# Writes runtime/startup-order.txt: the functions of the agent's binary that its starts run, which
# release builds place side by side at the front of the code (runtime/build.rs). Run it again
# when start-up changes a lot (new front end, new dependency on the start path); a stale list
# costs only locality, never a build.
#
# How: the release node agent is built as the image builds it, keeping its symbol table
# (DEVICELET_KEEP_SYMBOLS=1 only skips the link's --strip-all: the names are the image's, which
# they would not be with another profile, other features or another Cargo.lock), then the bench's start-up benchmark (`--only startup
# --quick`) spawns every agent under callgrind, and every function of the binary that ran in a
# start that compiled nothing is listed (mangled, as the linker names them), sorted by name.
# Under valgrind the CPU looks different, so a cache written natively is not used and the
# compile child cannot start: the first start on each cache compiles in the agent and is left
# out; the next ones, warm, make the list. The bench then stops at the first start that
# outlasts its 30 s wait under callgrind; the warm starts before it are enough (about 2,700
# functions; fewer than 1,000 fails the script).
# Needs valgrind (installed with apt-get when missing) and about 20 minutes on 2 cores, most of
# it the two release builds (the bench's, then the agent's).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null ||
  apt-get install -y -q valgrind >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q valgrind >/dev/null; }
target=$(cargo metadata --format-version 1 --no-deps --locked |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
export DEVICELET_KEEP_SYMBOLS=1
# Exactly as the Dockerfile builds it (`-p devicelet`), so features resolve as in the image. The
# bench is built first: its own build resolves features over the bench too, and must not be the
# last to write the agent's binaries.
cargo build --release --locked -p devicelet-bench
cargo build --release --locked -p devicelet --bin devicelet-node
rustup target add wasm32-wasip2
# The modules the bench checks for before it starts.
cargo build --release --target wasm32-wasip2 -p generic-dev -p misbehaving -p nvidia-gpu -p amd-gpu
bin=$target/release/devicelet-node
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
{
  echo '#!/bin/sh'
  printf 'exec valgrind -q --tool=callgrind --demangle=no --compress-strings=no --compress-pos=no --callgrind-out-file=%q %q "$@"\n' \
    "$runs/callgrind.%p" "$bin"
} >"$runs/agent"
chmod +x "$runs/agent"
"$target/release/devicelet-bench" --devicelet "$runs/agent" \
  --module-dir "$target/wasm32-wasip2/release" --only startup --quick --out "$runs/bench.md" ||
  echo "startup-order.sh: the bench stopped early (expected, see above); using the starts it made"
compgen -G "$runs/callgrind.*" >/dev/null || { echo "startup-order.sh: no start ran under callgrind" >&2; exit 1; }
python3 - "$bin" "$runs"/callgrind.* >"$runs/order.txt" <<'PY'
import os, re, sys
binary = os.path.realpath(sys.argv[1])
names = set()
for path in sys.argv[2:]:
    ob, ran = None, set()
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("ob="):
                ob = os.path.realpath(line[3:].strip())
            elif line.startswith("fn=") and ob == binary:
                # Callgrind marks recursion levels as `name'2`.
                name = re.sub(r"'\d+$", "", line[3:].strip())
                if name and not name.startswith("0x") and " " not in name:
                    ran.add(name)
    # A start that compiled its module (Cranelift ran in the agent) is not a warm one.
    if sum("cranelift_codegen" in n for n in ran) < 50:
        names |= ran
if len(names) < 1000:
    sys.exit(f"only {len(names)} functions of {binary} ran: did the starts run under callgrind?")
print("# Functions of the agent's binary that its starts run, placed together at the front of")
print("# the code in release builds (runtime/build.rs). Written by scripts/startup-order.sh.")
for name in sorted(names):
    print(name)
PY
mv "$runs/order.txt" runtime/startup-order.txt
listed=$(grep -vc '^#' runtime/startup-order.txt)
found=$(nm "$bin" | awk '{print $NF}' | sort -u | comm -12 - <(grep -v '^#' runtime/startup-order.txt | sort -u) | wc -l)
echo "runtime/startup-order.txt: $listed functions, $found of them named in $bin"
