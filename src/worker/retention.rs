//! The retention job, run by worker processes: every `retention.interval_secs`
//! it deletes what expired — consumed, failed and quarantined traces (with
//! their OTLP spans, reflections and round links) by each prompt's own
//! retention or the server's, finished rounds' bulky detail (kept: the round
//! and its usage totals), outbound events with their deliveries, idempotency
//! keys past their TTL, inbound webhook ids, and minute and second rollups
//! past the horizons readers use — in batches of `retention.batch_size` rows, each its
//! own short transaction, with a pause between batches. Consumed traces are
//! first appended to the archive when `retention.archive_dir` is set; if that
//! fails nothing is deleted. The label history and the outcome rollups of
//! hours and days are never deleted. Audit log entries are deleted only when
//! `retention.audit_days` is set (by the store's one guarded path), and a pass
//! that deleted anything appends its own `retention.run` audit entry. Every
//! deleted row is counted in `/metrics` (`combee_retention_deleted_total{what}`).
//! `combee prune --dry-run` reports what a pass would delete.

use std::{
    collections::BTreeMap,
    io::Write as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::{
    config::RetentionSettings,
    domain::{
        Prompt, PromptName, Trace,
        audit::{Actor, NewAuditEntry, RequestOrigin},
    },
    store::{DynStore, Expiring, StoreError, TraceExpiry, minute_rollup_cutoff, second_rollup_cutoff},
};

/// Inbound webhook ids are kept this long: far past the signature tolerance,
/// so a replay is refused by its timestamp before its id could be forgotten.
const INBOUND_ID_DAYS: i64 = 7;
/// Most prompts one list call returns.
const PAGE: u32 = 200;
/// The audit log's name in a report and in `combee_retention_deleted_total`.
const AUDIT: &str = "audit_log";

#[derive(Debug, thiserror::Error)]
pub enum PruneError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("archive: {0}")]
    Archive(#[from] std::io::Error),
}

/// What a pass deleted, or (dry run) would delete.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PruneReport {
    /// Traces per prompt (written as from a server-wide key: `name` in `default`, `project/name` elsewhere) and kind (`consumed`, `failed`, `quarantined`).
    pub traces: BTreeMap<String, BTreeMap<&'static str, u64>>,
    /// Rows deleted with the traces (not known on a dry run).
    pub reflections: u64,
    pub otlp_spans: u64,
    pub round_links: u64,
    /// Consumed traces appended to the archive first.
    pub archived: u64,
    /// Other rows: `round_details` (rounds compacted), `webhook_events`,
    /// `idempotency_keys`, `inbound_webhook_ids`, `minute_rollups`, `second_rollups`.
    pub other: BTreeMap<&'static str, u64>,
}

impl PruneReport {
    pub fn total_traces(&self) -> u64 {
        self.traces.values().flat_map(|k| k.values()).sum()
    }
}

/// When each kind of a prompt's traces expires.
pub fn trace_cutoffs(
    settings: &RetentionSettings,
    prompt: &Prompt,
    now: DateTime<Utc>,
) -> [(TraceExpiry, DateTime<Utc>); 3] {
    let own = &prompt.settings.retention;
    let days = |d: Option<u32>, default: u32| now - chrono::Duration::days(i64::from(d.unwrap_or(default)));
    [
        (TraceExpiry::Consumed, days(own.consumed_days, settings.consumed_days)),
        (TraceExpiry::Failed, days(own.failed_days, settings.failed_days)),
        (TraceExpiry::Quarantined, days(own.quarantined_days, settings.quarantined_days)),
    ]
}

pub struct Pruner {
    store: DynStore,
    settings: RetentionSettings,
    idempotency_ttl: chrono::Duration,
    archive: Option<Archive>,
}

impl Pruner {
    pub fn new(store: DynStore, settings: RetentionSettings, idempotency_ttl_hours: u64) -> Self {
        let archive = (!settings.archive_dir.is_empty()).then(|| Archive::new(&settings.archive_dir));
        Self {
            store,
            idempotency_ttl: chrono::Duration::hours(i64::try_from(idempotency_ttl_hours).unwrap_or(i64::MAX / 7200)),
            archive,
            settings,
        }
    }

    fn other_cutoffs(&self, now: DateTime<Utc>) -> [(Expiring, DateTime<Utc>); 4] {
        let days = |d: u32| now - chrono::Duration::days(i64::from(d));
        [
            (Expiring::RoundDetails, days(self.settings.round_detail_days)),
            (Expiring::Events, days(self.settings.events_days)),
            (Expiring::IdempotencyKeys, now - self.idempotency_ttl),
            (Expiring::InboundWebhookIds, now - chrono::Duration::days(INBOUND_ID_DAYS)),
        ]
    }

    async fn prompts(&self) -> Result<Vec<Prompt>, StoreError> {
        let mut all = Vec::new();
        let mut after: Option<PromptName> = None;
        loop {
            let page = self.store.prompts_page(after.as_ref(), PAGE).await?;
            let done = page.len() < PAGE as usize;
            after = page.last().map(|p| p.name.clone());
            all.extend(page);
            if done {
                return Ok(all);
            }
        }
    }

    /// What a pass at `now` would delete (minute and second rollups are not counted).
    pub async fn dry_run(&self, now: DateTime<Utc>) -> Result<PruneReport, PruneError> {
        let mut report = PruneReport::default();
        for prompt in self.prompts().await? {
            let mut kinds = BTreeMap::new();
            for (kind, cutoff) in trace_cutoffs(&self.settings, &prompt, now) {
                kinds.insert(kind.as_str(), self.store.count_expired_traces(&prompt.name, kind, cutoff).await?);
            }
            report.traces.insert(prompt.name.qualified().into_owned(), kinds);
        }
        for (what, cutoff) in self.other_cutoffs(now) {
            report.other.insert(what.as_str(), self.store.count_expiring(what, cutoff).await?);
        }
        if let Some(cutoff) = self.audit_cutoff(now) {
            report.other.insert(AUDIT, self.store.count_audit_before(cutoff).await?);
        }
        Ok(report)
    }

    /// Deletes everything expired at `now`, batch by batch, until nothing is
    /// left or `stop` is cancelled.
    pub async fn pass(&self, now: DateTime<Utc>, stop: &CancellationToken) -> Result<PruneReport, PruneError> {
        let mut report = PruneReport::default();
        let limit = self.settings.batch_size;
        for prompt in self.prompts().await? {
            for (kind, cutoff) in trace_cutoffs(&self.settings, &prompt, now) {
                loop {
                    if stop.is_cancelled() {
                        return Ok(report);
                    }
                    let ids = self.store.expired_traces(&prompt.name, kind, cutoff, limit).await?;
                    if ids.is_empty() {
                        break;
                    }
                    let started = Instant::now();
                    if kind == TraceExpiry::Consumed
                        && let Some(archive) = &self.archive
                    {
                        let traces = self.store.traces_by_ids(&ids).await?;
                        let archived = archive.append(traces).await?;
                        report.archived += archived;
                        metrics::counter!("combee_retention_archived_total").increment(archived);
                    }
                    let deleted = self.store.delete_expired_traces(&ids, kind).await?;
                    batch_done(started);
                    *report
                        .traces
                        .entry(prompt.name.qualified().into_owned())
                        .or_default()
                        .entry(kind.as_str())
                        .or_default() += deleted.traces;
                    report.reflections += deleted.reflections;
                    report.otlp_spans += deleted.otlp_spans;
                    report.round_links += deleted.round_links;
                    count("traces", deleted.traces);
                    count("reflections", deleted.reflections);
                    count("otlp_spans", deleted.otlp_spans);
                    count("round_links", deleted.round_links);
                    let short = ids.len() < limit as usize;
                    self.pause().await;
                    // Fewer deleted than found: the rest changed state meanwhile; move on.
                    if short || deleted.traces == 0 {
                        break;
                    }
                }
            }
            for (what, width, before) in
                [("minute_rollups", 60, minute_rollup_cutoff(now)), ("second_rollups", 1, second_rollup_cutoff(now))]
            {
                loop {
                    let started = Instant::now();
                    let n = self.store.prune_rollups(&prompt.name, width, before, limit).await?;
                    batch_done(started);
                    *report.other.entry(what).or_default() += n;
                    count(what, n);
                    if n < u64::from(limit) || stop.is_cancelled() {
                        break;
                    }
                    self.pause().await;
                }
            }
        }
        for (what, cutoff) in self.other_cutoffs(now) {
            loop {
                if stop.is_cancelled() {
                    return Ok(report);
                }
                let started = Instant::now();
                let n = self.store.prune(what, cutoff, limit).await?;
                batch_done(started);
                *report.other.entry(what.as_str()).or_default() += n;
                count(what.as_str(), n);
                if n < u64::from(limit) {
                    break;
                }
                self.pause().await;
            }
        }
        // The audit log, only when `audit_days` is set: through the one path its triggers let by.
        while let Some(cutoff) = self.audit_cutoff(now) {
            if stop.is_cancelled() {
                break;
            }
            let started = Instant::now();
            let n = self.store.prune_audit(cutoff, limit).await?;
            batch_done(started);
            *report.other.entry(AUDIT).or_default() += n;
            count(AUDIT, n);
            if n < u64::from(limit) {
                break;
            }
            self.pause().await;
        }
        Ok(report)
    }

    /// Audit entries made before this expire (none while `audit_days` is 0).
    fn audit_cutoff(&self, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        (self.settings.audit_days > 0).then(|| now - chrono::Duration::days(i64::from(self.settings.audit_days)))
    }

    /// Appends a pass's audit entry (`retention.run`): what it deleted, by whom.
    pub async fn record(&self, actor: Actor, report: &PruneReport) {
        let entry = NewAuditEntry::new(
            actor,
            RequestOrigin::default(),
            "retention.run",
            Some("retention".into()),
            None,
            None,
            serde_json::to_value(report).ok(),
        );
        crate::service::audit::record(&self.store, &entry).await;
    }

    async fn pause(&self) {
        if self.settings.batch_pause_ms > 0 {
            tokio::time::sleep(Duration::from_millis(self.settings.batch_pause_ms)).await;
        }
    }

    /// A pass every `interval_secs` until `shutdown` (the first one a little
    /// after start, so a restarting fleet does not prune all at once).
    pub async fn run(self, shutdown: CancellationToken) {
        let interval = Duration::from_secs(self.settings.interval_secs);
        let mut wait = Duration::from_secs(5).min(interval);
        tracing::info!(enabled = self.settings.enabled, "retention job started");
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
            wait = interval;
            if !self.settings.enabled {
                continue;
            }
            let started = Instant::now();
            match self.pass(Utc::now(), &shutdown).await {
                Ok(r) => {
                    let other: u64 = r.other.values().sum();
                    if r.total_traces() + other > 0 {
                        // A pass that deleted nothing changed nothing: no entry every few minutes.
                        self.record(Actor::Worker { name: "retention".into() }, &r).await;
                        tracing::info!(
                            traces = r.total_traces(),
                            archived = r.archived,
                            other,
                            secs = started.elapsed().as_secs_f64(),
                            "retention pass deleted expired rows"
                        );
                    }
                }
                Err(e) => {
                    metrics::counter!("combee_retention_errors_total").increment(1);
                    tracing::warn!(error = %e, "retention pass failed; nothing more deleted until the next one");
                }
            }
        }
    }
}

fn count(what: &'static str, n: u64) {
    if n > 0 {
        metrics::counter!("combee_retention_deleted_total", "what" => what).increment(n);
    }
}

fn batch_done(started: Instant) {
    metrics::counter!("combee_retention_batches_total").increment(1);
    metrics::histogram!("combee_retention_batch_seconds").record(started.elapsed().as_secs_f64());
}

/// Consumed traces, appended before deletion to
/// `<dir>/<prompt>/<YYYY-MM-DD>.jsonl.gz` by the UTC day each was created
/// (`<prompt>` as [`crate::domain::PromptName::qualified`] writes it: a
/// `default` prompt's bare name, `<project>/<name>` for another project's):
/// one JSON object per line, as `GET /v1/traces/{id}` answers it, each batch
/// one more gzip member (a multi-member file reads as one stream with `zcat`
/// or Python's `gzip`). Synced to disk before the traces are deleted; a pass
/// that fails after archiving may archive the same traces again (their `id`
/// tells the copies apart).
pub struct Archive {
    dir: PathBuf,
}

impl Archive {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// Appends the traces; how many were written.
    pub async fn append(&self, traces: Vec<Trace>) -> std::io::Result<u64> {
        let dir = self.dir.clone();
        tokio::task::spawn_blocking(move || write_archive(&dir, &traces))
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))?
    }
}

fn write_archive(dir: &Path, traces: &[Trace]) -> std::io::Result<u64> {
    let mut files: BTreeMap<PathBuf, Vec<&Trace>> = BTreeMap::new();
    for t in traces {
        let path = dir.join(&*t.prompt.qualified()).join(format!("{}.jsonl.gz", t.created_at.format("%Y-%m-%d")));
        files.entry(path).or_default().push(t);
    }
    for (path, traces) in &files {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        for t in traces {
            serde_json::to_writer(&mut gz, t)?;
            gz.write_all(b"\n")?;
        }
        let member = gz.finish()?;
        let mut file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        file.write_all(&member)?;
        file.sync_all()?;
    }
    Ok(traces.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{PromptSettings, RetentionOverride};

    fn prompt(retention: RetentionOverride) -> Prompt {
        Prompt {
            id: uuid::Uuid::nil(),
            name: PromptName::new("default", "p").unwrap(),
            project: "default".into(),
            strategy: Default::default(),
            promotion: Default::default(),
            settings: PromptSettings { retention, ..Default::default() },
            created_at: Utc::now(),
            created_by: "t".into(),
        }
    }

    #[test]
    fn a_prompts_own_retention_wins_member_by_member() {
        let now = Utc::now();
        let s = RetentionSettings::default();
        let days = |c: [(TraceExpiry, DateTime<Utc>); 3]| c.map(|(_, at)| (now - at).num_days());
        assert_eq!(days(trace_cutoffs(&s, &prompt(Default::default()), now)), [30, 30, 90]);
        let own = RetentionOverride { consumed_days: Some(365), quarantined_days: Some(2), ..Default::default() };
        assert_eq!(days(trace_cutoffs(&s, &prompt(own), now)), [365, 30, 2]);
    }
}
