//! The diff page: two versions of a prompt side by side, unchanged runs folded.

use super::*;

#[derive(Deserialize)]
pub struct DiffPageQuery {
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
    PathPrompt(name): PathPrompt,
    Query(q): Query<DiffPageQuery>,
) -> PageResult {
    op.require(Scope::PromptsRead)?;
    let prompt = existing_prompt(&st, &name).await?;
    let (Some(from), Some(to)) = (q.from, q.to) else {
        return Err(UiError::Service(ServiceError::BadRequest("choose two versions (`from` and `to`)".into())));
    };
    let d = version_diff(&st, &prompt, from, to).await?;
    // The gate's verdict on the newer version, for the operator's decision (`manual` prompts).
    let gate = service::gate::version_gate(&st, &prompt.name, to)
        .await?
        .as_ref()
        .map_or_else(String::new, super::versions::gate_card);
    let latest = service::prompts::latest_number(&st, &prompt.name).await?;
    let n = escape(&in_path(&op, &prompt.name));
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
{gate}
<p class="diff-stats" id="diff-stats"><span class="ins-count">+{added}</span> <span class="del-count">−{removed}</span> lines</p>
{playbook}
<h2>Rendered text</h2>
<table class="diff" id="diff"><tbody>{lines}</tbody></table>"#,
        escape(prompt.name.as_str()),
        d.from,
        d.to,
        options(d.from),
        options(d.to),
        tabs = prompt_tabs(&op, &prompt.name, ""),
    );
    Ok(page(&format!("{} diff", prompt.name.as_str()), Some(&op.who()), NavSection::Prompts, &body))
}
