#!/usr/bin/env bash
# A local OCI registry for trying `devicelet module push` and OCI sources: Debian's
# docker-registry, plain HTTP on ADDR (default 127.0.0.1:5000), its data in DIR (default
# ./local-registry), in the foreground until Ctrl-C. Installs docker-registry when missing
# (apt-get; run as root). Reach it with `--insecure-registry ADDR`, since it has no TLS.
#
#   scripts/local-registry.sh [ADDR] [DIR]
set -euo pipefail

addr="${1:-127.0.0.1:5000}"
dir="$(mkdir -p "${2:-local-registry}" && cd "${2:-local-registry}" && pwd)"

if ! command -v docker-registry >/dev/null; then
  echo "installing Debian's docker-registry" >&2
  apt-get install -y -q docker-registry >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q docker-registry >/dev/null; }
fi

# docker-registry reads everything from a config file; this is the least it needs.
cat > "$dir/config.yml" <<CONFIG
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $dir/data
http:
  addr: $addr
CONFIG

cat >&2 <<SAID
registry on http://$addr (data in $dir/data); try, in another shell:
  devicelet module push target/wasm32-wasip2/release/generic_dev.wasm oci://$addr/devicelet/generic-dev:0.1.0 --insecure-registry $addr
  devicelet module inspect oci://$addr/devicelet/generic-dev:0.1.0 --insecure-registry $addr
SAID
exec docker-registry serve "$dir/config.yml"
