//! The processes of a run: spawn the servers and kill them on every way out,
//! a scratch directory, and the memory and CPU each side used (from /proc).

use std::{
    net::SocketAddr,
    path::PathBuf,
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use tokio::process::{Child, Command};

use crate::client::request_once;

/// A child process killed when dropped (normal return, error, panic or ctrl-c).
pub(crate) struct ChildGuard {
    child: Child,
    pub(crate) pid: u32,
    log: PathBuf,
}

impl ChildGuard {
    pub(crate) fn spawn(mut cmd: Command, log: PathBuf) -> anyhow::Result<Self> {
        let log_file = std::fs::File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::from(log_file)).kill_on_drop(true);
        let child = cmd.spawn().with_context(|| format!("cannot start {:?}", cmd.as_std().get_program()))?;
        let pid = child.id().context("the child exited at once")?;
        Ok(Self { child, pid, log })
    }

    pub(crate) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }

    /// Polls `path` until it answers 200, failing if the child exits.
    pub(crate) async fn wait_ready(&mut self, addr: SocketAddr, path: &str) -> anyhow::Result<()> {
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").into_bytes();
        let give_up = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("the child exited ({status}) before it was ready:\n{}", self.log_tail());
            }
            if let Ok((200, _)) = request_once(addr, &request).await {
                return Ok(());
            }
            if Instant::now() > give_up {
                bail!("{addr}{path} was not ready within 60 s:\n{}", self.log_tail());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub(crate) async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// A scratch directory removed when dropped.
pub(crate) struct ScratchDir(pub(crate) PathBuf);

impl ScratchDir {
    pub(crate) fn new() -> anyhow::Result<Self> {
        let dir =
            std::env::temp_dir().join(format!("combee-bench-{}-{:08x}", std::process::id(), rand::random::<u32>()));
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        Ok(Self(dir))
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub(crate) fn free_port() -> anyhow::Result<SocketAddr> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("cannot find a free port")?;
    Ok(l.local_addr()?)
}

/// `VmRSS` and `VmHWM` of a process, in kB.
pub(crate) fn memory_kb(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// Samples a process's memory every 100 ms until dropped.
pub(crate) struct MemoryWatch {
    pub(crate) peak_rss_kb: Arc<AtomicU64>,
    phase_peak_kb: Arc<AtomicU64>,
    pub(crate) hwm_kb: Arc<AtomicU64>,
    pub(crate) samples: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl MemoryWatch {
    pub(crate) fn start(pid: u32) -> Self {
        let peak_rss_kb = Arc::new(AtomicU64::new(0));
        let phase_peak_kb = Arc::new(AtomicU64::new(0));
        let hwm_kb = Arc::new(AtomicU64::new(0));
        let samples = Arc::new(AtomicU64::new(0));
        let (p, ph, h, s) = (peak_rss_kb.clone(), phase_peak_kb.clone(), hwm_kb.clone(), samples.clone());
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tick.tick().await;
                if let Some((rss, hwm)) = memory_kb(pid) {
                    p.fetch_max(rss, Ordering::Relaxed);
                    ph.fetch_max(rss, Ordering::Relaxed);
                    h.fetch_max(hwm, Ordering::Relaxed);
                    s.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        Self { peak_rss_kb, phase_peak_kb, hwm_kb, samples, task }
    }

    /// The highest sampled RSS since the last call.
    pub(crate) fn take_phase_peak(&self) -> u64 {
        self.phase_peak_kb.swap(0, Ordering::Relaxed)
    }
}

impl Drop for MemoryWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// CPU time of a process (user + system), in clock ticks.
fn process_ticks(pid: &str) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0 };
    // Fields after the parenthesised command name: state is index 0, utime 11, stime 12.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let f: Vec<&str> = after.split_whitespace().collect();
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

/// CPU time of every process named `postgres` (the server and its backends,
/// checkpointer, WAL writer, autovacuum), in clock ticks; 0 where none runs here.
/// A backend that exits within a window takes its ticks with it, so this
/// undercounts short-lived ones; the bench's connections live for the run.
pub(crate) fn postgres_ticks() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0 };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str().filter(|n| n.bytes().all(|b| b.is_ascii_digit())).map(str::to_owned))
        .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "postgres"))
        .map(|pid| process_ticks(&pid))
        .sum()
}

/// Whole-machine (busy, total) ticks from the first line of /proc/stat.
fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let nums: Vec<u64> =
        stat.lines().next().unwrap_or_default().split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect();
    let total: u64 = nums.iter().take(8).sum();
    let idle = nums.get(3).copied().unwrap_or(0) + nums.get(4).copied().unwrap_or(0);
    (total.saturating_sub(idle), total)
}

pub(crate) fn clock_ticks_per_sec() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// CPU used during one measured window, as a share of one core (100 % = one core busy).
#[derive(Clone, Default)]
pub(crate) struct CpuWindow {
    pub(crate) server: u64,
    pub(crate) client: u64,
    /// Every `postgres` process's ([`postgres_ticks`]).
    pub(crate) store: u64,
    pub(crate) machine: (u64, u64),
}

impl CpuWindow {
    /// Adds another window's ticks (from [`CpuWindow::ticks`]).
    pub(crate) fn add(&mut self, other: CpuWindow) {
        self.server += other.server;
        self.client += other.client;
        self.store += other.store;
        self.machine.0 += other.machine.0;
        self.machine.1 += other.machine.1;
    }

    pub(crate) fn start(server_pid: u32) -> Self {
        Self {
            server: process_ticks(&server_pid.to_string()),
            client: process_ticks("self"),
            store: postgres_ticks(),
            machine: machine_ticks(),
        }
    }

    /// The ticks used since [`CpuWindow::start`] (server, client, machine busy, machine total).
    pub(crate) fn ticks(self, server_pid: u32) -> CpuWindow {
        let (busy, total) = machine_ticks();
        CpuWindow {
            server: process_ticks(&server_pid.to_string()) - self.server,
            client: process_ticks("self") - self.client,
            store: postgres_ticks().saturating_sub(self.store),
            machine: (busy - self.machine.0, total - self.machine.1),
        }
    }

    pub(crate) fn finish(self, server_pid: u32, elapsed: Duration, tck: f64) -> CpuUse {
        CpuUse::of(&self.ticks(server_pid), elapsed, tck)
    }
}

impl CpuUse {
    /// Shares of one core from the ticks used over `elapsed`.
    pub(crate) fn of(used: &CpuWindow, elapsed: Duration, tck: f64) -> Self {
        let secs = elapsed.as_secs_f64() * tck / 100.0;
        CpuUse {
            server_pct: used.server as f64 / secs,
            client_pct: used.client as f64 / secs,
            store_pct: used.store as f64 / secs,
            machine_busy_pct: 100.0 * used.machine.0 as f64 / used.machine.1.max(1) as f64,
        }
    }
}

pub(crate) struct CpuUse {
    pub(crate) server_pct: f64,
    pub(crate) client_pct: f64,
    /// Postgres's processes (0 on SQLite, which runs inside the server).
    pub(crate) store_pct: f64,
    pub(crate) machine_busy_pct: f64,
}
