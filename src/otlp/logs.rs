//! OTLP log records carrying GenAI events: the content of a model call when
//! an instrumentation sends it as events rather than span attributes
//! (`gen_ai.client.inference.operation.details`, the older
//! `gen_ai.{system,user,assistant,tool}.message` and `gen_ai.choice`), and
//! evaluation results (`gen_ai.evaluation.result`). Each record joins its
//! trace by trace id and its span by span id: it is stored beside the trace
//! id's spans and the trace is mapped again from the union, under the same
//! merge, hold and late-arrival rules as spans.
//!
//! A log record has no id of its own; it is stored under a hash of its
//! content (with its resource and scope), so an exporter's retry of the same
//! records stores nothing twice.

use opentelemetry_proto::tonic::{
    collector::logs::v1::ExportLogsServiceRequest,
    common::v1::KeyValue,
    logs::v1::{LogRecord, ResourceLogs, ScopeLogs},
};
use sha2::{Digest, Sha256};

use super::mapping::{Rejection, SpanGroup, group_by_trace, records, valid_trace_id};
use crate::domain::span::OtlpSpan;

/// Whether a log record speaks the GenAI (or combee) conventions: an event
/// named `gen_ai.*`, or an attribute `gen_ai.*` / `combee.*`. Other log
/// records (an application's ordinary logs sent to the same endpoint) are
/// not combee's to keep.
fn is_generative(log: &LogRecord) -> bool {
    let ours =
        |attrs: &[KeyValue]| attrs.iter().any(|kv| kv.key.starts_with("gen_ai.") || kv.key.starts_with("combee."));
    records::event_name(log).is_some_and(|n| n.starts_with("gen_ai.")) || ours(&log.attributes)
}

/// Splits a logs export into its trace ids' GenAI log records, in the order
/// each trace id first appears, each encoded for the store. Records without a
/// trace id, and records that are no GenAI events, are rejected with a reason.
pub fn split_request(req: &ExportLogsServiceRequest) -> (Vec<SpanGroup>, Vec<Rejection>) {
    let (mut no_trace, mut not_generative) = (0, 0);
    let mut items = Vec::new();
    for rl in &req.resource_logs {
        for sl in &rl.scope_logs {
            for log in &sl.log_records {
                if !is_generative(log) {
                    not_generative += 1;
                    continue;
                }
                if !valid_trace_id(&log.trace_id) {
                    no_trace += 1;
                    continue;
                }
                let one = ResourceLogs {
                    resource: rl.resource.clone(),
                    schema_url: rl.schema_url.clone(),
                    scope_logs: vec![ScopeLogs {
                        scope: sl.scope.clone(),
                        schema_url: sl.schema_url.clone(),
                        log_records: vec![log.clone()],
                    }],
                };
                let body = records::encode_log(one);
                let key = format!("log-{}", &hex::encode(Sha256::digest(&body))[..32]);
                items.push((log.trace_id.clone(), OtlpSpan { span_id: key, body }));
            }
        }
    }
    let mut rejected = Vec::new();
    if no_trace > 0 {
        rejected.push(Rejection {
            trace_id: None,
            spans: no_trace,
            reason: "no valid trace id (16 bytes, not all zero): a GenAI log record joins its trace by trace id, \
                     so emit it while the span of the model call is current"
                .into(),
        });
    }
    if not_generative > 0 {
        rejected.push(Rejection {
            trace_id: None,
            spans: not_generative,
            reason: "not a GenAI event (no `gen_ai.*` event name and no `gen_ai.*` or `combee.*` attribute); \
                     combee keeps only those"
                .into(),
        });
    }
    (group_by_trace(items), rejected)
}

/// The number of log records in an export (for the answer's counts).
pub fn count(req: &ExportLogsServiceRequest) -> usize {
    req.resource_logs.iter().flat_map(|rl| &rl.scope_logs).map(|sl| sl.log_records.len()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_proto::tonic::common::v1::{AnyValue, any_value::Value as Any};

    fn log(trace: u8, event: &str, attrs: Vec<KeyValue>) -> LogRecord {
        LogRecord {
            trace_id: vec![trace; 16],
            span_id: vec![trace; 8],
            event_name: event.into(),
            attributes: attrs,
            body: Some(AnyValue { value: Some(Any::StringValue("hi".into())) }),
            ..Default::default()
        }
    }

    fn export(logs: Vec<LogRecord>) -> ExportLogsServiceRequest {
        ExportLogsServiceRequest {
            resource_logs: vec![ResourceLogs {
                scope_logs: vec![ScopeLogs { log_records: logs, ..Default::default() }],
                ..Default::default()
            }],
        }
    }

    #[test]
    fn genai_records_group_by_trace_with_stable_keys_and_the_rest_is_rejected() {
        let plain = log(1, "", vec![]);
        let mut no_trace = log(2, "gen_ai.user.message", vec![]);
        no_trace.trace_id = vec![0; 16];
        let req = export(vec![
            log(1, "gen_ai.user.message", vec![]),
            plain,
            no_trace,
            log(3, "gen_ai.choice", vec![]),
            log(1, "gen_ai.choice", vec![]),
        ]);
        assert_eq!(count(&req), 5);
        let (groups, rejected) = split_request(&req);
        assert_eq!(groups.iter().map(|g| g.trace_id.as_str()).collect::<Vec<_>>(), ["01".repeat(16), "03".repeat(16)]);
        assert_eq!(groups[0].spans.len(), 2);
        assert!(groups[0].spans.iter().all(|s| s.span_id.starts_with("log-") && s.span_id.len() == 36));
        assert_ne!(groups[0].spans[0].span_id, groups[0].spans[1].span_id);
        let reasons: Vec<_> =
            rejected.iter().map(|r| (r.spans, r.reason.split(' ').take(3).collect::<Vec<_>>().join(" "))).collect();
        assert_eq!(reasons, [(1, "no valid trace".to_owned()), (1, "not a GenAI".to_owned())]);
        // The same export again gives the same keys: a retry stores nothing twice.
        assert_eq!(split_request(&req).0, groups);
    }
}
