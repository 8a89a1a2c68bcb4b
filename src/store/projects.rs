//! Projects: their rows and settings, and the question every reach check of
//! a trace or round asks the store — which project does it belong to (a
//! prompt's project is in its name).

use async_trait::async_trait;
use uuid::Uuid;

use super::{
    StoreResult,
    backend::{Backend, SqlStore},
    sql::{Cols, Dialect, corrupt, json, now, sql},
};
use crate::domain::project::{Project, ProjectSettings};

#[async_trait]
pub trait ProjectStore: Send + Sync {
    /// `AlreadyExists` when the name is taken.
    async fn create_project(&self, name: &str, settings: &ProjectSettings) -> StoreResult<Project>;
    async fn get_project(&self, name: &str) -> StoreResult<Option<Project>>;
    /// Every project, by name.
    async fn list_projects(&self) -> StoreResult<Vec<Project>>;
    /// `None` when there is no such project.
    async fn update_project_settings(&self, name: &str, settings: &ProjectSettings) -> StoreResult<Option<Project>>;
    /// The projects that hold a prompt named `name`, by name.
    async fn projects_holding(&self, name: &str) -> StoreResult<Vec<String>>;
    /// The project of the trace's prompt; `None` when there is no such trace.
    async fn trace_project(&self, trace: Uuid) -> StoreResult<Option<String>>;
    /// The project of the round's prompt; `None` when there is no such round.
    async fn round_project(&self, round: Uuid) -> StoreResult<Option<String>>;
}

const COLUMNS: &str = "name, settings, created_at";

#[async_trait]
impl<D: Backend> ProjectStore for SqlStore<D> {
    async fn create_project(&self, name: &str, settings: &ProjectSettings) -> StoreResult<Project> {
        let settings = serde_json::to_value(settings).map_err(|_| corrupt("project settings"))?;
        let row = sql::<D>(&format!(
            "INSERT INTO projects (name, settings, created_at) VALUES ($1, $2, $3) RETURNING {COLUMNS}"
        ))
        .bind(name)
        .bind(json(&settings))
        .bind(now())
        .fetch_one(&mut *self.writer.acquire().await?)
        .await?;
        project_from_row::<D>(&row)
    }

    async fn get_project(&self, name: &str) -> StoreResult<Option<Project>> {
        sql::<D>(&format!("SELECT {COLUMNS} FROM projects WHERE name = $1"))
            .bind(name)
            .fetch_optional(&mut *self.reader.acquire().await?)
            .await?
            .as_ref()
            .map(project_from_row::<D>)
            .transpose()
    }

    async fn list_projects(&self) -> StoreResult<Vec<Project>> {
        sql::<D>(&format!("SELECT {COLUMNS} FROM projects ORDER BY name"))
            .map(&mut *self.reader.acquire().await?, project_from_row::<D>)
            .await
    }

    async fn update_project_settings(&self, name: &str, settings: &ProjectSettings) -> StoreResult<Option<Project>> {
        let settings = serde_json::to_value(settings).map_err(|_| corrupt("project settings"))?;
        sql::<D>(&format!("UPDATE projects SET settings = $1 WHERE name = $2 RETURNING {COLUMNS}"))
            .bind(json(&settings))
            .bind(name)
            .fetch_optional(&mut *self.writer.acquire().await?)
            .await?
            .as_ref()
            .map(project_from_row::<D>)
            .transpose()
    }

    async fn projects_holding(&self, name: &str) -> StoreResult<Vec<String>> {
        sql::<D>("SELECT project FROM prompts WHERE name = $1 ORDER BY project")
            .bind(name)
            .map(&mut *self.reader.acquire().await?, |row| Cols::<D>(row).get("project"))
            .await
    }

    async fn trace_project(&self, trace: Uuid) -> StoreResult<Option<String>> {
        sql::<D>("SELECT p.project FROM traces t JOIN prompts p ON p.id = t.prompt_id WHERE t.id = $1")
            .bind(trace)
            .value(&mut *self.reader.acquire().await?, "project")
            .await
    }

    async fn round_project(&self, round: Uuid) -> StoreResult<Option<String>> {
        sql::<D>("SELECT p.project FROM rounds r JOIN prompts p ON p.id = r.prompt_id WHERE r.id = $1")
            .bind(round)
            .value(&mut *self.reader.acquire().await?, "project")
            .await
    }
}

fn project_from_row<D: Dialect>(row: &D::Row) -> StoreResult<Project> {
    let r = Cols::<D>(row);
    Ok(Project {
        name: r.get("name")?,
        settings: serde_json::from_value(r.get("settings")?).map_err(|_| corrupt("project settings"))?,
        created_at: r.get("created_at")?,
    })
}
