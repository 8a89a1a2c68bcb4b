//! The comparison server (`combee-bench bare`): a bare axum handler with a
//! fixed JSON body and no middleware, answering what combee answers, so a GET
//! figure's ratio to it is the cost of making the answer.

use std::net::SocketAddr;

use anyhow::Context;

/// The path the bare server answers: the prompt GET's own.
pub(crate) const BARE_PATH: &str = "/v1/prompts/bench";

pub(crate) async fn serve_bare(bind: SocketAddr, body_bytes: usize, headers: &[String]) -> anyhow::Result<()> {
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
}
