//! NVLink-aware preferred allocation: the set of GPUs with the best links among them.
//!
//! Scores between GPU pairs are read from NVML once per instance (the topology does not change
//! while the node runs); a choice then costs microseconds: every combination when there are few
//! (8 GPUs, any size: at most 70), a greedy pick otherwise.

use std::collections::HashMap;

use devicelet_sdk::nvml::{self, TopologyLevel};

/// Most combinations tried exhaustively before choosing greedily.
const MAX_COMBINATIONS: u64 = 20_000;

#[derive(Debug, Clone, Default)]
pub struct Scores(HashMap<(u32, u32), u64>);

impl Scores {
    /// NVLinks dominate; among equal links, the nearer common PCIe ancestor wins.
    pub fn read(indexes: &[u32]) -> Scores {
        let mut scores = HashMap::new();
        for (i, &a) in indexes.iter().enumerate() {
            for &b in &indexes[i + 1..] {
                let score = match nvml::topology(a, b) {
                    Ok(link) => u64::from(link.nvlinks) * 100 + level_score(link.level),
                    Err(_) => 0,
                };
                scores.insert((a, b), score);
                scores.insert((b, a), score);
            }
        }
        Scores(scores)
    }

    pub fn between(&self, a: u32, b: u32) -> u64 {
        self.0.get(&(a, b)).copied().unwrap_or(0)
    }
}

fn level_score(level: TopologyLevel) -> u64 {
    match level {
        TopologyLevel::Internal => 60,
        TopologyLevel::Single => 50,
        TopologyLevel::Multiple => 40,
        TopologyLevel::HostBridge => 30,
        TopologyLevel::Node => 20,
        TopologyLevel::System => 10,
    }
}

/// `must_include`, then the `size` devices from `available` whose pairwise scores sum highest.
/// Obeys the host's rules: at most `size` IDs, each from `available`, none twice.
pub fn choose(
    available: &[String],
    must_include: &[String],
    size: usize,
    score: impl Fn(&str, &str) -> u64,
) -> Vec<String> {
    let mut chosen: Vec<&String> = Vec::new();
    for id in must_include {
        if chosen.len() < size && available.contains(id) && !chosen.contains(&id) {
            chosen.push(id);
        }
    }
    let rest: Vec<&String> = available
        .iter()
        .enumerate()
        .filter(|(i, id)| !chosen.contains(id) && !available[..*i].contains(id))
        .map(|(_, id)| id)
        .collect();
    let need = size.saturating_sub(chosen.len()).min(rest.len());
    let total = |set: &[&String]| -> u64 {
        let mut sum = 0;
        for (i, a) in set.iter().enumerate() {
            for b in &set[i + 1..] {
                sum += score(a, b);
            }
        }
        sum
    };
    if combinations(rest.len() as u64, need as u64) <= MAX_COMBINATIONS {
        let mut best: Option<(u64, Vec<&String>)> = None;
        let mut pick: Vec<usize> = (0..need).collect();
        loop {
            let mut set = chosen.clone();
            set.extend(pick.iter().map(|&i| rest[i]));
            let value = total(&set);
            if best.as_ref().is_none_or(|(b, _)| value > *b) {
                best = Some((value, set));
            }
            if !next_combination(&mut pick, rest.len()) {
                break;
            }
        }
        if let Some((_, set)) = best {
            chosen = set;
        }
    } else {
        let mut rest = rest;
        while chosen.len() < size && !rest.is_empty() {
            let (at, _) = rest
                .iter()
                .enumerate()
                .map(|(i, id)| (i, chosen.iter().map(|c| score(c, id)).sum::<u64>()))
                .fold((0, None), |best, (i, s)| match best.1 {
                    Some(b) if b >= s => best,
                    _ => (i, Some(s)),
                });
            chosen.push(rest.remove(at));
        }
    }
    chosen.into_iter().cloned().collect()
}

fn combinations(n: u64, k: u64) -> u64 {
    let k = k.min(n - k.min(n));
    let mut c: u64 = 1;
    for i in 0..k {
        c = c.saturating_mul(n - i) / (i + 1);
        if c > MAX_COMBINATIONS {
            return c;
        }
    }
    c
}

/// Advances `pick` (strictly increasing indexes below `n`) to the next combination.
fn next_combination(pick: &mut [usize], n: usize) -> bool {
    let k = pick.len();
    for i in (0..k).rev() {
        if pick[i] < n - k + i {
            pick[i] += 1;
            for j in i + 1..k {
                pick[j] = pick[j - 1] + 1;
            }
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| i.to_string()).collect()
    }

    /// Two NVLink islands of four: 0-3 and 4-7.
    fn islands(a: &str, b: &str) -> u64 {
        let (a, b): (u32, u32) = (a.parse().unwrap(), b.parse().unwrap());
        if a / 4 == b / 4 { 1210 } else { 10 }
    }

    #[test]
    fn a_pair_stays_on_one_nvlink_island() {
        let chosen = choose(&ids(8), &["5".into()], 2, islands);
        assert_eq!(chosen.len(), 2);
        assert_eq!(chosen[0], "5");
        assert!(["4", "6", "7"].contains(&chosen[1].as_str()), "{chosen:?}");
        let four = choose(&ids(8), &[], 4, islands);
        let island: Vec<u32> = four.iter().map(|i| i.parse::<u32>().unwrap() / 4).collect();
        assert!(island.iter().all(|&i| i == island[0]), "{four:?}");
    }

    #[test]
    fn answers_follow_the_hosts_rules() {
        let available = ids(3);
        assert_eq!(choose(&available, &[], 5, islands).len(), 3);
        assert_eq!(choose(&available, &["9".into()], 1, islands).len(), 1);
        assert!(choose(&available, &[], 0, islands).is_empty());
        let many = ids(40);
        let chosen = choose(&many, &[], 10, islands);
        assert_eq!(chosen.len(), 10);
        let mut unique = chosen.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), 10);
    }

    #[test]
    fn combinations_count_and_advance() {
        assert_eq!(combinations(8, 4), 70);
        assert_eq!(combinations(3, 5), 1);
        let mut pick = vec![0, 1];
        let mut seen = 1;
        while next_combination(&mut pick, 4) {
            seen += 1;
        }
        assert_eq!(seen, 6);
    }
}
