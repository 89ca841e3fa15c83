//! `GetPreferredAllocation`: which of the available devices the kubelet should give a
//! container. Both paths do what NVIDIA's k8s-device-plugin v0.20 does, with NVIDIA's
//! arbitrary tie orders (Go map order, `sort.Slice`, the kubelet's unsorted list) replaced by
//! the candidate order ([`Entry::order_key`]: device index, then replica number), so the
//! answer is deterministic.
//!
//! - Whole GPUs (no MIG devices, no replica IDs): go-gpuallocator's best-effort policy
//!   ([`best_effort`]). Pad the available GPUs to a multiple of `size`, find the partition of
//!   them into sets of `size` with the highest total pair score ([`Topology`]) among those with
//!   a set holding every must-include GPU (and no padding), and return the highest-scoring such
//!   set of that partition. So a request leaves well-connected sets for the requests after it:
//!   on a DGX-1 (Volta) two pairs of `[0,2,4,5]` are `[0,2]` and `[4,5]`, and the answer is
//!   `[4,5]`, not the single best pair `[0,4]`.
//! - MIG devices or time-slicing/MPS replicas: NVIDIA's greedy loop ([`shared_greedy`]) under
//!   the configured [`SharedPolicy`].
//!
//! The result is always the must-include IDs followed by the picks, spelled exactly as the
//! kubelet sent them.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::devices::{PluginDevice, Resource};
use crate::devices::{Topology, split_replica_id};

/// Combination count up to which the fallback for more than [`PARTITION_GPU_LIMIT`] GPUs
/// searches exhaustively for the best single set; beyond it, greedy.
pub const EXACT_SEARCH_LIMIT: u64 = 1 << 15;

/// Available whole GPUs up to which the best-effort partition search runs (it is exact and
/// takes milliseconds at 16). With more, the single best-connected set is returned instead.
pub const PARTITION_GPU_LIMIT: usize = 16;

/// How shared devices (MIG devices, time-slicing replicas) are chosen: the config's
/// `[device_plugin.sharing] policy` (NVIDIA's `sharedDevicesAllocationPolicy`).
use crate::config::SharedPolicy;

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
        match resource.devices.get_key_value(id) {
            Some((key, device)) => Ok(Entry { id: key, device }),
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
    } else if must.len() + candidates.len() <= PARTITION_GPU_LIMIT {
        best_effort(&must, candidates, size, topology)
    } else {
        best_connected(&must, candidates, needed, topology)
    };

    Ok(must.iter().chain(&picks).map(|e| e.id.clone()).collect())
}

/// A requested ID (the resource's own copy) and the device it names.
#[derive(Debug, Clone, Copy)]
struct Entry<'a> {
    id: &'a String,
    device: &'a PluginDevice,
}

impl<'a> Entry<'a> {
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

    /// NVIDIA's bucket for the shared-device policies (`AnnotatedID.GetID()`): the device a
    /// replica `<uuid>::<n>` stands for, otherwise the ID itself. A MIG device is its own
    /// bucket, not its parent GPU's (grouping by parent is NVIDIA's open PR #2036).
    fn bucket(&self) -> &'a str {
        bucket(self.id, self.device)
    }
}

fn bucket<'a>(id: &'a str, device: &'a PluginDevice) -> &'a str {
    match split_replica_id(id) {
        Some(_) => device.uuid.as_str(),
        None => id,
    }
}

fn dedup(ids: &[String]) -> Vec<&String> {
    let mut seen = BTreeSet::new();
    ids.iter().filter(|id| seen.insert(id.as_str())).collect()
}

/// Shared devices, NVIDIA's greedy loop (`greedyAlloc` in k8s-device-plugin
/// `internal/rm/allocate.go`): one pick at a time, from the bucket ([`Entry::bucket`]) ranked
/// first, where a bucket's *allocated* count is its devices in the resource that are not
/// candidates any more (in use by other containers, must-include, or picked earlier in this
/// loop) and *picked* is how many this loop took from it:
///
/// - `Distributed`: fewest allocated, then fewest picked (NVIDIA PR #1788);
/// - `Packed`: most allocated, then fewest picked;
/// - `Spread` (NVIDIA PR #1936): fewest picked, counting must-include devices as picked, then
///   fewest allocated.
///
/// Remaining ties go to the candidate order, which also chooses the replica within a bucket.
fn shared_greedy<'a>(
    resource: &'a Resource,
    must: &[Entry<'a>],
    mut candidates: Vec<Entry<'a>>,
    needed: usize,
    policy: SharedPolicy,
) -> Vec<Entry<'a>> {
    let mut total: BTreeMap<&str, usize> = BTreeMap::new();
    for (id, device) in &resource.devices {
        *total.entry(bucket(id, device)).or_default() += 1;
    }
    let mut left: BTreeMap<&str, usize> = BTreeMap::new();
    for c in &candidates {
        *left.entry(c.bucket()).or_default() += 1;
    }
    let mut picked: BTreeMap<&str, usize> = BTreeMap::new();
    if policy == SharedPolicy::Spread {
        for m in must {
            *picked.entry(m.bucket()).or_default() += 1;
        }
    }

    let mut picks = Vec::with_capacity(needed);
    while picks.len() < needed && !candidates.is_empty() {
        let rank = |e: &Entry| {
            let b = e.bucket();
            let allocated = total.get(b).copied().unwrap_or(0) - left.get(b).copied().unwrap_or(0);
            let p = picked.get(b).copied().unwrap_or(0);
            match policy {
                SharedPolicy::Distributed => (allocated, p),
                SharedPolicy::Packed => (usize::MAX - allocated, p),
                SharedPolicy::Spread => (p, allocated),
            }
        };
        // Candidates are in order, so the first minimum is the lowest in order among ties.
        let best = (0..candidates.len())
            .min_by_key(|&i| (rank(&candidates[i]), i))
            .expect("candidates is not empty");
        let pick = candidates.remove(best);
        let b = pick.bucket();
        if let Some(l) = left.get_mut(b) {
            *l -= 1;
        }
        *picked.entry(b).or_default() += 1;
        picks.push(pick);
    }
    picks
}

/// Whole GPUs, go-gpuallocator's `BestEffortPolicy` (`gpuallocator/besteffort_policy.go`):
/// the GPUs (must-include and candidates, in candidate order) padded to a multiple of `size`
/// are partitioned into sets of `size`; a partition counts only when its padding is in one set
/// and some padding-free set holds every must-include GPU; the first partition (in
/// go-gpuallocator's enumeration order) with the highest summed set score wins, and of its sets
/// holding the must-include GPUs, the first with the highest score is the answer. A set with
/// padding is never returned (go-gpuallocator would return a nil device there when it scores
/// highest and the request has no must-include GPU; its plugin then fails the call).
///
/// Instead of walking every partition, [`Partitions`] memoises the best score of each
/// remaining set of GPUs and then retraces the first best partition, which is the same one.
fn best_effort<'a>(must: &[Entry<'a>], candidates: Vec<Entry<'a>>, size: usize, topology: &Topology) -> Vec<Entry<'a>> {
    let mut all: Vec<(Entry<'a>, bool)> = must
        .iter()
        .map(|e| (*e, true))
        .chain(candidates.into_iter().map(|e| (e, false)))
        .collect();
    all.sort_by_cached_key(|(e, _)| e.order_key());
    let n = all.len();
    let mut score = vec![0u64; n * n];
    for (i, (a, _)) in all.iter().enumerate() {
        for (j, (b, _)) in all.iter().enumerate() {
            score[i * n + j] = u64::from(topology.score(&a.device.uuid, &b.device.uuid));
        }
    }
    let required = all
        .iter()
        .enumerate()
        .filter(|(_, (_, m))| *m)
        .fold(0u64, |acc, (i, _)| acc | 1 << i);
    let mut partitions = Partitions::new(n, size, score, required);
    let Some(set) = partitions.best_set() else {
        // Cannot happen: validation leaves `must ≤ size ≤ available`, so some partition fits.
        return Vec::new();
    };
    all.iter()
        .enumerate()
        .filter(|(i, (_, m))| !m && set & (1 << i) != 0)
        .map(|(_, (e, _))| *e)
        .collect()
}

/// The partition search of [`best_effort`] over GPU positions `0..n` (bit `i` of a mask) and
/// padding positions `n..total`.
struct Partitions {
    n: usize,
    size: usize,
    /// Pair scores, row-major over the `n` GPUs.
    score: Vec<u64>,
    /// Must-include GPUs.
    required: u64,
    /// The padding positions.
    padding: u64,
    /// Best partition score of each remaining mask; `None` when no valid partition exists.
    memo: HashMap<u64, Option<u64>>,
}

impl Partitions {
    fn new(n: usize, size: usize, score: Vec<u64>, required: u64) -> Self {
        let total = n.div_ceil(size) * size;
        let padding = (n..total).fold(0u64, |acc, i| acc | 1 << i);
        Partitions {
            n,
            size,
            score,
            required,
            padding,
            memo: HashMap::new(),
        }
    }

    fn set_score(&self, set: u64) -> u64 {
        let mut s = 0;
        let mut rest = set & !self.padding;
        while rest != 0 {
            let i = rest.trailing_zeros() as usize;
            rest &= rest - 1;
            let mut others = rest;
            while others != 0 {
                let j = others.trailing_zeros() as usize;
                others &= others - 1;
                s += self.score[i * self.n + j];
            }
        }
        s
    }

    /// The sets of `size` holding the lowest member of `mask` that may be part of a partition
    /// (all padding or none; all must-include GPUs without padding, or none of them), in
    /// go-gpuallocator's order: the other members as combinations in position order. The
    /// padding and the must-include GPUs are chosen as blocks, so only valid sets are built.
    fn sets(&self, mask: u64) -> Vec<u64> {
        let low = mask.trailing_zeros();
        let low_bit = 1u64 << low;
        let (req, pad) = (mask & self.required, mask & self.padding);
        let singles: Vec<u32> = (low + 1..64)
            .filter(|&i| (mask & !self.required & !self.padding) & (1 << i) != 0)
            .collect();
        let blocks: Vec<u64> = if req & low_bit != 0 {
            // The must-include GPUs are all still here (they leave together), no padding.
            vec![req]
        } else {
            let mut b = vec![low_bit];
            if req != 0 {
                b.push(low_bit | req);
            }
            if pad != 0 {
                b.push(low_bit | pad);
            }
            b
        };
        let mut out = Vec::new();
        for base in blocks {
            let Some(k) = self.size.checked_sub(base.count_ones() as usize) else {
                continue;
            };
            combinations(&singles, k, |combo| out.push(base | combo));
        }
        // Lexicographic order of the members' positions: of two sets of one size, the one
        // holding the lowest position where they differ comes first, which is the larger
        // bit-reversed mask.
        out.sort_unstable_by_key(|&set| Reverse(set.reverse_bits()));
        out
    }

    /// The best score of partitioning `mask`, memoised.
    fn best(&mut self, mask: u64) -> Option<u64> {
        if mask == 0 {
            return Some(0);
        }
        if let Some(&known) = self.memo.get(&mask) {
            return known;
        }
        let mut best = None;
        for set in self.sets(mask) {
            if let Some(rest) = self.best(mask & !set) {
                let s = self.set_score(set) + rest;
                if best.is_none_or(|b| s > b) {
                    best = Some(s);
                }
            }
        }
        self.memo.insert(mask, best);
        best
    }

    /// The answer set (a mask of GPU positions), or `None` when no partition is valid.
    fn best_set(&mut self) -> Option<u64> {
        let all = (0..self.n).fold(self.padding, |acc, i| acc | 1 << i);
        let target = self.best(all)?;
        // Retrace the first partition in enumeration order that reaches the best score: at
        // each step the first set whose best completion keeps the total.
        let mut partition = Vec::new();
        let (mut mask, mut remaining) = (all, target);
        while mask != 0 {
            let next = self.sets(mask).into_iter().find_map(|set| {
                let s = self.set_score(set);
                let rest = self.best(mask & !set)?;
                (s + rest == remaining).then_some((set, s, rest))
            })?;
            partition.push(next.0);
            mask &= !next.0;
            remaining = next.2;
        }
        let mut answer: Option<(u64, u64)> = None;
        for set in partition {
            if set & self.required != self.required || set & self.padding != 0 {
                continue;
            }
            let s = self.set_score(set);
            if answer.is_none_or(|(_, b)| s > b) {
                answer = Some((set, s));
            }
        }
        answer.map(|(set, _)| set)
    }
}

/// Whole GPUs beyond [`PARTITION_GPU_LIMIT`], where the partition search would be slow: the
/// set of `needed` candidates that, together with `must`, maximises
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

/// Calls `f` with every `k`-subset of `items` (bit positions) as a mask, in lexicographic
/// order of positions.
fn combinations(items: &[u32], k: usize, mut f: impl FnMut(u64)) {
    if k > items.len() {
        return;
    }
    let mut combo: Vec<usize> = (0..k).collect();
    loop {
        f(combo.iter().fold(0u64, |acc, &c| acc | 1 << items[c]));
        let Some(i) = (0..k).rev().find(|&i| combo[i] < items.len() - k + i) else {
            return;
        };
        combo[i] += 1;
        for j in i + 1..k {
            combo[j] = combo[j - 1] + 1;
        }
    }
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
    use crate::devices::{Health, MigInfo};
    use crate::devices::{TopologyLevel, link_score};

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
        // Must-include across islands: {1,5,6,4} and {1,5,6,7} leave equally good other halves;
        // the partition {0,2,3,4} {1,5,6,7} comes first.
        let got = preferred_allocation(&res, &all(8), &ids(&[5, 1, 6]), 4, &topo, D).unwrap();
        assert_eq!(got, ids(&[5, 1, 6, 7]));
        // size == must_include
        let got = preferred_allocation(&res, &all(8), &ids(&[3, 2]), 2, &topo, D).unwrap();
        assert_eq!(got, ids(&[3, 2]));
    }

    #[test]
    fn ties_go_to_index_order() {
        // go-gpuallocator has no NUMA tie-break: with nothing to tell GPUs apart, the first
        // partition in index order wins.
        let res = gpus(8, 4);
        let flat = Topology::new();
        let got = preferred_allocation(&res, &all(8), &[], 2, &flat, D).unwrap();
        assert_eq!(got, ids(&[0, 1]));
        // 8 GPUs padded to 9: {0,1,2} {3,4,5} {6,7,pad}, the must-include GPU's set answers.
        let got = preferred_allocation(&res, &all(8), &ids(&[5]), 3, &flat, D).unwrap();
        assert_eq!(got, ids(&[5, 3, 4]));
        // Numerical index order, whatever order the kubelet sends.
        let res = gpus(12, 12);
        let got = preferred_allocation(&res, &ids(&[11, 10, 2, 9]), &[], 2, &flat, D).unwrap();
        assert_eq!(got, ids(&[2, 9]));
    }

    /// go-gpuallocator's DGX-1 Volta table (`NewDGX1VoltaNode` in
    /// NVIDIA/go-gpuallocator gpuallocator/common_test.go): NVLink counts, then PCIe levels.
    fn dgx1_volta() -> Topology {
        use TopologyLevel::{HostBridge, Single, System};
        let nvlinks = [
            (0, 1, 1),
            (0, 2, 1),
            (0, 3, 2),
            (0, 4, 2),
            (1, 2, 2),
            (1, 3, 1),
            (1, 5, 2),
            (2, 3, 2),
            (2, 6, 1),
            (3, 7, 1),
            (4, 5, 1),
            (4, 6, 1),
            (4, 7, 2),
            (5, 6, 2),
            (5, 7, 1),
            (6, 7, 2),
        ];
        let mut t = Topology::new();
        for a in 0..8 {
            for b in a + 1..8 {
                let level = if a / 4 != b / 4 {
                    System
                } else if a / 2 == b / 2 {
                    Single
                } else {
                    HostBridge
                };
                let links = nvlinks.iter().find(|(x, y, _)| (*x, *y) == (a, b)).map_or(0, |l| l.2);
                t.set(&uuid(a), &uuid(b), link_score(links, Some(level)));
            }
        }
        t
    }

    #[test]
    fn best_effort_partitions_like_go_gpuallocator() {
        // TestBestEffortAllocate in go-gpuallocator gpuallocator/besteffort_test.go.
        let res = gpus(8, 4);
        let t = dgx1_volta();
        type Case<'a> = (&'a [usize], &'a [usize], usize, &'a [usize]);
        let cases: [Case; 7] = [
            (&[0, 2, 4, 5], &[], 2, &[4, 5]),
            (&[0, 4, 5, 6], &[], 2, &[5, 6]),
            (&[0, 3, 1], &[], 2, &[0, 3]),
            (&[0, 1, 4], &[], 2, &[0, 4]),
            (&[0, 1, 2, 3, 4, 5, 6, 7], &[4], 1, &[4]),
            (&[0, 1, 2, 3, 4, 5, 6, 7], &[4], 2, &[4, 7]),
            (&[0, 1, 2, 3, 4, 5, 6, 7], &[4], 4, &[4, 5, 6, 7]),
        ];
        for (avail, must, size, want) in cases {
            let got = preferred_allocation(&res, &ids(avail), &ids(must), size, &t, D).unwrap();
            let mut got_sorted = got.clone();
            got_sorted.sort();
            assert_eq!(got_sorted, ids(want), "available {avail:?} must {must:?} size {size}");
            assert_eq!(got[..must.len()], ids(must)[..]);
        }
        // Successive pairs (TestBestEffortDGX1VoltaGPUAllocTwo): each answer leaves the next.
        let mut free: Vec<usize> = (0..8).collect();
        for want in [[0, 3], [1, 2], [4, 7], [5, 6]] {
            let got = preferred_allocation(&res, &ids(&free), &[], 2, &t, D).unwrap();
            assert_eq!(got, ids(&want));
            free.retain(|g| !want.contains(g));
        }
    }

    #[test]
    fn padded_sets_are_never_the_answer() {
        // 5 GPUs, size 3: padded to 6. GPUs 3 and 4 are the best pair, so the best partition is
        // {0,1,2} {3,4,pad}, whose padded set scores highest; the answer is the full set.
        let res = gpus(5, 5);
        let mut t = Topology::new();
        t.set(&uuid(3), &uuid(4), 1000);
        t.set(&uuid(0), &uuid(1), 10);
        let got = preferred_allocation(&res, &all(5), &[], 3, &t, D).unwrap();
        assert_eq!(got, ids(&[0, 1, 2]));
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

    const P: SharedPolicy = SharedPolicy::Packed;
    const S: SharedPolicy = SharedPolicy::Spread;

    fn replica(g: usize, n: usize) -> String {
        format!("{}::{n}", uuid(g))
    }

    /// Every replica of `gpus` GPUs × `replicas` except those `taken`.
    fn free(gpus: usize, replicas: usize, taken: &[(usize, usize)]) -> Vec<String> {
        (0..gpus)
            .flat_map(|g| (0..replicas).map(move |n| (g, n)))
            .filter(|p| !taken.contains(p))
            .map(|(g, n)| replica(g, n))
            .collect()
    }

    #[test]
    fn issue_example_packed_fills_the_busiest_gpu() {
        // 8 GPUs × 4 replicas, one replica each of GPUs 0 and 1 in use, 2 replicas wanted.
        let res = replicated(8, 4);
        let t = Topology::new();
        let avail = free(8, 4, &[(0, 0), (1, 0)]);
        // NVIDIA's packed keeps taking the most allocated GPU: both from GPU 0.
        let got = preferred_allocation(&res, &avail, &[], 2, &t, P).unwrap();
        assert_eq!(got, [replica(0, 1), replica(0, 2)]);
        // distributed: the least allocated GPUs, rotating on ties (PR #1788).
        let got = preferred_allocation(&res, &avail, &[], 2, &t, D).unwrap();
        assert_eq!(got, [replica(2, 0), replica(3, 0)]);
        let got = preferred_allocation(&res, &avail, &[], 2, &t, S).unwrap();
        assert_eq!(got, [replica(2, 0), replica(3, 0)]);
    }

    #[test]
    fn distributed_and_packed_follow_allocated_counts() {
        let res = replicated(2, 4);
        let t = Topology::new();
        // PR #1788's case: GPU 0 has one in use; distributed takes one from each.
        let avail = free(2, 4, &[(0, 0)]);
        let got = preferred_allocation(&res, &avail, &[], 2, &t, D).unwrap();
        assert_eq!(got, [replica(1, 0), replica(0, 1)]);
        let got = preferred_allocation(&res, &avail, &[], 3, &t, D).unwrap();
        assert_eq!(got, [replica(1, 0), replica(0, 1), replica(1, 1)]);
        let got = preferred_allocation(&res, &avail, &[], 3, &t, P).unwrap();
        assert_eq!(got, [replica(0, 1), replica(0, 2), replica(0, 3)]);
        // GPU 0 has two in use: distributed puts both on the idle GPU 1 (no distinct-GPU rule:
        // after one pick GPU 1 has 1 allocated, still fewer than 2).
        let avail = free(2, 4, &[(0, 0), (0, 1)]);
        let got = preferred_allocation(&res, &avail, &[], 2, &t, D).unwrap();
        assert_eq!(got, [replica(1, 0), replica(1, 1)]);
        let got = preferred_allocation(&res, &avail, &[], 2, &t, P).unwrap();
        assert_eq!(got, [replica(0, 2), replica(0, 3)]);
        // Packed overflows to the next GPU once the busiest is full.
        let got = preferred_allocation(&res, &avail, &[], 3, &t, P).unwrap();
        assert_eq!(got, [replica(0, 2), replica(0, 3), replica(1, 0)]);
        // A must-include replica counts as allocated on its GPU.
        let avail = free(2, 4, &[]);
        let got = preferred_allocation(&res, &avail, &[replica(0, 3)], 2, &t, P).unwrap();
        assert_eq!(got, [replica(0, 3), replica(0, 0)]);
        let got = preferred_allocation(&res, &avail, &[replica(1, 2)], 2, &t, D).unwrap();
        assert_eq!(got, [replica(1, 2), replica(0, 0)]);
        // Only one GPU has replicas free: the request still fits, on that GPU.
        let avail = free(2, 4, &[(1, 0), (1, 1), (1, 2), (1, 3)]);
        let got = preferred_allocation(&res, &avail, &[], 2, &t, D).unwrap();
        assert_eq!(got, [replica(0, 0), replica(0, 1)]);
    }

    #[test]
    fn spread_takes_distinct_gpus_first() {
        // PR #1936's example: GPU 0 has 5 of 8 in use, GPU 1 has 3; 2 wanted.
        let res = replicated(2, 8);
        let t = Topology::new();
        let taken: Vec<(usize, usize)> = (0..5).map(|n| (0, n)).chain((0..3).map(|n| (1, n))).collect();
        let avail = free(2, 8, &taken);
        let got = preferred_allocation(&res, &avail, &[], 2, &t, D).unwrap();
        assert_eq!(got, [replica(1, 3), replica(1, 4)]);
        let got = preferred_allocation(&res, &avail, &[], 2, &t, S).unwrap();
        assert_eq!(got, [replica(1, 3), replica(0, 5)]);
        let got = preferred_allocation(&res, &avail, &[], 3, &t, S).unwrap();
        assert_eq!(got, [replica(1, 3), replica(0, 5), replica(1, 4)]);
        // A must-include replica's GPU counts as picked under spread only.
        let avail = free(2, 4, &[(1, 0), (1, 1)]);
        let got = preferred_allocation(&res4(), &avail, &[replica(0, 3)], 2, &t, S).unwrap();
        assert_eq!(got, [replica(0, 3), replica(1, 2)]);
        let got = preferred_allocation(&res4(), &avail, &[replica(0, 3)], 2, &t, D).unwrap();
        assert_eq!(got, [replica(0, 3), replica(0, 0)]);
    }

    fn res4() -> Resource {
        replicated(2, 4)
    }

    #[test]
    fn replicas_order_numerically() {
        let res = replicated(2, 12);
        let t = Topology::new();
        // GPU 0: replicas 2, 10, 11 free (9 allocated); GPU 1: 3, 4 free (10 allocated).
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
        let got = preferred_allocation(&res, &avail, &[], 1, &t, P).unwrap();
        assert_eq!(got, [replica(1, 3)]);
    }

    #[test]
    fn mig_devices_are_their_own_buckets() {
        // NVIDIA v0.20 buckets by AnnotatedID.GetID(): a MIG device is its own bucket with one
        // device, so every candidate has 0 allocated and the policies agree (index order).
        let res = migs(3);
        let t = Topology::new();
        let every = s(&["MIG-0-0", "MIG-0-1", "MIG-0-2", "MIG-1-0", "MIG-1-1", "MIG-1-2"]);
        for policy in [D, P, S] {
            let got = preferred_allocation(&res, &every, &[], 2, &t, policy).unwrap();
            assert_eq!(got, s(&["MIG-0-0", "MIG-0-1"]), "{policy:?}");
            let got = preferred_allocation(&res, &every[1..], &[], 1, &t, policy).unwrap();
            assert_eq!(got, s(&["MIG-0-1"]), "{policy:?}");
            let got = preferred_allocation(&res, &every, &s(&["MIG-1-1"]), 2, &t, policy).unwrap();
            assert_eq!(got, s(&["MIG-1-1", "MIG-0-0"]), "{policy:?}");
        }
        // Time-sliced MIG devices: replicas bucket by their MIG device.
        let mut devices = BTreeMap::new();
        for (id, dev) in &res.devices {
            for n in 0..2 {
                devices.insert(format!("{id}::{n}"), dev.clone());
            }
        }
        let shared = Resource {
            name: "nvidia.com/mig-1g.5gb".into(),
            devices,
        };
        let avail: Vec<String> = shared.devices.keys().filter(|k| *k != "MIG-1-2::0").cloned().collect();
        let got = preferred_allocation(&shared, &avail, &[], 2, &t, P).unwrap();
        assert_eq!(got, s(&["MIG-1-2::1", "MIG-0-0::0"]));
        let got = preferred_allocation(&shared, &avail, &[], 2, &t, D).unwrap();
        assert_eq!(got, s(&["MIG-0-0::0", "MIG-0-1::0"]));
    }

    /// A naive reference for go-gpuallocator's `Allocate`: every partition, in its enumeration
    /// order, is scored (the one difference kept: a set with padding is never the answer).
    /// Returns the answer mask.
    fn go_best_effort(n: usize, size: usize, score: &[u64], required: u64) -> Option<u64> {
        fn sets_of(devs: &[usize], k: usize, f: &mut dyn FnMut(&[usize])) {
            let mut combo: Vec<usize> = (0..k).collect();
            if k > devs.len() {
                return;
            }
            loop {
                let set: Vec<usize> = combo.iter().map(|&c| devs[c]).collect();
                f(&set);
                let Some(i) = (0..k).rev().find(|&i| combo[i] < devs.len() - k + i) else {
                    return;
                };
                combo[i] += 1;
                for j in i + 1..k {
                    combo[j] = combo[j - 1] + 1;
                }
            }
        }
        fn iterate(
            devs: &[usize],
            size: usize,
            n: usize,
            padding: usize,
            accum: &mut Vec<Vec<usize>>,
            cb: &mut dyn FnMut(&[Vec<usize>]),
        ) {
            if devs.len() == size {
                accum.push(devs.to_vec());
                cb(accum);
                accum.pop();
                return;
            }
            sets_of(&devs[1..], size - 1, &mut |rest: &[usize]| {
                let mut set = vec![devs[0]];
                set.extend_from_slice(rest);
                let p = set.iter().filter(|&&d| d >= n).count();
                if p != 0 && p != padding {
                    return;
                }
                let remaining: Vec<usize> = devs.iter().copied().filter(|d| !set.contains(d)).collect();
                accum.push(set);
                iterate(&remaining, size, n, padding, accum, cb);
                accum.pop();
            });
        }
        let mask = |set: &[usize]| set.iter().fold(0u64, |a, &d| a | 1 << d);
        let set_score = |set: &[usize]| {
            let mut s = 0;
            for (x, &i) in set.iter().enumerate() {
                for &j in &set[x + 1..] {
                    if i < n && j < n {
                        s += score[i * n + j];
                    }
                }
            }
            s
        };
        let pad_mask = |set: &[usize]| set.iter().any(|&d| d >= n);
        let total = n.div_ceil(size) * size;
        let devs: Vec<usize> = (0..total).collect();
        let mut best: Option<(u64, Vec<Vec<usize>>)> = None;
        let mut consider = |partition: &[Vec<usize>]| {
            let ok = partition
                .iter()
                .any(|set| mask(set) & required == required && !pad_mask(set));
            if !ok {
                return;
            }
            let sc: u64 = partition.iter().map(|set| set_score(set)).sum();
            if best.as_ref().is_none_or(|(b, _)| sc > *b) {
                best = Some((sc, partition.to_vec()));
            }
        };
        if size == 1 {
            for d in 0..n {
                consider(&[vec![d]]);
            }
        } else {
            iterate(&devs, size, n, total - n, &mut Vec::new(), &mut consider);
        }
        let (_, partition) = best?;
        let mut answer: Option<(u64, u64)> = None;
        for set in &partition {
            if mask(set) & required != required || pad_mask(set) {
                continue;
            }
            let sc = set_score(set);
            if answer.is_none_or(|(_, b)| sc > b) {
                answer = Some((mask(set), sc));
            }
        }
        answer.map(|(m, _)| m)
    }

    #[test]
    fn partition_search_matches_the_naive_enumeration() {
        // Pseudo-random scores with many ties (few distinct values), every size, must-include
        // sets of 0..=2 GPUs.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for n in 1..=8usize {
            for round in 0..6 {
                let mut score = vec![0u64; n * n];
                for i in 0..n {
                    for j in i + 1..n {
                        let v = [10, 20, 30, 110, 130, 250][(next() % 6) as usize];
                        let v = if round == 0 { 10 } else { v };
                        score[i * n + j] = v;
                        score[j * n + i] = v;
                    }
                }
                for size in 1..=n {
                    let musts: [u64; 4] = [0, 1 << (next() % n as u64), (1 << (n - 1)) | 1, 0b110];
                    for required in musts {
                        if required.count_ones() as usize > size || required >> n != 0 {
                            continue;
                        }
                        let want = go_best_effort(n, size, &score, required);
                        let got = Partitions::new(n, size, score.clone(), required).best_set();
                        assert_eq!(got, want, "n {n} size {size} required {required:b} round {round}");
                    }
                }
            }
        }
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
