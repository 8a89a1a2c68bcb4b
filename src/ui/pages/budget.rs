//! The prompt page's budget section: the prompt's caps and the server's, the
//! daily cap holding learning back now, and the spend of the last days.

use super::*;
use crate::domain::budget::{BudgetCaps, BudgetReached};
use crate::service::budget::SpendReport;

/// Days of spend the prompt page lists.
const SPEND_DAYS_SHOWN: u32 = 7;

fn caps_text(c: &BudgetCaps) -> String {
    let mut parts = Vec::new();
    if let Some(t) = c.tokens_per_day {
        parts.push(format!("{t} tokens/day"));
    }
    if let Some(u) = c.usd_per_day {
        parts.push(format!("${u:.4}/day"));
    }
    if let Some(t) = c.tokens_per_round {
        parts.push(format!("{t} tokens/round"));
    }
    if let Some(u) = c.usd_per_round {
        parts.push(format!("${u:.4}/round"));
    }
    if parts.is_empty() { "none".to_owned() } else { escape(&parts.join(", ")) }
}

/// The notice a daily cap puts at the top of the prompt page (empty when none holds).
pub(super) fn budget_notice(reached: Option<&BudgetReached>) -> String {
    reached.map_or_else(String::new, |r| {
        format!(
            r#"<p class="notice bad" id="budget-state">{} {}: traces stay pending and no round calls the LLM until {} (sooner when the cap is raised: <code>PATCH /v1/prompts/{{name}}/settings</code>, <code>budget</code>).</p>"#,
            badge("budget_reached"),
            escape(&r.message),
            time(r.until),
        )
    })
}

/// The section itself.
pub(super) async fn budget_section(
    st: &AppState,
    prompt: &crate::domain::Prompt,
) -> Result<(String, SpendReport), UiError> {
    let report = service::budget::spend(st, prompt, SPEND_DAYS_SHOWN).await?;
    let mut rows = String::new();
    for d in &report.days {
        let kinds =
            d.by_kind.iter().map(|(k, s)| format!("{} {} tokens", escape(k), s.tokens)).collect::<Vec<_>>().join(", ");
        let _ = write!(
            rows,
            r#"<tr><td class="nowrap">{}</td><td class="num">{}</td><td class="num">${:.4}</td><td class="num">{}</td><td>{kinds}</td></tr>"#,
            d.day, d.tokens, d.usd, d.calls
        );
    }
    let table = if report.days.is_empty() {
        r#"<p class="muted" id="spend-empty">No LLM spend in the last days.</p>"#.to_owned()
    } else {
        format!(
            r#"<table id="spend" class="compact"><thead><tr><th>Day (UTC)</th><th class="num">Tokens</th><th class="num">USD</th><th class="num">Attempts</th><th>By kind</th></tr></thead><tbody>{rows}</tbody></table>"#
        )
    };
    let html = format!(
        r#"<h2>Budget <span class="muted small">last {SPEND_DAYS_SHOWN} days; <code>GET /v1/prompts/{{name}}/spend</code></span></h2>
<p id="budget-caps">This prompt's caps: <strong>{}</strong>. The server's (<code>[budget]</code>, daily caps over all prompts): {}.</p>{table}"#,
        caps_text(&report.caps),
        caps_text(&report.server_caps),
    );
    Ok((html, report))
}
