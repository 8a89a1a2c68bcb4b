//! The quality-vs-delay figure of one simulated model: retention against time
//! to learn, one marker per configuration.

use crate::report::{LearnReport, model_name, sizes_text};
use crate::results::{Family, RunRow, Sizing};
use crate::svg::{Axis, BOTTOM, H, LEFT, MarkerShape, RIGHT, Rect, Svg, TOP, W, legend_size, log_bounds, place_label};

fn style(family: Family) -> (MarkerShape, &'static str, bool) {
    match family {
        Family::Sequential => (MarkerShape::Square, "#222222", true),
        Family::SequentialOneRound => (MarkerShape::Square, "#777777", false),
        Family::Naive => (MarkerShape::Circle, "#d62728", true),
        Family::Combee => (MarkerShape::Triangle, "#1f77b4", true),
        Family::CombeeTuned => (MarkerShape::Diamond, "#1f77b4", false),
        Family::CombeeAuto => (MarkerShape::Star, "#2ca02c", true),
        Family::CombeeAutoWarm => (MarkerShape::Star, "#98df8a", true),
        Family::CombeeAutoResumed => (MarkerShape::Star, "#17becf", true),
        Family::CombeeAutoTuned => (MarkerShape::Star, "#2ca02c", false),
    }
}

impl LearnReport<'_> {
    pub(crate) fn quality_delay_svg(&self) -> String {
        let mut svg = Svg::new(
            &format!(
                "Retention vs time to learn N = {} traces ({} capacity model)",
                self.n(),
                model_name(self.sim.capacity_model)
            ),
            &format!(
                "simulated LLM: {} ms + {} ms/input token + {} ms/output token; K = {}, D = {}; playbook, p = 2",
                self.sim.fixed_ms,
                self.sim.per_input_token_ms,
                self.sim.per_output_token_ms,
                self.sim.capacity_k,
                self.sim.digest_reflections,
            ),
        );
        let (lo, hi) = log_bounds(self.rows.iter().map(|r| r.result().total_secs));
        let x = Axis { lo, hi, log: true, from: LEFT, to: W - RIGHT };
        let y = Axis { lo: 0.0, hi: 108.0, log: false, from: H - BOTTOM, to: TOP };
        svg.axes(
            &x,
            &y,
            1.0,
            10.0,
            "time to learn all N traces (s, log scale) — left is faster",
            "retention (% of the N insights in the final prompt)",
        );
        let families = [
            Family::Sequential,
            Family::SequentialOneRound,
            Family::Naive,
            Family::Combee,
            Family::CombeeTuned,
            Family::CombeeAuto,
            Family::CombeeAutoWarm,
            Family::CombeeAutoResumed,
        ];
        let entries: Vec<(Option<MarkerShape>, &str, bool, String)> = families
            .iter()
            .filter(|f| self.rows.iter().any(|r| r.setup.family == **f))
            .map(|&f| {
                let (s, c, filled) = style(f);
                let label = match f {
                    Family::Naive | Family::Combee | Family::CombeeTuned => format!("{} (label: batch size)", f.name()),
                    _ => f.name().to_owned(),
                };
                (Some(s), c, filled, label)
            })
            .collect();
        // The legend sits in the empty lower right: slow and forgetful is where nothing lands.
        let (lw, lh) = legend_size(&entries);
        let (lx, ly) = (x.to - lw - 10.0, y.from - lh - 10.0);
        svg.legend(lx, ly, &entries);
        let mut taken = vec![Rect { x0: lx, y0: ly, x1: lx + lw, y1: ly + lh }];
        let points: Vec<(&RunRow, f64, f64)> = self
            .rows
            .iter()
            .map(|row| {
                let r = row.result();
                (row, x.at(r.total_secs), y.at(100.0 * self.retention(r)))
            })
            .collect();
        // Named configurations are drawn last, on top of any fixed-size marker they share a spot with.
        let mut order: Vec<&(&RunRow, f64, f64)> = points.iter().collect();
        order.sort_by_key(|(row, _, _)| {
            !matches!(row.setup.sizing, Sizing::Fixed(_)) || row.setup.family == Family::Sequential
        });
        for &&(row, px, py) in &order {
            let (shape, color, filled) = style(row.setup.family);
            svg.marker(shape, px, py, color, filled);
            taken.push(Rect { x0: px - 8.0, y0: py - 8.0, x1: px + 8.0, y1: py + 8.0 });
        }
        // ... and labelled first, so they get the best spots.
        order.sort_by_key(|(row, _, _)| {
            matches!(row.setup.sizing, Sizing::Fixed(_)) && row.setup.family != Family::Sequential
        });
        let bounds = Rect { x0: x.from, y0: y.to, x1: x.to, y1: y.from };
        for &&(row, px, py) in &order {
            let r = row.result();
            let (_, color, _) = style(row.setup.family);
            let label = match (row.setup.family, &row.setup.sizing) {
                (Family::Naive | Family::Combee | Family::CombeeTuned, Sizing::Fixed(bs)) => format!("{bs}"),
                (Family::CombeeAuto, _) => format!("combee-auto: {}", sizes_text(r)),
                (Family::Sequential, _) => "sequential (bs 3)".to_owned(),
                (family, _) => family.name().to_owned(),
            };
            let (tx, ty, anchor, rect) = place_label(px, py, &label, 11.0, &taken, &bounds);
            taken.push(rect);
            svg.text(tx, ty, 11.0, anchor, color, &label);
        }
        svg.finish()
    }
}
