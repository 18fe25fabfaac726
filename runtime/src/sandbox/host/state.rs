//! What one module's store holds: its identity, its grants, its WASI context and its limits.

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
    pub(crate) module: Arc<str>,
    pub(crate) host_root: Arc<PathBuf>,
    pub(crate) grants: Arc<Grants>,
    pub(crate) limits: StoreLimits,
    /// NVML, for a module granted it.
    pub(crate) nvml: Option<Arc<crate::nvml::NvmlNode>>,
    /// The `log` interface shares the stdout/stderr allowance.
    pub(super) log_gate: super::output::ModuleOutput,
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
        output: Arc<super::output::OutputBudget>,
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
            module,
            host_root,
            grants,
            limits,
            nvml,
            log_gate,
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
