//! OTLP log ingest against the real server on both stores: GenAI events sent
//! as log records join the spans of their trace across exports and signals
//! (held until the trace maps, merged after, refused once a round took it),
//! in protobuf and JSON; ordinary log lines and records without a trace id
//! are a partial success; the same auth and body rules as spans.

use crate::common;

use common::{Backend, TestApp, expect_problem, spawn_app};
use opentelemetry_proto::tonic::{
    collector::{
        logs::v1::{ExportLogsServiceRequest, ExportLogsServiceResponse},
        trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse},
    },
    common::v1::{AnyValue, KeyValue, KeyValueList, any_value::Value as Any},
    logs::v1::{LogRecord, ResourceLogs, ScopeLogs},
    resource::v1::Resource,
    trace::v1::{ResourceSpans, ScopeSpans, Span},
};
use prost::Message;
use serde_json::{Value, json};

const LOGS: &str = "/v1/otlp/v1/logs";
const SPANS: &str = "/v1/otlp/v1/traces";
const T0: u64 = 1_700_000_000_000_000_000;

fn kv(key: &str, v: Any) -> KeyValue {
    KeyValue { key: key.into(), value: Some(AnyValue { value: Some(v) }), ..Default::default() }
}

fn s(key: &str, v: &str) -> KeyValue {
    kv(key, Any::StringValue(v.into()))
}

fn resource(prompt: &str) -> Option<Resource> {
    Some(Resource {
        attributes: vec![s("combee.prompt", prompt), s("service.name", "log-agent")],
        ..Default::default()
    })
}

/// The chat span of a model call, without content (as openai-v2 sends it when content goes to events).
fn chat_span(trace: u8, prompt: &str) -> ExportTraceServiceRequest {
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: resource(prompt),
            scope_spans: vec![ScopeSpans {
                spans: vec![Span {
                    trace_id: vec![trace; 16],
                    span_id: vec![trace; 8],
                    name: "chat sim".into(),
                    start_time_unix_nano: T0,
                    end_time_unix_nano: T0 + 50_000_000,
                    attributes: vec![s("gen_ai.operation.name", "chat"), s("gen_ai.request.model", "sim")],
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        }],
    }
}

fn event(trace: u8, at_ms: u64, name: &str, body: Vec<KeyValue>) -> LogRecord {
    LogRecord {
        trace_id: vec![trace; 16],
        span_id: vec![trace; 8],
        observed_time_unix_nano: T0 + at_ms * 1_000_000,
        event_name: name.into(),
        attributes: vec![s("gen_ai.system", "openai")],
        body: Some(AnyValue { value: Some(Any::KvlistValue(KeyValueList { values: body })) }),
        ..Default::default()
    }
}

/// The events of one model call: the user's message, then the choice.
fn call_events(trace: u8, question: &str, answer: &str) -> Vec<LogRecord> {
    let message = Any::KvlistValue(KeyValueList { values: vec![s("role", "assistant"), s("content", answer)] });
    vec![
        event(trace, 1, "gen_ai.user.message", vec![s("content", question)]),
        event(
            trace,
            40,
            "gen_ai.choice",
            vec![kv("index", Any::IntValue(0)), s("finish_reason", "stop"), kv("message", message)],
        ),
    ]
}

fn logs(prompt: &str, records: Vec<LogRecord>) -> ExportLogsServiceRequest {
    ExportLogsServiceRequest {
        resource_logs: vec![ResourceLogs {
            resource: resource(prompt),
            scope_logs: vec![ScopeLogs { log_records: records, ..Default::default() }],
            ..Default::default()
        }],
    }
}

async fn post(app: &TestApp, path: &str, body: Vec<u8>) -> reqwest::Response {
    app.http
        .post(app.url(path))
        .bearer_auth(&app.admin_key)
        .header("content-type", "application/x-protobuf")
        .body(body)
        .send()
        .await
        .unwrap()
}

async fn send_logs(app: &TestApp, req: &ExportLogsServiceRequest) -> Option<(i64, String)> {
    let res = post(app, LOGS, req.encode_to_vec()).await;
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-type"], "application/x-protobuf");
    let answer = ExportLogsServiceResponse::decode(res.bytes().await.unwrap()).expect("an ExportLogsServiceResponse");
    answer.partial_success.map(|p| (p.rejected_log_records, p.error_message))
}

async fn send_spans(app: &TestApp, req: &ExportTraceServiceRequest) -> Option<(i64, String)> {
    let res = post(app, SPANS, req.encode_to_vec()).await;
    assert_eq!(res.status(), 200);
    let answer = ExportTraceServiceResponse::decode(res.bytes().await.unwrap()).unwrap();
    answer.partial_success.map(|p| (p.rejected_spans, p.error_message))
}

async fn traces(app: &TestApp, prompt: &str) -> Vec<Value> {
    let page: Value = app.get(&format!("/v1/traces?prompt={prompt}")).send().await.unwrap().json().await.unwrap();
    page["traces"].as_array().unwrap().clone()
}

async fn log_events_complete_a_held_span(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("log-agent").await;
    // Span first: it names the prompt (its resource) but has no content, so it is held.
    let (rejected, warning) = send_spans(&app, &chat_span(1, "log-agent")).await.expect("a warning");
    assert_eq!(rejected, 0);
    assert!(warning.contains("held 1 span(s)") && warning.contains("no input"), "{warning}");
    assert!(traces(&app, "log-agent").await.is_empty());

    // Its log events arrive: one trace, the span's step holding the messages.
    let events = logs("log-agent", call_events(1, "where is order 7?", "it shipped"));
    assert_eq!(send_logs(&app, &events).await, None, "everything accepted");
    let stored = traces(&app, "log-agent").await;
    assert_eq!(stored.len(), 1);
    let t = &stored[0];
    assert_eq!(t["external_id"], "01".repeat(16));
    assert_eq!(t["input"], json!([{"role": "user", "content": "where is order 7?"}]));
    assert_eq!(t["output"][0]["message"]["content"], "it shipped");
    assert_eq!(t["trajectory"].as_array().unwrap().len(), 1, "{t}");
    assert_eq!(t["trajectory"][0]["name"], "chat sim");

    // A retry of the same log export stores nothing twice.
    assert_eq!(send_logs(&app, &events).await, None);
    assert_eq!(traces(&app, "log-agent").await.len(), 1);

    // Logs first, the span later: the logs make the trace, the span joins it in place.
    assert_eq!(send_logs(&app, &logs("log-agent", call_events(2, "refund?", "sure"))).await, None);
    let first = traces(&app, "log-agent").await.into_iter().find(|t| t["external_id"] == "02".repeat(16)).unwrap();
    assert_eq!(first["trajectory"][0]["name"], "log records (gen_ai.user.message)");
    assert_eq!(send_spans(&app, &chat_span(2, "log-agent")).await, None);
    let after = traces(&app, "log-agent").await.into_iter().find(|t| t["external_id"] == "02".repeat(16)).unwrap();
    assert_eq!((after["id"].clone(), after["trajectory"][0]["name"].clone()), (first["id"].clone(), json!("chat sim")));
    assert_eq!(after["input"], json!([{"role": "user", "content": "refund?"}]));

    // An evaluation arriving later as a log record becomes the trace's feedback.
    let eval = LogRecord {
        trace_id: vec![2; 16],
        span_id: vec![2; 8],
        observed_time_unix_nano: T0 + 900_000_000,
        event_name: "gen_ai.evaluation.result".into(),
        attributes: vec![
            s("gen_ai.evaluation.name", "helpfulness"),
            kv("gen_ai.evaluation.score.value", Any::DoubleValue(0.25)),
            s("gen_ai.evaluation.score.label", "fail"),
            s("gen_ai.evaluation.explanation", "did not ask for the order id"),
        ],
        ..Default::default()
    };
    assert_eq!(send_logs(&app, &logs("log-agent", vec![eval])).await, None);
    let t = app.get(&format!("/v1/traces/{}", after["id"].as_str().unwrap())).send().await.unwrap();
    let t: Value = t.json().await.unwrap();
    assert_eq!(t["feedback"], json!({"score": 0.25, "success": false, "comment": "did not ask for the order id"}));
}

async fn other_log_records_are_a_partial_success(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("log-agent").await;
    let plain = LogRecord {
        trace_id: vec![3; 16],
        span_id: vec![3; 8],
        severity_text: "INFO".into(),
        body: Some(AnyValue { value: Some(Any::StringValue("GET /health 200".into())) }),
        ..Default::default()
    };
    let mut no_trace = call_events(4, "q", "a").remove(0);
    no_trace.trace_id.clear();
    let mut records = call_events(5, "q", "a");
    records.extend([plain, no_trace]);
    let (rejected, message) = send_logs(&app, &logs("log-agent", records.clone())).await.expect("partial success");
    assert_eq!(rejected, 2);
    assert!(message.contains("not a GenAI event") && message.contains("no valid trace id"), "{message}");
    assert_eq!(traces(&app, "log-agent").await.len(), 1);

    // The same in the OTLP JSON encoding: the count is an int64, so a string.
    let body = serde_json::to_vec(&logs("log-agent", records)).unwrap();
    let res = app
        .http
        .post(app.url(LOGS))
        .bearer_auth(&app.admin_key)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let answer: Value = res.json().await.unwrap();
    assert_eq!(answer["partialSuccess"]["rejectedLogRecords"], "2", "{answer}");

    // Same key scope and body rules as spans.
    let res = app.http.post(app.url(LOGS)).header("content-type", "application/x-protobuf").body(vec![]).send().await;
    expect_problem(res.unwrap(), 401).await;
    let res = post(&app, LOGS, vec![0xff, 0xff, 0xff]).await;
    let detail = expect_problem(res, 400).await;
    assert!(detail["detail"].as_str().unwrap().contains("ExportLogsServiceRequest"), "{detail}");
    let doc: Value = app.get("/v1/openapi.json").send().await.unwrap().json().await.unwrap();
    assert!(doc["paths"][LOGS]["post"]["requestBody"]["content"]["application/x-protobuf"].is_object());
}

on_both_stores!(log_events_complete_a_held_span, other_log_records_are_a_partial_success);
