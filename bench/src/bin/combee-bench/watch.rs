//! Where a paced figure's tail comes from: while it runs, the server's write
//! groups are read every second from its `/metrics`, and Postgres (where it is
//! the store) is looked at ten times a second — is the checkpointer writing,
//! which autovacuum workers run and on what, what the busy backends wait on —
//! so the report can set each second's p99 beside what happened in it.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use sqlx::{PgPool, Row, postgres::PgPoolOptions};
use tokio::sync::Notify;

use crate::load::LoadResult;
use crate::model::WriteGroups;

/// What Postgres was doing at one look.
#[derive(Debug, Clone, Default)]
struct Look {
    at_ms: u32,
    /// The checkpointer was writing or flushing (not waiting for its next checkpoint).
    checkpointing: bool,
    /// Relations autovacuum workers were on.
    autovacuum: Vec<String>,
    /// Wait events of the client backends running a statement.
    waits: Vec<String>,
}

/// The looks and the server's groups, second by second, of one figure.
pub(crate) struct Watched {
    looks: Vec<Look>,
    /// The server's groups over each second (cumulative readings' differences).
    seconds: Vec<WriteGroups>,
}

/// Watches until [`Watch::stop`].
pub(crate) struct Watch {
    stop: Arc<Notify>,
    task: tokio::task::JoinHandle<Watched>,
}

impl Watch {
    /// Starts looking at `postgres` (none: SQLite) and the server at `addr`, from `start`.
    pub(crate) async fn start(postgres: Option<&str>, addr: SocketAddr, key: &str, start: Instant) -> Self {
        let pool = match postgres {
            Some(url) => PgPoolOptions::new().max_connections(1).connect(url).await.ok(),
            None => None,
        };
        let stop = Arc::new(Notify::new());
        let (stopped, key) = (stop.clone(), key.to_owned());
        let task = tokio::spawn(async move {
            let mut watched = Watched { looks: Vec::new(), seconds: Vec::new() };
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            let mut last = WriteGroups::read(addr, &key).await.unwrap_or_default();
            let mut n = 0u32;
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stopped.notified() => break,
                }
                if let Some(pool) = &pool
                    && let Some(mut look) = look(pool).await
                {
                    look.at_ms = start.elapsed().as_millis() as u32;
                    watched.looks.push(look);
                }
                n += 1;
                if n.is_multiple_of(10) {
                    let now = WriteGroups::read(addr, &key).await.unwrap_or(last);
                    watched.seconds.push(now.since(last));
                    last = now;
                }
            }
            if let Some(pool) = pool {
                pool.close().await;
            }
            watched
        });
        Self { stop, task }
    }

    pub(crate) async fn stop(self) -> Watched {
        self.stop.notify_one();
        self.task.await.unwrap_or(Watched { looks: Vec::new(), seconds: Vec::new() })
    }
}

/// Where Postgres's WAL is now, in bytes from its start (`None`: not Postgres, or unreachable).
pub(crate) async fn wal_position(postgres: Option<&str>) -> Option<u64> {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(postgres?).await.ok()?;
    let at: i64 =
        sqlx::query_scalar("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint").fetch_one(&mut conn).await.ok()?;
    let _ = sqlx::Connection::close(conn).await;
    u64::try_from(at).ok()
}

async fn look(pool: &PgPool) -> Option<Look> {
    let rows = sqlx::query(
        "SELECT backend_type, state, wait_event_type, wait_event, query FROM pg_stat_activity
         WHERE backend_type IN ('checkpointer', 'autovacuum worker')
            OR (backend_type = 'client backend' AND state = 'active' AND pid <> pg_backend_pid())",
    )
    .fetch_all(pool)
    .await
    .ok()?;
    let mut look = Look::default();
    for r in rows {
        let kind: String = r.try_get("backend_type").unwrap_or_default();
        let event: Option<String> = r.try_get("wait_event").ok().flatten();
        let event_type: Option<String> = r.try_get("wait_event_type").ok().flatten();
        match kind.as_str() {
            // Idle between checkpoints it waits on `CheckpointerMain`; anything else is a checkpoint's work.
            "checkpointer" => look.checkpointing = event.as_deref() != Some("CheckpointerMain"),
            "autovacuum worker" => {
                let query: String = r.try_get("query").unwrap_or_default();
                look.autovacuum.push(query.trim_start_matches("autovacuum: ").to_owned());
            }
            _ => look.waits.push(match (event_type, event) {
                (Some(t), Some(e)) => format!("{t}:{e}"),
                _ => "CPU".to_owned(),
            }),
        }
    }
    Some(look)
}

/// The per-second table of a paced figure: its latencies by when each request
/// was due, beside what the server's groups and Postgres did in that second.
pub(crate) fn per_second(result: &LoadResult, watched: &Watched, postgres: bool) -> String {
    let mut by_second: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for &(at_ms, latency) in &result.timeline {
        by_second.entry(at_ms / 1000).or_default().push(latency);
    }
    let mut o = String::from(
        "| second | requests | p50 ms | p99 ms | max ms | groups | rows a group | ms a group: begin, insert |",
    );
    if postgres {
        o.push_str(" checkpointer writing | autovacuum on | busy backends' waits (of all looks) |");
    }
    o.push('\n');
    o.push_str(if postgres {
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | --- |\n"
    } else {
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n"
    });
    for (second, mut latencies) in by_second {
        latencies.sort_unstable();
        let q = |p: f64| {
            let rank = ((latencies.len() as f64 * p).ceil() as usize).clamp(1, latencies.len());
            f64::from(latencies[rank - 1]) / 1000.0
        };
        let g = watched.seconds.get(second as usize).copied().unwrap_or_default();
        let per_group = |s: f64| 1000.0 * s / g.groups.max(1.0);
        o.push_str(&format!(
            "| {second} | {} | {:.1} | {:.1} | {:.1} | {:.0} | {:.1} | {:.2}, {:.2} |",
            latencies.len(),
            q(0.5),
            q(0.99),
            q(1.0),
            g.groups,
            g.rows / g.groups.max(1.0),
            per_group(g.phases[0]),
            per_group(g.phases[1]),
        ));
        if postgres {
            let looks: Vec<&Look> = watched.looks.iter().filter(|l| l.at_ms / 1000 == second).collect();
            let writing = looks.iter().filter(|l| l.checkpointing).count();
            let mut vacuumed: Vec<&str> = looks.iter().flat_map(|l| l.autovacuum.iter().map(String::as_str)).collect();
            vacuumed.sort_unstable();
            vacuumed.dedup();
            let mut waits: BTreeMap<&str, usize> = BTreeMap::new();
            for w in looks.iter().flat_map(|l| &l.waits) {
                *waits.entry(w.as_str()).or_default() += 1;
            }
            let mut waits: Vec<(&str, usize)> = waits.into_iter().collect();
            waits.sort_by_key(|w| std::cmp::Reverse(w.1));
            let waits: Vec<String> = waits.iter().take(3).map(|(w, n)| format!("{w} {n}")).collect();
            o.push_str(&format!(
                " {writing} of {} | {} | {} |",
                looks.len(),
                if vacuumed.is_empty() { "—".to_owned() } else { vacuumed.join("; ") },
                if waits.is_empty() { "—".to_owned() } else { waits.join(", ") },
            ));
        }
        o.push('\n');
    }
    o
}
