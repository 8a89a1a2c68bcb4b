//! The version page: one version's text and labels, and its regression gate —
//! the verdict, why, and every case with the version's reply beside
//! production's; the gate card is shown next to the diff too, where a
//! `manual` prompt's operator decides.

use super::*;
use crate::domain::regression::{Gate, GateStatus, RegressionCase};

/// A gate's verdict as a card: status, reason, means, and the cases (failing first).
pub(super) fn gate_card(gate: &Gate) -> String {
    let status = gate.status.as_str();
    let class = match gate.status {
        GateStatus::Passed => "ok",
        GateStatus::Rejected => "bad",
        _ => "",
    };
    let mean = |m: Option<f64>| m.map_or_else(|| "—".to_owned(), |m| format!("{m:.3}"));
    let mut rows = String::new();
    for c in &gate.cases {
        let prod = c.production.as_ref();
        let _ = write!(
            rows,
            r#"<tr class="{}"><td>{}</td><td class="num">{:.2}</td><td class="num">{}</td><td class="message">{}</td><td class="message">{}</td></tr>"#,
            if c.regressed { "case-regressed" } else { "" },
            escape(&c.name.clone().unwrap_or_else(|| c.case_id.to_string())),
            c.candidate.score,
            prod.map_or_else(|| "—".to_owned(), |p| format!("{:.2}", p.score)),
            clip(&c.candidate.critiques.join("; "), 300),
            clip(&c.candidate.reply, 300),
        );
    }
    let cases = if gate.cases.is_empty() {
        String::new()
    } else {
        format!(
            r#"<table id="gate-cases" class="compact"><thead><tr><th>Case</th><th class="num">Score</th><th class="num">Production</th><th>What failed</th><th>Reply</th></tr></thead><tbody>{rows}</tbody></table>"#
        )
    };
    let deadline = match (gate.status, gate.deadline) {
        (GateStatus::AwaitingHarness, Some(d)) => format!(" · the harness has until {}", time(d)),
        _ => String::new(),
    };
    format!(
        r#"<div class="card" id="gate"><h2>Regression gate <span class="{class}-text" id="gate-status">{status}</span></h2>
<p id="gate-reason">{}</p><p class="muted">mode {} · mean score {} (production v{} {}) · margin {}{deadline}</p>{cases}</div>"#,
        escape(gate.reason.as_deref().unwrap_or("not decided yet")),
        gate.mode.as_str(),
        mean(gate.candidate_mean),
        gate.production_version.map_or_else(|| "—".to_owned(), |v| v.to_string()),
        mean(gate.production_mean),
        gate.margin,
    )
}

/// The regression set as a table (the prompt page shows it).
pub(super) fn cases_table(cases: &[RegressionCase]) -> String {
    if cases.is_empty() {
        return r#"<p class="muted" id="regression-empty">No regression cases: learned versions are not gated. Add some with <code>combee regression import</code>, the API, or “Pin as regression case” on a trace.</p>"#.to_owned();
    }
    let mut rows = String::new();
    for c in cases {
        let checks = match &c.judge {
            Some(j) => format!("judge, passes at {}: {}", j.pass_score, j.rubric),
            None => serde_json::to_string(&c.checks).unwrap_or_default(),
        };
        let _ = write!(
            rows,
            r#"<tr id="case-{}"><td>{}</td><td>{}</td><td class="message">{}</td><td class="message"><code>{}</code></td></tr>"#,
            c.id,
            escape(&c.name.clone().unwrap_or_else(|| "—".into())),
            escape(c.source.as_str()),
            clip(&c.input.to_string(), 200),
            clip(&checks, 200),
        );
    }
    format!(
        r#"<table id="regression-cases" class="compact"><thead><tr><th>Name</th><th>Source</th><th>Input</th><th>Must hold</th></tr></thead><tbody>{rows}</tbody></table>"#
    )
}

pub async fn version(
    State(st): State<AppState>,
    op: Operator,
    PathPrompt(name): PathPrompt,
    Path((_name, number)): Path<(String, i64)>,
) -> PageResult {
    op.require(Scope::PromptsRead)?;
    let prompt = existing_prompt(&st, &name).await?;
    let resolved = service::prompts::resolved(&st, &prompt.name, &Selector::Version(number)).await?;
    let gate = service::gate::version_gate(&st, &prompt.name, number).await?;
    let v = &resolved.version;
    let labels: String = resolved.labels.iter().map(|l| badge(l.as_str())).collect();
    let gate = gate.as_ref().map_or_else(
        || r#"<p class="muted" id="gate-none">Not gated: the prompt had no regression set when this version was made.</p>"#.to_owned(),
        gate_card,
    );
    let diff = v.parent.map_or_else(String::new, |p| {
        format!(
            r#"<p><a href="/ui/prompts/{}/diff?from={p}&amp;to={}">Diff with v{p}</a></p>"#,
            escape(&in_path(&op, &prompt.name)),
            v.number
        )
    });
    let body = format!(
        r#"<h1>{} <span class="muted small">v{} {}</span></h1>
{tabs}
<p class="muted">{} · {} · {}</p>{diff}
{gate}
<h2>Text</h2><pre class="prompt-text" id="version-text">{}</pre>"#,
        escape(prompt.name.as_str()),
        v.number,
        labels,
        escape(v.source.as_str()),
        escape(&v.created_by),
        time(v.created_at),
        escape(&v.content.render()),
        tabs = prompt_tabs(&op, &prompt.name, ""),
    );
    Ok(page(&format!("{} v{}", prompt.name.as_str(), v.number), Some(&op.who()), NavSection::Prompts, &body))
}
