//! The figures: start the server, create the benchmark's prompt, then measure
//! each figure in turn (single and batched POSTs, paced POSTs, GETs alternating
//! with the bare server, the memory figure) into phases for the report.

use std::{
    net::SocketAddr,
    path::Path,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use anyhow::Context;
use tokio::process::Command;

use crate::bare::BARE_PATH;
use crate::client::{answer_headers, encode_get_with_subject, encode_request, request_once};
use crate::database::BenchDatabase;
use crate::ingest::{ServerTarget, ingest_phases};
use crate::load::{LoadResult, Pace, load, run_each_once};
use crate::model::{Facts, GET_SLICES, LoadPhase};
use crate::processes::{ChildGuard, CpuUse, CpuWindow, MemoryWatch, clock_ticks_per_sec, free_port, memory_kb};
use crate::{BenchStore, HttpArgs};

/// The comparison server ([`serve_bare`]), running while the GET figures are measured.
struct BareServer {
    guard: ChildGuard,
    addr: SocketAddr,
}

/// The requests of one GET figure, made for a server's address (its Host header).
type Requests<'a> = dyn Fn(SocketAddr) -> Vec<Vec<u8>> + 'a;

/// The benchmark's prompt, with the product's defaults (promotion `evaluated`: served through its population).
const CREATE_BENCH: &str = r#"{"name":"bench","base":"You are a benchmark agent."}"#;

/// `GET /v1/prompts/bench` on one server, without and with a subject (a
/// rotation of `--subjects` distinct ones, as agents serving many users send).
async fn get_phases(
    args: &HttpArgs,
    addr: SocketAddr,
    key: &str,
    store: &str,
    pid: u32,
    memory: &MemoryWatch,
    bare: Option<&BareServer>,
) -> anyhow::Result<Vec<LoadPhase>> {
    // The same requests to both servers (but the Host header).
    let plain = |addr| vec![encode_request("GET", BARE_PATH, addr, key, None)];
    let subjects = |addr| -> Vec<Vec<u8>> {
        (0..args.subjects.max(1))
            .map(|i| encode_get_with_subject(BARE_PATH, addr, key, &format!("user-{i:06}")))
            .collect()
    };
    let (status, _) = request_once(addr, &subjects(addr)[0]).await?;
    anyhow::ensure!(status == 200, "GET with a subject on {store} answered {status}");
    let mut out = Vec::new();
    let figures: [(String, &Requests<'_>); 2] = [
        (format!("GET /v1/prompts/bench [{store}]"), &plain),
        (format!("GET /v1/prompts/bench with a subject [{store}]"), &subjects),
    ];
    let (warmup, duration) = (Duration::from_secs(args.warmup), Duration::from_secs(args.duration));
    let slice = duration / GET_SLICES;
    let tck = clock_ticks_per_sec();
    for (name, requests) in figures {
        let paired =
            if bare.is_some() { format!(", alternating with the bare server every {slice:?}") } else { String::new() };
        eprintln!("combee-bench: {name}: {} s warm-up, {} s measured{paired}", args.warmup, args.duration);
        let ours = Arc::new(requests(addr));
        let theirs = bare.map(|b| (b, Arc::new(requests(b.addr))));
        if !warmup.is_zero() {
            load(addr, ours.clone(), 200, args.connections, warmup, Pace::Flat).await?;
            if let Some((b, r)) = &theirs {
                load(b.addr, r.clone(), 200, args.connections, warmup, Pace::Flat).await?;
            }
        }
        memory.take_phase_peak();
        let (mut result, mut used) = (LoadResult::default(), CpuWindow::default());
        let (mut bare_result, mut bare_used) = (LoadResult::default(), CpuWindow::default());
        let slices = if theirs.is_some() { GET_SLICES } else { 1 };
        for _ in 0..slices {
            let window = CpuWindow::start(pid);
            result.absorb(load(addr, ours.clone(), 200, args.connections, duration / slices, Pace::Flat).await?);
            used.add(window.ticks(pid));
            if let Some((b, r)) = &theirs {
                let window = CpuWindow::start(b.guard.pid);
                bare_result.absorb(load(b.addr, r.clone(), 200, args.connections, slice, Pace::Flat).await?);
                bare_used.add(window.ticks(b.guard.pid));
            }
        }
        let cpu = CpuUse::of(&used, result.elapsed, tck);
        let bare_phase = theirs.map(|(b, _)| {
            let cpu = CpuUse::of(&bare_used, bare_result.elapsed, tck);
            let peak_rss_kb = memory_kb(b.guard.pid).map_or(0, |m| m.1);
            let name = format!("bare axum GET, alternating with \"{name}\"");
            Box::new(LoadPhase {
                name,
                result: bare_result,
                cpu,
                items: 1,
                peak_rss_kb,
                bare: None,
                groups: None,
                per_second: None,
                wal_bytes: None,
            })
        });
        out.push(LoadPhase {
            name,
            result,
            cpu,
            items: 1,
            peak_rss_kb: memory.take_phase_peak(),
            bare: bare_phase,
            groups: None,
            per_second: None,
            wal_bytes: None,
        });
    }
    Ok(out)
}

/// The bounded caches under many prompts and subjects: creates `--memory-prompts`
/// prompts, fetches them with `--memory-subjects` distinct subjects (subject i
/// asks for prompt i mod prompts), and reads the server's RSS afterwards.
async fn memory_figure(
    args: &HttpArgs,
    addr: SocketAddr,
    key: &str,
    pid: u32,
) -> anyhow::Result<(usize, usize, u64, u64)> {
    let (prompts, subjects) = (args.memory_prompts.max(1), args.memory_subjects.max(1));
    eprintln!("combee-bench: memory: creating {prompts} prompts, then {subjects} GETs with distinct subjects");
    let creates: Vec<Vec<u8>> = (0..prompts)
        .map(|i| {
            let body =
                format!(r#"{{"name":"mem-{i:05}","base":"You are agent {i}. HttpAnswer precisely and briefly."}}"#);
            encode_request("POST", "/v1/prompts", addr, key, Some(body.as_bytes()))
        })
        .collect();
    run_each_once(addr, creates, 201, args.connections).await.context("creating the memory figure's prompts")?;
    let gets: Vec<Vec<u8>> = (0..subjects)
        .map(|i| {
            encode_get_with_subject(
                &format!("/v1/prompts/mem-{:05}", i % prompts),
                addr,
                key,
                &format!("subject-{i:07}"),
            )
        })
        .collect();
    run_each_once(addr, gets, 200, args.connections).await.context("the memory figure's GETs")?;
    let (rss, hwm) = memory_kb(pid).context("cannot read the server's memory")?;
    Ok((prompts, subjects, rss, hwm))
}

const TRACE: &str = r#"{"prompt":"bench","input":{"q":"What is the capital of France, and how long is the Seine?"},"output":"Paris; the Seine is about 777 km long.","feedback":{"success":true}}"#;

/// Measures every figure `args` asks for; the report renders what it returns.
pub(crate) async fn measure<'a>(
    args: &HttpArgs,
    server_bin: &Path,
    scratch: &Path,
    db_url: &str,
    database: Option<&'a BenchDatabase>,
) -> anyhow::Result<(Facts<'a>, Vec<LoadPhase>)> {
    let loadavg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let addr = free_port()?;
    let data_dir = scratch.join("data");
    let mut cmd = Command::new(server_bin);
    cmd.args(["serve", "--bind", &addr.to_string()])
        .env("DATABASE_URL", db_url)
        .env("COMBEE__DATABASE__DATA_DIR", &data_dir)
        .env("COMBEE__LOG__LEVEL", "warn")
        .env_remove("RUST_LOG")
        .env_remove("COMBEE__DATABASE__URL");
    if let Some(n) = args.db_connections {
        cmd.env("COMBEE__DATABASE__MAX_CONNECTIONS", n.to_string());
    }
    let mut server = ChildGuard::spawn(cmd, scratch.join("server.log"))?;
    server.wait_ready(addr, "/readyz").await.context("the combee server did not start")?;
    let key_path = data_dir.join("admin-key");
    let key = std::fs::read_to_string(&key_path)
        .with_context(|| format!("cannot read the admin key from {}", key_path.display()))?
        .trim()
        .to_owned();
    let memory = MemoryWatch::start(server.pid);
    let idle_rss_kb = memory_kb(server.pid).map_or(0, |m| m.0);

    let create = encode_request("POST", "/v1/prompts", addr, &key, Some(CREATE_BENCH.as_bytes()));
    let (status, body) = request_once(addr, &create).await?;
    anyhow::ensure!(
        status == 201,
        "creating the prompt answered {status}: {}\nserver log:\n{}",
        String::from_utf8_lossy(&body),
        server.log_tail()
    );

    let single = encode_request("POST", "/v1/traces", addr, &key, Some(TRACE.as_bytes()));
    let batch_body = format!(r#"{{"traces":[{}]}}"#, vec![TRACE; args.batch].join(","));
    let batched = encode_request("POST", "/v1/traces", addr, &key, Some(batch_body.as_bytes()));
    let get = encode_request("GET", "/v1/prompts/bench", addr, &key, None);
    let (status, prompt_body) = request_once(addr, &get).await?;
    anyhow::ensure!(status == 200, "GET /v1/prompts/bench answered {status}");
    // The same check for the batch, once, so a rejected batch is a setup error and not a figure.
    let (status, body) = request_once(addr, &batched).await?;
    anyhow::ensure!(
        status == 201,
        "a batch of {} answered {status}: {}\nserver log:\n{}",
        args.batch,
        String::from_utf8_lossy(&body),
        server.log_tail()
    );

    let wanted = |name: &str| args.only.is_empty() || args.only.iter().any(|o| o == name);
    let bare_addr = free_port()?;
    // Response headers the bare server sends (combee's, Content-Type included), once known.
    let mut bare_headers = 0;
    let target = ServerTarget {
        addr,
        key: &key,
        pid: server.pid,
        postgres_url: database.map(|db| db.url.as_str()),
        data_dir: &data_dir,
    };
    let ingest = ingest_phases(args, &target, &memory, single, batched, &wanted).await?;
    let mut phases = ingest.phases;

    if wanted("get") {
        let bare = if wanted("bare") {
            // Answers what combee answered: the headers of one of its answers, and the body size.
            let headers = answer_headers(addr, &get).await?;
            let mut cmd = Command::new(std::env::current_exe()?);
            cmd.args(["bare", "--bind", &bare_addr.to_string(), "--body-bytes", &prompt_body.len().to_string()]);
            for h in &headers {
                cmd.args(["--header", h]);
            }
            let mut guard = ChildGuard::spawn(cmd, scratch.join("bare.log"))?;
            guard.wait_ready(bare_addr, BARE_PATH).await.context("the bare axum server did not start")?;
            let (_, bare_body) =
                request_once(bare_addr, &encode_request("GET", BARE_PATH, bare_addr, &key, None)).await?;
            anyhow::ensure!(bare_body.len() == prompt_body.len(), "the bare body differs in size from the prompt's");
            let theirs = answer_headers(bare_addr, &encode_request("GET", BARE_PATH, bare_addr, &key, None)).await?;
            anyhow::ensure!(theirs.len() == headers.len(), "the bare server answers {theirs:?}, combee {headers:?}");
            bare_headers = headers.len() + 1;
            Some(BareServer { guard, addr: bare_addr })
        } else {
            None
        };
        let store = args.store.as_str();
        phases.extend(get_phases(args, addr, &key, store, server.pid, &memory, bare.as_ref()).await?);
        if args.store == BenchStore::Postgres && args.sqlite_get {
            // The embedded store's GET, from a second server of its own.
            let sqlite_addr = free_port()?;
            let sqlite_data = scratch.join("sqlite-data");
            let mut cmd = Command::new(server_bin);
            cmd.args(["serve", "--bind", &sqlite_addr.to_string()])
                .env("DATABASE_URL", "")
                .env("COMBEE__DATABASE__DATA_DIR", &sqlite_data)
                .env("COMBEE__LOG__LEVEL", "warn")
                .env_remove("RUST_LOG")
                .env_remove("COMBEE__DATABASE__URL");
            let mut sqlite = ChildGuard::spawn(cmd, scratch.join("server-sqlite.log"))?;
            sqlite.wait_ready(sqlite_addr, "/readyz").await.context("the SQLite combee server did not start")?;
            let key = std::fs::read_to_string(sqlite_data.join("admin-key"))?.trim().to_owned();
            let create = encode_request("POST", "/v1/prompts", sqlite_addr, &key, Some(CREATE_BENCH.as_bytes()));
            let (status, _) = request_once(sqlite_addr, &create).await?;
            anyhow::ensure!(status == 201, "creating the prompt on SQLite answered {status}");
            let watch = MemoryWatch::start(sqlite.pid);
            phases.extend(get_phases(args, sqlite_addr, &key, "sqlite", sqlite.pid, &watch, bare.as_ref()).await?);
            sqlite.stop().await;
        }
        if let Some(b) = bare {
            b.guard.stop().await;
        }
    }
    let memory_probe = if wanted("memory") { Some(memory_figure(args, addr, &key, server.pid).await?) } else { None };

    // One last sample, then the kernel's own high-water mark covers anything between samples.
    if let Some((rss, hwm)) = memory_kb(server.pid) {
        memory.peak_rss_kb.fetch_max(rss, Ordering::Relaxed);
        memory.hwm_kb.fetch_max(hwm, Ordering::Relaxed);
    }
    let facts = Facts {
        args: args.clone(),
        loadavg: loadavg.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
        database,
        idle_rss_kb,
        peak_rss_kb: memory.peak_rss_kb.load(Ordering::Relaxed),
        hwm_kb: memory.hwm_kb.load(Ordering::Relaxed),
        samples: memory.samples.load(Ordering::Relaxed),
        prompt_body_bytes: prompt_body.len(),
        bare_headers,
        memory_probe,
        floor: ingest.floor,
        paced: ingest.paced,
    };
    drop(memory);
    server.stop().await;
    Ok((facts, phases))
}
