//! Learning with a REAL MODEL: the real server on port 0 with its worker,
//! pointed at llama.cpp's OpenAI-compatible server running a real small model
//! (SmolLM2-135M-Instruct by default), which `scripts/test` builds, starts and
//! names in `COMBEE_REAL_LLM_URL` / `COMBEE_REAL_LLM_MODEL`. The server runs on
//! product defaults: only the backend's URL and the model names are set. The
//! tests check what a user would see from a small local model: a round ends
//! and publishes, the round record says how each answer was read and which
//! structured-output form each call asked for, and a backend that refuses
//! `response_format` is still learned from, and the real model judges traces
//! as an LLM-judge evaluator whose calibration against the agents' feedback
//! is reported (the pipeline is checked, not the tiny model's agreement).
//! Nothing a round publishes fails the lesson check (a small model's echoes of
//! the protocol are refused, not served). One test learns from llama.cpp's own
//! `llama-server` on its defaults (four slots sharing one context), which
//! `scripts/test` builds and names in `COMBEE_LLAMA_SERVER_URL`: its round ends
//! without a call failed for a full context.
//! `COMBEE_REAL_LLM=0` skips them.

use crate::common;

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    body::Bytes,
    extract::State,
    http::{Method, StatusCode, Uri},
    response::{IntoResponse, Response},
};
use common::{Backend, TestApp, eventually_every, spawn_app_with};
use serde_json::{Value, json};

/// The base text of the prompts the tests learn on.
const BASE: &str = "You are a support agent for an online shop. Answer the customer's message.";

/// The llama.cpp server a test learns from, held for the test's length.
struct RealLlm {
    url: String,
    model: String,
    /// An exclusive lock on a file named after the server: two tests that get
    /// the same one-slot server take turns instead of queueing each other's calls.
    _turn: std::fs::File,
}

/// The llama.cpp server to learn with, or `None` when `COMBEE_REAL_LLM=0` says
/// to skip. Without either, the test fails: a skipped test that reads as passed
/// would hide that nothing was run. `scripts/test` starts one server per slot of
/// the tests' nextest group and names them all in `COMBEE_REAL_LLM_URLS`; a test
/// takes the one of its slot (`NEXTEST_TEST_GROUP_SLOT`), so the group's tests
/// run side by side, each on a server of its own.
fn real_llm() -> Option<RealLlm> {
    if skipped() {
        return None;
    }
    let one = std::env::var("COMBEE_REAL_LLM_URL").unwrap_or_else(|_| {
        panic!(
            "the real-model tests need a llama.cpp server with a real model: run them through \
             scripts/test (it builds and starts one), or set COMBEE_REAL_LLM_URL (…/v1) and \
             COMBEE_REAL_LLM_MODEL yourself, or COMBEE_REAL_LLM=0 to skip them"
        )
    });
    let all = std::env::var("COMBEE_REAL_LLM_URLS").unwrap_or_default();
    let mut urls: Vec<&str> = all.split_whitespace().collect();
    if urls.is_empty() {
        urls.push(&one);
    }
    let slot: usize = std::env::var("NEXTEST_TEST_GROUP_SLOT").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    let url = urls[slot % urls.len()].to_owned();
    let model = std::env::var("COMBEE_REAL_LLM_MODEL").unwrap_or_else(|_| "local".to_owned());
    eprintln!("REAL MODEL server {url} (slot {slot} of {})", urls.len());
    Some(RealLlm { _turn: turn_on(&url), url, model })
}

fn skipped() -> bool {
    let skip = std::env::var("COMBEE_REAL_LLM").as_deref() == Ok("0");
    if skip {
        eprintln!("skipped: COMBEE_REAL_LLM=0 (the real-model tests need a llama.cpp server)");
    }
    skip
}

/// An exclusive lock on a file named after the server `url`, held while a test uses it.
fn turn_on(url: &str) -> std::fs::File {
    let name: String = url.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("real-llm-{name}.lock"));
    let turn = std::fs::File::create(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    turn.lock().unwrap_or_else(|e| panic!("locking {}: {e}", path.display()));
    turn
}

/// llama.cpp's own `llama-server` on its defaults (SmolLM2), which
/// `scripts/test` builds and starts and names in `COMBEE_LLAMA_SERVER_URL`; or
/// `None` when `COMBEE_REAL_LLM=0` says to skip. Without either, the test fails.
fn llama_server() -> Option<RealLlm> {
    if skipped() {
        return None;
    }
    let url = std::env::var("COMBEE_LLAMA_SERVER_URL").unwrap_or_else(|_| {
        panic!(
            "this test needs llama.cpp's own llama-server on its defaults: run it through scripts/test \
             (it builds and starts one), or set COMBEE_LLAMA_SERVER_URL (…/v1) yourself, or \
             COMBEE_REAL_LLM=0 to skip it"
        )
    });
    eprintln!("REAL MODEL llama-server {url} (its defaults)");
    Some(RealLlm { _turn: turn_on(&url), url, model: "smollm2".to_owned() })
}

/// The real server with its worker on product defaults, learning from `url`.
async fn spawn_learning_app(b: Backend, url: &str, model: &str) -> TestApp {
    spawn_app_with(b, |s| {
        s.server.role = combee::config::ProcessRole::All;
        s.llm.base_url = url.to_owned();
        s.llm.reflector_model = model.to_owned();
        s.llm.aggregator_model = model.to_owned();
    })
    .await
}

/// A support agent's runs on an online shop, each with feedback that says in
/// plain words what the reply got wrong (or that it was right).
fn support_traces(prompt: &str) -> Vec<Value> {
    let runs = [
        (
            "Where is my parcel? I ordered a kettle last week.",
            "Your parcel is on its way and should arrive soon.",
            false,
            0.3,
            "The reply did not give the order number (A-1042) or the tracking link, so the customer could not follow the parcel.",
        ),
        (
            "I want to return the shoes I bought, they are too small.",
            "Sure, you can return them.",
            false,
            0.2,
            "The reply did not say how to return the item: it should state the 30-day return window and link the returns form.",
        ),
        (
            "You charged me twice for order A-2231!",
            "Sorry about that. Anything else I can help with?",
            false,
            0.1,
            "The reply did not apologise specifically or say that the duplicate charge is refunded within 5 working days.",
        ),
        (
            "Can I change the delivery address for order A-3310?",
            "Yes, I have changed the address for order A-3310 to the one you gave. You will get a confirmation email.",
            true,
            1.0,
            "Correct: the reply named the order number and confirmed the change.",
        ),
        (
            "My discount code SAVE10 does not work.",
            "Discount codes sometimes do not work.",
            false,
            0.2,
            "The reply did not check the code's expiry date or tell the customer that SAVE10 expired on 31 October.",
        ),
        (
            "Hello, is the blue jacket available in size M?",
            "We have many jackets.",
            false,
            0.2,
            "The reply did not answer the question: it should say whether size M is in stock and offer to notify when it is back.",
        ),
        (
            "I never received my refund for order A-1877.",
            "Refunds take time.",
            false,
            0.3,
            "The reply did not give the order number or the date the refund was sent, and did not offer to escalate.",
        ),
        (
            "How do I cancel my subscription?",
            "Go to Account > Subscription > Cancel. Your subscription stays active until the end of the paid month.",
            true,
            1.0,
            "Correct: the reply gave the exact steps and said when the cancellation takes effect.",
        ),
        (
            "The mixer I received is broken.",
            "Please send it back.",
            false,
            0.2,
            "The reply did not ask for a photo of the damage or offer a replacement before asking for a return.",
        ),
        (
            "Do you ship to Norway?",
            "Yes.",
            false,
            0.4,
            "The reply did not give the shipping cost (12 EUR) or the delivery time (5 to 7 days) for Norway.",
        ),
    ];
    runs.iter()
        .map(|(question, reply, success, score, comment)| {
            json!({
                "prompt": prompt,
                "input": {"customer_message": question},
                "trajectory": [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": reply}
                ],
                "output": reply,
                "feedback": {"success": success, "score": score, "comment": comment}
            })
        })
        .collect()
}

/// How often a test looks at what it waits for: the model takes seconds a call,
/// and every look costs the machine it shares.
const POLL: Duration = Duration::from_secs(1);

/// How long a test waits for the model's work before it fails: a guard against
/// a hang, well above what a round took in CI (747–861 s).
const WAIT: Duration = Duration::from_secs(1800);

/// Creates a prompt on its defaults, sends the traces in one request (so a round
/// the worker may start by itself sees them all), triggers a round (or takes the
/// one the worker started) and waits for it to end. Returns the round record.
async fn learn_from(app: &TestApp, name: &str, traces: Vec<Value>) -> Value {
    let res = app.post("/v1/prompts", json!({"name": name, "base": BASE})).send().await.unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    let res = app.post("/v1/traces", json!({"traces": traces})).send().await.unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    let res = app.post(&format!("/v1/prompts/{name}/rounds"), json!({})).send().await.unwrap();
    let id = if res.status() == 202 {
        res.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned()
    } else {
        // 409: the worker started a round on the backlog first.
        assert_eq!(res.status(), 409, "{}", res.text().await.unwrap());
        let rounds: Value = app.get(&format!("/v1/prompts/{name}/rounds")).send().await.unwrap().json().await.unwrap();
        rounds["rounds"][0]["id"].as_str().expect("the round the worker started").to_owned()
    };
    let started = Instant::now();
    // A one-slot server on two shared cores, niced beside the rest of the suite
    // (scripts/test): a round takes minutes (12 to 15 in CI), and is looked at once a
    // second (each look is the whole round record).
    let deadline = started + WAIT;
    let r = eventually_every("the round's end", deadline, POLL, async || {
        let r: Value = app.get(&format!("/v1/rounds/{id}")).send().await.unwrap().json().await.unwrap();
        let ended = r["status"] == "succeeded" || r["status"] == "failed";
        if ended { Ok(r) } else { Err(format!("still {}: {}", r["status"], summary(&r, started.elapsed()))) }
    })
    .await;
    eprintln!("{}", summary(&r, started.elapsed()));
    r
}

/// One line on a round: how it ended, its calls, how their answers were read.
fn summary(round: &Value, elapsed: Duration) -> String {
    let mut reads: BTreeMap<String, usize> = BTreeMap::new();
    let mut formats: BTreeMap<String, usize> = BTreeMap::new();
    for call in round["llm_calls"].as_array().into_iter().flatten() {
        *reads.entry(call["read"].as_str().unwrap_or("-").to_owned()).or_default() += 1;
        *formats.entry(call["output_format"].as_str().unwrap_or("-").to_owned()).or_default() += 1;
    }
    format!(
        "REAL MODEL round {} after {:.0} s (attempt {}): {} calls, {} prompt + {} completion tokens; read {reads:?}; \
         output_format {formats:?}; error {}",
        round["status"],
        elapsed.as_secs_f64(),
        round["attempt"],
        round["usage"]["calls"],
        round["usage"]["prompt_tokens"],
        round["usage"]["completion_tokens"],
        round["error"],
    )
}

const READS: [&str; 4] = ["schema", "text", "repaired", "refused"];
const FORMATS: [&str; 4] = ["json_schema", "json_object_schema", "json_object", "plain"];

async fn a_round_with_a_real_model_publishes_and_says_how_it_read(b: Backend) {
    let Some(llm) = real_llm() else { return };
    let app = spawn_learning_app(b, &llm.url, &llm.model).await;
    // Six traces, not more: each group of reflections costs an aggregation, a
    // minute or two of this model's writing (a ten-trace round made five).
    let traces: Vec<Value> = support_traces("support-agent").into_iter().take(6).collect();
    let round = learn_from(&app, "support-agent", traces).await;

    // (a) The round ends: it publishes a version learned from its traces, or
    // none when every change its model proposed was refused by the lesson
    // check (what a 135M model writes is often the protocol's own markup);
    // whatever it publishes passes the check.
    assert_eq!(round["status"], "succeeded", "{round}");
    assert_eq!(round["trace_ids"].as_array().unwrap().len(), 6);
    eprintln!("REAL MODEL refused changes: {}", round["detail"]["outcome"]["refused"]);
    match round["result_version"].as_i64() {
        Some(version) => {
            assert!(version >= 2, "{round}");
            let v: Value = app
                .get(&format!("/v1/prompts/support-agent/versions/{version}"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            assert_eq!(v["source"], "learned", "{v}");
            eprintln!("REAL MODEL learned version {version}:\n{}", v["text"].as_str().unwrap());
            assert_every_bullet_passes_the_lesson_check(&v);
        }
        None => {
            let prompt: Value = app.get("/v1/prompts/support-agent").send().await.unwrap().json().await.unwrap();
            assert_eq!(prompt["version"], 1, "an unchanged round writes no version: {prompt}");
            eprintln!("REAL MODEL round ended unchanged: nothing it learned passed the lesson check");
        }
    }
    // What the aggregators proposed and what level 2 did with it, for whoever reads the log.
    eprintln!("REAL MODEL group outputs: {}", round["detail"]["group_outputs"]);
    eprintln!("REAL MODEL reduce: {}", round["detail"]["outcome"]);

    // (b) Every call records the output format it asked for, every answer how
    // it was read, and at least one answer was read from what the model wrote.
    let calls = round["llm_calls"].as_array().expect("the round's LLM calls");
    assert!(calls.len() >= 7, "a reflection per trace and an aggregation: {calls:?}");
    for call in calls {
        let format = call["output_format"].as_str().unwrap_or_else(|| panic!("no output_format: {call}"));
        assert!(FORMATS.contains(&format), "{call}");
        if call["error"].is_null() {
            let read = call["read"].as_str().unwrap_or_else(|| panic!("an answer with no `read`: {call}"));
            assert!(READS.contains(&read), "{call}");
            if read == "refused" {
                assert!(call["refused_answer"].is_string(), "a refused answer's text is kept: {call}");
            }
        }
    }
    assert!(
        calls.iter().any(|c| c["read"].as_str().is_some_and(|r| r != "refused")),
        "no answer was read from the answer itself: {calls:?}"
    );
}

/// Every section name and bullet of a published version passes the lesson
/// check: no number, punctuation or echo of the protocol's markup is served.
fn assert_every_bullet_passes_the_lesson_check(version: &Value) {
    use combee::{domain::DeltaOp, learn::lesson_check};
    let base = version["base"].as_str().unwrap_or(BASE);
    for section in version["playbook"]["sections"].as_array().into_iter().flatten() {
        for bullet in section["bullets"].as_array().into_iter().flatten() {
            let op = DeltaOp::Add {
                section: section["name"].as_str().unwrap_or_default().to_owned(),
                content: bullet["content"].as_str().unwrap_or_default().to_owned(),
                reason: String::new(),
            };
            assert_eq!(lesson_check::check_op(&op, base), Ok(()), "a published bullet fails the check: {op:?}");
        }
    }
}

/// What the proxy saw.
#[derive(Default)]
struct Refusals {
    refused: AtomicUsize,
    forwarded: AtomicUsize,
}

struct Proxy {
    upstream: String,
    http: reqwest::Client,
    seen: Refusals,
}

/// A backend that does not know `response_format`: any request carrying it is
/// answered 400 as such servers do, the rest goes to the real server.
async fn refuse_response_format(State(proxy): State<Arc<Proxy>>, method: Method, uri: Uri, body: Bytes) -> Response {
    let carries_format =
        serde_json::from_slice::<Value>(&body).is_ok_and(|v| v.get("response_format").is_some_and(|f| !f.is_null()));
    if carries_format {
        proxy.seen.refused.fetch_add(1, Ordering::Relaxed);
        let error = json!({"error": {"message": "response_format is not supported", "type": "invalid_request_error"}});
        return (StatusCode::BAD_REQUEST, axum::Json(error)).into_response();
    }
    proxy.seen.forwarded.fetch_add(1, Ordering::Relaxed);
    let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
    let target = format!("{}{}", proxy.upstream, path.strip_prefix("/v1").unwrap_or(path));
    let forwarded =
        proxy.http.request(method, target).header("content-type", "application/json").body(body).send().await;
    match forwarded {
        Ok(res) => {
            let status = StatusCode::from_u16(res.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            let body = res.bytes().await.unwrap_or_default();
            (status, [("content-type", "application/json")], body).into_response()
        }
        Err(e) => (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
    }
}

/// Starts the proxy on port 0; returns its `/v1` URL.
async fn spawn_refusing_proxy(upstream: &str) -> (String, Arc<Proxy>) {
    let proxy = Arc::new(Proxy {
        upstream: upstream.trim_end_matches('/').to_owned(),
        http: reqwest::Client::new(),
        seen: Refusals::default(),
    });
    let router = axum::Router::new().fallback(refuse_response_format).with_state(proxy.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    (format!("http://{addr}/v1"), proxy)
}

async fn a_backend_that_refuses_response_format_is_read_the_old_way(b: Backend) {
    let Some(llm) = real_llm() else { return };
    let (proxy_url, proxy) = spawn_refusing_proxy(&llm.url).await;
    let app = spawn_learning_app(b, &proxy_url, &llm.model).await;
    // Four traces: the subject is how the backend is asked and read, not what is learned.
    let traces = support_traces("plain-backend").into_iter().take(4).collect();
    let round = learn_from(&app, "plain-backend", traces).await;
    let (refused, forwarded) =
        (proxy.seen.refused.load(Ordering::Relaxed), proxy.seen.forwarded.load(Ordering::Relaxed));
    let calls = round["llm_calls"].as_array().expect("the round's LLM calls");
    let widest = calls.iter().filter_map(|c| c["concurrency_limit"].as_u64()).max().unwrap_or(1) as usize;
    eprintln!(
        "the proxy refused {refused} requests carrying response_format and forwarded {forwarded}; \
         concurrency limit at most {widest}"
    );

    // Detected once: each of the three shapes is refused at most by the calls in
    // flight when it was first refused (at most the concurrency limit), then never
    // asked for again.
    assert!(refused <= 3 * widest, "refused {refused} with at most {widest} calls in flight");
    assert!(forwarded >= 4, "the answers came through the proxy");
    let answered: Vec<&Value> = calls.iter().filter(|c| !c["read"].is_null()).collect();
    assert!(answered.len() >= 4, "{calls:?}");
    for call in &answered {
        assert_eq!(
            call["output_format"], "plain",
            "an answered call through a backend without response_format: {call}"
        );
        assert_ne!(call["read"], "schema", "no schema was enforced: {call}");
        if call["read"] == "refused" {
            // What the model wrote is kept for the operator, next to why it was refused.
            let text =
                call["refused_answer"].as_str().unwrap_or_else(|| panic!("a refused answer without its text: {call}"));
            assert!(!text.is_empty() && text.chars().count() <= 2_001, "{call}");
            assert!(call["error"].as_str().is_some_and(|e| e.contains("invalid answer")), "{call}");
        }
    }
    // Read by text, a 135M model rarely writes a whole reflection: the round may fail,
    // as documented; then the prompt backs off instead of re-running the same traces.
    match round["status"].as_str() {
        // A version, or none when what it learned left the prompt as it was.
        Some("succeeded") if round["result_version"].is_null() => {
            let prompt: Value = app.get("/v1/prompts/plain-backend").send().await.unwrap().json().await.unwrap();
            assert_eq!(prompt["version"], 1, "an unchanged round writes no version: {prompt}");
        }
        Some("succeeded") => assert!(round["result_version"].as_i64().is_some_and(|v| v >= 2), "{round}"),
        Some("failed") => {
            let learning: Value =
                app.get("/v1/prompts/plain-backend/learning").send().await.unwrap().json().await.unwrap();
            assert_eq!(learning["state"], "backing_off", "{learning}");
            assert_eq!(learning["failure_streak"], 1, "{learning}");
        }
        other => panic!("round ended {other:?}: {round}"),
    }
}

/// A plain rubric for the support traces above (whose feedback says what the
/// replies got wrong).
const SUPPORT_RUBRIC: &str = "The reply answers the customer's question completely and concretely: it names the \
    order number, the steps, the dates or the amounts the customer needs. A vague or evasive reply fails.";

async fn a_real_model_judges_traces_and_its_calibration_is_reported(b: Backend) {
    let Some(llm) = real_llm() else { return };
    let app = spawn_learning_app(b, &llm.url, &llm.model).await;
    let name = "judged-support";
    // A batch larger than the traces: no round competes with the judge for the one-slot server.
    let body = json!({"name": name, "base": "You are a support agent for an online shop.",
        "settings": {"batch_size": 1000}});
    let res = app.post("/v1/prompts", body).send().await.unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    let evaluators = json!({"evaluators": [{"kind": "judge", "name": "complete", "rubric": SUPPORT_RUBRIC}]});
    let res = app.put(&format!("/v1/prompts/{name}/evaluators"), evaluators).send().await.unwrap();
    assert_eq!(res.status(), 200, "{}", res.text().await.unwrap());
    let traces = support_traces(name);
    let with_feedback = traces.len();
    let res = app.post("/v1/traces", json!({"traces": traces})).send().await.unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    let ids: Vec<String> = res.json::<Value>().await.unwrap()["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().into())
        .collect();
    assert_eq!(ids.len(), with_feedback);

    // Every trace judged (a verdict kept on it, scored or saying why not).
    let started = Instant::now();
    let deadline = started + WAIT;
    let verdicts: Vec<Value> = eventually_every("every trace judged", deadline, POLL, async || {
        let mut out = Vec::new();
        for id in &ids {
            let t: Value = app.get(&format!("/v1/traces/{id}")).send().await.unwrap().json().await.unwrap();
            match t["judged"]["judgements"].as_array().and_then(|js| js.first()) {
                Some(j) => out.push(j.clone()),
                None => return Err(format!("{} of {} judged", out.len(), ids.len())),
            }
        }
        Ok(out)
    })
    .await;
    let scored = verdicts.iter().filter(|j| j["score"].is_number()).count();
    for j in &verdicts {
        assert_eq!(j["evaluator"], "complete", "{j}");
        assert!(j["score"].as_f64().is_some_and(|s| (0.0..=1.0).contains(&s)) || j["error"].is_string(), "{j}");
    }
    eprintln!(
        "REAL MODEL {} judged {} traces in {:.0} s: {scored} scored; verdicts {}",
        llm.model,
        verdicts.len(),
        started.elapsed().as_secs_f64(),
        Value::from(verdicts.clone())
    );
    assert!(scored > 0, "the judge scored no trace: {verdicts:?}");
    // The agent's feedback is never overwritten by the judge.
    let t: Value = app.get(&format!("/v1/traces/{}", ids[0])).send().await.unwrap().json().await.unwrap();
    assert_ne!(t["feedback_source"], "judge", "{t}");

    // Calibration through the CLI, as an operator asks for it: n is every
    // judged trace with feedback the judge scored.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_combee"))
        .args(["evaluators", "calibrate", name, "--json"])
        .env("COMBEE_URL", &app.base)
        .env("COMBEE_API_KEY", &app.admin_key)
        .env_remove("COMBEE_CONFIG_DIR")
        .output()
        .await
        .expect("run combee");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let cal: Value = serde_json::from_slice(&out.stdout).unwrap();
    let api: Value =
        app.get(&format!("/v1/prompts/{name}/evaluators/calibration")).send().await.unwrap().json().await.unwrap();
    assert_eq!(cal, api, "the CLI prints the API's calibration");
    let e = &cal["evaluators"][0];
    assert_eq!(e["evaluator"], "complete", "{cal}");
    assert_eq!(e["n"].as_u64(), Some(scored as u64), "{cal}");
    assert_eq!(cal["traces"].as_u64(), Some(with_feedback as u64), "{cal}");
    let accuracy = e["accuracy"].as_f64().expect("an accuracy");
    assert!((0.0..=1.0).contains(&accuracy), "{cal}");
    assert!(e["kappa"].is_null() || e["kappa"].as_f64().is_some_and(|k| (-1.0..=1.0).contains(&k)), "{cal}");
    eprintln!(
        "REAL MODEL {} judge calibration: n {} accuracy {} kappa {} (of {with_feedback} traces with feedback)",
        llm.model, e["n"], e["accuracy"], e["kappa"]
    );
}

/// llama.cpp's own server on its defaults: four slots sharing one context of
/// 8,192 tokens, which long answers at once fill ("Context size has been
/// exceeded."). combee reads what it holds from `GET /props`, keeps the calls
/// in flight within its slots and its context, and the round ends with no call
/// failed for a full context. Three traces (one aggregation) keep it short.
async fn a_round_on_llama_servers_own_defaults_never_fills_its_context(b: Backend) {
    let Some(llm) = llama_server() else { return };
    let app = spawn_learning_app(b, &llm.url, &llm.model).await;
    let traces = support_traces("slots").into_iter().take(3).collect();
    let round = learn_from(&app, "slots", traces).await;
    let calls = round["llm_calls"].as_array().expect("the round's LLM calls");
    assert!(calls.len() >= 4, "three reflections and an aggregation: {calls:?}");
    for call in calls {
        let error = call["error"].as_str().unwrap_or_default().to_lowercase();
        assert!(!error.contains("context"), "a call failed for the context: {call}");
        assert!(call["concurrency_limit"].as_u64().is_some_and(|l| l <= 4), "more than the four slots: {call}");
    }
    // The subject is the server's context, not the model's skill: a 135M model
    // may still write no usable aggregate, and the round then fails saying so.
    // Every call was answered (no transport error, no time-out) either way.
    if round["status"] != "succeeded" {
        assert_eq!(round["status"], "failed", "{round}");
        let error = round["error"].as_str().unwrap_or_default();
        let the_models_answers =
            error.starts_with("nothing learned") || error.starts_with("no trace could be reflected");
        assert!(the_models_answers, "the round failed for something else than the model's answers: {round}");
        assert!(!error.to_lowercase().contains("context"), "{round}");
        for call in calls {
            assert!(call["read"].is_string(), "a call with no answer to read: {call}");
        }
    }
    if round["result_version"].is_i64() {
        let version = round["result_version"].as_i64().unwrap();
        let v: Value =
            app.get(&format!("/v1/prompts/slots/versions/{version}")).send().await.unwrap().json().await.unwrap();
        assert_every_bullet_passes_the_lesson_check(&v);
    }
    // What the server said it holds, and that it never answered that its context was full.
    let metrics = app.get("/metrics").send().await.unwrap().text().await.unwrap();
    let gauge =
        |name: &str| metrics.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse::<f64>().ok()));
    assert_eq!(gauge("combee_llm_server_slots "), Some(4.0), "{metrics}");
    assert_eq!(gauge("combee_llm_context_tokens "), Some(8192.0), "{metrics}");
    assert!(gauge("combee_llm_context_full_total ").unwrap_or(0.0) == 0.0, "{metrics}");
}

// Long stories whose subject is the model, not the store: one on each store.
on_one_store!(
    postgres_a_real_model_judges_traces_and_its_calibration_is_reported: a_real_model_judges_traces_and_its_calibration_is_reported(Postgres),
    postgres_a_round_with_a_real_model_publishes_and_says_how_it_read: a_round_with_a_real_model_publishes_and_says_how_it_read(Postgres),
    sqlite_a_backend_that_refuses_response_format_is_read_the_old_way: a_backend_that_refuses_response_format_is_read_the_old_way(Sqlite),
    sqlite_a_round_on_llama_servers_own_defaults_never_fills_its_context: a_round_on_llama_servers_own_defaults_never_fills_its_context(Sqlite),
);
