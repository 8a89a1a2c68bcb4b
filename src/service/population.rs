//! The population of a prompt under the `evaluated` policy, shared by the
//! worker's rater and the operators' moves: its first champion, how arms are
//! reconciled with `production` (see `production.rs` for when), the policy in
//! effect for one prompt, and the arms as operators see them. The arms agents are served from are read in
//! `prompts.rs`, beside the prompt's text.

use serde::Serialize;
use utoipa::ToSchema;

use super::{AppState, ServiceResult};
use crate::{
    domain::{
        Prompt, PromptName,
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
        }
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
