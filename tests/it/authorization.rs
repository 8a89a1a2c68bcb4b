//! Every operation answers who may call it before anything about the request.
//! The operations come from the served OpenAPI document (the `/v1` API and the
//! Langfuse-compatible routes), so a route is covered as soon as it is
//! documented; each is called by every kind of caller — no
//! key, an unknown key, a key with each single scope — with a request that is
//! wrong everywhere it can be (a body that is not JSON under the wrong content
//! type, integer query and path parameters that are not numbers, bad headers).
//! A caller without the operation's scope gets 401 or 403, never a 4xx about
//! the request; a caller with it never gets 401 or 403.

use reqwest::Method;
use serde_json::Value;

use crate::common::{Backend, expect_problem, spawn_app};

const SCOPES: [&str; 6] =
    ["traces:write", "prompts:read", "prompts:write", "prompts:promote", "rounds:trigger", "admin"];

/// A request to `path` with every parameter and the body wrong.
fn hostile(app: &crate::common::TestApp, method: &str, path: &str, op: &Value) -> reqwest::RequestBuilder {
    let params = op["parameters"].as_array().cloned().unwrap_or_default();
    let mut url = path.to_owned();
    let mut query = Vec::new();
    let mut headers = Vec::new();
    for p in &params {
        let name = p["name"].as_str().unwrap();
        let integer = p["schema"]["type"] == "integer";
        match p["in"].as_str().unwrap() {
            // A number that is not one; a name that is no name; an id that is no UUID.
            "path" => url = url.replace(&format!("{{{name}}}"), if integer { "abc" } else { "Not%20A%20Name" }),
            "query" if integer => query.push((name.to_owned(), "x".to_owned())),
            "query" => query.push((name.to_owned(), "\u{1}".to_owned())),
            "header" => headers.push((name.to_owned(), "x".repeat(300))),
            _ => {}
        }
    }
    let method = Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
    let mut req = app.http.request(method, app.url(&url)).query(&query);
    for (k, v) in headers {
        req = req.header(k, v);
    }
    if op.get("requestBody").is_some() {
        req = req.header("content-type", "text/plain").body("{ not json");
    }
    req
}

async fn every_operation_checks_its_caller_before_its_request(b: Backend) {
    let app = spawn_app(b).await;
    let doc: Value = app.get("/v1/openapi.json").send().await.unwrap().json().await.unwrap();
    let mut keys = Vec::new();
    for scope in SCOPES {
        keys.push((scope, app.key_with(&[scope]).await));
    }
    let (mut operations, mut checked) = (0, 0);
    // Whatever needs no key: operations, the inbound webhook (its signature covers the body).
    let open = [("get", "/healthz"), ("get", "/readyz"), ("get", "/metrics"), ("post", "/v1/hooks/rounds/{name}")];
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            // A bearer key works on every route that takes a key (Langfuse's Basic pair too).
            let bearer = op["security"].as_array().into_iter().flatten().find_map(|s| s["bearer"][0].as_str());
            let Some(required) = bearer else {
                assert!(open.contains(&(method.as_str(), path.as_str())), "{method} {path} states no scope");
                continue;
            };
            assert!(SCOPES.contains(&required), "{method} {path} needs an unknown scope {required}");
            operations += 1;
            let what = format!("{} {path}", method.to_uppercase());
            let res = hostile(&app, method, path, op).send().await.unwrap();
            assert_eq!(res.status(), 401, "{what} without a key");
            let res =
                hostile(&app, method, path, op).bearer_auth("cmb_0000000000000000000000000000000000000000").send();
            assert_eq!(res.await.unwrap().status(), 401, "{what} with an unknown key");
            for (scope, key) in &keys {
                let res = hostile(&app, method, path, op).bearer_auth(key).send().await.unwrap();
                let status = res.status().as_u16();
                if *scope == required || *scope == "admin" {
                    assert!(![401, 403].contains(&status) && status < 500, "{what} with `{scope}`: {status}");
                } else {
                    let problem = expect_problem(res, 403).await;
                    let detail = problem["detail"].as_str().unwrap();
                    assert!(detail.contains(required), "{what} with `{scope}` names `{required}`: {detail}");
                }
                checked += 1;
            }
        }
    }
    assert!(operations >= 30, "the document lists the API's operations ({operations})");
    assert_eq!(checked, operations * SCOPES.len(), "every operation was called with every scope");
}

on_one_store!(every_operation_checks_the_caller_first: every_operation_checks_its_caller_before_its_request(Sqlite));
