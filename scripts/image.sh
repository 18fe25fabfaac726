#!/usr/bin/env bash
# Builds the devicelet container image from the Dockerfile, with the first container engine that
# works here: podman, then buildah, then docker (only when its daemon answers `docker info`).
#
# Without --prebuilt the engine does everything (target `runtime`: it pulls the pinned Rust image
# and builds inside it). With --prebuilt, cargo builds the agent and the modules on this machine,
# scripts/image-rootfs.sh assembles the image's tree in target/image/rootfs, and the engine builds
# target `prebuilt` from target/image: nothing is pulled.
#
# Exit status: 0 built; 1 a build failed; 2 a usage error, or no usable container engine.
set -euo pipefail

# Only bash builtins until an engine is found: a machine without one gets the clear message below.
usage() {
    printf '%s\n' \
        "usage: scripts/image.sh [--engine podman|buildah|docker] [--tag NAME:TAG]" \
        "                        [--prebuilt [--profile release|debug]]" \
        "" \
        "  --engine E     use E (default: the first that works of podman, buildah, docker)" \
        "  --tag T        the image's name (default: devicelet:<workspace version>)" \
        "  --prebuilt     build the agent and the modules here with cargo, assemble the tree in" \
        "                 target/image/rootfs and build the Dockerfile's 'prebuilt' target from it" \
        "                 (no builder image is pulled)" \
        "  --profile P    the agent's cargo profile for --prebuilt: release (default) or debug" \
        "                 (the modules are always release)" \
        "  -h, --help     this text" \
        "" \
        "With SOURCE_DATE_EPOCH set, file times and the image's creation time are that time."
}

fail() {
    echo "image.sh: $*" >&2
    exit 2
}

if [[ $0 == */* ]]; then cd "${0%/*}/.."; else cd ..; fi

engine='' tag='' prebuilt=false profile=''
while [[ $# -gt 0 ]]; do
    case $1 in
    --engine | --tag | --profile)
        [[ $# -ge 2 ]] || fail "$1 needs a value"
        printf -v "${1#--}" '%s' "$2"
        shift
        ;;
    --engine=* | --tag=* | --profile=*)
        option=${1%%=*}
        printf -v "${option#--}" '%s' "${1#*=}"
        ;;
    --prebuilt) prebuilt=true ;;
    -h | --help) usage && exit 0 ;;
    *) usage >&2 && fail "unknown argument '$1'" ;;
    esac
    shift
done
engine_choice=${engine:-}
engine=()
case $engine_choice in
'' | podman | buildah | docker) ;;
*) fail "--engine takes podman, buildah or docker, not '$engine_choice'" ;;
esac
case $profile in
'' | release | debug) ;;
*) fail "--profile takes release or debug, not '$profile'" ;;
esac
if [[ -n $profile && $prebuilt == false ]]; then
    fail "--profile applies only with --prebuilt (the full build is always release)"
fi
profile=${profile:-release}

version=
section=
while IFS= read -r line; do
    if [[ $line =~ ^\[([^]]*)\] ]]; then
        section=${BASH_REMATCH[1]}
    elif [[ $section == workspace.package && $line =~ ^version[[:space:]]*=[[:space:]]*\"([^\"]+)\" ]]; then
        version=${BASH_REMATCH[1]}
    fi
done <Cargo.toml
[[ -n $version ]] || fail "no version in Cargo.toml's [workspace.package]"
tag=${tag:-devicelet:$version}

# --- the engine -----------------------------------------------------------------------------------
# engine: the command with its global flags; why_<name>: why an engine is not usable.
first_line() { local l; IFS= read -r l <<<"$1" || true; echo "$l"; }

# podman and buildah share the store in /var/lib/containers (~/.local/share/containers rootless).
# Its configured driver (overlay where the kernel allows it) is used when it works; otherwise vfs,
# which needs no overlay mounts (nested containers, sandboxes without overlay support) at the cost
# of a full copy per layer. vfs is only the fallback: a store created with overlay refuses
# `--storage-driver vfs` ("database configuration mismatch"). The engine line printed at the end
# names the flags, for commands that inspect the image afterwards.
probe_store() { # podman|buildah
    local out vfs
    if out=$("$1" info 2>&1 >/dev/null); then
        engine=("$1")
    elif vfs=$("$1" --storage-driver vfs info 2>&1 >/dev/null); then
        engine=("$1" --storage-driver vfs)
    else
        printf -v "why_$1" '%s' "installed, but \`$1 info\` fails: $(first_line "$out"); with --storage-driver vfs: $(first_line "$vfs")"
        return 1
    fi
}
probe() { # podman|buildah|docker
    local out
    if ! command -v "$1" >/dev/null; then
        printf -v "why_$1" 'not installed'
        return 1
    fi
    case $1 in
    podman | buildah) probe_store "$1" ;;
    docker)
        if out=$(docker info 2>&1 >/dev/null); then
            engine=(docker)
        else
            printf -v "why_$1" '%s' "$(command -v docker) is installed, but \`docker info\` fails (no daemon running, or no access to its socket): $(first_line "$out")"
            return 1
        fi
        ;;
    esac
}

candidates=(podman buildah docker)
[[ -z $engine_choice ]] || candidates=("$engine_choice")
for c in "${candidates[@]}"; do
    probe "$c" && break
done
if [[ ${#engine[@]} -eq 0 ]]; then
    {
        if [[ -n $engine_choice ]]; then
            echo "image.sh: container engine '$engine_choice' is not usable:"
        else
            echo "image.sh: no usable container engine found (tried podman, buildah, docker):"
        fi
        for c in "${candidates[@]}"; do
            why=why_$c
            printf '  %-8s %s\n' "$c:" "${!why}"
        done
        echo "Install podman (Debian/Ubuntu: apt-get install podman; Fedora/RHEL: dnf install podman)"
        echo "or buildah, or start Docker's daemon; then run this again."
    } >&2
    exit 2
fi

# podman and buildah: isolation chroot. The build's RUN steps (rustup, cargo, the tree script)
# need no namespaces or cgroups of their own, and chroot needs no OCI runtime (runc or crun),
# which unprivileged CI containers and sandboxed machines may lack or not allow. No layer cache
# (--layers=false): buildah 1.28 (podman 4.3, Debian 12) reuses a cached step whatever the
# --build-arg values, which stamped an earlier build's version label on the image; and the
# cache would save little, the build's one costly step (cargo) redoes everything after any edit.
build=()
case ${engine[0]} in
podman) build=("${engine[@]}" build --layers=false --isolation "${BUILDAH_ISOLATION:-chroot}") ;;
buildah) build=("${engine[@]}" bud --layers=false --isolation "${BUILDAH_ISOLATION:-chroot}") ;;
docker) build=(docker build) ;;
esac
build+=(--file Dockerfile --tag "$tag" --build-arg "VERSION=$version")
if [[ -n ${SOURCE_DATE_EPOCH:-} ]]; then
    case ${engine[0]} in
    docker) build+=(--build-arg "SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH") ;;
    *) build+=(--timestamp "$SOURCE_DATE_EPOCH") ;;
    esac
fi

# --- the build ------------------------------------------------------------------------------------
# Any failure from here on exits 1, so that 2 always means "nothing to build with".
trap 'exit 1' ERR
if [[ $prebuilt == true ]]; then
    command -v cargo >/dev/null || fail "--prebuilt needs cargo (the Rust toolchain)"
    if command -v rustup >/dev/null; then
        rustup target add wasm32-wasip2
    else
        echo "image.sh: no rustup here; assuming the wasm32-wasip2 target is installed" >&2
    fi
    # The node agent alone, as the Dockerfile builds it: no simulator, fixtures, `try`, `demo` or
    # `simulate`. A release one exactly as the Dockerfile builds it (`-p devicelet`: features
    # resolved over the agent's own dependencies, the names runtime/startup-order.txt lists); a
    # debug one as tests/lib.rs builds it (`--bin` over the default members), so that it reuses
    # the tests' build.
    if [[ $profile == release ]]; then
        agent_flags=(--release -p devicelet)
    else
        agent_flags=()
    fi
    cargo build --locked "${agent_flags[@]}" --bin devicelet-node
    cargo build --locked --release --target wasm32-wasip2 -p generic-dev -p amd-gpu -p nvidia-gpu -p vfio-pci
    target_dir=$(cargo metadata --format-version 1 --no-deps --locked |
        sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
    [[ -n $target_dir ]] || fail "cargo metadata named no target directory"
    scripts/image-rootfs.sh "$target_dir/$profile/devicelet-node" "$target_dir/wasm32-wasip2/release" \
        "$target_dir/image/rootfs"
    "${build[@]}" --target prebuilt "$target_dir/image"
else
    "${build[@]}" --target runtime .
fi

# --- what was built -------------------------------------------------------------------------------
size=$("${engine[@]}" images --format '{{.Size}}' "$tag")
case ${engine[0]} in
buildah)
    # buildah 1.28's templates have no `json`: the arrays are spelled out (plain strings).
    # shellcheck disable=SC2016 # Go template variables, not the shell's
    list='[{{range $i, $a := .}}{{if $i}},{{end}}"{{$a}}"{{end}}]'
    config='{{with .OCIv1.Config}}{{with .Entrypoint}}'$list'{{end}} {{with .Cmd}}'$list'{{end}}{{end}}'
    entry=$("${engine[@]}" inspect --type image --format "$config" "$tag")
    ;;
*)
    entry=$("${engine[@]}" image inspect \
        --format '{{json .Config.Entrypoint}} {{json .Config.Cmd}}' "$tag")
    ;;
esac
echo
echo "built the devicelet image:"
echo "  tag:        $tag"
echo "  size:       $size"
echo "  entrypoint: $entry"
echo "  engine:     ${engine[*]}"
