//! The population of a prompt under the `evaluated` policy, where both the
//! worker's rater and the operators' moves keep it in step with `production`:
//! its first champion, how arms follow a moved `production` (the rater on its
//! ticks, an operator's promote or rollback at once), and the arms as
//! operators see them. The arms agents are served from are read in
//! `prompts.rs`, beside the prompt's text.

use serde::Serialize;
use utoipa::ToSchema;

use super::{AppState, ServiceResult};
use crate::{
    domain::{
        LabelName, Prompt, PromptName,
        label::Selector,
        population::{ArmState, PopulationArm},
    },
    evaluate::{
        population::{Arm, PopulationPolicy, traffic_weights},
        trueskill::Rating,
    },
    store::{DynStore, StoreResult},
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

/// Makes a stored population follow `production` at once after a move the
/// rater did not make (an operator's promote or rollback, a new version
/// labelled production): the version production points at becomes the
/// champion (joining at the prior if it was no arm), the old champion
/// competes on as a challenger, weights are recomputed. Nothing to do for a
/// prompt without a population, or when production is the champion already.
pub async fn follow_production(store: &DynStore, prompt: &PromptName, policy: &PopulationPolicy) -> StoreResult<()> {
    let production = store.resolve(prompt, &Selector::Label(LabelName::production())).await?;
    let Some(champion) = production.map(|r| r.version.number) else { return Ok(()) };
    let mut arms = store.live_arms(prompt, &[champion]).await?;
    if arms.is_empty() || arms.iter().any(|a| a.version == champion && a.state == ArmState::Champion) {
        return Ok(());
    }
    // The prompt's own population knobs (`settings.population`) in place of the server's.
    let own = store.get_prompt(prompt).await?.ok_or(crate::store::StoreError::NotFound)?;
    reconcile(&mut arms, champion, &own.settings.population.applied_to(policy));
    store.save_population(prompt, &arms).await
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
