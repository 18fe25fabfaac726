#!/usr/bin/env bash
# Pushes the reference modules to an OCI registry and writes the registry ConfigMap patch of
# deploy/oci/ that serves them from there by digest: deploy/base's registry with each
# `path = "/opt/devicelet/modules/<name>.wasm"` replaced by
# `source = "oci://<registry>/devicelet/<name>:<version>@sha256:<digest>"`.
#
#   scripts/oci-modules.sh REGISTRY [OUT] [-- devicelet flags for the registry...]
#   scripts/oci-modules.sh registry.example.com
#   scripts/oci-modules.sh 127.0.0.1:5000 /tmp/registry-patch.yaml -- --insecure-registry 127.0.0.1:5000
#
# OUT defaults to deploy/oci/registry-patch.yaml. The flags after `--` go to every
# `devicelet module push` (--registry-auth config.json, --registry-ca FILE,
# --insecure-registry HOST:PORT). DEVICELET and MODULE_DIR name the agent and the built modules
# (default: the release builds, made here when missing).
set -euo pipefail
cd "$(dirname "$0")/.."

registry=${1:?usage: scripts/oci-modules.sh REGISTRY [OUT] [-- devicelet flags...]}
shift
out=deploy/oci/registry-patch.yaml
if [ $# -gt 0 ] && [ "$1" != "--" ]; then
  out=$1
  shift
fi
[ "${1:-}" = "--" ] && shift
flags=("$@")

devicelet=${DEVICELET:-target/release/devicelet}
modules=${MODULE_DIR:-target/wasm32-wasip2/release}
if [ -z "${DEVICELET:-}" ] && [ ! -x "$devicelet" ]; then
  cargo build --release -p devicelet
fi
if [ -z "${MODULE_DIR:-}" ] && [ ! -f "$modules/nvidia_gpu.wasm" ]; then
  rustup target add wasm32-wasip2
  cargo build --release --target wasm32-wasip2 -p generic-dev -p amd-gpu -p nvidia-gpu -p vfio-pci
fi
version=$(sed -n '/^\[workspace.package\]/,/^\[/ s/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)

# The base registry, as the file the agent reads (the ConfigMap's block, unindented).
registry_toml=$(awk '/^  registry.toml: \|/ {on=1; next} on {sub(/^    /, ""); print}' deploy/base/configmap.yaml)

# Each module the base serves from the image, pushed, and its line replaced.
while read -r name; do
  file="$modules/${name//-/_}.wasm"
  [ -f "$file" ] || { echo "no $file: build the reference modules first" >&2; exit 1; }
  line=$("$devicelet" module push "$file" "oci://$registry/devicelet/$name:$version" "${flags[@]}" --log warn |
    sed -n 's/^registry line: //p')
  [ -n "$line" ] || { echo "pushing $file printed no registry line" >&2; exit 1; }
  registry_toml=$(printf '%s\n' "$registry_toml" |
    sed "s|^path = \"/opt/devicelet/modules/$name.wasm\"|$line|")
done < <(printf '%s\n' "$registry_toml" | sed -n 's|^path = "/opt/devicelet/modules/\(.*\)\.wasm"|\1|p')

{
  cat <<EOF
# JSON patch (RFC 6902) over the registry ConfigMap: deploy/base's registry (read its
# comments), with every module the image carries served from a registry by digest instead.
# Written by \`scripts/oci-modules.sh REGISTRY\`: the digests are those of the reference modules
# of the build it ran on, as it pushed them. Run it against your registry to push yours and
# rewrite this file with their digests.
# Add \`verify-key = "/etc/devicelet/keys/vendor.pub"\` to an entry to require its vendor's
# signature (mount the key, e.g. from a ConfigMap, at that path).
- op: replace
  path: /data/registry.toml
  value: |
EOF
  printf '%s\n' "$registry_toml" | sed 's/^\(.\)/    \1/'
} >"$out"
echo "wrote $out"
