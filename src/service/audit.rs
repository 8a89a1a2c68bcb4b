//! The audit log's one door: how a change becomes exactly one entry. For the
//! API and the web UI the request middleware (`http/observe.rs`) does it after
//! every successful write request: it puts an [`AuditSlot`] in the request,
//! which the authentication step fills with the caller ([`AuditSlot::set_actor`]),
//! and reads what the handler says about its change — an [`Audit`] the
//! handler returns beside its answer (it lands in the response's extensions)
//! — then appends the entry with [`record_request`]. The command line and the
//! worker append theirs with [`record`]. Reading: [`list`].

use std::sync::{Arc, Mutex};

use axum::response::{IntoResponse, IntoResponseParts, Response, ResponseParts};
use serde::Serialize;
use serde_json::Value;

use super::{AppState, ServiceResult};
use crate::domain::{
    Trace,
    audit::{Actor, AuditEntry, AuditQuery, NewAuditEntry, RequestOrigin},
    project::ListFilter,
};
use crate::store::DynStore;

/// A write request's place for its actor: the middleware inserts it into the
/// request's extensions, the authentication extractors fill it.
#[derive(Clone, Default)]
pub struct AuditSlot(Arc<Mutex<Option<Actor>>>, Arc<Mutex<Option<String>>>);

impl AuditSlot {
    pub fn set_actor(&self, actor: Actor) {
        if let Ok(mut slot) = self.0.lock() {
            *slot = Some(actor);
        }
    }

    pub fn actor(&self) -> Option<Actor> {
        self.0.lock().ok().and_then(|slot| slot.clone())
    }

    /// The project the request concerns: the caller's own, or that of the
    /// resource its path names (filled by the reach check).
    pub fn set_project(&self, project: String) {
        if let Ok(mut slot) = self.1.lock() {
            *slot = Some(project);
        }
    }

    pub fn project(&self) -> Option<String> {
        self.1.lock().ok().and_then(|slot| slot.clone())
    }
}

/// What a handler says about the change it made: the action, the resource,
/// and the values before and after. Returned beside the answer
/// (`Ok((audit, Json(view)))`), it goes into the response's extensions, where
/// the middleware reads it. Without [`Audit::after`], the entry's `after` is
/// the JSON answer itself; a route that returns none still gets its entry,
/// named by method and route.
#[derive(Debug, Clone, Default)]
pub struct Audit {
    pub action: String,
    pub resource_type: String,
    pub resource_id: String,
    pub before: Option<Value>,
    pub after: Option<Value>,
    /// The actor, for a route that authenticates by itself (sign-in, signed webhooks).
    pub by: Option<Actor>,
    /// The project the change concerns, when the request's path and caller do not say.
    pub project: Option<String>,
}

impl Audit {
    pub fn new(action: &str, resource_type: &str, resource_id: impl ToString) -> Self {
        Self {
            action: action.into(),
            resource_type: resource_type.into(),
            resource_id: resource_id.to_string(),
            ..Self::default()
        }
    }

    /// The value before the change (leave it out for a creation).
    pub fn before(mut self, value: impl Serialize) -> Self {
        self.before = serde_json::to_value(value).ok().filter(|v| !v.is_null());
        self
    }

    /// The value after the change, when the answer is not it.
    pub fn after(mut self, value: impl Serialize) -> Self {
        self.after = serde_json::to_value(value).ok().filter(|v| !v.is_null());
        self
    }

    pub fn by(mut self, actor: Actor) -> Self {
        self.by = Some(actor);
        self
    }

    pub fn in_project(mut self, project: Option<String>) -> Self {
        self.project = project;
        self
    }
}

impl IntoResponseParts for Audit {
    type Error = std::convert::Infallible;

    fn into_response_parts(self, mut res: ResponseParts) -> Result<ResponseParts, Self::Error> {
        res.extensions_mut().insert(self);
        Ok(res)
    }
}

/// Marks an answer that refused the request although its status is below
/// 400 (the web UI sends a request without a valid session to the sign-in
/// page with a redirect): no entry, as for any failure.
#[derive(Debug, Clone, Copy)]
pub struct Refused;

/// An answer of its own: empty, with the audit in its extensions (`(StatusCode::NO_CONTENT, audit)`).
impl IntoResponse for Audit {
    fn into_response(self) -> Response {
        (self, ()).into_response()
    }
}

/// Appends the entry of one successful write request: the actor from the
/// slot (or the handler's [`Audit::by`]), the origin, and the handler's
/// [`Audit`]; `answer` (the JSON body, if any) is `after` when the handler
/// gave none. Never fails the request: see [`record`].
pub async fn record_request(
    st: &AppState,
    slot: &AuditSlot,
    origin: RequestOrigin,
    audit: Option<Audit>,
    answer: Option<Value>,
) {
    let project = audit.as_ref().and_then(|a| a.project.clone()).or_else(|| slot.project());
    let entry = match audit {
        Some(a) => {
            let actor = a.by.or_else(|| slot.actor()).unwrap_or(Actor::Unknown);
            NewAuditEntry::new(
                actor,
                origin,
                a.action,
                Some(a.resource_type),
                Some(a.resource_id),
                a.before,
                a.after.or(answer),
            )
        }
        None => {
            let action =
                format!("{} {}", origin.method.as_deref().unwrap_or("?"), origin.route.as_deref().unwrap_or("?"));
            NewAuditEntry::new(slot.actor().unwrap_or(Actor::Unknown), origin, action, None, None, None, answer)
        }
    };
    let entry = entry.in_project(project);
    record(&st.store, &entry).await;
}

/// Appends `entry`. The change it describes is already committed, so a store
/// that refuses the entry does not undo it: the write is tried three times,
/// then logged as an error and counted in `combee_audit_write_failures_total`.
pub async fn record(store: &DynStore, entry: &NewAuditEntry) {
    for attempt in 0..3u64 {
        match store.append_audit(entry).await {
            Ok(_) => return,
            Err(e) if attempt == 2 => {
                metrics::counter!("combee_audit_write_failures_total").increment(1);
                tracing::error!(error = %e, action = %entry.action, "the audit entry of a change could not be written");
            }
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50 << (2 * attempt))).await,
        }
    }
}

/// Appends an entry a handler built itself (a change made by a GET, such as
/// a single sign-on callback, which the write middleware does not see).
pub async fn record_entry(st: &AppState, entry: &NewAuditEntry) {
    record(&st.store, entry).await;
}

/// Entries matching `query` of the projects `filter` shows, newest first. A
/// project's caller sees the entries naming its project only.
pub async fn list(
    st: &AppState,
    filter: &ListFilter,
    mut query: AuditQuery,
    limit: u32,
) -> ServiceResult<Vec<AuditEntry>> {
    query.project = match filter {
        ListFilter::Nothing => return Ok(Vec::new()),
        ListFilter::Project(p) => Some(p.clone()),
        ListFilter::All => None,
    };
    Ok(st.store.audit_entries(&query, limit).await?)
}

/// The command line's actor: the OS user running it.
pub fn cli_actor() -> Actor {
    let user = std::env::var("USER").or_else(|_| std::env::var("LOGNAME")).unwrap_or_else(|_| "unknown".into());
    Actor::Cli { user }
}

/// The change of one trace, as the audit log keeps it: its state (status,
/// quarantine, attempts), never its content — a deleted trace's input and
/// output must not live on in the log.
pub fn trace_change(action: &str, before: &Trace, after: Option<&Trace>) -> Audit {
    let audit = Audit::new(action, "trace", before.id).before(trace_state(before));
    match after {
        Some(after) => audit.after(trace_state(after)),
        None => audit,
    }
}

fn trace_state(t: &Trace) -> Value {
    serde_json::json!({
        "id": t.id,
        "prompt": t.prompt,
        "status": t.status,
        "attempts": t.attempts,
        "quarantined_at": t.quarantined_at,
        "quarantine_reason": t.quarantine_reason,
        "created_at": t.created_at,
    })
}
