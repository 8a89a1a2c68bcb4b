//! A minimal keep-alive HTTP/1.1 client: enough for answers framed by
//! Content-Length, which is all combee and the bare handler send. One write,
//! one read, no pool layer, so the load generator costs little CPU.

use std::{fmt::Write as _, io, net::SocketAddr};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

pub(crate) struct HttpConn {
    stream: TcpStream,
    buf: Vec<u8>,
}

pub(crate) struct HttpAnswer {
    pub(crate) status: u16,
    body_start: usize,
}

impl HttpConn {
    pub(crate) async fn connect(addr: SocketAddr) -> io::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Self { stream, buf: Vec::with_capacity(16 * 1024) })
    }

    /// Sends one pre-encoded request and reads its whole answer into `self.buf`.
    pub(crate) async fn roundtrip(&mut self, request: &[u8]) -> io::Result<HttpAnswer> {
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
                return Ok(HttpAnswer { status, body_start: head_end + 4 });
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

    pub(crate) fn body(&self, answer: &HttpAnswer) -> &[u8] {
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

pub(crate) fn encode_request(method: &str, path: &str, addr: SocketAddr, key: &str, body: Option<&[u8]>) -> Vec<u8> {
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
pub(crate) async fn request_once(addr: SocketAddr, request: &[u8]) -> io::Result<(u16, Vec<u8>)> {
    let mut conn = HttpConn::connect(addr).await?;
    let answer = conn.roundtrip(request).await?;
    Ok((answer.status, conn.body(&answer).to_vec()))
}

/// The header lines of an answer (`name: value`), but those the server adds
/// to every answer itself (`content-length`, `date`).
pub(crate) async fn answer_headers(addr: SocketAddr, request: &[u8]) -> io::Result<Vec<String>> {
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

/// A GET of `path` naming its subject in `Combee-Subject`.
pub(crate) fn encode_get_with_subject(path: &str, addr: SocketAddr, key: &str, subject: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\nCombee-Subject: {subject}\r\n\r\n")
        .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_give_status_and_length() {
        let head = b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\nContent-Length: 42";
        assert_eq!(parse_head(head).unwrap(), (201, 42));
        assert_eq!(parse_head(b"HTTP/1.1 304 Not Modified\r\netag: \"x\"").unwrap(), (304, 0));
        assert!(parse_head(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked").is_err());
    }
}
