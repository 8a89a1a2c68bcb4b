//! The prompt list and one prompt's page: text, labels, label history,
//! promote / roll back forms, whether failed rounds or a spending cap hold
//! learning back, and the prompt's LLM spend. A server-wide session sees every
//! project's prompts (with a project column and filter); a project's session
//! its own only.

use super::*;
use crate::domain::backoff::{LearningState, LearningStatus};

#[derive(Deserialize)]
pub struct AfterQuery {
    #[serde(default)]
    after: Option<String>,
    #[serde(default)]
    project: Option<String>,
}

pub async fn prompts(State(st): State<AppState>, op: Operator, Query(q): Query<AfterQuery>) -> PageResult {
    op.require(Scope::PromptsRead)?;
    let reach = op.reach();
    let asked = q.project.as_deref().filter(|p| !p.is_empty());
    let filter = crate::domain::project::list_filter(&reach, asked);
    // The next page starts after `project/name`: names repeat across projects.
    let after = q.after.as_deref().and_then(|a| PromptName::written(a, crate::domain::names::DEFAULT_PROJECT).ok());
    let list = service::prompts::list_prompts(&st, &filter, after.as_ref(), PAGE).await?;
    let server_wide = reach.project().is_none();
    let mut rows = String::new();
    for p in &list {
        let last = service::rounds::list_rounds(&st, &p.prompt.name, None, 1).await?;
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
        let project = if server_wide {
            format!(r#"<td class="project">{}</td>"#, escape(&p.prompt.project))
        } else {
            String::new()
        };
        let _ = write!(
            rows,
            r#"<tr><td class="name">{}</td>{project}<td>{}</td><td>{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td>{}</td></tr>"#,
            prompt_link(&op, &p.prompt.name),
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
                r#"<p class="pager"><a href="/ui/prompts?after={}&amp;project={}">Next page →</a></p>"#,
                escape(&url_encode(&format!("{}/{}", last.prompt.name.project(), last.prompt.name.as_str()))),
                escape(&url_encode(asked.unwrap_or("")))
            )
        }
        _ => String::new(),
    };
    let table = if list.is_empty() {
        r#"<p class="muted">No prompts yet. Create one with <code>POST /v1/prompts</code>.</p>"#.to_owned()
    } else {
        let project_head = if server_wide { "<th>Project</th>" } else { "" };
        format!(
            r#"<table id="prompts"><thead><tr><th>Name</th>{project_head}<th>Strategy</th><th>Promotion</th><th class="num">Production</th><th class="num">Latest</th><th class="num">Pending traces</th><th>Last round</th></tr></thead><tbody>{rows}</tbody></table>{more}"#
        )
    };
    // A server-wide session filters by project; a project's session has one.
    let project_filter = if server_wide {
        let options: String = service::projects::list(&st, &reach)
            .await?
            .iter()
            .map(|p| {
                let sel = if asked == Some(p.name.as_str()) { " selected" } else { "" };
                format!(r#"<option value="{0}"{sel}>{0}</option>"#, escape(&p.name))
            })
            .collect();
        format!(
            r#"<form method="get" action="/ui/prompts" class="filters"><label for="project">Project</label><select id="project" name="project"><option value="">all</option>{options}</select><button type="submit">Filter</button></form>"#
        )
    } else {
        format!(
            r#"<p class="muted" id="project-name">Project <strong>{}</strong></p>"#,
            escape(reach.project().unwrap_or(""))
        )
    };
    let body = format!(r#"<h1>Prompts</h1>{project_filter}{table}"#);
    Ok(page("Prompts", Some(&op.who()), NavSection::Prompts, &body))
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
/// Most points per line on the reward chart.
const REWARD_POINTS: i64 = 120;

/// A chart bucket's width in words: `by the minute`, `in 15-minute steps`, `hourly`.
fn bucket_words(secs: i64) -> String {
    match secs {
        60 => "by the minute".to_owned(),
        3_600 => "hourly".to_owned(),
        86_400 => "daily".to_owned(),
        s if s % 3_600 == 0 => format!("in {}-hour steps", s / 3_600),
        s => format!("in {}-minute steps", s / 60),
    }
}

pub async fn prompt(
    State(st): State<AppState>,
    op: Operator,
    PathPrompt(name): PathPrompt,
    Query(q): Query<PromptQuery>,
) -> PageResult {
    op.require(Scope::PromptsRead)?;
    let prompt = existing_prompt(&st, &name).await?;
    let production = service::prompts::resolve(&st, &prompt.name, &Selector::Label(LabelName::production())).await?;
    let labels = service::labels::list_labels(&st, &prompt.name).await?;
    let versions = service::prompts::list_versions(&st, &prompt.name, q.before, PAGE).await?;
    let latest = service::prompts::latest_number(&st, &prompt.name).await?;
    let prod_number = production.as_ref().map(|r| r.version.number);
    let can_promote = op.can(Scope::PromptsPromote);
    let n = escape(&in_path(&op, &prompt.name));

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
    let (budget, spend) = super::budget::budget_section(&st, &prompt).await?;
    let learning = learning_notice(&service::rounds::learning_state(&st, &prompt.name).await?)
        + &super::budget::budget_notice(spend.reached.as_ref());

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
            r#"<tr id="version-{}"><td class="num"><a href="/ui/prompts/{n}/versions/{1}"><strong>v{}</strong></a></td><td class="labels">{}</td><td>{}</td><td>{}</td><td class="message">{}</td><td class="by">{}</td><td class="when">{}</td><td class="actions">{}</td></tr>"#,
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
    // Reward over the last 7 days per version (at most the 6 newest with traces), zoomed to the data.
    let until = chrono::Utc::now();
    let since = until - chrono::Duration::days(7);
    let (outcomes, bucket) = service::outcomes::chart_outcomes(&st, &prompt.name, since, until, REWARD_POINTS).await?;
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
    let markers: Vec<plot::RewardMarker> =
        service::labels::production_moves_since(&st, &prompt.name, since, REWARD_MARKERS_SHOWN)
            .await?
            .iter()
            .filter_map(plot::RewardMarker::for_move)
            .collect();
    let reward_chart = plot::reward_plot(&series, &markers, bucket).unwrap_or_else(|| {
        r#"<p class="muted" id="reward-empty">No rewarded traces in the last 7 days.</p>"#.to_owned()
    });
    // The newest label moves: who or what moved which label, and why.
    let moves = service::labels::label_history(&st, &prompt.name, None, None, LABEL_MOVES_SHOWN).await?;
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
    let cases = service::regression::list_cases(&st, &prompt.name).await?;
    let (case_count, regression) = (cases.len(), super::versions::cases_table(&cases));
    let evaluators = evaluators_section(&st, &prompt.name).await?;
    let promote_note = if can_promote {
        ""
    } else {
        r#"<p class="muted">Promoting and rolling back need the <code>prompts:promote</code> scope.</p>"#
    };
    let body = format!(
        r#"<h1>{name} <span class="muted small" id="prompt-project">project {project} · {strategy} · promotion {promotion}</span></h1>
{tabs}{notice}{learning}
<div class="split"><div class="main-col">{text}</div>
<aside class="card"><h2>Labels</h2><ul class="labels" id="labels">{label_list}</ul></aside></div>
{diff_form}
<h2>Version history</h2>{promote_note}
<table id="versions"><thead><tr><th class="num">Version</th><th>Labels</th><th>Source</th><th>Round</th><th>Message</th><th>By</th><th>Time</th><th></th></tr></thead><tbody>{rows}</tbody></table>{older}
<h2>Regression set <span class="muted small">{case_count} cases; a learned version must pass them before it gets traffic</span></h2>{regression}
<h2>Reward by version <span class="muted small" id="reward-span">last 7 days, {buckets}</span></h2>{reward_chart}
{budget}
{evaluators}
<h2>Label history <span class="muted small">newest {LABEL_MOVES_SHOWN}; all of them: <code>combee prompts label-history</code></span></h2>{label_history}"#,
        name = escape(prompt.name.as_str()),
        project = escape(&prompt.project),
        strategy = escape(strategy_str(prompt.strategy)),
        promotion = escape(&word(&prompt.promotion)),
        tabs = prompt_tabs(&op, &prompt.name, "prompt"),
        buckets = bucket_words(bucket),
    );
    Ok(page(prompt.name.as_str(), Some(&op.who()), NavSection::Prompts, &body))
}

/// The prompt's evaluators, each with its agreement with the rewards agents
/// and operators gave (calibration). Cheap on every view: nothing is read
/// for a prompt without evaluators, and the agreement is over the newest
/// `PAGE_CALIBRATION_TRACES` scored traces (500; the API's over 5,000).
async fn evaluators_section(st: &AppState, name: &PromptName) -> Result<String, UiError> {
    let list = service::evaluators::get(st, name).await?.evaluators;
    if list.is_empty() {
        return Ok(r#"<h2>Evaluators</h2><p class="muted" id="evaluators-empty">None: only the rewards agents report count. Set them with <code>combee evaluators set</code> or <code>PUT /v1/prompts/{name}/evaluators</code>.</p>"#.to_owned());
    }
    let limit = service::evaluators::PAGE_CALIBRATION_TRACES;
    let cal = service::evaluators::calibration_over(st, name, limit).await?;
    let num = |v: Option<f64>| v.map_or_else(|| "—".to_owned(), |x| format!("{x:.2}"));
    let mut rows = String::new();
    for e in &list {
        let what = match e {
            crate::evaluate::evaluators::Evaluator::Checks { checks, .. } => {
                format!("{} code check(s)", checks.len())
            }
            crate::evaluate::evaluators::Evaluator::Judge { rubric, .. } => format!("LLM judge: {}", clip(rubric, 200)),
        };
        let agreement = cal.evaluators.iter().find(|a| a.evaluator == e.name());
        let _ = write!(
            rows,
            r#"<tr id="evaluator-{}"><td><strong>{}</strong></td><td>{}</td><td>{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td></tr>"#,
            escape(e.name()),
            escape(e.name()),
            escape(e.kind()),
            what,
            agreement.map_or(0, |a| a.n),
            num(agreement.and_then(|a| a.accuracy)),
            num(agreement.and_then(|a| a.kappa)),
        );
    }
    Ok(format!(
        r#"<h2>Evaluators <span class="muted small" id="evaluators-agreement">agreement with the {} traces agents or operators scored (the newest {limit} at most; all of them: <code>combee evaluators calibrate</code>)</span></h2><table id="evaluators" class="compact"><thead><tr><th>Name</th><th>Kind</th><th>What</th><th class="num">n</th><th class="num">Accuracy</th><th class="num">Kappa</th></tr></thead><tbody>{rows}</tbody></table>"#,
        cal.traces
    ))
}

/// Failed rounds in a row: whether the scheduler waits, until when, and why
/// the last one failed; nothing outside a failure streak.
fn learning_notice(l: &LearningState) -> String {
    if l.failure_streak == 0 {
        return String::new();
    }
    let wait = match (l.state, l.backoff_until) {
        (LearningStatus::BackingOff, Some(until)) => format!(
            "no round is scheduled before {} (<code>worker.failure_backoff_secs</code>, doubling per failure); a manual round or <code>DELETE /v1/prompts/{{name}}/backoff</code> ends the wait",
            time(until)
        ),
        _ => "the backoff is over; the next round is scheduled as the backlog asks".to_owned(),
    };
    let why = l.last_failure.as_deref().map_or_else(String::new, |e| format!(": {}", clip(e, 300)));
    format!(
        r#"<p class="notice bad" id="learning-state">{} <strong id="failure-streak">{}</strong> rounds failed in a row, the last one {}{why}. {wait}.</p>"#,
        badge(match l.state {
            LearningStatus::BackingOff => "backing_off",
            LearningStatus::BudgetReached => "budget_reached",
            LearningStatus::Ok => "ok",
        }),
        l.failure_streak,
        l.last_failed_at.map_or_else(|| "—".to_owned(), time),
    )
}
