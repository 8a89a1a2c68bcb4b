//! What the store keeps for each OTLP record of a trace id, and how a trace's
//! stored records become the spans the mapping reads.
//!
//! A span is kept as a `ResourceSpans` holding just that span (with its
//! resource and scope). A log record is kept as a `ResourceLogs` holding just
//! that record, inside an envelope whose only field has the number 1000, which
//! no `ResourceSpans` has: the two kinds cannot be mistaken for each other,
//! and the spans stored before log records existed read as they always did.
//!
//! When a trace is mapped, each log record becomes an event of the span it
//! names (its span id): GenAI log events carry the same content as the span
//! events of the older conventions, and read the same way. Log records whose
//! span has not arrived (or that name none) make a span of their own, so
//! their content counts until it does.

use std::collections::HashMap;

use opentelemetry_proto::tonic::{
    common::v1::{KeyValue, any_value::Value as Any},
    logs::v1::{LogRecord, ResourceLogs},
    trace::v1::{ResourceSpans, Span, span::Event},
};
use prost::Message;

use super::values::get;

/// The envelope of a stored log record (see the module comment).
#[derive(Clone, PartialEq, prost::Message)]
struct StoredLog {
    #[prost(message, optional, tag = "1000")]
    log: Option<ResourceLogs>,
}

/// Encodes a `ResourceLogs` holding one log record for the store.
pub(crate) fn encode_log(one: ResourceLogs) -> Vec<u8> {
    StoredLog { log: Some(one) }.encode_to_vec()
}

/// One span of a trace with its resource's attributes, in the order the
/// records were stored (the tie-break after start time).
pub(super) struct Record {
    pub span: Span,
    pub resource: Vec<KeyValue>,
    pub order: usize,
}

/// The name of a log record's event: the `event_name` field, else the older
/// `event.name` attribute.
pub(crate) fn event_name(log: &LogRecord) -> Option<&str> {
    if !log.event_name.is_empty() {
        return Some(&log.event_name);
    }
    match get(&log.attributes, "event.name") {
        Some(Any::StringValue(s)) if !s.is_empty() => Some(s),
        _ => None,
    }
}

/// A log record as a span event: its attributes, then the fields of its body
/// (a key-value body such as `{"content": …, "role": …}` spreads into the
/// event's attributes the way the span-event form of the conventions writes
/// them; another body is kept as `content`).
fn log_event(log: &LogRecord) -> Event {
    let name = event_name(log).unwrap_or_default().to_owned();
    let mut attributes: Vec<KeyValue> = Vec::new();
    match log.body.as_ref().and_then(|b| b.value.as_ref()) {
        Some(Any::KvlistValue(kv)) => attributes.extend(kv.values.iter().cloned()),
        Some(other) => attributes.push(KeyValue {
            key: "content".into(),
            value: Some(opentelemetry_proto::tonic::common::v1::AnyValue { value: Some(other.clone()) }),
            ..Default::default()
        }),
        None => {}
    }
    attributes.extend(log.attributes.iter().filter(|kv| kv.key != "event.name").cloned());
    Event { time_unix_nano: log_time(log), name, attributes, dropped_attributes_count: 0 }
}

/// When a log record happened: its timestamp, else when it was observed
/// (SDKs often leave the first unset).
pub(crate) fn log_time(log: &LogRecord) -> u64 {
    if log.time_unix_nano != 0 { log.time_unix_nano } else { log.observed_time_unix_nano }
}

/// Decodes a trace's stored bodies and joins its log records to their spans.
pub(super) fn decode_all(bodies: &[&[u8]]) -> Result<Vec<Record>, String> {
    let unreadable = || "a stored span or log record of this trace cannot be read".to_owned();
    let mut records: Vec<Record> = Vec::with_capacity(bodies.len());
    // (span id, resource, log record) in stored order.
    let mut logs: Vec<(Vec<u8>, Vec<KeyValue>, LogRecord)> = Vec::new();
    for body in bodies {
        let envelope = StoredLog::decode(*body).map_err(|_| unreadable())?;
        if let Some(rl) = envelope.log {
            let resource = rl.resource.map(|r| r.attributes).unwrap_or_default();
            for log in rl.scope_logs.into_iter().flat_map(|sl| sl.log_records) {
                logs.push((log.span_id.clone(), resource.clone(), log));
            }
            continue;
        }
        let rs = ResourceSpans::decode(*body).map_err(|_| unreadable())?;
        let resource = rs.resource.map(|r| r.attributes).unwrap_or_default();
        for span in rs.scope_spans.into_iter().flat_map(|ss| ss.spans) {
            records.push(Record { span, resource: resource.clone(), order: records.len() });
        }
    }
    if logs.is_empty() {
        return Ok(records);
    }
    // Log records in the order they happened (they are stored by a hash of
    // their content, so stored order says nothing within one export).
    logs.sort_by_key(|(_, _, log)| log_time(log));
    let by_span: HashMap<Vec<u8>, usize> =
        records.iter().enumerate().map(|(i, r)| (r.span.span_id.clone(), i)).collect();
    let mut orphans: Vec<(Vec<u8>, Record)> = Vec::new();
    for (span_id, resource, log) in logs {
        let event = log_event(&log);
        if let Some(&at) = by_span.get(&span_id) {
            records[at].span.events.push(event);
            continue;
        }
        let time = event.time_unix_nano;
        match orphans.iter_mut().find(|(id, _)| *id == span_id) {
            Some((_, r)) => {
                r.span.start_time_unix_nano = r.span.start_time_unix_nano.min(time);
                r.span.end_time_unix_nano = r.span.end_time_unix_nano.max(time);
                r.span.events.push(event);
            }
            None => {
                let span = Span {
                    trace_id: log.trace_id.clone(),
                    span_id: span_id.clone(),
                    name: format!("log records ({})", event.name),
                    start_time_unix_nano: time,
                    end_time_unix_nano: time,
                    events: vec![event],
                    ..Default::default()
                };
                orphans.push((span_id, Record { span, resource, order: 0 }));
            }
        }
    }
    for r in &mut records {
        r.span.events.sort_by_key(|e| e.time_unix_nano);
    }
    for (_, mut r) in orphans {
        r.order = records.len();
        records.push(r);
    }
    Ok(records)
}
