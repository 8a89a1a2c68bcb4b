//! The learning budget end to end: the real server on a port with its worker,
//! a real store, and the OpenAI-compatible simulator (a simulation, not a
//! model) injecting server errors so calls are retried. Caps are set below
//! what learning would spend; the tests check that the spend stays within the
//! cap plus one call, that no trace fails or is lost while learning waits, that
//! the spend combee counted is every attempt the simulator answered (retried
//! ones included), and that learning resumes when the (simulated) day ends or
//! the cap is raised.

use crate::common;

use std::time::Duration;

use combee::simulation::llm::SimConfig;
use common::{
    Backend, Sim, TestApp, eventually, expect_problem, learning, restart_app_with, spawn_app_with, spawn_sim,
};
use serde_json::{Value, json};

const TRACES: usize = 24;

fn sim_with_errors() -> SimConfig {
    // One answer in five is a 500: calls are retried, and every attempt must be counted.
    SimConfig { seed: 11, rate_5xx: 0.2, ..SimConfig::default() }
}

fn trace(prompt: &str, i: usize) -> Value {
    json!({
        "prompt": prompt,
        "input": {"task": format!("task {i}")},
        "trajectory": [{"role": "assistant", "content": format!("worked on task {i}")}],
        "output": format!("answer {i}"),
        "feedback": {"success": !i.is_multiple_of(3), "comment": format!("INSIGHT-b{i:03}: check field {i} first")}
    })
}

async fn patch_settings(app: &TestApp, name: &str, body: Value) -> reqwest::Response {
    app.http
        .patch(app.url(&format!("/v1/prompts/{name}/settings")))
        .bearer_auth(&app.admin_key)
        .header("content-type", "application/merge-patch+json")
        .body(body.to_string())
        .send()
        .await
        .unwrap()
}

async fn create(app: &TestApp, name: &str, budget: Value) {
    let body = json!({"name": name, "base": "You answer support questions.", "promotion": "auto",
                      "settings": {"batch_size": 6}});
    let res = app.post("/v1/prompts", body).send().await.unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    if !budget.is_null() {
        let res = patch_settings(app, name, json!({"budget": budget})).await;
        assert_eq!(res.status(), 200, "{}", res.text().await.unwrap());
    }
}

async fn send(app: &TestApp, name: &str, from: usize, to: usize) {
    let traces: Vec<Value> = (from..to).map(|i| trace(name, i)).collect();
    let res = app.post("/v1/traces", json!({"traces": traces})).send().await.unwrap();
    assert_eq!(res.status(), 201);
}

async fn get(app: &TestApp, path: &str) -> Value {
    let res = app.get(path).send().await.unwrap();
    assert_eq!(res.status(), 200, "{path}");
    res.json().await.unwrap()
}

/// A prompt as a path names it (`project/name` with its `/` escaped).
fn in_path(name: &str) -> String {
    name.replace('/', "%2F")
}

async fn spend(app: &TestApp, name: &str) -> Value {
    get(app, &format!("/v1/prompts/{}/spend?days=30", in_path(name))).await
}

async fn state(app: &TestApp, name: &str) -> Value {
    get(app, &format!("/v1/prompts/{}/learning", in_path(name))).await
}

/// Traces of the prompt with `status`.
async fn traces(app: &TestApp, name: &str, status: &str) -> usize {
    let page = get(app, &format!("/v1/traces?prompt={name}&status={status}&page_size=200")).await;
    page["traces"].as_array().unwrap().len()
}

/// The prompt's rounds, newest first.
async fn rounds(app: &TestApp, name: &str) -> Vec<Value> {
    let page = get(app, &format!("/v1/prompts/{}/rounds?page_size=100", in_path(name))).await;
    page["rounds"].as_array().cloned().unwrap_or_default()
}

/// The most tokens one attempt of the prompt's rounds used (from the rounds' call records).
async fn largest_call(app: &TestApp, name: &str) -> u64 {
    let mut most = 0;
    for r in rounds(app, name).await {
        let view = get(app, &format!("/v1/rounds/{}", r["id"].as_str().unwrap())).await;
        for c in view["llm_calls"].as_array().unwrap() {
            most = most.max(c["prompt_tokens"].as_u64().unwrap() + c["completion_tokens"].as_u64().unwrap());
        }
    }
    most
}

/// The tokens the simulator answered and the attempts it saw.
async fn billed(sim: &Sim) -> (u64, u64) {
    let s = sim.stats().await;
    (s["prompt_tokens"].as_u64().unwrap() + s["completion_tokens"].as_u64().unwrap(), s["requests"].as_u64().unwrap())
}

fn total(report: &Value, what: &str) -> u64 {
    report["days"].as_array().unwrap().iter().map(|d| d[what].as_u64().unwrap()).sum()
}

fn today(report: &Value) -> u64 {
    report["days"].as_array().unwrap().first().map_or(0, |d| d["tokens"].as_u64().unwrap())
}

/// The prompt's state once a daily cap holds it back and its round's last
/// calls have finished (the round waits in the queue, not charged an attempt).
async fn wait_reached(app: &TestApp, name: &str) -> Value {
    eventually("the budget to hold learning back", Duration::from_secs(90), async || {
        let s = state(app, name).await;
        let waiting = rounds(app, name).await.iter().all(|r| r["status"] != "running");
        if s["state"] == "budget_reached" && waiting { Ok(s) } else { Err(s.to_string()) }
    })
    .await
}

/// Nothing failed: no trace, no round.
async fn nothing_failed(app: &TestApp, name: &str) {
    assert_eq!(traces(app, name, "failed").await, 0);
    for r in rounds(app, name).await {
        assert_ne!(r["status"], "failed", "{r}");
    }
}

async fn a_daily_cap_holds_learning_until_the_next_day(b: Backend) {
    let sim = spawn_sim(sim_with_errors()).await;
    let app = spawn_app_with(b, |s| {
        learning(s, &sim.url);
        s.budget.recheck_secs = 1;
    })
    .await;
    // Far below what learning TRACES traces costs (a reflection alone reserves over 1,000 tokens).
    const CAP: u64 = 6_000;
    create(&app, "capped", json!({"tokens_per_day": CAP})).await;
    send(&app, "capped", 0, TRACES).await;

    let held = wait_reached(&app, "capped").await;
    assert_eq!(held["budget"]["scope"], "prompt tokens_per_day", "{held}");
    let until = held["budget"]["until"].as_str().unwrap();
    assert!(until.ends_with("T00:00:00Z"), "the next UTC day: {until}");
    assert!(held["budget"]["message"].as_str().unwrap().starts_with("budget reached until "), "{held}");
    // Holds count at their estimate, so calls that used less leave room a
    // later look may still use; then no call fits, and none is made (no retry
    // storm) while the round looks again every second: the spend stays put.
    let spent = eventually("the spend to settle under the cap", Duration::from_secs(60), async || {
        let before = (today(&spend(&app, "capped").await), billed(&sim).await);
        tokio::time::sleep(Duration::from_secs(3)).await;
        let after = (today(&spend(&app, "capped").await), billed(&sim).await);
        if before == after { Ok(after.0) } else { Err(format!("{before:?} -> {after:?}")) }
    })
    .await;
    assert_eq!(state(&app, "capped").await["state"], "budget_reached");
    let one_call = largest_call(&app, "capped").await;
    eprintln!("simulated LLM, prompt cap {CAP} tokens/day: spent {spent}, one call at most {one_call}");
    assert!(spent <= CAP + one_call, "spent {spent} > cap {CAP} + one call {one_call}");
    assert!(spent > 0);
    nothing_failed(&app, "capped").await;
    assert_eq!(traces(&app, "capped", "pending").await + traces(&app, "capped", "consumed").await, TRACES);
    assert!(traces(&app, "capped", "pending").await > 0, "the cap was below the natural spend");
    // The metrics say so, and a webhook event was queued once.
    let metrics = app.http.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(
        metrics.contains("combee_prompt_budget_reached_seconds{prompt=\"capped\",project=\"default\"}"),
        "{metrics}"
    );
    assert_eq!(budget_events(&app).await, 1);

    // Day after day the cap lets some learning through, until every trace is learned from.
    for day in 1..=30 {
        if traces(&app, "capped", "consumed").await == TRACES {
            break;
        }
        assert!(day < 30, "learning did not finish in 30 simulated days");
        app.state.clock.advance(chrono::Duration::days(1));
        eventually("learning to go on after the day ended", Duration::from_secs(90), async || {
            let s = state(&app, "capped").await;
            let done = traces(&app, "capped", "consumed").await == TRACES;
            if s["state"] == "budget_reached" || done { Ok(()) } else { Err(s.to_string()) }
        })
        .await;
    }
    nothing_failed(&app, "capped").await;
    let report = spend(&app, "capped").await;
    let one_call = largest_call(&app, "capped").await;
    for d in report["days"].as_array().unwrap() {
        assert!(d["tokens"].as_u64().unwrap() <= CAP + one_call, "{d}");
    }
    // Every attempt the simulator answered or failed is on the bill, retried ones included.
    let (sim_tokens, sim_requests) = billed(&sim).await;
    assert_eq!(total(&report, "tokens"), sim_tokens, "{report}");
    assert_eq!(total(&report, "calls"), sim_requests, "{report}");
    assert!(sim.stats().await["faults"]["server_error"].as_u64().unwrap_or(0) > 0, "no call was retried");
    // One event per prompt per day it was held back.
    assert!(budget_events(&app).await >= 2);
}

async fn raising_the_cap_resumes_learning_at_once(b: Backend) {
    let sim = spawn_sim(sim_with_errors()).await;
    let app = spawn_app_with(b, |s| {
        learning(s, &sim.url);
        // Longer than the test waits: only the raise can wake the waiting round.
        s.budget.recheck_secs = 3600;
    })
    .await;
    create(&app, "raised", json!({"tokens_per_day": 4_000, "usd_per_day": 5.0})).await;
    send(&app, "raised", 0, TRACES).await;
    wait_reached(&app, "raised").await;
    let res = patch_settings(&app, "raised", json!({"budget": {"tokens_per_day": null}})).await;
    assert_eq!(res.status(), 200);
    let report = spend(&app, "raised").await;
    assert_eq!(report["caps"], json!({"usd_per_day": 5.0}), "{report}");
    eventually("every trace learned from after the raise", Duration::from_secs(90), async || {
        let consumed = traces(&app, "raised", "consumed").await;
        if consumed == TRACES { Ok(()) } else { Err(format!("{consumed} consumed")) }
    })
    .await;
    assert_eq!(state(&app, "raised").await["state"], "ok");
    nothing_failed(&app, "raised").await;
    // Bad caps are refused with a reason, and change nothing.
    // A list is no patch (it would fill caps by position): refused too.
    for bad in [
        json!({"usd_per_day": -1}),
        json!({"tokens_per_day": "many"}),
        json!({"per_week": 3}),
        json!(7),
        json!([1_000, 5.0]),
        json!([{"tokens_per_day": 1}]),
    ] {
        let p = expect_problem(patch_settings(&app, "raised", json!({"budget": bad})).await, 422).await;
        assert!(p["detail"].as_str().unwrap().contains("budget"), "{p}");
    }
    assert_eq!(spend(&app, "raised").await["caps"], json!({"usd_per_day": 5.0}));
    let p = expect_problem(app.get("/v1/prompts/raised/spend?days=0").send().await.unwrap(), 400).await;
    assert!(p["detail"].as_str().unwrap().contains("days"), "{p}");
    expect_problem(app.get("/v1/prompts/nope/spend").send().await.unwrap(), 404).await;
}

async fn a_server_cap_is_shared_by_processes_and_survives_a_restart(b: Backend) {
    let sim = spawn_sim(sim_with_errors()).await;
    const CAP: u64 = 8_000;
    let capped = |s: &mut combee::config::Settings| {
        learning(s, &sim.url);
        s.budget.tokens_per_day = Some(CAP);
        s.budget.recheck_secs = 1;
    };
    let mut first = spawn_app_with(b, capped).await;
    // A second worker process on the same store.
    let mut second = restart_app_with(&first, capped).await;
    for name in ["one", "two"] {
        create(&first, name, Value::Null).await;
        send(&first, name, 0, TRACES).await;
    }
    let held = wait_reached(&first, "one").await;
    wait_reached(&second, "two").await;
    assert!(held["budget"]["scope"].as_str().unwrap().starts_with("server "), "{held}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let spent: u64 = today(&spend(&first, "one").await) + today(&spend(&first, "two").await);
    let one_call = largest_call(&first, "one").await.max(largest_call(&first, "two").await);
    eprintln!(
        "simulated LLM, server cap {CAP} tokens/day over two processes: spent {spent}, one call at most {one_call}"
    );
    assert!(spent <= CAP + one_call, "spent {spent} > cap {CAP} + one call {one_call}");
    let metrics = first.http.get(first.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("combee_budget_reached 1"), "{metrics}");

    // Both stop; one starts again with the cap raised: the spend is still there, and learning resumes.
    first.shutdown.cancel();
    second.shutdown.cancel();
    for server in [&mut first.server, &mut second.server] {
        let stopped = tokio::time::timeout(Duration::from_secs(30), server).await;
        stopped.expect("a process stops within 30 s").expect("its task").expect("it stops cleanly");
    }
    let again = restart_app_with(&first, |s| {
        capped(s);
        s.budget.tokens_per_day = Some(10 * CAP);
    })
    .await;
    // At least what was read before: a hold settles below what it reserved, so
    // a round held back at the cap may resume and spend the room left until
    // the processes stop (and, here, under the raised cap at once).
    let kept: u64 = today(&spend(&again, "one").await) + today(&spend(&again, "two").await);
    assert!(kept >= spent, "the spend survives a restart: {kept} after it, {spent} before");
    eventually("learning to resume under the raised cap", Duration::from_secs(90), async || {
        let s = state(&again, "one").await;
        if s["state"] == "ok" && traces(&again, "one", "consumed").await > 0 { Ok(()) } else { Err(s.to_string()) }
    })
    .await;
    nothing_failed(&again, "one").await;
    nothing_failed(&again, "two").await;
}

/// The store's side alone: holds count until settled, a refusal is remembered
/// once per day, a lift wakes the day, and spend reads back by day and kind.
async fn holds_and_settlements_in_the_store(b: Backend) {
    use combee::domain::budget::{BudgetCaps, Spent};
    use combee::store::{HoldOutcome, HoldRequest, Settlement};
    let ts = common::test_store(b).await;
    let store = ts.store;
    let day = chrono::NaiveDate::from_ymd_opt(2026, 3, 1).unwrap();
    let until = chrono::DateTime::parse_from_rfc3339("2026-03-02T00:00:00Z").unwrap().to_utc();
    let hold = |tokens: u64| HoldRequest {
        id: uuid::Uuid::now_v7(),
        day,
        prompt: "p",
        round: None,
        estimate: Spent { tokens, usd: 0.0, calls: 1 },
        server: BudgetCaps { tokens_per_day: Some(1000), ..Default::default() },
        until,
        expires_at: chrono::Utc::now() + chrono::Duration::minutes(10),
    };
    let first = hold(600);
    assert_eq!(store.hold_spend(&first).await.unwrap(), HoldOutcome::Held);
    // 600 held + 500 > 1000: refused, by the server's cap, for the day.
    let refused = store.hold_spend(&hold(500)).await.unwrap();
    assert_eq!(refused, HoldOutcome::Refused { scope: "server tokens_per_day".into(), daily: true });
    assert!(store.budget_reached("p", day).await.unwrap().is_some());
    assert!(store.budget_reached("", day).await.unwrap().is_some());
    // The attempt used less than it held: the rest is free again.
    let s = Settlement {
        hold: first.id,
        day,
        prompt: "p",
        kind: "reflection",
        round: None,
        used: Spent { tokens: 300, usd: 0.25, calls: 1 },
    };
    store.settle_spend(&s).await.unwrap();
    store.lift_server_budget(day).await.unwrap();
    // Raising the server's cap lifts what it held back, the prompt's row included.
    assert!(store.budget_reached("p", day).await.unwrap().is_none());
    assert!(store.budget_reached("", day).await.unwrap().is_none());
    assert_eq!(store.hold_spend(&hold(500)).await.unwrap(), HoldOutcome::Held);
    let days = store.spend_by_day("p", day).await.unwrap();
    assert_eq!(days.len(), 1);
    assert_eq!((days[0].tokens, days[0].calls, days[0].usd), (300, 1, 0.25));
    assert_eq!(days[0].by_kind["reflection"].tokens, 300);
    // A prompt's caps: set, read back, and a change lifts the day's hold.
    let caps = BudgetCaps { tokens_per_day: Some(10), usd_per_round: Some(0.5), ..Default::default() };
    store.set_prompt_caps("p", &caps, day, true).await.unwrap();
    assert_eq!(store.prompt_caps("p").await.unwrap(), caps);
    let refused = store.hold_spend(&hold(1)).await.unwrap();
    assert_eq!(refused, HoldOutcome::Refused { scope: "prompt tokens_per_day".into(), daily: true });
    assert_eq!(store.budget_reached("p", day).await.unwrap().unwrap().scope, "prompt tokens_per_day");
    store.set_prompt_caps("p", &BudgetCaps::default(), day, true).await.unwrap();
    assert!(store.budget_reached("p", day).await.unwrap().is_none(), "a change lifts the day's hold");
    assert_eq!(store.prompt_caps("p").await.unwrap(), BudgetCaps::default());

    // A round cap bounds the round, every pass of it together: a later pass
    // (a new claim after the round waited) gets no fresh allowance.
    let round = uuid::Uuid::now_v7();
    let server = BudgetCaps { tokens_per_round: Some(1000), ..Default::default() };
    let in_pass = |pass: i32, tokens: u64| HoldRequest { round: Some((round, pass)), server, ..hold(tokens) };
    let first_pass = in_pass(1, 700);
    assert_eq!(store.hold_spend(&first_pass).await.unwrap(), HoldOutcome::Held);
    let settled = Settlement {
        hold: first_pass.id,
        round: Some((round, 1)),
        used: Spent { tokens: 700, usd: 0.0, calls: 1 },
        ..s
    };
    store.settle_spend(&settled).await.unwrap();
    let refused = store.hold_spend(&in_pass(2, 400)).await.unwrap();
    assert_eq!(
        refused,
        HoldOutcome::Refused { scope: "server tokens_per_round".into(), daily: false },
        "700 + 400 > 1000"
    );
    assert_eq!(store.hold_spend(&in_pass(3, 300)).await.unwrap(), HoldOutcome::Held, "700 + 300 fits");
    // Another round has its own allowance.
    let other = HoldRequest { round: Some((uuid::Uuid::now_v7(), 1)), server, ..hold(900) };
    assert_eq!(store.hold_spend(&other).await.unwrap(), HoldOutcome::Held);
}

/// A project's cap holds all its prompts together, leaves other projects'
/// prompts alone, and a raise lets its waiting rounds go at once.
async fn a_projects_cap_holds_its_prompts_together(b: Backend) {
    let sim = spawn_sim(sim_with_errors()).await;
    let app = spawn_app_with(b, |s| {
        learning(s, &sim.url);
        s.budget.recheck_secs = 3600;
    })
    .await;
    let bad = json!({"name": "team", "settings": {"budget": {"tokens_per_day": -1}}});
    let p = expect_problem(app.post("/v1/projects", bad).send().await.unwrap(), 422).await;
    assert!(p["detail"].as_str().unwrap().contains("tokens_per_day"), "{p}");
    let listed = json!({"name": "team", "settings": {"budget": [null, null]}});
    let p = expect_problem(app.post("/v1/projects", listed).send().await.unwrap(), 422).await;
    assert!(p["detail"].as_str().unwrap().contains("budget"), "{p}");
    let team = json!({"name": "team", "settings": {"budget": {"tokens_per_day": 5_000}}});
    assert_eq!(app.post("/v1/projects", team).send().await.unwrap().status(), 201);
    // The server-wide key writes the team's prompts `team/left`, `team/right`.
    for (name, project) in [("left", "team"), ("right", "team"), ("free", "default")] {
        let body = json!({"name": name, "base": "You answer support questions.", "promotion": "auto",
                          "project": project, "settings": {"batch_size": 6}});
        assert_eq!(app.post("/v1/prompts", body).send().await.unwrap().status(), 201);
        let written = if project == "default" { name.to_owned() } else { format!("{project}/{name}") };
        send(&app, &written, 0, TRACES).await;
    }
    let (left, right) = ("team/left", "team/right");
    // The other project's prompt learns everything meanwhile.
    eventually("the free prompt learns all", Duration::from_secs(90), async || {
        let consumed = traces(&app, "free", "consumed").await;
        if consumed == TRACES { Ok(()) } else { Err(format!("{consumed} consumed")) }
    })
    .await;
    let held = eventually("the project's cap to hold", Duration::from_secs(90), async || {
        let (l, r) = (state(&app, left).await, state(&app, right).await);
        let both_idle = [rounds(&app, left).await, rounds(&app, right).await]
            .iter()
            .all(|rs| rs.iter().all(|r| r["status"] != "running"));
        let scope = |s: &Value| s["budget"]["scope"].as_str().unwrap_or_default().to_owned();
        match (l["state"] == "budget_reached" || r["state"] == "budget_reached") && both_idle {
            true => Ok(scope(&l).max(scope(&r))),
            false => Err(format!("{l} {r}")),
        }
    })
    .await;
    assert_eq!(held, "project tokens_per_day");
    let tokens = |r: Value| r["days"].as_array().unwrap().iter().map(|d| d["tokens"].as_u64().unwrap()).sum::<u64>();
    let spent = tokens(spend(&app, left).await) + tokens(spend(&app, right).await);
    let largest = largest_call(&app, left).await.max(largest_call(&app, right).await);
    assert!(spent <= 5_000 + largest, "the project spent {spent} against 5,000 (largest call {largest})");
    let left_out = traces(&app, left, "pending").await + traces(&app, right, "pending").await;
    assert!(left_out > 0, "the cap held some traces back");
    nothing_failed(&app, left).await;
    nothing_failed(&app, right).await;
    // Removing the project's cap lets both learn at once.
    let res = app.http.patch(app.url("/v1/projects/team")).bearer_auth(&app.admin_key).json(&json!({"settings": {}}));
    let res = res.send().await.unwrap();
    assert_eq!(res.status(), 200, "{}", res.text().await.unwrap());
    eventually("both prompts learn all after the raise", Duration::from_secs(90), async || {
        let consumed = traces(&app, left, "consumed").await + traces(&app, right, "consumed").await;
        if consumed == 2 * TRACES { Ok(()) } else { Err(format!("{consumed} consumed")) }
    })
    .await;
    assert_eq!(state(&app, left).await["state"], "ok");
}

async fn budget_events(app: &TestApp) -> i64 {
    use sqlx::Connection;
    let q = "SELECT count(*) AS n FROM webhook_events WHERE type = 'budget.reached'";
    if app.url.starts_with("sqlite://") {
        let mut c = sqlx::SqliteConnection::connect(&app.url).await.unwrap();
        sqlx::query_scalar::<_, i64>(q).fetch_one(&mut c).await.unwrap()
    } else {
        let mut c = sqlx::PgConnection::connect(&app.url).await.unwrap();
        sqlx::query_scalar::<_, i64>(q).fetch_one(&mut c).await.unwrap()
    }
}

on_both_stores!(
    holds_and_settlements_in_the_store,
    a_daily_cap_holds_learning_until_the_next_day,
    a_server_cap_is_shared_by_processes_and_survives_a_restart
);

on_one_store! {
    raising_the_cap_resumes_learning_at_once_postgres: raising_the_cap_resumes_learning_at_once(Postgres),
    a_projects_cap_holds_its_prompts_together_on_sqlite: a_projects_cap_holds_its_prompts_together(Sqlite),
}
