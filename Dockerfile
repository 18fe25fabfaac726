# The devicelet image: the agent, the glibc it links and the reference modules, on nothing else.
#
#   scripts/image.sh               builds the default target, `runtime`, here (context: the repo)
#   scripts/image.sh --prebuilt    builds target `prebuilt` from a tree assembled on the host
#                                  (context: target/image, holding rootfs/); no builder image
#
# Podman/buildah and BuildKit build only the stages the target needs: `--target prebuilt` never
# pulls the Rust image.

# --- build: the agent and the modules, then the image's file tree in /rootfs ---------------------
# Pinned to the workspace's toolchain (rust-version in Cargo.toml) and Debian release; the image's
# glibc is this image's.
FROM docker.io/library/rust:1.95.0-slim-bookworm AS build
RUN rustup target add wasm32-wasip2
WORKDIR /src
COPY . .
# The node agent alone (`devicelet-node`: no simulator, fixtures, `try`, `demo` or `simulate`),
# installed as /usr/bin/devicelet. `-p devicelet`: features resolve over the agent's own
# dependencies, not over every workspace member (the tests' CDI checker would add an HTTP client
# and a second TLS provider, aws-lc-rs, that the agent has no use for).
RUN cargo build --release --locked -p devicelet --bin devicelet-node \
 && cargo build --release --locked --target wasm32-wasip2 -p generic-dev -p amd-gpu -p nvidia-gpu -p vfio-pci
RUN scripts/image-rootfs.sh target/release/devicelet-node target/wasm32-wasip2/release /rootfs

# --- base: what both final stages say about themselves -------------------------------------------
FROM scratch AS base
# image.sh passes Cargo.toml's workspace version; "dev" marks an image built without it.
ARG VERSION=dev
LABEL org.opencontainers.image.title="devicelet" \
      org.opencontainers.image.description="Kubernetes device-plugin node agent running vendor WebAssembly modules" \
      org.opencontainers.image.source="https://github.com/devicelet/devicelet" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# Runs as root: it creates and removes sockets in the kubelet's device-plugin directory
# (/var/lib/kubelet/device-plugins, root-owned on the host), writes CDI specs in /var/run/cdi and
# reads the granted /sys and /dev trees.
USER 0:0
# When a module is granted NVML the agent dlopens the host's libnvidia-ml.so.1, mounted from the
# host beside the image's libraries, never over them (deploy/nvidia: --nvml-library
# /host/nvidia-lib/libnvidia-ml.so.1); it links against the image's glibc, which is why the image
# carries libdl, libpthread, librt and libm too.
ENTRYPOINT ["/usr/bin/devicelet", "run"]
# The registry ConfigMap is mounted here; the reference modules are in /opt/devicelet/modules/.
CMD ["--config", "/etc/devicelet/registry.toml"]

# --- prebuilt: the same tree, assembled on the host by scripts/image-rootfs.sh -------------------
# For machines that cannot pull the builder image; its context is a directory holding rootfs/.
FROM base AS prebuilt
COPY rootfs/ /

# --- runtime (the default): the tree the build stage assembled ------------------------------------
FROM base AS runtime
COPY --from=build /rootfs/ /
