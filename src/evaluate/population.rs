//! Decisions over a prompt's population of arms (the champion serving
//! production and its challengers): how traffic is split (LUCB-style), when a
//! challenger may replace the champion (the promotion gate), which arm to
//! retire when the population is full, and when production has regressed and
//! must be rolled back (the regression guard). Pure functions: the caller
//! supplies ratings and outcome aggregates and records the decision with its
//! numbers (they are what the label history shows).

use serde::Serialize;

use super::{
    stats::{Moments, drop_z},
    trueskill::Rating,
};

/// One arm as the decisions see it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arm {
    /// The version this arm serves.
    pub version: i64,
    pub rating: Rating,
    /// Traces of this version that carry a reward.
    pub scored_traces: u64,
}

/// Knobs of the population (defaults: `[population]` in `docs/configuration.md`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PopulationPolicy {
    /// Share of traffic all challengers together receive (default 0.2).
    pub explore_share: f64,
    /// Share every challenger receives at least, so the newest child is always
    /// measured (default 0.02; lowered to explore_share/n when there are many).
    pub min_arm_share: f64,
    /// Scored traces each side needs before the gate may act (default 50).
    pub min_traces: u64,
    /// Most challengers beside the champion (default 4).
    pub max_arms: usize,
}

impl Default for PopulationPolicy {
    fn default() -> Self {
        PopulationPolicy { explore_share: 0.2, min_arm_share: 0.02, min_traces: 50, max_arms: 4 }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PolicyError {
    #[error("`explore_share` must be in (0, 1), got {0}")]
    ExploreShare(f64),
    #[error("`min_arm_share` must be in (0, explore_share], got {0}")]
    MinArmShare(f64),
    #[error("`max_arms` must be at least 1")]
    MaxArms,
}

impl PopulationPolicy {
    pub fn validate(&self) -> Result<(), PolicyError> {
        if !(self.explore_share > 0.0 && self.explore_share < 1.0) {
            return Err(PolicyError::ExploreShare(self.explore_share));
        }
        if !(self.min_arm_share > 0.0 && self.min_arm_share <= self.explore_share) {
            return Err(PolicyError::MinArmShare(self.min_arm_share));
        }
        if self.max_arms == 0 {
            return Err(PolicyError::MaxArms);
        }
        Ok(())
    }
}

/// Orders by a score, then by version (newer first) so ties are deterministic.
fn by_score(score: impl Fn(&Arm) -> f64) -> impl Fn(&&Arm, &&Arm) -> std::cmp::Ordering {
    move |a, b| score(a).total_cmp(&score(b)).then(a.version.cmp(&b.version))
}

/// Traffic weights (version, share), summing to 1, in the order of `arms`.
///
/// LUCB-style: the champion (the version production points at, which the
/// gate keeps equal to the best μ−2σ with enough evidence) exploits with
/// 1 − explore_share; every challenger gets a floor share (so the newest
/// child is always measured) and the rest of the exploration share goes to
/// the challenger with the highest μ+2σ, the one most likely to overturn the
/// champion. A population without challengers sends everything to the
/// champion. `champion` must be one of `arms`; if it is not, the arm with the
/// highest μ−2σ is treated as champion.
pub fn traffic_weights(arms: &[Arm], champion: i64, policy: &PopulationPolicy) -> Vec<(i64, f64)> {
    let Some(champ) = arms
        .iter()
        .find(|a| a.version == champion)
        .or_else(|| arms.iter().max_by(by_score(|a| a.rating.conservative())))
        .map(|a| a.version)
    else {
        return Vec::new();
    };
    let challengers: Vec<&Arm> = arms.iter().filter(|a| a.version != champ).collect();
    if challengers.is_empty() {
        return arms.iter().map(|a| (a.version, 1.0)).collect();
    }
    let n = challengers.len() as f64;
    let floor = policy.min_arm_share.min(policy.explore_share / n);
    let leader = challengers.iter().copied().max_by(by_score(|a| a.rating.optimistic())).map(|a| a.version);
    let bonus = policy.explore_share - floor * n;
    arms.iter()
        .map(|a| {
            let share = if a.version == champ {
                1.0 - policy.explore_share
            } else if Some(a.version) == leader {
                floor + bonus
            } else {
                floor
            };
            (a.version, share)
        })
        .collect()
}

/// What the gate decided, with the numbers it decided on.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum GateDecision {
    /// Move production to `challenger`.
    Promote {
        challenger: i64,
        challenger_lower: f64,
        champion_lower: f64,
        challenger_traces: u64,
        champion_traces: u64,
    },
    /// The champion has too few scored traces to be compared.
    ChampionUnderSampled { traces: u64, needed: u64 },
    /// No challenger with enough traces has a higher μ−2σ than the champion.
    Hold { champion_lower: f64, best_challenger: Option<i64>, best_challenger_lower: Option<f64> },
}

/// The promotion gate (`docs/evaluated-policy.md`): the champion changes only when a
/// challenger's μ−2σ exceeds the champion's μ−2σ *and* both have at least
/// `min_traces` scored traces. Among several such challengers the highest
/// μ−2σ wins.
pub fn gate(champion: &Arm, challengers: &[Arm], policy: &PopulationPolicy) -> GateDecision {
    let champion_lower = champion.rating.conservative();
    if champion.scored_traces < policy.min_traces {
        return GateDecision::ChampionUnderSampled { traces: champion.scored_traces, needed: policy.min_traces };
    }
    let best = challengers
        .iter()
        .filter(|c| c.version != champion.version && c.scored_traces >= policy.min_traces)
        .max_by(by_score(|a| a.rating.conservative()));
    match best {
        Some(c) if c.rating.conservative() > champion_lower => GateDecision::Promote {
            challenger: c.version,
            challenger_lower: c.rating.conservative(),
            champion_lower,
            challenger_traces: c.scored_traces,
            champion_traces: champion.scored_traces,
        },
        other => GateDecision::Hold {
            champion_lower,
            best_challenger: other.map(|c| c.version),
            best_challenger_lower: other.map(|c| c.rating.conservative()),
        },
    }
}

/// The challenger to retire so a new child can join: when the challengers
/// already number `max_arms`, the one with the lowest μ−2σ (older first on a
/// tie). Never the champion, never `newest` (it has not been measured yet).
pub fn arm_to_retire(arms: &[Arm], champion: i64, newest: Option<i64>, policy: &PopulationPolicy) -> Option<i64> {
    let challengers: Vec<&Arm> = arms.iter().filter(|a| a.version != champion).collect();
    if challengers.len() < policy.max_arms {
        return None;
    }
    challengers
        .into_iter()
        .filter(|a| Some(a.version) != newest)
        .min_by(|a, b| a.rating.conservative().total_cmp(&b.rating.conservative()).then(a.version.cmp(&b.version)))
        .map(|a| a.version)
}

/// Knobs of the regression guard.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GuardPolicy {
    /// Scored traces each window needs before it can be judged (default 30).
    pub min_traces: u64,
    /// One-sided z the drop must exceed (default 2.326, i.e. 99% confidence).
    pub z: f64,
    /// Smallest drop in mean reward worth a rollback, in reward units
    /// (default 0.02: two points of success rate).
    pub min_drop: f64,
}

impl Default for GuardPolicy {
    fn default() -> Self {
        GuardPolicy { min_traces: 30, z: 2.326, min_drop: 0.02 }
    }
}

/// What production's current window is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Baseline {
    /// The same version in the window before.
    PreviousWindow,
    /// The version production pointed at before this one.
    PreviousProduction { version: i64 },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum GuardDecision {
    /// Production got significantly worse than `baseline`: roll back.
    RollBack { baseline: Baseline, baseline_mean: f64, current_mean: f64, z: f64 },
    /// Not enough scored traces in the current window to judge.
    TooFewTraces { traces: u64, needed: u64 },
    /// No baseline showed a significant drop.
    Healthy,
}

/// The regression guard: roll back when production's mean reward in the
/// current window is below a baseline's by at least `min_drop` with one-sided
/// Welch z ≥ `z`. Baselines with too few traces are skipped. When both
/// baselines trigger, the larger z is reported.
pub fn regression(current: &Moments, baselines: &[(Baseline, Moments)], policy: &GuardPolicy) -> GuardDecision {
    if current.count < policy.min_traces {
        return GuardDecision::TooFewTraces { traces: current.count, needed: policy.min_traces };
    }
    let Some(current_mean) = current.mean() else {
        return GuardDecision::Healthy;
    };
    baselines
        .iter()
        .filter(|(_, m)| m.count >= policy.min_traces)
        .filter_map(|(b, m)| {
            let baseline_mean = m.mean()?;
            let z = drop_z(m, current)?;
            (baseline_mean - current_mean >= policy.min_drop && z >= policy.z).then_some((*b, baseline_mean, z))
        })
        .max_by(|a, b| a.2.total_cmp(&b.2))
        .map_or(GuardDecision::Healthy, |(baseline, baseline_mean, z)| GuardDecision::RollBack {
            baseline,
            baseline_mean,
            current_mean,
            z,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arm(version: i64, mu: f64, sigma: f64, scored_traces: u64) -> Arm {
        Arm { version, rating: Rating { mu, sigma }, scored_traces }
    }

    fn share(weights: &[(i64, f64)], version: i64) -> f64 {
        weights.iter().find(|(v, _)| *v == version).map(|(_, w)| *w).unwrap()
    }

    #[test]
    fn the_champion_gets_most_traffic_and_the_most_promising_challenger_the_rest() {
        let policy = PopulationPolicy::default();
        let arms = [arm(1, 30.0, 1.0, 400), arm(2, 27.0, 1.0, 300), arm(3, 25.0, 8.0, 0), arm(4, 26.0, 3.0, 60)];
        let w = traffic_weights(&arms, 1, &policy);
        assert!((w.iter().map(|(_, s)| s).sum::<f64>() - 1.0).abs() < 1e-12);
        assert!((share(&w, 1) - 0.8).abs() < 1e-12);
        // Version 3 has the highest μ+2σ (41): it gets the exploration bonus.
        assert!((share(&w, 3) - (0.2 - 2.0 * 0.02)).abs() < 1e-12, "{w:?}");
        assert!((share(&w, 2) - 0.02).abs() < 1e-12 && (share(&w, 4) - 0.02).abs() < 1e-12);
    }

    #[test]
    fn a_lone_champion_gets_everything_and_floors_shrink_with_many_challengers() {
        let policy = PopulationPolicy { explore_share: 0.1, min_arm_share: 0.05, ..Default::default() };
        assert_eq!(traffic_weights(&[arm(7, 25.0, 8.0, 0)], 7, &policy), vec![(7, 1.0)]);
        let arms = [arm(1, 30.0, 1.0, 10), arm(2, 20.0, 1.0, 0), arm(3, 20.0, 1.0, 0), arm(4, 20.0, 1.0, 0)];
        let w = traffic_weights(&arms, 1, &policy);
        for v in 2..=4 {
            assert!((share(&w, v) - 0.1 / 3.0).abs() < 1e-12, "{w:?}");
        }
        assert!(traffic_weights(&[], 1, &policy).is_empty());
    }

    #[test]
    fn the_gate_waits_for_evidence_on_both_sides() {
        let policy = PopulationPolicy::default();
        let strong_but_new = arm(2, 40.0, 1.0, 49);
        assert_eq!(
            gate(&arm(1, 25.0, 1.0, 500), &[strong_but_new], &policy),
            GateDecision::Hold { champion_lower: 23.0, best_challenger: None, best_challenger_lower: None }
        );
        assert_eq!(
            gate(&arm(1, 25.0, 1.0, 10), &[arm(2, 40.0, 1.0, 500)], &policy),
            GateDecision::ChampionUnderSampled { traces: 10, needed: 50 }
        );
    }

    #[test]
    fn the_gate_promotes_only_on_a_higher_conservative_score() {
        let policy = PopulationPolicy::default();
        let champion = arm(1, 28.0, 1.0, 200); // μ−2σ = 26
        // Higher μ but too uncertain: μ−2σ = 30 − 6 = 24.
        assert!(matches!(gate(&champion, &[arm(2, 30.0, 3.0, 60)], &policy), GateDecision::Hold { .. }));
        let d = gate(&champion, &[arm(2, 30.0, 3.0, 60), arm(3, 29.0, 1.0, 80), arm(4, 28.5, 1.0, 90)], &policy);
        assert_eq!(
            d,
            GateDecision::Promote {
                challenger: 3,
                challenger_lower: 27.0,
                champion_lower: 26.0,
                challenger_traces: 80,
                champion_traces: 200
            }
        );
    }

    #[test]
    fn retire_the_weakest_challenger_but_never_the_champion_or_the_newest() {
        let policy = PopulationPolicy { max_arms: 2, ..Default::default() };
        let arms = [arm(1, 10.0, 1.0, 100), arm(2, 26.0, 1.0, 100), arm(3, 20.0, 8.0, 0)];
        assert_eq!(arm_to_retire(&arms, 1, Some(3), &policy), Some(2));
        assert_eq!(arm_to_retire(&arms, 1, None, &policy), Some(3));
        assert_eq!(arm_to_retire(&arms[..2], 1, None, &policy), None);
    }

    #[test]
    fn policy_validation_explains_bad_knobs() {
        assert!(PopulationPolicy::default().validate().is_ok());
        let bad = PopulationPolicy { explore_share: 1.0, ..Default::default() };
        assert_eq!(bad.validate(), Err(PolicyError::ExploreShare(1.0)));
        let bad = PopulationPolicy { min_arm_share: 0.5, ..Default::default() };
        assert_eq!(bad.validate(), Err(PolicyError::MinArmShare(0.5)));
    }

    /// `n` Bernoulli rewards with `successes` ones, interleaved.
    fn window(successes: u64, n: u64) -> Moments {
        let values: Vec<f64> =
            (0..n).map(|i| if i * successes / n != (i + 1) * successes / n { 1.0 } else { 0.0 }).collect();
        let m = Moments::from_values(&values);
        assert_eq!(m.sum as u64, successes);
        m
    }

    #[test]
    fn the_guard_rolls_back_a_significant_drop() {
        let policy = GuardPolicy::default();
        let d = regression(&window(120, 200), &[(Baseline::PreviousWindow, window(170, 200))], &policy);
        let GuardDecision::RollBack { baseline, baseline_mean, current_mean, z } = d else { panic!("{d:?}") };
        assert_eq!(baseline, Baseline::PreviousWindow);
        assert!((baseline_mean - 0.85).abs() < 1e-12 && (current_mean - 0.6).abs() < 1e-12 && z > 5.0);
    }

    #[test]
    fn the_guard_ignores_noise_small_drops_and_thin_windows() {
        let policy = GuardPolicy::default();
        // 0.80 → 0.78 on 100 traces each: well within noise.
        let noisy = regression(&window(78, 100), &[(Baseline::PreviousWindow, window(80, 100))], &policy);
        assert_eq!(noisy, GuardDecision::Healthy);
        // Significant but below min_drop (0.01 on 200k traces).
        let tiny =
            regression(&window(179_000, 200_000), &[(Baseline::PreviousWindow, window(181_000, 200_000))], &policy);
        assert_eq!(tiny, GuardDecision::Healthy);
        assert_eq!(
            regression(&window(0, 10), &[(Baseline::PreviousWindow, window(10, 10))], &policy),
            GuardDecision::TooFewTraces { traces: 10, needed: 30 }
        );
        // A baseline with too few traces is not evidence.
        assert_eq!(
            regression(&window(10, 100), &[(Baseline::PreviousWindow, window(10, 10))], &policy),
            GuardDecision::Healthy
        );
    }

    #[test]
    fn the_guard_reports_the_strongest_baseline() {
        let policy = GuardPolicy::default();
        let d = regression(
            &window(100, 200),
            &[
                (Baseline::PreviousWindow, window(130, 200)),
                (Baseline::PreviousProduction { version: 4 }, window(180, 200)),
            ],
            &policy,
        );
        assert!(
            matches!(d, GuardDecision::RollBack { baseline: Baseline::PreviousProduction { version: 4 }, .. }),
            "{d:?}"
        );
    }
}
