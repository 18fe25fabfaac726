//! Defaults and bounds for the registry's settings. They are public so that the CLI, the loader
//! and the documentation can quote the same numbers the validator enforces.

use std::time::Duration;

/// Read sysfs and /dev from the real root unless a fixture tree is named.
pub const DEFAULT_HOST_ROOT: &str = "/";

/// Domain given to resource names that a module states as a bare suffix (`fuse` becomes
/// `devicelet.io/fuse`): the kubelet only accepts extended resources with a domain.
pub const DEFAULT_RESOURCE_DOMAIN: &str = "devicelet.io";

/// Most modules one registry may list. A node has a handful of device types; every module costs
/// threads (its cells), address-space reservations and a socket per resource, so thousands of
/// them would exhaust the agent (9,000 aborted it, leaving sockets behind) before serving.
pub const MAX_MODULES: usize = 64;
/// Most resources one module may declare; a real one declares a handful.
pub const MAX_RESOURCES_PER_MODULE: usize = 64;
/// Most resources the agent serves in all, whatever the modules declare: each is a socket, a
/// server and a registration with the kubelet.
pub const MAX_RESOURCES: usize = 256;

/// How often a module is asked for device health when the registry does not say.
pub const DEFAULT_HEALTH_INTERVAL: Duration = Duration::from_secs(5);
/// Polling faster than this costs more CPU than any device state changes warrant.
pub const HEALTH_INTERVAL_MIN: Duration = Duration::from_millis(100);
/// Slower than this and the kubelet would keep scheduling onto devices long dead.
pub const HEALTH_INTERVAL_MAX: Duration = Duration::from_secs(60 * 60);

/// How long one call into a module may run when the registry does not say.
pub const DEFAULT_CALL_DEADLINE: Duration = Duration::from_secs(2);
/// A deadline below a millisecond cannot be enforced meaningfully by epoch interruption.
pub const CALL_DEADLINE_MIN: Duration = Duration::from_millis(1);
/// The kubelet gives `PreStartContainer` 30s in all (`KubeletPreStartContainerRPCTimeoutInSecs`).
/// A kubelet call may wait one deadline to start, may need a fresh instance (whose `init` gets
/// one deadline) and then runs for one: three deadlines must fit inside those 30s.
pub const CALL_DEADLINE_MAX: Duration = Duration::from_secs(10);
/// Health work (`enumerate`) is not on the kubelet's path, so it may take longer.
pub const HEALTH_DEADLINE_MAX: Duration = Duration::from_secs(60);

/// Linear memory a module may grow to when the registry does not say.
pub const DEFAULT_MEMORY_LIMIT: u64 = 64 * 1024 * 1024;
/// Below a mebibyte even a trivial component cannot instantiate (one wasm page is 64KiB and the
/// guest's allocator and stack need several).
pub const MEMORY_LIMIT_MIN: u64 = 1024 * 1024;
/// A device plugin has no business holding more than this on a node that runs workloads; it is
/// also the most a 32-bit wasm memory can address.
pub const MEMORY_LIMIT_MAX: u64 = 4 * 1024 * 1024 * 1024;

/// What the host may keep of one module's answers (device snapshots with their attributes) when
/// the registry does not say. A real module's snapshots are kilobytes.
pub const DEFAULT_HOST_MEMORY: u64 = 16 * 1024 * 1024;
/// Below this a module with a few hundred devices could not be served.
pub const HOST_MEMORY_MIN: u64 = 64 * 1024;
/// The agent serves every device type of the node: no single module may hold more of it.
pub const HOST_MEMORY_MAX: u64 = 256 * 1024 * 1024;
