//! Postgres as the coordination point of many writers and many processes:
//! gapless version numbers under 100 concurrent API writers, and a label move
//! made through one server process seen by another within about a second.

mod common;

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use common::{Backend, spawn_app};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_concurrent_version_creations_give_versions_one_to_101() {
    let app = spawn_app(Backend::Postgres).await;
    app.create_prompt("busy").await;
    let tasks: Vec<_> = (0..100)
        .map(|i| {
            let req = app.post("/v1/prompts/busy/versions", json!({"base": format!("edit {i}")}));
            tokio::spawn(async move { req.send().await.unwrap().status().as_u16() })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), 201);
    }
    let mut numbers = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let path = match &token {
            Some(t) => format!("/v1/prompts/busy/versions?page_size=200&page_token={t}"),
            None => "/v1/prompts/busy/versions?page_size=200".to_owned(),
        };
        let page: Value = app.get(&path).send().await.unwrap().json().await.unwrap();
        numbers.extend(page["versions"].as_array().unwrap().iter().map(|v| v["number"].as_i64().unwrap()));
        match page["next_page_token"].as_str() {
            Some(t) => token = Some(t.to_owned()),
            None => break,
        }
    }
    numbers.sort();
    assert_eq!(numbers, (1..=101).collect::<Vec<_>>(), "exactly 1..=101, no gap, no duplicate");
}

struct ChildServer(Child);

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_move_reaches_a_second_process_within_a_second() {
    let app = spawn_app(Backend::Postgres).await;
    app.create_prompt("shared").await;
    let v2 = app.post("/v1/prompts/shared/versions", json!({"base": "second"})).send().await.unwrap();
    assert_eq!(v2.status(), 201);

    let port = free_port();
    let data = tempfile::tempdir().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_combee"))
        .args(["serve", "--bind", &format!("127.0.0.1:{port}")])
        .env("DATABASE_URL", &app.url)
        .env("COMBEE_CONFIG_DIR", concat!(env!("CARGO_MANIFEST_DIR"), "/config"))
        .env("COMBEE__DATABASE__DATA_DIR", data.path())
        .env("COMBEE__LOG__LEVEL", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("start a second combee process");
    let _child = ChildServer(child);
    let other = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while app.http.get(format!("{other}/readyz")).send().await.map(|r| r.status() != 200).unwrap_or(true) {
        assert!(Instant::now() < deadline, "second process did not become ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let get_other = || app.http.get(format!("{other}/v1/prompts/shared")).bearer_auth(&app.admin_key).send();
    // The second process serves (and caches) version 1.
    for _ in 0..3 {
        let body: Value = get_other().await.unwrap().json().await.unwrap();
        assert_eq!(body["version"], 1);
    }
    let moved_at = Instant::now();
    let res = app.put("/v1/prompts/shared/labels/production", json!({"version": 2})).send().await.unwrap();
    assert_eq!(res.status(), 200);
    loop {
        let body: Value = get_other().await.unwrap().json().await.unwrap();
        if body["version"] == 2 {
            break;
        }
        assert!(moved_at.elapsed() < Duration::from_millis(1500), "second process still served v1 after 1.5 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let seen_after = moved_at.elapsed();
    eprintln!("label move seen by the second process after {seen_after:?}");
    assert!(seen_after < Duration::from_millis(1500));
}
