//! `combee-bench burst`: what an outcome read costs right after a burst. A
//! fresh server (each store in turn) takes `--traces` traces in batches as
//! fast as it will (a fleet's minute), then `GET /v1/prompts/{name}/metrics`
//! is read over a window holding all of them: at once after the burst (the
//! rollups' delta rows not yet folded) and `--after` seconds later, one read
//! at a time. With `--compare-bin`, a second server binary (another build of
//! combee) is measured the same way in the same run, on a fresh database.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::Context;
use tokio::process::Command;

use crate::client::{HttpConn, encode_request, request_once};
use crate::database::BenchDatabase;
use crate::load::{LoadResult, run_each_once};
use crate::model::thousands;
use crate::processes::{ChildGuard, ScratchDir, free_port};

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct BurstArgs {
    /// Traces in the burst.
    #[arg(long, default_value_t = 200_000)]
    traces: usize,
    /// Traces per request.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Concurrent keep-alive connections sending the burst.
    #[arg(long, default_value_t = 16)]
    connections: usize,
    /// Seconds after the burst's last answer when the measured reads start.
    #[arg(long, default_value_t = 5)]
    after: u64,
    /// Reads measured after `--after` seconds (one at a time, one keep-alive connection).
    #[arg(long, default_value_t = 200)]
    reads: usize,
    /// Seconds of reads at once after the burst (before any wait).
    #[arg(long, default_value_t = 1.0)]
    at_once: f64,
    /// The metrics window read (`window=`), which holds the whole burst.
    #[arg(long, default_value = "1h")]
    window: String,
    /// Which stores: postgres, sqlite or both. Postgres needs DATABASE_URL (an admin URL; a fresh
    /// database is made next to it for each server).
    #[arg(long, default_value = "both", value_parser = ["postgres", "sqlite", "both"])]
    store: String,
    /// The `combee` binary [default: next to this one].
    #[arg(long)]
    server_bin: Option<PathBuf>,
    /// Another `combee` binary (say, main's build) measured the same way, in the same run.
    #[arg(long)]
    compare_bin: Option<PathBuf>,
}

/// One store, one server binary: what the burst and the reads took.
struct Figure {
    store: &'static str,
    server: String,
    sent: usize,
    burst: Duration,
    /// Traces the read counted in the window (all versions).
    counted: u64,
    at_once: LoadResult,
    after: LoadResult,
    /// Rollup delta rows not yet folded (outcome and task rollups) when each series of reads began.
    unfolded: (i64, i64),
}

/// Rollup delta rows not yet folded by the compactor, read beside the server.
async fn unfolded_rows(db_url: &str, data_dir: &Path) -> anyhow::Result<i64> {
    use sqlx::Connection;
    const COUNT: &str = "SELECT (SELECT count(*) FROM outcome_rollups WHERE NOT compacted) \
                         + (SELECT count(*) FROM task_rollups WHERE NOT compacted)";
    Ok(if db_url.is_empty() {
        let url = format!("sqlite://{}?mode=ro", data_dir.join("combee.db").display());
        let mut c = sqlx::SqliteConnection::connect(&url).await?;
        sqlx::query_scalar(COUNT).fetch_one(&mut c).await?
    } else {
        let mut c = sqlx::PgConnection::connect(db_url).await?;
        sqlx::query_scalar(COUNT).fetch_one(&mut c).await?
    })
}

/// A realistic mix: two versions, success flags and scores, usage, task keys.
fn trace(i: usize) -> String {
    format!(
        r#"{{"prompt":"burst","prompt_version":{v},"input":{{"q":"question {i}"}},"output":"answer {i}","feedback":{{"success":{s},"score":{score}}},"metadata":{{"tokens":{tokens},"latency_ms":{latency},"cost_usd":0.0004,"task_key":"task-{task}"}}}}"#,
        v = 1 + i % 2,
        s = !i.is_multiple_of(3),
        score = (i % 5) as f64 / 4.0,
        tokens = 100 + i % 400,
        latency = 20 + i % 90,
        task = i % 50,
    )
}

pub(crate) async fn run_burst(args: BurstArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.traces > 0 && args.batch > 0 && args.reads > 0,
        "--traces, --batch and --reads must be positive"
    );
    let ours = match &args.server_bin {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("combee"),
    };
    let mut servers = vec![ours];
    servers.extend(args.compare_bin.clone());
    for s in &servers {
        anyhow::ensure!(s.exists(), "{} not found (build it with cargo build --release)", s.display());
    }
    let stores: &[&'static str] = match args.store.as_str() {
        "postgres" => &["postgres"],
        "sqlite" => &["sqlite"],
        _ => &["postgres", "sqlite"],
    };
    let loadavg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut figures = Vec::new();
    for &store in stores {
        for server in &servers {
            figures.push(measure(&args, server, store).await?);
        }
    }
    print!("{}", render(&args, &figures, loadavg.split_whitespace().take(3).collect::<Vec<_>>().join(" ")));
    Ok(())
}

async fn measure(args: &BurstArgs, server_bin: &Path, store: &'static str) -> anyhow::Result<Figure> {
    let scratch = ScratchDir::new()?;
    let database = match store {
        "postgres" => {
            let admin = std::env::var("DATABASE_URL")
                .ok()
                .filter(|u| !u.is_empty())
                .context("DATABASE_URL is unset: point it at a Postgres server (scripts/bench starts a private one)")?;
            Some(BenchDatabase::create(&admin).await?)
        }
        _ => None,
    };
    let db_url = database.as_ref().map(|d| d.url.clone()).unwrap_or_default();
    let outcome = measure_on(args, server_bin, store, &scratch.0, &db_url).await;
    if let Some(db) = database {
        db.drop_database().await;
    }
    outcome
}

async fn measure_on(
    args: &BurstArgs,
    server_bin: &Path,
    store: &'static str,
    scratch: &Path,
    db_url: &str,
) -> anyhow::Result<Figure> {
    let addr = free_port()?;
    let data_dir = scratch.join("data");
    let mut cmd = Command::new(server_bin);
    cmd.args(["serve", "--bind", &addr.to_string()])
        .env("DATABASE_URL", db_url)
        .env("COMBEE__DATABASE__DATA_DIR", &data_dir)
        .env("COMBEE__LOG__LEVEL", "warn")
        .env_remove("RUST_LOG")
        .env_remove("COMBEE__DATABASE__URL");
    let mut server = ChildGuard::spawn(cmd, scratch.join("server.log"))?;
    server.wait_ready(addr, "/readyz").await.context("the combee server did not start")?;
    let key = std::fs::read_to_string(data_dir.join("admin-key")).context("the admin key")?.trim().to_owned();
    for (path, body) in [
        ("/v1/prompts", r#"{"name":"burst","base":"You are a benchmark agent."}"#),
        ("/v1/prompts/burst/versions", r#"{"base":"You are a careful benchmark agent."}"#),
    ] {
        let (status, answer) =
            request_once(addr, &encode_request("POST", path, addr, &key, Some(body.as_bytes()))).await?;
        anyhow::ensure!(status == 201, "POST {path} answered {status}: {}", String::from_utf8_lossy(&answer));
    }
    let requests: Vec<Vec<u8>> = (0..args.traces.div_ceil(args.batch))
        .map(|b| {
            let traces: Vec<String> = (b * args.batch..((b + 1) * args.batch).min(args.traces)).map(trace).collect();
            let body = format!(r#"{{"traces":[{}]}}"#, traces.join(","));
            encode_request("POST", "/v1/traces", addr, &key, Some(body.as_bytes()))
        })
        .collect();
    let server_name = server_bin.display().to_string();
    eprintln!("combee-bench: burst [{store}, {server_name}]: {} traces in batches of {}", args.traces, args.batch);
    let started = Instant::now();
    run_each_once(addr, requests, 201, args.connections).await.context("the burst")?;
    let burst = started.elapsed();
    let ended = Instant::now();

    let read = encode_request("GET", &format!("/v1/prompts/burst/metrics?window={}", args.window), addr, &key, None);
    let mut conn = HttpConn::connect(addr).await?;
    let mut reads = async |until: Option<Instant>, count: usize| -> anyhow::Result<(LoadResult, u64)> {
        let (mut r, mut counted) = (LoadResult::default(), 0);
        let t = Instant::now();
        while until.map_or(r.ok < count as u64, |u| Instant::now() < u) {
            let t0 = Instant::now();
            let answer = conn.roundtrip(&read).await?;
            let took = t0.elapsed();
            anyhow::ensure!(answer.status == 200, "the metrics read answered {}", answer.status);
            let body: serde_json::Value = serde_json::from_slice(conn.body(&answer))?;
            counted = body["versions"].as_array().map_or(0, |v| v.iter().filter_map(|v| v["traces"].as_u64()).sum());
            r.ok += 1;
            r.latencies_us.push(took.as_micros().min(u128::from(u32::MAX)) as u32);
        }
        r.elapsed = t.elapsed();
        r.latencies_us.sort_unstable();
        Ok((r, counted))
    };
    let unfolded_at_once = unfolded_rows(db_url, &data_dir).await?;
    let (at_once, _) = reads(Some(Instant::now() + Duration::from_secs_f64(args.at_once)), 0).await?;
    tokio::time::sleep_until((ended + Duration::from_secs(args.after)).into()).await;
    let unfolded_after = unfolded_rows(db_url, &data_dir).await?;
    let (after, counted) = reads(None, args.reads).await?;
    server.stop().await;
    let unfolded = (unfolded_at_once, unfolded_after);
    Ok(Figure { store, server: server_name, sent: args.traces, burst, counted, at_once, after, unfolded })
}

fn render(args: &BurstArgs, figures: &[Figure], loadavg: String) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "# Outcome reads after a burst\n");
    let _ = writeln!(
        out,
        "`combee-bench burst`: {} traces (two versions, success, score, usage, 50 task keys) posted in batches of {} over \
         {} connections to a fresh server, as fast as it takes them; then `GET /v1/prompts/burst/metrics?window={}` \
         (one read at a time, one keep-alive connection, the answer parsed): for {} s at once after the burst, then {} \
         reads from {} s after it. Load average at the start: {loadavg}.\n",
        thousands(args.traces as f64),
        args.batch,
        args.connections,
        args.window,
        args.at_once,
        args.reads,
        args.after,
    );
    let _ = writeln!(
        out,
        "| store | server | burst | traces counted | reads at once: unfolded delta rows; n, p50, p95 | {a} s after: \
         unfolded delta rows | p50 | p95 | max | target p95 ≤ 20 ms |",
        a = args.after
    );
    let _ = writeln!(out, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for f in figures {
        let ms = |r: &LoadResult, q: f64| format!("{:.2} ms", r.quantile_ms(q));
        let p95 = f.after.quantile_ms(0.95);
        let _ = writeln!(
            out,
            "| {} | `{}` | {:.1} s ({} traces/s) | {} of {} | {}; {}, {}, {} | {} | {} | {} | {} | {} |",
            f.store,
            f.server,
            f.burst.as_secs_f64(),
            thousands(f.sent as f64 / f.burst.as_secs_f64()),
            thousands(f.counted as f64),
            thousands(f.sent as f64),
            thousands(f.unfolded.0 as f64),
            f.at_once.ok,
            ms(&f.at_once, 0.5),
            ms(&f.at_once, 0.95),
            thousands(f.unfolded.1 as f64),
            ms(&f.after, 0.5),
            ms(&f.after, 0.95),
            ms(&f.after, 1.0),
            if p95 <= 20.0 { "PASS" } else { "MISS" },
        );
    }
    out
}
