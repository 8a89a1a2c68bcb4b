//! OTLP/HTTP ingest: agents that already export OpenTelemetry GenAI spans and
//! log events send them to combee unchanged. This module decodes an export
//! request of either signal (protobuf or the OTLP JSON mapping, optionally
//! gzip- or deflate-compressed) and encodes its answer; [`mapping`] turns a
//! trace id's spans and log records into a trace, [`logs`] cuts a logs export
//! into records. Nothing here touches the network or the store.

pub mod logs;
pub mod mapping;

use std::io::Read;

use opentelemetry_proto::tonic::collector::{
    logs::v1::{ExportLogsPartialSuccess, ExportLogsServiceResponse},
    trace::v1::{ExportTracePartialSuccess, ExportTraceServiceRequest, ExportTraceServiceResponse},
};
use prost::Message;

/// The OTLP signals combee takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Traces,
    Logs,
}

impl Signal {
    /// The export request's message name.
    pub fn request(self) -> &'static str {
        match self {
            Self::Traces => "ExportTraceServiceRequest",
            Self::Logs => "ExportLogsServiceRequest",
        }
    }

    /// The request's one member in the OTLP JSON encoding.
    fn json_member(self) -> &'static str {
        match self {
            Self::Traces => "resourceSpans",
            Self::Logs => "resourceLogs",
        }
    }

    /// What the answer counts: spans or log records.
    pub fn unit(self) -> &'static str {
        match self {
            Self::Traces => "span(s)",
            Self::Logs => "log record(s)",
        }
    }
}

/// How the request body (and so the answer) is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// `application/x-protobuf`
    Protobuf,
    /// `application/json`, the OTLP JSON mapping (hex ids, lowerCamelCase).
    Json,
}

impl Encoding {
    /// From a `Content-Type` header value; parameters such as `charset` are ignored.
    pub fn from_content_type(value: Option<&str>) -> Result<Self, DecodeError> {
        let Some(value) = value else { return Err(DecodeError::ContentType(None)) };
        let mime = value.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
        match mime.as_str() {
            "application/x-protobuf" | "application/protobuf" => Ok(Self::Protobuf),
            "application/json" => Ok(Self::Json),
            _ => Err(DecodeError::ContentType(Some(clip(value, 80)))),
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Self::Protobuf => "application/x-protobuf",
            Self::Json => "application/json",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Protobuf => "protobuf",
            Self::Json => "json",
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DecodeError {
    #[error(
        "send OTLP exports as `Content-Type: application/x-protobuf` or `application/json`{}",
        .0.as_ref().map(|c| format!(" (got `{c}`)")).unwrap_or_default()
    )]
    ContentType(Option<String>),
    #[error("unsupported `Content-Encoding: {0}`; send the body uncompressed, `gzip` or `deflate`")]
    ContentEncoding(String),
    #[error("the decompressed body exceeds {limit} bytes (`limits.max_body_bytes`)")]
    TooLarge { limit: usize },
    #[error("the body is not valid {format}: {reason}")]
    Compressed { format: &'static str, reason: String },
    #[error("the body is not an OTLP {message} in protobuf: {reason}")]
    Protobuf { message: &'static str, reason: String },
    #[error("the body is not an OTLP {message} in the OTLP JSON encoding: {reason}")]
    Json { message: &'static str, reason: String },
}

impl DecodeError {
    /// Size violations are answered with 413, unknown media types with 415, the rest with 400.
    pub fn is_size(&self) -> bool {
        matches!(self, Self::TooLarge { .. })
    }
    pub fn is_media_type(&self) -> bool {
        matches!(self, Self::ContentType(_) | Self::ContentEncoding(_))
    }
}

/// Shortens an attacker-influenced string before it goes into an answer.
fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Undoes `Content-Encoding` (absent, `identity`, `gzip` or `deflate`), refusing
/// to inflate past `limit` bytes (a small compressed body can expand enormously).
pub fn decompress(encoding: Option<&str>, body: &[u8], limit: usize) -> Result<Vec<u8>, DecodeError> {
    let encoding = encoding.map(|e| e.trim().to_ascii_lowercase());
    match encoding.as_deref() {
        None | Some("") | Some("identity") => {
            if body.len() > limit {
                return Err(DecodeError::TooLarge { limit });
            }
            Ok(body.to_vec())
        }
        Some("gzip") | Some("x-gzip") => inflate(flate2::read::GzDecoder::new(body), "gzip", limit),
        // HTTP's `deflate` is the zlib format (RFC 9110), which exporters send.
        Some("deflate") => inflate(flate2::read::ZlibDecoder::new(body), "deflate", limit),
        Some(other) => Err(DecodeError::ContentEncoding(clip(other, 40))),
    }
}

fn inflate(decoder: impl Read, format: &'static str, limit: usize) -> Result<Vec<u8>, DecodeError> {
    let mut out = Vec::new();
    decoder
        .take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| DecodeError::Compressed { format, reason: clip(&e.to_string(), 200) })?;
    if out.len() > limit {
        return Err(DecodeError::TooLarge { limit });
    }
    Ok(out)
}

/// Decodes an (already decompressed) trace export request.
pub fn decode_request(encoding: Encoding, body: &[u8]) -> Result<ExportTraceServiceRequest, DecodeError> {
    decode_export(Signal::Traces, encoding, body)
}

/// Decodes an (already decompressed) export request of `signal`.
pub fn decode_export<M>(signal: Signal, encoding: Encoding, body: &[u8]) -> Result<M, DecodeError>
where
    M: Message + Default + serde::de::DeserializeOwned,
{
    let message = signal.request();
    match encoding {
        Encoding::Protobuf => {
            M::decode(body).map_err(|e| DecodeError::Protobuf { message, reason: clip(&e.to_string(), 200) })
        }
        Encoding::Json => {
            let json = |e: serde_json::Error| DecodeError::Json { message, reason: clip(&e.to_string(), 200) };
            let value: serde_json::Value = serde_json::from_slice(body).map_err(json)?;
            // serde would also read a message written as an array; OTLP JSON writes
            // messages as objects only, so the request and its resource items must be.
            let member = signal.json_member();
            let shape = match &value {
                serde_json::Value::Object(o) => match o.get(member) {
                    None | Some(serde_json::Value::Null) => Ok(()),
                    Some(serde_json::Value::Array(items)) if items.iter().all(serde_json::Value::is_object) => Ok(()),
                    Some(_) => Err(format!("`{member}` must be an array of objects")),
                },
                _ => Err("the body must be a JSON object".to_owned()),
            };
            shape.map_err(|reason| DecodeError::Json { message, reason })?;
            serde_json::from_value(value).map_err(json)
        }
    }
}

/// The OTLP answer: `partial_success` is set only when some records were
/// rejected, or with 0 rejected to carry a warning (as OTLP allows).
pub fn encode_response(encoding: Encoding, rejected_spans: usize, error_message: &str) -> Vec<u8> {
    encode_answer(Signal::Traces, encoding, rejected_spans, error_message)
}

/// [`encode_response`] for either signal: `rejected_spans` or `rejected_log_records`.
pub fn encode_answer(signal: Signal, encoding: Encoding, rejected: usize, error_message: &str) -> Vec<u8> {
    let partial = rejected > 0 || !error_message.is_empty();
    let error_message = error_message.to_owned();
    match (encoding, signal) {
        (Encoding::Protobuf, Signal::Traces) => {
            let partial_success =
                partial.then_some(ExportTracePartialSuccess { rejected_spans: rejected as i64, error_message });
            ExportTraceServiceResponse { partial_success }.encode_to_vec()
        }
        (Encoding::Protobuf, Signal::Logs) => {
            let partial_success =
                partial.then_some(ExportLogsPartialSuccess { rejected_log_records: rejected as i64, error_message });
            ExportLogsServiceResponse { partial_success }.encode_to_vec()
        }
        // Written by hand: the OTLP JSON mapping carries int64 as a string,
        // which the crate's serde support does not do for the counts.
        (Encoding::Json, _) => {
            let count = match signal {
                Signal::Traces => "rejectedSpans",
                Signal::Logs => "rejectedLogRecords",
            };
            let body = if partial {
                serde_json::json!({"partialSuccess": {count: rejected.to_string(), "errorMessage": error_message}})
            } else {
                serde_json::json!({})
            };
            body.to_string().into_bytes()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn content_types_are_recognised_with_parameters() {
        assert_eq!(Encoding::from_content_type(Some("application/x-protobuf")), Ok(Encoding::Protobuf));
        assert_eq!(Encoding::from_content_type(Some("Application/JSON; charset=utf-8")), Ok(Encoding::Json));
        assert!(Encoding::from_content_type(Some("text/plain")).unwrap_err().is_media_type());
        assert!(Encoding::from_content_type(None).unwrap_err().is_media_type());
    }

    #[test]
    fn gzip_is_inflated_within_the_limit_only() {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(&vec![b'a'; 10_000]).unwrap();
        let small = gz.finish().unwrap();
        assert!(small.len() < 200, "a bomb-like body compresses well");
        assert_eq!(decompress(Some("gzip"), &small, 10_000).unwrap().len(), 10_000);
        assert_eq!(decompress(Some("GZIP"), &small, 9_999), Err(DecodeError::TooLarge { limit: 9_999 }));
        assert!(matches!(
            decompress(Some("gzip"), b"not gzip", 100),
            Err(DecodeError::Compressed { format: "gzip", .. })
        ));
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        z.write_all(b"hello").unwrap();
        assert_eq!(decompress(Some("deflate"), &z.finish().unwrap(), 5).unwrap(), b"hello");
        assert!(decompress(Some("br"), b"x", 100).unwrap_err().is_media_type());
        assert_eq!(decompress(None, b"xyz", 3).unwrap(), b"xyz");
        assert!(decompress(Some("identity"), b"xyz", 2).unwrap_err().is_size());
    }

    #[test]
    fn garbage_is_a_decode_error_not_a_panic() {
        assert!(matches!(decode_request(Encoding::Protobuf, &[0xff, 0xff, 0xff]), Err(DecodeError::Protobuf { .. })));
        assert!(matches!(decode_request(Encoding::Json, b"{\"resourceSpans\": 3}"), Err(DecodeError::Json { .. })));
        assert_eq!(decode_request(Encoding::Json, b"{}").unwrap(), ExportTraceServiceRequest::default());
        // Messages are objects in OTLP JSON, never arrays (which serde alone would take).
        for bad in [&b"null"[..], b"[]", b"{\"resourceSpans\": [[]]}", b"{\"resourceSpans\": [1]}"] {
            assert!(matches!(decode_request(Encoding::Json, bad), Err(DecodeError::Json { .. })), "{bad:?}");
        }
        assert!(decode_request(Encoding::Json, b"{\"resourceSpans\": [{}], \"other\": 1}").is_ok());
    }

    #[test]
    fn the_otlp_json_mapping_decodes_hex_ids_and_string_int64s() {
        // Shaped like the example in the OTLP specification.
        let body = br#"{"resourceSpans": [{
            "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "agent"}}]},
            "scopeSpans": [{"scope": {"name": "s"}, "spans": [{
                "traceId": "5B8EFFF798038103D269B633813FC60C",
                "spanId": "eee19b7ec3c1b174",
                "parentSpanId": "",
                "name": "chat",
                "kind": 3,
                "startTimeUnixNano": "1544712660000000000",
                "endTimeUnixNano": 1544712661000000000,
                "attributes": [
                    {"key": "gen_ai.prompt.version", "value": {"intValue": "4"}},
                    {"key": "score", "value": {"doubleValue": 0.5}}
                ],
                "events": [{"timeUnixNano": "1544712660500000000", "name": "gen_ai.user.message",
                            "attributes": [{"key": "content", "value": {"stringValue": "hi"}}]}],
                "status": {"code": 2, "message": "boom"},
                "someFutureField": true
            }]}]
        }]}"#;
        let req = decode_request(Encoding::Json, body).unwrap();
        let span = &req.resource_spans[0].scope_spans[0].spans[0];
        assert_eq!(hex::encode(&span.trace_id), "5b8efff798038103d269b633813fc60c");
        assert_eq!(span.span_id.len(), 8);
        assert!(span.parent_span_id.is_empty());
        assert_eq!((span.start_time_unix_nano, span.end_time_unix_nano), (1544712660000000000, 1544712661000000000));
        use opentelemetry_proto::tonic::common::v1::any_value::Value;
        assert_eq!(span.attributes[0].value.as_ref().unwrap().value, Some(Value::IntValue(4)));
        assert_eq!(span.events[0].name, "gen_ai.user.message");
        assert_eq!(span.status.as_ref().map(|s| s.code), Some(2));
        // The same request in protobuf round-trips.
        let proto = req.encode_to_vec();
        assert_eq!(decode_request(Encoding::Protobuf, &proto).unwrap(), req);
    }

    #[test]
    fn responses_carry_partial_success_only_when_spans_were_rejected() {
        let full = encode_response(Encoding::Protobuf, 0, "");
        assert_eq!(ExportTraceServiceResponse::decode(full.as_slice()).unwrap().partial_success, None);
        let warning = encode_response(Encoding::Protobuf, 0, "held");
        let ps = ExportTraceServiceResponse::decode(warning.as_slice()).unwrap().partial_success.unwrap();
        assert_eq!((ps.rejected_spans, ps.error_message.as_str()), (0, "held"));
        let partial = encode_response(Encoding::Protobuf, 3, "why");
        let ps = ExportTraceServiceResponse::decode(partial.as_slice()).unwrap().partial_success.unwrap();
        assert_eq!((ps.rejected_spans, ps.error_message.as_str()), (3, "why"));
        let json: serde_json::Value = serde_json::from_slice(&encode_response(Encoding::Json, 2, "why")).unwrap();
        assert_eq!(json, serde_json::json!({"partialSuccess": {"rejectedSpans": "2", "errorMessage": "why"}}));
    }
}
