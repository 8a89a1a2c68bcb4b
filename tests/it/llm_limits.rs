//! A restarted worker starts from the concurrency limit its LLM backend
//! earned: the first round of a new process sends its calls at the rate the
//! last process had proven, as its round record shows, instead of climbing
//! from 2 again (the simulated LLM, a real server, both stores).

use crate::common;

use std::time::Duration;

use combee::llm::{config::LlmConfig, remember::BackendKey};
use combee::simulation::llm::SimConfig;
use common::{Backend, TestApp, eventually, learning, restart_app_with, round_end, spawn_app_with, spawn_sim};
use serde_json::{Value, json};

/// Posts `n` traces to `prompt`, triggers a round over them and returns its record.
async fn a_round(app: &TestApp, prompt: &str, n: usize) -> Value {
    let traces: Vec<Value> = (0..n)
        .map(|i| {
            json!({"prompt": prompt, "input": {"q": format!("task {i}")}, "output": format!("answer {i}"),
                        "feedback": {"success": false, "comment": format!("check field {i} first")}})
        })
        .collect();
    let res = app.post("/v1/traces", json!({"traces": traces})).send().await.unwrap();
    assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    let res = app.post(&format!("/v1/prompts/{prompt}/rounds"), json!({"batch_size": n})).send().await.unwrap();
    assert_eq!(res.status(), 202, "{}", res.text().await.unwrap());
    let id = res.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_owned();
    let round = round_end(app, &id, Duration::from_secs(60)).await;
    assert_eq!(round["status"], "succeeded", "{round}");
    round
}

/// The limit each of a round's calls was sent under, in the order they were made.
fn limits(round: &Value) -> Vec<u64> {
    round["llm_calls"].as_array().unwrap().iter().filter_map(|c| c["concurrency_limit"].as_u64()).collect()
}

async fn a_restarted_worker_starts_from_the_limit_its_backend_earned(b: Backend) {
    let sim = spawn_sim(SimConfig { fixed_ms: 40.0, ..SimConfig::default() }).await;
    let first = spawn_app_with(b, |s| learning(s, &sim.url)).await;
    // A fixed batch size, so the worker starts no round of its own beside the triggered ones.
    let res = first
        .post("/v1/prompts", json!({"name": "limits", "base": "You answer.", "settings": {"batch_size": 1000}}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);

    // A backend never seen: the first call goes out under a limit of 2, and the round climbs.
    let earned = limits(&a_round(&first, "limits", 48).await);
    assert_eq!(earned[0], 2, "{earned:?}");
    let climbed = *earned.iter().max().unwrap();
    assert!(climbed > 2, "{earned:?}");
    let key = BackendKey::of(&LlmConfig { base_url: sim.url.clone(), ..LlmConfig::default() });
    let kept = eventually("the earned limit kept", Duration::from_secs(10), async || {
        match first.store.llm_limit(&key.base_url, &key.model).await.unwrap() {
            Some(l) if l > 2 => Ok(l),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    // A new process on the same store: its first round's first call goes out under what was kept.
    first.shutdown.cancel();
    let second = restart_app_with(&first, |s| learning(s, &sim.url)).await;
    let resumed = limits(&a_round(&second, "limits", 48).await);
    assert!(resumed[0] > 2, "kept {kept}, then {resumed:?}");
}

on_both_stores!(a_restarted_worker_starts_from_the_limit_its_backend_earned);
