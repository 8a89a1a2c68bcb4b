//! The regression guard's judgement, as a pure function: is production's
//! reward in the current window significantly below a reference window (its
//! own previous window, or the previous production version's last window)?
//! "Significantly" means all of: at least `min_traces` rewarded traces on both
//! sides, a one-sided test at level `alpha` (two-proportion z test on
//! `feedback.success`, or Welch's z on `feedback.score` when success is not
//! reported), and a drop of at least `min_drop`. The worker (`worker::guard`)
//! feeds it the store's aggregates and acts on the verdict.

use serde::Serialize;

use super::{
    outcomes::{OutcomeBucket, RewardSources},
    stats::{Moments, drop_z, normal_cdf},
};

/// The thresholds of one judgement (from `[guard]` in the configuration).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GuardThresholds {
    pub alpha: f64,
    pub min_drop: f64,
    pub min_traces: u64,
}

/// One version's rewards in one window: what the store aggregates.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WindowRewards {
    pub success_trials: u64,
    pub successes: u64,
    pub score: Moments,
    /// Which rewards these are: reported by agents and operators, or judged.
    pub sources: RewardSources,
}

impl WindowRewards {
    /// The sum of `version`'s buckets.
    pub fn of_version(buckets: &[OutcomeBucket], version: i64) -> Self {
        buckets.iter().filter(|b| b.version == Some(version)).fold(Self::default(), |acc, b| Self {
            success_trials: acc.success_trials + b.success_trials,
            successes: acc.successes + b.successes,
            score: acc.score.combined(&b.score),
            sources: RewardSources {
                reported: acc.sources.reported + b.with_feedback.saturating_sub(b.judged),
                judged: acc.sources.judged + b.judged,
            },
        })
    }
}

/// Which reward was compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Metric {
    Success,
    Score,
}

/// The numbers of one comparison (the evidence of a rollback).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    pub metric: Metric,
    /// Traces with the reward on each side.
    pub reference_n: u64,
    pub current_n: u64,
    /// Success rate or mean score on each side.
    pub reference: f64,
    pub current: f64,
    /// `reference - current`: positive when production got worse.
    pub drop: f64,
    /// The one-sided test statistic and its p-value (H1: current is worse).
    pub z: f64,
    pub p_value: f64,
    /// The p-value is below `alpha` and the drop at least `min_drop`.
    pub significant: bool,
}

/// Compares `current` with `reference`; `None` when either side has fewer
/// than `min_traces` traces with the reward (no evidence, no verdict).
/// Success is preferred when both sides report it enough; score otherwise.
pub fn compare(reference: &WindowRewards, current: &WindowRewards, t: &GuardThresholds) -> Option<Comparison> {
    let min = t.min_traces.max(2);
    let (metric, reference_n, current_n, reference_v, current_v, z) =
        if reference.success_trials >= min && current.success_trials >= min {
            let (n1, n2) = (reference.success_trials as f64, current.success_trials as f64);
            let (p1, p2) = (reference.successes as f64 / n1, current.successes as f64 / n2);
            let pooled = (reference.successes + current.successes) as f64 / (n1 + n2);
            let se = (pooled * (1.0 - pooled) * (1.0 / n1 + 1.0 / n2)).sqrt();
            // se = 0 only when both sides are all successes or all failures: no difference.
            let z = if se > 0.0 { (p1 - p2) / se } else { 0.0 };
            (Metric::Success, reference.success_trials, current.success_trials, p1, p2, z)
        } else if reference.score.count >= min && current.score.count >= min {
            let z = drop_z(&reference.score, &current.score)?;
            let (m1, m2) = (reference.score.mean()?, current.score.mean()?);
            (Metric::Score, reference.score.count, current.score.count, m1, m2, z)
        } else {
            return None;
        };
    let p_value = 1.0 - normal_cdf(z);
    let drop = reference_v - current_v;
    Some(Comparison {
        metric,
        reference_n,
        current_n,
        reference: reference_v,
        current: current_v,
        drop,
        z,
        p_value,
        significant: p_value < t.alpha && drop >= t.min_drop,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: GuardThresholds = GuardThresholds { alpha: 0.01, min_drop: 0.05, min_traces: 50 };

    fn rate(successes: u64, trials: u64) -> WindowRewards {
        WindowRewards { success_trials: trials, successes, ..Default::default() }
    }

    #[test]
    fn a_clear_drop_in_success_is_significant() {
        let c = compare(&rate(90, 100), &rate(60, 100), &T).unwrap();
        assert_eq!(c.metric, Metric::Success);
        assert!((c.drop - 0.30).abs() < 1e-12);
        // Pooled p = 0.75, se = sqrt(0.75 * 0.25 * 0.02) = 0.061237: z = 0.30 / 0.061237 = 4.899.
        assert!((c.z - 4.898_979).abs() < 1e-5, "{}", c.z);
        assert!(c.p_value < 1e-5);
        assert!(c.significant);
    }

    #[test]
    fn noise_thin_evidence_small_drops_and_improvements_do_not_fire() {
        // Within noise: 0.80 vs 0.76 on 100 each (z ≈ 0.69).
        assert!(!compare(&rate(80, 100), &rate(76, 100), &T).unwrap().significant);
        // Thin: a huge drop on 49 traces is no evidence at all.
        assert!(compare(&rate(49, 49), &rate(0, 49), &T).is_none());
        assert!(compare(&rate(50, 50), &rate(0, 49), &T).is_none());
        // Significant but below min_drop: 0.50 vs 0.47 on 100,000 each.
        let c = compare(&rate(50_000, 100_000), &rate(47_000, 100_000), &T).unwrap();
        assert!(c.p_value < 0.01 && !c.significant);
        // Better is never a regression; equal extremes are no difference.
        assert!(!compare(&rate(50, 100), &rate(90, 100), &T).unwrap().significant);
        assert_eq!(compare(&rate(100, 100), &rate(100, 100), &T).unwrap().z, 0.0);
    }

    #[test]
    fn score_is_compared_with_welch_when_success_is_not_reported() {
        let good = WindowRewards { score: Moments::from_values(&[0.9; 30].repeat(2)), ..Default::default() };
        let mixed: Vec<f64> = (0..60).map(|i| if i % 2 == 0 { 0.2 } else { 0.6 }).collect();
        let bad = WindowRewards { score: Moments::from_values(&mixed), ..Default::default() };
        let c = compare(&good, &bad, &T).unwrap();
        assert_eq!(c.metric, Metric::Score);
        assert!((c.drop - 0.5).abs() < 1e-9 && c.significant);
        // Welch: se = sqrt(0/60 + var/60) with var = 0.0406779 (n-1): z = 0.5 / 0.026038 = 19.2.
        assert!((c.z - 19.203).abs() < 0.01, "{}", c.z);
    }

    #[test]
    fn window_rewards_sum_one_versions_buckets() {
        let b = |version, successes, trials| OutcomeBucket {
            version,
            success_trials: trials,
            successes,
            ..Default::default()
        };
        let buckets = [b(Some(2), 3, 4), b(Some(1), 1, 1), b(Some(2), 5, 6), b(None, 9, 9)];
        assert_eq!(WindowRewards::of_version(&buckets, 2), rate(8, 10));
    }
}
