//! Capacity control for the shuffle step: the capacity-aware group size, how
//! many reflections one level-1 aggregator call may be given, chosen from the
//! overload meter ([`super::meter`]) instead of the paper's fixed ⌊√n⌋ groups —
//! a model keeps only so much of what one call is given, and the meter measures
//! how much, per group size, for this prompt.
//!
//! The rule ([`choose_group_size`]), over the meter's size buckets that have
//! *enough* samples (at least [`MIN_METER_SAMPLES`] marked copies):
//! 1. the meter cannot measure this prompt (p = 1, or a rewrite prompt): the
//!    paper's ⌊√n⌋ groups ([`SizeSource::Default`]);
//! 2. no round was observed yet: groups of [`START_GROUP_SIZE`] reflections
//!    ([`SizeSource::Start`]) — the size of the sequential baseline's minibatch
//!    (GEPA's default of 3), rounded up to the meter's buckets. The first round
//!    then measures overload with its own p copies, at any batch size;
//! 3. rounds were observed but their answers marked nothing — neither their
//!    citations nor their text told which reflections they kept: no estimate at
//!    all, the paper's ⌊√n⌋ groups ([`SizeSource::NoEstimate`]);
//! 4. the largest measured bucket whose estimated retention is ≥
//!    `target_retention`, below every measured bucket that misses it: groups of
//!    at most that bucket's smallest size ([`SizeSource::Meter`]) — the
//!    smallest size, because retention falls with size and a bucket's estimate
//!    is an average over its sizes. While the next bucket up (twice the size) is
//!    not measured yet, one copy of every reflection goes to groups of that
//!    larger size (`probe_group`), so the round measures it too: each
//!    reflection keeps a copy in a group of the vouched size, and the meter
//!    learns whether larger (cheaper) groups would hold the target as well;
//! 5. every measured bucket misses the target: half the smallest one, to be
//!    measured next ([`SizeSource::Probe`]), but never below
//!    [`MIN_GROUP_SIZE`]; when the smallest is already that size no size holds
//!    the target ([`SizeSource::NoSizeHolds`]) and groups stay at
//!    [`MIN_GROUP_SIZE`]. A group of one reflection only restates it: at p = 2
//!    it costs two aggregator calls per trace (the sequential baseline makes
//!    one per three), and a single noisy reading of size 2 would otherwise
//!    lock a prompt into such groups for good (a measured miss is not probed
//!    again). Under the simulator's default capacity (K = 12) a size-2 call
//!    keeps ≈ 92 %, a size-1 call ≈ 96 %: the floor costs little retention;
//! 6. some rounds marked something, but no bucket has enough samples yet: the
//!    start size again.
//!
//! The size is an upper bound on a group; the batch is not bounded by quality at
//! all (capacity-aware groups keep their retention at any batch size).

use serde::{Deserialize, Serialize};

use super::meter::MeterBucket;

/// Marked copies a size bucket needs before its estimate is used ("enough").
/// The binomial error at 20 samples and r = 0.9 is ±7 points; a round of a few
/// dozen traces at p = 2 gives it.
pub const MIN_METER_SAMPLES: u64 = 20;

/// The smallest group the meter's rule chooses (module doc, rule 5).
pub const MIN_GROUP_SIZE: usize = 2;

/// The group size of a prompt's first round, before the meter has observed one.
pub const START_GROUP_SIZE: usize = 4;

/// Default `target_retention`: the share of a group's insights its answer
/// should keep (with p = 2 copies that is ≈ 99 % of the round's).
pub const DEFAULT_TARGET_RETENTION: f64 = 0.9;

/// Where a round's group size came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "source", rename_all = "snake_case")]
pub enum SizeSource {
    /// The paper's ⌊√n⌋ groups: the meter cannot measure this prompt.
    Default { why: String },
    /// No round observed yet: the start size, measured by this round.
    Start,
    /// Rounds were observed, but their answers told nothing about what they kept.
    NoEstimate { rounds: u64 },
    /// The meter: the largest measured size bucket holding the target.
    Meter { bucket_min: u32, retention: f64, samples: u64 },
    /// Every measured bucket misses the target: trying a smaller size.
    Probe { below_target_at: u32, retention: f64 },
    /// Even the smallest groups the rule chooses ([`MIN_GROUP_SIZE`]) miss the target.
    NoSizeHolds { retention: f64 },
}

impl SizeSource {
    /// One line for the round record and the controller page.
    pub fn message(&self) -> String {
        match self {
            Self::Default { why } => format!("the paper's ⌊√n⌋ groups: {why}"),
            Self::Start => format!(
                "groups of {START_GROUP_SIZE} to start: the overload meter has observed no round yet (this one measures it)"
            ),
            Self::NoEstimate { rounds } => format!(
                "the paper's ⌊√n⌋ groups: {rounds} rounds gave the overload meter no estimate (their answers neither \
                 cite their sources nor repeat the lessons they keep)"
            ),
            Self::Meter { bucket_min, retention, samples } => format!(
                "overload meter: groups of up to {bucket_min} keep an estimated {:.0}% ({samples} samples)",
                100.0 * retention
            ),
            Self::Probe { below_target_at, retention } => format!(
                "overload meter: groups of {below_target_at} keep only {:.0}%; trying smaller groups",
                100.0 * retention
            ),
            Self::NoSizeHolds { retention } => format!(
                "overload meter: even groups of {MIN_GROUP_SIZE} keep only {:.0}%; no group size holds the target \
                 (smaller groups would only restate single reflections)",
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
/// most (`None`: the paper's ⌊√n⌋ groups), the larger size one copy of each
/// reflection is given to measure it (`probe_group`), and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupSize {
    pub max_group: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe_group: Option<usize>,
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
        Self { max_group: None, probe_group: None, source: SizeSource::Default { why: why.to_owned() } }
    }

    /// Groups of at most `max_group`, for `source`.
    pub fn bounded(max_group: usize, source: SizeSource) -> Self {
        Self { max_group: Some(max_group.max(1)), probe_group: None, source }
    }

    /// One line for the round record and the controller page, the probe included.
    pub fn message(&self) -> String {
        match self.probe_group {
            Some(probe) => {
                format!("{}; one copy of each reflection in groups of {probe} to measure them", self.source.message())
            }
            None => self.source.message(),
        }
    }
}

/// The rule in the module doc. `buckets` as the meter shows them (any order);
/// `measurable` is false where the meter has nothing to measure (p = 1, rewrite).
pub fn choose_group_size(buckets: &[MeterBucket], target_retention: f64, measurable: bool) -> GroupSize {
    if !measurable {
        return GroupSize::default_because("the overload meter cannot measure this prompt (p = 1 or rewrite)");
    }
    if buckets.is_empty() {
        return GroupSize::bounded(START_GROUP_SIZE, SizeSource::Start);
    }
    let mut measured: Vec<(u32, f64, u64)> = buckets
        .iter()
        .filter(|b| b.samples >= MIN_METER_SAMPLES && b.size_min >= 1)
        .filter_map(|b| Some((b.size_min, b.retention?, b.samples)))
        .collect();
    measured.sort_by_key(|b| b.0);
    if measured.is_empty() {
        if buckets.iter().all(|b| b.samples == 0) {
            let rounds = buckets.iter().map(|b| b.rounds).max().unwrap_or(0);
            return GroupSize { max_group: None, probe_group: None, source: SizeSource::NoEstimate { rounds } };
        }
        return GroupSize::bounded(START_GROUP_SIZE, SizeSource::Start);
    }
    let first_miss = measured.iter().position(|b| b.1 < target_retention);
    let holding = &measured[..first_miss.unwrap_or(measured.len())];
    if let Some(&(bucket_min, retention, samples)) = holding.last() {
        let next = bucket_min.saturating_mul(2);
        let next_measured = measured.iter().any(|b| b.0 == next);
        let at_least = (bucket_min as usize).max(MIN_GROUP_SIZE);
        let mut size = GroupSize::bounded(at_least, SizeSource::Meter { bucket_min, retention, samples });
        size.probe_group = (!next_measured).then_some(next as usize);
        return size;
    }
    let (smallest, retention, _) = measured[0];
    if smallest as usize <= MIN_GROUP_SIZE {
        return GroupSize::bounded(MIN_GROUP_SIZE, SizeSource::NoSizeHolds { retention });
    }
    let half = (smallest as usize / 2).max(MIN_GROUP_SIZE);
    GroupSize::bounded(half, SizeSource::Probe { below_target_at: smallest, retention })
}

#[cfg(test)]
mod tests {
    use super::super::meter::BucketCounts;
    use super::*;

    fn bucket(size_min: u32, marked: u64, recaptured: u64) -> MeterBucket {
        MeterBucket::new(size_min, BucketCounts { marked, recaptured }, 1)
    }

    #[test]
    fn a_meter_that_observed_nothing_starts_small_and_one_that_cannot_measure_uses_the_papers_groups() {
        let g = choose_group_size(&[], 0.9, true);
        assert_eq!((g.max_group, g.probe_group, g.source.clone()), (Some(START_GROUP_SIZE), None, SizeSource::Start));
        // Too few samples count as unmeasured, however good they look.
        let g = choose_group_size(&[bucket(8, MIN_METER_SAMPLES - 1, MIN_METER_SAMPLES - 1)], 0.9, true);
        assert_eq!((g.max_group, g.source.holds_target()), (Some(START_GROUP_SIZE), false));
        // p = 1 or rewrite: nothing to measure.
        let g = choose_group_size(&[], 0.9, false);
        assert!(matches!(g.source, SizeSource::Default { .. }) && g.max_group.is_none());
    }

    #[test]
    fn rounds_that_marked_nothing_give_no_estimate_and_the_papers_groups() {
        let nothing = MeterBucket::new(4, BucketCounts::default(), 3);
        let g = choose_group_size(&[nothing], 0.9, true);
        assert_eq!((g.max_group, g.source.clone()), (None, SizeSource::NoEstimate { rounds: 3 }));
        assert!(g.message().contains("neither cite"), "{}", g.message());
    }

    #[test]
    fn once_a_size_holds_the_next_larger_one_is_probed_until_it_is_measured() {
        let g = choose_group_size(&[bucket(4, 100, 97)], 0.9, true);
        assert_eq!((g.max_group, g.probe_group), (Some(4), Some(8)));
        assert!(g.message().contains("groups of 8 to measure"), "{}", g.message());
        // 8 measured and holding: 8, probing 16.
        let g = choose_group_size(&[bucket(4, 100, 97), bucket(8, 100, 95)], 0.9, true);
        assert_eq!((g.max_group, g.probe_group), (Some(8), Some(16)));
        // 8 measured and missing: stay at 4, no probe.
        let g = choose_group_size(&[bucket(4, 100, 97), bucket(8, 100, 70)], 0.9, true);
        assert_eq!((g.max_group, g.probe_group), (Some(4), None));
    }

    #[test]
    fn the_largest_bucket_holding_the_target_sets_the_size() {
        // 2 and 4 hold 0.9, 8 does not; 16 (noisily) looks good again but lies above a miss.
        let meter = [bucket(16, 40, 38), bucket(2, 50, 48), bucket(4, 50, 46), bucket(8, 50, 30)];
        let g = choose_group_size(&meter, 0.9, true);
        assert_eq!(g.max_group, Some(4));
        assert_eq!(g.source, SizeSource::Meter { bucket_min: 4, retention: 46.0 / 50.0, samples: 50 });
        assert!(g.source.holds_target());
        // A laxer target allows the larger bucket.
        assert_eq!(choose_group_size(&meter, 0.6, true).max_group, Some(16));
    }

    #[test]
    fn a_meter_that_only_saw_misses_probes_half_the_smallest_size() {
        let g = choose_group_size(&[bucket(8, 30, 21), bucket(16, 30, 12)], 0.9, true);
        assert_eq!(g.max_group, Some(4));
        assert!(matches!(g.source, SizeSource::Probe { below_target_at: 8, .. }));
        let g = choose_group_size(&[bucket(2, 30, 20)], 0.9, true);
        assert_eq!(g.max_group, Some(MIN_GROUP_SIZE));
        assert!(matches!(g.source, SizeSource::NoSizeHolds { .. }));
        assert!(g.source.message().contains("no group size"));
    }

    #[test]
    fn groups_never_shrink_to_single_reflections() {
        // A noisy miss at 2 (and an old reading at 1) must not lock the prompt into groups of one.
        for meter in [vec![bucket(2, 40, 34)], vec![bucket(1, 40, 39), bucket(2, 40, 34)], vec![bucket(4, 40, 30)]] {
            let g = choose_group_size(&meter, 0.9, true);
            assert_eq!(g.max_group, Some(MIN_GROUP_SIZE), "{meter:?}");
        }
        // A small round at that size: 20 traces at p = 2 give groups of two distinct reflections.
        let plan = crate::learn::shuffle::grouping::plan_sized(crate::domain::Method::Combee, 20, 2, 1, Some(2), None);
        assert!(plan.groups.iter().all(|g| g.len() == 2 && g[0] != g[1]), "{:?}", plan.groups);
        assert_eq!(plan.groups.len(), 20);
    }
}
