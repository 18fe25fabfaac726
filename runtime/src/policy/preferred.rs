//! GetPreferredAllocation answered by the host, for any resource: every `must_include` device,
//! then the fewest NUMA nodes that can hold the rest, then `packed` or `distributed` among them.
//!
//! The kubelet's topology manager has already narrowed `available` to NUMA-aligned candidates (plus
//! devices reused from init containers, passed in `must_include`), but within a hint spanning
//! several nodes it takes whatever the plugin prefers, and without a preference it takes IDs in
//! order. So the answer keeps a container on as few NUMA nodes as it can; `packed` then fills the
//! nodes with the fewest free devices first (keeping whole nodes free for the next large request),
//! `distributed` spreads the devices over the chosen nodes. Unhealthy devices are never chosen
//! unless the kubelet must include them, and one never makes the answer fail for the others.
//!
//! The answer is advisory: the kubelet checks it and falls back to its own choice.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::device::{Device, Health};

/// How the host spreads a container's devices over the NUMA nodes it chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spread {
    /// Fill the node with the fewest free devices first.
    Packed,
    /// Take one device from each chosen node in turn, the node with the most free first.
    Distributed,
}

/// Most distinct NUMA nodes the subset search tells apart (2^12 subsets); nodes seen after the
/// first 11 share the last bit, so a device there still counts as one node more.
const MAX_NODES: usize = 12;

/// What a shared resource's answer takes into account: which physical device each replica ID
/// belongs to, and how many replicas of each are held already (from the ledger).
#[derive(Default)]
pub struct Usage<'a> {
    /// The physical device of an ID; None: every ID is its own device (not shared).
    pub physical: Option<fn(&str) -> &str>,
    /// Replicas held per physical device.
    pub in_use: HashMap<&'a str, usize>,
    /// A container gets one replica of a physical device at most (WIT 0.3
    /// `one-share-per-container`).
    pub one_per_device: bool,
}

impl Usage<'_> {
    fn physical<'b>(&self, id: &'b str) -> &'b str {
        self.physical.map_or(id, |f| f(id))
    }
}

/// `size` IDs: all of `must_include` first, then candidates from `available` chosen as the module
/// doc says. `snapshot` is the resource's current device list, sorted by ID. With replicas,
/// `packed` fills the replicas of the most used physical devices first and `distributed` takes
/// the least used ones, one replica per device while it can.
pub fn choose(
    snapshot: &[Device],
    available: &[String],
    must_include: &[String],
    size: usize,
    spread: Spread,
    usage: &Usage<'_>,
) -> Vec<String> {
    // The kubelet never asks for more than it offers; a caller that does gets what there is.
    let size = size.min(available.len().saturating_add(must_include.len()));
    let mut chosen: Vec<String> = Vec::with_capacity(size);
    let mut taken: HashSet<&str> = HashSet::new();
    for id in must_include {
        if chosen.len() < size && taken.insert(id) {
            chosen.push(id.clone());
        }
    }
    if chosen.len() == size {
        return chosen;
    }
    let need = size - chosen.len();
    let device = |id: &str| crate::resource::snapshot::find(snapshot, id);

    // Each NUMA node seen gets a bit; a device's mask is the nodes it sits on (0: none known).
    let mut bits: BTreeMap<i64, u32> = BTreeMap::new();
    let mut mask_of = |d: &Device| -> u64 {
        let mut mask = 0u64;
        for node in &d.numa_nodes {
            let next = bits.len() as u32;
            let bit = *bits.entry(*node).or_insert(next);
            mask |= 1 << bit.min(MAX_NODES as u32 - 1);
        }
        mask
    };
    let required: u64 = chosen
        .iter()
        .filter_map(|id| device(id))
        .fold(0, |m, d| m | mask_of(d));
    let mut candidates: Vec<(&Device, u64)> = Vec::new();
    for id in available {
        if !taken.insert(id) {
            continue;
        }
        if usage.one_per_device
            && chosen
                .iter()
                .any(|c| usage.physical(c) == usage.physical(id))
        {
            continue;
        }
        if let Some(d) = device(id).filter(|d| d.health == Health::Healthy) {
            candidates.push((d, mask_of(d)));
        }
    }
    let nodes = bits.len().min(MAX_NODES);

    let within = best_nodes(&candidates, required, need, nodes, spread);
    // Must-include replicas are held already (reused from an init container): the ledger's
    // usage counts them.
    let mut held: HashMap<String, usize> = HashMap::new();
    let pool: Vec<(&Device, u64)> = candidates
        .iter()
        .copied()
        .filter(|(_, m)| m & !within == 0)
        .collect();
    let picked = pick(pool, need, spread, usage, &mut held);
    chosen.extend(picked);
    if chosen.len() < size {
        // Not enough within any node set: the rest, in the same order, still beats failing.
        let rest: Vec<(&Device, u64)> = candidates
            .iter()
            .copied()
            .filter(|(d, _)| !chosen.contains(&d.id))
            .filter(|(d, _)| {
                !usage.one_per_device
                    || !chosen
                        .iter()
                        .any(|c| usage.physical(c) == usage.physical(&d.id))
            })
            .collect();
        let missing = size - chosen.len();
        chosen.extend(pick(rest, missing, spread, usage, &mut held));
    }
    chosen
}

/// The node set (as a mask) with the fewest nodes that includes `required` and holds `need`
/// candidates; among equals, the tightest fit when packing, the roomiest when distributing. All
/// nodes when none is big enough.
fn best_nodes(
    candidates: &[(&Device, u64)],
    required: u64,
    need: usize,
    nodes: usize,
    spread: Spread,
) -> u64 {
    let all = (1u64 << nodes) - 1;
    let mut per_mask: BTreeMap<u64, usize> = BTreeMap::new();
    for (_, m) in candidates {
        *per_mask.entry(*m).or_default() += 1;
    }
    let mut best: Option<(u32, usize, u64)> = None;
    for set in 0..=all {
        if set & required != required {
            continue;
        }
        let fits: usize = per_mask
            .iter()
            .filter(|(m, _)| *m & !set == 0)
            .map(|(_, n)| n)
            .sum();
        if fits < need {
            continue;
        }
        let rank = (set.count_ones(), fits, set);
        let better = match best {
            None => true,
            Some((count, best_fits, _)) => {
                rank.0 < count
                    || (rank.0 == count
                        && match spread {
                            Spread::Packed => fits < best_fits,
                            Spread::Distributed => fits > best_fits,
                        })
            }
        };
        if better {
            best = Some(rank);
        }
    }
    best.map_or(all, |(_, _, set)| set)
}

/// Takes `n` devices from `pool` one at a time, each the best by the policy given what was
/// taken so far (`held`: replicas per physical device, this request's included).
fn pick(
    mut pool: Vec<(&Device, u64)>,
    n: usize,
    spread: Spread,
    usage: &Usage<'_>,
    held: &mut HashMap<String, usize>,
) -> Vec<String> {
    let mut free: BTreeMap<u64, usize> = BTreeMap::new();
    for (_, m) in &pool {
        *free.entry(*m).or_default() += 1;
    }
    let mut taken_from: BTreeMap<u64, usize> = BTreeMap::new();
    let mut out = Vec::with_capacity(n);
    while out.len() < n && !pool.is_empty() {
        let used = |d: &Device| {
            let p = usage.physical(&d.id);
            usage.in_use.get(p).copied().unwrap_or(0) + held.get(p).copied().unwrap_or(0)
        };
        let best = match spread {
            // The node set with the fewest free first; within it, the most used device.
            Spread::Packed => pool
                .iter()
                .enumerate()
                .min_by(|(_, (a, am)), (_, (b, bm))| {
                    (
                        free[am],
                        am,
                        std::cmp::Reverse(used(a)),
                        usage.physical(&a.id),
                        &a.id,
                    )
                        .cmp(&(
                            free[bm],
                            bm,
                            std::cmp::Reverse(used(b)),
                            usage.physical(&b.id),
                            &b.id,
                        ))
                }),
            // The node set taken from least (the one with the most free first); within it, the
            // least used device.
            Spread::Distributed => pool
                .iter()
                .enumerate()
                .min_by(|(_, (a, am)), (_, (b, bm))| {
                    let turn = |m: &u64| taken_from.get(m).copied().unwrap_or(0);
                    (
                        turn(am),
                        std::cmp::Reverse(free[am]),
                        am,
                        used(a),
                        usage.physical(&a.id),
                        &a.id,
                    )
                        .cmp(&(
                            turn(bm),
                            std::cmp::Reverse(free[bm]),
                            bm,
                            used(b),
                            usage.physical(&b.id),
                            &b.id,
                        ))
                }),
        };
        let Some((at, _)) = best else { break };
        let (device, mask) = pool.swap_remove(at);
        if usage.one_per_device {
            let physical = usage.physical(&device.id);
            pool.retain(|(d, _)| usage.physical(&d.id) != physical);
        }
        *taken_from.entry(mask).or_default() += 1;
        *held
            .entry(usage.physical(&device.id).to_owned())
            .or_default() += 1;
        out.push(device.id.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(id: &str, numa: &[i64], health: Health) -> Device {
        Device {
            id: id.into(),
            health,
            numa_nodes: numa.to_vec(),
            attributes: Vec::new(),
            ..crate::device::Device::new("", crate::device::Health::Healthy)
        }
    }

    /// `per_node` healthy devices on each of `nodes` NUMA nodes: `n<node>-<i>`.
    fn node(nodes: i64, per_node: usize) -> Vec<Device> {
        let mut all: Vec<Device> = (0..nodes)
            .flat_map(|n| {
                (0..per_node).map(move |i| device(&format!("n{n}-{i}"), &[n], Health::Healthy))
            })
            .collect();
        all.sort_by(|a, b| a.id.cmp(&b.id));
        all
    }

    fn ids(devices: &[Device]) -> Vec<String> {
        devices.iter().map(|d| d.id.clone()).collect()
    }

    fn strings(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    /// [`choose`] with every device of the snapshot offered and none held.
    fn offered_all(
        snapshot: &[Device],
        must_include: &[String],
        size: usize,
        spread: Spread,
    ) -> Vec<String> {
        choose(
            snapshot,
            &ids(snapshot),
            must_include,
            size,
            spread,
            &Usage::default(),
        )
    }

    fn nodes_of(snapshot: &[Device], chosen: &[String]) -> HashSet<i64> {
        chosen
            .iter()
            .flat_map(|id| {
                crate::resource::snapshot::find(snapshot, id)
                    .unwrap()
                    .numa_nodes
                    .clone()
            })
            .collect()
    }

    #[test]
    fn a_request_that_fits_one_node_stays_on_one_node() {
        let snapshot = node(2, 4);
        for spread in [Spread::Packed, Spread::Distributed] {
            let chosen = offered_all(&snapshot, &[], 3, spread);
            assert_eq!(chosen.len(), 3);
            assert_eq!(
                nodes_of(&snapshot, &chosen).len(),
                1,
                "{spread:?}: {chosen:?}"
            );
        }
    }

    #[test]
    fn packed_fills_the_fuller_node_and_distributed_the_emptier() {
        let snapshot = node(2, 4);
        // Node 0 has one device taken already: 3 free there, 4 on node 1.
        let available: Vec<String> = ids(&snapshot)
            .into_iter()
            .filter(|id| id != "n0-0")
            .collect();
        let packed = choose(
            &snapshot,
            &available,
            &[],
            2,
            Spread::Packed,
            &Usage::default(),
        );
        assert_eq!(
            nodes_of(&snapshot, &packed),
            HashSet::from([0]),
            "{packed:?}"
        );
        let spread = choose(
            &snapshot,
            &available,
            &[],
            2,
            Spread::Distributed,
            &Usage::default(),
        );
        assert_eq!(
            nodes_of(&snapshot, &spread),
            HashSet::from([1]),
            "{spread:?}"
        );
    }

    #[test]
    fn must_include_comes_first_and_pulls_the_rest_to_its_node() {
        let snapshot = node(2, 4);
        let chosen = offered_all(&snapshot, &strings(&["n1-3"]), 3, Spread::Packed);
        assert_eq!(chosen[0], "n1-3");
        assert_eq!(nodes_of(&snapshot, &chosen), HashSet::from([1]));
        assert_eq!(
            chosen.iter().collect::<HashSet<_>>().len(),
            3,
            "no ID twice"
        );
    }

    #[test]
    fn a_request_larger_than_a_node_takes_the_fewest_nodes() {
        let snapshot = node(4, 2);
        let chosen = offered_all(&snapshot, &[], 4, Spread::Distributed);
        assert_eq!(chosen.len(), 4);
        assert_eq!(nodes_of(&snapshot, &chosen).len(), 2, "{chosen:?}");
    }

    #[test]
    fn an_unhealthy_device_is_skipped_and_never_fails_the_answer() {
        let mut snapshot = node(1, 3);
        snapshot[0].health = Health::Unhealthy;
        let chosen = offered_all(&snapshot, &[], 2, Spread::Packed);
        assert_eq!(chosen, strings(&["n0-1", "n0-2"]));
        // Asked for more than the healthy ones: as many as there are, no error.
        let chosen = offered_all(&snapshot, &[], 3, Spread::Packed);
        assert_eq!(chosen, strings(&["n0-1", "n0-2"]));
    }

    #[test]
    fn distributed_alternates_between_the_nodes_it_needs() {
        let snapshot = node(2, 2);
        let chosen = offered_all(&snapshot, &[], 4, Spread::Distributed);
        let first_two = nodes_of(&snapshot, &chosen[..2]);
        assert_eq!(first_two.len(), 2, "one from each node first: {chosen:?}");
    }

    /// `gpu-<g>::<r>` replicas: 2 GPUs on node 0 with 2 replicas each.
    fn replicas() -> Vec<Device> {
        ["gpu-0::0", "gpu-0::1", "gpu-1::0", "gpu-1::1"]
            .map(|id| device(id, &[0], Health::Healthy))
            .into()
    }

    fn shared(in_use: &[(&'static str, usize)]) -> Usage<'static> {
        Usage {
            physical: Some(crate::policy::sharing::physical_id),
            in_use: in_use.iter().copied().collect(),
            one_per_device: false,
        }
    }

    #[test]
    fn one_share_per_container_never_picks_two_replicas_of_one_device() {
        let snapshot = replicas();
        let all = ids(&snapshot);
        let usage = Usage {
            one_per_device: true,
            ..shared(&[])
        };
        for spread in [Spread::Packed, Spread::Distributed] {
            let two = choose(&snapshot, &all, &[], 2, spread, &usage);
            let gpus: HashSet<&str> = two
                .iter()
                .map(|id| crate::policy::sharing::physical_id(id))
                .collect();
            assert_eq!((two.len(), gpus.len()), (2, 2), "{spread:?}: {two:?}");
            // Three cannot be had without two of one device: two is the answer.
            let three = choose(&snapshot, &all, &[], 3, spread, &usage);
            assert_eq!(three.len(), 2, "{spread:?}: {three:?}");
            let with = choose(&snapshot, &all, &strings(&["gpu-0::1"]), 2, spread, &usage);
            assert_eq!(with, strings(&["gpu-0::1", "gpu-1::0"]), "{spread:?}");
        }
    }

    #[test]
    fn distributed_takes_the_least_used_devices_one_replica_each() {
        let snapshot = replicas();
        let free = strings(&["gpu-0::1", "gpu-1::0", "gpu-1::1"]);
        // gpu-0 has a replica held: gpu-1 first.
        let one = choose(
            &snapshot,
            &free,
            &[],
            1,
            Spread::Distributed,
            &shared(&[("gpu-0", 1)]),
        );
        assert_eq!(one, strings(&["gpu-1::0"]));
        // Two for one container: one replica of each GPU, never two of one while another is free.
        let all = ids(&snapshot);
        let two = choose(&snapshot, &all, &[], 2, Spread::Distributed, &shared(&[]));
        let gpus: HashSet<&str> = two
            .iter()
            .map(|id| crate::policy::sharing::physical_id(id))
            .collect();
        assert_eq!(gpus.len(), 2, "{two:?}");
    }

    #[test]
    fn packed_fills_a_devices_replicas_first() {
        let snapshot = replicas();
        let free = strings(&["gpu-0::1", "gpu-1::0", "gpu-1::1"]);
        let one = choose(
            &snapshot,
            &free,
            &[],
            1,
            Spread::Packed,
            &shared(&[("gpu-0", 1)]),
        );
        assert_eq!(one, strings(&["gpu-0::1"]), "the GPU already in use");
        let all = ids(&snapshot);
        let two = choose(&snapshot, &all, &[], 2, Spread::Packed, &shared(&[]));
        assert_eq!(two, strings(&["gpu-0::0", "gpu-0::1"]));
    }

    #[test]
    fn past_twelve_nodes_a_request_still_stays_on_one_node() {
        let snapshot = node(16, 2);
        for spread in [Spread::Packed, Spread::Distributed] {
            let chosen = offered_all(&snapshot, &[], 2, spread);
            assert_eq!(
                nodes_of(&snapshot, &chosen).len(),
                1,
                "{spread:?}: {chosen:?}"
            );
        }
    }

    #[test]
    fn a_size_beyond_what_is_offered_gets_what_there_is() {
        let snapshot = node(1, 2);
        let chosen = offered_all(&snapshot, &[], 1 << 40, Spread::Packed);
        assert_eq!(chosen.len(), 2);
    }

    #[test]
    fn devices_without_topology_fit_anywhere() {
        let snapshot = vec![
            device("a", &[], Health::Healthy),
            device("b", &[0], Health::Healthy),
            device("c", &[1], Health::Healthy),
        ];
        let chosen = offered_all(&snapshot, &strings(&["b"]), 2, Spread::Packed);
        assert_eq!(chosen, strings(&["b", "a"]), "stays on node 0");
    }
}
