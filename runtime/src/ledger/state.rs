//! The ledger's in-memory state and the queries on it; no I/O here.

use std::collections::BTreeMap;
use std::time::SystemTime;

use super::claims::Claims;
use super::entry::{Entry, Holder, truncate_to_millis};

/// Everything the checkpoint holds besides its version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct State {
    /// The id the next entry gets; always greater than every id in `entries`.
    pub next_id: u64,
    /// In increasing id order: the device-plugin front end's containers.
    pub entries: Vec<Entry>,
    /// DRA claims, by UID.
    pub claims: Claims,
}

impl Default for State {
    fn default() -> Self {
        State {
            next_id: 1,
            entries: Vec::new(),
            claims: Claims::default(),
        }
    }
}

impl State {
    /// Appends an entry made `now` and returns its id.
    pub fn push(
        &mut self,
        resource: &str,
        device_ids: Vec<String>,
        holder: Option<Holder>,
        now: SystemTime,
    ) -> u64 {
        let id = self.next_id;
        // `check` refuses `u64::MAX` on load, so this cannot overflow in practice.
        self.next_id = self.next_id.saturating_add(1);
        self.entries.push(Entry {
            id,
            resource: resource.to_owned(),
            device_ids,
            allocated_at: truncate_to_millis(now),
            holder,
        });
        id
    }

    /// Takes `device_ids` out of the older entries of `resource`, dropping those left empty: the
    /// kubelet only allocates a device nobody holds (a finished init container's devices are
    /// reused by the next container), so a new allocation is the device's newest word and the
    /// ledger holds at most one entry per device, however many pods came and went unreported.
    pub fn supersede(&mut self, resource: &str, device_ids: &[String]) {
        for entry in self.entries.iter_mut().filter(|e| e.resource == resource) {
            entry.device_ids.retain(|id| !device_ids.contains(id));
        }
        self.entries
            .retain(|e| e.resource != resource || !e.device_ids.is_empty());
    }

    /// Drops entries until at most `keep` remain: the oldest without a holder first, then the
    /// oldest. Returns how many went.
    pub fn make_room(&mut self, keep: usize) -> u64 {
        let mut dropped = 0;
        while self.entries.len() > keep {
            let oldest = self
                .entries
                .iter()
                .position(|e| e.holder.is_none())
                .unwrap_or(0);
            self.entries.remove(oldest);
            dropped += 1;
        }
        dropped
    }

    /// One row per device id of `resource`, sorted by id. A device named by several entries (a
    /// stale entry not yet reconciled, or one reused from an init container) is reported with
    /// the holder of the newest entry, which is the kubelet's latest word on it.
    pub fn holders(&self, resource: &str) -> Vec<(String, Option<Holder>)> {
        let mut rows: BTreeMap<&str, Option<&Holder>> = BTreeMap::new();
        for entry in self.entries.iter().filter(|e| e.resource == resource) {
            for id in &entry.device_ids {
                // Entries are in increasing id order: later ones overwrite earlier ones.
                rows.insert(id, entry.holder.as_ref());
            }
        }
        rows.into_iter()
            .map(|(id, h)| (id.to_owned(), h.cloned()))
            .collect()
    }

    /// Why a restored state cannot be trusted, if it cannot.
    pub fn check(&self) -> Result<(), String> {
        if self.next_id == 0 || self.next_id == u64::MAX {
            return Err(format!("next_id {} out of range", self.next_id));
        }
        let mut last = 0;
        for entry in &self.entries {
            if entry.id == 0 || entry.id <= last {
                return Err(format!(
                    "entry ids not strictly increasing at id {}",
                    entry.id
                ));
            }
            if entry.id >= self.next_id {
                return Err(format!(
                    "entry id {} not below next_id {}",
                    entry.id, self.next_id
                ));
            }
            last = entry.id;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(pod: &str) -> Holder {
        Holder::container("ns", pod, "c")
    }

    #[test]
    fn holders_lists_each_device_once_newest_entry_wins() {
        let mut s = State::default();
        let now = SystemTime::now();
        s.push("r", vec!["b".into(), "a".into()], Some(holder("old")), now);
        s.push("other", vec!["a".into()], Some(holder("x")), now);
        s.push("r", vec!["b".into()], None, now);
        assert_eq!(
            s.holders("r"),
            vec![
                ("a".to_owned(), Some(holder("old"))),
                ("b".to_owned(), None)
            ]
        );
        assert_eq!(
            s.holders("other"),
            vec![("a".to_owned(), Some(holder("x")))]
        );
        assert!(s.holders("none").is_empty());
    }

    #[test]
    fn a_new_allocation_takes_its_devices_out_of_older_entries() {
        let mut s = State::default();
        let now = SystemTime::now();
        s.push("r", vec!["a".into(), "b".into()], Some(holder("init")), now);
        s.push("other", vec!["a".into()], None, now);
        s.push("r", vec!["c".into()], None, now);
        s.supersede("r", &["a".into(), "c".into()]);
        s.push("r", vec!["a".into(), "c".into()], Some(holder("app")), now);
        let left: Vec<_> = s
            .entries
            .iter()
            .map(|e| (e.resource.as_str(), e.device_ids.join(",")))
            .collect();
        assert_eq!(
            left,
            [
                ("r", "b".into()),
                ("other", "a".into()),
                ("r", "a,c".into())
            ]
        );
        assert_eq!(s.check(), Ok(()));
    }

    #[test]
    fn check_refuses_inconsistent_ids() {
        let mut s = State::default();
        s.push("r", vec!["a".into()], None, SystemTime::now());
        s.push("r", vec!["b".into()], None, SystemTime::now());
        assert_eq!(s.check(), Ok(()));
        let mut bad = s.clone();
        bad.next_id = 2;
        assert!(bad.check().is_err());
        let mut bad = s.clone();
        bad.entries.swap(0, 1);
        assert!(bad.check().is_err());
        let mut bad = s;
        bad.next_id = u64::MAX;
        assert!(bad.check().is_err());
    }
}
