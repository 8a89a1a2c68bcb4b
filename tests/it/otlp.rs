//! OTLP/HTTP trace ingest against the real server on port 0, on both stores:
//! protobuf, the OTLP JSON encoding, gzip, partial success for spans that map
//! to no known prompt, auth, bad bodies, exporter retries, a trace split
//! across exports, re-sent spans, spans that arrive after a round; and the
//! acceptance test with the real OpenTelemetry Python SDK and its OTLP/HTTP exporter.

use crate::common;

use std::{
    io::Write,
    time::{Duration, Instant},
};

use common::{Backend, TestApp, expect_problem, learning, round_end, spawn_app, spawn_app_with, spawn_sim};
use opentelemetry_proto::tonic::{
    collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse},
    common::v1::{AnyValue, KeyValue, any_value::Value as Any},
    resource::v1::Resource,
    trace::v1::{ResourceSpans, ScopeSpans, Span},
};
use prost::Message;
use serde_json::{Value, json};

const PATH: &str = "/v1/otlp/v1/traces";

fn s(key: &str, v: &str) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue { value: Some(Any::StringValue(v.into())) }),
        ..Default::default()
    }
}

fn i(key: &str, v: i64) -> KeyValue {
    KeyValue { key: key.into(), value: Some(AnyValue { value: Some(Any::IntValue(v)) }), ..Default::default() }
}

fn span(trace: u8, id: u8, parent: Option<u8>, start_ms: u64, attrs: Vec<KeyValue>) -> Span {
    let start = 1_700_000_000_000_000_000 + start_ms * 1_000_000;
    Span {
        trace_id: vec![trace; 16],
        span_id: vec![id; 8],
        parent_span_id: parent.map(|p| vec![p; 8]).unwrap_or_default(),
        name: format!("span-{id}"),
        start_time_unix_nano: start,
        end_time_unix_nano: start + 5_000_000,
        attributes: attrs,
        ..Default::default()
    }
}

fn export(spans: Vec<Span>) -> ExportTraceServiceRequest {
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource { attributes: vec![s("service.name", "test-agent")], ..Default::default() }),
            scope_spans: vec![ScopeSpans { spans, ..Default::default() }],
            ..Default::default()
        }],
    }
}

/// One agent run: a root span with the prompt, a chat span with messages.
fn agent_run(trace: u8, prompt: &str, version: i64) -> Vec<Span> {
    vec![
        span(trace, 1, None, 0, vec![s("gen_ai.prompt.name", prompt), i("gen_ai.prompt.version", version)]),
        span(
            trace,
            2,
            Some(1),
            1,
            vec![
                s(
                    "gen_ai.input.messages",
                    &json!([{"role": "user", "content": format!("question {trace}")}]).to_string(),
                ),
                s(
                    "gen_ai.output.messages",
                    &json!([{"role": "assistant", "content": format!("answer {trace}")}]).to_string(),
                ),
            ],
        ),
    ]
}

fn hex_id(trace: u8) -> String {
    format!("{trace:02x}").repeat(16)
}

fn gzip(body: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(body).unwrap();
    gz.finish().unwrap()
}

fn post_raw(app: &TestApp, content_type: &str, body: Vec<u8>) -> reqwest::RequestBuilder {
    app.http.post(app.url(PATH)).bearer_auth(&app.admin_key).header("content-type", content_type).body(body)
}

async fn proto_answer(res: reqwest::Response) -> ExportTraceServiceResponse {
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-type"], "application/x-protobuf");
    ExportTraceServiceResponse::decode(res.bytes().await.unwrap()).expect("an ExportTraceServiceResponse")
}

async fn traces(app: &TestApp, prompt: &str) -> Vec<Value> {
    let page: Value = app.get(&format!("/v1/traces?prompt={prompt}")).send().await.unwrap().json().await.unwrap();
    page["traces"].as_array().unwrap().clone()
}

async fn protobuf_spans_become_traces(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("support-agent").await;
    let mut spans = agent_run(1, "support-agent", 1);
    spans.extend(agent_run(2, "support-agent", 1));
    let body = export(spans).encode_to_vec();
    let answer = proto_answer(post_raw(&app, "application/x-protobuf", body.clone()).send().await.unwrap()).await;
    assert_eq!(answer.partial_success, None, "everything accepted");

    let stored = traces(&app, "support-agent").await;
    assert_eq!(stored.len(), 2);
    let mut ids: Vec<&str> = stored.iter().map(|t| t["external_id"].as_str().unwrap()).collect();
    ids.sort();
    assert_eq!(ids, [hex_id(1), hex_id(2)]);
    let t = stored.iter().find(|t| t["external_id"] == hex_id(1)).unwrap();
    assert_eq!((t["status"].as_str(), t["prompt_version"].as_i64()), (Some("pending"), Some(1)));
    assert_eq!(t["input"], json!([{"role": "user", "content": "question 1"}]));
    assert_eq!(t["output"], json!([{"role": "assistant", "content": "answer 1"}]));
    assert_eq!(t["trajectory"].as_array().unwrap().len(), 2);
    assert_eq!(t["metadata"]["otel"]["service_name"], "test-agent");
    assert_eq!(t["metadata"]["otel"]["start_time"], "2023-11-14T22:13:20.000000Z");

    // An exporter retry of the same request stores nothing twice: every
    // span is known already.
    let res = post_raw(&app, "application/x-protobuf", body).send().await.unwrap();
    assert_eq!(proto_answer(res).await.partial_success, None);
    assert_eq!(traces(&app, "support-agent").await.len(), 2);

    // Two identical exports at once (a retry racing its original) still make
    // one trace.
    let third = export(agent_run(3, "support-agent", 1)).encode_to_vec();
    let (a, b) = tokio::join!(
        post_raw(&app, "application/x-protobuf", third.clone()).send(),
        post_raw(&app, "application/x-protobuf", third).send(),
    );
    assert_eq!(proto_answer(a.unwrap()).await.partial_success, None);
    assert_eq!(proto_answer(b.unwrap()).await.partial_success, None);
    assert_eq!(traces(&app, "support-agent").await.len(), 3);

    // The route is in the OpenAPI document with its error answers.
    let doc: Value = app.get("/v1/openapi.json").send().await.unwrap().json().await.unwrap();
    let op = &doc["paths"][PATH]["post"];
    for code in ["200", "400", "401", "403", "413", "415", "503"] {
        assert!(op["responses"][code].is_object(), "{code} missing: {op}");
    }
    assert!(op["requestBody"]["content"]["application/x-protobuf"].is_object(), "{op}");
}

async fn json_and_gzip_are_accepted(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("json-agent").await;
    // Written by hand in the OTLP JSON encoding: hex ids, lowerCamelCase, int64 as strings.
    let body = json!({"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "json-agent"}}]},
        "scopeSpans": [{"spans": [{
            "traceId": "0af7651916cd43dd8448eb211c80319c",
            "spanId": "b7ad6b7169203331",
            "name": "chat",
            "kind": 3,
            "startTimeUnixNano": "1700000000000000000",
            "endTimeUnixNano": "1700000000250000000",
            "attributes": [
                {"key": "gen_ai.prompt.name", "value": {"stringValue": "json-agent"}},
                {"key": "gen_ai.prompt.version", "value": {"intValue": "1"}},
                {"key": "gen_ai.prompt", "value": {"stringValue": "what is 2+2?"}},
                {"key": "gen_ai.completion", "value": {"stringValue": "4"}},
                {"key": "combee.feedback.success", "value": {"boolValue": true}},
                {"key": "gen_ai.usage.input_tokens", "value": {"intValue": "12"}}
            ]
        }]}]
    }]});
    let res = app
        .http
        .post(app.url(PATH))
        .bearer_auth(&app.admin_key)
        .header("content-type", "application/json")
        .header("content-encoding", "gzip")
        .body(gzip(body.to_string().as_bytes()))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-type"], "application/json");
    assert_eq!(res.json::<Value>().await.unwrap(), json!({}), "full success leaves partialSuccess out");
    let stored = traces(&app, "json-agent").await;
    assert_eq!(stored.len(), 1);
    let t = &stored[0];
    assert_eq!(t["external_id"], "0af7651916cd43dd8448eb211c80319c");
    assert_eq!((t["input"].as_str(), t["output"].as_str()), (Some("what is 2+2?"), Some("4")));
    assert_eq!(t["feedback"]["success"], true);
    assert_eq!(t["metadata"]["otel"]["input_tokens"], 12);
    assert_eq!(t["metadata"]["otel"]["duration_ms"], 250.0);

    // Gzip protobuf works the same way.
    let proto = gzip(&export(agent_run(9, "json-agent", 1)).encode_to_vec());
    let res = post_raw(&app, "application/x-protobuf", proto).header("content-encoding", "gzip").send().await.unwrap();
    assert_eq!(proto_answer(res).await.partial_success, None);
    assert_eq!(traces(&app, "json-agent").await.len(), 2);
}

async fn unmappable_spans_are_a_partial_success(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("known").await;
    let mut spans = agent_run(1, "known", 1); // 2 spans, accepted
    spans.extend(agent_run(2, "nobody-made-this", 1)); // 2 spans: unknown prompt
    spans.extend(agent_run(3, "known", 7)); // 2 spans: no version 7
    spans.push(span(4, 1, None, 0, vec![s("http.method", "GET")])); // 1 span: no prompt
    spans.push(span(5, 1, None, 0, vec![s("gen_ai.prompt.name", "known"), s("gen_ai.prompt.version", "v2")]));
    let req = export(spans);

    let answer =
        proto_answer(post_raw(&app, "application/x-protobuf", req.encode_to_vec()).send().await.unwrap()).await;
    let partial = answer.partial_success.expect("partial success");
    assert_eq!(partial.rejected_spans, 6);
    let msg = &partial.error_message;
    for needle in [
        "unknown prompt \"nobody-made-this\"",
        "has no version 7 (the latest is 1)",
        "belongs to no prompt",
        "positive integer",
        &hex_id(2),
    ] {
        assert!(msg.contains(needle), "{needle:?} missing from {msg:?}");
    }
    let stored = traces(&app, "known").await;
    assert_eq!(stored.len(), 1, "only the mappable trace is stored");
    assert_eq!(stored[0]["external_id"], hex_id(1));

    // The same in JSON: rejectedSpans is an int64, so a string.
    let json_body = serde_json::to_vec(&export(agent_run(6, "nobody-made-this", 1))).unwrap();
    let res = post_raw(&app, "application/json", json_body).send().await.unwrap();
    assert_eq!(res.status(), 200);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["partialSuccess"]["rejectedSpans"], "2");
    assert!(body["partialSuccess"]["errorMessage"].as_str().unwrap().contains("unknown prompt"));
    assert_eq!(traces(&app, "known").await.len(), 1);
}

/// A longer agent run in start order: the root span (prompt and version), a
/// chat span (the messages, no prompt), a tool span (no prompt).
fn long_run(trace: u8, prompt: &str) -> [Span; 3] {
    [
        span(trace, 1, None, 0, vec![s("gen_ai.prompt.name", prompt), i("gen_ai.prompt.version", 1)]),
        span(
            trace,
            2,
            Some(1),
            10,
            vec![
                s("gen_ai.input.messages", &json!([{"role": "user", "content": "where is order 7?"}]).to_string()),
                s("gen_ai.output.messages", &json!([{"role": "assistant", "content": "shipped"}]).to_string()),
            ],
        ),
        span(
            trace,
            3,
            Some(1),
            20,
            vec![s("gen_ai.tool.name", "lookup_order"), s("gen_ai.tool.call.result", "shipped")],
        ),
    ]
}

/// A span that arrives late with the user's verdict (and no prompt).
fn feedback_span(trace: u8) -> Span {
    span(trace, 4, Some(1), 30, vec![i("combee.feedback.score", 1), s("combee.feedback.comment", "resolved")])
}

async fn send(app: &TestApp, spans: Vec<Span>) -> ExportTraceServiceResponse {
    let res = post_raw(app, "application/x-protobuf", export(spans).encode_to_vec()).send().await.unwrap();
    proto_answer(res).await
}

fn step_names(t: &Value) -> Vec<&str> {
    t["trajectory"].as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect()
}

async fn a_trace_split_across_exports_becomes_one_trace(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("split-agent").await;
    let [root, chat, tool] = long_run(30, "split-agent");

    // Shuffled: the tool span first (no prompt): held, not rejected; the answer warns.
    let answer = send(&app, vec![tool]).await;
    let warning = answer.partial_success.expect("a warning");
    assert_eq!(warning.rejected_spans, 0);
    for needle in ["held 1 span(s)", &hex_id(30), "belongs to no prompt"] {
        assert!(warning.error_message.contains(needle), "{needle:?} missing from {warning:?}");
    }
    assert!(traces(&app, "split-agent").await.is_empty());

    // Then the root (prompt, no input yet), next to a complete trace of another id.
    let mut spans = vec![root];
    spans.extend(agent_run(31, "split-agent", 1));
    let warning = send(&app, spans).await.partial_success.expect("a warning");
    assert_eq!(warning.rejected_spans, 0);
    assert!(warning.error_message.contains("no input"), "{warning:?}");
    let stored = traces(&app, "split-agent").await;
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0]["external_id"], hex_id(31));

    // The chat span completes it: one trace, the whole trajectory in start order.
    assert_eq!(send(&app, vec![chat]).await.partial_success, None);
    let stored = traces(&app, "split-agent").await;
    assert_eq!(stored.len(), 2);
    let t = stored.iter().find(|t| t["external_id"] == hex_id(30)).unwrap();
    assert_eq!(step_names(t), ["span-1", "span-2", "span-3"]);
    assert_eq!((t["status"].as_str(), t["prompt_version"].as_i64()), (Some("pending"), Some(1)));
    assert_eq!(t["input"], json!([{"role": "user", "content": "where is order 7?"}]));
    assert_eq!(t["output"], json!([{"role": "assistant", "content": "shipped"}]));
    assert_eq!(t["trajectory"][2]["tool_call"]["result"], "shipped");
    assert_eq!(t["metadata"]["otel"]["spans"], 3);
    assert_eq!(t["metadata"]["otel"]["duration_ms"], 25.0);
}

async fn spans_resent_in_another_grouping_are_stored_once(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("resend-agent").await;
    let [root, chat, tool] = long_run(40, "resend-agent");
    assert_eq!(send(&app, vec![root.clone(), chat.clone(), tool.clone()]).await.partial_success, None);
    let first = traces(&app, "resend-agent").await;
    assert_eq!(first.len(), 1);

    // The same spans in other batches (other bodies, so no replay): nothing new.
    let duplicates_before = duplicate_spans_metric(&app).await;
    assert_eq!(send(&app, vec![tool.clone(), root.clone()]).await.partial_success, None);
    assert_eq!(
        send(&app, vec![chat.clone(), span(41, 9, None, 0, vec![s("http.route", "/x")])])
            .await
            .partial_success
            .map(|p| p.rejected_spans),
        Some(1)
    );
    let again = traces(&app, "resend-agent").await;
    assert_eq!(again.len(), 1);
    assert_eq!(again[0], first[0], "the trace did not change");

    // A late span (no prompt) with a re-sent one: added once to the same pending trace.
    assert_eq!(send(&app, vec![chat, feedback_span(40)]).await.partial_success, None);
    assert_eq!(send(&app, vec![feedback_span(40), root]).await.partial_success, None);
    let last = traces(&app, "resend-agent").await;
    assert_eq!(last.len(), 1);
    let t = &last[0];
    assert_eq!(t["id"], first[0]["id"]);
    assert_eq!(step_names(t), ["span-1", "span-2", "span-3", "span-4"]);
    assert_eq!((t["feedback"]["score"].as_f64(), t["feedback"]["comment"].as_str()), (Some(1.0), Some("resolved")));
    assert_eq!(t["metadata"]["otel"]["spans"], 4);
    let counted = duplicate_spans_metric(&app).await - duplicates_before;
    assert!(counted >= 6.0, "6 re-sent spans counted as duplicates, got {counted}");
}

async fn duplicate_spans_metric(app: &TestApp) -> f64 {
    let text = app.http.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines()
        .find(|l| l.starts_with("combee_otlp_spans_total{outcome=\"duplicate\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0.0, |v| v.parse().unwrap())
}

async fn spans_after_a_round_took_the_trace_are_rejected(b: Backend) {
    let sim = spawn_sim(combee::simulation::llm::SimConfig { seed: 12, ..Default::default() }).await;
    let app = spawn_app_with(b, |s| learning(s, &sim.url)).await;
    let res = app
        .post(
            "/v1/prompts",
            json!({"name": "late-agent", "base": "You track orders.", "settings": {"batch_size": 1000}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let [root, chat, tool] = long_run(50, "late-agent");
    assert_eq!(send(&app, vec![root, chat.clone(), tool]).await.partial_success, None);
    let res = app.post("/v1/prompts/late-agent/rounds", json!({"batch_size": 1})).send().await.unwrap();
    assert_eq!(res.status(), 202, "{}", res.text().await.unwrap());
    let id = res.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned();
    let done = round_end(&app, &id, Duration::from_secs(60)).await;
    assert_eq!(done["status"], "succeeded", "{done}");

    // A new span of the consumed trace is rejected with the reason; a re-sent one is not.
    let rejected = send(&app, vec![feedback_span(50)]).await.partial_success.expect("rejected");
    assert_eq!(rejected.rejected_spans, 1);
    for needle in [hex_id(50).as_str(), "already taken by a learning round"] {
        assert!(rejected.error_message.contains(needle), "{needle:?} missing from {rejected:?}");
    }
    assert_eq!(send(&app, vec![chat]).await.partial_success, None);
    let stored = traces(&app, "late-agent").await;
    assert_eq!(stored.len(), 1, "no follow-up trace");
    assert_eq!(stored[0]["status"], "consumed");
    assert_eq!(step_names(&stored[0]), ["span-1", "span-2", "span-3"]);
    assert!(stored[0]["feedback"]["score"].is_null());
}

async fn auth_is_required(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("guarded").await;
    let body = export(agent_run(1, "guarded", 1)).encode_to_vec();
    let res = app
        .http
        .post(app.url(PATH))
        .header("content-type", "application/x-protobuf")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    expect_problem(res, 401).await;
    let res = app
        .http
        .post(app.url(PATH))
        .bearer_auth("cmb_not_a_real_key")
        .header("content-type", "application/x-protobuf")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    expect_problem(res, 401).await;
    let reader = app.key_with(&["prompts:read"]).await;
    let res = app
        .http
        .post(app.url(PATH))
        .bearer_auth(&reader)
        .header("content-type", "application/x-protobuf")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    let p = expect_problem(res, 403).await;
    assert!(p["detail"].as_str().unwrap().contains("traces:write"));
    assert!(traces(&app, "guarded").await.is_empty());

    let writer = app.key_with(&["traces:write"]).await;
    let res = app
        .http
        .post(app.url(PATH))
        .bearer_auth(&writer)
        .header("content-type", "application/x-protobuf")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(proto_answer(res).await.partial_success, None);
    assert_eq!(traces(&app, "guarded").await.len(), 1);
}

async fn bad_bodies_are_problems(b: Backend) {
    let app = spawn_app(b).await; // limits.max_body_bytes = 256 KiB in tests
    app.create_prompt("p").await;
    let res = post_raw(&app, "application/x-protobuf", vec![0xff, 0xff, 0xff, 0xff]).send().await.unwrap();
    let p = expect_problem(res, 400).await;
    assert!(p["detail"].as_str().unwrap().contains("protobuf"));
    let res = post_raw(&app, "application/json", b"{\"resourceSpans\": 7}".to_vec()).send().await.unwrap();
    expect_problem(res, 400).await;
    let res = post_raw(&app, "text/plain", b"hello".to_vec()).send().await.unwrap();
    expect_problem(res, 415).await;
    let res = post_raw(&app, "application/x-protobuf", vec![]).header("content-encoding", "br").send().await.unwrap();
    expect_problem(res, 415).await;
    let res = post_raw(&app, "application/x-protobuf", b"not gzip".to_vec())
        .header("content-encoding", "gzip")
        .send()
        .await
        .unwrap();
    let p = expect_problem(res, 400).await;
    assert!(p["detail"].as_str().unwrap().contains("gzip"));
    // Too big as sent, and too big once inflated (a small gzip bomb).
    let res = post_raw(&app, "application/x-protobuf", vec![0; 300 * 1024]).send().await.unwrap();
    expect_problem(res, 413).await;
    let bomb = gzip(&vec![0; 4 * 1024 * 1024]);
    assert!(bomb.len() < 256 * 1024);
    let res = post_raw(&app, "application/x-protobuf", bomb).header("content-encoding", "gzip").send().await.unwrap();
    let p = expect_problem(res, 413).await;
    assert!(p["detail"].as_str().unwrap().contains("max_body_bytes"));
    // More trace ids than `limits.max_traces_per_batch` (50 in tests).
    let many: Vec<Span> = (1..=51u8).flat_map(|t| agent_run(t, "p", 1)).collect();
    let res = post_raw(&app, "application/x-protobuf", export(many).encode_to_vec()).send().await.unwrap();
    let p = expect_problem(res, 413).await;
    assert!(p["detail"].as_str().unwrap().contains("max_traces_per_batch"));
    assert!(traces(&app, "p").await.is_empty(), "nothing stored from a refused export");
    // An oversized field rejects that trace only, with the reason.
    let mut big = agent_run(60, "p", 1);
    big[1].attributes.push(s("gen_ai.prompt", &"x".repeat(9 * 1024)));
    big[1].attributes.retain(|kv| kv.key != "gen_ai.input.messages");
    let mut spans = big;
    spans.extend(agent_run(61, "p", 1));
    let answer =
        proto_answer(post_raw(&app, "application/x-protobuf", export(spans).encode_to_vec()).send().await.unwrap())
            .await;
    let partial = answer.partial_success.unwrap();
    assert_eq!(partial.rejected_spans, 2);
    assert!(partial.error_message.contains("the limit is 8192"), "{}", partial.error_message);
    assert_eq!(traces(&app, "p").await.len(), 1);
}

/// The OTLP acceptance test: the real OpenTelemetry Python SDK and its
/// OTLP/HTTP exporter send spans; the traces are found with the right
/// version, pending, and a round learns from them.
async fn the_python_sdk_exporter_feeds_a_round(b: Backend) {
    let sim = spawn_sim(combee::simulation::llm::SimConfig { seed: 11, ..Default::default() }).await;
    let app = spawn_app_with(b, |s| learning(s, &sim.url)).await;
    let res = app
        .post(
            "/v1/prompts",
            json!({"name": "otel-agent", "base": "You answer support questions.", "settings": {"batch_size": 1000}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let res = app
        .post("/v1/prompts/otel-agent/versions", json!({"base": "You answer support questions briefly."}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let key = app.key_with(&["traces:write"]).await;

    let n = 6;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/otlp_export.py");
    let base = app.base.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .args([script, "otel-agent", "2", &n.to_string()])
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("{base}/v1/otlp"))
            .env("OTEL_EXPORTER_OTLP_HEADERS", format!("Authorization=Bearer%20{key}"))
            .env("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
            .env("OTEL_EXPORTER_OTLP_TIMEOUT", "10")
            .output()
            .expect("python3 runs")
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(
        out.status.code(),
        Some(3),
        "the OpenTelemetry Python SDK is not installed; `scripts/test` installs it: {stderr}"
    );
    assert!(out.status.success(), "the Python exporter failed: {stderr}");
    let report: Value = serde_json::from_slice(&out.stdout).expect("the script prints a JSON report");
    let mut sent: Vec<String> =
        report["trace_ids"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_owned()).collect();
    sent.sort();
    assert_eq!(sent.len(), n);
    let exports = report["exports"].as_u64().unwrap();
    assert!(exports > 2 * n as u64, "each trace was split across exports (got {exports} exports)");

    let pending: Value =
        app.get("/v1/traces?prompt=otel-agent&status=pending").send().await.unwrap().json().await.unwrap();
    let pending = pending["traces"].as_array().unwrap();
    let mut found: Vec<String> = pending.iter().map(|t| t["external_id"].as_str().unwrap().to_owned()).collect();
    found.sort();
    assert_eq!(
        found, sent,
        "one trace per OpenTelemetry trace id, from three exports each; the span without a prompt was rejected"
    );
    for t in pending {
        assert_eq!(t["prompt_version"], 2, "{t}");
        let steps: Vec<&str> =
            t["trajectory"].as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect();
        assert_eq!(steps, ["invoke_agent otel-agent", "chat sim-model", "execute_tool lookup_order"]);
        assert!(t["input"][0]["parts"][0]["content"].as_str().unwrap().starts_with("where is order"));
        assert!(t["feedback"]["comment"].as_str().unwrap().starts_with("INSIGHT-otel"));
        assert_eq!(t["metadata"]["otel"]["service_name"], "otel-acceptance");
        assert_eq!(t["metadata"]["otel"]["output_tokens"], 7);
    }

    // Ready for a round: the worker learns from exactly these traces.
    let res = app.post("/v1/prompts/otel-agent/rounds", json!({"batch_size": n})).send().await.unwrap();
    assert_eq!(res.status(), 202, "{}", res.text().await.unwrap());
    let round: Value = res.json().await.unwrap();
    let id = round["id"].as_str().unwrap().to_owned();
    let done = round_end(&app, &id, Duration::from_secs(60)).await;
    assert_eq!(done["status"], "succeeded", "{done}");
    assert_eq!(done["trace_ids"].as_array().unwrap().len(), n);
    let left: Value =
        app.get("/v1/traces?prompt=otel-agent&status=pending").send().await.unwrap().json().await.unwrap();
    assert!(left["traces"].as_array().unwrap().is_empty());
}

on_both_stores!(
    protobuf_spans_become_traces,
    json_and_gzip_are_accepted,
    unmappable_spans_are_a_partial_success,
    auth_is_required,
    bad_bodies_are_problems,
    the_python_sdk_exporter_feeds_a_round,
    a_trace_split_across_exports_becomes_one_trace,
    spans_resent_in_another_grouping_are_stored_once,
    spans_after_a_round_took_the_trace_are_rejected,
);

/// A run of `long_run` shape under a 32-bit trace number (for more than 255 traces).
fn numbered_run(n: u32, prompt: &str) -> [Span; 3] {
    let mut id = vec![0xc0; 16];
    id[12..].copy_from_slice(&n.to_be_bytes());
    long_run(1, prompt).map(|mut s| {
        s.trace_id = id.clone();
        s
    })
}

/// Ingest cost, whole traces vs. traces in three exports each vs. re-sent
/// spans; prints the figures. Run: `cargo nextest run --test otlp measure --run-ignored only --no-capture`.
async fn measure_split_ingest(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("bench-agent").await;
    let (traces_n, per_export) = (500_u32, 25_u32);
    let timed = async |exports: Vec<Vec<Span>>| {
        let spans: usize = exports.iter().map(Vec::len).sum();
        let start = Instant::now();
        for e in exports {
            let answer = send(&app, e).await;
            assert_eq!(answer.partial_success.map(|p| p.rejected_spans).unwrap_or(0), 0);
        }
        (spans, start.elapsed())
    };
    let whole: Vec<Vec<Span>> = (0..traces_n / per_export)
        .map(|k| (0..per_export).flat_map(|i| numbered_run(k * per_export + i, "bench-agent")).collect())
        .collect();
    let split: Vec<Vec<Span>> = (0..traces_n / per_export)
        .flat_map(|k| {
            let runs: Vec<[Span; 3]> =
                (0..per_export).map(|i| numbered_run(traces_n + k * per_export + i, "bench-agent")).collect();
            // Children first (as a batch processor exports them), the roots last.
            [2, 1, 0].map(|part| runs.iter().map(|r| r[part].clone()).collect::<Vec<_>>())
        })
        .collect();
    // The split traces again, whole and in reverse order: other bodies, all duplicates.
    let resent: Vec<Vec<Span>> = split.chunks(3).rev().map(|c| c.iter().flatten().cloned().collect()).collect();
    for (what, exports) in [("whole traces", whole), ("3 exports per trace", split), ("re-sent (duplicates)", resent)] {
        let n = exports.len();
        let (spans, took) = timed(exports).await;
        eprintln!(
            "{b:?} {what}: {n} exports, {spans} spans in {:.0} ms = {:.0} spans/s",
            took.as_secs_f64() * 1e3,
            spans as f64 / took.as_secs_f64()
        );
    }
    let all = app.store.list_traces(&Default::default(), 5000).await.unwrap();
    assert_eq!(all.len(), 2 * traces_n as usize);
    assert!(all.iter().all(|t| t.trajectory.as_array().unwrap().len() == 3));
}

mod measure {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a measurement that prints figures"]
    async fn postgres() {
        super::measure_split_ingest(super::Backend::Postgres).await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a measurement that prints figures"]
    async fn sqlite() {
        super::measure_split_ingest(super::Backend::Sqlite).await
    }
}
