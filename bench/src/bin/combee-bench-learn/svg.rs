//! SVG by hand: axes with log or linear ticks, markers, lines, a legend, and
//! labels placed where they overlap nothing, for the quality-vs-delay figure.

use std::fmt::Write as _;

pub(crate) const W: f64 = 820.0;
pub(crate) const H: f64 = 520.0;
pub(crate) const LEFT: f64 = 80.0;
pub(crate) const RIGHT: f64 = 30.0;
pub(crate) const TOP: f64 = 56.0;
pub(crate) const BOTTOM: f64 = 70.0;

#[derive(Clone, Copy)]
pub(crate) struct Axis {
    pub(crate) lo: f64,
    pub(crate) hi: f64,
    pub(crate) log: bool,
    pub(crate) from: f64,
    pub(crate) to: f64,
}

impl Axis {
    pub(crate) fn at(&self, v: f64) -> f64 {
        let f = if self.log {
            (v.ln() - self.lo.ln()) / (self.hi.ln() - self.lo.ln())
        } else {
            (v - self.lo) / (self.hi - self.lo)
        };
        self.from + f * (self.to - self.from)
    }

    /// 1-2-5 ticks for a log axis, even steps for a linear one.
    fn ticks(&self, step: f64) -> Vec<f64> {
        if self.log {
            let mut out = Vec::new();
            let mut decade = 10f64.powf(self.lo.log10().floor());
            while decade <= self.hi {
                for m in [1.0, 2.0, 5.0] {
                    let v = decade * m;
                    if v >= self.lo * 0.999 && v <= self.hi * 1.001 {
                        out.push(v);
                    }
                }
                decade *= 10.0;
            }
            out
        } else {
            let mut out = Vec::new();
            let mut v = (self.lo / step).ceil() * step;
            while v <= self.hi + 1e-9 {
                out.push(v);
                v += step;
            }
            out
        }
    }
}

fn tick_label(v: f64) -> String {
    if v >= 1.0 && (v - v.round()).abs() < 1e-9 { format!("{}", v.round() as i64) } else { format!("{v}") }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

pub(crate) struct Svg {
    body: String,
}

impl Svg {
    pub(crate) fn new(title: &str, subtitle: &str) -> Self {
        let mut body = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\" \
             font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
        );
        let _ = writeln!(
            body,
            "<text x=\"{}\" y=\"24\" font-size=\"17\" font-weight=\"bold\" text-anchor=\"middle\">{}</text>",
            W / 2.0,
            esc(title)
        );
        let _ = writeln!(
            body,
            "<text x=\"{}\" y=\"43\" font-size=\"12\" fill=\"#555\" text-anchor=\"middle\">{}</text>",
            W / 2.0,
            esc(subtitle)
        );
        Self { body }
    }

    pub(crate) fn axes(&mut self, x: &Axis, y: &Axis, x_step: f64, y_step: f64, x_title: &str, y_title: &str) {
        let (x0, x1, y0, y1) = (x.from, x.to, y.from, y.to);
        for t in x.ticks(x_step) {
            let px = x.at(t);
            let _ = writeln!(
                self.body,
                "<line x1=\"{px:.1}\" y1=\"{y0:.1}\" x2=\"{px:.1}\" y2=\"{y1:.1}\" stroke=\"#e5e5e5\"/>"
            );
            let _ = writeln!(
                self.body,
                "<line x1=\"{px:.1}\" y1=\"{y0:.1}\" x2=\"{px:.1}\" y2=\"{:.1}\" stroke=\"#333\"/>",
                y0 + 5.0
            );
            let _ = writeln!(
                self.body,
                "<text x=\"{px:.1}\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"middle\">{}</text>",
                y0 + 19.0,
                tick_label(t)
            );
        }
        for t in y.ticks(y_step) {
            let py = y.at(t);
            let _ = writeln!(
                self.body,
                "<line x1=\"{x0:.1}\" y1=\"{py:.1}\" x2=\"{x1:.1}\" y2=\"{py:.1}\" stroke=\"#e5e5e5\"/>"
            );
            let _ = writeln!(
                self.body,
                "<line x1=\"{:.1}\" y1=\"{py:.1}\" x2=\"{x0:.1}\" y2=\"{py:.1}\" stroke=\"#333\"/>",
                x0 - 5.0
            );
            let _ = writeln!(
                self.body,
                "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"end\">{}</text>",
                x0 - 8.0,
                py + 4.0,
                tick_label(t)
            );
        }
        let _ = writeln!(
            self.body,
            "<rect x=\"{x0:.1}\" y=\"{y1:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"none\" stroke=\"#333\"/>",
            x1 - x0,
            y0 - y1
        );
        let _ = writeln!(
            self.body,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"13\" text-anchor=\"middle\">{}</text>",
            (x0 + x1) / 2.0,
            y0 + 42.0,
            esc(x_title)
        );
        let _ = writeln!(
            self.body,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"13\" text-anchor=\"middle\" transform=\"rotate(-90 {:.1} {:.1})\">{}</text>",
            22.0,
            (y0 + y1) / 2.0,
            22.0,
            (y0 + y1) / 2.0,
            esc(y_title)
        );
    }

    pub(crate) fn marker(&mut self, shape: MarkerShape, px: f64, py: f64, color: &str, filled: bool) {
        let fill = if filled { color } else { "white" };
        let style = format!("fill=\"{fill}\" stroke=\"{color}\" stroke-width=\"1.8\"");
        let _ = match shape {
            MarkerShape::Circle => writeln!(self.body, "<circle cx=\"{px:.1}\" cy=\"{py:.1}\" r=\"5.5\" {style}/>"),
            MarkerShape::Square => writeln!(
                self.body,
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"11\" height=\"11\" {style}/>",
                px - 5.5,
                py - 5.5
            ),
            MarkerShape::Triangle => writeln!(
                self.body,
                "<polygon points=\"{:.1},{:.1} {:.1},{:.1} {:.1},{:.1}\" {style}/>",
                px,
                py - 7.0,
                px - 6.5,
                py + 5.0,
                px + 6.5,
                py + 5.0
            ),
            MarkerShape::Diamond => writeln!(
                self.body,
                "<polygon points=\"{:.1},{:.1} {:.1},{:.1} {:.1},{:.1} {:.1},{:.1}\" {style}/>",
                px,
                py - 7.0,
                px + 7.0,
                py,
                px,
                py + 7.0,
                px - 7.0,
                py
            ),
            MarkerShape::Star => {
                let pts: Vec<String> = (0..10)
                    .map(|i| {
                        let r = if i % 2 == 0 { 10.0 } else { 4.2 };
                        let a = std::f64::consts::PI * (i as f64) / 5.0 - std::f64::consts::FRAC_PI_2;
                        format!("{:.1},{:.1}", px + r * a.cos(), py + r * a.sin())
                    })
                    .collect();
                writeln!(self.body, "<polygon points=\"{}\" {style}/>", pts.join(" "))
            }
        };
    }

    pub(crate) fn text(&mut self, px: f64, py: f64, size: f64, anchor: &str, color: &str, text: &str) {
        let _ = writeln!(
            self.body,
            "<text x=\"{px:.1}\" y=\"{py:.1}\" font-size=\"{size}\" text-anchor=\"{anchor}\" fill=\"{color}\">{}</text>",
            esc(text)
        );
    }

    fn line(&mut self, points: &[(f64, f64)], color: &str, width: f64, dash: Option<&str>) {
        let d: Vec<String> = points.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let dash = dash.map_or(String::new(), |d| format!(" stroke-dasharray=\"{d}\""));
        let _ = writeln!(
            self.body,
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"{width}\"{dash}/>",
            d.join(" ")
        );
    }

    /// A legend box; entries are (shape or line, color, filled, label).
    pub(crate) fn legend(&mut self, x: f64, y: f64, entries: &[(Option<MarkerShape>, &str, bool, String)]) {
        let (width, height) = legend_size(entries);
        let _ = writeln!(
            self.body,
            "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{width:.1}\" height=\"{height:.1}\" fill=\"white\" fill-opacity=\"0.92\" stroke=\"#999\"/>"
        );
        for (i, (shape, color, filled, label)) in entries.iter().enumerate() {
            let cy = y + 17.0 + 20.0 * i as f64;
            match shape {
                Some(s) => self.marker(*s, x + 20.0, cy, color, *filled),
                None => {
                    self.line(&[(x + 8.0, cy), (x + 32.0, cy)], color, 2.0, if *filled { None } else { Some("6 4") })
                }
            }
            self.text(x + 40.0, cy + 4.0, 12.0, "start", "#222", label);
        }
    }

    pub(crate) fn finish(mut self) -> String {
        self.body.push_str("</svg>\n");
        self.body
    }
}

#[derive(Clone, Copy)]
pub(crate) enum MarkerShape {
    Circle,
    Square,
    Triangle,
    Diamond,
    Star,
}

#[derive(Clone, Copy)]
pub(crate) struct Rect {
    pub(crate) x0: f64,
    pub(crate) y0: f64,
    pub(crate) x1: f64,
    pub(crate) y1: f64,
}

impl Rect {
    fn overlap(&self, o: &Rect) -> f64 {
        let w = (self.x1.min(o.x1) - self.x0.max(o.x0)).max(0.0);
        let h = (self.y1.min(o.y1) - self.y0.max(o.y0)).max(0.0);
        w * h
    }

    fn inside(&self, o: &Rect) -> bool {
        self.x0 >= o.x0 && self.x1 <= o.x1 && self.y0 >= o.y0 && self.y1 <= o.y1
    }
}

/// Where to put a marker's label: the first of a few spots around it that is
/// inside the plot and free of markers, the legend and earlier labels, else the
/// spot with the least overlap. Returns the text position, anchor and box.
pub(crate) fn place_label(
    px: f64,
    py: f64,
    text: &str,
    size: f64,
    taken: &[Rect],
    bounds: &Rect,
) -> (f64, f64, &'static str, Rect) {
    let w = text.chars().count() as f64 * size * 0.58;
    let spots = [
        (9.0, 4.0, "start"),
        (-9.0, 4.0, "end"),
        (0.0, -12.0, "middle"),
        (0.0, 20.0, "middle"),
        (7.0, -10.0, "start"),
        (7.0, 18.0, "start"),
        (-7.0, -10.0, "end"),
        (-7.0, 18.0, "end"),
        (0.0, -25.0, "middle"),
        (0.0, 33.0, "middle"),
        (22.0, 4.0, "start"),
        (-22.0, 4.0, "end"),
    ];
    let boxed = |(dx, dy, anchor): (f64, f64, &'static str)| {
        let (tx, ty) = (px + dx, py + dy);
        let x0 = match anchor {
            "start" => tx,
            "end" => tx - w,
            _ => tx - w / 2.0,
        };
        (tx, ty, anchor, Rect { x0, y0: ty - size, x1: x0 + w, y1: ty + 3.0 })
    };
    let cost = |r: &Rect| {
        let outside = if r.inside(bounds) { 0.0 } else { 1e6 };
        outside + taken.iter().map(|t| t.overlap(r)).sum::<f64>()
    };
    let mut best = boxed(spots[0]);
    let mut best_cost = cost(&best.3);
    for spot in spots {
        let candidate = boxed(spot);
        let c = cost(&candidate.3);
        if c < best_cost {
            (best, best_cost) = (candidate, c);
        }
        if c == 0.0 {
            break;
        }
    }
    best
}

pub(crate) fn legend_size(entries: &[(Option<MarkerShape>, &str, bool, String)]) -> (f64, f64) {
    let width = 14.0 + 36.0 + entries.iter().map(|e| e.3.chars().count()).max().unwrap_or(0) as f64 * 6.6;
    (width, 10.0 + 20.0 * entries.len() as f64)
}

/// Bounds of a log axis on 1-2-5 values, with some room on both sides.
pub(crate) fn log_bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() {
        return (1.0, 10.0);
    }
    let steps = |decade: f64| [1.0, 2.0, 5.0].map(|m| m * 10f64.powf(decade));
    let below = (lo / 1.3).log10().floor();
    let lo = steps(below).into_iter().filter(|v| *v <= lo / 1.3).fold(10f64.powf(below), f64::max);
    let above = (hi * 1.3).log10().floor();
    let hi = steps(above).into_iter().chain([10f64.powf(above + 1.0)]).find(|v| *v >= hi * 1.3).unwrap_or(hi * 2.0);
    (lo, hi)
}
