//! `devicelet:plugin/log`: a module's log lines become tracing events tagged with its name,
//! under the same rate limit as its stdout and stderr.

use std::sync::Arc;

use wasmtime::component::{HasSelf, Linker};

use super::output::ModuleOutput;
use crate::sandbox::bindings::v0_1::devicelet::plugin::log::{self, Host, Level};

/// Longest log line kept; the rest is cut so a module cannot flood the agent's log.
const MAX_LINE: usize = 4096;

/// What `log` sees: the module's name and its output allowance.
pub struct Log {
    module: Arc<str>,
    gate: ModuleOutput,
}

impl Log {
    pub(super) fn new(module: Arc<str>, gate: ModuleOutput) -> Self {
        Log { module, gate }
    }

    /// Always linked: every module may log.
    pub fn add_to_linker<T: Send + 'static>(
        linker: &mut Linker<T>,
        view: fn(&mut T) -> &mut Log,
    ) -> wasmtime::Result<()> {
        // Under every line's name: the interface is the same in each.
        for name in crate::sandbox::bindings::imports::host_names("log") {
            log::add_to_linker_instance::<T, HasSelf<Log>>(&mut linker.instance(&name)?, view)?;
        }
        Ok(())
    }
}

impl Host for Log {
    fn log(&mut self, level: Level, message: String) {
        if !self.gate.admit() {
            return;
        }
        let mut message = message;
        if message.len() > MAX_LINE {
            let mut cut = MAX_LINE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push('…');
        }
        let module = &*self.module;
        let message = super::output::escape(&message);
        match level {
            Level::Trace => tracing::trace!(module, "{message}"),
            Level::Debug => tracing::debug!(module, "{message}"),
            Level::Info => tracing::info!(module, "{message}"),
            Level::Warn => tracing::warn!(module, "{message}"),
            Level::Error => tracing::error!(module, "{message}"),
        }
    }
}
