//! One [`Store`] implementation for both SQL backends: [`SqlStore`] holds the
//! pools and the change broadcast; each method is either written once here
//! over [`Dialect`](super::sql::Dialect), or handed to the backend's
//! [`Backend`] implementation where its SQL really differs.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use crate::evaluate::outcomes::OutcomeBucket;
use serde_json::Value;
use sqlx::{Pool, Transaction};
use tokio::sync::broadcast;
use uuid::Uuid;

use super::{
    ApiKey, AttemptRecord, Backlog, Change, ClaimedDelivery, ClaimedRound, DeliveryAttempt, IdempotencyKey,
    IdempotentIngest, Label, LabelMove, NewPrompt, NewUiSession, NewWebhook, OpenRound, OtlpMerge, OtlpRemapFn,
    OtlpSpan, PopulationArm, PromptSummary, RequeueFailed, Resolved, RoundCall, RoundFailure, Scope, Selector, Store,
    StoreKind, StoreResult, TaskRewards, TraceAction, TraceCharges, TraceFilter, UiSession, Webhook, scopes_to_string,
    sql::{
        Cols, Dialect, ROUND_COLUMNS, TRACE_COLUMNS, VERSION_COLUMNS, WEBHOOK_COLUMNS, apply_move, arm_from_row,
        corrupt, history_from_row, key_from_row, label_from_row, now, prompt_from_row, prompt_id, record_move,
        round_from_row, sql, trace_from_row, version_from_row, webhook_from_row,
    },
};
use crate::{
    domain::{
        Feedback, LabelHistoryEntry, LabelName, MoveCause, Prompt, PromptName, PromptSettings, Reflection, Trace,
        Version, event::events_to_column, prompt::NewVersion, round::Round, trace::ValidTrace,
    },
    llm::LlmCall,
};

/// A SQL store: `writer` takes every write (SQLite: one connection, so writers
/// queue in-process), `reader` the reads (on Postgres the same pool).
pub struct SqlStore<D: Backend> {
    pub(super) writer: Pool<D>,
    pub(super) reader: Pool<D>,
    pub(super) changes: broadcast::Sender<Change>,
    /// What only this backend keeps (Postgres: its listener; SQLite: the key generation cache).
    pub(super) extra: D::Extra,
}

impl<D: Backend> SqlStore<D> {
    /// Tells this process's cache readers (SQLite; Postgres hears its own NOTIFY instead).
    pub(super) fn announce(&self, change: Change) {
        if D::ANNOUNCE_LOCALLY {
            let _ = self.changes.send(change);
        }
    }

    /// Commits, telling every process's cache about `change` (NOTIFY inside
    /// the transaction on Postgres, the in-process broadcast after it on SQLite).
    pub(super) async fn commit(&self, mut tx: Transaction<'_, D>, change: Change) -> StoreResult<()> {
        let payload = match &change {
            Change::Prompt(name) => format!("prompt:{name}"),
            Change::Keys => "keys".into(),
            Change::RoundQueued => "round".into(),
            Change::OutboxEvent => "outbox".into(),
            Change::Resync => "resync".into(),
        };
        D::notify(&mut tx, &payload).await?;
        tx.commit().await?;
        self.announce(change);
        Ok(())
    }

    pub(super) fn announce_outbox(&self, queued: bool) {
        if queued {
            self.announce(Change::OutboxEvent);
        }
    }
}

/// The store methods whose SQL differs between the backends.
#[async_trait]
pub trait Backend: Dialect {
    const KIND: StoreKind;
    /// True when changes are announced in-process after commit rather than by NOTIFY.
    const ANNOUNCE_LOCALLY: bool;
    type Extra: Send + Sync + 'static;

    async fn ping(s: &SqlStore<Self>) -> StoreResult<()>;
    async fn api_key_generation(s: &SqlStore<Self>) -> StoreResult<i64>;
    async fn create_prompt(s: &SqlStore<Self>, p: NewPrompt, first: NewVersion) -> StoreResult<(Prompt, Version)>;
    async fn update_prompt_settings(
        s: &SqlStore<Self>,
        name: &PromptName,
        expected: &PromptSettings,
        new: &PromptSettings,
    ) -> StoreResult<Option<Prompt>>;
    async fn list_prompts(s: &SqlStore<Self>, after: Option<&str>, limit: u32) -> StoreResult<Vec<PromptSummary>>;
    async fn create_version(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        v: NewVersion,
        moves: &[LabelMove],
    ) -> StoreResult<Version>;
    async fn resolve(s: &SqlStore<Self>, prompt: &PromptName, selector: &Selector) -> StoreResult<Option<Resolved>>;
    async fn delete_label(s: &SqlStore<Self>, prompt: &PromptName, label: &LabelName, by: &str) -> StoreResult<bool>;
    async fn task_rewards(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> StoreResult<Vec<TaskRewards>>;
    async fn save_population(s: &SqlStore<Self>, prompt: &PromptName, arms: &[PopulationArm]) -> StoreResult<()>;
    async fn insert_traces(s: &SqlStore<Self>, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>>;
    async fn list_traces(s: &SqlStore<Self>, f: &TraceFilter, limit: u32) -> StoreResult<Vec<Trace>>;
    async fn add_feedback(s: &SqlStore<Self>, id: Uuid, feedback: Feedback) -> StoreResult<Option<Trace>>;
    async fn version_outcomes(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
        bucket_secs: i64,
    ) -> StoreResult<Vec<OutcomeBucket>>;
    async fn quarantine_trace(s: &SqlStore<Self>, id: Uuid, reason: &str) -> StoreResult<TraceAction>;
    async fn quarantine_traces(s: &SqlStore<Self>, f: &TraceFilter, reason: &str) -> StoreResult<u64>;
    async fn release_trace(s: &SqlStore<Self>, id: Uuid) -> StoreResult<TraceAction>;
    async fn delete_trace(s: &SqlStore<Self>, id: Uuid) -> StoreResult<TraceAction>;
    async fn merge_otlp_spans(
        s: &SqlStore<Self>,
        otel_trace_id: &str,
        spans: &[OtlpSpan],
        remap: &OtlpRemapFn<'_>,
    ) -> StoreResult<OtlpMerge>;
    async fn purge_held_otlp_spans(s: &SqlStore<Self>, older_than: DateTime<Utc>) -> StoreResult<u64>;
    async fn requeue_failed_traces(s: &SqlStore<Self>, req: &RequeueFailed) -> StoreResult<Vec<Uuid>>;
    async fn insert_traces_idempotent(
        s: &SqlStore<Self>,
        key: IdempotencyKey<'_>,
        traces: &[ValidTrace],
        status: u16,
        answer: &(dyn for<'i> Fn(&'i [Uuid]) -> Vec<u8> + Send + Sync),
    ) -> StoreResult<IdempotentIngest>;
    async fn idempotency_purge(s: &SqlStore<Self>, older_than: DateTime<Utc>) -> StoreResult<u64>;
    async fn open_round(s: &SqlStore<Self>, req: &OpenRound) -> StoreResult<Option<Round>>;
    async fn backlogs(s: &SqlStore<Self>) -> StoreResult<Vec<Backlog>>;
    async fn claim_round(s: &SqlStore<Self>, owner: &str, lease: Duration) -> StoreResult<Option<ClaimedRound>>;
    async fn heartbeat_round(s: &SqlStore<Self>, round: Uuid, attempt: i32, lease: Duration) -> StoreResult<bool>;
    async fn adopt_reflections(s: &SqlStore<Self>, round: Uuid) -> StoreResult<u64>;
    async fn save_reflection(
        s: &SqlStore<Self>,
        round: Uuid,
        trace: Uuid,
        r: &Reflection,
        from_trace: bool,
    ) -> StoreResult<()>;
    async fn record_llm_call(s: &SqlStore<Self>, round: Uuid, attempt: i32, call: &LlmCall) -> StoreResult<()>;
    async fn round_calls(s: &SqlStore<Self>, round: Uuid) -> StoreResult<Vec<RoundCall>>;
    async fn update_round(
        s: &SqlStore<Self>,
        round: Uuid,
        attempt: i32,
        k: Option<i32>,
        detail: &Value,
    ) -> StoreResult<bool>;
    // One fenced transaction needs all of these; a wrapper struct would only rename them.
    #[allow(clippy::too_many_arguments)]
    async fn publish_round(
        s: &SqlStore<Self>,
        round: Uuid,
        attempt: i32,
        v: NewVersion,
        label: LabelName,
        detail: &Value,
        sample_secs: Option<f64>,
        charges: &TraceCharges,
    ) -> StoreResult<Version>;
    async fn fail_round(
        s: &SqlStore<Self>,
        round: Uuid,
        attempt: i32,
        error: &str,
        how: RoundFailure,
    ) -> StoreResult<()>;
    async fn webhook_attempts(
        s: &SqlStore<Self>,
        id: Uuid,
        before: Option<i64>,
        limit: u32,
    ) -> StoreResult<Vec<DeliveryAttempt>>;
    async fn claim_deliveries(
        s: &SqlStore<Self>,
        owner: &str,
        lease: Duration,
        limit: u32,
    ) -> StoreResult<Vec<ClaimedDelivery>>;
    async fn finish_delivery(s: &SqlStore<Self>, d: &ClaimedDelivery, rec: &AttemptRecord) -> StoreResult<bool>;
    async fn controller_samples(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        limit: u32,
    ) -> StoreResult<Vec<super::ControllerSample>>;
    async fn save_controller_choice(s: &SqlStore<Self>, prompt: &PromptName, choice: &Value) -> StoreResult<()>;
    async fn record_meter_counts(
        s: &SqlStore<Self>,
        prompt: &PromptName,
        round: Uuid,
        counts: &[super::MeterCounts],
    ) -> StoreResult<()>;
    async fn meter_counts(s: &SqlStore<Self>, prompt: &PromptName) -> StoreResult<Vec<super::MeterCounts>>;
}

#[async_trait]
impl<D: Backend> Store for SqlStore<D> {
    fn kind(&self) -> StoreKind {
        D::KIND
    }

    fn changes(&self) -> broadcast::Receiver<Change> {
        self.changes.subscribe()
    }

    async fn ping(&self) -> StoreResult<()> {
        D::ping(self).await
    }

    async fn create_api_key(&self, name: &str, prefix: &str, hash: &str, scopes: &[Scope]) -> StoreResult<ApiKey> {
        let mut tx = self.writer.begin().await?;
        let row = sql::<D>(
            "INSERT INTO api_keys (id, name, prefix, hash, scopes, created_at) VALUES ($1, $2, $3, $4, $5, $6)
             RETURNING id, name, prefix, hash, scopes, created_at, revoked_at",
        )
        .bind(Uuid::now_v7())
        .bind(name)
        .bind(prefix)
        .bind(hash)
        .bind(scopes_to_string(scopes))
        .bind(now())
        .fetch_one(&mut *tx)
        .await?;
        self.commit(tx, Change::Keys).await?;
        key_from_row::<D>(&row)
    }

    async fn api_key_by_hash(&self, hash: &str) -> StoreResult<Option<ApiKey>> {
        sql::<D>("SELECT id, name, prefix, hash, scopes, created_at, revoked_at FROM api_keys WHERE hash = $1")
            .bind(hash)
            .fetch_optional(&mut *self.reader.acquire().await?)
            .await?
            .as_ref()
            .map(key_from_row::<D>)
            .transpose()
    }

    async fn list_api_keys(&self) -> StoreResult<Vec<ApiKey>> {
        sql::<D>("SELECT id, name, prefix, hash, scopes, created_at, revoked_at FROM api_keys ORDER BY created_at")
            .map(&mut *self.reader.acquire().await?, key_from_row::<D>)
            .await
    }

    async fn revoke_api_key(&self, id_or_prefix: &str) -> StoreResult<bool> {
        let mut tx = self.writer.begin().await?;
        let n = sql::<D>("UPDATE api_keys SET revoked_at = $3 WHERE revoked_at IS NULL AND (id = $1 OR prefix = $2)")
            .bind(Uuid::parse_str(id_or_prefix).ok())
            .bind(id_or_prefix)
            .bind(now())
            .execute(&mut *tx)
            .await?;
        self.commit(tx, Change::Keys).await?;
        Ok(n > 0)
    }

    async fn api_key_generation(&self) -> StoreResult<i64> {
        D::api_key_generation(self).await
    }

    async fn count_active_api_keys(&self) -> StoreResult<i64> {
        let n = sql::<D>("SELECT count(*) AS n FROM api_keys WHERE revoked_at IS NULL")
            .value(&mut *self.reader.acquire().await?, "n")
            .await?;
        Ok(n.unwrap_or(0))
    }

    async fn create_ui_session(&self, session: &NewUiSession) -> StoreResult<()> {
        let mut tx = self.writer.begin().await?;
        sql::<D>("DELETE FROM ui_sessions WHERE expires_at <= $1").bind(now()).execute(&mut *tx).await?;
        sql::<D>(
            "INSERT INTO ui_sessions (token_hash, key_id, csrf_token, created_at, expires_at) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(&session.token_hash)
        .bind(session.key_id)
        .bind(&session.csrf_token)
        .bind(now())
        .bind(session.expires_at)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn ui_session(&self, token_hash: &str) -> StoreResult<Option<(UiSession, ApiKey)>> {
        let row = sql::<D>(
            "SELECT s.key_id, s.csrf_token, s.created_at AS session_created_at, s.expires_at,
                    k.id, k.name, k.prefix, k.hash, k.scopes, k.created_at, k.revoked_at
             FROM ui_sessions s JOIN api_keys k ON k.id = s.key_id
             WHERE s.token_hash = $1 AND s.expires_at > $2",
        )
        .bind(token_hash)
        .bind(now())
        .fetch_optional(&mut *self.reader.acquire().await?)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let r = Cols::<D>(&row);
        let session = UiSession {
            key_id: r.get("key_id")?,
            csrf_token: r.get("csrf_token")?,
            created_at: r.get("session_created_at")?,
            expires_at: r.get("expires_at")?,
        };
        Ok(Some((session, key_from_row::<D>(&row)?)))
    }

    async fn delete_ui_session(&self, token_hash: &str) -> StoreResult<bool> {
        let n = sql::<D>("DELETE FROM ui_sessions WHERE token_hash = $1")
            .bind(token_hash)
            .execute(&mut *self.writer.acquire().await?)
            .await?;
        Ok(n > 0)
    }

    async fn create_prompt(&self, p: NewPrompt, first: NewVersion) -> StoreResult<(Prompt, Version)> {
        D::create_prompt(self, p, first).await
    }

    async fn get_prompt(&self, name: &PromptName) -> StoreResult<Option<Prompt>> {
        sql::<D>("SELECT id, name, strategy, promotion, settings, created_at, created_by FROM prompts WHERE name = $1")
            .bind(name.as_str())
            .fetch_optional(&mut *self.reader.acquire().await?)
            .await?
            .as_ref()
            .map(prompt_from_row::<D>)
            .transpose()
    }

    async fn update_prompt_settings(
        &self,
        name: &PromptName,
        expected: &PromptSettings,
        new: &PromptSettings,
    ) -> StoreResult<Option<Prompt>> {
        D::update_prompt_settings(self, name, expected, new).await
    }

    async fn list_prompts(&self, after: Option<&str>, limit: u32) -> StoreResult<Vec<PromptSummary>> {
        D::list_prompts(self, after, limit).await
    }

    async fn create_version(&self, prompt: &PromptName, v: NewVersion, moves: &[LabelMove]) -> StoreResult<Version> {
        D::create_version(self, prompt, v, moves).await
    }

    async fn resolve(&self, prompt: &PromptName, selector: &Selector) -> StoreResult<Option<Resolved>> {
        D::resolve(self, prompt, selector).await
    }

    async fn list_versions(&self, prompt: &PromptName, before: Option<i64>, limit: u32) -> StoreResult<Vec<Version>> {
        sql::<D>(&format!(
            "SELECT {VERSION_COLUMNS} FROM versions v JOIN prompts p ON p.id = v.prompt_id
             WHERE p.name = $1 AND ($2 IS NULL OR v.number < $2) ORDER BY v.number DESC LIMIT $3"
        ))
        .bind(prompt.as_str())
        .bind(before)
        .bind(i64::from(limit))
        .map(&mut *self.reader.acquire().await?, version_from_row::<D>)
        .await
    }

    async fn list_labels(&self, prompt: &PromptName) -> StoreResult<Vec<Label>> {
        sql::<D>(
            "SELECT l.name, l.version, l.updated_at, l.updated_by FROM labels l JOIN prompts p ON p.id = l.prompt_id
             WHERE p.name = $1 ORDER BY l.name",
        )
        .bind(prompt.as_str())
        .map(&mut *self.reader.acquire().await?, label_from_row::<D>)
        .await
    }

    async fn move_label_because(&self, prompt: &PromptName, mv: &LabelMove, cause: &MoveCause) -> StoreResult<Label> {
        let mut tx = self.writer.begin().await?;
        let id = prompt_id::<D>(&mut tx, prompt).await?;
        let (label, previous) = apply_move::<D>(&mut tx, id, mv).await?;
        let queued = record_move::<D>(&mut tx, id, prompt, &label, previous, cause).await?;
        self.commit(tx, Change::Prompt(prompt.to_string())).await?;
        self.announce_outbox(queued);
        Ok(label)
    }

    async fn delete_label(&self, prompt: &PromptName, label: &LabelName, by: &str) -> StoreResult<bool> {
        D::delete_label(self, prompt, label, by).await
    }

    async fn task_rewards(
        &self,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> StoreResult<Vec<TaskRewards>> {
        D::task_rewards(self, prompt, from, until).await
    }

    async fn population(&self, prompt: &PromptName) -> StoreResult<Vec<PopulationArm>> {
        sql::<D>(
            "SELECT a.version, a.state, a.mu, a.sigma, a.weight, a.scored_traces, a.created_from, a.rated_until
             FROM population_arms a JOIN prompts p ON p.id = a.prompt_id
             WHERE p.name = $1 ORDER BY a.version",
        )
        .bind(prompt.as_str())
        .map(&mut *self.reader.acquire().await?, arm_from_row::<D>)
        .await
    }

    async fn save_population(&self, prompt: &PromptName, arms: &[PopulationArm]) -> StoreResult<()> {
        D::save_population(self, prompt, arms).await
    }

    async fn label_history(
        &self,
        prompt: &PromptName,
        label: Option<&LabelName>,
        before: Option<i64>,
        limit: u32,
    ) -> StoreResult<Vec<LabelHistoryEntry>> {
        sql::<D>(
            "SELECT m.id, m.label, m.from_version, m.to_version, m.kind, m.actor, m.reason, m.evidence, m.at
             FROM label_moves m JOIN prompts p ON p.id = m.prompt_id
             WHERE p.name = $1 AND ($2 IS NULL OR m.label = $2) AND ($3 IS NULL OR m.id < $3)
             ORDER BY m.id DESC LIMIT $4",
        )
        .bind(prompt.as_str())
        .bind(label.map(LabelName::as_str))
        .bind(before)
        .bind(i64::from(limit))
        .map(&mut *self.reader.acquire().await?, history_from_row::<D>)
        .await
    }

    async fn insert_traces(&self, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>> {
        D::insert_traces(self, traces).await
    }

    async fn get_trace(&self, id: Uuid) -> StoreResult<Option<Trace>> {
        sql::<D>(&format!("SELECT {TRACE_COLUMNS} FROM traces t JOIN prompts p ON p.id = t.prompt_id WHERE t.id = $1"))
            .bind(id)
            .fetch_optional(&mut *self.reader.acquire().await?)
            .await?
            .as_ref()
            .map(trace_from_row::<D>)
            .transpose()
    }

    async fn list_traces(&self, f: &TraceFilter, limit: u32) -> StoreResult<Vec<Trace>> {
        D::list_traces(self, f, limit).await
    }

    async fn add_feedback(&self, id: Uuid, feedback: Feedback) -> StoreResult<Option<Trace>> {
        D::add_feedback(self, id, feedback).await
    }

    async fn version_outcomes(
        &self,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
        bucket_secs: i64,
    ) -> StoreResult<Vec<OutcomeBucket>> {
        D::version_outcomes(self, prompt, from, until, bucket_secs).await
    }

    async fn quarantine_trace(&self, id: Uuid, reason: &str) -> StoreResult<TraceAction> {
        D::quarantine_trace(self, id, reason).await
    }

    async fn quarantine_traces(&self, f: &TraceFilter, reason: &str) -> StoreResult<u64> {
        D::quarantine_traces(self, f, reason).await
    }

    async fn release_trace(&self, id: Uuid) -> StoreResult<TraceAction> {
        D::release_trace(self, id).await
    }

    async fn delete_trace(&self, id: Uuid) -> StoreResult<TraceAction> {
        D::delete_trace(self, id).await
    }

    async fn merge_otlp_spans(
        &self,
        otel_trace_id: &str,
        spans: &[OtlpSpan],
        remap: &OtlpRemapFn<'_>,
    ) -> StoreResult<OtlpMerge> {
        D::merge_otlp_spans(self, otel_trace_id, spans, remap).await
    }

    async fn purge_held_otlp_spans(&self, older_than: DateTime<Utc>) -> StoreResult<u64> {
        D::purge_held_otlp_spans(self, older_than).await
    }

    async fn requeue_failed_traces(&self, req: &RequeueFailed) -> StoreResult<Vec<Uuid>> {
        D::requeue_failed_traces(self, req).await
    }

    async fn insert_traces_idempotent(
        &self,
        key: IdempotencyKey<'_>,
        traces: &[ValidTrace],
        status: u16,
        answer: &(dyn for<'i> Fn(&'i [Uuid]) -> Vec<u8> + Send + Sync),
    ) -> StoreResult<IdempotentIngest> {
        D::insert_traces_idempotent(self, key, traces, status, answer).await
    }

    async fn idempotency_purge(&self, older_than: DateTime<Utc>) -> StoreResult<u64> {
        D::idempotency_purge(self, older_than).await
    }

    async fn open_round(&self, req: &OpenRound) -> StoreResult<Option<Round>> {
        D::open_round(self, req).await
    }

    async fn backlogs(&self) -> StoreResult<Vec<Backlog>> {
        D::backlogs(self).await
    }

    async fn claim_round(&self, owner: &str, lease: Duration) -> StoreResult<Option<ClaimedRound>> {
        D::claim_round(self, owner, lease).await
    }

    async fn heartbeat_round(&self, round: Uuid, attempt: i32, lease: Duration) -> StoreResult<bool> {
        D::heartbeat_round(self, round, attempt, lease).await
    }

    async fn adopt_reflections(&self, round: Uuid) -> StoreResult<u64> {
        D::adopt_reflections(self, round).await
    }

    async fn save_reflection(&self, round: Uuid, trace: Uuid, r: &Reflection, from_trace: bool) -> StoreResult<()> {
        D::save_reflection(self, round, trace, r, from_trace).await
    }

    async fn round_reflections(&self, round: Uuid) -> StoreResult<Vec<(Uuid, Reflection, bool)>> {
        sql::<D>("SELECT trace_id, reflection, from_trace FROM reflections WHERE round_id = $1 ORDER BY created_at, trace_id")
            .bind(round)
            .map(&mut *self.reader.acquire().await?, |row| {
                let r = Cols::<D>(row);
                let reflection = serde_json::from_value(r.get("reflection")?).map_err(|_| corrupt("reflection"))?;
                Ok((r.get("trace_id")?, reflection, r.get("from_trace")?))
            })
            .await
    }

    async fn record_llm_call(&self, round: Uuid, attempt: i32, call: &LlmCall) -> StoreResult<()> {
        D::record_llm_call(self, round, attempt, call).await
    }

    async fn round_calls(&self, round: Uuid) -> StoreResult<Vec<RoundCall>> {
        D::round_calls(self, round).await
    }

    async fn update_round(&self, round: Uuid, attempt: i32, k: Option<i32>, detail: &Value) -> StoreResult<bool> {
        D::update_round(self, round, attempt, k, detail).await
    }

    // One fenced transaction needs all of these; a wrapper struct would only rename them.
    #[allow(clippy::too_many_arguments)]
    async fn publish_round(
        &self,
        round: Uuid,
        attempt: i32,
        v: NewVersion,
        label: LabelName,
        detail: &Value,
        sample_secs: Option<f64>,
        charges: &TraceCharges,
    ) -> StoreResult<Version> {
        D::publish_round(self, round, attempt, v, label, detail, sample_secs, charges).await
    }

    async fn fail_round(&self, round: Uuid, attempt: i32, error: &str, how: RoundFailure) -> StoreResult<()> {
        D::fail_round(self, round, attempt, error, how).await
    }

    async fn get_round(&self, id: Uuid) -> StoreResult<Option<Round>> {
        sql::<D>(&format!("SELECT {ROUND_COLUMNS} FROM rounds r JOIN prompts p ON p.id = r.prompt_id WHERE r.id = $1"))
            .bind(id)
            .fetch_optional(&mut *self.reader.acquire().await?)
            .await?
            .as_ref()
            .map(round_from_row::<D>)
            .transpose()
    }

    async fn list_rounds(
        &self,
        prompt: Option<&PromptName>,
        before: Option<Uuid>,
        limit: u32,
    ) -> StoreResult<Vec<Round>> {
        sql::<D>(&format!(
            "SELECT {ROUND_COLUMNS} FROM rounds r JOIN prompts p ON p.id = r.prompt_id
             WHERE ($1 IS NULL OR p.name = $1) AND ($2 IS NULL OR r.id < $2) ORDER BY r.id DESC LIMIT $3"
        ))
        .bind(prompt.map(|p| p.as_str()))
        .bind(before)
        .bind(i64::from(limit))
        .map(&mut *self.reader.acquire().await?, round_from_row::<D>)
        .await
    }

    async fn round_trace_ids(&self, round: Uuid) -> StoreResult<Vec<Uuid>> {
        sql::<D>("SELECT trace_id FROM round_traces WHERE round_id = $1 ORDER BY position")
            .bind(round)
            .map(&mut *self.reader.acquire().await?, |row| Cols::<D>(row).get("trace_id"))
            .await
    }

    async fn create_webhook(&self, h: &NewWebhook) -> StoreResult<Webhook> {
        let row = sql::<D>(&format!(
            "INSERT INTO webhook_subscriptions (id, url, events, description, secret, created_at, updated_at)
             VALUES ($1, $2, $3, $4, $5, $6, $6) RETURNING {WEBHOOK_COLUMNS}"
        ))
        .bind(Uuid::now_v7())
        .bind(&h.url)
        .bind(events_to_column(&h.events))
        .bind(h.description.as_deref())
        .bind(h.secret.expose())
        .bind(now())
        .fetch_one(&mut *self.writer.acquire().await?)
        .await?;
        webhook_from_row::<D>(&row)
    }

    async fn list_webhooks(&self) -> StoreResult<Vec<Webhook>> {
        sql::<D>(&format!("SELECT {WEBHOOK_COLUMNS} FROM webhook_subscriptions ORDER BY id"))
            .map(&mut *self.reader.acquire().await?, webhook_from_row::<D>)
            .await
    }

    async fn get_webhook(&self, id: Uuid) -> StoreResult<Option<Webhook>> {
        sql::<D>(&format!("SELECT {WEBHOOK_COLUMNS} FROM webhook_subscriptions WHERE id = $1"))
            .bind(id)
            .fetch_optional(&mut *self.reader.acquire().await?)
            .await?
            .as_ref()
            .map(webhook_from_row::<D>)
            .transpose()
    }

    async fn delete_webhook(&self, id: Uuid) -> StoreResult<bool> {
        let n = sql::<D>("DELETE FROM webhook_subscriptions WHERE id = $1")
            .bind(id)
            .execute(&mut *self.writer.acquire().await?)
            .await?;
        Ok(n > 0)
    }

    async fn webhook_attempts(&self, id: Uuid, before: Option<i64>, limit: u32) -> StoreResult<Vec<DeliveryAttempt>> {
        D::webhook_attempts(self, id, before, limit).await
    }

    async fn claim_deliveries(&self, owner: &str, lease: Duration, limit: u32) -> StoreResult<Vec<ClaimedDelivery>> {
        D::claim_deliveries(self, owner, lease, limit).await
    }

    async fn finish_delivery(&self, d: &ClaimedDelivery, rec: &AttemptRecord) -> StoreResult<bool> {
        D::finish_delivery(self, d, rec).await
    }

    async fn controller_samples(&self, prompt: &PromptName, limit: u32) -> StoreResult<Vec<super::ControllerSample>> {
        D::controller_samples(self, prompt, limit).await
    }

    async fn save_controller_choice(&self, prompt: &PromptName, choice: &Value) -> StoreResult<()> {
        D::save_controller_choice(self, prompt, choice).await
    }

    async fn controller_choice(&self, prompt: &PromptName) -> StoreResult<Option<(Value, DateTime<Utc>)>> {
        let row = sql::<D>(
            "SELECT c.choice, c.updated_at FROM controller_choices c JOIN prompts p ON p.id = c.prompt_id WHERE p.name = $1",
        )
        .bind(prompt.as_str())
        .fetch_optional(&mut *self.reader.acquire().await?)
        .await?;
        row.map(|row| {
            let r = Cols::<D>(&row);
            Ok((r.get("choice")?, r.get("updated_at")?))
        })
        .transpose()
    }

    async fn record_meter_counts(
        &self,
        prompt: &PromptName,
        round: Uuid,
        counts: &[super::MeterCounts],
    ) -> StoreResult<()> {
        D::record_meter_counts(self, prompt, round, counts).await
    }

    async fn meter_counts(&self, prompt: &PromptName) -> StoreResult<Vec<super::MeterCounts>> {
        D::meter_counts(self, prompt).await
    }
}
