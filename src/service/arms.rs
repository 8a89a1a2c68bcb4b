//! How arms join the population of an `evaluated` prompt: a learned version
//! as a challenger (mutation: the parent's μ, σ = √(σ_parent² + 1)) instead
//! of moving `production`, a crossover child with the precision-weighted mean
//! of its parents' ratings; the weakest challenger that had its chance to be
//! rated retires to make room, one whose lessons another arm holds first.

use chrono::Utc;

use crate::{
    domain::{
        PromptName,
        label::Selector,
        population::{ArmState, PopulationArm},
    },
    evaluate::{
        population::{Arm, PopulationPolicy, arm_to_retire},
        trueskill::Rating,
    },
    service::{
        population::{effective_policy, reconcile, unmeasured},
        production::production_version,
    },
    store::{DynStore, StoreError, StoreResult},
};

/// Mutation: `version`, learned from `parent`, joins the population of
/// `prompt` as a challenger with the parent's μ and σ = √(σ_parent² + 1);
/// the weakest challenger is retired when there are more than `max_arms`.
/// Weights are recomputed and saved.
pub async fn add_challenger(
    store: &DynStore,
    prompt: &PromptName,
    version: i64,
    parent: Option<i64>,
    policy: &PopulationPolicy,
) -> StoreResult<Vec<PopulationArm>> {
    let parents: Vec<i64> = parent.into_iter().collect();
    join(store, prompt, version, &parents, policy, |rated| rated.first().copied().unwrap_or_default().mutated_child())
        .await
}

/// Crossover: `version`, bred from `parents` (the first is the champion whose
/// bullets it kept), joins as a challenger with μ = the precision-weighted
/// mean of the parents' μ and σ = √(1/Σσᵢ⁻² + 1); retirement as for mutation.
pub async fn add_crossover_child(
    store: &DynStore,
    prompt: &PromptName,
    version: i64,
    parents: &[i64],
    policy: &PopulationPolicy,
) -> StoreResult<Vec<PopulationArm>> {
    join(store, prompt, version, parents, policy, |rated| {
        Rating::crossover_child(rated).unwrap_or_else(|| Rating::default().mutated_child())
    })
    .await
}

/// A new arm joins: its prior from its parents' current ratings (a parent
/// that never was an arm counts at the default prior), the weakest
/// challenger retired while there are more than `max_arms`, weights saved.
async fn join(
    store: &DynStore,
    prompt: &PromptName,
    version: i64,
    parents: &[i64],
    policy: &PopulationPolicy,
    prior: impl FnOnce(&[Rating]) -> Rating,
) -> StoreResult<Vec<PopulationArm>> {
    let champion = production_version(store, prompt).await?.ok_or(StoreError::NotFound)?;
    let (_, policy) = &effective_policy(store, prompt, policy).await?;
    let also: Vec<i64> = std::iter::once(champion).chain(parents.iter().copied()).collect();
    let mut arms = store.live_arms(prompt, &also).await?;
    reconcile(&mut arms, champion, policy);
    let rated: Vec<Rating> =
        parents.iter().map(|p| arms.iter().find(|a| a.version == *p).map_or(Rating::default(), |a| a.rating)).collect();
    arms.retain(|a| a.version != version);
    arms.push(PopulationArm {
        version,
        state: ArmState::Challenger,
        rating: prior(&rated),
        weight: 0.0,
        scored_traces: 0,
        created_from: parents.first().copied(),
        parents: parents.to_vec(),
        rated_until: None,
        joined_at: None,
    });
    // `max_arms` counts challengers; retire until there is room (the newest
    // stays, and so does every arm that has not had its chance to be rated).
    let mut live: Vec<Arm> = arms.iter().filter(|a| a.state != ArmState::Retired).map(Arm::from).collect();
    let room = PopulationPolicy { max_arms: policy.max_arms + 1, ..*policy };
    let unmeasured = unmeasured(&arms, champion, Utc::now(), policy);
    let covered = if live.len() > room.max_arms { covered(store, prompt, &live, champion).await? } else { Vec::new() };
    while let Some(weakest) = arm_to_retire(&live, champion, Some(version), &unmeasured, &covered, &room) {
        live.retain(|a| a.version != weakest);
        if let Some(a) = arms.iter_mut().find(|a| a.version == weakest) {
            a.state = ArmState::Retired;
        }
    }
    if live.len() > room.max_arms {
        tracing::info!(%prompt, version, live = live.len(), "the population holds more arms than max_arms until the unmeasured ones are rated");
    }
    reconcile(&mut arms, champion, policy);
    store.save_population(prompt, &arms).await?;
    Ok(arms)
}

/// The live challengers whose every lesson another live arm holds: retiring
/// one loses nothing learned (a round's lessons live on in the versions built on it).
async fn covered(store: &DynStore, prompt: &PromptName, live: &[Arm], champion: i64) -> StoreResult<Vec<i64>> {
    let mut contents = Vec::with_capacity(live.len());
    for a in live {
        if let Some(r) = store.resolve(prompt, &Selector::Version(a.version)).await? {
            contents.push((a.version, r.version.content));
        }
    }
    Ok(contents
        .iter()
        .filter(|(v, c)| *v != champion && contents.iter().any(|(w, other)| w != v && other.holds_lessons_of(c)))
        .map(|(v, _)| *v)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crossover_childs_prior_is_the_precision_weighted_mean_of_its_parents() {
        // σ 2 and 4: precisions 1/4 and 1/16; μ = (30/4 + 18/16) / (5/16) = 27.6; σ = √(16/5 + 1).
        let child =
            Rating::crossover_child(&[Rating { mu: 30.0, sigma: 2.0 }, Rating { mu: 18.0, sigma: 4.0 }]).unwrap();
        assert!((child.mu - 27.6).abs() < 1e-12, "{child:?}");
        assert!((child.sigma - (16.0f64 / 5.0 + 1.0).sqrt()).abs() < 1e-12, "{child:?}");
        // Two fresh arms at the prior: μ stays 25, σ = √(σ0²/2 + 1).
        let fresh = Rating::crossover_child(&[Rating::default(), Rating::default()]).unwrap();
        assert!((fresh.mu - 25.0).abs() < 1e-12);
        assert!((fresh.sigma - ((25.0f64 / 3.0).powi(2) / 2.0 + 1.0).sqrt()).abs() < 1e-12);
    }
}
