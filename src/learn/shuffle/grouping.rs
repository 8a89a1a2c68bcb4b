//! The shuffle step's second half: which reflections go to which level-1
//! aggregator call. Combee cuts the augmented, shuffled list into k = ⌊√n⌋
//! contiguous groups that run in parallel; the `naive` and `sequential`
//! baselines use the same code path with a different grouping, so a benchmark
//! compares methods and nothing else.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::augment::augmented_indices;

/// Size of a sequential (GEPA-default) minibatch.
pub const SEQUENTIAL_BATCH: usize = 3;

/// Largest group bound under which Combee's copies are laid out in layers
/// (see [`plan_sized`]), so that no group holds a reflection twice.
pub const LAYERED_BELOW: usize = 3;

use crate::domain::Method;

/// Whether the groups of a plan are aggregated against the same frozen version
/// and merged once, or applied one after another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Execution {
    Parallel,
    Sequential,
}

/// The grouping of one round: `groups[g]` lists indices into the round's reflections.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub method: Method,
    pub execution: Execution,
    pub groups: Vec<Vec<usize>>,
}

/// k = max(1, ⌊√n⌋) where n is the number of traces (not the augmented length).
pub fn combee_group_count(n: usize) -> usize {
    n.isqrt().max(1)
}

/// Cuts `0..len` into `k` contiguous ranges whose sizes differ by at most one;
/// the larger ranges come first. With `len < k` only `len` ranges (of one item)
/// are returned so none is empty; `k = 0` is treated as 1; `len = 0` gives none.
pub fn split_contiguous(len: usize, k: usize) -> Vec<Range<usize>> {
    if len == 0 {
        return Vec::new();
    }
    let k = k.clamp(1, len);
    let (base, extra) = (len / k, len % k);
    let mut start = 0;
    (0..k)
        .map(|g| {
            let size = base + usize::from(g < extra);
            let r = start..start + size;
            start += size;
            r
        })
        .collect()
}

/// Consecutive batches of `size` (the last may be shorter), in order.
pub fn sequential_batches(len: usize, size: usize) -> Vec<Range<usize>> {
    let size = size.max(1);
    (0..len).step_by(size).map(|s| s..(s + size).min(len)).collect()
}

/// The groups for `n` reflections under `method`. `p` (duplication, at least 1)
/// and `seed` only matter for Combee; the same inputs always give the same plan.
pub fn plan(method: Method, n: usize, p: u32, seed: u64) -> Plan {
    plan_sized(method, n, p, seed, None, None)
}

/// Combee's group count when no group may hold more than `max_group` of the
/// p·n augmented reflections: k = max(⌊√n⌋, ⌈p·n / max_group⌉) — the paper's
/// ⌊√n⌋ is the special case of a size bound it already meets.
pub fn capacity_group_count(n: usize, p: u32, max_group: Option<usize>) -> usize {
    let paper = combee_group_count(n);
    match max_group {
        Some(g) => paper.max((n * p.max(1) as usize).div_ceil(g.max(1))),
        None => paper,
    }
}

/// [`plan`] with Combee's groups bounded by `max_group` reflections each
/// (see [`capacity_group_count`]); the baselines ignore the bound. With a
/// `probe_group` (and p ≥ 2) the copies are cut in layers instead
/// ([`layered_groups`]): p − 1 copies of every reflection in groups of at most
/// `max_group`, the last copy in groups of at most `probe_group`. So are they
/// when `max_group` is at most [`LAYERED_BELOW`] without a probe: cut from one
/// shuffled list, such small groups would often hold two copies of one
/// reflection, a group of one in disguise.
pub fn plan_sized(
    method: Method,
    n: usize,
    p: u32,
    seed: u64,
    max_group: Option<usize>,
    probe_group: Option<usize>,
) -> Plan {
    match method {
        Method::Combee => {
            let groups = match (max_group, probe_group) {
                (Some(base), Some(probe)) if p >= 2 && n > 0 => {
                    let sizes: Vec<usize> = (0..p).map(|c| if c + 1 == p { probe } else { base }).collect();
                    layered_groups(n, &sizes, seed)
                }
                (Some(base), None) if p >= 2 && n > 0 && base <= LAYERED_BELOW => {
                    layered_groups(n, &vec![base; p as usize], seed)
                }
                _ => {
                    let augmented = augmented_indices(n, p.max(1), seed);
                    split_contiguous(augmented.len(), capacity_group_count(n, p, max_group))
                        .into_iter()
                        .map(|r| augmented[r].to_vec())
                        .collect()
                }
            };
            Plan { method, execution: Execution::Parallel, groups }
        }
        Method::Naive => {
            let groups = if n == 0 { Vec::new() } else { vec![(0..n).collect()] };
            Plan { method, execution: Execution::Parallel, groups }
        }
        Method::Sequential => Plan {
            method,
            execution: Execution::Sequential,
            groups: sequential_batches(n, SEQUENTIAL_BATCH).into_iter().map(|r| r.collect()).collect(),
        },
    }
}

/// One copy of every reflection per entry of `sizes`: each copy layer is its
/// own seeded shuffle of the n reflections, cut into ⌈n / size⌉ near-equal
/// contiguous groups. Two copies of a reflection never share a group, and each
/// layer's groups have that layer's size — so one round measures several sizes
/// (the overload meter's samples) while every reflection keeps a copy in a group
/// of the size it was vouched for.
pub fn layered_groups(n: usize, sizes: &[usize], seed: u64) -> Vec<Vec<usize>> {
    let mut groups = Vec::new();
    for (layer, &size) in sizes.iter().enumerate() {
        let order = augmented_indices(n, 1, seed.wrapping_add(layer as u64).rotate_left(7 * layer as u32));
        for r in split_contiguous(n, n.div_ceil(size.max(1))) {
            groups.push(order[r].to_vec());
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_count_is_floor_sqrt_at_least_one() {
        for (n, k) in [(0, 1), (1, 1), (3, 1), (4, 2), (15, 3), (16, 4), (100, 10), (99, 9)] {
            assert_eq!(combee_group_count(n), k, "n = {n}");
        }
    }

    #[test]
    fn contiguous_split_is_near_equal_and_covers_everything() {
        for len in 0..40 {
            for k in 0..12 {
                let parts = split_contiguous(len, k);
                let covered: Vec<usize> = parts.iter().cloned().flatten().collect();
                assert_eq!(covered, (0..len).collect::<Vec<_>>());
                assert!(parts.iter().all(|r| !r.is_empty()));
                if len >= k.max(1) {
                    assert_eq!(parts.len(), k.max(1));
                }
                let sizes: Vec<usize> = parts.iter().map(|r| r.len()).collect();
                if let (Some(max), Some(min)) = (sizes.iter().max(), sizes.iter().min()) {
                    assert!(max - min <= 1, "len {len} k {k}: {sizes:?}");
                }
            }
        }
        assert_eq!(split_contiguous(10, 3), vec![0..4, 4..7, 7..10]);
    }

    #[test]
    fn sequential_batches_are_threes_in_order() {
        assert_eq!(sequential_batches(7, 3), vec![0..3, 3..6, 6..7]);
        assert!(sequential_batches(0, 3).is_empty());
    }

    #[test]
    fn combee_groups_cover_every_reflection_exactly_p_times() {
        for n in [1, 3, 4, 15, 16, 100] {
            for p in [1, 2, 3] {
                let plan = plan(Method::Combee, n, p, 99);
                assert_eq!(plan.groups.len(), combee_group_count(n).min(n * p as usize));
                assert_eq!(plan.execution, Execution::Parallel);
                let mut counts = vec![0u32; n];
                for g in &plan.groups {
                    for &i in g {
                        counts[i] += 1;
                    }
                }
                assert!(counts.iter().all(|&c| c == p), "n {n} p {p}");
            }
        }
    }

    #[test]
    fn a_group_size_bound_adds_groups_but_never_fewer_than_the_papers() {
        for (n, p, g) in [(300, 2, 8), (100, 2, 2), (40, 2, 4), (17, 3, 5), (9, 2, 100), (1, 2, 1)] {
            let plan = plan_sized(Method::Combee, n, p, 7, Some(g), None);
            let k = plan.groups.len();
            assert!(k >= combee_group_count(n).min(n * p as usize), "n {n} p {p} g {g}: {k}");
            assert!(plan.groups.iter().all(|grp| grp.len() <= g.max(n * p as usize / k)), "n {n} g {g}");
            if (n * p as usize).div_ceil(combee_group_count(n)) > g {
                assert!(plan.groups.iter().all(|grp| grp.len() <= g), "n {n} p {p} g {g}");
            }
            let mut counts = vec![0u32; n];
            plan.groups.iter().flatten().for_each(|&i| counts[i] += 1);
            assert!(counts.iter().all(|&c| c == p), "every reflection p times");
        }
        assert_eq!(capacity_group_count(300, 2, Some(8)), 75);
        assert_eq!(capacity_group_count(300, 2, None), 17);
        assert_eq!(capacity_group_count(16, 2, Some(100)), 4);
        assert_eq!(
            plan_sized(Method::Naive, 5, 2, 1, Some(2), None).groups.len(),
            1,
            "naive is one call by definition"
        );
    }

    #[test]
    fn a_probe_puts_the_last_copy_in_larger_groups_and_never_two_copies_together() {
        let plan = plan_sized(Method::Combee, 40, 2, 3, Some(4), Some(8));
        let (small, large): (Vec<_>, Vec<_>) = plan.groups.iter().partition(|g| g.len() <= 4);
        assert_eq!((small.len(), large.len()), (10, 5));
        assert!(large.iter().all(|g| g.len() == 8));
        let mut counts = [0u32; 40];
        for g in &plan.groups {
            let distinct: std::collections::HashSet<&usize> = g.iter().collect();
            assert_eq!(distinct.len(), g.len(), "a copy twice in one group: {g:?}");
            g.iter().for_each(|&i| counts[i] += 1);
        }
        assert!(counts.iter().all(|&c| c == 2));
        assert_eq!(plan, plan_sized(Method::Combee, 40, 2, 3, Some(4), Some(8)), "reproducible");
        // p = 1 has no second copy to probe with: the probe is ignored.
        assert_eq!(plan_sized(Method::Combee, 40, 1, 3, Some(4), Some(8)).groups.len(), 10);
    }

    #[test]
    fn combee_plan_is_reproducible_from_its_seed() {
        assert_eq!(plan(Method::Combee, 30, 2, 5), plan(Method::Combee, 30, 2, 5));
        assert_ne!(plan(Method::Combee, 30, 2, 5), plan(Method::Combee, 30, 2, 6));
    }

    #[test]
    fn baselines_group_without_shuffle() {
        let naive = plan(Method::Naive, 5, 2, 1);
        assert_eq!(naive.groups, vec![vec![0, 1, 2, 3, 4]]);
        let seq = plan(Method::Sequential, 7, 2, 1);
        assert_eq!(seq.execution, Execution::Sequential);
        assert_eq!(seq.groups, vec![vec![0, 1, 2], vec![3, 4, 5], vec![6]]);
        assert!(plan(Method::Naive, 0, 2, 1).groups.is_empty());
    }

    #[test]
    fn method_serializes_lowercase() {
        assert_eq!(serde_json::to_string(&Method::Sequential).unwrap(), "\"sequential\"");
        assert_eq!(serde_json::from_str::<Method>("\"combee\"").unwrap(), Method::Combee);
    }
}
