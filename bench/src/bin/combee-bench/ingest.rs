//! The trace-ingest figures: single-trace POSTs in a closed loop (the
//! machine's single-trace capacity), then paced at a share of that capacity
//! measured just before (watched second by second, see `watch.rs`), then
//! batched POSTs in slices alternating with the store's own floor
//! (`floor.rs`), so every ratio the report gives is of one run and the
//! batched figure and its floor saw the same minutes of the machine.

use std::{
    net::SocketAddr,
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use crate::floor::{Floor, Written, figures};
use crate::load::{LoadResult, Pace, load};
use crate::model::{FLOOR_SLICES, FloorFigure, FloorFigures, LoadPhase, WriteGroups, thousands};
use crate::processes::{CpuUse, CpuWindow, MemoryWatch, clock_ticks_per_sec};
use crate::watch::{Watch, per_second, wal_position};
use crate::{BenchStore, HttpArgs};

/// The offered rate of the paced figure when `--paced-rate` is not given: this
/// share of the single-trace capacity measured in the same run.
pub(crate) const PACED_SHARE: f64 = 0.5;

/// What the ingest figures measured.
pub(crate) struct Ingest {
    pub(crate) phases: Vec<LoadPhase>,
    pub(crate) floor: Option<FloorFigures>,
    /// The paced figure's rate, and whether it was the measured capacity's share.
    pub(crate) paced: Option<(f64, bool)>,
}

/// Where the server and its store are.
pub(crate) struct ServerTarget<'a> {
    pub(crate) addr: SocketAddr,
    pub(crate) key: &'a str,
    pub(crate) pid: u32,
    /// The bench database (Postgres), or the server's data directory (SQLite).
    pub(crate) postgres_url: Option<&'a str>,
    pub(crate) data_dir: &'a Path,
}

pub(crate) async fn ingest_phases(
    args: &HttpArgs,
    target: &ServerTarget<'_>,
    memory: &MemoryWatch,
    single: Vec<u8>,
    batched: Vec<u8>,
    wanted: &dyn Fn(&str) -> bool,
) -> anyhow::Result<Ingest> {
    let (addr, key) = (target.addr, target.key);
    let tck = clock_ticks_per_sec();
    let duration = Duration::from_secs(args.duration);
    let warmup = Duration::from_secs(args.warmup);
    let mut out = Ingest { phases: Vec::new(), floor: None, paced: None };
    let single = Arc::new(vec![single]);

    if wanted("post") {
        let name = "single-trace POST /v1/traces".to_owned();
        out.phases.push(measure(args, target, memory, name, single.clone(), 1, Pace::Flat, false).await?);
    }
    let capacity = out.phases.first().map(|p| p.result.per_sec());
    let rate = match (args.paced_rate, capacity) {
        (Some(rate), _) => Some((rate, false)),
        (None, Some(capacity)) => Some((PACED_SHARE * capacity, true)),
        // Nothing measured to take a share of: the rate the earlier reports used.
        (None, None) => Some((5000.0, false)),
    }
    .filter(|(rate, _)| *rate > 0.0);
    if wanted("paced")
        && let Some((rate, share)) = rate
    {
        let name = format!("single-trace POST /v1/traces, paced at {} req/s", thousands(rate));
        out.phases.push(measure(args, target, memory, name, single, 1, Pace::Rate(rate), true).await?);
        out.paced = Some((rate, share));
    }
    if wanted("batch") {
        let name = "batched POST /v1/traces".to_owned();
        let request = Arc::new(vec![batched]);
        if !wanted("floor") {
            out.phases.push(measure(args, target, memory, name, request, args.batch as u64, Pace::Flat, false).await?);
            return Ok(out);
        }
        let mut floor = match target.postgres_url {
            Some(url) => {
                let connections =
                    args.db_connections.unwrap_or(combee::config::Settings::default().database.max_connections);
                Floor::postgres(url, connections as usize, args.batch).await?
            }
            None => Floor::sqlite(&target.data_dir.join("combee.db"), args.batch).await?,
        };
        let connections = match &floor {
            Floor::Postgres { connections, .. } => *connections,
            Floor::Sqlite { .. } => 1,
        };
        let kinds = figures(target.postgres_url.is_some());
        eprintln!(
            "combee-bench: {name}, alternating with the store's floor ({} figures): {} s warm-up, {} s measured each",
            kinds.len(),
            args.warmup,
            args.duration
        );
        // The warm-up shows how many rows combee commits a group (SQLite's floor commits as many).
        let before = WriteGroups::read(addr, key).await?;
        load(addr, request.clone(), 201, args.connections, warmup.max(Duration::from_secs(1)), Pace::Flat).await?;
        let warm = WriteGroups::read(addr, key).await?.since(before);
        floor.commit_about(warm.rows / warm.groups.max(1.0));
        for &(way, table) in &kinds {
            floor.run(way, table, warmup / 2).await?;
        }
        memory.take_phase_peak();
        let slice = duration / FLOOR_SLICES;
        let (mut result, mut used) = (LoadResult::default(), CpuWindow::default());
        let mut written = vec![(Written::default(), CpuWindow::default(), 0u64); kinds.len()];
        let mut wal = 0u64;
        let url = target.postgres_url;
        let mut group_time = WriteGroups::default();
        for _ in 0..FLOOR_SLICES {
            let window = CpuWindow::start(target.pid);
            let before = WriteGroups::read(addr, key).await?;
            let wal_before = wal_position(url).await;
            result.absorb(load(addr, request.clone(), 201, args.connections, slice, Pace::Flat).await?);
            used.add(window.ticks(target.pid));
            wal += wal_since(wal_before, url).await;
            group_time = add(group_time, WriteGroups::read(addr, key).await?.since(before));
            for (i, &(way, table)) in kinds.iter().enumerate() {
                let window = CpuWindow::start(target.pid);
                let wal_before = wal_position(url).await;
                let w = floor.run(way, table, slice).await?;
                written[i].0.absorb(w);
                written[i].1.add(window.ticks(target.pid));
                written[i].2 += wal_since(wal_before, url).await;
            }
        }
        let floor_rows = floor.commit_rows();
        floor.finish().await;
        let cpu = CpuUse::of(&used, result.elapsed, tck);
        out.phases.push(LoadPhase {
            name,
            result,
            cpu,
            items: args.batch as u64,
            peak_rss_kb: memory.take_phase_peak(),
            bare: None,
            groups: Some(group_time),
            per_second: None,
            wal_bytes: url.map(|_| wal),
        });
        let figures = kinds
            .iter()
            .zip(written)
            .map(|(&(way, table), (written, ticks, wal))| FloorFigure {
                way,
                table,
                written,
                cpu: CpuUse::of(&ticks, written.elapsed, tck),
                wal_bytes: url.map(|_| wal),
            })
            .collect();
        out.floor = Some(FloorFigures { figures, connections, commit_rows: floor_rows });
    }
    Ok(out)
}

/// The sum of two windows' group readings.
fn add(a: WriteGroups, b: WriteGroups) -> WriteGroups {
    let mut phases = a.phases;
    for (p, q) in phases.iter_mut().zip(b.phases) {
        *p += q;
    }
    WriteGroups { groups: a.groups + b.groups, rows: a.rows + b.rows, seconds: a.seconds + b.seconds, phases }
}

/// One POST figure: warm-up, then `duration` measured, the server's groups
/// read around it; `watched`, second by second as well.
#[allow(clippy::too_many_arguments)]
async fn measure(
    args: &HttpArgs,
    target: &ServerTarget<'_>,
    memory: &MemoryWatch,
    name: String,
    request: Arc<Vec<Vec<u8>>>,
    items: u64,
    pace: Pace,
    watched: bool,
) -> anyhow::Result<LoadPhase> {
    let (addr, key) = (target.addr, target.key);
    eprintln!("combee-bench: {name}: {} s warm-up, {} s measured", args.warmup, args.duration);
    if args.warmup > 0 {
        load(addr, request.clone(), 201, args.connections, Duration::from_secs(args.warmup), pace).await?;
    }
    memory.take_phase_peak();
    let groups_before = WriteGroups::read(addr, key).await?;
    let watch = if watched { Some(Watch::start(target.postgres_url, addr, key, Instant::now()).await) } else { None };
    let wal_before = wal_position(target.postgres_url).await;
    let cpu = CpuWindow::start(target.pid);
    let result = load(addr, request, 201, args.connections, Duration::from_secs(args.duration), pace).await?;
    let cpu = cpu.finish(target.pid, result.elapsed, clock_ticks_per_sec());
    let wal_bytes = match wal_before {
        Some(_) => Some(wal_since(wal_before, target.postgres_url).await),
        None => None,
    };
    let per_second = match watch {
        Some(w) => Some(per_second(&result, &w.stop().await, args.store == BenchStore::Postgres)),
        None => None,
    };
    let groups = WriteGroups::read(addr, key).await?.since(groups_before);
    Ok(LoadPhase {
        name,
        result,
        cpu,
        items,
        peak_rss_kb: memory.take_phase_peak(),
        bare: None,
        groups: Some(groups),
        per_second,
        wal_bytes,
    })
}

/// WAL written since `before` (0 where there is no Postgres to ask).
async fn wal_since(before: Option<u64>, postgres: Option<&str>) -> u64 {
    match (before, wal_position(postgres).await) {
        (Some(b), Some(a)) => a.saturating_sub(b),
        _ => 0,
    }
}
