//! What one period of the live phase records: latencies and errors per kind
//! of request, the rater's and Postgres's figures, and the Prometheus counters
//! they are read from.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Instant,
};

use sqlx::PgConnection;

use crate::insight;
use crate::processes::CpuSecs;

/// Latencies (µs) and errors of one kind of request in one period.
#[derive(Default)]
pub(crate) struct Samples {
    pub(crate) us: Vec<u32>,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<String>,
}

impl Samples {
    pub(crate) fn quantile_ms(&self, q: f64) -> f64 {
        if self.us.is_empty() {
            return f64::NAN;
        }
        let mut v = self.us.clone();
        v.sort_unstable();
        let rank = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len());
        f64::from(v[rank - 1]) / 1000.0
    }
}

pub(crate) const KINDS: [&str; 5] = ["GET prompt", "POST trace", "OTLP export", "late feedback", "GET metrics"];

pub(crate) struct Period {
    /// The warm-up (printed, left out of the ratios).
    pub(crate) warmup: bool,
    pub(crate) samples: BTreeMap<&'static str, Samples>,
    pub(crate) sizes: BTreeMap<String, i64>,
    pub(crate) rss_kb: u64,
    /// Rater ticks: their summed seconds and count.
    pub(crate) rater: (f64, f64),
    /// Of the ticks' seconds, those waiting on the crossover's LLM call.
    pub(crate) rater_llm: f64,
    /// The store work of the rated windows (reading the window, saving the ratings), and how many windows.
    pub(crate) rater_windows: (f64, f64),
    /// Of that work, reading the windows and saving the ratings, apart.
    pub(crate) rater_read_save: (f64, f64),
    /// Live arms per `evaluated` population at the period's end.
    pub(crate) live_arms: f64,
    /// Postgres's own upkeep in the period: autovacuum runs, dead rows at its end, checkpoints.
    pub(crate) upkeep: Upkeep,
    /// CPU seconds each process used in the period, and the period's length in seconds.
    pub(crate) cpu: CpuSecs,
    /// Inside Postgres: CPU per kind of process, its backends' waits.
    pub(crate) inside: insight::Sampled,
    /// The statements Postgres ran in the period, by query id (empty without `pg_stat_statements`).
    pub(crate) statements: BTreeMap<i64, insight::Statement>,
    pub(crate) secs: f64,
    pub(crate) rounds: Vec<f64>,
    pub(crate) deleted: f64,
    pub(crate) traces: i64,
}

/// Tables whose upkeep the report follows: the biggest, and the rollups the rater and metrics read.
pub(crate) const UPKEEP_TABLES: [&str; 3] = ["traces", "outcome_rollups", "task_rollups"];

/// Postgres's background work, as counters to difference between periods.
#[derive(Default, Clone)]
pub(crate) struct Upkeep {
    /// Per table of [`UPKEEP_TABLES`]: autovacuum runs, dead rows now.
    pub(crate) tables: BTreeMap<String, (i64, i64)>,
    pub(crate) checkpoints: i64,
}

impl Upkeep {
    pub(crate) async fn read(db: &mut PgConnection) -> anyhow::Result<Self> {
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
    pub(crate) fn since(&self, before: &Self) -> Self {
        let tables = self
            .tables
            .iter()
            .map(|(t, (runs, dead))| (t.clone(), (runs - before.tables.get(t).map_or(0, |b| b.0), *dead)))
            .collect();
        Self { tables, checkpoints: self.checkpoints - before.checkpoints }
    }
}

pub(crate) struct Live {
    pub(crate) periods: Vec<Period>,
    pub(crate) runs: u64,
}

pub(crate) type Recorder = Arc<Mutex<BTreeMap<&'static str, Samples>>>;

pub(crate) fn record(r: &Recorder, kind: &'static str, t0: Instant, outcome: Result<u16, String>, ok: u16) {
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
pub(crate) fn summary(scrape: &str, name: &str) -> (f64, f64) {
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
pub(crate) fn labelled_sum(scrape: &str, name: &str, label: &str) -> f64 {
    let prefix = format!("{name}_sum{{{label}}}");
    scrape.lines().filter(|l| l.starts_with(&prefix)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

pub(crate) fn counter(scrape: &str, name: &str) -> f64 {
    scrape.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}
