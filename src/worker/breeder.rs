//! Crossover, run by the rater after a rated window: with probability
//! `crossover_prob` and when at least two arms each won some task keys, one
//! LLM call crosses the winners into a child (source `crossover`, see
//! [`crate::learn::crossover`]) that joins as a challenger with μ = the
//! precision-weighted mean of its parents' μ, σ = √(1/Σσᵢ⁻² + 1); label
//! `candidate`, the evidence in the label history. A failure is logged and
//! counted by the rater, never fatal.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use chrono::{DateTime, Utc};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::service::{arms::add_crossover_child, population::repeated_version};
use crate::{
    domain::{
        LabelMoveKind, LabelName, MoveCause, Prompt, PromptName, Strategy, VersionSource,
        label::{LabelMove, Selector},
        prompt::NewVersion,
    },
    evaluate::{
        population::PopulationPolicy,
        rater::{TIE, TaskRewards, task_winners},
        trueskill::Rating,
    },
    learn::{
        crossover::{self, Winner},
        denylist::ContentDenylist,
        merge::budget::Budget,
    },
    llm::{
        LlmBackend, LlmError,
        config::LlmConfig,
        meter::{CallTag, Tagged},
    },
    store::{DynStore, StoreError},
};

/// Who crossover children are made and labelled by.
pub const CROSSOVER_ACTOR: &str = "crossover";

/// The LLM and the content rules crossover children are made with, and the
/// store and server population policy they join under.
#[derive(Clone)]
pub(super) struct Breeder {
    pub(super) store: DynStore,
    pub(super) population: PopulationPolicy,
    pub(super) backend: Arc<dyn LlmBackend>,
    pub(super) llm: Arc<LlmConfig>,
    pub(super) denylist: Arc<ContentDenylist>,
}

/// What a crossover attempt after a rated window did.
#[derive(Debug, Clone, PartialEq)]
pub enum CrossoverOutcome {
    /// The window's draw against `crossover_prob` said no.
    NotDrawn,
    /// Fewer than two arms won task keys in the window.
    TooFewWinners { winners: Vec<i64> },
    /// Only playbook prompts have bullets to cross.
    NotPlaybook,
    /// The model imported nothing the champion does not already hold.
    NothingImported,
    /// The child would teach what this live arm or recent version teaches
    /// (the same bullets, whatever their ids, order or counters; e.g. the
    /// same winners crossed again in a later window): no new version.
    SameAsArm { version: i64 },
    /// The child `version`, bred from `parents` (the champion first), joined the population.
    Bred { version: i64, parents: Vec<i64>, rating: Rating },
}

/// What rating a window read, handed on to the crossover after it so the
/// crossover reads nothing twice.
pub(super) struct RatedWindow {
    pub(super) prompt: Prompt,
    pub(super) policy: PopulationPolicy,
    /// The version `production` points at after the rating (and the gate).
    pub(super) champion: i64,
    /// The live arms' versions.
    pub(super) live: Vec<i64>,
    /// The window's task rewards, when the rating read them (two or more ranked arms).
    pub(super) tasks: Option<Vec<TaskRewards>>,
    pub(super) from: DateTime<Utc>,
    pub(super) until: DateTime<Utc>,
}

/// Why a crossover attempt failed (logged and counted; the rater goes on).
#[derive(Debug, thiserror::Error)]
pub enum CrossoverError {
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("the crossover call failed: {0}")]
    Llm(#[from] LlmError),
    #[error("the child was refused: {0}")]
    Refused(String),
}

impl CrossoverOutcome {
    pub(super) fn label(&self) -> &'static str {
        match self {
            Self::NotDrawn => "not_drawn",
            Self::TooFewWinners { .. } => "too_few_winners",
            Self::NotPlaybook => "not_playbook",
            Self::NothingImported => "nothing_imported",
            Self::SameAsArm { .. } => "same_as_arm",
            Self::Bred { .. } => "bred",
        }
    }
}

/// The window's crossover draw in [0, 1): the same for the same prompt and
/// window end in every process, so a test can force it with 0 or 1.
fn crossover_draw(prompt: &PromptName, window_end: DateTime<Utc>) -> f64 {
    let digest = Sha256::new()
        .chain_update(b"crossover")
        .chain_update(prompt.qualified().as_bytes())
        .chain_update(window_end.timestamp_micros().to_le_bytes())
        .finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    (u64::from_le_bytes(first) >> 11) as f64 / (1u64 << 53) as f64
}

impl Breeder {
    /// Crossover after a rated window (see the module's comment), on what
    /// rating the window read already, adding the time of its LLM call to `llm`.
    pub(super) async fn breed(
        &self,
        rated: RatedWindow,
        llm: &mut Duration,
    ) -> Result<CrossoverOutcome, CrossoverError> {
        let RatedWindow { prompt: p, policy, champion, live: mut versions, tasks, from, until } = rated;
        let prompt = &p.name;
        if crossover_draw(prompt, until) >= policy.crossover_prob {
            return Ok(CrossoverOutcome::NotDrawn);
        }
        if p.strategy != Strategy::Playbook {
            return Ok(CrossoverOutcome::NotPlaybook);
        }
        versions.sort_unstable();
        let tasks = match tasks {
            Some(tasks) => tasks,
            None => self.store.task_rewards(prompt, from, until).await?,
        };
        let won = task_winners(&tasks, &versions, TIE);
        if won.len() < 2 {
            return Ok(CrossoverOutcome::TooFewWinners { winners: won.into_keys().collect() });
        }
        let load = |v: i64| async move {
            self.store
                .resolve(prompt, &Selector::Version(v))
                .await?
                .map(|r| r.version)
                .ok_or(CrossoverError::Refused(format!("version {v} is gone")))
        };
        let champion_version = load(champion).await?;
        let mut winner_versions = Vec::new();
        for v in won.keys() {
            winner_versions.push(load(*v).await?);
        }
        let winners: Vec<Winner<'_>> = winner_versions
            .iter()
            .map(|v| Winner { version: v.number, content: &v.content, won: won[&v.number].clone() })
            .collect();
        let mut calls = Vec::new();
        let asked = std::time::Instant::now();
        // Counted against the prompt's budget like its rounds' calls.
        let tagged = Tagged::new(self.backend.clone(), CallTag::prompt(&p.name.qualified(), "crossover"));
        let selection =
            crossover::select(&tagged, &self.llm, champion, &champion_version.content, &winners, &mut calls).await;
        *llm += asked.elapsed();
        let selection = selection?;
        let budget = Budget::for_prompt(&p.settings, p.strategy);
        let bred = crossover::breed(&champion_version.content, &selection, &budget);
        for r in &bred.refused {
            metrics::counter!("combee_learned_changes_refused_total", "rule" => r.rule.as_str(), "source" => "crossover")
                .increment(1);
            tracing::info!(%prompt, from = r.import.from_version, bullet = %r.import.bullet_id, reason = %r.reason,
                "crossover did not import a bullet that fails the lesson check");
        }
        let Some((child, applied)) = bred.child else {
            return Ok(CrossoverOutcome::NothingImported);
        };
        self.denylist.check(&champion_version.content, &child).map_err(CrossoverError::Refused)?;
        // A child that teaches what a live arm or a recent version teaches would only be measured again.
        let base = (champion, &champion_version.content);
        if let Some(version) = repeated_version(&self.store, prompt, base, &child).await? {
            return Ok(CrossoverOutcome::SameAsArm { version });
        }
        // The champion (whose bullets the child kept) first, then the winners.
        let mut parents = vec![champion];
        parents.extend(won.keys().copied().filter(|v| *v != champion));
        let imported: BTreeMap<i64, usize> = selection.import.iter().fold(BTreeMap::new(), |mut m, i| {
            *m.entry(i.from_version).or_default() += 1;
            m
        });
        let from_list = imported.iter().map(|(v, n)| format!("{n} from v{v}")).collect::<Vec<_>>().join(", ");
        let message = format!(
            "crossover of {}: kept v{champion}'s bullets ({} dropped), imported {from_list}",
            parents.iter().map(|v| format!("v{v}")).collect::<Vec<_>>().join(", "),
            selection.drop.len(),
        );
        let version = self
            .store
            .create_version(
                prompt,
                NewVersion {
                    parent: Some(champion),
                    source: VersionSource::Crossover,
                    round_id: None,
                    content: child,
                    message: message.clone(),
                    created_by: CROSSOVER_ACTOR.to_owned(),
                },
                &[],
            )
            .await?;
        let arms = add_crossover_child(&self.store, prompt, version.number, &parents, &self.population).await?;
        let rating = arms.iter().find(|a| a.version == version.number).map_or_else(Rating::default, |a| a.rating);
        let parent_ratings: Vec<serde_json::Value> = parents
            .iter()
            .map(|v| json!({"version": v, "rating": arms.iter().find(|a| a.version == *v).map(|a| a.rating)}))
            .collect();
        let evidence = json!({
            "parents": parent_ratings,
            "child": {"version": version.number, "rating": rating},
            "won": won.iter().map(|(v, keys)| json!({"version": v, "tasks": keys})).collect::<Vec<_>>(),
            "window": {"from": from, "until": until},
            "template": crossover::template_id(),
            "selection": {"drop": selection.drop, "import": selection.import, "reason": selection.reason},
            "answer": selection.notes,
            "applied": applied.applied.len(),
            "skipped": applied.skipped.len(),
            "refused": bred.refused,
            "llm_calls": calls,
        });
        let mv = LabelMove {
            label: LabelName::candidate(),
            to_version: version.number,
            expected_current: None,
            check_current: false,
            by: CROSSOVER_ACTOR.to_owned(),
        };
        let cause = MoveCause::new(LabelMoveKind::Crossover, message).with_evidence(evidence);
        // The child exists and competes either way; the label is its pointer for people.
        if let Err(e) = self.store.move_label_because(prompt, &mv, &cause).await {
            tracing::warn!(%prompt, version = version.number, error = %e, "the crossover child was not labelled candidate");
        }
        Ok(CrossoverOutcome::Bred { version: version.number, parents, rating })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crossover_draw_is_seeded_by_prompt_and_window() {
        let p = PromptName::new("default", "p").unwrap();
        let t = DateTime::parse_from_rfc3339("2026-11-23T16:00:00Z").unwrap().with_timezone(&Utc);
        assert_eq!(crossover_draw(&p, t), crossover_draw(&p, t));
        // Over many windows about a fifth fall below 0.2, all below 1, none below 0.
        let draws: Vec<f64> = (0..2000).map(|i| crossover_draw(&p, t + chrono::Duration::seconds(i))).collect();
        assert!(draws.iter().all(|d| (0.0..1.0).contains(d)));
        let share = draws.iter().filter(|d| **d < 0.2).count() as f64 / 2000.0;
        assert!((share - 0.2).abs() < 0.03, "{share}");
    }
}
