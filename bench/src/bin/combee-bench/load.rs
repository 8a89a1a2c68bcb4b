//! Load: N keep-alive connections sending requests back to back or on a
//! fixed schedule (one request, or a rotation of them), and what they saw.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context;

use crate::client::HttpConn;

#[derive(Debug, Default)]
pub(crate) struct LoadResult {
    pub(crate) ok: u64,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<String>,
    pub(crate) elapsed: Duration,
    /// Latencies of successful requests, in microseconds, sorted.
    pub(crate) latencies_us: Vec<u32>,
    /// Every successful request as (when it was due, in ms from the window's
    /// start; its latency in µs), in no particular order: where in the window
    /// the slow ones were.
    pub(crate) timeline: Vec<(u32, u32)>,
}

impl LoadResult {
    /// Adds another window's requests (a later slice of the same figure).
    pub(crate) fn absorb(&mut self, other: LoadResult) {
        self.ok += other.ok;
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
        self.elapsed += other.elapsed;
        self.latencies_us.extend(other.latencies_us);
        self.latencies_us.sort_unstable();
        self.timeline.extend(other.timeline);
    }

    pub(crate) fn per_sec(&self) -> f64 {
        self.ok as f64 / self.elapsed.as_secs_f64()
    }

    pub(crate) fn quantile_ms(&self, q: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return f64::NAN;
        }
        let rank = ((self.latencies_us.len() as f64 * q).ceil() as usize).clamp(1, self.latencies_us.len());
        f64::from(self.latencies_us[rank - 1]) / 1000.0
    }
}

/// How the connections send.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Pace {
    /// Each connection sends its next request as soon as the last is answered (closed loop).
    Flat,
    /// The connections together send this many requests per second on a fixed schedule; a
    /// latency counts from the scheduled time, so a slow answer also charges the requests
    /// that waited behind it (no coordinated omission).
    Rate(f64),
}

pub(crate) async fn load(
    addr: SocketAddr,
    requests: Arc<Vec<Vec<u8>>>,
    expect: u16,
    connections: usize,
    duration: Duration,
    pace: Pace,
) -> anyhow::Result<LoadResult> {
    // Connect first so the measured window holds requests only.
    let mut conns = Vec::with_capacity(connections);
    for _ in 0..connections {
        conns.push(HttpConn::connect(addr).await.with_context(|| format!("cannot connect to {addr}"))?);
    }
    let start = Instant::now();
    let deadline = start + duration;
    let mut workers = tokio::task::JoinSet::new();
    for (k, mut conn) in conns.into_iter().enumerate() {
        let requests = requests.clone();
        workers.spawn(async move {
            // Connection k sends requests k, k + connections, … of the rotation.
            let mut turn = k;
            let mut r = LoadResult { latencies_us: Vec::with_capacity(32 * 1024), ..LoadResult::default() };
            // For a paced load, connection k sends at start + k/rate + i·connections/rate.
            let (mut next, interval) = match pace {
                Pace::Flat => (start, Duration::ZERO),
                Pace::Rate(rate) => (
                    start + Duration::from_secs_f64(k as f64 / rate),
                    Duration::from_secs_f64(connections as f64 / rate),
                ),
            };
            while next < deadline && Instant::now() < deadline {
                let t0 = match pace {
                    Pace::Flat => Instant::now(),
                    Pace::Rate(_) => {
                        tokio::time::sleep_until(next.into()).await;
                        let scheduled = next;
                        next += interval;
                        scheduled
                    }
                };
                let request = &requests[turn % requests.len()];
                turn += connections;
                match conn.roundtrip(request).await {
                    Ok(a) if a.status == expect => {
                        r.ok += 1;
                        let latency = t0.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
                        r.latencies_us.push(latency);
                        r.timeline.push((t0.duration_since(start).as_millis() as u32, latency));
                    }
                    Ok(a) => {
                        r.errors += 1;
                        r.first_error.get_or_insert_with(|| {
                            format!("HTTP {}: {}", a.status, String::from_utf8_lossy(conn.body(&a)))
                        });
                    }
                    Err(e) => {
                        r.errors += 1;
                        r.first_error.get_or_insert_with(|| e.to_string());
                        match HttpConn::connect(addr).await {
                            Ok(c) => conn = c,
                            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                        }
                    }
                }
            }
            r
        });
    }
    let mut total = LoadResult::default();
    while let Some(joined) = workers.join_next().await {
        let r = joined.context("a load worker failed")?;
        total.ok += r.ok;
        total.errors += r.errors;
        if total.first_error.is_none() {
            total.first_error = r.first_error;
        }
        total.latencies_us.extend(r.latencies_us);
        total.timeline.extend(r.timeline);
    }
    // In-flight requests at the deadline are finished and counted, so the
    // window runs until the last of them.
    total.elapsed = start.elapsed();
    total.latencies_us.sort_unstable();
    Ok(total)
}

/// Sends every request once over `connections` keep-alive connections; fails on any other status.
pub(crate) async fn run_each_once(
    addr: SocketAddr,
    requests: Vec<Vec<u8>>,
    expect: u16,
    connections: usize,
) -> anyhow::Result<()> {
    let requests = Arc::new(requests);
    let next = Arc::new(AtomicU64::new(0));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..connections.max(1) {
        let (requests, next) = (requests.clone(), next.clone());
        workers.spawn(async move {
            let mut conn = HttpConn::connect(addr).await?;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(request) = requests.get(i) else { return anyhow::Ok(()) };
                let answer = conn.roundtrip(request).await?;
                anyhow::ensure!(
                    answer.status == expect,
                    "request {i} answered {}: {}",
                    answer.status,
                    String::from_utf8_lossy(conn.body(&answer))
                );
            }
        });
    }
    while let Some(joined) = workers.join_next().await {
        joined??;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_nearest_rank() {
        let r = LoadResult { latencies_us: (1..=100).map(|v| v * 1000).collect(), ..LoadResult::default() };
        assert_eq!(r.quantile_ms(0.5), 50.0);
        assert_eq!(r.quantile_ms(0.99), 99.0);
    }
}
