//! How arms join the population of an `evaluated` prompt: a learned version
//! as a challenger (mutation: the parent's μ, σ = √(σ_parent² + 1)) instead
//! of moving `production`, a crossover child with the precision-weighted mean
//! of its parents' ratings; the weakest challenger retires to make room.

use crate::{
    domain::{
        PromptName,
        population::{ArmState, PopulationArm},
    },
    evaluate::{
        population::{Arm, PopulationPolicy, arm_to_retire},
        trueskill::Rating,
    },
    service::{
        population::{effective_policy, reconcile},
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
    });
    // `max_arms` counts challengers; retire until there is room (the newest stays).
    let mut live: Vec<Arm> = arms.iter().filter(|a| a.state != ArmState::Retired).map(Arm::from).collect();
    while let Some(weakest) =
        arm_to_retire(&live, champion, Some(version), &PopulationPolicy { max_arms: policy.max_arms + 1, ..*policy })
    {
        live.retain(|a| a.version != weakest);
        if let Some(a) = arms.iter_mut().find(|a| a.version == weakest) {
            a.state = ArmState::Retired;
        }
    }
    reconcile(&mut arms, champion, policy);
    store.save_population(prompt, &arms).await?;
    Ok(arms)
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
