//! The Markdown report: the machine and settings, the targets table, and
//! per figure its throughput, latencies, CPU and memory.

use std::fmt::Write as _;

use crate::floor::{Table, Way};
use crate::model::{FLOOR_SLICES, Facts, FloorFigures, GET_SLICES, LoadPhase, PHASES, thousands};

fn nproc() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|v| v.split_once(':')).map(|(_, m)| m.trim().to_owned()))
        .unwrap_or_else(|| "unknown CPU".into())
}

fn pass(ok: bool) -> &'static str {
    if ok { "PASS" } else { "FAIL" }
}

pub(crate) fn render(f: &Facts, phases: &[LoadPhase]) -> String {
    let a = &f.args;
    let mut o = String::new();
    let find = |prefix: &str| phases.iter().find(|p| p.name.starts_with(prefix));
    let exact = |name: &str| phases.iter().find(|p| p.name == name);
    let _ = writeln!(o, "# combee foundation benchmark (HTTP)\n");
    let _ = writeln!(
        o,
        "- machine: {} CPUs (nproc) — {}; load average before the run: {}",
        nproc(),
        cpu_model(),
        f.loadavg
    );
    let load1: f64 = f.loadavg.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
    if load1 > nproc() as f64 * 0.5 {
        let _ = writeln!(
            o,
            "- **warning: the machine was already busy before the run** (1-minute load average {load1:.1} on {} CPUs); the figures below are pessimistic — compare runs made on a quiet machine",
            nproc()
        );
    }
    let store = match f.database {
        Some(db) => format!(
            "postgres (fresh database, `synchronous_commit = {}`, `fsync = {}`)",
            db.synchronous_commit, db.fsync
        ),
        None => format!("{} (embedded, temp data dir)", a.store.as_str()),
    };
    let _ = writeln!(o, "- store: {store}");
    let pool = a.db_connections.map_or("the default".to_owned(), |n| n.to_string());
    let _ =
        writeln!(o, "- server: `combee serve` (release build), log level warn, `database.max_connections` = {pool}");
    let _ = writeln!(
        o,
        "- load: {} concurrent keep-alive connections, {} s measured per figure after {} s warm-up; batches of {} traces",
        a.connections, a.duration, a.warmup, a.batch
    );
    let _ = writeln!(
        o,
        "- client: combee-bench's own minimal HTTP/1.1 client (pre-encoded requests, Content-Length framing, no pool layer) on {} tokio thread(s). **Client, server and Postgres share this machine**: the client's CPU is taken from the server's budget (see the CPU columns).",
        a.client_threads
    );
    let _ = writeln!(o, "\n| figure | measured | target | result |\n| --- | --- | --- | --- |");
    let single = exact("single-trace POST /v1/traces");
    let batched = exact("batched POST /v1/traces");
    let batched_tps = batched.map(|p| p.result.per_sec() * p.items as f64);
    if let Some(p) = single {
        let (rps, p50, p99) = (p.result.per_sec(), p.result.quantile_ms(0.50), p.result.quantile_ms(0.99));
        let _ = writeln!(
            o,
            "| single-trace POST throughput (the machine's single-trace capacity) | {} req/s | — | {} |",
            thousands(rps),
            if p.result.errors == 0 { "—" } else { "FAIL (errors)" }
        );
        if let Some(tps) = batched_tps {
            let share = rps / tps;
            let _ = writeln!(
                o,
                "| single-trace POST over batched ingest, same run (req/s ÷ traces/s) | {share:.2} ({} ÷ {}) | ≥ 0.5 | {} |",
                thousands(rps),
                thousands(tps),
                pass(share >= 0.5 && p.result.errors == 0)
            );
        }
        let _ = writeln!(
            o,
            "| single-trace POST latency at full load ({} connections, closed loop) | p50 {p50:.1} ms, p99 {p99:.1} ms | p99 ≤ 25 ms | {} |",
            a.connections,
            pass(p99 <= 25.0)
        );
    }
    if let (Some(p), Some((rate, share))) = (find("single-trace POST /v1/traces, paced"), f.paced) {
        let (p50, p99) = (p.result.quantile_ms(0.50), p.result.quantile_ms(0.99));
        let offered = if share {
            format!("{} req/s offered (half the capacity above)", thousands(rate))
        } else {
            format!("{} req/s offered", thousands(rate))
        };
        let _ = writeln!(
            o,
            "| single-trace POST latency at {offered} | p50 {p50:.1} ms, p99 {p99:.1} ms: p99 = {:.1} × p50 ({} req/s served) | p99 ≤ 5 × p50 | {} |",
            p99 / p50,
            thousands(p.result.per_sec()),
            pass(p99 <= 5.0 * p50 && p.result.errors == 0 && p.result.per_sec() >= 0.97 * rate)
        );
    }
    if let (Some(p), Some(tps)) = (batched, batched_tps) {
        let _ = writeln!(
            o,
            "| batched ingest ({} traces/request) | {} traces/s ({} req/s, p99 {:.1} ms) | — | {} |",
            p.items,
            thousands(tps),
            thousands(p.result.per_sec()),
            p.result.quantile_ms(0.99),
            if p.result.errors == 0 { "—" } else { "FAIL (errors)" }
        );
        if let Some(floor) = &f.floor {
            // The floor: the same store alone, the same rows, into a table with only a primary key.
            let way = if a.store.as_str() == "postgres" { Way::Copy } else { Way::Insert };
            if let Some(pk) = floor.figures.iter().find(|g| g.way == way && g.table == Table::PrimaryKeyOnly) {
                let share = tps / pk.written.per_sec();
                let _ = writeln!(
                    o,
                    "| batched ingest over the store's own floor, same run: {} of the same rows into a primary-key-only table | {share:.2} ({} ÷ {} rows/s) | ≥ 0.6 | {} |",
                    way.label(),
                    thousands(tps),
                    thousands(pk.written.per_sec()),
                    pass(share >= 0.6 && p.result.errors == 0)
                );
            }
        }
    }
    for store in ["postgres", "sqlite"] {
        for (with, label) in [("", "without a subject"), (" with a subject", "with a subject")] {
            let Some(p) = exact(&format!("GET /v1/prompts/bench{with} [{store}]")) else { continue };
            if let Some(b) = &p.bare {
                let share = 100.0 * p.result.per_sec() / b.result.per_sec();
                let cpu_share = 100.0 * b.cpu.server_pct / b.result.per_sec() / (p.cpu.server_pct / p.result.per_sec());
                let _ = writeln!(
                    o,
                    "| prompt GET vs bare axum handler, {store}, {label} | {share:.0} % ({} vs {} req/s; p99 {:.1} vs {:.1} ms; server CPU per request: bare {:.0} % of combee's) | ≥ 85 % | {} |",
                    thousands(p.result.per_sec()),
                    thousands(b.result.per_sec()),
                    p.result.quantile_ms(0.99),
                    b.result.quantile_ms(0.99),
                    cpu_share,
                    pass(share >= 85.0 && p.result.errors == 0)
                );
            }
        }
    }
    if let Some((prompts, subjects, rss, hwm)) = f.memory_probe {
        let mb = rss.max(hwm) as f64 / 1024.0;
        let _ = writeln!(
            o,
            "| server RSS after {} prompts fetched by {} distinct subjects | {mb:.1} MB (RSS {:.1} MB, VmHWM {:.1} MB) | ≤ 150 MB | {} |",
            thousands(prompts as f64),
            thousands(subjects as f64),
            rss as f64 / 1024.0,
            hwm as f64 / 1024.0,
            pass(mb <= 150.0)
        );
    }
    let peak_mb = f.peak_rss_kb.max(f.hwm_kb) as f64 / 1024.0;
    let _ = writeln!(
        o,
        "| server RSS, peak over the run | {peak_mb:.1} MB (sampled max {:.1} MB, VmHWM {:.1} MB, idle {:.1} MB) | ≤ 150 MB | {} |",
        f.peak_rss_kb as f64 / 1024.0,
        f.hwm_kb as f64 / 1024.0,
        f.idle_rss_kb as f64 / 1024.0,
        pass(peak_mb <= 150.0)
    );

    let _ = writeln!(o, "\n## Per figure\n");
    let _ = writeln!(
        o,
        "CPU is a share of one core over the measured window (200 % = both cores); \"machine\" is all CPUs busy, including Postgres and anything else running.\n"
    );
    let _ = writeln!(
        o,
        "| figure | requests | errors | req/s | p50 ms | p90 ms | p99 ms | max ms | server CPU | server CPU µs/req | client CPU | Postgres CPU µs/req | WAL bytes/req | machine busy | server peak RSS |"
    );
    let _ = writeln!(
        o,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    let rows = phases.iter().flat_map(|p| std::iter::once(p).chain(p.bare.as_deref()));
    for p in rows.clone() {
        let r = &p.result;
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} % | {:.0} | {:.0} % | {} | {} | {:.0} % | {:.1} MB |",
            p.name,
            r.ok,
            r.errors,
            thousands(r.per_sec()),
            r.quantile_ms(0.50),
            r.quantile_ms(0.90),
            r.quantile_ms(0.99),
            r.latencies_us.last().map_or(f64::NAN, |v| f64::from(*v) / 1000.0),
            p.cpu.server_pct,
            p.cpu.server_pct / 100.0 * 1e6 / r.per_sec(),
            p.cpu.client_pct,
            if p.cpu.store_pct > 0.0 {
                format!("{:.0}", p.cpu.store_pct / 100.0 * 1e6 / r.per_sec())
            } else {
                "—".to_owned()
            },
            p.wal_bytes.map_or("—".to_owned(), |b| format!("{:.0}", b as f64 / r.ok.max(1) as f64)),
            p.cpu.machine_busy_pct,
            p.peak_rss_kb as f64 / 1024.0,
        );
    }
    let grouped: Vec<_> = phases.iter().filter_map(|p| p.groups.map(|g| (p, g))).collect();
    if !grouped.is_empty() {
        let _ = writeln!(
            o,
            "\nWhere the write path's time goes (the server's `combee_store_write_group_*` metrics over the measured \
             window): trace writes are committed in groups, one transaction and one flush to disk each; *lanes busy* \
             is the groups' commit time over the window (1.00 = one lane committing all the time). On Postgres a group is \
             one statement that commits itself (*begin* is taking a connection, *insert* the statement with its \
             commit and flush), and a request of 32 traces or more commits alone as a group of its own, so *lanes \
             busy* counts those commits in flight too.\n"
        );
        let _ = writeln!(
            o,
            "| figure | groups/s | rows per group | ms per group | µs per row | lanes busy | ms per group by phase ({}) |",
            PHASES.join(", ")
        );
        let _ = writeln!(o, "| --- | ---: | ---: | ---: | ---: | ---: | --- |");
        for (p, g) in grouped {
            let secs = p.result.elapsed.as_secs_f64();
            let _ = writeln!(
                o,
                "| {} | {} | {:.1} | {:.2} | {:.0} | {:.2} | {} |",
                p.name,
                thousands(g.groups / secs),
                g.rows / g.groups.max(1.0),
                1000.0 * g.seconds / g.groups.max(1.0),
                1e6 * g.seconds / g.rows.max(1.0),
                g.seconds / secs,
                if g.phases.iter().all(|&s| s == 0.0) {
                    "—".to_owned()
                } else {
                    g.phases
                        .iter()
                        .map(|s| format!("{:.2}", 1000.0 * s / g.groups.max(1.0)))
                        .collect::<Vec<_>>()
                        .join(", ")
                },
            );
        }
    }
    if let (Some(floor), Some(b)) = (&f.floor, exact("batched POST /v1/traces")) {
        o.push_str(&floor_section(a.store.as_str(), floor, b));
    }
    for p in phases.iter().filter(|p| p.per_second.is_some()) {
        let _ = writeln!(
            o,
            "\n## Second by second: {}\n\nEach request counted in the second it was due; *groups* and *ms a group* are the server's \
             write groups committed in that second (*begin*: taking a connection, or on SQLite the writer's `BEGIN`; *insert*: the \
             statement with its commit and flush on Postgres, the inserts on SQLite). On Postgres, ten looks a second at \
             `pg_stat_activity`: whether the checkpointer was writing, which relations autovacuum was on, and what the backends \
             running a statement waited on (*CPU*: none).\n",
            p.name
        );
        o.push_str(p.per_second.as_deref().unwrap_or_default());
    }
    for p in rows {
        if let Some(e) = &p.result.first_error {
            let e: String = e.chars().take(300).collect();
            let _ = writeln!(o, "\nFirst error in \"{}\": {e}", p.name);
        }
    }
    let _ = writeln!(
        o,
        "\nMemory was sampled from /proc/<pid>/status every 100 ms ({} samples); the prompt body is {} bytes.",
        f.samples, f.prompt_body_bytes
    );
    if f.bare_headers > 0 {
        let _ = writeln!(
            o,
            "The bare axum handler (no middleware, no extractor) answers the same requests at the same path with the same {}-byte body and the same {} response headers as combee's GET (those of one of its answers, plus `content-length` and `date`); each GET figure is measured in {GET_SLICES} slices alternating with its bare figure, so both see the same machine.",
            f.prompt_body_bytes, f.bare_headers
        );
    }
    o
}

/// The store alone with the batched figure's rows, beside it: rates, combee's
/// share of each, and what the schema and the service cost.
fn floor_section(store: &str, floor: &FloorFigures, batched: &LoadPhase) -> String {
    let mut o = String::new();
    let tps = batched.result.per_sec() * batched.items as f64;
    let postgres = store == "postgres";
    let writers = if postgres {
        format!(
            "{} connections (the server's pool size), one statement a transaction (combee's batches of 32 traces or \
             more commit alone, one request a transaction)",
            floor.connections
        )
    } else {
        format!(
            "one connection with combee's pragmas (WAL, `synchronous = FULL`, foreign keys on), multi-row inserts of \
             the batch's size (combee's one writer committed about {} rows a group in the figure's warm-up)",
            floor.commit_rows
        )
    };
    let _ = writeln!(
        o,
        "\n## The store's own floor\n\nThe same {store}, alone, writing the trace rows combee stored in this run (the same \
         JSON text, fresh ids) in transactions of {} rows from {writers}: into (a) a table with the same columns and only a \
         primary key, and (b) a copy of combee's `traces` table with all its indexes. Measured in {FLOOR_SLICES} slices \
         alternating with combee's batched figure. *Store CPU* is Postgres's processes' (on SQLite the store runs inside \
         the writing process: the server for combee, the bench client for the floor).\n",
        floor.commit_rows
    );
    let _ = writeln!(
        o,
        "| figure | rows/s | combee's batched rate as a share of it | store CPU µs/row | server CPU µs/row | client CPU µs/row | WAL bytes/row | machine busy |"
    );
    let _ = writeln!(o, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let wal =
        |bytes: Option<u64>, rows: f64| bytes.map_or("—".to_owned(), |b| format!("{:.0}", b as f64 / rows.max(1.0)));
    let per_row = |pct: f64, rate: f64| pct / 100.0 * 1e6 / rate.max(1e-9);
    let c = &batched.cpu;
    let _ = writeln!(
        o,
        "| combee: batched POST /v1/traces | {} | 1.00 | {:.1} | {:.1} | {:.1} | {} | {:.0} % |",
        thousands(tps),
        per_row(c.store_pct, tps),
        per_row(c.server_pct, tps),
        per_row(c.client_pct, tps),
        wal(batched.wal_bytes, tps * batched.result.elapsed.as_secs_f64()),
        c.machine_busy_pct
    );
    for g in &floor.figures {
        let rate = g.written.per_sec();
        let _ = writeln!(
            o,
            "| {}, {} | {} | {:.2} | {:.1} | {:.1} | {:.1} | {} | {:.0} % |",
            g.way.label(),
            g.table.label(),
            thousands(rate),
            tps / rate,
            per_row(g.cpu.store_pct, rate),
            per_row(g.cpu.server_pct, rate),
            per_row(g.cpu.client_pct, rate),
            wal(g.wal_bytes, g.written.rows as f64),
            g.cpu.machine_busy_pct
        );
    }
    let rate =
        |way, table| floor.figures.iter().find(|g| g.way == way && g.table == table).map(|g| g.written.per_sec());
    let ways = if postgres { vec![Way::Copy, Way::Insert] } else { vec![Way::Insert] };
    for way in ways {
        if let (Some(pk), Some(full)) = (rate(way, Table::PrimaryKeyOnly), rate(way, Table::Traces)) {
            let _ = writeln!(
                o,
                "\n{}: the schema's cost, (b) ÷ (a) = {:.2}; the service's cost, combee ÷ (b) = {:.2}; combee ÷ (a) = {:.2}.",
                way.label(),
                full / pk,
                tps / full,
                tps / pk
            );
        }
    }
    o
}
