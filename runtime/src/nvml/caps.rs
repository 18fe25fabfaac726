//! The driver's table of MIG capability minors, `/proc/driver/nvidia-caps/mig-minors`: which
//! `/dev/nvidia-caps/nvidia-cap<minor>` node grants access to which GPU or compute instance.
//! NVML does not report these; a container using a MIG device needs both of its nodes.

use std::collections::HashMap;
use std::path::Path;

/// Where the table lives, below the host root.
pub const MIG_MINORS: &str = "proc/driver/nvidia-caps/mig-minors";
/// A real table has a few hundred lines; anything far larger is not the driver's.
const MAX_BYTES: u64 = 1 << 20;

#[derive(Debug, Default)]
pub struct MigMinors(HashMap<String, u32>);

impl MigMinors {
    /// Reads the table under `host_root`; an absent or unreadable table is empty (a driver
    /// without MIG support has none).
    pub fn read(host_root: &Path) -> MigMinors {
        match crate::files::read_regular(&host_root.join(MIG_MINORS), MAX_BYTES) {
            Ok(bytes) => MigMinors::parse(&String::from_utf8_lossy(&bytes)),
            Err(_) => MigMinors::default(),
        }
    }

    fn parse(text: &str) -> MigMinors {
        MigMinors(
            text.lines()
                .filter_map(|line| {
                    let (name, minor) = line.trim().split_once(char::is_whitespace)?;
                    Some((name.to_owned(), minor.trim().parse().ok()?))
                })
                .collect(),
        )
    }

    /// The minors for GPU instance `gi` and its compute instance `ci` on the GPU whose device
    /// node is `/dev/nvidia<gpu_minor>`, those the table has.
    pub fn for_instance(&self, gpu_minor: u32, gi: u32, ci: u32) -> Vec<u32> {
        [
            format!("gpu{gpu_minor}/gi{gi}/access"),
            format!("gpu{gpu_minor}/gi{gi}/ci{ci}/access"),
        ]
        .iter()
        .filter_map(|name| self.0.get(name).copied())
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_compute_instance_needs_its_gpu_instance_and_its_own_minor() {
        let table = MigMinors::parse(
            "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n\
             gpu1/gi1/access 147\ngpu1/gi1/ci0/access 148\ngarbage\n",
        );
        assert_eq!(table.for_instance(0, 1, 0), vec![12, 13]);
        assert_eq!(table.for_instance(1, 1, 0), vec![147, 148]);
        assert!(table.for_instance(2, 1, 0).is_empty());
    }
}
