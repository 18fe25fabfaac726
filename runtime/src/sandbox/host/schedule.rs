//! `devicelet:plugin/schedule`: a module asking for its next health check sooner than the
//! interval, because it knows something changes then (a GPU's quiet period ends).

use std::time::Duration;

use wasmtime::component::{HasSelf, Linker};

use crate::sandbox::bindings::v0_1::devicelet::plugin::schedule::{self, Host};

/// Shortest recheck a module may ask for: a module asking for 0 must not make the host spin.
pub const MIN_RECHECK: Duration = Duration::from_millis(10);

/// The recheck asked for during the current call, if any.
#[derive(Default)]
pub struct Schedule {
    asked: Option<Duration>,
}

impl Schedule {
    /// Always linked: it touches nothing but this field.
    pub fn add_to_linker<T: Send + 'static>(
        linker: &mut Linker<T>,
        view: fn(&mut T) -> &mut Schedule,
    ) -> wasmtime::Result<()> {
        // Under every line's name: the interface is the same in each.
        for name in crate::sandbox::bindings::imports::host_names("schedule") {
            schedule::add_to_linker_instance::<T, HasSelf<Schedule>>(
                &mut linker.instance(&name)?,
                view,
            )?;
        }
        Ok(())
    }

    /// What the call just made asked for (once).
    pub fn take(&mut self) -> Option<Duration> {
        self.asked.take()
    }
}

impl Host for Schedule {
    fn recheck_after(&mut self, ms: u64) {
        let asked = Duration::from_millis(ms).max(MIN_RECHECK);
        self.asked = Some(self.asked.map_or(asked, |earlier| earlier.min(asked)));
    }
}
