//! The members page (admins only): the explicit grants people hold beside
//! their mapped groups, a form to give one, and a button to take one away —
//! the same operations as `/v1/members` and `combee members`.

use axum::{
    Form,
    extract::State,
    response::{IntoResponse, Redirect, Response},
};
use serde::Deserialize;

use super::{
    UiError,
    html::{self, NavSection, escape, time},
    session::Operator,
};
use crate::{
    domain::access::{Role, Scope},
    service::{AppState, ServiceError, audit::Audit, people},
};

pub async fn page(State(st): State<AppState>, op: Operator) -> Result<Response, UiError> {
    op.require(Scope::Admin)?;
    let members = people::list_members(&st, &op.reach()).await?;
    let csrf = escape(&op.session.csrf_token);
    let mut rows = String::new();
    for m in &members {
        rows.push_str(&format!(
            r#"<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td><td><form method="post" action="/ui/members/remove" class="inline"><input type="hidden" name="csrf" value="{csrf}"><input type="hidden" name="subject" value="{}"><input type="hidden" name="project" value="{}"><button type="submit" class="danger">Remove</button></form></td></tr>"#,
            escape(&m.subject),
            escape(m.project.as_deref().unwrap_or("every project")),
            m.role.as_str(),
            time(m.updated_at),
            escape(&m.subject),
            escape(m.project.as_deref().unwrap_or("")),
        ));
    }
    let roles: String = Role::ALL.iter().map(|r| format!(r#"<option value="{0}">{0}</option>"#, r.as_str())).collect();
    let body = format!(
        r#"<section class="card"><h1>Members</h1>
<p class="muted">Explicit grants, beside those the single sign-on groups give. A member is named by the provider's subject or an email address.</p>
<table id="members"><thead><tr><th>Subject or email</th><th>Project</th><th>Role</th><th>Changed</th><th></th></tr></thead><tbody>{rows}</tbody></table>
<h2>Give a role</h2>
<form method="post" action="/ui/members" id="member-form">
<input type="hidden" name="csrf" value="{csrf}">
<label for="subject">Subject or email</label><input type="text" id="subject" name="subject" required>
<label for="project">Project (empty: every project)</label><input type="text" id="project" name="project">
<label for="role">Role</label><select id="role" name="role">{roles}</select>
<button type="submit" id="member-save">Save</button>
</form></section>"#
    );
    Ok(html::page("Members", Some(&op.who()), NavSection::Members, &body).into_response())
}

#[derive(Deserialize)]
pub struct MemberForm {
    #[serde(default)]
    csrf: Option<String>,
    #[serde(default)]
    subject: String,
    #[serde(default)]
    project: String,
    #[serde(default)]
    role: String,
}

pub async fn set(State(st): State<AppState>, op: Operator, Form(f): Form<MemberForm>) -> Result<Response, UiError> {
    op.check_csrf(f.csrf.as_deref())?;
    op.require(Scope::Admin)?;
    let role = Role::parse(&f.role)
        .ok_or_else(|| UiError::Service(ServiceError::BadRequest("role must be viewer, operator or admin".into())))?;
    let project = Some(f.project.trim()).filter(|p| !p.is_empty());
    let (member, before) = people::set_member(&st, &op.reach(), f.subject.trim(), project, role).await?;
    let audit = Audit::new("member.set", "member", &member.subject).before(before).after(&member);
    Ok((audit, Redirect::to("/ui/members")).into_response())
}

#[derive(Deserialize)]
pub struct RemoveForm {
    #[serde(default)]
    csrf: Option<String>,
    #[serde(default)]
    subject: String,
    /// The project of the grant removed; empty: the server-wide grant.
    #[serde(default)]
    project: String,
}

pub async fn remove(State(st): State<AppState>, op: Operator, Form(f): Form<RemoveForm>) -> Result<Response, UiError> {
    op.check_csrf(f.csrf.as_deref())?;
    op.require(Scope::Admin)?;
    let project = Some(f.project.trim()).filter(|p| !p.is_empty());
    // The row's one grant: a server-wide one is removed by the server-wide session alone.
    let removed = match project {
        Some(p) => people::remove_member(&st, &op.reach(), &f.subject, Some(p)).await?,
        None => people::remove_grant(&st, &op.reach(), &f.subject).await?,
    };
    let audit = Audit::new("member.remove", "member", &f.subject).before(&removed);
    Ok((audit, Redirect::to("/ui/members")).into_response())
}
