//! People signed in through single sign-on: their sessions (kept by the hash
//! of their cookie token), the explicit grants admins give them, and the
//! sign-ins under way (taken once by their callback).

use async_trait::async_trait;
use serde_json::Value;

use super::{
    StoreError, StoreResult,
    backend::{Backend, SqlStore},
    sessions::{delete_session, sweep_expired},
    sql::{Cols, Dialect, json, now, sql},
};
use crate::domain::{
    access::Role,
    people::{Grant, Member, NewPersonSession, PendingLogin, Person, PersonSession},
};

#[async_trait]
pub trait PeopleStore: Send + Sync {
    /// Opens a person's session, and deletes expired ones on the way.
    async fn create_person_session(&self, session: &NewPersonSession) -> StoreResult<()>;
    /// The unexpired person session with this token hash.
    async fn person_session(&self, token_hash: &str) -> StoreResult<Option<PersonSession>>;
    /// Sets the grant in use; false when there is no such session.
    async fn set_person_grant(&self, token_hash: &str, grant: &Grant) -> StoreResult<bool>;
    /// False when there was no such session.
    async fn delete_person_session(&self, token_hash: &str) -> StoreResult<bool>;

    /// Every explicit grant, by subject, then project (server-wide first).
    async fn list_members(&self) -> StoreResult<Vec<Member>>;
    /// Creates or replaces a member's grant in `grant.project` (absent:
    /// server-wide); a person may hold one in each project. The grant before
    /// in that place, if any.
    async fn put_member(&self, subject: &str, grant: &Grant) -> StoreResult<(Member, Option<Member>)>;
    /// Removes the member's grant in `project` (`None`: the server-wide one),
    /// if there was one.
    async fn delete_member(&self, subject: &str, project: Option<&str>) -> StoreResult<Option<Member>>;
    /// Removes every grant of the member; those removed.
    async fn delete_members(&self, subject: &str) -> StoreResult<Vec<Member>>;
    /// The members named by this subject or (case-insensitively) this email.
    async fn members_for(&self, subject: &str, email: Option<&str>) -> StoreResult<Vec<Member>>;

    /// Keeps a sign-in under way, and deletes expired ones on the way.
    async fn save_login(&self, login: &PendingLogin) -> StoreResult<()>;
    /// Takes (deletes and returns) the unexpired sign-in with this state hash.
    async fn take_login(&self, state_hash: &str) -> StoreResult<Option<PendingLogin>>;
}

fn role_of(s: &str) -> StoreResult<Role> {
    Role::parse(s).ok_or_else(|| StoreError::Corrupt(format!("unknown role {s:?}")))
}

fn member_from_row<D: Dialect>(row: &D::Row) -> StoreResult<Member> {
    let r = Cols::<D>(row);
    Ok(Member {
        subject: r.get("subject")?,
        project: r.get("project")?,
        role: role_of(&r.get::<String>("role")?)?,
        created_at: r.get("created_at")?,
        updated_at: r.get("updated_at")?,
    })
}

const MEMBER_COLS: &str = "subject, project, role, created_at, updated_at";

/// The grant of `$1` in the place `$2` names (NULL: server-wide).
const IN_PLACE: &str = "(project = $2 OR (project IS NULL AND $2 IS NULL))";

#[async_trait]
impl<D: Backend> PeopleStore for SqlStore<D> {
    async fn create_person_session(&self, s: &NewPersonSession) -> StoreResult<()> {
        let grants = serde_json::to_value(&s.grants).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let mut tx = self.begin_write().await?;
        sweep_expired::<D>(&mut tx, "person_sessions").await?;
        sql::<D>(
            "INSERT INTO person_sessions (token_hash, subject, name, email, grants, project, role, csrf_token,
                                          created_at, expires_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(&s.token_hash)
        .bind(&s.person.subject)
        .bind(&s.person.name)
        .bind(s.person.email.as_deref())
        .bind(json(&grants))
        .bind(s.current.as_ref().and_then(|g| g.project.as_deref()))
        .bind(s.current.as_ref().map(|g| g.role.as_str()))
        .bind(&s.csrf_token)
        .bind(now())
        .bind(s.expires_at)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn person_session(&self, token_hash: &str) -> StoreResult<Option<PersonSession>> {
        let row = sql::<D>(
            "SELECT subject, name, email, grants, project, role, csrf_token, created_at, expires_at
             FROM person_sessions WHERE token_hash = $1 AND expires_at > $2",
        )
        .bind(token_hash)
        .bind(now())
        .fetch_optional(&mut *self.reader.acquire().await?)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let r = Cols::<D>(&row);
        let grants: Value = r.get("grants")?;
        let grants: Vec<Grant> = serde_json::from_value(grants).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let current = match r.get::<Option<String>>("role")? {
            Some(role) => Some(Grant { project: r.get("project")?, role: role_of(&role)? }),
            None => None,
        };
        Ok(Some(PersonSession {
            person: Person { subject: r.get("subject")?, name: r.get("name")?, email: r.get("email")? },
            grants,
            current,
            csrf_token: r.get("csrf_token")?,
            created_at: r.get("created_at")?,
            expires_at: r.get("expires_at")?,
        }))
    }

    async fn set_person_grant(&self, token_hash: &str, grant: &Grant) -> StoreResult<bool> {
        let n = sql::<D>("UPDATE person_sessions SET project = $1, role = $2 WHERE token_hash = $3")
            .bind(grant.project.as_deref())
            .bind(grant.role.as_str())
            .bind(token_hash)
            .execute(&mut *self.writer.acquire().await?)
            .await?;
        Ok(n > 0)
    }

    async fn delete_person_session(&self, token_hash: &str) -> StoreResult<bool> {
        delete_session(self, "person_sessions", token_hash).await
    }

    async fn list_members(&self) -> StoreResult<Vec<Member>> {
        let rows = sql::<D>(&format!("SELECT {MEMBER_COLS} FROM members ORDER BY subject, coalesce(project, '')"))
            .fetch_all(&mut *self.reader.acquire().await?)
            .await?;
        rows.iter().map(member_from_row::<D>).collect()
    }

    async fn put_member(&self, subject: &str, grant: &Grant) -> StoreResult<(Member, Option<Member>)> {
        let mut tx = self.begin_write().await?;
        let before = sql::<D>(&format!("SELECT {MEMBER_COLS} FROM members WHERE subject = $1 AND {IN_PLACE}"))
            .bind(subject)
            .bind(grant.project.as_deref())
            .fetch_optional(&mut *tx)
            .await?
            .map(|r| member_from_row::<D>(&r))
            .transpose()?;
        let at = now();
        // Replaced in place (the key is the subject and where the role holds,
        // and a server-wide grant has no project to conflict on).
        let text = if before.is_some() {
            format!(
                "UPDATE members SET role = $3, updated_at = $4 WHERE subject = $1 AND {IN_PLACE}
                 RETURNING {MEMBER_COLS}"
            )
        } else {
            format!(
                "INSERT INTO members (subject, project, role, created_at, updated_at) VALUES ($1, $2, $3, $4, $4)
                 RETURNING {MEMBER_COLS}"
            )
        };
        let row = sql::<D>(&text)
            .bind(subject)
            .bind(grant.project.as_deref())
            .bind(grant.role.as_str())
            .bind(at)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok((member_from_row::<D>(&row)?, before))
    }

    async fn delete_member(&self, subject: &str, project: Option<&str>) -> StoreResult<Option<Member>> {
        sql::<D>(&format!("DELETE FROM members WHERE subject = $1 AND {IN_PLACE} RETURNING {MEMBER_COLS}"))
            .bind(subject)
            .bind(project)
            .fetch_optional(&mut *self.writer.acquire().await?)
            .await?
            .map(|r| member_from_row::<D>(&r))
            .transpose()
    }

    async fn delete_members(&self, subject: &str) -> StoreResult<Vec<Member>> {
        let rows = sql::<D>(&format!("DELETE FROM members WHERE subject = $1 RETURNING {MEMBER_COLS}"))
            .bind(subject)
            .fetch_all(&mut *self.writer.acquire().await?)
            .await?;
        let mut removed = rows.iter().map(member_from_row::<D>).collect::<StoreResult<Vec<_>>>()?;
        removed.sort_by(|a, b| a.project.cmp(&b.project));
        Ok(removed)
    }

    async fn members_for(&self, subject: &str, email: Option<&str>) -> StoreResult<Vec<Member>> {
        let rows = sql::<D>(&format!(
            "SELECT {MEMBER_COLS} FROM members WHERE subject = $1 OR ($2 IS NOT NULL AND lower(subject) = lower($2))
             ORDER BY subject"
        ))
        .bind(subject)
        .bind(email)
        .fetch_all(&mut *self.reader.acquire().await?)
        .await?;
        rows.iter().map(member_from_row::<D>).collect()
    }

    async fn save_login(&self, login: &PendingLogin) -> StoreResult<()> {
        let mut tx = self.begin_write().await?;
        sql::<D>("DELETE FROM oidc_logins WHERE expires_at <= $1").bind(now()).execute(&mut *tx).await?;
        sql::<D>("INSERT INTO oidc_logins (state_hash, nonce, verifier, expires_at) VALUES ($1, $2, $3, $4)")
            .bind(&login.state_hash)
            .bind(&login.nonce)
            .bind(&login.verifier)
            .bind(login.expires_at)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn take_login(&self, state_hash: &str) -> StoreResult<Option<PendingLogin>> {
        let row = sql::<D>(
            "DELETE FROM oidc_logins WHERE state_hash = $1 AND expires_at > $2
             RETURNING state_hash, nonce, verifier, expires_at",
        )
        .bind(state_hash)
        .bind(now())
        .fetch_optional(&mut *self.writer.acquire().await?)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let r = Cols::<D>(&row);
        Ok(Some(PendingLogin {
            state_hash: r.get("state_hash")?,
            nonce: r.get("nonce")?,
            verifier: r.get("verifier")?,
            expires_at: r.get("expires_at")?,
        }))
    }
}
