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

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Stdio,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context;
use clap::Parser;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection};
use tokio::process::{Child, Command};

mod insight;

#[derive(Debug, Clone, Parser)]
#[command(
    name = "combee-bench-soak",
    about = "A year in a day: history, then a live period on product defaults (SIMULATION)"
)]
struct Args {
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
    let args = Args::parse();
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

struct Server {
    child: Child,
    pid: u32,
    addr: SocketAddr,
}

impl Server {
    async fn start(bin: &Path, envs: &[(&str, String)], args: &[&str], log_path: &Path) -> anyhow::Result<Self> {
        let addr = free_port()?;
        let mut cmd = Command::new(bin);
        cmd.args(args).arg("--bind").arg(addr.to_string());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let log_file = std::fs::File::create(log_path)?;
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::from(log_file)).kill_on_drop(true);
        let child = cmd.spawn().with_context(|| format!("cannot start {}", bin.display()))?;
        let pid = child.id().context("the child exited at once")?;
        Ok(Self { child, pid, addr })
    }

    async fn wait_ready(&self, path: &str) -> anyhow::Result<()> {
        let http = reqwest::Client::new();
        for _ in 0..600 {
            if http.get(format!("http://{}{path}", self.addr)).send().await.is_ok_and(|r| r.status().is_success()) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::bail!("{} did not answer {path} within a minute", self.addr)
    }

    async fn stop(mut self) {
        let _ = std::process::Command::new("kill").arg("-TERM").arg(self.pid.to_string()).status();
        if tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await.is_err() {
            let _ = self.child.kill().await;
        }
    }
}

fn free_port() -> anyhow::Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

fn with_database(url: &str, db: &str) -> anyhow::Result<String> {
    let (base, query) = url.split_once('?').map_or((url, None), |(b, q)| (b, Some(q)));
    let scheme_end = base.find("://").context("DATABASE_URL is not a URL")? + 3;
    let authority_end = base[scheme_end..].find('/').map_or(base.len(), |i| scheme_end + i);
    Ok(format!("{}/{db}{}", &base[..authority_end], query.map(|q| format!("?{q}")).unwrap_or_default()))
}

fn rss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:").and_then(|v| v.split_whitespace().next()?.parse().ok()))
        .unwrap_or(0)
}

/// CPU seconds used so far (user + system, with reaped children's) by each of
/// the processes that share the machine in the live period, to difference
/// between periods: whatever one of them takes, the others wait for.
#[derive(Debug, Default, Clone, Copy)]
struct CpuSecs {
    server: f64,
    sim: f64,
    postgres: f64,
    load: f64,
}

impl CpuSecs {
    fn read(server: u32, sim: u32) -> Self {
        // Every `postgres` process: backends, autovacuum workers, the checkpointer; an exited
        // one's time moves into the postmaster's reaped-children counters, so the sum is steady.
        let postgres = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "postgres"))
            .map(cpu_secs)
            .sum();
        Self { server: cpu_secs(server), sim: cpu_secs(sim), postgres, load: cpu_secs(std::process::id()) }
    }

    fn since(&self, before: &Self) -> Self {
        Self {
            server: self.server - before.server,
            sim: self.sim - before.sim,
            postgres: self.postgres - before.postgres,
            load: self.load - before.load,
        }
    }
}

/// Clock ticks per second, the unit of `/proc/<pid>/stat`'s CPU times.
fn clock_ticks() -> f64 {
    static TICKS: std::sync::LazyLock<f64> = std::sync::LazyLock::new(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok()?.trim().parse().ok())
            .unwrap_or(100.0)
    });
    *TICKS
}

/// A process's CPU seconds: utime, stime, cutime and cstime of `/proc/<pid>/stat`.
fn cpu_secs(pid: u32) -> f64 {
    stat_cpu_secs(pid, 4)
}

/// The first `fields` of utime, stime, cutime and cstime in `/proc/<pid>/stat`, in seconds.
fn stat_cpu_secs(pid: u32, fields: usize) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces): state is the first, utime the 12th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let ticks: f64 = rest.split_whitespace().skip(11).take(fields).filter_map(|v| v.parse::<f64>().ok()).sum();
    ticks / clock_ticks()
}

fn prompt_name(i: usize) -> String {
    format!("soak-{i:03}")
}

async fn run(args: Args) -> anyhow::Result<String> {
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
    args: &Args,
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

/// A UUIDv7 of the row's time (SQL), random below the millisecond.
const V7: &str = "(lpad(to_hex((extract(epoch FROM ts) * 1000)::bigint), 12, '0') || '7' \
     || substr(md5(g::text || ':' || p::text), 1, 3) || '8' || substr(md5(p::text || ':' || g::text), 1, 15))::uuid";

async fn load_history(db: &mut PgConnection, args: &Args) -> anyhow::Result<()> {
    let per_prompt = args.history_traces / args.prompts as u64;
    let span_us = args.history_days * 86_400 * 1_000_000;
    sqlx::raw_sql("SET synchronous_commit = off").execute(&mut *db).await?;
    let prompts: Vec<(uuid::Uuid, String)> =
        sqlx::query_as("SELECT id, name FROM prompts ORDER BY name").fetch_all(&mut *db).await?;
    // A round per prompt and day, with its LLM calls and group outputs.
    log("loading rounds");
    sqlx::query(&format!(
        "INSERT INTO rounds (id, prompt_id, status, trigger, method, strategy, seed, duplication, n, k, base_version,
                             attempt, detail, created_at, started_at, finished_at, updated_at, not_before)
         SELECT md5('round:' || p.id || ':' || d)::uuid, p.id, 'succeeded', 'backlog', 'combee', 'playbook', d, 2, 200, 14, 1,
                1, jsonb_build_object('group_outputs', (SELECT jsonb_agg(jsonb_build_object('group', k, 'traces', '[]'::jsonb,
                    'output', jsonb_build_object('operations', jsonb_build_array(jsonb_build_object('op', 'ADD', 'section', 'tips',
                    'content', repeat('a specific insight about the task ', 6)))))) FROM generate_series(1, 14) k),
                    'phases', '{{}}'::jsonb),
                ts, ts, ts + interval '40 seconds', ts, ts
         FROM prompts p, generate_series(0, {days} - 1) d,
              LATERAL (SELECT now() - interval '1 hour' - ({days} - d) * interval '1 day' AS ts) t",
        days = args.history_days
    ))
    .execute(&mut *db)
    .await?;
    sqlx::query(
        "INSERT INTO llm_calls (round_id, attempt, role, model, prompt_tokens, completion_tokens, cost_usd, latency_ms, retries, created_at)
         SELECT r.id, 1, CASE WHEN c < 20 THEN 'reflector' ELSE 'aggregator' END, 'sim', 900, 300, 0.0004, 800, 0, r.finished_at
         FROM rounds r, generate_series(1, 34) c",
    )
    .execute(&mut *db)
    .await?;
    // A bulk load builds the secondary indexes of the big tables once at the end (as a
    // restore would) instead of row by row: the same definitions, dropped and made again.
    let indexes: Vec<(String, String)> = sqlx::query_as(
        "SELECT indexname::text, indexdef FROM pg_indexes WHERE schemaname = 'public'
           AND tablename IN ('traces', 'otlp_spans', 'reflections', 'round_traces')
           AND indexname NOT IN (SELECT conname FROM pg_constraint)",
    )
    .fetch_all(&mut *db)
    .await?;
    for (name, _) in &indexes {
        sqlx::raw_sql(&format!("DROP INDEX {name}")).execute(&mut *db).await?;
    }
    // Traces: consumed (98 %), failed (1.5 %), quarantined (0.5 %); every tenth linked to its
    // day's round with a reflection; every tenth (another) with two OTLP spans.
    const CHUNK: u64 = 250_000;
    for (p_idx, (prompt_id, name)) in prompts.iter().enumerate() {
        log(format!("loading {per_prompt} traces of {name}"));
        let mut from = 0;
        while from < per_prompt {
            let to = (from + CHUNK).min(per_prompt);
            let mut tx = db.begin().await?;
            sqlx::query(&format!(
                "WITH s AS (
                     SELECT g, {p_idx} AS p, now() - interval '1 hour' - ({span_us} - g * {span_us} / {per_prompt}) * interval '1 microsecond' AS ts
                     FROM generate_series({from}::bigint, {to} - 1) g)
                 INSERT INTO traces (id, prompt_id, prompt_version, status, input, trajectory, output, feedback, metadata,
                                     attempts, created_at, updated_at, quarantined_at, quarantine_reason)
                 SELECT {V7}, $1, 1,
                        CASE WHEN g % 200 < 3 THEN 'failed' WHEN g % 200 = 3 THEN 'pending' ELSE 'consumed' END,
                        jsonb_build_object('question', 'How do I reset the password of account ' || g || '?'),
                        jsonb_build_array(jsonb_build_object('role', 'assistant', 'content', 'Looking up account ' || g),
                                          jsonb_build_object('role', 'tool', 'name', 'lookup', 'content', 'found ' || g)),
                        to_jsonb('Go to Settings, then Security, then Reset. Ticket ' || g),
                        jsonb_build_object('success', (g * 7919) % 10 < 6, 'score', ((g * 104729) % 11) / 10.0),
                        jsonb_build_object('task_key', 'task-' || (g % 40), 'tokens', 200 + g % 300),
                        CASE WHEN g % 200 < 3 THEN 3 ELSE 0 END, ts, ts,
                        CASE WHEN g % 200 = 3 THEN ts END, CASE WHEN g % 200 = 3 THEN 'hostile burst' END
                 FROM s"
            ))
            .bind(prompt_id)
            .execute(&mut *tx)
            .await?;
            sqlx::query(&format!(
                "WITH s AS (
                     SELECT g, {p_idx} AS p, now() - interval '1 hour' - ({span_us} - g * {span_us} / {per_prompt}) * interval '1 microsecond' AS ts
                     FROM generate_series({from}::bigint, {to} - 1) g WHERE g % 10 = 0 AND g % 200 >= 4),
                 t AS (SELECT {V7} AS id, ts, md5('round:' || $1::text || ':' || greatest(0, {days} - 1 - floor(extract(epoch FROM (now() - interval '1 hour' - ts)) / 86400)::int))::uuid AS round_id, g FROM s),
                 rt AS (INSERT INTO round_traces (round_id, trace_id, position) SELECT round_id, id, g FROM t)
                 INSERT INTO reflections (round_id, trace_id, reflection, from_trace, created_at)
                 SELECT round_id, id, jsonb_build_object('error', 'none', 'root_cause', 'the agent skipped a step',
                        'correct_approach', 'check the account first', 'key_insight', 'verify the account before resetting ' || g,
                        'bullet_tags', '[]'::jsonb), false, ts FROM t",
                days = args.history_days
            ))
            .bind(prompt_id)
            .execute(&mut *tx)
            .await?;
            sqlx::query(&format!(
                "WITH s AS (
                     SELECT g, {p_idx} AS p, now() - interval '1 hour' - ({span_us} - g * {span_us} / {per_prompt}) * interval '1 microsecond' AS ts
                     FROM generate_series({from}::bigint, {to} - 1) g WHERE g % 10 = 1)
                 INSERT INTO otlp_spans (otel_trace_id, span_id, trace_id, body, received_at)
                 SELECT md5('otel:' || $2 || ':' || g), lpad(to_hex(k), 16, '0'), {V7},
                        convert_to(repeat('gen_ai.input.messages: how do I reset the password of account ' || g || '; ', 6), 'UTF8'), ts
                 FROM s, generate_series(1, 2) k"
            ))
            .bind(prompt_id)
            .bind(name)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            from = to;
        }
    }
    log(format!("building {} indexes", indexes.len()));
    for (_, def) in &indexes {
        sqlx::raw_sql(def).execute(&mut *db).await?;
    }
    // Rolled up as migration 0015 does for traces already stored.
    log("rolling up the history");
    let migration = include_str!("../../../../migrations/postgres/0015_outcome_rollups.sql");
    let backfill = &migration[migration.find("INSERT INTO outcome_rollups").context("the backfill of 0015")?..];
    sqlx::raw_sql(backfill).execute(&mut *db).await?;
    log("VACUUM ANALYZE");
    sqlx::raw_sql("VACUUM ANALYZE").execute(&mut *db).await?;
    Ok(())
}

async fn table_sizes(db: &mut PgConnection) -> anyhow::Result<BTreeMap<String, i64>> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT c.relname::text, pg_total_relation_size(c.oid) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.relkind = 'r' AND n.nspname = 'public'",
    )
    .fetch_all(&mut *db)
    .await?;
    Ok(rows.into_iter().collect())
}

/// Latencies (µs) and errors of one kind of request in one period.
#[derive(Default)]
struct Samples {
    us: Vec<u32>,
    errors: u64,
    first_error: Option<String>,
}

impl Samples {
    fn quantile_ms(&self, q: f64) -> f64 {
        if self.us.is_empty() {
            return f64::NAN;
        }
        let mut v = self.us.clone();
        v.sort_unstable();
        let rank = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len());
        f64::from(v[rank - 1]) / 1000.0
    }
}

const KINDS: [&str; 5] = ["GET prompt", "POST trace", "OTLP export", "late feedback", "GET metrics"];

struct Period {
    /// The warm-up (printed, left out of the ratios).
    warmup: bool,
    samples: BTreeMap<&'static str, Samples>,
    sizes: BTreeMap<String, i64>,
    rss_kb: u64,
    /// Rater ticks: their summed seconds and count.
    rater: (f64, f64),
    /// Of the ticks' seconds, those waiting on the crossover's LLM call.
    rater_llm: f64,
    /// The store work of the rated windows (reading the window, saving the ratings), and how many windows.
    rater_windows: (f64, f64),
    /// Of that work, reading the windows and saving the ratings, apart.
    rater_read_save: (f64, f64),
    /// Live arms per `evaluated` population at the period's end.
    live_arms: f64,
    /// Postgres's own upkeep in the period: autovacuum runs, dead rows at its end, checkpoints.
    upkeep: Upkeep,
    /// CPU seconds each process used in the period, and the period's length in seconds.
    cpu: CpuSecs,
    /// Inside Postgres: CPU per kind of process, its backends' waits.
    inside: insight::Sampled,
    /// The statements Postgres ran in the period, by query id (empty without `pg_stat_statements`).
    statements: BTreeMap<i64, insight::Statement>,
    secs: f64,
    rounds: Vec<f64>,
    deleted: f64,
    traces: i64,
}

/// Tables whose upkeep the report follows: the biggest, and the rollups the rater and metrics read.
const UPKEEP_TABLES: [&str; 3] = ["traces", "outcome_rollups", "task_rollups"];

/// Postgres's background work, as counters to difference between periods.
#[derive(Default, Clone)]
struct Upkeep {
    /// Per table of [`UPKEEP_TABLES`]: autovacuum runs, dead rows now.
    tables: BTreeMap<String, (i64, i64)>,
    checkpoints: i64,
}

impl Upkeep {
    async fn read(db: &mut PgConnection) -> anyhow::Result<Self> {
        let rows: Vec<(String, i64, i64)> = sqlx::query_as(
            "SELECT relname::text, autovacuum_count, n_dead_tup FROM pg_stat_user_tables WHERE relname = ANY($1)",
        )
        .bind(UPKEEP_TABLES.map(str::to_owned).to_vec())
        .fetch_all(&mut *db)
        .await?;
        let checkpoints: i64 = sqlx::query_scalar("SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter")
            .fetch_one(&mut *db)
            .await?;
        Ok(Self { tables: rows.into_iter().map(|(t, a, d)| (t, (a, d))).collect(), checkpoints })
    }

    /// Runs and checkpoints since `before`; dead rows as they are now.
    fn since(&self, before: &Self) -> Self {
        let tables = self
            .tables
            .iter()
            .map(|(t, (runs, dead))| (t.clone(), (runs - before.tables.get(t).map_or(0, |b| b.0), *dead)))
            .collect();
        Self { tables, checkpoints: self.checkpoints - before.checkpoints }
    }
}

struct Live {
    periods: Vec<Period>,
    runs: u64,
}

type Recorder = Arc<Mutex<BTreeMap<&'static str, Samples>>>;

fn record(r: &Recorder, kind: &'static str, t0: Instant, outcome: Result<u16, String>, ok: u16) {
    let mut m = r.lock().unwrap_or_else(|e| e.into_inner());
    let s = m.entry(kind).or_default();
    match outcome {
        Ok(status) if status == ok => s.us.push(t0.elapsed().as_micros().min(u128::from(u32::MAX)) as u32),
        Ok(status) => {
            s.errors += 1;
            s.first_error.get_or_insert_with(|| format!("HTTP {status}"));
        }
        Err(e) => {
            s.errors += 1;
            s.first_error.get_or_insert(e);
        }
    }
}

/// The sum and count of a Prometheus summary or histogram in a scrape.
fn summary(scrape: &str, name: &str) -> (f64, f64) {
    let get = |suffix: &str| {
        scrape
            .lines()
            .filter(|l| l.starts_with(&format!("{name}_{suffix}")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    (get("sum"), get("count"))
}

/// The sum of a summary or histogram with this label (e.g. `phase="read"`).
fn labelled_sum(scrape: &str, name: &str, label: &str) -> f64 {
    let prefix = format!("{name}_sum{{{label}}}");
    scrape.lines().filter(|l| l.starts_with(&prefix)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

fn counter(scrape: &str, name: &str) -> f64 {
    scrape.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

async fn live(args: &Args, server: &Server, sim_pid: u32, key: &str, url: &str) -> anyhow::Result<Live> {
    let base = format!("http://{}", server.addr);
    let http = reqwest::Client::builder().pool_max_idle_per_host(256).timeout(Duration::from_secs(30)).build()?;
    let recorder: Recorder = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let runs = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    // Agents: one run every 1/rate seconds, each in its own task (open loop).
    {
        let (http, base, key, recorder, stop, runs) =
            (http.clone(), base.clone(), key.to_owned(), recorder.clone(), stop.clone(), runs.clone());
        let args = args.clone();
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / args.rate));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut n: u64 = 0;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                n += 1;
                runs.fetch_add(1, Ordering::Relaxed);
                let (http, base, key, recorder, args) =
                    (http.clone(), base.clone(), key.clone(), recorder.clone(), args.clone());
                tokio::spawn(async move { agent_run(n, &http, &base, &key, &recorder, &args).await });
            }
        });
    }
    // A dashboard.
    {
        let (http, base, key, recorder, stop) =
            (http.clone(), base.clone(), key.to_owned(), recorder.clone(), stop.clone());
        let (every, prompts) = (Duration::from_secs_f64(1.0 / args.metrics_rate), args.prompts);
        tasks.spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(7);
            let mut tick = tokio::time::interval(every);
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let t0 = Instant::now();
                let name = prompt_name(rng.gen_range(0..prompts));
                let res = http.get(format!("{base}/v1/prompts/{name}/metrics")).bearer_auth(&key).send().await;
                record(&recorder, "GET metrics", t0, res.map(|r| r.status().as_u16()).map_err(|e| e.to_string()), 200);
            }
        });
    }
    let mut db = PgConnection::connect(url).await?;
    let period = Duration::from_secs(args.live_secs / u64::from(args.periods.max(1)));
    let mut lengths: Vec<(bool, Duration)> = vec![(false, period); args.periods.max(1) as usize];
    if args.warmup_secs > 0 {
        lengths.insert(0, (true, Duration::from_secs(args.warmup_secs)));
    }
    let mut periods = Vec::new();
    let mut last_scrape = String::new();
    let mut last_upkeep = Upkeep::read(&mut db).await?;
    let mut last_cpu = CpuSecs::read(server.pid, sim_pid);
    let statements = insight::Statements::enable(&mut db).await;
    let sampler = insight::Sampler::start(url).await?;
    for (p, (warmup, length)) in lengths.into_iter().enumerate() {
        let from = chrono::Utc::now();
        statements.reset(&mut db).await;
        sampler.take();
        tokio::time::sleep(length).await;
        let inside = sampler.take();
        let period_statements = statements.read(&mut db).await;
        let now_cpu = CpuSecs::read(server.pid, sim_pid);
        let cpu = now_cpu.since(&last_cpu);
        last_cpu = now_cpu;
        let samples = std::mem::take(&mut *recorder.lock().unwrap_or_else(|e| e.into_inner()));
        let scrape = http.get(format!("{base}/metrics")).send().await?.text().await?;
        let (rs, rc) = summary(&scrape, "combee_rater_tick_seconds");
        let (ls, lc) = summary(&last_scrape, "combee_rater_tick_seconds");
        let phase = |s: &str, phase: &str| labelled_sum(s, "combee_rater_phase_seconds", &format!("phase=\"{phase}\""));
        let since = |phase_name: &str| phase(&scrape, phase_name) - phase(&last_scrape, phase_name);
        let rater_llm = since("crossover_llm");
        let windows_work = since("read") + since("save");
        let rater_read_save = (since("read"), since("save"));
        let windows =
            counter(&scrape, "combee_rater_windows_total") - counter(&last_scrape, "combee_rater_windows_total");
        let deleted = counter(&scrape, "combee_retention_deleted_total{what=\"traces\"}")
            - counter(&last_scrape, "combee_retention_deleted_total{what=\"traces\"}");
        last_scrape = scrape;
        let rounds: Vec<f64> = sqlx::query_scalar(
            "SELECT extract(epoch FROM finished_at - started_at)::float8 FROM rounds
             WHERE status = 'succeeded' AND finished_at >= $1 AND started_at IS NOT NULL",
        )
        .bind(from)
        .fetch_all(&mut db)
        .await?;
        let traces: i64 = sqlx::query_scalar("SELECT count(*) FROM traces").fetch_one(&mut db).await?;
        let live_arms: f64 = sqlx::query_scalar(
            "SELECT coalesce(count(*)::float8 / nullif(count(DISTINCT prompt_id), 0), 0) FROM population_arms
             WHERE state <> 'retired'",
        )
        .fetch_one(&mut db)
        .await?;
        let now_upkeep = Upkeep::read(&mut db).await?;
        let upkeep = now_upkeep.since(&last_upkeep);
        last_upkeep = now_upkeep;
        let period = Period {
            warmup,
            rater_llm,
            rater_windows: (windows_work, windows),
            rater_read_save,
            live_arms,
            upkeep,
            cpu,
            inside,
            statements: period_statements,
            secs: length.as_secs_f64(),
            samples,
            sizes: table_sizes(&mut db).await?,
            rss_kb: rss_kb(server.pid),
            rater: (rs - ls, rc - lc),
            rounds,
            deleted,
            traces,
        };
        let get = period.samples.get("GET prompt").map_or(f64::NAN, |s| s.quantile_ms(0.99));
        let name =
            if warmup { "warm-up".to_owned() } else { format!("period {}", p + usize::from(args.warmup_secs == 0)) };
        log(format!("{name}: GET p99 {get:.2} ms, {traces} traces stored, {deleted:.0} deleted"));
        periods.push(period);
    }
    stop.store(true, Ordering::Relaxed);
    tasks.shutdown().await;
    Ok(Live { periods, runs: runs.load(Ordering::Relaxed) })
}

/// One simulated agent run: fetch the prompt for a subject, run (simulated),
/// report the trace with its reward, sometimes feedback later.
async fn agent_run(n: u64, http: &reqwest::Client, base: &str, key: &str, recorder: &Recorder, args: &Args) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(n);
    let name = prompt_name(rng.gen_range(0..args.prompts));
    let subject = format!("user-{}", rng.gen_range(0..args.subjects));
    let t0 = Instant::now();
    let res =
        http.get(format!("{base}/v1/prompts/{name}")).bearer_auth(key).header("combee-subject", &subject).send().await;
    let version = match res {
        Ok(r) => {
            let status = r.status().as_u16();
            let body: Value = r.json().await.unwrap_or(Value::Null);
            record(recorder, "GET prompt", t0, Ok(status), 200);
            body["version"].as_i64()
        }
        Err(e) => {
            record(recorder, "GET prompt", t0, Err(e.to_string()), 200);
            None
        }
    };
    let success = rng.gen_bool(0.6);
    let score = f64::from(rng.gen_range(0..=10)) / 10.0;
    let task = format!("task-{}", rng.gen_range(0..40));
    if rng.gen_bool(args.otlp_share) {
        let now_ns = chrono::Utc::now().timestamp_nanos_opt().unwrap_or(0);
        let body = json!({"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "soak-agent"}}]},
        "scopeSpans": [{"spans": [{
            "traceId": format!("{:032x}", rng.r#gen::<u128>()), "spanId": format!("{:016x}", rng.r#gen::<u64>()),
            "name": format!("invoke_agent {name}"), "kind": 3,
            "startTimeUnixNano": (now_ns - 900_000_000).to_string(), "endTimeUnixNano": now_ns.to_string(),
            "attributes": [
                {"key": "gen_ai.prompt.name", "value": {"stringValue": name}},
                {"key": "gen_ai.prompt.version", "value": {"intValue": version.unwrap_or(1).to_string()}},
                {"key": "gen_ai.prompt", "value": {"stringValue": format!("How do I reset the password of {subject}?")}},
                {"key": "gen_ai.completion", "value": {"stringValue": "Settings, Security, Reset."}},
                {"key": "combee.feedback.success", "value": {"boolValue": success}},
                {"key": "gen_ai.usage.input_tokens", "value": {"intValue": "240"}}
            ]}]}]}]});
        let t0 = Instant::now();
        let res = http.post(format!("{base}/v1/otlp/v1/traces")).bearer_auth(key).json(&body).send().await;
        record(recorder, "OTLP export", t0, res.map(|r| r.status().as_u16()).map_err(|e| e.to_string()), 200);
        return;
    }
    let trace = json!({
        "prompt": name, "prompt_version": version,
        "input": {"question": format!("How do I reset the password of {subject}?")},
        "trajectory": [{"role": "assistant", "content": "Looking up the account"}, {"role": "tool", "name": "lookup", "content": "found"}],
        "output": "Go to Settings, then Security, then Reset.",
        "feedback": {"success": success, "score": score},
        "metadata": {"task_key": task, "tokens": rng.gen_range(200..500)},
    });
    let t0 = Instant::now();
    let res = http.post(format!("{base}/v1/traces")).bearer_auth(key).json(&trace).send().await;
    let id = match res {
        Ok(r) => {
            let status = r.status().as_u16();
            let body: Value = r.json().await.unwrap_or(Value::Null);
            record(recorder, "POST trace", t0, Ok(status), 201);
            body["ids"][0].as_str().or(body["id"].as_str()).map(str::to_owned)
        }
        Err(e) => {
            record(recorder, "POST trace", t0, Err(e.to_string()), 201);
            None
        }
    };
    if let Some(id) = id.filter(|_| rng.gen_bool(args.late_feedback)) {
        tokio::time::sleep(Duration::from_secs(rng.gen_range(1..10))).await;
        let t0 = Instant::now();
        let res = http
            .post(format!("{base}/v1/traces/{id}/feedback"))
            .bearer_auth(key)
            .json(&json!({"score": 1.0, "comment": "the user confirmed it worked"}))
            .send()
            .await;
        record(recorder, "late feedback", t0, res.map(|r| r.status().as_u16()).map_err(|e| e.to_string()), 200);
    }
}

fn mb(bytes: i64) -> f64 {
    bytes as f64 / 1_048_576.0
}

fn render(
    args: &Args,
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
