//! What Postgres spent its time on in each period of the soak, so a figure
//! that drifts can be traced to a cause: CPU per kind of Postgres process and
//! the wait events of its active backends (both sampled every second), and the
//! statements that took the most execution time (from `pg_stat_statements`,
//! when the server preloads it, as `scripts/bench-soak`'s private Postgres does).

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
    time::Duration,
};

use sqlx::{Connection, PgConnection};

/// What the sampler saw since it was last taken.
#[derive(Debug, Default)]
pub struct Sampled {
    /// CPU seconds per kind of Postgres process (see [`kind`]).
    pub cpu: BTreeMap<&'static str, f64>,
    /// Per wait ("type: event", or "on CPU"), how many active backends were in it, summed over samples.
    pub waits: BTreeMap<String, u64>,
    /// Samples taken.
    pub samples: u64,
}

/// The kind of Postgres process a command line names.
fn kind(cmdline: &str) -> &'static str {
    let Some(title) = cmdline.strip_prefix("postgres: ") else { return "other" };
    if title.starts_with("autovacuum worker") {
        "autovacuum"
    } else if ["checkpointer", "background writer", "walwriter"].iter().any(|w| title.starts_with(w)) {
        "writers"
    } else if title.contains('(') {
        // "user database host(port) state": a client's backend.
        "backends"
    } else {
        "other"
    }
}

/// The kinds in the order the report prints them ("other": the postmaster,
/// the autovacuum launcher, the stats and replication launchers).
pub const KINDS: [&str; 4] = ["backends", "autovacuum", "writers", "other"];

/// Samples Postgres's processes and activity every second in the background.
pub struct Sampler {
    shared: Arc<Mutex<Sampled>>,
    task: tokio::task::JoinHandle<()>,
}

impl Sampler {
    pub async fn start(url: &str) -> anyhow::Result<Self> {
        let mut db = PgConnection::connect(url).await?;
        let shared = Arc::new(Mutex::new(Sampled::default()));
        let out = shared.clone();
        let task = tokio::spawn(async move {
            let mut seen: HashMap<u32, f64> = HashMap::new();
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                let cpu = sample_cpu(&mut seen);
                let waits: Vec<(String, i64)> = sqlx::query_as(
                    "SELECT coalesce(wait_event_type || ': ' || wait_event, 'on CPU'), count(*) FROM pg_stat_activity
                     WHERE state = 'active' AND pid <> pg_backend_pid() AND backend_type = 'client backend'
                     GROUP BY 1",
                )
                .fetch_all(&mut db)
                .await
                .unwrap_or_default();
                let mut s = out.lock().unwrap_or_else(|e| e.into_inner());
                for (k, c) in cpu {
                    *s.cpu.entry(k).or_default() += c;
                }
                for (w, n) in waits {
                    *s.waits.entry(w).or_default() += n as u64;
                }
                s.samples += 1;
            }
        });
        Ok(Self { shared, task })
    }

    /// What was sampled since the last take.
    pub fn take(&self) -> Sampled {
        std::mem::take(&mut *self.shared.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// CPU used since the last sample by each kind of Postgres process (a
/// process first seen counts all its time; one that exited between samples
/// loses at most its last second).
fn sample_cpu(seen: &mut HashMap<u32, f64>) -> BTreeMap<&'static str, f64> {
    let mut out = BTreeMap::new();
    let mut now = HashMap::new();
    for pid in std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
    {
        if !std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "postgres") {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let secs = own_cpu_secs(pid);
        *out.entry(kind(cmdline.trim())).or_default() += secs - seen.get(&pid).copied().unwrap_or(0.0);
        now.insert(pid, secs);
    }
    *seen = now;
    out
}

/// A process's own CPU seconds (utime + stime, not its reaped children's).
fn own_cpu_secs(pid: u32) -> f64 {
    crate::processes::stat_cpu_secs(pid, 2)
}

/// One statement's execution in a period, from `pg_stat_statements`.
#[derive(Debug, Clone)]
pub struct Statement {
    pub text: String,
    pub calls: i64,
    pub total_ms: f64,
    /// Shared blocks found in the buffer cache and read from outside it.
    pub hit: i64,
    pub read: i64,
}

/// `pg_stat_statements` in the soak's database, when the server has it.
pub struct Statements {
    available: bool,
}

impl Statements {
    /// Creates the extension in the database (a superuser's connection).
    pub async fn enable(db: &mut PgConnection) -> Self {
        let available =
            sqlx::raw_sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").execute(&mut *db).await.is_ok()
                && sqlx::query("SELECT 1 FROM pg_stat_statements LIMIT 1").fetch_optional(&mut *db).await.is_ok();
        Self { available }
    }

    /// Starts counting afresh.
    pub async fn reset(&self, db: &mut PgConnection) {
        if self.available {
            let _ = sqlx::query("SELECT pg_stat_statements_reset()").execute(&mut *db).await;
        }
    }

    /// This database's statements since the last reset, by query id.
    pub async fn read(&self, db: &mut PgConnection) -> BTreeMap<i64, Statement> {
        if !self.available {
            return BTreeMap::new();
        }
        let rows: Vec<(i64, String, i64, f64, i64, i64)> = sqlx::query_as(
            "SELECT queryid, query, calls, total_exec_time, shared_blks_hit, shared_blks_read FROM pg_stat_statements
             WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) AND queryid IS NOT NULL",
        )
        .fetch_all(&mut *db)
        .await
        .unwrap_or_default();
        rows.into_iter()
            .map(|(id, text, calls, total_ms, hit, read)| (id, Statement { text, calls, total_ms, hit, read }))
            .collect()
    }
}

/// A statement's text on one line, at most `max` characters, safe in a Markdown table cell.
pub fn one_line(text: &str, max: usize) -> String {
    let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut cut: String = flat.chars().take(max).collect();
    if flat.chars().count() > max {
        cut.push('…');
    }
    cut.replace('|', "\\|")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_kinds_come_from_their_titles() {
        assert_eq!(kind("postgres: autovacuum worker soak_1"), "autovacuum");
        assert_eq!(kind("postgres: checkpointer"), "writers");
        assert_eq!(kind("postgres: walwriter"), "writers");
        assert_eq!(kind("postgres: postgres soak_1 127.0.0.1(5432) idle"), "backends");
        assert_eq!(kind("postgres: autovacuum launcher"), "other");
        assert_eq!(kind("/usr/lib/postgresql/15/bin/postgres -D /tmp/x"), "other");
    }

    #[test]
    fn statements_fit_a_table_cell() {
        assert_eq!(one_line("SELECT a\n   || b FROM t", 100), "SELECT a \\|\\| b FROM t");
        assert_eq!(one_line("SELECT 1234", 6), "SELECT…");
    }
}
