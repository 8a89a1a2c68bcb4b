//! The end of a finished round, one path for every promotion policy:
//! [`Publication::of`] decides, as plain data, everything the end writes —
//! the version (or none), its label under the prompt's policy, its
//! provenance, the round's record, the controller's round-time sample, the
//! overload meter's counts, the traces charged for their own failures, and
//! whether the version joins the population or waits for its regression gate;
//! [`publish`] carries that one value out: the meter, the check that the
//! version teaches something no live arm or recent version teaches, then the
//! store's one fenced transaction through the one door `production` moves by
//! ([`crate::service::production::Mover::finish_round`], also under `auto`),
//! then the population or the gate. The worker loop only claims and runs
//! rounds and hands a finished one here.

use serde_json::Value;

use crate::{
    domain::{
        LabelName, Method, Promotion, VersionSource, prompt::NewVersion, regression::GateMode, round::method_str,
    },
    learn::round::RoundOutcome,
    service::{self, AppState},
    store::{ClaimedRound, MeterCounts, RoundEnd, StoreError, TraceCharges, TraceFault},
};

/// A finished round, as the publication policy decides it: one value from
/// the worker to the store.
#[derive(Debug, Clone)]
pub struct Publication {
    /// What the store writes in the round's last transaction: the version
    /// (`production` under promotion `auto`, `candidate` otherwise) or none,
    /// the record, the sample, the charges.
    pub end: RoundEnd,
    /// The overload meter's counts of this round (empty when it has none).
    pub meter: Vec<MeterCounts>,
    /// Whether the version joins the population as a challenger (`evaluated`, not gated).
    pub joins_population: bool,
    /// The regression gate the version waits for, if the prompt has one.
    pub gated: Option<GateMode>,
    /// Whether a version that only repeats a live arm or a recent version is
    /// left unwritten (`evaluated` and `manual`; under `auto` the version is
    /// production's next state, whatever it repeats).
    pub refuses_repeats: bool,
    /// Level 2 degraded: some answers could not be read and the union was kept.
    pub degraded_level2: bool,
}

// A gated version (the prompt has a regression set or a harness) is published
// as `candidate` whatever the policy and joins no population: the gate
// exposes it once it passed (`service::gate`).

/// Who ends rounds, and how many attempts a trace gets: the worker's side of a publication.
#[derive(Debug, Clone, Copy)]
pub struct Publisher<'a> {
    /// Who the version is created by (`worker:<owner>`).
    pub by: &'a str,
    pub max_trace_attempts: i32,
}

/// What became of a publication.
#[derive(Debug)]
pub enum Published {
    /// The version's number.
    Version(i64),
    /// The round succeeded without a version: its content equalled its base's.
    Unchanged,
    /// The round succeeded without a version: it would only repeat the lessons of this version.
    Repeats(i64),
    /// Another worker owns the round now (its lease was lost): nothing was written.
    LeaseLost,
    /// The store refused or failed: the round should be retried or failed.
    Failed(StoreError),
}

impl Publication {
    /// The policy: which label, which provenance, what is recorded beside the version.
    pub fn of(
        claimed: &ClaimedRound,
        outcome: &RoundOutcome,
        detail: Value,
        elapsed_secs: f64,
        gated: Option<GateMode>,
        publisher: Publisher<'_>,
    ) -> Self {
        let ClaimedRound { round, prompt, base, .. } = claimed;
        let label = match prompt.promotion {
            Promotion::Auto if gated.is_none() => LabelName::production(),
            // A learned child is measured (evaluated), reviewed (manual) or gated before it may serve production.
            _ => LabelName::candidate(),
        };
        let record = &outcome.record;
        let version = NewVersion {
            parent: Some(base.number),
            source: VersionSource::Learned,
            round_id: Some(round.id),
            content: outcome.content.clone(),
            message: format!(
                "learned from {} traces ({} round, k = {}, p = {})",
                record.n,
                method_str(outcome.method),
                record.k,
                record.p
            ),
            created_by: publisher.by.to_owned(),
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
        // What the round learned left the content as the base version had it:
        // the round succeeds, but no version is written (a copy of its parent
        // would only be another version to review, gate and measure).
        let unchanged = outcome.content.serves_as(&base.content);
        Self {
            end: RoundEnd {
                round: round.id,
                attempt: round.attempt,
                version: (!unchanged).then_some((version, label)),
                detail,
                k: Some(outcome.k as i32),
                // Only Combee rounds describe the delay the controller models.
                sample_secs: (outcome.method == Method::Combee && record.n > 0).then_some(elapsed_secs),
                charges: TraceCharges { faults, max_trace_attempts: publisher.max_trace_attempts },
            },
            meter,
            joins_population: prompt.promotion == Promotion::Evaluated && gated.is_none(),
            gated,
            refuses_repeats: prompt.promotion != Promotion::Auto,
            degraded_level2: record.level2.is_degraded(),
        }
    }
}

/// Carries a publication out: the meter first (once the round publishes, the
/// scheduler may size the next round from it; what the groups kept is a
/// measurement of the model whether or not publishing succeeds, and recording a
/// round twice counts once); then, unless it only repeats a version the prompt
/// has, the version, its label, the traces and the round's record in one
/// fenced transaction through `production`'s one door; then the population or
/// the regression gate. A round whose content is its base's, or repeats one,
/// ends succeeded without a version.
pub async fn publish(state: &AppState, claimed: &ClaimedRound, mut publication: Publication) -> Published {
    let store = &state.store;
    let (prompt, base) = (&claimed.prompt, &claimed.base);
    if !publication.meter.is_empty()
        && let Err(e) = store.record_meter_counts(&prompt.name, publication.end.round, &publication.meter).await
    {
        tracing::warn!(error = %e, "the overload meter was not updated for this round");
    }
    let mut repeats = None;
    if publication.refuses_repeats
        && let Some((version, _)) = &publication.end.version
    {
        match service::population::repeated_version(store, &prompt.name, (base.number, &base.content), &version.content)
            .await
        {
            Ok(Some(v)) => repeats = Some(v),
            Ok(None) => {}
            Err(e) => return Published::Failed(e),
        }
    }
    if let Some(v) = repeats {
        publication.end.version = None;
        if let Value::Object(detail) = &mut publication.end.detail {
            detail.insert("repeats".into(), v.into());
        }
    }
    let mover = service::production::Mover::of(state);
    let written = match mover.finish_round(&prompt.name, &publication.end).await {
        Ok(written) => written,
        Err(StoreError::Conflict) => return Published::LeaseLost,
        Err(e) => return Published::Failed(e),
    };
    metrics::counter!("combee_rounds_total", "outcome" => "succeeded").increment(1);
    let Some(version) = written else {
        metrics::counter!("combee_rounds_unchanged_total").increment(1);
        return match repeats {
            Some(v) => {
                metrics::counter!("combee_rounds_repeated_total").increment(1);
                tracing::info!(
                    repeats = v,
                    "round succeeded; what it learned repeats a version the prompt has, so no version"
                );
                Published::Repeats(v)
            }
            None => {
                tracing::info!("round succeeded; what it learned left the prompt unchanged, so no version");
                Published::Unchanged
            }
        };
    };
    if publication.degraded_level2 {
        metrics::counter!("combee_level2_degraded_total").increment(1);
        tracing::warn!(
            version = version.number,
            "published with a degraded level 2 (the union where answers were unreadable)"
        );
    }
    let label = publication.end.version.as_ref().map(|(_, l)| l.to_string()).unwrap_or_default();
    tracing::info!(version = version.number, label, "round published");
    if publication.joins_population {
        let policy = state.settings.population.policy();
        if let Err(e) =
            service::arms::add_challenger(store, &prompt.name, version.number, version.parent, &policy).await
        {
            tracing::error!(version = version.number, error = %e, "the learned version could not join the population");
        }
    }
    if let Some(mode) = publication.gated {
        match service::gate::open(store, &state.settings.regression, &prompt.name, &version, mode).await {
            Ok(()) => tracing::info!(version = version.number, mode = mode.as_str(), "regression gate opened"),
            Err(e) => tracing::error!(version = version.number, error = %e,
                "the version's regression gate could not be opened; it stays candidate, unexposed"),
        }
    }
    Published::Version(version.number)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{
        Prompt, PromptName, PromptSettings, Strategy, Version, VersionContent,
        round::{Round, RoundStatus, RoundTrigger},
    };
    use crate::learn::{
        capacity::meter::{BucketCounts, MeterReading},
        round::{OutcomeRecord, Unreflected},
    };

    fn claimed(promotion: Promotion, base: VersionContent) -> ClaimedRound {
        let name = PromptName::new("default", "p").unwrap();
        let now = chrono::Utc::now();
        ClaimedRound {
            round: Round {
                id: uuid::Uuid::from_u128(1),
                prompt: name.clone(),
                status: RoundStatus::Running,
                trigger: RoundTrigger::Backlog,
                method: Method::Combee,
                strategy: Strategy::Playbook,
                seed: 1,
                duplication: 2,
                n: 20,
                k: None,
                base_version: 3,
                result_version: None,
                attempt: 2,
                error: None,
                detail: Value::Null,
                created_at: now,
                started_at: None,
                finished_at: None,
                updated_at: now,
            },
            prompt: Prompt {
                id: uuid::Uuid::nil(),
                name: name.clone(),
                project: "default".into(),
                strategy: Strategy::Playbook,
                promotion,
                settings: PromptSettings::default(),
                created_at: now,
                created_by: "t".into(),
            },
            base: Version {
                prompt: name,
                number: 3,
                parent: None,
                source: VersionSource::Manual,
                round_id: None,
                content_hash: base.hash(),
                content: base,
                message: String::new(),
                created_by: "t".into(),
                created_at: now,
            },
            traces: Vec::new(),
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
        let other = VersionContent { base: "a".into(), playbook: None };
        let publisher = Publisher { by: "worker:x", max_trace_attempts: 3 };
        // Published from base v3 whose content is `base`.
        let of = |promotion, base: &VersionContent, method, secs, gated| {
            let claimed = claimed(promotion, base.clone());
            Publication::of(&claimed, &outcome(method), Value::Null, secs, gated, publisher)
        };
        let auto = of(Promotion::Auto, &other, Method::Combee, 2.5, None);
        let (version, label) = auto.end.version.clone().expect("a version");
        assert_eq!((label, auto.joins_population, auto.refuses_repeats), (LabelName::production(), false, false));
        assert_eq!((version.parent, version.round_id), (Some(3), Some(uuid::Uuid::from_u128(1))));
        assert_eq!(version.message, "learned from 20 traces (combee round, k = 10, p = 2)");
        assert_eq!((version.created_by.as_str(), auto.end.attempt, auto.end.k), ("worker:x", 2, Some(10)));
        assert_eq!(auto.end.sample_secs, Some(2.5));
        assert_eq!(auto.meter, vec![MeterCounts { size_min: 4, marked: 30, recaptured: 27, rounds: 1 }]);
        assert_eq!((auto.end.charges.faults.len(), auto.end.charges.max_trace_attempts), (1, 3));
        // Learned content equal to the base's: the round publishes no version.
        let same = outcome(Method::Combee).content;
        assert!(of(Promotion::Auto, &same, Method::Combee, 2.5, None).end.version.is_none());
        // So is a learned playbook without bullets on a base that had none: agents see the same text.
        let bare = VersionContent { base: same.base.clone(), playbook: None };
        let mut learned_empty = outcome(Method::Combee);
        learned_empty.content.playbook = Some(crate::domain::playbook::Playbook::default());
        let learned_empty =
            Publication::of(&claimed(Promotion::Auto, bare), &learned_empty, Value::Null, 1.0, None, publisher);
        assert!(learned_empty.end.version.is_none());
        let evaluated = of(Promotion::Evaluated, &other, Method::Combee, 1.0, None);
        let label = evaluated.end.version.as_ref().map(|(_, l)| l.clone());
        assert_eq!((label, evaluated.joins_population), (Some(LabelName::candidate()), true));
        assert!(evaluated.refuses_repeats);
        let manual = of(Promotion::Manual, &other, Method::Sequential, 1.0, None);
        let label = manual.end.version.as_ref().map(|(_, l)| l.clone());
        assert_eq!(
            (label, manual.joins_population, manual.end.sample_secs),
            (Some(LabelName::candidate()), false, None)
        );
        // A gated version waits as candidate under every policy and joins no population yet.
        for promotion in [Promotion::Auto, Promotion::Evaluated, Promotion::Manual] {
            let gated = of(promotion, &other, Method::Combee, 1.0, Some(GateMode::Cases));
            let label = gated.end.version.as_ref().map(|(_, l)| l.clone());
            assert_eq!((label, gated.joins_population), (Some(LabelName::candidate()), false), "{promotion:?}");
            assert_eq!(gated.gated, Some(GateMode::Cases));
        }
    }
}
