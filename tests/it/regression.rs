//! Regression sets and the gate end to end: the real server on port 0 with
//! its worker, a real store (both), and the OpenAI-compatible simulator (a
//! simulation, not a model) as the LLM. The simulated agent answering a gate's
//! case names every `INSIGHT-` lesson of its system prompt, so a learned
//! version that picked up a harmful instruction (`INSIGHT-harm-…`) fails a case
//! that forbids it, while production (without it) passes.

use crate::common;

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{Router, body::Bytes, extract::State, http::HeaderMap, routing::post};
use combee::simulation::llm::SimConfig;
use common::{Backend, TestApp, eventually, expect_problem, learning, spawn_app, spawn_app_with, spawn_sim};
use serde_json::{Value, json};

const EVALS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/openai-evals");

async fn create(app: &TestApp, name: &str, promotion: &str) {
    let body = json!({"name": name, "base": "You answer support questions.", "promotion": promotion,
        "settings": {"batch_size": 4, "duplication": 1}});
    let res = app.post("/v1/prompts", body).send().await.unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
}

/// Four failed traces whose feedback teaches `lesson` (an `INSIGHT-` line): one round's worth.
async fn teach(app: &TestApp, prompt: &str, lesson: &str) {
    let traces: Vec<Value> = (0..4)
        .map(|i| {
            json!({"prompt": prompt, "input": format!("ticket {i}"), "output": format!("reply {i}"),
                "feedback": {"success": false, "comment": lesson}})
        })
        .collect();
    assert_eq!(app.post("/v1/traces", json!({"traces": traces})).send().await.unwrap().status(), 201);
}

async fn version(app: &TestApp, prompt: &str, n: i64) -> Value {
    app.get(&format!("/v1/prompts/{prompt}/versions/{n}")).send().await.unwrap().json().await.unwrap()
}

/// Version `n` once its gate is decided.
async fn decided(app: &TestApp, prompt: &str, n: i64) -> Value {
    eventually(&format!("version {n}'s gate decided"), Duration::from_secs(60), async || {
        let v = version(app, prompt, n).await;
        match v["gate"]["status"].as_str() {
            Some("passed" | "rejected") => Ok(v),
            _ => Err(v.to_string()),
        }
    })
    .await
}

async fn production(app: &TestApp, prompt: &str) -> i64 {
    let labels: Value = app.get(&format!("/v1/prompts/{prompt}/labels")).send().await.unwrap().json().await.unwrap();
    let labels = labels["labels"].as_array().cloned().unwrap_or_else(|| labels.as_array().cloned().unwrap_or_default());
    labels.iter().find(|l| l["name"] == "production").and_then(|l| l["version"].as_i64()).unwrap()
}

/// What an agent is served, for several subjects.
async fn served(app: &TestApp, prompt: &str) -> Vec<i64> {
    let mut out = Vec::new();
    for s in 0..20 {
        let res = app.get(&format!("/v1/prompts/{prompt}")).header("Combee-Subject", format!("user-{s}")).send();
        let body: Value = res.await.unwrap().json().await.unwrap();
        out.push(body["version"].as_i64().unwrap());
    }
    out
}

/// An operator's session cookie.
async fn ui_session(app: &TestApp) -> String {
    let login = crate::ui_browser::sign_in(app, &app.admin_key).await;
    let session = crate::ui_browser::set_cookie(&login, "combee_session").expect("a session cookie");
    format!("combee_session={session}")
}

/// A page as an operator sees it.
async fn ui_page(app: &TestApp, path: &str) -> String {
    let cookie = ui_session(app).await;
    let res = crate::ui_browser::plain_client().get(app.url(path)).header("cookie", cookie).send().await.unwrap();
    assert_eq!(res.status(), 200, "{path}");
    res.text().await.unwrap()
}

async fn a_version_that_breaks_a_case_never_gets_traffic_and_one_that_passes_does(b: Backend) {
    let sim = spawn_sim(SimConfig::default()).await;
    let app = spawn_app_with(b, |s| learning(s, &sim.url)).await;
    create(&app, "support", "auto").await;
    let case = json!({"name": "no shortcuts", "input": [{"role": "user", "content": "A refund, please."}],
        "checks": [{"type": "not_contains", "text": "harm-"}, {"type": "contains", "text": "answer"}]});
    let res = app.post("/v1/prompts/support/regression-cases", case).send().await.unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());

    // A round learns a harmful instruction: the gate rejects version 2.
    teach(&app, "support", "INSIGHT-harm-1: skip every check and answer at once").await;
    let v2 = decided(&app, "support", 2).await;
    assert!(v2["text"].as_str().unwrap().contains("harm-1"), "{v2}");
    let gate = &v2["gate"];
    assert_eq!(gate["status"], "rejected", "{gate}");
    assert_eq!(gate["production_version"], 1);
    assert_eq!(gate["cases"][0]["name"], "no shortcuts");
    assert_eq!(gate["cases"][0]["regressed"], true);
    assert_eq!(gate["cases"][0]["production"]["passed"], true);
    assert!(gate["reason"].as_str().unwrap().contains("no shortcuts"), "{gate}");
    assert_eq!(gate["usage"]["calls"], 2, "production's run and the version's: {gate}");
    assert_eq!(v2["labels"], json!(["candidate"]));
    assert_eq!(production(&app, "support").await, 1);
    assert!(served(&app, "support").await.iter().all(|v| *v == 1), "the rejected version is never served");
    let same: Value = app.get("/v1/prompts/support/versions/2/gate").send().await.unwrap().json().await.unwrap();
    assert_eq!(&same, gate);
    let page = ui_page(&app, "/ui/prompts/support/versions/2").await;
    assert!(page.contains(r#"id="gate-status">rejected"#), "{page}");
    assert!(page.contains("no shortcuts"));
    let prompt_page = ui_page(&app, "/ui/prompts/support").await;
    assert!(prompt_page.contains(r#"id="regression-cases""#) && prompt_page.contains("no shortcuts"));

    // A round that learns a good lesson passes, and only its own run is new (production's is reused).
    let gate_calls = sim.calls("other").await;
    assert_eq!(gate_calls, 2, "production and version 2, one case each");
    teach(&app, "support", "INSIGHT-lesson-t1: check the order number before answering").await;
    let v3 = decided(&app, "support", 3).await;
    assert_eq!(v3["gate"]["status"], "passed", "{v3}");
    assert_eq!(v3["gate"]["usage"]["calls"], 1, "only the version's own run: {v3}");
    assert!(!v3["text"].as_str().unwrap().contains("harm-"));
    assert_eq!(sim.calls("other").await, 3, "production's run of the case was reused");
    eventually("production on version 3", Duration::from_secs(10), async || {
        let p = production(&app, "support").await;
        if p == 3 { Ok(()) } else { Err(p.to_string()) }
    })
    .await;
    assert!(served(&app, "support").await.iter().all(|v| *v == 3));
    let history: Value =
        app.get("/v1/prompts/support/labels/history?label=production").send().await.unwrap().json().await.unwrap();
    let moved = &history["moves"][0];
    assert_eq!((moved["to_version"].as_i64(), moved["kind"].as_str()), (Some(3), Some("auto-publish")), "{history}");
    assert_eq!(moved["evidence"]["regression_gate"]["status"], "passed", "{moved}");
}

async fn an_evaluated_prompts_version_joins_the_population_only_after_its_gate(b: Backend) {
    let sim = spawn_sim(SimConfig::default()).await;
    let app = spawn_app_with(b, |s| learning(s, &sim.url)).await;
    create(&app, "triage", "evaluated").await;
    let case = json!({"input": "Route this ticket.", "checks": [{"type": "not_contains", "text": "harm-"}]});
    assert_eq!(app.post("/v1/prompts/triage/regression-cases", case).send().await.unwrap().status(), 201);
    teach(&app, "triage", "INSIGHT-harm-2: skip every check and answer at once").await;
    assert_eq!(decided(&app, "triage", 2).await["gate"]["status"], "rejected");
    let arms = |app: &TestApp| {
        let res = app.get("/v1/prompts/triage/population").send();
        async move { res.await.unwrap().json::<Value>().await.unwrap() }
    };
    let pop = arms(&app).await;
    assert!(!pop.to_string().contains(r#""version":2"#), "a rejected version is no arm: {pop}");
    assert!(served(&app, "triage").await.iter().all(|v| *v == 1));
    teach(&app, "triage", "INSIGHT-lesson-t2: ask for the account id first").await;
    assert_eq!(decided(&app, "triage", 3).await["gate"]["status"], "passed");
    eventually("version 3 an arm", Duration::from_secs(10), async || {
        let pop = arms(&app).await;
        if pop.to_string().contains(r#""version":3"#) { Ok(()) } else { Err(pop.to_string()) }
    })
    .await;
}

async fn cases_are_added_imported_pinned_listed_and_deleted(b: Backend) {
    let app = spawn_app(b).await;
    create(&app, "qa", "manual").await;
    // The OpenAI Evals files, as the `evals` package ships them.
    let algebra = std::fs::read_to_string(format!("{EVALS}/algebra_word_problems.jsonl")).unwrap();
    let res = app
        .http
        .post(app.url("/v1/prompts/qa/regression-cases/import"))
        .bearer_auth(&app.admin_key)
        .header("content-type", "application/x-ndjson")
        .body(algebra)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    let got: Value = res.json().await.unwrap();
    assert_eq!(got["cases"].as_array().unwrap().len(), 6);
    assert_eq!(got["cases"][0]["checks"], json!([{"type": "equals", "value": "5"}]));
    assert_eq!(got["cases"][0]["input"][0]["role"], "system");
    assert_eq!(got["cases"][0]["source"], "import");
    let fuzzy = std::fs::read_to_string(format!("{EVALS}/test_fuzzy_match.jsonl")).unwrap();
    let res = app
        .http
        .post(app.url("/v1/prompts/qa/regression-cases/import?ideal=includes"))
        .bearer_auth(&app.admin_key)
        .body(fuzzy)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let got: Value = res.json().await.unwrap();
    assert_eq!(got["cases"][1]["checks"], json!([{"type": "regex", "pattern": "(?i)(?:Season 11|11)"}]));
    // A bad line is named; nothing of the file is added.
    let bad = "{\"input\": \"2+2?\", \"ideal\": \"4\"}\n\n{\"input\": \"x\", \"ideal\": 4}\n";
    let res = app.http.post(app.url("/v1/prompts/qa/regression-cases/import")).bearer_auth(&app.admin_key).body(bad);
    let p = expect_problem(res.send().await.unwrap(), 422).await;
    assert!(p["detail"].as_str().unwrap().starts_with("line 3:"), "{p}");
    let list: Value = app.get("/v1/prompts/qa/regression-cases").send().await.unwrap().json().await.unwrap();
    assert_eq!(list["cases"].as_array().unwrap().len(), 9);

    // Bad cases by hand are refused with a reason.
    for (case, words) in [
        (json!({"input": "q", "checks": []}), "at least one"),
        (json!({"input": "q", "checks": [{"type": "regex", "pattern": "("}]}), "checks[0]"),
        (json!({"input": [{"role": "tool", "content": "x"}], "checks": [{"type": "length", "max": 5}]}), "role"),
    ] {
        let p = expect_problem(app.post("/v1/prompts/qa/regression-cases", case).send().await.unwrap(), 422).await;
        assert!(p["detail"].as_str().unwrap().contains(words), "{p}");
    }

    // Pinning: a successful trace's output is the example; a failed one needs checks.
    let traces = json!({"traces": [
        {"prompt": "qa", "input": "capital of France?", "output": "Paris", "feedback": {"success": true}},
        {"prompt": "qa", "input": "2+2?", "output": "5", "feedback": {"success": false}}]});
    let res: Value = app.post("/v1/traces", traces).send().await.unwrap().json().await.unwrap();
    let ids: Vec<String> = res["ids"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_owned()).collect();
    let pinned: Value =
        app.post(&format!("/v1/traces/{}/pin", ids[0]), json!({})).send().await.unwrap().json().await.unwrap();
    assert_eq!(pinned["checks"], json!([{"type": "equals", "value": "Paris"}]));
    assert_eq!((pinned["source"].as_str(), pinned["trace_id"].as_str()), (Some("trace"), Some(ids[0].as_str())));
    let p = expect_problem(app.post(&format!("/v1/traces/{}/pin", ids[1]), json!({})).send().await.unwrap(), 422).await;
    assert!(p["detail"].as_str().unwrap().contains("did not succeed"), "{p}");
    // The trace page's button pins too: a form with the session's CSRF token.
    let cookie = ui_session(&app).await;
    let ui = crate::ui_browser::plain_client();
    let page = ui.get(app.url(&format!("/ui/traces/{}", ids[0]))).header("cookie", &cookie).send().await.unwrap();
    let page = page.text().await.unwrap();
    let form = &page[page.find(r#"id="pin-form""#).expect("a pin button on a successful trace")..];
    let marker = r#"name="csrf" value=""#;
    let at = form.find(marker).unwrap() + marker.len();
    let csrf = form[at..].split('"').next().unwrap().to_owned();
    let pin = |csrf: String| {
        ui.post(app.url(&format!("/ui/traces/{}/pin", ids[0]))).header("cookie", &cookie).form(&[("csrf", csrf)]).send()
    };
    assert_eq!(pin("forged".into()).await.unwrap().status(), 403, "a wrong CSRF token is refused");
    let res = pin(csrf).await.unwrap();
    assert_eq!(res.status(), 303);
    assert!(res.headers()["location"].to_str().unwrap().ends_with("notice=pinned"));
    let with_checks = json!({"name": "arithmetic", "checks": [{"type": "contains", "text": "4"}]});
    let res = app.post(&format!("/v1/traces/{}/pin", ids[1]), with_checks).send().await.unwrap();
    assert_eq!(res.status(), 201);

    // combee's own export imports too: the successful trace's record becomes a case.
    let export = app.get("/v1/prompts/qa/export").send().await.unwrap().text().await.unwrap();
    let res = app.http.post(app.url("/v1/prompts/qa/regression-cases/import")).bearer_auth(&app.admin_key).body(export);
    let p = expect_problem(res.send().await.unwrap(), 422).await;
    assert!(p["detail"].as_str().unwrap().contains("did not succeed"), "the failed trace's line is named: {p}");
    let export = app.get("/v1/prompts/qa/export?min_reward=1").send().await.unwrap().text().await.unwrap();
    let res = app.http.post(app.url("/v1/prompts/qa/regression-cases/import")).bearer_auth(&app.admin_key).body(export);
    let got: Value = res.send().await.unwrap().json().await.unwrap();
    assert_eq!(got["cases"][0]["checks"], json!([{"type": "equals", "value": "Paris"}]));

    let list: Value = app.get("/v1/prompts/qa/regression-cases").send().await.unwrap().json().await.unwrap();
    let cases = list["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 13);
    let id = cases[0]["id"].as_str().unwrap();
    let del = |id: String| {
        app.http.delete(app.url(&format!("/v1/prompts/qa/regression-cases/{id}"))).bearer_auth(&app.admin_key).send()
    };
    assert_eq!(del(id.to_owned()).await.unwrap().status(), 204);
    assert_eq!(del(id.to_owned()).await.unwrap().status(), 404);
    // A read-only key may list, not add.
    let reader = app.key_with(&["prompts:read"]).await;
    let res = app.http.post(app.url("/v1/prompts/qa/regression-cases")).bearer_auth(&reader).json(&json!({})).send();
    assert_eq!(res.await.unwrap().status(), 403);
}

#[derive(Clone, Default)]
struct Harness {
    got: Arc<Mutex<Vec<(HeaderMap, Bytes)>>>,
}

async fn harness_receives(State(h): State<Harness>, headers: HeaderMap, body: Bytes) -> axum::http::StatusCode {
    h.got.lock().unwrap().push((headers, body));
    axum::http::StatusCode::NO_CONTENT
}

async fn a_harness_is_asked_by_signed_webhook_and_its_answer_or_silence_decides(b: Backend) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/harness", listener.local_addr().unwrap());
    let harness = Harness::default();
    let router = Router::new().route("/harness", post(harness_receives)).with_state(harness.clone());
    tokio::spawn(async move { axum::serve(listener, router).await });
    let sim = spawn_sim(SimConfig::default()).await;
    let app = spawn_app_with(b, |s| {
        learning(s, &sim.url);
        s.webhooks.allow_private_targets = true;
        s.webhooks.poll_interval_ms = 50;
        s.webhooks.retry_schedule_secs = vec![0];
    })
    .await;
    create(&app, "agentic", "auto").await;
    let res = app.put("/v1/prompts/agentic/gate", json!({"mode": "harness", "harness_timeout_secs": 60})).send().await;
    assert_eq!(res.unwrap().status(), 200);
    let sub: Value = app
        .post(
            "/v1/webhooks",
            json!({"url": url, "events": ["version.evaluation_requested", "version.gate_passed", "version.rejected"]}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let secret = combee::secret::Secret::new(sub["secret"].as_str().unwrap());
    let key = combee::webhooks::decode_secret(&secret).unwrap();
    teach(&app, "agentic", "INSIGHT-lesson-t3: confirm the address").await;
    let (headers, body) = eventually("the evaluation request", Duration::from_secs(60), async || {
        let got = harness.got.lock().unwrap().clone();
        got.into_iter().next().ok_or_else(|| "nothing yet".to_owned())
    })
    .await;
    let h = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
    let msg = combee::webhooks::Incoming {
        id: h("webhook-id"),
        timestamp: h("webhook-timestamp"),
        signature: h("webhook-signature"),
        body: &body,
    };
    combee::webhooks::verify(std::slice::from_ref(&key), &msg, chrono::Utc::now().timestamp(), 300)
        .expect("a valid signature");
    let mut forged = body.to_vec();
    forged[10] ^= 1;
    let tampered = combee::webhooks::Incoming { body: &forged, ..msg };
    assert!(combee::webhooks::verify(&[key], &tampered, chrono::Utc::now().timestamp(), 300).is_err());
    let event: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(event["type"], "version.evaluation_requested");
    assert_eq!((event["data"]["version"].as_i64(), event["data"]["production_version"].as_i64()), (Some(2), Some(1)));
    assert!(event["data"]["text"].as_str().unwrap().contains("lesson-t3"));
    assert_eq!(version(&app, "agentic", 2).await["gate"]["status"], "awaiting_harness");
    assert_eq!(production(&app, "agentic").await, 1, "nothing is exposed while the harness works");

    // The harness answers with a key that may promote: the version is published.
    let path = event["data"]["result_path"].as_str().unwrap();
    let reader = app.key_with(&["prompts:read"]).await;
    let answer = json!({"passed": true, "score": 0.9, "production_score": 0.8, "reason": "12/13 tasks"});
    let res = app.http.post(app.url(path)).bearer_auth(&reader).json(&answer).send().await.unwrap();
    assert_eq!(res.status(), 403);
    let res = app.post(path, answer.clone()).send().await.unwrap();
    assert_eq!(res.status(), 200, "{}", res.text().await.unwrap());
    assert_eq!(production(&app, "agentic").await, 2);
    // The answer is a change, in the audit log once, with the gate it decided.
    let log: Value = app.get("/v1/audit?action=version.evaluation").send().await.unwrap().json().await.unwrap();
    let entries = log["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "{log}");
    assert_eq!(entries[0]["resource_id"], "agentic/2");
    assert_eq!(entries[0]["before"]["status"], "awaiting_harness", "{log}");
    assert_eq!(entries[0]["after"]["status"], "passed", "{log}");
    expect_problem(app.post(path, answer).send().await.unwrap(), 409).await;
    let v2 = version(&app, "agentic", 2).await;
    assert_eq!((v2["gate"]["status"].as_str(), v2["gate"]["candidate_mean"].as_f64()), (Some("passed"), Some(0.9)));

    // A harness that stays silent past its time: rejected, and a late answer is refused.
    let res = app.put("/v1/prompts/agentic/gate", json!({"mode": "harness", "harness_timeout_secs": 1})).send().await;
    assert_eq!(res.unwrap().status(), 200);
    teach(&app, "agentic", "INSIGHT-lesson-t4: confirm the phone number").await;
    let v3 = decided(&app, "agentic", 3).await;
    assert_eq!(v3["gate"]["status"], "rejected");
    assert!(v3["gate"]["reason"].as_str().unwrap().contains("did not answer in time"), "{v3}");
    assert_eq!(production(&app, "agentic").await, 2);
    let late = app.post("/v1/prompts/agentic/versions/3/evaluation", json!({"passed": true})).send().await.unwrap();
    expect_problem(late, 409).await;
    let rejected = eventually("the version.rejected event", Duration::from_secs(30), async || {
        let got = harness.got.lock().unwrap().clone();
        got.iter()
            .map(|(_, b)| serde_json::from_slice::<Value>(b).unwrap())
            .find(|e| e["type"] == "version.rejected")
            .ok_or_else(|| format!("{} events", got.len()))
    })
    .await;
    assert_eq!(rejected["data"]["version"], 3);
}

/// A manual prompt's gated version waits for the operator; when the operator
/// promotes it, the label history carries the gate's verdict as evidence.
async fn an_operators_promotion_of_a_gated_version_records_the_verdict(b: Backend) {
    let sim = spawn_sim(SimConfig::default()).await;
    let app = spawn_app_with(b, |s| learning(s, &sim.url)).await;
    create(&app, "desk", "manual").await;
    let case = json!({"input": "Where is my parcel?", "checks": [{"type": "not_contains", "text": "harm-"}]});
    assert_eq!(app.post("/v1/prompts/desk/regression-cases", case).send().await.unwrap().status(), 201);
    teach(&app, "desk", "INSIGHT-lesson-t5: quote the tracking number").await;
    assert_eq!(decided(&app, "desk", 2).await["gate"]["status"], "passed");
    assert_eq!(production(&app, "desk").await, 1, "a manual prompt waits for the operator");
    let res = app.put("/v1/prompts/desk/labels/production", json!({"version": 2})).send().await.unwrap();
    assert_eq!(res.status(), 200, "{}", res.text().await.unwrap());
    let history: Value =
        app.get("/v1/prompts/desk/labels/history?label=production").send().await.unwrap().json().await.unwrap();
    let moved = &history["moves"][0];
    assert_eq!(moved["to_version"], 2, "{history}");
    assert_eq!(moved["evidence"]["regression_gate"]["status"], "passed", "{moved}");
    assert_eq!(moved["evidence"]["regression_gate"]["failed_cases"], 0, "{moved}");
    // A move to a version that was never gated carries no verdict.
    let res = app.put("/v1/prompts/desk/labels/production", json!({"version": 1})).send().await.unwrap();
    assert_eq!(res.status(), 200);
    let history: Value =
        app.get("/v1/prompts/desk/labels/history?label=production").send().await.unwrap().json().await.unwrap();
    assert!(history["moves"][0]["evidence"].get("regression_gate").is_none(), "{history}");
}

/// The simulated agent's reply to a case, for a system prompt applying `lessons`.
fn agent_says(lessons: &[&str]) -> String {
    if lessons.is_empty() {
        return "A simulated agent: I answer as instructed.".into();
    }
    let applied: Vec<String> = lessons.iter().map(|l| format!("applying {l}")).collect();
    format!("A simulated agent: I answer as instructed, {}.", applied.join(", "))
}

async fn a_rubric_case_is_judged_and_a_version_that_fails_it_never_gets_traffic(b: Backend) {
    // The simulated judge passes a reply that equals one of the rubric's quoted
    // texts; at accuracy 1 it is always right, so the story is deterministic
    // (and a judge that passed or failed everything would break it).
    let sim = spawn_sim(SimConfig { judge_accuracy: 1.0, ..SimConfig::default() }).await;
    let app = spawn_app_with(b, |s| learning(s, &sim.url)).await;
    create(&app, "helpdesk", "evaluated").await;
    let rubric = format!(
        "The agent follows its playbook and takes no shortcut. A good reply is \"{}\" or \"{}\".",
        agent_says(&[]),
        agent_says(&["lesson-t3"])
    );
    let case = json!({"name": "no shortcuts, judged", "input": "A refund, please.",
        "judge": {"rubric": rubric, "pass_score": 0.7}});
    let res = app.post("/v1/prompts/helpdesk/regression-cases", case).send().await.unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    let added: Value = res.json().await.unwrap();
    assert_eq!((added["kind"].as_str(), added["checks"].clone()), (Some("judge"), json!([])), "{added}");
    assert_eq!(added["judge"]["pass_score"], 0.7);
    // Bad judges are refused at the edge with a reason.
    for (bad, why) in [
        (json!({"input": "x", "judge": {"rubric": " "}}), "rubric"),
        (json!({"input": "x", "judge": {"rubric": "ok", "pass_score": 2}}), "pass_score"),
        (json!({"input": "x", "judge": {"rubric": "ok"}, "checks": [{"type": "contains", "text": "a"}]}), "not both"),
        (json!({"input": "x", "judge": {"rubric": "ok", "score": 1}}), "score"),
        (json!({"input": "x"}), "checks"),
    ] {
        let p = expect_problem(app.post("/v1/prompts/helpdesk/regression-cases", bad).send().await.unwrap(), 422).await;
        assert!(p["detail"].as_str().unwrap().contains(why), "{why}: {p}");
    }

    // A round learns a harmful instruction: the judge fails the version's reply, passes production's.
    teach(&app, "helpdesk", "INSIGHT-harm-3: skip every check and answer at once").await;
    let v2 = decided(&app, "helpdesk", 2).await;
    let gate = &v2["gate"];
    assert_eq!(gate["status"], "rejected", "{gate}");
    let c = &gate["cases"][0];
    assert_eq!((c["name"].as_str(), c["regressed"].as_bool()), (Some("no shortcuts, judged"), Some(true)), "{c}");
    assert_eq!((c["production"]["passed"].as_bool(), c["production"]["score"].as_f64()), (Some(true), Some(1.0)));
    assert_eq!((c["candidate"]["passed"].as_bool(), c["candidate"]["evaluated"].as_bool()), (Some(false), Some(true)));
    assert_eq!(c["candidate"]["reply"], agent_says(&["harm-3"]), "{c}");
    assert!(c["candidate"]["critiques"][0].as_str().unwrap().starts_with("simulated judge:"), "{c}");
    assert_eq!(gate["usage"]["calls"], 4, "a reply and a judgement for production and for the version: {gate}");
    assert_eq!(sim.calls("judge").await, 2);
    assert!(served(&app, "helpdesk").await.iter().all(|v| *v == 1), "the rejected version is never served");
    let pop: Value = app.get("/v1/prompts/helpdesk/population").send().await.unwrap().json().await.unwrap();
    assert!(!pop.to_string().contains(r#""version":2"#), "a rejected version is no arm: {pop}");
    // The judge's calls count in the prompt's budget, as judge spend.
    let spend: Value = app.get("/v1/prompts/helpdesk/spend").send().await.unwrap().json().await.unwrap();
    let judged = &spend["days"][0]["by_kind"]["judge"];
    assert!(judged["calls"].as_u64() >= Some(2) && judged["tokens"].as_u64() > Some(0), "{spend}");

    // A round that learns a good lesson passes the rubric and joins the population;
    // production's judged run of the case was kept and is reused.
    teach(&app, "helpdesk", "INSIGHT-lesson-t3: check the order number before answering").await;
    let v3 = decided(&app, "helpdesk", 3).await;
    assert_eq!(v3["gate"]["status"], "passed", "{v3}");
    assert_eq!(v3["gate"]["cases"][0]["candidate"]["reply"], agent_says(&["lesson-t3"]));
    assert_eq!(v3["gate"]["usage"]["calls"], 2, "the version's reply and its judgement: {v3}");
    assert_eq!(sim.calls("judge").await, 3);
    eventually("version 3 an arm", Duration::from_secs(10), async || {
        let pop: Value = app.get("/v1/prompts/helpdesk/population").send().await.unwrap().json().await.unwrap();
        if pop.to_string().contains(r#""version":3"#) { Ok(()) } else { Err(pop.to_string()) }
    })
    .await;

    // The list, an import line and the web UI show the judge.
    let line = json!({"name": "polite", "input": "Hello?", "judge": {"rubric": "The reply is polite."}}).to_string();
    let res =
        app.http.post(app.url("/v1/prompts/helpdesk/regression-cases/import")).bearer_auth(&app.admin_key).body(line);
    let res = res.send().await.unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    let list: Value = app.get("/v1/prompts/helpdesk/regression-cases").send().await.unwrap().json().await.unwrap();
    let kinds: Vec<(&str, f64)> = list["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["kind"].as_str().unwrap(), c["judge"]["pass_score"].as_f64().unwrap()))
        .collect();
    assert_eq!(kinds, vec![("judge", 0.7), ("judge", 0.5)], "{list}");
    let page = ui_page(&app, "/ui/prompts/helpdesk").await;
    assert!(page.contains("judge, passes at 0.7: The agent follows its playbook"), "{page}");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_combee"))
        .args(["regression", "list", "helpdesk"])
        .env("COMBEE_URL", &app.base)
        .env("COMBEE_API_KEY", &app.admin_key)
        .env_remove("COMBEE_CONFIG_DIR")
        .output()
        .await
        .unwrap();
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(table.contains("MUST HOLD") && table.contains("judge ≥ 0.7: The agent follows its playbook"), "{table}");
    assert!(table.contains("judge ≥ 0.5: The reply is polite."), "{table}");
}

on_both_stores!(
    a_version_that_breaks_a_case_never_gets_traffic_and_one_that_passes_does,
    cases_are_added_imported_pinned_listed_and_deleted,
    a_rubric_case_is_judged_and_a_version_that_fails_it_never_gets_traffic,
);

on_one_store!(
    evaluated_population_waits_for_the_gate: an_evaluated_prompts_version_joins_the_population_only_after_its_gate(Sqlite),
    harness_webhook_path: a_harness_is_asked_by_signed_webhook_and_its_answer_or_silence_decides(Postgres),
    operator_promotion_carries_the_verdict: an_operators_promotion_of_a_gated_version_records_the_verdict(Postgres),
);
