//! Decisions over a prompt's population of arms (the champion serving
//! production and its challengers): how traffic is split (LUCB-style), when a
//! challenger may replace the champion (the promotion gate, with a margin and a
//! cool-down so that equally good versions do not take turns), and which arm to
//! retire when the population is full. Pure functions: the caller supplies
//! ratings and trace counts and records the decision with its numbers (they are
//! what the label history shows). (Rolling production back is the regression
//! guard's, in [`super::guard`].)

use serde::Serialize;

use super::trueskill::Rating;

/// One arm as the decisions see it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arm {
    /// The version this arm serves.
    pub version: i64,
    pub rating: Rating,
    /// Traces of this version that carry a reward.
    pub scored_traces: u64,
}

/// Knobs of the population (the server's `[population]` in `docs/configuration.md`,
/// each overridable per prompt through `settings.population`: see
/// `domain::population_settings::PopulationOverrides::applied_to`).
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
    /// TrueSkill points by which a challenger's μ−2σ must exceed the champion's
    /// before the gate moves production (default [`DEFAULT_MARGIN`]).
    pub margin: f64,
    /// Rating windows production stays after it last moved (by the gate, an
    /// operator or the regression guard) before the gate may move it again
    /// (default [`DEFAULT_COOLDOWN_WINDOWS`]).
    pub cooldown_windows: u64,
    /// Chance per rated window of a crossover (default 0.2).
    pub crossover_prob: f64,
    /// Longest rating window, seconds (the server's `window_secs`, default 600):
    /// also how long a new arm waits at most for its first evidence.
    pub window_secs: u64,
    /// Shortest rating window, seconds (the server's `min_window_secs`, default
    /// 60): a window closes this early once its arms have their evidence.
    pub min_window_secs: u64,
}

/// Default gate margin, in TrueSkill points: about half of β (25/6, the spread
/// of one window's performance), so a challenger must be ahead on its
/// *conservative* score by more than a lucky window or two moves a
/// well-measured rating. A clearly better version gains that much within a few
/// windows; an equally good one rarely does.
pub const DEFAULT_MARGIN: f64 = 2.0;

/// Default cool-down, in rating windows (100 minutes at the default 600 s
/// window): production moves at most about once per ten windows, so among
/// equally good versions — whose ratings cross back and forth by chance — it
/// moves at most a few times a day instead of every window or two.
pub const DEFAULT_COOLDOWN_WINDOWS: u64 = 10;

impl Default for PopulationPolicy {
    fn default() -> Self {
        PopulationPolicy {
            explore_share: 0.2,
            min_arm_share: 0.02,
            min_traces: 50,
            max_arms: 4,
            margin: DEFAULT_MARGIN,
            cooldown_windows: DEFAULT_COOLDOWN_WINDOWS,
            crossover_prob: 0.2,
            window_secs: 600,
            min_window_secs: 60,
        }
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
    #[error("`margin` must be a number ≥ 0, got {0}")]
    Margin(f64),
    #[error("`crossover_prob` must be in [0, 1], got {0}")]
    CrossoverProb(f64),
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
        if !(self.margin.is_finite() && self.margin >= 0.0) {
            return Err(PolicyError::Margin(self.margin));
        }
        if !(0.0..=1.0).contains(&self.crossover_prob) {
            return Err(PolicyError::CrossoverProb(self.crossover_prob));
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
        margin: f64,
    },
    /// The champion has too few scored traces to be compared.
    ChampionUnderSampled { traces: u64, needed: u64 },
    /// Production moved too recently: the gate waits `cooldown_windows` windows.
    CoolingDown { windows_since_move: u64, cooldown_windows: u64 },
    /// No challenger with enough traces has a μ−2σ above the champion's by the margin.
    Hold { champion_lower: f64, best_challenger: Option<i64>, best_challenger_lower: Option<f64>, margin: f64 },
}

/// The promotion gate (`docs/evaluated-policy.md`, `docs/learning-controller.md`):
/// the champion changes only when both sides have at least `min_traces`
/// scored traces and a challenger's μ−2σ exceeds the champion's μ−2σ by more
/// than `margin`; among several such challengers the highest μ−2σ wins. For
/// `cooldown_windows` rating windows after production moved
/// (`windows_since_move`: `None` when it never moved from one version to
/// another) only a challenger in `built_on_champion` may pass — a version
/// learned on top of production, holding what it holds and more: moving
/// forward to it cannot take production back and forth. A move back to an
/// earlier version — a former champion competing on as a challenger — or
/// sideways to a sibling passes exactly the same test, cool-down included: no
/// version is favoured for having served before.
pub fn gate(
    champion: &Arm,
    challengers: &[Arm],
    policy: &PopulationPolicy,
    windows_since_move: Option<u64>,
    built_on_champion: &[i64],
) -> GateDecision {
    let champion_lower = champion.rating.conservative();
    if champion.scored_traces < policy.min_traces {
        return GateDecision::ChampionUnderSampled { traces: champion.scored_traces, needed: policy.min_traces };
    }
    let cooling = windows_since_move.filter(|since| *since < policy.cooldown_windows);
    let best = challengers
        .iter()
        .filter(|c| c.version != champion.version && c.scored_traces >= policy.min_traces)
        .filter(|c| cooling.is_none() || built_on_champion.contains(&c.version))
        .max_by(by_score(|a| a.rating.conservative()));
    match (best, cooling) {
        (Some(c), _) if c.rating.conservative() > champion_lower + policy.margin => GateDecision::Promote {
            challenger: c.version,
            challenger_lower: c.rating.conservative(),
            champion_lower,
            challenger_traces: c.scored_traces,
            champion_traces: champion.scored_traces,
            margin: policy.margin,
        },
        (_, Some(since)) => {
            GateDecision::CoolingDown { windows_since_move: since, cooldown_windows: policy.cooldown_windows }
        }
        (other, None) => GateDecision::Hold {
            champion_lower,
            best_challenger: other.map(|c| c.version),
            best_challenger_lower: other.map(|c| c.rating.conservative()),
            margin: policy.margin,
        },
    }
}

/// The challenger to retire so a new child can join: when the challengers
/// already number `max_arms`, the one with the lowest μ−2σ (older first on a
/// tie) — first among those whose lessons another live arm holds (`covered`:
/// nothing learned is lost with them), then among the rest. Never the
/// champion, never `newest`, never an arm in `unmeasured` (it has not had its
/// chance to be rated yet).
pub fn arm_to_retire(
    arms: &[Arm],
    champion: i64,
    newest: Option<i64>,
    unmeasured: &[i64],
    covered: &[i64],
    policy: &PopulationPolicy,
) -> Option<i64> {
    let challengers: Vec<&Arm> = arms.iter().filter(|a| a.version != champion).collect();
    if challengers.len() < policy.max_arms {
        return None;
    }
    let weakest = |covered_only: bool| {
        challengers
            .iter()
            .filter(|a| Some(a.version) != newest && !unmeasured.contains(&a.version))
            .filter(|a| !covered_only || covered.contains(&a.version))
            .min_by(|a, b| a.rating.conservative().total_cmp(&b.rating.conservative()).then(a.version.cmp(&b.version)))
            .map(|a| a.version)
    };
    weakest(true).or_else(|| weakest(false))
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
            gate(&arm(1, 25.0, 1.0, 500), &[strong_but_new], &policy, None, &[]),
            GateDecision::Hold {
                champion_lower: 23.0,
                best_challenger: None,
                best_challenger_lower: None,
                margin: 2.0
            }
        );
        assert_eq!(
            gate(&arm(1, 25.0, 1.0, 10), &[arm(2, 40.0, 1.0, 500)], &policy, None, &[]),
            GateDecision::ChampionUnderSampled { traces: 10, needed: 50 }
        );
    }

    #[test]
    fn the_gate_promotes_only_on_a_conservative_score_higher_by_the_margin() {
        let no_margin = PopulationPolicy { margin: 0.0, ..PopulationPolicy::default() };
        let champion = arm(1, 28.0, 1.0, 200); // μ−2σ = 26
        // Higher μ but too uncertain: μ−2σ = 30 − 6 = 24.
        assert!(matches!(gate(&champion, &[arm(2, 30.0, 3.0, 60)], &no_margin, None, &[]), GateDecision::Hold { .. }));
        let challengers = [arm(2, 30.0, 3.0, 60), arm(3, 29.0, 1.0, 80), arm(4, 28.5, 1.0, 90)];
        assert_eq!(
            gate(&champion, &challengers, &no_margin, None, &[]),
            GateDecision::Promote {
                challenger: 3,
                challenger_lower: 27.0,
                champion_lower: 26.0,
                challenger_traces: 80,
                champion_traces: 200,
                margin: 0.0,
            }
        );
        // The default margin (2 points) is not exceeded by 27 over 26; 28.5 over 26 is.
        assert!(matches!(
            gate(&champion, &challengers, &PopulationPolicy::default(), None, &[]),
            GateDecision::Hold { .. }
        ));
        let ahead = arm(5, 30.5, 1.0, 80);
        assert!(matches!(
            gate(&champion, &[ahead], &PopulationPolicy::default(), None, &[]),
            GateDecision::Promote { challenger: 5, .. }
        ));
    }

    #[test]
    fn after_a_move_the_gate_cools_down_whichever_way_production_would_go() {
        let policy = PopulationPolicy::default();
        let champion = arm(7, 25.0, 1.0, 200);
        // The former champion (version 3) is far ahead again: it still waits out the cool-down.
        let former = arm(3, 35.0, 1.0, 900);
        assert_eq!(
            gate(&champion, &[former], &policy, Some(9), &[]),
            GateDecision::CoolingDown { windows_since_move: 9, cooldown_windows: DEFAULT_COOLDOWN_WINDOWS }
        );
        assert!(matches!(
            gate(&champion, &[former], &policy, Some(10), &[]),
            GateDecision::Promote { challenger: 3, .. }
        ));
        // Production that never moved (only created) has no cool-down.
        assert!(matches!(gate(&champion, &[former], &policy, None, &[]), GateDecision::Promote { .. }));
        // A version built on production moves it forward within the cool-down, on the same evidence;
        // the former champion still waits.
        let forward = arm(8, 35.0, 1.0, 900);
        assert!(matches!(
            gate(&champion, &[former, forward], &policy, Some(1), &[8]),
            GateDecision::Promote { challenger: 8, .. }
        ));
        let not_ahead = arm(8, 25.5, 1.0, 900);
        assert_eq!(
            gate(&champion, &[former, not_ahead], &policy, Some(1), &[8]),
            GateDecision::CoolingDown { windows_since_move: 1, cooldown_windows: DEFAULT_COOLDOWN_WINDOWS }
        );
    }

    /// Equally good arms rated window after window on noisy rewards, as the
    /// rater does: the champion with 80 % of 400 runs, three challengers sharing
    /// the rest, every arm succeeding 80 % of the time. Returns production's
    /// moves over `windows` rating windows.
    fn moves_among_equals(policy: &PopulationPolicy, seed: u64, windows: u64, better: Option<f64>) -> Vec<(u64, i64)> {
        use crate::evaluate::trueskill::{TrueSkill, ranks_from_rewards};
        use rand::{Rng, SeedableRng};
        let ts = TrueSkill::default();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let success = |v: i64| if v == 4 { better.unwrap_or(0.8) } else { 0.8 };
        let mut arms: Vec<Arm> = (1..=4).map(|v| arm(v, 25.0, 25.0 / 3.0, 0)).collect();
        let mut champion = 1;
        let mut last_move: Option<u64> = None;
        let mut moves = Vec::new();
        for w in 0..windows {
            let rewards: Vec<f64> = arms
                .iter()
                .map(|a| {
                    let n = if a.version == champion { 320 } else { 27 };
                    let wins = (0..n).filter(|_| rng.r#gen::<f64>() < success(a.version)).count();
                    wins as f64 / n as f64
                })
                .collect();
            for a in arms.iter_mut() {
                a.scored_traces += if a.version == champion { 320 } else { 27 };
            }
            let ratings: Vec<Rating> = arms.iter().map(|a| a.rating).collect();
            let new = ts.rate_ranking(&ratings, &ranks_from_rewards(&rewards, 0.01)).unwrap();
            arms.iter_mut().zip(new).for_each(|(a, r)| a.rating = r);
            let champ = *arms.iter().find(|a| a.version == champion).unwrap();
            if let GateDecision::Promote { challenger, .. } = gate(&champ, &arms, policy, last_move.map(|m| w - m), &[])
            {
                champion = challenger;
                last_move = Some(w);
                moves.push((w, challenger));
            }
        }
        moves
    }

    #[test]
    fn the_margin_holds_production_through_rating_noise() {
        let today = PopulationPolicy { margin: 0.0, cooldown_windows: 0, ..PopulationPolicy::default() };
        let defaults = PopulationPolicy::default();
        let seeds = 0..20;
        let before: Vec<usize> = seeds.clone().map(|s| moves_among_equals(&today, s, 30, None).len()).collect();
        let after: Vec<usize> = seeds.clone().map(|s| moves_among_equals(&defaults, s, 30, None).len()).collect();
        // Without margin and cool-down equally good versions take turns in production.
        assert!(before.iter().sum::<usize>() >= 20 * 3, "{before:?}");
        // With them, production moves at most twice in 30 windows, whatever the noise.
        assert!(after.iter().all(|&m| m <= 2), "{after:?}");
        // A version 10 points better still takes production, in every run.
        for s in seeds {
            let moved = moves_among_equals(&defaults, s, 30, Some(0.9));
            assert!(moved.iter().any(|&(_, v)| v == 4), "seed {s}: {moved:?}");
        }
    }

    /// At high traffic windows close after a minute: a day is 1,440 windows.
    /// Equally good versions still move production only a few times a day
    /// (the margin and the cool-down count windows, whatever their length).
    #[test]
    fn a_day_of_one_minute_windows_moves_production_among_equals_a_few_times_at_most() {
        let defaults = PopulationPolicy::default();
        let moves: Vec<usize> = (0..10).map(|s| moves_among_equals(&defaults, s, 1440, None).len()).collect();
        assert!(moves.iter().all(|&m| m <= 6), "{moves:?}");
    }

    #[test]
    fn retire_the_weakest_challenger_but_never_the_champion_or_the_newest() {
        let policy = PopulationPolicy { max_arms: 2, ..Default::default() };
        let arms = [arm(1, 10.0, 1.0, 100), arm(2, 26.0, 1.0, 100), arm(3, 20.0, 8.0, 0)];
        assert_eq!(arm_to_retire(&arms, 1, Some(3), &[], &[], &policy), Some(2));
        assert_eq!(arm_to_retire(&arms, 1, None, &[], &[], &policy), Some(3));
        assert_eq!(arm_to_retire(&arms[..2], 1, None, &[], &[], &policy), None);
    }

    #[test]
    fn an_unmeasured_arm_is_never_retired_and_a_covered_one_goes_first() {
        let policy = PopulationPolicy { max_arms: 3, ..Default::default() };
        let arms = [arm(1, 30.0, 1.0, 900), arm(2, 20.0, 1.0, 100), arm(3, 25.0, 1.0, 100), arm(4, 10.0, 8.0, 0)];
        // v4 is the weakest but has not had its chance: v2 goes.
        assert_eq!(arm_to_retire(&arms, 1, Some(5), &[4], &[], &policy), Some(2));
        // v3's lessons live on in another arm: it goes before the weaker v2.
        assert_eq!(arm_to_retire(&arms, 1, Some(5), &[4], &[3], &policy), Some(3));
        // Nobody may go: none is retired (the population waits for evidence).
        assert_eq!(arm_to_retire(&arms, 1, Some(4), &[2, 3], &[], &policy), None);
    }

    #[test]
    fn policy_validation_explains_bad_knobs() {
        assert!(PopulationPolicy::default().validate().is_ok());
        let bad = PopulationPolicy { explore_share: 1.0, ..Default::default() };
        assert_eq!(bad.validate(), Err(PolicyError::ExploreShare(1.0)));
        let bad = PopulationPolicy { min_arm_share: 0.5, ..Default::default() };
        assert_eq!(bad.validate(), Err(PolicyError::MinArmShare(0.5)));
    }
}
