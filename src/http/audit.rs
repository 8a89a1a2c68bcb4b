//! The audit log over HTTP: the write request's side of the middleware
//! ([`Pending`]: started for every audited write in `observe.rs`, appended
//! once it succeeded), and `GET /v1/audit`, the log read back newest first
//! with filters and cursor paging (admin scope).

use std::net::SocketAddr;

use axum::{
    Json,
    body::{Body, HttpBody as _},
    extract::{ConnectInfo, Request, State},
    http::header,
    response::Response,
};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{
    AppState,
    error::{ApiError, ApiResult},
    extract::{ApiQuery, Authorized, scope},
};
use crate::{
    domain::audit::{AuditEntry, AuditQuery, RequestOrigin},
    service::{
        audit::{self, Audit, AuditSlot, Refused},
        pagination::{PageParams, next_token},
    },
};

/// The largest JSON answer kept as an entry's `after`; a larger one is left out.
const MAX_AFTER_BYTES: u64 = 256 * 1024;

/// An audited write request in flight: its actor slot (in the request's
/// extensions, for the authentication step to fill), its client and route.
pub struct Pending {
    slot: AuditSlot,
    client_addr: Option<String>,
    route: String,
}

impl Pending {
    pub fn start(req: &mut Request, route: String) -> Self {
        let slot = AuditSlot::default();
        req.extensions_mut().insert(slot.clone());
        let client_addr = req.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0.ip().to_string());
        Self { slot, client_addr, route }
    }

    /// Whether `res` answers a change that happened: a status below 400 not marked [`Refused`].
    pub fn succeeded(res: &Response) -> bool {
        res.status().as_u16() < 400 && res.extensions().get::<Refused>().is_none()
    }

    /// Appends the entry of the successful answer `res`, and gives `res` back.
    pub async fn record(self, st: AppState, method: String, request_id: Option<String>, res: Response) -> Response {
        let origin = RequestOrigin {
            request_id,
            client_addr: self.client_addr,
            method: Some(method),
            route: Some(self.route),
            status: Some(res.status().as_u16()),
        };
        let (mut parts, body) = res.into_parts();
        let change = parts.extensions.remove::<Audit>();
        let json = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/json"));
        let wanted = json
            && change.as_ref().is_none_or(|c| c.after.is_none())
            && body.size_hint().exact().is_some_and(|n| n <= MAX_AFTER_BYTES);
        let (body, answer) = if wanted {
            match axum::body::to_bytes(body, MAX_AFTER_BYTES as usize).await {
                Ok(bytes) => {
                    let answer = serde_json::from_slice(&bytes).ok();
                    (Body::from(bytes), answer)
                }
                // A full body of a known size does not fail to read.
                Err(_) => (Body::empty(), None),
            }
        } else {
            (body, None)
        };
        audit::record_request(&st, &self.slot, origin, change, answer).await;
        Response::from_parts(parts, body)
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct AuditFilter {
    /// The actor: an API key's id, or an actor's name (a key's name, `retention`, an OS user).
    pub actor: Option<String>,
    /// e.g. `key.create`, `label.move`, `retention.run`.
    pub action: Option<String>,
    /// e.g. `prompt`, `label`, `key`, `webhook`, `trace`.
    pub resource_type: Option<String>,
    pub resource_id: Option<String>,
    /// RFC 3339; entries at or after it.
    #[serde(default, deserialize_with = "crate::http::extract::bounded_time")]
    pub since: Option<DateTime<Utc>>,
    /// RFC 3339; entries before it.
    #[serde(default, deserialize_with = "crate::http::extract::bounded_time")]
    pub until: Option<DateTime<Utc>>,
    /// Only entries concerning this project (a project's key sees only its own anyway).
    pub project: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AuditPage {
    /// Newest first.
    pub entries: Vec<AuditEntry>,
    pub next_page_token: Option<String>,
}

/// Filters are short: longer is not a value the log holds.
fn short(what: &str, v: Option<String>) -> ApiResult<Option<String>> {
    match v {
        Some(s) if s.is_empty() || s.len() > 200 => {
            Err(ApiError::unprocessable(format!("`{what}` must be 1 to 200 characters")))
        }
        other => Ok(other),
    }
}

#[utoipa::path(get, path = "/v1/audit", tag = "audit", params(AuditFilter, PageParams),
    responses((status = 200, body = AuditPage), (status = 400, body = super::error::Problem),
        (status = 422, body = super::error::Problem)),
    security(("bearer" = ["admin"])))]
/// The audit log, newest first: every change made through the API, the web
/// UI or the command line, and every retention run that deleted something —
/// who, when, from where, what, and the values before and after (secrets redacted).
pub async fn audit_log(
    State(st): State<AppState>,
    caller: Authorized<scope::Admin>,
    ApiQuery(filter): ApiQuery<AuditFilter>,
    ApiQuery(page): ApiQuery<PageParams>,
) -> ApiResult<Json<AuditPage>> {
    let before_id = match page.cursor()? {
        Some(c) => Some(c.parse::<i64>().map_err(|_| ApiError::bad_request("bad `page_token`".into()))?),
        None => None,
    };
    if let (Some(since), Some(until)) = (filter.since, filter.until)
        && since > until
    {
        return Err(ApiError::unprocessable("`since` is after `until`".into()));
    }
    let query = AuditQuery {
        actor: short("actor", filter.actor)?,
        action: short("action", filter.action)?,
        resource_type: short("resource_type", filter.resource_type)?,
        resource_id: short("resource_id", filter.resource_id)?,
        since: filter.since,
        until: filter.until,
        before_id,
        project: None,
    };
    let projects = crate::domain::project::list_filter(&caller.reach(), filter.project.as_deref());
    let size = page.size(st.settings.limits.max_page_size);
    let entries = audit::list(&st, &projects, query, size).await?;
    let next_page_token = next_token(&entries, size, |e| e.id.to_string());
    Ok(Json(AuditPage { entries, next_page_token }))
}
