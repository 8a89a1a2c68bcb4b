//! A prompt's rounds and one round's page: phases, usage and calls, answers,
//! operations, group outputs and reflections.

use super::*;
use crate::domain::round::RoundStatus;
use crate::llm::{AnswerRead, LlmCall};

/// What a round that succeeded without a version shows as its result.
const UNCHANGED: &str = r#"<span class="muted" title="it would have served its base version's text">unchanged</span>"#;

#[derive(Deserialize)]
pub struct BeforeIdQuery {
    #[serde(default)]
    before: Option<Uuid>,
}

pub async fn rounds(
    State(st): State<AppState>,
    op: Operator,
    PathPrompt(name): PathPrompt,
    Query(q): Query<BeforeIdQuery>,
) -> PageResult {
    op.require(Scope::PromptsRead)?;
    let prompt = existing_prompt(&st, &name).await?;
    let list = service::rounds::list_rounds(&st, &prompt.name, q.before, PAGE).await?;
    let mut rows = String::new();
    for r in &list {
        let result = match (r.result_version, &r.error) {
            (Some(v), _) => format!("v{v}"),
            (None, Some(e)) => format!(r#"<span class="bad-text">{}</span>"#, clip(e, 80)),
            (None, None) if r.status == RoundStatus::Succeeded => UNCHANGED.to_owned(),
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
    let n = escape(&in_path(&op, &prompt.name));
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
        prompt_tabs(&op, &prompt.name, "rounds")
    );
    Ok(page(&format!("{} rounds", prompt.name.as_str()), Some(&op.who()), NavSection::Prompts, &body))
}

fn phase_bars<O>(detail: &RoundDetail<O>, origin: Option<chrono::DateTime<chrono::Utc>>) -> Vec<(String, f64, f64)> {
    let mut bars: Vec<_> =
        detail.phases.iter().filter_map(|(name, p)| Some((name.clone(), p.started_at?, p.elapsed_ms()?))).collect();
    bars.sort_by_key(|b| b.1);
    let origin = origin.or_else(|| bars.first().map(|b| b.1));
    bars.into_iter()
        .map(|(name, start, elapsed)| {
            let offset = origin.map_or(0.0, |o| (start - o).num_milliseconds().max(0) as f64);
            (name, offset, elapsed)
        })
        .collect()
}

fn op_row(op: &DeltaOp, extra: &str) -> String {
    let (kind, target, content) = match op {
        DeltaOp::Add { section, content, .. } => ("add", section, content.as_str()),
        DeltaOp::Update { id, content, .. } => ("update", id, content.as_str()),
        DeltaOp::Remove { id, .. } => ("remove", id, ""),
    };
    format!(
        r#"<tr><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td></tr>"#,
        badge(kind),
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
    let detail = LearnedRoundDetail::read(&r.detail).unwrap_or_else(|e| {
        tracing::warn!(round = %r.id, error = %e, "the round's record is unreadable; the page shows its columns only");
        LearnedRoundDetail::default()
    });

    let result = match (r.result_version, &r.error) {
        (Some(v), _) => format!(
            r#"<a href="/ui/prompts/{}/diff?from={}&amp;to={v}" id="result-version">v{v}</a> <span class="muted">(diff against the base v{})</span>"#,
            escape(&in_path(&op, &r.prompt)),
            r.base_version,
            r.base_version
        ),
        (None, Some(e)) => format!(r#"<span class="bad-text" id="round-error">{}</span>"#, escape(e)),
        (None, None) if r.status == RoundStatus::Succeeded => {
            format!(r#"{UNCHANGED} <span class="muted">(what it learned left v{} as it was)</span>"#, r.base_version)
        }
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
        prompt_link(&op, &r.prompt),
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
    let bars = phase_bars(&detail, r.started_at);
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
            r#"<tr><td>{}</td><td>{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">${:.5}</td><td class="num">{}</td><td class="num">{}</td><td>{}</td><td>{}</td><td class="num">{}</td><td>{}</td></tr>"#,
            escape(&word(&c.call.role)),
            escape(&c.call.model),
            c.attempt,
            c.call.prompt_tokens,
            c.call.completion_tokens,
            c.call.cost_usd,
            escape(&duration_ms(c.call.latency_ms as f64)),
            c.call.retries,
            c.call.read.map_or_else(|| "—".to_owned(), |r| badge(r.as_str())),
            c.call.output_format.map_or("—", |f| f.as_str()),
            c.call.concurrency_limit.map_or_else(|| "—".to_owned(), |n| n.to_string()),
            call_error(&c.call)
        );
    }
    let calls = format!(
        r#"{}<details class="card" id="llm-calls-box"><summary>LLM calls ({})</summary><table class="compact" id="llm-calls"><thead><tr><th>Role</th><th>Model</th><th class="num">Attempt</th><th class="num">Prompt tok</th><th class="num">Completion tok</th><th class="num">Cost</th><th class="num">Latency</th><th class="num">Retries</th><th>Read</th><th>Format</th><th class="num">Limit</th><th>Error</th></tr></thead><tbody>{calls}</tbody></table></details>"#,
        reads_summary(view.llm_calls.iter().map(|c| &c.call)),
        view.llm_calls.len()
    );

    // Operations (playbook rounds).
    let outcome = detail.outcome.as_ref();
    let (applied, skipped) = outcome.map_or((&[][..], &[][..]), |o| (&o.applied[..], &o.skipped[..]));
    let groups_of = |g: &[usize]| g.iter().map(usize::to_string).collect::<Vec<_>>().join(", ");
    let ops = if applied.is_empty() && skipped.is_empty() {
        String::new()
    } else {
        let applied_rows: String = applied
            .iter()
            .map(|a| {
                op_row(
                    &a.op,
                    &format!("groups {} → <code>{}</code>", escape(&groups_of(&a.groups)), escape(&a.bullet_id)),
                )
            })
            .collect();
        let skipped_rows: String = skipped
            .iter()
            .map(|s| {
                let reason = serde_json::to_value(&s.reason).ok();
                let kind = reason.as_ref().and_then(|r| r.get("kind")).and_then(Value::as_str).unwrap_or("?");
                op_row(&s.op, &format!("groups {} · skipped: {}", escape(&groups_of(&s.groups)), escape(kind)))
            })
            .collect();
        format!(
            r#"<h2>Operations</h2><details class="card" open id="operations-box"><summary>{} applied, {} skipped</summary><table class="compact" id="operations"><thead><tr><th>Op</th><th>Section / bullet</th><th>Content</th><th>Groups / outcome</th></tr></thead><tbody>{applied_rows}{skipped_rows}</tbody></table></details>"#,
            applied.len(),
            skipped.len()
        )
    };

    // Group outputs.
    let group_outputs: String = detail
        .group_outputs
        .iter()
        .map(|g| {
            format!(
                r#"<details><summary>Group {} · {} reflections</summary><pre class="json">{}</pre></details>"#,
                g.group,
                g.traces.len(),
                pretty(&g.output)
            )
        })
        .collect();
    let group_outputs = if group_outputs.is_empty() {
        String::new()
    } else {
        format!(r#"<h2>Group outputs</h2><div class="card groups" id="group-outputs">{group_outputs}</div>"#)
    };

    let answers = answers_section(outcome);
    let refused = refused_section(outcome);

    // Reflections, with provenance: whether an applied operation cites each.
    let covered: std::collections::HashMap<Uuid, bool> = outcome
        .and_then(|o| o.coverage.as_ref())
        .map(|c| c.reflections.iter().map(|r| (r.trace_id, r.covered)).collect())
        .unwrap_or_default();
    let mut refl = String::new();
    for x in &view.reflections {
        let cover = match covered.get(&x.trace_id) {
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
{answers}{ops}{refused}{group_outputs}
<h2>Reflections</h2>{reflections}"#,
        short_id(r.id),
        prompt_tabs(&op, &r.prompt, "rounds"),
    );
    Ok(page(&format!("Round {}", short_id(r.id)), Some(&op.who()), NavSection::Prompts, &body))
}

/// What the lesson check refused (`outcome.refused`): each change with its
/// rule and reason. The content is the model's output: untrusted, escaped.
fn refused_section(outcome: Option<&OutcomeRecord>) -> String {
    let Some(o) = outcome.filter(|o| !o.refused.is_empty()) else { return String::new() };
    let mut rows = String::new();
    for r in &o.refused {
        let (kind, target, content) = match (&r.op, &r.instruction) {
            (Some(DeltaOp::Add { section, content, .. }), _) => ("add", section.as_str(), content.as_str()),
            (Some(DeltaOp::Update { id, content, .. }), _) => ("update", id.as_str(), content.as_str()),
            (Some(DeltaOp::Remove { id, .. }), _) => ("remove", id.as_str(), ""),
            (None, Some(text)) => ("instruction", "", text.as_str()),
            (None, None) => ("?", "", ""),
        };
        let groups = r.groups.iter().map(usize::to_string).collect::<Vec<_>>().join(", ");
        let _ = write!(
            rows,
            r#"<tr class="refused-change"><td>{}</td><td><code>{}</code></td><td><pre class="refused-text">{}</pre></td><td>{}</td><td><code>{}</code></td><td class="bad-text">{}</td></tr>"#,
            badge(kind),
            escape(target),
            clip(content, 500),
            escape(&groups),
            escape(r.rule.as_str()),
            escape(&r.reason)
        );
    }
    format!(
        r#"<h2>Refused</h2><details class="card" open id="refused-box"><summary>{} learned changes refused by the lesson check: they entered no version</summary><table class="compact" id="refused"><thead><tr><th>Op</th><th>Section / bullet</th><th>Text (the model's, untrusted)</th><th>Groups</th><th>Rule</th><th>Why</th></tr></thead><tbody>{rows}</tbody></table></details>"#,
        o.refused.len()
    )
}

/// How many of the round's answers were read each way (none when no call says).
fn reads_summary<'a>(calls: impl Iterator<Item = &'a LlmCall> + Clone) -> String {
    if calls.clone().all(|c| c.read.is_none()) {
        return String::new();
    }
    let counts: Vec<String> = AnswerRead::ALL
        .iter()
        .map(|&read| {
            let n = calls.clone().filter(|c| c.read == Some(read)).count();
            format!(r#"<strong id="answers-{}">{n}</strong> {}"#, read.as_str(), read.as_str())
        })
        .collect();
    format!(r#"<p class="usage" id="answer-reads">Answers read: {}</p>"#, counts.join(" · "))
}

/// A call's error; for a refused answer, also the model's text (untrusted,
/// escaped, folded away) so an operator sees what was refused and why.
fn call_error(call: &LlmCall) -> String {
    let mut cell = call
        .error
        .as_deref()
        .map_or_else(String::new, |e| format!(r#"<span class="bad-text">{}</span>"#, clip(e, 120)));
    if let Some(answer) = &call.refused_answer {
        let _ = write!(
            cell,
            r#"<details class="refused-answer"><summary>The model's answer (untrusted, {} characters shown)</summary><pre>{}</pre></details>"#,
            answer.chars().count(),
            escape(answer)
        );
    }
    cell
}

/// The round's answer report (`outcome.answers`, `outcome.coverage`): what
/// tolerant reading ignored or dropped, groups degraded, and the covered share.
fn answers_section(outcome: Option<&OutcomeRecord>) -> String {
    let Some(o) = outcome else { return String::new() };
    let a = &o.answers;
    let coverage_fact = o.coverage.as_ref().map_or_else(String::new, |c| {
        format!(
            r#"<dt>Covered reflections</dt><dd id="covered-share">{} of {} ({:.1}%)</dd>"#,
            c.covered,
            c.n,
            100.0 * c.share
        )
    });
    let mut facts = coverage_fact;
    if o.level2.is_degraded() {
        let _ = write!(
            facts,
            r#"<dt>Level 2</dt><dd id="level2-degraded" class="bad-text">degraded to the union for {} unreadable answers</dd>"#,
            o.level2.degraded.len()
        );
    }
    if let Some(m) = &o.meter {
        let _ = write!(
            facts,
            r#"<dt>Overload meter</dt><dd id="meter-reading">{} answers read by their citations, {} by text (no citations), {} by text (implausible citations)</dd>"#,
            m.by_sources, m.missing_sources, m.implausible_sources
        );
    }
    let mut rows = String::new();
    for d in &o.level2.degraded {
        let _ = write!(
            rows,
            r#"<tr><td>level 2</td><td>degraded to the union ({} inputs)</td><td class="bad-text">{}</td></tr>"#,
            d.inputs,
            clip(&d.error, 300)
        );
    }
    for g in &a.groups_degraded {
        // The refused text is the model's output: untrusted, shown escaped.
        let answer = g.refused_answer.as_deref().map_or_else(String::new, |t| {
            format!(
                r#"<details class="refused-answer"><summary>The model's answer</summary><pre>{}</pre></details>"#,
                clip(t, 2_000)
            )
        });
        let _ = write!(
            rows,
            r#"<tr class="group-degraded"><td>group {}</td><td>degraded: contributed nothing ({} reflections)</td><td class="bad-text">{}{answer}</td></tr>"#,
            g.group,
            g.traces.len(),
            clip(&g.error, 300)
        );
    }
    for c in &a.calls {
        let who = match (c.group, c.trace_id) {
            (Some(g), _) => format!("group {g}"),
            (None, Some(t)) => format!("trace {}", escape(&t.to_string().chars().take(8).collect::<String>())),
            _ => String::new(),
        };
        let mut what: Vec<String> = Vec::new();
        if !c.notes.wrapping.is_empty() {
            what.push(format!("unwrapped from {}", escape(&c.notes.wrapping.join(", "))));
        }
        if !c.notes.unknown_keys.is_empty() {
            what.push(format!("ignored keys <code>{}</code>", escape(&c.notes.unknown_keys.join(", "))));
        }
        for d in &c.notes.dropped {
            what.push(format!("dropped <code>{}</code>: {}", escape(&d.item), clip(&d.reason, 200)));
        }
        let _ = write!(
            rows,
            r#"<tr><td>{who}</td><td>{}</td><td>{}</td></tr>"#,
            escape(c.task.as_str()),
            what.join("<br>")
        );
    }
    format!(
        r#"<h2>Answers</h2><details class="card" id="answers-box"{}><summary>{} tolerated answers · {} unknown keys ignored · {} items dropped · {} groups degraded · {} reflections lost</summary><dl class="facts">{facts}</dl><table class="compact" id="answer-notes"><thead><tr><th>Call</th><th>Task</th><th>What was ignored or dropped, and why</th></tr></thead><tbody>{rows}</tbody></table></details>"#,
        if rows.is_empty() { "" } else { " open" },
        a.tolerated_answers,
        a.unknown_keys,
        a.dropped_items,
        a.groups_degraded.len(),
        a.reflections_lost.len(),
    )
}
