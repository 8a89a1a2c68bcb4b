//! A throw-away PostgreSQL server in a temp dir, for the tests that restart
//! or crash their database (the shared test server must not be restarted
//! under the other tests).

use std::{path::PathBuf, process::Command};

/// A private PostgreSQL server in a temp dir, stopped and removed on drop.
pub struct PrivatePostgres {
    dir: tempfile::TempDir,
    port: u16,
}

fn pg_bin(name: &str) -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(name))
        .find(|p| p.exists());
    on_path.unwrap_or_else(|| {
        let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL is installed")
            .filter_map(|e| e.ok().map(|e| e.path().join("bin").join(name)))
            .filter(|p| p.exists())
            .collect();
        found.sort();
        found.pop().unwrap_or_else(|| panic!("PostgreSQL's {name} was not found"))
    })
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| o.stdout.starts_with(b"0\n")).unwrap_or(false)
}

/// Runs a PostgreSQL program as the `postgres` user when we are root (it refuses to run as root).
fn pg_command(name: &str) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(pg_bin(name));
        c
    } else {
        Command::new(pg_bin(name))
    }
}

pub fn run(mut c: Command, what: &str) {
    let out = c.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl PrivatePostgres {
    pub fn start() -> Self {
        let dir = tempfile::Builder::new().prefix("combee-pg-private").tempdir().expect("temp dir");
        if is_root() {
            run(
                {
                    let mut c = Command::new("chown");
                    c.arg("postgres").arg(dir.path());
                    c
                },
                "chown",
            );
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut initdb = pg_command("initdb");
        initdb.arg("-D").arg(dir.path().join("data")).args(["-U", "postgres", "--auth=trust", "-E", "UTF8"]);
        run(initdb, "initdb");
        let pg = Self { dir, port };
        run(pg.ctl("start"), "pg_ctl start");
        pg
    }

    pub fn ctl(&self, action: &str) -> Command {
        let mut c = pg_command("pg_ctl");
        c.arg("-D").arg(self.dir.path().join("data")).arg("-l").arg(self.dir.path().join("server.log"));
        c.args(["-w", "-t", "60", "-m", "fast", "-o"]);
        c.arg(format!("-p {} -k {} -c listen_addresses=127.0.0.1", self.port, self.dir.path().display()));
        c.arg(action);
        c
    }

    /// Stops the server as a crash would (`-m immediate`: no checkpoint, the
    /// next start recovers from the WAL) and starts it again at once.
    pub fn crash_restart(&self) {
        let mut stop = pg_command("pg_ctl");
        stop.arg("-D").arg(self.dir.path().join("data")).args(["-m", "immediate", "-w", "stop"]);
        run(stop, "pg_ctl stop -m immediate");
        run(self.ctl("start"), "pg_ctl start");
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let mut stop = pg_command("pg_ctl");
        stop.arg("-D").arg(self.dir.path().join("data")).args(["-m", "immediate", "-w", "stop"]);
        let _ = stop.output();
    }
}
