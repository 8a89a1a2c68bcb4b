//! Capacity control between rounds: the batch-size controller
//! (`docs/learning-controller.md`), as plain functions over plain data — how
//! many pending traces the next round of a prompt takes. The worker keeps and
//! persists the samples and the meter; this module only decides.
//!
//! # The rule
//! A round takes **everything pending**, up to the smallest of two bounds — so
//! in continuous operation (one round of a prompt at a time) each round takes
//! what arrived while the last one ran, and a backlog is learned from in as few
//! rounds as the bounds allow:
//! 1. **round time** (`max_round_secs`, the knob): the measured round wall
//!    time R(bs) is fitted as R(bs) = A·bs^(−α) over the median time per
//!    size; the largest batch whose fitted R stays within `max_round_secs` is
//!    the bound (none while R does not grow with bs). A trace therefore waits at
//!    most about `max_wait_secs` (a round starts) + `max_round_secs` (it runs)
//!    + one more round (the one it arrived during).
//! 2. **`max_batch`**, a plain ceiling.
//!
//! Quality sets no bound on the batch: the overload meter sizes the round's
//! *groups* ([`super::sizing`]), and capacity-aware groups keep their retention
//! at any batch size. The first round of a prompt is not held back to measure:
//! its own p copies are the meter's samples. (The paper's ⌊√n⌋ groups, used
//! where the meter cannot measure, are bounded only by round time and
//! `max_batch` as well — never by a fixed small cap.)
//!
//! A round starts once `min_batch` traces are pending (the *target*), or when
//! the oldest has waited `max_wait_secs`. The rule depends on no ladder and
//! no starting size: only on the measured round times and the knobs.
//!
//! # Samples and window
//! A [`RoundSample`] is one finished round: its batch size and its wall time R. For
//! each batch size only the `window` most recent samples count (oldest first
//! in the input), and a size is represented by the *median* R of those — robust
//! to a one-off slow round (a retried 429).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::sizing::{DEFAULT_TARGET_RETENTION, GroupSize};

/// One finished round: its batch size and wall time in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RoundSample {
    pub batch_size: u32,
    pub round_secs: f64,
}

/// y = A·x^(−α), fitted in log–log space; `r2` is the fit's R² in log space.
/// The controller fits the round time R(bs) with it (α < 0 when R grows).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PowerLawFit {
    pub a: f64,
    pub alpha: f64,
    pub r2: f64,
}

impl PowerLawFit {
    /// The fitted value at `bs`.
    pub fn delay(&self, bs: f64) -> f64 {
        self.a * bs.powf(-self.alpha)
    }

    /// The largest x with A·x^(−α) ≤ `limit`, when the curve grows (α < 0).
    pub fn largest_within(&self, limit: f64) -> Option<f64> {
        (self.alpha < 0.0 && self.a > 0.0 && limit > 0.0).then(|| (limit / self.a).powf(1.0 / -self.alpha))
    }
}

/// Default `max_batch`. Measured (`scripts/bench-learn`, its max_batch section,
/// simulated LLM): the time to learn a backlog keeps falling up to a ceiling of
/// 1,024 and beyond, at the product's client concurrency (64) and at a large
/// one, with retention unchanged; what grows is the round's record (about
/// 0.75 KiB per trace: 776 KiB at 1,024, past 1 MiB beyond) and what one failed
/// round puts back to pending. 1,024 keeps a round's record under 1 MiB.
pub const DEFAULT_MAX_BATCH: u32 = 1024;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ControllerConfig {
    /// A round starts once this many traces are pending (or `max_wait_secs` passed).
    pub min_batch: u32,
    /// No round takes more.
    pub max_batch: u32,
    /// The longest a round should take (seconds): bounds the batch through the
    /// measured round times.
    pub max_round_secs: f64,
    /// The share of a level-1 group's insights its answer should keep: sets the
    /// capacity-aware group size ([`super::sizing`]).
    pub target_retention: f64,
    /// The batch a manual trigger takes before the controller has chosen.
    pub default_batch: u32,
    /// Most recent samples kept per batch size.
    pub window: usize,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        Self {
            min_batch: 4,
            max_batch: DEFAULT_MAX_BATCH,
            max_round_secs: 300.0,
            target_retention: DEFAULT_TARGET_RETENTION,
            default_batch: 16,
            window: 5,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControllerConfigError {
    #[error("min_batch must be at least 1 and at most max_batch")]
    BadBounds,
    #[error("max_round_secs must be a positive number of seconds")]
    BadRoundSecs,
    #[error("target_retention must be a number in (0, 1]")]
    BadTargetRetention,
    #[error("window must be at least 1")]
    BadWindow,
}

impl ControllerConfig {
    pub fn validate(&self) -> Result<(), ControllerConfigError> {
        if self.min_batch == 0 || self.min_batch > self.max_batch {
            return Err(ControllerConfigError::BadBounds);
        }
        if !(self.max_round_secs.is_finite() && self.max_round_secs > 0.0) {
            return Err(ControllerConfigError::BadRoundSecs);
        }
        if !(self.target_retention > 0.0 && self.target_retention <= 1.0) {
            return Err(ControllerConfigError::BadTargetRetention);
        }
        if self.window == 0 {
            return Err(ControllerConfigError::BadWindow);
        }
        Ok(())
    }

    fn bounds(&self) -> (u32, u32) {
        let min = self.min_batch.max(1);
        (min, self.max_batch.max(min))
    }
}

/// What the overload meter says about quality, for the page: the group size the
/// next round gets (the batch does not depend on it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Quality {
    /// The meter cannot measure this prompt (p = 1 or the rewrite strategy).
    Unmeasured,
    /// The group size the meter chose for the next round, and whether it holds the target.
    Meter { group_size: GroupSize, p: u32 },
}

impl Quality {
    /// From the meter's group-size choice for a prompt with `p` copies per
    /// trace; `measurable` is false where the meter has no data to give (p = 1, rewrite).
    pub fn of(group_size: GroupSize, p: u32, measurable: bool) -> Self {
        if measurable && p >= 2 { Self::Meter { group_size, p } } else { Self::Unmeasured }
    }
}

/// Which bound set the batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rule", rename_all = "snake_case")]
pub enum Reason {
    /// Nothing is pending.
    Empty,
    /// Everything pending fits every bound: the round takes it all.
    WholeBacklog {
        backlog: u64,
    },
    /// The fitted round time reaches `max_round_secs` at this batch.
    RoundTime {
        batch: u32,
        max_round_secs: f64,
    },
    MaxBatch {
        max_batch: u32,
    },
}

impl Reason {
    pub fn message(&self) -> String {
        match self {
            Self::Empty => "nothing is pending".to_owned(),
            Self::WholeBacklog { backlog } => {
                format!("takes everything pending ({backlog}): what arrived during the last round, within every bound")
            }
            Self::RoundTime { batch, max_round_secs } => {
                format!("capped at {batch}: the fitted round time reaches max_round_secs = {max_round_secs} s there")
            }
            Self::MaxBatch { max_batch } => format!("capped at max_batch = {max_batch}"),
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// The batch to take now: everything pending up to `cap`.
    pub batch_size: u32,
    /// A round starts once this many are pending (`min_batch`, within `cap`).
    pub target: u32,
    /// The largest batch allowed now (the smallest bound).
    pub cap: u32,
    pub reason: Reason,
    /// The fitted round time R(bs) = A·bs^(−α), when two sizes were measured.
    pub fit: Option<PowerLawFit>,
    /// R at `batch_size` by the fit, when there is one.
    pub predicted_round_secs: Option<f64>,
    /// What quality allows, for the page.
    pub quality: Quality,
}

/// Least squares of ln y = ln A − α·ln x. `None` with fewer than two distinct
/// sizes or any non-positive or non-finite value.
pub fn fit_power_law(points: &[(f64, f64)]) -> Option<PowerLawFit> {
    if points.iter().any(|&(bs, t)| !(bs.is_finite() && t.is_finite() && bs > 0.0 && t > 0.0)) {
        return None;
    }
    let xs: Vec<f64> = points.iter().map(|p| p.0.ln()).collect();
    let ys: Vec<f64> = points.iter().map(|p| p.1.ln()).collect();
    let n = points.len() as f64;
    let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
    let sxx: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
    if points.len() < 2 || sxx <= 1e-12 {
        return None;
    }
    let sxy: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let slope = sxy / sxx;
    let intercept = my - slope * mx;
    let ss_tot: f64 = ys.iter().map(|y| (y - my).powi(2)).sum();
    let ss_res: f64 = xs.iter().zip(&ys).map(|(x, y)| (y - intercept - slope * x).powi(2)).sum();
    let r2 = if ss_tot <= 1e-12 { 1.0 } else { 1.0 - ss_res / ss_tot };
    Some(PowerLawFit { a: intercept.exp(), alpha: -slope, r2 })
}

/// One point per batch size: the median wall time of its `window` most recent
/// valid samples (samples are given oldest first), ascending by size.
pub fn profile(samples: &[RoundSample], window: usize) -> Vec<(u32, f64)> {
    let mut by_size: BTreeMap<u32, Vec<f64>> = BTreeMap::new();
    for s in samples.iter().rev().filter(|s| s.batch_size > 0 && s.round_secs.is_finite() && s.round_secs > 0.0) {
        let kept = by_size.entry(s.batch_size).or_default();
        if kept.len() < window.max(1) {
            kept.push(s.round_secs);
        }
    }
    by_size
        .into_iter()
        .map(|(bs, mut r)| {
            r.sort_by(f64::total_cmp);
            let mid = r.len() / 2;
            let median = if r.len() % 2 == 1 { r[mid] } else { (r[mid - 1] + r[mid]) / 2.0 };
            (bs, median)
        })
        .collect()
}

/// Fits the round time R(bs) over the profile.
pub fn fit_round_time(profile: &[(u32, f64)]) -> Option<PowerLawFit> {
    let points: Vec<(f64, f64)> = profile.iter().map(|&(bs, r)| (f64::from(bs), r)).collect();
    fit_power_law(&points)
}

/// The largest batch whose round should stay within `max_round_secs`: from the
/// fit when there is one; from a single measured size, proportionally (R ∝ bs,
/// the pessimistic case) when that size already takes longer; else no bound.
fn round_time_bound(profile: &[(u32, f64)], fit: Option<PowerLawFit>, max_round_secs: f64) -> Option<u32> {
    let clamp = |x: f64| (x + 1e-9).floor().clamp(1.0, f64::from(u32::MAX)) as u32;
    match (fit, profile) {
        (Some(f), _) => f.largest_within(max_round_secs).filter(|x| x.is_finite()).map(clamp),
        (None, [(bs, r)]) if *r > max_round_secs => Some(clamp(f64::from(*bs) * max_round_secs / r)),
        _ => None,
    }
}

/// Chooses the next batch from the samples of past rounds (oldest first), the
/// number pending and what the meter says; the rule is in the module doc.
pub fn choose(samples: &[RoundSample], backlog: u64, quality: &Quality, cfg: &ControllerConfig) -> Choice {
    let (min, max) = cfg.bounds();
    let profile = profile(samples, cfg.window);
    let fit = fit_round_time(&profile);

    // The bounds, smallest wins (ties: the later, more specific one).
    let mut bounds: Vec<(u32, Reason)> = vec![(max, Reason::MaxBatch { max_batch: max })];
    if let Some(b) = round_time_bound(&profile, fit, cfg.max_round_secs) {
        bounds.push((b.max(min), Reason::RoundTime { batch: b.max(min), max_round_secs: cfg.max_round_secs }));
    }
    let (cap, bound) = bounds.into_iter().rev().min_by_key(|(b, _)| *b).unwrap_or((max, Reason::Empty));
    let batch_size = u64::from(cap).min(backlog) as u32;
    let reason = if backlog == 0 {
        Reason::Empty
    } else if backlog <= u64::from(cap) {
        Reason::WholeBacklog { backlog }
    } else {
        bound
    };
    Choice {
        batch_size,
        target: min.min(cap),
        cap,
        reason,
        fit,
        predicted_round_secs: fit.filter(|_| batch_size > 0).map(|f| f.delay(f64::from(batch_size))),
        quality: quality.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::meter::{BucketCounts, MeterBucket};
    use super::super::sizing::choose_group_size;
    use super::*;

    fn close(actual: f64, expected: f64, rel: f64) -> bool {
        ((actual - expected) / expected).abs() <= rel
    }

    /// Rounds whose wall time follows R(bs) = c·bs^beta.
    fn rounds(sizes: &[u32], c: f64, beta: f64) -> Vec<RoundSample> {
        sizes.iter().map(|&bs| RoundSample { batch_size: bs, round_secs: c * f64::from(bs).powf(beta) }).collect()
    }

    fn measured(buckets: &[(u32, u64, u64)]) -> Quality {
        let b: Vec<MeterBucket> = buckets
            .iter()
            .map(|&(s, m, r)| MeterBucket::new(s, BucketCounts { marked: m, recaptured: r }, 1))
            .collect();
        Quality::of(choose_group_size(&b, 0.9, true), 2, true)
    }

    fn holds() -> Quality {
        measured(&[(4, 100, 98), (8, 100, 95), (16, 100, 60)])
    }

    #[test]
    fn fit_recovers_exact_power_law() {
        for (a, alpha) in [(120.0, 0.7), (3.5, -0.2), (0.5, -1.0)] {
            let points: Vec<(f64, f64)> =
                [4.0, 8.0, 16.0, 32.0, 64.0].iter().map(|&bs: &f64| (bs, a * bs.powf(-alpha))).collect();
            let fit = fit_power_law(&points).unwrap();
            assert!(close(fit.a, a, 0.02) && close(fit.alpha, alpha, 0.02), "{fit:?}");
        }
        assert!(fit_power_law(&[(4.0, 10.0), (4.0, 12.0)]).is_none());
        assert!(fit_power_law(&[(4.0, 10.0), (8.0, 0.0)]).is_none());
    }

    #[test]
    fn with_quality_assured_a_round_takes_everything_pending_up_to_max_batch() {
        let cfg = ControllerConfig { max_batch: 256, ..ControllerConfig::default() };
        // Round time nearly flat (the simulator): no time bound below max_batch.
        let samples = rounds(&[20, 20, 180], 0.5, 0.03);
        let c = choose(&samples, 90, &holds(), &cfg);
        assert_eq!((c.batch_size, c.cap, c.target), (90, 256, 4));
        assert_eq!(c.reason, Reason::WholeBacklog { backlog: 90 });
        let c = choose(&samples, 1000, &holds(), &cfg);
        assert_eq!((c.batch_size, c.reason.clone()), (256, Reason::MaxBatch { max_batch: 256 }));
        assert!(c.predicted_round_secs.unwrap() < 1.0);
        assert_eq!(choose(&samples, 0, &holds(), &cfg).reason, Reason::Empty);
    }

    #[test]
    fn the_choice_does_not_depend_on_where_sizes_were_first_tried() {
        // The old rule scaled with the smallest profiled size; this one does not.
        let cfg = ControllerConfig { max_round_secs: 10.0, max_batch: 10_000, ..ControllerConfig::default() };
        let from_4 = choose(&rounds(&[4, 8, 16, 32], 0.1, 1.0), 5000, &holds(), &cfg);
        let from_16 = choose(&rounds(&[16, 32, 64], 0.1, 1.0), 5000, &holds(), &cfg);
        // R = 0.1·bs reaches 10 s at bs = 100, whichever sizes were measured.
        assert_eq!((from_4.cap, from_16.cap), (100, 100));
        assert!(matches!(from_4.reason, Reason::RoundTime { batch: 100, .. }), "{}", from_4.reason);
    }

    #[test]
    fn round_time_bounds_the_batch_by_max_round_secs() {
        let cfg = ControllerConfig { max_round_secs: 60.0, max_batch: 256, ..ControllerConfig::default() };
        // R(bs) = 2·bs^0.5: 60 s at bs = 900 > max_batch; at max_round_secs 20: bs = 100.
        let samples = rounds(&[10, 40, 90], 2.0, 0.5);
        assert_eq!(choose(&samples, 5000, &holds(), &cfg).cap, 256);
        let tight = ControllerConfig { max_round_secs: 20.0, ..cfg.clone() };
        let c = choose(&samples, 5000, &holds(), &tight);
        assert_eq!(c.cap, 100);
        assert!(close(c.predicted_round_secs.unwrap(), 20.0, 1e-6));
        // One measured size that is already too slow: proportional.
        let one = choose(&[RoundSample { batch_size: 50, round_secs: 40.0 }], 5000, &holds(), &tight);
        assert_eq!(one.cap, 25);
        // One size within the limit says nothing about larger ones.
        let ok = choose(&[RoundSample { batch_size: 50, round_secs: 4.0 }], 5000, &holds(), &tight);
        assert_eq!(ok.cap, 256);
        // Even the smallest batch too slow: still min_batch, never zero.
        let slow = choose(&rounds(&[4, 8], 100.0, 1.0), 5000, &holds(), &tight);
        assert_eq!(slow.cap, 4);
    }

    #[test]
    fn quality_never_holds_the_batch_back_not_even_before_the_meter_has_measured() {
        let cfg = ControllerConfig::default();
        let max = cfg.max_batch;
        // Nothing measured yet: the first round takes the backlog (it measures with its own copies).
        let first = choose(&[], 300, &measured(&[]), &cfg);
        assert_eq!((first.batch_size, first.target), (300.min(max), 4));
        // Only misses measured, or no size holding: groups shrink, the batch does not.
        assert_eq!(choose(&[], 300, &measured(&[(8, 30, 20)]), &cfg).batch_size, 300.min(max));
        assert_eq!(choose(&[], 300, &measured(&[(1, 50, 30)]), &cfg).batch_size, 300.min(max));
        // A prompt the meter cannot measure (p = 1): the same.
        let p1 = choose(&[], 300, &Quality::of(GroupSize::default(), 1, true), &cfg);
        assert_eq!((p1.batch_size, p1.quality.clone()), (300.min(max), Quality::Unmeasured));
        assert_eq!(choose(&[], 5000, &holds(), &cfg).reason, Reason::MaxBatch { max_batch: max });
    }

    #[test]
    fn minute_long_rounds_are_learned_as_rounds_of_seconds() {
        // A one-slot server: R grows about linearly, 1 to 10 minutes per round.
        let minutes = rounds(&[5, 8, 16, 32, 40], 15.0, 0.95);
        assert!(minutes.iter().all(|s| (60.0..=600.0).contains(&s.round_secs)), "{minutes:?}");
        let seconds: Vec<RoundSample> =
            minutes.iter().map(|s| RoundSample { batch_size: s.batch_size, round_secs: s.round_secs / 60.0 }).collect();
        let fit_min = fit_round_time(&profile(&minutes, 5)).unwrap();
        let fit_sec = fit_round_time(&profile(&seconds, 5)).unwrap();
        // Only A carries the unit: the exponent and the fit's quality do not.
        assert!(close(fit_min.alpha, -0.95, 1e-9) && close(fit_min.alpha, fit_sec.alpha, 1e-9), "{fit_min:?}");
        assert!(close(fit_min.a, 60.0 * fit_sec.a, 1e-9) && close(fit_min.r2, fit_sec.r2, 1e-9));
        // The same bound in the same units gives the same batch.
        for limit in [300.0, 600.0, 1800.0] {
            let slow = ControllerConfig { max_round_secs: limit, max_batch: 10_000, ..ControllerConfig::default() };
            let fast = ControllerConfig { max_round_secs: limit / 60.0, ..slow.clone() };
            let (c_min, c_sec) = (choose(&minutes, 5000, &holds(), &slow), choose(&seconds, 5000, &holds(), &fast));
            assert_eq!(c_min.cap, c_sec.cap, "max_round_secs = {limit}");
            assert!(matches!(c_min.reason, Reason::RoundTime { .. }), "{}", c_min.reason);
            // 15·bs^0.95 = limit.
            let expected = (limit / 15.0_f64).powf(1.0 / 0.95).floor() as u32;
            assert!(c_min.cap.abs_diff(expected) <= 1, "{} vs {expected}", c_min.cap);
            assert!(c_min.predicted_round_secs.unwrap() <= limit * (1.0 + 1e-9));
        }
        // One ten-minute round alone, over a five-minute bound: proportionally smaller.
        let one = [RoundSample { batch_size: 40, round_secs: 600.0 }];
        assert_eq!(choose(&one, 5000, &holds(), &ControllerConfig::default()).cap, 20);
    }

    #[test]
    fn profile_keeps_the_recent_window_per_size_by_median() {
        let s = |bs, r| RoundSample { batch_size: bs, round_secs: r };
        let samples = [s(4, 100.0), s(4, 1.0), s(4, 2.0), s(4, 3.0), s(8, 5.0), s(8, -1.0), s(0, 1.0)];
        assert_eq!(profile(&samples, 3), vec![(4, 2.0), (8, 5.0)]);
        assert_eq!(profile(&samples, 4), vec![(4, 2.5), (8, 5.0)]);
    }

    #[test]
    fn config_validation() {
        assert_eq!(ControllerConfig::default().validate(), Ok(()));
        let bad = ControllerConfig { min_batch: 10, max_batch: 5, ..ControllerConfig::default() };
        assert_eq!(bad.validate(), Err(ControllerConfigError::BadBounds));
        let bad = ControllerConfig { max_round_secs: 0.0, ..ControllerConfig::default() };
        assert_eq!(bad.validate(), Err(ControllerConfigError::BadRoundSecs));
        let bad = ControllerConfig { target_retention: 1.5, ..ControllerConfig::default() };
        assert_eq!(bad.validate(), Err(ControllerConfigError::BadTargetRetention));
    }
}
