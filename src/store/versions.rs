//! Versions of a prompt as rows: their columns and mapper, the insert, the
//! checks that versions exist, and the prompt id and name that every row
//! owned by a prompt is keyed by. Below the resources that build on them
//! (prompts, labels, rounds, traces, the population).

use chrono::{DateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

use super::{
    StoreError, StoreResult,
    sql::{Cols, Dialect, corrupt, opt_json, sql},
};
use crate::domain::{PromptName, Version, VersionContent, VersionSource, prompt::NewVersion};

/// A prompt's name as stored: its project and its name in it.
pub(super) fn prompt_name(project: &str, name: &str) -> StoreResult<PromptName> {
    PromptName::new(project, name).map_err(|_| corrupt("prompt name"))
}

/// The prompt's name of a row that selected `p.project AS prompt_project, p.name AS prompt_name`.
pub(super) fn prompt_name_of<D: Dialect>(r: &Cols<'_, D>) -> StoreResult<PromptName> {
    prompt_name(&r.get::<String>("prompt_project")?, &r.get::<String>("prompt_name")?)
}

pub(super) const VERSION_COLUMNS: &str = "p.project AS prompt_project, p.name AS prompt_name, v.number, v.parent, v.source, v.round_id, v.base, \
     v.playbook, v.content_hash, v.message, v.created_by, v.created_at";

pub(super) fn version_from_row<D: Dialect>(row: &D::Row) -> StoreResult<Version> {
    let r = Cols::<D>(row);
    let source: String = r.get("source")?;
    let playbook: Option<Value> = r.get("playbook")?;
    Ok(Version {
        prompt: prompt_name_of(&r)?,
        number: r.get("number")?,
        parent: r.get("parent")?,
        source: VersionSource::parse(&source).ok_or_else(|| corrupt("version source"))?,
        round_id: r.get("round_id")?,
        content: VersionContent {
            base: r.get("base")?,
            playbook: playbook.map(serde_json::from_value).transpose().map_err(|_| corrupt("playbook"))?,
        },
        content_hash: r.get("content_hash")?,
        message: r.get("message")?,
        created_by: r.get("created_by")?,
        created_at: r.get("created_at")?,
    })
}

/// Inserts version `number` of the prompt, created `at`.
pub(super) async fn insert_version<D: Dialect>(
    c: &mut D::Connection,
    prompt_id: Uuid,
    number: i64,
    v: &NewVersion,
    at: DateTime<Utc>,
) -> StoreResult<()> {
    let playbook =
        v.content.playbook.as_ref().map(serde_json::to_value).transpose().map_err(|_| corrupt("playbook"))?;
    sql::<D>(
        "INSERT INTO versions (prompt_id, number, parent, source, round_id, base, playbook, content_hash, message,
                               created_by, created_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
    )
    .bind(prompt_id)
    .bind(number)
    .bind(v.parent)
    .bind(v.source.as_str())
    .bind(v.round_id)
    .bind(&v.content.base)
    .bind(opt_json(playbook.as_ref()))
    .bind(v.content.hash())
    .bind(&v.message)
    .bind(&v.created_by)
    .bind(at)
    .execute(c)
    .await?;
    Ok(())
}

/// `Invalid("version N does not exist")` unless the prompt has version `number`.
pub(super) async fn require_version<D: Dialect>(
    c: &mut D::Connection,
    prompt_id: Uuid,
    number: i64,
) -> StoreResult<()> {
    let exists = sql::<D>("SELECT 1 AS one FROM versions WHERE prompt_id = $1 AND number = $2")
        .bind(prompt_id)
        .bind(number)
        .fetch_optional(c)
        .await?
        .is_some();
    if exists { Ok(()) } else { Err(StoreError::Invalid(format!("version {number} does not exist"))) }
}

/// [`require_version`] for several versions in one statement: `Invalid`
/// naming the first of `numbers` the prompt does not have.
pub(super) async fn require_versions<D: Dialect>(
    c: &mut D::Connection,
    prompt_id: Uuid,
    numbers: &[i64],
) -> StoreResult<()> {
    if numbers.is_empty() {
        return Ok(());
    }
    let list = (0..numbers.len()).map(|i| format!("${}", i + 2)).collect::<Vec<_>>().join(", ");
    let text = format!("SELECT number FROM versions WHERE prompt_id = $1 AND number IN ({list})");
    let mut q = sql::<D>(&text).bind(prompt_id);
    for n in numbers {
        q = q.bind(*n);
    }
    let found = q.map(c, |row| Cols::<D>(row).get::<i64>("number")).await?;
    match numbers.iter().find(|n| !found.contains(n)) {
        Some(missing) => Err(StoreError::Invalid(format!("version {missing} does not exist"))),
        None => Ok(()),
    }
}

pub(super) async fn prompt_id<D: Dialect>(c: &mut D::Connection, name: &PromptName) -> StoreResult<Uuid> {
    sql::<D>("SELECT id FROM prompts WHERE project = $1 AND name = $2")
        .bind(name.project())
        .bind(name.as_str())
        .value(c, "id")
        .await?
        .ok_or(StoreError::NotFound)
}
