//! The processes of the soak: the server (started, awaited, stopped) and what
//! each process sharing the machine used, its RSS and CPU seconds (from /proc).

use std::{net::SocketAddr, path::Path, process::Stdio, time::Duration};

use anyhow::Context;
use tokio::process::{Child, Command};

pub(crate) struct Server {
    child: Child,
    pub(crate) pid: u32,
    pub(crate) addr: SocketAddr,
}

impl Server {
    pub(crate) async fn start(
        bin: &Path,
        envs: &[(&str, String)],
        args: &[&str],
        log_path: &Path,
    ) -> anyhow::Result<Self> {
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

    pub(crate) async fn wait_ready(&self, path: &str) -> anyhow::Result<()> {
        let http = reqwest::Client::new();
        for _ in 0..600 {
            if http.get(format!("http://{}{path}", self.addr)).send().await.is_ok_and(|r| r.status().is_success()) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::bail!("{} did not answer {path} within a minute", self.addr)
    }

    pub(crate) async fn stop(mut self) {
        let _ = std::process::Command::new("kill").arg("-TERM").arg(self.pid.to_string()).status();
        if tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await.is_err() {
            let _ = self.child.kill().await;
        }
    }
}

pub(crate) fn free_port() -> anyhow::Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

pub(crate) fn rss_kb(pid: u32) -> u64 {
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
pub(crate) struct CpuSecs {
    pub(crate) server: f64,
    pub(crate) sim: f64,
    pub(crate) postgres: f64,
    pub(crate) load: f64,
}

impl CpuSecs {
    pub(crate) fn read(server: u32, sim: u32) -> Self {
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

    pub(crate) fn since(&self, before: &Self) -> Self {
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
pub(crate) fn stat_cpu_secs(pid: u32, fields: usize) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces): state is the first, utime the 12th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let ticks: f64 = rest.split_whitespace().skip(11).take(fields).filter_map(|v| v.parse::<f64>().ok()).sum();
    ticks / clock_ticks()
}
