//! `combee traces quarantine|release|delete`: an operator's containment of a
//! poisoned trace stream (quarantined traces are kept but never learned from,
//! until released).
//!
//! `combee traces import FILE.jsonl`: sends a JSON Lines file of traces in
//! batches so that a re-run imports nothing twice (each batch carries an
//! `Idempotency-Key` derived from its content and position), and so that one
//! bad line costs only itself: local parse errors are caught before sending,
//! a server rejection naming `traces[i]` is mapped back to the file's line,
//! and the batch is sent again without it. `combee traces requeue` puts
//! failed traces back to pending. `combee traces export` is in `export.rs`.

use std::{
    collections::VecDeque,
    fs::File,
    io::{BufRead, BufReader, IsTerminal, Write},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use clap::Subcommand;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::client::{Answer, ApiClient, CliError, CliResult, Failure, print_json};

#[derive(Debug, Subcommand)]
pub enum TracesCommand {
    /// Import a JSON Lines file (one trace object per line); re-running it imports nothing twice.
    ///
    /// Lines that fail (bad JSON, rejected by the server) are reported as FILE:LINE: detail on
    /// stderr and the rest is imported; the exit code is then 5. Re-runs are recognised as long
    /// as the file's lines, --batch-size, --prompt and the API key stay the same (within the
    /// server's `limits.idempotency_ttl_hours`).
    Import {
        file: PathBuf,
        /// Lines per request (the server may ask for fewer; batches are then split).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000))]
        batch_size: u32,
        /// The prompt for lines that name none.
        #[arg(long, value_name = "NAME")]
        prompt: Option<String>,
    },
    /// Put a prompt's failed traces back to pending (attempts reset), so the next round learns from them.
    ///
    /// Give the trace ids, or --all for every failed trace of the prompt; --since narrows either
    /// to traces received at or after a time. Traces that are not failed are left alone.
    #[command(group(clap::ArgGroup::new("which").required(true).args(["ids", "all"])))]
    Requeue {
        /// The prompt whose traces to requeue.
        prompt: String,
        /// Trace ids (comma-separated, or the flag repeated).
        #[arg(long, value_delimiter = ',', num_args = 1.., value_name = "ID")]
        ids: Vec<String>,
        /// Every failed trace of the prompt.
        #[arg(long)]
        all: bool,
        /// Only traces received at or after this RFC 3339 time.
        #[arg(long, value_name = "TIME")]
        since: Option<String>,
    },
    /// Hold traces back from learning: by id, or every pending trace of --prompt (optionally
    /// received in [--since, --until)). Quarantined traces stay visible and are never learned from.
    Quarantine {
        /// Trace ids (UUIDs).
        #[arg(required_unless_present = "prompt", conflicts_with = "prompt")]
        ids: Vec<String>,
        /// Quarantine every unreserved pending trace of this prompt.
        #[arg(long, value_name = "NAME")]
        prompt: Option<String>,
        /// RFC 3339; with --prompt: only traces received at or after it.
        #[arg(long, requires = "prompt")]
        since: Option<String>,
        /// RFC 3339; with --prompt: only traces received before it.
        #[arg(long, requires = "prompt")]
        until: Option<String>,
        /// Why (shown with the trace).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Lift the quarantine of traces held back by mistake: they are learned from again.
    Release {
        /// Trace ids (UUIDs).
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Delete traces no version was learned from (pending, quarantined or failed).
    Delete {
        /// Trace ids (UUIDs).
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Export a prompt's traces as JSON Lines for fine-tuning or RL (streamed; see --format).
    Export(super::export::ExportArgs),
}

pub async fn run(api: &ApiClient, json_out: bool, cmd: TracesCommand) -> CliResult<()> {
    match cmd {
        TracesCommand::Import { file, batch_size, prompt } => {
            import(api, json_out, &file, batch_size as usize, prompt.as_deref()).await
        }
        TracesCommand::Requeue { prompt, ids, all, since } => requeue(api, json_out, &prompt, ids, all, since).await,
        TracesCommand::Quarantine { ids, prompt, since, until, reason } => match prompt {
            Some(prompt) => {
                let body = json!({"prompt": prompt, "since": since, "until": until, "reason": reason});
                let answer = api.send_json(Method::POST, "/v1/traces/quarantine", &body).await?;
                if json_out {
                    print_json(&answer.body);
                } else {
                    println!("quarantined {} traces of {prompt}", answer.body["quarantined"]);
                }
                Ok(())
            }
            None => {
                let body = json!({ "reason": reason });
                each_trace(json_out, &ids, "quarantined", |id| {
                    let req =
                        api.request(Method::POST, &format!("/v1/traces/{}/quarantine", super::client::encode(id)));
                    api.send(req.json(&body))
                })
                .await
            }
        },
        TracesCommand::Release { ids } => {
            each_trace(json_out, &ids, "released", |id| {
                api.send(api.request(Method::DELETE, &format!("/v1/traces/{}/quarantine", super::client::encode(id))))
            })
            .await
        }
        TracesCommand::Export(args) => super::export::run(api, args).await,
        TracesCommand::Delete { ids } => {
            each_trace(json_out, &ids, "deleted", |id| {
                api.send(api.request(Method::DELETE, &format!("/v1/traces/{}", super::client::encode(id))))
            })
            .await
        }
    }
}

async fn requeue(
    api: &ApiClient,
    json_out: bool,
    prompt: &str,
    ids: Vec<String>,
    all: bool,
    since: Option<String>,
) -> CliResult<()> {
    let mut body = if all { json!({"all": true}) } else { json!({ "ids": ids }) };
    if let Some(since) = since {
        body["since"] = json!(since);
    }
    let path = format!("/v1/prompts/{}/traces/requeue", super::client::encode(prompt));
    let answer = api.send_json(Method::POST, &path, &body).await?.body;
    if json_out {
        print_json(&answer);
    } else {
        let count = answer["count"].as_u64().unwrap_or(0);
        println!("requeued {count} failed trace{} of {prompt}", if count == 1 { "" } else { "s" });
        for id in answer["ids"].as_array().into_iter().flatten() {
            println!("{}", id.as_str().unwrap_or_default());
        }
    }
    Ok(())
}

/// Runs `action` on every id, reporting each; the first failure is the exit status
/// after all ids were tried (one refused trace must not stop the containment of the rest).
async fn each_trace<F, Fut>(json_out: bool, ids: &[String], done: &str, action: F) -> CliResult<()>
where
    F: Fn(&str) -> Fut,
    Fut: std::future::Future<Output = CliResult<Answer>>,
{
    let mut first_error = None;
    let mut results = Vec::new();
    for id in ids {
        match action(id).await {
            Ok(answer) => {
                if json_out {
                    results.push(json!({"id": id, "ok": true, "trace": answer.body}));
                } else {
                    println!("{id}: {done}");
                }
            }
            Err(e) => {
                if json_out {
                    results.push(json!({"id": id, "ok": false, "error": e.message}));
                } else {
                    eprintln!("{id}: {}", e.message);
                }
                first_error.get_or_insert(e);
            }
        }
    }
    if json_out {
        print_json(&json!({ "results": results }));
    }
    first_error.map_or(Ok(()), Err)
}

/// One line of the file, ready to send.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    /// 1-based line number in the file.
    pub number: usize,
    /// A JSON object, as sent.
    pub json: String,
}

/// Checks one line as far as is cheap: blank lines are `Ok(None)`; a line
/// that is not a JSON object, or names no prompt when there is no default,
/// is an error. A line is sent verbatim unless the default prompt is added.
pub fn prepare_line(raw: &str, default_prompt: Option<&str>) -> Result<Option<String>, String> {
    let text = raw.trim();
    if text.is_empty() {
        return Ok(None);
    }
    let mut value: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let Some(obj) = value.as_object_mut() else {
        return Err("expected a JSON object (one trace per line)".to_owned());
    };
    match obj.get("prompt") {
        Some(Value::String(_)) => Ok(Some(text.to_owned())),
        Some(Value::Null) | None => match default_prompt {
            Some(p) => {
                obj.insert("prompt".to_owned(), Value::String(p.to_owned()));
                Ok(Some(value.to_string()))
            }
            None => Err("no \"prompt\" field (pass --prompt NAME to give lines without one a default)".to_owned()),
        },
        Some(_) => Err("\"prompt\" must be a string".to_owned()),
    }
}

/// `{"traces": [...]}` from lines that are JSON objects already.
pub fn batch_body(lines: &[Line]) -> String {
    let mut body = String::from("{\"traces\":[");
    for (i, l) in lines.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        body.push_str(&l.json);
    }
    body.push_str("]}");
    body
}

/// Deterministic in the batch's content and its first line, so a re-run of
/// the same file sends the same keys and the server replays instead of storing.
pub fn idempotency_key(lines: &[Line], body: &str) -> String {
    let first = lines.first().map_or(0, |l| l.number);
    let mut h = Sha256::new();
    h.update(format!("combee-import-v1\n{first}\n").as_bytes());
    h.update(body.as_bytes());
    format!("import-{}", hex::encode(h.finalize()))
}

/// The `i` of a server detail starting `traces[i]: …`, and the rest of it.
pub fn rejected_index(detail: &str) -> Option<(usize, &str)> {
    let rest = detail.strip_prefix("traces[")?;
    let (digits, rest) = rest.split_once(']')?;
    let i = digits.parse().ok()?;
    Some((i, rest.trim_start_matches(':').trim_start()))
}

/// Halves `lines` until every piece holds at most `limit` lines — the same
/// pieces a 413 would have split them into, so keys stay stable across runs.
pub fn split_to(lines: Vec<Line>, limit: Option<usize>) -> Vec<Vec<Line>> {
    let Some(limit) = limit.map(|l| l.max(1)) else { return vec![lines] };
    if lines.len() <= limit {
        return vec![lines];
    }
    let (a, b) = halve(lines);
    let mut out = split_to(a, Some(limit));
    out.extend(split_to(b, Some(limit)));
    out
}

fn halve(mut lines: Vec<Line>) -> (Vec<Line>, Vec<Line>) {
    let back = lines.split_off(lines.len().div_ceil(2));
    (lines, back)
}

/// What the import did, line by line.
#[derive(Debug, Default)]
pub struct Report {
    pub lines: usize,
    pub imported: usize,
    pub skipped: usize,
    pub failed: Vec<(usize, String)>,
}

/// Progress on stderr: a bar redrawn in place on a terminal, a plain line
/// every few seconds otherwise.
struct Progress {
    total_bytes: u64,
    tty: bool,
    /// Last drawn; starts at creation so a quick import prints only its summary.
    last: Instant,
    drawn: bool,
}

impl Progress {
    fn new(total_bytes: u64) -> Self {
        Self { total_bytes, tty: std::io::stderr().is_terminal(), last: Instant::now(), drawn: false }
    }

    fn update(&mut self, bytes: u64, r: &Report) {
        let every = if self.tty { Duration::from_millis(100) } else { Duration::from_secs(2) };
        if self.last.elapsed() < every {
            return;
        }
        self.last = Instant::now();
        let pct = (bytes.min(self.total_bytes) * 100).checked_div(self.total_bytes).unwrap_or(100) as usize;
        let counts = format!(
            "{} lines: {} imported, {} already there, {} failed",
            r.lines,
            r.imported,
            r.skipped,
            r.failed.len()
        );
        let mut err = std::io::stderr().lock();
        if self.tty {
            let filled = pct * 30 / 100;
            let _ = write!(err, "\r\x1b[2K[{}{}] {pct:>3}% {counts}", "#".repeat(filled), " ".repeat(30 - filled));
            self.drawn = true;
        } else {
            let _ = writeln!(err, "import: {pct}% read, {counts}");
        }
        let _ = err.flush();
    }

    /// Clears the bar so a message can be printed on a line of its own.
    fn clear(&mut self) {
        if self.tty && self.drawn {
            let _ = write!(std::io::stderr(), "\r\x1b[2K");
            self.drawn = false;
        }
    }
}

struct Importer<'a> {
    api: &'a ApiClient,
    file: String,
    report: Report,
    progress: Progress,
    /// The most lines the server took in one request, once it refused more (413).
    limit: Option<usize>,
}

impl Importer<'_> {
    fn fail(&mut self, line: usize, detail: &str) {
        self.progress.clear();
        eprintln!("{}:{line}: {detail}", self.file);
        self.report.failed.push((line, detail.to_owned()));
    }

    /// Sends one batch; rejected lines are taken out and the rest sent again.
    async fn send(&mut self, lines: Vec<Line>) -> CliResult<()> {
        let mut queue: VecDeque<Vec<Line>> = split_to(lines, self.limit).into();
        while let Some(mut chunk) = queue.pop_front() {
            if chunk.is_empty() {
                continue;
            }
            let body = batch_body(&chunk);
            let key = idempotency_key(&chunk, &body);
            match post(self.api, body, &key).await {
                Ok(answer) => {
                    if answer.header("idempotent-replayed") == Some("true") {
                        self.report.skipped += chunk.len();
                    } else {
                        self.report.imported += answer.body["count"].as_u64().map_or(chunk.len(), |n| n as usize);
                    }
                }
                Err(e) if matches!(e.status.map(|s| s.as_u16()), Some(413 | 422)) => match rejected_index(&e.message) {
                    Some((i, why)) if i < chunk.len() => {
                        let bad = chunk.remove(i);
                        self.fail(bad.number, why);
                        queue.push_front(chunk);
                    }
                    _ if e.status == Some(StatusCode::PAYLOAD_TOO_LARGE) && chunk.len() > 1 => {
                        let (a, b) = halve(chunk);
                        self.limit = Some(self.limit.map_or(a.len(), |l| l.min(a.len())));
                        queue.push_front(b);
                        queue.push_front(a);
                    }
                    _ => chunk.iter().for_each(|l| self.fail(l.number, &e.message)),
                },
                // Auth, a missing route, the server or network: no later batch would do better.
                Err(e) if matches!(e.kind, Failure::Auth | Failure::NotFound | Failure::Server) => return Err(e),
                Err(e) => chunk.iter().for_each(|l| self.fail(l.number, &e.to_string())),
            }
        }
        Ok(())
    }
}

/// POSTs a batch, retrying what may pass on a second try: an unreachable or
/// failing server, 429, and 409 (older servers: the same key still in flight). The key makes
/// retries safe.
async fn post(api: &ApiClient, body: String, key: &str) -> CliResult<Answer> {
    let mut delay = Duration::from_millis(500);
    for attempt in 0.. {
        let req = api
            .request(Method::POST, "/v1/traces")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(body.clone());
        match api.send(req).await {
            Err(e)
                if attempt < 3
                    && (e.kind == Failure::Server || matches!(e.status.map(|s| s.as_u16()), Some(409 | 429))) =>
            {
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            other => return other,
        }
    }
    unreachable!("the loop returns")
}

async fn import(
    api: &ApiClient,
    json_out: bool,
    path: &Path,
    batch_size: usize,
    default_prompt: Option<&str>,
) -> CliResult<()> {
    let file = File::open(path).map_err(|e| CliError::local(format!("cannot open {}: {e}", path.display())))?;
    let total = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut reader = BufReader::new(file);
    let mut imp = Importer {
        api,
        file: path.display().to_string(),
        report: Report::default(),
        progress: Progress::new(total),
        limit: None,
    };
    let mut batch = Vec::with_capacity(batch_size);
    let (mut number, mut bytes, mut raw) = (0usize, 0u64, Vec::new());
    let outcome: CliResult<()> = async {
        loop {
            raw.clear();
            let n = reader
                .read_until(b'\n', &mut raw)
                .map_err(|e| CliError::local(format!("reading {}: {e}", path.display())))?;
            if n > 0 {
                number += 1;
                bytes += n as u64;
                match std::str::from_utf8(&raw).map_err(|_| "not UTF-8 text".to_owned()) {
                    Ok(text) => match prepare_line(text, default_prompt) {
                        Ok(Some(json)) => batch.push(Line { number, json }),
                        Ok(None) => {}
                        Err(why) => imp.fail(number, &why),
                    },
                    Err(why) => imp.fail(number, &why),
                }
            }
            if batch.len() >= batch_size || (n == 0 && !batch.is_empty()) {
                imp.send(std::mem::take(&mut batch)).await?;
            }
            imp.report.lines = number;
            imp.progress.update(bytes, &imp.report);
            if n == 0 {
                return Ok(());
            }
        }
    }
    .await;
    imp.progress.clear();
    imp.report.failed.sort_by_key(|(line, _)| *line);
    let r = &imp.report;
    if json_out {
        let errors: Vec<Value> =
            r.failed.iter().map(|(line, detail)| json!({"line": line, "detail": detail})).collect();
        print_json(&json!({
            "file": imp.file, "lines": r.lines, "imported": r.imported, "skipped": r.skipped,
            "failed": r.failed.len(), "errors": errors, "complete": outcome.is_ok(),
        }));
    } else {
        println!(
            "{}: {} imported, {} skipped as already imported, {} failed",
            imp.file,
            r.imported,
            r.skipped,
            r.failed.len()
        );
    }
    outcome.map_err(|e| CliError { message: format!("import stopped at line {number}: {}", e.message), ..e })?;
    if !r.failed.is_empty() {
        return Err(CliError::new(
            Failure::Invalid,
            format!("{} line(s) of {} failed; the rest were imported", r.failed.len(), imp.file),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(number: usize, json: &str) -> Line {
        Line { number, json: json.to_owned() }
    }

    #[test]
    fn lines_are_checked_locally_as_far_as_is_cheap() {
        assert_eq!(prepare_line("   \n", None), Ok(None));
        assert_eq!(
            prepare_line("{\"prompt\":\"a\",\"input\":1}\n", None),
            Ok(Some("{\"prompt\":\"a\",\"input\":1}".into()))
        );
        assert!(prepare_line("{\"prompt\":", None).unwrap_err().starts_with("not valid JSON"));
        assert!(prepare_line("[1,2]", None).unwrap_err().contains("JSON object"));
        assert!(prepare_line("{\"input\":1}", None).unwrap_err().contains("--prompt"));
        assert!(prepare_line("{\"prompt\":7}", Some("d")).unwrap_err().contains("string"));
        let filled: Value = serde_json::from_str(&prepare_line("{\"input\":1}", Some("d")).unwrap().unwrap()).unwrap();
        assert_eq!(filled, json!({"prompt": "d", "input": 1}));
    }

    #[test]
    fn keys_depend_on_content_and_position_only() {
        let a = vec![line(1, "{\"a\":1}"), line(2, "{\"b\":2}")];
        let body = batch_body(&a);
        assert_eq!(body, "{\"traces\":[{\"a\":1},{\"b\":2}]}");
        assert_eq!(idempotency_key(&a, &body), idempotency_key(&a.clone(), &batch_body(&a)));
        let moved = vec![line(3, "{\"a\":1}"), line(4, "{\"b\":2}")];
        assert_ne!(idempotency_key(&a, &body), idempotency_key(&moved, &batch_body(&moved)));
        let fewer = vec![line(1, "{\"a\":1}")];
        assert_ne!(idempotency_key(&a, &body), idempotency_key(&fewer, &batch_body(&fewer)));
        assert!(idempotency_key(&a, &body).len() <= 255);
    }

    #[test]
    fn server_rejections_name_the_trace() {
        assert_eq!(rejected_index("traces[3]: unknown prompt \"x\""), Some((3, "unknown prompt \"x\"")));
        assert_eq!(rejected_index("traces[12]: input: missing field"), Some((12, "input: missing field")));
        assert_eq!(rejected_index("the batch holds 60 traces"), None);
        assert_eq!(rejected_index("traces[x]: y"), None);
    }

    #[test]
    fn splitting_is_repeatable_halving() {
        let lines: Vec<Line> = (1..=7).map(|n| line(n, "{}")).collect();
        let sizes = |v: Vec<Vec<Line>>| v.iter().map(Vec::len).collect::<Vec<_>>();
        assert_eq!(sizes(split_to(lines.clone(), None)), [7]);
        assert_eq!(sizes(split_to(lines.clone(), Some(4))), [4, 3]);
        assert_eq!(sizes(split_to(lines.clone(), Some(2))), [2, 2, 2, 1]);
        assert_eq!(
            split_to(lines, Some(1)).concat().iter().map(|l| l.number).collect::<Vec<_>>(),
            [1, 2, 3, 4, 5, 6, 7]
        );
    }
}
