//! `combee-bench`: the foundation benchmark. It starts the real server as a
//! child process on a fresh database, loads it over keep-alive HTTP/1.1 for a
//! fixed time per figure, and prints a Markdown report with targets. It is a
//! report, not a test: a missed target still exits 0; a setup error does not.
//!
//! The load generator shares the machine with the server (and Postgres), so it
//! uses its own tiny HTTP/1.1 client (one write, one read, `Content-Length`
//! framing, no pool layer) on one tokio thread by default to keep its CPU cost
//! low; the report shows how much CPU each side used.
//!
//! `combee-bench bare` (hidden) is the comparison server: a bare axum handler
//! with a fixed JSON body and no middleware. It answers what combee answers
//! (the same body size and the same response headers, as in one of combee's
//! answers) to the same requests, and each GET figure is measured in
//! slices alternating with it, so both see the same machine: the ratio is
//! the cost of making the answer, not of sending a longer one, nor of a
//! neighbour's load that came and went between two figures.
//!
//! `combee-bench burst` is a section of its own: the cost of an outcome read
//! (`GET /v1/prompts/{name}/metrics`) right after a burst of traces, on both
//! stores (see `burst.rs`).

mod bare;
mod burst;
mod client;
mod database;
mod figures;
mod floor;
mod ingest;
mod load;
mod model;
mod processes;
mod report;
mod watch;

use std::{net::SocketAddr, path::PathBuf};

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};

use crate::bare::serve_bare;
use crate::database::BenchDatabase;
use crate::figures::measure;
use crate::processes::ScratchDir;
use crate::report::render;

#[derive(Debug, Parser)]
#[command(name = "combee-bench", about = "Prints combee's foundation benchmark figures (run it through scripts/bench)")]
struct BenchCli {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Load the HTTP API of a freshly started server and print the report.
    Http(HttpArgs),
    /// Post a burst of traces to a fresh server, then time the metrics read over a window holding them.
    Burst(burst::BurstArgs),
    /// The comparison server: a bare axum handler answering `GET /v1/prompts/bench` with a fixed JSON body.
    #[command(hide = true)]
    Bare {
        #[arg(long)]
        bind: SocketAddr,
        /// Size of the JSON body, in bytes.
        #[arg(long)]
        body_bytes: usize,
        /// A response header, `name: value` (repeatable).
        #[arg(long = "header")]
        headers: Vec<String>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BenchStore {
    Postgres,
    Sqlite,
}

impl BenchStore {
    fn as_str(self) -> &'static str {
        match self {
            BenchStore::Postgres => "postgres",
            BenchStore::Sqlite => "sqlite",
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
struct HttpArgs {
    /// Seconds each figure is measured for.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Seconds of unmeasured load before each figure.
    #[arg(long, default_value_t = 2)]
    warmup: u64,
    /// Concurrent keep-alive connections.
    #[arg(long, default_value_t = 64)]
    connections: usize,
    /// Traces per request in the batched-ingest figure.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Which store the server runs on. Postgres needs DATABASE_URL (an admin URL; a fresh database is created next to it).
    #[arg(long, value_enum, default_value_t = BenchStore::Postgres)]
    store: BenchStore,
    /// The server's `database.max_connections` (unset: the server's default).
    #[arg(long)]
    db_connections: Option<u32>,
    /// Offered load of the paced single-trace figure, in req/s (0 skips it) [default: half the
    /// single-trace capacity the closed-loop figure measured just before, or 5,000 without it].
    #[arg(long)]
    paced_rate: Option<f64>,
    /// Tokio worker threads for the load generator.
    #[arg(long, default_value_t = 1)]
    client_threads: usize,
    /// The `combee` binary [default: next to this one].
    #[arg(long)]
    server_bin: Option<PathBuf>,
    /// Only these figures (comma-separated: post, paced, batch, floor, get, bare, memory) [default: all];
    /// `floor` (the store alone with the same rows) is measured in slices alternating with `batch`.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Distinct subjects the GET-with-a-subject figures rotate through.
    #[arg(long, default_value_t = 10_000)]
    subjects: usize,
    /// Prompts and subjects of the memory figure: this many prompts are created, then fetched with
    /// `memory_subjects` distinct subjects.
    #[arg(long, default_value_t = 10_000)]
    memory_prompts: usize,
    #[arg(long, default_value_t = 100_000)]
    memory_subjects: usize,
    /// Keep the Postgres bench database afterwards (its name is printed), to look into it (e.g. which
    /// relations the WAL went to, with pg_waldump) [default: dropped].
    #[arg(long)]
    keep_database: bool,
    /// Also measure GET on the embedded SQLite store (a second server) when the store is Postgres.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    sqlite_get: bool,
}

fn main() -> std::process::ExitCode {
    let cli = BenchCli::parse();
    let result = match cli.command {
        BenchCommand::Bare { bind, body_bytes, headers } => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(serve_bare(bind, body_bytes, &headers))),
        BenchCommand::Burst(args) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| {
                rt.block_on(async {
                    tokio::select! {
                        r = burst::run_burst(args) => r,
                        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
                    }
                })
            }),
        BenchCommand::Http(args) => {
            let rt = if args.client_threads <= 1 {
                tokio::runtime::Builder::new_current_thread().enable_all().build()
            } else {
                tokio::runtime::Builder::new_multi_thread().worker_threads(args.client_threads).enable_all().build()
            };
            rt.map_err(anyhow::Error::from).and_then(|rt| {
                rt.block_on(async {
                    // Returning drops every child guard, which kills the children.
                    tokio::select! {
                        r = run_http(args) => r,
                        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
                    }
                })
            })
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("combee-bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run_http(args: HttpArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.connections > 0 && args.duration > 0, "--connections and --duration must be positive");
    let server_bin = match &args.server_bin {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("combee"),
    };
    anyhow::ensure!(server_bin.exists(), "{} not found (build it with cargo build --release)", server_bin.display());
    let scratch = ScratchDir::new()?;

    let mut database = None;
    let db_url = match args.store {
        BenchStore::Sqlite => String::new(),
        BenchStore::Postgres => {
            let admin = std::env::var("DATABASE_URL")
                .ok()
                .filter(|u| !u.is_empty())
                .context("DATABASE_URL is unset: point it at a Postgres server (scripts/bench starts a private one)")?;
            let db = BenchDatabase::create(&admin).await?;
            let url = db.url.clone();
            database = Some(db);
            url
        }
    };
    let outcome = measure(&args, &server_bin, &scratch.0, &db_url, database.as_ref())
        .await
        .map(|(facts, phases)| render(&facts, &phases));
    if let Some(db) = database {
        if args.keep_database {
            eprintln!("combee-bench: kept the bench database {}", db.url);
        } else {
            db.drop_database().await;
        }
    }
    let report = outcome?;
    print!("{report}");
    Ok(())
}
