#!/usr/bin/env bash
# Checks devicelet against a real NVIDIA GPU node: runs `devicelet validate` with the nvidia-gpu
# module and the node's real NVML library, then compares what devicelet would advertise for
# nvidia.com/gpu with what `nvidia-smi -q -x` reports; then starts the agent (`devicelet run`)
# against the built-in kubelet simulator (`devicelet simulate --allocate nvidia.com/gpu=1`),
# checks the allocated GPU's UUID and device nodes against nvidia-smi and, when PyTorch or CuPy
# is importable, runs a small CUDA computation with CUDA_VISIBLE_DEVICES set to that UUID. Prints
# a pass/fail table (exit 1 when a check fails, 2 when the node or the machine lacks something
# the check needs).
#
# Needs: the NVIDIA driver (nvidia-smi and libnvidia-ml.so.1), python3, and the Rust toolchain
# with rustup (unless both --devicelet and --module are given). No kubelet is needed.
# CI never runs this (it has no GPU); run it by hand on a GPU machine.
#
# Usage: scripts/gpu-check.sh [--nvml-library PATH] [--nvidia-smi CMD] [--devicelet PATH]
#                             [--module PATH]
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/gpu-check.sh [options]

Runs `devicelet validate` with the nvidia-gpu module against this node's GPUs and compares
what devicelet would advertise with `nvidia-smi -q -x`; then runs the agent against the kubelet
simulator, allocates one GPU, checks the answer against nvidia-smi and, with PyTorch or CuPy
installed, runs a CUDA computation on the allocated GPU alone.

Options:
  --nvml-library PATH  NVML library to load: a path or a name the loader searches for
                       (default: libnvidia-ml.so.1)
  --nvidia-smi CMD     nvidia-smi to run (default: nvidia-smi)
  --devicelet PATH     use this prebuilt devicelet binary instead of building it
  --module PATH        use this prebuilt nvidia_gpu.wasm instead of building it
  -h, --help           show this help

Exit status: 0 all checks passed, 1 some check failed, 2 could not run the checks.
EOF
}

# Paths given on the command line are relative to the caller's directory, not the repository
# root this script moves to, so make them absolute first.
absolute() {
    case "$1" in
        /*) printf '%s\n' "$1" ;;
        *) printf '%s\n' "$PWD/$1" ;;
    esac
}

need_value() {
    if [ "$#" -lt 2 ]; then
        echo "$1 needs a value (see --help)" >&2
        exit 2
    fi
}

nvml_library="libnvidia-ml.so.1"
nvidia_smi="nvidia-smi"
devicelet=""
module=""
while [ "$#" -gt 0 ]; do
    case "$1" in
        --nvml-library)
            need_value "$@"
            # A bare name is left for the dynamic loader to search for; a path is made absolute.
            case "$2" in
                */*) nvml_library="$(absolute "$2")" ;;
                *) nvml_library="$2" ;;
            esac
            shift 2
            ;;
        --nvidia-smi)
            need_value "$@"
            case "$2" in
                */*) nvidia_smi="$(absolute "$2")" ;;
                *) nvidia_smi="$2" ;;
            esac
            shift 2
            ;;
        --devicelet)
            need_value "$@"
            devicelet="$(absolute "$2")"
            shift 2
            ;;
        --module)
            need_value "$@"
            module="$(absolute "$2")"
            shift 2
            ;;
        -h | --help)
            usage
            exit 0
            ;;
        *)
            echo "unknown argument: $1" >&2
            usage >&2
            exit 2
            ;;
    esac
done

cd "$(dirname "$0")/.."

if ! command -v "$nvidia_smi" >/dev/null 2>&1; then
    echo "no nvidia-smi here: run this on a node with an NVIDIA GPU and its driver" >&2
    exit 2
fi
if ! command -v python3 >/dev/null 2>&1; then
    echo "no python3 here: this check parses nvidia-smi's XML with it; install python3" >&2
    exit 2
fi

# Build only what was not given.
target="${CARGO_TARGET_DIR:-target}"
if [ -z "$module" ] || [ -z "$devicelet" ]; then
    if ! command -v cargo >/dev/null 2>&1; then
        echo "no cargo here: install the Rust toolchain, or pass --devicelet and --module" >&2
        exit 2
    fi
fi
if [ -z "$module" ]; then
    rustup target add wasm32-wasip2
    cargo build --release --target wasm32-wasip2 -p nvidia-gpu
    module="$(absolute "$target/wasm32-wasip2/release/nvidia_gpu.wasm")"
fi
if [ -z "$devicelet" ]; then
    cargo build --release -p devicelet
    devicelet="$(absolute "$target/release/devicelet")"
fi
for file in "$module" "$devicelet"; do
    if [ ! -f "$file" ]; then
        echo "missing: $file" >&2
        exit 2
    fi
done

work="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# Whole GPUs named by UUID, so validate's device IDs are the UUIDs nvidia-smi reports.
cat >"$work/registry.toml" <<EOF
host-root = "/"
resource-domain = "nvidia.com"

[[module]]
name = "nvidia-gpu"
path = "$module"
health-interval = "5s"

[module.grants]
dev = ["/dev/nvidia*", "/dev/nvidia-caps/*"]
libraries = ["nvml"]

[module.config]
device-id-strategy = "uuid"
mig-strategy = "none"
EOF

if ! "$nvidia_smi" -q -x >"$work/nvidia-smi.xml" 2>"$work/nvidia-smi.err"; then
    echo "\`$nvidia_smi -q -x\` failed:" >&2
    cat "$work/nvidia-smi.err" >&2
    exit 2
fi

# A failing validate still prints what it found, so compare anyway; its exit status is a check
# of its own. CDI specs go to a scratch directory (validate only names where they would go).
validate_rc=0
"$devicelet" validate --config "$work/registry.toml" --nvml-library "$nvml_library" \
    --cdi-dir "$work/cdi" >"$work/validate.out" 2>"$work/validate.err" || validate_rc=$?
if [ "$validate_rc" -ne 0 ]; then
    echo "devicelet validate exited with $validate_rc; its output:"
    sed 's/^/| /' "$work/validate.out" "$work/validate.err"
    echo
fi

# The agent as on a node, with the simulator as its kubelet: the simulator allocates one GPU
# once the resource registers and prints the Allocate answer.
mkdir -p "$work/kubelet" "$work/state"
"$devicelet" simulate --dir "$work/kubelet" --allocate nvidia.com/gpu=1 >"$work/simulate.out" 2>&1 &
simulator=$!
"$devicelet" run --config "$work/registry.toml" --nvml-library "$nvml_library" \
    --kubelet-dir "$work/kubelet" --pod-resources-socket "$work/pod-resources/kubelet.sock" \
    --state-dir "$work/state" --cdi-dir "$work/cdi" \
    >"$work/run.out" 2>&1 &
agent=$!
trap 'kill "$agent" "$simulator" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 1 300); do
    if grep -q "PreStartContainer:\|allocation of .* failed" "$work/simulate.out"; then
        break
    fi
    sleep 0.1
done
kill "$agent" "$simulator" 2>/dev/null || true
wait 2>/dev/null || true
if ! grep -q "PreStartContainer:" "$work/simulate.out"; then
    echo "no allocation within 30 s; the simulator said:"
    sed 's/^/| /' "$work/simulate.out"
    echo "and the agent:"
    sed 's/^/| /' "$work/run.out"
    echo
fi

python3 - "$work/nvidia-smi.xml" "$work/validate.out" "$validate_rc" "$work/simulate.out" <<'PY'
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

smi_path, validate_path, validate_rc = sys.argv[1], sys.argv[2], int(sys.argv[3])
simulate_path = sys.argv[4]
RESOURCE = "nvidia.com/gpu"


def text(elem, path):
    found = elem.find(path)
    return found.text.strip() if found is not None and found.text else ""


def pci(address):
    """Normalise a PCI address: nvidia-smi writes an 8-digit domain (00000000:07:00.0) in upper
    case, devicelet the usual 4-digit one (0000:07:00.0)."""
    match = re.fullmatch(r"([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)", address)
    if not match:
        return address.lower()
    domain, bus, dev, fn = (int(p, 16) for p in match.groups())
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn:x}"


# --- nvidia-smi's view -------------------------------------------------------------------------
root = ET.parse(smi_path).getroot()
driver = text(root, "driver_version")
gpus = []
for gpu in root.findall("gpu"):
    memory = text(gpu, "fb_memory_usage/total")  # "81920 MiB"
    gpus.append({
        "uuid": text(gpu, "uuid"),
        "name": text(gpu, "product_name"),
        "memory": memory.split()[0] if memory else "",
        "mig": text(gpu, "mig_mode/current_mig"),  # Enabled, Disabled or N/A
        "pci": pci(text(gpu, "pci/pci_bus_id") or gpu.get("id", "")),
        "minor": text(gpu, "minor_number"),
    })

# --- devicelet's view --------------------------------------------------------------------------
# The `NVML:` line, then the device lines under `  resource nvidia.com/gpu (...)`: 4 spaces, the
# ID, the health, maybe ` NUMA a,b`, maybe ` {k=v, k=v}`. The other lines at that depth
# ("device list: ...", "2 devices, 2 healthy:", "CDI spec: ...") don't fit the pattern.
DEVICE = re.compile(r"^    (\S+) (Healthy|Unhealthy)(?: NUMA [0-9,]+)?(?: \{(.*)\})?$")
nvml = None
devices = []
in_resource = False
with open(validate_path, encoding="utf-8", errors="replace") as f:
    for line in f:
        line = line.rstrip("\n")
        if line.startswith("  NVML: "):
            nvml = line[len("  NVML: "):]
        if line.startswith("  resource "):
            in_resource = line[len("  resource "):].split(" ")[0] == RESOURCE
            continue
        if not line.startswith("    "):
            in_resource = False  # a line at module depth or above ends the resource's block
            continue
        match = DEVICE.match(line) if in_resource else None
        if match:
            attrs = {}
            for pair in (match.group(3) or "").split(", "):
                if "=" in pair:
                    key, value = pair.split("=", 1)
                    attrs[key] = value
            devices.append({"id": match.group(1), "health": match.group(2), "attrs": attrs})

# --- the checks --------------------------------------------------------------------------------
rows = []


def check(name, gpu, smi, dl, ok):
    rows.append((name, gpu, str(smi), str(dl), "PASS" if ok else "FAIL"))


check("validate ok", "-", "-", f"exit {validate_rc}", validate_rc == 0)
loaded = nvml is not None and not nvml.startswith("unavailable")
check("NVML loaded", "-", f"driver {driver}" if driver else "-",
      nvml if nvml is not None else "(no NVML line)", loaded)
check("GPU count", "-", len(gpus), len(devices), len(gpus) == len(devices))


def find(gpu):
    """devicelet's device for an nvidia-smi GPU: by its uuid attribute or its ID (the UUID with
    device-id-strategy uuid), else by PCI address (an unhealthy device may carry little else)."""
    for d in devices:
        if gpu["uuid"] and gpu["uuid"] in (d["attrs"].get("uuid"), d["id"]):
            return d
    for d in devices:
        if "pci-address" in d["attrs"] and pci(d["attrs"]["pci-address"]) == gpu["pci"]:
            return d
    return None


matched = []
for gpu in gpus:
    label = gpu["uuid"] or gpu["pci"]
    d = find(gpu)
    check("advertised", label, "present", d["id"] if d else "(missing)", d is not None)
    if d is None:
        continue  # nothing more to compare for it; the row above already fails
    matched.append(id(d))
    attrs = d["attrs"]
    check("healthy", label, "-", d["health"], d["health"] == "Healthy")
    check("memory MiB", label, gpu["memory"] or "?", attrs.get("memory-mib", "(none)"),
          gpu["memory"] != "" and attrs.get("memory-mib") == gpu["memory"])
    # N/A means the GPU cannot do MIG at all, which devicelet reports as not enabled.
    smi_mig = gpu["mig"] == "Enabled"
    dl_mig = attrs.get("mig-enabled", "(none)")
    check("MIG mode", label, gpu["mig"] or "?", dl_mig,
          dl_mig in ("true", "false") and (dl_mig == "true") == smi_mig)
    check("name", label, gpu["name"] or "?", attrs.get("name", "(none)"),
          attrs.get("name") == gpu["name"])

# Devices devicelet would advertise that nvidia-smi does not know of.
for d in devices:
    if id(d) not in matched:
        check("known to nvidia-smi", d["id"], "(missing)", "present", False)

# --- an allocation through the agent and the simulated kubelet ------------------------------------
with open(simulate_path, encoding="utf-8", errors="replace") as f:
    simulated = f.read()
envs, nodes, section = {}, [], None
for line in simulated.splitlines():
    if line.startswith("  ") and not line.startswith("    "):
        section = line.strip().rstrip(":").split(":")[0]
        continue
    if line.startswith("    ") and section == "envs" and "=" in line:
        key, value = line.strip().split("=", 1)
        envs[key] = value
    if line.startswith("    ") and section == "devices":
        nodes.append(line.strip().split(" -> ")[0])
allocated = envs.get("NVIDIA_VISIBLE_DEVICES", "")
check("allocated", "-", "one GPU", allocated or "(no allocation)", allocated != "")
gpu = next((g for g in gpus if g["uuid"] == allocated), None)
check("allocated UUID", allocated or "-", "known" if gpu else "(unknown)", allocated or "-",
      gpu is not None)
if gpu is not None:
    own = f"/dev/nvidia{gpu['minor']}"
    check("device node", allocated, own, own if own in nodes else "(missing)", own in nodes)
    check("control node", allocated, "/dev/nvidiactl",
          "/dev/nvidiactl" if "/dev/nvidiactl" in nodes else "(missing)",
          "/dev/nvidiactl" in nodes or not os.path.exists("/dev/nvidiactl"))
    others = [f"/dev/nvidia{g['minor']}" for g in gpus if g is not gpu]
    leaked = [n for n in nodes if n in others]
    check("no other GPU", allocated, "-", ", ".join(leaked) or "none", not leaked)
    # CUDA on the allocated GPU alone, as the container would see it.
    program = None
    for module, code in (
        ("torch", "import torch; assert torch.cuda.device_count() == 1; "
                  "a = torch.ones(256, 256, device='cuda'); "
                  "print(torch.cuda.get_device_name(0), float((a @ a).sum()))"),
        ("cupy", "import cupy; assert cupy.cuda.runtime.getDeviceCount() == 1; "
                 "a = cupy.ones((256, 256)); print(float((a @ a).sum()))"),
    ):
        if subprocess.run([sys.executable, "-c", f"import {module}"],
                          capture_output=True).returncode == 0:
            program = (module, code)
            break
    if program is None:
        print("neither PyTorch nor CuPy is importable: the CUDA check is skipped")
    else:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=allocated)
        ran = subprocess.run([sys.executable, "-c", program[1]], env=env,
                             capture_output=True, text=True, timeout=300)
        out = (ran.stdout.strip() or ran.stderr.strip()[-200:])
        # 256 x 256 ones: every product entry is 256, the sum 256^3.
        ok = ran.returncode == 0 and out.endswith(str(float(256 ** 3)))
        check(f"CUDA ({program[0]})", allocated, "1 device, sum 16777216.0", out, ok)

header = ("CHECK", "GPU", "nvidia-smi", "devicelet", "RESULT")
widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]


def show(row):
    print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


show(header)
print("-+-".join("-" * w for w in widths))
for row in rows:
    show(row)
failed = sum(1 for r in rows if r[4] == "FAIL")
print(f"{len(rows)} checks, {failed} failed")
sys.exit(1 if failed else 0)
PY
