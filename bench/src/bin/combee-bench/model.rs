//! What the figures measure and the report reads: each figure's phase, the
//! store's write groups, the floor's figures and the run's facts. The runs
//! (`figures.rs`, `ingest.rs`, `watch.rs`) fill them in; `report.rs` renders
//! them; neither imports the other.

use std::net::SocketAddr;

use crate::HttpArgs;
use crate::client::{encode_request, request_once};
use crate::database::BenchDatabase;
use crate::floor::{Table, Way, Written};
use crate::load::LoadResult;
use crate::processes::CpuUse;

/// Slices each GET figure and its bare pair are measured in, alternately.
pub(crate) const GET_SLICES: u32 = 4;

/// Slices the batched figure and each floor figure are measured in, alternately.
pub(crate) const FLOOR_SLICES: u32 = 4;

/// One figure as measured: its load, its CPU, its memory and what the store did.
pub(crate) struct LoadPhase {
    pub(crate) name: String,
    pub(crate) result: LoadResult,
    pub(crate) cpu: CpuUse,
    /// Traces per request (1 for GETs and single POSTs).
    pub(crate) items: u64,
    pub(crate) peak_rss_kb: u64,
    /// The bare server's figure, measured in the slices between this one's (GETs).
    pub(crate) bare: Option<Box<LoadPhase>>,
    /// The trace writes' groups over the measured window (POSTs).
    pub(crate) groups: Option<WriteGroups>,
    /// Second by second, with what the server and the store did (a paced figure; see `watch.rs`).
    pub(crate) per_second: Option<String>,
    /// Bytes of WAL Postgres wrote over the measured window (POSTs on Postgres).
    pub(crate) wal_bytes: Option<u64>,
}

/// What the server's `/metrics` says of its trace-write groups, summed since it started.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct WriteGroups {
    pub(crate) groups: f64,
    pub(crate) rows: f64,
    pub(crate) seconds: f64,
    /// Seconds of each phase of a group's commit, as [`PHASES`] names them.
    pub(crate) phases: [f64; PHASES.len()],
}

/// The phases of a group's commit that the server times (on Postgres only `begin` and `insert`).
pub(crate) const PHASES: [&str; 5] = ["begin", "insert", "other", "rollups", "commit"];

impl WriteGroups {
    pub(crate) async fn read(addr: SocketAddr, key: &str) -> anyhow::Result<Self> {
        let (status, body) = request_once(addr, &encode_request("GET", "/metrics", addr, key, None)).await?;
        anyhow::ensure!(status == 200, "GET /metrics answered {status}");
        let text = String::from_utf8_lossy(&body);
        let value = |name: &str| {
            text.lines()
                .find_map(|l| {
                    l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse().ok())
                })
                .unwrap_or(0.0)
        };
        Ok(Self {
            groups: value("combee_store_write_group_rows_count"),
            rows: value("combee_store_write_group_rows_sum"),
            seconds: value("combee_store_write_group_seconds_sum"),
            phases: PHASES.map(|p| value(&format!("combee_store_write_phase_seconds_sum{{phase=\"{p}\"}}"))),
        })
    }

    pub(crate) fn since(self, before: Self) -> Self {
        let mut phases = self.phases;
        for (p, b) in phases.iter_mut().zip(before.phases) {
            *p -= b;
        }
        Self {
            groups: self.groups - before.groups,
            rows: self.rows - before.rows,
            seconds: self.seconds - before.seconds,
            phases,
        }
    }
}

/// One floor figure, beside the batched one.
pub(crate) struct FloorFigure {
    pub(crate) way: Way,
    pub(crate) table: Table,
    pub(crate) written: Written,
    pub(crate) cpu: CpuUse,
    /// Bytes of WAL written (Postgres).
    pub(crate) wal_bytes: Option<u64>,
}

/// The floor's figures and how they were written.
pub(crate) struct FloorFigures {
    pub(crate) figures: Vec<FloorFigure>,
    /// Connections writing (Postgres: the server's pool size; SQLite: one).
    pub(crate) connections: usize,
    /// Rows a transaction.
    pub(crate) commit_rows: usize,
}

/// The run's facts besides its phases, for the report.
pub(crate) struct Facts<'a> {
    pub(crate) args: HttpArgs,
    pub(crate) loadavg: String,
    pub(crate) database: Option<&'a BenchDatabase>,
    pub(crate) idle_rss_kb: u64,
    pub(crate) peak_rss_kb: u64,
    pub(crate) hwm_kb: u64,
    pub(crate) samples: u64,
    pub(crate) prompt_body_bytes: usize,
    /// Response headers the bare server sends besides `content-length` and `date` (0: not run).
    pub(crate) bare_headers: usize,
    /// The memory figure: (prompts, subjects, RSS after, in kB, VmHWM in kB).
    pub(crate) memory_probe: Option<(usize, usize, u64, u64)>,
    /// The store alone with the same rows, beside the batched figure.
    pub(crate) floor: Option<FloorFigures>,
    /// The paced figure's offered rate, and whether it is a share of the capacity measured.
    pub(crate) paced: Option<(f64, bool)>,
}

/// A count with thousands separators: 12345 -> "12,345".
pub(crate) fn thousands(v: f64) -> String {
    let n = v.round() as u64;
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
