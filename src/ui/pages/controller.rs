//! The batch-size controller's page: its samples, fit, choice and the
//! overload meter.

use super::*;

fn f(v: &Value) -> Option<f64> {
    v.as_f64().filter(|x| x.is_finite())
}

pub async fn controller(State(st): State<AppState>, op: Operator, PathPrompt(name): PathPrompt) -> PageResult {
    op.require(Scope::PromptsRead)?;
    let view = controller_view(&st, &name).await?;
    let c = &view.choice;
    let fit = c.get("fit").filter(|v| !v.is_null());
    let (a, alpha, r2) = (
        fit.and_then(|f| f.get("a")).and_then(f),
        fit.and_then(|f| f.get("alpha")).and_then(f),
        fit.and_then(|f| f.get("r2")).and_then(f),
    );
    let chosen = c.get("cap").and_then(f).or_else(|| c.get("batch_size").and_then(f));
    let points: Vec<(f64, f64)> = view.curve.iter().map(|p| (f64::from(p.batch_size), p.round_secs)).collect();
    let svg = plot::delay_plot(&plot::DelayPlot { points: &points, fit: a.zip(alpha), chosen }).map_or_else(
        || r#"<p class="muted" id="no-samples">No Combee round has published yet, so there is nothing to plot.</p>"#.to_owned(),
        |svg| {
            format!(
                r#"{svg}<p class="legend"><span class="key point"></span> measured round time R(bs) <span class="key fit"></span> fitted A·bs<sup>−α</sup> <span class="key choice"></span> largest batch allowed now</p>"#
            )
        },
    );
    let num = |v: Option<f64>, digits: usize| v.map_or_else(|| "—".to_owned(), |x| format!("{x:.digits$}"));
    let facts = format!(
        r#"<dl class="facts" id="controller-facts">
<dt>Mode</dt><dd>{}</dd><dt>Backlog N</dt><dd>{}</dd><dt>Batch now</dt><dd id="chosen-batch">{}</dd>
<dt>Starts at</dt><dd>{} pending</dd><dt>Largest batch now</dt><dd>{}</dd><dt>Round time R(bs)</dt><dd>A = {}, α = {}, R² = {}</dd>
<dt>Rule</dt><dd>{}</dd><dt>Group size</dt><dd id="group-size">{}</dd><dt>Last choice</dt><dd>{}</dd></dl>"#,
        escape(view.mode),
        view.backlog,
        c.get("batch_size").map(Value::to_string).map_or_else(|| "—".to_owned(), |s| escape(&s)),
        c.get("target").map(Value::to_string).map_or_else(|| "—".to_owned(), |s| escape(&s)),
        c.get("cap").map(Value::to_string).map_or_else(|| "—".to_owned(), |s| escape(&s)),
        num(a, 2),
        num(alpha, 3),
        num(r2, 3),
        escape(&view.reason),
        escape(view.meter.group_size.get("message").and_then(Value::as_str).unwrap_or("—")),
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
                p.fitted_round_secs.map_or_else(|| "—".to_owned(), |x| format!("{x:.2} s"))
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
<h2>Profile</h2><table class="compact" id="profile"><thead><tr><th class="num">Batch size</th><th class="num">Median round R</th><th class="num">Backlog at this size (N/bs)·R</th><th class="num">Fitted R</th></tr></thead><tbody>{profile}</tbody></table>
<h2>Overload meter <span class="muted small">share of a group's lessons its answer keeps, by group size</span></h2>
<p class="muted small">{meter_method}. Target retention {target:.0}%.</p>{meter}
<h2>Samples <span class="muted small">newest first</span></h2><table class="compact" id="samples"><thead><tr><th>Time</th><th class="num">Batch size</th><th class="num">Round time</th><th>Round</th></tr></thead><tbody>{samples}</tbody></table>"#,
        escape(name.as_str()),
        prompt_tabs(&op, &name, "controller"),
        meter_method = escape(crate::service::controller::METER_METHOD),
        target = 100.0 * view.meter.target_retention,
    );
    Ok(page(&format!("{} controller", name.as_str()), Some(&op.who()), NavSection::Prompts, &body))
}
