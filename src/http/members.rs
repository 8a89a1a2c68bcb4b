//! People's explicit grants over HTTP (scope `admin`): who, named by the
//! single sign-on provider's subject or an email address, holds which role
//! where, beside the grants their mapped groups give. The same as
//! `combee members` and the web UI's members page.

use axum::{Json, extract::State, http::StatusCode};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{
    AppState,
    error::ApiResult,
    extract::{ApiJson, ApiPath, ApiQuery, Authorized, scope},
};
use crate::{
    domain::{access::Role, people::Member},
    service::{audit::Audit, people},
};

#[derive(Debug, Serialize, ToSchema)]
pub struct MemberList {
    pub members: Vec<Member>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetMember {
    /// The project the role holds in; absent or null: every project (for a
    /// project's key: its own project).
    #[serde(default)]
    #[schema(pattern = "^[a-z0-9][a-z0-9._-]{0,63}$")]
    pub project: Option<String>,
    pub role: Role,
}

#[utoipa::path(get, path = "/v1/members", tag = "members", responses((status = 200, body = MemberList)),
    security(("bearer" = ["admin"])))]
pub async fn list_members(State(st): State<AppState>, caller: Authorized<scope::Admin>) -> ApiResult<Json<MemberList>> {
    Ok(Json(MemberList { members: people::list_members(&st, &caller.reach()).await? }))
}

#[utoipa::path(put, path = "/v1/members/{subject}", tag = "members", request_body = SetMember,
    params(("subject" = String, Path, description = "the provider's subject (`sub`) or an email address")),
    responses((status = 200, body = Member), (status = 422, body = super::error::Problem)),
    security(("bearer" = ["admin"])))]
pub async fn set_member(
    State(st): State<AppState>,
    caller: Authorized<scope::Admin>,
    ApiPath(subject): ApiPath<String>,
    ApiJson(req): ApiJson<SetMember>,
) -> ApiResult<(Audit, Json<Member>)> {
    let (member, before) = people::set_member(&st, &caller.reach(), &subject, req.project.as_deref(), req.role).await?;
    let project = member.project.clone();
    let audit = Audit::new("member.set", "member", &member.subject).before(before).in_project(project);
    Ok((audit, Json(member)))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RemoveMemberQuery {
    /// Only the grant in this project (a project's key: its own, whether named or not; a
    /// server-wide key without it removes every grant of the member).
    #[param(pattern = "^[a-z0-9][a-z0-9._-]{0,63}$")]
    pub project: Option<String>,
}

#[utoipa::path(delete, path = "/v1/members/{subject}", tag = "members",
    params(("subject" = String, Path, description = "the provider's subject (`sub`) or an email address"), RemoveMemberQuery),
    responses((status = 204), (status = 404, body = super::error::Problem)), security(("bearer" = ["admin"])))]
pub async fn remove_member(
    State(st): State<AppState>,
    caller: Authorized<scope::Admin>,
    ApiPath(subject): ApiPath<String>,
    ApiQuery(q): ApiQuery<RemoveMemberQuery>,
) -> ApiResult<(StatusCode, Audit)> {
    let removed = people::remove_member(&st, &caller.reach(), &subject, q.project.as_deref()).await?;
    // One grant is the entry's before, with its project; several are the whole server's.
    let audit = match &removed[..] {
        [one] => Audit::new("member.remove", "member", &subject).before(one).in_project(one.project.clone()),
        all => Audit::new("member.remove", "member", &subject).before(all),
    };
    Ok((StatusCode::NO_CONTENT, audit))
}
