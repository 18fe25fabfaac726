//! What one module's store holds: its limits, its WASI context, and one state per host interface.
//! Each interface sees only its own state (the linker hands it `&mut` that field, as
//! wasmtime-wasi-config does), so `sysfs` cannot reach the NVML handle or the /dev grants.

use std::path::PathBuf;
use std::sync::Arc;

use wasmtime::StoreLimits;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::config::Grants;

/// WASI handles (streams, pollables) one instance may hold at once; the table lives outside the
/// module's linear memory, so it is capped here. Rust's std needs a handful.
const MAX_HANDLES: usize = 1024;

pub struct HostState {
    pub(crate) limits: StoreLimits,
    pub(crate) log: super::log::Log,
    pub(crate) sysfs: super::sysfs::Sysfs,
    pub(crate) devnodes: super::devnodes::Devnodes,
    pub(crate) nvml: super::nvml::Nvml,
    pub(crate) schedule: super::schedule::Schedule,
    wasi: WasiCtx,
    table: ResourceTable,
}

impl HostState {
    /// A module gets WASI with no preopened directories, no sockets and no environment: only
    /// what Rust's std needs to start. Its stdout and stderr become rate-limited log lines.
    pub fn new(
        module: Arc<str>,
        host_root: Arc<PathBuf>,
        grants: Arc<Grants>,
        limits: StoreLimits,
        output: Arc<super::output::OutputAllowance>,
        nvml: Option<Arc<crate::nvml::NvmlNode>>,
    ) -> Self {
        let (stdout, stderr) = super::output::ModuleOutput::pair(module.clone(), output);
        let log_gate = stdout.clone();
        let mut wasi = WasiCtx::builder();
        wasi.stdout(stdout)
            .stderr(stderr)
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false);
        HostState {
            limits,
            // The `log` interface shares the stdout/stderr allowance.
            log: super::log::Log::new(module, log_gate),
            sysfs: super::sysfs::Sysfs::new(host_root.clone(), grants.sysfs.clone()),
            devnodes: super::devnodes::Devnodes::new(host_root.clone(), grants.dev.clone()),
            nvml: super::nvml::Nvml::new(
                host_root,
                nvml,
                grants.has_library(crate::config::NVML_MIG),
            ),
            schedule: super::schedule::Schedule::default(),
            wasi: wasi.build(),
            table: {
                let mut table = ResourceTable::new();
                table.set_max_capacity(MAX_HANDLES);
                table
            },
        }
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}
