//! `GetPreferredAllocation`: which of the available devices the kubelet should give a
//! container.
//!
//! - Whole GPUs (no MIG devices, no replica IDs): the topology policy. Pick the set of `size`
//!   GPUs containing every must-include GPU whose summed pairwise link score ([`Topology`]) is
//!   highest. NVIDIA (go-gpuallocator's best-effort policy) partitions *all* available GPUs
//!   into sets of `size` and returns the best set of the best partition; for one request what a
//!   user observes is "the best-connected set", which is what this computes directly (the two
//!   differ only when the best single set would leave badly connected leftovers, a trade-off
//!   NVIDIA makes for future requests it cannot know).
//! - MIG devices or time-slicing/MPS replicas: NVIDIA's shared-device greedy policy
//!   ([`SharedPolicy`]), spreading over or packing onto physical GPUs.
//!
//! The result is always the must-include IDs followed by the picks, spelled exactly as the
//! kubelet sent them. Everything is deterministic.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use crate::devices::{Topology, split_replica_id};
use crate::plugin::resources::{PluginDevice, Resource};

/// Combination count up to which the topology policy searches exhaustively (covers every
/// `size` for up to 16 candidate GPUs: C(16, 8) = 12870); beyond it, greedy.
pub const EXACT_SEARCH_LIMIT: u64 = 1 << 15;

/// How shared devices (MIG devices, time-slicing replicas) are chosen: the config's
/// `[device_plugin.sharing] policy` (NVIDIA's `sharedDevicesAllocationPolicy`).
pub use crate::config::SharedPolicy;

/// Why a preferred-allocation request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PreferredError {
    /// An available or must-include ID that this resource does not advertise.
    #[error("preferred allocation for '{resource}': unknown device: {id}")]
    UnknownDevice { id: String, resource: String },
    /// A must-include ID missing from the available list.
    #[error("preferred allocation: must-include device {id} is not in the available list")]
    MustIncludeNotAvailable { id: String },
    /// Fewer devices asked for than must be included.
    #[error("preferred allocation: size {size} is smaller than the {must_include} must-include devices")]
    SizeBelowMustInclude { size: usize, must_include: usize },
    /// More devices asked for than are available.
    #[error("preferred allocation: size {size} exceeds the {available} available devices")]
    NotEnoughAvailable { size: usize, available: usize },
}

/// Chooses `size` of `available` (IDs as the kubelet sent them), always including
/// `must_include`; see the module docs for the two policies.
///
/// Validation: every ID must be a key of `resource.devices`, `must_include ⊆ available`,
/// `must_include.len() ≤ size ≤ available.len()` (after removing duplicate IDs).
pub fn preferred_allocation<'a>(
    resource: &'a Resource,
    available: &'a [String],
    must_include: &'a [String],
    size: usize,
    topology: &Topology,
    policy: SharedPolicy,
) -> Result<Vec<String>, PreferredError> {
    let lookup = |id: &'a String| -> Result<Entry<'a>, PreferredError> {
        match resource.devices.get(id) {
            Some(device) => Ok(Entry { id, device }),
            None => Err(PreferredError::UnknownDevice {
                id: id.clone(),
                resource: resource.name.clone(),
            }),
        }
    };
    let available = dedup(available)
        .into_iter()
        .map(lookup)
        .collect::<Result<Vec<_>, _>>()?;
    let must = dedup(must_include)
        .into_iter()
        .map(lookup)
        .collect::<Result<Vec<_>, _>>()?;

    let available_ids: BTreeSet<&str> = available.iter().map(|e| e.id.as_str()).collect();
    if let Some(missing) = must.iter().find(|e| !available_ids.contains(e.id.as_str())) {
        return Err(PreferredError::MustIncludeNotAvailable { id: missing.id.clone() });
    }
    if size < must.len() {
        return Err(PreferredError::SizeBelowMustInclude {
            size,
            must_include: must.len(),
        });
    }
    if size > available.len() {
        return Err(PreferredError::NotEnoughAvailable {
            size,
            available: available.len(),
        });
    }

    let must_ids: BTreeSet<&str> = must.iter().map(|e| e.id.as_str()).collect();
    let mut candidates: Vec<Entry> = available
        .into_iter()
        .filter(|e| !must_ids.contains(e.id.as_str()))
        .collect();
    candidates.sort_by_cached_key(Entry::order_key);
    let needed = size - must.len();

    let shared = must
        .iter()
        .chain(&candidates)
        .any(|e| e.device.mig.is_some() || split_replica_id(e.id).is_some());
    let picks = if needed == 0 {
        Vec::new()
    } else if shared {
        shared_greedy(resource, &must, candidates, needed, policy)
    } else {
        best_connected(&must, candidates, needed, topology)
    };

    Ok(must.iter().chain(&picks).map(|e| e.id.clone()).collect())
}

/// A requested ID and the device it names.
#[derive(Debug, Clone, Copy)]
struct Entry<'a> {
    id: &'a String,
    device: &'a PluginDevice,
}

impl Entry<'_> {
    /// Deterministic candidate order: device index numerically (`"2"` < `"10"`, `"1:0"` <
    /// `"1:1"`), then replica number numerically, then the ID itself.
    fn order_key(&self) -> (Vec<u32>, u64, String) {
        let index = self
            .device
            .index
            .split(':')
            .map(|part| part.parse().unwrap_or(u32::MAX))
            .collect();
        let replica = split_replica_id(self.id).map_or(0, |(_, n)| n.parse::<u64>().map_or(u64::MAX, |n| n + 1));
        (index, replica, self.id.clone())
    }
}

fn dedup(ids: &[String]) -> Vec<&String> {
    let mut seen = BTreeSet::new();
    ids.iter().filter(|id| seen.insert(id.as_str())).collect()
}

/// Shared devices, NVIDIA's greedy loop: one pick at a time, preferring
///
/// 1. the candidate whose device (the GPU or MIG device a replica stands for; for a device that
///    is not a replica, the device itself) is in this request the fewest times so far
///    (must-include and picks): two replicas of one GPU in one container are the same GPU
///    twice, so a request for several replicas gets distinct GPUs while any have one free;
/// 2. then the candidate whose physical GPU carries the fewest (`Distributed`) / most
///    (`Packed`) of this resource's devices already taken — in use by other containers (not
///    available), must-include, or picked earlier in this loop;
/// 3. then the GPU with the fewest devices in this request so far;
/// 4. then candidate order ([`Entry::order_key`]).
///
/// Rule 1 never applies between MIG devices that are not replicas (each is a distinct device),
/// so `Packed` still fills one GPU's MIG devices first. Counting devices in use elsewhere is what
/// spreads single-device pods over GPUs under `Distributed`: a GPU's load is its device count in
/// the resource minus its candidates not yet picked.
fn shared_greedy<'a>(
    resource: &Resource,
    must: &[Entry<'a>],
    mut candidates: Vec<Entry<'a>>,
    needed: usize,
    policy: SharedPolicy,
) -> Vec<Entry<'a>> {
    let mut load: BTreeMap<&str, usize> = BTreeMap::new();
    for device in resource.devices.values() {
        *load.entry(device.physical_uuid()).or_default() += 1;
    }
    for c in &candidates {
        if let Some(l) = load.get_mut(c.device.physical_uuid()) {
            *l -= 1;
        }
    }
    // Per physical GPU, and per device the container would see (replicas of one device share
    // it; any other ID is its own device).
    let mut in_request: BTreeMap<&str, usize> = BTreeMap::new();
    let mut same_device: BTreeMap<&str, usize> = BTreeMap::new();
    for m in must {
        *in_request.entry(m.device.physical_uuid()).or_default() += 1;
        *same_device.entry(seen_device(m)).or_default() += 1;
    }

    let mut picks = Vec::with_capacity(needed);
    while picks.len() < needed && !candidates.is_empty() {
        let rank = |e: &Entry| {
            let gpu = e.device.physical_uuid();
            let d = same_device.get(seen_device(e)).copied().unwrap_or(0);
            let l = load.get(gpu).copied().unwrap_or(0);
            let r = in_request.get(gpu).copied().unwrap_or(0);
            match policy {
                SharedPolicy::Distributed => (d, l, r),
                SharedPolicy::Packed => (d, usize::MAX - l, r),
            }
        };
        // Candidates are in order, so the first minimum is the lowest in order among ties.
        let best = (0..candidates.len())
            .min_by_key(|&i| (rank(&candidates[i]), i))
            .expect("candidates is not empty");
        let pick = candidates.remove(best);
        let gpu = pick.device.physical_uuid();
        *load.entry(gpu).or_default() += 1;
        *in_request.entry(gpu).or_default() += 1;
        *same_device.entry(seen_device(&pick)).or_default() += 1;
        picks.push(pick);
    }
    picks
}

/// The device a container given `e` sees: for a replica (`<uuid>::<n>`) the device it
/// replicates, otherwise the ID itself (never shared with another ID).
fn seen_device<'a>(e: &Entry<'a>) -> &'a str {
    match split_replica_id(e.id) {
        Some(_) => e.device.uuid.as_str(),
        None => e.id.as_str(),
    }
}

/// Whole GPUs: the set of `needed` candidates that, together with `must`, maximises
/// (1) the summed pairwise [`Topology`] score, then (2) how many picks share a NUMA node with a
/// must-include GPU, then (3) how many pairs in the whole set share a NUMA node, then
/// (4) the lowest candidate order. Exhaustive when there are at most [`EXACT_SEARCH_LIMIT`]
/// combinations, greedy otherwise.
fn best_connected<'a>(
    must: &[Entry<'a>],
    candidates: Vec<Entry<'a>>,
    needed: usize,
    topology: &Topology,
) -> Vec<Entry<'a>> {
    let scorer = SetScorer::new(must, &candidates, topology);
    let chosen = if binomial(candidates.len(), needed) <= EXACT_SEARCH_LIMIT {
        exhaustive(&scorer, candidates.len(), needed)
    } else {
        greedy(&scorer, candidates.len(), needed, must.is_empty())
    };
    chosen.into_iter().map(|i| candidates[i]).collect()
}

/// Precomputed pair facts over `must` (positions `0..m`) and the candidates (`m..`).
struct SetScorer {
    m: usize,
    n: usize,
    /// Pair scores, row-major over all `m + n` members.
    score: Vec<u64>,
    /// Whether both members have the same known NUMA node.
    same_numa: Vec<bool>,
    /// Per candidate: shares a NUMA node with some must-include GPU.
    near_must: Vec<bool>,
}

/// Ranking of a set; larger is better. The candidate-order tie-break is applied by the callers.
type SetRank = (u64, usize, usize);

impl SetScorer {
    fn new(must: &[Entry], candidates: &[Entry], topology: &Topology) -> Self {
        let all: Vec<&PluginDevice> = must.iter().chain(candidates).map(|e| e.device).collect();
        let total = all.len();
        let mut score = vec![0u64; total * total];
        let mut same_numa = vec![false; total * total];
        for (i, a) in all.iter().enumerate() {
            for (j, b) in all.iter().enumerate() {
                score[i * total + j] = u64::from(topology.score(&a.uuid, &b.uuid));
                same_numa[i * total + j] = a.numa_node.is_some() && a.numa_node == b.numa_node;
            }
        }
        let must_numa: BTreeSet<i64> = must.iter().filter_map(|e| e.device.numa_node).collect();
        let near_must = candidates
            .iter()
            .map(|e| e.device.numa_node.is_some_and(|n| must_numa.contains(&n)))
            .collect();
        SetScorer {
            m: must.len(),
            n: candidates.len(),
            score,
            same_numa,
            near_must,
        }
    }

    fn total(&self) -> usize {
        self.m + self.n
    }

    /// Rank of `must` plus the candidates at `chosen` (candidate positions).
    fn rank(&self, chosen: &[usize]) -> SetRank {
        let members: Vec<usize> = (0..self.m).chain(chosen.iter().map(|c| self.m + c)).collect();
        let t = self.total();
        let (mut score, mut pairs) = (0u64, 0usize);
        for (x, &i) in members.iter().enumerate() {
            for &j in &members[x + 1..] {
                score += self.score[i * t + j];
                pairs += usize::from(self.same_numa[i * t + j]);
            }
        }
        let near = chosen.iter().filter(|&&c| self.near_must[c]).count();
        (score, near, pairs)
    }

    /// How adding candidate `c` to `members` (all positions) ranks, for the greedy step.
    fn gain(&self, members: &[usize], c: usize) -> SetRank {
        let t = self.total();
        let pos = self.m + c;
        let score = members.iter().map(|&i| self.score[i * t + pos]).sum();
        let pairs = members.iter().filter(|&&i| self.same_numa[i * t + pos]).count();
        (score, usize::from(self.near_must[c]), pairs)
    }
}

/// Every `k`-subset of `0..n` in lexicographic order; keeps the first of the best.
fn exhaustive(scorer: &SetScorer, n: usize, k: usize) -> Vec<usize> {
    let mut combo: Vec<usize> = (0..k).collect();
    let mut best = combo.clone();
    let mut best_rank = scorer.rank(&combo);
    loop {
        // Advance to the next combination: bump the rightmost position that can move.
        let Some(i) = (0..k).rev().find(|&i| combo[i] < n - k + i) else {
            return best;
        };
        combo[i] += 1;
        for j in i + 1..k {
            combo[j] = combo[j - 1] + 1;
        }
        let rank = scorer.rank(&combo);
        if rank > best_rank {
            best_rank = rank;
            best.clone_from(&combo);
        }
    }
}

/// Greedy growth: repeatedly add the candidate with the best gain against the current set
/// (lowest order on ties). With no must-include GPU, every candidate is tried as the seed and
/// the best resulting set is kept, so the first pick is not an arbitrary one.
fn greedy(scorer: &SetScorer, n: usize, k: usize, seeded: bool) -> Vec<usize> {
    let grow = |mut chosen: Vec<usize>| {
        let mut members: Vec<usize> = (0..scorer.m).chain(chosen.iter().map(|c| scorer.m + c)).collect();
        while chosen.len() < k {
            let next = (0..n)
                .filter(|c| !chosen.contains(c))
                .max_by_key(|&c| (scorer.gain(&members, c), Reverse(c)))
                .expect("enough candidates");
            chosen.push(next);
            members.push(scorer.m + next);
        }
        chosen.sort_unstable();
        chosen
    };
    if !seeded {
        return grow(Vec::new());
    }
    let mut best: Option<(SetRank, Vec<usize>)> = None;
    for seed in 0..n {
        let set = grow(vec![seed]);
        let rank = scorer.rank(&set);
        let better = match &best {
            None => true,
            Some((r, s)) => rank > *r || (rank == *r && set < *s),
        };
        if better {
            best = Some((rank, set));
        }
    }
    best.map(|(_, s)| s).unwrap_or_default()
}

/// C(n, k), saturating at `u64::MAX`.
fn binomial(n: usize, k: usize) -> u64 {
    if k > n {
        return 0;
    }
    let k = k.min(n - k) as u64;
    let n = n as u64;
    let mut acc: u128 = 1;
    for i in 0..k {
        acc = acc * u128::from(n - i) / u128::from(i + 1);
        if acc > u128::from(u64::MAX) {
            return u64::MAX;
        }
    }
    acc as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{TopologyLevel, link_score};
    use crate::plugin::resources::{Health, MigInfo};

    fn uuid(i: usize) -> String {
        format!("GPU-{i:08}-0000-0000-0000-000000000000")
    }

    fn gpu(i: usize, numa: i64) -> PluginDevice {
        PluginDevice {
            uuid: uuid(i),
            index: i.to_string(),
            minor: i as u32,
            numa_node: Some(numa),
            mig: None,
            health: Health::Healthy,
        }
    }

    fn gpus(n: usize, per_numa: usize) -> Resource {
        Resource {
            name: "nvidia.com/gpu".into(),
            devices: (0..n).map(|i| (uuid(i), gpu(i, (i / per_numa) as i64))).collect(),
        }
    }

    /// Islands of `island` GPUs: NVLink (4 links, same NUMA) inside, cross-CPU PCIe between.
    fn islands(n: usize, island: usize) -> Topology {
        let mut t = Topology::new();
        for a in 0..n {
            for b in a + 1..n {
                let s = if a / island == b / island {
                    link_score(4, Some(TopologyLevel::Node))
                } else {
                    link_score(0, Some(TopologyLevel::System))
                };
                t.set(&uuid(a), &uuid(b), s);
            }
        }
        t
    }

    fn ids(is: &[usize]) -> Vec<String> {
        is.iter().map(|&i| uuid(i)).collect()
    }

    fn all(n: usize) -> Vec<String> {
        ids(&(0..n).collect::<Vec<_>>())
    }

    const D: SharedPolicy = SharedPolicy::Distributed;

    #[test]
    fn dgx_picks_an_nvlink_island() {
        // NUMA nodes interleave the islands (0,1,4,5 | 2,3,6,7), so scores must decide.
        let res = gpus(8, 2);
        let res = Resource {
            devices: res
                .devices
                .into_iter()
                .map(|(k, mut d)| {
                    d.numa_node = Some(i64::from((d.minor / 2) % 2));
                    (k, d)
                })
                .collect(),
            ..res
        };
        let topo = islands(8, 4);
        let got = preferred_allocation(&res, &all(8), &[], 4, &topo, D).unwrap();
        assert_eq!(got, ids(&[0, 1, 2, 3]));
        // One GPU of the first island taken: the second island is whole.
        let got = preferred_allocation(&res, &ids(&[0, 2, 3, 4, 5, 6, 7]), &[], 4, &topo, D);
        assert_eq!(got.unwrap(), ids(&[4, 5, 6, 7]));
        // Pairs stay inside an island, lowest first.
        let got = preferred_allocation(&res, &all(8), &[], 2, &topo, D).unwrap();
        assert_eq!(got, ids(&[0, 1]));
        // Available order does not matter.
        let mut shuffled = all(8);
        shuffled.reverse();
        let got = preferred_allocation(&res, &shuffled, &[], 4, &topo, D).unwrap();
        assert_eq!(got, ids(&[0, 1, 2, 3]));
    }

    #[test]
    fn must_include_is_honoured_and_first() {
        let res = gpus(8, 4);
        let topo = islands(8, 4);
        let got = preferred_allocation(&res, &all(8), &ids(&[6]), 4, &topo, D).unwrap();
        assert_eq!(got, ids(&[6, 4, 5, 7]));
        // Must-include across islands: the rest follows the bigger pull.
        let got = preferred_allocation(&res, &all(8), &ids(&[5, 1, 6]), 4, &topo, D).unwrap();
        assert_eq!(got, ids(&[5, 1, 6, 4]));
        // size == must_include
        let got = preferred_allocation(&res, &all(8), &ids(&[3, 2]), 2, &topo, D).unwrap();
        assert_eq!(got, ids(&[3, 2]));
    }

    #[test]
    fn numa_then_index_break_ties() {
        let res = gpus(8, 4);
        let flat = Topology::new();
        // Equal scores: join the must-include GPU's NUMA node.
        let got = preferred_allocation(&res, &all(8), &ids(&[5]), 3, &flat, D).unwrap();
        assert_eq!(got, ids(&[5, 4, 6]));
        // No must-include: keep the set on one NUMA node.
        let got = preferred_allocation(&res, &ids(&[2, 3, 4, 5, 6, 7]), &[], 4, &flat, D).unwrap();
        assert_eq!(got, ids(&[4, 5, 6, 7]));
        // Nothing to tell apart: lowest indices, numerically ordered.
        let res = gpus(12, 12);
        let got = preferred_allocation(&res, &ids(&[11, 10, 2, 9]), &[], 2, &flat, D).unwrap();
        assert_eq!(got, ids(&[2, 9]));
    }

    #[test]
    fn size_equal_to_available() {
        let res = gpus(8, 4);
        let got = preferred_allocation(&res, &ids(&[7, 1, 3]), &ids(&[3]), 3, &islands(8, 4), D);
        assert_eq!(got.unwrap(), ids(&[3, 1, 7]));
    }

    #[test]
    fn greedy_beyond_the_exact_limit() {
        // 24 GPUs, islands of 8, size 8: C(24, 8) is far past the exact-search limit.
        let res = gpus(24, 24);
        let topo = islands(24, 8);
        assert!(binomial(24, 8) > EXACT_SEARCH_LIMIT);
        let avail: Vec<usize> = (0..24).filter(|i| *i != 3 && *i != 12).collect();
        let got = preferred_allocation(&res, &ids(&avail), &[], 8, &topo, D).unwrap();
        assert_eq!(got, ids(&[16, 17, 18, 19, 20, 21, 22, 23]));
        let got = preferred_allocation(&res, &ids(&avail), &ids(&[9]), 7, &topo, D).unwrap();
        assert_eq!(got, ids(&[9, 8, 10, 11, 13, 14, 15]));
    }

    #[test]
    fn errors() {
        let res = gpus(4, 4);
        let t = Topology::new();
        let err = preferred_allocation(&res, &["GPU-x".into()], &[], 1, &t, D).unwrap_err();
        assert_eq!(
            err.to_string(),
            "preferred allocation for 'nvidia.com/gpu': unknown device: GPU-x"
        );
        let err = preferred_allocation(&res, &all(2), &["GPU-y".into()], 1, &t, D).unwrap_err();
        assert!(matches!(err, PreferredError::UnknownDevice { ref id, .. } if id == "GPU-y"));
        let err = preferred_allocation(&res, &all(2), &ids(&[3]), 2, &t, D).unwrap_err();
        assert_eq!(err, PreferredError::MustIncludeNotAvailable { id: uuid(3) });
        assert!(err.to_string().contains(&uuid(3)));
        let err = preferred_allocation(&res, &all(3), &ids(&[0, 1]), 1, &t, D).unwrap_err();
        assert_eq!(
            err.to_string(),
            "preferred allocation: size 1 is smaller than the 2 must-include devices"
        );
        let err = preferred_allocation(&res, &all(3), &[], 4, &t, D).unwrap_err();
        assert_eq!(
            err.to_string(),
            "preferred allocation: size 4 exceeds the 3 available devices"
        );
        // Duplicates count once.
        let dup = [uuid(0), uuid(0)];
        assert!(preferred_allocation(&res, &dup, &[], 2, &t, D).is_err());
        assert_eq!(preferred_allocation(&res, &dup, &[], 1, &t, D).unwrap(), ids(&[0]));
        assert!(preferred_allocation(&res, &all(3), &[], 0, &t, D).unwrap().is_empty());
    }

    /// MIG resource: `per_gpu` 1g devices on each of GPUs 0 and 1; IDs `MIG-<gpu>-<n>`.
    fn migs(per_gpu: u32) -> Resource {
        let mut devices = BTreeMap::new();
        for g in 0..2u32 {
            for n in 0..per_gpu {
                let id = format!("MIG-{g}-{n}");
                let dev = PluginDevice {
                    uuid: id.clone(),
                    index: format!("{g}:{n}"),
                    minor: g,
                    numa_node: Some(0),
                    mig: Some(MigInfo {
                        parent_uuid: uuid(g as usize),
                        parent_index: g,
                        gi_id: n + 7,
                        ci_id: 0,
                        profile: "1g.5gb".into(),
                    }),
                    health: Health::Healthy,
                };
                devices.insert(id, dev);
            }
        }
        Resource {
            name: "nvidia.com/mig-1g.5gb".into(),
            devices,
        }
    }

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn mig_distributed_vs_packed() {
        use SharedPolicy::Packed;
        let res = migs(3);
        let t = Topology::new();
        let every = s(&["MIG-0-0", "MIG-0-1", "MIG-0-2", "MIG-1-0", "MIG-1-1", "MIG-1-2"]);

        let got = preferred_allocation(&res, &every, &[], 2, &t, D).unwrap();
        assert_eq!(got, s(&["MIG-0-0", "MIG-1-0"]));
        let got = preferred_allocation(&res, &every, &[], 2, &t, Packed).unwrap();
        assert_eq!(got, s(&["MIG-0-0", "MIG-0-1"]));
        let got = preferred_allocation(&res, &every, &[], 4, &t, D).unwrap();
        assert_eq!(got, s(&["MIG-0-0", "MIG-1-0", "MIG-0-1", "MIG-1-1"]));
        let got = preferred_allocation(&res, &every, &[], 4, &t, Packed).unwrap();
        assert_eq!(got, s(&["MIG-0-0", "MIG-0-1", "MIG-0-2", "MIG-1-0"]));

        // MIG-0-0 in use by another pod: GPU 0 carries load 1.
        let rest = &every[1..];
        let got = preferred_allocation(&res, rest, &[], 1, &t, D).unwrap();
        assert_eq!(got, s(&["MIG-1-0"]));
        let got = preferred_allocation(&res, rest, &[], 1, &t, Packed).unwrap();
        assert_eq!(got, s(&["MIG-0-1"]));

        // Must-include counts as load on its GPU.
        let must = s(&["MIG-1-1"]);
        let got = preferred_allocation(&res, &every, &must, 2, &t, D).unwrap();
        assert_eq!(got, s(&["MIG-1-1", "MIG-0-0"]));
        let got = preferred_allocation(&res, &every, &must, 2, &t, Packed).unwrap();
        assert_eq!(got, s(&["MIG-1-1", "MIG-1-0"]));
    }

    #[test]
    fn replicas_spread_and_order_numerically() {
        let mut devices = BTreeMap::new();
        for g in 0..2 {
            for n in 0..12 {
                devices.insert(format!("{}::{n}", uuid(g)), gpu(g, 0));
            }
        }
        let res = Resource {
            name: "nvidia.com/gpu".into(),
            devices,
        };
        let t = Topology::new();
        let replica = |g: usize, n: usize| format!("{}::{n}", uuid(g));
        // GPU 0 has replicas 0, 1 in use; 2 and 10, 11 free. GPU 1 has 0..=2 in use.
        let avail = vec![
            replica(0, 10),
            replica(0, 2),
            replica(0, 11),
            replica(1, 3),
            replica(1, 4),
        ];
        let got = preferred_allocation(&res, &avail, &[], 1, &t, D).unwrap();
        assert_eq!(got, [replica(0, 2)]);
        let got = preferred_allocation(&res, &avail, &[], 2, &t, D).unwrap();
        assert_eq!(got, [replica(0, 2), replica(1, 3)]);
        let got = preferred_allocation(&res, &avail, &[], 1, &t, SharedPolicy::Packed).unwrap();
        assert_eq!(got, [replica(1, 3)]);
    }

    /// `gpus` GPUs time-sliced into `replicas` each: IDs `<uuid>::<n>`.
    fn replicated(gpus: usize, replicas: usize) -> Resource {
        let mut devices = BTreeMap::new();
        for g in 0..gpus {
            for n in 0..replicas {
                devices.insert(format!("{}::{n}", uuid(g)), gpu(g, 0));
            }
        }
        Resource {
            name: "nvidia.com/gpu".into(),
            devices,
        }
    }

    #[test]
    fn replicas_go_to_distinct_gpus_before_load_decides() {
        use SharedPolicy::Packed;
        let res = replicated(2, 4);
        let t = Topology::new();
        let replica = |g: usize, n: usize| format!("{}::{n}", uuid(g));
        let free = |taken: &[(usize, usize)]| -> Vec<String> {
            (0..2)
                .flat_map(|g| (0..4).map(move |n| (g, n)))
                .filter(|p| !taken.contains(p))
                .map(|(g, n)| replica(g, n))
                .collect()
        };

        // GPU 0 has one replica in use, GPU 1 none: one replica of each GPU under both
        // policies; the policy only orders them (and breaks the tie for a third).
        let avail = free(&[(0, 0)]);
        let got = preferred_allocation(&res, &avail, &[], 2, &t, D).unwrap();
        assert_eq!(got, [replica(1, 0), replica(0, 1)]);
        let got = preferred_allocation(&res, &avail, &[], 2, &t, Packed).unwrap();
        assert_eq!(got, [replica(0, 1), replica(1, 0)]);
        let got = preferred_allocation(&res, &avail, &[], 3, &t, D).unwrap();
        assert_eq!(got, [replica(1, 0), replica(0, 1), replica(1, 1)]);
        let got = preferred_allocation(&res, &avail, &[], 3, &t, Packed).unwrap();
        assert_eq!(got, [replica(0, 1), replica(1, 0), replica(0, 2)]);

        // GPU 0 has two in use: distributed does not put both on the idle GPU 1.
        let avail = free(&[(0, 0), (0, 1)]);
        let got = preferred_allocation(&res, &avail, &[], 2, &t, D).unwrap();
        assert_eq!(got, [replica(1, 0), replica(0, 2)]);
        let got = preferred_allocation(&res, &avail, &[], 2, &t, Packed).unwrap();
        assert_eq!(got, [replica(0, 2), replica(1, 0)]);

        // A must-include replica's GPU counts as already in the request.
        let avail = free(&[]);
        let got = preferred_allocation(&res, &avail, &[replica(0, 3)], 2, &t, Packed).unwrap();
        assert_eq!(got, [replica(0, 3), replica(1, 0)]);
        let got = preferred_allocation(&res, &avail, &[replica(1, 2)], 2, &t, D).unwrap();
        assert_eq!(got, [replica(1, 2), replica(0, 0)]);

        // Only one GPU has replicas free: the request still fits, on that GPU.
        let avail = free(&[(1, 0), (1, 1), (1, 2), (1, 3)]);
        let got = preferred_allocation(&res, &avail, &[], 2, &t, D).unwrap();
        assert_eq!(got, [replica(0, 0), replica(0, 1)]);
    }

    #[test]
    fn binomials() {
        assert_eq!(binomial(16, 8), 12870);
        assert!(binomial(16, 8) <= EXACT_SEARCH_LIMIT);
        assert_eq!(binomial(5, 0), 1);
        assert_eq!(binomial(3, 4), 0);
        assert_eq!(binomial(1000, 500), u64::MAX);
    }
}
