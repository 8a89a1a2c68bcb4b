//! Capacity-aware group size: how many reflections one level-1 aggregator call
//! may be given, chosen from the overload meter ([`super::meter`]) instead of
//! the paper's fixed ⌊√n⌋ groups — a model keeps only so much of what one call
//! is given, and the meter measures how much, per group size, for this prompt.
//!
//! The rule ([`choose_group_size`]), over the meter's size buckets that have
//! *enough* samples (at least [`MIN_METER_SAMPLES`] marked copies):
//! 1. no bucket measured enough (or the meter cannot measure: p = 1, or a
//!    rewrite prompt): the paper's ⌊√n⌋ groups ([`SizeSource::Default`]);
//! 2. the largest measured bucket whose estimated retention is ≥
//!    `target_retention`, below every measured bucket that misses it: groups
//!    of at most that bucket's smallest size ([`SizeSource::Meter`]) — the
//!    smallest size, because retention falls with size and a bucket's estimate
//!    is an average over its sizes;
//! 3. every measured bucket misses the target: half the smallest one, to be
//!    measured next ([`SizeSource::Probe`]); when that is already size 1 no size
//!    holds the target ([`SizeSource::NoSizeHolds`]), groups of one.
//!
//! The size is an upper bound: a plan never has fewer than ⌊√n⌋ groups, so the
//! paper's grouping is the special case of a meter that vouches for large groups.

use serde::{Deserialize, Serialize};

use super::meter::MeterBucket;

/// Marked copies a size bucket needs before its estimate is used ("enough").
/// With p = 2 one round of 20 traces gives a bucket about 40 copies, of which
/// the marked share is the retention itself, so one such round suffices down to
/// about 50 % retention; the binomial error at 20 samples and r = 0.9 is ±7 points.
pub const MIN_METER_SAMPLES: u64 = 20;

/// Default `target_retention`: the share of a group's insights its answer
/// should keep (with p = 2 copies that is ≈ 99 % of the round's).
pub const DEFAULT_TARGET_RETENTION: f64 = 0.9;

/// Where a round's group size came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "source", rename_all = "snake_case")]
pub enum SizeSource {
    /// The paper's ⌊√n⌋ groups: the meter has not measured enough (or cannot).
    Default { why: String },
    /// The meter: the largest measured size bucket holding the target.
    Meter { bucket_min: u32, retention: f64, samples: u64 },
    /// Every measured bucket misses the target: trying a smaller size.
    Probe { below_target_at: u32, retention: f64 },
    /// Even groups of one reflection miss the target.
    NoSizeHolds { retention: f64 },
}

impl SizeSource {
    /// One line for the round record and the controller page.
    pub fn message(&self) -> String {
        match self {
            Self::Default { why } => format!("the paper's ⌊√n⌋ groups: {why}"),
            Self::Meter { bucket_min, retention, samples } => format!(
                "overload meter: groups of up to {bucket_min} keep an estimated {:.0}% ({samples} samples)",
                100.0 * retention
            ),
            Self::Probe { below_target_at, retention } => format!(
                "overload meter: groups of {below_target_at} keep only {:.0}%; trying smaller groups",
                100.0 * retention
            ),
            Self::NoSizeHolds { retention } => format!(
                "overload meter: even single-reflection calls keep only {:.0}%; no group size holds the target",
                100.0 * retention
            ),
        }
    }

    /// Whether the size rests on a measurement that holds the target.
    pub fn holds_target(&self) -> bool {
        matches!(self, Self::Meter { .. })
    }
}

/// The group size a round uses: `max_group` reflections per level-1 call at
/// most (`None`: the paper's ⌊√n⌋ groups), and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupSize {
    pub max_group: Option<usize>,
    #[serde(flatten)]
    pub source: SizeSource,
}

impl Default for GroupSize {
    fn default() -> Self {
        Self::default_because("no group size bound was given")
    }
}

impl GroupSize {
    pub fn default_because(why: &str) -> Self {
        Self { max_group: None, source: SizeSource::Default { why: why.to_owned() } }
    }
}

/// The rule in the module doc. `buckets` as the meter shows them (any order).
pub fn choose_group_size(buckets: &[MeterBucket], target_retention: f64) -> GroupSize {
    let mut measured: Vec<(u32, f64, u64)> = buckets
        .iter()
        .filter(|b| b.samples >= MIN_METER_SAMPLES && b.size_min >= 1)
        .filter_map(|b| Some((b.size_min, b.retention?, b.samples)))
        .collect();
    measured.sort_by_key(|b| b.0);
    if measured.is_empty() {
        return GroupSize::default_because(&format!(
            "the overload meter has no group size with {MIN_METER_SAMPLES} samples yet"
        ));
    }
    let first_miss = measured.iter().position(|b| b.1 < target_retention);
    let holding = &measured[..first_miss.unwrap_or(measured.len())];
    if let Some(&(bucket_min, retention, samples)) = holding.last() {
        return GroupSize {
            max_group: Some(bucket_min as usize),
            source: SizeSource::Meter { bucket_min, retention, samples },
        };
    }
    let (smallest, retention, _) = measured[0];
    if smallest <= 1 {
        return GroupSize { max_group: Some(1), source: SizeSource::NoSizeHolds { retention } };
    }
    GroupSize {
        max_group: Some((smallest / 2).max(1) as usize),
        source: SizeSource::Probe { below_target_at: smallest, retention },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::learn::meter::BucketCounts;

    fn bucket(size_min: u32, marked: u64, recaptured: u64) -> MeterBucket {
        MeterBucket::new(size_min, BucketCounts { marked, recaptured }, 1)
    }

    #[test]
    fn an_unmeasured_meter_gives_the_papers_default() {
        let g = choose_group_size(&[], 0.9);
        assert_eq!(g.max_group, None);
        assert!(matches!(g.source, SizeSource::Default { .. }));
        // Too few samples count as unmeasured, however good they look.
        let g = choose_group_size(&[bucket(8, MIN_METER_SAMPLES - 1, MIN_METER_SAMPLES - 1)], 0.9);
        assert_eq!(g.max_group, None);
        assert!(!g.source.holds_target());
    }

    #[test]
    fn the_largest_bucket_holding_the_target_sets_the_size() {
        // 2 and 4 hold 0.9, 8 does not; 16 (noisily) looks good again but lies above a miss.
        let meter = [bucket(16, 40, 38), bucket(2, 50, 48), bucket(4, 50, 46), bucket(8, 50, 30)];
        let g = choose_group_size(&meter, 0.9);
        assert_eq!(g.max_group, Some(4));
        assert_eq!(g.source, SizeSource::Meter { bucket_min: 4, retention: 46.0 / 50.0, samples: 50 });
        assert!(g.source.holds_target());
        // A laxer target allows the larger bucket.
        assert_eq!(choose_group_size(&meter, 0.6).max_group, Some(16));
    }

    #[test]
    fn a_meter_that_only_saw_misses_probes_half_the_smallest_size() {
        let g = choose_group_size(&[bucket(8, 30, 21), bucket(16, 30, 12)], 0.9);
        assert_eq!(g.max_group, Some(4));
        assert!(matches!(g.source, SizeSource::Probe { below_target_at: 8, .. }));
        let g = choose_group_size(&[bucket(1, 30, 20)], 0.9);
        assert_eq!(g.max_group, Some(1));
        assert!(matches!(g.source, SizeSource::NoSizeHolds { .. }));
        assert!(g.source.message().contains("no group size"));
    }
}
