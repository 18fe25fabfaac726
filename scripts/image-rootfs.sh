#!/usr/bin/env bash
# Assembles the container image's file tree, for the Dockerfile's build stage and for
# `scripts/image.sh --prebuilt`:
#
#   scripts/image-rootfs.sh BINARY MODULE_DIR OUT_DIR
#
# BINARY     the node agent (cargo's target/<profile>/devicelet-node), installed as devicelet
# MODULE_DIR cargo's wasm32-wasip2 output (target/wasm32-wasip2/release): generic_dev.wasm,
#            amd_gpu.wasm, nvidia_gpu.wasm, vfio_pci.wasm
# OUT_DIR    the tree to write; replaced if it holds a tree this script wrote before
#
# The tree: /usr/bin/devicelet; the glibc it links, at the paths the dynamic loader found them
# (real files, no symlinks; the loader itself at exactly the path the binary's PT_INTERP names);
# the glibc libraries NVIDIA's libnvidia-ml.so.1 links (libdl, libpthread, librt, libm), since the
# agent dlopens the host's NVML at run time; the reference modules in /opt/devicelet/modules/
# (named with hyphens, as the registry names them), and compiled ahead of time by the binary
# itself in /opt/devicelet/precompiled/ (`devicelet precompile`, the directory `run` looks in by
# default), so a new node's first start compiles none of them; an empty /tmp (1777) and
# /etc/devicelet/.
# With SOURCE_DATE_EPOCH set, every file gets that time, for reproducible layers.
set -euo pipefail
umask 022

die() {
    echo "image-rootfs.sh: $*" >&2
    exit 1
}

if [[ $# -ne 3 ]]; then
    echo "usage: $0 BINARY MODULE_DIR OUT_DIR" >&2
    exit 2
fi
binary=$1 module_dir=$2 out=$3
modules=(generic-dev amd-gpu nvidia-gpu vfio-pci)
# The glibc libraries libnvidia-ml.so.1 lists as NEEDED besides libc itself.
nvml_needs=(libdl.so.2 libpthread.so.0 librt.so.1 libm.so.6)

[[ -f $binary && -x $binary ]] ||
    die "no agent binary at '$binary' (build it first: cargo build --release -p devicelet --bin devicelet-node)"
for m in "${modules[@]}"; do
    [[ -f $module_dir/${m//-/_}.wasm ]] ||
        die "module '$m' missing: no '${m//-/_}.wasm' in '$module_dir' (build the modules first: cargo build --release --target wasm32-wasip2 -p generic-dev -p amd-gpu -p nvidia-gpu -p vfio-pci)"
done
command -v readelf >/dev/null || die "readelf not found (it comes with binutils, beside the linker)"

# The loader the binary asks for, exactly as PT_INTERP names it.
interp=$(readelf --program-headers --wide "$binary" |
    sed -n 's/.*\[Requesting program interpreter: \(.*\)\]$/\1/p')
[[ -n $interp ]] || die "'$binary' names no program interpreter: not a dynamically linked ELF binary"
[[ -x $interp ]] || die "the loader '$interp' that '$binary' asks for is not on this machine"

# What the loader resolves, transitively (what ldd prints): "name => /path (0x...)".
listing=$("$interp" --list "$binary") || die "the loader '$interp' could not list the libraries of '$binary'"
if grep -q 'not found' <<<"$listing"; then
    die "libraries of '$binary' not found on this machine:"$'\n'"$(grep 'not found' <<<"$listing")"
fi
mapfile -t libs < <(sed -n 's/^[[:space:]]*[^[:space:]]* => \(\/[^ ]*\) (0x[0-9a-f]*)$/\1/p' <<<"$listing" |
    grep -vxF -- "$interp")

# Every library the binary names (ELF NEEDED) must be among them, or be the loader itself.
mapfile -t needed < <(readelf --dynamic --wide "$binary" | sed -n 's/.*(NEEDED).*\[\(.*\)\]$/\1/p')
for lib in "${needed[@]}"; do
    [[ $lib == "${interp##*/}" ]] || printf '%s\n' "${libs[@]}" | grep -q "/$lib\$" ||
        die "'$binary' needs '$lib', which the loader did not resolve:"$'\n'"$listing"
done

# NVML's glibc libraries live beside libc.
libc=$(printf '%s\n' "${libs[@]}" | grep '/libc\.so\.6$' || true)
[[ -n $libc ]] || die "'$binary' does not link glibc's libc.so.6: the image must be glibc-based (NVML is a glibc library)"
libdir=$(dirname "$libc")
for lib in "${nvml_needs[@]}"; do
    [[ -e $libdir/$lib ]] || die "'$libdir/$lib' missing: the host's libnvidia-ml.so.1 needs it"
    printf '%s\n' "${libs[@]}" | grep -qx "$libdir/$lib" || libs+=("$libdir/$lib")
done

# The image has no ld.so.cache: the loader finds libraries only in its built-in directories.
search=$("$interp" --help 2>/dev/null | sed -n 's/^[[:space:]]*\(\/[^ ]*\) (system search path)$/\1/p')
if [[ -z $search ]]; then
    echo "image-rootfs.sh: warning: '$interp --help' lists no system search path; not checking library directories" >&2
else
    for lib in "${libs[@]}"; do
        grep -qx "$(dirname "$lib")" <<<"$search" ||
            die "'$lib' lies outside the loader's default directories (${search//$'\n'/ }); the image has no ld.so.cache to find it"
    done
fi

# Replace OUT_DIR only if it is empty or a tree from an earlier run.
if [[ -e $out ]]; then
    [[ -d $out ]] || die "'$out' exists and is not a directory"
    if [[ -n $(ls -A "$out") && ! -f $out/usr/bin/devicelet ]]; then
        die "'$out' is not empty and holds no earlier image tree; not removing it"
    fi
    rm -rf -- "$out"
fi
mkdir -p -- "$out"

install -D -m 0755 -- "$binary" "$out/usr/bin/devicelet"
install -D -m 0755 -- "$(readlink -f -- "$interp")" "$out$interp"
for lib in "${libs[@]}"; do
    install -D -m 0644 -- "$(readlink -f -- "$lib")" "$out$lib"
done
for m in "${modules[@]}"; do
    install -D -m 0644 -- "$module_dir/${m//-/_}.wasm" "$out/opt/devicelet/modules/$m.wasm"
done
# Compiled by this very binary, for its wasmtime and this machine's CPU features: a node whose
# CPU offers other features finds no entry for its own and compiles, as without them.
wasm=()
for m in "${modules[@]}"; do
    wasm+=("$out/opt/devicelet/modules/$m.wasm")
done
"$binary" precompile --out "$out/opt/devicelet/precompiled" "${wasm[@]}" >/dev/null ||
    die "'$binary' could not precompile the modules"
install -d -m 1777 -- "$out/tmp"
install -d -m 0755 -- "$out/etc/devicelet"

if [[ -n ${SOURCE_DATE_EPOCH:-} ]]; then
    find "$out" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
fi

echo "image-rootfs.sh: $out: /usr/bin/devicelet, $interp, ${#libs[@]} libraries, ${#modules[@]} modules (precompiled)"
