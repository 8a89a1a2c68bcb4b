//! The overload meter: how much of what a level-1 aggregator call is given it
//! keeps, as a function of the call's group size — measured from the product's
//! own provenance, without knowing which reflections held an insight.
//!
//! With duplication p ≥ 2 every reflection sits in at least two groups. Each
//! group's answer cites the reflections its operations came from, so each copy
//! is either *covered* (its group cited it) or not. That is capture–recapture:
//! if a reflection's other copy was covered, the reflection certainly holds
//! something worth keeping, and whether *this* copy was covered too is a fair
//! draw of the per-copy retention r of this copy's group size. So, per size
//! bucket, r̂ = recaptured / marked, where *marked* counts copies whose
//! reflection was covered by another of its copies, and *recaptured* those of
//! them covered by their own group as well. For p = 2 and one bucket this is
//! the Lincoln–Petersen form r̂ = 2B / (2B + O) (B: both copies covered, O:
//! exactly one). Reflections neither copy covered carry no information about r
//! (no insight, or lost twice) and are not counted; nor are reflections whose
//! copies landed in the same group, or copies in a group that was left out.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::domain::GroupOutput;

/// Copies in a size bucket whose reflection another copy covered (`marked`),
/// and how many of them their own group covered too (`recaptured`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct BucketCounts {
    pub marked: u64,
    pub recaptured: u64,
}

impl BucketCounts {
    /// r̂ = recaptured / marked; `None` before anything was marked.
    pub fn estimate(&self) -> Option<f64> {
        (self.marked > 0).then(|| self.recaptured as f64 / self.marked as f64)
    }
}

/// The bucket of a group of `size` distinct reflections: sizes
/// `[2^j, 2^(j+1))` share one, named by its smallest size (1, 2, 4, 8, …).
pub fn bucket_of(size: usize) -> u32 {
    if size == 0 { 0 } else { 1u32 << size.ilog2() }
}

/// The largest size in the bucket that starts at `min`.
pub fn bucket_max(min: u32) -> u32 {
    if min == 0 { 0 } else { min.saturating_mul(2) - 1 }
}

/// Which reflections (trace ids) one group output cites: its operations'
/// `sources` are 0-based positions in the group's `traces`.
fn covered_by(out: &GroupOutput) -> HashSet<Uuid> {
    let Some(ops) = out.output.get("operations").and_then(|v| v.as_array()) else { return HashSet::new() };
    ops.iter()
        .filter_map(|op| op.get("sources")?.as_array())
        .flatten()
        .filter_map(|p| out.traces.get(usize::try_from(p.as_u64()?).ok()?).copied())
        .collect()
}

/// The meter's counts from one round's level-1 outputs (groups left out of the
/// round have no output and so do not count), by bucket.
pub fn observe(outputs: &[GroupOutput]) -> BTreeMap<u32, BucketCounts> {
    // Per reflection: for each group holding it, (bucket, covered).
    let mut copies: HashMap<Uuid, Vec<(u32, bool)>> = HashMap::new();
    for out in outputs {
        let covered = covered_by(out);
        let bucket = bucket_of(out.traces.len());
        let distinct: HashSet<&Uuid> = out.traces.iter().collect();
        for t in distinct {
            copies.entry(*t).or_default().push((bucket, covered.contains(t)));
        }
    }
    let mut counts: BTreeMap<u32, BucketCounts> = BTreeMap::new();
    for held in copies.values().filter(|h| h.len() >= 2) {
        let total = held.iter().filter(|(_, c)| *c).count();
        for &(bucket, covered) in held {
            let others = total - usize::from(covered);
            if others > 0 {
                let c = counts.entry(bucket).or_default();
                c.marked += 1;
                c.recaptured += u64::from(covered);
            }
        }
    }
    counts
}

/// One bucket of the meter as stored and shown.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MeterBucket {
    /// Smallest group size (distinct reflections) in the bucket.
    pub size_min: u32,
    /// Largest group size in the bucket.
    pub size_max: u32,
    /// Estimated per-group retention r̂ (0..=1): the share of a group's
    /// insights its answer keeps. `None` until a copy was marked.
    pub retention: Option<f64>,
    /// Copies the estimate rests on (marked copies).
    pub samples: u64,
    /// Of them, covered by their own group too.
    pub recaptured: u64,
    /// Rounds that contributed.
    pub rounds: u64,
}

impl MeterBucket {
    pub fn new(size_min: u32, counts: BucketCounts, rounds: u64) -> Self {
        Self {
            size_min,
            size_max: bucket_max(size_min),
            retention: counts.estimate(),
            samples: counts.marked,
            recaptured: counts.recaptured,
            rounds,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn id(i: u128) -> Uuid {
        Uuid::from_u128(i)
    }

    /// A group of traces `members` whose answer cites the members at `cited` positions.
    fn group(g: usize, members: &[u128], cited: &[usize]) -> GroupOutput {
        let ops: Vec<_> = cited
            .iter()
            .map(|p| json!({"op": "ADD", "section": "s", "content": format!("lesson {p}"), "reason": "", "sources": [p]}))
            .collect();
        GroupOutput {
            group: g,
            traces: members.iter().map(|&i| id(i)).collect(),
            output: json!({ "operations": ops }),
            key: String::new(),
        }
    }

    #[test]
    fn buckets_are_powers_of_two() {
        assert_eq!([1, 2, 3, 4, 7, 8, 15, 16, 100].map(bucket_of), [1, 2, 2, 4, 4, 8, 8, 16, 64]);
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_max(8), 15);
    }

    #[test]
    fn two_copies_of_four_reflections_give_the_lincoln_petersen_estimate() {
        // Reflections 1..=4 in group A and again in group B (size 4 each).
        // 1: both cover (B), 2: only A, 3: only B (O = 2), 4: neither.
        let a = group(0, &[1, 2, 3, 4], &[0, 1]);
        let b = group(1, &[3, 1, 4, 2], &[0, 1]);
        let counts = observe(&[a, b]);

        assert_eq!(counts[&4], BucketCounts { marked: 4, recaptured: 2 });
        // 2B / (2B + O) = 2 / (2 + 2).
        assert_eq!(counts[&4].estimate(), Some(0.5));
    }

    #[test]
    fn copies_in_groups_of_different_sizes_count_in_their_own_bucket() {
        // Small group (2) keeps everything; large group (8) keeps a quarter.
        let small1 = group(0, &[1, 2], &[0, 1]);
        let small2 = group(1, &[3, 4], &[0, 1]);
        let small3 = group(2, &[5, 6], &[0, 1]);
        let small4 = group(3, &[7, 8], &[0, 1]);
        let large = group(4, &[1, 2, 3, 4, 5, 6, 7, 8], &[0, 1]);
        let counts = observe(&[small1, small2, small3, small4, large]);
        // Only the small copies of 1 and 2 are marked (the large group covered just those).
        assert_eq!(counts[&2], BucketCounts { marked: 2, recaptured: 2 });
        assert_eq!(counts[&8], BucketCounts { marked: 8, recaptured: 2 });
        assert_eq!(counts[&8].estimate(), Some(0.25));
        assert_eq!(counts[&2].estimate(), Some(1.0));
    }

    #[test]
    fn a_reflection_in_one_group_only_or_never_covered_tells_nothing() {
        // 1 and 2 are only in group 0 (both copies landed there); 3 is never covered.
        let a = group(0, &[1, 2, 3], &[0, 1]);
        let b = group(1, &[3, 4], &[1]);
        let counts = observe(&[a, b]);
        assert!(counts.is_empty(), "{counts:?}");
        assert_eq!(BucketCounts::default().estimate(), None);
    }

    #[test]
    fn three_copies_mark_each_other() {
        // p = 3: reflection 1 in three groups of size 1; two cover it.
        let outs = [group(0, &[1], &[0]), group(1, &[1], &[0]), group(2, &[1], &[])];
        // Each copy has another covered copy: 3 marked, 2 recaptured.
        assert_eq!(observe(&outs)[&1], BucketCounts { marked: 3, recaptured: 2 });
    }

    #[test]
    fn a_group_citing_past_its_members_is_not_miscounted() {
        let a = group(0, &[1, 2], &[0, 5]);
        let b = group(1, &[1, 2], &[0]);
        assert_eq!(observe(&[a, b])[&2], BucketCounts { marked: 2, recaptured: 2 });
    }
}
