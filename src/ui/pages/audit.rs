//! The audit log page (admin keys only): every change, newest first, with
//! filters by actor, action and resource, and the values before and after.

use super::*;
use crate::domain::audit::AuditQuery;

#[derive(Deserialize)]
pub struct AuditPageQuery {
    #[serde(default)]
    actor: Option<String>,
    #[serde(default)]
    action: Option<String>,
    #[serde(default)]
    resource_type: Option<String>,
    #[serde(default)]
    resource_id: Option<String>,
    #[serde(default)]
    page_token: Option<String>,
}

/// A filter as typed: blank is none; longer than the log holds is refused.
fn filter(what: &str, v: Option<String>) -> Result<Option<String>, UiError> {
    match v.map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()) {
        Some(s) if s.len() > 200 => {
            Err(UiError::Service(ServiceError::BadRequest(format!("`{what}` must be at most 200 characters"))))
        }
        other => Ok(other),
    }
}

fn change(v: Option<&Value>) -> String {
    match v {
        None => r#"<span class="muted">—</span>"#.to_owned(),
        Some(v) => {
            format!("<details><summary>{}</summary><pre>{}</pre></details>", clip(&v.to_string(), 60), pretty(v))
        }
    }
}

pub async fn audit(State(st): State<AppState>, op: Operator, Query(q): Query<AuditPageQuery>) -> PageResult {
    op.require(Scope::Admin)?;
    let page_params = PageParams { page_size: Some(PAGE), page_token: q.page_token };
    let before_id = match page_params.cursor()? {
        Some(c) => {
            Some(c.parse::<i64>().map_err(|_| UiError::Service(ServiceError::BadRequest("bad page token".into())))?)
        }
        None => None,
    };
    let query = AuditQuery {
        actor: filter("actor", q.actor)?,
        action: filter("action", q.action)?,
        resource_type: filter("resource_type", q.resource_type)?,
        resource_id: filter("resource_id", q.resource_id)?,
        before_id,
        ..AuditQuery::default()
    };
    let projects = crate::domain::project::list_filter(&op.reach(), None);
    let entries = service::audit::list(&st, &projects, query.clone(), PAGE).await?;
    let next = next_token(&entries, PAGE, |e| e.id.to_string());

    let mut rows = String::new();
    for e in &entries {
        let actor = match &e.actor_id {
            Some(id) => format!(
                r#"{} <span class="muted" title="{}">{}</span>"#,
                escape(&e.actor_name),
                escape(id),
                escape(&e.actor_type)
            ),
            None => format!(r#"{} <span class="muted">{}</span>"#, escape(&e.actor_name), escape(&e.actor_type)),
        };
        let resource = match (&e.resource_type, &e.resource_id) {
            (Some(t), Some(id)) => format!("{} <code>{}</code>", escape(t), escape(id)),
            (Some(t), None) => escape(t),
            _ => "—".to_owned(),
        };
        let route = match (&e.method, &e.route) {
            (Some(m), Some(r)) => format!("<code>{} {}</code>", escape(m), escape(r)),
            _ => r#"<span class="muted">—</span>"#.to_owned(),
        };
        let from =
            [e.client_addr.as_deref(), e.request_id.as_deref()].into_iter().flatten().map(escape).collect::<Vec<_>>();
        let _ = write!(
            rows,
            r#"<tr><td class="num">{}</td><td class="nowrap">{}</td><td>{actor}</td><td><code>{}</code></td><td>{resource}</td><td>{route}</td><td class="nowrap">{}</td><td>{}</td><td>{}</td></tr>"#,
            e.id,
            time(e.at),
            escape(&e.action),
            from.join("<br>"),
            change(e.before.as_ref()),
            change(e.after.as_ref()),
        );
    }
    let value = |v: &Option<String>| escape(v.as_deref().unwrap_or(""));
    let pager = match next {
        Some(token) => {
            let mut href = format!("/ui/audit?page_token={}", url_encode(&token));
            for (name, v) in [
                ("actor", &query.actor),
                ("action", &query.action),
                ("resource_type", &query.resource_type),
                ("resource_id", &query.resource_id),
            ] {
                if let Some(v) = v {
                    let _ = write!(href, "&{name}={}", url_encode(v));
                }
            }
            format!(r#"<p class="pager"><a href="{}" id="next-page">Next page →</a></p>"#, escape(&href))
        }
        None => String::new(),
    };
    let table = if entries.is_empty() {
        r#"<p class="muted" id="no-entries">No entries match.</p>"#.to_owned()
    } else {
        format!(
            r#"<table id="audit"><thead><tr><th class="num">#</th><th>When</th><th>Who</th><th>Action</th><th>Resource</th><th>Route</th><th>From</th><th>Before</th><th>After</th></tr></thead><tbody>{rows}</tbody></table>{pager}"#
        )
    };
    let body = format!(
        r#"<h1>Audit log</h1>
<p class="muted">Every change made through the API, this UI or the command line, and every retention run that deleted something; secrets are never shown.</p>
<form method="get" action="/ui/audit" class="filters card" id="audit-filters">
<label>Actor <input type="text" name="actor" value="{}" id="filter-actor" placeholder="key id or name"></label>
<label>Action <input type="text" name="action" value="{}" id="filter-action" placeholder="e.g. label.move"></label>
<label>Resource <input type="text" name="resource_type" value="{}" id="filter-resource-type" placeholder="e.g. prompt"></label>
<label>Id <input type="text" name="resource_id" value="{}" id="filter-resource-id"></label>
<button type="submit" id="filter-submit">Filter</button></form>
{table}"#,
        value(&query.actor),
        value(&query.action),
        value(&query.resource_type),
        value(&query.resource_id),
    );
    Ok(page("Audit log", Some(&op.who()), NavSection::Audit, &body))
}
