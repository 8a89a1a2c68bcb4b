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
