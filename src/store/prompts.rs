//! Prompts and their immutable versions: create, read, list, change settings, append a version with
//! its label moves, resolve a selector.

use async_trait::async_trait;
use serde_json::Value;
use uuid::Uuid;

use super::{
    Change, StoreError, StoreKind, StoreResult,
    backend::{Backend, SqlStore},
    labels::{apply_move, record_history, record_move, version_move_kind},
    sql::{Cols, Dialect, corrupt, enum_str, json, now, sql},
    versions::{VERSION_COLUMNS, insert_version, prompt_name, version_from_row},
    webhooks::record_event,
};
use crate::domain::{
    LabelMoveKind, LabelName, MoveCause, Prompt, PromptName, PromptSettings, Version,
    event::OutboxEvent,
    label::{LabelMove, Resolved, Selector},
    prompt::{NewPrompt, NewVersion, PromptSummary},
};

/// Prompts and their immutable, numbered versions.
#[async_trait]
pub trait PromptStore: Send + Sync {
    /// Creates the prompt and its version 1, labelled `production` (a `create`
    /// entry in the label history).
    async fn create_prompt(&self, prompt: NewPrompt, first: NewVersion) -> StoreResult<(Prompt, Version)>;
    async fn get_prompt(&self, name: &PromptName) -> StoreResult<Option<Prompt>>;
    /// Replaces a prompt's settings if they still equal `expected` (`Conflict`
    /// otherwise: read again and retry); `None` when the prompt does not exist.
    async fn update_prompt_settings(
        &self,
        name: &PromptName,
        expected: &PromptSettings,
        new: &PromptSettings,
    ) -> StoreResult<Option<Prompt>>;
    /// Prompts ordered by name, then project, starting after `after`, each
    /// with its production version and pending traces (what people list
    /// them by). Only `project`'s prompts when given.
    async fn list_prompts(
        &self,
        after: Option<&PromptName>,
        project: Option<&str>,
        limit: u32,
    ) -> StoreResult<Vec<PromptSummary>>;
    /// Prompts ordered by name, then project, starting after `after`: the
    /// prompts alone, without counting their traces (what the periodic jobs
    /// walk, at a cost that does not grow with a backlog).
    async fn prompts_page(&self, after: Option<&PromptName>, limit: u32) -> StoreResult<Vec<Prompt>>;
    /// Appends a version (number = previous + 1, never a gap or a duplicate) and
    /// applies the label moves in the same transaction. A failed CAS rolls all back.
    /// The moves enter the label history as `rollback` when the version's source
    /// is `rollback`, as `promote` otherwise, with the version's message as reason.
    async fn create_version(
        &self,
        prompt: &PromptName,
        version: NewVersion,
        moves: &[LabelMove],
    ) -> StoreResult<Version>;
    async fn resolve(&self, prompt: &PromptName, selector: &Selector) -> StoreResult<Option<Resolved>>;
    /// Versions newest first, with numbers below `before`.
    async fn list_versions(&self, prompt: &PromptName, before: Option<i64>, limit: u32) -> StoreResult<Vec<Version>>;
}

#[async_trait]
impl<D: Backend> PromptStore for SqlStore<D> {
    async fn create_prompt(&self, p: NewPrompt, first: NewVersion) -> StoreResult<(Prompt, Version)> {
        let id = Uuid::now_v7();
        let created_at = now();
        let mut tx = self.begin_write().await?;
        let settings = serde_json::to_value(&p.settings).map_err(|_| corrupt("settings"))?;
        sql::<D>(
            "INSERT INTO prompts (id, name, strategy, promotion, settings, version_count, created_at, created_by, project)
             VALUES ($1, $2, $3, $4, $5, 1, $6, $7, $8)",
        )
        .bind(id)
        .bind(p.name.as_str())
        .bind(enum_str(p.strategy))
        .bind(enum_str(p.promotion))
        .bind(json(&settings))
        .bind(created_at)
        .bind(&p.created_by)
        .bind(p.name.project())
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
            project: p.name.project().to_owned(),
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
        self.commit(tx, Change::prompt(&prompt.name)).await?;
        self.announce_outbox(queued);
        Ok((prompt, version))
    }

    async fn get_prompt(&self, name: &PromptName) -> StoreResult<Option<Prompt>> {
        sql::<D>(
            "SELECT id, name, project, strategy, promotion, settings, created_at, created_by FROM prompts
             WHERE project = $1 AND name = $2",
        )
        .bind(name.project())
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
        let mut tx = self.begin_write().await?;
        let current: Option<Value> = sql::<D>(&format!(
            "SELECT settings FROM prompts WHERE project = $1 AND name = $2{}",
            D::lock(" FOR UPDATE")
        ))
        .bind(name.project())
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
            "UPDATE prompts SET settings = $1 WHERE project = $3 AND name = $2
             RETURNING id, name, project, strategy, promotion, settings, created_at, created_by",
        )
        .bind(json(&new))
        .bind(name.as_str())
        .bind(name.project())
        .fetch_one(&mut tx)
        .await?;
        tx.commit().await?;
        prompt_from_row::<D>(&row).map(Some)
    }

    async fn list_prompts(
        &self,
        after: Option<&PromptName>,
        project: Option<&str>,
        limit: u32,
    ) -> StoreResult<Vec<PromptSummary>> {
        // A prompt's pending traces are its backlog and what its rounds hold,
        // each counted in the partial index that holds only those (SQLite is
        // told which: without statistics it would walk the prompt's traces).
        let (backlog, reserved) = match D::KIND {
            StoreKind::Sqlite => (" INDEXED BY traces_backlog", " INDEXED BY traces_reserved"),
            StoreKind::Postgres => ("", ""),
        };
        let text = format!(
            "SELECT p.id, p.name, p.project, p.strategy, p.promotion, p.settings, p.created_at, p.created_by, p.version_count,
                    (SELECT version FROM labels l WHERE l.prompt_id = p.id AND l.name = 'production') AS production_version,
                    (SELECT count(*) FROM traces t{backlog}
                      WHERE t.prompt_id = p.id AND t.status = 'pending' AND t.round_id IS NULL AND t.quarantined_at IS NULL)
                    + (SELECT count(*) FROM traces t{reserved}
                      WHERE t.prompt_id = p.id AND t.status = 'pending' AND t.round_id IS NOT NULL
                        AND t.quarantined_at IS NULL) AS pending
             FROM prompts p
             WHERE ($1 IS NULL OR p.name > $1 OR (p.name = $1 AND p.project > $4)) AND ($3 IS NULL OR p.project = $3)
             ORDER BY p.name, p.project LIMIT $2"
        );
        sql::<D>(&text)
            .bind(after.map(PromptName::as_str))
            .bind(i64::from(limit))
            .bind(project)
            .bind(after.map(PromptName::project))
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

    async fn prompts_page(&self, after: Option<&PromptName>, limit: u32) -> StoreResult<Vec<Prompt>> {
        let (filter, limit_param) =
            if after.is_some() { ("WHERE name > $1 OR (name = $1 AND project > $2)", "$3") } else { ("", "$1") };
        let text = format!(
            "SELECT id, name, project, strategy, promotion, settings, created_at, created_by FROM prompts {filter}
             ORDER BY name, project LIMIT {limit_param}"
        );
        let mut q = sql::<D>(&text);
        if let Some(after) = after {
            q = q.bind(after.as_str()).bind(after.project());
        }
        q.bind(i64::from(limit)).map(&mut *self.reader.acquire().await?, prompt_from_row::<D>).await
    }

    async fn create_version(&self, prompt: &PromptName, v: NewVersion, moves: &[LabelMove]) -> StoreResult<Version> {
        let created_at = now();
        let mut tx = self.begin_write().await?;
        let row = sql::<D>(
            "UPDATE prompts SET version_count = version_count + 1 WHERE project = $1 AND name = $2
             RETURNING id, version_count",
        )
        .bind(prompt.project())
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
        self.commit(tx, Change::prompt(prompt)).await?;
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
                 JOIN versions v ON v.prompt_id = l.prompt_id AND v.number = l.version
                 WHERE p.name = $1 AND p.project = $3 AND l.name = $2"
            }
            Selector::Latest => {
                "prompts p JOIN versions v ON v.prompt_id = p.id AND v.number = p.version_count
                 WHERE p.name = $1 AND p.project = $2"
            }
            Selector::Version(_) => {
                "prompts p JOIN versions v ON v.prompt_id = p.id AND v.number = $2 WHERE p.name = $1 AND p.project = $3"
            }
        };
        let text = format!("SELECT {VERSION_COLUMNS}, {labels} FROM {from}");
        let query = sql::<D>(&text).bind(prompt.as_str());
        let query = match selector {
            Selector::Label(label) => query.bind(label.as_str()),
            Selector::Latest => query,
            Selector::Version(n) => query.bind(*n),
        }
        .bind(prompt.project());
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
        // The cursor is in the text only when given (no `$2 IS NULL OR …`), so a
        // page deep in a long history starts at the cursor in the index.
        // The prompt is matched on `versions` itself, so Postgres walks its key
        // back from the newest and stops at the limit; matched by the joined
        // name, it sorted every version of the prompt for each page (the newest
        // version: 334 blocks with 408 versions, 7 this way).
        let (cursor, limit_param) = if before.is_some() { ("AND v.number < $3", "$4") } else { ("", "$3") };
        let text = format!(
            "SELECT {VERSION_COLUMNS} FROM versions v JOIN prompts p ON p.id = v.prompt_id
             WHERE v.prompt_id = (SELECT id FROM prompts WHERE project = $1 AND name = $2) {cursor}
             ORDER BY v.number DESC LIMIT {limit_param}"
        );
        let mut q = sql::<D>(&text).bind(prompt.project()).bind(prompt.as_str());
        if let Some(before) = before {
            q = q.bind(before);
        }
        q.bind(i64::from(limit)).map(&mut *self.reader.acquire().await?, version_from_row::<D>).await
    }
}

pub(super) fn prompt_from_row<D: Dialect>(row: &D::Row) -> StoreResult<Prompt> {
    let r = Cols::<D>(row);
    Ok(Prompt {
        id: r.get("id")?,
        name: prompt_name(&r.get::<String>("project")?, &r.get::<String>("name")?)?,
        project: r.get("project")?,
        strategy: serde_json::from_value(Value::String(r.get("strategy")?)).map_err(|_| corrupt("strategy"))?,
        promotion: serde_json::from_value(Value::String(r.get("promotion")?)).map_err(|_| corrupt("promotion"))?,
        settings: serde_json::from_value(r.get("settings")?).map_err(|_| corrupt("settings"))?,
        created_at: r.get("created_at")?,
        created_by: r.get("created_by")?,
    })
}
