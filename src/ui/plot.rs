//! Inline SVG charts, rendered on the server from plain numbers: the
//! batch-size controller's delay curve (measured T(bs), the fitted
//! A·bs^(−α), the chosen bs*), a round's phase timeline, and reward over
//! time per version with `production`'s promotions and rollbacks marked. No
//! script, no inline styles: classes only, so the page's CSP can forbid both.

use std::fmt::Write;

use super::html::escape;
use crate::domain::{LabelHistoryEntry, LabelMoveKind};

const W: f64 = 680.0;
const H: f64 = 360.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 20.0;
const BOTTOM: f64 = 50.0;

/// What the delay plot shows.
pub struct DelayPlot<'a> {
    /// (batch size, measured delay T in seconds), one per profiled size.
    pub points: &'a [(f64, f64)],
    /// (A, α) of the fit T(bs) = A·bs^(−α).
    pub fit: Option<(f64, f64)>,
    /// The batch size the controller chose.
    pub chosen: Option<f64>,
}

/// Log–log axes: the power law is a straight line there.
struct LogAxis {
    lo: f64,
    hi: f64,
    from: f64,
    to: f64,
}

impl LogAxis {
    fn new(lo: f64, hi: f64, from: f64, to: f64) -> Self {
        let (lo, hi) = if hi / lo < 1.5 { (lo / 1.5, hi * 1.5) } else { (lo, hi) };
        Self { lo: lo.ln(), hi: hi.ln(), from, to }
    }
    fn at(&self, v: f64) -> f64 {
        self.from + (v.ln() - self.lo) / (self.hi - self.lo) * (self.to - self.from)
    }
    fn contains(&self, v: f64) -> bool {
        v > 0.0 && v.ln() >= self.lo - 1e-9 && v.ln() <= self.hi + 1e-9
    }
}

/// 1, 2, 5 × 10^k ticks inside the range.
fn decade_ticks(axis: &LogAxis) -> Vec<f64> {
    let (lo, hi) = (axis.lo.exp(), axis.hi.exp());
    let mut ticks = Vec::new();
    let mut base = 10f64.powf(lo.log10().floor());
    while base <= hi {
        for m in [1.0, 2.0, 5.0] {
            let t = base * m;
            if t >= lo && t <= hi {
                ticks.push(t);
            }
        }
        base *= 10.0;
    }
    ticks
}

/// A tick or point value with two significant digits below 1 (`0.005`,
/// `0.012`), so small delays do not all print as `0.00`.
fn num(v: f64) -> String {
    if v >= 100.0 || v == v.round() {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        let decimals = ((-v.log10()).floor() as usize + 2).min(9);
        let s = format!("{v:.decimals$}");
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

/// The plot as an `<svg>` element, or `None` without any point.
pub fn delay_plot(p: &DelayPlot<'_>) -> Option<String> {
    let pts: Vec<(f64, f64)> =
        p.points.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite() && *x > 0.0 && *y > 0.0).collect();
    if pts.is_empty() {
        return None;
    }
    let mut xs: Vec<f64> = pts.iter().map(|p| p.0).collect();
    xs.extend(p.chosen.filter(|c| c.is_finite() && *c > 0.0));
    let (xmin, xmax) = xs.iter().fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    let (xmin, xmax) = (xmin / 1.25, xmax * 1.25);
    let curve: Vec<(f64, f64)> = match p.fit {
        Some((a, alpha)) if a.is_finite() && alpha.is_finite() && a > 0.0 => (0..=60)
            .map(|i| {
                let x = xmin * (xmax / xmin).powf(f64::from(i) / 60.0);
                (x, a * x.powf(-alpha))
            })
            .collect(),
        _ => Vec::new(),
    };
    let ys = pts.iter().chain(curve.iter()).map(|p| p.1).filter(|y| y.is_finite() && *y > 0.0);
    let (ymin, ymax) = ys.fold((f64::MAX, f64::MIN), |(a, b), y| (a.min(y), b.max(y)));
    let x = LogAxis::new(xmin, xmax, LEFT, W - RIGHT);
    let y = LogAxis::new(ymin / 1.2, ymax * 1.2, H - BOTTOM, TOP);

    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg class="plot" id="controller-plot" viewBox="0 0 {W} {H}" role="img" aria-label="Delay of learning the backlog against batch size">"#
    );
    let _ = write!(
        s,
        r#"<rect class="frame" x="{LEFT}" y="{TOP}" width="{}" height="{}"/>"#,
        W - LEFT - RIGHT,
        H - TOP - BOTTOM
    );
    // Grid and ticks: x at the powers of two in range, y at 1-2-5 decades.
    let mut bs = 2f64.powf(xmin.log2().ceil());
    while bs <= xmax {
        let px = x.at(bs);
        let _ = write!(
            s,
            r#"<line class="grid" x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{:.1}"/><text class="tick" x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            H - BOTTOM,
            H - BOTTOM + 18.0,
            escape(&num(bs))
        );
        bs *= 2.0;
    }
    for t in decade_ticks(&y) {
        let py = y.at(t);
        let _ = write!(
            s,
            r#"<line class="grid" x1="{LEFT}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}"/><text class="tick" x="{:.1}" y="{:.1}" text-anchor="end">{} s</text>"#,
            W - RIGHT,
            LEFT - 6.0,
            py + 4.0,
            escape(&num(t))
        );
    }
    let _ = write!(
        s,
        r#"<text class="axis" x="{:.1}" y="{:.1}" text-anchor="middle">batch size (log scale)</text><text class="axis" transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle">delay T(bs) for the backlog (log scale)</text>"#,
        (LEFT + W - RIGHT) / 2.0,
        H - 8.0,
        (TOP + H - BOTTOM) / 2.0
    );
    if !curve.is_empty() {
        let d: Vec<String> = curve
            .iter()
            .filter(|(cx, cy)| x.contains(*cx) && y.contains(*cy))
            .enumerate()
            .map(|(i, (cx, cy))| format!("{}{:.1} {:.1}", if i == 0 { "M" } else { "L" }, x.at(*cx), y.at(*cy)))
            .collect();
        let _ = write!(s, r#"<path class="fit" d="{}"/>"#, d.join(" "));
    }
    if let Some(c) = p.chosen.filter(|c| x.contains(*c)) {
        let px = x.at(c);
        // The label goes on whichever side of the line has room.
        let (lx, anchor) = if px > (LEFT + W - RIGHT) / 2.0 { (px - 6.0, "end") } else { (px + 6.0, "start") };
        let _ = write!(
            s,
            r#"<line class="choice" x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{:.1}"/><text class="choice-label" x="{lx:.1}" y="{:.1}" text-anchor="{anchor}">bs* = {}</text>"#,
            H - BOTTOM,
            TOP + 16.0,
            escape(&num(c))
        );
    }
    for (bx, by) in &pts {
        let _ = write!(
            s,
            r#"<circle class="point" cx="{:.1}" cy="{:.1}" r="5"><title>bs {}: T = {} s</title></circle>"#,
            x.at(*bx),
            y.at(*by),
            escape(&num(*bx)),
            escape(&num(*by))
        );
    }
    s.push_str("</svg>");
    Some(s)
}

/// One bar of the phase timeline: offsets from the round's start, in ms.
pub struct PhaseBar<'a> {
    pub name: &'a str,
    pub start_ms: f64,
    pub elapsed_ms: f64,
}

/// A Gantt-like strip of the round's phases.
pub fn timeline(bars: &[PhaseBar<'_>]) -> Option<String> {
    let end = bars.iter().map(|b| b.start_ms + b.elapsed_ms).fold(0.0, f64::max);
    if bars.is_empty() || end <= 0.0 {
        return None;
    }
    const TW: f64 = 1150.0;
    const LABEL: f64 = 110.0;
    const ROW: f64 = 24.0;
    let width = TW - LABEL - RIGHT;
    let height = ROW * bars.len() as f64 + 24.0;
    let mut s = format!(r#"<svg class="timeline" viewBox="0 0 {TW} {height}" role="img" aria-label="Phase timeline">"#);
    for (i, b) in bars.iter().enumerate() {
        let y = ROW * i as f64 + 4.0;
        let x0 = LABEL + b.start_ms / end * width;
        let w = (b.elapsed_ms / end * width).max(2.0);
        let _ = write!(
            s,
            r#"<text class="tick" x="{:.1}" y="{:.1}" text-anchor="end">{}</text><rect class="bar" x="{x0:.1}" y="{y:.1}" width="{w:.1}" height="{:.1}"><title>{}: {}</title></rect>"#,
            LABEL - 8.0,
            y + 14.0,
            escape(b.name),
            ROW - 8.0,
            escape(b.name),
            escape(&super::html::duration_ms(b.elapsed_ms))
        );
    }
    let _ = write!(
        s,
        r#"<text class="tick" x="{LABEL}" y="{:.1}">0</text><text class="tick" x="{:.1}" y="{:.1}" text-anchor="end">{}</text></svg>"#,
        height - 4.0,
        TW - RIGHT,
        height - 4.0,
        escape(&super::html::duration_ms(end))
    );
    Some(s)
}

#[cfg(test)]
mod num_tests {
    #[test]
    fn small_values_keep_significant_digits() {
        assert_eq!(super::num(0.005), "0.005");
        assert_eq!(super::num(0.0123), "0.012");
        assert_eq!(super::num(0.5), "0.5");
        assert_eq!(super::num(2.5), "2.5");
        assert_eq!(super::num(16.0), "16");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_delay_plot_has_a_point_per_size_the_fit_and_the_choice() {
        let points = [(4.0, 100.0), (8.0, 55.0), (16.0, 31.0)];
        let svg = delay_plot(&DelayPlot { points: &points, fit: Some((380.0, 0.95)), chosen: Some(12.0) }).unwrap();
        assert_eq!(svg.matches("<circle class=\"point\"").count(), 3);
        assert!(svg.contains("<path class=\"fit\" d=\"M"));
        assert!(svg.contains("bs* = 12"));
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
    }

    #[test]
    fn no_points_no_plot_and_bad_numbers_are_dropped() {
        assert!(delay_plot(&DelayPlot { points: &[], fit: None, chosen: None }).is_none());
        let svg = delay_plot(&DelayPlot { points: &[(4.0, f64::NAN), (8.0, 3.0)], fit: None, chosen: None }).unwrap();
        assert_eq!(svg.matches("<circle").count(), 1);
        assert!(!svg.contains("NaN"));
    }

    #[test]
    fn the_timeline_scales_bars_to_the_round() {
        let bars = [
            PhaseBar { name: "map", start_ms: 0.0, elapsed_ms: 300.0 },
            PhaseBar { name: "<reduce>", start_ms: 300.0, elapsed_ms: 100.0 },
        ];
        let svg = timeline(&bars).unwrap();
        assert_eq!(svg.matches("<rect class=\"bar\"").count(), 2);
        assert!(svg.contains("&lt;reduce&gt;") && !svg.contains("<reduce>"));
    }
}

/// One version's reward over time, for [`reward_plot`].
pub struct RewardSeries<'a> {
    /// `v3`, `v3 (production)`, `no version`.
    pub name: &'a str,
    /// (bucket start in Unix seconds, reward), oldest first.
    pub points: &'a [(i64, f64)],
}

/// Whether a marked move put a version forward or took one back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkerClass {
    /// An operator's promote, the gate's promote, a round's auto-publish.
    Promotion,
    /// An operator's rollback, the regression guard's rollback.
    Rollback,
}

impl MarkerClass {
    fn as_str(self) -> &'static str {
        match self {
            Self::Promotion => "promotion",
            Self::Rollback => "rollback",
        }
    }
}

/// A move of `production` drawn on the reward chart as a vertical line, so a
/// change in reward can be read against what changed the served version.
pub struct RewardMarker {
    /// When `production` moved, Unix seconds.
    pub at: i64,
    pub class: MarkerClass,
    /// The move's kind (`gate-promote`, `guard-rollback`, …): a CSS class too.
    pub kind: LabelMoveKind,
    /// The tooltip: kind, versions, who moved it and why.
    pub title: String,
}

/// Longest reason quoted in a marker's tooltip, in characters.
const MARKER_REASON_CHARS: usize = 200;

impl RewardMarker {
    /// The marker for a label move, or `None` for moves that neither promote
    /// nor roll back (the prompt's creation, a label deletion, a crossover child's label).
    pub fn for_move(m: &LabelHistoryEntry) -> Option<Self> {
        let class = match m.kind {
            LabelMoveKind::Promote | LabelMoveKind::GatePromote | LabelMoveKind::AutoPublish => MarkerClass::Promotion,
            LabelMoveKind::Rollback | LabelMoveKind::GuardRollback => MarkerClass::Rollback,
            // A crossover child is labelled `candidate`; it serves production only after a gate promotion.
            LabelMoveKind::Create | LabelMoveKind::Delete | LabelMoveKind::Crossover => return None,
        };
        let version = |v: Option<i64>| v.map_or_else(|| "—".to_owned(), |v| format!("v{v}"));
        let mut reason: String = m.reason.chars().take(MARKER_REASON_CHARS).collect();
        if m.reason.chars().count() > MARKER_REASON_CHARS {
            reason.push('…');
        }
        let title = format!(
            "{} {}: {} → {} by {} at {} UTC{}{}",
            m.kind.as_str(),
            m.label.as_str(),
            version(m.from_version),
            version(m.to_version),
            m.actor,
            m.at.format("%Y-%m-%d %H:%M:%S"),
            if reason.is_empty() { "" } else { " — " },
            reason
        );
        Some(Self { at: m.at.timestamp(), class, kind: m.kind, title })
    }
}

/// Reward (success rate, or mean score where no success is reported) per
/// version over time: one line per version, colour-coded by class
/// `series-0` … `series-5`, with a legend; every marker is a vertical line
/// (`g.marker.promotion` or `g.marker.rollback`) with its move as tooltip.
/// The time axis zooms to the data (points `bucket_secs` apart): a short run
/// fills the plot, and a move is drawn when it falls within a quarter of the
/// data's span (at least one bucket) of it, widening the axis to reach it;
/// moves further off are left out. `None` without any point.
pub fn reward_plot(series: &[RewardSeries<'_>], markers: &[RewardMarker], bucket_secs: i64) -> Option<String> {
    let all: Vec<(i64, f64)> =
        series.iter().flat_map(|s| s.points.iter().copied()).filter(|(_, y)| y.is_finite()).collect();
    if all.is_empty() {
        return None;
    }
    let (first, last) = all.iter().fold((i64::MAX, i64::MIN), |(a, b), (t, _)| (a.min(*t), b.max(*t)));
    let slack = ((last - first) / 4).max(bucket_secs.max(1));
    let markers: Vec<&RewardMarker> =
        markers.iter().filter(|m| m.at >= first - slack && m.at <= last + slack).collect();
    let (tmin, tmax) = markers.iter().fold((first, last), |(a, b), m| (a.min(m.at), b.max(m.at)));
    let pad = bucket_secs.max(1) as f64 / 2.0;
    let (tmin, tmax) = if tmax > tmin { (tmin as f64, tmax as f64) } else { (tmin as f64 - pad, tmax as f64 + pad) };
    let (ymin, ymax) = all.iter().fold((0.0f64, 1.0f64), |(a, b), (_, y)| (a.min(*y), b.max(*y)));
    let px = |t: i64| LEFT + (t as f64 - tmin) / (tmax - tmin) * (W - LEFT - RIGHT);
    let py = |y: f64| H - BOTTOM - (y - ymin) / (ymax - ymin) * (H - TOP - BOTTOM);

    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg class="plot" id="reward-plot" viewBox="0 0 {W} {H}" role="img" aria-label="Reward over time per version"><rect class="frame" x="{LEFT}" y="{TOP}" width="{}" height="{}"/>"#,
        W - LEFT - RIGHT,
        H - TOP - BOTTOM
    );
    for i in 0..=4 {
        let v = ymin + (ymax - ymin) * f64::from(i) / 4.0;
        let y = py(v);
        let _ = write!(
            s,
            r#"<line class="grid" x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}"/><text class="tick" x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            W - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            escape(&format!("{v:.2}"))
        );
    }
    for (t, anchor) in [(tmin, "start"), (tmax, "end")] {
        let label = chrono::DateTime::from_timestamp(t as i64, 0)
            .map_or_else(String::new, |d| d.format("%Y-%m-%d %H:%M").to_string());
        let _ = write!(
            s,
            r#"<text class="tick" x="{:.1}" y="{:.1}" text-anchor="{anchor}">{} UTC</text>"#,
            px(t as i64),
            H - BOTTOM + 18.0,
            escape(&label)
        );
    }
    let _ = write!(
        s,
        r#"<text class="axis" x="{:.1}" y="{:.1}" text-anchor="middle">time</text><text class="axis" transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle">reward (success rate, else mean score)</text>"#,
        (LEFT + W - RIGHT) / 2.0,
        H - 8.0,
        (TOP + H - BOTTOM) / 2.0
    );
    for m in &markers {
        let x = px(m.at);
        let _ = write!(
            s,
            r#"<g class="marker {} move-{}"><line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}"/><text class="marker-label" x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text><title>{}</title></g>"#,
            m.class.as_str(),
            m.kind.as_str(),
            H - BOTTOM,
            TOP - 4.0,
            match m.class {
                MarkerClass::Promotion => "▲",
                MarkerClass::Rollback => "↶",
            },
            escape(&m.title)
        );
    }
    for (i, line) in series.iter().enumerate() {
        let pts: Vec<&(i64, f64)> = line.points.iter().filter(|(_, y)| y.is_finite()).collect();
        if pts.is_empty() {
            continue;
        }
        let class = format!("series-{}", i % 6);
        let d: Vec<String> = pts
            .iter()
            .enumerate()
            .map(|(j, (t, y))| format!("{}{:.1} {:.1}", if j == 0 { "M" } else { "L" }, px(*t), py(*y)))
            .collect();
        let _ = write!(
            s,
            r#"<path class="series {class}" d="{}"><title>{}</title></path>"#,
            d.join(" "),
            escape(line.name)
        );
        for (t, y) in pts {
            let _ = write!(
                s,
                r#"<circle class="series-point {class}" cx="{:.1}" cy="{:.1}" r="3"><title>{}: {}</title></circle>"#,
                px(*t),
                py(*y),
                escape(line.name),
                escape(&format!("{y:.3}"))
            );
        }
    }
    s.push_str("</svg><p class=\"legend\" id=\"reward-legend\">");
    for (i, line) in series.iter().enumerate() {
        let _ = write!(s, r#"<span class="key series-{}"></span>{}"#, i % 6, escape(line.name));
    }
    if !markers.is_empty() {
        s.push_str(
            r#"<span class="key marker-key promotion"></span>promotion ▲<span class="key marker-key rollback"></span>rollback ↶ (hover a line for the move)"#,
        );
    }
    s.push_str("</p>");
    Some(s)
}

#[cfg(test)]
mod reward_tests {
    use super::*;

    #[test]
    fn one_line_per_version_with_escaped_names() {
        let a = [(0, 0.5), (3600, 0.75)];
        let b = [(3600, 0.25)];
        let svg = reward_plot(
            &[RewardSeries { name: "v2 (production)", points: &a }, RewardSeries { name: "<v1>", points: &b }],
            &[],
            3600,
        )
        .unwrap();
        assert_eq!(svg.matches("<path class=\"series").count(), 2);
        assert_eq!(svg.matches("<circle class=\"series-point").count(), 3);
        assert!(svg.contains("&lt;v1&gt;") && !svg.contains("<v1>"));
        assert!(reward_plot(&[RewardSeries { name: "v1", points: &[] }], &[], 3600).is_none());
        assert!(!svg.contains("class=\"marker"), "no move, no marker");
    }

    fn entry(kind: LabelMoveKind, from: i64, to: i64, at: i64, reason: &str) -> LabelHistoryEntry {
        LabelHistoryEntry {
            id: 1,
            label: crate::domain::LabelName::production(),
            from_version: Some(from),
            to_version: Some(to),
            kind,
            actor: "gate".into(),
            reason: reason.into(),
            evidence: None,
            at: chrono::DateTime::from_timestamp(at, 0).unwrap(),
        }
    }

    #[test]
    fn promotions_and_rollbacks_are_vertical_lines_with_their_move_as_tooltip() {
        let points = [(0, 0.5), (3600, 0.75)];
        let moves = [
            entry(LabelMoveKind::Create, 0, 1, 0, ""),
            entry(LabelMoveKind::GatePromote, 1, 2, 1800, "μ−2σ 21.0 > 18.2 <b>"),
            entry(LabelMoveKind::GuardRollback, 2, 1, 5400, "reward fell"),
        ];
        let markers: Vec<RewardMarker> = moves.iter().filter_map(RewardMarker::for_move).collect();
        assert_eq!(markers.len(), 2, "the creation is not a promotion");
        let svg = reward_plot(&[RewardSeries { name: "v1", points: &points }], &markers, 3600).unwrap();
        assert_eq!(svg.matches("<g class=\"marker promotion move-gate-promote\">").count(), 1);
        assert_eq!(svg.matches("<g class=\"marker rollback move-guard-rollback\">").count(), 1);
        assert!(svg.contains("gate-promote production: v1 → v2 by gate"), "{svg}");
        assert!(svg.contains("&lt;b&gt;") && !svg.contains("<b>"), "reasons are escaped");
        // The gate's move sits halfway between the points; the rollback after the
        // last point widens the axis to the right edge of the plot.
        let x = |class: &str| -> f64 {
            let at = svg.find(class).unwrap();
            let rest = &svg[at..];
            let x1 = rest.find("x1=\"").unwrap() + 4;
            rest[x1..].split('"').next().unwrap().parse().unwrap()
        };
        let right = W - RIGHT;
        assert!((x("move-guard-rollback") - right).abs() < 0.1);
        assert!((x("move-gate-promote") - (LEFT + (right - LEFT) / 3.0)).abs() < 0.1);
        let long = entry(LabelMoveKind::Promote, 1, 2, 0, &"x".repeat(500));
        assert!(RewardMarker::for_move(&long).unwrap().title.ends_with("x…"));
    }

    /// The x of every `<circle>` of the plot, in order.
    fn point_xs(svg: &str) -> Vec<f64> {
        svg.split("<circle")
            .skip(1)
            .map(|c| c.split("cx=\"").nth(1).unwrap().split('"').next().unwrap().parse().unwrap())
            .collect()
    }

    #[test]
    fn a_short_run_fills_the_axis_and_far_moves_are_left_out() {
        // Three minutes of data, a week after a promotion and a minute before a rollback.
        let t0 = 1_800_000_000;
        let points = [(t0, 0.5), (t0 + 60, 0.25), (t0 + 120, 0.75)];
        let moves = [
            entry(LabelMoveKind::Promote, 1, 2, t0 - 5 * 86_400, "long ago"),
            entry(LabelMoveKind::Rollback, 2, 1, t0 + 180, "just after"),
        ];
        let markers: Vec<RewardMarker> = moves.iter().filter_map(RewardMarker::for_move).collect();
        let svg = reward_plot(&[RewardSeries { name: "v1", points: &points }], &markers, 60).unwrap();
        assert!(!svg.contains("long ago"), "a move days away is not drawn");
        assert_eq!(svg.matches("<g class=\"marker").count(), 1, "the rollback a minute later is");
        let xs = point_xs(&svg);
        assert!((xs[0] - LEFT).abs() < 0.1, "the run starts at the left edge: {xs:?}");
        let right = W - RIGHT;
        assert!((xs[2] - (LEFT + (right - LEFT) * 120.0 / 180.0)).abs() < 0.1, "{xs:?}");
        // The axis is labelled with the run's own start and end.
        let label = |t: i64| chrono::DateTime::from_timestamp(t, 0).unwrap().format("%Y-%m-%d %H:%M").to_string();
        assert!(svg.contains(&format!(">{} UTC<", label(t0))) && svg.contains(&format!(">{} UTC<", label(t0 + 180))));
        // One instant: half a bucket either side, the point in the middle.
        let one = [(t0, 0.5)];
        let xs = point_xs(&reward_plot(&[RewardSeries { name: "v1", points: &one }], &[], 60).unwrap());
        assert!((xs[0] - (LEFT + right) / 2.0).abs() < 0.1, "{xs:?}");
    }
}
