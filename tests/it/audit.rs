//! The audit log: every write operation the OpenAPI document names appends
//! exactly one entry with who, from where, what and the values before and
//! after — or is in the exempt list below, with its reason; no secret reaches
//! an entry; the log pages and filters, is admin-only, and is read by the CLI
//! and the web UI; the stores refuse to change or delete an entry except
//! through the retention rule's pruning.

use std::collections::BTreeSet;

use base64::{Engine, engine::general_purpose::STANDARD};
use combee::{
    domain::audit::{Actor, AuditQuery, NewAuditEntry, RequestOrigin},
    worker::retention::Pruner,
};
use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sqlx::Connection;

use crate::{
    common::{Backend, TestApp, expect_problem, spawn_app, spawn_app_with, test_store},
    ui_browser::{plain_client, set_cookie, sign_in},
};

/// The write operations that append no entry, and why: trace ingest in all
/// its forms is data the agents send (thousands a second), not an operator's
/// change. What operators do to traces — quarantine, release, delete, requeue
/// — is audited.
const EXEMPT: [(&str, &str, &str); 5] = [
    ("POST", "/v1/traces", "trace ingest: the agents' data, at high volume"),
    ("POST", "/v1/traces/{id}/feedback", "late feedback is part of a trace's data, sent by agents"),
    ("POST", "/v1/otlp/v1/traces", "OTLP span ingest: the agents' data, at high volume"),
    ("POST", "/v1/otlp/v1/logs", "OTLP log ingest: the agents' data, at high volume"),
    ("POST", "/api/public/otel/v1/traces", "Langfuse-compatible span ingest: the agents' data, at high volume"),
];

const WEBHOOK_KEY: &[u8] = b"a test secret of thirty-two bytes";

/// What an operation's one entry must say.
struct Expect {
    action: &'static str,
    resource_type: &'static str,
    /// Whether `before` (and `after`) hold a value; the other must be null.
    before: bool,
    after: bool,
}

fn expect(action: &'static str, resource_type: &'static str, before: bool, after: bool) -> Option<Expect> {
    Some(Expect { action, resource_type, before, after })
}

/// The id of the newest entry (0 when none).
async fn newest(app: &TestApp) -> i64 {
    let page: Value = app.get("/v1/audit?page_size=1").send().await.unwrap().json().await.unwrap();
    page["entries"][0]["id"].as_i64().unwrap_or(0)
}

/// Every entry after `id`, oldest first.
async fn entries_after(app: &TestApp, id: i64) -> Vec<Value> {
    let page: Value = app.get("/v1/audit?page_size=200").send().await.unwrap().json().await.unwrap();
    let mut newer: Vec<Value> =
        page["entries"].as_array().unwrap().iter().filter(|e| e["id"].as_i64().unwrap() > id).cloned().collect();
    newer.reverse();
    newer
}

/// Runs one write operation and checks its entry (or, exempt, that it has none).
struct Run<'a> {
    app: &'a TestApp,
    admin_id: String,
    covered: BTreeSet<(String, String)>,
}

impl Run<'_> {
    async fn op(&mut self, method: &str, path: &str, req: reqwest::RequestBuilder, want: Option<Expect>) -> Value {
        let last = newest(self.app).await;
        let res = req.send().await.unwrap();
        let status = res.status().as_u16();
        let request_id = res.headers()["x-request-id"].to_str().unwrap().to_owned();
        let text = res.text().await.unwrap();
        assert!(status < 300, "{method} {path}: {status} {text}");
        let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let new = entries_after(self.app, last).await;
        self.covered.insert((method.to_owned(), path.to_owned()));
        let Some(want) = want else {
            assert!(EXEMPT.iter().any(|(m, p, _)| (*m, *p) == (method, path)), "{method} {path} is not exempt");
            assert!(new.is_empty(), "{method} {path} is exempt, yet wrote {new:?}");
            return body;
        };
        assert_eq!(new.len(), 1, "{method} {path}: exactly one entry, got {new:#?}");
        let e = &new[0];
        assert_eq!(e["action"], want.action, "{e}");
        assert_eq!(e["resource_type"], want.resource_type, "{e}");
        assert!(e["resource_id"].as_str().is_some_and(|id| !id.is_empty()), "{e}");
        assert_eq!((e["method"].as_str(), e["route"].as_str()), (Some(method), Some(path)), "{e}");
        assert_eq!(e["status"], status, "{e}");
        assert_eq!(e["request_id"], request_id.as_str(), "{e}");
        assert_eq!(e["client_addr"], "127.0.0.1", "{e}");
        if path.starts_with("/v1/hooks/") {
            assert_eq!((e["actor_type"].as_str(), e["actor_id"].as_str()), (Some("webhook"), None), "{e}");
        } else {
            assert_eq!((e["actor_type"].as_str(), e["actor_id"].as_str()), (Some("key"), Some(&*self.admin_id)));
            assert_eq!(e["actor_name"], "bootstrap admin");
        }
        assert_eq!(!e["before"].is_null(), want.before, "{method} {path} before: {e}");
        assert_eq!(!e["after"].is_null(), want.after, "{method} {path} after: {e}");
        body
    }
}

fn patch(app: &TestApp, path: &str, body: Value) -> reqwest::RequestBuilder {
    app.http
        .patch(app.url(path))
        .bearer_auth(&app.admin_key)
        .header("content-type", "application/merge-patch+json")
        .body(body.to_string())
}

fn delete(app: &TestApp, path: &str) -> reqwest::RequestBuilder {
    app.http.delete(app.url(path)).bearer_auth(&app.admin_key)
}

fn trace(prompt: &str, i: usize) -> Value {
    json!({"prompt": prompt, "input": {"task": i}, "output": format!("answer {i}"), "feedback": {"success": true}})
}

/// Signed as Standard Webhooks says, without combee's own code.
fn signed(app: &TestApp, prompt: &str, id: &str, body: &str) -> reqwest::RequestBuilder {
    let ts = chrono::Utc::now().timestamp();
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(WEBHOOK_KEY).unwrap();
    mac.update(format!("{id}.{ts}.{body}").as_bytes());
    let sig = STANDARD.encode(mac.finalize().into_bytes());
    app.http
        .post(app.url(&format!("/v1/hooks/rounds/{prompt}")))
        .header("webhook-id", id)
        .header("webhook-timestamp", ts.to_string())
        .header("webhook-signature", format!("v1,{sig}"))
        .header("content-type", "application/json")
        .body(body.to_owned())
}

async fn admin_id(app: &TestApp) -> String {
    let keys: Value = app.get("/v1/keys").send().await.unwrap().json().await.unwrap();
    let admin = keys["keys"].as_array().unwrap().iter().find(|k| k["name"] == "bootstrap admin").unwrap();
    admin["id"].as_str().unwrap().to_owned()
}

async fn every_write_operation_appends_exactly_one_entry(b: Backend) {
    let app = spawn_app_with(b, |s| {
        s.webhooks.inbound_secrets =
            vec![combee::secret::Secret::new(format!("whsec_{}", STANDARD.encode(WEBHOOK_KEY)))];
        s.webhooks.allow_private_targets = true;
    })
    .await;
    let doc: Value = app.get("/v1/openapi.json").send().await.unwrap().json().await.unwrap();
    let mut writes = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            if ["post", "put", "patch", "delete"].contains(&method.as_str()) {
                writes.insert((method.to_uppercase(), path.clone()));
            }
        }
    }
    let mut run = Run { admin_id: admin_id(&app).await, app: &app, covered: BTreeSet::new() };

    // Prompts, settings, versions, labels.
    let created = json!({"name": "audited", "base": "You help."});
    run.op("POST", "/v1/prompts", app.post("/v1/prompts", created), expect("prompt.create", "prompt", false, true))
        .await;
    let path = "/v1/prompts/{name}/settings";
    let req = patch(&app, "/v1/prompts/audited/settings", json!({"max_wait_secs": 60}));
    run.op("PATCH", path, req, expect("prompt.settings.update", "prompt", true, true)).await;
    let req = app.post("/v1/prompts/audited/versions", json!({"base": "You help, twice."}));
    run.op("POST", "/v1/prompts/{name}/versions", req, expect("version.create", "version", false, true)).await;
    let path = "/v1/prompts/{name}/labels/{label}";
    let req = app.put("/v1/prompts/audited/labels/staging", json!({"version": 1}));
    run.op("PUT", path, req, expect("label.move", "label", false, true)).await;
    let req = app.put("/v1/prompts/audited/labels/staging", json!({"version": 2}));
    run.op("PUT", path, req, expect("label.move", "label", true, true)).await;
    let req = delete(&app, "/v1/prompts/audited/labels/staging");
    run.op("DELETE", path, req, expect("label.delete", "label", true, false)).await;
    let req = app.post("/v1/prompts/audited/rollback", json!({"to": 1}));
    run.op("POST", "/v1/prompts/{name}/rollback", req, expect("prompt.rollback", "prompt", true, true)).await;

    // Ingest is exempt: no entry.
    let req = app.post("/v1/traces", json!({"traces": [trace("audited", 0), trace("audited", 1)]}));
    let ids = run.op("POST", "/v1/traces", req, None).await;
    let id = ids["ids"][0].as_str().unwrap().to_owned();
    let req = app.post(&format!("/v1/traces/{id}/feedback"), json!({"comment": "late"}));
    run.op("POST", "/v1/traces/{id}/feedback", req, None).await;
    let req = app.post("/v1/otlp/v1/traces", json!({"resourceSpans": []}));
    run.op("POST", "/v1/otlp/v1/traces", req, None).await;
    let req = app.post("/v1/otlp/v1/logs", json!({"resourceLogs": []}));
    run.op("POST", "/v1/otlp/v1/logs", req, None).await;
    let basic = format!("Basic {}", STANDARD.encode(format!("{}:{}", &app.admin_key[..12], app.admin_key)));
    let req = app
        .http
        .post(app.url("/api/public/otel/v1/traces"))
        .header("authorization", basic)
        .json(&json!({"resourceSpans": []}));
    run.op("POST", "/api/public/otel/v1/traces", req, None).await;

    // What operators do to traces.
    let path = "/v1/traces/{id}/quarantine";
    let req = app.post(&format!("/v1/traces/{id}/quarantine"), json!({"reason": "odd"}));
    run.op("POST", path, req, expect("trace.quarantine", "trace", true, true)).await;
    let req = delete(&app, &format!("/v1/traces/{id}/quarantine"));
    run.op("DELETE", path, req, expect("trace.release", "trace", true, true)).await;
    let req = delete(&app, &format!("/v1/traces/{id}"));
    run.op("DELETE", "/v1/traces/{id}", req, expect("trace.delete", "trace", true, false)).await;
    let req = app.post("/v1/traces/quarantine", json!({"prompt": "audited"}));
    run.op("POST", "/v1/traces/quarantine", req, expect("traces.quarantine", "prompt", false, true)).await;
    let req = app.post("/v1/prompts/audited/traces/requeue", json!({"all": true}));
    run.op("POST", "/v1/prompts/{name}/traces/requeue", req, expect("traces.requeue", "prompt", false, true)).await;

    // Rounds: by key, by signed webhook; the backoff reset.
    for name in ["rounds", "hooked"] {
        assert_eq!(app.post("/v1/prompts", json!({"name": name, "base": "Hi."})).send().await.unwrap().status(), 201);
        let traces = json!({"traces": [trace(name, 0), trace(name, 1)]});
        assert_eq!(app.post("/v1/traces", traces).send().await.unwrap().status(), 201);
    }
    let req = app.post("/v1/prompts/rounds/rounds", json!({}));
    run.op("POST", "/v1/prompts/{name}/rounds", req, expect("round.trigger", "round", false, true)).await;
    let req = signed(&app, "hooked", "msg_audit", "{}");
    run.op("POST", "/v1/hooks/rounds/{name}", req, expect("round.trigger", "round", false, true)).await;
    let req = delete(&app, "/v1/prompts/audited/backoff");
    run.op("DELETE", "/v1/prompts/{name}/backoff", req, expect("prompt.backoff.clear", "prompt", true, true)).await;

    // Keys and webhooks, whose secrets are shown once and never logged.
    let req = app.post("/v1/keys", json!({"name": "ci", "scopes": ["prompts:read"]}));
    let key = run.op("POST", "/v1/keys", req, expect("key.create", "key", false, true)).await;
    let req = delete(&app, &format!("/v1/keys/{}", key["id"].as_str().unwrap()));
    run.op("DELETE", "/v1/keys/{id}", req, expect("key.revoke", "key", true, false)).await;
    let req = app.post("/v1/webhooks", json!({"url": "http://127.0.0.1:9/hook", "events": ["round.failed"]}));
    let hook = run.op("POST", "/v1/webhooks", req, expect("webhook.create", "webhook", false, true)).await;
    let req = delete(&app, &format!("/v1/webhooks/{}", hook["id"].as_str().unwrap()));
    run.op("DELETE", "/v1/webhooks/{id}", req, expect("webhook.delete", "webhook", true, false)).await;

    // Members: a person's explicit grant, set (again: then it has a before) and removed.
    let req = app.put("/v1/members/ann@example.com", json!({"project": "default", "role": "viewer"}));
    run.op("PUT", "/v1/members/{subject}", req, expect("member.set", "member", false, true)).await;
    // The grant in the same project changes (one per project).
    let req = app.put("/v1/members/ann@example.com", json!({"project": "default", "role": "admin"}));
    run.op("PUT", "/v1/members/{subject}", req, expect("member.set", "member", true, true)).await;
    let req = delete(&app, "/v1/members/ann@example.com");
    run.op("DELETE", "/v1/members/{subject}", req, expect("member.remove", "member", true, false)).await;

    // Evaluators.
    let evaluators = json!({"evaluators": [{"name": "mentions", "kind": "checks", "checks": [{"type": "contains", "text": "answer"}]}]});
    let req = app.put("/v1/prompts/audited/evaluators", evaluators);
    run.op("PUT", "/v1/prompts/{name}/evaluators", req, expect("prompt.evaluators.update", "prompt", true, true)).await;

    // Regression sets.
    let checks = json!([{"type": "contains", "text": "answer"}]);
    let req = app.post("/v1/prompts/audited/regression-cases", json!({"input": "hi", "checks": checks}));
    let path = "/v1/prompts/{name}/regression-cases";
    let case = run.op("POST", path, req, expect("regression_case.create", "regression_case", false, true)).await;
    let req = delete(&app, &format!("/v1/prompts/audited/regression-cases/{}", case["id"].as_str().unwrap()));
    let path = "/v1/prompts/{name}/regression-cases/{id}";
    run.op("DELETE", path, req, expect("regression_case.delete", "regression_case", true, false)).await;
    // Its before-value is the one case deleted, not the set.
    let page: Value = app.get("/v1/audit?page_size=1").send().await.unwrap().json().await.unwrap();
    let before = &page["entries"][0]["before"];
    let one = (&before["id"], &before["input"], &before["checks"][0]["text"]);
    assert_eq!(one, (&case["id"], &json!("hi"), &json!("answer")), "{before}");
    let line = json!({"input": [{"role": "user", "content": "2+2?"}], "ideal": "4"}).to_string();
    let req =
        app.http.post(app.url("/v1/prompts/audited/regression-cases/import")).bearer_auth(&app.admin_key).body(line);
    let path = "/v1/prompts/{name}/regression-cases/import";
    run.op("POST", path, req, expect("regression_cases.import", "prompt", false, true)).await;
    let pinned = ids["ids"][1].as_str().unwrap();
    let req = app.post(&format!("/v1/traces/{pinned}/pin"), json!({"checks": checks}));
    run.op("POST", "/v1/traces/{id}/pin", req, expect("regression_case.pin", "regression_case", false, true)).await;
    let req = app.put("/v1/prompts/audited/gate", json!({"mode": "cases"}));
    run.op("PUT", "/v1/prompts/{name}/gate", req, expect("prompt.gate.update", "prompt", true, true)).await;
    // Projects.
    let req = app.post("/v1/projects", json!({"name": "audited-team"}));
    run.op("POST", "/v1/projects", req, expect("project.create", "project", false, true)).await;
    let req = patch(&app, "/v1/projects/audited-team", json!({"settings": {"prompt_defaults": {"max_wait_secs": 60}}}));
    run.op("PATCH", "/v1/projects/{name}", req, expect("project.update", "project", true, true)).await;

    // A harness's answer needs a learned version awaiting it: its entry is
    // checked where that story is told (regression.rs, the harness test).
    run.covered.insert(("POST".into(), "/v1/prompts/{name}/versions/{number}/evaluation".into()));

    // Every write operation of the document was run here.
    let missing: Vec<_> = writes.difference(&run.covered).collect();
    assert!(missing.is_empty(), "write operations this test does not run: {missing:?}");
    let unknown: Vec<_> = run.covered.difference(&writes).collect();
    assert!(unknown.is_empty(), "operations the document does not name: {unknown:?}");

    // No secret in any entry: the new key's, the webhook's, the admin key.
    let all = app.get("/v1/audit?page_size=500").send().await.unwrap().text().await.unwrap();
    let key_secret = key["secret"].as_str().unwrap();
    let hook_secret = hook["secret"].as_str().unwrap();
    assert!(key_secret.starts_with("cmb_") && hook_secret.starts_with("whsec_"));
    for secret in [key_secret, &key_secret[12..], hook_secret, &app.admin_key, &app.admin_key[12..]] {
        assert!(!all.contains(secret), "a secret reached the audit log");
    }
    assert!(!all.contains("whsec_"), "no webhook secret at all");
    let page: Value = serde_json::from_str(&all).unwrap();
    let created_key = page["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["action"] == "key.create" && e["resource_id"] == key["id"])
        .unwrap();
    assert_eq!(created_key["after"]["prefix"], key["prefix"], "the visible prefix stays: {created_key}");
}

async fn the_log_pages_filters_and_refuses_what_is_not_its_own(b: Backend) {
    let app = spawn_app(b).await;
    let admin = admin_id(&app).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let res = app.post("/v1/keys", json!({"name": format!("k{i}"), "scopes": ["prompts:read"]})).send().await;
        let body: Value = res.unwrap().json().await.unwrap();
        ids.push(body["id"].as_str().unwrap().to_owned());
    }
    // Failed writes append nothing: a refused body, an unknown key, a missing scope.
    let before = newest(&app).await;
    expect_problem(app.post("/v1/keys", json!({"name": "x", "scopes": []})).send().await.unwrap(), 422).await;
    let stranger = app.http.post(app.url("/v1/keys")).bearer_auth("cmb_nope").json(&json!({"name": "x"}));
    expect_problem(stranger.send().await.unwrap(), 401).await;
    let reader = app.key_with(&["prompts:read"]).await;
    let after_reader = newest(&app).await;
    assert_eq!(after_reader, before + 1, "creating the reader's key is one entry");
    let denied =
        app.http.post(app.url("/v1/keys")).bearer_auth(&reader).json(&json!({"name": "x", "scopes": ["admin"]}));
    expect_problem(denied.send().await.unwrap(), 403).await;
    assert_eq!(newest(&app).await, after_reader, "no entry for a refused write");

    // Pages of two, newest first, each entry once.
    let mut seen = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let url = match &token {
            Some(t) => format!("/v1/audit?action=key.create&actor={admin}&page_size=2&page_token={t}"),
            None => format!("/v1/audit?action=key.create&actor={admin}&page_size=2"),
        };
        let page: Value = app.get(&url).send().await.unwrap().json().await.unwrap();
        for e in page["entries"].as_array().unwrap() {
            assert_eq!(e["actor_id"], admin.as_str());
            seen.push((e["id"].as_i64().unwrap(), e["resource_id"].as_str().unwrap().to_owned()));
        }
        match page["next_page_token"].as_str() {
            Some(t) => token = Some(t.to_owned()),
            None => break,
        }
    }
    assert!(seen.windows(2).all(|w| w[0].0 > w[1].0), "newest first, no repeats: {seen:?}");
    // The reader's key, then the five, newest first (the first admin key's entry is the system's).
    let resources: Vec<String> = seen.iter().map(|s| s.1.clone()).collect();
    let expected: Vec<String> = ids.iter().rev().cloned().collect();
    assert_eq!(resources.len(), 6, "{seen:?}");
    assert_eq!(resources[1..], expected[..]);

    // Filters: the resource, the actor by name, time.
    let one: Value = app
        .get(&format!("/v1/audit?resource_type=key&resource_id={}", ids[2]))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(one["entries"].as_array().unwrap().len(), 1);
    assert_eq!(one["entries"][0]["after"]["name"], "k2");
    let by_name: Value =
        app.get("/v1/audit?actor=bootstrap%20admin&page_size=100").send().await.unwrap().json().await.unwrap();
    assert_eq!(by_name["entries"].as_array().unwrap().len(), 6);
    let future = (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339().replace('+', "%2B");
    let past = (chrono::Utc::now() - chrono::Duration::hours(1)).to_rfc3339().replace('+', "%2B");
    let later: Value = app.get(&format!("/v1/audit?since={future}")).send().await.unwrap().json().await.unwrap();
    assert!(later["entries"].as_array().unwrap().is_empty());
    let window: Value = app
        .get(&format!("/v1/audit?since={past}&until={future}&page_size=100"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let everything: Value = app.get("/v1/audit?page_size=100").send().await.unwrap().json().await.unwrap();
    assert_eq!(window["entries"], everything["entries"], "every entry is in the last hour");

    // Bad input is a 4xx with a reason; readers are not admins.
    expect_problem(app.get(&format!("/v1/audit?since={future}&until={past}")).send().await.unwrap(), 422).await;
    expect_problem(app.get("/v1/audit?page_token=x").send().await.unwrap(), 400).await;
    expect_problem(app.get("/v1/audit?action=").send().await.unwrap(), 422).await;
    expect_problem(app.get("/v1/audit?since=yesterday").send().await.unwrap(), 400).await;
    let as_reader = app.http.get(app.url("/v1/audit")).bearer_auth(&reader).send().await.unwrap();
    expect_problem(as_reader, 403).await;
}

/// `combee audit` reads the log; `combee keys` on the store records its OS user.
async fn the_command_line_reads_and_writes_the_log(b: Backend) {
    let app = spawn_app(b).await;
    let config = tempfile::tempdir().unwrap();
    std::fs::write(config.path().join("default.toml"), "").unwrap();
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_combee"));
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("COMBEE__")) {
        cmd.env_remove(k);
    }
    let out = cmd
        .args(["keys", "create", "--name", "by-hand", "--scopes", "prompts:read"])
        .env("COMBEE_CONFIG_DIR", config.path())
        .env("COMBEE__DATABASE__URL", &app.url)
        .env_remove("DATABASE_URL")
        .env("USER", "auditor")
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let secret = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    // A retention pass run by hand is recorded even when it deleted nothing.
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_combee"));
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("COMBEE__")) {
        cmd.env_remove(k);
    }
    let out = cmd
        .args(["prune", "--json"])
        .env("COMBEE_CONFIG_DIR", config.path())
        .env("COMBEE__DATABASE__URL", &app.url)
        .env_remove("DATABASE_URL")
        .env("USER", "pruner")
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let pruned: Value = app.get("/v1/audit?action=retention.run").send().await.unwrap().json().await.unwrap();
    let run = &pruned["entries"][0];
    assert_eq!((run["actor_type"].as_str(), run["actor_name"].as_str()), (Some("cli"), Some("pruner")), "{pruned}");
    assert!(run["after"]["other"].is_object(), "the report is the entry's after: {run}");

    let audit = |args: &[&str]| {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_combee"));
        cmd.arg("audit").args(args).env("COMBEE_URL", &app.base).env("COMBEE_API_KEY", &app.admin_key);
        cmd.output()
    };
    let out = audit(&["--json", "--actor", "auditor"]).await.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    let entries = listed["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "{listed}");
    assert_eq!((entries[0]["actor_type"].as_str(), entries[0]["action"].as_str()), (Some("cli"), Some("key.create")));
    assert_eq!(entries[0]["after"]["name"], "by-hand");
    assert!(!String::from_utf8_lossy(&out.stdout).contains(&secret[12..]), "the key's secret is not in the log");

    // Two pages of one: the first says how to go on; the table names the actions.
    let out = audit(&["--limit", "1"]).await.unwrap();
    assert!(out.status.success());
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.starts_with("ID") && table.contains("retention.run") && table.contains("cli:pruner"), "{table}");
    let more = String::from_utf8(out.stderr).unwrap();
    let token = more.trim().strip_prefix("more entries: --page-token ").unwrap_or_else(|| panic!("{more}"));
    let out = audit(&["--json", "--page-token", token]).await.unwrap();
    let rest: Value = serde_json::from_slice(&out.stdout).unwrap();
    let older: Vec<(&str, &str)> = rest["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["actor_type"].as_str().unwrap(), e["action"].as_str().unwrap()))
        .collect();
    assert_eq!(older, [("cli", "key.create"), ("system", "key.create")], "then the first admin key, made at start-up");

    // A reader's key gets exit code 3.
    let reader = app.key_with(&["prompts:read"]).await;
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_combee"));
    let out = cmd.arg("audit").env("COMBEE_URL", &app.base).env("COMBEE_API_KEY", &reader).output().await.unwrap();
    assert_eq!(out.status.code(), Some(3));
}

fn hidden(html: &str, name: &str) -> String {
    let marker = format!(r#"name="{name}" value=""#);
    let start = html.find(&marker).unwrap_or_else(|| panic!("no hidden {name} in page")) + marker.len();
    html[start..].split('"').next().unwrap().to_owned()
}

/// The web UI's sign-in, forms and sign-out are each one entry by the session's key; a form sent without a
/// valid session is none; the audit page lists them for an admin and is linked from the navigation.
async fn the_web_ui_is_audited_and_shows_the_log(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("p").await;
    let res = app.post("/v1/prompts/p/versions", json!({"base": "Second."})).send().await.unwrap();
    assert_eq!(res.status(), 201);
    let last = newest(&app).await;
    let signed_in = sign_in(&app, &app.admin_key).await;
    assert_eq!(signed_in.status(), 303);
    let cookie = set_cookie(&signed_in, "combee_session").unwrap();
    let http = plain_client();
    let page = http.get(app.url("/ui/prompts/p")).header("cookie", format!("combee_session={cookie}")).send();
    let html = page.await.unwrap().text().await.unwrap();
    assert!(html.contains(r#"href="/ui/audit""#), "an admin's navigation links the audit log");
    let csrf = hidden(&html, "csrf");
    let promote = |cookie: String| {
        http.post(app.url("/ui/prompts/p/promote"))
            .header("cookie", format!("combee_session={cookie}"))
            .form(&[("csrf", csrf.as_str()), ("version", "2"), ("expected", "1")])
            .send()
    };
    let stale = promote("not-a-session".into()).await.unwrap();
    assert_eq!(stale.status(), 303, "to the sign-in page");
    assert_eq!(promote(cookie.clone()).await.unwrap().status(), 303);
    let logout = http
        .post(app.url("/ui/logout"))
        .header("cookie", format!("combee_session={cookie}"))
        .form(&[("csrf", csrf.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(logout.status(), 303);

    let new = entries_after(&app, last).await;
    let actions: Vec<&str> = new.iter().map(|e| e["action"].as_str().unwrap()).collect();
    assert_eq!(actions, ["ui.sign_in", "label.move", "ui.sign_out"], "{new:#?}");
    let admin = admin_id(&app).await;
    for e in &new {
        assert_eq!((e["actor_type"].as_str(), e["actor_id"].as_str()), (Some("ui"), Some(admin.as_str())), "{e}");
        assert_eq!(e["method"], "POST");
    }
    assert_eq!(new[1]["route"], "/ui/prompts/{name}/promote");
    assert_eq!((new[1]["before"]["version"].as_i64(), new[1]["after"]["version"].as_i64()), (Some(1), Some(2)));
    assert!(!serde_json::to_string(&new).unwrap().contains(&app.admin_key[12..]), "the key typed in is not logged");

    // The page, for an admin (a reader gets no link and a 403).
    let again = set_cookie(&sign_in(&app, &app.admin_key).await, "combee_session").unwrap();
    let page = http.get(app.url("/ui/audit?action=label.move")).header("cookie", format!("combee_session={again}"));
    let page = page.send().await.unwrap();
    assert_eq!(page.status(), 200);
    let html = page.text().await.unwrap();
    assert!(html.contains(r#"<table id="audit">"#) && html.contains("/ui/prompts/{name}/promote"), "{html}");
    assert!(!html.contains("ui.sign_in"), "filtered by action");
    let reader = app.key_with(&["prompts:read"]).await;
    let theirs = set_cookie(&sign_in(&app, &reader).await, "combee_session").unwrap();
    let prompts = http.get(app.url("/ui/prompts")).header("cookie", format!("combee_session={theirs}")).send();
    assert!(!prompts.await.unwrap().text().await.unwrap().contains(r#"href="/ui/audit""#));
    let denied = http.get(app.url("/ui/audit")).header("cookie", format!("combee_session={theirs}")).send();
    assert_eq!(denied.await.unwrap().status(), 403);
}

fn entry(action: &str, resource: &str) -> NewAuditEntry {
    NewAuditEntry::new(
        Actor::Cli { user: "tester".into() },
        RequestOrigin::default(),
        action,
        Some("key".into()),
        Some(resource.into()),
        None,
        Some(json!({"name": resource, "secret": "cmb_0123456789012345678901234567890123456789"})),
    )
}

/// Runs raw SQL on the store's database, past combee's code.
async fn raw(b: Backend, url: &str, sql: &str) -> Result<(), sqlx::Error> {
    match b {
        Backend::Postgres => sqlx::raw_sql(sql).execute(&mut sqlx::PgConnection::connect(url).await?).await.map(|_| ()),
        Backend::Sqlite => {
            sqlx::raw_sql(sql).execute(&mut sqlx::SqliteConnection::connect(url).await?).await.map(|_| ())
        }
    }
}

async fn the_store_keeps_entries_append_only_but_for_retention(b: Backend) {
    let ts = test_store(b).await;
    let s = &ts.store;
    for (action, resource) in [("key.create", "a"), ("key.create", "b"), ("key.revoke", "a")] {
        s.append_audit(&entry(action, resource)).await.unwrap();
    }
    let all = s.audit_entries(&AuditQuery::default(), 10).await.unwrap();
    assert_eq!(all.iter().map(|e| e.action.as_str()).collect::<Vec<_>>(), ["key.revoke", "key.create", "key.create"]);
    assert_eq!(all[0].after.as_ref().unwrap()["secret"], "[redacted]", "redacted before it is stored");
    assert_eq!((all[0].actor_type.as_str(), all[0].actor_name.as_str()), ("cli", "tester"));
    let q = AuditQuery { resource_id: Some("a".into()), ..Default::default() };
    assert_eq!(s.audit_entries(&q, 10).await.unwrap().len(), 2);
    let q = AuditQuery { action: Some("key.create".into()), before_id: Some(all[1].id), ..Default::default() };
    assert_eq!(s.audit_entries(&q, 10).await.unwrap(), vec![all[2].clone()]);
    let q = AuditQuery { actor: Some("tester".into()), ..Default::default() };
    assert_eq!(s.audit_entries(&q, 2).await.unwrap().len(), 2, "the limit holds");

    // The database itself refuses to change or remove an entry.
    for sql in ["UPDATE audit_log SET actor_name = 'someone else'", "DELETE FROM audit_log"] {
        let err = raw(b, &ts.url, sql).await.expect_err(sql).to_string();
        assert!(err.contains("append-only"), "{sql}: {err}");
    }

    // Retention: an entry ten days old goes with `audit_days = 5`; the others stay.
    let old_at = match b {
        Backend::Postgres => "now() - interval '10 days'".to_owned(),
        Backend::Sqlite => (chrono::Utc::now() - chrono::Duration::days(10)).timestamp_micros().to_string(),
    };
    let insert = format!(
        "INSERT INTO audit_log (at, actor_type, actor_name, action) VALUES ({old_at}, 'cli', 'tester', 'old.thing')"
    );
    raw(b, &ts.url, &insert).await.unwrap();
    let keep_forever = Pruner::new(s.clone(), Default::default(), 24);
    let report = keep_forever.pass(chrono::Utc::now(), &Default::default()).await.unwrap();
    assert!(!report.other.contains_key("audit_log"), "kept forever by default");
    let settings = combee::config::RetentionSettings { audit_days: 5, ..Default::default() };
    let pruner = Pruner::new(s.clone(), settings, 24);
    let dry = pruner.dry_run(chrono::Utc::now()).await.unwrap();
    assert_eq!(dry.other["audit_log"], 1);
    let report = pruner.pass(chrono::Utc::now(), &Default::default()).await.unwrap();
    assert_eq!(report.other["audit_log"], 1);
    let left = s.audit_entries(&AuditQuery::default(), 10).await.unwrap();
    assert_eq!(left, all, "only the old entry went");
    pruner.record(Actor::Worker { name: "retention".into() }, &report).await;
    let run = &s.audit_entries(&AuditQuery::default(), 1).await.unwrap()[0];
    assert_eq!(
        (run.action.as_str(), run.actor_type.as_str(), run.actor_name.as_str()),
        ("retention.run", "worker", "retention")
    );
    assert_eq!(run.after.as_ref().unwrap()["other"]["audit_log"], 1);

    // The pruning left no way open behind it.
    let err = raw(b, &ts.url, "DELETE FROM audit_log").await.expect_err("delete").to_string();
    assert!(err.contains("append-only"), "{err}");
    // Only entries older than the cutoff pass, even on the pruning path.
    assert_eq!(s.prune_audit(chrono::Utc::now() - chrono::Duration::days(1), 100).await.unwrap(), 0);
    assert_eq!(s.audit_entries(&AuditQuery::default(), 10).await.unwrap().len(), 4);
}

on_both_stores!(
    every_write_operation_appends_exactly_one_entry,
    the_log_pages_filters_and_refuses_what_is_not_its_own,
    the_store_keeps_entries_append_only_but_for_retention,
);

on_one_store!(
    cli_on_postgres: the_command_line_reads_and_writes_the_log(Postgres),
    ui_on_sqlite: the_web_ui_is_audited_and_shows_the_log(Sqlite),
);
