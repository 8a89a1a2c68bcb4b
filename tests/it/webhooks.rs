//! Outbound webhooks end to end: the real server on port 0 with its delivery
//! worker, a real store, and a receiver (axum on port 0) in the test. The
//! signatures are checked by an independent Standard Webhooks implementation
//! (the `standardwebhooks` Python package, which `scripts/test` installs).

use crate::common;

use std::{
    fmt::Write,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    body::Bytes,
    extract::State,
    http::{HeaderMap, StatusCode},
    routing::post,
};
use combee::config::{ProcessRole, Settings};
use common::{Backend, TestApp, eventually, expect_problem, restart_app_with, spawn_app, spawn_app_with};
use serde_json::{Value, json};
use tokio::sync::watch;
use tracing::{
    Event, Level, Metadata, Subscriber,
    field::{Field, Visit},
    level_filters::LevelFilter,
    span::{Attributes, Id, Record},
};

/// One request the receiver got.
#[derive(Debug, Clone)]
struct Received {
    headers: Vec<(String, String)>,
    body: String,
    answered: u16,
}

impl Received {
    fn header(&self, name: &str) -> &str {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str()).unwrap_or_default()
    }
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).expect("a JSON body")
    }
}

#[derive(Clone)]
struct Receiver {
    url: String,
    got: Arc<Mutex<Vec<Received>>>,
    count: watch::Receiver<usize>,
}

type Plan = Arc<dyn Fn(usize) -> u16 + Send + Sync>;

#[derive(Clone)]
struct ReceiverState {
    got: Arc<Mutex<Vec<Received>>>,
    count: Arc<watch::Sender<usize>>,
    plan: Plan,
}

async fn receive(State(st): State<ReceiverState>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let headers = headers.iter().map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned())).collect();
    let (n, answered) = {
        let mut got = st.got.lock().unwrap();
        let answered = (st.plan)(got.len());
        got.push(Received { headers, body: String::from_utf8_lossy(&body).into_owned(), answered });
        (got.len(), answered)
    };
    st.count.send_replace(n);
    StatusCode::from_u16(answered).unwrap()
}

/// A receiver answering request number `i` (0-based) with `plan(i)`.
async fn spawn_receiver(plan: impl Fn(usize) -> u16 + Send + Sync + 'static) -> Receiver {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hooks/combee", listener.local_addr().unwrap());
    let got = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = watch::channel(0);
    let state = ReceiverState { got: got.clone(), count: Arc::new(tx), plan: Arc::new(plan) };
    let app = Router::new().route("/hooks/combee", post(receive)).with_state(state);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Receiver { url, got, count: rx }
}

impl Receiver {
    /// Waits until at least `n` requests arrived and returns them all.
    async fn wait_for(&self, n: usize) -> Vec<Received> {
        let mut count = self.count.clone();
        tokio::time::timeout(Duration::from_secs(30), count.wait_for(|c| *c >= n))
            .await
            .unwrap_or_else(|_| panic!("expected {n} deliveries, got {:?}", self.got.lock().unwrap().len()))
            .unwrap();
        self.got.lock().unwrap().clone()
    }
}

/// Deliveries on: the worker runs (its LLM is never called: no traces are
/// sent), private targets allowed (the receiver is on loopback), quick retries.
fn delivering(s: &mut Settings) {
    s.server.role = ProcessRole::All;
    s.llm.base_url = "http://127.0.0.1:9/v1".into();
    s.worker.poll_interval_ms = 50;
    s.webhooks.allow_private_targets = true;
    s.webhooks.retry_schedule_secs = vec![0];
    s.webhooks.poll_interval_ms = 50;
    s.webhooks.request_timeout_secs = 5;
}

async fn subscribe(app: &TestApp, url: &str, events: &[&str]) -> Value {
    let res =
        app.post("/v1/webhooks", json!({"url": url, "events": events, "description": "test"})).send().await.unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    res.json().await.unwrap()
}

/// The subscription's delivery log once it has at least `n` attempts.
async fn log_with(app: &TestApp, id: &str, n: usize) -> Vec<Value> {
    eventually(&format!("{n} delivery attempts"), Duration::from_secs(30), async || {
        let log: Value = app.get(&format!("/v1/webhooks/{id}/deliveries")).send().await.unwrap().json().await.unwrap();
        let rows = log["deliveries"].as_array().cloned().unwrap_or_default();
        if rows.len() >= n { Ok(rows) } else { Err(log.to_string()) }
    })
    .await
}

const VERIFY_PY: &str = r#"
import json, sys
from standardwebhooks.webhooks import Webhook
secret, headers_path, body_path = sys.argv[1:4]
headers = json.load(open(headers_path))
body = open(body_path, "rb").read()
print(json.dumps(Webhook(secret).verify(body, headers)))
"#;

/// Runs the Python reference implementation over a received request.
fn python_verifies(secret: &str, r: &Received, body: &str) -> Result<Value, String> {
    let dir = tempfile::tempdir().unwrap();
    let headers: serde_json::Map<String, Value> =
        r.headers.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect();
    let hp = dir.path().join("headers.json");
    let bp = dir.path().join("body");
    std::fs::write(&hp, Value::Object(headers).to_string()).unwrap();
    std::fs::write(&bp, body.as_bytes()).unwrap();
    let out = std::process::Command::new("python3")
        .args(["-c", VERIFY_PY, secret])
        .arg(&hp)
        .arg(&bp)
        .output()
        .expect("python3 runs (scripts/test installs `standardwebhooks`)");
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).expect("verifier prints the payload"))
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

async fn signatures_verify_with_the_reference_implementation(b: Backend) {
    let rx = spawn_receiver(|_| 204).await;
    let app = spawn_app_with(b, delivering).await;
    let sub = subscribe(&app, &rx.url, &["version.created"]).await;
    let secret = sub["secret"].as_str().unwrap();
    assert!(secret.starts_with("whsec_"));
    app.create_prompt("signed").await;

    let got = rx.wait_for(1).await;
    let r = &got[0];
    assert!(r.header("webhook-id").starts_with("msg_"));
    assert_eq!(r.header("content-type"), "application/json");
    let payload = python_verifies(secret, r, &r.body).expect("the reference implementation accepts the signature");
    assert_eq!(payload["type"], "version.created");
    assert_eq!((payload["data"]["prompt"].as_str(), payload["data"]["version"].as_i64()), (Some("signed"), Some(1)));
    assert_eq!(payload["data"]["labels"], json!(["production"]));
    assert!(chrono::DateTime::parse_from_rfc3339(payload["timestamp"].as_str().unwrap()).is_ok());

    let tampered = r.body.replace("signed", "signeD");
    assert!(python_verifies(secret, r, &tampered).is_err(), "a changed body must not verify");
    let other = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    assert!(python_verifies(other, r, &r.body).is_err(), "another secret must not verify");
}

async fn failures_are_retried_with_the_same_id_until_one_succeeds(b: Backend) {
    let rx = spawn_receiver(|i| if i < 2 { 500 } else { 200 }).await;
    let app = spawn_app_with(b, delivering).await;
    let sub = subscribe(&app, &rx.url, &["version.created"]).await;
    let id = sub["id"].as_str().unwrap();
    app.create_prompt("flaky").await;

    let got = rx.wait_for(3).await;
    let log = log_with(&app, id, 3).await;
    let got_now = rx.got.lock().unwrap().clone();
    assert_eq!(got_now.len(), 3, "no attempt after the success: {got_now:?}");
    assert_eq!(got.iter().map(|r| r.answered).collect::<Vec<_>>(), [500, 500, 200]);
    let ids: Vec<&str> = got.iter().map(|r| r.header("webhook-id")).collect();
    assert!(ids.iter().all(|i| *i == ids[0] && !i.is_empty()), "one webhook-id on every attempt: {ids:?}");
    assert!(got.iter().all(|r| r.body == got[0].body), "the same body every time");
    assert_eq!(got[0].json()["type"], "version.created", "only the subscribed event type");

    // The log, newest first: every attempt with its status, the last a success.
    let rows: Vec<(i64, Option<i64>)> =
        log.iter().map(|r| (r["attempt"].as_i64().unwrap(), r["status_code"].as_i64())).collect();
    assert_eq!(rows, [(3, Some(200)), (2, Some(500)), (1, Some(500))]);
    assert!(log.iter().all(|r| r["event_id"] == ids[0] && r["event_type"] == "version.created"));
    assert!(log.iter().all(|r| r["delivery_status"] == "succeeded"));
    assert!(log[0]["error"].is_null() && log[0]["next_attempt_at"].is_null());
    assert!(log[1]["error"].as_str().unwrap().contains("500"));
    assert!(log[1]["next_attempt_at"].is_string());
    assert!(log.iter().all(|r| r["latency_ms"].is_u64() && r["attempted_at"].is_string()));
}

async fn an_event_written_before_a_restart_is_delivered_after_it(b: Backend) {
    let rx = spawn_receiver(|_| 200).await;
    // First process: API only, so nothing is delivered; the event waits in the outbox.
    let mut first = spawn_app_with(b, |s| {
        delivering(s);
        s.server.role = ProcessRole::Api;
    })
    .await;
    let sub = subscribe(&first, &rx.url, &["version.created", "label.moved"]).await;
    let id = sub["id"].as_str().unwrap().to_owned();
    first.create_prompt("durable").await;
    let log: Value = first.get(&format!("/v1/webhooks/{id}/deliveries")).send().await.unwrap().json().await.unwrap();
    assert_eq!(log["deliveries"], json!([]), "no deliverer in an API-only process");
    first.shutdown.cancel();
    (&mut first.server).await.unwrap().unwrap();
    assert!(rx.got.lock().unwrap().is_empty());

    // Second process on the same store, with the delivery worker.
    let second = restart_app_with(&first, delivering).await;
    let got = rx.wait_for(2).await;
    let mut types: Vec<String> = got.iter().map(|r| r.json()["type"].as_str().unwrap().to_owned()).collect();
    types.sort();
    assert_eq!(types, ["label.moved", "version.created"]);
    let moved = got.iter().map(Received::json).find(|p| p["type"] == "label.moved").unwrap();
    assert_eq!(
        moved["data"],
        json!({"prompt": "durable", "project": "default", "label": "production", "version": 1, "previous_version": null, "moved_by": moved["data"]["moved_by"]})
    );
    assert_eq!(log_with(&second, &id, 2).await.len(), 2);
}

async fn private_targets_are_refused_by_default(b: Backend) {
    let app = spawn_app(b).await;
    for url in [
        "http://127.0.0.1/hook",
        "http://localhost:8080/hook",
        "http://10.0.0.7/x",
        "http://[::1]/x",
        "http://169.254.169.254/latest",
    ] {
        let res = app.post("/v1/webhooks", json!({"url": url, "events": ["round.failed"]})).send().await.unwrap();
        let p = expect_problem(res, 422).await;
        assert!(p["detail"].as_str().unwrap().contains("allow_private_targets"), "{url}: {p}");
    }
    for (body, why) in [
        (json!({"url": "ftp://example.com/x", "events": ["round.failed"]}), "http or https"),
        (json!({"url": "https://example.com/x", "events": ["round.exploded"]}), "unknown event"),
        (json!({"url": "https://example.com/x", "events": []}), "at least one"),
        (
            json!({"url": "https://example.com/x", "events": ["label.moved"], "description": "d".repeat(501)}),
            "description",
        ),
        (json!({"url": format!("https://example.com/{}", "x".repeat(3000)), "events": ["label.moved"]}), "longer"),
    ] {
        let res = app.post("/v1/webhooks", body).send().await.unwrap();
        let p = expect_problem(res, 422).await;
        assert!(p["detail"].as_str().unwrap().contains(why), "{p}");
    }
    let res = app.post("/v1/webhooks", json!({"events": ["label.moved"]})).send().await.unwrap();
    expect_problem(res, 422).await;
    let reader = app.key_with(&["prompts:read"]).await;
    let res = app
        .http
        .post(app.url("/v1/webhooks"))
        .bearer_auth(reader)
        .json(&json!({"url": "https://example.com/x", "events": ["label.moved"]}))
        .send()
        .await
        .unwrap();
    expect_problem(res, 403).await;
    let list: Value = app.get("/v1/webhooks").send().await.unwrap().json().await.unwrap();
    assert_eq!(list["webhooks"], json!([]), "nothing refused was stored");
}

async fn gone_disables_the_subscription(b: Backend) {
    let gone = spawn_receiver(|_| 410).await;
    let ok = spawn_receiver(|_| 200).await;
    let app = spawn_app_with(b, delivering).await;
    let sub = subscribe(&app, &gone.url, &["version.created", "label.moved"]).await;
    let id = sub["id"].as_str().unwrap();
    app.create_prompt("first").await;
    gone.wait_for(1).await;
    let log = log_with(&app, id, 1).await;
    assert_eq!(log[0]["status_code"], 410);
    let hook: Value = app.get(&format!("/v1/webhooks/{id}")).send().await.unwrap().json().await.unwrap();
    assert_eq!(hook["enabled"], false, "{hook}");
    assert!(hook["disabled_reason"].as_str().unwrap().contains("410"));

    // A later event reaches a live subscriber but not the disabled one.
    subscribe(&app, &ok.url, &["version.created"]).await;
    app.create_prompt("second").await;
    let got = ok.wait_for(1).await;
    assert_eq!(got[0].json()["data"]["prompt"], "second");
    let before = log.len();
    let after = log_with(&app, id, 0).await;
    assert!(after.len() <= 2 && after.len() >= before, "{after:?}");
    assert!(gone.got.lock().unwrap().iter().all(|r| r.json()["data"]["prompt"] == "first"));
}

/// Every event and span field of this test process at debug level or above,
/// as text. A plain subscriber that keeps no span registry: installed while
/// the test's runtime threads already run, a registry's per-thread span
/// stacks could disagree with it and panic inside a library's task.
fn captured_logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let capture = Capture { sink: buf.clone(), next_span: AtomicU64::new(1) };
        let _ = tracing::subscriber::set_global_default(capture);
        buf
    })
    .clone()
}

struct Capture {
    sink: Arc<Mutex<Vec<u8>>>,
    next_span: AtomicU64,
}

impl Capture {
    fn write(&self, line: String) {
        let mut sink = self.sink.lock().unwrap();
        sink.extend_from_slice(line.as_bytes());
        sink.push(b'\n');
    }
}

/// Writes each field as `name=value`.
struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }
}

impl Subscriber for Capture {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        *metadata.level() <= Level::DEBUG
    }
    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::DEBUG)
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut fields = Fields(format!("span {}", span.metadata().name()));
        span.record(&mut fields);
        self.write(fields.0);
        Id::from_u64(self.next_span.fetch_add(1, Ordering::Relaxed))
    }
    fn record(&self, _: &Id, values: &Record<'_>) {
        let mut fields = Fields("span record".to_owned());
        values.record(&mut fields);
        self.write(fields.0);
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let meta = event.metadata();
        let mut fields = Fields(format!("{} {}", meta.level(), meta.target()));
        event.record(&mut fields);
        self.write(fields.0);
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

async fn secrets_stay_out_of_answers_and_logs(b: Backend) {
    let logs = captured_logs();
    let rx = spawn_receiver(|_| 200).await;
    let app = spawn_app_with(b, delivering).await;
    let sub = subscribe(&app, &rx.url, &["version.created", "label.moved"]).await;
    let secret = sub["secret"].as_str().unwrap().to_owned();
    let key_part = secret.strip_prefix("whsec_").unwrap().to_owned();
    let id = sub["id"].as_str().unwrap();
    app.create_prompt("quiet").await;
    rx.wait_for(2).await;
    log_with(&app, id, 2).await;

    for path in ["/v1/webhooks".to_owned(), format!("/v1/webhooks/{id}"), format!("/v1/webhooks/{id}/deliveries")] {
        let text = app.get(&path).send().await.unwrap().text().await.unwrap();
        assert!(!text.contains(&key_part), "{path} shows the secret: {text}");
        assert!(!text.contains("secret"), "{path} has a secret field: {text}");
    }
    let doc = app.get("/v1/openapi.json").send().await.unwrap().text().await.unwrap();
    assert!(doc.contains("/v1/webhooks/{id}/deliveries"));

    let logs = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    assert!(logs.contains("webhook delivered"), "the capture works");
    assert!(logs.contains("webhook subscription created"));
    assert!(!logs.contains(&key_part), "a log line shows the secret");
}

/// Posts `n` traces of `version` of `prompt`, the first `successes` successful, through the API.
async fn post_rewarded(app: &TestApp, prompt: &str, version: i64, successes: usize, n: usize) {
    let all: Vec<Value> = (0..n)
        .map(|i| {
            json!({"prompt": prompt, "prompt_version": version, "input": {"task": i},
                   "output": "done", "feedback": {"success": i < successes}})
        })
        .collect();
    for chunk in all.chunks(50) {
        let res = app.post("/v1/traces", json!({"traces": chunk})).send().await.unwrap();
        assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    }
}

async fn production_of(app: &TestApp, prompt: &str) -> i64 {
    let labels: Value = app.get(&format!("/v1/prompts/{prompt}/labels")).send().await.unwrap().json().await.unwrap();
    labels["labels"].as_array().unwrap().iter().find(|l| l["name"] == "production").unwrap()["version"]
        .as_i64()
        .unwrap()
}

/// An operator's new version made production (`promote` in the label history).
async fn promote_new_version(app: &TestApp, prompt: &str, base: &str) -> i64 {
    let res = app
        .post(&format!("/v1/prompts/{prompt}/versions"), json!({"base": base, "labels": ["production"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    res.json::<Value>().await.unwrap()["number"].as_i64().unwrap()
}

/// The regression guard on, ticking every second, with deliveries to loopback; no learning worker.
fn guarded(s: &mut Settings) {
    s.server.role = ProcessRole::All;
    s.webhooks.allow_private_targets = true;
    s.webhooks.poll_interval_ms = 50;
    s.guard.tick_secs = 1;
}

/// A new production version whose success rate falls well below the previous
/// one's is rolled back by the running guard within a tick: production points
/// at the previous version again, the label history has a `guard-rollback`
/// with the test's numbers, and a `prompt.rolled_back` webhook goes out.
async fn an_injected_regression_is_rolled_back_within_one_guard_tick(b: Backend) {
    let rx = spawn_receiver(|_| 204).await;
    let app = spawn_app_with(b, guarded).await;
    subscribe(&app, &rx.url, &["prompt.rolled_back"]).await;
    app.create_prompt("guarded").await;
    post_rewarded(&app, "guarded", 1, 54, 60).await; // 90 %
    let v2 = promote_new_version(&app, "guarded", "You are a careless agent.").await;
    post_rewarded(&app, "guarded", v2, 24, 60).await; // 40 %
    let started = std::time::Instant::now();
    eventually("the guard's roll-back", Duration::from_secs(10), async || {
        let production = production_of(&app, "guarded").await;
        if production == 1 { Ok(()) } else { Err(format!("production is v{production}")) }
    })
    .await;
    let took = started.elapsed();
    eprintln!("regression guard: production rolled back {took:?} after the regression was posted (tick 1 s)");
    assert!(took < Duration::from_secs(3), "more than one tick (1 s) plus slack: {took:?}");

    let got = rx.wait_for(1).await;
    let event = got[0].json();
    assert_eq!(event["type"], "prompt.rolled_back");
    let data = &event["data"];
    assert_eq!((data["prompt"].as_str(), data["kind"].as_str()), (Some("guarded"), Some("guard-rollback")));
    assert_eq!((data["version"].as_i64(), data["previous_version"].as_i64()), (Some(1), Some(v2)));
    assert_eq!(data["moved_by"], "guard");

    let history: Value = app.get("/v1/prompts/guarded/labels/history").send().await.unwrap().json().await.unwrap();
    let top = &history["moves"][0];
    assert_eq!((top["kind"].as_str(), top["actor"].as_str()), (Some("guard-rollback"), Some("guard")));
    assert_eq!((top["from_version"].as_i64(), top["to_version"].as_i64()), (Some(v2), Some(1)));
    let evidence = &top["evidence"];
    assert_eq!(evidence["fired_on"], "previous_production");
    let test = &evidence["previous_production"];
    assert_eq!(
        (test["metric"].as_str(), test["reference_n"].as_u64(), test["current_n"].as_u64()),
        (Some("success"), Some(60), Some(60))
    );
    assert!(
        (test["reference"].as_f64().unwrap() - 0.9).abs() < 1e-9
            && (test["current"].as_f64().unwrap() - 0.4).abs() < 1e-9
    );
    assert!(test["p_value"].as_f64().unwrap() < 0.01, "{test}");
    assert!(top["reason"].as_str().unwrap().contains("rolled back to v1"), "{top}");
    assert_eq!(data["evidence"], *evidence, "the webhook carries the same numbers");
}

/// Judged directly (one tick of the same guard the worker runs): thin
/// evidence, a drop within noise and a prompt that opted out are left alone;
/// the operator who re-promotes a version the guard took out is not overruled.
async fn thin_or_noisy_evidence_never_rolls_back(b: Backend) {
    use combee::{config::GuardSettings, worker::guard::RegressionGuard};
    let app = spawn_app(b).await;
    let guard = RegressionGuard::new(app.store.clone(), GuardSettings::default());

    app.create_prompt("thin").await;
    post_rewarded(&app, "thin", 1, 40, 40).await;
    let thin = promote_new_version(&app, "thin", "worse").await;
    post_rewarded(&app, "thin", thin, 0, 40).await; // 100 % → 0 %, but 40 < 50 traces a side

    app.create_prompt("noisy").await;
    post_rewarded(&app, "noisy", 1, 48, 60).await; // 80 %
    let noisy = promote_new_version(&app, "noisy", "same").await;
    post_rewarded(&app, "noisy", noisy, 45, 60).await; // 75 %: p ≈ 0.26

    app.create_prompt("opted-out").await;
    let res = app
        .http
        .patch(app.url("/v1/prompts/opted-out/settings"))
        .bearer_auth(&app.admin_key)
        .json(&json!({"regression_guard": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200, "{}", res.text().await.unwrap());
    post_rewarded(&app, "opted-out", 1, 60, 60).await;
    let opted = promote_new_version(&app, "opted-out", "worse").await;
    post_rewarded(&app, "opted-out", opted, 0, 60).await;

    app.create_prompt("overruled").await;
    post_rewarded(&app, "overruled", 1, 60, 60).await;
    let bad = promote_new_version(&app, "overruled", "worse").await;
    post_rewarded(&app, "overruled", bad, 10, 60).await;

    guard.tick(chrono::Utc::now()).await.unwrap();
    assert_eq!(production_of(&app, "thin").await, thin);
    assert_eq!(production_of(&app, "noisy").await, noisy);
    assert_eq!(production_of(&app, "opted-out").await, opted);
    assert_eq!(production_of(&app, "overruled").await, 1, "the clear regression is rolled back");

    // The operator puts it back on purpose: the guard respects that, tick after tick.
    let res = app
        .put("/v1/prompts/overruled/labels/production", json!({"version": bad, "reason": "expected dip, new task mix"}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    guard.tick(chrono::Utc::now()).await.unwrap();
    guard.tick(chrono::Utc::now()).await.unwrap();
    assert_eq!(production_of(&app, "overruled").await, bad);
    let history: Value = app.get("/v1/prompts/overruled/labels/history").send().await.unwrap().json().await.unwrap();
    let kinds: Vec<&str> = history["moves"].as_array().unwrap().iter().map(|m| m["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, vec!["promote", "guard-rollback", "promote", "create"]);
    assert_eq!(history["moves"][0]["reason"], "expected dip, new task mix");
    for name in ["thin", "noisy", "opted-out"] {
        let h: Value =
            app.get(&format!("/v1/prompts/{name}/labels/history")).send().await.unwrap().json().await.unwrap();
        assert!(h["moves"].as_array().unwrap().iter().all(|m| m["kind"] != "guard-rollback"), "{name}: {h}");
    }
}

on_both_stores!(
    an_injected_regression_is_rolled_back_within_one_guard_tick,
    thin_or_noisy_evidence_never_rolls_back,
    signatures_verify_with_the_reference_implementation,
    failures_are_retried_with_the_same_id_until_one_succeeds,
    an_event_written_before_a_restart_is_delivered_after_it,
    private_targets_are_refused_by_default,
    gone_disables_the_subscription,
    secrets_stay_out_of_answers_and_logs,
);
