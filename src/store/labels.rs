//! Labels: list, move (compare-and-set, recorded in the label history), delete, and the history
//! itself.

use async_trait::async_trait;
use uuid::Uuid;

use super::{
    Change, StoreError, StoreResult,
    backend::{Backend, SqlStore},
    sql::{Cols, Dialect, corrupt, now, opt_json, sql},
    versions::{prompt_id, require_version},
    webhooks::record_event,
};
use crate::domain::{
    LabelHistoryEntry, LabelMoveKind, LabelName, MoveCause, PromptName, VersionSource,
    event::OutboxEvent,
    label::{Label, LabelMove},
};

/// How the label moves that come with a new version enter the label history.
pub(crate) fn version_move_kind(source: VersionSource) -> LabelMoveKind {
    match source {
        VersionSource::Rollback => LabelMoveKind::Rollback,
        VersionSource::Learned => LabelMoveKind::AutoPublish,
        VersionSource::Manual => LabelMoveKind::Promote,
        VersionSource::Crossover => LabelMoveKind::Crossover,
    }
}

/// The labels of a prompt and their history.
#[async_trait]
pub trait LabelStore: Send + Sync {
    async fn list_labels(&self, prompt: &PromptName) -> StoreResult<Vec<Label>>;
    /// Applies one compare-and-set label move (`Conflict` when the CAS fails),
    /// recorded in the label history as an operator's `promote`.
    async fn move_label(&self, prompt: &PromptName, mv: &LabelMove) -> StoreResult<Label> {
        self.move_label_because(prompt, mv, &MoveCause::new(LabelMoveKind::Promote, "")).await
    }
    /// [`LabelStore::move_label`] recording `cause` in the label history, in the
    /// same transaction (a move that changes nothing records nothing). A
    /// `guard-rollback` or `rollback` also queues a `prompt.rolled_back` event.
    async fn move_label_because(&self, prompt: &PromptName, mv: &LabelMove, cause: &MoveCause) -> StoreResult<Label>;
    /// Deletes a label, recording who did it in the label history; false when
    /// there was no such label.
    async fn delete_label(&self, prompt: &PromptName, label: &LabelName, by: &str) -> StoreResult<bool>;
    /// The prompt's label history, newest first: moves with ids below
    /// `before`, of `label` only when given. Empty for an unknown prompt.
    async fn label_history(
        &self,
        prompt: &PromptName,
        label: Option<&LabelName>,
        before: Option<i64>,
        limit: u32,
    ) -> StoreResult<Vec<LabelHistoryEntry>> {
        let query = LabelMoveQuery { label: label.cloned(), before, ..Default::default() };
        self.label_moves(prompt, &query, limit).await
    }
    /// Up to `limit` of the prompt's label moves that match `query`, newest
    /// first; each read walks an index on (prompt, label or kind, id), so it
    /// costs what it returns, not the length of the history.
    async fn label_moves(
        &self,
        prompt: &PromptName,
        query: &LabelMoveQuery,
        limit: u32,
    ) -> StoreResult<Vec<LabelHistoryEntry>>;
}

/// Which label moves to read (every condition given must hold).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LabelMoveQuery {
    pub label: Option<LabelName>,
    pub kind: Option<LabelMoveKind>,
    pub from_version: Option<i64>,
    pub to_version: Option<i64>,
    /// Moves with ids below this one (the page cursor).
    pub before: Option<i64>,
}

#[async_trait]
impl<D: Backend> LabelStore for SqlStore<D> {
    async fn list_labels(&self, prompt: &PromptName) -> StoreResult<Vec<Label>> {
        sql::<D>(
            "SELECT l.name, l.version, l.updated_at, l.updated_by FROM labels l JOIN prompts p ON p.id = l.prompt_id
             WHERE p.project = $1 AND p.name = $2 ORDER BY l.name",
        )
        .bind(prompt.project())
        .bind(prompt.as_str())
        .map(&mut *self.reader.acquire().await?, label_from_row::<D>)
        .await
    }

    async fn move_label_because(&self, prompt: &PromptName, mv: &LabelMove, cause: &MoveCause) -> StoreResult<Label> {
        let mut tx = self.begin_write().await?;
        let id = prompt_id::<D>(&mut tx, prompt).await?;
        let (label, previous) = apply_move::<D>(&mut tx, id, mv).await?;
        let queued = record_move::<D>(&mut tx, id, prompt, &label, previous, cause).await?;
        self.commit(tx, Change::prompt(prompt)).await?;
        self.announce_outbox(queued);
        Ok(label)
    }

    async fn delete_label(&self, prompt: &PromptName, label: &LabelName, by: &str) -> StoreResult<bool> {
        let mut tx = self.begin_write().await?;
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
        self.commit(tx, Change::prompt(prompt)).await?;
        Ok(deleted.is_some())
    }

    async fn label_moves(
        &self,
        prompt: &PromptName,
        query: &LabelMoveQuery,
        limit: u32,
    ) -> StoreResult<Vec<LabelHistoryEntry>> {
        // Only the conditions given are in the text (no `$n IS NULL OR …`), so
        // the planner sees which index serves them, on every execution.
        let mut conditions = vec!["m.prompt_id = (SELECT id FROM prompts WHERE project = $1 AND name = $2)".to_owned()];
        let mut n = 3;
        let mut next = |column: &str| {
            let c = format!("{column} = ${n}");
            n += 1;
            c
        };
        let label = query.label.as_ref().map(|l| (next("m.label"), l.as_str()));
        let kind = query.kind.map(|k| (next("m.kind"), k.as_str()));
        let from = query.from_version.map(|v| (next("m.from_version"), v));
        let to = query.to_version.map(|v| (next("m.to_version"), v));
        let before = query.before.map(|id| (format!("m.id < ${n}"), id));
        conditions.extend(label.iter().map(|(c, _)| c.clone()));
        conditions.extend(kind.iter().map(|(c, _)| c.clone()));
        conditions.extend(from.iter().chain(to.iter()).chain(before.iter()).map(|(c, _)| c.clone()));
        let text = format!(
            "SELECT m.id, m.label, m.from_version, m.to_version, m.kind, m.actor, m.reason, m.evidence, m.at
             FROM label_moves m WHERE {} ORDER BY m.id DESC LIMIT {}",
            conditions.join(" AND "),
            limit.max(1)
        );
        let mut q = sql::<D>(&text).bind(prompt.project()).bind(prompt.as_str());
        for (_, v) in label.iter().chain(kind.iter()) {
            q = q.bind(*v);
        }
        for (_, v) in from.iter().chain(to.iter()).chain(before.iter()) {
            q = q.bind(*v);
        }
        q.map(&mut *self.reader.acquire().await?, history_from_row::<D>).await
    }
}

fn label_name(s: &str) -> StoreResult<LabelName> {
    LabelName::parse(s).map_err(|_| corrupt("label name"))
}

pub(super) fn label_from_row<D: Dialect>(row: &D::Row) -> StoreResult<Label> {
    let r = Cols::<D>(row);
    Ok(Label {
        name: label_name(&r.get::<String>("name")?)?,
        version: r.get("version")?,
        updated_at: r.get("updated_at")?,
        updated_by: r.get("updated_by")?,
    })
}

pub(super) fn history_from_row<D: Dialect>(row: &D::Row) -> StoreResult<LabelHistoryEntry> {
    let r = Cols::<D>(row);
    let kind: String = r.get("kind")?;
    Ok(LabelHistoryEntry {
        id: r.get("id")?,
        label: label_name(&r.get::<String>("label")?)?,
        from_version: r.get("from_version")?,
        to_version: r.get("to_version")?,
        kind: LabelMoveKind::parse(&kind).ok_or_else(|| corrupt("label move kind"))?,
        actor: r.get("actor")?,
        reason: r.get("reason")?,
        evidence: r.get("evidence")?,
        at: r.get("at")?,
    })
}

/// Appends one entry to the label history (inside the caller's transaction).
// The columns of one history row; a struct would only rename them.
#[allow(clippy::too_many_arguments)]
pub(super) async fn record_history<D: Dialect>(
    c: &mut D::Connection,
    prompt_id: Uuid,
    label: &LabelName,
    from: Option<i64>,
    to: Option<i64>,
    actor: &str,
    cause: &MoveCause,
) -> StoreResult<()> {
    sql::<D>(
        "INSERT INTO label_moves (prompt_id, label, from_version, to_version, kind, actor, reason, evidence, at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(prompt_id)
    .bind(label.as_str())
    .bind(from)
    .bind(to)
    .bind(cause.kind.as_str())
    .bind(actor)
    .bind(&cause.reason)
    .bind(opt_json(cause.evidence.as_ref()))
    .bind(now())
    .execute(c)
    .await?;
    Ok(())
}

/// The history entry and outbox events of one label move (none when it did
/// not change anything). True when a delivery was queued.
pub(super) async fn record_move<D: Dialect>(
    c: &mut D::Connection,
    prompt_id: Uuid,
    prompt: &PromptName,
    label: &Label,
    previous: Option<i64>,
    cause: &MoveCause,
) -> StoreResult<bool> {
    if previous == Some(label.version) {
        return Ok(false);
    }
    record_history::<D>(c, prompt_id, &label.name, previous, Some(label.version), &label.updated_by, cause).await?;
    let moved = OutboxEvent::label_moved(prompt, &label.name, label.version, previous, &label.updated_by);
    let mut queued = record_event::<D>(c, &moved).await?;
    if matches!(cause.kind, LabelMoveKind::Rollback | LabelMoveKind::GuardRollback) {
        let e = OutboxEvent::rolled_back(prompt, &label.name, label.version, previous, &label.updated_by, cause);
        queued |= record_event::<D>(c, &e).await?;
    }
    Ok(queued)
}

/// Moves a label; returns it with the version it pointed at before.
pub(super) async fn apply_move<D: Dialect>(
    c: &mut D::Connection,
    prompt_id: Uuid,
    mv: &LabelMove,
) -> StoreResult<(Label, Option<i64>)> {
    let current: Option<i64> =
        sql::<D>(&format!("SELECT version FROM labels WHERE prompt_id = $1 AND name = $2{}", D::lock(" FOR UPDATE")))
            .bind(prompt_id)
            .bind(mv.label.as_str())
            .value(c, "version")
            .await?;
    if mv.check_current && current != mv.expected_current {
        return Err(StoreError::Conflict);
    }
    require_version::<D>(c, prompt_id, mv.to_version).await?;
    let row = sql::<D>(
        "INSERT INTO labels (prompt_id, name, version, updated_at, updated_by) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (prompt_id, name) DO UPDATE SET version = excluded.version, updated_at = excluded.updated_at,
             updated_by = excluded.updated_by
         RETURNING name, version, updated_at, updated_by",
    )
    .bind(prompt_id)
    .bind(mv.label.as_str())
    .bind(mv.to_version)
    .bind(now())
    .bind(&mv.by)
    .fetch_one(c)
    .await?;
    Ok((label_from_row::<D>(&row)?, current))
}
