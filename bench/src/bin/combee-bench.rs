//! `combee-bench`: the foundation benchmark. It starts the real server as a
//! child process on a fresh database, loads it over keep-alive HTTP/1.1 for a
//! fixed time per figure, and prints a Markdown report with targets. It is a
//! report, not a test: a missed target still exits 0; a setup error does not.
//!
//! The load generator shares the machine with the server (and Postgres), so it
//! uses its own tiny HTTP/1.1 client (one write, one read, `Content-Length`
//! framing, no pool layer) on one tokio thread by default to keep its CPU cost
//! low; the report shows how much CPU each side used.
//!
//! `combee-bench bare` (hidden) is the comparison server: a bare axum handler
//! with a fixed JSON body and no middleware. It answers what combee answers
//! (the same body size and the same response headers, as in one of combee's
//! answers) to the same requests, and each GET figure is measured in
//! slices alternating with it, so both see the same machine: the ratio is
//! the cost of making the answer, not of sending a longer one, nor of a
//! neighbour's load that came and went between two figures.

use std::{
    fmt::Write as _,
    io,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand, ValueEnum};
use sqlx::Connection;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    process::{Child, Command},
};

#[derive(Debug, Parser)]
#[command(name = "combee-bench", about = "Prints combee's foundation benchmark figures (run it through scripts/bench)")]
struct Cli {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Load the HTTP API of a freshly started server and print the report.
    Http(HttpArgs),
    /// The comparison server: a bare axum handler answering `GET /v1/prompts/bench` with a fixed JSON body.
    #[command(hide = true)]
    Bare {
        #[arg(long)]
        bind: SocketAddr,
        /// Size of the JSON body, in bytes.
        #[arg(long)]
        body_bytes: usize,
        /// A response header, `name: value` (repeatable).
        #[arg(long = "header")]
        headers: Vec<String>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StoreKind {
    Postgres,
    Sqlite,
}

impl StoreKind {
    fn as_str(self) -> &'static str {
        match self {
            StoreKind::Postgres => "postgres",
            StoreKind::Sqlite => "sqlite",
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
struct HttpArgs {
    /// Seconds each figure is measured for.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Seconds of unmeasured load before each figure.
    #[arg(long, default_value_t = 2)]
    warmup: u64,
    /// Concurrent keep-alive connections.
    #[arg(long, default_value_t = 64)]
    connections: usize,
    /// Traces per request in the batched-ingest figure.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Which store the server runs on. Postgres needs DATABASE_URL (an admin URL; a fresh database is created next to it).
    #[arg(long, value_enum, default_value_t = StoreKind::Postgres)]
    store: StoreKind,
    /// The server's `database.max_connections` (unset: the server's default).
    #[arg(long)]
    db_connections: Option<u32>,
    /// Offered load of the paced single-trace figure, in req/s (0 skips it).
    #[arg(long, default_value_t = 1500.0)]
    paced_rate: f64,
    /// Tokio worker threads for the load generator.
    #[arg(long, default_value_t = 1)]
    client_threads: usize,
    /// The `combee` binary [default: next to this one].
    #[arg(long)]
    server_bin: Option<PathBuf>,
    /// Only these figures (comma-separated: post, paced, batch, get, bare, memory) [default: all].
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Distinct subjects the GET-with-a-subject figures rotate through.
    #[arg(long, default_value_t = 10_000)]
    subjects: usize,
    /// Prompts and subjects of the memory figure: this many prompts are created, then fetched with
    /// `memory_subjects` distinct subjects.
    #[arg(long, default_value_t = 10_000)]
    memory_prompts: usize,
    #[arg(long, default_value_t = 100_000)]
    memory_subjects: usize,
    /// Also measure GET on the embedded SQLite store (a second server) when the store is Postgres.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    sqlite_get: bool,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        BenchCommand::Bare { bind, body_bytes, headers } => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(serve_bare(bind, body_bytes, &headers))),
        BenchCommand::Http(args) => {
            let rt = if args.client_threads <= 1 {
                tokio::runtime::Builder::new_current_thread().enable_all().build()
            } else {
                tokio::runtime::Builder::new_multi_thread().worker_threads(args.client_threads).enable_all().build()
            };
            rt.map_err(anyhow::Error::from).and_then(|rt| {
                rt.block_on(async {
                    // Returning drops every child guard, which kills the children.
                    tokio::select! {
                        r = run_http(args) => r,
                        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
                    }
                })
            })
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("combee-bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

// ---------------------------------------------------------------------------
// The bare comparison server.

/// The path the bare server answers: the prompt GET's own.
const BARE_PATH: &str = "/v1/prompts/bench";

async fn serve_bare(bind: SocketAddr, body_bytes: usize, headers: &[String]) -> anyhow::Result<()> {
    use axum::{
        Router,
        body::Bytes,
        http::{HeaderMap, HeaderName, HeaderValue, header},
        routing::get,
    };
    let body = Bytes::from(padded_json(body_bytes));
    let mut head = HeaderMap::new();
    head.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    for line in headers {
        let (name, value) = line.split_once(':').with_context(|| format!("--header {line:?} is not `name: value`"))?;
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        HeaderName::from_bytes(name.as_bytes())?;
        HeaderValue::from_str(value)?;
        // Static, as combee's own fixed headers are: a copy of the map then counts no references.
        let (name, value): (&'static str, &'static str) = (Box::leak(name.into()), Box::leak(value.into()));
        head.insert(HeaderName::from_static(name), HeaderValue::from_static(value));
    }
    let app = Router::new().route(
        BARE_PATH,
        get(move || {
            let (head, body) = (head.clone(), body.clone());
            async move { (head, body) }
        }),
    );
    let listener = tokio::net::TcpListener::bind(bind).await.with_context(|| format!("cannot listen on {bind}"))?;
    axum::serve(listener, app).await?;
    Ok(())
}

/// `{"pad":"xxx…"}` of exactly `n` bytes (at least the 10 bytes of the frame).
fn padded_json(n: usize) -> Vec<u8> {
    let frame = br#"{"pad":""}"#.len();
    let mut s = String::from(r#"{"pad":""#);
    s.extend(std::iter::repeat_n('x', n.saturating_sub(frame)));
    s.push_str(r#""}"#);
    s.into_bytes()
}

// ---------------------------------------------------------------------------
// A minimal keep-alive HTTP/1.1 client: enough for answers framed by
// Content-Length, which is all combee and the bare handler send.

struct HttpConn {
    stream: TcpStream,
    buf: Vec<u8>,
}

struct Answer {
    status: u16,
    body_start: usize,
}

impl HttpConn {
    async fn connect(addr: SocketAddr) -> io::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Self { stream, buf: Vec::with_capacity(16 * 1024) })
    }

    /// Sends one pre-encoded request and reads its whole answer into `self.buf`.
    async fn roundtrip(&mut self, request: &[u8]) -> io::Result<Answer> {
        self.stream.write_all(request).await?;
        self.buf.clear();
        let mut scanned = 0;
        loop {
            if let Some(at) = find(&self.buf[scanned..], b"\r\n\r\n") {
                let head_end = scanned + at;
                let (status, len) = parse_head(&self.buf[..head_end])?;
                let total = head_end + 4 + len;
                while self.buf.len() < total {
                    self.read_more().await?;
                }
                return Ok(Answer { status, body_start: head_end + 4 });
            }
            scanned = self.buf.len().saturating_sub(3);
            self.read_more().await?;
        }
    }

    async fn read_more(&mut self) -> io::Result<()> {
        self.buf.reserve(8 * 1024);
        if self.stream.read_buf(&mut self.buf).await? == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the server closed the connection"));
        }
        Ok(())
    }

    fn body(&self, answer: &Answer) -> &[u8] {
        &self.buf[answer.body_start..]
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The status code and the Content-Length of an answer's head.
fn parse_head(head: &[u8]) -> io::Result<(u16, usize)> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_owned());
    let text = std::str::from_utf8(head).map_err(|_| bad("the answer's head is not UTF-8"))?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 =
        status_line.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| bad("malformed status line"))?;
    let mut len = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else { continue };
        if name.eq_ignore_ascii_case("content-length") {
            len = Some(value.trim().parse().map_err(|_| bad("malformed Content-Length"))?);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(bad("chunked answers are not supported by the bench client"));
        }
    }
    match (len, status) {
        (Some(n), _) => Ok((status, n)),
        (None, 204 | 304) => Ok((status, 0)),
        (None, _) => Err(bad("the answer has no Content-Length")),
    }
}

fn encode_request(method: &str, path: &str, addr: SocketAddr, key: &str, body: Option<&[u8]>) -> Vec<u8> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\n");
    if let Some(b) = body {
        let _ = write!(head, "Content-Type: application/json\r\nContent-Length: {}\r\n", b.len());
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(body.unwrap_or_default());
    out
}

/// One request on a fresh connection, for set-up steps.
async fn request_once(addr: SocketAddr, request: &[u8]) -> io::Result<(u16, Vec<u8>)> {
    let mut conn = HttpConn::connect(addr).await?;
    let answer = conn.roundtrip(request).await?;
    Ok((answer.status, conn.body(&answer).to_vec()))
}

/// The header lines of an answer (`name: value`), but those the server adds
/// to every answer itself (`content-length`, `date`).
async fn answer_headers(addr: SocketAddr, request: &[u8]) -> io::Result<Vec<String>> {
    let mut conn = HttpConn::connect(addr).await?;
    let answer = conn.roundtrip(request).await?;
    let head = String::from_utf8_lossy(&conn.buf[..answer.body_start.saturating_sub(4)]).into_owned();
    Ok(head
        .split("\r\n")
        .skip(1)
        .filter(|line| {
            let name = line.split(':').next().unwrap_or_default().trim().to_ascii_lowercase();
            !matches!(name.as_str(), "content-length" | "date" | "content-type")
        })
        .map(str::to_owned)
        .collect())
}

// ---------------------------------------------------------------------------
// Load: N connections sending requests back to back (one request, or a rotation of them).

#[derive(Debug, Default)]
struct LoadResult {
    ok: u64,
    errors: u64,
    first_error: Option<String>,
    elapsed: Duration,
    /// Latencies of successful requests, in microseconds, sorted.
    latencies_us: Vec<u32>,
}

impl LoadResult {
    /// Adds another window's requests (a later slice of the same figure).
    fn absorb(&mut self, other: LoadResult) {
        self.ok += other.ok;
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
        self.elapsed += other.elapsed;
        self.latencies_us.extend(other.latencies_us);
        self.latencies_us.sort_unstable();
    }

    fn per_sec(&self) -> f64 {
        self.ok as f64 / self.elapsed.as_secs_f64()
    }

    fn quantile_ms(&self, q: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return f64::NAN;
        }
        let rank = ((self.latencies_us.len() as f64 * q).ceil() as usize).clamp(1, self.latencies_us.len());
        f64::from(self.latencies_us[rank - 1]) / 1000.0
    }
}

/// How the connections send.
#[derive(Debug, Clone, Copy)]
enum Pace {
    /// Each connection sends its next request as soon as the last is answered (closed loop).
    Flat,
    /// The connections together send this many requests per second on a fixed schedule; a
    /// latency counts from the scheduled time, so a slow answer also charges the requests
    /// that waited behind it (no coordinated omission).
    Rate(f64),
}

async fn load(
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
                        r.latencies_us.push(t0.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
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
    }
    // In-flight requests at the deadline are finished and counted, so the
    // window runs until the last of them.
    total.elapsed = start.elapsed();
    total.latencies_us.sort_unstable();
    Ok(total)
}

// ---------------------------------------------------------------------------
// Processes: spawn, watch memory and CPU, and kill on every way out.

/// A child process killed when dropped (normal return, error, panic or ctrl-c).
struct ChildGuard {
    child: Child,
    pid: u32,
    log: PathBuf,
}

impl ChildGuard {
    fn spawn(mut cmd: Command, log: PathBuf) -> anyhow::Result<Self> {
        let log_file = std::fs::File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::from(log_file)).kill_on_drop(true);
        let child = cmd.spawn().with_context(|| format!("cannot start {:?}", cmd.as_std().get_program()))?;
        let pid = child.id().context("the child exited at once")?;
        Ok(Self { child, pid, log })
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    }

    /// Polls `path` until it answers 200, failing if the child exits.
    async fn wait_ready(&mut self, addr: SocketAddr, path: &str) -> anyhow::Result<()> {
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

    async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// A scratch directory removed when dropped.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new() -> anyhow::Result<Self> {
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

fn free_port() -> anyhow::Result<SocketAddr> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("cannot find a free port")?;
    Ok(l.local_addr()?)
}

/// `VmRSS` and `VmHWM` of a process, in kB.
fn memory_kb(pid: u32) -> Option<(u64, u64)> {
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
struct MemoryWatch {
    peak_rss_kb: Arc<AtomicU64>,
    phase_peak_kb: Arc<AtomicU64>,
    hwm_kb: Arc<AtomicU64>,
    samples: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl MemoryWatch {
    fn start(pid: u32) -> Self {
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
    fn take_phase_peak(&self) -> u64 {
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

/// Whole-machine (busy, total) ticks from the first line of /proc/stat.
fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let nums: Vec<u64> =
        stat.lines().next().unwrap_or_default().split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect();
    let total: u64 = nums.iter().take(8).sum();
    let idle = nums.get(3).copied().unwrap_or(0) + nums.get(4).copied().unwrap_or(0);
    (total.saturating_sub(idle), total)
}

fn clock_ticks_per_sec() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// CPU used during one measured window, as a share of one core (100 % = one core busy).
struct CpuWindow {
    server: u64,
    client: u64,
    machine: (u64, u64),
}

impl CpuWindow {
    /// Adds another window's ticks (from [`CpuWindow::ticks`]).
    fn add(&mut self, other: CpuWindow) {
        self.server += other.server;
        self.client += other.client;
        self.machine.0 += other.machine.0;
        self.machine.1 += other.machine.1;
    }

    fn start(server_pid: u32) -> Self {
        Self { server: process_ticks(&server_pid.to_string()), client: process_ticks("self"), machine: machine_ticks() }
    }

    /// The ticks used since [`CpuWindow::start`] (server, client, machine busy, machine total).
    fn ticks(self, server_pid: u32) -> CpuWindow {
        let (busy, total) = machine_ticks();
        CpuWindow {
            server: process_ticks(&server_pid.to_string()) - self.server,
            client: process_ticks("self") - self.client,
            machine: (busy - self.machine.0, total - self.machine.1),
        }
    }

    fn finish(self, server_pid: u32, elapsed: Duration, tck: f64) -> CpuUse {
        CpuUse::of(&self.ticks(server_pid), elapsed, tck)
    }
}

impl CpuUse {
    /// Shares of one core from the ticks used over `elapsed`.
    fn of(used: &CpuWindow, elapsed: Duration, tck: f64) -> Self {
        let secs = elapsed.as_secs_f64() * tck / 100.0;
        CpuUse {
            server_pct: used.server as f64 / secs,
            client_pct: used.client as f64 / secs,
            machine_busy_pct: 100.0 * used.machine.0 as f64 / used.machine.1.max(1) as f64,
        }
    }
}

struct CpuUse {
    server_pct: f64,
    client_pct: f64,
    machine_busy_pct: f64,
}

// ---------------------------------------------------------------------------
// The run.

struct Phase {
    name: String,
    result: LoadResult,
    cpu: CpuUse,
    /// Traces per request (1 for GETs and single POSTs).
    items: u64,
    peak_rss_kb: u64,
    /// The bare server's figure, measured in the slices between this one's (GETs).
    bare: Option<Box<Phase>>,
}

/// The comparison server ([`serve_bare`]), running while the GET figures are measured.
struct BareServer {
    guard: ChildGuard,
    addr: SocketAddr,
}

/// The requests of one GET figure, made for a server's address (its Host header).
type Requests<'a> = dyn Fn(SocketAddr) -> Vec<Vec<u8>> + 'a;

/// Slices each GET figure and its bare pair are measured in, alternately.
const GET_SLICES: u32 = 4;

async fn run_http(args: HttpArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.connections > 0 && args.duration > 0, "--connections and --duration must be positive");
    let server_bin = match &args.server_bin {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("combee"),
    };
    anyhow::ensure!(server_bin.exists(), "{} not found (build it with cargo build --release)", server_bin.display());
    let scratch = ScratchDir::new()?;

    let mut database = None;
    let db_url = match args.store {
        StoreKind::Sqlite => String::new(),
        StoreKind::Postgres => {
            let admin = std::env::var("DATABASE_URL")
                .ok()
                .filter(|u| !u.is_empty())
                .context("DATABASE_URL is unset: point it at a Postgres server (scripts/bench starts a private one)")?;
            let db = BenchDatabase::create(&admin).await?;
            let url = db.url.clone();
            database = Some(db);
            url
        }
    };
    let outcome = measure(&args, &server_bin, &scratch.0, &db_url, database.as_ref()).await;
    if let Some(db) = database {
        db.drop_database().await;
    }
    let report = outcome?;
    print!("{report}");
    Ok(())
}

/// A fresh database next to the admin URL's, dropped after the run.
struct BenchDatabase {
    admin: String,
    name: String,
    url: String,
    synchronous_commit: String,
    fsync: String,
}

impl BenchDatabase {
    async fn create(admin: &str) -> anyhow::Result<Self> {
        let name = format!("bench_{:08x}", rand::random::<u32>());
        let mut conn = sqlx::PgConnection::connect(admin).await.context("cannot connect to DATABASE_URL")?;
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut conn).await.context("CREATE DATABASE")?;
        let synchronous_commit: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(&mut conn).await?;
        let fsync: String = sqlx::query_scalar("SHOW fsync").fetch_one(&mut conn).await?;
        conn.close().await?;
        Ok(Self { admin: admin.to_owned(), url: with_database(admin, &name)?, name, synchronous_commit, fsync })
    }

    async fn drop_database(self) {
        let dropped = async {
            let mut conn = sqlx::PgConnection::connect(&self.admin).await?;
            sqlx::query(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name)).execute(&mut conn).await?;
            conn.close().await
        };
        if let Err(e) = dropped.await {
            eprintln!("combee-bench: could not drop database {}: {e}", self.name);
        }
    }
}

/// The same URL with another database name.
fn with_database(url: &str, db: &str) -> anyhow::Result<String> {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").context("DATABASE_URL is not a URL")? + 3;
    let authority_end = base[scheme_end..].find('/').map_or(base.len(), |i| scheme_end + i);
    let mut out = format!("{}/{db}", &base[..authority_end]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    Ok(out)
}

/// The benchmark's prompt, with the product's defaults (promotion `evaluated`: served through its population).
const CREATE_BENCH: &str = r#"{"name":"bench","base":"You are a benchmark agent."}"#;

/// A GET of `path` naming its subject in `Combee-Subject`.
fn encode_get_with_subject(path: &str, addr: SocketAddr, key: &str, subject: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\nCombee-Subject: {subject}\r\n\r\n")
        .into_bytes()
}

/// `GET /v1/prompts/bench` on one server, without and with a subject (a
/// rotation of `--subjects` distinct ones, as agents serving many users send).
async fn get_phases(
    args: &HttpArgs,
    addr: SocketAddr,
    key: &str,
    store: &str,
    pid: u32,
    memory: &MemoryWatch,
    bare: Option<&BareServer>,
) -> anyhow::Result<Vec<Phase>> {
    // The same requests to both servers (but the Host header).
    let plain = |addr| vec![encode_request("GET", BARE_PATH, addr, key, None)];
    let subjects = |addr| -> Vec<Vec<u8>> {
        (0..args.subjects.max(1))
            .map(|i| encode_get_with_subject(BARE_PATH, addr, key, &format!("user-{i:06}")))
            .collect()
    };
    let (status, _) = request_once(addr, &subjects(addr)[0]).await?;
    anyhow::ensure!(status == 200, "GET with a subject on {store} answered {status}");
    let mut out = Vec::new();
    let figures: [(String, &Requests<'_>); 2] = [
        (format!("GET /v1/prompts/bench [{store}]"), &plain),
        (format!("GET /v1/prompts/bench with a subject [{store}]"), &subjects),
    ];
    let (warmup, duration) = (Duration::from_secs(args.warmup), Duration::from_secs(args.duration));
    let slice = duration / GET_SLICES;
    let tck = clock_ticks_per_sec();
    for (name, requests) in figures {
        let paired =
            if bare.is_some() { format!(", alternating with the bare server every {slice:?}") } else { String::new() };
        eprintln!("combee-bench: {name}: {} s warm-up, {} s measured{paired}", args.warmup, args.duration);
        let ours = Arc::new(requests(addr));
        let theirs = bare.map(|b| (b, Arc::new(requests(b.addr))));
        if !warmup.is_zero() {
            load(addr, ours.clone(), 200, args.connections, warmup, Pace::Flat).await?;
            if let Some((b, r)) = &theirs {
                load(b.addr, r.clone(), 200, args.connections, warmup, Pace::Flat).await?;
            }
        }
        memory.take_phase_peak();
        let (mut result, mut used) = (LoadResult::default(), CpuWindow { server: 0, client: 0, machine: (0, 0) });
        let (mut bare_result, mut bare_used) =
            (LoadResult::default(), CpuWindow { server: 0, client: 0, machine: (0, 0) });
        let slices = if theirs.is_some() { GET_SLICES } else { 1 };
        for _ in 0..slices {
            let window = CpuWindow::start(pid);
            result.absorb(load(addr, ours.clone(), 200, args.connections, duration / slices, Pace::Flat).await?);
            used.add(window.ticks(pid));
            if let Some((b, r)) = &theirs {
                let window = CpuWindow::start(b.guard.pid);
                bare_result.absorb(load(b.addr, r.clone(), 200, args.connections, slice, Pace::Flat).await?);
                bare_used.add(window.ticks(b.guard.pid));
            }
        }
        let cpu = CpuUse::of(&used, result.elapsed, tck);
        let bare_phase = theirs.map(|(b, _)| {
            let cpu = CpuUse::of(&bare_used, bare_result.elapsed, tck);
            let peak_rss_kb = memory_kb(b.guard.pid).map_or(0, |m| m.1);
            let name = format!("bare axum GET, alternating with \"{name}\"");
            Box::new(Phase { name, result: bare_result, cpu, items: 1, peak_rss_kb, bare: None })
        });
        out.push(Phase { name, result, cpu, items: 1, peak_rss_kb: memory.take_phase_peak(), bare: bare_phase });
    }
    Ok(out)
}

/// The bounded caches under many prompts and subjects: creates `--memory-prompts`
/// prompts, fetches them with `--memory-subjects` distinct subjects (subject i
/// asks for prompt i mod prompts), and reads the server's RSS afterwards.
async fn memory_figure(
    args: &HttpArgs,
    addr: SocketAddr,
    key: &str,
    pid: u32,
) -> anyhow::Result<(usize, usize, u64, u64)> {
    let (prompts, subjects) = (args.memory_prompts.max(1), args.memory_subjects.max(1));
    eprintln!("combee-bench: memory: creating {prompts} prompts, then {subjects} GETs with distinct subjects");
    let creates: Vec<Vec<u8>> = (0..prompts)
        .map(|i| {
            let body = format!(r#"{{"name":"mem-{i:05}","base":"You are agent {i}. Answer precisely and briefly."}}"#);
            encode_request("POST", "/v1/prompts", addr, key, Some(body.as_bytes()))
        })
        .collect();
    run_each_once(addr, creates, 201, args.connections).await.context("creating the memory figure's prompts")?;
    let gets: Vec<Vec<u8>> = (0..subjects)
        .map(|i| {
            encode_get_with_subject(
                &format!("/v1/prompts/mem-{:05}", i % prompts),
                addr,
                key,
                &format!("subject-{i:07}"),
            )
        })
        .collect();
    run_each_once(addr, gets, 200, args.connections).await.context("the memory figure's GETs")?;
    let (rss, hwm) = memory_kb(pid).context("cannot read the server's memory")?;
    Ok((prompts, subjects, rss, hwm))
}

/// Sends every request once over `connections` keep-alive connections; fails on any other status.
async fn run_each_once(
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

const TRACE: &str = r#"{"prompt":"bench","input":{"q":"What is the capital of France, and how long is the Seine?"},"output":"Paris; the Seine is about 777 km long.","feedback":{"success":true}}"#;

async fn measure(
    args: &HttpArgs,
    server_bin: &Path,
    scratch: &Path,
    db_url: &str,
    database: Option<&BenchDatabase>,
) -> anyhow::Result<String> {
    let tck = clock_ticks_per_sec();
    let loadavg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let addr = free_port()?;
    let data_dir = scratch.join("data");
    let mut cmd = Command::new(server_bin);
    cmd.args(["serve", "--bind", &addr.to_string()])
        .env("DATABASE_URL", db_url)
        .env("COMBEE__DATABASE__DATA_DIR", &data_dir)
        .env("COMBEE__LOG__LEVEL", "warn")
        .env_remove("RUST_LOG")
        .env_remove("COMBEE__DATABASE__URL");
    if let Some(n) = args.db_connections {
        cmd.env("COMBEE__DATABASE__MAX_CONNECTIONS", n.to_string());
    }
    let mut server = ChildGuard::spawn(cmd, scratch.join("server.log"))?;
    server.wait_ready(addr, "/readyz").await.context("the combee server did not start")?;
    let key_path = data_dir.join("admin-key");
    let key = std::fs::read_to_string(&key_path)
        .with_context(|| format!("cannot read the admin key from {}", key_path.display()))?
        .trim()
        .to_owned();
    let memory = MemoryWatch::start(server.pid);
    let idle_rss_kb = memory_kb(server.pid).map_or(0, |m| m.0);

    let create = encode_request("POST", "/v1/prompts", addr, &key, Some(CREATE_BENCH.as_bytes()));
    let (status, body) = request_once(addr, &create).await?;
    anyhow::ensure!(
        status == 201,
        "creating the prompt answered {status}: {}\nserver log:\n{}",
        String::from_utf8_lossy(&body),
        server.log_tail()
    );

    let single = encode_request("POST", "/v1/traces", addr, &key, Some(TRACE.as_bytes()));
    let batch_body = format!(r#"{{"traces":[{}]}}"#, vec![TRACE; args.batch].join(","));
    let batched = encode_request("POST", "/v1/traces", addr, &key, Some(batch_body.as_bytes()));
    let get = encode_request("GET", "/v1/prompts/bench", addr, &key, None);
    let (status, prompt_body) = request_once(addr, &get).await?;
    anyhow::ensure!(status == 200, "GET /v1/prompts/bench answered {status}");
    // The same check for the batch, once, so a rejected batch is a setup error and not a figure.
    let (status, body) = request_once(addr, &batched).await?;
    anyhow::ensure!(
        status == 201,
        "a batch of {} answered {status}: {}\nserver log:\n{}",
        args.batch,
        String::from_utf8_lossy(&body),
        server.log_tail()
    );

    let wanted = |name: &str| args.only.is_empty() || args.only.iter().any(|o| o == name);
    let bare_addr = free_port()?;
    // Response headers the bare server sends (combee's, Content-Type included), once known.
    let mut bare_headers = 0;
    let duration = Duration::from_secs(args.duration);
    let warmup = Duration::from_secs(args.warmup);
    let mut phases = Vec::new();
    let paced_name = format!("single-trace POST /v1/traces, paced at {} req/s", thousands(args.paced_rate));
    let plan = [
        ("post", "single-trace POST /v1/traces".to_owned(), single.clone(), 201, 1, Pace::Flat),
        ("paced", paced_name, single, 201, 1, Pace::Rate(args.paced_rate)),
        ("batch", "batched POST /v1/traces".to_owned(), batched, 201, args.batch as u64, Pace::Flat),
    ];
    for (id, name, request, expect, items, pace) in plan {
        if !wanted(id) || (id == "paced" && args.paced_rate <= 0.0) {
            continue;
        }
        eprintln!("combee-bench: {name}: {} s warm-up, {} s measured", args.warmup, args.duration);
        let request = Arc::new(vec![request]);
        if !warmup.is_zero() {
            load(addr, request.clone(), expect, args.connections, warmup, pace).await?;
        }
        memory.take_phase_peak();
        let cpu = CpuWindow::start(server.pid);
        let result = load(addr, request, expect, args.connections, duration, pace).await?;
        let cpu = cpu.finish(server.pid, result.elapsed, tck);
        phases.push(Phase {
            name: name.to_owned(),
            result,
            cpu,
            items,
            peak_rss_kb: memory.take_phase_peak(),
            bare: None,
        });
    }

    if wanted("get") {
        let bare = if wanted("bare") {
            // Answers what combee answered: the headers of one of its answers, and the body size.
            let headers = answer_headers(addr, &get).await?;
            let mut cmd = Command::new(std::env::current_exe()?);
            cmd.args(["bare", "--bind", &bare_addr.to_string(), "--body-bytes", &prompt_body.len().to_string()]);
            for h in &headers {
                cmd.args(["--header", h]);
            }
            let mut guard = ChildGuard::spawn(cmd, scratch.join("bare.log"))?;
            guard.wait_ready(bare_addr, BARE_PATH).await.context("the bare axum server did not start")?;
            let (_, bare_body) =
                request_once(bare_addr, &encode_request("GET", BARE_PATH, bare_addr, &key, None)).await?;
            anyhow::ensure!(bare_body.len() == prompt_body.len(), "the bare body differs in size from the prompt's");
            let theirs = answer_headers(bare_addr, &encode_request("GET", BARE_PATH, bare_addr, &key, None)).await?;
            anyhow::ensure!(theirs.len() == headers.len(), "the bare server answers {theirs:?}, combee {headers:?}");
            bare_headers = headers.len() + 1;
            Some(BareServer { guard, addr: bare_addr })
        } else {
            None
        };
        let store = args.store.as_str();
        phases.extend(get_phases(args, addr, &key, store, server.pid, &memory, bare.as_ref()).await?);
        if args.store == StoreKind::Postgres && args.sqlite_get {
            // The embedded store's GET, from a second server of its own.
            let sqlite_addr = free_port()?;
            let sqlite_data = scratch.join("sqlite-data");
            let mut cmd = Command::new(server_bin);
            cmd.args(["serve", "--bind", &sqlite_addr.to_string()])
                .env("DATABASE_URL", "")
                .env("COMBEE__DATABASE__DATA_DIR", &sqlite_data)
                .env("COMBEE__LOG__LEVEL", "warn")
                .env_remove("RUST_LOG")
                .env_remove("COMBEE__DATABASE__URL");
            let mut sqlite = ChildGuard::spawn(cmd, scratch.join("server-sqlite.log"))?;
            sqlite.wait_ready(sqlite_addr, "/readyz").await.context("the SQLite combee server did not start")?;
            let key = std::fs::read_to_string(sqlite_data.join("admin-key"))?.trim().to_owned();
            let create = encode_request("POST", "/v1/prompts", sqlite_addr, &key, Some(CREATE_BENCH.as_bytes()));
            let (status, _) = request_once(sqlite_addr, &create).await?;
            anyhow::ensure!(status == 201, "creating the prompt on SQLite answered {status}");
            let watch = MemoryWatch::start(sqlite.pid);
            phases.extend(get_phases(args, sqlite_addr, &key, "sqlite", sqlite.pid, &watch, bare.as_ref()).await?);
            sqlite.stop().await;
        }
        if let Some(b) = bare {
            b.guard.stop().await;
        }
    }
    let memory_probe = if wanted("memory") { Some(memory_figure(args, addr, &key, server.pid).await?) } else { None };

    // One last sample, then the kernel's own high-water mark covers anything between samples.
    if let Some((rss, hwm)) = memory_kb(server.pid) {
        memory.peak_rss_kb.fetch_max(rss, Ordering::Relaxed);
        memory.hwm_kb.fetch_max(hwm, Ordering::Relaxed);
    }
    let facts = Facts {
        args: args.clone(),
        loadavg: loadavg.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
        database,
        idle_rss_kb,
        peak_rss_kb: memory.peak_rss_kb.load(Ordering::Relaxed),
        hwm_kb: memory.hwm_kb.load(Ordering::Relaxed),
        samples: memory.samples.load(Ordering::Relaxed),
        prompt_body_bytes: prompt_body.len(),
        bare_headers,
        memory_probe,
    };
    drop(memory);
    server.stop().await;
    Ok(render(&facts, &phases))
}

struct Facts<'a> {
    args: HttpArgs,
    loadavg: String,
    database: Option<&'a BenchDatabase>,
    idle_rss_kb: u64,
    peak_rss_kb: u64,
    hwm_kb: u64,
    samples: u64,
    prompt_body_bytes: usize,
    /// Response headers the bare server sends besides `content-length` and `date` (0: not run).
    bare_headers: usize,
    /// The memory figure: (prompts, subjects, RSS after, in kB, VmHWM in kB).
    memory_probe: Option<(usize, usize, u64, u64)>,
}

fn nproc() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|v| v.split_once(':')).map(|(_, m)| m.trim().to_owned()))
        .unwrap_or_else(|| "unknown CPU".into())
}

fn pass(ok: bool) -> &'static str {
    if ok { "PASS" } else { "FAIL" }
}

fn thousands(v: f64) -> String {
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

fn render(f: &Facts, phases: &[Phase]) -> String {
    let a = &f.args;
    let mut o = String::new();
    let find = |prefix: &str| phases.iter().find(|p| p.name.starts_with(prefix));
    let exact = |name: &str| phases.iter().find(|p| p.name == name);
    let _ = writeln!(o, "# combee foundation benchmark (HTTP)\n");
    let _ = writeln!(
        o,
        "- machine: {} CPUs (nproc) — {}; load average before the run: {}",
        nproc(),
        cpu_model(),
        f.loadavg
    );
    let load1: f64 = f.loadavg.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
    if load1 > nproc() as f64 * 0.5 {
        let _ = writeln!(
            o,
            "- **warning: the machine was already busy before the run** (1-minute load average {load1:.1} on {} CPUs); the figures below are pessimistic — compare runs made on a quiet machine",
            nproc()
        );
    }
    let store = match f.database {
        Some(db) => format!(
            "postgres (fresh database, `synchronous_commit = {}`, `fsync = {}`)",
            db.synchronous_commit, db.fsync
        ),
        None => format!("{} (embedded, temp data dir)", a.store.as_str()),
    };
    let _ = writeln!(o, "- store: {store}");
    let pool = a.db_connections.map_or("the default".to_owned(), |n| n.to_string());
    let _ =
        writeln!(o, "- server: `combee serve` (release build), log level warn, `database.max_connections` = {pool}");
    let _ = writeln!(
        o,
        "- load: {} concurrent keep-alive connections, {} s measured per figure after {} s warm-up; batches of {} traces",
        a.connections, a.duration, a.warmup, a.batch
    );
    let _ = writeln!(
        o,
        "- client: combee-bench's own minimal HTTP/1.1 client (pre-encoded requests, Content-Length framing, no pool layer) on {} tokio thread(s). **Client, server and Postgres share this machine**: the client's CPU is taken from the server's budget (see the CPU columns).",
        a.client_threads
    );
    let _ = writeln!(o, "\n| figure | measured | target | result |\n| --- | --- | --- | --- |");
    if let Some(p) = exact("single-trace POST /v1/traces") {
        let (rps, p50, p99) = (p.result.per_sec(), p.result.quantile_ms(0.50), p.result.quantile_ms(0.99));
        let _ = writeln!(
            o,
            "| single-trace POST throughput | {} req/s | ≥ 1,500 req/s | {} |",
            thousands(rps),
            pass(rps >= 1500.0 && p.result.errors == 0)
        );
        let _ = writeln!(
            o,
            "| single-trace POST latency at full load ({} connections, closed loop) | p50 {p50:.1} ms, p99 {p99:.1} ms | p99 ≤ 25 ms | {} |",
            a.connections,
            pass(p99 <= 25.0)
        );
    }
    if let Some(p) = find("single-trace POST /v1/traces, paced") {
        let (p50, p99) = (p.result.quantile_ms(0.50), p.result.quantile_ms(0.99));
        let _ = writeln!(
            o,
            "| single-trace POST latency at {} req/s offered | p50 {p50:.1} ms, p99 {p99:.1} ms ({} req/s served) | p99 ≤ 25 ms | {} |",
            thousands(a.paced_rate),
            thousands(p.result.per_sec()),
            pass(p99 <= 25.0 && p.result.errors == 0 && p.result.per_sec() >= 0.97 * a.paced_rate)
        );
    }
    if let Some(p) = exact("batched POST /v1/traces") {
        let tps = p.result.per_sec() * p.items as f64;
        let _ = writeln!(
            o,
            "| batched ingest ({} traces/request) | {} traces/s ({} req/s, p99 {:.1} ms) | ≥ 5,000 traces/s | {} |",
            p.items,
            thousands(tps),
            thousands(p.result.per_sec()),
            p.result.quantile_ms(0.99),
            pass(tps >= 5000.0 && p.result.errors == 0)
        );
    }
    for store in ["postgres", "sqlite"] {
        for (with, label) in [("", "without a subject"), (" with a subject", "with a subject")] {
            let Some(p) = exact(&format!("GET /v1/prompts/bench{with} [{store}]")) else { continue };
            if let Some(b) = &p.bare {
                let share = 100.0 * p.result.per_sec() / b.result.per_sec();
                let cpu_share = 100.0 * b.cpu.server_pct / b.result.per_sec() / (p.cpu.server_pct / p.result.per_sec());
                let _ = writeln!(
                    o,
                    "| prompt GET vs bare axum handler, {store}, {label} | {share:.0} % ({} vs {} req/s; p99 {:.1} vs {:.1} ms; server CPU per request: bare {:.0} % of combee's) | ≥ 85 % | {} |",
                    thousands(p.result.per_sec()),
                    thousands(b.result.per_sec()),
                    p.result.quantile_ms(0.99),
                    b.result.quantile_ms(0.99),
                    cpu_share,
                    pass(share >= 85.0 && p.result.errors == 0)
                );
            }
        }
    }
    if let Some((prompts, subjects, rss, hwm)) = f.memory_probe {
        let mb = rss.max(hwm) as f64 / 1024.0;
        let _ = writeln!(
            o,
            "| server RSS after {} prompts fetched by {} distinct subjects | {mb:.1} MB (RSS {:.1} MB, VmHWM {:.1} MB) | ≤ 150 MB | {} |",
            thousands(prompts as f64),
            thousands(subjects as f64),
            rss as f64 / 1024.0,
            hwm as f64 / 1024.0,
            pass(mb <= 150.0)
        );
    }
    let peak_mb = f.peak_rss_kb.max(f.hwm_kb) as f64 / 1024.0;
    let _ = writeln!(
        o,
        "| server RSS, peak over the run | {peak_mb:.1} MB (sampled max {:.1} MB, VmHWM {:.1} MB, idle {:.1} MB) | ≤ 150 MB | {} |",
        f.peak_rss_kb as f64 / 1024.0,
        f.hwm_kb as f64 / 1024.0,
        f.idle_rss_kb as f64 / 1024.0,
        pass(peak_mb <= 150.0)
    );

    let _ = writeln!(o, "\n## Per figure\n");
    let _ = writeln!(
        o,
        "CPU is a share of one core over the measured window (200 % = both cores); \"machine\" is all CPUs busy, including Postgres and anything else running.\n"
    );
    let _ = writeln!(
        o,
        "| figure | requests | errors | req/s | p50 ms | p90 ms | p99 ms | max ms | server CPU | server CPU µs/req | client CPU | machine busy | server peak RSS |"
    );
    let _ = writeln!(o, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let rows = phases.iter().flat_map(|p| std::iter::once(p).chain(p.bare.as_deref()));
    for p in rows.clone() {
        let r = &p.result;
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} % | {:.0} | {:.0} % | {:.0} % | {:.1} MB |",
            p.name,
            r.ok,
            r.errors,
            thousands(r.per_sec()),
            r.quantile_ms(0.50),
            r.quantile_ms(0.90),
            r.quantile_ms(0.99),
            r.latencies_us.last().map_or(f64::NAN, |v| f64::from(*v) / 1000.0),
            p.cpu.server_pct,
            p.cpu.server_pct / 100.0 * 1e6 / r.per_sec(),
            p.cpu.client_pct,
            p.cpu.machine_busy_pct,
            p.peak_rss_kb as f64 / 1024.0,
        );
    }
    for p in rows {
        if let Some(e) = &p.result.first_error {
            let e: String = e.chars().take(300).collect();
            let _ = writeln!(o, "\nFirst error in \"{}\": {e}", p.name);
        }
    }
    let _ = writeln!(
        o,
        "\nMemory was sampled from /proc/<pid>/status every 100 ms ({} samples); the prompt body is {} bytes.",
        f.samples, f.prompt_body_bytes
    );
    if f.bare_headers > 0 {
        let _ = writeln!(
            o,
            "The bare axum handler (no middleware, no extractor) answers the same requests at the same path with the same {}-byte body and the same {} response headers as combee's GET (those of one of its answers, plus `content-length` and `date`); each GET figure is measured in {GET_SLICES} slices alternating with its bare figure, so both see the same machine.",
            f.prompt_body_bytes, f.bare_headers
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padded_json_has_the_requested_size_and_parses() {
        for n in [10, 11, 400, 4096] {
            let body = padded_json(n);
            assert_eq!(body.len(), n);
            assert!(serde_json::from_slice::<serde_json::Value>(&body).is_ok());
        }
    }

    #[test]
    fn heads_give_status_and_length() {
        let head = b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\nContent-Length: 42";
        assert_eq!(parse_head(head).unwrap(), (201, 42));
        assert_eq!(parse_head(b"HTTP/1.1 304 Not Modified\r\netag: \"x\"").unwrap(), (304, 0));
        assert!(parse_head(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked").is_err());
    }

    #[test]
    fn database_name_is_swapped_keeping_the_query() {
        assert_eq!(
            with_database("postgres://u:p@127.0.0.1:5432/postgres?sslmode=disable", "bench_1").unwrap(),
            "postgres://u:p@127.0.0.1:5432/bench_1?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h", "b").unwrap(), "postgres://h/b");
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let r = LoadResult { latencies_us: (1..=100).map(|v| v * 1000).collect(), ..LoadResult::default() };
        assert_eq!(r.quantile_ms(0.5), 50.0);
        assert_eq!(r.quantile_ms(0.99), 99.0);
    }
}
