//! The trace browser and one trace's page, with its actions.

use super::*;

#[derive(Deserialize)]
pub struct TracesQuery {
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    status: Option<String>,
    #[serde(default)]
    page_token: Option<String>,
}

/// A one-line preview of a JSON value (strings without their quotes).
fn preview(v: &Value, max: usize) -> String {
    match v {
        Value::Null => r#"<span class="muted">—</span>"#.to_owned(),
        Value::String(s) => clip(s, max),
        other => clip(&other.to_string(), max),
    }
}

pub async fn traces(State(st): State<AppState>, op: Operator, Query(q): Query<TracesQuery>) -> PageResult {
    op.require(Scope::PromptsRead)?;
    let prompt = match q.prompt.as_deref().filter(|s| !s.is_empty()) {
        Some(p) => Some(service::projects::prompt_in_reach(&st, &op.reach(), p).await?),
        None => None,
    };
    let status = match q.status.as_deref().filter(|s| !s.is_empty()) {
        Some(s) => Some(TraceStatus::parse(s).ok_or_else(|| {
            UiError::Service(ServiceError::BadRequest("status must be pending, consumed or failed".into()))
        })?),
        None => None,
    };
    let page_params = PageParams { page_size: Some(PAGE), page_token: q.page_token };
    let before_id = match page_params.cursor()? {
        Some(c) => {
            Some(Uuid::parse_str(&c).map_err(|_| UiError::Service(ServiceError::BadRequest("bad page token".into())))?)
        }
        None => None,
    };
    let projects = crate::domain::project::list_filter(&op.reach(), None);
    let project = projects.project().map(str::to_owned);
    let filter = TraceFilter { prompt: prompt.clone(), project, status, since: None, until: None, before_id };
    let list = service::traces::list_traces(&st, &filter, PAGE).await?;
    let next = next_token(&list, PAGE, |t| t.id.to_string());

    let all_prompts = service::prompts::list_prompts(&st, &projects, None, 200).await?;
    let prompt_options: String = all_prompts
        .iter()
        .map(|p| {
            let sel = if prompt.as_ref() == Some(&p.prompt.name) { " selected" } else { "" };
            format!(r#"<option value="{0}"{sel}>{0}</option>"#, escape(p.prompt.name.as_str()))
        })
        .collect();
    let status_options: String = ["pending", "consumed", "failed", "quarantined"]
        .iter()
        .map(|s| {
            let sel = if status.map(TraceStatus::as_str) == Some(*s) { " selected" } else { "" };
            format!(r#"<option value="{s}"{sel}>{s}</option>"#)
        })
        .collect();

    let mut rows = String::new();
    for t in &list {
        let fb = &t.feedback;
        let outcome = match (fb.success, fb.score) {
            (Some(true), s) => {
                format!(r#"<span class="ok-text">✓</span>{}"#, s.map_or_else(String::new, |s| format!(" {s:.2}")))
            }
            (Some(false), s) => {
                format!(r#"<span class="bad-text">✗</span>{}"#, s.map_or_else(String::new, |s| format!(" {s:.2}")))
            }
            (None, Some(s)) => format!("{s:.2}"),
            (None, None) => "—".to_owned(),
        };
        let _ = write!(
            rows,
            r#"<tr><td class="nowrap"><a href="/ui/traces/{}" title="{}">{}</a></td><td>{}</td><td class="num">{}</td><td>{}</td><td>{}</td><td class="preview">{}</td><td class="preview">{}</td><td class="nowrap">{}</td></tr>"#,
            t.id,
            t.id,
            short_id(t.id),
            prompt_link(&op, &t.prompt),
            t.prompt_version.map_or_else(|| "—".to_owned(), |v| format!("v{v}")),
            badge(t.status.as_str()),
            outcome,
            preview(&t.input, 80),
            preview(&t.output, 80),
            time(t.created_at)
        );
    }
    let pager = match next {
        Some(token) => {
            let mut href = format!("/ui/traces?page_token={}", url_encode(&token));
            if let Some(p) = &prompt {
                let _ = write!(href, "&prompt={}", in_path(&op, p));
            }
            if let Some(s) = status {
                let _ = write!(href, "&status={}", s.as_str());
            }
            format!(r#"<p class="pager"><a href="{}" id="next-page">Next page →</a></p>"#, escape(&href))
        }
        None => String::new(),
    };
    let table = if list.is_empty() {
        r#"<p class="muted" id="no-traces">No traces match.</p>"#.to_owned()
    } else {
        format!(
            r#"<table id="traces"><thead><tr><th>Trace</th><th>Prompt</th><th class="num">Version</th><th>Status</th><th>Feedback</th><th>Input</th><th>Output</th><th>Received</th></tr></thead><tbody>{rows}</tbody></table>{pager}"#
        )
    };
    let body = format!(
        r#"<h1>Traces</h1>
<form method="get" action="/ui/traces" class="filters card" id="trace-filters">
<label>Prompt <select name="prompt" id="filter-prompt"><option value="">all</option>{prompt_options}</select></label>
<label>Status <select name="status" id="filter-status"><option value="">any</option>{status_options}</select></label>
<button type="submit" id="filter-submit">Filter</button></form>
{table}"#
    );
    Ok(page("Traces", Some(&op.who()), NavSection::Traces, &body))
}

#[derive(Debug, Default, Deserialize)]
pub struct TraceNotice {
    #[serde(default)]
    notice: Option<String>,
}

/// The operator's label form (a score from 0 to 1 and a comment), for a key with `prompts:write`.
fn label_form(op: &Operator, t: &crate::domain::Trace) -> String {
    if !op.can(Scope::PromptsWrite) {
        return String::new();
    }
    format!(
        r#"<div class="card" id="label"><form method="post" action="/ui/traces/{id}/label" class="inline" id="label-form"><input type="hidden" name="csrf" value="{csrf}"><label>Your score <input type="number" name="score" min="0" max="1" step="0.01" required id="label-score"></label> <input type="text" name="comment" maxlength="2000" placeholder="what went wrong (optional)" id="label-comment"> <button type="submit" class="small" id="label-submit" title="Store as human feedback: it replaces a judged score and counts for calibration">Label</button></form></div>"#,
        id = t.id,
        csrf = escape(&op.session.csrf_token)
    )
}

/// What the prompt's evaluators said of the trace, one row each.
fn judgements(t: &crate::domain::Trace) -> String {
    let Some(j) = &t.judged else { return String::new() };
    let rows: String = j
        .judgements
        .iter()
        .map(|j| {
            format!(
                "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
                escape(&j.evaluator),
                j.score.map_or_else(|| "—".to_owned(), |s| format!("{s:.2}")),
                escape(j.critique.as_deref().or(j.error.as_deref()).unwrap_or(""))
            )
        })
        .collect();
    format!(
        r#"<h2>Evaluators</h2><table id="judgements"><tr><th>Evaluator</th><th>Score</th><th>Critique</th></tr>{rows}</table><p class="muted">Judged {}.</p>"#,
        time(j.at)
    )
}

/// The Quarantine (or Release) and Delete forms, for a key with `prompts:write` and a trace they apply to.
fn trace_actions(op: &Operator, t: &crate::domain::Trace) -> String {
    use crate::domain::TraceStatus;
    if !op.can(Scope::PromptsWrite) || t.status == TraceStatus::Consumed || t.round_id.is_some() {
        return String::new();
    }
    let csrf = format!(r#"<input type="hidden" name="csrf" value="{}">"#, escape(&op.session.csrf_token));
    let quarantine = if t.status == TraceStatus::Quarantined {
        format!(
            r#"<form method="post" action="/ui/traces/{id}/release" class="inline" id="release-form">{csrf}<button type="submit" class="small" id="release" title="Lift the quarantine: learn from this trace again">Release</button></form> "#,
            id = t.id
        )
    } else {
        format!(
            r#"<form method="post" action="/ui/traces/{id}/quarantine" class="inline" id="quarantine-form">{csrf}<input type="text" name="reason" maxlength="500" placeholder="reason (optional)" id="quarantine-reason"> <button type="submit" class="small" id="quarantine" title="Hold this trace back from learning">Quarantine</button></form> "#,
            id = t.id
        )
    };
    format!(
        r#"<div class="card" id="trace-actions">{quarantine}<form method="post" action="/ui/traces/{id}/delete" class="inline">{csrf}<button type="submit" class="small secondary" id="delete-trace" title="Delete this trace for good">Delete</button></form></div>"#,
        id = t.id
    )
}

/// "Pin as regression case", for a key with `prompts:write` and a trace that
/// succeeded (its output is the example the case keeps); any trace can be
/// pinned with checks of the operator's through the API.
fn pin_form(op: &Operator, t: &crate::domain::Trace) -> String {
    if !op.can(Scope::PromptsWrite) || t.feedback.success != Some(true) {
        return String::new();
    }
    format!(
        r#"<div class="card" id="pin-actions"><form method="post" action="/ui/traces/{id}/pin" class="inline" id="pin-form"><input type="hidden" name="csrf" value="{}"><button type="submit" class="small" id="pin" title="Keep this input as a regression case: a learned version's reply must equal this output">Pin as regression case</button></form></div>"#,
        escape(&op.session.csrf_token),
        id = t.id
    )
}

/// Who wrote the feedback shown.
fn feedback_title(source: Option<crate::domain::trace::FeedbackSource>) -> &'static str {
    use crate::domain::trace::FeedbackSource;
    match source {
        Some(FeedbackSource::Judge) => "Feedback (judged by the prompt's evaluators)",
        Some(FeedbackSource::Human) => "Feedback (an operator's label)",
        _ => "Feedback",
    }
}

pub async fn trace(
    State(st): State<AppState>,
    op: Operator,
    Path(id): Path<String>,
    Query(q): Query<TraceNotice>,
) -> PageResult {
    op.require(Scope::PromptsRead)?;
    let id = Uuid::parse_str(&id).map_err(|_| UiError::NotFound("No such trace: ids are UUIDs.".into()))?;
    let t = service::traces::get_trace(&st, id).await.map_err(|e| match e {
        ServiceError::NotFound(_) => UiError::NotFound(format!("Trace {id} not found.")),
        other => other.into(),
    })?;
    let section =
        |title: &str, v: &Value| format!(r#"<h2>{}</h2><pre class="json">{}</pre>"#, escape(title), pretty(v));
    let feedback = serde_json::to_value(&t.feedback).unwrap_or_default();
    let body = format!(
        r#"<h1>Trace <code>{}</code></h1>
<div class="card"><dl class="facts" id="trace-facts">
<dt>Prompt</dt><dd>{}</dd><dt>Version</dt><dd>{}</dd><dt>Status</dt><dd>{}</dd><dt>Round</dt><dd>{}</dd>
<dt>Attempts</dt><dd>{}</dd><dt>Failure</dt><dd>{}</dd><dt>External id</dt><dd>{}</dd>
<dt>Received</dt><dd>{}</dd><dt>Updated</dt><dd>{}</dd><dt>Quarantine</dt><dd id="quarantine-info">{}</dd></dl></div>
{}{}{}
<p class="muted">Trace content is shown as the agent sent it (untrusted data).</p>
{}{}{}{}{}{}"#,
        t.id,
        prompt_link(&op, &t.prompt),
        t.prompt_version.map_or_else(|| "—".to_owned(), |v| format!("v{v}")),
        badge(t.status.as_str()),
        t.round_id.map_or_else(|| "—".to_owned(), |r| round_link(r, &short_id(r))),
        t.attempts,
        t.failure_reason.as_deref().map_or_else(|| "—".to_owned(), escape),
        t.external_id.as_deref().map_or_else(|| "—".to_owned(), escape),
        time(t.created_at),
        time(t.updated_at),
        match (t.quarantined_at, t.quarantine_reason.as_deref()) {
            (Some(at), reason) => format!("{} — {}", time(at), escape(reason.unwrap_or(""))),
            _ => "—".to_owned(),
        },
        match q.notice.as_deref() {
            Some("quarantined") =>
                r#"<p class="notice ok" id="notice">Quarantined: no round will learn from this trace.</p>"#,
            Some("released") => r#"<p class="notice ok" id="notice">Released: rounds learn from this trace again.</p>"#,
            Some("pinned") => {
                r#"<p class="notice ok" id="notice">Pinned: this trace's input is now a regression case of its prompt.</p>"#
            }
            Some("labelled") =>
                r#"<p class="notice ok" id="notice">Labelled: your score is the trace's feedback now.</p>"#,
            _ => "",
        },
        trace_actions(&op, &t),
        pin_form(&op, &t),
        section("Input", &t.input),
        section("Trajectory", &t.trajectory),
        section("Output", &t.output),
        section(feedback_title(t.feedback_source), &feedback) + &judgements(&t) + &label_form(&op, &t),
        t.reflection.as_ref().map_or_else(String::new, |r| section("Agent's reflection", r)),
        section("Metadata", &t.metadata),
    );
    Ok(page(&format!("Trace {}", short_id(t.id)), Some(&op.who()), NavSection::Traces, &body))
}
