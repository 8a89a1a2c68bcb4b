//! The population rater's judgement of one rating window, as plain data in
//! and plain data out, so the worker only reads the window and applies what
//! this decides: which live arms are ranked and on what basis (the task keys
//! they share, or their window means), their TrueSkill update (one
//! multi-player ranking, rewards within [`TIE`] tied), the promotion gate's
//! decision, and — when it promotes — the move of `production` with its reason
//! and evidence as the label history shows them. Also the window's task
//! winners, which the crossover after a window breeds from.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::json;
use sha2::{Digest, Sha256};

use super::{
    outcomes::{OutcomeBucket, RewardSources},
    population::{Arm, GateDecision, PopulationPolicy, gate},
    trueskill::{TrueSkill, ranks_from_rewards},
};

/// E-SPL's tie rule: rewards within this of each other share a rank.
pub const TIE: f64 = 0.01;

/// Task keys every ranked arm must have run before arms are compared on
/// matched work instead of on their window means.
pub const MIN_SHARED_TASKS: usize = 5;

/// The rewards of one version on one task (traces carrying `metadata.task_key`).
#[derive(Debug, Clone, PartialEq)]
pub struct TaskRewards {
    pub version: i64,
    pub task_key: String,
    /// Rewarded traces of this version on this task.
    pub traces: u64,
    /// Sum of their rewards: 1/0 for `feedback.success`, else `feedback.score`.
    pub reward_sum: f64,
}

/// A task key an arm won: its mean reward there, and the best other arm's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WonTask {
    pub task_key: String,
    pub reward: f64,
    pub runner_up: f64,
}

/// How the arms of a window were compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Basis {
    /// On the task keys all ranked arms ran: each arm's mean reward per shared
    /// key, averaged over the keys (arms in an online split see different work).
    SharedTasks,
    /// On each arm's mean reward over the window (too few shared task keys).
    WindowMeans,
}

/// One rating window as the rater reads it.
#[derive(Debug, Clone)]
pub struct Window<'a> {
    /// The live arms (none retired), the champion among them.
    pub arms: &'a [Arm],
    /// The version `production` points at.
    pub champion: i64,
    /// The live arms' outcomes in the window.
    pub buckets: &'a [OutcomeBucket],
    /// The window's task rewards; read only when two or more arms are ranked
    /// (see [`needs_tasks`]), `None` otherwise.
    pub tasks: Option<&'a [TaskRewards]>,
    /// Scored traces an arm needs in the window to be ranked.
    pub min_window_traces: u64,
    /// Rating windows since `production` last moved from one version to
    /// another (`None`: it never did).
    pub windows_since_move: Option<u64>,
    /// The arms learned on top of the champion (the cool-down does not hold them back).
    pub built_on_champion: &'a [i64],
    /// The prompt's population policy in effect.
    pub policy: &'a PopulationPolicy,
    pub from: DateTime<Utc>,
    pub until: DateTime<Utc>,
}

/// What to do after a window: the arms to save, what was ranked, the gate's
/// decision, and the move of `production` when it promotes.
#[derive(Debug, Clone, PartialEq)]
pub struct WindowPlan {
    /// The live arms with their new ratings and scored traces, in the order given.
    pub arms: Vec<Arm>,
    /// The ranked arms' versions, in the order given.
    pub ranked: Vec<i64>,
    pub basis: Basis,
    /// Which rewards the ranked arms' were: reported, judged or both.
    pub rewards: RewardSources,
    pub gate: GateDecision,
    pub promotion: Option<ProductionMove>,
}

/// The gate's move of `production`, as the label history records it.
#[derive(Debug, Clone, PartialEq)]
pub struct ProductionMove {
    pub from: i64,
    pub to: i64,
    pub reason: String,
    pub evidence: serde_json::Value,
}

/// The window's champion is not among its live arms: the population and
/// `production` disagree, which reconciling them first rules out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the champion is not a live arm")]
pub struct ChampionNotLive;

/// One arm's reward in a window: success rate when its traces report
/// success, mean score otherwise; with how many traces carried it.
fn window_reward(buckets: &[OutcomeBucket], version: i64) -> (u64, Option<f64>) {
    let mine = buckets.iter().filter(|b| b.version == Some(version));
    let (mut trials, mut successes, mut scored, mut score_sum, mut with_feedback) = (0u64, 0u64, 0u64, 0.0, 0u64);
    for b in mine {
        trials += b.success_trials;
        successes += b.successes;
        scored += b.score.count;
        score_sum += b.score.sum;
        with_feedback += b.with_feedback;
    }
    let reward = if trials > 0 {
        Some(successes as f64 / trials as f64)
    } else if scored > 0 {
        Some(score_sum / scored as f64)
    } else {
        None
    };
    (with_feedback, reward)
}

/// The arms ranked in a window, by index into `arms`: those whose reward is
/// carried by at least `min_traces` scored traces; with those traces and the reward.
fn ranked_arms(arms: &[Arm], buckets: &[OutcomeBucket], min_traces: u64) -> Vec<(usize, u64, f64)> {
    arms.iter()
        .enumerate()
        .filter_map(|(i, a)| {
            let (scored, reward) = window_reward(buckets, a.version);
            reward.filter(|_| scored >= min_traces).map(|r| (i, scored, r))
        })
        .collect()
}

/// Whether rating this window needs its task rewards: two or more arms are ranked.
pub fn needs_tasks(arms: &[Arm], buckets: &[OutcomeBucket], min_traces: u64) -> bool {
    ranked_arms(arms, buckets, min_traces).len() >= 2
}

/// Rates one window: ranks the arms with enough scored traces (on their
/// shared task keys when there are [`MIN_SHARED_TASKS`] of them, else on
/// their window means), updates their ratings with one TrueSkill ranking,
/// and runs the promotion gate on the result.
pub fn rate(w: &Window<'_>, trueskill: &TrueSkill) -> Result<WindowPlan, ChampionNotLive> {
    let mut arms = w.arms.to_vec();
    let mut ranked = ranked_arms(&arms, w.buckets, w.min_window_traces);
    for (i, scored, _) in &ranked {
        arms[*i].scored_traces += scored;
    }
    let mut basis = Basis::WindowMeans;
    if ranked.len() >= 2 {
        let versions: Vec<i64> = ranked.iter().map(|(i, _, _)| arms[*i].version).collect();
        if let Some(matched) = w.tasks.and_then(|t| matched_rewards(t, &versions, MIN_SHARED_TASKS)) {
            basis = Basis::SharedTasks;
            for ((_, _, r), m) in ranked.iter_mut().zip(matched) {
                *r = m;
            }
        }
        let rewards: Vec<f64> = ranked.iter().map(|(_, _, r)| *r).collect();
        let ratings: Vec<_> = ranked.iter().map(|(i, _, _)| arms[*i].rating).collect();
        if let Some(new) = trueskill.rate_ranking(&ratings, &ranks_from_rewards(&rewards, TIE)) {
            for ((i, _, _), r) in ranked.iter().zip(new) {
                arms[*i].rating = r;
            }
        }
    }
    let champion = arms.iter().find(|a| a.version == w.champion).copied().ok_or(ChampionNotLive)?;
    let decision = gate(&champion, &arms, w.policy, w.windows_since_move, w.built_on_champion);
    let ranked_versions: Vec<i64> = ranked.iter().map(|(i, _, _)| arms[*i].version).collect();
    let sources = RewardSources::of(w.buckets, Some(&ranked_versions));
    let promotion = match decision {
        GateDecision::Promote { .. } => Some(promotion(w, &arms, &ranked, (basis, sources), &decision)),
        _ => None,
    };
    Ok(WindowPlan {
        ranked: ranked.iter().map(|(i, _, _)| arms[*i].version).collect(),
        arms,
        basis,
        rewards: sources,
        gate: decision,
        promotion,
    })
}

/// The gate's move with the reason and evidence the label history shows.
fn promotion(
    w: &Window<'_>,
    arms: &[Arm],
    ranked: &[(usize, u64, f64)],
    (basis, sources): (Basis, RewardSources),
    decision: &GateDecision,
) -> ProductionMove {
    let GateDecision::Promote {
        challenger,
        challenger_lower,
        champion_lower,
        challenger_traces,
        champion_traces,
        margin,
    } = *decision
    else {
        unreachable!("only a promotion has a move")
    };
    let champion = w.champion;
    let rating_of = |v: i64| arms.iter().find(|a| a.version == v).map(|a| a.rating);
    let rewards: Vec<serde_json::Value> =
        ranked.iter().map(|(i, _, r)| json!({"version": arms[*i].version, "reward": r})).collect();
    let reason = format!(
        "promotion gate: v{challenger} μ−2σ = {challenger_lower:.2} ({challenger_traces} scored traces) \
         exceeds champion v{champion} μ−2σ = {champion_lower:.2} ({champion_traces} scored traces) by more \
         than the margin {margin}"
    );
    let evidence = json!({
        "champion": {"version": champion, "rating": rating_of(champion), "lower": champion_lower, "scored_traces": champion_traces},
        "challenger": {"version": challenger, "rating": rating_of(challenger), "lower": challenger_lower, "scored_traces": challenger_traces},
        "min_traces": w.policy.min_traces,
        "margin": margin,
        "cooldown_windows": w.policy.cooldown_windows,
        "windows_since_last_move": w.windows_since_move,
        "built_on_champion": w.built_on_champion.contains(&challenger),
        "window": {"from": w.from, "until": w.until, "basis": basis, "rewards": rewards,
                   "rewards_used": sources.evidence()},
    });
    ProductionMove { from: champion, to: challenger, reason, evidence }
}

/// The task keys each of `versions` *won* in a window: keys that at least two
/// of them ran, where its mean reward beats every other's by more than `tie`.
/// Keys within `tie` of the runner-up have no winner.
pub fn task_winners(tasks: &[TaskRewards], versions: &[i64], tie: f64) -> BTreeMap<i64, Vec<WonTask>> {
    let mut per_key: BTreeMap<&str, Vec<(i64, f64)>> = BTreeMap::new();
    for t in tasks.iter().filter(|t| t.traces > 0 && versions.contains(&t.version)) {
        per_key.entry(&t.task_key).or_default().push((t.version, t.reward_sum / t.traces as f64));
    }
    let mut out: BTreeMap<i64, Vec<WonTask>> = BTreeMap::new();
    for (key, mut means) in per_key {
        if means.len() < 2 {
            continue;
        }
        means.sort_by(|a, b| b.1.total_cmp(&a.1));
        let ((best, reward), runner_up) = (means[0], means[1].1);
        if reward - runner_up > tie {
            out.entry(best).or_default().push(WonTask { task_key: key.to_owned(), reward, runner_up });
        }
    }
    out
}

/// Each of `versions`' reward on the task keys all of them ran (the mean of
/// its per-key mean rewards), in the order of `versions`; `None` when they
/// share fewer than `min_keys` keys.
pub fn matched_rewards(tasks: &[TaskRewards], versions: &[i64], min_keys: usize) -> Option<Vec<f64>> {
    let mut per_key: BTreeMap<&str, BTreeMap<i64, f64>> = BTreeMap::new();
    for t in tasks.iter().filter(|t| t.traces > 0 && versions.contains(&t.version)) {
        per_key.entry(&t.task_key).or_default().insert(t.version, t.reward_sum / t.traces as f64);
    }
    let wanted: BTreeSet<i64> = versions.iter().copied().collect();
    let shared: Vec<&BTreeMap<i64, f64>> =
        per_key.values().filter(|by_version| by_version.keys().copied().collect::<BTreeSet<_>>() == wanted).collect();
    if shared.len() < min_keys.max(1) {
        return None;
    }
    Some(versions.iter().map(|v| shared.iter().map(|m| m[v]).sum::<f64>() / shared.len() as f64).collect())
}

/// Whether the window's evidence lets it close before its full length: the
/// champion and `leader` (the challenger exploration favours, the one most
/// likely to overturn it) each carry at least `min_traces` scored traces in it.
/// Arms with less are not ranked in it, as in any window.
pub fn evidence_to_close(buckets: &[OutcomeBucket], champion: i64, leader: Option<i64>, min_traces: u64) -> bool {
    let Some(leader) = leader.filter(|l| *l != champion) else { return false };
    [champion, leader].into_iter().all(|v| {
        let (scored, reward) = window_reward(buckets, v);
        reward.is_some() && scored >= min_traces
    })
}

/// Whether a tick at `now` should look at a population's window — a
/// pre-filter on what the schedule statement says; the rating reads the arms
/// and decides. Due when the window has its full length (`window_secs` since
/// the last rated window, or a never-rated population's slot, see
/// [`first_window_due`]); and, with two live arms or more, once in every
/// `min_window_secs` of an open window, which may close early
/// ([`evidence_to_close`]). So a prompt whose window is open costs a tick a
/// read at most once per `min_window_secs`.
pub fn window_may_be_due(
    prompt: &str,
    rated_until: Option<DateTime<Utc>>,
    live_arms: i64,
    now: DateTime<Utc>,
    tick_secs: u64,
    (window_secs, min_window_secs): (u64, u64),
) -> bool {
    let min = min_window_secs.clamp(1, window_secs.max(1));
    let compared = live_arms >= 2;
    let ms = |secs: u64| secs.min(u64::MAX / 2000) as i64 * 1000;
    match rated_until {
        Some(t) => {
            // Looked at on the first tick after each whole `min` of the window's age.
            let age = (now - t).num_milliseconds();
            let crossed = age.div_euclid(ms(min)) > (age - ms(tick_secs.max(1))).div_euclid(ms(min));
            age >= ms(window_secs) || (compared && age >= ms(min) && crossed)
        }
        None => {
            first_window_due(prompt, now, tick_secs, window_secs)
                || (compared && first_window_due(prompt, now, tick_secs, min))
        }
    }
}

/// Whether a population never rated may have its first window rated in the
/// tick at `now`: each prompt has a slot among the `window_secs / tick_secs`
/// ticks of a window (from a hash of its name), so populations that start
/// together are rated in different ticks, and stay apart (each next window is
/// due one window after the last).
pub fn first_window_due(prompt: &str, now: DateTime<Utc>, tick_secs: u64, window_secs: u64) -> bool {
    let slots = (window_secs / tick_secs.max(1)).max(1);
    let digest = Sha256::new().chain_update(b"rating slot").chain_update(prompt.as_bytes()).finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    let tick = now.timestamp().max(0) as u64 / tick_secs.max(1);
    u64::from_le_bytes(first) % slots == tick % slots
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::evaluate::{outcomes::OutcomeBucket, trueskill::Rating};

    fn task(version: i64, key: &str, traces: u64, reward_sum: f64) -> TaskRewards {
        TaskRewards { version, task_key: key.into(), traces, reward_sum }
    }

    #[test]
    fn arms_are_compared_on_the_tasks_they_share() {
        // v1 ran easy and hard tasks; v2 only hard ones: on window means v1
        // looks better, on the shared (hard) keys v2 is.
        let mut tasks = Vec::new();
        for k in 0..5 {
            tasks.push(task(1, &format!("hard-{k}"), 2, 0.0));
            tasks.push(task(2, &format!("hard-{k}"), 2, 1.0));
            tasks.push(task(1, &format!("easy-{k}"), 4, 4.0));
        }
        assert_eq!(matched_rewards(&tasks, &[1, 2], 5), Some(vec![0.0, 0.5]));
        assert_eq!(matched_rewards(&tasks, &[2, 1], 5), Some(vec![0.5, 0.0]));
        assert_eq!(matched_rewards(&tasks, &[1, 2], 6), None, "five shared keys are not six");
        // A key counts only when every arm ran it.
        assert_eq!(matched_rewards(&tasks, &[1, 2, 3], 1), None);
    }

    #[test]
    fn a_task_key_is_won_only_by_a_clear_best_among_two_or_more() {
        let tasks = vec![
            task(1, "a", 2, 2.0), // v1 1.0 vs v2 0.0: v1 wins
            task(2, "a", 2, 0.0),
            task(1, "b", 4, 1.0), // v1 0.25 vs v2 0.75 vs v3 0.5: v2 wins
            task(2, "b", 4, 3.0),
            task(3, "b", 2, 1.0),
            task(1, "c", 1, 1.0), // a tie within 0.01: nobody
            task(2, "c", 200, 199.0),
            task(3, "d", 3, 3.0), // only v3 ran it: nobody
            task(9, "a", 5, 5.0), // not a live arm: ignored
        ];
        let won = task_winners(&tasks, &[1, 2, 3], TIE);
        assert_eq!(won.keys().copied().collect::<Vec<_>>(), [1, 2]);
        assert_eq!(won[&1], [WonTask { task_key: "a".into(), reward: 1.0, runner_up: 0.0 }]);
        assert_eq!(won[&2], [WonTask { task_key: "b".into(), reward: 0.75, runner_up: 0.5 }]);
    }

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    /// A window bucket of `version`: `successes` of `trials` traces succeeded.
    fn bucket(version: i64, trials: u64, successes: u64) -> OutcomeBucket {
        OutcomeBucket {
            version: Some(version),
            traces: trials,
            with_feedback: trials,
            success_trials: trials,
            successes,
            ..OutcomeBucket::default()
        }
    }

    fn arm(version: i64, mu: f64, sigma: f64, scored_traces: u64) -> Arm {
        Arm { version, rating: Rating { mu, sigma }, scored_traces }
    }

    fn window<'a>(arms: &'a [Arm], buckets: &'a [OutcomeBucket], policy: &'a PopulationPolicy) -> Window<'a> {
        Window {
            arms,
            champion: 1,
            buckets,
            tasks: None,
            min_window_traces: 10,
            windows_since_move: None,
            built_on_champion: &[],
            policy,
            from: at("2026-11-23T16:00:00Z"),
            until: at("2026-11-23T16:10:00Z"),
        }
    }

    #[test]
    fn a_window_ranks_the_arms_with_enough_traces_and_rates_them() {
        let policy = PopulationPolicy::default();
        let arms = [arm(1, 25.0, 8.0, 0), arm(2, 25.0, 8.0, 0), arm(3, 25.0, 8.0, 0)];
        // v2 beats v1; v3 has too few traces to be ranked.
        let buckets = [bucket(1, 20, 5), bucket(2, 20, 15), bucket(3, 4, 4)];
        let w = window(&arms, &buckets, &policy);
        assert!(needs_tasks(&arms, &buckets, w.min_window_traces));
        let plan = rate(&w, &TrueSkill::default()).unwrap();
        assert_eq!((plan.ranked.as_slice(), plan.basis), (&[1, 2][..], Basis::WindowMeans));
        assert!(plan.arms[1].rating.mu > plan.arms[0].rating.mu, "{plan:?}");
        assert_eq!(plan.arms[2], arms[2], "an unranked arm keeps its rating and count");
        assert_eq!((plan.arms[0].scored_traces, plan.arms[1].scored_traces), (20, 20));
        // The champion has too few scored traces for the gate.
        assert!(matches!(plan.gate, GateDecision::ChampionUnderSampled { .. }));
        assert_eq!(plan.promotion, None);
    }

    #[test]
    fn shared_tasks_decide_the_ranking_when_there_are_enough() {
        let policy = PopulationPolicy::default();
        let arms = [arm(1, 25.0, 8.0, 0), arm(2, 25.0, 8.0, 0)];
        // On window means v1 is ahead; on the five keys both ran, v2 is.
        let buckets = [bucket(1, 20, 15), bucket(2, 20, 10)];
        let tasks: Vec<TaskRewards> =
            (0..5).flat_map(|k| [task(1, &format!("k{k}"), 2, 0.0), task(2, &format!("k{k}"), 2, 2.0)]).collect();
        let w = Window { tasks: Some(&tasks), ..window(&arms, &buckets, &policy) };
        let plan = rate(&w, &TrueSkill::default()).unwrap();
        assert_eq!(plan.basis, Basis::SharedTasks);
        assert!(plan.arms[1].rating.mu > plan.arms[0].rating.mu, "{plan:?}");
    }

    #[test]
    fn the_gate_s_promotion_carries_its_reason_and_evidence() {
        let policy = PopulationPolicy { min_traces: 10, ..PopulationPolicy::default() };
        let arms = [arm(1, 20.0, 1.0, 100), arm(2, 30.0, 1.0, 100)];
        let buckets = [bucket(1, 20, 10), bucket(2, 20, 10)];
        let w = Window { windows_since_move: Some(50), ..window(&arms, &buckets, &policy) };
        let plan = rate(&w, &TrueSkill::default()).unwrap();
        let p = plan.promotion.expect("the gate promotes v2");
        assert_eq!((p.from, p.to), (1, 2));
        assert!(p.reason.starts_with("promotion gate: v2 μ−2σ"), "{}", p.reason);
        assert_eq!(p.evidence["challenger"]["version"], 2);
        assert_eq!(p.evidence["windows_since_last_move"], 50);
        assert_eq!(p.evidence["window"]["basis"], "window_means");
        assert_eq!(p.evidence["window"]["rewards"].as_array().map(Vec::len), Some(2));
    }

    #[test]
    fn a_window_closes_early_once_the_champion_and_the_leader_have_evidence() {
        let buckets = [bucket(1, 40, 20), bucket(2, 12, 12), bucket(3, 2, 2)];
        assert!(evidence_to_close(&buckets, 1, Some(2), 10));
        assert!(!evidence_to_close(&buckets, 1, Some(2), 13), "the leader has 12");
        assert!(!evidence_to_close(&buckets, 1, Some(3), 10), "another challenger leads and has 2");
        assert!(!evidence_to_close(&buckets, 1, None, 10), "a lone champion is compared with nobody");
        // A tick looks at an open window once per min_window_secs, and at a full one always.
        let t0 = at("2026-11-23T16:00:00Z");
        let due = |secs: i64, live: i64| {
            window_may_be_due("p", Some(t0), live, t0 + chrono::Duration::seconds(secs), 10, (600, 60))
        };
        assert!(!due(30, 2) && due(60, 2) && !due(70, 2) && due(125, 2) && !due(130, 2));
        // Ticks that straddle the minute see it once, whatever their phase.
        let ms = |ms: i64| window_may_be_due("p", Some(t0), 2, t0 + chrono::Duration::milliseconds(ms), 10, (600, 60));
        assert!(!ms(59_990) && ms(69_990) && !ms(79_990));
        assert!(ms(60_010) && !ms(70_010));
        assert!(!due(60, 1), "one live arm: only a full window");
        assert!(due(600, 1) && due(601, 1));
        // A population never rated: its full-window slot, and with two arms an early slot per minute.
        let early = (0..60)
            .filter(|s| window_may_be_due("p", None, 2, t0 + chrono::Duration::seconds(s * 10), 10, (600, 60)))
            .count();
        let full = (0..60)
            .filter(|s| window_may_be_due("p", None, 1, t0 + chrono::Duration::seconds(s * 10), 10, (600, 60)))
            .count();
        assert_eq!((full, early), (1, 10), "one full slot in 600 s; ten early slots (one a minute) with two arms");
    }

    #[test]
    fn a_champion_missing_from_the_live_arms_is_refused() {
        let policy = PopulationPolicy::default();
        let arms = [arm(2, 25.0, 8.0, 0)];
        assert_eq!(rate(&window(&arms, &[], &policy), &TrueSkill::default()), Err(ChampionNotLive));
    }
}
