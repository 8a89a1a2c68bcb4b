//! `combee-bench-soak`: a year in a day (a SIMULATION: simulated agents, the
//! simulated LLM). On a durable Postgres it loads a history of traces with
//! their timestamps (default 10 million over 60 days for 50 prompts, with
//! rounds, reflections, OTLP spans and LLM call records), rolls it up as
//! migration 0015 does, then runs the real server on product defaults
//! (retention, the worker's rounds against the simulator, the population
//! rater, the regression guard) for a live period while simulated agents do
//! what agents do — GET their prompt with a subject, POST a trace with a
//! reward (a share over OTLP), send late feedback — and a dashboard reads
//! metrics. A warm-up comes first (learning starts, populations fill,
//! retention deletes the history past its horizon): printed, labelled, and
//! left out of the last / first ratios. Per period it prints latencies (µs
//! resolution), the rater's tick time and where it went, round wall times,
//! per-table sizes, the server's RSS and errors; then a projection of the
//! database size per day at 100 traces/s with retention on and off.
//! It is a report: a missed target still exits 0.

mod history;
mod insight;
mod live;
mod period;
mod processes;
mod report;

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::Instant,
};

use anyhow::Context;
use clap::Parser;
use serde_json::json;
use sqlx::{Connection, PgConnection};
use tokio::process::Command;

use crate::history::{load_history, table_sizes};
use crate::live::live;
use crate::processes::{Server, free_port};
use crate::report::render;

#[derive(Debug, Clone, Parser)]
#[command(
    name = "combee-bench-soak",
    about = "A year in a day: history, then a live period on product defaults (SIMULATION)"
)]
struct SoakArgs {
    /// Prompts.
    #[arg(long, default_value_t = 50)]
    prompts: usize,
    /// Traces in the loaded history.
    #[arg(long, default_value_t = 10_000_000)]
    history_traces: u64,
    /// Days the history spans (ending an hour ago).
    #[arg(long, default_value_t = 60)]
    history_days: i64,
    /// Length of the live period, in seconds.
    #[arg(long, default_value_t = 1_200)]
    live_secs: u64,
    /// Periods the live phase is reported in.
    #[arg(long, default_value_t = 4)]
    periods: u32,
    /// A warm-up before the live periods, in seconds: learning starts, the
    /// controller walks its ladder, populations fill, retention deletes the
    /// history past its horizon (about 5 million traces of the default
    /// history: some 7 minutes). Printed, labelled, and left out of the ratios.
    #[arg(long, default_value_t = 480)]
    warmup_secs: u64,
    /// Agent runs per second (each: a GET with a subject, then a trace).
    #[arg(long, default_value_t = 50.0)]
    rate: f64,
    /// Share of the traces sent over OTLP (JSON) instead of `POST /v1/traces`.
    #[arg(long, default_value_t = 0.1)]
    otlp_share: f64,
    /// Share of the posted traces that get late feedback (a few seconds later).
    #[arg(long, default_value_t = 0.1)]
    late_feedback: f64,
    /// Dashboard reads of `GET /v1/prompts/{name}/metrics` per second.
    #[arg(long, default_value_t = 2.0)]
    metrics_rate: f64,
    /// Distinct subjects the agents serve.
    #[arg(long, default_value_t = 100_000)]
    subjects: u64,
    /// Retention on (product default) or off, for comparison.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    retention: bool,
    /// The `combee` binary [default: next to this one].
    #[arg(long)]
    server_bin: Option<PathBuf>,
    /// Keep the database afterwards (its name is printed).
    #[arg(long)]
    keep: bool,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::process::ExitCode {
    let args = SoakArgs::parse();
    match run(args).await {
        Ok(report) => {
            print!("{report}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("combee-bench-soak: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn log(msg: impl AsRef<str>) {
    eprintln!("combee-bench-soak: {}", msg.as_ref());
}

fn with_database(url: &str, db: &str) -> anyhow::Result<String> {
    let (base, query) = url.split_once('?').map_or((url, None), |(b, q)| (b, Some(q)));
    let scheme_end = base.find("://").context("DATABASE_URL is not a URL")? + 3;
    let authority_end = base[scheme_end..].find('/').map_or(base.len(), |i| scheme_end + i);
    Ok(format!("{}/{db}{}", &base[..authority_end], query.map(|q| format!("?{q}")).unwrap_or_default()))
}

fn prompt_name(i: usize) -> String {
    format!("soak-{i:03}")
}

async fn run(args: SoakArgs) -> anyhow::Result<String> {
    let bin = match &args.server_bin {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("combee"),
    };
    let admin = std::env::var("DATABASE_URL")
        .context("DATABASE_URL is unset (scripts/bench-soak starts a private Postgres)")?;
    let db = format!("soak_{:08x}", rand::random::<u32>());
    let mut conn = PgConnection::connect(&admin).await?;
    sqlx::query(&format!("CREATE DATABASE {db}")).execute(&mut conn).await?;
    let settings: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, setting FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit', 'shared_buffers', 'server_version')",
    )
    .fetch_all(&mut conn)
    .await?;
    let url = with_database(&admin, &db)?;
    log(format!("database {db}"));
    let scratch = tempfile::tempdir()?;
    let outcome = soak(&args, &bin, &url, scratch.path(), &settings).await;
    if !args.keep {
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")).execute(&mut conn).await;
    }
    outcome
}

async fn soak(
    args: &SoakArgs,
    bin: &Path,
    url: &str,
    scratch: &Path,
    pg_settings: &[(String, String)],
) -> anyhow::Result<String> {
    let loadavg_start = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    // The simulated LLM.
    let sim_addr = free_port()?;
    let mut sim = Command::new(bin);
    sim.args(["sim-llm", "--bind", &sim_addr.to_string(), "--fixed-ms", "20"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(scratch.join("sim.log"))?))
        .kill_on_drop(true);
    let sim = sim.spawn().context("cannot start the simulated LLM")?;
    let sim_pid = sim.id().context("the simulated LLM exited at once")?;
    let envs = vec![
        ("DATABASE_URL", url.to_owned()),
        ("COMBEE__DATABASE__DATA_DIR", scratch.join("data").display().to_string()),
        ("COMBEE__LOG__LEVEL", "warn".to_owned()),
        ("COMBEE__LLM__BASE_URL", format!("http://{sim_addr}/v1")),
        ("COMBEE__RETENTION__ENABLED", args.retention.to_string()),
    ];
    // 1. The prompts, made through the API (product defaults), then the server stops for the load.
    let server = Server::start(bin, &envs, &["serve"], &scratch.join("server-setup.log")).await?;
    server.wait_ready("/readyz").await?;
    let key = std::fs::read_to_string(scratch.join("data/admin-key"))?.trim().to_owned();
    let http = reqwest::Client::builder().pool_max_idle_per_host(64).build()?;
    for i in 0..args.prompts {
        let body = json!({"name": prompt_name(i), "base": format!("You are support agent {i}. Answer precisely.")});
        let res = http.post(format!("http://{}/v1/prompts", server.addr)).bearer_auth(&key).json(&body).send().await?;
        anyhow::ensure!(res.status().as_u16() == 201, "creating a prompt answered {}", res.status());
    }
    server.stop().await;

    // 2. The history, with its timestamps.
    let started = Instant::now();
    let mut db = PgConnection::connect(url).await?;
    load_history(&mut db, args).await?;
    let load_secs = started.elapsed().as_secs_f64();
    let history_sizes = table_sizes(&mut db).await?;
    let loaded: i64 = sqlx::query_scalar("SELECT count(*) FROM traces").fetch_one(&mut db).await?;
    log(format!("history loaded: {loaded} traces in {load_secs:.0} s"));

    // 3. Live, on product defaults.
    let server = Server::start(bin, &envs, &["serve"], &scratch.join("server.log")).await?;
    server.wait_ready("/readyz").await?;
    let live = live(args, &server, sim_pid, &key, url).await?;
    let final_sizes = table_sizes(&mut db).await?;
    let traces_now: i64 = sqlx::query_scalar("SELECT count(*) FROM traces").fetch_one(&mut db).await?;
    let scrape = http.get(format!("http://{}/metrics", server.addr)).send().await?.text().await?;
    server.stop().await;
    let loadavg_end = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    Ok(render(
        args,
        pg_settings,
        (&loadavg_start, &loadavg_end),
        (loaded, load_secs, &history_sizes),
        &live,
        (traces_now, &final_sizes),
        &scrape,
    ))
}
