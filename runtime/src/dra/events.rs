//! What DRA drivers report as they work, for the agent's metrics. Counted by the agent, not the
//! driver, so the figures outlive a driver's restart on an upgrade; the front end names no
//! metrics type.

use std::sync::Arc;
use std::time::Duration;

/// One thing a driver did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DraEvent {
    /// A claim answered in a NodePrepareResources call (`ok`: without an error), and how long
    /// it took, waiting for its lock included.
    Prepared { ok: bool, took: Duration },
    /// A claim answered in a NodeUnprepareResources call.
    Unprepared { ok: bool, took: Duration },
    /// ResourceSlices created, replaced or deleted by one sync.
    SliceWrites(u64),
    /// A request to the API server failed (unreachable, refused, conflict).
    ApiError,
}

type Sink = Arc<dyn Fn(&str, DraEvent) + Send + Sync>;

/// Where a driver's events go; the default drops them.
#[derive(Clone, Default)]
pub struct DraEvents(Option<Sink>);

impl DraEvents {
    pub fn new(sink: impl Fn(&str, DraEvent) + Send + Sync + 'static) -> DraEvents {
        DraEvents(Some(Arc::new(sink)))
    }

    /// `driver` did `event`.
    pub fn emit(&self, driver: &str, event: DraEvent) {
        if let Some(sink) = &self.0 {
            sink(driver, event);
        }
    }
}

impl std::fmt::Debug for DraEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "DraEvents(counted)"
        } else {
            "DraEvents(dropped)"
        })
    }
}
