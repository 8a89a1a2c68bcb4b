//! Dataset export against the real server on both stores: the three shapes,
//! the filters (version, label, time, reward), an export longer than one
//! store page read back line by line, quarantined traces left out, and bad
//! filters as problems. (A real consumer, pyarrow, reads exports in the
//! ecosystem tests.)

use crate::common;

use common::{Backend, TestApp, expect_problem, spawn_app_with};
use serde_json::{Value, json};

async fn post_traces(app: &TestApp, traces: Vec<Value>) {
    for chunk in traces.chunks(500) {
        let res = app.post("/v1/traces", json!({"traces": chunk})).send().await.unwrap();
        assert_eq!(res.status(), 201, "{}", res.text().await.unwrap());
    }
}

async fn export(app: &TestApp, query: &str) -> Vec<Value> {
    let res = app.get(&format!("/v1/prompts/shop/export{query}")).send().await.unwrap();
    assert_eq!(res.status(), 200, "{query}");
    assert_eq!(res.headers()["content-type"], "application/x-ndjson");
    let text = res.text().await.unwrap();
    assert!(text.is_empty() || text.ends_with('\n'));
    text.lines().map(|l| serde_json::from_str(l).expect("one JSON record per line")).collect()
}

fn run(i: usize, version: Option<i64>, feedback: Value) -> Value {
    json!({
        "prompt": "shop", "prompt_version": version,
        "input": {"question": format!("question {i}")},
        "trajectory": [{"role": "assistant", "content": format!("answer {i}")}],
        "output": format!("answer {i}"),
        "feedback": feedback,
    })
}

async fn exports_stream_every_shape_with_filters(b: Backend) {
    let app = spawn_app_with(b, |s| s.limits.max_traces_per_batch = 500).await;
    let res = app
        .post("/v1/prompts", json!({"name": "shop", "base": "You sell {item}.", "promotion": "manual"}))
        .send()
        .await;
    assert_eq!(res.unwrap().status(), 201);
    let res =
        app.post("/v1/prompts/shop/versions", json!({"base": "You sell {item}, kindly.", "labels": ["candidate"]}));
    assert_eq!(res.send().await.unwrap().status(), 201);

    // 1,100 rewarded traces of version 1 (more than two store pages), some of
    // version 2, one without a version, one without feedback.
    let mut traces: Vec<Value> = (0..1100).map(|i| run(i, Some(1), json!({"score": (i % 10) as f64 / 10.0}))).collect();
    traces.extend((0..5).map(|i| run(2000 + i, Some(2), json!({"success": i % 2 == 0}))));
    traces.push(run(3000, None, json!({"success": true})));
    traces.push(run(3001, Some(1), json!({})));
    post_traces(&app, traces).await;

    let all = export(&app, "").await;
    assert_eq!(all.len(), 1107);
    let first = all.iter().find(|t| t["input"]["question"] == "question 0").unwrap();
    assert_eq!((first["output"].as_str(), first["reward"].as_f64()), (Some("answer 0"), Some(0.0)));
    assert!(all.windows(2).all(|w| w[0]["id"].as_str() < w[1]["id"].as_str()), "oldest first, each once");
    assert_eq!(all.iter().filter(|t| t["reward"].is_null()).count(), 1);

    let chat = export(&app, "?format=chat&version=2").await;
    assert_eq!(chat.len(), 5);
    assert_eq!(
        chat[0],
        json!({"messages": [
            {"role": "system", "content": "You sell {item}, kindly."},
            {"role": "user", "content": "{\"question\":\"question 2000\"}"},
            {"role": "assistant", "content": "answer 2000"},
        ]})
    );
    // By label: the version `candidate` points at now; chat leaves out the trace without a version.
    assert_eq!(export(&app, "?format=chat&label=candidate").await, chat);
    assert_eq!(export(&app, "?format=chat").await.len(), 1106);

    let rewards = export(&app, "?format=reward&min_reward=0.85").await;
    assert_eq!(rewards.len(), 113, "score 0.9 (110), success of version 2 (3); not the one without a version");
    let r = rewards.iter().find(|r| r["version"] == 2).unwrap();
    assert_eq!(
        (r["reward"].as_f64(), r["success"].as_bool(), r["prompt_name"].as_str()),
        (Some(1.0), Some(true), Some("shop"))
    );
    assert_eq!(r["prompt"][0], json!({"role": "system", "content": "You sell {item}, kindly."}));
    assert_eq!(r["completion"], json!([{"role": "assistant", "content": "answer 2000"}]));
    assert_eq!(export(&app, "?format=reward&max_reward=0").await.len(), 110 + 2);
    assert_eq!(export(&app, "?format=reward").await.len(), 1105, "all but the unrewarded and the versionless");

    // Time: nothing before the first trace, everything before the end of time.
    assert!(export(&app, "?until=2000-01-01T00:00:00Z").await.is_empty());
    assert_eq!(export(&app, "?since=2000-01-01T00:00:00Z&until=2999-01-01T00:00:00Z").await.len(), 1107);

    // Quarantined traces are never exported.
    let id = first["id"].as_str().unwrap();
    assert_eq!(app.post(&format!("/v1/traces/{id}/quarantine"), json!({})).send().await.unwrap().status(), 200);
    assert_eq!(export(&app, "").await.len(), 1106);

    // Filters that cannot both hold match nothing; both a version and a label: while it points there.
    assert!(export(&app, "?min_reward=0.9&max_reward=0.1").await.is_empty());
    assert!(export(&app, "?since=2030-01-01T00:00:00Z&until=2020-01-01T00:00:00Z").await.is_empty());
    assert_eq!(export(&app, "?format=chat&version=2&label=candidate").await, chat);
    for (query, status) in [
        ("?version=1&label=candidate", 404),
        ("?format=parquet", 400),
        ("?version=0", 400),
        ("?min_reward=inf", 400),
        ("?since=yesterday", 400),
        ("?label=nowhere", 404),
    ] {
        let res = app.get(&format!("/v1/prompts/shop/export{query}")).send().await.unwrap();
        expect_problem(res, status).await;
    }
    expect_problem(app.get("/v1/prompts/nobody/export").send().await.unwrap(), 404).await;
    let writer = app.key_with(&["traces:write"]).await;
    let res = app.http.get(app.url("/v1/prompts/shop/export")).bearer_auth(writer).send().await.unwrap();
    expect_problem(res, 403).await;
}

/// `combee traces export`: stdout or a file, the count on stderr, exit codes.
async fn the_cli_streams_an_export_to_a_file(b: Backend) {
    let app = spawn_app_with(b, |_| {}).await;
    let res = app.post("/v1/prompts", json!({"name": "shop", "base": "You sell {item}."})).send().await;
    assert_eq!(res.unwrap().status(), 201);
    post_traces(&app, (0..3).map(|i| run(i, Some(1), json!({"score": i as f64}))).collect()).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("chat.jsonl");
    let cli = |args: Vec<String>| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_combee"))
            .args(args)
            .env("COMBEE_URL", &app.base)
            .env("COMBEE_API_KEY", &app.admin_key)
            .env_remove("COMBEE_CONFIG_DIR")
            .output()
    };
    let args = |extra: &[&str]| {
        let mut a: Vec<String> = ["traces", "export", "shop"].map(String::from).to_vec();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let out = cli(args(&["--format", "reward", "--min-reward", "1", "-o", file.to_str().unwrap()])).await.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("exported 2 record(s) of shop"));
    let lines: Vec<Value> =
        std::fs::read_to_string(&file).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.iter().map(|l| l["reward"].as_f64().unwrap()).collect::<Vec<_>>(), [1.0, 2.0]);
    assert!(!dir.path().join("chat.jsonl.partial").exists());

    let out = cli(args(&[])).await.unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap().lines().count(), 3);
    let out = cli(args(&["--label", "nowhere"])).await.unwrap();
    assert_eq!(out.status.code(), Some(2), "404 is exit code 2");
}

on_both_stores!(exports_stream_every_shape_with_filters);
on_one_store!(cli_streams_an_export: the_cli_streams_an_export_to_a_file(Sqlite));

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Memory while exporting, small and large: the server's resident memory
/// during the download barely moves while the body grows tenfold. Prints the
/// figures. Run: `cargo nextest run -E 'test(/export::measure/)' --run-ignored only --no-capture`.
async fn measure_export_memory(b: Backend) {
    let app = spawn_app_with(b, |s| {
        s.limits.max_traces_per_batch = 500;
        s.limits.max_body_bytes = 8 << 20;
    })
    .await;
    let res = app.post("/v1/prompts", json!({"name": "shop", "base": "You sell {item}."})).send().await;
    assert_eq!(res.unwrap().status(), 201);
    let pad = "x".repeat(1500);
    let mut sent = 0;
    for n in [2_000, 20_000] {
        let traces: Vec<Value> = (sent..n)
            .map(|i| json!({"prompt": "shop", "prompt_version": 1, "input": {"q": i, "pad": pad}, "output": "a", "feedback": {"score": 1.0}}))
            .collect();
        post_traces(&app, traces).await;
        sent = n;
        let before = rss_kib();
        let mut res = app.get("/v1/prompts/shop/export").send().await.unwrap();
        let (mut bytes, mut peak) = (0_usize, before);
        while let Some(chunk) = res.chunk().await.unwrap() {
            bytes += chunk.len();
            peak = peak.max(rss_kib());
        }
        eprintln!(
            "{b:?}: exported {n} traces, {:.1} MiB, in-process resident memory {:.1} MiB before, peak {:.1} MiB during (+{:.1} MiB)",
            bytes as f64 / 1048576.0,
            before as f64 / 1024.0,
            peak as f64 / 1024.0,
            (peak - before) as f64 / 1024.0
        );
    }
}

mod measure {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a measurement that prints figures"]
    async fn export_memory_postgres() {
        super::measure_export_memory(super::Backend::Postgres).await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a measurement that prints figures"]
    async fn export_memory_sqlite() {
        super::measure_export_memory(super::Backend::Sqlite).await
    }
}
