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
    ApiKey, AttemptRecord, Backlog, Change, ClaimedDelivery, ClaimedRound, DeliveryAttempt, DeliveryOutcome,
    IdempotencyKey, IdempotentIngest, Label, LabelMove, NewPrompt, NewUiSession, NewWebhook, OpenRound, OtlpMerge,
    OtlpRemap, OtlpRemapFn, OtlpSpan, PopulationArm, PromptSummary, RequeueFailed, Resolved, RoundCall, RoundFailure,
    Scope, Selector, Store, StoreError, StoreKind, StoreResult, TaskRewards, TraceAction, TraceCharges, TraceFilter,
    UiSession, Webhook, prompt_reference_problem,
    rollups::{self, Counted, Sign},
    scopes_to_string,
    sql::{
        Cols, Dialect, Param, ROUND_COLUMNS, TRACE_COLUMNS, VERSION_COLUMNS, WEBHOOK_COLUMNS, apply_move, arm_from_row,
        charge_traces, corrupt, enum_str, fence, history_from_row, insert_otlp_spans, insert_version, json,
        key_from_row, label_from_row, later, lock_for_action, now, opt_json, prompt_from_row, prompt_id, record_event,
        record_history, record_move, release_traces, require_version, round_from_row, sql, trace_from_row,
        version_from_row, webhook_from_row,
    },
    version_move_kind,
};
use crate::{
    domain::{
        Feedback, LabelHistoryEntry, LabelMoveKind, LabelName, MoveCause, Prompt, PromptName, PromptSettings,
        Reflection, Trace, Version,
        event::{OutboxEvent, events_to_column},
        prompt::NewVersion,
        round::{self, Round},
        trace::ValidTrace,
    },
    llm::LlmCall,
    secret::Secret,
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

    async fn api_key_generation(s: &SqlStore<Self>) -> StoreResult<i64>;
    async fn insert_traces(s: &SqlStore<Self>, traces: &[ValidTrace]) -> StoreResult<Vec<Uuid>>;
    async fn insert_traces_idempotent(
        s: &SqlStore<Self>,
        key: IdempotencyKey<'_>,
        traces: &[ValidTrace],
        status: u16,
        answer: &(dyn for<'i> Fn(&'i [Uuid]) -> Vec<u8> + Send + Sync),
    ) -> StoreResult<IdempotentIngest>;
    /// Takes the lease of the oldest claimable round (see [`Store::claim_round`]); its id.
    async fn claim_round_id(s: &SqlStore<Self>, owner: &str, lease: Duration) -> StoreResult<Option<Uuid>>;
    async fn heartbeat_round(s: &SqlStore<Self>, round: Uuid, attempt: i32, lease: Duration) -> StoreResult<bool>;
    /// Leases up to `limit` due deliveries to `owner`: the ids claimed.
    async fn claim_delivery_ids(s: &SqlStore<Self>, owner: &str, lease: Duration, limit: u32)
    -> StoreResult<Vec<Uuid>>;
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
        sql::<D>("SELECT 1 AS one").execute(&mut *self.reader.acquire().await?).await?;
        Ok(())
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
        let id = Uuid::now_v7();
        let created_at = now();
        let mut tx = self.writer.begin().await?;
        let settings = serde_json::to_value(&p.settings).map_err(|_| corrupt("settings"))?;
        sql::<D>(
            "INSERT INTO prompts (id, name, strategy, promotion, settings, version_count, created_at, created_by)
             VALUES ($1, $2, $3, $4, $5, 1, $6, $7)",
        )
        .bind(id)
        .bind(p.name.as_str())
        .bind(enum_str(p.strategy))
        .bind(enum_str(p.promotion))
        .bind(json(&settings))
        .bind(created_at)
        .bind(&p.created_by)
        .execute(&mut *tx)
        .await?;
        insert_version::<D>(&mut tx, id, 1, &first, created_at).await?;
        sql::<D>("INSERT INTO labels (prompt_id, name, version, updated_at, updated_by) VALUES ($1, $2, 1, $3, $4)")
            .bind(id)
            .bind(LabelName::PRODUCTION)
            .bind(created_at)
            .bind(&first.created_by)
            .execute(&mut *tx)
            .await?;
        let prompt = Prompt {
            id,
            name: p.name.clone(),
            strategy: p.strategy,
            promotion: p.promotion,
            settings: p.settings,
            created_at,
            created_by: p.created_by,
        };
        let version = first.into_version(p.name, 1, created_at);
        let production = LabelName::parse(LabelName::PRODUCTION).map_err(|_| corrupt("label name"))?;
        let mut queued =
            record_event::<D>(&mut tx, &OutboxEvent::version_created(&version, &[LabelName::PRODUCTION])).await?;
        let moved = OutboxEvent::label_moved(&prompt.name, &production, 1, None, &version.created_by);
        queued |= record_event::<D>(&mut tx, &moved).await?;
        let cause = MoveCause::new(LabelMoveKind::Create, "prompt created");
        record_history::<D>(&mut tx, id, &production, None, Some(1), &version.created_by, &cause).await?;
        self.commit(tx, Change::Prompt(prompt.name.to_string())).await?;
        self.announce_outbox(queued);
        Ok((prompt, version))
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
        let mut tx = self.writer.begin().await?;
        let current: Option<Value> =
            sql::<D>(&format!("SELECT settings FROM prompts WHERE name = $1{}", D::lock(" FOR UPDATE")))
                .bind(name.as_str())
                .value(&mut tx, "settings")
                .await?;
        let Some(current) = current else { return Ok(None) };
        let current: PromptSettings = serde_json::from_value(current).map_err(|_| corrupt("settings"))?;
        if &current != expected {
            return Err(StoreError::Conflict);
        }
        let new = serde_json::to_value(new).map_err(|_| corrupt("settings"))?;
        let row = sql::<D>(
            "UPDATE prompts SET settings = $1 WHERE name = $2
             RETURNING id, name, strategy, promotion, settings, created_at, created_by",
        )
        .bind(json(&new))
        .bind(name.as_str())
        .fetch_one(&mut tx)
        .await?;
        tx.commit().await?;
        prompt_from_row::<D>(&row).map(Some)
    }

    async fn list_prompts(&self, after: Option<&str>, limit: u32) -> StoreResult<Vec<PromptSummary>> {
        sql::<D>(
            "SELECT p.id, p.name, p.strategy, p.promotion, p.settings, p.created_at, p.created_by, p.version_count,
                    (SELECT version FROM labels l WHERE l.prompt_id = p.id AND l.name = 'production') AS production_version,
                    (SELECT count(*) FROM traces t WHERE t.prompt_id = p.id AND t.status = 'pending' AND t.quarantined_at IS NULL) AS pending
             FROM prompts p WHERE ($1 IS NULL OR p.name > $1) ORDER BY p.name LIMIT $2",
        )
        .bind(after)
        .bind(i64::from(limit))
        .map(&mut *self.reader.acquire().await?, |row| {
            let r = Cols::<D>(row);
            Ok(PromptSummary {
                prompt: prompt_from_row::<D>(row)?,
                production_version: r.get("production_version")?,
                latest_version: r.get("version_count")?,
                pending_traces: r.get("pending")?,
            })
        })
        .await
    }

    async fn create_version(&self, prompt: &PromptName, v: NewVersion, moves: &[LabelMove]) -> StoreResult<Version> {
        let created_at = now();
        let mut tx = self.writer.begin().await?;
        let row = sql::<D>(
            "UPDATE prompts SET version_count = version_count + 1 WHERE name = $1 RETURNING id, version_count",
        )
        .bind(prompt.as_str())
        .fetch_one(&mut tx)
        .await?;
        let (id, number): (Uuid, i64) = (Cols::<D>(&row).get("id")?, Cols::<D>(&row).get("version_count")?);
        if v.parent.is_some_and(|p| p < 1 || p >= number) {
            return Err(StoreError::Invalid("parent version does not exist".into()));
        }
        insert_version::<D>(&mut tx, id, number, &v, created_at).await?;
        let mut moved = Vec::with_capacity(moves.len());
        for mv in moves {
            let mv = LabelMove { to_version: if mv.to_version == 0 { number } else { mv.to_version }, ..mv.clone() };
            moved.push(apply_move::<D>(&mut tx, id, &mv).await?);
        }
        let version = v.into_version(prompt.clone(), number, created_at);
        let on_new: Vec<&str> =
            moved.iter().filter(|(l, _)| l.version == number).map(|(l, _)| l.name.as_str()).collect();
        let mut queued = record_event::<D>(&mut tx, &OutboxEvent::version_created(&version, &on_new)).await?;
        let cause = MoveCause::new(version_move_kind(version.source), version.message.clone());
        for (label, previous) in &moved {
            queued |= record_move::<D>(&mut tx, id, prompt, label, *previous, &cause).await?;
        }
        self.commit(tx, Change::Prompt(prompt.to_string())).await?;
        self.announce_outbox(queued);
        Ok(version)
    }

    async fn resolve(&self, prompt: &PromptName, selector: &Selector) -> StoreResult<Option<Resolved>> {
        let labels = format!(
            "(SELECT {} FROM labels l2 WHERE l2.prompt_id = v.prompt_id AND l2.version = v.number) AS labels",
            D::string_agg("l2.name")
        );
        let from = match selector {
            Selector::Label(_) => {
                "labels l JOIN prompts p ON p.id = l.prompt_id
                 JOIN versions v ON v.prompt_id = l.prompt_id AND v.number = l.version WHERE p.name = $1 AND l.name = $2"
            }
            Selector::Latest => {
                "prompts p JOIN versions v ON v.prompt_id = p.id AND v.number = p.version_count WHERE p.name = $1"
            }
            Selector::Version(_) => "prompts p JOIN versions v ON v.prompt_id = p.id AND v.number = $2 WHERE p.name = $1",
        };
        let text = format!("SELECT {VERSION_COLUMNS}, {labels} FROM {from}");
        let query = sql::<D>(&text).bind(prompt.as_str());
        let query = match selector {
            Selector::Label(label) => query.bind(label.as_str()),
            Selector::Latest => query,
            Selector::Version(n) => query.bind(*n),
        };
        let Some(row) = query.fetch_optional(&mut *self.reader.acquire().await?).await? else { return Ok(None) };
        let labels: Option<String> = Cols::<D>(&row).get("labels")?;
        let mut labels = labels
            .unwrap_or_default()
            .split(',')
            .filter(|l| !l.is_empty())
            .map(|l| LabelName::parse(l).map_err(|_| corrupt("label name")))
            .collect::<StoreResult<Vec<_>>>()?;
        labels.sort();
        Ok(Some(Resolved { version: version_from_row::<D>(&row)?, labels }))
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
        let mut tx = self.writer.begin().await?;
        let id = prompt_id::<D>(&mut tx, prompt).await?;
        let deleted: Option<i64> = sql::<D>("DELETE FROM labels WHERE prompt_id = $1 AND name = $2 RETURNING version")
            .bind(id)
            .bind(label.as_str())
            .value(&mut tx, "version")
            .await?;
        if let Some(version) = deleted {
            let cause = MoveCause::new(LabelMoveKind::Delete, "label deleted");
            record_history::<D>(&mut tx, id, label, Some(version), None, by, &cause).await?;
        }
        self.commit(tx, Change::Prompt(prompt.to_string())).await?;
        Ok(deleted.is_some())
    }

    async fn task_rewards(
        &self,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> StoreResult<Vec<TaskRewards>> {
        rollups::read_task_rewards(self, prompt, from, until).await
    }

    async fn population(&self, prompt: &PromptName) -> StoreResult<Vec<PopulationArm>> {
        sql::<D>(
            "SELECT a.version, a.state, a.mu, a.sigma, a.weight, a.scored_traces, a.created_from, a.parents,
                    a.rated_until
             FROM population_arms a JOIN prompts p ON p.id = a.prompt_id
             WHERE p.name = $1 ORDER BY a.version",
        )
        .bind(prompt.as_str())
        .map(&mut *self.reader.acquire().await?, arm_from_row::<D>)
        .await
    }

    async fn save_population(&self, prompt: &PromptName, arms: &[PopulationArm]) -> StoreResult<()> {
        let mut tx = self.writer.begin().await?;
        let id = prompt_id::<D>(&mut tx, prompt).await?;
        for arm in arms {
            require_version::<D>(&mut tx, id, arm.version).await?;
            sql::<D>(
                "INSERT INTO population_arms (prompt_id, version, state, mu, sigma, weight, scored_traces, created_from,
                                              rated_until, created_at, updated_at, parents)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $10, $11)
                 ON CONFLICT (prompt_id, version) DO UPDATE SET
                    state = excluded.state, mu = excluded.mu, sigma = excluded.sigma, weight = excluded.weight,
                    scored_traces = excluded.scored_traces, created_from = excluded.created_from,
                    rated_until = excluded.rated_until, updated_at = excluded.updated_at, parents = excluded.parents",
            )
            .bind(id)
            .bind(arm.version)
            .bind(arm.state.as_str())
            .bind(arm.rating.mu)
            .bind(arm.rating.sigma)
            .bind(arm.weight)
            .bind(arm.scored_traces as i64)
            .bind(arm.created_from)
            .bind(arm.rated_until)
            .bind(now())
            .bind(json(&serde_json::to_value(&arm.parents).map_err(|_| corrupt("arm parents"))?))
            .execute(&mut tx)
            .await?;
        }
        self.commit(tx, Change::Prompt(prompt.to_string())).await?;
        Ok(())
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
        sql::<D>(&format!(
            "SELECT {TRACE_COLUMNS} FROM traces t JOIN prompts p ON p.id = t.prompt_id
             WHERE ($1 IS NULL OR p.name = $1)
               AND ($2 IS NULL OR CASE WHEN $2 = 'quarantined' THEN t.quarantined_at IS NOT NULL
                                       ELSE t.status = $2 AND t.quarantined_at IS NULL END)
               AND ($3 IS NULL OR t.created_at >= $3) AND ($4 IS NULL OR t.created_at < $4)
               AND ($5 IS NULL OR t.id < $5)
             ORDER BY t.id DESC LIMIT $6"
        ))
        .bind(f.prompt.as_ref().map(|p| p.as_str()))
        .bind(f.status.map(|s| s.as_str()))
        .bind(f.since)
        .bind(f.until)
        .bind(f.before_id)
        .bind(i64::from(limit))
        .map(&mut *self.reader.acquire().await?, trace_from_row::<D>)
        .await
    }

    async fn add_feedback(&self, id: Uuid, feedback: Feedback) -> StoreResult<Option<Trace>> {
        let mut tx = self.writer.begin().await?;
        let current: Option<Value> =
            sql::<D>(&format!("SELECT feedback FROM traces WHERE id = $1{}", D::lock(" FOR UPDATE")))
                .bind(id)
                .value(&mut tx, "feedback")
                .await?;
        let Some(current) = current else { return Ok(None) };
        let current: Feedback = serde_json::from_value(current).map_err(|_| corrupt("feedback"))?;
        let merged = serde_json::to_value(current.merged(feedback)).map_err(|_| corrupt("feedback"))?;
        // Under the row lock: the old contribution out, the new one in, once.
        rollups::account::<D>(&mut tx, &[id], Sign::Retract, Counted::Unquarantined).await?;
        sql::<D>("UPDATE traces SET feedback = $1, updated_at = $2 WHERE id = $3")
            .bind(json(&merged))
            .bind(now())
            .bind(id)
            .execute(&mut tx)
            .await?;
        rollups::account::<D>(&mut tx, &[id], Sign::Credit, Counted::Unquarantined).await?;
        tx.commit().await?;
        self.get_trace(id).await
    }

    async fn version_outcomes(
        &self,
        prompt: &PromptName,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
        bucket_secs: i64,
    ) -> StoreResult<Vec<OutcomeBucket>> {
        rollups::read_version_outcomes(self, prompt, from, until, bucket_secs).await
    }

    async fn quarantine_trace(&self, id: Uuid, reason: &str) -> StoreResult<TraceAction> {
        let mut tx = self.writer.begin().await?;
        if let Some(refused) = lock_for_action::<D>(&mut tx, id, false).await? {
            return Ok(refused);
        }
        let held: Vec<Uuid> = sql::<D>(
            "UPDATE traces SET quarantined_at = $1, quarantine_reason = $2, updated_at = $1
             WHERE id = $3 AND quarantined_at IS NULL RETURNING id",
        )
        .bind(now())
        .bind(reason)
        .bind(id)
        .map(&mut tx, |row| Cols::<D>(row).get("id"))
        .await?;
        rollups::account::<D>(&mut tx, &held, Sign::Retract, Counted::All).await?;
        tx.commit().await?;
        Ok(TraceAction::found(self.get_trace(id).await?))
    }

    async fn quarantine_traces(&self, f: &TraceFilter, reason: &str) -> StoreResult<u64> {
        let Some(prompt) = &f.prompt else { return Ok(0) };
        let mut tx = self.writer.begin().await?;
        let held: Vec<Uuid> = sql::<D>(
            "UPDATE traces SET quarantined_at = $1, quarantine_reason = $2, updated_at = $1
             WHERE prompt_id = (SELECT id FROM prompts WHERE name = $3) AND status = 'pending' AND round_id IS NULL
               AND quarantined_at IS NULL
               AND ($4 IS NULL OR created_at >= $4) AND ($5 IS NULL OR created_at < $5)
             RETURNING id",
        )
        .bind(now())
        .bind(reason)
        .bind(prompt.as_str())
        .bind(f.since)
        .bind(f.until)
        .map(&mut tx, |row| Cols::<D>(row).get("id"))
        .await?;
        // The rows this statement changed, whatever ran meanwhile: their rewards leave the rollups.
        rollups::account::<D>(&mut tx, &held, Sign::Retract, Counted::All).await?;
        tx.commit().await?;
        Ok(held.len() as u64)
    }

    async fn release_trace(&self, id: Uuid) -> StoreResult<TraceAction> {
        let mut tx = self.writer.begin().await?;
        let released: Vec<Uuid> = sql::<D>(
            "UPDATE traces SET quarantined_at = NULL, quarantine_reason = NULL, updated_at = $1
             WHERE id = $2 AND quarantined_at IS NOT NULL RETURNING id",
        )
        .bind(now())
        .bind(id)
        .map(&mut tx, |row| Cols::<D>(row).get("id"))
        .await?;
        rollups::account::<D>(&mut tx, &released, Sign::Credit, Counted::All).await?;
        tx.commit().await?;
        Ok(TraceAction::found(self.get_trace(id).await?))
    }

    async fn delete_trace(&self, id: Uuid) -> StoreResult<TraceAction> {
        let Some(trace) = self.get_trace(id).await? else { return Ok(TraceAction::NotFound) };
        let mut tx = self.writer.begin().await?;
        if let Some(refused) = lock_for_action::<D>(&mut tx, id, true).await? {
            return Ok(refused);
        }
        // An operator's delete takes the trace's outcome with it (retention's does not).
        rollups::account::<D>(&mut tx, &[id], Sign::Retract, Counted::Unquarantined).await?;
        // Only rounds that ended without publishing can still name it; its OTLP
        // spans go too (a re-sent span would then make a new trace).
        for text in [
            "DELETE FROM reflections WHERE trace_id = $1",
            "DELETE FROM round_traces WHERE trace_id = $1",
            "DELETE FROM otlp_spans WHERE trace_id = $1",
            "DELETE FROM traces WHERE id = $1",
        ] {
            sql::<D>(text).bind(id).execute(&mut tx).await?;
        }
        tx.commit().await?;
        Ok(TraceAction::Done(Box::new(trace)))
    }

    async fn merge_otlp_spans(
        &self,
        otel_trace_id: &str,
        spans: &[OtlpSpan],
        remap: &OtlpRemapFn<'_>,
    ) -> StoreResult<OtlpMerge> {
        let mut tx = self.writer.begin().await?;
        // Serialises exports of the same trace id, including the first one.
        D::serialize_otlp(&mut tx, otel_trace_id).await?;
        let stored = sql::<D>(
            "SELECT span_id, trace_id, body FROM otlp_spans WHERE otel_trace_id = $1 ORDER BY received_at, span_id",
        )
        .bind(otel_trace_id)
        .fetch_all(&mut tx)
        .await?;
        let mut seen = std::collections::HashSet::new();
        let mut linked = None;
        let mut bodies: Vec<Vec<u8>> = Vec::with_capacity(stored.len() + spans.len());
        for row in &stored {
            let r = Cols::<D>(row);
            seen.insert(r.get::<String>("span_id")?);
            linked = linked.or(r.get::<Option<Uuid>>("trace_id")?);
            bodies.push(r.get("body")?);
        }
        let new: Vec<&OtlpSpan> = spans.iter().filter(|s| seen.insert(s.span_id.clone())).collect();
        if new.is_empty() {
            // Ended explicitly: a dropped transaction would keep its locks
            // until its pooled connection is used again.
            tx.rollback().await?;
            return Ok(OtlpMerge::Duplicate);
        }
        // The linked trace's feedback, read under the lock that keeps it open.
        let mut linked_feedback: Option<Value> = None;
        if let Some(trace) = linked {
            // The row lock keeps a round from taking the trace while it changes
            // (rounds skip locked traces); a round that took it first wins.
            let text = format!(
                "SELECT feedback, CASE WHEN status = 'pending' AND round_id IS NULL THEN 1 ELSE 0 END AS open
                 FROM traces WHERE id = $1{}",
                D::lock(" FOR UPDATE")
            );
            let row = sql::<D>(&text).bind(trace).fetch_optional(&mut tx).await?;
            let open: Option<i32> = row.as_ref().map(|r| Cols::<D>(r).get("open")).transpose()?;
            if open != Some(1) {
                tx.rollback().await?;
                return Ok(OtlpMerge::Closed { trace, spans: new.len() });
            }
            linked_feedback = row.as_ref().map(|r| Cols::<D>(r).get("feedback")).transpose()?;
        }
        bodies.extend(new.iter().map(|s| s.body.clone()));
        let refs: Vec<&[u8]> = bodies.iter().map(Vec::as_slice).collect();
        let mapped = match remap(&refs) {
            OtlpRemap::Invalid(reason) => {
                tx.rollback().await?;
                return Ok(OtlpMerge::Rejected { spans: new.len(), reason });
            }
            OtlpRemap::Incomplete(reason) if linked.is_some() => {
                tx.rollback().await?;
                return Ok(OtlpMerge::Rejected { spans: new.len(), reason });
            }
            OtlpRemap::Incomplete(reason) => {
                insert_otlp_spans::<D>(&mut tx, otel_trace_id, None, &new).await?;
                tx.commit().await?;
                return Ok(OtlpMerge::Held { added: new.len(), reason });
            }
            OtlpRemap::Mapped(t) => *t,
        };
        let prompt = sql::<D>("SELECT id, version_count FROM prompts WHERE name = $1")
            .bind(mapped.prompt.as_str())
            .fetch_optional(&mut tx)
            .await?;
        let count = prompt.as_ref().map(|r| Cols::<D>(r).get::<i64>("version_count")).transpose()?;
        if let Some(reason) = prompt_reference_problem(&mapped, count) {
            tx.rollback().await?;
            return Ok(OtlpMerge::Rejected { spans: new.len(), reason });
        }
        let prompt_id: Uuid =
            prompt.as_ref().map(|r| Cols::<D>(r).get("id")).transpose()?.ok_or_else(|| corrupt("prompt"))?;
        let now = now();
        let (trace, created) = match linked {
            Some(trace) => {
                let current = linked_feedback.take().ok_or(StoreError::NotFound)?;
                let current: Feedback = serde_json::from_value(current).map_err(|_| corrupt("feedback"))?;
                // Feedback given through the API stays unless a span says otherwise.
                let feedback =
                    serde_json::to_value(current.merged(mapped.feedback.clone())).map_err(|_| corrupt("feedback"))?;
                rollups::account::<D>(&mut tx, &[trace], Sign::Retract, Counted::Unquarantined).await?;
                sql::<D>(
                    "UPDATE traces SET prompt_id = $2, prompt_version = $3, input = $4, trajectory = $5, output = $6,
                            feedback = $7, metadata = $8, updated_at = $9 WHERE id = $1",
                )
                .bind(trace)
                .bind(prompt_id)
                .bind(mapped.prompt_version)
                .bind(json(&mapped.input))
                .bind(json(&mapped.trajectory))
                .bind(json(&mapped.output))
                .bind(json(&feedback))
                .bind(json(&mapped.metadata))
                .bind(now)
                .execute(&mut tx)
                .await?;
                rollups::account::<D>(&mut tx, &[trace], Sign::Credit, Counted::Unquarantined).await?;
                (trace, false)
            }
            None => {
                let trace = Uuid::now_v7();
                let feedback = serde_json::to_value(&mapped.feedback).map_err(|_| corrupt("feedback"))?;
                sql::<D>(
                    "INSERT INTO traces (id, prompt_id, prompt_version, input, trajectory, output, feedback, reflection,
                                         external_id, metadata, created_at, updated_at)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $11)",
                )
                .bind(trace)
                .bind(prompt_id)
                .bind(mapped.prompt_version)
                .bind(json(&mapped.input))
                .bind(json(&mapped.trajectory))
                .bind(json(&mapped.output))
                .bind(json(&feedback))
                .bind(opt_json(mapped.reflection.as_ref()))
                .bind(mapped.external_id.as_deref())
                .bind(json(&mapped.metadata))
                .bind(now)
                .execute(&mut tx)
                .await?;
                sql::<D>("UPDATE otlp_spans SET trace_id = $2 WHERE otel_trace_id = $1 AND trace_id IS NULL")
                    .bind(otel_trace_id)
                    .bind(trace)
                    .execute(&mut tx)
                    .await?;
                rollups::account::<D>(&mut tx, &[trace], Sign::Credit, Counted::All).await?;
                (trace, true)
            }
        };
        insert_otlp_spans::<D>(&mut tx, otel_trace_id, Some(trace), &new).await?;
        tx.commit().await?;
        let added = new.len();
        Ok(if created { OtlpMerge::Created { trace, added } } else { OtlpMerge::Extended { trace, added } })
    }

    async fn purge_held_otlp_spans(&self, older_than: DateTime<Utc>) -> StoreResult<u64> {
        sql::<D>(
            "DELETE FROM otlp_spans WHERE trace_id IS NULL AND otel_trace_id IN (
                 SELECT otel_trace_id FROM otlp_spans WHERE trace_id IS NULL
                 GROUP BY otel_trace_id HAVING max(received_at) < $1)",
        )
        .bind(older_than)
        .execute(&mut *self.writer.acquire().await?)
        .await
    }

    async fn requeue_failed_traces(&self, req: &RequeueFailed) -> StoreResult<Vec<Uuid>> {
        let mut tx = self.writer.begin().await?;
        let prompt = prompt_id::<D>(&mut tx, &req.prompt).await?;
        let text = format!(
            "UPDATE traces SET status = 'pending', attempts = 0, failure_reason = NULL, round_id = NULL, updated_at = $4
             WHERE prompt_id = $1 AND status = 'failed' AND ($2 IS NULL OR {}) AND ($3 IS NULL OR created_at >= $3)
             RETURNING id",
            D::any_of("id", "$2")
        );
        let mut ids: Vec<Uuid> = sql::<D>(&text)
            .bind(prompt)
            .bind(Param::Ids(req.ids.as_deref()))
            .bind(req.since)
            .bind(now())
            .map(&mut tx, |row| Cols::<D>(row).get("id"))
            .await?;
        if ids.is_empty() {
            tx.commit().await?;
        } else {
            self.commit(tx, Change::RoundQueued).await?;
        }
        ids.sort();
        Ok(ids)
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
        sql::<D>("DELETE FROM idempotency_keys WHERE created_at < $1")
            .bind(older_than)
            .execute(&mut *self.writer.acquire().await?)
            .await
    }

    async fn open_round(&self, req: &OpenRound) -> StoreResult<Option<Round>> {
        let now = now();
        let mut tx = self.writer.begin().await?;
        // First, so a duplicate delivery is told so (not "a round is in flight":
        // its own round). A concurrent duplicate waits here on the primary key;
        // every refusal below rolls back, forgetting the id.
        if let Some(hook) = &req.inbound_webhook_id {
            let n = sql::<D>("INSERT INTO inbound_webhooks (id, received_at) VALUES ($1, $2) ON CONFLICT DO NOTHING")
                .bind(hook)
                .bind(now)
                .execute(&mut tx)
                .await?;
            if n == 0 {
                return Err(StoreError::Duplicate);
            }
        }
        // The prompt row lock (Postgres; the single writer on SQLite) serialises round creation per prompt.
        let text = format!(
            "SELECT id, strategy, settings, version_count FROM prompts WHERE name = $1{}",
            D::lock(" FOR UPDATE")
        );
        let row = sql::<D>(&text).bind(req.prompt.as_str()).fetch_one(&mut tx).await?;
        let r = Cols::<D>(&row);
        let prompt_id: Uuid = r.get("id")?;
        let strategy: String = r.get("strategy")?;
        let settings: PromptSettings = serde_json::from_value(r.get("settings")?).map_err(|_| corrupt("settings"))?;
        let latest: i64 = r.get("version_count")?;
        let active = sql::<D>("SELECT id FROM rounds WHERE prompt_id = $1 AND status IN ('queued', 'running')")
            .bind(prompt_id)
            .fetch_optional(&mut tx)
            .await?;
        if active.is_some() {
            return Err(StoreError::AlreadyExists);
        }
        let text = format!(
            "SELECT id FROM traces WHERE prompt_id = $1 AND status = 'pending' AND round_id IS NULL
               AND quarantined_at IS NULL ORDER BY id LIMIT $2{}",
            D::lock(" FOR UPDATE SKIP LOCKED")
        );
        let ids: Vec<Uuid> = sql::<D>(&text)
            .bind(prompt_id)
            .bind(i64::from(req.batch))
            .map(&mut tx, |row| Cols::<D>(row).get("id"))
            .await?;
        if ids.is_empty() || (ids.len() as u32) < req.min_traces {
            return Ok(None);
        }
        let production: Option<i64> =
            sql::<D>("SELECT version FROM labels WHERE prompt_id = $1 AND name = 'production'")
                .bind(prompt_id)
                .value(&mut tx, "version")
                .await?;
        let id = Uuid::now_v7();
        sql::<D>(
            "INSERT INTO rounds (id, prompt_id, status, trigger, method, strategy, seed, duplication, n, base_version,
                                 not_before, created_at, updated_at)
             VALUES ($1, $2, 'queued', $3, $4, $5, $6, $7, $8, $9, $10, $10, $10)",
        )
        .bind(id)
        .bind(prompt_id)
        .bind(req.trigger.as_str())
        .bind(round::method_str(req.method))
        .bind(strategy)
        .bind(req.seed)
        .bind(settings.duplication as i32)
        .bind(ids.len() as i32)
        .bind(production.unwrap_or(latest))
        .bind(now)
        .execute(&mut tx)
        .await?;
        D::reserve_traces(&mut tx, id, &ids, now).await?;
        self.commit(tx, Change::RoundQueued).await?;
        self.get_round(id).await
    }

    async fn backlogs(&self) -> StoreResult<Vec<Backlog>> {
        sql::<D>(
            "SELECT p.id, p.name, p.strategy, p.promotion, p.settings, p.created_at, p.created_by,
                    (SELECT count(*) FROM traces t WHERE t.prompt_id = p.id AND t.status = 'pending' AND t.round_id IS NULL AND t.quarantined_at IS NULL) AS pending,
                    (SELECT min(t.created_at) FROM traces t WHERE t.prompt_id = p.id AND t.status = 'pending' AND t.round_id IS NULL AND t.quarantined_at IS NULL) AS oldest,
                    EXISTS (SELECT 1 FROM rounds r WHERE r.prompt_id = p.id AND r.status IN ('queued', 'running')) AS active
             FROM prompts p ORDER BY p.name",
        )
        .map(&mut *self.reader.acquire().await?, |row| {
            let r = Cols::<D>(row);
            Ok(Backlog {
                prompt: prompt_from_row::<D>(row)?,
                pending: r.get("pending")?,
                oldest: r.get("oldest")?,
                active_round: r.get("active")?,
            })
        })
        .await
    }

    async fn claim_round(&self, owner: &str, lease: Duration) -> StoreResult<Option<ClaimedRound>> {
        let Some(id) = D::claim_round_id(self, owner, lease).await? else { return Ok(None) };
        let round = self.get_round(id).await?.ok_or(StoreError::NotFound)?;
        let prompt = self.get_prompt(&round.prompt).await?.ok_or(StoreError::NotFound)?;
        let base = self
            .resolve(&round.prompt, &Selector::Version(round.base_version))
            .await?
            .ok_or_else(|| corrupt("round base version"))?
            .version;
        let traces = sql::<D>(&format!(
            "SELECT {TRACE_COLUMNS} FROM round_traces rt JOIN traces t ON t.id = rt.trace_id
             JOIN prompts p ON p.id = t.prompt_id WHERE rt.round_id = $1 ORDER BY rt.position"
        ))
        .bind(id)
        .map(&mut *self.reader.acquire().await?, trace_from_row::<D>)
        .await?;
        Ok(Some(ClaimedRound { round, prompt, base, traces }))
    }

    async fn heartbeat_round(&self, round: Uuid, attempt: i32, lease: Duration) -> StoreResult<bool> {
        D::heartbeat_round(self, round, attempt, lease).await
    }

    async fn adopt_reflections(&self, round: Uuid) -> StoreResult<u64> {
        // Newest first: of several earlier reflections on a trace, the newest wins.
        sql::<D>(
            "INSERT INTO reflections (round_id, trace_id, reflection, from_trace, created_at)
             SELECT cur.id, r.trace_id, r.reflection, r.from_trace, $2
             FROM rounds cur
             JOIN round_traces rt ON rt.round_id = cur.id
             JOIN reflections r ON r.trace_id = rt.trace_id AND r.round_id <> cur.id
             JOIN rounds prev ON prev.id = r.round_id AND prev.prompt_id = cur.prompt_id
                             AND prev.base_version = cur.base_version AND prev.strategy = cur.strategy
             WHERE cur.id = $1
             ORDER BY r.trace_id, r.created_at DESC
             ON CONFLICT DO NOTHING",
        )
        .bind(round)
        .bind(now())
        .execute(&mut *self.writer.acquire().await?)
        .await
    }

    async fn save_reflection(&self, round: Uuid, trace: Uuid, r: &Reflection, from_trace: bool) -> StoreResult<()> {
        let reflection = serde_json::to_value(r).map_err(|_| corrupt("reflection"))?;
        sql::<D>(
            "INSERT INTO reflections (round_id, trace_id, reflection, from_trace, created_at) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT DO NOTHING",
        )
        .bind(round)
        .bind(trace)
        .bind(json(&reflection))
        .bind(from_trace)
        .bind(now())
        .execute(&mut *self.writer.acquire().await?)
        .await?;
        Ok(())
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
        sql::<D>(
            "INSERT INTO llm_calls (round_id, attempt, role, model, prompt_tokens, completion_tokens, cost_usd, latency_ms,
                                    retries, error, created_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        )
        .bind(round)
        .bind(attempt)
        .bind(enum_str(call.role))
        .bind(&call.model)
        .bind(call.prompt_tokens as i64)
        .bind(call.completion_tokens as i64)
        .bind(call.cost_usd)
        .bind(call.latency_ms as i64)
        .bind(call.retries as i32)
        .bind(call.error.as_deref())
        .bind(now())
        .execute(&mut *self.writer.acquire().await?)
        .await?;
        Ok(())
    }

    async fn round_calls(&self, round: Uuid) -> StoreResult<Vec<RoundCall>> {
        sql::<D>(
            "SELECT attempt, role, model, prompt_tokens, completion_tokens, cost_usd, latency_ms, retries, error, created_at
             FROM llm_calls WHERE round_id = $1 ORDER BY id",
        )
        .bind(round)
        .map(&mut *self.reader.acquire().await?, |row| {
            let r = Cols::<D>(row);
            Ok(RoundCall {
                attempt: r.get("attempt")?,
                call: LlmCall {
                    role: serde_json::from_value(Value::String(r.get("role")?)).map_err(|_| corrupt("llm role"))?,
                    model: r.get("model")?,
                    prompt_tokens: r.get::<i64>("prompt_tokens")? as u64,
                    completion_tokens: r.get::<i64>("completion_tokens")? as u64,
                    cost_usd: r.get("cost_usd")?,
                    latency_ms: r.get::<i64>("latency_ms")? as u64,
                    retries: r.get::<i32>("retries")? as u32,
                    error: r.get("error")?,
                },
                created_at: r.get("created_at")?,
            })
        })
        .await
    }

    async fn update_round(&self, round: Uuid, attempt: i32, k: Option<i32>, detail: &Value) -> StoreResult<bool> {
        let n = sql::<D>(
            "UPDATE rounds SET k = COALESCE($1, k), detail = $2, updated_at = $3
             WHERE id = $4 AND attempt = $5 AND status = 'running'",
        )
        .bind(k)
        .bind(json(detail))
        .bind(now())
        .bind(round)
        .bind(attempt)
        .execute(&mut *self.writer.acquire().await?)
        .await?;
        Ok(n == 1)
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
        let now = now();
        let mut tx = self.writer.begin().await?;
        let (prompt_id, name) = fence::<D>(&mut tx, round, attempt).await?;
        if let Some(secs) = sample_secs.filter(|s| *s > 0.0) {
            sql::<D>(
                "INSERT INTO controller_samples (prompt_id, round_id, batch_size, round_secs, created_at)
                 SELECT prompt_id, id, n, $1, $2 FROM rounds WHERE id = $3",
            )
            .bind(secs)
            .bind(now)
            .bind(round)
            .execute(&mut tx)
            .await?;
        }
        let number: i64 =
            sql::<D>("UPDATE prompts SET version_count = version_count + 1 WHERE id = $1 RETURNING version_count")
                .bind(prompt_id)
                .value(&mut tx, "version_count")
                .await?
                .ok_or(StoreError::NotFound)?;
        insert_version::<D>(&mut tx, prompt_id, number, &v, now).await?;
        let by = v.created_by.clone();
        let mv =
            LabelMove { label: label.clone(), to_version: number, expected_current: None, check_current: false, by };
        let (moved, previous) = apply_move::<D>(&mut tx, prompt_id, &mv).await?;
        charge_traces::<D>(&mut tx, round, charges).await?;
        sql::<D>(
            "UPDATE traces SET status = 'consumed', updated_at = $1 WHERE round_id = $2 AND status = 'pending'
               AND EXISTS (SELECT 1 FROM reflections r WHERE r.round_id = $2 AND r.trace_id = traces.id)",
        )
        .bind(now)
        .bind(round)
        .execute(&mut tx)
        .await?;
        release_traces::<D>(&mut tx, round).await?;
        sql::<D>(
            "UPDATE rounds SET status = 'succeeded', result_version = $1, detail = $2, error = NULL, finished_at = $3,
                    lease_owner = NULL, lease_expires_at = NULL, updated_at = $3 WHERE id = $4",
        )
        .bind(number)
        .bind(json(detail))
        .bind(now)
        .bind(round)
        .execute(&mut tx)
        .await?;
        let version = v.into_version(PromptName::parse(&name).map_err(|_| corrupt("prompt name"))?, number, now);
        let mut queued = record_event::<D>(&mut tx, &OutboxEvent::version_created(&version, &[label.as_str()])).await?;
        let cause = MoveCause::new(LabelMoveKind::AutoPublish, format!("round {round} published v{number}"))
            .with_evidence(serde_json::json!({ "round_id": round }));
        queued |= record_move::<D>(&mut tx, prompt_id, &version.prompt, &moved, previous, &cause).await?;
        let completed = OutboxEvent::round_completed(&version.prompt, round, number, &label);
        queued |= record_event::<D>(&mut tx, &completed).await?;
        self.commit(tx, Change::Prompt(name)).await?;
        self.announce_outbox(queued);
        Ok(version)
    }

    async fn fail_round(&self, round: Uuid, attempt: i32, error: &str, how: RoundFailure) -> StoreResult<()> {
        let now = now();
        let mut tx = self.writer.begin().await?;
        let (_, name) = fence::<D>(&mut tx, round, attempt).await?;
        let mut queued = false;
        let requeued = match how {
            RoundFailure::Retry { after } => {
                sql::<D>(
                    "UPDATE rounds SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL, error = $1,
                            not_before = $2, updated_at = $3 WHERE id = $4",
                )
                .bind(error)
                .bind(later(now, after))
                .bind(now)
                .bind(round)
                .execute(&mut tx)
                .await?;
                true
            }
            RoundFailure::GiveUp { charges } => {
                charge_traces::<D>(&mut tx, round, &charges).await?;
                release_traces::<D>(&mut tx, round).await?;
                sql::<D>(
                    "UPDATE rounds SET status = 'failed', error = $1, finished_at = $2, lease_owner = NULL,
                            lease_expires_at = NULL, updated_at = $2 WHERE id = $3",
                )
                .bind(error)
                .bind(now)
                .bind(round)
                .execute(&mut tx)
                .await?;
                queued = record_event::<D>(&mut tx, &OutboxEvent::round_failed(&name, round, attempt, error)).await?;
                false
            }
        };
        if requeued {
            self.commit(tx, Change::RoundQueued).await?;
        } else {
            tx.commit().await?;
        }
        self.announce_outbox(queued);
        Ok(())
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
        sql::<D>(
            "SELECT a.id, a.delivery_id, d.event_id, e.type, a.attempt, a.status_code, a.error, a.latency_ms,
                    a.created_at, a.next_attempt_at, d.status
             FROM webhook_attempts a JOIN webhook_deliveries d ON d.id = a.delivery_id
             JOIN webhook_events e ON e.id = d.event_id
             WHERE a.subscription_id = $1 AND ($2 IS NULL OR a.id < $2) ORDER BY a.id DESC LIMIT $3",
        )
        .bind(id)
        .bind(before)
        .bind(i64::from(limit))
        .map(&mut *self.reader.acquire().await?, |row| {
            let r = Cols::<D>(row);
            Ok(DeliveryAttempt {
                seq: r.get("id")?,
                delivery_id: r.get("delivery_id")?,
                event_id: r.get("event_id")?,
                event_type: r.get("type")?,
                attempt: r.get("attempt")?,
                status_code: r.get::<Option<i32>>("status_code")?.map(|c| c as u16),
                error: r.get("error")?,
                latency_ms: r.get::<i64>("latency_ms")?.max(0) as u64,
                attempted_at: r.get("created_at")?,
                next_attempt_at: r.get("next_attempt_at")?,
                delivery_status: r.get("status")?,
            })
        })
        .await
    }

    async fn claim_deliveries(&self, owner: &str, lease: Duration, limit: u32) -> StoreResult<Vec<ClaimedDelivery>> {
        let ids = D::claim_delivery_ids(self, owner, lease, limit).await?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let text = format!(
            "SELECT d.id, d.subscription_id, d.event_id, e.type, e.body, s.url, s.secret, d.attempts
             FROM webhook_deliveries d JOIN webhook_events e ON e.id = d.event_id
             JOIN webhook_subscriptions s ON s.id = d.subscription_id
             WHERE {} ORDER BY d.next_attempt_at",
            D::any_of("d.id", "$1")
        );
        sql::<D>(&text)
            .bind(Param::Ids(Some(&ids)))
            .map(&mut *self.writer.acquire().await?, |row| {
                let r = Cols::<D>(row);
                Ok(ClaimedDelivery {
                    id: r.get("id")?,
                    subscription_id: r.get("subscription_id")?,
                    event_id: r.get("event_id")?,
                    event_type: r.get("type")?,
                    body: r.get("body")?,
                    url: r.get("url")?,
                    secret: Secret::new(r.get::<String>("secret")?),
                    attempt: r.get("attempts")?,
                })
            })
            .await
    }

    async fn finish_delivery(&self, d: &ClaimedDelivery, rec: &AttemptRecord) -> StoreResult<bool> {
        let now = now();
        let (status, next_at) = match &rec.outcome {
            DeliveryOutcome::Succeeded => ("succeeded", None),
            DeliveryOutcome::Retry { at } => ("pending", Some(*at)),
            DeliveryOutcome::GiveUp | DeliveryOutcome::Gone => ("failed", None),
        };
        let mut tx = self.writer.begin().await?;
        let n = sql::<D>(
            "UPDATE webhook_deliveries SET status = $3, next_attempt_at = COALESCE($4, next_attempt_at),
                    last_error = $5, lease_owner = NULL, updated_at = $6
             WHERE id = $1 AND attempts = $2 AND status = 'pending'",
        )
        .bind(d.id)
        .bind(d.attempt)
        .bind(status)
        .bind(next_at)
        .bind(rec.error.as_deref())
        .bind(now)
        .execute(&mut tx)
        .await?;
        if n == 0 {
            return Ok(false);
        }
        sql::<D>(
            "INSERT INTO webhook_attempts (delivery_id, subscription_id, attempt, status_code, error, latency_ms,
                                           next_attempt_at, created_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(d.id)
        .bind(d.subscription_id)
        .bind(d.attempt)
        .bind(rec.status_code.map(i32::from))
        .bind(rec.error.as_deref())
        .bind(rec.latency_ms.min(i64::MAX as u64) as i64)
        .bind(next_at)
        .bind(now)
        .execute(&mut tx)
        .await?;
        if rec.outcome == DeliveryOutcome::Gone {
            sql::<D>(
                "UPDATE webhook_subscriptions SET enabled = FALSE, updated_at = $1,
                        disabled_reason = 'the receiver answered 410 Gone' WHERE id = $2",
            )
            .bind(now)
            .bind(d.subscription_id)
            .execute(&mut tx)
            .await?;
            sql::<D>(
                "UPDATE webhook_deliveries SET status = 'failed', last_error = 'subscription disabled', updated_at = $1
                 WHERE subscription_id = $2 AND status = 'pending'",
            )
            .bind(now)
            .bind(d.subscription_id)
            .execute(&mut tx)
            .await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    async fn controller_samples(&self, prompt: &PromptName, limit: u32) -> StoreResult<Vec<super::ControllerSample>> {
        let mut samples = sql::<D>(
            "SELECT s.batch_size, s.round_secs, s.round_id, s.created_at FROM controller_samples s
             JOIN prompts p ON p.id = s.prompt_id WHERE p.name = $1 ORDER BY s.id DESC LIMIT $2",
        )
        .bind(prompt.as_str())
        .bind(i64::from(limit))
        .map(&mut *self.reader.acquire().await?, |row| {
            let r = Cols::<D>(row);
            Ok(super::ControllerSample {
                batch_size: r.get::<i32>("batch_size")? as u32,
                round_secs: r.get("round_secs")?,
                round_id: r.get("round_id")?,
                created_at: r.get("created_at")?,
            })
        })
        .await?;
        samples.reverse();
        Ok(samples)
    }

    async fn save_controller_choice(&self, prompt: &PromptName, choice: &Value) -> StoreResult<()> {
        sql::<D>(
            "INSERT INTO controller_choices (prompt_id, choice, updated_at) SELECT id, $1, $2 FROM prompts WHERE name = $3
             ON CONFLICT (prompt_id) DO UPDATE SET choice = excluded.choice, updated_at = excluded.updated_at",
        )
        .bind(json(choice))
        .bind(now())
        .bind(prompt.as_str())
        .execute(&mut *self.writer.acquire().await?)
        .await?;
        Ok(())
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
        let mut tx = self.writer.begin().await?;
        for c in counts {
            sql::<D>(
                "INSERT INTO meter_counts (round_id, prompt_id, size_min, marked, recaptured, created_at)
                 SELECT $1, id, $2, $3, $4, $5 FROM prompts WHERE name = $6
                 ON CONFLICT (round_id, size_min) DO NOTHING",
            )
            .bind(round)
            .bind(i32::try_from(c.size_min).unwrap_or(i32::MAX))
            .bind(i64::try_from(c.marked).unwrap_or(i64::MAX))
            .bind(i64::try_from(c.recaptured).unwrap_or(i64::MAX))
            .bind(now())
            .bind(prompt.as_str())
            .execute(&mut tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn meter_counts(&self, prompt: &PromptName) -> StoreResult<Vec<super::MeterCounts>> {
        sql::<D>(
            "SELECT m.size_min, CAST(SUM(m.marked) AS BIGINT) AS marked, CAST(SUM(m.recaptured) AS BIGINT) AS recaptured,
                    COUNT(*) AS rounds
             FROM meter_counts m JOIN prompts p ON p.id = m.prompt_id WHERE p.name = $1
             GROUP BY m.size_min ORDER BY m.size_min",
        )
        .bind(prompt.as_str())
        .map(&mut *self.reader.acquire().await?, |row| {
            let r = Cols::<D>(row);
            Ok(super::MeterCounts {
                size_min: r.get::<i32>("size_min")? as u32,
                marked: r.get::<i64>("marked")? as u64,
                recaptured: r.get::<i64>("recaptured")? as u64,
                rounds: r.get::<i64>("rounds")? as u64,
            })
        })
        .await
    }
}
