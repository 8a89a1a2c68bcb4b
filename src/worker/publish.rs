//! What publishing a finished round means, in one place: the label its version
//! gets under the prompt's promotion policy, the version's provenance, the
//! controller's round-time sample, the overload meter's counts, the traces
//! charged for their own failures, and — under `evaluated` — the new version
//! joining the population as a challenger. The worker loop only claims and runs
//! rounds and hands a finished one here; [`Publication::of`] is the policy as
//! plain data, [`publish`] carries it out against the store.

use crate::{
    domain::{LabelName, Method, Promotion, Prompt, VersionContent, VersionSource, prompt::NewVersion},
    evaluate::population::PopulationPolicy,
    learn::round::RoundOutcome,
    store::{DynStore, MeterCounts, StoreError, TraceCharges, TraceFault},
};

/// A finished round, as the publication policy decides it.
#[derive(Debug, Clone)]
pub struct Publication {
    /// `production` under promotion `auto`; `candidate` otherwise.
    pub label: LabelName,
    pub version: NewVersion,
    /// The round's wall time, when it describes the delay the controller models (Combee rounds).
    pub sample_secs: Option<f64>,
    /// The overload meter's counts of this round (empty when it has none).
    pub meter: Vec<MeterCounts>,
    /// Traces charged for their own failure (their reflection could not be obtained).
    pub faults: Vec<TraceFault>,
    /// Whether the version joins the population as a challenger (`evaluated`).
    pub joins_population: bool,
    /// What the round learned left the content as the base version had it:
    /// the round succeeds, but no version is written (a copy of its parent
    /// would only be another version to review, gate and measure).
    pub unchanged: bool,
}

// A gated version (the prompt has a regression set or a harness) is published
// as `candidate` whatever the policy and joins no population: the gate
// exposes it once it passed (`service::gate`).

/// What became of a publication.
#[derive(Debug)]
pub enum Published {
    /// The version's number.
    Version(i64),
    /// The round succeeded without a version: its content equalled its base's.
    Unchanged,
    /// Another worker owns the round now (its lease was lost): nothing was written.
    LeaseLost,
    /// The store refused or failed: the round should be retried or failed.
    Failed(StoreError),
}

impl Publication {
    /// The policy: which label, which provenance, what is recorded beside the version.
    pub fn of(
        prompt: &Prompt,
        parent: (i64, &VersionContent),
        round: uuid::Uuid,
        outcome: &RoundOutcome,
        elapsed_secs: f64,
        by: &str,
        gated: bool,
    ) -> Self {
        let label = match prompt.promotion {
            Promotion::Auto if !gated => LabelName::production(),
            Promotion::Auto => LabelName::candidate(),
            // A learned child is measured (evaluated) or reviewed (manual) before it may serve production.
            Promotion::Manual | Promotion::Evaluated => LabelName::candidate(),
        };
        let (parent, base) = parent;
        let record = &outcome.record;
        let version = NewVersion {
            parent: Some(parent),
            source: VersionSource::Learned,
            round_id: Some(round),
            content: outcome.content.clone(),
            message: format!(
                "learned from {} traces ({} round, k = {}, p = {})",
                record.n,
                crate::domain::round::method_str(outcome.method),
                record.k,
                record.p
            ),
            created_by: by.to_owned(),
        };
        let meter = record.meter.as_ref().map_or_else(Vec::new, |m| {
            m.buckets
                .iter()
                .map(|&(size_min, c)| MeterCounts { size_min, marked: c.marked, recaptured: c.recaptured, rounds: 1 })
                .collect()
        });
        let faults = record
            .unreflected
            .iter()
            .map(|u| TraceFault { trace_id: u.trace_id, reason: format!("reflection failed: {}", u.error) })
            .collect();
        Self {
            label,
            version,
            // Only Combee rounds describe the delay the controller models.
            sample_secs: (outcome.method == Method::Combee && record.n > 0).then_some(elapsed_secs),
            meter,
            faults,
            joins_population: prompt.promotion == Promotion::Evaluated && !gated,
            unchanged: outcome.content.serves_as(base),
        }
    }
}

/// Carries a publication out: the meter first (once the round publishes, the
/// scheduler may size the next round from it; what the groups kept is a
/// measurement of the model whether or not publishing succeeds, and recording a
/// round twice counts once), then the version, its label, the traces and the
/// round's record in one fenced transaction, then the population. A round
/// whose content is its base's ends succeeded without a version.
#[allow(clippy::too_many_arguments)]
pub async fn publish(
    store: &DynStore,
    prompt: &Prompt,
    round: uuid::Uuid,
    attempt: i32,
    publication: Publication,
    detail: &serde_json::Value,
    max_trace_attempts: i32,
    population: &PopulationPolicy,
    degraded_level2: bool,
) -> Published {
    if !publication.meter.is_empty()
        && let Err(e) = store.record_meter_counts(&prompt.name, round, &publication.meter).await
    {
        tracing::warn!(error = %e, "the overload meter was not updated for this round");
    }
    let charges = TraceCharges { faults: publication.faults, max_trace_attempts };
    if publication.unchanged {
        return match store.finish_round_unchanged(round, attempt, detail, publication.sample_secs, &charges).await {
            Ok(()) => {
                metrics::counter!("combee_rounds_total", "outcome" => "succeeded").increment(1);
                metrics::counter!("combee_rounds_unchanged_total").increment(1);
                tracing::info!("round succeeded; what it learned left the prompt unchanged, so no version");
                Published::Unchanged
            }
            Err(StoreError::Conflict) => Published::LeaseLost,
            Err(e) => Published::Failed(e),
        };
    }
    let label = publication.label.clone();
    let published = store
        .publish_round(round, attempt, publication.version, label.clone(), detail, publication.sample_secs, &charges)
        .await;
    let version = match published {
        Ok(v) => v,
        Err(StoreError::Conflict) => return Published::LeaseLost,
        Err(e) => return Published::Failed(e),
    };
    metrics::counter!("combee_rounds_total", "outcome" => "succeeded").increment(1);
    if degraded_level2 {
        metrics::counter!("combee_level2_degraded_total").increment(1);
        tracing::warn!(
            version = version.number,
            "published with a degraded level 2 (the union where answers were unreadable)"
        );
    }
    tracing::info!(version = version.number, label = %label, "round published");
    if publication.joins_population
        && let Err(e) =
            crate::service::arms::add_challenger(store, &prompt.name, version.number, version.parent, population).await
    {
        tracing::error!(version = version.number, error = %e, "the learned version could not join the population");
    }
    Published::Version(version.number)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{PromptName, PromptSettings, Strategy, VersionContent};
    use crate::learn::{
        capacity::meter::{BucketCounts, MeterReading},
        round::{OutcomeRecord, Unreflected},
    };

    fn prompt(promotion: Promotion) -> Prompt {
        Prompt {
            id: uuid::Uuid::nil(),
            name: PromptName::new("default", "p").unwrap(),
            project: "default".into(),
            strategy: Strategy::Playbook,
            promotion,
            settings: PromptSettings::default(),
            created_at: chrono::Utc::now(),
            created_by: "t".into(),
        }
    }

    fn outcome(method: Method) -> RoundOutcome {
        RoundOutcome {
            content: VersionContent { base: "b".into(), playbook: None },
            method,
            strategy: Strategy::Playbook,
            group_outputs: Vec::new(),
            calls: Vec::new(),
            record: OutcomeRecord {
                n: 20,
                k: 10,
                p: 2,
                unreflected: vec![Unreflected { trace_id: uuid::Uuid::from_u128(9), error: "bad".into() }],
                meter: Some(MeterReading {
                    buckets: vec![(4, BucketCounts { marked: 30, recaptured: 27 })],
                    ..Default::default()
                }),
                ..Default::default()
            },
        }
    }

    #[test]
    fn the_promotion_policy_picks_the_label_and_evaluated_versions_join_the_population() {
        let round = uuid::Uuid::from_u128(1);
        let other = VersionContent { base: "a".into(), playbook: None };
        // Published from base v3 whose content is `base`, by a worker called "w" unless said.
        let of = |promotion, base: &VersionContent, method, secs, gated| {
            Publication::of(&prompt(promotion), (3, base), round, &outcome(method), secs, "w", gated)
        };
        let auto = Publication::of(
            &prompt(Promotion::Auto),
            (3, &other),
            round,
            &outcome(Method::Combee),
            2.5,
            "worker:x",
            false,
        );
        assert_eq!((auto.label, auto.joins_population), (LabelName::production(), false));
        assert_eq!((auto.version.parent, auto.version.round_id), (Some(3), Some(round)));
        assert_eq!(auto.version.message, "learned from 20 traces (combee round, k = 10, p = 2)");
        assert_eq!(auto.sample_secs, Some(2.5));
        assert_eq!(auto.meter, vec![MeterCounts { size_min: 4, marked: 30, recaptured: 27, rounds: 1 }]);
        assert_eq!(auto.faults.len(), 1);
        assert!(!auto.unchanged);
        // Learned content equal to the base's: the round publishes no version.
        let same = outcome(Method::Combee).content;
        assert!(of(Promotion::Auto, &same, Method::Combee, 2.5, false).unchanged);
        // So is a learned playbook without bullets on a base that had none: agents see the same text.
        let bare = VersionContent { base: same.base.clone(), playbook: None };
        let mut learned_empty = outcome(Method::Combee);
        learned_empty.content.playbook = Some(crate::domain::playbook::Playbook::default());
        let learned_empty =
            Publication::of(&prompt(Promotion::Auto), (3, &bare), round, &learned_empty, 1.0, "w", false);
        assert!(learned_empty.unchanged);
        let evaluated = of(Promotion::Evaluated, &other, Method::Combee, 1.0, false);
        assert_eq!((evaluated.label, evaluated.joins_population), (LabelName::candidate(), true));
        let manual = of(Promotion::Manual, &other, Method::Sequential, 1.0, false);
        assert_eq!((manual.label, manual.joins_population, manual.sample_secs), (LabelName::candidate(), false, None));
        // A gated version waits as candidate under every policy and joins no population yet.
        for promotion in [Promotion::Auto, Promotion::Evaluated, Promotion::Manual] {
            let gated = of(promotion, &other, Method::Combee, 1.0, true);
            assert_eq!((gated.label, gated.joins_population), (LabelName::candidate(), false), "{promotion:?}");
        }
    }
}
