//! `combee serve` processes of a real binary — this tree's, or an earlier
//! release's with its own configuration — on one database, for the tests that
//! run several processes: start one, wait until it is ready, stop it as an
//! operator does (SIGTERM) or as a crash does (kill -9).

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::Duration,
};

use super::eventually;

/// A child process, killed (kill -9) on drop unless it has exited.
pub struct Process(pub Child);

impl Process {
    /// Stops the process as an operator or an orchestrator does: SIGTERM, after
    /// which it lets in-flight requests finish; waits for it to exit.
    pub fn terminate(&mut self) -> ExitStatus {
        let pid = self.0.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status().expect("run kill");
        assert!(sent.success(), "SIGTERM to process {pid}");
        self.0.wait().expect("wait for the process")
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A loopback port nobody listens on (yet).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A `combee` binary and the configuration directory it reads.
#[derive(Debug, Clone)]
pub struct Build {
    pub bin: PathBuf,
    pub config: PathBuf,
}

impl Build {
    /// This tree's binary (cargo builds it for the tests) and its `config/`.
    pub fn this() -> Self {
        Self {
            bin: PathBuf::from(env!("CARGO_BIN_EXE_combee")),
            config: PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/config")),
        }
    }

    /// `combee serve --role <role>` on `db`, listening on `port`, with its own
    /// data directory and quiet logs; more settings with `.env(…)` before `.spawn()`.
    pub fn serve(&self, role: &str, port: u16, db: &str, data: &Path) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.args(["serve", "--role", role, "--bind", &format!("127.0.0.1:{port}")])
            .env("DATABASE_URL", db)
            .env("COMBEE_CONFIG_DIR", &self.config)
            .env("COMBEE__DATABASE__DATA_DIR", data)
            .env("COMBEE__LOG__LEVEL", "warn")
            .stdout(Stdio::null());
        cmd
    }
}

/// Waits for the process at `base` to answer `/readyz` with 200.
pub async fn ready(http: &reqwest::Client, base: &str) {
    eventually(&format!("{base} ready"), Duration::from_secs(30), async || {
        match http.get(format!("{base}/readyz")).send().await {
            Ok(r) if r.status() == 200 => Ok(()),
            Ok(r) => Err(r.status().to_string()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await
}

/// The local TCP ports of the sockets process `pid` holds open (Linux: its
/// descriptors' socket inodes, looked up in /proc/net/tcp and tcp6): the ports
/// its database sessions come from, as `pg_stat_activity.client_port` shows.
pub fn tcp_ports_of(pid: u32) -> Vec<u16> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the process's descriptors")
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            Some(target.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect();
    let mut ports = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        for line in std::fs::read_to_string(table).unwrap_or_default().lines().skip(1) {
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(inode)) = (fields.get(1), fields.get(9)) else { continue };
            if inodes.contains(*inode)
                && let Some(port) = local.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok())
            {
                ports.push(port);
            }
        }
    }
    ports
}

/// Waits until Postgres holds no session that came from `ports` (taken with
/// [`tcp_ports_of`] before a kill -9): once a dead client's backends have
/// exited, whatever it had sent has committed or rolled back.
pub async fn sessions_ended(db: &str, ports: &[u16]) {
    use sqlx::Connection;
    let mut c = sqlx::PgConnection::connect(db).await.expect("connect to the database");
    let ports: Vec<i32> = ports.iter().map(|&p| i32::from(p)).collect();
    eventually("the killed process's database sessions to end", Duration::from_secs(30), async || {
        let live: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE client_port = ANY($1)")
            .bind(&ports)
            .fetch_one(&mut c)
            .await
            .map_err(|e| e.to_string())?;
        if live == 0 { Ok(()) } else { Err(format!("{live} sessions left")) }
    })
    .await;
}
