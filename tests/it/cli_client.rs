//! The operator CLI (`combee prompts|traces|rounds`) as a script would use it:
//! the real binary against the real server on port 0, on both stores, judged
//! by its output and its exit codes.

use crate::common;

use std::{path::Path, process::Output};

use common::{Backend, TestApp, spawn_app};
use serde_json::{Value, json};

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", self.stdout))
    }
}

/// Runs `combee ARGS` against the app with `key` in `COMBEE_API_KEY`.
async fn combee(app: &TestApp, key: &str, args: &[&str]) -> Run {
    let out: Output = tokio::process::Command::new(env!("CARGO_BIN_EXE_combee"))
        .args(args)
        .env("COMBEE_URL", &app.base)
        .env("COMBEE_API_KEY", key)
        .env_remove("COMBEE_CONFIG_DIR")
        .output()
        .await
        .expect("run combee");
    let run = Run {
        code: out.status.code().expect("exit code"),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    };
    assert!(
        key.is_empty() || (!run.stdout.contains(key) && !run.stderr.contains(key)),
        "the API key must never be printed: {} {}",
        run.stdout,
        run.stderr
    );
    run
}

async fn ok(app: &TestApp, args: &[&str]) -> Run {
    let run = combee(app, &app.admin_key, args).await;
    assert_eq!(run.code, 0, "combee {args:?} failed: {}", run.stderr);
    run
}

async fn fails(app: &TestApp, args: &[&str], code: i32) -> Run {
    let run = combee(app, &app.admin_key, args).await;
    assert_eq!(run.code, code, "combee {args:?}: stdout {} stderr {}", run.stdout, run.stderr);
    run
}

/// How many traces the server holds for `prompt`, through `GET /v1/traces`.
async fn trace_count(app: &TestApp, prompt: &str) -> usize {
    let mut count = 0;
    let mut token: Option<String> = None;
    loop {
        let mut path = format!("/v1/traces?prompt={prompt}&page_size=200");
        if let Some(t) = &token {
            path.push_str(&format!("&page_token={t}"));
        }
        let page: Value = app.get(&path).send().await.unwrap().json().await.unwrap();
        count += page["traces"].as_array().unwrap().len();
        match page["next_page_token"].as_str() {
            Some(t) => token = Some(t.to_owned()),
            None => return count,
        }
    }
}

fn trace(prompt: Option<&str>, i: usize) -> String {
    let mut t = json!({"input": {"question": format!("q{i}")}, "output": format!("a{i}"), "feedback": {"success": i.is_multiple_of(2)}});
    if let Some(p) = prompt {
        t["prompt"] = json!(p);
    }
    t.to_string()
}

fn write_lines(path: &Path, lines: &[String]) {
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

async fn import_reports_bad_lines_by_number_and_never_imports_twice(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("support-agent").await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("traces.jsonl");
    let mut lines = vec![
        trace(Some("support-agent"), 1),                          // 1
        "{\"prompt\": \"support-agent\", \"input\": ".to_owned(), // 2: bad JSON
        trace(None, 3),                                           // 3: takes --prompt
        trace(Some("no-such-prompt"), 4),                         // 4: unknown prompt
        String::new(),                                            // 5: blank, ignored
        r#"{"prompt": "support-agent", "input": {}, "feedback": {"score": "high"}}"#.to_owned(), // 6: invalid field
        "[1, 2, 3]".to_owned(),                                   // 7: not an object
    ];
    // Enough good lines for two batches of 100, each more than the server's 50 per request.
    lines.extend((8..=160).map(|i| trace(Some("support-agent"), i)));
    write_lines(&file, &lines);
    let good = 2 + (8..=160).count();
    let path = file.to_str().unwrap();

    let first = fails(&app, &["traces", "import", path, "--prompt", "support-agent"], 5).await;
    for (line, why) in [(2, "not valid JSON"), (4, "unknown prompt"), (6, "score"), (7, "JSON object")] {
        let prefix = format!("{path}:{line}: ");
        assert!(
            first.stderr.lines().any(|l| l.starts_with(&prefix) && l.contains(why)),
            "line {line} reported ({why}): {}",
            first.stderr
        );
    }
    for line in [1, 3, 5, 8, 160] {
        assert!(!first.stderr.contains(&format!("{path}:{line}:")), "line {line} is fine: {}", first.stderr);
    }
    assert!(
        first.stdout.contains(&format!("{good} imported, 0 skipped as already imported, 4 failed")),
        "{}",
        first.stdout
    );
    assert_eq!(trace_count(&app, "support-agent").await, good);

    // The same file again: every good line is recognised, none stored twice.
    let again = fails(&app, &["traces", "import", path, "--prompt", "support-agent", "--json"], 5).await;
    let summary = again.json();
    assert_eq!((summary["imported"].as_u64(), summary["skipped"].as_u64()), (Some(0), Some(good as u64)), "{summary}");
    let failed_lines: Vec<u64> =
        summary["errors"].as_array().unwrap().iter().map(|e| e["line"].as_u64().unwrap()).collect();
    assert_eq!(failed_lines, [2, 4, 6, 7]);
    assert_eq!(trace_count(&app, "support-agent").await, good);

    // A clean file exits 0; a missing file is a local error.
    let clean = dir.path().join("clean.jsonl");
    write_lines(&clean, &(1..=3).map(|i| trace(None, 1000 + i)).collect::<Vec<_>>());
    let run =
        ok(&app, &["traces", "import", clean.to_str().unwrap(), "--prompt", "support-agent", "--batch-size", "2"])
            .await;
    assert!(run.stdout.contains("3 imported, 0 skipped as already imported, 0 failed"), "{}", run.stdout);
    assert_eq!(trace_count(&app, "support-agent").await, good + 3);
    fails(&app, &["traces", "import", dir.path().join("absent.jsonl").to_str().unwrap()], 1).await;
    let bad_key = combee(&app, "cmb_not_a_real_key_at_all_000000000000000", &["traces", "import", path]).await;
    assert_eq!(bad_key.code, 3, "{}", bad_key.stderr);
}

async fn prompts_round_trip_with_exit_codes(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("support-agent").await;
    let res = app
        .post("/v1/prompts/support-agent/versions", json!({"base": "You are a careful agent.", "message": "tone"}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);

    let list = ok(&app, &["prompts", "list"]).await;
    assert!(list.stdout.starts_with("NAME"), "{}", list.stdout);
    let row = list.stdout.lines().find(|l| l.starts_with("support-agent")).expect("a row for the prompt");
    assert_eq!(
        row.split_whitespace().take(7).collect::<Vec<_>>(),
        ["support-agent", "default", "playbook", "auto", "1", "2", "0"]
    );
    let listed = ok(&app, &["prompts", "list", "--json"]).await.json();
    assert_eq!(listed["prompts"][0]["name"], "support-agent");

    let show = ok(&app, &["prompts", "show", "support-agent"]).await;
    assert!(show.stdout.contains("version: 1") && show.stdout.contains("You are a helpful agent."), "{}", show.stdout);
    let etag_v1 = show.stdout.lines().find_map(|l| l.strip_prefix("etag:")).unwrap().trim().to_owned();
    assert!(etag_v1.starts_with("\"v1-"), "{etag_v1}");
    let v2 = ok(&app, &["prompts", "show", "support-agent", "--version", "2", "--json"]).await.json();
    assert_eq!((v2["version"].as_i64(), v2["text"].as_str()), (Some(2), Some("You are a careful agent.")));
    let latest = ok(&app, &["prompts", "show", "support-agent", "--label", "latest"]).await;
    assert!(latest.stdout.contains("version: 2"));
    let missing = fails(&app, &["prompts", "show", "nope"], 2).await;
    assert!(missing.stderr.contains("not found") && missing.stderr.contains("404"), "{}", missing.stderr);
    fails(&app, &["prompts", "show", "support-agent", "--version", "9"], 2).await;
    fails(&app, &["prompts", "show", "support-agent", "--version", "1", "--label", "x"], 1).await;

    let history = ok(&app, &["prompts", "history", "support-agent"]).await;
    let rows: Vec<Vec<&str>> = history.stdout.lines().skip(1).map(|l| l.split_whitespace().take(4).collect()).collect();
    assert_eq!(rows, [vec!["2", "1", "manual", "-"], vec!["1", "-", "manual", "production"]], "{}", history.stdout);
    assert_eq!(
        ok(&app, &["prompts", "history", "support-agent", "--json"]).await.json()["versions"].as_array().unwrap().len(),
        2
    );

    let diff = ok(&app, &["prompts", "diff", "support-agent", "1", "2"]).await;
    assert!(diff.stdout.contains("-You are a helpful agent.") && diff.stdout.contains("+You are a careful agent."));
    assert_eq!(ok(&app, &["prompts", "diff", "support-agent", "1", "2", "--json"]).await.json()["to"], 2);
    fails(&app, &["prompts", "diff", "support-agent", "1", "7"], 2).await;

    // Promote with the ETag fetched just before; then a stale ETag is refused (412 → 4).
    let promoted = ok(&app, &["prompts", "promote", "support-agent", "2"]).await;
    assert!(promoted.stdout.contains("production -> v2"), "{}", promoted.stdout);
    let stale = fails(&app, &["prompts", "promote", "support-agent", "1", "--if-match", &etag_v1], 4).await;
    assert!(stale.stderr.contains("moved") && stale.stderr.contains("412"), "{}", stale.stderr);
    let now: Value = app.get("/v1/prompts/support-agent").send().await.unwrap().json().await.unwrap();
    assert_eq!(now["version"], 2, "a refused promotion changes nothing");
    let candidate =
        ok(&app, &["prompts", "promote", "support-agent", "1", "--label", "candidate", "--json"]).await.json();
    assert_eq!((candidate["name"].as_str(), candidate["version"].as_i64()), (Some("candidate"), Some(1)));
    fails(&app, &["prompts", "promote", "nope", "1"], 2).await;

    let rolled = ok(&app, &["prompts", "rollback", "support-agent", "1", "--message", "back to basics"]).await;
    assert!(rolled.stdout.contains("v3 has v1's content"), "{}", rolled.stdout);
    let now: Value = app.get("/v1/prompts/support-agent").send().await.unwrap().json().await.unwrap();
    assert_eq!((now["version"].as_i64(), now["source"].as_str()), (Some(3), Some("rollback")));
    fails(&app, &["prompts", "rollback", "support-agent", "2", "--if-match", &etag_v1], 4).await;
    fails(&app, &["prompts", "rollback", "support-agent", "42"], 4).await;

    // The label history shows every move above, newest first, with who and why.
    ok(&app, &["prompts", "promote", "support-agent", "2", "--label", "candidate", "--reason", "retry v2"]).await;
    let moves = ok(&app, &["prompts", "label-history", "support-agent"]).await;
    let rows: Vec<Vec<&str>> = moves.stdout.lines().skip(1).map(|l| l.split_whitespace().collect()).collect();
    let summary: Vec<(&str, &str, &str, &str)> = rows.iter().map(|r| (r[2], r[3], r[5], r[6])).collect();
    assert_eq!(
        summary,
        [
            ("candidate", "v1", "v2", "promote"),
            ("production", "v2", "v3", "rollback"),
            ("candidate", "-", "v1", "promote"),
            ("production", "v1", "v2", "promote"),
            ("production", "-", "v1", "create"),
        ],
        "{}",
        moves.stdout
    );
    assert!(moves.stdout.lines().nth(1).unwrap().trim_end().ends_with("retry v2"), "{}", moves.stdout);
    assert!(moves.stdout.contains("back to basics"), "{}", moves.stdout);
    let only = ok(&app, &["prompts", "label-history", "support-agent", "--label", "production", "--json"]).await.json();
    assert_eq!(only["moves"].as_array().unwrap().len(), 3);
    assert!(only["moves"].as_array().unwrap().iter().all(|m| m["actor"].as_str().unwrap().starts_with("key:")));
    fails(&app, &["prompts", "label-history", "nope"], 2).await;

    // Keys: a bad one is 3, a missing scope is 3, a key file works, no key at all is 3.
    let bad = combee(&app, "cmb_not_a_real_key_at_all_000000000000000", &["prompts", "list"]).await;
    assert_eq!(bad.code, 3, "{}", bad.stderr);
    let reader = app.key_with(&["prompts:read"]).await;
    assert_eq!(combee(&app, &reader, &["prompts", "list"]).await.code, 0);
    let denied = combee(&app, &reader, &["prompts", "promote", "support-agent", "1"]).await;
    assert_eq!(denied.code, 3, "{}", denied.stderr);
    assert!(denied.stderr.contains("prompts:promote"), "{}", denied.stderr);
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, format!("{}\n", app.admin_key)).unwrap();
    let by_file = combee(&app, "", &["prompts", "list", "--api-key-file", key_file.to_str().unwrap()]).await;
    assert_eq!(by_file.code, 0, "{}", by_file.stderr);
    assert!(!by_file.stdout.contains(&app.admin_key) && !by_file.stderr.contains(&app.admin_key));
    let none = combee(&app, "", &["prompts", "list"]).await;
    assert_eq!(none.code, 3);
    assert!(none.stderr.contains("COMBEE_API_KEY"), "{}", none.stderr);
}

async fn rounds_trigger_list_show(b: Backend) {
    let app = spawn_app(b).await;
    let res = app
        .post("/v1/prompts", json!({"name": "learner", "base": "Base.", "settings": {"batch_size": 5}}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let traces: Vec<Value> = (0..3).map(|i| serde_json::from_str(&trace(Some("learner"), i)).unwrap()).collect();
    assert_eq!(app.post("/v1/traces", json!({ "traces": traces })).send().await.unwrap().status(), 201);

    fails(&app, &["rounds", "trigger", "learner", "--method", "bogus"], 1).await;
    let round = ok(&app, &["rounds", "trigger", "learner", "--json"]).await.json();
    let id = round["id"].as_str().unwrap().to_owned();
    assert_eq!(
        (round["status"].as_str(), round["n"].as_i64(), round["method"].as_str()),
        (Some("queued"), Some(3), Some("combee"))
    );
    // One round at a time: the second is a conflict.
    let busy = fails(&app, &["rounds", "trigger", "learner"], 4).await;
    assert!(busy.stderr.contains("in flight"), "{}", busy.stderr);
    fails(&app, &["rounds", "trigger", "nope"], 2).await;

    let list = ok(&app, &["rounds", "list", "learner"]).await;
    let row = list.stdout.lines().find(|l| l.starts_with(&id)).expect("the round is listed");
    assert_eq!(row.split_whitespace().take(5).collect::<Vec<_>>()[1..], ["queued", "api", "combee", "3"]);
    assert_eq!(ok(&app, &["rounds", "list", "learner", "--json"]).await.json()["rounds"][0]["id"], id.as_str());
    fails(&app, &["rounds", "list", "nope"], 2).await;

    let show = ok(&app, &["rounds", "show", &id]).await;
    assert!(show.stdout.contains("status:    queued") && show.stdout.contains("n=3"), "{}", show.stdout);
    let shown = ok(&app, &["rounds", "show", &id, "--json"]).await.json();
    assert_eq!(shown["trace_ids"].as_array().unwrap().len(), 3);
    fails(&app, &["rounds", "show", &uuid::Uuid::new_v4().to_string()], 2).await;

    // Naive and sequential are chosen by flag; the batch size caps the traces taken.
    app.create_prompt("other").await;
    let traces: Vec<Value> = (0..4).map(|i| serde_json::from_str(&trace(Some("other"), i)).unwrap()).collect();
    assert_eq!(app.post("/v1/traces", json!({ "traces": traces })).send().await.unwrap().status(), 201);
    let seq = ok(&app, &["rounds", "trigger", "other", "--method", "sequential", "--batch-size", "2"]).await;
    assert!(seq.stdout.contains("queued for other: 2 traces, method sequential"), "{}", seq.stdout);
}

async fn traces_requeue_puts_failed_traces_back(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("learner").await;
    let traces: Vec<Value> = (0..3).map(|i| serde_json::from_str(&trace(Some("learner"), i)).unwrap()).collect();
    assert_eq!(app.post("/v1/traces", json!({ "traces": traces })).send().await.unwrap().status(), 201);
    let failed = common::fail_pending_traces(&app.store, "learner").await;
    let id = failed[0].to_string();

    // Which traces must be said: ids or --all (a usage error otherwise).
    fails(&app, &["traces", "requeue", "learner"], 1).await;
    let one = ok(&app, &["traces", "requeue", "learner", "--ids", &id]).await;
    assert!(one.stdout.contains("requeued 1 failed trace of learner") && one.stdout.contains(&id), "{}", one.stdout);
    let rest = ok(&app, &["traces", "requeue", "learner", "--all", "--json"]).await.json();
    assert_eq!(rest["count"], 2);
    let mut expected: Vec<String> = failed[1..].iter().map(|u| u.to_string()).collect();
    expected.sort();
    assert_eq!(rest["ids"], json!(expected));
    let none = ok(&app, &["traces", "requeue", "learner", "--all"]).await;
    assert!(none.stdout.contains("requeued 0 failed traces"), "{}", none.stdout);
    assert_eq!(trace_count(&app, "learner").await, 3);
    let pending: Value =
        app.get("/v1/traces?prompt=learner&status=pending").send().await.unwrap().json().await.unwrap();
    assert_eq!(pending["traces"].as_array().unwrap().len(), 3, "all three are pending again");
    fails(&app, &["traces", "requeue", "nope", "--all"], 2).await;
    // A key without traces:write is refused.
    let reader = app.key_with(&["prompts:read"]).await;
    let denied = combee(&app, &reader, &["traces", "requeue", "learner", "--all"]).await;
    assert_eq!(denied.code, 3, "{}", denied.stderr);
    assert!(denied.stderr.contains("traces:write"), "{}", denied.stderr);
}

/// `combee evaluators set|get|calibrate`: a file in, the server's checks
/// answered with exit code 5 and its reason, calibration as a table.
async fn evaluators_set_get_calibrate(b: Backend) {
    let app = spawn_app(b).await;
    app.create_prompt("graded").await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("evaluators.json");
    let list = json!([{"kind": "checks", "name": "format",
        "checks": [{"type": "contains", "text": "ANSWER:", "case_sensitive": false}]}]);
    std::fs::write(&file, list.to_string()).unwrap();
    let set = ok(&app, &["evaluators", "set", "graded", file.to_str().unwrap()]).await;
    assert!(set.stdout.contains("1 evaluator(s) saved"), "{}", set.stdout);
    let got = ok(&app, &["evaluators", "get", "graded"]).await.json();
    assert_eq!(got["evaluators"], list);
    std::fs::write(&file, json!({"evaluators": [{"kind": "judge", "name": "j", "rubric": ""}]}).to_string()).unwrap();
    let bad = fails(&app, &["evaluators", "set", "graded", file.to_str().unwrap()], 5).await;
    assert!(bad.stderr.contains("rubric"), "{}", bad.stderr);
    let cal = ok(&app, &["evaluators", "calibrate", "graded"]).await;
    assert!(cal.stdout.contains("EVALUATOR") && cal.stdout.contains("format"), "{}", cal.stdout);
    fails(&app, &["evaluators", "get", "nope"], 2).await;
}

on_both_stores!(
    evaluators_set_get_calibrate,
    traces_requeue_puts_failed_traces_back,
    import_reports_bad_lines_by_number_and_never_imports_twice,
    prompts_round_trip_with_exit_codes,
    rounds_trigger_list_show,
);
