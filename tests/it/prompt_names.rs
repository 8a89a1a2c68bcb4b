//! Two teams on one server each hold a prompt `support-agent`, in the
//! product's default loop: each team's project makes its prompts wait at most
//! a second for a batch, each team creates its prompt with no settings of its
//! own, and its agents fetch it with a subject and post traces until the
//! worker has learned from them. Each team's key serves, lists, learns from
//! and exports only its own `support-agent`; the other's versions, traces and
//! rounds are absent to it. A server-wide key reaches each as
//! `team-a/support-agent`, while its bare `support-agent` is always
//! `default`'s — absent until `default` makes one, with a 404 that says which
//! projects hold the name.

use std::time::Duration;

use combee::simulation::llm::SimConfig;
use serde_json::{Value, json};

use crate::common::{self, Backend, TestApp, eventually, spawn_app_with, spawn_sim};

const TEAMS: [&str; 2] = ["team-a", "team-b"];

/// A request with `key`, answered 2xx; its JSON.
async fn ok(app: &TestApp, key: &str, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
    let mut req = app.http.request(method.clone(), app.url(path)).bearer_auth(key);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let res = req.send().await.unwrap();
    let status = res.status();
    let text = res.text().await.unwrap();
    assert!(status.is_success(), "{method} {path}: {status} {text}");
    serde_json::from_str(&text).unwrap_or(Value::Null)
}

async fn get(app: &TestApp, key: &str, path: &str) -> Value {
    ok(app, key, reqwest::Method::GET, path, None).await
}

async fn status(app: &TestApp, key: &str, path: &str) -> (u16, String) {
    let res = app.http.get(app.url(path)).bearer_auth(key).send().await.unwrap();
    (res.status().as_u16(), res.text().await.unwrap())
}

/// One agent of `team`: fetches its prompt with a subject and posts a batch
/// of runs that ran with the version it was served.
async fn agent_round(app: &TestApp, key: &str, team: &str, n: usize) {
    let served = get(app, key, &format!("/v1/prompts/support-agent?subject=user-{n}")).await;
    assert!(served["text"].as_str().unwrap().contains(&format!("for {team}")), "{team} is served its own: {served}");
    let traces: Vec<Value> = (0..4)
        .map(|j| {
            json!({"prompt": "support-agent", "prompt_version": served["version"],
                   "input": {"team": team, "n": n, "j": j}, "output": format!("answer {n}.{j}"),
                   "feedback": {"success": j % 2 == 0, "comment": format!("INSIGHT-{team}: check field {j} first")},
                   "metadata": {"subject": format!("user-{n}")}})
        })
        .collect();
    ok(app, key, reqwest::Method::POST, "/v1/traces", Some(json!({"traces": traces}))).await;
}

/// The inputs' `team` of a list of traces (or export records).
fn teams_of<'a>(traces: impl Iterator<Item = &'a Value>) -> Vec<String> {
    let mut teams: Vec<String> = traces.map(|t| t["input"]["team"].as_str().unwrap_or("?").to_owned()).collect();
    teams.sort();
    teams.dedup();
    teams
}

async fn two_projects_each_learn_serve_and_export_their_own_support_agent(b: Backend) {
    let sim = spawn_sim(SimConfig { seed: 7, ..SimConfig::default() }).await;
    let app = spawn_app_with(b, |s| common::learning(s, &sim.url)).await;
    let admin = app.admin_key.clone();
    let mut keys = Vec::new();
    for team in TEAMS {
        let project = json!({"name": team, "settings": {"prompt_defaults": {"max_wait_secs": 1}}});
        ok(&app, &admin, reqwest::Method::POST, "/v1/projects", Some(project)).await;
        let key = json!({"name": format!("{team} admin"), "scopes": ["admin"], "project": team});
        let key = ok(&app, &admin, reqwest::Method::POST, "/v1/keys", Some(key)).await;
        keys.push(key["secret"].as_str().unwrap().to_owned());
    }
    // Each team creates its `support-agent`, with no settings and no project named.
    for (team, key) in TEAMS.iter().zip(&keys) {
        let body = json!({"name": "support-agent", "base": format!("You are the support agent for {team}.")});
        let made = ok(&app, key, reqwest::Method::POST, "/v1/prompts", Some(body)).await;
        assert_eq!((made["project"].as_str(), made["version"]["number"].as_i64()), (Some(*team), Some(1)));
    }

    // The agents go on until the worker has learned a version of each team's prompt.
    let mut n = 0;
    let learned = eventually("a learned version of each team's prompt", Duration::from_secs(90), async || {
        for (team, key) in TEAMS.iter().zip(&keys) {
            agent_round(&app, key, team, n).await;
        }
        n += 1;
        let mut learned = Vec::new();
        for key in &keys {
            let versions = get(&app, key, "/v1/prompts/support-agent/versions").await;
            let v = versions["versions"].as_array().unwrap().iter().find(|v| v["source"] == "learned").cloned();
            learned.push(v);
        }
        match learned.iter().all(Option::is_some) {
            true => Ok(learned.into_iter().flatten().collect::<Vec<_>>()),
            false => Err(format!("{learned:?}")),
        }
    })
    .await;

    let mut rounds_of = Vec::new();
    for (i, (team, key)) in TEAMS.iter().zip(&keys).enumerate() {
        let other = TEAMS[1 - i];
        // Its learned version came from its own traces: the other team's lessons are not in it.
        let text = learned[i]["playbook"].to_string() + learned[i]["base"].as_str().unwrap_or_default();
        assert!(!text.contains(&format!("INSIGHT-{other}")), "{team} learned from {other}: {text}");
        assert!(learned[i]["base"].as_str().unwrap().contains(&format!("for {team}")), "{}", learned[i]);
        // Served, listed and exported: its own only.
        let served = get(&app, key, "/v1/prompts/support-agent").await;
        assert_eq!(served["name"], format!("{team}/support-agent"), "the name any key writes back");
        let traces = get(&app, key, "/v1/traces?page_size=200").await;
        assert_eq!(teams_of(traces["traces"].as_array().unwrap().iter()), [*team]);
        let export = app
            .http
            .get(app.url("/v1/prompts/support-agent/export"))
            .bearer_auth(key)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let records: Vec<Value> = export.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert!(!records.is_empty(), "{team}'s export");
        assert_eq!(teams_of(records.iter()), [*team]);
        let rounds = get(&app, key, "/v1/prompts/support-agent/rounds").await["rounds"].as_array().unwrap().clone();
        assert!(!rounds.is_empty());
        rounds_of.push((rounds, traces["traces"][0]["id"].as_str().unwrap().to_owned()));
        let prompts = get(&app, key, "/v1/prompts").await;
        assert_eq!(prompts["prompts"].as_array().unwrap().len(), 1, "{team} lists its own only: {prompts}");
    }
    // Neither team's key finds the other's rounds, traces or versions.
    for (i, key) in keys.iter().enumerate() {
        let (other_rounds, other_trace) = &rounds_of[1 - i];
        let round = other_rounds[0]["id"].as_str().unwrap();
        assert_eq!(status(&app, key, &format!("/v1/rounds/{round}")).await.0, 404);
        assert_eq!(status(&app, key, &format!("/v1/traces/{other_trace}")).await.0, 404);
        let other = TEAMS[1 - i];
        let (code, text) = status(&app, key, &format!("/v1/prompts/{other}%2Fsupport-agent/versions")).await;
        let absent = status(&app, key, &format!("/v1/prompts/{other}%2Fabsent/versions")).await;
        assert_eq!((code, text.replace("support-agent", "absent")), absent, "as if absent");
    }

    // A server-wide key reaches each explicitly; a bare name is `default`'s.
    for team in TEAMS {
        let served = get(&app, &admin, &format!("/v1/prompts/{team}%2Fsupport-agent")).await;
        assert!(served["text"].as_str().unwrap().contains(&format!("for {team}")), "{served}");
        let traces = get(&app, &admin, &format!("/v1/traces?prompt={team}/support-agent&page_size=200")).await;
        assert_eq!(teams_of(traces["traces"].as_array().unwrap().iter()), [team]);
        let langfuse = get(&app, &admin, &format!("/api/public/v2/prompts/{team}%2Fsupport-agent")).await;
        assert_eq!(langfuse["name"], format!("{team}/support-agent"));
    }
    let (code, text) = status(&app, &admin, "/v1/prompts/support-agent").await;
    assert_eq!(code, 404);
    assert!(
        text.contains("project team-a, project team-b hold one") && text.contains("team-a/support-agent"),
        "{text}"
    );
    // Traces of a server-wide key go where their name says.
    let trace = json!({"prompt": "team-b/support-agent", "input": {"team": "team-b", "from": "ops"}, "output": "x"});
    ok(&app, &admin, reqwest::Method::POST, "/v1/traces", Some(trace)).await;
    let traces = get(&app, &keys[1], "/v1/traces?page_size=200").await;
    assert!(traces["traces"].as_array().unwrap().iter().any(|t| t["input"]["from"] == "ops"));
    let bare = json!({"prompt": "support-agent", "input": {"team": "none"}, "output": "x"});
    let res = app.post("/v1/traces", bare).send().await.unwrap();
    assert_eq!(res.status(), 422, "a bare name is `default`'s, which has none yet");

    // `default` takes the name too: the bare name is now its prompt, and the teams see no change.
    let body = json!({"name": "support-agent", "base": "You are the default support agent."});
    ok(&app, &admin, reqwest::Method::POST, "/v1/prompts", Some(body)).await;
    let served = get(&app, &admin, "/v1/prompts/support-agent").await;
    assert_eq!((served["name"].as_str(), served["version"].as_i64()), (Some("support-agent"), Some(1)));
    for (team, key) in TEAMS.iter().zip(&keys) {
        let served = get(&app, key, "/v1/prompts/support-agent").await;
        assert!(served["text"].as_str().unwrap().contains(&format!("for {team}")), "{served}");
    }
    let all = get(&app, &admin, "/v1/prompts").await;
    let mut listed: Vec<(String, String)> = all["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["name"].as_str().unwrap().to_owned(), p["project"].as_str().unwrap().to_owned()))
        .collect();
    listed.sort();
    let support = |p: &str| ("support-agent".to_owned(), p.to_owned());
    assert_eq!(listed, [support("default"), support("team-a"), support("team-b")]);
}

crate::on_one_store!(
    two_projects_on_sqlite: two_projects_each_learn_serve_and_export_their_own_support_agent(Sqlite),
);
