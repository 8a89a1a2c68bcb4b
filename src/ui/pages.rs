//! The UI's read-only pages: prompts, one prompt (text, labels, history,
//! promote / roll back forms), a diff, rounds, one round, the batch-size
//! controller, and the trace browser. GET handlers never change state.

use std::fmt::Write;

use axum::{
    extract::{Path, Query, State},
    response::Html,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use super::{
    UiError,
    html::{Section, badge, clip, duration_ms, escape, opt_time, page, time, url_encode},
    plot,
    session::Operator,
};
use crate::{
    domain::{
        LabelName, Strategy, TraceStatus,
        diff::{LineTag, SectionBullet},
        round::{Round, method_str, strategy_str},
    },
    service::{
        AppState, ServiceError,
        controller::controller_view,
        pagination::{PageParams, next_token},
        prompts::{existing_prompt, version_diff},
        rounds::round_view,
    },
    store::{Scope, Selector, TraceFilter},
};

type PageResult = Result<Html<String>, UiError>;

const PAGE: u32 = 50;

/// A serde enum's wire name (`"auto"`, `"reflector"`, …).
fn word<T: Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(Value::String(s)) => s,
        _ => "?".to_owned(),
    }
}

fn prompt_link(name: &str) -> String {
    format!(r#"<a href="/ui/prompts/{}">{}</a>"#, escape(&url_encode(name)), escape(name))
}

fn round_link(id: Uuid, text: &str) -> String {
    format!(r#"<a href="/ui/rounds/{id}" title="{id}">{}</a>"#, escape(text))
}

/// The last 8 hex digits: ids are UUIDv7, whose first digits are a timestamp
/// shared by everything made in the same millisecond.
fn short_id(id: Uuid) -> String {
    let hex = id.simple().to_string();
    hex[hex.len() - 8..].to_owned()
}

fn pretty(v: &Value) -> String {
    escape(&serde_json::to_string_pretty(v).unwrap_or_default())
}

fn round_duration_ms(r: &Round) -> Option<f64> {
    Some((r.finished_at? - r.started_at?).num_milliseconds() as f64)
}

fn prompt_tabs(name: &str, current: &str) -> String {
    let n = escape(&url_encode(name));
    let tab = |href: String, label: &str, key: &str| {
        let class = if key == current { r#" class="current""# } else { "" };
        format!(r#"<a href="{href}"{class}>{label}</a>"#)
    };
    format!(
        r#"<nav class="tabs">{}{}{}{}</nav>"#,
        tab(format!("/ui/prompts/{n}"), "Versions", "prompt"),
        tab(format!("/ui/prompts/{n}/rounds"), "Rounds", "rounds"),
        tab(format!("/ui/prompts/{n}/controller"), "Controller", "controller"),
        tab(format!("/ui/traces?prompt={n}"), "Traces", "traces"),
    )
}

// ---------------------------------------------------------------- prompts

#[derive(Deserialize)]
pub struct AfterQuery {
    #[serde(default)]
    after: Option<String>,
}

pub async fn prompts(State(st): State<AppState>, op: Operator, Query(q): Query<AfterQuery>) -> PageResult {
    op.require(Scope::PromptsRead)?;
    let list = st.store.list_prompts(q.after.as_deref(), PAGE).await?;
    let mut rows = String::new();
    for p in &list {
        let last = st.store.list_rounds(Some(&p.prompt.name), None, 1).await?;
        let last = last.first().map_or_else(
            || r#"<span class="muted">none yet</span>"#.to_owned(),
            |r| {
                format!(
                    "{} {}",
                    badge(r.status.as_str()),
                    round_link(r.id, &r.created_at.format("%Y-%m-%d %H:%M").to_string())
                )
            },
        );
        let _ = write!(
            rows,
            r#"<tr><td class="name">{}</td><td>{}</td><td>{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td>{}</td></tr>"#,
            prompt_link(p.prompt.name.as_str()),
            escape(strategy_str(p.prompt.strategy)),
            escape(&word(&p.prompt.promotion)),
            p.production_version.map_or_else(|| "—".to_owned(), |v| format!("v{v}")),
            p.latest_version,
            p.pending_traces,
            last
        );
    }
    let more = match list.last() {
        Some(last) if list.len() as u32 == PAGE => {
            format!(
                r#"<p class="pager"><a href="/ui/prompts?after={}">Next page →</a></p>"#,
                escape(&url_encode(last.prompt.name.as_str()))
            )
        }
        _ => String::new(),
    };
    let table = if list.is_empty() {
        r#"<p class="muted">No prompts yet. Create one with <code>POST /v1/prompts</code>.</p>"#.to_owned()
    } else {
        format!(
            r#"<table id="prompts"><thead><tr><th>Name</th><th>Strategy</th><th>Promotion</th><th class="num">Production</th><th class="num">Latest</th><th class="num">Pending traces</th><th>Last round</th></tr></thead><tbody>{rows}</tbody></table>{more}"#
        )
    };
    let body = format!(r#"<h1>Prompts</h1>{table}"#);
    Ok(page("Prompts", Some(&op.who()), Section::Prompts, &body))
}

#[derive(Deserialize)]
pub struct PromptQuery {
    #[serde(default)]
    before: Option<i64>,
    #[serde(default)]
    notice: Option<String>,
    #[serde(default)]
    v: Option<i64>,
}

/// Label moves the prompt page shows.
const LABEL_MOVES_SHOWN: u32 = 20;
/// Newest moves of `production` marked on the reward chart.
const REWARD_MARKERS_SHOWN: u32 = 100;

pub async fn prompt(
    State(st): State<AppState>,
    op: Operator,
    Path(name): Path<String>,
    Query(q): Query<PromptQuery>,
) -> PageResult {
    op.require(Scope::PromptsRead)?;
    let prompt = existing_prompt(&st, &name).await?;
    let production = st.store.resolve(&prompt.name, &Selector::Label(LabelName::production())).await?;
    let labels = st.store.list_labels(&prompt.name).await?;
    let versions = st.store.list_versions(&prompt.name, q.before, PAGE).await?;
    let latest = st.store.resolve(&prompt.name, &Selector::Latest).await?.map_or(0, |r| r.version.number);
    let prod_number = production.as_ref().map(|r| r.version.number);
    let can_promote = op.can(Scope::PromptsPromote);
    let n = escape(&url_encode(prompt.name.as_str()));

    // Only fixed messages; the number is parsed, never echoed as text.
    let notice = match (q.notice.as_deref(), q.v) {
        (Some("promoted"), Some(v)) => {
            format!(r#"<p class="notice ok" id="notice">Version {v} is now production.</p>"#)
        }
        (Some("rolled_back"), Some(v)) => {
            format!(
                r#"<p class="notice ok" id="notice">Rolled back: version {v} is a copy of the chosen version and is now production.</p>"#
            )
        }
        _ => String::new(),
    };

    let mut label_list = String::new();
    for l in &labels {
        let _ = write!(
            label_list,
            r#"<li>{} → <strong>v{}</strong><span class="meta">by {} · {}</span></li>"#,
            badge(l.name.as_str()),
            l.version,
            escape(&l.updated_by),
            time(l.updated_at)
        );
    }

    let text = production.as_ref().map_or_else(
        || r#"<p class="muted">No version is labelled production.</p>"#.to_owned(),
        |r| {
            format!(
                r#"<h2>Production text <span class="muted">(v{})</span></h2><pre class="prompt-text" id="production-text">{}</pre>"#,
                r.version.number,
                escape(&r.version.content.render())
            )
        },
    );

    // Diff form: every version number up to the latest.
    let options = |selected: i64| {
        (1..=latest)
            .rev()
            .map(|v| format!(r#"<option value="{v}"{}>v{v}</option>"#, if v == selected { " selected" } else { "" }))
            .collect::<String>()
    };
    let diff_form = if latest >= 2 {
        format!(
            r#"<form method="get" action="/ui/prompts/{n}/diff" class="diff-form card" id="diff-form"><strong>Compare</strong>
<label>from <select name="from" id="diff-from">{}</select></label>
<label>to <select name="to" id="diff-to">{}</select></label>
<button type="submit" id="diff-submit">Show diff</button></form>"#,
            options(prod_number.unwrap_or(1).min(latest - 1).max(1)),
            options(latest)
        )
    } else {
        String::new()
    };

    let mut rows = String::new();
    for v in &versions {
        let vlabels: String = labels.iter().filter(|l| l.version == v.number).map(|l| badge(l.name.as_str())).collect();
        let round = v.round_id.map_or_else(|| "—".to_owned(), |id| round_link(id, &short_id(id)));
        let mut actions = String::new();
        if can_promote
            && let Some(prod) = prod_number
            && v.number != prod
        {
            let hidden = format!(
                r#"<input type="hidden" name="csrf" value="{}"><input type="hidden" name="version" value="{}"><input type="hidden" name="expected" value="{prod}">"#,
                escape(&op.session.csrf_token),
                v.number
            );
            let _ = write!(
                actions,
                r#"<form method="post" action="/ui/prompts/{n}/promote" class="inline">{hidden}<button type="submit" class="small" id="promote-{0}" title="Point production at v{0}">Promote</button></form>
<form method="post" action="/ui/prompts/{n}/rollback" class="inline">{hidden}<button type="submit" class="small secondary" id="rollback-{0}" title="Copy v{0}'s content into a new version and make it production">Roll back to</button></form>"#,
                v.number
            );
        }
        let _ = write!(
            rows,
            r#"<tr id="version-{}"><td class="num"><strong>v{}</strong></td><td>{}</td><td>{}</td><td>{}</td><td class="message">{}</td><td>{}</td><td class="nowrap">{}</td><td class="actions">{}</td></tr>"#,
            v.number,
            v.number,
            vlabels,
            escape(v.source.as_str()),
            round,
            clip(&v.message, 160),
            escape(&v.created_by),
            time(v.created_at),
            actions
        );
    }
    let older = match versions.last() {
        Some(last) if versions.len() as u32 == PAGE && last.number > 1 => {
            format!(r#"<p class="pager"><a href="/ui/prompts/{n}?before={}">Older versions →</a></p>"#, last.number)
        }
        _ => String::new(),
    };
    // Reward over the last 7 days per version (at most the 6 newest with traces).
    let until = chrono::Utc::now();
    let buckets = st.store.version_outcomes(&prompt.name, until - chrono::Duration::days(7), until, 3_600).await?;
    let outcomes = crate::evaluate::outcomes::summarize(&buckets, |v| {
        labels.iter().filter(|l| l.version == v).map(|l| l.name.as_str().to_owned()).collect()
    });
    let shown: Vec<(String, Vec<(i64, f64)>)> = outcomes
        .iter()
        .take(6)
        .map(|o| {
            let name = match (o.version, o.labels.is_empty()) {
                (Some(v), true) => format!("v{v}"),
                (Some(v), false) => format!("v{v} ({})", o.labels.join(", ")),
                (None, _) => "no version".to_owned(),
            };
            let points =
                o.series.iter().filter_map(|p| Some((p.start.timestamp(), p.success_rate.or(p.mean_score)?))).collect();
            (name, points)
        })
        .collect();
    let series: Vec<plot::RewardSeries<'_>> =
        shown.iter().map(|(name, points)| plot::RewardSeries { name, points }).collect();
    // Production's promotions and rollbacks inside the chart's 7 days, as markers.
    let markers: Vec<plot::RewardMarker> = st
        .store
        .label_history(&prompt.name, Some(&LabelName::production()), None, REWARD_MARKERS_SHOWN)
        .await?
        .iter()
        .filter(|m| m.at >= until - chrono::Duration::days(7))
        .filter_map(plot::RewardMarker::for_move)
        .collect();
    let reward_chart = plot::reward_plot(&series, &markers).unwrap_or_else(|| {
        r#"<p class="muted" id="reward-empty">No rewarded traces in the last 7 days.</p>"#.to_owned()
    });
    // The newest label moves: who or what moved which label, and why.
    let moves = st.store.label_history(&prompt.name, None, None, LABEL_MOVES_SHOWN).await?;
    let mut move_rows = String::new();
    for m in &moves {
        let version = |v: Option<i64>| v.map_or_else(|| "—".to_owned(), |v| format!("v{v}"));
        let evidence = m.evidence.as_ref().map_or_else(String::new, |e| {
            format!(r#"<details><summary>numbers</summary><pre class="json">{}</pre></details>"#, pretty(e))
        });
        let _ = write!(
            move_rows,
            r#"<tr id="move-{}" class="move-{}"><td class="nowrap">{}</td><td>{}</td><td class="nowrap">{} → {}</td><td>{}</td><td>{}</td><td class="message">{}{}</td></tr>"#,
            m.id,
            m.kind.as_str(),
            time(m.at),
            badge(m.label.as_str()),
            version(m.from_version),
            version(m.to_version),
            escape(m.kind.as_str()),
            escape(&m.actor),
            clip(&m.reason, 300),
            evidence
        );
    }
    let label_history = if moves.is_empty() {
        r#"<p class="muted" id="label-history-empty">No label move recorded yet (moves before label history existed are not shown).</p>"#.to_owned()
    } else {
        format!(
            r#"<table id="label-history" class="compact"><thead><tr><th>Time</th><th>Label</th><th>Move</th><th>Kind</th><th>By</th><th>Why</th></tr></thead><tbody>{move_rows}</tbody></table>"#
        )
    };
    let promote_note = if can_promote {
        ""
    } else {
        r#"<p class="muted">Promoting and rolling back need the <code>prompts:promote</code> scope.</p>"#
    };
    let body = format!(
        r#"<h1>{name} <span class="muted small">{strategy} · promotion {promotion}</span></h1>
{tabs}{notice}
<div class="split"><div class="main-col">{text}</div>
<aside class="card"><h2>Labels</h2><ul class="labels" id="labels">{label_list}</ul></aside></div>
{diff_form}
<h2>Version history</h2>{promote_note}
<table id="versions"><thead><tr><th class="num">Version</th><th>Labels</th><th>Source</th><th>Round</th><th>Message</th><th>By</th><th>Time</th><th></th></tr></thead><tbody>{rows}</tbody></table>{older}
<h2>Reward by version <span class="muted small">last 7 days, hourly</span></h2>{reward_chart}
<h2>Label history <span class="muted small">newest {LABEL_MOVES_SHOWN}; all of them: <code>combee prompts label-history</code></span></h2>{label_history}"#,
        name = escape(prompt.name.as_str()),
        strategy = escape(strategy_str(prompt.strategy)),
        promotion = escape(&word(&prompt.promotion)),
        tabs = prompt_tabs(prompt.name.as_str(), "prompt"),
    );
    Ok(page(prompt.name.as_str(), Some(&op.who()), Section::Prompts, &body))
}

// ---------------------------------------------------------------- diff

#[derive(Deserialize)]
pub struct DiffQuery {
    #[serde(default)]
    from: Option<i64>,
    #[serde(default)]
    to: Option<i64>,
}

/// Equal runs longer than this fold, keeping `CONTEXT` lines each side.
const FOLD: usize = 8;
const CONTEXT: usize = 3;

fn bullet(b: &SectionBullet) -> String {
    format!(
        r#"<code>{}</code> <span class="muted">[{}]</span> {} <span class="muted">(+{} / −{})</span>"#,
        escape(&b.bullet.id),
        escape(&b.section),
        escape(&b.bullet.content),
        b.bullet.helpful,
        b.bullet.harmful
    )
}

pub async fn diff(
    State(st): State<AppState>,
    op: Operator,
    Path(name): Path<String>,
    Query(q): Query<DiffQuery>,
) -> PageResult {
    op.require(Scope::PromptsRead)?;
    let prompt = existing_prompt(&st, &name).await?;
    let (Some(from), Some(to)) = (q.from, q.to) else {
        return Err(UiError::Service(ServiceError::BadRequest("choose two versions (`from` and `to`)".into())));
    };
    let d = version_diff(&st, &prompt, from, to).await?;
    let latest = st.store.resolve(&prompt.name, &Selector::Latest).await?.map_or(0, |r| r.version.number);
    let n = escape(&url_encode(prompt.name.as_str()));
    let options = |selected: i64| {
        (1..=latest)
            .rev()
            .map(|v| format!(r#"<option value="{v}"{}>v{v}</option>"#, if v == selected { " selected" } else { "" }))
            .collect::<String>()
    };

    // Lines, with long unchanged stretches folded.
    let mut lines = String::new();
    let (mut added, mut removed) = (0, 0);
    let mut i = 0;
    while i < d.lines.len() {
        if d.lines[i].tag == LineTag::Equal {
            let start = i;
            while i < d.lines.len() && d.lines[i].tag == LineTag::Equal {
                i += 1;
            }
            let run = &d.lines[start..i];
            let (head, tail) = (if start == 0 { 0 } else { CONTEXT }, if i == d.lines.len() { 0 } else { CONTEXT });
            if run.len() > FOLD.max(head + tail) {
                for l in &run[..head] {
                    let _ = write!(lines, r#"<tr class="eq"><td class="sign"> </td><td>{}</td></tr>"#, escape(&l.text));
                }
                let _ = write!(
                    lines,
                    r#"<tr class="fold"><td class="sign">⋯</td><td>{} unchanged lines</td></tr>"#,
                    run.len() - head - tail
                );
                for l in &run[run.len() - tail..] {
                    let _ = write!(lines, r#"<tr class="eq"><td class="sign"> </td><td>{}</td></tr>"#, escape(&l.text));
                }
            } else {
                for l in run {
                    let _ = write!(lines, r#"<tr class="eq"><td class="sign"> </td><td>{}</td></tr>"#, escape(&l.text));
                }
            }
            continue;
        }
        let l = &d.lines[i];
        let (class, sign) = if l.tag == LineTag::Insert {
            added += 1;
            ("ins", "+")
        } else {
            removed += 1;
            ("del", "−")
        };
        let _ = write!(lines, r#"<tr class="{class}"><td class="sign">{sign}</td><td>{}</td></tr>"#, escape(&l.text));
        i += 1;
    }

    let playbook = match (&d.playbook, prompt.strategy) {
        (Some(pb), Strategy::Playbook) => {
            let list = |items: &[SectionBullet], class: &str, id: &str| {
                if items.is_empty() {
                    format!(r#"<p class="muted" id="{id}">none</p>"#)
                } else {
                    format!(
                        r#"<ul class="bullets {class}" id="{id}">{}</ul>"#,
                        items.iter().map(|b| format!("<li>{}</li>", bullet(b))).collect::<String>()
                    )
                }
            };
            let changed = if pb.changed.is_empty() {
                r#"<p class="muted" id="bullets-changed">none</p>"#.to_owned()
            } else {
                format!(
                    r#"<ul class="bullets changed" id="bullets-changed">{}</ul>"#,
                    pb.changed
                        .iter()
                        .map(|c| format!(
                            r#"<li><div class="del">{}</div><div class="ins">{}</div></li>"#,
                            bullet(&c.before),
                            bullet(&c.after)
                        ))
                        .collect::<String>()
                )
            };
            format!(
                r#"<h2>Playbook bullets</h2><div class="bullet-diff">
<section><h3>Added ({})</h3>{}</section>
<section><h3>Removed ({})</h3>{}</section>
<section><h3>Changed ({})</h3>{changed}</section></div>"#,
                pb.added.len(),
                list(&pb.added, "ins", "bullets-added"),
                pb.removed.len(),
                list(&pb.removed, "del", "bullets-removed"),
                pb.changed.len(),
            )
        }
        _ => String::new(),
    };
    let body = format!(
        r#"<h1>{} <span class="muted small">diff v{} → v{}</span></h1>
{tabs}
<form method="get" action="/ui/prompts/{n}/diff" class="diff-form card" id="diff-form"><strong>Compare</strong>
<label>from <select name="from" id="diff-from">{}</select></label>
<label>to <select name="to" id="diff-to">{}</select></label>
<button type="submit" id="diff-submit">Show diff</button></form>
<p class="diff-stats" id="diff-stats"><span class="ins-count">+{added}</span> <span class="del-count">−{removed}</span> lines</p>
{playbook}
<h2>Rendered text</h2>
<table class="diff" id="diff"><tbody>{lines}</tbody></table>"#,
        escape(prompt.name.as_str()),
        d.from,
        d.to,
        options(d.from),
        options(d.to),
        tabs = prompt_tabs(prompt.name.as_str(), ""),
    );
    Ok(page(&format!("{} diff", prompt.name.as_str()), Some(&op.who()), Section::Prompts, &body))
}

// ---------------------------------------------------------------- rounds

#[derive(Deserialize)]
pub struct BeforeIdQuery {
    #[serde(default)]
    before: Option<Uuid>,
}

pub async fn rounds(
    State(st): State<AppState>,
    op: Operator,
    Path(name): Path<String>,
    Query(q): Query<BeforeIdQuery>,
) -> PageResult {
    op.require(Scope::PromptsRead)?;
    let prompt = existing_prompt(&st, &name).await?;
    let list = st.store.list_rounds(Some(&prompt.name), q.before, PAGE).await?;
    let mut rows = String::new();
    for r in &list {
        let result = match (r.result_version, &r.error) {
            (Some(v), _) => format!("v{v}"),
            (None, Some(e)) => format!(r#"<span class="bad-text">{}</span>"#, clip(e, 80)),
            _ => "—".to_owned(),
        };
        let _ = write!(
            rows,
            r#"<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td>{}</td></tr>"#,
            round_link(r.id, &r.created_at.format("%Y-%m-%d %H:%M:%S").to_string()),
            badge(r.status.as_str()),
            escape(r.trigger.as_str()),
            escape(method_str(r.method)),
            r.n,
            r.k.map_or_else(|| "—".to_owned(), |k| k.to_string()),
            r.duplication,
            round_duration_ms(r).map_or_else(|| "—".to_owned(), duration_ms),
            result
        );
    }
    let n = escape(&url_encode(prompt.name.as_str()));
    let more = match list.last() {
        Some(last) if list.len() as u32 == PAGE => {
            format!(r#"<p class="pager"><a href="/ui/prompts/{n}/rounds?before={}">Older rounds →</a></p>"#, last.id)
        }
        _ => String::new(),
    };
    let table = if list.is_empty() {
        r#"<p class="muted">No rounds yet.</p>"#.to_owned()
    } else {
        format!(
            r#"<table id="rounds"><thead><tr><th>Created</th><th>Status</th><th>Trigger</th><th>Method</th><th class="num">n</th><th class="num">k</th><th class="num">p</th><th class="num">Duration</th><th>Result</th></tr></thead><tbody>{rows}</tbody></table>{more}"#
        )
    };
    let body = format!(
        r#"<h1>{} <span class="muted small">rounds</span></h1>{}{table}"#,
        escape(prompt.name.as_str()),
        prompt_tabs(prompt.name.as_str(), "rounds")
    );
    Ok(page(&format!("{} rounds", prompt.name.as_str()), Some(&op.who()), Section::Prompts, &body))
}

fn phase_bars(detail: &Value, origin: Option<chrono::DateTime<chrono::Utc>>) -> Vec<(String, f64, f64)> {
    let Some(phases) = detail.get("phases").and_then(Value::as_object) else { return Vec::new() };
    let parse = |v: Option<&Value>| {
        v.and_then(Value::as_str).and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok()).map(|t| t.to_utc())
    };
    let mut bars: Vec<_> = phases
        .iter()
        .filter_map(|(name, p)| {
            let start = parse(p.get("started_at"))?;
            let elapsed = p
                .get("elapsed_ms")
                .and_then(Value::as_f64)
                .or_else(|| parse(p.get("finished_at")).map(|f| (f - start).num_milliseconds() as f64))?;
            Some((name.clone(), start, elapsed))
        })
        .collect();
    bars.sort_by_key(|b| b.1);
    let origin = origin.or_else(|| bars.first().map(|b| b.1));
    bars.into_iter()
        .map(|(name, start, elapsed)| {
            let offset = origin.map_or(0.0, |o| (start - o).num_milliseconds().max(0) as f64);
            (name, offset, elapsed)
        })
        .collect()
}

fn op_row(op: &Value, extra: &str) -> String {
    let kind = op.get("op").and_then(Value::as_str).unwrap_or("?");
    let target = op.get("id").or_else(|| op.get("section")).and_then(Value::as_str).unwrap_or("");
    let content = op.get("content").and_then(Value::as_str).unwrap_or("");
    format!(
        r#"<tr><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td></tr>"#,
        badge(&kind.to_lowercase()),
        escape(target),
        clip(content, 200),
        extra
    )
}

pub async fn round(State(st): State<AppState>, op: Operator, Path(id): Path<String>) -> PageResult {
    op.require(Scope::PromptsRead)?;
    let id = Uuid::parse_str(&id).map_err(|_| UiError::NotFound("No such round: ids are UUIDs.".into()))?;
    let view = round_view(&st, id).await?;
    let r = &view.round;
    let detail = &r.detail;

    let result = match (r.result_version, &r.error) {
        (Some(v), _) => format!(
            r#"<a href="/ui/prompts/{}/diff?from={}&amp;to={v}" id="result-version">v{v}</a> <span class="muted">(diff against the base v{})</span>"#,
            escape(&url_encode(r.prompt.as_str())),
            r.base_version,
            r.base_version
        ),
        (None, Some(e)) => format!(r#"<span class="bad-text" id="round-error">{}</span>"#, escape(e)),
        _ => r#"<span class="muted">not yet</span>"#.to_owned(),
    };
    let summary = format!(
        r#"<dl class="facts" id="round-facts">
<dt>Prompt</dt><dd>{}</dd><dt>Status</dt><dd>{}</dd><dt>Result</dt><dd>{result}</dd>
<dt>Method</dt><dd>{}</dd><dt>Strategy</dt><dd>{}</dd><dt>Trigger</dt><dd>{}</dd>
<dt>n (traces)</dt><dd>{}</dd><dt>k (groups)</dt><dd>{}</dd><dt>p (duplication)</dt><dd>{}</dd>
<dt>Base version</dt><dd>v{}</dd><dt>Seed</dt><dd>{}</dd><dt>Attempt</dt><dd>{}</dd>
<dt>Created</dt><dd>{}</dd><dt>Started</dt><dd>{}</dd><dt>Finished</dt><dd>{}</dd><dt>Duration</dt><dd>{}</dd>
</dl>"#,
        prompt_link(r.prompt.as_str()),
        badge(r.status.as_str()),
        escape(method_str(r.method)),
        escape(strategy_str(r.strategy)),
        escape(r.trigger.as_str()),
        r.n,
        r.k.map_or_else(|| "—".to_owned(), |k| k.to_string()),
        r.duplication,
        r.base_version,
        r.seed,
        r.attempt,
        time(r.created_at),
        opt_time(r.started_at),
        opt_time(r.finished_at),
        round_duration_ms(r).map_or_else(|| "—".to_owned(), duration_ms),
    );

    // Phase timeline.
    let bars = phase_bars(detail, r.started_at);
    let phase_rows: String = bars
        .iter()
        .map(|(name, start, el)| {
            format!(
                r#"<tr><td>{}</td><td class="num">+{}</td><td class="num">{}</td></tr>"#,
                escape(name),
                escape(&duration_ms(*start)),
                escape(&duration_ms(*el))
            )
        })
        .collect();
    let plot_bars: Vec<plot::PhaseBar<'_>> =
        bars.iter().map(|(n, s, e)| plot::PhaseBar { name: n, start_ms: *s, elapsed_ms: *e }).collect();
    let timeline = match plot::timeline(&plot_bars) {
        Some(svg) => format!(
            r#"<h2>Phases</h2><div class="card">{svg}<table class="compact" id="phases"><thead><tr><th>Phase</th><th class="num">Start</th><th class="num">Duration</th></tr></thead><tbody>{phase_rows}</tbody></table></div>"#
        ),
        None => r#"<h2>Phases</h2><p class="muted">No phase has finished yet.</p>"#.to_owned(),
    };

    // Usage and calls.
    let u = &view.usage;
    let usage = format!(
        r#"<p class="usage" id="usage"><strong>{}</strong> LLM calls · <strong>{}</strong> prompt tokens · <strong>{}</strong> completion tokens · <strong>${:.4}</strong> · {} retries</p>"#,
        u.calls, u.prompt_tokens, u.completion_tokens, u.cost_usd, u.retries
    );
    let mut calls = String::new();
    for c in &view.llm_calls {
        let _ = write!(
            calls,
            r#"<tr><td>{}</td><td>{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">${:.5}</td><td class="num">{}</td><td class="num">{}</td><td>{}</td></tr>"#,
            escape(&word(&c.call.role)),
            escape(&c.call.model),
            c.attempt,
            c.call.prompt_tokens,
            c.call.completion_tokens,
            c.call.cost_usd,
            escape(&duration_ms(c.call.latency_ms as f64)),
            c.call.retries,
            c.call
                .error
                .as_deref()
                .map_or_else(String::new, |e| format!(r#"<span class="bad-text">{}</span>"#, clip(e, 120)))
        );
    }
    let calls = format!(
        r#"<details class="card" id="llm-calls-box"><summary>LLM calls ({})</summary><table class="compact" id="llm-calls"><thead><tr><th>Role</th><th>Model</th><th class="num">Attempt</th><th class="num">Prompt tok</th><th class="num">Completion tok</th><th class="num">Cost</th><th class="num">Latency</th><th class="num">Retries</th><th>Error</th></tr></thead><tbody>{calls}</tbody></table></details>"#,
        view.llm_calls.len()
    );

    // Operations (playbook rounds).
    let outcome = detail.get("outcome");
    let list = |key: &str| outcome.and_then(|o| o.get(key)).and_then(Value::as_array).cloned().unwrap_or_default();
    let (applied, skipped) = (list("applied"), list("skipped"));
    let groups_of = |a: &Value| {
        a.get("groups")
            .and_then(Value::as_array)
            .map(|g| g.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", "))
            .unwrap_or_default()
    };
    let ops = if applied.is_empty() && skipped.is_empty() {
        String::new()
    } else {
        let applied_rows: String = applied
            .iter()
            .map(|a| {
                let bullet = a.get("bullet_id").and_then(Value::as_str).unwrap_or("");
                op_row(
                    a.get("op").unwrap_or(&Value::Null),
                    &format!("groups {} → <code>{}</code>", escape(&groups_of(a)), escape(bullet)),
                )
            })
            .collect();
        let skipped_rows: String = skipped
            .iter()
            .map(|s| {
                let reason = s.get("reason").and_then(|r| r.get("kind")).and_then(Value::as_str).unwrap_or("?");
                op_row(
                    s.get("op").unwrap_or(&Value::Null),
                    &format!("groups {} · skipped: {}", escape(&groups_of(s)), escape(reason)),
                )
            })
            .collect();
        format!(
            r#"<h2>Operations</h2><details class="card" open id="operations-box"><summary>{} applied, {} skipped</summary><table class="compact" id="operations"><thead><tr><th>Op</th><th>Section / bullet</th><th>Content</th><th>Groups / outcome</th></tr></thead><tbody>{applied_rows}{skipped_rows}</tbody></table></details>"#,
            applied.len(),
            skipped.len()
        )
    };

    // Group outputs.
    let group_outputs = match detail.get("group_outputs") {
        Some(Value::Array(gs)) if !gs.is_empty() => gs
            .iter()
            .map(|g| {
                let n = g.get("group").map(Value::to_string).unwrap_or_default();
                let traces = g.get("traces").and_then(Value::as_array).map_or(0, Vec::len);
                format!(
                    r#"<details><summary>Group {} · {traces} reflections</summary><pre class="json">{}</pre></details>"#,
                    escape(&n),
                    pretty(g.get("output").unwrap_or(&Value::Null))
                )
            })
            .collect::<String>(),
        Some(Value::Object(gs)) if !gs.is_empty() => gs
            .iter()
            .map(|(k, v)| format!(r#"<details><summary>Group {}</summary><pre class="json">{}</pre></details>"#, escape(k), pretty(v)))
            .collect(),
        _ => String::new(),
    };
    let group_outputs = if group_outputs.is_empty() {
        String::new()
    } else {
        format!(r#"<h2>Group outputs</h2><div class="card groups" id="group-outputs">{group_outputs}</div>"#)
    };

    let answers = answers_section(outcome);

    // Reflections, with provenance: whether an applied operation cites each.
    let covered: std::collections::HashMap<String, bool> = outcome
        .and_then(|o| o.pointer("/coverage/reflections"))
        .and_then(Value::as_array)
        .map(|rs| {
            rs.iter()
                .filter_map(|r| Some((r.get("trace_id")?.as_str()?.to_owned(), r.get("covered")?.as_bool()?)))
                .collect()
        })
        .unwrap_or_default();
    let mut refl = String::new();
    for x in &view.reflections {
        let cover = match covered.get(&x.trace_id.to_string()) {
            Some(true) => r#"<span class="badge ok">covered</span>"#,
            Some(false) => r#"<span class="badge plain">not covered</span>"#,
            None => "—",
        };
        let _ = write!(
            refl,
            r#"<tr><td><a href="/ui/traces/{}">{}</a>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{cover}</td></tr>"#,
            x.trace_id,
            short_id(x.trace_id),
            if x.from_trace { r#" <span class="badge plain">agent's own</span>"# } else { "" },
            clip(&x.reflection.key_insight, 200),
            clip(&x.reflection.error, 120),
            clip(&x.reflection.root_cause, 120)
        );
    }
    let reflections = format!(
        r#"<details class="card" id="reflections-box"><summary>Reflections ({})</summary><table class="compact" id="reflections"><thead><tr><th>Trace</th><th>Key insight</th><th>Error</th><th>Root cause</th><th>Provenance</th></tr></thead><tbody>{refl}</tbody></table></details>"#,
        view.reflections.len()
    );

    let body = format!(
        r#"<h1>Round <code>{}</code></h1>{}
<div class="card">{summary}</div>
{timeline}
<h2>Usage</h2>{usage}{calls}
{answers}{ops}{group_outputs}
<h2>Reflections</h2>{reflections}"#,
        short_id(r.id),
        prompt_tabs(r.prompt.as_str(), "rounds"),
    );
    Ok(page(&format!("Round {}", short_id(r.id)), Some(&op.who()), Section::Prompts, &body))
}

/// The round's answer report (`outcome.answers`, `outcome.coverage`): what
/// tolerant reading ignored or dropped, groups left out, and the covered share.
fn answers_section(outcome: Option<&Value>) -> String {
    let Some(o) = outcome else { return String::new() };
    let (Some(a), coverage) = (o.get("answers"), o.get("coverage").filter(|c| !c.is_null())) else {
        return String::new();
    };
    let num = |v: &Value, k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
    let list = |v: &Value, k: &str| v.get(k).and_then(Value::as_array).cloned().unwrap_or_default();
    let coverage_fact = coverage.map_or_else(String::new, |c| {
        format!(
            r#"<dt>Covered reflections</dt><dd id="covered-share">{} of {} ({:.1}%)</dd>"#,
            num(c, "covered"),
            num(c, "n"),
            100.0 * c.get("share").and_then(Value::as_f64).unwrap_or(0.0)
        )
    });
    let mut rows = String::new();
    for g in list(a, "groups_left_out") {
        let _ = write!(
            rows,
            r#"<tr><td>group {}</td><td>left out ({} reflections)</td><td class="bad-text">{}</td></tr>"#,
            num(&g, "group"),
            g.get("traces").and_then(Value::as_array).map_or(0, Vec::len),
            clip(g.get("error").and_then(Value::as_str).unwrap_or(""), 300)
        );
    }
    for c in list(a, "calls") {
        let who = match (c.get("group").and_then(Value::as_u64), c.get("trace_id").and_then(Value::as_str)) {
            (Some(g), _) => format!("group {g}"),
            (None, Some(t)) => format!("trace {}", escape(&t.chars().take(8).collect::<String>())),
            _ => String::new(),
        };
        let task = c.get("task").and_then(Value::as_str).unwrap_or("");
        let mut what: Vec<String> = Vec::new();
        let wrapping: Vec<String> = list(&c, "wrapping").iter().filter_map(Value::as_str).map(str::to_owned).collect();
        if !wrapping.is_empty() {
            what.push(format!("unwrapped from {}", escape(&wrapping.join(", "))));
        }
        let keys: Vec<String> = list(&c, "unknown_keys").iter().filter_map(Value::as_str).map(str::to_owned).collect();
        if !keys.is_empty() {
            what.push(format!("ignored keys <code>{}</code>", escape(&keys.join(", "))));
        }
        for d in list(&c, "dropped") {
            what.push(format!(
                "dropped <code>{}</code>: {}",
                escape(d.get("item").and_then(Value::as_str).unwrap_or("")),
                clip(d.get("reason").and_then(Value::as_str).unwrap_or(""), 200)
            ));
        }
        let _ = write!(rows, r#"<tr><td>{who}</td><td>{}</td><td>{}</td></tr>"#, escape(task), what.join("<br>"));
    }
    format!(
        r#"<h2>Answers</h2><details class="card" id="answers-box"{}><summary>{} tolerated answers · {} unknown keys ignored · {} items dropped · {} groups left out · {} reflections lost</summary><dl class="facts">{coverage_fact}</dl><table class="compact" id="answer-notes"><thead><tr><th>Call</th><th>Task</th><th>What was ignored or dropped, and why</th></tr></thead><tbody>{rows}</tbody></table></details>"#,
        if rows.is_empty() { "" } else { " open" },
        num(a, "tolerated_answers"),
        num(a, "unknown_keys"),
        num(a, "dropped_items"),
        list(a, "groups_left_out").len(),
        list(a, "reflections_lost").len(),
    )
}

// ---------------------------------------------------------------- controller

fn f(v: &Value) -> Option<f64> {
    v.as_f64().filter(|x| x.is_finite())
}

pub async fn controller(State(st): State<AppState>, op: Operator, Path(name): Path<String>) -> PageResult {
    op.require(Scope::PromptsRead)?;
    let prompt = existing_prompt(&st, &name).await?;
    let view = controller_view(&st, &prompt.name).await?;
    let c = &view.choice;
    let fit = c.get("fit").filter(|v| !v.is_null());
    let (a, alpha, r2) = (
        fit.and_then(|f| f.get("a")).and_then(f),
        fit.and_then(|f| f.get("alpha")).and_then(f),
        fit.and_then(|f| f.get("r2")).and_then(f),
    );
    let chosen = c.get("target").and_then(f).or_else(|| c.get("batch_size").and_then(f));
    let points: Vec<(f64, f64)> = view.curve.iter().map(|p| (f64::from(p.batch_size), p.delay_secs)).collect();
    let svg = plot::delay_plot(&plot::DelayPlot { points: &points, fit: a.zip(alpha), chosen }).map_or_else(
        || r#"<p class="muted" id="no-samples">No Combee round has published yet, so there is nothing to plot.</p>"#.to_owned(),
        |svg| {
            format!(
                r#"{svg}<p class="legend"><span class="key point"></span> measured T(bs) = (N/bs)·R(bs) <span class="key fit"></span> fitted A·bs<sup>−α</sup> <span class="key choice"></span> chosen bs*</p>"#
            )
        },
    );
    let num = |v: Option<f64>, digits: usize| v.map_or_else(|| "—".to_owned(), |x| format!("{x:.digits$}"));
    let facts = format!(
        r#"<dl class="facts" id="controller-facts">
<dt>Mode</dt><dd>{}</dd><dt>Backlog N</dt><dd>{}</dd><dt>Batch now</dt><dd id="chosen-batch">{}</dd>
<dt>Target</dt><dd>{}</dd><dt>Plateau bs*</dt><dd>{}</dd><dt>Fit</dt><dd>A = {}, α = {}, R² = {}</dd>
<dt>Rule</dt><dd>{}</dd><dt>Last choice</dt><dd>{}</dd></dl>"#,
        escape(view.mode),
        view.backlog,
        c.get("batch_size").map(Value::to_string).map_or_else(|| "—".to_owned(), |s| escape(&s)),
        c.get("target").map(Value::to_string).map_or_else(|| "—".to_owned(), |s| escape(&s)),
        num(c.get("plateau").and_then(f), 1),
        num(a, 2),
        num(alpha, 3),
        num(r2, 3),
        escape(&view.reason),
        opt_time(view.last_choice_at),
    );
    let fixed = view
        .fixed_batch_size
        .map(|n| format!(r#"<p class="notice">This prompt has a fixed batch size ({n}); the worker uses it, and the controller's choice below is only shown.</p>"#))
        .unwrap_or_default();
    let profile: String = view
        .curve
        .iter()
        .map(|p| {
            format!(
                r#"<tr><td class="num">{}</td><td class="num">{:.2} s</td><td class="num">{:.2} s</td><td class="num">{}</td></tr>"#,
                p.batch_size,
                p.round_secs,
                p.delay_secs,
                p.fitted_delay_secs.map_or_else(|| "—".to_owned(), |x| format!("{x:.2} s"))
            )
        })
        .collect();
    let samples: String = view
        .samples
        .iter()
        .rev()
        .map(|s| {
            format!(
                r#"<tr><td>{}</td><td class="num">{}</td><td class="num">{:.2} s</td><td>{}</td></tr>"#,
                time(s.created_at),
                s.batch_size,
                s.round_secs,
                round_link(s.round_id, &short_id(s.round_id))
            )
        })
        .collect();
    let meter_rows: String = view
        .meter
        .buckets
        .iter()
        .map(|b| {
            format!(
                r#"<tr><td class="num">{}–{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td></tr>"#,
                b.size_min,
                b.size_max,
                b.retention.map_or_else(|| "—".to_owned(), |r| format!("{:.0}%", r * 100.0)),
                b.samples,
                b.rounds
            )
        })
        .collect();
    let meter = if meter_rows.is_empty() {
        r#"<p class="muted" id="no-meter">No playbook round with p ≥ 2 has published yet, so retention has not been measured.</p>"#.to_owned()
    } else {
        format!(
            r#"<table class="compact" id="meter"><thead><tr><th class="num">Group size</th><th class="num">Estimated retention</th><th class="num">Samples</th><th class="num">Rounds</th></tr></thead><tbody>{meter_rows}</tbody></table>"#
        )
    };
    let body = format!(
        r#"<h1>{} <span class="muted small">batch-size controller</span></h1>{}{fixed}
<div class="split"><div class="main-col card">{svg}</div><aside class="card">{facts}</aside></div>
<h2>Profile</h2><table class="compact" id="profile"><thead><tr><th class="num">Batch size</th><th class="num">Median round R</th><th class="num">Delay T</th><th class="num">Fitted T</th></tr></thead><tbody>{profile}</tbody></table>
<h2>Overload meter <span class="muted small">share of a group's lessons its answer keeps, by group size</span></h2>
<p class="muted small">{meter_method}</p>{meter}
<h2>Samples <span class="muted small">newest first</span></h2><table class="compact" id="samples"><thead><tr><th>Time</th><th class="num">Batch size</th><th class="num">Round time</th><th>Round</th></tr></thead><tbody>{samples}</tbody></table>"#,
        escape(prompt.name.as_str()),
        prompt_tabs(prompt.name.as_str(), "controller"),
        meter_method = escape(crate::service::controller::METER_METHOD),
    );
    Ok(page(&format!("{} controller", prompt.name.as_str()), Some(&op.who()), Section::Prompts, &body))
}

// ---------------------------------------------------------------- traces

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
        Some(p) => Some(existing_prompt(&st, p).await?.name),
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
    let filter = TraceFilter { prompt: prompt.clone(), status, since: None, until: None, before_id };
    let list = st.store.list_traces(&filter, PAGE).await?;
    let next = next_token(&list, PAGE, |t| t.id.to_string());

    let all_prompts = st.store.list_prompts(None, 200).await?;
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
            prompt_link(t.prompt.as_str()),
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
                let _ = write!(href, "&prompt={}", url_encode(p.as_str()));
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
    Ok(page("Traces", Some(&op.who()), Section::Traces, &body))
}

#[derive(Debug, Default, Deserialize)]
pub struct TraceNotice {
    #[serde(default)]
    notice: Option<String>,
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

pub async fn trace(
    State(st): State<AppState>,
    op: Operator,
    Path(id): Path<String>,
    Query(q): Query<TraceNotice>,
) -> PageResult {
    op.require(Scope::PromptsRead)?;
    let id = Uuid::parse_str(&id).map_err(|_| UiError::NotFound("No such trace: ids are UUIDs.".into()))?;
    let t = st.store.get_trace(id).await?.ok_or_else(|| UiError::NotFound(format!("Trace {id} not found.")))?;
    let section =
        |title: &str, v: &Value| format!(r#"<h2>{}</h2><pre class="json">{}</pre>"#, escape(title), pretty(v));
    let feedback = serde_json::to_value(&t.feedback).unwrap_or_default();
    let body = format!(
        r#"<h1>Trace <code>{}</code></h1>
<div class="card"><dl class="facts" id="trace-facts">
<dt>Prompt</dt><dd>{}</dd><dt>Version</dt><dd>{}</dd><dt>Status</dt><dd>{}</dd><dt>Round</dt><dd>{}</dd>
<dt>Attempts</dt><dd>{}</dd><dt>Failure</dt><dd>{}</dd><dt>External id</dt><dd>{}</dd>
<dt>Received</dt><dd>{}</dd><dt>Updated</dt><dd>{}</dd><dt>Quarantine</dt><dd id="quarantine-info">{}</dd></dl></div>
{}{}
<p class="muted">Trace content is shown as the agent sent it (untrusted data).</p>
{}{}{}{}{}{}"#,
        t.id,
        prompt_link(t.prompt.as_str()),
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
            _ => "",
        },
        trace_actions(&op, &t),
        section("Input", &t.input),
        section("Trajectory", &t.trajectory),
        section("Output", &t.output),
        section("Feedback", &feedback),
        t.reflection.as_ref().map_or_else(String::new, |r| section("Agent's reflection", r)),
        section("Metadata", &t.metadata),
    );
    Ok(page(&format!("Trace {}", short_id(t.id)), Some(&op.who()), Section::Traces, &body))
}
