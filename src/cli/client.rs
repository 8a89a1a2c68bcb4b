//! The operator CLI's connection to a running server: where it is, which key
//! to send (never printed), and one error type whose variants are the exit
//! codes scripts can rely on.

use std::{fmt, path::PathBuf, time::Duration};

use clap::Args;
use reqwest::{Method, RequestBuilder, StatusCode, header::HeaderMap};
use serde::Serialize;
use serde_json::Value;

use crate::secret::Secret;

/// The environment variable holding the API key.
pub const API_KEY_ENV: &str = "COMBEE_API_KEY";

/// Flags shared by every command that talks to a server.
#[derive(Debug, Clone, Args)]
pub struct ClientArgs {
    /// The server's base URL.
    #[arg(long, env = "COMBEE_URL", default_value = "http://127.0.0.1:8080", global = true)]
    pub url: String,
    /// Read the API key from this file instead of $COMBEE_API_KEY.
    #[arg(long, value_name = "PATH", global = true)]
    pub api_key_file: Option<PathBuf>,
    /// Print the server's JSON instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
}

/// What went wrong, as far as a script cares: each kind is one exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// 1: bad usage or a local problem (unreadable file, …).
    Local = 1,
    /// 2: the server answered 404.
    NotFound = 2,
    /// 3: no key, or the server answered 401/403.
    Auth = 3,
    /// 4: the server answered 409 or 412.
    Conflict = 4,
    /// 5: any other 4xx, or lines of an import that failed.
    Invalid = 5,
    /// 6: a 5xx, an unreachable server, or an unreadable answer.
    Server = 6,
}

impl Failure {
    pub fn from_status(status: StatusCode) -> Self {
        match status.as_u16() {
            404 => Self::NotFound,
            401 | 403 => Self::Auth,
            409 | 412 => Self::Conflict,
            400..=499 => Self::Invalid,
            _ => Self::Server,
        }
    }

    pub fn exit_code(self) -> u8 {
        self as u8
    }
}

/// An error of a client command; `main` turns its kind into the exit code.
#[derive(Debug)]
pub struct CliError {
    pub kind: Failure,
    /// The HTTP status, when the server answered.
    pub status: Option<StatusCode>,
    pub message: String,
}

impl CliError {
    pub fn new(kind: Failure, message: impl Into<String>) -> Self {
        Self { kind, status: None, message: message.into() }
    }

    pub fn local(message: impl Into<String>) -> Self {
        Self::new(Failure::Local, message)
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.status {
            Some(s) => write!(f, "{} (HTTP {})", self.message, s.as_u16()),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for CliError {}

pub type CliResult<T> = Result<T, CliError>;

/// The exit code for any error `cli::run` returns: a `CliError`'s kind, else 1.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    e.downcast_ref::<CliError>().map_or(Failure::Local.exit_code(), |c| c.kind.exit_code())
}

/// A successful answer: status, headers and the JSON body (`Null` when empty).
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Value,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// A server and the key to talk to it with.
pub struct ApiClient {
    base: String,
    key: Secret,
    http: reqwest::Client,
}

impl fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiClient").field("base", &self.base).field("key", &self.key).finish()
    }
}

fn read_key(args: &ClientArgs) -> CliResult<Secret> {
    let key = match &args.api_key_file {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| CliError::local(format!("cannot read the API key file {}: {e}", path.display())))?,
        None => std::env::var(API_KEY_ENV).unwrap_or_default(),
    };
    let key = key.trim();
    if key.is_empty() {
        return Err(CliError::new(Failure::Auth, format!("no API key: set {API_KEY_ENV} or pass --api-key-file PATH")));
    }
    Ok(Secret::new(key))
}

/// The server's base URL (checked) and the API key, as every client command reads them.
pub fn url_and_key(args: &ClientArgs) -> CliResult<(String, Secret)> {
    let key = read_key(args)?;
    let base = args.url.trim_end_matches('/').to_owned();
    if !(base.starts_with("http://") || base.starts_with("https://")) {
        return Err(CliError::local(format!("--url must start with http:// or https://, not {base:?}")));
    }
    Ok((base, key))
}

impl ApiClient {
    pub fn new(args: &ClientArgs) -> CliResult<Self> {
        let (base, key) = url_and_key(args)?;
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(120))
            .user_agent(concat!("combee-cli/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| CliError::local(format!("cannot build an HTTP client: {e}")))?;
        Ok(Self { base, key, http })
    }

    /// A request to `path` (under the base URL) carrying the key.
    pub fn request(&self, method: Method, path: &str) -> RequestBuilder {
        self.http.request(method, format!("{}{path}", self.base)).bearer_auth(self.key.expose())
    }

    pub async fn get(&self, path: &str) -> CliResult<Answer> {
        self.send(self.request(Method::GET, path)).await
    }

    pub async fn send_json(&self, method: Method, path: &str, body: &impl Serialize) -> CliResult<Answer> {
        self.send(self.request(method, path).json(body)).await
    }

    /// Sends the request; a non-2xx answer becomes a `CliError` carrying the
    /// problem's `detail`.
    pub async fn send(&self, req: RequestBuilder) -> CliResult<Answer> {
        let res = req.send().await.map_err(|e| network_error(&self.base, &e))?;
        let status = res.status();
        let headers = res.headers().clone();
        let bytes = res
            .bytes()
            .await
            .map_err(|e| CliError::new(Failure::Server, format!("reading the answer from {}: {e}", self.base)))?;
        if !status.is_success() {
            return Err(CliError { kind: Failure::from_status(status), status: Some(status), message: detail(&bytes) });
        }
        let body = if bytes.iter().all(u8::is_ascii_whitespace) {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .map_err(|e| CliError::new(Failure::Server, format!("the server's answer is not JSON: {e}")))?
        };
        Ok(Answer { status, headers, body })
    }

    /// Follows `next_page_token` and gathers every item of `field`.
    pub async fn get_all(&self, path: &str, field: &str) -> CliResult<Vec<Value>> {
        let sep = if path.contains('?') { '&' } else { '?' };
        let mut items = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let url = match &token {
                Some(t) => format!("{path}{sep}page_size=200&page_token={}", encode(t)),
                None => format!("{path}{sep}page_size=200"),
            };
            let mut page = self.get(&url).await?.body;
            if let Some(Value::Array(more)) = page.get_mut(field).map(Value::take) {
                items.extend(more);
            }
            match page.get("next_page_token").and_then(Value::as_str) {
                Some(t) if !t.is_empty() => token = Some(t.to_owned()),
                _ => return Ok(items),
            }
        }
    }
}

pub(crate) fn network_error(base: &str, e: &reqwest::Error) -> CliError {
    let what = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "cannot connect"
    } else {
        "request failed"
    };
    // reqwest's Display names the URL, never the headers, so the key stays out.
    CliError::new(Failure::Server, format!("{what}: {base}: {e}"))
}

/// The RFC 9457 `detail` of an error answer, or a short excerpt of whatever came.
pub fn detail(body: &[u8]) -> String {
    if let Ok(v) = serde_json::from_slice::<Value>(body)
        && let Some(d) = v.get("detail").and_then(Value::as_str)
    {
        return d.to_owned();
    }
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.is_empty() { "the server gave no detail".to_owned() } else { text.chars().take(300).collect() }
}

/// Percent-encodes a path segment or query value.
pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Prints a value as pretty JSON on stdout.
pub fn print_json(v: &Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string()));
}

/// Left-aligned columns sized to their widest cell; the last column is not padded.
pub fn print_table(headers: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let last = cells.len().saturating_sub(1);
        let mut out = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i == last {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<w$}  "));
            }
        }
        println!("{}", out.trim_end());
    };
    line(headers.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

/// A JSON field as table text: strings bare, null as `-`.
pub fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".to_owned(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// An RFC 3339 timestamp shortened to the second, in UTC.
pub fn when(v: &Value) -> String {
    match v.as_str().and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok()) {
        Some(t) => t.with_timezone(&chrono::Utc).format("%Y-%m-%d %H:%M:%S").to_string(),
        None => cell(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_the_documented_exit_codes() {
        let code = |s: u16| Failure::from_status(StatusCode::from_u16(s).unwrap()).exit_code();
        assert_eq!([code(404), code(401), code(403), code(409), code(412)], [2, 3, 3, 4, 4]);
        assert_eq!([code(400), code(413), code(422), code(429)], [5, 5, 5, 5]);
        assert_eq!([code(500), code(503)], [6, 6]);
        assert_eq!(exit_code(&anyhow::anyhow!("plain")), 1);
        assert_eq!(exit_code(&CliError::new(Failure::Conflict, "x").into()), 4);
    }

    #[test]
    fn detail_prefers_the_problem_field() {
        assert_eq!(detail(br#"{"type":"t","status":404,"detail":"prompt \"x\" not found"}"#), "prompt \"x\" not found");
        assert_eq!(detail(b"  "), "the server gave no detail");
        assert_eq!(detail(b"Bad Gateway"), "Bad Gateway");
    }

    #[test]
    fn encode_keeps_unreserved_and_escapes_the_rest() {
        assert_eq!(encode("support-agent_1.x~"), "support-agent_1.x~");
        assert_eq!(encode("a b/c?"), "a%20b%2Fc%3F");
    }
}
