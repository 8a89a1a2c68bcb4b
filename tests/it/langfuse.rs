//! The Langfuse-compatible routes against the real server: prompts in
//! Langfuse's shape by label and by version with the SDKs' Basic key pair,
//! the refusals (a wrong pair, a missing scope, unknown names), and the
//! tracing alias ingesting OTLP spans like `/v1/otlp/v1/traces`. The real
//! Langfuse SDKs are driven by the ecosystem tests (tests/ecosystem).

use crate::common;

use base64::Engine;
use common::{Backend, TestApp, expect_problem, spawn_app};
use opentelemetry_proto::tonic::{
    collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse},
    common::v1::{AnyValue, KeyValue, any_value::Value as Any},
    trace::v1::{ResourceSpans, ScopeSpans, Span},
};
use prost::Message;
use serde_json::{Value, json};

fn basic(public: &str, secret: &str) -> String {
    format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{public}:{secret}")))
}

fn get(app: &TestApp, path: &str, auth: &str) -> reqwest::RequestBuilder {
    app.http.get(app.url(path)).header("authorization", auth)
}

async fn prompts_come_in_langfuse_shape_with_the_key_pair(b: Backend) {
    let app = spawn_app(b).await;
    let res = app
        .post(
            "/v1/prompts",
            json!({"name": "support-agent", "base": "Help {customer} with their order.", "promotion": "manual"}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let res = app
        .post(
            "/v1/prompts/support-agent/versions",
            json!({"base": "Help {customer} kindly.", "message": "kinder", "labels": ["staging"]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let key = app.key_with(&["prompts:read"]).await;
    let pair = basic(&key[..12], &key);

    let res = get(&app, "/api/public/v2/prompts/support-agent", &pair).send().await.unwrap();
    assert_eq!(res.status(), 200);
    let production: Value = res.json().await.unwrap();
    assert_eq!(
        production,
        json!({"name": "support-agent", "version": 1, "type": "text", "prompt": "Help {{customer}} with their order.",
               "config": {}, "labels": ["production"], "tags": [], "commitMessage": "created", "resolutionGraph": null})
    );
    let by_label: Value = get(&app, "/api/public/v2/prompts/support-agent?label=staging", &pair)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        (by_label["version"].as_i64(), by_label["prompt"].as_str()),
        (Some(2), Some("Help {{customer}} kindly."))
    );
    assert_eq!((by_label["labels"].clone(), by_label["commitMessage"].clone()), (json!(["staging"]), json!("kinder")));
    let by_version: Value = get(&app, "/api/public/v2/prompts/support-agent?version=2&resolve=false", &pair)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(by_version, by_label);
    // A bearer key works as well.
    let res =
        get(&app, "/api/public/v2/prompts/support-agent?label=latest", &format!("Bearer {key}")).send().await.unwrap();
    assert_eq!(res.json::<Value>().await.unwrap()["version"], 2);

    // Refusals are problem documents.
    for (path, auth, status) in [
        ("/api/public/v2/prompts/support-agent", basic("pk-lf-1234", &key), 401),
        ("/api/public/v2/prompts/support-agent", basic(&key[..12], "cmb_not-a-key"), 401),
        ("/api/public/v2/prompts/support-agent", "Basic !!!".to_owned(), 401),
        ("/api/public/v2/prompts/nobody", pair.clone(), 404),
        ("/api/public/v2/prompts/support-agent?version=9", pair.clone(), 404),
        ("/api/public/v2/prompts/support-agent?label=staging&version=1", pair.clone(), 404),
        ("/api/public/v2/prompts/support-agent?version=two", pair.clone(), 400),
        ("/api/public/v2/prompts/support-agent?label=Not%20a%20label", pair.clone(), 400),
    ] {
        let res = get(&app, path, &auth).send().await.unwrap();
        expect_problem(res, status).await;
    }
    let res = app.http.get(app.url("/api/public/v2/prompts/support-agent")).send().await.unwrap();
    let problem = expect_problem(res, 401).await;
    assert!(problem["detail"].as_str().unwrap().contains("public key is the combee key's prefix"), "{problem}");
    let writer = app.key_with(&["traces:write"]).await;
    expect_problem(
        get(&app, "/api/public/v2/prompts/support-agent", &basic(&writer[..12], &writer)).send().await.unwrap(),
        403,
    )
    .await;
}

async fn the_tracing_alias_ingests_otlp_spans(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("lf-agent").await;
    let key = app.key_with(&["traces:write"]).await;
    let s = |k: &str, v: &str| KeyValue {
        key: k.into(),
        value: Some(AnyValue { value: Some(Any::StringValue(v.into())) }),
        ..Default::default()
    };
    let span = Span {
        trace_id: vec![7; 16],
        span_id: vec![7; 8],
        name: "OpenAI-generation".into(),
        start_time_unix_nano: 1_700_000_000_000_000_000,
        end_time_unix_nano: 1_700_000_000_100_000_000,
        attributes: vec![
            s("langfuse.observation.type", "generation"),
            s("langfuse.observation.prompt.name", "lf-agent"),
            KeyValue {
                key: "langfuse.observation.prompt.version".into(),
                value: Some(AnyValue { value: Some(Any::IntValue(1)) }),
                ..Default::default()
            },
            s("langfuse.observation.input", r#"[{"role": "user", "content": "where is order 7?"}]"#),
            s("langfuse.observation.output", r#"{"role": "assistant", "content": "it shipped"}"#),
        ],
        ..Default::default()
    };
    let export = ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            scope_spans: vec![ScopeSpans { spans: vec![span], ..Default::default() }],
            ..Default::default()
        }],
    };
    let res = app
        .http
        .post(app.url("/api/public/otel/v1/traces"))
        .header("authorization", basic(&key[..12], &key))
        .header("content-type", "application/x-protobuf")
        .body(export.encode_to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let answer = ExportTraceServiceResponse::decode(res.bytes().await.unwrap()).unwrap();
    assert_eq!(answer.partial_success, None);
    let page: Value = app.get("/v1/traces?prompt=lf-agent").send().await.unwrap().json().await.unwrap();
    let t = &page["traces"][0];
    assert_eq!((t["prompt_version"].as_i64(), t["output"]["content"].as_str()), (Some(1), Some("it shipped")));
    assert_eq!(t["input"], json!([{"role": "user", "content": "where is order 7?"}]));

    // The key pair is checked before the body is read.
    let res = app
        .http
        .post(app.url("/api/public/otel/v1/traces"))
        .header("authorization", basic("wrong", &key))
        .header("content-type", "text/plain")
        .body("x")
        .send()
        .await
        .unwrap();
    expect_problem(res, 401).await;
    let doc: Value = app.get("/v1/openapi.json").send().await.unwrap().json().await.unwrap();
    assert!(doc["paths"]["/api/public/v2/prompts/{name}"]["get"].is_object());
    assert_eq!(doc["components"]["securitySchemes"]["basic"]["scheme"], "basic");
}

on_one_store!(
    sqlite_prompts_come_in_langfuse_shape: prompts_come_in_langfuse_shape_with_the_key_pair(Sqlite),
    postgres_the_tracing_alias_ingests_otlp_spans: the_tracing_alias_ingests_otlp_spans(Postgres),
);
