//! What a request must look like where the OpenAPI document alone cannot
//! make a fuzzer find it out: path and query parameters of the wrong type are answered
//! in plain words, an optional body is JSON or nothing, and a bound on a
//! string holds for the string as sent.

use serde_json::{Value, json};

use crate::common::{Backend, expect_problem, spawn_app};

async fn path_parameters_are_explained_in_plain_words(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("p").await;
    for bad in ["abc", "1.5", "99999999999999999999"] {
        let res = app.get(&format!("/v1/prompts/p/versions/{bad}")).send().await.unwrap();
        let problem = expect_problem(res, 400).await;
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains("`number`") && detail.contains("a whole number") && detail.contains(bad), "{detail}");
        assert!(!detail.contains("i64") && !detail.contains("Cannot parse"), "{detail}");
    }
    // Query parameters likewise: named, in plain words.
    let res = app.get("/v1/prompts/p?version=abc").send().await.unwrap();
    let detail = expect_problem(res, 400).await["detail"].as_str().unwrap().to_owned();
    assert_eq!(detail, "the query parameter `version` must be a whole number");
}

async fn optional_bodies_are_json_or_nothing(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("p").await;
    let res = app.post("/v1/traces", json!({"prompt": "p", "input": "x"})).send().await.unwrap();
    let id = res.json::<Value>().await.unwrap()["ids"][0].as_str().unwrap().to_owned();
    let quarantine = format!("/v1/traces/{id}/quarantine");
    let raw = |path: &str, content_type: Option<&str>, body: &'static str| {
        let mut req = app.http.post(app.url(path)).bearer_auth(&app.admin_key).body(body);
        if let Some(t) = content_type {
            req = req.header("content-type", t);
        }
        req.send()
    };
    // JSON under another name is refused before it is read; no body at all is fine.
    expect_problem(raw(&quarantine, Some("text/plain"), r#"{"reason": "x"}"#).await.unwrap(), 415).await;
    expect_problem(raw("/v1/prompts/p/rounds", None, r#"{"batch_size": 1}"#).await.unwrap(), 415).await;
    expect_problem(raw(&quarantine, Some("application/json"), "[1]").await.unwrap(), 422).await;
    // A reason longer than 500 characters is refused even when it is mostly blanks.
    let padded = format!("{}x", " ".repeat(500));
    let res = app.post(&quarantine, json!({ "reason": padded })).send().await.unwrap();
    let problem = expect_problem(res, 422).await;
    assert!(problem["detail"].as_str().unwrap().contains("500"), "{problem}");
    // Whitespace declared as JSON is not JSON (no value in it).
    let problem = expect_problem(raw(&quarantine, Some("application/json"), "\t").await.unwrap(), 400).await;
    assert!(problem["detail"].as_str().unwrap().contains("not valid JSON"), "{problem}");
    let res = raw(&quarantine, None, "").await.unwrap();
    assert_eq!(res.status(), 200, "an empty body quarantines with the default reason");
    let res = raw("/v1/prompts/p/rounds", Some("application/json"), "null").await.unwrap();
    assert_eq!(res.status(), 409, "`null` is no body: defaults, and the only trace is quarantined");
    // The document says so: a trigger's body is optional.
    let doc: Value = app.get("/v1/openapi.json").send().await.unwrap().json().await.unwrap();
    assert_eq!(doc["paths"]["/v1/prompts/{name}/rounds"]["post"]["requestBody"]["required"], false);
}

async fn integers_in_bodies_may_be_written_as_integral_floats(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("p").await;
    // 2^51 − 1 written with a fraction of zero is an integer (JSON Schema says
    // so), read exactly: no version that high, so the rollback conflicts.
    let res = app.post("/v1/prompts/p/rollback", json!({"to": 2_251_799_813_685_247.0_f64})).send().await.unwrap();
    let problem = expect_problem(res, 409).await;
    assert!(problem["detail"].as_str().unwrap().contains("2251799813685247"), "{problem}");
}

on_one_store!(
    path_parameter_errors_in_plain_words: path_parameters_are_explained_in_plain_words(Postgres),
    optional_bodies_json_or_nothing: optional_bodies_are_json_or_nothing(Sqlite),
    integral_floats_are_integers: integers_in_bodies_may_be_written_as_integral_floats(Postgres),
);
