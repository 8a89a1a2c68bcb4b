//! The population of a prompt under the `evaluated` policy, shared by the
//! worker's rater, its rounds and the operators' moves: its first champion,
//! how arms are reconciled with `production` (see `production.rs` for when),
//! the policy in effect for one prompt, where learning goes on from (the
//! newest challenger built on production, once it had its chance to be rated)
//! and which learned content would only repeat a version the prompt has, and
//! the arms as operators see them. The arms agents are served from are read in
//! `prompts.rs`, beside the prompt's text.

use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;

use super::{AppState, ServiceResult};
use crate::{
    domain::{
        LabelName, Prompt, PromptName, VersionContent,
        label::Selector,
        population::{ArmState, PopulationArm},
    },
    evaluate::{
        population::{Arm, PopulationPolicy, traffic_weights},
        trueskill::Rating,
    },
    store::{DynStore, StoreError, StoreResult},
};

/// A population's first arm: `version` as champion at the prior (μ0, σ0)
/// with all the traffic.
pub fn first_champion(version: i64) -> PopulationArm {
    PopulationArm {
        version,
        state: ArmState::Champion,
        rating: Rating::default(),
        weight: 1.0,
        scored_traces: 0,
        created_from: None,
        parents: Vec::new(),
        rated_until: None,
        joined_at: None,
    }
}

/// Makes the population agree with `production` (the champion) and sets
/// the live arms' weights. An empty population gets the champion at the prior.
pub fn reconcile(arms: &mut Vec<PopulationArm>, champion: i64, policy: &PopulationPolicy) {
    if !arms.iter().any(|a| a.version == champion) {
        arms.push(first_champion(champion));
    }
    for a in arms.iter_mut() {
        if a.version == champion {
            a.state = ArmState::Champion;
        } else if a.state == ArmState::Champion {
            // Production moved away (gate, operator, guard): the old champion keeps competing.
            a.state = ArmState::Challenger;
        }
    }
    let live: Vec<Arm> = arms.iter().filter(|a| a.state != ArmState::Retired).map(Arm::from).collect();
    let weights = traffic_weights(&live, champion, policy);
    for a in arms.iter_mut() {
        a.weight = weights.iter().find(|(v, _)| *v == a.version).map_or(0.0, |(_, w)| *w);
    }
}

/// The population policy of `prompt` in effect: the server's, with the
/// prompt's own `settings.population` knobs in place; with the prompt read.
pub async fn effective_policy(
    store: &DynStore,
    prompt: &PromptName,
    server: &PopulationPolicy,
) -> StoreResult<(Prompt, PopulationPolicy)> {
    let own = store.get_prompt(prompt).await?.ok_or(StoreError::NotFound)?;
    let policy = own.settings.population.applied_to(server);
    Ok((own, policy))
}

/// Whether `arm` had its chance to be rated: it has the scored traces the
/// gate asks of each side (`min_traces`), or it has been in the population a
/// whole longest window (`window_secs`) — without rewards no evidence ever
/// comes, and learning must not wait for it forever. An arm not stored yet
/// (no `joined_at`) has not.
pub fn had_its_chance(arm: &PopulationArm, now: DateTime<Utc>, policy: &PopulationPolicy) -> bool {
    let window = chrono::Duration::seconds(policy.window_secs.min(i64::MAX as u64) as i64);
    arm.scored_traces >= policy.min_traces || arm.joined_at.is_some_and(|t| now - t >= window)
}

/// The live challengers that have not had their chance to be rated yet.
pub fn unmeasured(arms: &[PopulationArm], champion: i64, now: DateTime<Utc>, policy: &PopulationPolicy) -> Vec<i64> {
    arms.iter()
        .filter(|a| a.state != ArmState::Retired && a.version != champion && !had_its_chance(a, now, policy))
        .map(|a| a.version)
        .collect()
}

/// Where the next learning round of an `evaluated` prompt starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundBase {
    /// From this version: the newest live challenger built on production (a
    /// descendant by `created_from`) and not measured below it — it holds what
    /// production holds and what rounds learned since — or production itself.
    From(i64),
    /// Not yet: this live challenger has not had its chance to be rated. The
    /// traces wait (pending, not lost), so a round never learns again what a
    /// version under measurement already holds, and a new arm joins only
    /// once the one before it was measured.
    Wait(i64),
}

/// Where learning goes on from (see [`RoundBase`]), over the arms of the
/// population: the live ones and every arm (retired too) from `champion` on.
pub fn round_base(arms: &[PopulationArm], champion: i64, now: DateTime<Utc>, policy: &PopulationPolicy) -> RoundBase {
    if let Some(waiting) = unmeasured(arms, champion, now, policy).into_iter().max() {
        return RoundBase::Wait(waiting);
    }
    let champion_mu = arms.iter().find(|a| a.version == champion).map(|a| a.rating.mu);
    let measured_below = |a: &PopulationArm| champion_mu.is_some_and(|mu| a.scored_traces > 0 && a.rating.mu < mu);
    arms.iter()
        .filter(|a| a.state == ArmState::Challenger && built_on(arms, a.version, champion) && !measured_below(a))
        .map(|a| a.version)
        .max()
        .map_or(RoundBase::From(champion), RoundBase::From)
}

/// Whether `version` was learned on top of `ancestor`: a descendant by
/// `created_from`, through the arms given (retired links too).
pub fn built_on(arms: &[PopulationArm], version: i64, ancestor: i64) -> bool {
    let parent = |v: i64| arms.iter().find(|a| a.version == v).and_then(|a| a.created_from);
    let mut at = parent(version);
    while let Some(v) = at {
        if v == ancestor {
            return true;
        }
        // Parents are older versions: the walk ends below the ancestor.
        at = if v > ancestor { parent(v) } else { None };
    }
    false
}

/// The live arms of `prompt` and every arm from `champion`'s version on,
/// retired ones too: what following production's line needs.
pub async fn line_of(store: &DynStore, prompt: &PromptName, champion: i64) -> StoreResult<Vec<PopulationArm>> {
    let mut arms = store.live_arms(prompt, &[champion]).await?;
    let since = store.population_page(prompt, Some(champion - 1), LINEAGE_ARMS).await?;
    arms.extend(since.into_iter().filter(|a| a.state == ArmState::Retired));
    Ok(arms)
}

/// [`round_base`] for `prompt` as the store has it now.
pub async fn next_round_base(
    store: &DynStore,
    prompt: &PromptName,
    server: &PopulationPolicy,
    now: DateTime<Utc>,
) -> StoreResult<RoundBase> {
    let production = store.resolve(prompt, &Selector::Label(LabelName::production())).await?;
    let champion = production.ok_or(StoreError::NotFound)?.version.number;
    let (_, policy) = effective_policy(store, prompt, server).await?;
    Ok(round_base(&line_of(store, prompt, champion).await?, champion, now, &policy))
}

/// Most arms read to follow the lineage from production to its newest challenger.
const LINEAGE_ARMS: u32 = 1000;

/// Recent versions a learned or bred version is compared with before it is written.
pub const RECENT_VERSIONS: u32 = 20;

/// The version whose lessons `content` would only repeat ([`VersionContent::same_lessons`]):
/// `base`, one of the prompt's [`RECENT_VERSIONS`] newest versions, or a live
/// arm of its population; `None` when it teaches something new.
pub async fn repeated_version(
    store: &DynStore,
    prompt: &PromptName,
    base: (i64, &VersionContent),
    content: &VersionContent,
) -> StoreResult<Option<i64>> {
    if content.same_lessons(base.1) {
        return Ok(Some(base.0));
    }
    let recent = store.list_versions(prompt, None, RECENT_VERSIONS).await?;
    if let Some(v) = recent.iter().find(|v| v.content.same_lessons(content)) {
        return Ok(Some(v.number));
    }
    let seen = |n: i64| n == base.0 || recent.iter().any(|v| v.number == n);
    for arm in store.live_arms(prompt, &[]).await?.into_iter().filter(|a| !seen(a.version)) {
        let Some(older) = store.resolve(prompt, &Selector::Version(arm.version)).await? else { continue };
        if older.version.content.same_lessons(content) {
            return Ok(Some(arm.version));
        }
    }
    Ok(None)
}

/// Starts the population of a new `evaluated` prompt: version 1 as champion.
pub(super) async fn seed(st: &AppState, prompt: &PromptName, version: i64) -> StoreResult<()> {
    st.store.save_population(prompt, &[first_champion(version)]).await
}

/// One arm as operators see it.
#[derive(Debug, Serialize, ToSchema)]
pub struct PopulationArmView {
    #[serde(flatten)]
    pub arm: PopulationArm,
    /// μ − 2σ: what the promotion gate compares.
    pub conservative: f64,
    /// μ + 2σ: what exploration chases.
    pub optimistic: f64,
}

/// One page of the prompt's population, retired arms too, by version: up to
/// `limit` arms with versions above `after`.
pub async fn population(
    st: &AppState,
    prompt: &Prompt,
    after: Option<i64>,
    limit: u32,
) -> ServiceResult<Vec<PopulationArmView>> {
    Ok(st
        .store
        .population_page(&prompt.name, after, limit)
        .await?
        .into_iter()
        .map(|arm| PopulationArmView {
            conservative: arm.rating.conservative(),
            optimistic: arm.rating.optimistic(),
            arm,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arm(version: i64, state: ArmState) -> PopulationArm {
        PopulationArm {
            version,
            state,
            rating: Rating::default(),
            weight: 0.0,
            scored_traces: 0,
            created_from: None,
            parents: Vec::new(),
            rated_until: None,
            joined_at: None,
        }
    }

    /// `v`, learned from `from`, with `scored` traces, joined `ago` seconds before `now`.
    fn child(v: i64, from: i64, scored: u64, ago: i64, now: DateTime<Utc>) -> PopulationArm {
        PopulationArm {
            created_from: Some(from),
            parents: vec![from],
            scored_traces: scored,
            joined_at: Some(now - chrono::Duration::seconds(ago)),
            ..arm(v, ArmState::Challenger)
        }
    }

    #[test]
    fn learning_waits_for_evidence_then_builds_on_the_newest_challenger_of_production() {
        let policy = PopulationPolicy { min_traces: 50, window_secs: 600, ..PopulationPolicy::default() };
        let now = Utc::now();
        let champion =
            PopulationArm { joined_at: Some(now - chrono::Duration::hours(1)), ..arm(1, ArmState::Champion) };
        // Production alone: learn from it.
        assert_eq!(round_base(std::slice::from_ref(&champion), 1, now, &policy), RoundBase::From(1));
        // v2 just joined, unmeasured: wait for it.
        let v2 = child(2, 1, 10, 30, now);
        assert_eq!(round_base(&[champion.clone(), v2.clone()], 1, now, &policy), RoundBase::Wait(2));
        // Measured (enough scored traces), or a whole window old without evidence: build on it.
        let measured = PopulationArm { scored_traces: 50, ..v2.clone() };
        assert_eq!(round_base(&[champion.clone(), measured.clone()], 1, now, &policy), RoundBase::From(2));
        let old = PopulationArm { joined_at: Some(now - chrono::Duration::seconds(600)), scored_traces: 0, ..v2 };
        assert_eq!(round_base(&[champion.clone(), old], 1, now, &policy), RoundBase::From(2));
        // v4 was built on v3, built on v2 (retired, still a link): the newest of production's line.
        let v3 = PopulationArm { state: ArmState::Retired, ..child(3, 2, 60, 500, now) };
        let v4 = child(4, 3, 60, 100, now);
        let side = child(5, 9, 60, 50, now); // built on a version before production: not its line
        let arms = [champion.clone(), measured.clone(), v3, v4.clone(), side];
        assert_eq!(round_base(&arms, 1, now, &policy), RoundBase::From(4));
        // Measured below production (e.g. it learned something harmful): the line goes on from the one before.
        let mut rated = [champion.clone(), measured, PopulationArm { rating: Rating { mu: 20.0, sigma: 3.0 }, ..v4 }];
        assert_eq!(round_base(&rated, 1, now, &policy), RoundBase::From(2));
        rated[1].rating.mu = 24.0;
        assert_eq!(round_base(&rated, 1, now, &policy), RoundBase::From(1));
    }

    #[test]
    fn reconcile_follows_production_and_gives_retired_arms_nothing() {
        let policy = PopulationPolicy::default();
        let mut arms = vec![arm(1, ArmState::Champion), arm(2, ArmState::Challenger), arm(3, ArmState::Retired)];
        reconcile(&mut arms, 2, &policy);
        assert_eq!(arms[0].state, ArmState::Challenger);
        assert_eq!(arms[1].state, ArmState::Champion);
        assert!((arms[1].weight - 0.8).abs() < 1e-12 && (arms[0].weight - 0.2).abs() < 1e-12);
        assert_eq!(arms[2].weight, 0.0);
        let mut empty = Vec::new();
        reconcile(&mut empty, 5, &policy);
        assert_eq!(empty.len(), 1);
        assert_eq!((empty[0].version, empty[0].state, empty[0].weight), (5, ArmState::Champion, 1.0));
    }
}
