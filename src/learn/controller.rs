//! The dynamic batch-size controller (design §4), as plain functions over
//! plain data: from the round wall times observed at several batch sizes it
//! fits the backlog delay T(bs) = A·bs^(−α) and picks the plateau batch size,
//! the largest whose marginal delay reduction still exceeds τ. The worker keeps
//! and persists the samples; this module only decides.
//!
//! # Samples and window
//! A [`Sample`] is one finished round: its batch size and its wall time R. For
//! each batch size only the `window` most recent samples count (the caller
//! passes samples oldest first), and a size is represented by the *median* R of
//! those samples — robust to a one-off slow round (a retried 429), while a real
//! latency change takes over a size after ⌈window/2⌉ new rounds. Sizes are kept
//! per size rather than decayed globally so the warm-up's small sizes, which
//! anchor the slope, are never forgotten while the chosen size keeps refreshing.
//!
//! # Delay model and choice
//! For a backlog of N traces T(bs) = (N/bs)·R(bs). The fit is least squares of
//! ln T = ln A − α·ln bs over one point per size. With bs_min the smallest
//! profiled size, τ = τ_rel·|T′(bs_min)| and T′(bs) = −α·A·bs^(−α−1), so
//! bs* = (α·A/τ)^(1/(α+1)) = bs_min·τ_rel^(−1/(α+1)): A, and with it N, cancels,
//! and the choice depends only on the shape of R.
//!
//! Rules, first match wins ([`Reason`] names the one that set the size):
//! 1. warm-up: while fewer than three sizes have samples, the next ladder size
//!    (ascending, within [min_batch, max_batch]) without samples and ≤ backlog;
//! 2. fallback to `default_batch` when warm-up cannot walk (no untried size fits
//!    the backlog) or the samples cannot be fitted;
//! 3. α ≤ 0 (bigger batches do not shorten the delay): `min_batch`;
//! 4. otherwise ⌊bs*⌋, clamped to [min_batch, max_batch].
//!
//! The result is the *target* (a round starts once the backlog reaches it); the
//! batch to take now is the target clamped to the backlog.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Default τ_rel: stop growing the batch once the marginal gain falls to 1.6 %
/// of the steepest profiled slope.
pub const DEFAULT_TAU_REL: f64 = 0.016;
/// Distinct profiled sizes needed before the controller trusts a fit.
pub const MIN_DISTINCT_SIZES: usize = 3;

/// One finished round: its batch size and wall time in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub batch_size: u32,
    pub round_secs: f64,
}

/// T(bs) = A·bs^(−α), fitted in log–log space; `r2` is the fit's R² in log space.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Fit {
    pub a: f64,
    pub alpha: f64,
    pub r2: f64,
}

impl Fit {
    /// The fitted delay at `bs`.
    pub fn delay(&self, bs: f64) -> f64 {
        self.a * bs.powf(-self.alpha)
    }

    /// T′(bs) = −α·A·bs^(−α−1).
    pub fn slope(&self, bs: f64) -> f64 {
        -self.alpha * self.a * bs.powf(-self.alpha - 1.0)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ControllerConfig {
    pub min_batch: u32,
    pub max_batch: u32,
    pub tau_rel: f64,
    pub default_batch: u32,
    /// Sizes tried during warm-up, ascending.
    pub ladder: Vec<u32>,
    /// Most recent samples kept per batch size.
    pub window: usize,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        let max_batch = 256;
        Self {
            min_batch: 4,
            max_batch,
            tau_rel: DEFAULT_TAU_REL,
            default_batch: 16,
            ladder: Self::doubling_ladder(4, max_batch),
            window: 5,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("min_batch must be at least 1 and at most max_batch")]
    BadBounds,
    #[error("tau_rel must be a number in (0, 1)")]
    BadTauRel,
    #[error("window must be at least 1")]
    BadWindow,
}

impl ControllerConfig {
    /// `start, 2·start, 4·start, …` up to `max`.
    pub fn doubling_ladder(start: u32, max: u32) -> Vec<u32> {
        std::iter::successors(Some(start.max(1)), |&s| s.checked_mul(2)).take_while(|&s| s <= max).collect()
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.min_batch == 0 || self.min_batch > self.max_batch {
            return Err(ConfigError::BadBounds);
        }
        if !(self.tau_rel > 0.0 && self.tau_rel < 1.0) {
            return Err(ConfigError::BadTauRel);
        }
        if self.window == 0 {
            return Err(ConfigError::BadWindow);
        }
        Ok(())
    }

    fn bounds(&self) -> (u32, u32) {
        let min = self.min_batch.max(1);
        (min, self.max_batch.max(min))
    }
}

/// Why the controller chose a size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rule", rename_all = "snake_case")]
pub enum Reason {
    /// Profiling the next untried ladder size.
    WarmUp {
        sizes_profiled: usize,
    },
    /// The fitted plateau, within bounds.
    Plateau {
        plateau: f64,
    },
    ClampedToMin {
        plateau: f64,
    },
    ClampedToMax {
        plateau: f64,
    },
    /// The fit shows no gain from larger batches (α ≤ 0).
    NoGain {
        alpha: f64,
    },
    /// The target exceeds the backlog, so the batch is the whole backlog.
    ClampedToBacklog {
        target: u32,
        backlog: u64,
    },
    Fallback {
        why: FallbackWhy,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FallbackWhy {
    /// Warm-up needs another size but none left on the ladder fits the backlog.
    LadderBlocked,
    /// The samples could not be fitted (degenerate or invalid values).
    NoFit,
}

impl Reason {
    pub fn message(&self) -> String {
        match self {
            Self::WarmUp { sizes_profiled } => {
                format!(
                    "warm-up: profiling the next ladder size ({sizes_profiled} of {MIN_DISTINCT_SIZES} sizes profiled)"
                )
            }
            Self::Plateau { plateau } => format!("fitted plateau bs* = {plateau:.1}"),
            Self::ClampedToMin { plateau } => format!("fitted plateau bs* = {plateau:.1}, raised to min_batch"),
            Self::ClampedToMax { plateau } => format!("fitted plateau bs* = {plateau:.1}, capped at max_batch"),
            Self::NoGain { alpha } => {
                format!("larger batches do not reduce the delay (alpha = {alpha:.3}); using min_batch")
            }
            Self::ClampedToBacklog { target, backlog } => {
                format!("target batch size {target} exceeds the backlog of {backlog}; taking the whole backlog")
            }
            Self::Fallback { why: FallbackWhy::LadderBlocked } => {
                "fallback to default_batch: the backlog is smaller than every untried ladder size".to_owned()
            }
            Self::Fallback { why: FallbackWhy::NoFit } => {
                "fallback to default_batch: the samples cannot be fitted".to_owned()
            }
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
    /// The batch to take now: `target` clamped to the backlog.
    pub batch_size: u32,
    /// The size the controller wants; a round starts once the backlog reaches it.
    pub target: u32,
    pub reason: Reason,
    /// The fit over the current backlog (A scales with it), when one was made.
    pub fit: Option<Fit>,
    /// The unclamped plateau bs*, when a fit was made.
    pub plateau: Option<f64>,
}

/// Least squares of ln T = ln A − α·ln bs. `None` with fewer than two distinct
/// sizes or any non-positive or non-finite value.
pub fn fit_power_law(points: &[(f64, f64)]) -> Option<Fit> {
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
    Some(Fit { a: intercept.exp(), alpha: -slope, r2 })
}

/// bs* = (α·A/τ)^(1/(α+1)): where |T′(bs)| has fallen to τ. Meaningful for
/// α > 0 and τ > 0 only (otherwise NaN or infinite).
pub fn plateau(fit: &Fit, tau: f64) -> f64 {
    (fit.alpha * fit.a / tau).powf(1.0 / (fit.alpha + 1.0))
}

/// τ = τ_rel·|T′(bs_min)|.
pub fn tau(fit: &Fit, tau_rel: f64, bs_min: f64) -> f64 {
    tau_rel * fit.slope(bs_min).abs()
}

/// One point per batch size: the median wall time of its `window` most recent
/// valid samples (samples are given oldest first), ascending by size.
pub fn profile(samples: &[Sample], window: usize) -> Vec<(u32, f64)> {
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

/// Fits T(bs) = (N/bs)·R(bs) for a backlog of `backlog` traces (at least one).
pub fn fit_delay(profile: &[(u32, f64)], backlog: u64) -> Option<Fit> {
    let n = backlog.max(1) as f64;
    let points: Vec<(f64, f64)> = profile.iter().map(|&(bs, r)| (f64::from(bs), n / f64::from(bs) * r)).collect();
    fit_power_law(&points)
}

/// Chooses the next batch size from the samples of past rounds (oldest first)
/// and the current backlog; rules in the module doc.
pub fn choose(samples: &[Sample], backlog: u64, cfg: &ControllerConfig) -> Choice {
    let (min, max) = cfg.bounds();
    let profile = profile(samples, cfg.window);
    let finish = |target: u32, reason: Reason, fit: Option<Fit>, plateau: Option<f64>| {
        let batch_size = u64::from(target).min(backlog) as u32;
        let reason = if u64::from(target) > backlog { Reason::ClampedToBacklog { target, backlog } } else { reason };
        Choice { batch_size, target, reason, fit, plateau }
    };
    let fallback = |why| finish(cfg.default_batch.clamp(min, max), Reason::Fallback { why }, None, None);

    if profile.len() < MIN_DISTINCT_SIZES {
        let mut ladder = cfg.ladder.clone();
        ladder.sort_unstable();
        let next = ladder
            .into_iter()
            .filter(|&s| (min..=max).contains(&s) && u64::from(s) <= backlog)
            .find(|s| profile.iter().all(|(bs, _)| bs != s));
        return match next {
            Some(step) => finish(step, Reason::WarmUp { sizes_profiled: profile.len() }, None, None),
            None => fallback(FallbackWhy::LadderBlocked),
        };
    }

    let Some(fit) = fit_delay(&profile, backlog) else { return fallback(FallbackWhy::NoFit) };
    if fit.alpha <= 0.0 {
        return finish(min, Reason::NoGain { alpha: fit.alpha }, Some(fit), None);
    }
    let bs_min = f64::from(profile[0].0);
    let star = plateau(&fit, tau(&fit, cfg.tau_rel, bs_min));
    if !star.is_finite() {
        return fallback(FallbackWhy::NoFit);
    }
    let (target, reason) = if star < f64::from(min) {
        (min, Reason::ClampedToMin { plateau: star })
    } else if star >= f64::from(max) + 1.0 {
        (max, Reason::ClampedToMax { plateau: star })
    } else {
        ((star.floor() as u32).clamp(min, max), Reason::Plateau { plateau: star })
    };
    finish(target, reason, Some(fit), Some(star))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn close(actual: f64, expected: f64, rel: f64) -> bool {
        ((actual - expected) / expected).abs() <= rel
    }

    /// Samples from rounds whose wall time follows R(bs) = c·bs^(1−α), i.e. a
    /// per-trace delay T₁(bs) = c·bs^(−α).
    fn rounds(sizes: &[u32], c: f64, alpha: f64) -> Vec<Sample> {
        sizes.iter().map(|&bs| Sample { batch_size: bs, round_secs: c * f64::from(bs).powf(1.0 - alpha) }).collect()
    }

    fn cfg() -> ControllerConfig {
        ControllerConfig { min_batch: 1, max_batch: 1024, ..ControllerConfig::default() }
    }

    #[test]
    fn fit_recovers_exact_power_law_within_two_percent() {
        for (a, alpha) in [(120.0, 0.7), (3.5, 0.2), (9000.0, 1.4)] {
            let points: Vec<(f64, f64)> =
                [4.0, 8.0, 16.0, 32.0, 64.0].iter().map(|&bs: &f64| (bs, a * bs.powf(-alpha))).collect();
            let fit = fit_power_law(&points).unwrap();
            assert!(close(fit.a, a, 0.02) && close(fit.alpha, alpha, 0.02), "{fit:?}");
            assert!(fit.r2 > 0.999_999);
        }
    }

    #[test]
    fn fit_recovers_noisy_power_law_within_ten_percent() {
        let (a, alpha) = (250.0, 0.8);
        for seed in 0..20 {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let points: Vec<(f64, f64)> = (1..=64)
                .map(|bs| {
                    let bs = f64::from(bs);
                    (bs, a * bs.powf(-alpha) * (1.0 + rng.gen_range(-0.1..=0.1)))
                })
                .collect();
            let fit = fit_power_law(&points).unwrap();
            assert!(close(fit.a, a, 0.10) && close(fit.alpha, alpha, 0.10), "seed {seed}: {fit:?}");
        }
    }

    #[test]
    fn fit_needs_two_distinct_positive_sizes() {
        assert!(fit_power_law(&[]).is_none());
        assert!(fit_power_law(&[(4.0, 10.0), (4.0, 12.0)]).is_none());
        assert!(fit_power_law(&[(4.0, 10.0), (8.0, 0.0)]).is_none());
        assert!(fit_power_law(&[(0.0, 10.0), (8.0, 5.0)]).is_none());
        assert!(fit_power_law(&[(4.0, f64::NAN), (8.0, 5.0)]).is_none());
        assert!(fit_power_law(&[(4.0, 10.0), (8.0, 5.0)]).is_some());
    }

    #[test]
    fn plateau_formula_matches_a_numeric_search() {
        for (a, alpha, tau_rel) in [(500.0, 0.9, 0.016), (40.0, 0.4, 0.05), (1e4, 1.6, 0.01)] {
            let fit = Fit { a, alpha, r2: 1.0 };
            let bs_min = 4.0;
            let tau = tau(&fit, tau_rel, bs_min);
            // |T′| decreases monotonically; bisect for the bs where it reaches τ.
            let (mut lo, mut hi) = (bs_min, 1e9);
            for _ in 0..200 {
                let mid = (lo + hi) / 2.0;
                if fit.slope(mid).abs() > tau { lo = mid } else { hi = mid }
            }
            let star = plateau(&fit, tau);
            assert!(close(star, lo, 1e-9), "formula {star} vs search {lo}");
            assert!(close(star, bs_min * tau_rel.powf(-1.0 / (alpha + 1.0)), 1e-9));
        }
    }

    #[test]
    fn choice_does_not_depend_on_the_backlog_size() {
        let samples = rounds(&[4, 8, 16, 32], 2.0, 0.6);
        let small = choose(&samples, 300, &cfg());
        let large = choose(&samples, 300_000, &cfg());
        assert_eq!(small.target, large.target);
        assert!(matches!(small.reason, Reason::Plateau { .. }), "{}", small.reason);
        let (fs, fl) = (small.fit.unwrap(), large.fit.unwrap());
        assert!(close(fl.a / fs.a, 1000.0, 1e-9), "A scales with N");
        assert!(close(fs.alpha, fl.alpha, 1e-12));
        // bs* = bs_min·τ_rel^(−1/(α+1)) = 4·0.016^(−1/1.6) ≈ 53.03
        assert_eq!(small.target, 53);
        assert_eq!(small.batch_size, 53);
    }

    #[test]
    fn warm_up_walks_the_ladder_within_the_backlog() {
        let c = ControllerConfig::default();
        assert_eq!(c.ladder, vec![4, 8, 16, 32, 64, 128, 256]);
        let first = choose(&[], 100, &c);
        assert_eq!((first.batch_size, first.reason.clone()), (4, Reason::WarmUp { sizes_profiled: 0 }));
        let second = choose(&rounds(&[4, 4], 1.0, 0.5), 100, &c);
        assert_eq!(second.batch_size, 8);
        let third = choose(&rounds(&[4, 8], 1.0, 0.5), 100, &c);
        assert_eq!((third.batch_size, third.reason), (16, Reason::WarmUp { sizes_profiled: 2 }));
        // Sizes profiled outside the ladder count; the ladder skips what was tried.
        let skip = choose(&rounds(&[4, 10], 1.0, 0.5), 100, &c);
        assert_eq!(skip.batch_size, 8);
        assert!(choose(&rounds(&[4, 8, 16], 1.0, 0.5), 100, &c).fit.is_some());
    }

    #[test]
    fn blocked_warm_up_falls_back_to_the_default() {
        let c = ControllerConfig { default_batch: 8, ..ControllerConfig::default() };
        // 4 and 8 are profiled, the next rung (16) does not fit a backlog of 12.
        let blocked = choose(&rounds(&[4, 8], 1.0, 0.5), 12, &c);
        assert_eq!((blocked.target, blocked.batch_size), (8, 8));
        assert_eq!(blocked.reason, Reason::Fallback { why: FallbackWhy::LadderBlocked });
        assert!(blocked.reason.message().contains("default_batch"));
        let small = choose(&rounds(&[4, 8], 1.0, 0.5), 6, &c);
        assert_eq!((small.target, small.batch_size), (8, 6));
        assert_eq!(small.reason, Reason::ClampedToBacklog { target: 8, backlog: 6 });
        let nothing = choose(&[], 0, &c);
        assert_eq!(nothing.batch_size, 0);
    }

    #[test]
    fn plateau_is_clamped_to_bounds_and_backlog() {
        let samples = rounds(&[4, 8, 16, 32], 2.0, 0.6); // bs* ≈ 53.03
        let capped = choose(&samples, 1000, &ControllerConfig { max_batch: 32, ..cfg() });
        assert_eq!(capped.target, 32);
        assert!(matches!(capped.reason, Reason::ClampedToMax { plateau } if close(plateau, 53.03, 0.001)));
        let raised = choose(&samples, 1000, &ControllerConfig { min_batch: 64, ..cfg() });
        assert_eq!(raised.target, 64);
        assert!(matches!(raised.reason, Reason::ClampedToMin { .. }));
        let short = choose(&samples, 40, &cfg());
        assert_eq!((short.target, short.batch_size), (53, 40));
        assert_eq!(short.reason, Reason::ClampedToBacklog { target: 53, backlog: 40 });
    }

    #[test]
    fn no_gain_from_batching_picks_the_minimum() {
        // Round time linear in bs: the backlog takes as long at any batch size.
        let samples = rounds(&[4, 8, 16], 0.5, 0.0);
        let choice = choose(&samples, 100, &ControllerConfig { min_batch: 3, ..cfg() });
        assert_eq!(choice.target, 3);
        assert!(matches!(choice.reason, Reason::NoGain { .. }));
    }

    #[test]
    fn profile_keeps_the_recent_window_per_size_by_median() {
        let s = |bs, r| Sample { batch_size: bs, round_secs: r };
        let samples = [s(4, 100.0), s(4, 1.0), s(4, 2.0), s(4, 3.0), s(8, 5.0), s(8, -1.0), s(0, 1.0)];
        assert_eq!(profile(&samples, 3), vec![(4, 2.0), (8, 5.0)]);
        assert_eq!(profile(&samples, 4), vec![(4, 2.5), (8, 5.0)]);
    }

    #[test]
    fn drift_in_latency_moves_the_fit() {
        let c = ControllerConfig { window: 3, ..cfg() };
        let mut samples = rounds(&[4, 8, 16, 32, 4, 8, 16, 32], 2.0, 0.6);
        let before = choose(&samples, 1000, &c);
        // The backend gets slower per call: fixed overhead grows, so batching helps more.
        let drifted = rounds(&[4, 8, 16, 32], 2.0, 0.9);
        samples.extend(drifted.iter().chain(&drifted).copied());
        let after = choose(&samples, 1000, &c);
        let (fb, fa) = (before.fit.unwrap(), after.fit.unwrap());
        assert!(close(fb.alpha, 0.6, 1e-9));
        assert!(close(fa.alpha, 0.9, 1e-9), "two of three window slots now hold the new latency: {fa:?}");
        assert_ne!(before.target, after.target);
        // A single outlier round does not move a size's median.
        samples.push(Sample { batch_size: 16, round_secs: 1e6 });
        assert_eq!(choose(&samples, 1000, &c).target, after.target);
    }

    #[test]
    fn config_validation() {
        assert_eq!(ControllerConfig::default().validate(), Ok(()));
        let bad = ControllerConfig { min_batch: 10, max_batch: 5, ..ControllerConfig::default() };
        assert_eq!(bad.validate(), Err(ConfigError::BadBounds));
        let bad = ControllerConfig { tau_rel: 0.0, ..ControllerConfig::default() };
        assert_eq!(bad.validate(), Err(ConfigError::BadTauRel));
        assert_eq!(ControllerConfig::doubling_ladder(4, 20), vec![4, 8, 16]);
    }
}
