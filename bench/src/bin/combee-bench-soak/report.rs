//! The soak's Markdown report: the setting, per period latencies, the rater,
//! Postgres's upkeep and insides, table sizes, the targets, and the
//! projection of the database size at 100 traces/s.

use std::{collections::BTreeMap, fmt::Write as _};

use crate::period::{KINDS, Live, Period, UPKEEP_TABLES, counter, summary};
use crate::{SoakArgs, insight};

fn mb(bytes: i64) -> f64 {
    bytes as f64 / 1_048_576.0
}

pub(crate) fn render(
    args: &SoakArgs,
    pg: &[(String, String)],
    load: (&str, &str),
    history: (i64, f64, &BTreeMap<String, i64>),
    live: &Live,
    end: (i64, &BTreeMap<String, i64>),
    scrape: &str,
) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# combee soak benchmark: a year in a day (SIMULATION)\n");
    let _ = writeln!(
        o,
        "Everything here is a **SIMULATION**: simulated agents against the real server, which learns against combee's simulated LLM. Product defaults (retention {}, the worker, the population rater, the regression guard, default caches); only the LLM's address is set.\n",
        if args.retention { "on" } else { "OFF (comparison run)" }
    );
    let setting = |k: &str| pg.iter().find(|(n, _)| n == k).map_or("?", |(_, v)| v.as_str()).to_owned();
    let _ = writeln!(
        o,
        "- machine: {} CPUs shared by the load generator, the server, the simulated LLM and Postgres; load average at the start {} and at the end {}",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        load.0.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
        load.1.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
    let _ = writeln!(
        o,
        "- Postgres {} (private, durable: fsync = {}, synchronous_commit = {}, shared_buffers = {} × 8 kB)",
        setting("server_version"),
        setting("fsync"),
        setting("synchronous_commit"),
        setting("shared_buffers")
    );
    let hist_total: i64 = history.2.values().sum();
    let _ = writeln!(
        o,
        "- history: {} traces over {} days for {} prompts, loaded with their timestamps in {:.0} s ({} rounds with their LLM calls, every tenth trace with a reflection, every tenth with two OTLP spans); database {:.0} MB",
        history.0,
        args.history_days,
        args.prompts,
        history.1,
        args.history_days * args.prompts as i64,
        mb(hist_total)
    );
    let _ = writeln!(
        o,
        "- live: a {} s warm-up, then {} s in {} periods; {} agent runs/s (each a GET with a subject from {} and a trace with a reward; {:.0} % over OTLP, {:.0} % of posted traces with late feedback); a dashboard reads metrics (default 7-day window) {} times/s; {} runs in all",
        args.warmup_secs,
        args.live_secs,
        args.periods,
        args.rate,
        args.subjects,
        args.otlp_share * 100.0,
        args.late_feedback * 100.0,
        args.metrics_rate,
        live.runs
    );
    if args.warmup_secs > 0 {
        let _ = writeln!(
            o,
            "- the **warm-up** is the live load's first {} s: learning starts, the batch-size controller walks its ladder, populations fill from one arm to several, retention deletes the history past its 30-day horizon. It is printed, but the last / first ratios compare the periods after it (worst-case targets — metrics p99, errors, RSS — include it)",
            args.warmup_secs
        );
    }
    let _ = writeln!(
        o,
        "- rater: a tick checks every `evaluated` prompt and rates the windows that closed (each prompt's every 600 s, staggered over the ticks); its time includes waiting on the simulated LLM when a rated window draws a crossover (20 %). \"own work\" is the tick less that wait; \"per window\" is the store work (read the window, save the ratings) per rated window\n"
    );
    let _ = writeln!(o, "## Per period\n");
    let _ = write!(o, "| period | ");
    for k in KINDS {
        let _ = write!(o, "{k} p50 / p99 ms | ");
    }
    let _ = writeln!(
        o,
        "errors | rater tick mean s (ticks) | rater tick own work s | rater per window ms (windows) | rounds (mean wall) | traces deleted | traces stored | database | server RSS |"
    );
    let _ = writeln!(o, "|{}", " --- |".repeat(KINDS.len() + 10));
    for (p, name) in live.periods.iter().zip(period_names(&live.periods)) {
        let _ = write!(o, "| {name} | ");
        for k in KINDS {
            match p.samples.get(k) {
                Some(s) if !s.us.is_empty() => {
                    let _ = write!(o, "{:.2} / {:.2} | ", s.quantile_ms(0.5), s.quantile_ms(0.99));
                }
                _ => {
                    let _ = write!(o, "— | ");
                }
            }
        }
        let errors: u64 = p.samples.values().map(|s| s.errors).sum();
        let (rater, own) = if p.rater.1 > 0.0 {
            (
                format!("{:.3} ({})", p.rater.0 / p.rater.1, p.rater.1),
                format!("{:.3}", (p.rater.0 - p.rater_llm) / p.rater.1),
            )
        } else {
            ("—".into(), "—".into())
        };
        let per_window = if p.rater_windows.1 > 0.0 {
            format!("{:.1} ({})", 1000.0 * p.rater_windows.0 / p.rater_windows.1, p.rater_windows.1)
        } else {
            "—".into()
        };
        let rounds = if p.rounds.is_empty() {
            "0".into()
        } else {
            format!("{} ({:.1} s)", p.rounds.len(), p.rounds.iter().sum::<f64>() / p.rounds.len() as f64)
        };
        let _ = writeln!(
            o,
            "{errors} | {rater} | {own} | {per_window} | {rounds} | {:.0} | {} | {:.0} MB | {:.1} MB |",
            p.deleted,
            p.traces,
            mb(p.sizes.values().sum()),
            p.rss_kb as f64 / 1024.0
        );
    }
    for p in &live.periods {
        for (k, s) in &p.samples {
            if let Some(e) = &s.first_error {
                let _ = writeln!(o, "\nFirst error of \"{k}\": {e}");
            }
        }
    }
    let _ = writeln!(
        o,
        "\n## The rater and Postgres's upkeep, per period\n\nWhere a rated window's store work went (reading the window; saving the ratings), how many arms each `evaluated` population had live at the period's end, what Postgres did in the background meanwhile (autovacuum runs and dead rows at the period's end per table, checkpoints), and the CPU each process sharing the 2 cores used (percent of one core: the server, the simulated LLM, every Postgres process, this load generator).\n"
    );
    let _ = writeln!(
        o,
        "| period | windows | read ms / window | save ms / window | live arms per population | autovacuums ({}) | dead rows at the end ({}) | checkpoints | CPU % (server / simulated LLM / Postgres / load) |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        UPKEEP_TABLES.join(" / "),
        UPKEEP_TABLES.join(" / ")
    );
    for (p, name) in live.periods.iter().zip(period_names(&live.periods)) {
        let per = |secs: f64| {
            if p.rater_windows.1 > 0.0 { format!("{:.1}", 1000.0 * secs / p.rater_windows.1) } else { "—".into() }
        };
        let column = |pick: fn(&(i64, i64)) -> i64| {
            UPKEEP_TABLES.map(|t| p.upkeep.tables.get(t).map_or("—".to_owned(), |v| pick(v).to_string())).join(" / ")
        };
        let _ = writeln!(
            o,
            "| {name} | {} | {} | {} | {:.1} | {} | {} | {} | {} |",
            p.rater_windows.1,
            per(p.rater_read_save.0),
            per(p.rater_read_save.1),
            p.live_arms,
            column(|v| v.0),
            column(|v| v.1),
            p.upkeep.checkpoints,
            [p.cpu.server, p.cpu.sim, p.cpu.postgres, p.cpu.load]
                .map(|c| format!("{:.0}", 100.0 * c / p.secs.max(1.0)))
                .join(" / ")
        );
    }
    render_inside(&mut o, live);
    let _ = writeln!(o, "\n## Per-table size (MB): after the load, after each period\n");
    let mut tables: Vec<&String> = end.1.keys().collect();
    tables.sort_by_key(|t| -end.1[*t]);
    let _ = write!(o, "| table | history |");
    let mut measured = 0;
    for p in &live.periods {
        if p.warmup {
            let _ = write!(o, " warm-up |");
        } else {
            measured += 1;
            let _ = write!(o, " period {measured} |");
        }
    }
    let _ = writeln!(o, "\n|{}", " --- |".repeat(live.periods.len() + 2));
    for t in tables.iter().take(16) {
        let _ = write!(o, "| {t} | {:.1} |", mb(history.2.get(*t).copied().unwrap_or(0)));
        for p in &live.periods {
            let _ = write!(o, " {:.1} |", mb(p.sizes.get(*t).copied().unwrap_or(0)));
        }
        let _ = writeln!(o);
    }
    // Targets: ratios over the periods after the warm-up.
    let first = live.periods.iter().find(|p| !p.warmup);
    let last = live.periods.iter().rev().find(|p| !p.warmup);
    let _ = writeln!(
        o,
        "\n## Targets\n\nRatios: the last period over the first after the warm-up.\n\n| target | measured | result |\n| --- | --- | --- |"
    );
    if let (Some(f), Some(l)) = (first, last) {
        for k in KINDS {
            let (Some(a), Some(b)) = (f.samples.get(k), l.samples.get(k)) else { continue };
            for q in [0.5, 0.99] {
                let ratio = b.quantile_ms(q) / a.quantile_ms(q);
                let _ = writeln!(
                    o,
                    "| {k} p{:.0}: last period / first ≤ 1.3 | {ratio:.2} ({:.2} / {:.2} ms) | {} |",
                    q * 100.0,
                    b.quantile_ms(q),
                    a.quantile_ms(q),
                    pass(ratio <= 1.3)
                );
            }
        }
        if f.rater.1 > 0.0 && l.rater.1 > 0.0 && f.rater_windows.1 > 0.0 && l.rater_windows.1 > 0.0 {
            // A tick's work is the windows that closed before it (each prompt's every window,
            // staggered), so the comparable figure is per rated window; per tick is shown beside it.
            let own_per_window = |p: &Period| 1000.0 * (p.rater.0 - p.rater_llm) / p.rater_windows.1;
            let ratio = own_per_window(l) / own_per_window(f);
            let _ = writeln!(
                o,
                "| rater ticks' own work (less the simulated LLM's answer time) per rated window: last / first ≤ 1.3 | {ratio:.2} ({:.1} / {:.1} ms) | {} |",
                own_per_window(l),
                own_per_window(f),
                pass(ratio <= 1.3)
            );
            let own = |p: &Period| (p.rater.0 - p.rater_llm) / p.rater.1;
            let per_tick = |p: &Period| p.rater_windows.1 / p.rater.1;
            let _ = writeln!(
                o,
                "| rater tick, its own work (information: a tick rates the windows due, here {:.1} / {:.1} a tick) | {:.2} ({:.3} / {:.3} s) | — |",
                per_tick(l),
                per_tick(f),
                own(l) / own(f),
                own(l),
                own(f)
            );
            let mean = |p: &Period| p.rater.0 / p.rater.1;
            let _ = writeln!(
                o,
                "| rater tick with the LLM wait (information: crossovers are a 20 % draw per window) | {:.2} ({:.3} / {:.3} s) | — |",
                mean(l) / mean(f),
                mean(l),
                mean(f)
            );
        }
        if f.rater_windows.1 > 0.0 && l.rater_windows.1 > 0.0 {
            let per = |p: &Period| 1000.0 * p.rater_windows.0 / p.rater_windows.1;
            let ratio = per(l) / per(f);
            let _ = writeln!(
                o,
                "| rater store work per rated window: last / first ≤ 1.3 | {ratio:.2} ({:.1} / {:.1} ms) | {} |",
                per(l),
                per(f),
                pass(ratio <= 1.3)
            );
        }
        let metrics_p99 = live
            .periods
            .iter()
            .filter_map(|p| p.samples.get("GET metrics"))
            .map(|s| s.quantile_ms(0.99))
            .fold(0.0, f64::max);
        let _ = writeln!(
            o,
            "| metrics p99 ≤ 20 ms over the {}-trace history (worst period, warm-up included) | {metrics_p99:.2} ms | {} |",
            history.0,
            pass(metrics_p99 <= 20.0)
        );
        let size = |p: &Period| p.sizes.values().sum::<i64>() as f64;
        let growth = size(l) / size(f);
        let _ = writeln!(
            o,
            "| database size past the horizon: last / first ≤ 1.2 | {growth:.3} ({:.0} / {:.0} MB) | {} |",
            size(l) / 1_048_576.0,
            size(f) / 1_048_576.0,
            pass(growth <= 1.2)
        );
    }
    let errors: u64 = live.periods.iter().flat_map(|p| p.samples.values()).map(|s| s.errors).sum();
    let _ = writeln!(o, "| errors = 0 (warm-up included) | {errors} | {} |", pass(errors == 0));
    let rss = live.periods.iter().map(|p| p.rss_kb).max().unwrap_or(0) as f64 / 1024.0;
    let _ = writeln!(o, "| server RSS ≤ 150 MB (warm-up included) | {rss:.1} MB | {} |", pass(rss <= 150.0));
    // Projection.
    let _ = writeln!(o, "\n## Projection: 100 traces/s\n");
    let trace_tables = ["traces", "otlp_spans", "reflections", "round_traces"];
    let trace_bytes: i64 = trace_tables.iter().filter_map(|t| history.2.get(*t)).sum();
    let per_trace = trace_bytes as f64 / history.0.max(1) as f64;
    let per_day = per_trace * 100.0 * 86_400.0;
    let deleted_total = counter(scrape, "combee_retention_deleted_total{what=\"traces\"}");
    let (batch_sum, batches) = summary(scrape, "combee_retention_batch_seconds");
    let _ = writeln!(
        o,
        "- bytes per trace, with its share of OTLP spans, reflections and round links, indexes included: **{per_trace:.0} B** (from the history's tables: {:.0} MB for {} traces)",
        mb(trace_bytes),
        history.0
    );
    let _ = writeln!(
        o,
        "- retention **off**: the database grows by **{:.1} GB per day** ({:.0} GB a year)",
        per_day / 1e9,
        per_day * 365.0 / 1e9
    );
    let _ = writeln!(
        o,
        "- retention **on** (30 days): it grows for 30 days to about **{:.0} GB**, then stays there (deleted rows' space is reused), plus the outcome rollups' hour and day rows (per prompt and version: 24 + 1 rows a day)",
        per_day * 30.0 / 1e9
    );
    if batches > 0.0 {
        let rate = deleted_total / batch_sum.max(1e-9);
        let _ = writeln!(
            o,
            "- deletion, measured: {deleted_total:.0} traces deleted in {batches:.0} batches, {:.0} ms per batch on average: **{rate:.0} traces/s** while a batch runs, {:.0}× the 100 traces/s to keep up with (so deleting needs about {:.1} % of the time)",
            1000.0 * batch_sum / batches,
            rate / 100.0,
            100.0 * 100.0 / rate.max(1e-9)
        );
    }
    o
}

/// What Postgres spent its time on per period: CPU per kind of process, the
/// waits of its active client backends, and its statements (the costliest,
/// and those whose time per call rose the most from the first measured
/// period to the last).
fn render_inside(o: &mut String, live: &Live) {
    let names = period_names(&live.periods);
    let _ = writeln!(
        o,
        "\n## Inside Postgres, per period\n\nSampled every second: the CPU of each kind of Postgres process (percent of one core; client backends, autovacuum workers, the checkpointer, background writer and WAL writer, the rest), how many client backends were active on average, and what the active ones were waiting on (average backends in each wait; \"on CPU\": running or runnable).\n"
    );
    let _ = writeln!(
        o,
        "| period | CPU % ({}) | active backends | their waits (average backends) |\n| --- | --- | --- | --- |",
        insight::KINDS.join(" / ")
    );
    for (p, name) in live.periods.iter().zip(&names) {
        let n = p.inside.samples.max(1) as f64;
        let mut waits: Vec<(&String, &u64)> = p.inside.waits.iter().collect();
        waits.sort_by_key(|(_, c)| std::cmp::Reverse(**c));
        let active: u64 = waits.iter().map(|(_, c)| **c).sum();
        let _ = writeln!(
            o,
            "| {name} | {} | {:.2} | {} |",
            insight::KINDS
                .map(|k| format!("{:.0}", 100.0 * p.inside.cpu.get(k).copied().unwrap_or(0.0) / p.secs.max(1.0)))
                .join(" / "),
            active as f64 / n,
            waits.iter().take(5).map(|(w, c)| format!("{w} {:.2}", **c as f64 / n)).collect::<Vec<_>>().join("; ")
        );
    }
    let measured: Vec<(&Period, &String)> = live.periods.iter().zip(&names).filter(|(p, _)| !p.warmup).collect();
    if measured.iter().all(|(p, _)| p.statements.is_empty()) {
        let _ = writeln!(o, "\n(No statement figures: the server does not preload `pg_stat_statements`.)");
        return;
    }
    // The costliest statements over the measured periods.
    let mut total: BTreeMap<i64, f64> = BTreeMap::new();
    for (p, _) in &measured {
        for (id, st) in &p.statements {
            *total.entry(*id).or_default() += st.total_ms;
        }
    }
    let all_ms: f64 = total.values().sum();
    let mut ranked: Vec<(i64, f64)> = total.into_iter().collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
    let text_of = |id: i64| {
        live.periods
            .iter()
            .find_map(|p| p.statements.get(&id))
            .map_or(String::new(), |s| insight::one_line(&s.text, 110))
    };
    let _ = writeln!(
        o,
        "\n### The statements that took the most of Postgres's execution time\n\nFrom `pg_stat_statements`, over the measured periods ({:.0} s of execution in all); per period: mean ms per call × calls per second.\n",
        all_ms / 1000.0
    );
    let _ = write!(o, "| statement | share |");
    for (_, name) in &measured {
        let _ = write!(o, " {name} |");
    }
    let _ = writeln!(o, "\n|{}", " --- |".repeat(measured.len() + 2));
    for (id, ms) in ranked.iter().take(15) {
        let _ = write!(o, "| `{}` | {:.1} % |", text_of(*id), 100.0 * ms / all_ms.max(1e-9));
        for (p, _) in &measured {
            match p.statements.get(id) {
                Some(s) if s.calls > 0 => {
                    let _ =
                        write!(o, " {:.2} × {:.1} |", s.total_ms / s.calls as f64, s.calls as f64 / p.secs.max(1.0));
                }
                _ => {
                    let _ = write!(o, " — |");
                }
            }
        }
        let _ = writeln!(o);
    }
    // The statements whose time per call rose the most.
    let (Some((first, _)), Some((last, _))) = (measured.first(), measured.last()) else { return };
    let mut rose: Vec<(i64, f64)> = first
        .statements
        .iter()
        .filter_map(|(id, a)| {
            let b = last.statements.get(id)?;
            (a.calls >= 10 && b.calls >= 10 && a.total_ms + b.total_ms >= 1000.0)
                .then(|| (*id, (b.total_ms / b.calls as f64) / (a.total_ms / a.calls as f64)))
        })
        .collect();
    rose.sort_by(|a, b| b.1.total_cmp(&a.1));
    let _ = writeln!(
        o,
        "\n### The statements whose time per call rose the most (last measured period / first; at least 10 calls in each and 1 s in both)\n\n| statement | ratio | mean ms first → last | calls first → last | shared blocks per call, hit + read: first → last |\n| --- | --- | --- | --- | --- |"
    );
    for (id, ratio) in rose.iter().take(10) {
        let (a, b) = (&first.statements[id], &last.statements[id]);
        let per = |s: &insight::Statement, v: i64| v as f64 / s.calls.max(1) as f64;
        let _ = writeln!(
            o,
            "| `{}` | {ratio:.2} | {:.2} → {:.2} | {} → {} | {:.0} + {:.1} → {:.0} + {:.1} |",
            text_of(*id),
            a.total_ms / a.calls as f64,
            b.total_ms / b.calls as f64,
            a.calls,
            b.calls,
            per(a, a.hit),
            per(a, a.read),
            per(b, b.hit),
            per(b, b.read)
        );
    }
}

/// "warm-up", then the measured periods numbered from 1.
fn period_names(periods: &[Period]) -> Vec<String> {
    let mut measured = 0;
    periods
        .iter()
        .map(|p| {
            if p.warmup {
                "warm-up".to_owned()
            } else {
                measured += 1;
                measured.to_string()
            }
        })
        .collect()
}

fn pass(ok: bool) -> &'static str {
    if ok { "PASS" } else { "FAIL" }
}
